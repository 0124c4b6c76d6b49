// Requirement strings as users write them ("foo[bar]>=1.0; python_version<'3.12'") and as pip
// prints them in "No matching distribution found for foo<2,>=1".
//
// The daemon fetches what these name from an index on the host, so anything that is not a
// plain "name + version constraint" (options, URLs, paths) is rejected rather than interpreted.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace esb::packages {

struct Requirement {
  std::string name;     // PEP 503-normalised: lowercase, runs of [-_.] → '-'
  std::string display;  // as given, trimmed
  std::vector<std::string> extras;  // normalised, in the given order
  std::string specifier;            // canonical ">=1.0,<2", or "" for any version
};

// PEP 503 normalisation of a project name.
std::string NormalizeName(std::string_view name);

// Parses a PEP 508 requirement without URL: name, optional [extras], optional version
// specifiers (also in parentheses: "foo (>=1.0)"), optional "; marker" (ignored: pip has
// evaluated it already). InvalidArgument for everything else, with the reason.
absl::StatusOr<Requirement> ParseRequirement(std::string_view text);

}  // namespace esb::packages

// Requirement strings as users write them ("foo[bar]>=1.0; python_version<'3.12'") and as pip
// prints them in "No matching distribution found for foo<2,>=1".
//
// The daemon fetches what these name from an index on the host, so anything that is not a
// plain "name + version constraint" (options, URLs, paths) is rejected rather than interpreted.
#pragma once

#include <optional>
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
  std::string marker;               // the PEP 508 environment marker after ';', trimmed, or ""
};

// Longest requirement string accepted (pip's messages included), and longest project name.
inline constexpr size_t kMaxRequirementLength = 2000;
inline constexpr size_t kMaxProjectNameLength = 200;

// PEP 503 normalisation of a project name.
std::string NormalizeName(std::string_view name);

// Parses a PEP 508 requirement without URL: name, optional [extras], optional version
// specifiers (also in parentheses: "foo (>=1.0)"), optional "; marker". The marker is checked
// against the PEP 508 grammar (variables, quoted strings, comparison / in / not in, and, or,
// parentheses) but not evaluated: the sandbox's Python does that. InvalidArgument for
// everything else, with the reason.
absl::StatusOr<Requirement> ParseRequirement(std::string_view text);

// Checks a PEP 508 environment marker ("python_version < '3.12' and os_name == 'posix'").
// InvalidArgument with the reason when it does not follow the grammar.
absl::Status ValidateMarker(std::string_view marker);

// pip's output (sandbox-controlled, so hostile: up to megabytes, any bytes) after a failed
// `pip install`: the text after the first "No matching distribution found for " up to the end
// of its line, without trailing spaces and a final '.'; nullopt when pip said no such thing.
// Plain string search, linear in the output. The view points into `pip_output`; callers must
// still bound and parse it (ParseRequirement refuses more than kMaxRequirementLength).
std::optional<std::string_view> FindMissingDistribution(std::string_view pip_output);

// The installer's probe: a Python snippet run in the sandbox that prints, as one JSON array,
// one entry per requirement it was given, in order:
//   {"skip": true}                          the environment marker is false here
//   {"installed": "1.2" | null, "ok": b}    the installed version of the distribution (null:
//                                           none) and whether it satisfies the specifier
//   {"error": "why"}                        the sandbox's `packaging` rejects the requirement
// The answer comes out of the sandbox, so it is parsed as hostile input: entries are matched to
// the requests' own requirements by position (the sandbox cannot add requirements), surplus
// entries are ignored, and anything malformed is an error rather than a guess.
struct ProbeEntry {
  enum class Kind { kSkip, kSatisfied, kMissing, kInvalid };
  Kind kind = Kind::kMissing;
  std::string installed;  // kSatisfied: the installed version (printable, bounded)
  std::string error;      // kInvalid: the sandbox's reason (printable, bounded)
};
// FailedPrecondition naming the defect when `json` is not a valid answer for `count`
// requirements.
absl::StatusOr<std::vector<ProbeEntry>> ParseProbeAnswer(std::string_view json, size_t count);

// Untrusted text (a requirement, a sandbox's output) for a one-line message: bytes outside
// printable ASCII replaced by '?', cut to `max` bytes ("..." marks a cut).
std::string Printable(std::string_view s, size_t max);

}  // namespace esb::packages

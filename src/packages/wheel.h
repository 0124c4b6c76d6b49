// Wheel filenames (PEP 427/425) and how well a wheel fits the sandbox's Python.
//
// The sandbox cannot build from source and runs one known CPython on one architecture with one
// glibc, so of all files for a version the daemon must pick a wheel pip there will accept, and
// the most specific one (a compiled cp311 wheel beats a pure-Python fallback).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "packages/version.h"

namespace esb::packages {

struct WheelName {
  std::string filename;  // as given
  std::string name;      // PEP 503-normalised project name
  Version version;
  std::string build_tag;  // "" or e.g. "1" / "2abc"
  std::vector<std::string> python_tags;  // "py2.py3" → {"py2", "py3"}
  std::vector<std::string> abi_tags;
  std::vector<std::string> platform_tags;
};

// The sandbox interpreter and platform.
struct Target {
  int py_major = 3, py_minor = 11;
  std::string arch = "x86_64";
  int glibc_major = 2, glibc_minor = 36;

  // "cp311": the cache directory and abi tag for this interpreter.
  std::string PythonTag() const;
  // "3.11" and a version standing for this interpreter in requires-python checks.
  Version PythonVersion() const;
};

// Parses "{name}-{version}(-{build})?-{python}-{abi}-{platform}.whl". Filenames with path
// separators or characters outside [A-Za-z0-9._+!-] are rejected (they name files on the host).
absl::StatusOr<WheelName> ParseWheelFilename(std::string_view filename);

// -1 when pip on `target` would refuse the wheel; otherwise a score where higher means more
// specific: cp311-cp311-manylinux > cp311-abi3-manylinux > cp38-abi3 > py3-none-any.
// linux_x86_64 wheels are refused (not portable across distributions).
int WheelScore(const WheelName& wheel, const Target& target);

// True for names like "foo-1.0.tar.gz" / ".zip" / ".tar.bz2" (source distributions).
bool IsSdistFilename(std::string_view filename);
// The version part of an sdist filename for project `normalized_name`, or "" if it does not
// look like one of its sdists.
std::string SdistVersion(std::string_view filename, std::string_view normalized_name);

}  // namespace esb::packages

#include "packages/wheel.h"

#include <algorithm>
#include <cctype>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/util.h"
#include "packages/requirement.h"

namespace esb::packages {
namespace {

constexpr size_t kMaxFilenameLength = 255;

bool SafeFilenameChar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-' ||
         c == '+' || c == '!';
}

std::vector<std::string> SplitTags(std::string_view s) {
  std::vector<std::string> out;
  for (absl::string_view p : absl::StrSplit(AbslView(s), '.')) out.emplace_back(StdView(p));
  return out;
}

// "cp311" → (3, 11); "py3" → (3, -1); "cp27mu"-like suffixes are reported via *suffix.
bool ParseInterpTag(std::string_view tag, std::string_view prefix, int* major, int* minor,
                    std::string* suffix = nullptr) {
  if (!tag.starts_with(prefix)) return false;
  std::string_view digits = tag.substr(prefix.size());
  size_t n = 0;
  while (n < digits.size() && std::isdigit(static_cast<unsigned char>(digits[n]))) ++n;
  if (n == 0 || n > 4) return false;
  if (suffix != nullptr) {
    *suffix = std::string(digits.substr(n));
  } else if (n != digits.size()) {
    return false;
  }
  *major = digits[0] - '0';
  *minor = -1;
  if (n > 1) {
    if (!absl::SimpleAtoi(AbslView(digits.substr(1, n - 1)), minor)) return false;
  }
  return true;
}

// Python+abi score, -1 if incompatible.
int InterpreterScore(const std::string& py, const std::string& abi, const Target& t) {
  int major = 0, minor = 0;
  const std::string own = t.PythonTag();
  if (ParseInterpTag(py, "cp", &major, &minor)) {
    if (major != t.py_major || minor < 0) return -1;
    if (abi == "abi3") {
      // Stable ABI: built for cp3Y runs on every later 3.x.
      if (minor > t.py_minor) return -1;
      return 200 + minor;
    }
    if (minor != t.py_minor) return -1;
    if (abi == own || abi == own + "m") return 300;
    if (abi == "none") return 150;
    return -1;
  }
  if (ParseInterpTag(py, "py", &major, &minor)) {
    if (major != t.py_major) return -1;
    if (minor > t.py_minor) return -1;
    if (abi != "none") return -1;
    return minor < 0 ? 100 : 100 + minor / 2;  // py3 / py3Y: generic pure Python
  }
  return -1;
}

// Platform score, -1 if incompatible.
int PlatformScore(const std::string& plat, const Target& t) {
  if (plat == "any") return 0;
  const std::string suffix = "_" + t.arch;
  if (!absl::EndsWith(plat, suffix)) return -1;
  std::string_view base = std::string_view(plat).substr(0, plat.size() - suffix.size());
  int need_major = 2, need_minor = -1;
  if (base == "manylinux1") {
    need_minor = 5;
  } else if (base == "manylinux2010") {
    need_minor = 12;
  } else if (base == "manylinux2014") {
    need_minor = 17;
  } else if (base.starts_with("manylinux_")) {
    std::vector<std::string> parts = absl::StrSplit(AbslView(base.substr(10)), '_');
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &need_major) ||
        !absl::SimpleAtoi(parts[1], &need_minor)) {
      return -1;
    }
  } else {
    return -1;  // linux_x86_64, musllinux, macosx, win ...
  }
  if (need_major != t.glibc_major || need_minor > t.glibc_minor || need_minor < 0) return -1;
  return 1 + std::min(need_minor, 98);
}

}  // namespace

std::string Target::PythonTag() const { return absl::StrCat("cp", py_major, py_minor); }

Version Target::PythonVersion() const {
  // pip compares requires-python with the full interpreter version (3.11.x). We only know
  // major.minor, so take a late patch release: ">3.11" and ">=3.11.2" then admit it.
  Version v;
  v.release = {py_major, py_minor, 99};
  v.original = v.ToString();
  return v;
}

absl::StatusOr<WheelName> ParseWheelFilename(std::string_view filename) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid wheel filename '", AbslView(filename.substr(0, 100)), "': ", why));
  };
  if (filename.size() > kMaxFilenameLength) return bad("too long");
  if (!filename.ends_with(".whl")) return bad("does not end in .whl");
  for (char c : filename) {
    if (!SafeFilenameChar(c)) return bad("unexpected character");
  }
  if (filename.front() == '.' || filename.front() == '-') return bad("bad first character");
  std::vector<std::string> parts =
      absl::StrSplit(AbslView(filename.substr(0, filename.size() - 4)), '-');
  if (parts.size() != 5 && parts.size() != 6) return bad("expected 5 or 6 '-'-separated fields");
  for (const auto& p : parts) {
    if (p.empty()) return bad("empty field");
  }
  WheelName w;
  w.filename = std::string(filename);
  w.name = NormalizeName(parts[0]);
  auto version = ParseVersion(parts[1]);
  if (!version.ok()) return bad(version.status().message());
  w.version = *version;
  size_t tag_start = 2;
  if (parts.size() == 6) {
    if (!std::isdigit(static_cast<unsigned char>(parts[2][0]))) {
      return bad("build tag must start with a digit");
    }
    w.build_tag = parts[2];
    tag_start = 3;
  }
  w.python_tags = SplitTags(parts[tag_start]);
  w.abi_tags = SplitTags(parts[tag_start + 1]);
  w.platform_tags = SplitTags(parts[tag_start + 2]);
  return w;
}

int WheelScore(const WheelName& wheel, const Target& target) {
  int best_interp = -1;
  for (const auto& py : wheel.python_tags) {
    for (const auto& abi : wheel.abi_tags) best_interp = std::max(best_interp, InterpreterScore(py, abi, target));
  }
  if (best_interp < 0) return -1;
  int best_plat = -1;
  for (const auto& plat : wheel.platform_tags) best_plat = std::max(best_plat, PlatformScore(plat, target));
  if (best_plat < 0) return -1;
  // The interpreter match dominates (as in pip's tag priority); the platform breaks ties.
  return best_interp * 100 + best_plat;
}

bool IsSdistFilename(std::string_view f) {
  for (std::string_view ext : {".tar.gz", ".zip", ".tar.bz2", ".tgz", ".tar.xz", ".tar"}) {
    if (f.ends_with(ext)) return true;
  }
  return false;
}

std::string SdistVersion(std::string_view f, std::string_view normalized_name) {
  std::string_view stem;
  for (std::string_view ext : {".tar.gz", ".zip", ".tar.bz2", ".tgz", ".tar.xz", ".tar"}) {
    if (f.ends_with(ext)) {
      stem = f.substr(0, f.size() - ext.size());
      break;
    }
  }
  if (stem.empty()) return "";
  // The name may itself contain '-': try every split point whose prefix normalises to the name.
  for (size_t dash = stem.find('-'); dash != std::string_view::npos;
       dash = stem.find('-', dash + 1)) {
    if (NormalizeName(stem.substr(0, dash)) == normalized_name) {
      std::string_view ver = stem.substr(dash + 1);
      if (ParseVersion(ver).ok()) return std::string(ver);
    }
  }
  return "";
}

}  // namespace esb::packages

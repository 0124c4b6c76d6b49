#include "core/volumes.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "storage/sqlite_store.h"

namespace esb {

absl::Status ValidateVolumeName(std::string_view name) {
  if (name.empty() || name.size() > kMaxVolumeNameBytes || name[0] == '-') {
    return absl::InvalidArgumentError(
        "volume name must be 1-63 characters of a-z, 0-9 and '-', not starting with '-'");
  }
  for (char c : name) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-')) {
      return absl::InvalidArgumentError(
          "volume name must be 1-63 characters of a-z, 0-9 and '-', not starting with '-'");
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateVolumePath(std::string_view path) {
  auto bad = [&](std::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("volume path '", std::string(path.substr(0, 64)),
                                                   "' is not allowed: ", std::string(why)));
  };
  if (path.size() > kMaxVolumePathBytes) return bad("longer than 255 bytes");
  if (path.substr(0, 5) != "/mnt/" || path.size() == 5) {
    return bad("volumes mount below /mnt (e.g. /mnt/data)");
  }
  std::vector<std::string> parts = absl::StrSplit(std::string(path.substr(5)), '/');
  for (const std::string& part : parts) {
    if (part.empty()) return bad("empty path component");
    if (part == "." || part == "..") return bad("'.' and '..' are not allowed");
    for (char c : part) {
      if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
            c == '.' || c == '_' || c == '-')) {
        return bad("components are made of A-Z, a-z, 0-9, '.', '_' and '-'");
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateVolumeSize(int64_t size_mb, int64_t max_mb) {
  if (size_mb < kMinVolumeMb || size_mb > max_mb) {
    return absl::InvalidArgumentError(absl::StrCat("size_mb ", size_mb, " is outside ",
                                                   kMinVolumeMb, "..", max_mb, " (max_volume_mb)"));
  }
  return absl::OkStatus();
}

std::string VolumeKey(std::string_view tenant, std::string_view name) {
  return absl::StrCat(Sha256Hex(tenant).substr(0, 16), "/", std::string(name));
}

}  // namespace esb

// Persistent volumes (issue 11): the rules the core applies to names, mount paths and sizes,
// and the driver key of a tenant's volume. Decisions only; the container driver makes them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace esb {

inline constexpr size_t kMaxVolumeNameBytes = 63;
inline constexpr size_t kMaxVolumePathBytes = 255;
inline constexpr int64_t kMinVolumeMb = 16;  // mkfs.ext4 needs room for its journal

// [a-z0-9-]{1,63}, not starting with '-'. InvalidArgument naming the rule otherwise.
absl::Status ValidateVolumeName(std::string_view name);
// A mount point below /mnt: absolute, at most 255 bytes, components of [A-Za-z0-9._-] that are
// not "." or "..", no empty component. /mnt is a small tmpfs of the sandbox's own (the image is
// read-only), so a volume never hides a system directory (/proc, /sys, /dev, /run, /etc, ...)
// nor /workspace.
absl::Status ValidateVolumePath(std::string_view path);
// size_mb within kMinVolumeMb..max_mb (InvalidArgument naming the limit otherwise).
absl::Status ValidateVolumeSize(int64_t size_mb, int64_t max_mb);
// The driver's name of `tenant`'s volume `name`: "<first 16 hex of SHA-256(tenant)>/<name>",
// so equal names of two tenants never meet in the driver.
std::string VolumeKey(std::string_view tenant, std::string_view name);

}  // namespace esb

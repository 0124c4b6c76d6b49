// Workspace manifests (drivers/step_state.h WorkspaceManifest) as stored blobs, and the diff
// between two of them. The codec is compact JSON: {"v":1,"t":total_bytes,"e":[[path, type,
// mode, size, mtime_ns, sha256, target, change_key], ...]} with type "f" | "d" | "l".
// Decoding checks everything (a manifest comes from a driver reporting a sandbox): paths,
// order, types, keys and counts, so that what the API serves from it is well-formed.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "drivers/step_state.h"

namespace esb {

inline constexpr size_t kMaxManifestEntries = 200000;

// A relative '/'-separated path with no empty, "." or ".." component, no NUL, ≤ 4096 bytes.
bool IsValidManifestPath(std::string_view path);
// Checks a manifest a driver produced (the same rules as decoding).
absl::Status ValidateManifest(const WorkspaceManifest& manifest);

std::string EncodeManifest(const WorkspaceManifest& manifest);
absl::StatusOr<WorkspaceManifest> DecodeManifest(std::string_view json);

struct ManifestChange {
  std::string path;
  std::string change;  // "added" | "modified" | "deleted"
};
// What changed from `parent` to `child` (both sorted): by path; a file is modified when its
// contents, mode, type or link target differ.
std::vector<ManifestChange> DiffManifests(const WorkspaceManifest& parent,
                                          const WorkspaceManifest& child);

// The entry at `path` (nullptr when absent); binary search.
const ManifestEntry* FindEntry(const WorkspaceManifest& manifest, std::string_view path);

// A unified diff of two texts (line-based, "--- a/path" / "+++ b/path" headers), at most
// `max_bytes` of output (truncated set when cut).
std::string UnifiedDiff(std::string_view path, std::string_view before, std::string_view after,
                        size_t max_bytes, bool* truncated);

}  // namespace esb

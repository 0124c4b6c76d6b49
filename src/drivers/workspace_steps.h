// Time travel for drivers whose sandbox runs esb-agent (container now, microVM later): the
// workspace of a step captured into the core's BlobStore through the agent's `walk`, and put
// back through `apply` (docs/agent-protocol.md "Workspace steps").
//
// Everything the agent reports is hostile: the manifest is shape-counted before it is parsed;
// every path must be relative and normalised (no "..", no leading "/", no empty or "."
// component, valid UTF-8), listed once, in order, below a listed directory; types, modes,
// lengths and counts are bounded; contents must add up exactly to what was received. Hashes
// and sizes of file contents are the host's (BlobStore::Put hashes what was received; the
// sandbox's sizes are only used to skip an unchanged file, with its change key).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "drivers/agent_client.h"
#include "drivers/step_state.h"

namespace esb {

// A manifest path: relative, '/'-separated, no empty, "." or ".." component, no NUL, valid
// UTF-8, at most 4095 bytes, components at most 255.
bool ValidWorkspacePath(std::string_view path);

// One entry of a validated walk; `content` set when the agent sent the file's bytes.
struct WalkedEntry {
  ManifestEntry entry;
  bool has_content = false;
  std::string_view content;  // into the reply's contents
};

// Validates a walk reply (see above). InvalidArgument naming the first problem; at most
// `max_entries` entries (FailedPrecondition beyond).
absl::StatusOr<std::vector<WalkedEntry>> ParseAgentWalk(const AgentWalkReply& reply,
                                                        int64_t max_entries);

// The workspace now: a walk against `*base` (the previous walk's token, updated), file
// contents stored in `blobs`. A file whose change key, size and mtime equal the entry of
// options.previous for its path reuses that entry's blob without being read. Over
// options.max_files / max_bytes: FailedPrecondition (nothing is referenced). `known` (may be
// null) is consulted the same way after options.previous: what a restore learned.
absl::StatusOr<WorkspaceManifest> CaptureAgentWorkspace(AgentClient& agent, BlobStore& blobs,
                                                        const CaptureOptions& options,
                                                        std::string* base,
                                                        const WorkspaceManifest* known = nullptr);

// Files a capture reads (not sent inline with the walk) are read one at a time, at most the
// blob store's max_blob_bytes each (a larger, sparse or growing file, or a Read that never
// ends: FailedPrecondition naming the file, nothing stored); all captures together hold at
// most kMaxCaptureBytesHeld of them (a capture waits up to 10 s for room, then fails:
// Unavailable). CaptureBytesHeld: what they hold now.
inline constexpr int64_t kMaxCaptureBytesHeld = int64_t{512} << 20;
int64_t CaptureBytesHeld();

// Makes the workspace exactly `target`: what is not in it is removed, files that differ are
// written from `blobs` (NotFound → FailedPrecondition: the step's contents were collected),
// symlinks, modes and mtimes as recorded. Files still unchanged since the capture (same change
// key, size and mtime) are not rewritten. `*base` becomes the token of the walk it made (the
// next capture's base). `now_known` (may be null) receives the step's files as they are now
// (after a restore that wrote any): their change keys of now and the step's blobs (with the same
// size and mtime as the step recorded; the sandbox can only mislabel its own files this way), for
// the next capture's `known`.
absl::Status RestoreAgentWorkspace(AgentClient& agent, BlobStore& blobs,
                                   const WorkspaceManifest& target, std::string* base,
                                   WorkspaceManifest* now_known = nullptr);

}  // namespace esb

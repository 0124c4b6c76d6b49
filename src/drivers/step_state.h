// Time travel (issue 13; docs/design.md "Time travel"): what a driver captures after a step and
// gives back on rewind or fork. The core keeps the step log (SQLite), the content-addressed
// blob store and retention; a driver knows how to read its instance's state and how to put it
// back. Everything an instance reports here comes from inside a sandbox: hostile (paths,
// sizes, counts and JSON are validated and bounded by the driver before they reach the core).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace esb {

// What a snapshot holds.
enum class SnapshotContent { kMemory, kDisk, kMemoryAndDisk };
std::string_view SnapshotContentName(SnapshotContent content);  // memory | disk | memory+disk

// A snapshot as the driver made it: `state` is driver-private (like InstanceRef::state).
struct SnapshotRef {
  std::string id;
  std::string driver;
  SnapshotContent content = SnapshotContent::kMemoryAndDisk;
  std::string source_id;  // the environment it was taken from
  std::string state;
  // Bytes it holds on the host (memory pages it keeps, image files), for retention; 0: unknown.
  int64_t bytes = 0;
  // Held by a live process (e.g. nano's frozen clone): lost when esbd or its worker restarts.
  bool live = false;
};

// Content-addressed bytes: a blob's key is the lowercase hex SHA-256 of its contents, computed
// by the store (never taken from a sandbox). The core's implementation is on disk
// (core/snapshots/); tests use drivers/testing/memory_blob_store.h.
class BlobStore {
 public:
  virtual ~BlobStore() = default;
  // Stores `data` (idempotent); returns its SHA-256. ResourceExhausted when over a cap.
  virtual absl::StatusOr<std::string> Put(std::string_view data) = 0;
  virtual bool Has(std::string_view sha256) = 0;
  // The whole blob; NotFound when absent (e.g. collected).
  virtual absl::StatusOr<std::string> Get(std::string_view sha256) = 0;
  // At most `length` bytes of a blob from `offset` (fewer at its end, none past it); NotFound
  // when absent. Restores and downloads read a large blob this way, a bounded piece at a time.
  // A store on disk verifies the whole blob against its key when `offset` is 0 (DataLoss), so
  // a reader going from 0 to the end reads verified bytes. The default reads the whole blob
  // (stores for tests).
  virtual absl::StatusOr<std::string> ReadRange(std::string_view sha256, int64_t offset,
                                                int64_t length) {
    absl::StatusOr<std::string> all = Get(sha256);
    if (!all.ok()) return all.status();
    if (offset < 0 || length < 0) return absl::InvalidArgumentError("negative offset or length");
    if (offset >= static_cast<int64_t>(all->size())) return std::string();
    return all->substr(static_cast<size_t>(offset), static_cast<size_t>(length));
  }
  // The largest blob Put stores: a capture never reads a bigger file into esbd.
  virtual int64_t max_blob_bytes() const { return int64_t{256} << 20; }
};

// One entry of /workspace at a step.
struct ManifestEntry {
  enum class Type { kFile, kDir, kSymlink };
  // Relative to /workspace, '/'-separated: no leading '/', no empty, '.' or '..' component.
  std::string path;
  Type type = Type::kFile;
  uint32_t mode = 0;     // permission bits (07777)
  int64_t size = 0;      // files: bytes
  int64_t mtime_ns = 0;  // as the sandbox reported it (informational)
  std::string sha256;    // files: the blob holding the contents
  std::string target;    // symlinks: the link text (never followed)
  // Driver-private change detection (e.g. "<ino>:<ctime_ns>"): a file whose change_key, size
  // and mtime_ns equal the previous manifest's entry for the same path reuses its sha256
  // without reading the file again. Empty: always read.
  std::string change_key;
};

// /workspace at a step: entries sorted by path (byte order), each path once.
struct WorkspaceManifest {
  std::vector<ManifestEntry> entries;
  int64_t total_bytes = 0;  // sum of file sizes
};

// What a step's state is, as a driver captured it.
struct StepState {
  WorkspaceManifest workspace;
  // An honest memory(+disk) snapshot (the step's `memory: "snapshot"`), driver-owned: the core
  // stores it and hands it back to RestoreStep/ForkStep, and releases it with DeleteSnapshot.
  // Unset: memory "none" (files are exact; processes and live variables do not come back).
  std::optional<SnapshotRef> memory;
  // Unset memory although CaptureOptions::memory asked for it: why (the step's memory_detail
  // "unsupported: <reason>"). Empty: the core's generic reason.
  std::string memory_reason;
  // The shell session's state (cwd, variables, functions), opaque to the core, ≤ 256 KiB;
  // restored as is. Empty: the driver has no shell session.
  std::string shell_state;
  // After a Python step: a bounded JSON array (≤ 64 KiB) summarising the session's variables,
  // each {"name","type","repr"} plus, where known, "shape", "dtype", "len", "columns";
  // empty: not captured.
  std::string variables_json;
};

struct CaptureOptions {
  // The parent step's manifest (unchanged files are not read again); null: read everything.
  const WorkspaceManifest* previous = nullptr;
  bool memory = true;     // take a memory snapshot when the driver can (StepMemory())
  bool variables = true;  // summarise the Python session's variables (after a Python step)
  int64_t max_files = 10000;
  int64_t max_bytes = int64_t{1} << 30;  // over either: FailedPrecondition (nothing stored)
};

// What a driver can do for a step's memory on this host.
struct StepMemorySupport {
  bool available = false;
  std::string mechanism;  // e.g. "fork" (nano), "runsc checkpoint" (gVisor), "criu"
  std::string reason;     // when not available: why, for /healthz and the step's detail
};

}  // namespace esb

// The core's content-addressed blob store for time travel (docs/design.md "Time travel"):
// workspace file contents, manifests, variables summaries and shell states, on disk under
// <state_dir>/blobs/<first two hex>/<sha256>. The key is the SHA-256 the store computes itself;
// a key from anywhere else (a URL, a manifest from a sandbox) is checked to be 64 lowercase hex
// before it names a file, and every read is verified against it.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "drivers/step_state.h"

namespace esb {

struct DiskBlobStoreOptions {
  std::string dir;                              // created 0700 when missing
  int64_t max_blob_bytes = int64_t{256} << 20;  // one blob
  int64_t max_total_bytes = int64_t{8} << 30;   // the whole store
};

// true for 64 lowercase hex characters (a blob key).
bool IsBlobKey(std::string_view key);

class DiskBlobStore : public BlobStore {
 public:
  // Opens (creating) the store, drops temporary files a crash left and counts what is stored.
  static absl::StatusOr<std::unique_ptr<DiskBlobStore>> Open(DiskBlobStoreOptions options);

  // Atomic (written to a temporary file, then renamed into place). Storing an existing blob
  // refreshes its mtime, so a sweep's grace period protects it until its step is written.
  absl::StatusOr<std::string> Put(std::string_view data) override;
  bool Has(std::string_view sha256) override;
  // NotFound when absent; DataLoss when its bytes do not hash to its key.
  absl::StatusOr<std::string> Get(std::string_view sha256) override;
  // pread of the range (offset 0: the whole blob is first hashed in 1 MiB pieces and checked
  // against its key, DataLoss otherwise): holds at most `length` bytes (+ 1 MiB).
  absl::StatusOr<std::string> ReadRange(std::string_view sha256, int64_t offset,
                                        int64_t length) override;
  int64_t max_blob_bytes() const override { return options_.max_blob_bytes; }

  // Garbage collection (core/snapshots/retention): every blob with its size and mtime, and
  // removal of one.
  struct Entry {
    std::string key;
    int64_t size = 0;
    int64_t mtime_ms = 0;
  };
  absl::StatusOr<std::vector<Entry>> List();
  absl::Status Remove(std::string_view sha256);
  int64_t total_bytes();
  const DiskBlobStoreOptions& options() const { return options_; }

 private:
  explicit DiskBlobStore(DiskBlobStoreOptions options) : options_(std::move(options)) {}
  std::string PathOf(std::string_view key) const;

  DiskBlobStoreOptions options_;
  std::mutex mu_;  // guards total_
  int64_t total_ = 0;
};

}  // namespace esb

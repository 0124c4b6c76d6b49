// The core's content-addressed blob store for time travel (docs/design.md "Time travel"):
// workspace file contents, manifests, variables summaries and shell states, on disk under
// <state_dir>/blobs/t/<tenant tag>/<first two hex>/<sha256>. The key is the SHA-256 the store
// computes itself; a key from anywhere else (a URL, a manifest from a sandbox) is checked to be
// 64 lowercase hex before it names a file, and every read is verified against it.
//
// Each tenant has its own namespace (ForTenant): identical content is stored once per tenant,
// never shared across tenants, so whether a Put succeeds, and how long it takes, says nothing
// about what another tenant stored. Each tenant's bytes count against its share of the store
// (max_tenant_bytes) and all of them against the store's cap, both checked before anything is
// written. Garbage collection (the core's sweep) never removes a blob a Put or a pin holds, nor
// one touched while the sweep ran.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "absl/status/statusor.h"
#include "drivers/step_state.h"

namespace esb {

struct DiskBlobStoreOptions {
  std::string dir;                              // created 0700 when missing
  int64_t max_blob_bytes = int64_t{256} << 20;  // one blob
  int64_t max_total_bytes = int64_t{8} << 30;   // the whole store
  // One tenant's blobs at most (its share); 0: a quarter of max_total_bytes.
  int64_t max_tenant_bytes = 0;
};

// true for 64 lowercase hex characters (a blob key).
bool IsBlobKey(std::string_view key);

class DiskBlobStore {
 public:
  // Opens (creating) the store, drops temporary files a crash left (and blobs of the layout
  // before tenant namespaces, which nothing can reference) and counts what is stored.
  static absl::StatusOr<std::unique_ptr<DiskBlobStore>> Open(DiskBlobStoreOptions options);
  ~DiskBlobStore();

  // One tenant's blobs. What a Put stored or found stays pinned (never swept) until this view
  // is destroyed: a capture keeps its view until its step is stored.
  class Tenant : public BlobStore {
   public:
    Tenant(const Tenant&) = delete;
    Tenant& operator=(const Tenant&) = delete;
    ~Tenant() override;
    // Atomic (a temporary file renamed into place). ResourceExhausted, before anything is
    // written, when the blob is over max_blob_bytes or would take the tenant over its share or
    // the store over its cap ("capture refused: ..."). Content the tenant already stored is
    // shared (no charge).
    absl::StatusOr<std::string> Put(std::string_view data) override;
    bool Has(std::string_view sha256) override;
    // NotFound when absent; DataLoss when its bytes do not hash to its key.
    absl::StatusOr<std::string> Get(std::string_view sha256) override;
    // pread of the range (offset 0: the whole blob is first hashed in 1 MiB pieces and checked
    // against its key, DataLoss otherwise): holds at most `length` bytes (+ 1 MiB).
    absl::StatusOr<std::string> ReadRange(std::string_view sha256, int64_t offset,
                                          int64_t length) override;
    int64_t max_blob_bytes() const override { return store_->options_.max_blob_bytes; }
    // Keeps `sha256` from being swept while this view lives (false: the tenant has no such
    // blob).
    bool Pin(std::string_view sha256);
    const std::string& tag() const { return tag_; }

   private:
    friend class DiskBlobStore;
    Tenant(DiskBlobStore* store, std::string tag) : store_(store), tag_(std::move(tag)) {}
    DiskBlobStore* store_;
    std::string tag_;
    std::set<std::string> pinned_;
  };
  // The view of `tenant` (any string; its directory is named by a hash of it).
  Tenant ForTenant(std::string_view tenant) { return Tenant(this, TenantTag(tenant)); }
  static std::string TenantTag(std::string_view tenant);

  // Garbage collection (the core's sweep). A sweep runs between BeginSweep and EndSweep (one at
  // a time): a key pinned or unpinned meanwhile is remembered, and RemoveUnused refuses it as it
  // refuses a pinned one, so a capture that stored (or re-found) a blob after the sweep read
  // the steps keeps it.
  struct Entry {
    std::string key;
    int64_t size = 0;
  };
  std::vector<std::string> TenantTags();
  absl::StatusOr<std::vector<Entry>> List(const std::string& tag);
  void BeginSweep();
  void EndSweep();
  // Removes the blob unless it is pinned or was touched during this sweep; its size when
  // removed, 0 otherwise.
  int64_t RemoveUnused(const std::string& tag, std::string_view sha256);

  int64_t total_bytes();
  int64_t tenant_bytes(std::string_view tenant);
  // One tenant's share (max_tenant_bytes resolved).
  int64_t tenant_cap() const { return tenant_cap_; }
  const DiskBlobStoreOptions& options() const { return options_; }

 private:
  explicit DiskBlobStore(DiskBlobStoreOptions options);
  std::string PathOf(const std::string& tag, std::string_view key) const;
  void PinLocked(const std::string& pin);

  DiskBlobStoreOptions options_;
  int64_t tenant_cap_ = 0;
  std::mutex mu_;  // guards everything below
  int64_t total_ = 0;
  std::map<std::string, int64_t> tenant_total_;  // tag → bytes
  std::unordered_map<std::string, int> pins_;    // "<tag>/<key>" → views holding it
  bool sweeping_ = false;
  std::unordered_set<std::string> touched_;  // "<tag>/<key>" pinned or unpinned in a sweep
};

}  // namespace esb

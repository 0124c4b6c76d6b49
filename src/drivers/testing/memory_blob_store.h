// Test helper: a BlobStore (drivers/step_state.h) in memory, keyed by SHA-256 like the core's.
// Link esb_storage (Sha256Hex).
#pragma once

#include <map>
#include <mutex>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "drivers/step_state.h"
#include "storage/sqlite_store.h"

namespace esb::testing {

class MemoryBlobStore : public BlobStore {
 public:
  absl::StatusOr<std::string> Put(std::string_view data) override {
    std::string key = Sha256Hex(data);
    std::lock_guard<std::mutex> lock(mu_);
    ++puts_;
    blobs_.try_emplace(key, data);
    return key;
  }
  bool Has(std::string_view sha256) override {
    std::lock_guard<std::mutex> lock(mu_);
    return blobs_.count(std::string(sha256)) > 0;
  }
  absl::StatusOr<std::string> Get(std::string_view sha256) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blobs_.find(std::string(sha256));
    if (it == blobs_.end()) return absl::NotFoundError("no blob " + std::string(sha256));
    return it->second;
  }
  // How many Put calls (a capture that skips unchanged files puts only the changed ones).
  int puts() {
    std::lock_guard<std::mutex> lock(mu_);
    return puts_;
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    return blobs_.size();
  }

 private:
  std::mutex mu_;
  std::map<std::string, std::string> blobs_;
  int puts_ = 0;
};

}  // namespace esb::testing

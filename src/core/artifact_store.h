// Artifacts: what a run produced besides its output (matplotlib figures, files written under
// /workspace/artifacts). esbd copies each one out of the sandbox into this host-side store, so
// an artifact stays downloadable after its environment is gone (a one-shot POST /run destroys
// its environment as soon as the code finishes) — until it expires.
//
// On disk: <dir>/<id>.bin (the bytes) and <dir>/<id>.json (the metadata, written second and
// atomically, so a crash leaves at most an orphan .bin that Open() removes). The index lives in
// memory and is rebuilt from the .json files at start.
//
// Limits: bytes per artifact, bytes per tenant (a Put that would exceed it is refused with
// ResourceExhausted; nothing old is evicted behind the tenant's back), and a time to live
// after which Sweep() deletes the artifact.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/util.h"

namespace esb {

struct ArtifactMeta {
  std::string id;  // "art_" + 24 hex characters
  std::string tenant;
  std::string environment_id;
  std::string kind;       // "image" | "file"
  std::string name;       // "figure-1.png", or the path under /workspace/artifacts
  std::string mime_type;  // "image/png", ...
  std::string title;      // figure title; empty = none
  int64_t size = 0;
  int64_t step = 0;  // the environment's exec sequence number when it was captured
  int64_t created_ms = 0;
};

class ArtifactStore {
 public:
  struct Options {
    std::string dir;
    int64_t max_artifact_bytes = 32ll << 20;
    int64_t max_tenant_bytes = 1ll << 30;
    // Empty artifacts cost no bytes but a file pair and an index entry each: count them too.
    int64_t max_tenant_artifacts = 10000;
    int64_t ttl_s = 24 * 3600;
  };

  // Creates `dir` if needed and loads what is there (dropping expired and incomplete entries).
  static absl::StatusOr<std::unique_ptr<ArtifactStore>> Open(const Options& options);

  // Stores `data` under a new id (meta.id, size and created_ms are filled in).
  absl::StatusOr<ArtifactMeta> Put(ArtifactMeta meta, std::string_view data);
  // Metadata of one artifact; NotFound unless it belongs to `tenant` and `environment_id`.
  absl::StatusOr<ArtifactMeta> Get(const std::string& tenant, const std::string& environment_id,
                                   const std::string& id) const;
  absl::StatusOr<std::string> Read(const std::string& tenant, const std::string& environment_id,
                                   const std::string& id) const;
  // The artifact's bytes, opened for reading in chunks (a download streams them rather than
  // holding the whole artifact in memory); same checks as Read. The file stays readable through
  // the fd even if the artifact is swept meanwhile.
  absl::StatusOr<UniqueFd> Open(const std::string& tenant, const std::string& environment_id,
                                const std::string& id) const;
  // An environment's artifacts, oldest first.
  std::vector<ArtifactMeta> List(const std::string& tenant,
                                 const std::string& environment_id) const;
  // Deletes expired artifacts; returns how many.
  int Sweep(int64_t now_ms);
  // Sweep(now) if the last sweep was more than a minute ago (called on the request paths, so
  // no thread of its own is needed).
  void MaybeSweep();

  int64_t TenantBytes(const std::string& tenant) const;
  const Options& options() const { return options_; }

 private:
  explicit ArtifactStore(Options options) : options_(std::move(options)) {}
  std::string PathOf(const std::string& id, std::string_view ext) const;
  void RemoveLocked(const std::string& id);

  Options options_;
  mutable std::mutex mu_;
  std::map<std::string, ArtifactMeta> by_id_;
  std::map<std::string, uint64_t> order_;  // id -> insertion sequence (List's order)
  uint64_t next_order_ = 0;
  int64_t last_sweep_ms_ = 0;
  std::map<std::string, int64_t> tenant_bytes_;
  std::map<std::string, int64_t> tenant_count_;
};

}  // namespace esb

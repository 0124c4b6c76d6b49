// The host-side wheel cache behind `packages: [...]`.
//
// Sandboxes have no network, so esbd downloads wheels from one configured simple index on the
// host and later copies them into the sandbox, where pip installs them with --no-index
// --find-links. Dependency resolution stays with pip: when it reports a missing requirement,
// the daemon calls Fetch for it too. Nothing downloaded here is executed or unpacked.
//
// Layout under cache_dir:
//   index/<name>.json                          the project page as parsed, with its fetch time
//   wheels/<cp311>/<name>/<version>/<file>.whl  verified wheels (sha256, zip magic, size cap)
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "packages/http_fetcher.h"
#include "packages/requirement.h"
#include "packages/simple_index.h"
#include "packages/version.h"
#include "packages/wheel.h"

namespace esb::packages {

struct Wheel {
  std::string name;      // normalised project name
  std::string version;   // normalised version
  std::string filename;
  std::string path;      // the file on the host
  std::string sha256;    // lowercase hex of the file (empty from CachedWheels)
  int64_t size = 0;
  bool from_cache = false;  // no wheel download happened
  bool offline = false;     // the index was unreachable; chosen from the cache
};

class WheelCache {
 public:
  struct Options {
    std::string cache_dir;
    std::string index_url;  // e.g. "https://mirror.example/simple" ('/' appended if missing)
    // Extra hosts wheel files may come from (the index's host is always allowed).
    std::vector<std::string> allowed_hosts;
    Target target;
    int64_t max_wheel_bytes = 256 << 20;
    int64_t max_page_bytes = 16 << 20;
    std::chrono::seconds index_ttl{600};
    std::chrono::seconds http_timeout{120};
    std::chrono::seconds connect_timeout{10};
    // Wall clock in unix milliseconds for the page TTL; empty = the real clock (tests inject).
    std::function<int64_t()> now_ms;
  };

  // `fetcher` is not owned and must outlive the cache.
  WheelCache(Options options, HttpFetcher* fetcher);

  // Finds the best wheel for `req` on the index and makes sure it is in the cache. Thread-safe;
  // concurrent calls for the same project page or file make one request.
  absl::StatusOr<Wheel> Fetch(const Requirement& req);

  // Wheels for `name` (normalised) in the cache for the target interpreter, any version.
  std::vector<Wheel> CachedWheels(const std::string& name);

  const Options& options() const { return options_; }

 private:
  struct Page {
    int64_t fetched_ms = 0;
    std::string url;
    std::vector<IndexLink> links;
  };
  struct Choice {
    IndexLink link;
    WheelName wheel;
  };

  absl::StatusOr<Page> GetPage(const std::string& name);
  absl::StatusOr<Page> DownloadPage(const std::string& name, const std::string& url);
  absl::StatusOr<Choice> Choose(const Requirement& req, const Specifier& spec,
                                const std::vector<IndexLink>& links);
  absl::StatusOr<Wheel> Offline(const Requirement& req, const Specifier& spec,
                                const absl::Status& why);
  absl::StatusOr<Wheel> Materialize(const Requirement& req, const Choice& choice);
  absl::Status Download(const Requirement& req, const Choice& choice, const std::string& path,
                        std::string* sha256, int64_t* size);
  std::shared_ptr<std::mutex> KeyLock(const std::string& key);
  int64_t Now() const;
  std::string WheelDir(const std::string& name) const;
  std::vector<std::string> AllowedHosts() const;

  Options options_;
  HttpFetcher* fetcher_;
  absl::Status init_status_;
  std::string index_host_;

  std::mutex mu_;
  std::map<std::string, Page> pages_;                           // guarded by mu_
  std::map<std::string, std::shared_ptr<std::mutex>> key_locks_;  // guarded by mu_
};

// Lowercase hex SHA-256 of a file.
absl::StatusOr<std::string> Sha256File(const std::string& path);

}  // namespace esb::packages

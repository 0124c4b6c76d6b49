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
//   wheels/.../.<file>.whl.part-<random>        a download in progress (swept when stale)
//
// Status classes, as the HTTP API maps them: the client's doing or a permanent condition →
// FailedPrecondition / NotFound / PermissionDenied / InvalidArgument (4xx); the index's fault
// (unreachable, a broken page, a corrupt file) → Unavailable (503); the install's own time
// running out → DeadlineExceeded.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
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
  // While any copy of this Wheel (from Fetch) lives, quota eviction leaves `path` alone: hold
  // it until the file has been read. Must not outlive the WheelCache.
  std::shared_ptr<const void> lease;
};

class WheelCache {
 public:
  using Clock = std::chrono::steady_clock;

  struct Options {
    std::string cache_dir;
    std::string index_url;  // e.g. "https://mirror.example/simple" ('/' appended if missing)
    // Extra hosts wheel files may come from: "host" (the scheme's default port) or "host:port".
    // The index's host and port are always allowed.
    std::vector<std::string> allowed_hosts;
    Target target;
    int64_t max_wheel_bytes = 256 << 20;
    int64_t max_page_bytes = 16 << 20;
    // Total size of the cached wheels; above it, the least recently used wheels (by file
    // modification time, refreshed whenever a wheel is handed out) are deleted after each
    // download, except wheels currently leased (Wheel::lease). 0 = unlimited.
    int64_t max_cache_bytes = 0;
    // Parsed project pages kept in memory (each can hold thousands of links); expired pages
    // are dropped first, then the oldest. Pages also persist on disk under index/.
    size_t max_pages_in_memory = 256;
    std::chrono::seconds index_ttl{600};
    std::chrono::seconds http_timeout{120};
    std::chrono::seconds connect_timeout{10};
    // Wall clock in unix milliseconds for the page TTL; empty = the real clock (tests inject).
    std::function<int64_t()> now_ms;
  };

  // A governed environment's egress (docs/design.md "Host-side wheel cache"; the core's
  // EnvironmentManager::HostFetchEgressFor fills it): every request of the fetch goes through
  // `route` (that environment's egress proxy decides, DLP-scans and audits it), and whatever
  // the cache would hand out without a request — a fresh cached index page, a cached wheel,
  // the offline fallback — is first put to `check` with the URL it would have come from (for
  // the offline fallback, which does not know a file's origin: the index page's URL and each
  // of allowed_hosts, all of which must pass).
  struct Egress {
    std::shared_ptr<const ProxyRoute> route;
    // OK, or why the environment may not have data from `url` now (PermissionDenied naming
    // the host and the rule; the implementation audits the refusal).
    std::function<absl::Status(const std::string& url)> check;
  };

  // `fetcher` is not owned and must outlive the cache. Deletes partial downloads (.part-*)
  // older than max(2 × http_timeout, 1 h) left under cache_dir by an earlier process.
  WheelCache(Options options, HttpFetcher* fetcher);

  // Finds the best wheel for `req` on the index and makes sure it is in the cache. Thread-safe;
  // concurrent calls for the same project page or file make one request. Every request and
  // every wait for a concurrent one ends by `deadline` (the caller's overall time; each request
  // gets at most http_timeout anyway): past it → DeadlineExceeded, without the offline fallback.
  // `egress` (not owned; null: direct): for a governed environment, see Egress.
  absl::StatusOr<Wheel> Fetch(const Requirement& req,
                              Clock::time_point deadline = Clock::time_point::max(),
                              const Egress* egress = nullptr);

  // Wheels for `name` (normalised) in the cache for the target interpreter, any version.
  std::vector<Wheel> CachedWheels(const std::string& name);

  // What the cache holds in memory (for tests and metrics).
  struct Stats {
    size_t pages_in_memory = 0;
    size_t key_locks = 0;      // projects / files with a fetch in progress or waited for
    size_t leased_wheels = 0;  // distinct wheel files with a live Wheel::lease
  };
  Stats GetStats();

  const Options& options() const { return options_; }
  // OK, or why the options are unusable (a bad index_url, no cache_dir): every Fetch then
  // fails with it. esbd checks it at start.
  const absl::Status& init_status() const { return init_status_; }

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

  // One mutex per key ("page:<name>", "file:<path>"), so that concurrent callers make one
  // request; the entry lives only while someone holds or waits for it.
  struct KeyLock {
    std::timed_mutex mu;
    int users = 0;  // holders and waiters; guarded by WheelCache::mu_
  };
  class KeyGuard {
   public:
    KeyGuard() = default;
    KeyGuard(KeyGuard&& o) noexcept { *this = std::move(o); }
    KeyGuard& operator=(KeyGuard&& o) noexcept;
    ~KeyGuard() { Release(); }
    void Release();

   private:
    friend class WheelCache;
    WheelCache* cache_ = nullptr;
    std::map<std::string, std::unique_ptr<KeyLock>>::iterator it_;
  };

  absl::StatusOr<Page> GetPage(const std::string& name, Clock::time_point deadline,
                               const Egress* egress);
  absl::StatusOr<Page> DownloadPage(const std::string& name, const std::string& url,
                                    Clock::time_point deadline, const Egress* egress);
  absl::StatusOr<Choice> Choose(const Requirement& req, const Specifier& spec,
                                const std::vector<IndexLink>& links);
  absl::StatusOr<Wheel> Offline(const Requirement& req, const Specifier& spec,
                                const absl::Status& why, Clock::time_point deadline,
                                const Egress* egress);
  absl::StatusOr<Wheel> Materialize(const Requirement& req, const Choice& choice,
                                    Clock::time_point deadline, const Egress* egress);
  absl::Status Download(const Requirement& req, const Choice& choice, const std::string& path,
                        Clock::time_point deadline, const Egress* egress, std::string* sha256,
                        int64_t* size);
  // Blocks until `key` is free or `deadline` (→ DeadlineExceeded naming `what`).
  absl::StatusOr<KeyGuard> LockKey(const std::string& key, Clock::time_point deadline,
                                   std::string_view what);
  // Non-blocking; false when someone else holds or waits for `key`.
  bool TryLockKey(const std::string& key, KeyGuard* guard);
  // Both of the above: joins `key`'s entry, calls `lock` on its mutex (true = got it), and
  // leaves the entry again when it did not.
  std::optional<KeyGuard> AcquireKey(const std::string& key,
                                     const std::function<bool(std::timed_mutex&)>& lock);
  // Calls fn(entry, file name) for each regular file in the wheel tree
  // (<cache_dir>/wheels/<tag>/<name>/<version>/<file>).
  void ForEachCacheFile(
      const std::function<void(const std::filesystem::directory_entry&, const std::string&)>& fn)
      const;
  // Limits for one request: at most http_timeout / connect_timeout, and ending by `deadline`;
  // through egress->route when governed.
  absl::StatusOr<FetchLimits> Limits(int64_t max_body_bytes, Clock::time_point deadline,
                                     std::string_view what, const Egress* egress) const;
  // egress->check(url) when governed (a hit handed out without a request); else OK.
  static absl::Status CheckHit(const Egress* egress, const std::string& url);
  void RememberPage(const std::string& name, const Page& page);  // with mu_ held
  std::shared_ptr<const void> Lease(const std::string& path);
  void EvictOverQuota();
  void SweepPartialDownloads();
  int64_t Now() const;
  std::string WheelDir(const std::string& name) const;
  std::vector<std::string> AllowedHosts() const;

  Options options_;
  HttpFetcher* fetcher_;
  absl::Status init_status_;
  std::string index_host_;  // "host:port" of the index, always explicit
  bool index_https_ = false;

  std::mutex mu_;
  std::map<std::string, Page> pages_;                         // guarded by mu_
  std::map<std::string, std::unique_ptr<KeyLock>> key_locks_;  // guarded by mu_
  std::map<std::string, int> leases_;  // wheel path → live leases; guarded by mu_
  std::mutex evict_mu_;                // one eviction pass at a time
};

// Lowercase hex SHA-256 of a file.
absl::StatusOr<std::string> Sha256File(const std::string& path);

}  // namespace esb::packages

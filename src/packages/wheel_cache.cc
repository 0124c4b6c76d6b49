#include "packages/wheel_cache.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <boost/json.hpp>
#include <cerrno>
#include <filesystem>
#include <optional>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/util.h"
#include "packages/url.h"

namespace esb::packages {
namespace {

namespace fs = std::filesystem;
namespace json = boost::json;

constexpr char kAcceptIndex[] = "application/vnd.pypi.simple.v1+json, text/html;q=0.1";
constexpr int kMaxListedVersions = 10;
constexpr int kMaxListedFiles = 5;

class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new()) { EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr); }
  ~Sha256() { EVP_MD_CTX_free(ctx_); }
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void Update(std::string_view d) { EVP_DigestUpdate(ctx_, d.data(), d.size()); }
  std::string HexDigest() {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    EVP_DigestFinal_ex(ctx_, md, &n);
    static constexpr char kHex[] = "0123456789abcdef";
    std::string out;
    for (unsigned int i = 0; i < n; ++i) {
      out += kHex[md[i] >> 4];
      out += kHex[md[i] & 15];
    }
    return out;
  }

 private:
  EVP_MD_CTX* ctx_;
};

bool ValidProjectName(const std::string& n) {
  if (n.empty() || n.size() > 200 || n.front() == '-' || n.back() == '-') return false;
  return std::all_of(n.begin(), n.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-';
  });
}

// pip's rule: a link whose requires-python cannot be parsed is not excluded.
bool PythonAdmitted(const std::string& requires_python, const Target& t) {
  if (requires_python.empty()) return true;
  auto spec = ParseSpecifier(requires_python);
  if (!spec.ok()) return true;
  return spec->Contains(t.PythonVersion(), true);
}

// pip: prereleases only when the specifier names one, or when no final release satisfies it.
template <class T>
std::vector<const T*> Satisfying(const std::map<Version, T>& by_version, const Specifier& spec) {
  std::vector<const T*> out;
  for (bool allow_pre : {false, true}) {
    for (const auto& [v, item] : by_version) {
      if (spec.Contains(v, allow_pre)) out.push_back(&item);
    }
    if (!out.empty()) break;
  }
  return out;
}

// PEP 592: a yanked release may still be chosen when the specifier pins that very version
// (a non-wildcard "==" or "===") and no release that is not yanked matches.
bool PinsOneVersion(const Specifier& spec) {
  for (const auto& c : spec.clauses()) {
    if (c.op == "===" || (c.op == "==" && !c.wildcard)) return true;
  }
  return false;
}

// Marks a cached wheel as just used, for the least-recently-used quota eviction.
void Touch(const std::string& path) { utimensat(AT_FDCWD, path.c_str(), nullptr, 0); }

std::string Describe(const Requirement& req) {
  return req.specifier.empty() ? req.name : absl::StrCat(req.name, " ", req.specifier);
}

json::value PageToJson(int64_t fetched_ms, const std::string& url,
                       const std::vector<IndexLink>& links) {
  json::array files;
  for (const auto& l : links) {
    files.push_back(json::object{{"filename", l.filename},
                                 {"url", l.url},
                                 {"sha256", l.sha256},
                                 {"yanked", l.yanked},
                                 {"requires_python", l.requires_python}});
  }
  return json::object{{"fetched_ms", fetched_ms}, {"url", url}, {"files", std::move(files)}};
}

bool PageFromJson(const std::string& text, int64_t* fetched_ms, std::string* url,
                  std::vector<IndexLink>* links) {
  boost::system::error_code ec;
  json::value v = json::parse(text, ec);
  if (ec || !v.is_object()) return false;
  const auto& o = v.get_object();
  const auto* f = o.if_contains("fetched_ms");
  const auto* u = o.if_contains("url");
  const auto* files = o.if_contains("files");
  if (!f || !f->is_int64() || !u || !u->is_string() || !files || !files->is_array()) return false;
  *fetched_ms = f->get_int64();
  *url = std::string(u->get_string());
  for (const auto& e : files->get_array()) {
    const auto* fo = e.if_object();
    if (!fo) return false;
    IndexLink l;
    auto str = [&](const char* key, std::string* out) {
      const auto* x = fo->if_contains(key);
      if (x && x->is_string()) *out = std::string(x->get_string());
    };
    str("filename", &l.filename);
    str("url", &l.url);
    str("sha256", &l.sha256);
    str("requires_python", &l.requires_python);
    if (const auto* y = fo->if_contains("yanked"); y && y->is_bool()) l.yanked = y->get_bool();
    links->push_back(std::move(l));
  }
  return true;
}

}  // namespace

absl::StatusOr<std::string> Sha256File(const std::string& path) {
  UniqueFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return ErrnoStatus("open " + path);
  Sha256 sha;
  char buf[64 << 10];
  while (true) {
    ssize_t n = read(fd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus("read " + path);
    if (n == 0) break;
    sha.Update(std::string_view(buf, static_cast<size_t>(n)));
  }
  return sha.HexDigest();
}

WheelCache::WheelCache(Options options, HttpFetcher* fetcher)
    : options_(std::move(options)), fetcher_(fetcher) {
  if (!options_.index_url.empty() && !options_.index_url.ends_with('/')) {
    options_.index_url += '/';
  }
  // Paths are compared as strings (key locks, leases): one spelling of the root.
  while (options_.cache_dir.size() > 1 && options_.cache_dir.ends_with('/')) {
    options_.cache_dir.pop_back();
  }
  auto u = ParseUrl(options_.index_url);
  if (!u.ok()) {
    init_status_ = absl::InvalidArgumentError(
        absl::StrCat("package index URL: ", u.status().message()));
  } else {
    // With its port always: the index's own entry admits exactly the index's host and port.
    std::string host = u->host.find(':') != std::string::npos ? "[" + u->host + "]" : u->host;
    index_host_ = absl::StrCat(host, ":", u->port);
    index_https_ = u->scheme == "https";
  }
  if (options_.cache_dir.empty()) {
    init_status_ = absl::InvalidArgumentError("package cache directory is not set");
  }
  if (init_status_.ok()) SweepPartialDownloads();
}

WheelCache::KeyGuard& WheelCache::KeyGuard::operator=(KeyGuard&& o) noexcept {
  if (this != &o) {
    Release();
    cache_ = o.cache_;
    it_ = o.it_;
    o.cache_ = nullptr;
  }
  return *this;
}

void WheelCache::KeyGuard::Release() {
  if (cache_ == nullptr) return;
  it_->second->mu.unlock();
  std::lock_guard<std::mutex> lock(cache_->mu_);
  if (--it_->second->users == 0) cache_->key_locks_.erase(it_);
  cache_ = nullptr;
}

std::optional<WheelCache::KeyGuard> WheelCache::AcquireKey(
    const std::string& key, const std::function<bool(std::timed_mutex&)>& lock) {
  std::map<std::string, std::unique_ptr<KeyLock>>::iterator it;
  {
    std::lock_guard<std::mutex> l(mu_);
    it = key_locks_.try_emplace(key).first;
    if (!it->second) it->second = std::make_unique<KeyLock>();
    ++it->second->users;  // from now on the entry stays until we give it up
  }
  if (!lock(it->second->mu)) {
    std::lock_guard<std::mutex> l(mu_);
    if (--it->second->users == 0) key_locks_.erase(it);
    return std::nullopt;
  }
  KeyGuard guard;
  guard.cache_ = this;
  guard.it_ = it;
  return guard;
}

absl::StatusOr<WheelCache::KeyGuard> WheelCache::LockKey(const std::string& key,
                                                         Clock::time_point deadline,
                                                         std::string_view what) {
  auto guard = AcquireKey(key, [deadline](std::timed_mutex& mu) {
    if (deadline != Clock::time_point::max()) return mu.try_lock_until(deadline);
    mu.lock();
    return true;
  });
  if (!guard) {
    return absl::DeadlineExceededError(absl::StrCat("timed out waiting for ", AbslView(what)));
  }
  return std::move(*guard);
}

bool WheelCache::TryLockKey(const std::string& key, KeyGuard* guard) {
  auto got = AcquireKey(key, [](std::timed_mutex& mu) { return mu.try_lock(); });
  if (!got) return false;
  *guard = std::move(*got);
  return true;
}

std::shared_ptr<const void> WheelCache::Lease(const std::string& path) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++leases_[path];
  }
  return std::shared_ptr<const void>(nullptr, [this, path](const void*) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = leases_.find(path);
    if (it != leases_.end() && --it->second == 0) leases_.erase(it);
  });
}

WheelCache::Stats WheelCache::GetStats() {
  std::lock_guard<std::mutex> lock(mu_);
  Stats s;
  s.pages_in_memory = pages_.size();
  s.key_locks = key_locks_.size();
  s.leased_wheels = leases_.size();
  return s;
}

absl::StatusOr<FetchLimits> WheelCache::Limits(int64_t max_body_bytes, Clock::time_point deadline,
                                               std::string_view what, const Egress* egress) const {
  FetchLimits limits;
  limits.max_body_bytes = max_body_bytes;
  limits.timeout = options_.http_timeout;
  limits.connect_timeout = options_.connect_timeout;
  if (deadline != Clock::time_point::max()) {
    auto remaining =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (remaining <= std::chrono::milliseconds::zero()) {
      return absl::DeadlineExceededError(
          absl::StrCat("out of time before fetching ", AbslView(what)));
    }
    limits.timeout = std::min(limits.timeout, remaining);
    limits.connect_timeout = std::min(limits.connect_timeout, remaining);
  }
  limits.allowed_hosts = AllowedHosts();
  if (egress != nullptr) {
    if (egress->route == nullptr) return absl::InternalError("governed fetch without a route");
    limits.proxy = egress->route;
  }
  return limits;
}

void WheelCache::RememberPage(const std::string& name, const Page& page) {
  if (options_.max_pages_in_memory == 0) return;
  // Expired pages are of no use (they are refetched, or read back from disk); then, at the cap,
  // the oldest goes. Linear, over at most max_pages_in_memory entries.
  const int64_t now = Now();
  const int64_t ttl_ms = static_cast<int64_t>(options_.index_ttl.count()) * 1000;
  for (auto it = pages_.begin(); it != pages_.end();) {
    int64_t age = now - it->second.fetched_ms;
    if (it->first != name && (age < 0 || age >= ttl_ms)) {
      it = pages_.erase(it);
    } else {
      ++it;
    }
  }
  if (!pages_.count(name) && pages_.size() >= options_.max_pages_in_memory) {
    auto oldest = std::min_element(pages_.begin(), pages_.end(), [](const auto& a, const auto& b) {
      return a.second.fetched_ms < b.second.fetched_ms;
    });
    pages_.erase(oldest);
  }
  pages_[name] = page;
}

void WheelCache::ForEachCacheFile(
    const std::function<void(const fs::directory_entry&, const std::string&)>& fn) const {
  std::error_code ec;
  for (fs::recursive_directory_iterator it(options_.cache_dir + "/wheels", ec), end;
       !ec && it != end; it.increment(ec)) {
    if (it.depth() >= 3) it.disable_recursion_pending();  // <tag>/<name>/<version>/<file>
    std::error_code fec;
    if (!it->is_regular_file(fec) || fec) continue;
    fn(*it, it->path().filename().string());
  }
}

void WheelCache::SweepPartialDownloads() {
  // A download writes its .part file continuously and ends within http_timeout; one that is
  // much older belongs to a process that died (a crash, a kill -9) and would stay forever.
  const auto max_age = std::max<std::chrono::seconds>(2 * options_.http_timeout,
                                                      std::chrono::hours(1));
  const auto cutoff = fs::file_time_type::clock::now() - max_age;
  int removed = 0;
  ForEachCacheFile([&](const fs::directory_entry& f, const std::string& fn) {
    if (!fn.starts_with('.') || fn.find(".part-") == std::string::npos) return;
    std::error_code fec;
    auto mtime = f.last_write_time(fec);
    if (fec || mtime >= cutoff) return;
    if (fs::remove(f.path(), fec)) ++removed;
  });
  if (removed > 0) {
    LogInfo(absl::StrCat("wheel cache: removed ", removed, " stale partial download(s)"));
  }
}

void WheelCache::EvictOverQuota() {
  if (options_.max_cache_bytes <= 0) return;
  std::lock_guard<std::mutex> evicting(evict_mu_);
  struct Entry {
    std::string path;
    int64_t size;
    fs::file_time_type mtime;
  };
  std::vector<Entry> entries;
  int64_t total = 0;
  ForEachCacheFile([&](const fs::directory_entry& f, const std::string& fn) {
    if (fn.starts_with('.') || !fn.ends_with(".whl")) return;  // partial downloads
    std::error_code fec;
    Entry e{f.path().string(), static_cast<int64_t>(f.file_size(fec)), f.last_write_time(fec)};
    if (fec) return;
    total += e.size;
    entries.push_back(std::move(e));
  });
  if (total <= options_.max_cache_bytes) return;
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.mtime < b.mtime; });
  for (const Entry& e : entries) {
    if (total <= options_.max_cache_bytes) break;
    // Holding the file's key lock: nobody is between finding the file and leasing it.
    KeyGuard guard;
    if (!TryLockKey("file:" + e.path, &guard)) continue;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (leases_.count(e.path)) continue;  // being handed out right now
    }
    std::error_code rec;
    if (fs::remove(e.path, rec)) {
      total -= e.size;
      LogInfo(absl::StrCat("wheel cache over ", options_.max_cache_bytes, " bytes: evicted ",
                           e.path));
    }
  }
  if (total > options_.max_cache_bytes) {
    LogWarn(absl::StrCat("wheel cache holds ", total, " bytes, over its limit of ",
                         options_.max_cache_bytes, ": the rest is in use"));
  }
}

int64_t WheelCache::Now() const { return options_.now_ms ? options_.now_ms() : NowUnixMs(); }

std::string WheelCache::WheelDir(const std::string& name) const {
  return absl::StrCat(options_.cache_dir, "/wheels/", options_.target.PythonTag(), "/", name);
}

std::vector<std::string> WheelCache::AllowedHosts() const {
  std::vector<std::string> hosts = options_.allowed_hosts;
  hosts.push_back(index_host_);
  return hosts;
}

absl::Status WheelCache::CheckHit(const Egress* egress, const std::string& url) {
  if (egress == nullptr) return absl::OkStatus();
  if (!egress->check) return absl::InternalError("governed fetch without a policy check");
  return egress->check(url);
}

absl::StatusOr<Wheel> WheelCache::Fetch(const Requirement& req, Clock::time_point deadline,
                                        const Egress* egress) {
  if (!init_status_.ok()) return init_status_;
  if (!ValidProjectName(req.name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid package name '", req.name, "' (not normalised)"));
  }
  auto spec = ParseSpecifier(req.specifier);
  if (!spec.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("package '", req.name, "': ", spec.status().message()));
  }
  auto page = GetPage(req.name, deadline, egress);
  if (!page.ok()) {
    // The caller's time running out is not the index being unreachable: no fallback then.
    if (IsUnreachable(page.status()) && Clock::now() < deadline) {
      return Offline(req, *spec, page.status(), deadline, egress);
    }
    return page.status();
  }
  auto choice = Choose(req, *spec, page->links);
  if (!choice.ok()) return choice.status();
  auto wheel = Materialize(req, *choice, deadline, egress);
  if (wheel.ok() && !wheel->from_cache) EvictOverQuota();
  return wheel;
}

absl::StatusOr<WheelCache::Page> WheelCache::GetPage(const std::string& name,
                                                     Clock::time_point deadline,
                                                     const Egress* egress) {
  const std::string url = options_.index_url + name + "/";
  const int64_t ttl_ms = static_cast<int64_t>(options_.index_ttl.count()) * 1000;
  auto fresh = [&](const Page& p) {
    int64_t age = Now() - p.fetched_ms;
    return p.url == url && age >= 0 && age < ttl_ms;
  };
  // One request per project at a time: concurrent callers wait and then find it cached.
  auto key_guard = LockKey("page:" + name, deadline,
                           absl::StrCat("another fetch of the index page of package '", name, "'"));
  if (!key_guard.ok()) return key_guard.status();
  std::optional<Page> hit;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pages_.find(name);
    if (it != pages_.end() && fresh(it->second)) hit = it->second;
  }
  if (hit) {
    // A governed environment gets a cached page only if its policy lets it reach the index now.
    if (absl::Status st = CheckHit(egress, url); !st.ok()) return st;
    return *std::move(hit);
  }
  const std::string disk_path = absl::StrCat(options_.cache_dir, "/index/", name, ".json");
  std::string text;
  Page page;
  if (ReadFileToString(disk_path, &text).ok() &&
      PageFromJson(text, &page.fetched_ms, &page.url, &page.links) && fresh(page)) {
    if (absl::Status st = CheckHit(egress, url); !st.ok()) return st;
    std::lock_guard<std::mutex> lock(mu_);
    RememberPage(name, page);
    return page;
  }
  auto downloaded = DownloadPage(name, url, deadline, egress);
  if (!downloaded.ok()) return downloaded.status();
  std::error_code ec;
  fs::create_directories(options_.cache_dir + "/index", ec);
  absl::Status written = ec ? ErrnoStatus("mkdir " + options_.cache_dir + "/index", ec.value())
                            : WriteStringToFile(disk_path, json::serialize(PageToJson(
                                                              downloaded->fetched_ms, url,
                                                              downloaded->links)));
  if (!written.ok()) LogWarn(absl::StrCat("cannot persist index page: ", written.message()));
  std::lock_guard<std::mutex> lock(mu_);
  RememberPage(name, *downloaded);
  return downloaded;
}

absl::StatusOr<WheelCache::Page> WheelCache::DownloadPage(const std::string& name,
                                                          const std::string& url,
                                                          Clock::time_point deadline,
                                                          const Egress* egress) {
  auto limits = Limits(options_.max_page_bytes, deadline,
                       absl::StrCat("the index page of package '", name, "'"), egress);
  if (!limits.ok()) return limits.status();
  limits->accept = kAcceptIndex;
  std::string body;
  auto result = fetcher_->Get(url, *limits, [&](std::string_view chunk) {
    body.append(chunk);
    return absl::OkStatus();
  });
  if (!result.ok()) {
    if (absl::IsNotFound(result.status())) {
      return absl::NotFoundError(
          absl::StrCat("package '", name, "' not found on ", options_.index_url));
    }
    if (absl::IsResourceExhausted(result.status())) {
      // Permanent (until the operator raises the cap): not a reason to retry later.
      return absl::FailedPreconditionError(absl::StrCat(
          "the index page of package '", name, "' on ", options_.index_url,
          " is larger than the limit of ", options_.max_page_bytes, " bytes: ",
          result.status().message()));
    }
    return absl::Status(result.status().code(),
                        absl::StrCat("cannot fetch the index page of package '", name, "' from ",
                                     options_.index_url, ": ", result.status().message()));
  }
  Page page;
  page.fetched_ms = Now();
  page.url = url;
  std::string base = result->final_url.empty() ? url : result->final_url;
  auto links = absl::StrContains(result->content_type, AbslView(kSimpleJsonContentType))
                   ? ParseSimpleIndexJson(body, base)
                   : ParseSimpleIndexHtml(body, base);
  if (!links.ok()) {
    // A page that does not parse is the index's fault (Unavailable: the client did nothing
    // wrong, and a cached wheel may still serve); too many links is a permanent condition.
    absl::StatusCode code = absl::IsFailedPrecondition(links.status())
                                ? absl::StatusCode::kFailedPrecondition
                                : absl::StatusCode::kUnavailable;
    return absl::Status(code, absl::StrCat("bad index page of package '", name, "' from ",
                                           options_.index_url, ": ", links.status().message()));
  }
  page.links = std::move(*links);
  return page;
}

absl::StatusOr<WheelCache::Choice> WheelCache::Choose(const Requirement& req,
                                                      const Specifier& spec,
                                                      const std::vector<IndexLink>& links) {
  const Target& t = options_.target;
  std::map<Version, std::vector<Choice>> usable;  // compatible, not yanked, python admitted
  std::map<Version, std::vector<Choice>> yanked;  // compatible, python admitted, but yanked
  std::map<Version, std::vector<std::string>> all;  // every file of the project, for messages
  bool any_wheel = false, any_sdist = false;
  for (const auto& link : links) {
    auto w = ParseWheelFilename(link.filename);
    if (w.ok()) {
      if (w->name != req.name) continue;
      any_wheel = true;
      all[w->version].push_back(link.filename);
      if (!PythonAdmitted(link.requires_python, t) || WheelScore(*w, t) < 0) continue;
      (link.yanked ? yanked : usable)[w->version].push_back(Choice{link, *w});
      continue;
    }
    std::string sv = SdistVersion(link.filename, req.name);
    if (!sv.empty()) {
      any_sdist = true;
      auto v = ParseVersion(sv);
      if (v.ok()) all[*v].push_back(link.filename);
    }
  }
  const std::string where = options_.index_url;
  if (!any_wheel && any_sdist) {
    return absl::FailedPreconditionError(absl::StrCat(
        "package '", req.name, "': only source distributions exist on ", where,
        "; wheels are required (the sandbox cannot build packages from source)"));
  }
  if (all.empty()) {
    return absl::NotFoundError(
        absl::StrCat("package '", req.name, "' has no files on ", where));
  }
  std::vector<const std::vector<Choice>*> matching = Satisfying(usable, spec);
  if (matching.empty() && PinsOneVersion(spec)) {
    matching = Satisfying(yanked, spec);
    if (!matching.empty()) {
      LogWarn(absl::StrCat("package '", Describe(req), "': only a yanked release matches; using "
                           "it, as the version is pinned (PEP 592)"));
    }
  }
  if (matching.empty()) {
    std::vector<const std::vector<std::string>*> files = Satisfying(all, spec);
    if (!files.empty()) {
      // Versions exist but none has a wheel we can use.
      std::vector<std::string> names;
      for (auto it = files.rbegin(); it != files.rend(); ++it) {
        for (const auto& f : **it) {
          if (names.size() < kMaxListedFiles) names.push_back(f);
        }
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "package '", Describe(req), "' on ", where, " has no usable wheel for ", t.PythonTag(),
          " on manylinux (glibc ", t.glibc_major, ".", t.glibc_minor, ") ", t.arch,
          " (files are yanked, source-only, need another Python or platform): ",
          absl::StrJoin(names, ", ")));
    }
    std::vector<std::string> versions;
    for (auto it = all.rbegin(); it != all.rend() && versions.size() < kMaxListedVersions; ++it) {
      versions.push_back(it->first.ToString());
    }
    return absl::NotFoundError(absl::StrCat("no version of package '", req.name,
                                            "' matches '", req.specifier, "' on ", where,
                                            "; available: ", absl::StrJoin(versions, ", ")));
  }
  // Highest satisfying version (the map is ordered), then the most specific wheel.
  const std::vector<Choice>& best_version = *matching.back();
  const Choice* best = nullptr;
  int best_score = -1;
  for (const auto& c : best_version) {
    int score = WheelScore(c.wheel, t);
    if (score > best_score) {
      best = &c;
      best_score = score;
    }
  }
  return *best;
}

absl::StatusOr<Wheel> WheelCache::Materialize(const Requirement& req, const Choice& choice,
                                              Clock::time_point deadline, const Egress* egress) {
  const std::string dir = absl::StrCat(WheelDir(req.name), "/", choice.wheel.version.ToString());
  const std::string path = dir + "/" + choice.link.filename;
  Wheel w;
  w.name = req.name;
  w.version = choice.wheel.version.ToString();
  w.filename = choice.link.filename;
  w.path = path;

  auto key_guard = LockKey("file:" + path, deadline,
                           absl::StrCat("another download of ", choice.link.filename));
  if (!key_guard.ok()) return key_guard.status();
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) {
    auto sha = Sha256File(path);
    if (sha.ok() && (choice.link.sha256.empty() || *sha == choice.link.sha256)) {
      // A governed environment gets a cached wheel only if its policy lets it reach the host
      // the file would come from, now (the cache was filled by anyone's fetch).
      if (absl::Status st = CheckHit(egress, choice.link.url); !st.ok()) {
        return absl::Status(st.code(),
                            absl::StrCat("package '", req.name, "' file ", choice.link.filename,
                                         " (host cache): ", st.message()));
      }
      w.sha256 = *sha;
      w.size = static_cast<int64_t>(fs::file_size(path, ec));
      w.from_cache = true;
      w.lease = Lease(path);  // under the key lock: eviction cannot slip in between
      Touch(path);
      return w;
    }
    LogWarn(absl::StrCat("cached wheel ", path, " does not match the index sha256; refetching"));
    fs::remove(path, ec);
  }
  fs::create_directories(dir, ec);
  if (ec) return ErrnoStatus("cannot create the wheel cache directory " + dir, ec.value());
  if (auto s = Download(req, choice, path, deadline, egress, &w.sha256, &w.size); !s.ok()) {
    return s;
  }
  w.lease = Lease(path);
  return w;
}

absl::Status WheelCache::Download(const Requirement& req, const Choice& choice,
                                  const std::string& path, Clock::time_point deadline,
                                  const Egress* egress, std::string* sha256, int64_t* size) {
  const IndexLink& link = choice.link;
  const std::string ctx = absl::StrCat("package '", req.name, "' file ", link.filename, " from ",
                                       options_.index_url);
  auto url = ParseUrl(link.url);
  if (!url.ok()) {
    return absl::UnavailableError(
        absl::StrCat(ctx, ": the index links an invalid URL: ", url.status().message()));
  }
  std::vector<std::string> allowed = AllowedHosts();
  if (!HostAllowed(*url, allowed)) {
    return absl::PermissionDeniedError(absl::StrCat(ctx, ": host '", url->HostPort(),
                                                    "' is not allowed (allowed: ",
                                                    absl::StrJoin(allowed, ", "), ")"));
  }
  // SECURITY: an https index vouches for its pages, not for a plain-http download anyone on
  // the path can replace, unless the page pins the file's content by hash.
  if (index_https_ && url->scheme != "https" && link.sha256.empty()) {
    return absl::PermissionDeniedError(absl::StrCat(
        ctx, ": refusing to download ", url->ToString(),
        " over plain http: the index is https and its link carries no sha256 hash"));
  }
  auto limits = Limits(options_.max_wheel_bytes, deadline, ctx, egress);
  if (!limits.ok()) return limits.status();
  const std::string tmp = absl::StrCat(path.substr(0, path.rfind('/') + 1), ".",
                                       link.filename, ".part-", RandomHex(6));
  // SECURITY: O_EXCL on a random name in our own cache dir; never follows a planted symlink.
  UniqueFd fd(open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644));
  if (!fd) return ErrnoStatus("cannot create " + tmp);
  Sha256 sha;
  int64_t written = 0;
  std::string head;
  bool sink_failed = false;
  auto too_large = [&](absl::string_view detail) {
    // Permanent for this wheel (until the operator raises the cap): FailedPrecondition.
    return absl::FailedPreconditionError(absl::StrCat(
        "the wheel is larger than the limit of ", options_.max_wheel_bytes, " bytes", detail));
  };
  auto result = fetcher_->Get(link.url, *limits, [&](std::string_view chunk) -> absl::Status {
    written += static_cast<int64_t>(chunk.size());
    if (written > options_.max_wheel_bytes) {
      sink_failed = true;
      return too_large("");
    }
    if (head.size() < 4) head.append(chunk.substr(0, 4 - head.size()));
    sha.Update(chunk);
    while (!chunk.empty()) {
      ssize_t n = write(fd.get(), chunk.data(), chunk.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        sink_failed = true;
        return ErrnoStatus("write " + tmp);
      }
      chunk.remove_prefix(static_cast<size_t>(n));
    }
    return absl::OkStatus();
  });
  auto fail = [&](absl::Status s) {
    unlink(tmp.c_str());
    return absl::Status(s.code(), absl::StrCat(ctx, ": ", s.message()));
  };
  if (!result.ok()) {
    // The fetcher's own size cap (a Content-Length over the limit) is ResourceExhausted.
    if (!sink_failed && absl::IsResourceExhausted(result.status())) {
      return fail(too_large(absl::StrCat(" (", result.status().message(), ")")));
    }
    return fail(result.status());
  }
  // A corrupt file is the index's fault, not the client's and not ours: Unavailable.
  std::string digest = sha.HexDigest();
  if (!link.sha256.empty() && digest != link.sha256) {
    return fail(absl::UnavailableError(
        absl::StrCat("the index served a corrupt file: sha256 mismatch: the index says ",
                     link.sha256, ", the download is ", digest)));
  }
  if (head != std::string_view("PK\x03\x04", 4)) {
    return fail(absl::UnavailableError(
        "the index served a corrupt file: not a zip file (no PK header)"));
  }
  if (fsync(fd.get()) != 0) return fail(ErrnoStatus("fsync " + tmp));
  fd.reset();
  if (rename(tmp.c_str(), path.c_str()) != 0) return fail(ErrnoStatus("rename to " + path));
  *sha256 = digest;
  *size = written;
  LogInfo(absl::StrCat("cached ", link.filename, " (", written, " bytes) for package '", req.name,
                       "'"));
  return absl::OkStatus();
}

std::vector<Wheel> WheelCache::CachedWheels(const std::string& name) {
  std::vector<Wheel> out;
  if (!ValidProjectName(name)) return out;
  std::error_code ec;
  for (fs::recursive_directory_iterator it(WheelDir(name), ec), end; !ec && it != end;
       it.increment(ec)) {
    if (it.depth() > 1) continue;
    if (!it->is_regular_file(ec)) continue;
    std::string fn = it->path().filename().string();
    if (fn.starts_with('.')) continue;  // partial downloads
    auto w = ParseWheelFilename(fn);
    if (!w.ok() || w->name != name) continue;
    if (it->path().parent_path().filename().string() != w->version.ToString()) continue;
    Wheel wheel;
    wheel.name = name;
    wheel.version = w->version.ToString();
    wheel.filename = fn;
    wheel.path = it->path().string();
    wheel.size = static_cast<int64_t>(it->file_size(ec));
    wheel.from_cache = true;
    out.push_back(std::move(wheel));
  }
  return out;
}

absl::StatusOr<Wheel> WheelCache::Offline(const Requirement& req, const Specifier& spec,
                                          const absl::Status& why, Clock::time_point deadline,
                                          const Egress* egress) {
  std::map<Version, std::vector<std::pair<Wheel, int>>> by_version;
  for (auto& w : CachedWheels(req.name)) {
    auto name = ParseWheelFilename(w.filename);
    int score = name.ok() ? WheelScore(*name, options_.target) : -1;
    if (score < 0) continue;
    by_version[name->version].emplace_back(std::move(w), score);
  }
  auto matching = Satisfying(by_version, spec);
  if (matching.empty()) {
    return absl::Status(why.code(), absl::StrCat(why.message(), "; and no cached wheel of '",
                                                 Describe(req), "' is available"));
  }
  const auto& candidates = *matching.back();
  auto best = std::max_element(candidates.begin(), candidates.end(),
                               [](const auto& a, const auto& b) { return a.second < b.second; });
  Wheel w = best->first;
  // The cache does not record where a file came from (the index, or a file host it links): a
  // governed environment needs its policy to allow the index and every configured file host.
  if (egress != nullptr) {
    std::vector<std::string> origins = {options_.index_url + req.name + "/"};
    const std::string scheme = index_https_ ? "https://" : "http://";
    for (const std::string& host : options_.allowed_hosts) origins.push_back(scheme + host + "/");
    for (const std::string& origin : origins) {
      if (absl::Status st = CheckHit(egress, origin); !st.ok()) {
        return absl::Status(st.code(), absl::StrCat(why.message(),
                                                    "; and the host cache may not be used "
                                                    "instead: ",
                                                    st.message()));
      }
    }
  }
  auto key_guard =
      LockKey("file:" + w.path, deadline, absl::StrCat("another use of ", w.filename));
  if (!key_guard.ok()) return key_guard.status();
  auto sha = Sha256File(w.path);
  if (!sha.ok()) return sha.status();  // e.g. evicted meanwhile
  w.sha256 = *sha;
  w.offline = true;
  w.lease = Lease(w.path);
  Touch(w.path);
  LogWarn(absl::StrCat("package index unreachable (", why.message(), "); using cached ",
                       w.filename));
  return w;
}

}  // namespace esb::packages

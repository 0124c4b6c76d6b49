#include "packages/wheel_cache.h"

#include <gtest/gtest.h>
#include <openssl/sha.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <map>
#include <thread>

#include "common/util.h"
#include "packages/url.h"

namespace esb::packages {
namespace {

namespace fs = std::filesystem;

constexpr char kIndex[] = "https://mirror.example/simple/";

std::string Sha(const std::string& data) {
  unsigned char md[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(data.data()), data.size(), md);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : md) {
    out += kHex[c >> 4];
    out += kHex[c & 15];
  }
  return out;
}

std::string WheelBytes(const std::string& tag) { return std::string("PK\x03\x04", 4) + tag; }

// Serves canned answers per URL and counts requests.
class FakeFetcher : public HttpFetcher {
 public:
  struct Answer {
    int status = 200;
    std::string content_type = "text/html";
    std::string body;
  };

  absl::StatusOr<HttpResult> Get(const std::string& url, const FetchLimits& limits,
                                 const BodySink& sink) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++counts_[url];
      ++total_;
      last_limits_ = limits;
    }
    if (delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));
    if (unreachable_) return absl::UnavailableError("cannot connect to mirror.example: refused");
    Answer a;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = answers_.find(url);
      if (it == answers_.end()) return HttpStatusError(404, url);
      a = it->second;
    }
    if (a.status < 200 || a.status >= 300) return HttpStatusError(a.status, url);
    if (!stream_past_limit_ && static_cast<int64_t>(a.body.size()) > limits.max_body_bytes) {
      return absl::ResourceExhaustedError("response exceeds the limit");
    }
    // Stream in small pieces, like the real fetcher.
    for (size_t i = 0; i < a.body.size(); i += 3) {
      if (auto s = sink(std::string_view(a.body).substr(i, 3)); !s.ok()) return s;
    }
    return HttpResult{a.status, a.content_type, url, static_cast<int64_t>(a.body.size())};
  }

  void Set(const std::string& url, Answer a) {
    std::lock_guard<std::mutex> lock(mu_);
    answers_[url] = std::move(a);
  }
  int Count(const std::string& url) {
    std::lock_guard<std::mutex> lock(mu_);
    return counts_[url];
  }
  int Total() {
    std::lock_guard<std::mutex> lock(mu_);
    return total_;
  }
  FetchLimits LastLimits() {
    std::lock_guard<std::mutex> lock(mu_);
    return last_limits_;
  }
  std::atomic<bool> unreachable_{false};
  int delay_ms_ = 0;
  // Like a server without Content-Length: the body streams until the sink refuses it.
  bool stream_past_limit_ = false;

 private:
  std::mutex mu_;
  std::map<std::string, Answer> answers_;
  std::map<std::string, int> counts_;
  int total_ = 0;
  FetchLimits last_limits_;
};

class WheelCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("esb-pkg-test-" + RandomHex(6));
    fs::create_directories(dir_);
    options_.cache_dir = dir_.string();
    options_.index_url = "https://mirror.example/simple";  // '/' is appended
    options_.allowed_hosts = {"files.example"};
    options_.now_ms = [this] { return now_ms_.load(); };
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A project page linking files; each file: {filename, body, sha ("" = none), extra attrs}.
  struct File {
    std::string filename;
    std::string body;
    bool with_sha = true;
    std::string attrs;
  };
  void Serve(const std::string& project, const std::vector<File>& files) {
    std::string html = "<html><body>\n";
    for (const auto& f : files) {
      std::string href = "../../files/" + f.filename;
      if (f.with_sha) href += "#sha256=" + Sha(f.body);
      html += "<a href=\"" + href + "\" " + f.attrs + ">" + f.filename + "</a><br/>\n";
      fetcher_.Set(FileUrl(f.filename), {200, "application/octet-stream", f.body});
    }
    fetcher_.Set(PageUrl(project), {200, "text/html; charset=utf-8", html + "</body></html>"});
  }
  static std::string PageUrl(const std::string& p) { return std::string(kIndex) + p + "/"; }
  static std::string FileUrl(const std::string& f) {
    return "https://mirror.example/files/" + f;
  }
  absl::StatusOr<Wheel> Fetch(WheelCache& cache, const char* req) {
    auto r = ParseRequirement(req);
    EXPECT_TRUE(r.ok()) << r.status();
    return cache.Fetch(*r);
  }

  fs::path dir_;
  WheelCache::Options options_;
  FakeFetcher fetcher_;
  std::atomic<int64_t> now_ms_{1'700'000'000'000};
};

TEST_F(WheelCacheTest, PicksHighestMatchingVersionAndBestWheel) {
  Serve("foo", {{"foo-1.0-py3-none-any.whl", WheelBytes("1.0")},
                {"foo-1.5-py3-none-any.whl", WheelBytes("1.5 pure")},
                {"foo-1.5-cp311-cp311-manylinux_2_17_x86_64.whl", WheelBytes("1.5 native")},
                {"foo-1.5-cp311-cp311-linux_x86_64.whl", WheelBytes("1.5 linux")},
                {"foo-2.0-py3-none-any.whl", WheelBytes("2.0")},
                {"foo-2.1b1-py3-none-any.whl", WheelBytes("2.1b1")},
                {"foo-1.9-py3-none-any.whl", WheelBytes("1.9"), true, "data-yanked=\"\""},
                {"foo-1.8-py3-none-any.whl", WheelBytes("1.8"), true,
                 "data-requires-python=\"&gt;=3.12\""},
                {"foo-1.6.tar.gz", "sdist"}});
  WheelCache cache(options_, &fetcher_);

  auto w = Fetch(cache, "foo<2");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->version, "1.5");
  EXPECT_EQ(w->filename, "foo-1.5-cp311-cp311-manylinux_2_17_x86_64.whl");
  EXPECT_FALSE(w->from_cache);
  EXPECT_FALSE(w->offline);
  EXPECT_EQ(w->path, dir_.string() + "/wheels/cp311/foo/1.5/" + w->filename);
  EXPECT_EQ(w->sha256, Sha(WheelBytes("1.5 native")));
  EXPECT_EQ(w->size, static_cast<int64_t>(WheelBytes("1.5 native").size()));
  std::string content;
  ASSERT_TRUE(ReadFileToString(w->path, &content).ok());
  EXPECT_EQ(content, WheelBytes("1.5 native"));

  w = Fetch(cache, "foo");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->version, "2.0");  // no prerelease unless asked
  w = Fetch(cache, "foo>=2.1b1");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->version, "2.1b1");
  w = Fetch(cache, "foo>2.0");  // only a prerelease satisfies: pip takes it
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->version, "2.1b1");
  w = Fetch(cache, "foo>=1.5,<1.99");  // 1.9 yanked, 1.8 needs Python 3.12, 1.6 sdist only
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->version, "1.5");
  w = Fetch(cache, "foo>=1.8,<1.99");  // versions exist, but no usable wheel
  EXPECT_TRUE(absl::IsFailedPrecondition(w.status())) << w.status();
  EXPECT_NE(std::string(w.status().message()).find("foo-1.9-py3-none-any.whl"), std::string::npos);
  EXPECT_EQ(fetcher_.Count(PageUrl("foo")), 1);  // page fetched once
}

TEST_F(WheelCacheTest, CacheHitMakesNoRequestsAcrossRestarts) {
  Serve("foo", {{"foo-1.0-py3-none-any.whl", WheelBytes("1.0")}});
  {
    WheelCache cache(options_, &fetcher_);
    auto w = Fetch(cache, "foo==1.0");
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_FALSE(w->from_cache);
    EXPECT_EQ(fetcher_.Total(), 2);
    w = Fetch(cache, "foo==1.0");
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_TRUE(w->from_cache);
    EXPECT_EQ(fetcher_.Total(), 2);
  }
  // A restarted daemon within the TTL reads the page from disk.
  WheelCache restarted(options_, &fetcher_);
  auto w = Fetch(restarted, "foo==1.0");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE(w->from_cache);
  EXPECT_EQ(w->sha256, Sha(WheelBytes("1.0")));
  EXPECT_EQ(fetcher_.Total(), 2);
  EXPECT_TRUE(fs::exists(dir_ / "index" / "foo.json"));
}

TEST_F(WheelCacheTest, TtlExpiryRefetchesPageButNotWheel) {
  Serve("foo", {{"foo-1.0-py3-none-any.whl", WheelBytes("1.0")}});
  WheelCache cache(options_, &fetcher_);
  ASSERT_TRUE(Fetch(cache, "foo").ok());
  now_ms_ += 601'000;
  auto w = Fetch(cache, "foo");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE(w->from_cache);
  EXPECT_EQ(fetcher_.Count(PageUrl("foo")), 2);
  EXPECT_EQ(fetcher_.Count(FileUrl("foo-1.0-py3-none-any.whl")), 1);
  // A new version appeared: the refreshed page sees it after the next expiry.
  Serve("foo", {{"foo-1.0-py3-none-any.whl", WheelBytes("1.0")},
                {"foo-1.1-py3-none-any.whl", WheelBytes("1.1")}});
  w = Fetch(cache, "foo");
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(w->version, "1.0");  // still within the TTL
  now_ms_ += 601'000;
  w = Fetch(cache, "foo");
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(w->version, "1.1");
}

TEST_F(WheelCacheTest, OfflineFallsBackToCachedWheel) {
  Serve("foo", {{"foo-1.0-py3-none-any.whl", WheelBytes("1.0")},
                {"foo-1.2-py3-none-any.whl", WheelBytes("1.2")}});
  WheelCache cache(options_, &fetcher_);
  ASSERT_TRUE(Fetch(cache, "foo==1.0").ok());
  ASSERT_TRUE(Fetch(cache, "foo==1.2").ok());
  now_ms_ += 601'000;
  fetcher_.unreachable_ = true;
  auto w = Fetch(cache, "foo<1.5");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE(w->offline);
  EXPECT_TRUE(w->from_cache);
  EXPECT_EQ(w->version, "1.2");
  EXPECT_EQ(w->sha256, Sha(WheelBytes("1.2")));
  w = Fetch(cache, "foo<1.1");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->version, "1.0");
  w = Fetch(cache, "foo>=2");
  EXPECT_TRUE(absl::IsUnavailable(w.status())) << w.status();
  EXPECT_NE(std::string(w.status().message()).find("no cached wheel"), std::string::npos);
  w = Fetch(cache, "bar");
  EXPECT_TRUE(absl::IsUnavailable(w.status())) << w.status();
  EXPECT_NE(std::string(w.status().message()).find("bar"), std::string::npos);

  auto cached = cache.CachedWheels("foo");
  EXPECT_EQ(cached.size(), 2u);
}

// ---- a governed environment's fetches (WheelCache::Egress)

// An Egress whose route is recognisable and whose check allows the hosts in `allowed` and
// records every URL it was asked about.
struct TestEgress {
  std::vector<std::string> allowed;  // host names the "policy" allows
  std::vector<std::string> asked;    // URLs put to the check, in order
  WheelCache::Egress egress;
  TestEgress() {
    auto route = std::make_shared<ProxyRoute>();
    route->ca_pem = "env CA";
    egress.route = route;
    egress.check = [this](const std::string& url) -> absl::Status {
      asked.push_back(url);
      auto u = ParseUrl(url);
      if (u.ok() && std::find(allowed.begin(), allowed.end(), u->host) != allowed.end())
        return absl::OkStatus();
      return absl::PermissionDeniedError("policy refuses " + (u.ok() ? u->host : url) +
                                         " (rule 'not_allowed')");
    };
  }
};

TEST_F(WheelCacheTest, GovernedFetchesGoThroughTheEnvironmentsRoute) {
  Serve("foo", {{"foo-1.0-py3-none-any.whl", WheelBytes("1.0")}});
  WheelCache cache(options_, &fetcher_);
  TestEgress governed;
  governed.allowed = {"mirror.example"};
  auto req = ParseRequirement("foo");
  auto w = cache.Fetch(*req, WheelCache::Clock::time_point::max(), &governed.egress);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_FALSE(w->from_cache);
  EXPECT_EQ(fetcher_.Total(), 2);
  // Both requests (page and wheel) carried the environment's route: the proxy decides them.
  EXPECT_EQ(fetcher_.LastLimits().proxy, governed.egress.route);
  EXPECT_TRUE(governed.asked.empty()) << "downloads are decided by the proxy, not the check";
  // A non-governed fetch stays direct (the page expired: a request is made).
  now_ms_ += 601'000;
  ASSERT_TRUE(Fetch(cache, "foo").ok());
  ASSERT_EQ(fetcher_.Total(), 3);
  EXPECT_EQ(fetcher_.LastLimits().proxy, nullptr);
}

TEST_F(WheelCacheTest, GovernedCacheHitIsRefusedWhenThePolicyRefusesTheFilesHost) {
  Serve("foo", {{"foo-1.0-py3-none-any.whl", WheelBytes("1.0")}});
  WheelCache cache(options_, &fetcher_);
  ASSERT_TRUE(Fetch(cache, "foo").ok());  // another environment filled the cache
  ASSERT_EQ(fetcher_.Total(), 2);
  auto req = ParseRequirement("foo");
  // The index page is allowed, the file's host is not (policy changed, or never allowed).
  TestEgress governed;
  governed.allowed = {"mirror.example"};
  auto w = cache.Fetch(*req, WheelCache::Clock::time_point::max(), &governed.egress);
  ASSERT_TRUE(w.ok()) << w.status();  // same host for page and file: allowed
  EXPECT_TRUE(w->from_cache);
  EXPECT_EQ(governed.asked,
            (std::vector<std::string>{PageUrl("foo"), FileUrl("foo-1.0-py3-none-any.whl")}));
  // Refusing everything: the cached page is refused before any wheel is looked at.
  TestEgress denied;
  w = cache.Fetch(*req, WheelCache::Clock::time_point::max(), &denied.egress);
  EXPECT_TRUE(absl::IsPermissionDenied(w.status())) << w.status();
  EXPECT_NE(std::string(w.status().message()).find("mirror.example"), std::string::npos);
  EXPECT_EQ(denied.asked, std::vector<std::string>{PageUrl("foo")});
  EXPECT_EQ(fetcher_.Total(), 2) << "a refused hit makes no request either";
}

TEST_F(WheelCacheTest, GovernedWheelHitOnAnotherHostIsChecked) {
  // The page (index host) is allowed, the wheel lives on files.example, which is not.
  std::string html = "<a href=\"https://files.example/f/foo-1.0-py3-none-any.whl#sha256=" +
                     Sha(WheelBytes("1.0")) + "\">foo-1.0-py3-none-any.whl</a>";
  fetcher_.Set(PageUrl("foo"), {200, "text/html", html});
  fetcher_.Set("https://files.example/f/foo-1.0-py3-none-any.whl",
               {200, "application/octet-stream", WheelBytes("1.0")});
  WheelCache cache(options_, &fetcher_);
  ASSERT_TRUE(Fetch(cache, "foo").ok());
  TestEgress governed;
  governed.allowed = {"mirror.example"};
  auto req = ParseRequirement("foo");
  auto w = cache.Fetch(*req, WheelCache::Clock::time_point::max(), &governed.egress);
  EXPECT_TRUE(absl::IsPermissionDenied(w.status())) << w.status();
  EXPECT_NE(std::string(w.status().message()).find("files.example"), std::string::npos)
      << w.status();
  EXPECT_NE(std::string(w.status().message()).find("host cache"), std::string::npos);
  EXPECT_EQ(fetcher_.Total(), 2);
  governed.allowed.push_back("files.example");
  w = cache.Fetch(*req, WheelCache::Clock::time_point::max(), &governed.egress);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE(w->from_cache);
}

TEST_F(WheelCacheTest, GovernedPageFromDiskAndOfflineFallbackAreChecked) {
  Serve("foo", {{"foo-1.0-py3-none-any.whl", WheelBytes("1.0")}});
  {
    WheelCache first(options_, &fetcher_);
    ASSERT_TRUE(Fetch(first, "foo").ok());
  }
  auto req = ParseRequirement("foo");
  // A restarted daemon: the fresh page comes from disk; still checked.
  WheelCache cache(options_, &fetcher_);
  TestEgress denied;
  auto w = cache.Fetch(*req, WheelCache::Clock::time_point::max(), &denied.egress);
  EXPECT_TRUE(absl::IsPermissionDenied(w.status())) << w.status();
  EXPECT_EQ(denied.asked, std::vector<std::string>{PageUrl("foo")});
  // The index unreachable (e.g. the proxy down): the offline fallback is checked too.
  now_ms_ += 601'000;
  fetcher_.unreachable_ = true;
  TestEgress denied2;
  w = cache.Fetch(*req, WheelCache::Clock::time_point::max(), &denied2.egress);
  EXPECT_TRUE(absl::IsPermissionDenied(w.status())) << w.status();
  EXPECT_NE(std::string(w.status().message()).find("host cache may not be used"), std::string::npos)
      << w.status();
  // The fallback does not know which host a cached file came from: the index and every
  // configured file host (files.example here) must be allowed.
  TestEgress index_only;
  index_only.allowed = {"mirror.example"};
  w = cache.Fetch(*req, WheelCache::Clock::time_point::max(), &index_only.egress);
  EXPECT_TRUE(absl::IsPermissionDenied(w.status())) << w.status();
  EXPECT_NE(std::string(w.status().message()).find("files.example"), std::string::npos)
      << w.status();
  TestEgress allowed;
  allowed.allowed = {"mirror.example", "files.example"};
  w = cache.Fetch(*req, WheelCache::Clock::time_point::max(), &allowed.egress);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE(w->offline);
  EXPECT_EQ(allowed.asked.back(), "https://files.example/");
}

// A corrupt file is the index's fault: Unavailable (HTTP 503), not DataLoss (500).
TEST_F(WheelCacheTest, ShaMismatchIsUnavailableAndLeavesNothing) {
  Serve("foo", {{"foo-1.0-py3-none-any.whl", WheelBytes("1.0")}});
  fetcher_.Set(FileUrl("foo-1.0-py3-none-any.whl"), {200, "", WheelBytes("tampered")});
  WheelCache cache(options_, &fetcher_);
  auto w = Fetch(cache, "foo");
  EXPECT_TRUE(absl::IsUnavailable(w.status())) << w.status();
  EXPECT_NE(std::string(w.status().message()).find("sha256"), std::string::npos);
  EXPECT_NE(std::string(w.status().message()).find("the index served a corrupt file"),
            std::string::npos);
  EXPECT_NE(std::string(w.status().message()).find("foo"), std::string::npos);
  fs::path vdir = dir_ / "wheels" / "cp311" / "foo" / "1.0";
  EXPECT_TRUE(fs::is_empty(vdir)) << "partial file left behind";
}

TEST_F(WheelCacheTest, CorruptCachedFileIsRefetched) {
  Serve("foo", {{"foo-1.0-py3-none-any.whl", WheelBytes("1.0")}});
  WheelCache cache(options_, &fetcher_);
  auto w = Fetch(cache, "foo");
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(WriteStringToFile(w->path, "garbage").ok());
  w = Fetch(cache, "foo");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_FALSE(w->from_cache);
  EXPECT_EQ(fetcher_.Count(FileUrl("foo-1.0-py3-none-any.whl")), 2);
}

TEST_F(WheelCacheTest, NotAZipIsRejected) {
  Serve("foo", {{"foo-1.0-py3-none-any.whl", "<html>login page</html>", false}});
  WheelCache cache(options_, &fetcher_);
  auto w = Fetch(cache, "foo");
  EXPECT_TRUE(absl::IsUnavailable(w.status())) << w.status();
  EXPECT_NE(std::string(w.status().message()).find("not a zip file"), std::string::npos);
}

// Over max_wheel_bytes is permanent for that wheel: FailedPrecondition (400), not
// ResourceExhausted (429, "try again later"). Both ways the cap is hit.
TEST_F(WheelCacheTest, OversizeWheelIsRefused) {
  options_.max_wheel_bytes = 10;
  Serve("foo", {{"foo-1.0-py3-none-any.whl", WheelBytes(std::string(100, 'x'))}});
  for (bool streamed : {false, true}) {
    SCOPED_TRACE(streamed ? "cut off while streaming" : "refused by the fetcher");
    fetcher_.stream_past_limit_ = streamed;
    WheelCache cache(options_, &fetcher_);
    auto w = Fetch(cache, "foo");
    EXPECT_TRUE(absl::IsFailedPrecondition(w.status())) << w.status();
    EXPECT_NE(std::string(w.status().message()).find("larger than the limit of 10 bytes"),
              std::string::npos)
        << w.status();
    EXPECT_TRUE(fs::is_empty(dir_ / "wheels" / "cp311" / "foo" / "1.0"));
  }
}

TEST_F(WheelCacheTest, OversizePageIsFailedPrecondition) {
  options_.max_page_bytes = 10;
  Serve("foo", {{"foo-1.0-py3-none-any.whl", WheelBytes("1.0")}});
  WheelCache cache(options_, &fetcher_);
  auto w = Fetch(cache, "foo");
  EXPECT_TRUE(absl::IsFailedPrecondition(w.status())) << w.status();
  EXPECT_NE(std::string(w.status().message()).find("larger than the limit of 10 bytes"),
            std::string::npos)
      << w.status();
}

// A page that does not parse, or a link that is not a URL, is the index's fault: Unavailable.
TEST_F(WheelCacheTest, BrokenIndexPagesAreUnavailable) {
  fetcher_.Set(PageUrl("foo"), {200, "application/vnd.pypi.simple.v1+json", "{\"files\": 7"});
  WheelCache cache(options_, &fetcher_);
  auto w = Fetch(cache, "foo");
  EXPECT_TRUE(absl::IsUnavailable(w.status())) << w.status();
  EXPECT_NE(std::string(w.status().message()).find("bad index page of package 'foo'"),
            std::string::npos)
      << w.status();

  // A page of the on-disk cache whose link is not a URL (as a broken index could leave it).
  fs::create_directories(dir_ / "index");
  ASSERT_TRUE(WriteStringToFile(
                  (dir_ / "index" / "bar.json").string(),
                  "{\"fetched_ms\": " + std::to_string(now_ms_.load()) + ", \"url\": \"" +
                      PageUrl("bar") +
                      "\", \"files\": [{\"filename\": \"bar-1.0-py3-none-any.whl\", "
                      "\"url\": \"not a url\"}]}")
                  .ok());
  w = Fetch(cache, "bar");
  EXPECT_TRUE(absl::IsUnavailable(w.status())) << w.status();
  EXPECT_NE(std::string(w.status().message()).find("invalid URL"), std::string::npos)
      << w.status();

  std::string many;
  for (size_t i = 0; i <= kMaxLinksPerPage; ++i) many += "<a href=\"f" + std::to_string(i) + "\">";
  fetcher_.Set(PageUrl("baz"), {200, "text/html", many});
  w = Fetch(cache, "baz");
  EXPECT_TRUE(absl::IsFailedPrecondition(w.status())) << w.status();
}

TEST_F(WheelCacheTest, OnlySdistsIsFailedPrecondition) {
  Serve("foo", {{"foo-1.0.tar.gz", "sdist"}, {"foo-1.1.zip", "sdist"}});
  WheelCache cache(options_, &fetcher_);
  auto w = Fetch(cache, "foo");
  EXPECT_TRUE(absl::IsFailedPrecondition(w.status())) << w.status();
  std::string msg(w.status().message());
  EXPECT_NE(msg.find("only source distributions"), std::string::npos) << msg;
  EXPECT_NE(msg.find(kIndex), std::string::npos) << msg;
}

TEST_F(WheelCacheTest, NoCompatibleWheelIsFailedPrecondition) {
  Serve("foo", {{"foo-1.0-cp312-cp312-manylinux2014_x86_64.whl", WheelBytes("x")},
                {"foo-1.0-cp311-cp311-win_amd64.whl", WheelBytes("x")}});
  WheelCache cache(options_, &fetcher_);
  auto w = Fetch(cache, "foo");
  EXPECT_TRUE(absl::IsFailedPrecondition(w.status())) << w.status();
  EXPECT_NE(std::string(w.status().message()).find("cp311"), std::string::npos);
}

TEST_F(WheelCacheTest, MissingProjectIsNotFound) {
  WheelCache cache(options_, &fetcher_);
  auto w = Fetch(cache, "nope");
  EXPECT_TRUE(absl::IsNotFound(w.status())) << w.status();
  EXPECT_EQ(std::string(w.status().message()),
            "package 'nope' not found on https://mirror.example/simple/");
}

TEST_F(WheelCacheTest, NoMatchingVersionListsAvailable) {
  std::vector<File> files;
  for (int i = 0; i < 12; ++i) {
    files.push_back({"foo-1." + std::to_string(i) + "-py3-none-any.whl", WheelBytes("x")});
  }
  Serve("foo", files);
  WheelCache cache(options_, &fetcher_);
  auto w = Fetch(cache, "foo>=5");
  EXPECT_TRUE(absl::IsNotFound(w.status())) << w.status();
  std::string msg(w.status().message());
  EXPECT_NE(msg.find("1.11, 1.10, 1.9"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("1.1,"), std::string::npos) << "lists at most 10: " << msg;
  EXPECT_NE(msg.find(">=5"), std::string::npos) << msg;
}

TEST_F(WheelCacheTest, ServerErrorWithoutCacheIsUnavailable) {
  fetcher_.Set(PageUrl("foo"), {503, "text/plain", "busy"});
  WheelCache cache(options_, &fetcher_);
  auto w = Fetch(cache, "foo");
  EXPECT_TRUE(absl::IsUnavailable(w.status())) << w.status();
}

// Finding: allowed hosts ignored ports. A file on another port of an allowed host (or of the
// index's host) is another service; refused unless that host:port is allowed.
TEST_F(WheelCacheTest, AllowedHostsMatchPortsExactly) {
  auto page = [](const std::string& url) {
    return FakeFetcher::Answer{200, "text/html", "<a href=\"" + url + "\">x</a>"};
  };
  const std::string body = WheelBytes("ports");
  for (const char* url : {"https://files.example:8443/foo-1.0-py3-none-any.whl",
                          "https://mirror.example:8443/foo-1.0-py3-none-any.whl"}) {
    SCOPED_TRACE(url);
    fetcher_.Set(PageUrl("foo"), page(url));
    fetcher_.Set(url, {200, "", body});
    WheelCache cache(options_, &fetcher_);
    auto w = Fetch(cache, "foo");
    EXPECT_TRUE(absl::IsPermissionDenied(w.status())) << w.status();
    EXPECT_NE(std::string(w.status().message()).find(":8443' is not allowed"), std::string::npos)
        << w.status();
    EXPECT_EQ(fetcher_.Count(url), 0);
  }
  options_.allowed_hosts = {"files.example:8443"};
  fetcher_.Set(PageUrl("foo"), page("https://files.example:8443/foo-1.0-py3-none-any.whl"));
  WheelCache cache(options_, &fetcher_);
  auto w = Fetch(cache, "foo");
  ASSERT_TRUE(w.ok()) << w.status();
  // What the fetcher is told to allow (redirects included) is exact too.
  const auto& hosts = fetcher_.LastLimits().allowed_hosts;
  EXPECT_NE(std::find(hosts.begin(), hosts.end(), "mirror.example:443"), hosts.end());
}

// An https index's link to a plain-http file is only followed when the link pins its sha256.
TEST_F(WheelCacheTest, PlainHttpFileFromHttpsIndexNeedsAHash) {
  const std::string body = WheelBytes("plain");
  const std::string url = "http://files.example/foo-1.0-py3-none-any.whl";
  fetcher_.Set(url, {200, "", body});
  fetcher_.Set(PageUrl("foo"), {200, "text/html", "<a href=\"" + url + "\">x</a>"});
  {
    WheelCache cache(options_, &fetcher_);
    auto w = Fetch(cache, "foo");
    EXPECT_TRUE(absl::IsPermissionDenied(w.status())) << w.status();
    EXPECT_NE(std::string(w.status().message()).find("plain http"), std::string::npos)
        << w.status();
    EXPECT_EQ(fetcher_.Count(url), 0);
  }
  fetcher_.Set(PageUrl("foo"),
               {200, "text/html", "<a href=\"" + url + "#sha256=" + Sha(body) + "\">x</a>"});
  now_ms_ += 601'000;  // past the TTL of the page cached on disk above
  WheelCache cache(options_, &fetcher_);
  auto w = Fetch(cache, "foo");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->sha256, Sha(body));
}

// PEP 592: yanked releases are skipped, unless the requirement pins exactly that version and
// nothing that is not yanked matches.
TEST_F(WheelCacheTest, YankedReleaseOnlyWhenPinned) {
  Serve("foo", {{"foo-0.9-py3-none-any.whl", WheelBytes("0.9")},
                {"foo-1.0-py3-none-any.whl", WheelBytes("1.0"), true, "data-yanked=\"broken\""},
                {"foo-1.1-py3-none-any.whl", WheelBytes("1.1"), true, "data-yanked"}});
  WheelCache cache(options_, &fetcher_);
  auto version = [&](const char* req) {
    auto w = Fetch(cache, req);
    return w.ok() ? w->version : std::string(w.status().message());
  };
  EXPECT_EQ(version("foo"), "0.9");
  EXPECT_EQ(version("foo==1.0"), "1.0");
  EXPECT_EQ(version("foo===1.1"), "1.1");
  EXPECT_EQ(version("foo==1.1,>=1"), "1.1");
  EXPECT_EQ(version("foo<=1.0"), "0.9");  // not pinned: the un-yanked release
  EXPECT_NE(version("foo>=1.0").find("yanked"), std::string::npos);
  EXPECT_NE(version("foo==1.*").find("yanked"), std::string::npos);  // a wildcard pins nothing
}

// Finding: fetches took http_timeout each, whatever the install's remaining time.
TEST_F(WheelCacheTest, DeadlineBoundsEveryRequest) {
  options_.http_timeout = std::chrono::seconds(120);
  Serve("foo", {{"foo-1.0-py3-none-any.whl", WheelBytes("1.0")}});
  WheelCache cache(options_, &fetcher_);
  auto r = ParseRequirement("foo");
  auto w = cache.Fetch(*r, WheelCache::Clock::now() + std::chrono::seconds(5));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_LE(fetcher_.LastLimits().timeout, std::chrono::seconds(5));
  EXPECT_GT(fetcher_.LastLimits().timeout, std::chrono::seconds(3));
  EXPECT_LE(fetcher_.LastLimits().connect_timeout, std::chrono::seconds(5));
  // Without a deadline: http_timeout.
  now_ms_ += 601'000;
  ASSERT_TRUE(cache.Fetch(*r).ok());
  EXPECT_EQ(fetcher_.LastLimits().timeout, std::chrono::seconds(120));

  // Out of time: no request, and no quiet fallback to the cached wheel.
  now_ms_ += 601'000;
  int before = fetcher_.Total();
  w = cache.Fetch(*r, WheelCache::Clock::now() - std::chrono::milliseconds(1));
  EXPECT_TRUE(absl::IsDeadlineExceeded(w.status())) << w.status();
  EXPECT_EQ(fetcher_.Total(), before);
}

TEST_F(WheelCacheTest, WaitingForAConcurrentFetchHonoursTheDeadline) {
  Serve("foo", {{"foo-1.0-py3-none-any.whl", WheelBytes("1.0")}});
  fetcher_.delay_ms_ = 1500;
  WheelCache cache(options_, &fetcher_);
  std::thread slow([&] { (void)Fetch(cache, "foo"); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // `slow` holds the page lock
  auto r = ParseRequirement("foo");
  auto start = WheelCache::Clock::now();
  auto w = cache.Fetch(*r, start + std::chrono::milliseconds(200));
  auto took = WheelCache::Clock::now() - start;
  slow.join();
  EXPECT_TRUE(absl::IsDeadlineExceeded(w.status())) << w.status();
  EXPECT_NE(std::string(w.status().message()).find("waiting for another fetch"), std::string::npos)
      << w.status();
  EXPECT_LT(took, std::chrono::milliseconds(1000));
  EXPECT_EQ(cache.GetStats().key_locks, 0u);
}

// Finding: one key lock per distinct name stayed forever, and so did every page.
TEST_F(WheelCacheTest, KeyLocksAndPagesDoNotAccumulate) {
  options_.max_pages_in_memory = 3;
  std::vector<File> files;
  for (int i = 0; i < 10; ++i) {
    std::string name = "p" + std::to_string(i);
    Serve(name, {{name + "-1.0-py3-none-any.whl", WheelBytes(name)}});
  }
  WheelCache cache(options_, &fetcher_);
  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(Fetch(cache, ("p" + std::to_string(i)).c_str()).ok());
    EXPECT_TRUE(Fetch(cache, ("missing" + std::to_string(i)).c_str()).status().code() ==
                absl::StatusCode::kNotFound);
  }
  WheelCache::Stats stats = cache.GetStats();
  EXPECT_EQ(stats.key_locks, 0u);
  EXPECT_EQ(stats.pages_in_memory, 3u);
  EXPECT_EQ(stats.leased_wheels, 0u);  // the Wheels above are gone
  // Expired pages are dropped when another is added.
  now_ms_ += 601'000;
  ASSERT_TRUE(Fetch(cache, "p0").ok());
  EXPECT_EQ(cache.GetStats().pages_in_memory, 1u);
}

// Finding: .part files of a crashed download stayed forever.
TEST_F(WheelCacheTest, StalePartialDownloadsAreSweptAtOpen) {
  fs::path vdir = dir_ / "wheels" / "cp311" / "foo" / "1.0";
  fs::create_directories(vdir);
  auto make = [&](const std::string& name, std::chrono::hours age) {
    ASSERT_TRUE(WriteStringToFile((vdir / name).string(), "partial").ok());
    fs::last_write_time(vdir / name, fs::file_time_type::clock::now() - age);
  };
  make(".foo-1.0-py3-none-any.whl.part-0123456789ab", std::chrono::hours(3));
  make(".foo-1.0-py3-none-any.whl.part-ba9876543210", std::chrono::hours(0));  // in progress
  make("foo-1.0-py3-none-any.whl", std::chrono::hours(3));
  make(".other", std::chrono::hours(3));
  WheelCache cache(options_, &fetcher_);
  EXPECT_FALSE(fs::exists(vdir / ".foo-1.0-py3-none-any.whl.part-0123456789ab"));
  EXPECT_TRUE(fs::exists(vdir / ".foo-1.0-py3-none-any.whl.part-ba9876543210"));
  EXPECT_TRUE(fs::exists(vdir / "foo-1.0-py3-none-any.whl"));
  EXPECT_TRUE(fs::exists(vdir / ".other"));
}

// max_cache_bytes: least recently used wheels go first, never one that is leased.
TEST_F(WheelCacheTest, QuotaEvictsLeastRecentlyUsedButNotLeased) {
  const std::string pad(1000, 'z');
  for (const char* n : {"a", "b", "c", "d"}) {
    Serve(n, {{std::string(n) + "-1.0-py3-none-any.whl", WheelBytes(n + pad)}});
  }
  const int64_t wheel_size = static_cast<int64_t>(WheelBytes("a" + pad).size());
  options_.max_cache_bytes = 2 * wheel_size + 10;  // room for two
  WheelCache cache(options_, &fetcher_);
  auto path = [&](const std::string& n) {
    return dir_ / "wheels" / "cp311" / n / "1.0" / (n + "-1.0-py3-none-any.whl");
  };
  auto age = [&](const std::string& n, int hours) {
    fs::last_write_time(path(n), fs::file_time_type::clock::now() - std::chrono::hours(hours));
  };
  ASSERT_TRUE(Fetch(cache, "a").ok());
  ASSERT_TRUE(Fetch(cache, "b").ok());
  age("a", 3);
  age("b", 2);
  // Using `a` again makes it the most recent: `b` is evicted for `c`.
  auto a = Fetch(cache, "a");
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(a->from_cache);
  a = absl::InternalError("released");
  ASSERT_TRUE(Fetch(cache, "c").ok());
  EXPECT_TRUE(fs::exists(path("a")));
  EXPECT_FALSE(fs::exists(path("b")));
  EXPECT_TRUE(fs::exists(path("c")));

  // A leased wheel stays even when it is the oldest; the next oldest goes instead.
  age("a", 5);
  age("c", 4);
  auto held = Fetch(cache, "a");  // touches `a`; age it again while holding it
  ASSERT_TRUE(held.ok());
  age("a", 5);
  EXPECT_EQ(cache.GetStats().leased_wheels, 1u);
  ASSERT_TRUE(Fetch(cache, "d").ok());
  EXPECT_TRUE(fs::exists(path("a")));
  EXPECT_FALSE(fs::exists(path("c")));
  EXPECT_TRUE(fs::exists(path("d")));
  // Released, it is evicted by the next download.
  held = absl::InternalError("released");
  EXPECT_EQ(cache.GetStats().leased_wheels, 0u);
  ASSERT_TRUE(Fetch(cache, "b").ok());  // downloaded again
  EXPECT_FALSE(fs::exists(path("a")));
  EXPECT_TRUE(fs::exists(path("b")));
  EXPECT_TRUE(fs::exists(path("d")));
  // A wheel evicted from disk is simply downloaded again.
  auto again = Fetch(cache, "a");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->from_cache);
}

TEST_F(WheelCacheTest, FileOnForeignHostIsRefused) {
  fetcher_.Set(PageUrl("foo"),
               {200, "text/html", "<a href=\"https://evil.example/foo-1.0-py3-none-any.whl\">x</a>"});
  WheelCache cache(options_, &fetcher_);
  auto w = Fetch(cache, "foo");
  EXPECT_TRUE(absl::IsPermissionDenied(w.status())) << w.status();
  EXPECT_NE(std::string(w.status().message()).find("evil.example"), std::string::npos);
  EXPECT_EQ(fetcher_.Count("https://evil.example/foo-1.0-py3-none-any.whl"), 0);
}

TEST_F(WheelCacheTest, AllowedFileHostAndJsonIndex) {
  std::string body = WheelBytes("json");
  fetcher_.Set(PageUrl("foo"),
               {200, "application/vnd.pypi.simple.v1+json",
                R"({"meta":{"api-version":"1.0"},"name":"foo","files":[{"filename":"foo-3.0-py3-none-any.whl",
                "url":"https://files.example/p/foo-3.0-py3-none-any.whl","hashes":{"sha256":")" +
                    Sha(body) + R"("}}]})"});
  fetcher_.Set("https://files.example/p/foo-3.0-py3-none-any.whl", {200, "", body});
  WheelCache cache(options_, &fetcher_);
  auto w = Fetch(cache, "Foo[extra]>=3");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->version, "3.0");
  EXPECT_EQ(w->sha256, Sha(body));
}

TEST_F(WheelCacheTest, ConcurrentFetchesDownloadOnce) {
  Serve("foo", {{"foo-1.0-py3-none-any.whl", WheelBytes(std::string(1000, 'z'))}});
  fetcher_.delay_ms_ = 50;
  WheelCache cache(options_, &fetcher_);
  std::vector<std::thread> threads;
  std::atomic<int> ok{0}, downloaded{0};
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&] {
      auto r = ParseRequirement("foo");
      auto w = cache.Fetch(*r);
      if (w.ok()) {
        ++ok;
        if (!w->from_cache) ++downloaded;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 4);
  EXPECT_EQ(downloaded.load(), 1);
  EXPECT_EQ(fetcher_.Count(FileUrl("foo-1.0-py3-none-any.whl")), 1);
  EXPECT_EQ(fetcher_.Count(PageUrl("foo")), 1);
}

TEST_F(WheelCacheTest, BadOptionsAreReported) {
  options_.index_url = "ftp://mirror.example/simple";
  WheelCache cache(options_, &fetcher_);
  auto w = Fetch(cache, "foo");
  EXPECT_TRUE(absl::IsInvalidArgument(w.status())) << w.status();
  EXPECT_EQ(fetcher_.Total(), 0);
}

}  // namespace
}  // namespace esb::packages

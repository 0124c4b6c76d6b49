#include "packages/wheel_cache.h"

#include <gtest/gtest.h>
#include <openssl/sha.h>

#include <atomic>
#include <filesystem>
#include <map>
#include <thread>

#include "common/util.h"

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
    if (static_cast<int64_t>(a.body.size()) > limits.max_body_bytes) {
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
  std::atomic<bool> unreachable_{false};
  int delay_ms_ = 0;

 private:
  std::mutex mu_;
  std::map<std::string, Answer> answers_;
  std::map<std::string, int> counts_;
  int total_ = 0;
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

TEST_F(WheelCacheTest, ShaMismatchIsDataLossAndLeavesNothing) {
  Serve("foo", {{"foo-1.0-py3-none-any.whl", WheelBytes("1.0")}});
  fetcher_.Set(FileUrl("foo-1.0-py3-none-any.whl"), {200, "", WheelBytes("tampered")});
  WheelCache cache(options_, &fetcher_);
  auto w = Fetch(cache, "foo");
  EXPECT_TRUE(absl::IsDataLoss(w.status())) << w.status();
  EXPECT_NE(std::string(w.status().message()).find("sha256"), std::string::npos);
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
  EXPECT_TRUE(absl::IsDataLoss(w.status())) << w.status();
}

TEST_F(WheelCacheTest, OversizeWheelIsRefused) {
  options_.max_wheel_bytes = 10;
  Serve("foo", {{"foo-1.0-py3-none-any.whl", WheelBytes(std::string(100, 'x'))}});
  WheelCache cache(options_, &fetcher_);
  auto w = Fetch(cache, "foo");
  EXPECT_TRUE(absl::IsResourceExhausted(w.status())) << w.status();
  EXPECT_TRUE(fs::is_empty(dir_ / "wheels" / "cp311" / "foo" / "1.0"));
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

#include "packages/simple_index.h"

#include <gtest/gtest.h>

#include <chrono>

#include "packages/url.h"

namespace esb::packages {
namespace {

constexpr char kPage[] = "https://mirror.example/simple/foo/";
const std::string kSha(64, 'a');

TEST(ResolveUrlTest, Rfc3986) {
  auto r = [](const char* ref) {
    auto u = ResolveUrl("https://h.example/simple/foo/", ref);
    return u.ok() ? *u : std::string("ERR:") + std::string(u.status().message());
  };
  EXPECT_EQ(r("foo-1.0.whl"), "https://h.example/simple/foo/foo-1.0.whl");
  EXPECT_EQ(r("../../packages/ab/foo-1.0.whl#sha256=00"), "https://h.example/packages/ab/foo-1.0.whl");
  EXPECT_EQ(r("/packages/foo.whl"), "https://h.example/packages/foo.whl");
  EXPECT_EQ(r("//files.example/p/foo.whl"), "https://files.example/p/foo.whl");
  EXPECT_EQ(r("http://other.example:8080/x/./y/../foo.whl"), "http://other.example:8080/x/foo.whl");
  EXPECT_EQ(r("?q=1"), "https://h.example/simple/foo/?q=1");
  EXPECT_EQ(r("../../../../../etc/passwd"), "https://h.example/etc/passwd");
  EXPECT_EQ(r("HTTPS://H.Example:443/a"), "https://h.example/a");
  EXPECT_TRUE(r("ftp://x/y").starts_with("ERR:"));
  EXPECT_TRUE(r("https://user@h.example/y").starts_with("ERR:"));
}

TEST(ParseUrlTest, Parts) {
  auto u = ParseUrl("http://[::1]:8080/a?b#c");
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(u->host, "::1");
  EXPECT_EQ(u->port, "8080");
  EXPECT_EQ(u->target, "/a?b");
  EXPECT_EQ(u->HostPort(), "[::1]:8080");
  EXPECT_FALSE(ParseUrl("http://h:99999/").ok());
  EXPECT_FALSE(ParseUrl("/relative").ok());
}

TEST(HtmlEntitiesTest, Decodes) {
  EXPECT_EQ(DecodeHtmlEntities("&gt;=3.8&#44;&lt;4&amp;&quot;&#39;&#x41;&apos;&bogus;"),
            ">=3.8,<4&\"'A'&bogus;");
  EXPECT_EQ(DecodeHtmlEntities("a & b"), "a & b");
}

TEST(SimpleIndexHtmlTest, ParsesLinks) {
  std::string html = R"(<!DOCTYPE html><html><head><title>Links for foo</title></head><body>
<h1>Links for foo</h1>
<a href="foo-1.0-py3-none-any.whl#sha256=)" + std::string(64, 'A') + R"(">foo-1.0-py3-none-any.whl</a><br/>
<A HREF='../../packages/foo-1.1.tar.gz' data-requires-python="&gt;=3.8">foo-1.1.tar.gz</A>
<a data-yanked="" href="https://files.example/foo-0.9-py3-none-any.whl#md5=abc">x</a>
<a data-yanked data-requires-python='&gt;=3.7,&lt;4' href=/abs/foo-2.0-py3-none-any.whl>foo</a>
<abbr>not a link</abbr><a name="anchor">no href</a>
<a href="foo%2B-3.0-py3-none-any.whl?x=1&amp;y=2" title="a > b">t</a>
</body></html>)";
  auto links = ParseSimpleIndexHtml(html, kPage);
  ASSERT_TRUE(links.ok()) << links.status();
  ASSERT_EQ(links->size(), 5u);
  const auto& l = *links;
  EXPECT_EQ(l[0].filename, "foo-1.0-py3-none-any.whl");
  EXPECT_EQ(l[0].url, "https://mirror.example/simple/foo/foo-1.0-py3-none-any.whl");
  EXPECT_EQ(l[0].sha256, kSha);
  EXPECT_FALSE(l[0].yanked);
  EXPECT_EQ(l[0].requires_python, "");
  EXPECT_EQ(l[1].url, "https://mirror.example/packages/foo-1.1.tar.gz");
  EXPECT_EQ(l[1].requires_python, ">=3.8");
  EXPECT_EQ(l[2].url, "https://files.example/foo-0.9-py3-none-any.whl");
  EXPECT_TRUE(l[2].yanked);
  EXPECT_EQ(l[2].sha256, "");  // md5 fragments are ignored
  EXPECT_TRUE(l[3].yanked);
  EXPECT_EQ(l[3].url, "https://mirror.example/abs/foo-2.0-py3-none-any.whl");
  EXPECT_EQ(l[3].requires_python, ">=3.7,<4");
  EXPECT_EQ(l[4].filename, "foo+-3.0-py3-none-any.whl");
  EXPECT_EQ(l[4].url, "https://mirror.example/simple/foo/foo%2B-3.0-py3-none-any.whl?x=1&y=2");
}

TEST(SimpleIndexHtmlTest, ToleratesJunk) {
  auto links = ParseSimpleIndexHtml("<a href=\"x.whl\"", kPage);  // unterminated tag
  ASSERT_TRUE(links.ok());
  EXPECT_TRUE(links->empty());
  links = ParseSimpleIndexHtml("<a href=\"ftp://x/y.whl\">y</a><a href=\"ok.whl\">", kPage);
  ASSERT_TRUE(links.ok());
  ASSERT_EQ(links->size(), 1u);
  EXPECT_EQ((*links)[0].filename, "ok.whl");
  EXPECT_FALSE(ParseSimpleIndexHtml("", "not a url").ok());
}

TEST(SimpleIndexJsonTest, ParsesFiles) {
  std::string json = R"({"meta":{"api-version":"1.1"},"name":"foo","files":[
    {"filename":"foo-1.0-py3-none-any.whl","url":"../../packages/foo-1.0-py3-none-any.whl",
     "hashes":{"sha256":")" + std::string(64, 'B') + R"("},"requires-python":">=3.8"},
    {"filename":"foo-0.9-py3-none-any.whl","url":"https://files.example/foo-0.9-py3-none-any.whl#sha256=00",
     "hashes":{},"yanked":"broken"},
    {"filename":"foo-0.8-py3-none-any.whl","url":"foo-0.8-py3-none-any.whl","hashes":{},"yanked":false},
    {"filename":"nourl.whl"}, 7]})";
  auto links = ParseSimpleIndexJson(json, kPage);
  ASSERT_TRUE(links.ok()) << links.status();
  ASSERT_EQ(links->size(), 3u);
  EXPECT_EQ((*links)[0].url, "https://mirror.example/packages/foo-1.0-py3-none-any.whl");
  EXPECT_EQ((*links)[0].sha256, std::string(64, 'b'));
  EXPECT_EQ((*links)[0].requires_python, ">=3.8");
  EXPECT_TRUE((*links)[1].yanked);
  EXPECT_EQ((*links)[1].url, "https://files.example/foo-0.9-py3-none-any.whl");
  EXPECT_FALSE((*links)[2].yanked);
  EXPECT_FALSE(ParseSimpleIndexJson("{not json", kPage).ok());
  EXPECT_FALSE(ParseSimpleIndexJson("{\"name\":\"foo\"}", kPage).ok());
}

// Finding: a page of unclosed "<a>" tags made every tag search (and copy and decode) the rest
// of the page for "</a": 400 kB took 117 s. Index pages are untrusted input; all of these must
// be linear.
TEST(SimpleIndexHtmlTest, PathologicalPagesAreFast) {
  using Clock = std::chrono::steady_clock;
  auto timed = [](const std::string& html, size_t* links) {
    auto start = Clock::now();
    auto r = ParseSimpleIndexHtml(html, kPage);
    EXPECT_TRUE(r.ok()) << r.status();
    *links = r.ok() ? r->size() : 0;
    return Clock::now() - start;
  };
  std::string page;
  size_t n = 0;
  for (int i = 0; i < 400'000 / 3; ++i) page += "<a>";
  EXPECT_LT(timed(page, &n), std::chrono::seconds(2));
  EXPECT_EQ(n, 0u);
  // Anchors with hrefs and never a "</a", each followed by a long text.
  page.clear();
  for (int i = 0; i < 5'000; ++i) {
    page += "<a href=\"f-" + std::to_string(i) + ".whl\">" + std::string(200, 't');
  }
  EXPECT_LT(timed(page, &n), std::chrono::seconds(2));
  EXPECT_EQ(n, 5'000u);
  // An attribute of a megabyte of '&' (each used to search the rest for ';').
  page = "<a href=\"x.whl\" title=\"" + std::string(1 << 20, '&') + "\">x</a>";
  EXPECT_LT(timed(page, &n), std::chrono::seconds(2));
  EXPECT_EQ(n, 1u);
  // The link text is still found when it is there, and an unfinished one is ignored.
  auto links = ParseSimpleIndexHtml(
      "<a href=\"/\">foo-1.0-py3-none-any.whl</a><a href=\"/x/\">" + std::string(10'000, 'y'),
      kPage);
  ASSERT_TRUE(links.ok());
  ASSERT_EQ(links->size(), 2u);
  EXPECT_EQ((*links)[0].filename, "foo-1.0-py3-none-any.whl");
  EXPECT_EQ((*links)[1].filename, "");
}

TEST(SimpleIndexHtmlTest, LinkCountIsCapped) {
  std::string page;
  for (size_t i = 0; i <= kMaxLinksPerPage; ++i) page += "<a href=\"f" + std::to_string(i) + "\">";
  auto r = ParseSimpleIndexHtml(page, kPage);
  EXPECT_TRUE(absl::IsFailedPrecondition(r.status())) << r.status();
  EXPECT_NE(std::string(r.status().message()).find("more than 50000 files"), std::string::npos);
  // Exactly at the cap is fine.
  page.resize(page.rfind("<a"));
  r = ParseSimpleIndexHtml(page, kPage);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->size(), kMaxLinksPerPage);

  std::string json = R"({"files":[)";
  for (size_t i = 0; i <= kMaxLinksPerPage; ++i) {
    json += std::string(i ? "," : "") + R"({"filename":"f","url":"f)" + std::to_string(i) + "\"}";
  }
  json += "]}";
  r = ParseSimpleIndexJson(json, kPage);
  EXPECT_TRUE(absl::IsFailedPrecondition(r.status())) << r.status();
}

TEST(HtmlEntitiesTest, LongRunsOfAmpersands) {
  EXPECT_EQ(DecodeHtmlEntities("&&amp;&" + std::string(20, 'x') + ";"),
            "&&&" + std::string(20, 'x') + ";");
  EXPECT_EQ(DecodeHtmlEntities("&#x10FFFF;&#1114111;"), "\xF4\x8F\xBF\xBF\xF4\x8F\xBF\xBF");
}

// Finding: an allowed host matched any port (and the wheel cache's own check too).
TEST(HostAllowedTest, HostAndPortMustMatch) {
  auto allowed = [](const char* url, std::vector<std::string> hosts) {
    auto u = ParseUrl(url);
    EXPECT_TRUE(u.ok()) << url;
    return u.ok() && HostAllowed(*u, hosts);
  };
  EXPECT_TRUE(allowed("https://files.example/x", {"files.example"}));
  EXPECT_TRUE(allowed("http://files.example/x", {"files.example"}));
  EXPECT_TRUE(allowed("https://Files.Example:443/x", {"FILES.example"}));
  EXPECT_FALSE(allowed("https://files.example:8443/x", {"files.example"}));
  EXPECT_FALSE(allowed("http://files.example:443/x", {"files.example"}));
  EXPECT_TRUE(allowed("https://files.example:8443/x", {"files.example:8443"}));
  EXPECT_FALSE(allowed("https://files.example/x", {"files.example:8443"}));
  EXPECT_TRUE(allowed("https://files.example/x", {"files.example:443"}));
  EXPECT_TRUE(allowed("https://files.example/x", {"files.example:0443"}));
  EXPECT_FALSE(allowed("https://evil.example/x", {"files.example", "mirror.example:443"}));
  EXPECT_FALSE(allowed("https://files.example.evil/x", {"files.example"}));
  // IPv6, with and without brackets.
  EXPECT_TRUE(allowed("http://[::1]:8080/x", {"[::1]:8080"}));
  EXPECT_FALSE(allowed("http://[::1]:8080/x", {"[::1]", "::1"}));
  EXPECT_TRUE(allowed("http://[::1]/x", {"::1"}));
  EXPECT_TRUE(allowed("http://[::1]/x", {"[::1]"}));
  // Malformed entries match nothing.
  EXPECT_FALSE(allowed("http://files.example/x", {"files.example:", "files.example:http",
                                                  ":80", "[::1", "files.example:99999"}));
}

}  // namespace
}  // namespace esb::packages

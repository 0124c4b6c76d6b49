// The egress fixtures on their own, host-side (no esbd, no proxy): the real clients the
// end-to-end tests run in a sandbox (git, pip, Python's http.client) work against the local
// upstream with the test root trusted, and fail without it.
#include <gtest/gtest.h>

#include "common/shell_quote.h"
#include "integration/daemon.h"
#include "integration/egress/upstream.h"

namespace esb::testing {
namespace {
namespace json = boost::json;

class EgressFixturesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why = up_.Start();
    ASSERT_EQ(why, "");
  }
  std::string Url(const std::string& path) const {
    return "https://127.0.0.1:" + std::to_string(up_.port()) + path;
  }
  EgressUpstream up_;
};

TEST_F(EgressFixturesTest, GitClonesOverHttpsWithTheTestRootTrusted) {
  ASSERT_EQ(up_.AddGitRepo("demo", {{"README.md", "demo repo\n"}, {"src/app.py", "print(1)\n"}}),
            "");
  const std::string dest = up_.dir() + "/clone";
  ShellResult r =
      RunShell("git clone -q " + Url("/demo.git") + " " + ShellQuote(dest) + " && cat " +
                   ShellQuote(dest) + "/README.md " + ShellQuote(dest) + "/src/app.py",
               {"GIT_SSL_CAINFO=" + up_.root_ca()});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output, "demo repo\nprint(1)\n");
  bool saw_upload_pack = false;
  for (const json::object& row : up_.Requests())
    if (row.at("path").as_string() == "/demo.git/git-upload-pack" && row.at("tls").as_bool())
      saw_upload_pack = true;
  EXPECT_TRUE(saw_upload_pack) << up_.Received();
}

TEST_F(EgressFixturesTest, GitCloneFailsWithoutTheTestRoot) {
  ASSERT_EQ(up_.AddGitRepo("demo", {{"README.md", "x\n"}}), "");
  ShellResult r = RunShell("git clone -q " + Url("/demo.git") + " " + up_.dir() + "/clone",
                           {"GIT_SSL_CAINFO=/etc/ssl/certs/ca-certificates.crt"});
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("certificate"), std::string::npos) << r.output;
}

TEST_F(EgressFixturesTest, PipInstallsTheIndexWheelOverHttpsWithTheTestRootTrusted) {
  const std::string target = up_.dir() + "/site";
  ShellResult r = RunShell(
      "python3 -m pip install -q --disable-pip-version-check --no-cache-dir --retries 0 "
      "--index-url " +
          Url("/simple/") + " --cert " + up_.root_ca() + " --target " + target +
          " esbtestpkg && PYTHONPATH=" + target +
          " python3 -c 'import esbtestpkg; print(esbtestpkg.hello())'",
      {}, 120);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("hello from esbtestpkg 1.0 with dep 1.1\n"), std::string::npos)
      << r.output;
}

TEST_F(EgressFixturesTest, EchoRecordsEveryByteOfAChunkedHttpsPostAndItsSni) {
  // The marker is split across two chunks: the record holds the raw chunked stream, the
  // summary the decoded length.
  const std::string script =
      "import http.client, json, ssl, sys\n"
      "ctx = ssl.create_default_context(cafile=sys.argv[2])\n"
      "c = http.client.HTTPSConnection('echo.test', int(sys.argv[1]), context=ctx)\n"
      "c.sock = ctx.wrap_socket(__import__('socket').create_connection(('127.0.0.1', "
      "int(sys.argv[1]))), server_hostname='echo.test')\n"
      "c.request('POST', '/upload?x=1', body=iter([b'PLANTED-', b'MARKER-42']),\n"
      "          headers={'Host': 'echo.test'}, encode_chunked=True)\n"
      "r = c.getresponse()\n"
      "print(r.status, json.loads(r.read())['body_len'])\n";
  ShellResult r = RunShell("python3 -c " + ShellQuote(script) + " " + std::to_string(up_.port()) +
                           " " + up_.root_ca());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output, "200 17\n");
  const std::string received = up_.Received();
  EXPECT_NE(received.find("POST /upload?x=1 HTTP/1.1\r\n"), std::string::npos) << received;
  EXPECT_NE(received.find("PLANTED-"), std::string::npos) << received;
  EXPECT_NE(received.find("MARKER-42"), std::string::npos) << received;
  std::vector<json::object> rows = up_.Requests();
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].at("sni").as_string(), "echo.test");
  EXPECT_EQ(rows[0].at("body_len").as_int64(), 17);
}

TEST_F(EgressFixturesTest, PlainHttpOnTheSamePortAndRedirectsOnDemand) {
  HttpResult r = Http(up_.port(), "GET", "/redirect?to=https://evil.test/stolen&code=307");
  EXPECT_EQ(r.status, 307) << r.body;
  EXPECT_EQ(r.headers["location"], "https://evil.test/stolen");
  HttpResult echo = Http(up_.port(), "POST", "/anything", "{\"a\":1}");
  EXPECT_EQ(echo.status, 200) << echo.body;
  EXPECT_EQ(echo.str("method"), "POST");
  EXPECT_EQ(echo.num("body_len"), 7);
  EXPECT_FALSE(echo.flag("tls"));
}

}  // namespace
}  // namespace esb::testing

#include "exe/flags.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <map>

#include "common/util.h"

namespace esb {
namespace {

struct Env {
  std::map<std::string, std::string> vars;
  std::function<const char*(const char*)> fn() const {
    return [this](const char* n) -> const char* {
      auto it = vars.find(n);
      return it == vars.end() ? nullptr : it->second.c_str();
    };
  }
};

absl::StatusOr<CommandLine> Parse(std::vector<std::string> args, DaemonConfig* c,
                                  const Env& env = {}) {
  return ParseCommandLine(args, env.fn(), c);
}

TEST(FlagsTest, McpConformanceFixturesIsOffUnlessGiven) {
  DaemonConfig c;
  auto cl = Parse({"--listen", "127.0.0.1:1"}, &c);
  ASSERT_TRUE(cl.ok());
  EXPECT_FALSE(cl->mcp_conformance_fixtures);
  cl = Parse({"--mcp-conformance-fixtures"}, &c);
  ASSERT_TRUE(cl.ok());
  EXPECT_TRUE(cl->mcp_conformance_fixtures);
  // After a command's first word it is the command's own argument.
  cl = Parse({"mcp-stdio", "--mcp-conformance-fixtures"}, &c);
  ASSERT_TRUE(cl.ok());
  EXPECT_FALSE(cl->mcp_conformance_fixtures);
  EXPECT_EQ(cl->command, (std::vector<std::string>{"mcp-stdio", "--mcp-conformance-fixtures"}));
}

TEST(FlagsTest, FlagsInBothSpellingsFillTheConfig) {
  DaemonConfig c;
  auto cl = Parse({"--listen", "0.0.0.0:9", "--state-dir=/s", "--image", "default=/r",
                   "--image=py=/p", "--pool-size", "3", "--default-ttl=60", "--runtime", "runc",
                   "--image-cache", "/cache", "--python-wasm", "/w", "--log-level", "debug"},
                  &c);
  ASSERT_TRUE(cl.ok()) << cl.status();
  EXPECT_EQ(c.listen, "0.0.0.0:9");
  EXPECT_EQ(c.state_dir, "/s");
  EXPECT_EQ(c.images.at("default"), "/r");
  EXPECT_EQ(c.images.at("py"), "/p");
  EXPECT_EQ(c.pool_size, 3);
  EXPECT_EQ(c.default_ttl_s, 60);
  EXPECT_EQ(c.container_runtime, "runc");
  EXPECT_EQ(c.image_cache, "/cache");
  EXPECT_EQ(c.python_wasm, "/w");
  EXPECT_TRUE(cl->command.empty());
  EXPECT_FALSE(cl->help);
}

TEST(FlagsTest, FlagsWinOverEnvironmentWhichWinsOverTheFile) {
  char tmpl[] = "/tmp/esb-flags-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  std::string file = std::string(tmpl) + "/esbd.json";
  ASSERT_TRUE(
      WriteStringToFile(file, R"({"listen": "127.0.0.1:1", "state_dir": "/f", "pool_size": 5})")
          .ok());
  Env env;
  env.vars = {{"ESBD_CONFIG", file},
              {"ESBD_STATE_DIR", "/e"},
              {"ESBD_POOL_SIZE", "6"},
              {"ESB_CACHE_DIR", "/env-cache"}};
  DaemonConfig c;
  auto cl = Parse({"--pool-size", "7"}, &c, env);
  ASSERT_TRUE(cl.ok()) << cl.status();
  EXPECT_EQ(cl->config_path, file);
  EXPECT_EQ(c.listen, "127.0.0.1:1");  // file
  EXPECT_EQ(c.state_dir, "/e");        // environment over file
  EXPECT_EQ(c.pool_size, 7);           // flag over environment
  EXPECT_EQ(c.image_cache, "/env-cache");
  // --config names the file even after other flags, and wins over ESBD_CONFIG.
  DaemonConfig d;
  auto missing = Parse({"--pool-size", "1", "--config", std::string(tmpl) + "/none.json"}, &d, env);
  EXPECT_FALSE(missing.ok());
  std::remove(file.c_str());
  rmdir(tmpl);
}

TEST(FlagsTest, CommandKeepsItsOwnArgumentsAndDaemonFlagsAnywhere) {
  DaemonConfig c;
  auto cl = Parse({"--state-dir", "/s", "keys", "add", "--tenant", "acme", "--name", "ci"}, &c);
  ASSERT_TRUE(cl.ok()) << cl.status();
  EXPECT_EQ(cl->command,
            (std::vector<std::string>{"keys", "add", "--tenant", "acme", "--name", "ci"}));
  DaemonConfig d;
  auto after = Parse({"cleanup", "--state-dir", "/later"}, &d);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->command, std::vector<std::string>{"cleanup"});
  EXPECT_EQ(d.state_dir, "/later");
}

TEST(FlagsTest, MistakesAreErrorsNamingTheFlag) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  } cases[] = {
      {{"--bogus"}, "unknown flag '--bogus'"},
      {{"--pool-size", "-1"}, "--pool-size needs a non-negative number"},
      {{"--pool-size", "many"}, "--pool-size needs a non-negative number"},
      {{"--pool-size", "99999999999"}, "--pool-size needs a non-negative number"},
      {{"--image", "=/r"}, "--image needs NAME=ROOTFS_DIR"},
      {{"--image", "nodir"}, "--image needs NAME=ROOTFS_DIR"},
      {{"--listen"}, "--listen needs a value"},
      {{"--log-level", "loud"}, "log level 'loud'"},
  };
  for (const Case& k : cases) {
    DaemonConfig c;
    auto cl = Parse(k.args, &c);
    ASSERT_FALSE(cl.ok()) << k.args[0];
    EXPECT_NE(std::string(cl.status().message()).find(k.message), std::string::npos) << cl.status();
  }
}

TEST(FlagsTest, EgressResolveIsRepeatableAndUpstreamCaIsSet) {
  DaemonConfig c;
  auto cl = Parse({"--egress-resolve", "weather.test=127.0.0.1:18080",
                   "--egress-resolve=Git.Test=[::1]:8443", "--egress-upstream-ca", "/ca.pem"},
                  &c);
  ASSERT_TRUE(cl.ok()) << cl.status();
  EXPECT_EQ(c.egress.resolve.size(), 2u);
  EXPECT_EQ(c.egress.resolve.at("weather.test"), "127.0.0.1:18080");
  EXPECT_EQ(c.egress.resolve.at("git.test"), "[::1]:8443");
  EXPECT_EQ(c.egress.upstream_ca, "/ca.pem");
  EXPECT_NE(std::string(kEsbdUsage).find("--egress-resolve NAME=HOST:PORT"), std::string::npos);

  struct Case {
    std::string arg;
    std::string message;
  } bad[] = {
      {"weather.test", "--egress-resolve needs NAME=HOST:PORT"},
      {"=127.0.0.1:1", "--egress-resolve needs NAME=HOST:PORT"},
      {"weather.test=127.0.0.1", "must be HOST:PORT"},
      {"weather.test=127.0.0.1:0", "must be HOST:PORT"},
      {"weather.test=127.0.0.1:99999", "must be HOST:PORT"},
      {"*.weather.test=127.0.0.1:1", "must be a host name"},
      {"weather.test:443=127.0.0.1:1", "must be a host name"},
  };
  for (const Case& k : bad) {
    DaemonConfig d;
    auto r = Parse({"--egress-resolve", k.arg}, &d);
    ASSERT_FALSE(r.ok()) << k.arg;
    EXPECT_NE(std::string(r.status().message()).find(k.message), std::string::npos)
        << k.arg << ": " << r.status();
  }
}

TEST(FlagsTest, HelpAndVersion) {
  DaemonConfig c;
  auto h = Parse({"-h"}, &c);
  ASSERT_TRUE(h.ok());
  EXPECT_TRUE(h->help);
  auto v = Parse({"--version"}, &c);
  ASSERT_TRUE(v.ok());
  EXPECT_TRUE(v->version);
  EXPECT_NE(std::string(kEsbdUsage).find("--image-cache"), std::string::npos);
}

}  // namespace
}  // namespace esb

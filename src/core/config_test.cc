#include "core/config.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <map>

#include "common/util.h"

namespace esb {
namespace {

std::string TempFile(const std::string& content) {
  std::string path = "/tmp/esb_config_test_" + RandomHex(6) + ".json";
  EXPECT_TRUE(WriteStringToFile(path, content).ok());
  return path;
}

TEST(ConfigTest, LoadsKnownKeys) {
  DaemonConfig c;
  std::string path = TempFile(R"({"listen": "0.0.0.0:9000", "pool_size": 4,
      "images": {"default": "/img"}, "defaults": {"memory_mb": 256},
      "state_key_file": "/etc/esbd/state.key",
      "keys": [{"key": "esb_0123456789abcdef", "tenant": "acme", "name": "ci"}]})");
  ASSERT_TRUE(LoadConfigFile(path, &c).ok());
  EXPECT_EQ(c.listen, "0.0.0.0:9000");
  EXPECT_EQ(c.state_key_file, "/etc/esbd/state.key");
  EXPECT_EQ(c.pool_size, 4);
  EXPECT_EQ(c.images["default"], "/img");
  EXPECT_EQ(c.defaults.memory_mb, 256);
  ASSERT_EQ(c.keys.size(), 1u);
  EXPECT_EQ(c.keys[0].tenant, "acme");
  std::remove(path.c_str());
}

TEST(ConfigTest, LoadsPackagesAndArtifacts) {
  DaemonConfig c;
  std::string path = TempFile(R"({"packages": {"index_url": "http://127.0.0.1:3141/simple/",
      "allowed_hosts": ["files.example.org"], "index_ttl_seconds": 60, "max_wheel_mb": 10, "max_cache_mb": 500,
      "timeout_seconds": 30, "cache_dir": "/var/cache/wheels", "ca_file": "/etc/corp-ca.pem"},
      "artifacts": {"ttl_seconds": 120, "max_artifact_mb": 5, "max_tenant_mb": 50},
      "audit": {"retention_days": 7, "rate_per_second": 5, "query_timeout_ms": 250,
                "egress_rate_per_second": 50, "egress_burst": 500, "egress_stored_mb": 64}})");
  ASSERT_TRUE(LoadConfigFile(path, &c).ok());
  EXPECT_EQ(c.packages.index_url, "http://127.0.0.1:3141/simple/");
  ASSERT_EQ(c.packages.allowed_hosts.size(), 1u);
  EXPECT_EQ(c.packages.allowed_hosts[0], "files.example.org");
  EXPECT_EQ(c.packages.index_ttl_s, 60);
  EXPECT_EQ(c.packages.max_wheel_mb, 10);
  EXPECT_EQ(c.packages.max_cache_mb, 500);
  EXPECT_EQ(c.packages.timeout_s, 30);
  EXPECT_EQ(c.packages.cache_dir, "/var/cache/wheels");
  EXPECT_EQ(c.packages.ca_file, "/etc/corp-ca.pem");
  EXPECT_EQ(c.artifacts.ttl_s, 120);
  EXPECT_EQ(c.artifacts.max_artifact_mb, 5);
  EXPECT_EQ(c.artifacts.max_tenant_mb, 50);
  EXPECT_EQ(c.audit.retention_days, 7);
  EXPECT_EQ(c.audit.rate_per_second, 5);
  EXPECT_EQ(c.audit.query_timeout_ms, 250);
  EXPECT_EQ(c.audit.egress_rate_per_second, 50);
  EXPECT_EQ(c.audit.egress_burst, 500);
  EXPECT_EQ(c.audit.egress_stored_mb, 64);
  std::remove(path.c_str());
}

TEST(ConfigTest, StepStoreSizesAreSettableAndValidated) {
  DaemonConfig d;
  EXPECT_EQ(d.steps.store_mb, 8192);
  EXPECT_EQ(d.steps.max_tenant_mb, 0);
  DaemonConfig c;
  std::string path =
      TempFile(R"({"steps": {"store_mb": 2048, "max_tenant_mb": 256, "max_blob_mb": 64,
                             "sweep_interval_seconds": 1}})");
  ASSERT_TRUE(LoadConfigFile(path, &c).ok());
  EXPECT_EQ(c.steps.store_mb, 2048);
  EXPECT_EQ(c.steps.max_tenant_mb, 256);
  EXPECT_EQ(c.steps.max_blob_mb, 64);
  EXPECT_EQ(c.steps.sweep_interval_s, 1);
  std::remove(path.c_str());
  for (const char* bad : {R"({"steps": {"store_mb": 0}})", R"({"steps": {"max_tenant_mb": -1}})",
                          R"({"steps": {"store_mb": 100, "max_tenant_mb": 200}})",
                          R"({"steps": {"max_blob_mb": 0}})", R"({"steps": {"stor_mb": 1}})",
                          R"({"steps": {"sweep_interval_seconds": 0}})", R"({"steps": 5})"}) {
    DaemonConfig b;
    std::string p = TempFile(bad);
    absl::Status st = LoadConfigFile(p, &b);
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << bad;
    EXPECT_NE(st.message().find("steps"), std::string_view::npos) << st;
    std::remove(p.c_str());
  }
}

TEST(ConfigTest, HostedMcpLimitsAreSettableAndValidated) {
  DaemonConfig d;
  EXPECT_EQ(d.mcp.max_servers_per_environment, 4);
  EXPECT_EQ(d.mcp.call_timeout_s, 60);
  DaemonConfig c;
  std::string path = TempFile(
      R"({"mcp": {"max_servers_per_environment": 2, "max_message_bytes": 65536,
                  "call_timeout_seconds": 5, "max_lines_per_second": 100, "max_restarts": 0}})");
  ASSERT_TRUE(LoadConfigFile(path, &c).ok());
  EXPECT_EQ(c.mcp.max_servers_per_environment, 2);
  EXPECT_EQ(c.mcp.max_message_bytes, 65536);
  EXPECT_EQ(c.mcp.call_timeout_s, 5);
  EXPECT_EQ(c.mcp.max_lines_per_second, 100);
  EXPECT_EQ(c.mcp.max_restarts, 0);
  EXPECT_EQ(c.mcp.max_servers, 64);  // untouched keys keep their defaults
  std::remove(path.c_str());
  for (const char* bad :
       {R"({"mcp": {"max_servers_per_environment": 33}})", R"({"mcp": {"max_message_bytes": 10}})",
        R"({"mcp": {"call_timeout_seconds": 0}})", R"({"mcp": {"max_servrs": 1}})",
        R"({"mcp": {"max_restarts": "3"}})", R"({"mcp": 5})"}) {
    DaemonConfig b;
    std::string p = TempFile(bad);
    absl::Status st = LoadConfigFile(p, &b);
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << bad;
    EXPECT_NE(st.message().find("mcp"), std::string_view::npos) << st;
    std::remove(p.c_str());
  }
}

TEST(ConfigTest, McpLimitsAndOrigins) {
  DaemonConfig c;
  EXPECT_EQ(c.mcp.max_sessions, 1024);
  std::string path = TempFile(
      R"({"mcp": {"max_sessions": 10, "max_sessions_per_tenant": 2, "session_idle_seconds": 60,
                  "allowed_origins": ["https://app.example"]}})");
  ASSERT_TRUE(LoadConfigFile(path, &c).ok());
  EXPECT_EQ(c.mcp.max_sessions, 10);
  EXPECT_EQ(c.mcp.max_sessions_per_tenant, 2);
  EXPECT_EQ(c.mcp.session_idle_s, 60);
  EXPECT_EQ(c.mcp.allowed_origins, std::vector<std::string>{"https://app.example"});
  std::remove(path.c_str());
  for (const char* bad :
       {R"({"mcp": {"max_sessions": 0}})", R"({"mcp": {"max_sessions_per_tenant": 2000}})",
        R"({"mcp": {"session_idle_seconds": 0}})", R"({"mcp": {"allowed_origins": "x"}})",
        R"({"mcp": {"allowed_origins": [""]}})", R"({"mcp": {"max_session": 1}})",
        R"({"mcp": 1})"}) {
    DaemonConfig b;
    std::string p = TempFile(bad);
    absl::Status st = LoadConfigFile(p, &b);
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << bad;
    EXPECT_NE(st.message().find("mcp"), std::string_view::npos) << st;
    std::remove(p.c_str());
  }
}

TEST(ConfigTest, RejectsUnknownKeysWrongTypesAndWeakKeys) {
  DaemonConfig c;
  for (const char* bad :
       {R"({"listne": "x"})", R"({"pool_size": "two"})", R"([1,2])",
        R"({"keys": [{"key": "short", "tenant": "a"}]})", R"({"defaults": {"memroy_mb": 1}})",
        "{not json", R"({"packages": {"index": "http://x/"}})",
        R"({"packages": {"index_url": "ftp://x/"}})", R"({"packages": {"allowed_hosts": "x"}})",
        R"({"packages": {"max_cache_mb": -1}})", R"({"packages": {"max_wheel_mb": 0}})",
        R"({"artifacts": {"ttl_seconds": -1}})", R"({"audit": {"retention_days": 0}})",
        R"({"audit": {"rate_per_second": 0}})", R"({"audit": {"egress_rate_per_second": 0}})",
        R"({"audit": {"egress_burst": -5}})", R"({"audit": {"query_timeout_ms": 0}})",
        R"({"audit": {"retention": 3}})"}) {
    std::string path = TempFile(bad);
    absl::Status st = LoadConfigFile(path, &c);
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << bad << " → " << st;
    std::remove(path.c_str());
  }
  EXPECT_TRUE(absl::IsNotFound(LoadConfigFile("/nonexistent/esbd.json", &c)));
}

TEST(ConfigTest, DefaultPidsAboveMaxPidsIsRefusedAtLoad) {
  for (const char* bad : {R"({"max_pids": 100, "defaults": {"pids": 101}})",
                          R"({"defaults": {"pids": 5000}, "max_pids": 4096})",
                          R"({"defaults": {"pids": 8192}})"}) {  // above the default 4096
    DaemonConfig c;
    std::string path = TempFile(bad);
    absl::Status st = LoadConfigFile(path, &c);
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << bad << " → " << st;
    EXPECT_NE(st.message().find("defaults.pids"), std::string::npos) << st;
    EXPECT_NE(st.message().find("max_pids"), std::string::npos) << st;
    std::remove(path.c_str());
  }
  DaemonConfig c;
  std::string path = TempFile(R"({"max_pids": 100, "defaults": {"pids": 100}})");
  EXPECT_TRUE(LoadConfigFile(path, &c).ok());
  EXPECT_EQ(c.defaults.pids, 100);
  std::remove(path.c_str());
}

TEST(ConfigTest, HttpThreadsAndConnectionCapsAreSettableAndValidated) {
  DaemonConfig defaults;
  EXPECT_EQ(defaults.io_threads, 2);
  EXPECT_EQ(defaults.max_streams, 0);
  EXPECT_EQ(defaults.max_open_connections_per_peer, 0);
  EXPECT_EQ(defaults.audit.write_behind_ms, 50);
  DaemonConfig c;
  std::string path = TempFile(
      R"({"max_connections": 64, "io_threads": 4, "max_streams": 32,
          "max_open_connections_per_peer": 20000, "audit": {"write_behind_ms": 0}})");
  ASSERT_TRUE(LoadConfigFile(path, &c).ok());
  EXPECT_EQ(c.io_threads, 4);
  EXPECT_EQ(c.max_streams, 32);
  EXPECT_EQ(c.max_open_connections_per_peer, 20000);
  EXPECT_EQ(c.audit.write_behind_ms, 0);
  std::remove(path.c_str());
  for (const char* bad : {R"({"io_threads": 0})", R"({"io_threads": 65})",
                          R"({"io_threads": "2"})", R"({"max_streams": -1})",
                          R"({"max_connections": 8, "max_streams": 9})",
                          R"({"max_open_connections_per_peer": -1})",
                          R"({"max_open_connections_per_peer": 1048577})",
                          R"({"audit": {"write_behind_ms": -1}})",
                          R"({"audit": {"write_behind_ms": 1001}})"}) {
    DaemonConfig d;
    path = TempFile(bad);
    absl::Status st = LoadConfigFile(path, &d);
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << bad << " → " << st;
    std::remove(path.c_str());
  }
}

TEST(ConfigTest, HttpBudgetsAndPerTenantSharesAreSettableAndValidated) {
  DaemonConfig c;
  std::string path = TempFile(
      R"({"max_connections": 64, "max_buffered_body_bytes": 67108864,
          "max_buffered_header_bytes": 8388608, "max_requests_per_tenant": 16,
          "max_buffered_body_bytes_per_tenant": 33554432})");
  ASSERT_TRUE(LoadConfigFile(path, &c).ok());
  EXPECT_EQ(c.max_buffered_body_bytes, 64ll << 20);
  EXPECT_EQ(c.max_buffered_header_bytes, 8ll << 20);
  EXPECT_EQ(c.max_requests_per_tenant, 16);
  EXPECT_EQ(c.max_buffered_body_bytes_per_tenant, 32ll << 20);
  std::remove(path.c_str());
  for (const char* bad : {R"({"max_connections": 0})",
                          R"({"max_buffered_body_bytes": 1048576})",  // < max_json_body_bytes
                          R"({"max_buffered_header_bytes": 65536})",
                          R"({"max_requests_per_tenant": -1})",
                          R"({"max_connections": 8, "max_requests_per_tenant": 9})",
                          R"({"max_buffered_body_bytes_per_tenant": 1048576})",
                          R"({"max_buffered_body_bytes_per_tenant": 268435456})"}) {
    DaemonConfig d;
    path = TempFile(bad);
    absl::Status st = LoadConfigFile(path, &d);
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << bad << " → " << st;
    std::remove(path.c_str());
  }
}

TEST(ConfigTest, SlowClientRatesResponseBudgetAndAccessLogAreSettableAndValidated) {
  DaemonConfig c;
  std::string path = TempFile(
      R"({"min_transfer_bytes_per_second": 1024, "min_transfer_grace_ms": 2000,
          "max_buffered_response_bytes": 8388608, "access_log_lines_per_second": 0})");
  ASSERT_TRUE(LoadConfigFile(path, &c).ok());
  EXPECT_EQ(c.min_transfer_bytes_per_second, 1024);
  EXPECT_EQ(c.min_transfer_grace_ms, 2000);
  EXPECT_EQ(c.max_buffered_response_bytes, 8ll << 20);
  EXPECT_EQ(c.access_log_lines_per_second, 0);
  std::remove(path.c_str());
  for (const char* bad : {R"({"min_transfer_bytes_per_second": -1})",
                          R"({"min_transfer_grace_ms": 10})",
                          R"({"max_buffered_response_bytes": 1048576})",
                          R"({"access_log_lines_per_second": -5})"}) {
    DaemonConfig d;
    path = TempFile(bad);
    absl::Status st = LoadConfigFile(path, &d);
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << bad << " → " << st;
    std::remove(path.c_str());
  }
}

TEST(ConfigTest, UserNamespaceKeysAreSettableAndValidated) {
  DaemonConfig c;
  EXPECT_TRUE(c.user_namespaces);
  std::string path = TempFile(R"({"user_namespaces": false, "userns_uid_base": 196608})");
  ASSERT_TRUE(LoadConfigFile(path, &c).ok());
  EXPECT_FALSE(c.user_namespaces);
  EXPECT_EQ(c.userns_uid_base, 196608);
  std::remove(path.c_str());
  for (const char* bad : {R"({"user_namespaces": "yes"})", R"({"userns_uid_base": 1000})",
                          R"({"userns_uid_base": 2147483648})", R"({"userns_uid_base": 200000})"}) {
    DaemonConfig d;
    path = TempFile(bad);
    absl::Status st = LoadConfigFile(path, &d);
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << bad << " → " << st;
    std::remove(path.c_str());
  }
}

TEST(ConfigTest, EgressSectionAndIntentCatalogue) {
  DaemonConfig c;
  // "tenants" before "default" on purpose: tenant defaults are laid over the daemon's anyway.
  std::string path = TempFile(R"({
      "intents": {"check-weather": {"allow": ["weather.test", "*.weather.test"]},
                  "pip": {"allow": ["pypi.test"], "max_ttl_seconds": 600}},
      "egress": {
        "tenants": {"acme": {"default": {"allow": ["acme.test"]},
                             "intents": {"pip": {"allow": ["mirror.acme.test"]},
                                         "deploy": {"allow": ["deploy.acme.test:443"]}}}},
        "default": {"deny": ["*.evil.test"], "tls_inspect": false},
        "resolve": {"Weather.Test": "127.0.0.1:18080"},
        "upstream_ca": "/etc/test-root.pem"}})");
  absl::Status st = LoadConfigFile(path, &c);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(c.egress.resolve.at("weather.test"), "127.0.0.1:18080");
  EXPECT_EQ(c.egress.upstream_ca, "/etc/test-root.pem");
  EXPECT_EQ(c.egress.default_policy.deny.size(), 1u);
  EXPECT_FALSE(c.egress.default_policy.tls_inspect);
  const governance::EgressPolicy& acme = c.egress.DefaultPolicyFor("acme");
  EXPECT_EQ(acme.allow.size(), 1u);
  EXPECT_EQ(acme.deny.size(), 1u) << "laid over the daemon default";
  EXPECT_FALSE(acme.tls_inspect);
  EXPECT_TRUE(c.egress.DefaultPolicyFor("other").allow.empty());
  auto acme_intents = c.egress.IntentsFor("acme");
  EXPECT_EQ(acme_intents.size(), 3u);
  EXPECT_EQ(acme_intents.at("pip").allow[0].text, "mirror.acme.test") << "tenant entry replaces";
  EXPECT_EQ(acme_intents.at("check-weather").allow.size(), 2u) << "daemon entry kept";
  EXPECT_EQ(c.egress.IntentsFor("other").size(), 2u);
  EXPECT_EQ(c.egress.IntentsFor("other").at("pip").max_ttl_seconds, 600);
  std::remove(path.c_str());
}

TEST(ConfigTest, BadEgressConfigIsAnErrorNamingTheKey) {
  struct Case {
    const char* json;
    const char* message;
  } cases[] = {
      {R"({"egress": []})", "'egress' must be an object"},
      {R"({"egress": {"bogus": 1}})", "unknown key 'egress.bogus'"},
      {R"({"egress": {"default": {"mode": "wide"}}})", "egress.default: network.mode"},
      {R"({"egress": {"default": {"allow": ["*"]}}})", "egress.default: network.allow[0]"},
      {R"({"egress": {"resolve": {"a.test": "nohost"}}})", "must be HOST:PORT"},
      {R"({"egress": {"resolve": {"*.a.test": "127.0.0.1:1"}}})", "must be a host name"},
      {R"({"egress": {"resolve": {"a.test": 5}}})", "egress.resolve"},
      {R"({"egress": {"upstream_ca": 5}})", "'egress.upstream_ca' must be a string"},
      {R"({"egress": {"tenants": {"acme": {"x": 1}}}})", "unknown key 'egress.tenants.acme.x'"},
      {R"({"egress": {"tenants": {"acme": {"intents": {"X": {"allow": ["a.test"]}}}}}})",
       "egress.tenants.acme.intents"},
      {R"({"intents": {"w": {"allow": []}}})", "intents: intents.w.allow must list"},
      {R"({"intents": {"w": {"allow": ["a.test"], "ttl": 1}}})", "unknown field"},
  };
  for (const Case& k : cases) {
    DaemonConfig c;
    std::string path = TempFile(k.json);
    absl::Status st = LoadConfigFile(path, &c);
    EXPECT_FALSE(st.ok()) << k.json;
    EXPECT_NE(std::string(st.message()).find(k.message), std::string::npos)
        << k.json << " -> " << st;
    std::remove(path.c_str());
  }
}

TEST(ConfigTest, EnvironmentOverrides) {
  std::map<std::string, std::string> env{{"ESBD_LISTEN", "127.0.0.1:1"},
                                         {"ESBD_POOL_SIZE", "0"},
                                         {"ESBD_IMAGE_DEFAULT", "/rootfs"}};
  DaemonConfig c;
  auto get = [&](const char* n) -> const char* {
    auto it = env.find(n);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  ASSERT_TRUE(ApplyEnvironment(get, &c).ok());
  EXPECT_EQ(c.listen, "127.0.0.1:1");
  EXPECT_EQ(c.pool_size, 0);
  EXPECT_EQ(c.images["default"], "/rootfs");
  env["ESBD_POOL_SIZE"] = "-3";
  EXPECT_FALSE(ApplyEnvironment(get, &c).ok());
}

TEST(ConfigTest, ParseListen) {
  std::string h;
  uint16_t p;
  ASSERT_TRUE(ParseListen("127.0.0.1:8080", &h, &p).ok());
  EXPECT_EQ(h, "127.0.0.1");
  EXPECT_EQ(p, 8080);
  ASSERT_TRUE(ParseListen("[::1]:0", &h, &p).ok());
  EXPECT_EQ(h, "::1");
  EXPECT_FALSE(ParseListen("8080", &h, &p).ok());
  EXPECT_FALSE(ParseListen("host:99999", &h, &p).ok());
  EXPECT_FALSE(ParseListen(":80", &h, &p).ok());
}

// defaults.memory_mb / disk_mb above the per-environment caps: refused at load (explicit caps)
// and when the caps are derived from the host's RAM.
TEST(ConfigTest, DefaultMemoryAboveMaxMemoryIsRefused) {
  for (const char* bad : {R"({"max_memory_mb": 256, "defaults": {"memory_mb": 512}})",
                          R"({"defaults": {"disk_mb": 2048}, "max_disk_mb": 1024})",
                          R"({"max_memory_mb": 8192, "sandbox_memory_mb": 4096})",
                          R"({"max_memory_mb": 16})"}) {
    DaemonConfig c;
    std::string path = TempFile(bad);
    absl::Status st = LoadConfigFile(path, &c);
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << bad << " → " << st;
    EXPECT_NE(st.message().find("_mb"), std::string::npos) << st;
    std::remove(path.c_str());
  }
  // A 1 GiB host: derived caps are too small for a 1024 MiB default.
  DaemonConfig small;
  small.defaults.memory_mb = 1024;
  absl::Status st = ResolveMemoryLimits(1024, &small);
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_NE(st.message().find("defaults.memory_mb"), std::string::npos) << st;
  // Unknown RAM and nothing configured: refuse rather than run unlimited.
  DaemonConfig unknown;
  EXPECT_FALSE(ResolveMemoryLimits(0, &unknown).ok());
}

// A 24 GiB host (the red-team host): 6 GiB stay for the host, sandboxes + nano share the rest.
TEST(ConfigTest, MemoryLimitsAreDerivedFromHostRam) {
  DaemonConfig c;
  ASSERT_TRUE(ResolveMemoryLimits(24576, &c).ok());
  EXPECT_EQ(c.nano_memory_mb, 18432 / 8);
  EXPECT_EQ(c.sandbox_memory_mb, 18432 - 18432 / 8);
  EXPECT_EQ(c.max_memory_mb, c.sandbox_memory_mb / 2);
  EXPECT_EQ(c.max_disk_mb, c.max_memory_mb);
  EXPECT_LE(c.sandbox_memory_mb + c.nano_memory_mb, 24576 - 2048);
  // Explicit values are kept.
  DaemonConfig e;
  e.max_memory_mb = 1024;
  ASSERT_TRUE(ResolveMemoryLimits(24576, &e).ok());
  EXPECT_EQ(e.max_memory_mb, 1024);
  EXPECT_EQ(e.max_disk_mb, 1024);
}

}  // namespace
}  // namespace esb

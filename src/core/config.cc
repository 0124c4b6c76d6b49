#include "core/config.h"

#include <algorithm>
#include <boost/json.hpp>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/host_memory.h"
#include "common/util.h"
#include "drivers/env_limits.h"

namespace esb {
namespace json = boost::json;
namespace {

absl::Status TypeError(const std::string& key, const std::string& want) {
  return absl::InvalidArgumentError(absl::StrCat("config: '", key, "' must be ", want));
}

absl::Status GetString(const json::value& v, const std::string& key, std::string* out) {
  if (!v.is_string()) return TypeError(key, "a string");
  *out = std::string(v.as_string());
  return absl::OkStatus();
}

absl::Status GetBool(const json::value& v, const std::string& key, bool* out) {
  if (!v.is_bool()) return TypeError(key, "true or false");
  *out = v.as_bool();
  return absl::OkStatus();
}

template <typename T>
absl::Status GetInt(const json::value& v, const std::string& key, T* out) {
  if (!v.is_int64() && !v.is_uint64()) return TypeError(key, "an integer");
  int64_t n = v.is_int64() ? v.as_int64() : static_cast<int64_t>(v.as_uint64());
  if (n < 0) return TypeError(key, "a non-negative integer");
  *out = static_cast<T>(n);
  return absl::OkStatus();
}

absl::Status ParseDefaults(const json::value& v, EnvSpec* spec) {
  if (!v.is_object()) return TypeError("defaults", "an object");
  for (const auto& kv : v.as_object()) {
    std::string key = absl::StrCat("defaults.", std::string(kv.key()));
    absl::Status st;
    if (kv.key() == "cpu") {
      if (!kv.value().is_number()) return TypeError(key, "a number");
      spec->cpu = kv.value().to_number<double>();
    } else if (kv.key() == "memory_mb") {
      st = GetInt(kv.value(), key, &spec->memory_mb);
    } else if (kv.key() == "pids") {
      st = GetInt(kv.value(), key, &spec->pids);
    } else if (kv.key() == "disk_mb") {
      st = GetInt(kv.value(), key, &spec->disk_mb);
    } else if (kv.key() == "image") {
      st = GetString(kv.value(), key, &spec->image);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("config: unknown key '", key, "'"));
    }
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status ParsePackages(const json::value& v, PackagesConfig* p) {
  if (!v.is_object()) return TypeError("packages", "an object");
  for (const auto& kv : v.as_object()) {
    std::string key = absl::StrCat("packages.", std::string(kv.key()));
    absl::Status st;
    if (kv.key() == "index_url") {
      st = GetString(kv.value(), key, &p->index_url);
    } else if (kv.key() == "cache_dir") {
      st = GetString(kv.value(), key, &p->cache_dir);
    } else if (kv.key() == "ca_file") {
      st = GetString(kv.value(), key, &p->ca_file);
    } else if (kv.key() == "allowed_hosts") {
      if (!kv.value().is_array()) return TypeError(key, "an array of host names");
      for (const auto& h : kv.value().as_array()) {
        if (!h.is_string()) return TypeError(key, "an array of host names");
        p->allowed_hosts.emplace_back(h.as_string());
      }
    } else if (kv.key() == "index_ttl_seconds") {
      st = GetInt(kv.value(), key, &p->index_ttl_s);
    } else if (kv.key() == "max_wheel_mb") {
      st = GetInt(kv.value(), key, &p->max_wheel_mb);
    } else if (kv.key() == "max_cache_mb") {
      st = GetInt(kv.value(), key, &p->max_cache_mb);
    } else if (kv.key() == "timeout_seconds") {
      st = GetInt(kv.value(), key, &p->timeout_s);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("config: unknown key '", key, "'"));
    }
    if (!st.ok()) return st;
  }
  if (p->max_cache_mb < 0) return TypeError("packages.max_cache_mb", "0 (unlimited) or more");
  if (p->max_wheel_mb < 1) return TypeError("packages.max_wheel_mb", "1 or more");
  if (!p->index_url.empty() && p->index_url.rfind("http://", 0) != 0 &&
      p->index_url.rfind("https://", 0) != 0)
    return TypeError("packages.index_url", "an http:// or https:// URL");
  return absl::OkStatus();
}

absl::Status ParseArtifacts(const json::value& v, ArtifactsConfig* a) {
  if (!v.is_object()) return TypeError("artifacts", "an object");
  for (const auto& kv : v.as_object()) {
    std::string key = absl::StrCat("artifacts.", std::string(kv.key()));
    absl::Status st;
    if (kv.key() == "ttl_seconds") st = GetInt(kv.value(), key, &a->ttl_s);
    else if (kv.key() == "max_artifact_mb") st = GetInt(kv.value(), key, &a->max_artifact_mb);
    else if (kv.key() == "max_tenant_mb") st = GetInt(kv.value(), key, &a->max_tenant_mb);
    else return absl::InvalidArgumentError(absl::StrCat("config: unknown key '", key, "'"));
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status ParseMcp(const json::value& v, McpConfig* c) {
  if (!v.is_object()) return TypeError("mcp", "an object");
  // Hosted servers' limits (core/mcp_hosts): integers with a range each.
  struct IntKey {
    const char* name;
    int64_t* i64;
    int* i32;
    int64_t min, max;
  };
  const IntKey hosted[] = {
      {"max_servers_per_environment", nullptr, &c->max_servers_per_environment, 0, 32},
      {"max_servers", nullptr, &c->max_servers, 0, 1024},
      {"max_message_bytes", &c->max_message_bytes, nullptr, 4096, 64ll << 20},
      {"call_timeout_seconds", &c->call_timeout_s, nullptr, 1, 3600},
      {"start_timeout_seconds", &c->start_timeout_s, nullptr, 1, 600},
      {"max_concurrent_calls_per_server", nullptr, &c->max_concurrent_calls_per_server, 1, 256},
      {"max_output_bytes_per_second", &c->max_output_bytes_per_second, nullptr, 64 << 10,
       1ll << 30},
      {"max_lines_per_second", &c->max_lines_per_second, nullptr, 10, 1000000},
      {"max_garbage_lines", nullptr, &c->max_garbage_lines, 0, 1000},
      {"max_restarts", nullptr, &c->max_restarts, 0, 100},
      {"stderr_tail_bytes", &c->stderr_tail_bytes, nullptr, 256, 1 << 20},
      {"max_tools_per_server", nullptr, &c->max_tools_per_server, 1, 10000},
  };
  for (const auto& kv : v.as_object()) {
    std::string key = absl::StrCat("mcp.", std::string(kv.key()));
    absl::Status st;
    const IntKey* h = nullptr;
    for (const IntKey& k : hosted)
      if (kv.key() == k.name) h = &k;
    if (h != nullptr) {
      int64_t value = 0;
      if (st = GetInt(kv.value(), key, &value); !st.ok()) return st;
      if (value < h->min || value > h->max)
        return TypeError(key, absl::StrCat(h->min, "..", h->max));
      if (h->i64 != nullptr)
        *h->i64 = value;
      else
        *h->i32 = static_cast<int>(value);
    } else if (kv.key() == "max_sessions") {
      st = GetInt(kv.value(), key, &c->max_sessions);
    } else if (kv.key() == "max_sessions_per_tenant") {
      st = GetInt(kv.value(), key, &c->max_sessions_per_tenant);
    } else if (kv.key() == "session_idle_seconds") {
      st = GetInt(kv.value(), key, &c->session_idle_s);
    } else if (kv.key() == "allowed_origins") {
      if (!kv.value().is_array()) return TypeError(key, "an array of origins");
      for (const auto& o : kv.value().as_array()) {
        if (!o.is_string() || o.as_string().empty() || o.as_string().size() > 256)
          return TypeError(key, "an array of origins (\"https://host[:port]\")");
        c->allowed_origins.emplace_back(o.as_string());
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat("config: unknown key '", key, "'"));
    }
    if (!st.ok()) return st;
  }
  if (c->max_sessions < 1 || c->max_sessions > 100000)
    return TypeError("mcp.max_sessions", "1..100000");
  if (c->max_sessions_per_tenant < 1 || c->max_sessions_per_tenant > c->max_sessions)
    return TypeError("mcp.max_sessions_per_tenant", "1..max_sessions");
  if (c->session_idle_s < 1 || c->session_idle_s > 86400)
    return TypeError("mcp.session_idle_seconds", "1..86400");
  return absl::OkStatus();
}

absl::Status ParseSteps(const json::value& v, StepsConfig* c) {
  if (!v.is_object()) return TypeError("steps", "an object");
  for (const auto& kv : v.as_object()) {
    std::string key = absl::StrCat("steps.", std::string(kv.key()));
    absl::Status st;
    if (kv.key() == "store_mb")
      st = GetInt(kv.value(), key, &c->store_mb);
    else if (kv.key() == "max_tenant_mb")
      st = GetInt(kv.value(), key, &c->max_tenant_mb);
    else if (kv.key() == "max_blob_mb")
      st = GetInt(kv.value(), key, &c->max_blob_mb);
    else if (kv.key() == "sweep_interval_seconds")
      st = GetInt(kv.value(), key, &c->sweep_interval_s);
    else
      return absl::InvalidArgumentError(absl::StrCat("config: unknown key '", key, "'"));
    if (!st.ok()) return st;
  }
  if (c->store_mb < 1 || c->store_mb > (int64_t{1} << 24))
    return TypeError("steps.store_mb", "1..16777216");
  if (c->max_tenant_mb < 0 || c->max_tenant_mb > c->store_mb)
    return TypeError("steps.max_tenant_mb", "0 (a quarter of store_mb)..store_mb");
  if (c->max_blob_mb < 1 || c->max_blob_mb > 4096) return TypeError("steps.max_blob_mb", "1..4096");
  if (c->sweep_interval_s < 1 || c->sweep_interval_s > 3600)
    return TypeError("steps.sweep_interval_seconds", "1..3600");
  return absl::OkStatus();
}

absl::Status ParseAudit(const json::value& v, AuditConfig* a) {
  if (!v.is_object()) return TypeError("audit", "an object");
  for (const auto& kv : v.as_object()) {
    std::string key = absl::StrCat("audit.", std::string(kv.key()));
    absl::Status st;
    if (kv.key() == "retention_days") st = GetInt(kv.value(), key, &a->retention_days);
    else if (kv.key() == "max_rows_per_tenant") st = GetInt(kv.value(), key, &a->max_rows_per_tenant);
    else if (kv.key() == "rate_per_second") st = GetInt(kv.value(), key, &a->rate_per_second);
    else if (kv.key() == "burst") st = GetInt(kv.value(), key, &a->burst);
    else if (kv.key() == "egress_rate_per_second")
      st = GetInt(kv.value(), key, &a->egress_rate_per_second);
    else if (kv.key() == "egress_burst")
      st = GetInt(kv.value(), key, &a->egress_burst);
    else if (kv.key() == "egress_stored_mb")
      st = GetInt(kv.value(), key, &a->egress_stored_mb);
    else if (kv.key() == "max_detail_bytes") st = GetInt(kv.value(), key, &a->max_detail_bytes);
    else if (kv.key() == "query_timeout_ms") st = GetInt(kv.value(), key, &a->query_timeout_ms);
    else if (kv.key() == "write_behind_ms") st = GetInt(kv.value(), key, &a->write_behind_ms);
    else return absl::InvalidArgumentError(absl::StrCat("config: unknown key '", key, "'"));
    if (!st.ok()) return st;
  }
  // Zero would switch the log (or searches) off entirely: never what an operator means.
  if (a->retention_days < 1) return TypeError("audit.retention_days", "1 or more");
  if (a->max_rows_per_tenant < 100) return TypeError("audit.max_rows_per_tenant", "100 or more");
  if (a->rate_per_second < 1) return TypeError("audit.rate_per_second", "1 or more");
  if (a->burst < 1) return TypeError("audit.burst", "1 or more");
  if (a->egress_rate_per_second < 1) return TypeError("audit.egress_rate_per_second", "1 or more");
  if (a->egress_burst < 1) return TypeError("audit.egress_burst", "1 or more");
  if (a->egress_stored_mb < 0 || a->egress_stored_mb > (1 << 20))
    return TypeError("audit.egress_stored_mb", "0..1048576");
  if (a->max_detail_bytes < 64 || a->max_detail_bytes > 65536)
    return TypeError("audit.max_detail_bytes", "64..65536");
  if (a->write_behind_ms < 0 || a->write_behind_ms > 1000)
    return TypeError("audit.write_behind_ms", "0 (synchronous)..1000");
  if (a->query_timeout_ms < 10 || a->query_timeout_ms > 60000)
    return TypeError("audit.query_timeout_ms", "10..60000");
  return absl::OkStatus();
}

absl::Status CheckResolveTarget(const std::string& where, const std::string& name,
                                const std::string& target) {
  auto rule = governance::ParseHostRule(name);
  if (!rule.ok() || rule->kind != governance::HostRule::Kind::kExact || rule->port)
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": '", name, "' must be a host name (no '*.', no port)"));
  std::string host;
  uint16_t port = 0;
  if (!ParseListen(target, &host, &port).ok() || port == 0)
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": '", target, "' for ", name, " must be HOST:PORT (port 1..65535)"));
  return absl::OkStatus();
}

absl::Status EgressConfigError(const std::string& where, const absl::Status& st) {
  return absl::InvalidArgumentError(absl::StrCat("config: ", where, ": ", st.message()));
}

absl::Status ParseEgress(const json::value& v, EgressConfig* e) {
  if (!v.is_object()) return TypeError("egress", "an object");
  const json::object& o = v.as_object();
  // "default" first: the tenants' defaults are laid over it, whatever the key order.
  if (const json::value* d = o.if_contains("default")) {
    auto policy = governance::ParseEgressPolicy(*d, e->default_policy);
    if (!policy.ok()) return EgressConfigError("egress.default", policy.status());
    e->default_policy = *std::move(policy);
  }
  for (const auto& kv : o) {
    std::string key = absl::StrCat("egress.", std::string(kv.key()));
    absl::Status st;
    if (kv.key() == "default") {
      continue;
    } else if (kv.key() == "upstream_ca") {
      st = GetString(kv.value(), key, &e->upstream_ca);
    } else if (kv.key() == "resolve") {
      if (!kv.value().is_object()) return TypeError(key, "an object of NAME → \"HOST:PORT\"");
      for (const auto& r : kv.value().as_object()) {
        if (!r.value().is_string()) return TypeError(key, "an object of NAME → \"HOST:PORT\"");
        std::string name = absl::AsciiStrToLower(std::string(r.key()));
        std::string target(r.value().as_string());
        if (st = CheckResolveTarget(absl::StrCat("config: ", key), name, target); !st.ok())
          return st;
        e->resolve[name] = target;
      }
    } else if (kv.key() == "tenants") {
      if (!kv.value().is_object()) return TypeError(key, "an object of tenant → settings");
      for (const auto& t : kv.value().as_object()) {
        std::string tenant(t.key());
        std::string where = absl::StrCat(key, ".", tenant);
        if (!t.value().is_object()) return TypeError(where, "an object {default, intents}");
        for (const auto& f : t.value().as_object()) {
          std::string fk = absl::StrCat(where, ".", std::string(f.key()));
          if (f.key() == "default") {
            auto policy = governance::ParseEgressPolicy(f.value(), e->default_policy);
            if (!policy.ok()) return EgressConfigError(fk, policy.status());
            e->tenant_default_policy[tenant] = *std::move(policy);
          } else if (f.key() == "intents") {
            auto catalogue = governance::ParseIntentCatalogue(f.value());
            if (!catalogue.ok()) return EgressConfigError(fk, catalogue.status());
            e->tenant_intents[tenant] = *std::move(catalogue);
          } else {
            return absl::InvalidArgumentError(absl::StrCat("config: unknown key '", fk, "'"));
          }
        }
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat("config: unknown key '", key, "'"));
    }
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

// The HTTP server's connection, memory and fair-share limits must let at least one request of
// every allowed size through.
absl::Status ValidateHttpLimits(const DaemonConfig& c) {
  if (c.max_connections < 1) return TypeError("max_connections", "1 or more");
  if (c.io_threads < 1 || c.io_threads > 64) return TypeError("io_threads", "1..64");
  if (c.max_streams < 0 || c.max_streams > c.max_connections)
    return TypeError("max_streams", "0 (max_connections)..max_connections");
  if (c.max_open_connections_per_peer < 0 || c.max_open_connections_per_peer > (1 << 20))
    return TypeError("max_open_connections_per_peer",
                     "0 (seven eighths of the open-connection cap)..1048576");
  if (c.max_json_body_bytes < 1) return TypeError("max_json_body_bytes", "1 or more");
  if (c.max_buffered_body_bytes < c.max_json_body_bytes)
    return TypeError("max_buffered_body_bytes", "at least max_json_body_bytes");
  if (c.max_buffered_header_bytes < (1 << 20))
    return TypeError("max_buffered_header_bytes", "at least 1048576 (1 MiB)");
  if (c.max_requests_per_tenant < 0 || c.max_requests_per_tenant > c.max_connections)
    return TypeError("max_requests_per_tenant",
                     "0 (a quarter of max_connections)..max_connections");
  if (c.max_buffered_body_bytes_per_tenant != 0 &&
      (c.max_buffered_body_bytes_per_tenant < c.max_json_body_bytes ||
       c.max_buffered_body_bytes_per_tenant > c.max_buffered_body_bytes))
    return TypeError("max_buffered_body_bytes_per_tenant",
                     "0 (a quarter of max_buffered_body_bytes) or max_json_body_bytes.."
                     "max_buffered_body_bytes");
  if (c.min_transfer_bytes_per_second < 0 || c.min_transfer_bytes_per_second > (1ll << 30))
    return TypeError("min_transfer_bytes_per_second", "0 (no minimum)..1073741824");
  if (c.min_transfer_grace_ms < 100 || c.min_transfer_grace_ms > 3600000)
    return TypeError("min_transfer_grace_ms", "100..3600000");
  if (c.max_buffered_response_bytes < (4ll << 20))
    return TypeError("max_buffered_response_bytes", "at least 4194304 (4 MiB)");
  if (c.access_log_lines_per_second < 0 || c.access_log_lines_per_second > 1000000)
    return TypeError("access_log_lines_per_second", "0 (no limit)..1000000");
  if (c.userns_uid_base < 65536 || c.userns_uid_base > (1LL << 31) - 65536 ||
      c.userns_uid_base % 65536 != 0)
    return TypeError("userns_uid_base",
                     "a multiple of 65536 in 65536..2147418112 (above host uids, below 2^31)");
  return absl::OkStatus();
}

}  // namespace

namespace {

// Cross-field checks of the memory keys; a 0 key is not checked (derived later).
absl::Status CheckMemoryCaps(const DaemonConfig& c, const std::string& path) {
  const std::string where = path.empty() ? "config" : absl::StrCat("config ", path);
  for (auto [name, v] : {std::pair<const char*, int64_t>{"sandbox_memory_mb", c.sandbox_memory_mb},
                         {"nano_memory_mb", c.nano_memory_mb},
                         {"max_memory_mb", c.max_memory_mb},
                         {"max_disk_mb", c.max_disk_mb}}) {
    if (v != 0 && !(v >= 64 && v <= (1LL << 24))) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", name, " must be 64..16777216 (MiB) or 0 (derive)"));
    }
  }
  if (c.max_memory_mb != 0 && c.sandbox_memory_mb != 0 && c.max_memory_mb > c.sandbox_memory_mb) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": max_memory_mb (", c.max_memory_mb, ") exceeds sandbox_memory_mb (",
        c.sandbox_memory_mb, ", the limit of all sandboxes together)"));
  }
  // `defaults` must be something an environment may ask for: the one limit table
  // (drivers/env_limits.h). A cap still 0 is derived later and checked then.
  EnvLimitCaps caps =
      HostEnvLimitCaps(c.max_memory_mb != 0 ? c.max_memory_mb : (1LL << 24), c.max_pids,
                       c.max_disk_mb != 0 ? c.max_disk_mb : (1LL << 24));
  if (absl::Status st = CheckEnvLimits(c.defaults, caps); !st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": defaults.", st.message(), "; change the default or the limit"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LoadConfigFile(const std::string& path, DaemonConfig* c) {
  std::string text;
  absl::Status st = ReadFileToString(path, &text);
  if (!st.ok()) return st;
  boost::system::error_code ec;
  json::value root = json::parse(text, ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat("config ", path, ": ", ec.message()));
  if (!root.is_object())
    return absl::InvalidArgumentError(absl::StrCat("config ", path, ": not a JSON object"));
  for (const auto& kv : root.as_object()) {
    std::string key(kv.key());
    const json::value& v = kv.value();
    if (key == "listen") st = GetString(v, key, &c->listen);
    else if (key == "unix_socket") st = GetString(v, key, &c->unix_socket);
    else if (key == "state_dir") st = GetString(v, key, &c->state_dir);
    else if (key == "state_key_file")
      st = GetString(v, key, &c->state_key_file);
    else if (key == "container_runtime") st = GetString(v, key, &c->container_runtime);
    else if (key == "agent_binary") st = GetString(v, key, &c->agent_binary);
    else if (key == "user_namespaces")
      st = GetBool(v, key, &c->user_namespaces);
    else if (key == "userns_uid_base")
      st = GetInt(v, key, &c->userns_uid_base);
    else if (key == "python_wasm") st = GetString(v, key, &c->python_wasm);
    else if (key == "nano_worker") st = GetString(v, key, &c->nano_worker);
    else if (key == "router_rules") st = GetString(v, key, &c->router_rules);
    else if (key == "image_cache")
      st = GetString(v, key, &c->image_cache);
    else if (key == "log_level") st = GetString(v, key, &c->log_level);
    else if (key == "default_ttl_seconds") st = GetInt(v, key, &c->default_ttl_s);
    else if (key == "max_ttl_seconds") st = GetInt(v, key, &c->max_ttl_s);
    else if (key == "pool_size") st = GetInt(v, key, &c->pool_size);
    else if (key == "max_environments") st = GetInt(v, key, &c->max_environments);
    else if (key == "max_environments_per_tenant")
      st = GetInt(v, key, &c->max_environments_per_tenant);
    else if (key == "max_volume_mb") st = GetInt(v, key, &c->max_volume_mb);
    else if (key == "max_volumes_per_tenant") st = GetInt(v, key, &c->max_volumes_per_tenant);
    else if (key == "max_terminals_per_environment")
      st = GetInt(v, key, &c->max_terminals_per_environment);
    else if (key == "max_terminals_per_tenant")
      st = GetInt(v, key, &c->max_terminals_per_tenant);
    else if (key == "terminal_idle_timeout_seconds")
      st = GetInt(v, key, &c->terminal_idle_timeout_s);
    else if (key == "max_output_bytes") st = GetInt(v, key, &c->max_output_bytes);
    else if (key == "max_upload_bytes") st = GetInt(v, key, &c->max_upload_bytes);
    else if (key == "max_json_body_bytes") st = GetInt(v, key, &c->max_json_body_bytes);
    else if (key == "max_connections") st = GetInt(v, key, &c->max_connections);
    else if (key == "io_threads") st = GetInt(v, key, &c->io_threads);
    else if (key == "max_streams") st = GetInt(v, key, &c->max_streams);
    else if (key == "max_open_connections_per_peer")
      st = GetInt(v, key, &c->max_open_connections_per_peer);
    else if (key == "max_buffered_body_bytes") st = GetInt(v, key, &c->max_buffered_body_bytes);
    else if (key == "max_buffered_header_bytes")
      st = GetInt(v, key, &c->max_buffered_header_bytes);
    else if (key == "max_requests_per_tenant") st = GetInt(v, key, &c->max_requests_per_tenant);
    else if (key == "max_buffered_body_bytes_per_tenant")
      st = GetInt(v, key, &c->max_buffered_body_bytes_per_tenant);
    else if (key == "min_transfer_bytes_per_second")
      st = GetInt(v, key, &c->min_transfer_bytes_per_second);
    else if (key == "min_transfer_grace_ms") st = GetInt(v, key, &c->min_transfer_grace_ms);
    else if (key == "max_buffered_response_bytes")
      st = GetInt(v, key, &c->max_buffered_response_bytes);
    else if (key == "access_log_lines_per_second")
      st = GetInt(v, key, &c->access_log_lines_per_second);
    else if (key == "max_pids") st = GetInt(v, key, &c->max_pids);
    else if (key == "sandbox_memory_mb") st = GetInt(v, key, &c->sandbox_memory_mb);
    else if (key == "nano_memory_mb") st = GetInt(v, key, &c->nano_memory_mb);
    else if (key == "max_memory_mb") st = GetInt(v, key, &c->max_memory_mb);
    else if (key == "max_disk_mb") st = GetInt(v, key, &c->max_disk_mb);
    else if (key == "defaults") st = ParseDefaults(v, &c->defaults);
    else if (key == "packages") st = ParsePackages(v, &c->packages);
    else if (key == "artifacts") st = ParseArtifacts(v, &c->artifacts);
    else if (key == "audit")
      st = ParseAudit(v, &c->audit);
    else if (key == "steps")
      st = ParseSteps(v, &c->steps);
    else if (key == "mcp")
      st = ParseMcp(v, &c->mcp);
    else if (key == "egress")
      st = ParseEgress(v, &c->egress);
    else if (key == "intents") {
      auto catalogue = governance::ParseIntentCatalogue(v);
      if (!catalogue.ok())
        st = EgressConfigError("intents", catalogue.status());
      else
        c->egress.intents = *std::move(catalogue);
    } else if (key == "images") {
      if (!v.is_object()) return TypeError(key, "an object of name → rootfs directory");
      for (const auto& img : v.as_object()) {
        std::string dir;
        st = GetString(img.value(), absl::StrCat("images.", std::string(img.key())), &dir);
        if (!st.ok()) return st;
        c->images[std::string(img.key())] = dir;
      }
    } else if (key == "keys") {
      if (!v.is_array()) return TypeError(key, "an array");
      for (const auto& k : v.as_array()) {
        if (!k.is_object()) return TypeError("keys[]", "objects {key, tenant, name}");
        KeyConfig kc;
        for (const auto& f : k.as_object()) {
          std::string fk = absl::StrCat("keys[].", std::string(f.key()));
          if (f.key() == "key") st = GetString(f.value(), fk, &kc.key);
          else if (f.key() == "tenant") st = GetString(f.value(), fk, &kc.tenant);
          else if (f.key() == "name") st = GetString(f.value(), fk, &kc.name);
          else return absl::InvalidArgumentError(absl::StrCat("config: unknown key '", fk, "'"));
          if (!st.ok()) return st;
        }
        if (kc.key.size() < 16 || kc.tenant.empty())
          return absl::InvalidArgumentError(
              "config: every keys[] entry needs a 'key' of at least 16 characters and a "
              "'tenant'");
        c->keys.push_back(kc);
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat("config: unknown key '", key, "'"));
    }
    if (!st.ok()) return st;
  }
  // Checked after all keys (either may come first): a default outside the limits would make
  // every create that leaves it out fail in the driver (400) and the warm pool never fill.
  // Memory caps given in the file (0 = derived later from the host's RAM, checked then).
  if (absl::Status mem = CheckMemoryCaps(*c, path); !mem.ok()) return mem;
  if (c->max_volume_mb < 16 || c->max_volume_mb > (int64_t{1} << 20))
    return TypeError("max_volume_mb", "16..1048576");
  if (c->max_volumes_per_tenant < 0) return TypeError("max_volumes_per_tenant", "0 or more");
  if (c->max_terminals_per_environment < 0)
    return TypeError("max_terminals_per_environment", "0 or more");
  if (c->max_terminals_per_tenant < 0) return TypeError("max_terminals_per_tenant", "0 or more");
  if (c->terminal_idle_timeout_s < 1 || c->terminal_idle_timeout_s > 86400)
    return TypeError("terminal_idle_timeout_seconds", "1..86400");
  // HTTP limits (cross-field: checked once every key is in).
  if (absl::Status http = ValidateHttpLimits(*c); !http.ok()) return http;
  return absl::OkStatus();
}

absl::Status ResolveMemoryLimits(int64_t host_mb, DaemonConfig* c) {
  const MemoryBudget b = DeriveMemoryBudget(host_mb);
  const bool derive = c->sandbox_memory_mb == 0 || c->nano_memory_mb == 0 ||
                      c->max_memory_mb == 0 || c->max_disk_mb == 0;
  if (derive && host_mb <= 0) {
    return absl::FailedPreconditionError(
        "cannot read MemTotal from /proc/meminfo: set sandbox_memory_mb, nano_memory_mb, "
        "max_memory_mb and max_disk_mb in the config");
  }
  if (c->sandbox_memory_mb == 0) c->sandbox_memory_mb = b.sandboxes_mb;
  if (c->nano_memory_mb == 0) c->nano_memory_mb = b.nano_mb;
  if (c->max_memory_mb == 0) c->max_memory_mb = std::min(b.max_env_mb, c->sandbox_memory_mb);
  if (c->max_disk_mb == 0) c->max_disk_mb = c->max_memory_mb;
  return CheckMemoryCaps(*c, "");
}

absl::Status ApplyEnvironment(const std::function<const char*(const char*)>& getenv_fn,
                              DaemonConfig* c) {
  auto str = [&](const char* name, std::string* out) {
    if (const char* v = getenv_fn(name); v && *v) *out = v;
  };
  str("ESBD_LISTEN", &c->listen);
  str("ESBD_STATE_DIR", &c->state_dir);
  str("ESBD_UNIX_SOCKET", &c->unix_socket);
  str("ESBD_RUNTIME", &c->container_runtime);
  str("ESBD_LOG_LEVEL", &c->log_level);
  str("ESBD_AGENT_BINARY", &c->agent_binary);
  str("ESBD_PYTHON_WASM", &c->python_wasm);
  str("ESBD_NANO_WORKER", &c->nano_worker);
  str("ESBD_ROUTER_RULES", &c->router_rules);
  str("ESBD_PACKAGE_INDEX", &c->packages.index_url);
  str("ESB_CACHE_DIR", &c->image_cache);
  if (const char* v = getenv_fn("ESBD_IMAGE_DEFAULT"); v && *v) c->images["default"] = v;
  if (const char* v = getenv_fn("ESBD_POOL_SIZE"); v && *v) {
    if (!absl::SimpleAtoi(v, &c->pool_size) || c->pool_size < 0)
      return absl::InvalidArgumentError("ESBD_POOL_SIZE must be a non-negative integer");
  }
  if (const char* v = getenv_fn("ESBD_DEFAULT_TTL"); v && *v) {
    if (!absl::SimpleAtoi(v, &c->default_ttl_s) || c->default_ttl_s <= 0)
      return absl::InvalidArgumentError("ESBD_DEFAULT_TTL must be a positive integer (s)");
  }
  return absl::OkStatus();
}

const governance::EgressPolicy& EgressConfig::DefaultPolicyFor(const std::string& tenant) const {
  auto it = tenant_default_policy.find(tenant);
  return it == tenant_default_policy.end() ? default_policy : it->second;
}

governance::IntentCatalogue EgressConfig::IntentsFor(const std::string& tenant) const {
  governance::IntentCatalogue out = intents;
  if (auto it = tenant_intents.find(tenant); it != tenant_intents.end()) {
    for (const auto& [name, def] : it->second) out[name] = def;
  }
  return out;
}

absl::Status AddEgressResolve(std::string_view spec, EgressConfig* egress) {
  size_t eq = spec.find('=');
  if (eq == std::string_view::npos || eq == 0)
    return absl::InvalidArgumentError(
        absl::StrCat("--egress-resolve needs NAME=HOST:PORT, got '", AbslView(spec), "'"));
  std::string name = absl::AsciiStrToLower(std::string(spec.substr(0, eq)));
  std::string target(spec.substr(eq + 1));
  if (absl::Status st = CheckResolveTarget("--egress-resolve", name, target); !st.ok()) return st;
  egress->resolve[name] = target;
  return absl::OkStatus();
}

absl::Status ParseListen(const std::string& listen, std::string* host, uint16_t* port) {
  size_t colon = listen.rfind(':');
  if (colon == std::string::npos || colon + 1 >= listen.size())
    return absl::InvalidArgumentError(absl::StrCat("listen address '", listen,
                                                   "' must be HOST:PORT"));
  std::string h = listen.substr(0, colon);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  if (h.empty()) return absl::InvalidArgumentError("listen address has an empty host");
  int p = 0;
  if (!absl::SimpleAtoi(listen.substr(colon + 1), &p) || p < 0 || p > 65535)
    return absl::InvalidArgumentError(absl::StrCat("listen address '", listen,
                                                   "' has a bad port"));
  *host = h;
  *port = static_cast<uint16_t>(p);
  return absl::OkStatus();
}

}  // namespace esb

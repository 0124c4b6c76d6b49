#include "exe/flags.h"

#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace esb {

const char kEsbdUsage[] = R"(esbd — the EnterSandBox daemon

Usage:
  esbd [--listen HOST:PORT] [--state-dir DIR] [--config FILE] [--unix-socket PATH|none]
       [--image NAME=ROOTFS_DIR]... [--image-cache DIR] [--runtime auto|crun|runc]
       [--pool-size N] [--default-ttl SECONDS] [--log-level debug|info|warn|error]
       [--python-wasm DIR] [--nano-worker PATH] [--router-rules FILE]
       [--egress-resolve NAME=HOST:PORT]... [--egress-upstream-ca FILE]
  esbd keys add --tenant TENANT [--name NAME]     create an API key (printed once)
  esbd keys list                                  list API keys (ids, tenants; never secrets)
  esbd keys revoke KEY_ID                         revoke a key
  esbd cleanup                                    destroy every environment recorded in the
                                                  state dir (the daemon must not be running)
  esbd mcp-stdio [--url URL] [--socket PATH]      an MCP stdio server (newline-delimited
                                                  JSON-RPC on stdin/stdout) for a running esbd:
                                                  its unix socket by default, or --url with the
                                                  API key from ESB_API_KEY

MCP: esbd serves MCP (2025-11-25 sessions and the stateless 2026-07-28) at /mcp with the same
API keys as REST; limits and allowed browser origins in the config's "mcp" object.
--mcp-conformance-fixtures (TEST ONLY, off by default) adds the official conformance suite's
fixture tools (test_simple_text, ...) to /mcp.

Egress (environments created with a network policy): --egress-resolve makes the egress proxy
send NAME to HOST:PORT instead of resolving it (tests, air-gapped sites; config
egress.resolve); --egress-upstream-ca adds PEM roots the proxy trusts upstream (config
egress.upstream_ca).

Images: with no --image / --python-wasm (or their variables), esbd runs the newest complete
build `make images` wrote to the image cache (--image-cache, ESB_CACHE_DIR, default
/var/cache/entersandbox) and logs which one.

Environment: ESBD_LISTEN, ESBD_STATE_DIR, ESBD_CONFIG, ESBD_UNIX_SOCKET, ESBD_IMAGE_DEFAULT,
ESBD_RUNTIME, ESBD_POOL_SIZE, ESBD_DEFAULT_TTL, ESBD_LOG_LEVEL, ESBD_AGENT_BINARY,
ESBD_PYTHON_WASM (nano tier artefact dir), ESBD_NANO_WORKER, ESBD_ROUTER_RULES, ESB_CACHE_DIR.
Flags win over the environment, which wins over the config file.
)";

namespace {

// "--name VALUE" or "--name=VALUE" at args[*i]; advances *i past a separate value.
absl::StatusOr<bool> TakeValue(const std::vector<std::string>& args, size_t* i, const char* name,
                               std::string* value) {
  const std::string& a = args[*i];
  std::string flag = absl::StrCat("--", name);
  if (a == flag) {
    if (*i + 1 >= args.size())
      return absl::InvalidArgumentError(absl::StrCat(flag, " needs a value"));
    *value = args[++*i];
    return true;
  }
  if (a.size() > flag.size() && a.compare(0, flag.size(), flag) == 0 && a[flag.size()] == '=') {
    *value = a.substr(flag.size() + 1);
    return true;
  }
  return false;
}

template <typename T>
absl::Status ToCount(const std::string& v, const char* name, T* out) {
  int64_t n = 0;
  if (!absl::SimpleAtoi(v, &n) || n < 0 || n > std::numeric_limits<T>::max())
    return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a non-negative number"));
  *out = static_cast<T>(n);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CommandLine> ParseCommandLine(
    const std::vector<std::string>& args, const std::function<const char*(const char*)>& getenv_fn,
    DaemonConfig* c) {
  CommandLine out;
  if (const char* v = getenv_fn("ESBD_CONFIG"); v && *v) out.config_path = v;
  // --config first (file < environment < flags), up to the command.
  for (size_t i = 0; i < args.size(); ++i) {
    std::string v;
    auto took = TakeValue(args, &i, "config", &v);
    if (!took.ok()) return took.status();
    if (*took) out.config_path = v;
  }
  if (!out.config_path.empty()) {
    if (absl::Status st = LoadConfigFile(out.config_path, c); !st.ok()) return st;
  }
  if (absl::Status st = ApplyEnvironment(getenv_fn, c); !st.ok()) return st;

  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help") {
      out.help = true;
      continue;
    }
    if (a == "--version") {
      out.version = true;
      continue;
    }
    if (a == "--mcp-conformance-fixtures" && out.command.empty()) {
      out.mcp_conformance_fixtures = true;
      continue;
    }
    if (a.rfind("--", 0) != 0) {  // a word of the command
      out.command.push_back(a);
      continue;
    }
    struct StringFlag {
      const char* name;
      std::string* field;
    };
    const StringFlag kStrings[] = {
        {"config", &out.config_path},       {"listen", &c->listen},
        {"state-dir", &c->state_dir},       {"unix-socket", &c->unix_socket},
        {"runtime", &c->container_runtime}, {"log-level", &c->log_level},
        {"agent-binary", &c->agent_binary}, {"python-wasm", &c->python_wasm},
        {"nano-worker", &c->nano_worker},   {"router-rules", &c->router_rules},
        {"image-cache", &c->image_cache},   {"egress-upstream-ca", &c->egress.upstream_ca},
    };
    bool matched = false;
    std::string value;
    for (const StringFlag& f : kStrings) {
      auto took = TakeValue(args, &i, f.name, &value);
      if (!took.ok()) return took.status();
      if (*took) {
        *f.field = value;
        matched = true;
        break;
      }
    }
    if (matched) continue;
    absl::StatusOr<bool> took = TakeValue(args, &i, "image", &value);
    if (!took.ok()) return took.status();
    if (*took) {
      size_t eq = value.find('=');
      if (eq == std::string::npos || eq == 0)
        return absl::InvalidArgumentError("--image needs NAME=ROOTFS_DIR");
      c->images[value.substr(0, eq)] = value.substr(eq + 1);
      continue;
    }
    if (took = TakeValue(args, &i, "egress-resolve", &value); !took.ok()) return took.status();
    if (*took) {
      if (absl::Status st = AddEgressResolve(value, &c->egress); !st.ok()) return st;
      continue;
    }
    if (took = TakeValue(args, &i, "pool-size", &value); !took.ok()) return took.status();
    if (*took) {
      if (absl::Status st = ToCount(value, "pool-size", &c->pool_size); !st.ok()) return st;
      continue;
    }
    if (took = TakeValue(args, &i, "default-ttl", &value); !took.ok()) return took.status();
    if (*took) {
      if (absl::Status st = ToCount(value, "default-ttl", &c->default_ttl_s); !st.ok()) return st;
      continue;
    }
    // Not a daemon flag: after the command's first word it is the command's own
    // (`keys add --tenant T`); before it, a mistake.
    if (!out.command.empty()) {
      out.command.push_back(a);
      continue;
    }
    return absl::InvalidArgumentError(absl::StrCat("unknown flag '", a, "' (see --help)"));
  }
  if (c->log_level != "debug" && c->log_level != "info" && c->log_level != "warn" &&
      c->log_level != "error") {
    return absl::InvalidArgumentError(
        absl::StrCat("log level '", c->log_level, "' is not debug, info, warn or error"));
  }
  return out;
}

}  // namespace esb

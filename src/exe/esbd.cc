// esbd: wiring only. Reads configuration, opens the store, builds the drivers, the core and the
// HTTP API, and runs until SIGTERM/SIGINT.
#include <malloc.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "api/http_server.h"
#include "api/run_service.h"
#include "api/service.h"
#include "common/host_memory.h"
#include "common/util.h"
#include "core/config.h"
#include "core/environment_manager.h"
#include "core/metrics.h"
#include "drivers/container/container_driver.h"
#include "drivers/nano/nano_driver.h"
#include "router/rules.h"
#include "storage/store.h"

namespace {

constexpr char kUsage[] = R"(esbd — the EnterSandBox daemon

Usage:
  esbd [--listen HOST:PORT] [--state-dir DIR] [--config FILE] [--unix-socket PATH|none]
       [--image NAME=ROOTFS_DIR]... [--runtime auto|crun|runc] [--pool-size N]
       [--default-ttl SECONDS] [--log-level debug|info|warn|error]
       [--python-wasm DIR] [--nano-worker PATH] [--router-rules FILE]
  esbd keys add --tenant TENANT [--name NAME]     create an API key (printed once)
  esbd keys list                                  list API keys (ids, tenants; never secrets)
  esbd keys revoke KEY_ID                         revoke a key
  esbd cleanup                                    destroy every environment recorded in the
                                                  state dir (the daemon must not be running)

Environment: ESBD_LISTEN, ESBD_STATE_DIR, ESBD_CONFIG, ESBD_UNIX_SOCKET, ESBD_IMAGE_DEFAULT,
ESBD_RUNTIME, ESBD_POOL_SIZE, ESBD_DEFAULT_TTL, ESBD_LOG_LEVEL, ESBD_AGENT_BINARY,
ESBD_PYTHON_WASM (nano tier artefact dir), ESBD_NANO_WORKER, ESBD_ROUTER_RULES.
Flags win over the environment, which wins over the config file.
)";

int Fail(const std::string& message) {
  std::cerr << "esbd: " << message << "\n";
  return 2;
}

std::string SelfDir() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? "." : p.parent_path().string();
}

// Parses flags into `c`; returns the remaining positional args.
absl::StatusOr<std::vector<std::string>> ParseFlags(int argc, char** argv, esb::DaemonConfig* c,
                                                    std::string* config_path) {
  std::vector<std::string> rest;
  // Two passes: --config first (file < env < flags), then everything else.
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--config" && i + 1 < argc) *config_path = argv[i + 1];
    else if (a.rfind("--config=", 0) == 0) *config_path = a.substr(9);
  }
  if (!config_path->empty()) {
    if (absl::Status st = esb::LoadConfigFile(*config_path, c); !st.ok()) return st;
  }
  if (absl::Status st = esb::ApplyEnvironment([](const char* n) { return std::getenv(n); }, c);
      !st.ok())
    return st;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    std::string value;
    auto take = [&](const char* name) -> bool {
      std::string flag = absl::StrCat("--", name);
      if (a == flag) {
        if (i + 1 >= argc) return false;
        value = argv[++i];
        return true;
      }
      if (a.rfind(flag + "=", 0) == 0) {
        value = a.substr(flag.size() + 1);
        return true;
      }
      return false;
    };
    auto to_int = [&](const std::string& v, const char* name, auto* out) -> absl::Status {
      char* end = nullptr;
      long long n = std::strtoll(v.c_str(), &end, 10);
      if (v.empty() || *end || n < 0)
        return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a number"));
      *out = static_cast<std::remove_pointer_t<decltype(out)>>(n);
      return absl::OkStatus();
    };
    if (take("config")) continue;
    if (take("listen")) c->listen = value;
    else if (take("state-dir")) c->state_dir = value;
    else if (take("unix-socket")) c->unix_socket = value;
    else if (take("runtime")) c->container_runtime = value;
    else if (take("log-level")) c->log_level = value;
    else if (take("agent-binary")) c->agent_binary = value;
    else if (take("python-wasm")) c->python_wasm = value;
    else if (take("nano-worker")) c->nano_worker = value;
    else if (take("router-rules")) c->router_rules = value;
    else if (take("image")) {
      size_t eq = value.find('=');
      if (eq == std::string::npos || eq == 0)
        return absl::InvalidArgumentError("--image needs NAME=ROOTFS_DIR");
      c->images[value.substr(0, eq)] = value.substr(eq + 1);
    } else if (take("pool-size")) {
      if (auto st = to_int(value, "pool-size", &c->pool_size); !st.ok()) return st;
    } else if (take("default-ttl")) {
      if (auto st = to_int(value, "default-ttl", &c->default_ttl_s); !st.ok()) return st;
    } else if (a == "-h" || a == "--help") {
      rest.push_back("help");
    } else if (a == "--version") {
      rest.push_back("version");
    } else if (a.rfind("--", 0) == 0 && rest.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag '", a, "' (see --help)"));
    } else {
      rest.push_back(a);
    }
  }
  return rest;
}

int KeysCommand(esb::Store* store, const std::vector<std::string>& args) {
  if (args.size() < 2) return Fail("usage: esbd keys add|list|revoke ...");
  const std::string& cmd = args[1];
  if (cmd == "add") {
    std::string tenant, name;
    for (size_t i = 2; i + 1 < args.size(); i += 2) {
      if (args[i] == "--tenant") tenant = args[i + 1];
      else if (args[i] == "--name") name = args[i + 1];
      else return Fail(absl::StrCat("keys add: unknown argument '", args[i], "'"));
    }
    if (tenant.empty()) return Fail("keys add: --tenant is required");
    std::string secret;
    auto rec = store->CreateApiKey(tenant, name, &secret);
    if (!rec.ok()) return Fail(rec.status().ToString());
    std::cout << "key_id: " << rec->key_id << "\ntenant: " << rec->tenant << "\napi_key: "
              << secret << "\n(the api_key is shown only once; esbd stores only its hash)\n";
    return 0;
  }
  if (cmd == "list") {
    auto keys = store->ListApiKeys();
    if (!keys.ok()) return Fail(keys.status().ToString());
    std::printf("%-28s %-20s %-16s %-25s %s\n", "KEY_ID", "TENANT", "NAME", "CREATED", "STATE");
    for (const auto& k : *keys)
      std::printf("%-28s %-20s %-16s %-25s %s\n", k.key_id.c_str(), k.tenant.c_str(),
                  k.name.c_str(), esb::FormatRfc3339(k.created_ms).c_str(),
                  k.revoked ? "revoked" : "active");
    return 0;
  }
  if (cmd == "revoke" && args.size() == 3) {
    if (absl::Status st = store->RevokeApiKey(args[2]); !st.ok()) return Fail(st.ToString());
    std::cout << "revoked " << args[2] << "\n";
    return 0;
  }
  return Fail("usage: esbd keys add --tenant T [--name N] | keys list | keys revoke KEY_ID");
}

}  // namespace

int main(int argc, char** argv) {
  // Large buffers (request bodies, answers, file chunks) come and go in bursts. glibc's dynamic
  // thresholds would serve them from per-thread heaps it keeps (up to 64 MiB of free top chunk
  // each) after they are freed; fixed thresholds map every buffer of 1 MiB or more on its own
  // and unmap it when freed, so RSS falls back after a burst.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  mallopt(M_TRIM_THRESHOLD, 8 << 20);
  esb::DaemonConfig config;
  std::string config_path = std::getenv("ESBD_CONFIG") ? std::getenv("ESBD_CONFIG") : "";
  auto rest = ParseFlags(argc, argv, &config, &config_path);
  if (!rest.ok()) return Fail(std::string(rest.status().message()));
  if (!rest->empty() && (*rest)[0] == "help") {
    std::cout << kUsage;
    return 0;
  }
  if (!rest->empty() && (*rest)[0] == "version") {
    std::cout << "esbd " << ESB_VERSION << "\n";
    return 0;
  }
  if (config.log_level == "debug") esb::SetLogLevel(esb::LogLevel::kDebug);
  else if (config.log_level == "warn") esb::SetLogLevel(esb::LogLevel::kWarn);
  else if (config.log_level == "error") esb::SetLogLevel(esb::LogLevel::kError);
  if (absl::Status st = esb::ResolveMemoryLimits(esb::HostMemoryMb(), &config); !st.ok())
    return Fail(std::string(st.message()));
  // SECURITY: the kernel's OOM killer picks sandboxes (oom_score_adj 500, oci_spec) and never
  // esbd first; sandbox memory is also capped below the host's RAM (container driver).
  if (FILE* f = std::fopen("/proc/self/oom_score_adj", "we")) {
    if (std::fputs("-500", f) < 0 || std::fclose(f) != 0) {
      esb::LogWarn(absl::StrCat("cannot lower esbd's oom_score_adj to -500 (needs ",
                                "CAP_SYS_RESOURCE): ", std::strerror(errno)));
    }
  } else {
    esb::LogWarn(absl::StrCat("cannot open /proc/self/oom_score_adj: ", std::strerror(errno)));
  }

  std::error_code ec;
  std::filesystem::create_directories(config.state_dir, ec);
  if (ec) return Fail(absl::StrCat("cannot create state dir ", config.state_dir, ": ", ec.message()));
  std::string state_dir = std::filesystem::absolute(config.state_dir).lexically_normal().string();
  ::chmod(state_dir.c_str(), 0700);

  esb::StoreOptions sopts;
  sopts.retention_s = config.audit.retention_days * 86400;
  sopts.max_audit_rows_per_tenant = config.audit.max_rows_per_tenant;
  sopts.audit_rate_per_s = static_cast<double>(config.audit.rate_per_second);
  sopts.audit_burst = static_cast<double>(config.audit.burst);
  sopts.max_detail_bytes = static_cast<size_t>(config.audit.max_detail_bytes);
  sopts.audit_query_timeout_ms = config.audit.query_timeout_ms;
  auto store = esb::Store::Open(state_dir + "/esbd.db", sopts);
  if (!store.ok()) return Fail(absl::StrCat("opening the state database: ", store.status().ToString()));

  if (!rest->empty()) {
    if ((*rest)[0] == "keys") return KeysCommand(store->get(), *rest);
    if ((*rest)[0] != "cleanup")
      return Fail(absl::StrCat("unknown command '", (*rest)[0], "' (see --help)"));
  }

  for (const auto& k : config.keys) {
    if (absl::Status st = (*store)->ImportApiKey(k.tenant, k.key, k.name); !st.ok())
      return Fail(absl::StrCat("importing API key for tenant ", k.tenant, ": ", st.ToString()));
  }

  std::string host;
  uint16_t port = 0;
  if (absl::Status st = esb::ParseListen(config.listen, &host, &port); !st.ok())
    return Fail(std::string(st.message()));

  // Block the shutdown signals before any thread starts, so only sigwait() below sees them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  // Drivers.
  esb::api::ServiceOptions service_options;
  service_options.images = config.images;
  service_options.max_output_bytes = config.max_output_bytes;
  service_options.max_upload_bytes = config.max_upload_bytes;
  service_options.host_cpus = static_cast<int>(std::thread::hardware_concurrency());
  service_options.max_pids = config.max_pids;
  service_options.max_memory_mb = config.max_memory_mb;
  service_options.max_disk_mb = config.max_disk_mb;
  std::vector<std::unique_ptr<esb::Driver>> owned;
  std::map<std::string, esb::Driver*> drivers;
  esb::ContainerDriverOptions copts;
  copts.state_dir = state_dir + "/container";
  copts.agent_binary =
      config.agent_binary.empty() ? SelfDir() + "/esb-agent" : config.agent_binary;
  copts.images = config.images;
  copts.runtime = config.container_runtime;
  copts.max_pids = config.max_pids;
  copts.max_memory_mb = config.max_memory_mb;
  copts.max_disk_mb = config.max_disk_mb;
  copts.total_memory_mb = config.sandbox_memory_mb;
  copts.user_namespaces = config.user_namespaces;
  copts.userns_uid_base = static_cast<uint32_t>(config.userns_uid_base);
  // Ranges above the base up to 2^31 (tools treat uids as signed 32-bit numbers).
  copts.userns_slots = static_cast<uint32_t>(
      std::min<int64_t>(4096, ((1LL << 31) - config.userns_uid_base) / 65536));
  if (config.images.empty()) {
    service_options.unavailable_runtimes["container"] =
        "no image configured (build one with `make images`, then pass --image "
        "default=DIR or ESBD_IMAGE_DEFAULT)";
  } else if (auto d = esb::NewContainerDriver(copts); d.ok()) {
    drivers["container"] = d->get();
    service_options.driver_descriptions["container"] = (*d)->Describe();
    esb::UsernsStatus userns = esb::ContainerUsernsStatus(**d);
    service_options.userns["container"] = {userns.enabled, userns.reason};
    owned.push_back(std::move(*d));
  } else {
    service_options.unavailable_runtimes["container"] = std::string(d.status().message());
    esb::LogError(absl::StrCat("container driver unavailable: ", d.status().ToString()));
  }
  if (!config.images.empty()) {
    esb::ContainerDriverOptions gopts = copts;
    gopts.runtime = "runsc";
    gopts.state_dir = state_dir + "/gvisor";
    if (auto d = esb::NewContainerDriver(gopts); d.ok()) {
      drivers["gvisor"] = d->get();
      service_options.driver_descriptions["gvisor"] = (*d)->Describe();
      esb::UsernsStatus userns = esb::ContainerUsernsStatus(**d);
      service_options.userns["gvisor"] = {userns.enabled, userns.reason};
      owned.push_back(std::move(*d));
    } else {
      service_options.unavailable_runtimes["gvisor"] = std::string(d.status().message());
      esb::LogInfo(absl::StrCat("gvisor runtime unavailable: ", d.status().message()));
    }
  }
  // Nano tier: CPython on wasm in seccomp-confined workers forked by a fork server.
  std::unique_ptr<esb::NanoDriver> nano;
  {
    std::string worker =
        config.nano_worker.empty() ? SelfDir() + "/esb-nano-worker" : config.nano_worker;
    std::error_code exists_ec;
    if (config.python_wasm.empty()) {
      service_options.unavailable_runtimes["nano"] =
          "no python.wasm artefact configured (make images; --python-wasm DIR or "
          "ESBD_PYTHON_WASM)";
    } else if (!std::filesystem::exists(worker, exists_ec)) {
      service_options.unavailable_runtimes["nano"] =
          absl::StrCat("nano worker binary ", worker, " is missing (rebuild after make images)");
    } else if (auto nopts = esb::PythonNanoOptions(worker, config.python_wasm); !nopts.ok()) {
      service_options.unavailable_runtimes["nano"] = std::string(nopts.status().message());
    } else {
      // The nano tier's cgroup gets its own share of the host's sandbox memory budget.
      nopts->cgroup_memory_mb = config.nano_memory_mb;
      esb::LogInfo(absl::StrCat("nano tier: memory limit of its cgroup ", nopts->cgroup_name,
                                " = ", config.nano_memory_mb, " MiB"));
      nano = esb::NewNanoDriver(*nopts);
      drivers["nano"] = nano.get();
      service_options.driver_descriptions["nano"] = nano->Describe();
    }
  }
  service_options.unavailable_runtimes["microvm"] =
      "the microvm driver is not built yet: KVM on this host cannot boot guests (see "
      "docs/design.md)";

  if (!rest->empty() && (*rest)[0] == "cleanup") {
    auto live = (*store)->ListLiveEnvironments();
    if (!live.ok()) return Fail(live.status().ToString());
    int failed = 0;
    for (esb::EnvironmentRecord rec : *live) {
      auto it = drivers.find(rec.runtime);
      if (it != drivers.end()) {
        absl::Status st = it->second->Destroy({rec.id, rec.runtime, rec.driver_state});
        if (!st.ok()) {
          ++failed;
          std::cerr << "esbd: destroying " << rec.id << ": " << st << "\n";
          continue;
        }
      }
      rec.state = "destroyed";
      rec.destroyed_ms = esb::NowUnixMs();
      if (rec.destroy_reason.empty()) rec.destroy_reason = "cleanup";
      (*store)->PutEnvironment(rec).IgnoreError();
      std::cout << "destroyed " << rec.id << "\n";
    }
    return failed ? 1 : 0;
  }

  esb::Metrics metrics;
  esb::ManagerOptions mopts;
  mopts.default_ttl_s = config.default_ttl_s;
  mopts.max_ttl_s = config.max_ttl_s;
  mopts.pool_size = config.pool_size;
  mopts.max_environments = config.max_environments;
  mopts.max_environments_per_tenant = config.max_environments_per_tenant;
  mopts.default_spec = config.defaults;
  esb::EnvironmentManager manager(store->get(), drivers, &metrics, mopts);
  if (absl::Status st = manager.Start(); !st.ok())
    return Fail(absl::StrCat("starting the environment manager: ", st.ToString()));

  esb::api::HttpServer::Options hopts;
  hopts.host = host;
  hopts.port = port;
  hopts.unix_socket_path = config.unix_socket.empty() ? state_dir + "/esbd.sock"
                           : config.unix_socket == "none" ? ""
                                                          : config.unix_socket;
  hopts.max_connections = config.max_connections;
  hopts.max_body_bytes = static_cast<uint64_t>(config.max_json_body_bytes);
  hopts.max_buffered_body_bytes = static_cast<uint64_t>(config.max_buffered_body_bytes);
  hopts.max_buffered_header_bytes = static_cast<uint64_t>(config.max_buffered_header_bytes);
  // Fair shares per tenant (0: a quarter of the whole, but always room for one request and
  // one body of the largest size a tenant may send).
  hopts.max_requests_per_principal = config.max_requests_per_tenant > 0
                                         ? config.max_requests_per_tenant
                                         : std::max(1, config.max_connections / 4);
  hopts.max_buffered_body_bytes_per_principal = static_cast<uint64_t>(
      config.max_buffered_body_bytes_per_tenant > 0
          ? config.max_buffered_body_bytes_per_tenant
          : std::min(config.max_buffered_body_bytes,
                     std::max(config.max_buffered_body_bytes / 4, config.max_json_body_bytes)));
  hopts.min_write_bytes_per_second = static_cast<uint64_t>(config.min_transfer_bytes_per_second);
  hopts.min_read_bytes_per_second = static_cast<uint64_t>(config.min_transfer_bytes_per_second);
  hopts.min_rate_grace = std::chrono::milliseconds(config.min_transfer_grace_ms);
  hopts.max_buffered_response_bytes = static_cast<uint64_t>(config.max_buffered_response_bytes);
  hopts.access_log_lines_per_second = static_cast<int>(config.access_log_lines_per_second);
  hopts.on_response = [&metrics](const esb::api::Request&, int status, int64_t) {
    metrics.CountHttp(status);
  };
  // Every open client connection costs one fd, idle ones included: take all the fds the hard
  // limit allows (children could raise their soft limit to it anyway). The server caps open
  // connections at half the soft limit and closes the oldest idle one beyond that.
  if (rlimit rl{}; getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
      esb::LogWarn(absl::StrCat("raising RLIMIT_NOFILE: ", std::strerror(errno)));
  }
  esb::api::HttpServer server(hopts);
  esb::api::ApiService service(&manager, store->get(), &metrics, service_options);
  // The adaptive router's rules (reloaded when the file changes).
  std::string rules_path =
      config.router_rules.empty() ? std::string(ESB_SOURCE_DIR) + "/config/router.json"
                                  : config.router_rules;
  std::unique_ptr<esb::router::RulesHolder> rules;
  if (auto holder = esb::router::RulesHolder::Create(rules_path); holder.ok()) {
    rules = std::move(*holder);
    esb::LogInfo(absl::StrCat("router rules: ", rules_path));
  } else {
    esb::LogWarn(absl::StrCat("router rules unavailable (", holder.status().message(),
                              "): runtime auto tries nano first and falls back to heavy"));
  }
  // Artifacts (figures, files under /workspace/artifacts) are kept on the host.
  esb::ArtifactStore::Options aopts;
  aopts.dir = state_dir + "/artifacts";
  aopts.ttl_s = config.artifacts.ttl_s;
  aopts.max_artifact_bytes = config.artifacts.max_artifact_mb << 20;
  aopts.max_tenant_bytes = config.artifacts.max_tenant_mb << 20;
  auto artifacts = esb::ArtifactStore::Open(aopts);
  if (!artifacts.ok())
    return Fail(absl::StrCat("artifact store: ", artifacts.status().message()));
  service.SetArtifactStore(artifacts->get());
  // `packages`: wheels from the configured index, cached on the host. With no index, only
  // requirements the image already satisfies are accepted.
  esb::packages::BeastHttpFetcher fetcher(config.packages.ca_file);
  std::unique_ptr<esb::packages::WheelCache> wheels;
  if (!config.packages.index_url.empty()) {
    // The fetcher re-reads the CA bundle on every fetch (rotation without a restart), but a
    // bundle that is missing at start is a configuration mistake: say so now, not at the
    // first install.
    if (!config.packages.ca_file.empty() && access(config.packages.ca_file.c_str(), R_OK) != 0) {
      return Fail(absl::StrCat("packages.ca_file '", config.packages.ca_file,
                               "' cannot be read: ", std::strerror(errno)));
    }
    esb::packages::WheelCache::Options wopts;
    wopts.index_url = config.packages.index_url;
    wopts.cache_dir = config.packages.cache_dir.empty() ? state_dir + "/wheels"
                                                        : config.packages.cache_dir;
    wopts.allowed_hosts = config.packages.allowed_hosts;
    wopts.index_ttl = std::chrono::seconds(config.packages.index_ttl_s);
    wopts.max_wheel_bytes = config.packages.max_wheel_mb << 20;
    wopts.max_cache_bytes = config.packages.max_cache_mb << 20;
    wheels = std::make_unique<esb::packages::WheelCache>(wopts, &fetcher);
    if (!wheels->init_status().ok())
      return Fail(absl::StrCat("packages: ", wheels->init_status().message()));
    esb::LogInfo(absl::StrCat("packages: index ", config.packages.index_url, ", wheel cache ",
                              wopts.cache_dir));
  }
  esb::api::PackageInstaller::Options iopts;
  iopts.timeout_ms = config.packages.timeout_s * 1000;
  esb::api::PackageInstaller installer(
      &manager, wheels.get(), iopts,
      [&service](const std::string& tenant, const std::string& env_id,
                 const esb::packages::Wheel& w) {
        service.Audit(tenant, env_id, "package.fetch",
                      absl::StrCat(w.name, "==", w.version, " ", w.filename), std::nullopt, 0,
                      w.size, 200);
      });
  esb::api::RunDeps run_deps;
  run_deps.manager = &manager;
  run_deps.service = &service;
  run_deps.nano = nano.get();
  run_deps.rules = rules.get();
  run_deps.artifacts = artifacts->get();
  run_deps.installer = &installer;
  service.SetRunHandler(esb::api::MakeRunHandler(run_deps));
  service.Register(server.router());
  if (absl::Status st = server.Start(); !st.ok()) {
    manager.Stop();
    return Fail(absl::StrCat("cannot listen on ", config.listen, ": ", st.message()));
  }

  // Start the nano fork server now (it instantiates the interpreter once), so the first
  // user's run does not pay for it.
  std::thread nano_warmup;
  if (nano) {
    nano_warmup = std::thread([&nano] {
      int64_t t0 = esb::MonotonicMs();
      esb::RunRequest warm;
      warm.code = "pass";
      auto r = nano->Run(nullptr, warm);
      if (r.ok()) esb::LogInfo(absl::StrCat("nano tier warm in ", esb::MonotonicMs() - t0, " ms"));
      else esb::LogWarn(absl::StrCat("nano warm-up failed: ", r.status().ToString()));
    });
  }

  auto keys = (*store)->CountActiveApiKeys();
  bool loopback = host == "127.0.0.1" || host == "::1" || host == "localhost";
  if (keys.ok() && *keys == 0) {
    esb::LogWarn("==================================================================");
    esb::LogWarn("DEV MODE: no API keys configured. Only loopback/unix-socket clients");
    esb::LogWarn("are served, all as tenant 'default'. Create keys with `esbd keys add`.");
    esb::LogWarn("==================================================================");
  }
  if (!loopback) esb::LogWarn(absl::StrCat("listening on a non-loopback address: ", host));
  esb::LogInfo(absl::StrCat("esbd ", ESB_VERSION, " listening on http://", host, ":",
                            server.tcp_port(),
                            hopts.unix_socket_path.empty() ? ""
                                                           : " and unix:" + hopts.unix_socket_path,
                            " (state: ", state_dir, ")"));
  for (const auto& [name, desc] : service_options.driver_descriptions)
    esb::LogInfo(absl::StrCat("driver ", name, ": ", desc));
  for (const auto& [name, why] : service_options.unavailable_runtimes)
    esb::LogInfo(absl::StrCat("runtime ", name, " unavailable: ", why));

  int sig = 0;
  sigwait(&signals, &sig);
  esb::LogInfo(absl::StrCat("received ", strsignal(sig), "; shutting down (environments keep "
                            "running and are re-attached on the next start)"));
  if (nano_warmup.joinable()) nano_warmup.join();
  server.Stop();
  manager.Stop();
  esb::LogInfo("bye");
  return 0;
}

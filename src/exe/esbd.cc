// esbd: wiring only. Reads the command line and configuration (exe/flags.h), opens the store,
// registers the drivers (core/driver_registry.h), builds the core and the HTTP API, and runs
// until SIGTERM/SIGINT. `esbd keys` (exe/keys_command.h) and `esbd cleanup` (core/recovery.h)
// run against the same state dir.
#include <malloc.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "api/http_server.h"
#include "api/mcp/conformance_fixtures.h"
#include "api/mcp/esb_tools.h"
#include "api/mcp/mcp_endpoint.h"
#include "api/run_service.h"
#include "api/service.h"
#include "common/host_memory.h"
#include "common/util.h"
#include "core/config.h"
#include "core/driver_registry.h"
#include "core/egress_proxy.h"
#include "core/environment_manager.h"
#include "core/image_discovery.h"
#include "core/mcp_hosts/hosts.h"
#include "core/metrics.h"
#include "core/recovery.h"
#include "core/snapshots/blob_store.h"
#include "core/tools/tool_gate.h"
#include "drivers/container/container_driver.h"
#include "drivers/nano/nano_driver.h"
#include "exe/flags.h"
#include "exe/keys_command.h"
#include "exe/mcp_stdio.h"
#include "governance/tls/ca.h"
#include "router/rules.h"
#include "storage/store.h"

namespace {

int Fail(const std::string& message) {
  std::cerr << "esbd: " << message << "\n";
  return 2;
}

std::string SelfDir() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? "." : p.parent_path().string();
}

// Fills the artefacts the configuration leaves unset (no --image default / --python-wasm or
// their variables) from the newest complete `make images` build, and says which one it uses.
void UseImageBuild(esb::DaemonConfig* config) {
  if (config->images.count("default") && !config->python_wasm.empty()) return;
  auto build = esb::FindNewestImageBuild(config->image_cache);
  if (!build.ok()) {
    esb::LogWarn(absl::StrCat("images: ", build.status().message()));
    return;
  }
  esb::LogInfo(absl::StrCat("images: using build ", build->manifest, " (",
                            esb::FormatRfc3339(build->created_unix_ms), ")"));
  if (!config->images.count("default")) {
    config->images["default"] = build->rootfs;
    esb::LogInfo(absl::StrCat("images: default rootfs ", build->rootfs));
  }
  if (config->python_wasm.empty()) {
    config->python_wasm = build->python_wasm;
    esb::LogInfo(absl::StrCat("images: python.wasm ", build->python_wasm));
  }
}

// Registers every driver esbd knows, each probed on this host (container and gVisor share the
// container driver with different OCI runtimes; nano runs CPython on wasm; microvm is not built).
void RegisterDrivers(const esb::DaemonConfig& config, const std::string& state_dir,
                     esb::DriverRegistry* registry, esb::NanoDriver** nano) {
  using Tier = esb::DriverRegistry::Tier;
  esb::ContainerDriverOptions copts;
  copts.state_dir = state_dir + "/container";
  copts.agent_binary = config.agent_binary.empty() ? SelfDir() + "/esb-agent" : config.agent_binary;
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
  esb::ContainerDriverOptions gopts = copts;
  gopts.runtime = "runsc";
  gopts.state_dir = state_dir + "/gvisor";
  if (config.images.empty()) {
    const char* why =
        "no image configured (build one with `make images`, or pass --image default=DIR or "
        "ESBD_IMAGE_DEFAULT)";
    registry->RegisterUnavailable("container", Tier::kHeavy, why);
    registry->RegisterUnavailable("gvisor", Tier::kHeavy, why);
  } else {
    registry->Register("container", Tier::kHeavy, [&] { return esb::NewContainerDriver(copts); });
    registry->Register("gvisor", Tier::kHeavy, [&] { return esb::NewContainerDriver(gopts); });
  }
  // Nano tier: CPython on wasm in seccomp-confined workers forked by a fork server.
  registry->Register("nano", Tier::kNano, [&]() -> absl::StatusOr<std::unique_ptr<esb::Driver>> {
    std::string worker =
        config.nano_worker.empty() ? SelfDir() + "/esb-nano-worker" : config.nano_worker;
    std::error_code ec;
    if (config.python_wasm.empty()) {
      return absl::UnavailableError(
          "no python.wasm artefact configured (make images; --python-wasm DIR or "
          "ESBD_PYTHON_WASM)");
    }
    if (!std::filesystem::exists(worker, ec)) {
      return absl::UnavailableError(
          absl::StrCat("nano worker binary ", worker, " is missing (rebuild after make images)"));
    }
    auto nopts = esb::PythonNanoOptions(worker, config.python_wasm);
    if (!nopts.ok()) return nopts.status();
    // The nano tier's cgroup gets its own share of the host's sandbox memory budget.
    nopts->cgroup_memory_mb = config.nano_memory_mb;
    // Time travel: older steps' memory as compact images (NanoDriver::CompactSnapshot).
    nopts->snapshot_dir = state_dir + "/nano-images";
    esb::LogInfo(absl::StrCat("nano tier: memory limit of its cgroup ", nopts->cgroup_name, " = ",
                              config.nano_memory_mb, " MiB"));
    std::unique_ptr<esb::NanoDriver> d = esb::NewNanoDriver(*nopts);
    *nano = d.get();
    return std::unique_ptr<esb::Driver>(std::move(d));
  });
  registry->RegisterUnavailable(
      "microvm", Tier::kHeavy,
      "the microvm driver is not built yet: KVM on this host cannot boot guests (see "
      "docs/design.md)");
  for (const auto& e : registry->entries()) {
    if (e.driver) {
      esb::LogInfo(
          absl::StrCat("driver ", e.name, " (", esb::DriverTierName(e.tier), "): ", e.description));
    } else {
      esb::LogInfo(absl::StrCat("runtime ", e.name, " unavailable: ", e.unavailable));
    }
  }
}

// The egress proxy's options: esb-proxy next to esbd, the config's resolve overrides and
// upstream roots, and its own uid/gid (the user esb-proxy, else a fixed id below the sandbox
// ranges: refused if the configured ranges cover it).
esb::ProxyEgressOptions EgressOptions(const esb::DaemonConfig& config) {
  esb::ProxyEgressOptions o;
  o.proxy_binary = SelfDir() + "/esb-proxy";
  for (const auto& [name, target] : config.egress.resolve) o.resolve.push_back(name + "=" + target);
  o.upstream_ca = config.egress.upstream_ca;
  const esb::ProxyIdentity id = esb::FindProxyIdentity();
  const int64_t base = config.userns_uid_base;
  const int64_t end = base + std::min<int64_t>(4096, ((1LL << 31) - base) / 65536) * 65536;
  if (config.user_namespaces && id.uid >= base && id.uid < end) {
    esb::LogWarn(absl::StrCat("egress: the proxy's ", id.source, " lies in the sandbox uid ",
                              "ranges (userns_uid_base ", base, "): create the esb-proxy user"));
    o.uid = o.gid = 0;  // Start refuses: egress disabled
  } else {
    o.uid = id.uid;
    o.gid = id.gid;
    esb::LogInfo(absl::StrCat("egress: esb-proxy runs as ", id.source, " (uid ", id.uid, ")"));
  }
  return o;
}

// `esbd cleanup`: the restart-cleanup policy with every environment destroyed.
int CleanupCommand(esb::Store* store, const esb::DriverRegistry& registry) {
  auto outcome = esb::RecoverEnvironments(store, registry.Available(),
                                          esb::RecoveryMode::kDestroyAll, esb::NowUnixMs());
  if (!outcome.ok()) return Fail(outcome.status().ToString());
  for (const std::string& id : outcome->destroyed) std::cout << "destroyed " << id << "\n";
  for (const auto& r : outcome->destroy_failed)
    std::cerr << "esbd: destroying " << r.record.id << " failed; run cleanup again\n";
  return outcome->destroy_failed.empty() ? 0 : 1;
}

}  // namespace

// `esbd mcp-stdio [--url URL] [--socket PATH] [--path /mcp]`: the MCP stdio bridge to a running
// daemon (exe/mcp_stdio.h). stdout carries MCP only; everything else goes to stderr.
int McpStdioCommand(const esb::DaemonConfig& config, const std::vector<std::string>& command) {
  std::string url, socket, path = "/mcp";
  for (size_t i = 1; i < command.size(); ++i) {
    const std::string& a = command[i];
    std::string* target = a == "--url"      ? &url
                          : a == "--socket" ? &socket
                          : a == "--path"   ? &path
                                            : nullptr;
    if (!target || i + 1 >= command.size())
      return Fail(absl::StrCat("mcp-stdio: unknown or incomplete argument '", a,
                               "' (usage: esbd mcp-stdio [--url URL] [--socket PATH])"));
    *target = command[++i];
  }
  esb::McpStdioOptions o;
  o.path = path;
  if (const char* key = std::getenv("ESB_API_KEY"); key && *key) o.api_key = key;
  if (!url.empty()) {
    auto ep = esb::cli::ParseUrl(url);
    if (!ep.ok()) return Fail(absl::StrCat("mcp-stdio: ", ep.status().message()));
    o.endpoint = *ep;
  } else {
    if (socket.empty()) {
      if (config.unix_socket == "none")
        return Fail("mcp-stdio: the daemon has no unix socket (unix_socket none): use --url");
      socket = config.unix_socket.empty()
                   ? (std::filesystem::absolute(config.state_dir) / "esbd.sock").string()
                   : config.unix_socket;
    }
    o.endpoint = esb::cli::UnixEndpoint(socket);
  }
  signal(SIGPIPE, SIG_IGN);
  esb::LogInfo(
      absl::StrCat("mcp-stdio: serving MCP on stdin/stdout for esbd at ", o.endpoint.url, o.path));
  return esb::RunMcpStdio(o, std::cin, std::cout, esb::cli::MakeBeastTransport);
}

// The tools /mcp serves: esbd's (api/mcp/esb_tools.h, every call through the ToolCallGate),
// plus the conformance suite's fixtures when asked (tests only).
std::shared_ptr<esb::tools::ToolProvider> McpTools(std::shared_ptr<esb::tools::ToolProvider> esbd,
                                                   bool conformance_fixtures) {
  if (!conformance_fixtures) return esbd;
  esb::LogWarn("==================================================================");
  esb::LogWarn("TEST ONLY: --mcp-conformance-fixtures: /mcp also serves the MCP");
  esb::LogWarn("conformance suite's fixture tools (test_simple_text, ...).");
  esb::LogWarn("==================================================================");
  return esb::api::mcp::MergeProviders(std::move(esbd), esb::api::mcp::NewConformanceFixtures());
}

int main(int argc, char** argv) {
  // Large buffers (request bodies, answers, file chunks) come and go in bursts. glibc's dynamic
  // thresholds would serve them from per-thread heaps it keeps (up to 64 MiB of free top chunk
  // each) after they are freed; fixed thresholds map every buffer of 1 MiB or more on its own
  // and unmap it when freed, so RSS falls back after a burst.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  mallopt(M_TRIM_THRESHOLD, 8 << 20);
  esb::DaemonConfig config;
  auto cmdline = esb::ParseCommandLine(
      std::vector<std::string>(argv + 1, argv + argc), [](const char* n) { return std::getenv(n); },
      &config);
  if (!cmdline.ok()) return Fail(std::string(cmdline.status().message()));
  if (cmdline->help) {
    std::cout << esb::kEsbdUsage;
    return 0;
  }
  if (cmdline->version) {
    std::cout << "esbd " << ESB_VERSION << "\n";
    return 0;
  }
  const std::vector<std::string>& command = cmdline->command;
  if (config.log_level == "debug") esb::SetLogLevel(esb::LogLevel::kDebug);
  else if (config.log_level == "warn") esb::SetLogLevel(esb::LogLevel::kWarn);
  else if (config.log_level == "error") esb::SetLogLevel(esb::LogLevel::kError);
  if (!command.empty() && command[0] == "mcp-stdio") return McpStdioCommand(config, command);
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
  sopts.egress_rate_per_s = static_cast<double>(config.audit.egress_rate_per_second);
  sopts.egress_burst = static_cast<double>(config.audit.egress_burst);
  sopts.max_egress_stored_bytes_per_tenant = config.audit.egress_stored_mb << 20;
  sopts.max_detail_bytes = static_cast<size_t>(config.audit.max_detail_bytes);
  sopts.audit_query_timeout_ms = config.audit.query_timeout_ms;
  sopts.write_behind_ms = config.audit.write_behind_ms;
  sopts.secret_key_file =
      config.state_key_file.empty() ? state_dir + "/state.key" : config.state_key_file;
  auto store = esb::Store::Open(state_dir + "/esbd.db", sopts);
  if (!store.ok()) return Fail(absl::StrCat("opening the state database: ", store.status().ToString()));

  if (!command.empty()) {
    if (command[0] == "keys")
      return esb::RunKeysCommand(store->get(), command, std::cout, std::cerr);
    if (command[0] != "cleanup")
      return Fail(absl::StrCat("unknown command '", command[0], "' (see --help)"));
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

  // Drivers: the images `make images` built unless configured, then every driver probed.
  UseImageBuild(&config);
  esb::DriverRegistry registry;
  esb::NanoDriver* nano = nullptr;  // the run pipeline still calls nano's Run directly
  RegisterDrivers(config, state_dir, &registry, &nano);
  if (!command.empty() && command[0] == "cleanup") return CleanupCommand(store->get(), registry);

  esb::api::ServiceOptions service_options;
  service_options.images = config.images;
  service_options.drivers = &registry;
  for (const char* name : {"container", "gvisor"}) {
    if (esb::Driver* d = registry.Find(name)) {
      esb::UsernsStatus userns = esb::ContainerUsernsStatus(*d);
      service_options.userns[name] = {userns.enabled, userns.reason};
    }
  }
  service_options.max_output_bytes = config.max_output_bytes;
  service_options.max_upload_bytes = config.max_upload_bytes;
  service_options.limits =
      esb::HostEnvLimitCaps(config.max_memory_mb, config.max_pids, config.max_disk_mb);

  esb::Metrics metrics;
  esb::ManagerOptions mopts;
  mopts.default_ttl_s = config.default_ttl_s;
  mopts.max_ttl_s = config.max_ttl_s;
  mopts.pool_size = config.pool_size;
  mopts.max_environments = config.max_environments;
  mopts.max_environments_per_tenant = config.max_environments_per_tenant;
  mopts.max_volume_mb = config.max_volume_mb;
  mopts.max_volumes_per_tenant = config.max_volumes_per_tenant;
  mopts.max_terminals_per_environment = config.max_terminals_per_environment;
  mopts.max_terminals_per_tenant = config.max_terminals_per_tenant;
  mopts.terminal_idle_timeout_ms = config.terminal_idle_timeout_s * 1000;
  mopts.default_spec = config.defaults;
  // Egress governance: defaults and intent catalogues; esb-proxy beside esbd, started and
  // supervised as its own unprivileged user (core/egress_proxy.h), and a CA per governed
  // environment (governance/tls/ca.h). Its audit rows go through the one audit path.
  mopts.egress_config = config.egress;
  esb::AuditLog egress_audit(store->get(), &metrics);
  esb::ProxyEgressControl egress(
      EgressOptions(config),
      [&egress_audit](const esb::EgressAuditRow& row) { egress_audit.RecordEgress(row); });
  if (absl::Status st = egress.Start(); !st.ok()) {
    esb::LogWarn(absl::StrCat(st.message(), ": environments with a network policy are refused"));
  }
  mopts.egress = &egress;
  service_options.egress = &egress;
  mopts.make_ca = []() -> absl::StatusOr<esb::EgressCaPem> {
    absl::StatusOr<esb::governance::tls::CaPem> ca =
        esb::governance::tls::GenerateCa("EnterSandBox environment CA");
    if (!ca.ok()) return ca.status();
    return esb::EgressCaPem{ca->cert_pem, ca->key_pem};
  };
  // Time travel: the content-addressed blobs of steps (docs/design.md "Time travel").
  esb::DiskBlobStoreOptions bopts;
  bopts.dir = state_dir + "/blobs";
  bopts.max_total_bytes = config.steps.store_mb << 20;
  bopts.max_tenant_bytes = config.steps.max_tenant_mb << 20;
  bopts.max_blob_bytes = config.steps.max_blob_mb << 20;
  mopts.blob_sweep_interval_ms = config.steps.sweep_interval_s * 1000;
  auto blobs = esb::DiskBlobStore::Open(bopts);
  if (!blobs.ok())
    esb::LogWarn(
        absl::StrCat("time travel: ", blobs.status().message(), ": environments record no steps"));
  else
    mopts.blobs = blobs->get();
  esb::EnvironmentManager manager(store->get(), registry.Available(), &metrics, mopts);
  if (absl::Status st = manager.Start(); !st.ok())
    return Fail(absl::StrCat("starting the environment manager: ", st.ToString()));

  esb::api::HttpServer::Options hopts;
  hopts.host = host;
  hopts.port = port;
  hopts.unix_socket_path = config.unix_socket.empty() ? state_dir + "/esbd.sock"
                           : config.unix_socket == "none" ? ""
                                                          : config.unix_socket;
  hopts.max_connections = config.max_connections;
  hopts.io_threads = config.io_threads;
  hopts.max_streams = config.max_streams;
  hopts.max_open_connections_per_peer = config.max_open_connections_per_peer;
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
  // The one gate of every tool call (core/tools/tool_gate.h: DLP, one tool.call audit row).
  esb::tools::ToolCallGate tool_gate(&manager.audit(), esb::tools::DlpPolicyFrom(&manager));
  // MCP servers hosted in sandboxes (core/mcp_hosts): their REST routes, and the function
  // EsbToolsDeps::environment_tools takes: mcp_hosts->EnvironmentProvider.
  auto mcp_hosts = std::make_unique<esb::mcp_hosts::McpHosts>(&manager, config.mcp);
  mcp_hosts->SetCallGate(&tool_gate);
  service.SetMcpHosts(mcp_hosts.get());
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
  esb::packages::PackageInstaller::Options iopts;
  iopts.timeout_ms = config.packages.timeout_s * 1000;
  esb::packages::PackageInstaller installer(&manager, wheels.get(), iopts);
  esb::run::RunPipeline run_pipeline({.manager = &manager,
                                      .rules = rules.get(),
                                      .artifacts = artifacts->get(),
                                      .installer = &installer});
  service.SetRunHandler(esb::api::MakeRunHandler(&run_pipeline));
  service.Register(server.router());
  // MCP at /mcp (docs/api.md "MCP"): the same keys and tenants as REST.
  esb::api::mcp::McpEndpointOptions mcp_options;
  mcp_options.max_sessions = static_cast<int>(config.mcp.max_sessions);
  mcp_options.max_sessions_per_tenant = static_cast<int>(config.mcp.max_sessions_per_tenant);
  mcp_options.session_idle_timeout_ms = config.mcp.session_idle_s * 1000;
  mcp_options.allowed_origins = config.mcp.allowed_origins;
  // Host names this machine (DNS rebinding protection) when only loopback can connect.
  const bool loopback = host == "127.0.0.1" || host == "::1" || host == "localhost";
  mcp_options.loopback_listener = loopback;
  mcp_options.instructions =
      "EnterSandBox: sandboxed environments for running code. Create an environment, then run "
      "commands and code and read and write files in it by its environment_id.";
  // esbd's own tools (api/mcp/esb_tools.h) through the one tool gate built above (the one hosted
  // servers' calls pass too); list_environment_tools / call_environment_tool reach the
  // environment's hosted servers (namespaced "<server>.<tool>").
  esb::mcp_hosts::McpHosts* hosts = mcp_hosts.get();
  auto esbd_tools = std::make_shared<esb::api::mcp::EsbTools>(esb::api::mcp::EsbToolsDeps{
      .manager = &manager,
      .api = &service,
      .gate = &tool_gate,
      .pipeline = &run_pipeline,
      .artifacts = artifacts->get(),
      .environment_tools = [hosts](const esb::Caller& caller, const std::string& environment_id) {
        return hosts->EnvironmentProvider(caller, environment_id);
      }});
  std::shared_ptr<esb::tools::ToolProvider> mcp_tools =
      McpTools(esbd_tools, cmdline->mcp_conformance_fixtures);
  auto mcp = esb::api::mcp::RegisterMcpEndpoint(
      server.router(), "/mcp",
      {.admit = [&service](esb::api::Request& r) { return service.Admit(r, false); },
       .caller_of = [&service](const esb::api::Request& r) { return service.CallerOf(r); }},
      [mcp_tools](const esb::api::Request&, const esb::Caller&)
          -> absl::StatusOr<std::shared_ptr<esb::tools::ToolProvider>> { return mcp_tools; },
      mcp_options);
  // Each MCP server hosted in a sandbox at /environments/{id}/mcp/{name} (docs/api.md "Hosted
  // MCP servers"): the same transport, the hosted server's own tools unchanged; another
  // tenant's environment (or no such server) is 404.
  esb::api::mcp::McpEndpointOptions hosted_mcp_options = mcp_options;
  hosted_mcp_options.server_name = "esbd-hosted";
  hosted_mcp_options.instructions.clear();
  auto hosted_mcp = esb::api::mcp::RegisterMcpEndpoint(
      server.router(), "/environments/{id}/mcp/{name}",
      {.admit = [&service](esb::api::Request& r) { return service.Admit(r, false); },
       .caller_of = [&service](const esb::api::Request& r) { return service.CallerOf(r); }},
      [&mcp_hosts](const esb::api::Request& r, const esb::Caller& caller)
          -> absl::StatusOr<std::shared_ptr<esb::tools::ToolProvider>> {
        return mcp_hosts->ServerProvider(caller, r.Param("id"), r.Param("name"));
      },
      hosted_mcp_options);
  if (absl::Status st = server.Start(); !st.ok()) {
    manager.Stop();
    return Fail(absl::StrCat("cannot listen on ", config.listen, ": ", st.message()));
  }

  // Start the nano fork server now (it instantiates the interpreter once), so the first
  // user's run does not pay for it.
  std::thread nano_warmup;
  if (nano) {
    nano_warmup = std::thread([nano] {
      int64_t t0 = esb::MonotonicMs();
      esb::RunRequest warm;
      warm.code = "pass";
      auto r = nano->RunCode(nullptr, warm, nullptr);
      if (r.ok()) esb::LogInfo(absl::StrCat("nano tier warm in ", esb::MonotonicMs() - t0, " ms"));
      else esb::LogWarn(absl::StrCat("nano warm-up failed: ", r.status().ToString()));
    });
  }

  auto keys = (*store)->CountActiveApiKeys();
  if (keys.ok() && *keys == 0) {
    esb::LogWarn("==================================================================");
    esb::LogWarn("DEV MODE: no API keys configured. Only loopback/unix-socket clients");
    esb::LogWarn("are served, all as tenant 'default'. Create keys with `esbd keys add`.");
    esb::LogWarn("==================================================================");
  }
  if (!loopback) esb::LogWarn(absl::StrCat("listening on a non-loopback address: ", host));
  // Test harnesses start esbd with --listen 127.0.0.1:0 and read the port from this line.
  esb::LogInfo(
      absl::StrCat("esbd ", ESB_VERSION, " listening on http://", host, ":", server.tcp_port(),
                   hopts.unix_socket_path.empty() ? "" : " and unix:" + hopts.unix_socket_path,
                   " (state: ", state_dir, ")"));

  int sig = 0;
  sigwait(&signals, &sig);
  esb::LogInfo(absl::StrCat("received ", strsignal(sig), "; shutting down (environments keep "
                            "running and are re-attached on the next start)"));
  if (nano_warmup.joinable()) nano_warmup.join();
  mcp->Shutdown();  // wakes MCP GET streams so the server drains quickly
  hosted_mcp->Shutdown();
  server.Stop();
  // Hosted MCP servers end with esbd (they are not re-attached: docs/design.md).
  mcp_hosts.reset();
  manager.Stop();
  // The proxy goes with esbd (its listeners close: governed sandboxes fail closed until the
  // next esbd re-attaches them).
  egress.Stop();
  esb::LogInfo("bye");
  return 0;
}

// esbd configuration: embedded defaults < config file (JSON) < ESBD_* environment < flags.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "drivers/driver.h"
#include "governance/policy.h"

namespace esb {

struct KeyConfig {
  std::string key;     // the secret, as clients send it
  std::string tenant;
  std::string name;
};

// `packages: [...]` on the run endpoints (api/package_installer.h): where esbd fetches wheels.
struct PackagesConfig {
  std::string index_url;                   // PEP 503 simple index; empty: packages refused
  std::vector<std::string> allowed_hosts;  // file hosts besides the index's own
  std::string cache_dir;                   // empty: <state_dir>/wheels
  std::string ca_file;                     // extra trusted CAs (PEM) for an https index
  int64_t index_ttl_s = 600;               // how long an index page is trusted
  int64_t max_wheel_mb = 256;
  int64_t max_cache_mb = 10240;            // the wheel cache on disk (LRU); 0 = unlimited
  int64_t timeout_s = 600;                 // one whole install
};

// Artifacts (core/artifact_store.h).
struct ArtifactsConfig {
  int64_t ttl_s = 24 * 3600;
  int64_t max_artifact_mb = 32;
  int64_t max_tenant_mb = 1024;
};

// Time travel's blob store (core/snapshots/blob_store.h; docs/design.md "Time travel"):
//   "steps": {"store_mb": 8192, "max_tenant_mb": 0, "max_blob_mb": 256,
//             "sweep_interval_seconds": 10}
struct StepsConfig {
  int64_t store_mb = 8192;        // every tenant's step blobs together
  int64_t max_tenant_mb = 0;      // one tenant's share; 0: a quarter of store_mb
  int64_t max_blob_mb = 256;      // one blob (a file's contents at a step)
  int64_t sweep_interval_s = 10;  // the blob sweep at most this often (tests: 1)
};

// MCP (issue 14, docs/api.md "MCP" and "Hosted MCP servers"): the daemon config's one "mcp"
// object, parsed by ParseMcp (config.cc).
//   "mcp": {"max_sessions": 1024, "max_sessions_per_tenant": 64, "session_idle_seconds": 1800,
//           "allowed_origins": ["https://app.example"], "max_servers_per_environment": 4, ...}
struct McpConfig {
  // esbd's /mcp and hosted servers' endpoints (api/mcp/mcp_endpoint.h).
  int64_t max_sessions = 1024;               // legacy (2025-11-25) sessions in all
  int64_t max_sessions_per_tenant = 64;      // ... and per tenant
  int64_t session_idle_s = 1800;             // an unused session expires after this
  std::vector<std::string> allowed_origins;  // browser Origins allowed besides loopback pages
  // Hosted MCP servers (core/mcp_hosts). Every key has a default and a range.
  int max_servers_per_environment = 4;      // 0..32 (0: hosting is off)
  int max_servers = 64;                     // the whole daemon (two threads each), 0..1024
  int64_t max_message_bytes = 4 << 20;      // one JSON-RPC line from a server, 4 KiB..64 MiB
  int64_t call_timeout_s = 60;              // a tools/call, 1..3600
  int64_t start_timeout_s = 30;             // spawn + handshake + tools/list, 1..600
  int max_concurrent_calls_per_server = 8;  // more at once: 429, 1..256
  // Output flood (stdout + stderr bytes; stdout lines): averaged over 2 s (a burst of twice the
  // rate, and at least two max-size messages, passes). Over it the server is killed and
  // reported.
  int64_t max_output_bytes_per_second = 8 << 20;  // 64 KiB..1 GiB
  int64_t max_lines_per_second = 2000;            // 10..1000000
  int max_garbage_lines = 8;         // stdout lines that are not JSON-RPC before a kill, 0..1000
  int max_restarts = 3;              // restarts after crashes (backoff 1, 2, 4 ... 30 s), 0..100
  int64_t stderr_tail_bytes = 8192;  // kept for error reports, 256..1 MiB
  int max_tools_per_server = 1000;   // tools/list beyond it is cut, 1..10000
};

// The audit log and the state database (storage/store.h StoreOptions): retention, per-tenant
// row cap and rate, stored field size, search deadline.
struct AuditConfig {
  int64_t retention_days = 30;            // audit rows and destroyed environments' records
  int64_t max_rows_per_tenant = 100000;
  int64_t rate_per_second = 20;           // per tenant; over it similar rows are summarised
  int64_t burst = 200;
  // Egress rows (one per request through the egress proxy) have their own bucket per tenant.
  int64_t egress_rate_per_second = 200;
  int64_t egress_burst = 2000;
  int64_t egress_stored_mb = 256;  // per tenant: egress headers + bodies kept (then rows only)
  int64_t max_detail_bytes = 1024;
  int64_t query_timeout_ms = 500;         // an audit search running longer answers 503
  // Audit rows and exec counters are committed this long after the action, off its reply
  // (StoreOptions::write_behind_ms; a crash may lose this interval of them). 0: synchronous.
  int64_t write_behind_ms = 50;
};

// Egress governance (issue 12; docs/api.md "Network policy"). Config file:
//   "egress": {"resolve": {"NAME": "HOST:PORT"}, "upstream_ca": "FILE",
//              "default": {policy}, "tenants": {"TENANT": {"default": {policy},
//                                                          "intents": {catalogue}}}},
//   "intents": {catalogue}
struct EgressConfig {
  // The proxy sends NAME to HOST:PORT instead of resolving it (tests, air-gapped sites); such a
  // name counts as explicitly allowed to reach a private address. --egress-resolve adds to it.
  std::map<std::string, std::string> resolve;
  std::string upstream_ca;  // extra roots (PEM) the proxy trusts upstream; --egress-upstream-ca
  // The daemon's base policy: a create's (or PUT's) policy object is laid over it, field by
  // field (fields the request leaves out take these values; `"network": {}` is this policy).
  governance::EgressPolicy default_policy;
  // Per tenant, laid over default_policy the same way.
  std::map<std::string, governance::EgressPolicy> tenant_default_policy;
  // The intent catalogue; per tenant, entries of the same name replace the daemon's, others add.
  governance::IntentCatalogue intents;
  std::map<std::string, governance::IntentCatalogue> tenant_intents;

  // The policy a tenant's requests are laid over, and the tenant's intent catalogue.
  const governance::EgressPolicy& DefaultPolicyFor(const std::string& tenant) const;
  governance::IntentCatalogue IntentsFor(const std::string& tenant) const;
};
// Checks and adds one NAME=HOST:PORT override (the --egress-resolve syntax).
absl::Status AddEgressResolve(std::string_view spec, EgressConfig* egress);

struct DaemonConfig {
  std::string listen = "127.0.0.1:8080";
  std::string unix_socket;  // empty: <state_dir>/esbd.sock; "none" disables
  std::string state_dir = "./var";
  // The key the state database seals secrets with (the env CA private keys): 32 bytes, 0600,
  // created on first start. Empty: <state_dir>/state.key. Back it up with the database.
  std::string state_key_file;
  std::map<std::string, std::string> images;  // image name → rootfs directory
  std::string container_runtime = "auto";     // auto | crun | runc
  // Container sandboxes in user namespaces, each with its own range of 65536 host uids from
  // userns_uid_base (ContainerDriverOptions; off or impossible: host uids, /healthz says why).
  bool user_namespaces = true;
  int64_t userns_uid_base = 1879048192;       // 0x70000000
  std::string agent_binary;                   // empty: esb-agent next to esbd
  std::string python_wasm;                    // nano tier artefact dir (images/python-wasm)
  std::string nano_worker;                    // empty: esb-nano-worker next to esbd
  std::string router_rules;                   // routing rules (JSON); empty: built-in path
  // Where `make images` keeps its builds: with no image or python_wasm configured, esbd runs
  // the newest complete one (core/image_discovery.h).
  std::string image_cache = "/var/cache/entersandbox";
  int64_t default_ttl_s = 900;
  int64_t max_ttl_s = 86400;
  int pool_size = 2;
  int max_environments = 500;
  int max_environments_per_tenant = 200;
  // Persistent volumes (ManagerOptions): size cap of one (MiB), count per tenant.
  int64_t max_volume_mb = 4096;
  int max_volumes_per_tenant = 16;
  // Interactive terminals (ManagerOptions): open at once per environment and per tenant, and
  // how long one may sit with neither input nor output before it is closed.
  int max_terminals_per_environment = 4;
  int max_terminals_per_tenant = 16;
  int64_t terminal_idle_timeout_s = 1800;
  int64_t max_output_bytes = 1 << 20;
  int64_t max_upload_bytes = 256ll << 20;
  int64_t max_json_body_bytes = 16ll << 20;
  int max_connections = 1024;
  // The HTTP server's threads and connection caps (api/http_server.h Options): I/O threads
  // (accept, idle and header waits, WebSockets; 1..64); streamed answers (SSE, downloads,
  // WebSockets) at once, 0: max_connections; open connections from one peer (one IP, or one uid
  // on the unix socket), 0: seven eighths of the open-connection cap (3/4 of RLIMIT_NOFILE).
  int io_threads = 2;
  int max_streams = 0;
  int max_open_connections_per_peer = 0;
  // HTTP memory and fair shares (api/http_server.h Options): buffered JSON bodies across all
  // connections, and request headers still being received; per tenant (the dev-mode tenant and
  // anonymous clients count as one each): requests in progress at once and buffered bodies.
  // 0 for a per-tenant share: a quarter of the total (at least one request / one max-size body).
  int64_t max_buffered_body_bytes = 128ll << 20;
  int64_t max_buffered_header_bytes = 64ll << 20;
  int max_requests_per_tenant = 0;
  int64_t max_buffered_body_bytes_per_tenant = 0;
  // Slow clients: request bodies must arrive, and responses be read, at least this fast on
  // average once the grace has passed (408 / connection reset otherwise). 0: no minimum.
  int64_t min_transfer_bytes_per_second = 16 << 10;
  int64_t min_transfer_grace_ms = 10000;
  // Buffered (non-streamed) answers waiting for their clients, all connections; per tenant a
  // quarter. Over it, a large answer is replaced with 503 / 429.
  int64_t max_buffered_response_bytes = 256ll << 20;
  // Access log lines per second (the rest are summarised once a second); 0: no limit.
  int64_t access_log_lines_per_second = 100;
  // Most processes/threads one environment may have (its pids cgroup limit); requests for
  // more are refused with 400. All sandboxes together are also capped (container driver).
  int64_t max_pids = 4096;
  // Memory (MiB; 0: derived from the host's RAM by ResolveMemoryLimits, common/host_memory.h).
  // sandbox_memory_mb: memory limit of the cgroup parent of all container sandboxes;
  // nano_memory_mb: of the nano tier's cgroup; max_memory_mb / max_disk_mb: the most one
  // environment may ask for (400 above). /workspace, /tmp and /dev/shm are tmpfs charged to
  // the environment's memory cgroup, so disk_mb never adds RAM beyond memory_mb.
  int64_t sandbox_memory_mb = 0;
  int64_t nano_memory_mb = 0;
  int64_t max_memory_mb = 0;
  int64_t max_disk_mb = 0;
  EnvSpec defaults;
  std::vector<KeyConfig> keys;
  PackagesConfig packages;
  ArtifactsConfig artifacts;
  AuditConfig audit;
  StepsConfig steps;
  McpConfig mcp;
  EgressConfig egress;
  std::string log_level = "info";
};

// Reads a JSON config file. Unknown keys and wrong types are errors naming the key.
absl::Status LoadConfigFile(const std::string& path, DaemonConfig* config);
// Fills the memory limits left 0 from the host's RAM (host_mb: MemTotal in MiB, 0 if unknown)
// and checks them: caps within the sandboxes' limit, defaults.memory_mb/disk_mb within the caps.
absl::Status ResolveMemoryLimits(int64_t host_mb, DaemonConfig* config);
// Applies ESBD_LISTEN, ESBD_STATE_DIR, ESBD_CONFIG (ignored here), ESBD_UNIX_SOCKET,
// ESBD_IMAGE_DEFAULT, ESBD_RUNTIME, ESBD_POOL_SIZE, ESBD_DEFAULT_TTL, ESBD_LOG_LEVEL,
// ESBD_AGENT_BINARY, ESBD_PYTHON_WASM, ESBD_NANO_WORKER,
// ESBD_ROUTER_RULES, ESBD_PACKAGE_INDEX (packages.index_url), ESB_CACHE_DIR (image_cache, the
// variable the image build scripts read).
absl::Status ApplyEnvironment(const std::function<const char*(const char*)>& getenv_fn,
                              DaemonConfig* config);
// Splits "HOST:PORT" ("[::1]:8080" too). Port must be 0..65535.
absl::Status ParseListen(const std::string& listen, std::string* host, uint16_t* port);

}  // namespace esb

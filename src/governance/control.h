// The control protocol between esbd and esb-proxy (issue 12; docs/design.md "Egress proxy").
//
// esbd creates a connected AF_UNIX SOCK_STREAM socketpair, starts esb-proxy with one end as
// `--control-fd N` and keeps the other. Everything esbd tells the proxy and everything the proxy
// reports travels over it as frames of the agent-protocol codec (common/protocol.h): type
// REQUEST, stream = the sender's message sequence number (1, 2, ...), header {"op": "<op>"},
// payload = the message as one JSON object (at most kMaxControlPayloadBytes).
//
//   esbd → proxy   attach   Attach{env_id, tenant, policy, intents, CA cert+key PEM} + the
//                           environment's listening socket, passed with SCM_RIGHTS on the same
//                           sendmsg as the frame's first byte. The listener IS the identity of
//                           the environment: whatever connects to it is that environment.
//                  update   Update{env_id, policy, intents}: replaces both; checked on the next
//                           request (also on kept-alive connections and inside tunnels).
//                  detach   Detach{env_id}: closes the listener and every connection of the env.
//                  ping     Ping{}: the proxy answers with a Health.
//   proxy → esbd   result   Result{seq, ok, error}: one per attach/update/detach, seq = the
//                           request frame's stream id.
//                  audit    AuditEvent: one per request or refused connection.
//                  health   Health: on start (ready), every kHealthIntervalMs, and per ping.
//
// The proxy exits when the control socket closes (esbd died or restarts it); its listeners close
// with it, so sandboxes fail closed (ECONNREFUSED) until esbd re-attaches them with fresh fds.
//
// Both ends: ControlChannel (send/receive typed messages, fd passing). esbd's end:
// ControlClient (a reader thread calling back with audit/health/result, thread-safe sends).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "boost/json.hpp"
#include "common/log_throttle.h"
#include "common/protocol.h"
#include "common/util.h"
#include "governance/policy.h"

namespace esb::governance::control {

inline constexpr uint32_t kMaxControlPayloadBytes = 4u << 20;
// Size caps of the redacted request headers and body an AuditEvent carries.
inline constexpr size_t kAuditHeadersCap = 16 << 10;
inline constexpr size_t kAuditBodyCap = 64 << 10;
inline constexpr int64_t kHealthIntervalMs = 5000;

// ---- esbd → proxy

struct Attach {
  std::string env_id;
  std::string tenant;
  EgressPolicy policy;
  std::vector<ActiveIntent> intents;  // absolute expiry; expired ones are ignored at decision
  std::string ca_cert_pem;            // the environment's CA (governance/tls/ca.h)
  std::string ca_key_pem;
  // The listening TCP socket (127.0.0.1:3128 inside the env's netns). On send: borrowed (the
  // channel passes a copy; the caller closes its own). On receive: owned by the message.
  int listener_fd = -1;
  UniqueFd received_listener;  // set on receive (listener_fd == received_listener.get())
};

struct Update {
  std::string env_id;
  EgressPolicy policy;
  std::vector<ActiveIntent> intents;
};

struct Detach {
  std::string env_id;
};

struct Ping {};

// ---- proxy → esbd

struct Result {
  uint32_t seq = 0;  // the stream id of the attach/update/detach frame it answers
  bool ok = true;
  std::string error;
};

// One DLP finding as audited: never the matched text.
struct AuditFinding {
  std::string rule_id;  // "dlp:credit_card"
  std::string action;   // "block" | "redact" | "log"
  std::string where;    // "url" | "header" | "body" | "response_body" | "host"
  int count = 1;
};

// One egress request (plain HTTP or inside an inspected tunnel), one opaque tunnel, or one
// refused connection/CONNECT.
struct AuditEvent {
  int64_t time_ms = 0;  // start, ms since the Unix epoch
  std::string env_id;
  std::string tenant;
  std::vector<std::string> intents;  // names of the intents active at decision time
  std::string method;                // "GET", "POST", "CONNECT", ...
  std::string scheme;                // "http" | "https" (inspected) | "tunnel" (opaque)
  std::string host;
  uint16_t port = 0;
  std::string path;  // path + query (DLP-redacted); "" for CONNECT/tunnels
  int status = 0;    // status sent to the client (0: none, connection dropped)
  // "allowed" | "blocked" | "redacted" (allowed, a DLP redact rule changed it) | "opaque"
  // (tunnelled without inspection) | "error" (upstream unreachable, deadline, bad request)
  std::string decision;
  std::vector<std::string> rule_ids;  // the policy rule first ("allow:*.x", "deny:x"), then DLP
  std::string reason;                 // human text for blocks and errors
  int64_t bytes_up = 0;               // request bytes sent upstream (body, after redaction)
  int64_t bytes_down = 0;             // response bytes sent to the client (body)
  int64_t duration_ms = 0;
  // Request headers after DLP redaction and audit masking (Authorization, Cookie, key-like
  // values), "Name: value\n" lines, at most kAuditHeadersCap.
  std::string request_headers;
  // Request body after DLP redaction, at most kAuditBodyCap bytes; sha256 (hex) of the original
  // body as received from the client ("" when there was no body).
  std::string request_body;
  bool request_body_truncated = false;
  std::string request_body_sha256;
  std::vector<AuditFinding> findings;
};

struct Health {
  int64_t pid = 0;
  int64_t uptime_ms = 0;
  int64_t environments = 0;    // attached
  int64_t connections = 0;     // open client connections, all environments
  int64_t requests_total = 0;  // audited events since start
  int64_t blocked_total = 0;
  // Fair-share refusals since start (proxy.h ProxyOptions): a connection over a cap (env,
  // tenant, total), a body over the buffered-body budget, a DLP scan over the tenant's queue,
  // a name over the env's or tenant's resolution share.
  int64_t refused_connections = 0;
  int64_t refused_body_budget = 0;
  int64_t refused_dlp_busy = 0;
  int64_t refused_resolve_busy = 0;
  int64_t body_buffered_bytes = 0;  // request bodies buffered now, all tenants
  // Audit events the proxy's outbox dropped since start (a tenant over its queue share); each
  // drop is also reported to esbd as an "audit:dropped" event of the environment concerned.
  int64_t audit_dropped = 0;
};

using ToProxy = std::variant<Attach, Update, Detach, Ping>;
using ToEsbd = std::variant<Result, AuditEvent, Health>;

// JSON forms (the frame payloads). Parse* validate fully (policy through ParseEgressPolicy).
boost::json::object ToJson(const AuditEvent& event);
absl::StatusOr<AuditEvent> ParseAuditEvent(const boost::json::value& value);
boost::json::object ToJson(const Health& health);
absl::StatusOr<Health> ParseHealth(const boost::json::value& value);

// One end of the control socket. Send is thread-safe; Receive must be called from one thread.
class ControlChannel {
 public:
  explicit ControlChannel(UniqueFd fd);
  int fd() const { return fd_.get(); }

  // Sends one message; an Attach passes its listener_fd with SCM_RIGHTS. `seq` (optional out):
  // the frame's stream id (Results refer to it).
  absl::Status Send(const ToProxy& message, uint32_t* seq = nullptr);
  absl::Status Send(const ToEsbd& message);

  // Blocks until one complete message arrives (no deadline: the peer's close ends it with
  // absl::UnavailableError("control socket closed")). A malformed frame or message, or an
  // attach without a passed fd, is an error; the channel is then unusable. `seq`: stream id.
  absl::StatusOr<ToProxy> ReceiveToProxy(uint32_t* seq = nullptr);
  absl::StatusOr<ToEsbd> ReceiveToEsbd();

 private:
  absl::Status SendFrame(std::string_view op, const boost::json::object& body, int pass_fd,
                         uint32_t* seq);
  absl::StatusOr<proto::Frame> ReceiveFrame(std::vector<UniqueFd>* fds);

  UniqueFd fd_;
  std::mutex send_mu_;
  uint32_t next_seq_ = 1;
  proto::FrameDecoder decoder_{kMaxControlPayloadBytes};
  std::vector<UniqueFd> pending_fds_;  // received with SCM_RIGHTS, not yet claimed by an attach
};

// esbd's end: owns the channel and a reader thread that calls back (from that thread) with
// every audit event, health report and result. `on_closed` runs once when the socket closes or
// fails (the proxy died): esbd restarts it and re-attaches every environment.
class ControlClient {
 public:
  struct Callbacks {
    std::function<void(AuditEvent)> on_audit;
    std::function<void(const Health&)> on_health;
    std::function<void(const Result&)> on_result;
    std::function<void(const absl::Status&)> on_closed;
  };
  ControlClient(UniqueFd fd, Callbacks callbacks);
  ~ControlClient();  // shuts the socket down and joins the reader
  ControlClient(const ControlClient&) = delete;
  ControlClient& operator=(const ControlClient&) = delete;

  // Each returns the request's seq (matched by a later Result) or the send error.
  // SECURITY: the listener fd is duplicated into the proxy; the caller still owns `listener_fd`.
  absl::StatusOr<uint32_t> Attach(const control::Attach& attach);
  absl::StatusOr<uint32_t> Update(const control::Update& update);
  absl::StatusOr<uint32_t> Detach(std::string_view env_id);
  absl::Status Ping();

 private:
  void ReadLoop();

  ControlChannel channel_;
  Callbacks callbacks_;
  LogThrottle dropped_;  // messages dropped as unusable (ReadLoop)
  std::thread reader_;
};

}  // namespace esb::governance::control

#include "governance/control.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cstring>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "common/fd_passing.h"
#include "common/utf8.h"
#include "common/util.h"

namespace esb::governance::control {
namespace {

namespace json = boost::json;

// Every message body is a JSON object; these read its fields strictly (wrong type = error).
class Reader {
 public:
  Reader(const json::value& v, std::string_view what) : what_(what) {
    if (!v.is_object()) {
      status_ = absl::InvalidArgumentError(absl::StrCat(AbslView(what), ": not a JSON object"));
    } else {
      obj_ = &v.as_object();
    }
  }
  bool ok() const { return status_.ok(); }
  const absl::Status& status() const { return status_; }

  std::string String(std::string_view key, bool required = false) {
    const json::value* v = Find(key, required);
    if (v == nullptr) return "";
    if (!v->is_string()) return Fail(key, "a string"), "";
    return std::string(v->as_string());
  }
  int64_t Int(std::string_view key, bool required = false) {
    const json::value* v = Find(key, required);
    if (v == nullptr) return 0;
    if (v->is_int64()) return v->as_int64();
    if (v->is_uint64() && v->as_uint64() <= INT64_MAX) return static_cast<int64_t>(v->as_uint64());
    return Fail(key, "an integer"), 0;
  }
  bool Bool(std::string_view key) {
    const json::value* v = Find(key, false);
    if (v == nullptr) return false;
    if (!v->is_bool()) return Fail(key, "a boolean"), false;
    return v->as_bool();
  }
  const json::array* Array(std::string_view key) {
    const json::value* v = Find(key, false);
    if (v == nullptr) return nullptr;
    if (!v->is_array()) return Fail(key, "an array"), nullptr;
    return &v->as_array();
  }
  std::vector<std::string> Strings(std::string_view key) {
    std::vector<std::string> out;
    const json::array* a = Array(key);
    if (a == nullptr) return out;
    for (const json::value& e : *a) {
      if (!e.is_string()) return Fail(key, "an array of strings"), out;
      out.emplace_back(e.as_string());
    }
    return out;
  }
  const json::value* Find(std::string_view key, bool required) {
    if (obj_ == nullptr || !status_.ok()) return nullptr;
    const json::value* v = obj_->if_contains(key);
    if (v == nullptr && required) Fail(key, "present");
    return v;
  }
  void Fail(std::string_view key, std::string_view want) {
    if (status_.ok()) {
      status_ = absl::InvalidArgumentError(
          absl::StrCat(what_, ".", AbslView(key), ": must be ", AbslView(want)));
    }
  }
  void Fail(absl::Status s) {
    if (status_.ok()) status_ = std::move(s);
  }

 private:
  std::string what_;
  const json::object* obj_ = nullptr;
  absl::Status status_;
};

json::array StringsToJson(const std::vector<std::string>& v) {
  json::array a;
  for (const std::string& s : v) a.emplace_back(s);
  return a;
}

json::array IntentsToJson(const std::vector<ActiveIntent>& intents) {
  json::array a;
  for (const ActiveIntent& i : intents) a.emplace_back(ToJson(i));
  return a;
}

std::vector<ActiveIntent> ParseIntents(Reader& r) {
  std::vector<ActiveIntent> out;
  const json::array* a = r.Array("intents");
  if (a == nullptr) return out;
  if (a->size() > kMaxActiveIntents) {
    r.Fail(absl::InvalidArgumentError("intents: too many active intents"));
    return out;
  }
  for (const json::value& v : *a) {
    absl::StatusOr<ActiveIntent> i = ParseActiveIntent(v);
    if (!i.ok()) {
      r.Fail(i.status());
      return out;
    }
    out.push_back(*std::move(i));
  }
  return out;
}

EgressPolicy ParsePolicy(Reader& r) {
  const json::value* v = r.Find("policy", true);
  if (v == nullptr) return {};
  absl::StatusOr<EgressPolicy> p = ParseEgressPolicy(*v);
  if (!p.ok()) {
    r.Fail(p.status());
    return {};
  }
  return *std::move(p);
}

absl::Status ChannelError(std::string_view what, const std::string& error) {
  if (error == "connection closed") return absl::UnavailableError("control socket closed");
  return absl::UnavailableError(absl::StrCat("control socket: ", AbslView(what), ": ", error));
}

}  // namespace

json::object ToJson(const AuditEvent& e) {
  // SECURITY: these strings come from sandbox traffic (targets, header values, bodies) and may
  // hold any bytes; esbd's JSON parser refuses invalid UTF-8, so they are made valid here (an
  // invalid byte becomes U+FFFD). Before, one request with a 0xFF byte closed the control
  // channel and restarted the proxy for every tenant.
  auto text = [](const std::string& v) { return SanitizeUtf8(v); };
  auto texts = [&](const std::vector<std::string>& v) {
    std::vector<std::string> out;
    out.reserve(v.size());
    for (const std::string& x : v) out.push_back(text(x));
    return StringsToJson(out);
  };
  json::array findings;
  for (const AuditFinding& f : e.findings) {
    findings.emplace_back(json::object{{"rule_id", text(f.rule_id)},
                                       {"action", text(f.action)},
                                       {"where", text(f.where)},
                                       {"count", f.count}});
  }
  return json::object{{"time_ms", e.time_ms},
                      {"env_id", text(e.env_id)},
                      {"tenant", text(e.tenant)},
                      {"intents", texts(e.intents)},
                      {"method", text(e.method)},
                      {"scheme", text(e.scheme)},
                      {"host", text(e.host)},
                      {"port", e.port},
                      {"path", text(e.path)},
                      {"status", e.status},
                      {"decision", text(e.decision)},
                      {"rule_ids", texts(e.rule_ids)},
                      {"reason", text(e.reason)},
                      {"bytes_up", e.bytes_up},
                      {"bytes_down", e.bytes_down},
                      {"duration_ms", e.duration_ms},
                      {"request_headers", text(e.request_headers)},
                      {"request_body", text(e.request_body)},
                      {"request_body_truncated", e.request_body_truncated},
                      {"request_body_sha256", text(e.request_body_sha256)},
                      {"findings", std::move(findings)}};
}

absl::StatusOr<AuditEvent> ParseAuditEvent(const json::value& value) {
  Reader r(value, "audit");
  AuditEvent e;
  e.time_ms = r.Int("time_ms", true);
  e.env_id = r.String("env_id", true);
  e.tenant = r.String("tenant");
  e.intents = r.Strings("intents");
  e.method = r.String("method");
  e.scheme = r.String("scheme");
  e.host = r.String("host");
  int64_t port = r.Int("port");
  if (port < 0 || port > 65535) r.Fail("port", "a port number");
  e.port = static_cast<uint16_t>(port);
  e.path = r.String("path");
  e.status = static_cast<int>(r.Int("status"));
  e.decision = r.String("decision", true);
  e.rule_ids = r.Strings("rule_ids");
  e.reason = r.String("reason");
  e.bytes_up = r.Int("bytes_up");
  e.bytes_down = r.Int("bytes_down");
  e.duration_ms = r.Int("duration_ms");
  e.request_headers = r.String("request_headers");
  e.request_body = r.String("request_body");
  e.request_body_truncated = r.Bool("request_body_truncated");
  e.request_body_sha256 = r.String("request_body_sha256");
  if (const json::array* a = r.Array("findings")) {
    for (const json::value& v : *a) {
      Reader f(v, "audit.findings[]");
      AuditFinding finding;
      finding.rule_id = f.String("rule_id", true);
      finding.action = f.String("action");
      finding.where = f.String("where");
      finding.count = static_cast<int>(f.Int("count"));
      if (!f.ok()) return f.status();
      e.findings.push_back(std::move(finding));
    }
  }
  if (!r.ok()) return r.status();
  return e;
}

json::object ToJson(const Health& h) {
  return json::object{{"pid", h.pid},
                      {"uptime_ms", h.uptime_ms},
                      {"environments", h.environments},
                      {"connections", h.connections},
                      {"requests_total", h.requests_total},
                      {"blocked_total", h.blocked_total},
                      {"refused_connections", h.refused_connections},
                      {"refused_body_budget", h.refused_body_budget},
                      {"refused_dlp_busy", h.refused_dlp_busy},
                      {"refused_resolve_busy", h.refused_resolve_busy},
                      {"body_buffered_bytes", h.body_buffered_bytes},
                      {"audit_dropped", h.audit_dropped}};
}

absl::StatusOr<Health> ParseHealth(const json::value& value) {
  Reader r(value, "health");
  Health h;
  h.pid = r.Int("pid");
  h.uptime_ms = r.Int("uptime_ms");
  h.environments = r.Int("environments");
  h.connections = r.Int("connections");
  h.requests_total = r.Int("requests_total");
  h.blocked_total = r.Int("blocked_total");
  h.refused_connections = r.Int("refused_connections");
  h.refused_body_budget = r.Int("refused_body_budget");
  h.refused_dlp_busy = r.Int("refused_dlp_busy");
  h.refused_resolve_busy = r.Int("refused_resolve_busy");
  h.body_buffered_bytes = r.Int("body_buffered_bytes");
  h.audit_dropped = r.Int("audit_dropped");
  if (!r.ok()) return r.status();
  return h;
}

// ---- ControlChannel

ControlChannel::ControlChannel(UniqueFd fd) : fd_(std::move(fd)) {}

absl::Status ControlChannel::SendFrame(std::string_view op, const json::object& body, int pass_fd,
                                       uint32_t* seq) {
  proto::Frame frame;
  frame.type = proto::FrameType::kRequest;
  frame.header = json::object{{"op", op}};
  frame.payload = json::serialize(body);
  if (frame.payload.size() > kMaxControlPayloadBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "control message '", AbslView(op), "' too large (", frame.payload.size(), " bytes)"));
  }
  std::lock_guard<std::mutex> lock(send_mu_);
  frame.stream = next_seq_++;
  if (next_seq_ == 0) next_seq_ = 1;
  if (seq != nullptr) *seq = frame.stream;
  std::string bytes = proto::EncodeFrame(frame);
  std::string error;
  // SECURITY: the listener fd crosses to the proxy attached to this frame's first byte, so the
  // receiver pairs it with exactly this attach (fds are claimed in order).
  bool ok = pass_fd >= 0 ? proto::WriteAllWithFd(fd_.get(), bytes, pass_fd, &error)
                         : proto::WriteAll(fd_.get(), bytes, &error);
  if (!ok) return ChannelError("send", error);
  return absl::OkStatus();
}

absl::Status ControlChannel::Send(const ToProxy& message, uint32_t* seq) {
  return std::visit(
      [&](const auto& m) -> absl::Status {
        using T = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<T, Attach>) {
          if (m.listener_fd < 0) return absl::InvalidArgumentError("attach without a listener");
          return SendFrame("attach",
                           json::object{{"env_id", m.env_id},
                                        {"tenant", m.tenant},
                                        {"policy", ToJson(m.policy)},
                                        {"intents", IntentsToJson(m.intents)},
                                        {"ca_cert_pem", m.ca_cert_pem},
                                        {"ca_key_pem", m.ca_key_pem}},
                           m.listener_fd, seq);
        } else if constexpr (std::is_same_v<T, Update>) {
          return SendFrame("update",
                           json::object{{"env_id", m.env_id},
                                        {"policy", ToJson(m.policy)},
                                        {"intents", IntentsToJson(m.intents)}},
                           -1, seq);
        } else if constexpr (std::is_same_v<T, Detach>) {
          return SendFrame("detach", json::object{{"env_id", m.env_id}}, -1, seq);
        } else {
          return SendFrame("ping", json::object{}, -1, seq);
        }
      },
      message);
}

absl::Status ControlChannel::Send(const ToEsbd& message) {
  return std::visit(
      [&](const auto& m) -> absl::Status {
        using T = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<T, Result>) {
          return SendFrame("result", json::object{{"seq", m.seq}, {"ok", m.ok}, {"error", m.error}},
                           -1, nullptr);
        } else if constexpr (std::is_same_v<T, AuditEvent>) {
          return SendFrame("audit", ToJson(m), -1, nullptr);
        } else {
          return SendFrame("health", ToJson(m), -1, nullptr);
        }
      },
      message);
}

absl::StatusOr<proto::Frame> ControlChannel::ReceiveFrame(std::vector<UniqueFd>* fds) {
  for (;;) {
    if (std::optional<proto::Frame> f = decoder_.Next()) return *std::move(f);
    if (decoder_.failed()) return ChannelError("receive", decoder_.error());
    char buf[64 << 10];
    iovec iov{buf, sizeof(buf)};
    alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))];
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t n = recvmsg(fd_.get(), &msg, MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ChannelError("receive", strerror(errno));
    }
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int received;
        std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        fds->emplace_back(received);
      }
    }
    if (msg.msg_flags & MSG_CTRUNC) return ChannelError("receive", "passed fds truncated");
    if (n == 0) return ChannelError("receive", "connection closed");
    decoder_.Feed(std::string_view(buf, static_cast<size_t>(n)));
  }
}

namespace {

absl::StatusOr<json::value> FrameBody(const proto::Frame& frame, std::string* op) {
  const json::value* o = frame.header.if_contains("op");
  if (frame.type != proto::FrameType::kRequest || o == nullptr || !o->is_string()) {
    return absl::InvalidArgumentError("control frame without an op");
  }
  *op = std::string(o->as_string());
  json::error_code ec;
  json::parse_options options;
  options.max_depth = 32;
  json::value body = json::parse(frame.payload, ec, {}, options);
  if (ec) return absl::InvalidArgumentError(absl::StrCat("control '", *op, "': bad JSON"));
  return body;
}

}  // namespace

absl::StatusOr<ToProxy> ControlChannel::ReceiveToProxy(uint32_t* seq) {
  absl::StatusOr<proto::Frame> frame = ReceiveFrame(&pending_fds_);
  if (!frame.ok()) return frame.status();
  if (seq != nullptr) *seq = frame->stream;
  std::string op;
  absl::StatusOr<json::value> body = FrameBody(*frame, &op);
  if (!body.ok()) return body.status();
  Reader r(*body, op);
  if (op == "attach") {
    if (pending_fds_.empty()) return absl::InvalidArgumentError("attach without a passed fd");
    Attach a;
    a.received_listener = std::move(pending_fds_.front());
    pending_fds_.erase(pending_fds_.begin());
    a.listener_fd = a.received_listener.get();
    a.env_id = r.String("env_id", true);
    a.tenant = r.String("tenant");
    a.policy = ParsePolicy(r);
    a.intents = ParseIntents(r);
    a.ca_cert_pem = r.String("ca_cert_pem");
    a.ca_key_pem = r.String("ca_key_pem");
    if (!r.ok()) return r.status();
    if (a.env_id.empty()) return absl::InvalidArgumentError("attach: empty env_id");
    return ToProxy(std::move(a));
  }
  if (op == "update") {
    Update u;
    u.env_id = r.String("env_id", true);
    u.policy = ParsePolicy(r);
    u.intents = ParseIntents(r);
    if (!r.ok()) return r.status();
    return ToProxy(std::move(u));
  }
  if (op == "detach") {
    Detach d{r.String("env_id", true)};
    if (!r.ok()) return r.status();
    return ToProxy(std::move(d));
  }
  if (op == "ping") return ToProxy(Ping{});
  return absl::InvalidArgumentError(absl::StrCat("unknown control op '", op, "'"));
}

absl::StatusOr<ToEsbd> ControlChannel::ReceiveToEsbd() {
  std::vector<UniqueFd> unexpected;
  absl::StatusOr<proto::Frame> frame = ReceiveFrame(&unexpected);
  if (!frame.ok()) return frame.status();
  std::string op;
  absl::StatusOr<json::value> body = FrameBody(*frame, &op);
  if (!body.ok()) return body.status();
  if (op == "audit") {
    absl::StatusOr<AuditEvent> e = ParseAuditEvent(*body);
    if (!e.ok()) return e.status();
    return ToEsbd(*std::move(e));
  }
  if (op == "health") {
    absl::StatusOr<Health> h = ParseHealth(*body);
    if (!h.ok()) return h.status();
    return ToEsbd(*h);
  }
  if (op == "result") {
    Reader r(*body, "result");
    Result res;
    int64_t seq = r.Int("seq", true);
    if (seq < 0 || seq > UINT32_MAX) r.Fail("seq", "a u32");
    res.seq = static_cast<uint32_t>(seq);
    res.ok = r.Bool("ok");
    res.error = r.String("error");
    if (!r.ok()) return r.status();
    return ToEsbd(res);
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown control op '", op, "'"));
}

// ---- ControlClient

ControlClient::ControlClient(UniqueFd fd, Callbacks callbacks)
    : channel_(std::move(fd)), callbacks_(std::move(callbacks)) {
  reader_ = std::thread([this] { ReadLoop(); });
}

ControlClient::~ControlClient() {
  shutdown(channel_.fd(), SHUT_RDWR);
  if (reader_.joinable()) reader_.join();
}

void ControlClient::ReadLoop() {
  for (;;) {
    absl::StatusOr<ToEsbd> m = channel_.ReceiveToEsbd();
    if (!m.ok()) {
      // A well-framed message esbd cannot use (bad JSON, bad field) is dropped: the proxy
      // parses sandbox traffic, and one odd event must not cut every tenant's egress. Only a
      // framing or socket error ends the channel.
      if (m.status().code() == absl::StatusCode::kInvalidArgument) {
        if (uint64_t n = dropped_.Hit()) {
          LogWarn(absl::StrCat("egress control: dropped a message from esb-proxy (", n,
                               " so far): ", m.status().message()));
        }
        continue;
      }
      if (callbacks_.on_closed) callbacks_.on_closed(m.status());
      return;
    }
    if (auto* e = std::get_if<AuditEvent>(&*m)) {
      if (callbacks_.on_audit) callbacks_.on_audit(std::move(*e));
    } else if (auto* h = std::get_if<Health>(&*m)) {
      if (callbacks_.on_health) callbacks_.on_health(*h);
    } else if (auto* res = std::get_if<Result>(&*m)) {
      if (callbacks_.on_result) callbacks_.on_result(*res);
    }
  }
}

absl::StatusOr<uint32_t> ControlClient::Attach(const control::Attach& attach) {
  uint32_t seq = 0;
  // Attach holds a UniqueFd (move-only): send a borrowed copy of the fields.
  control::Attach copy;
  copy.env_id = attach.env_id;
  copy.tenant = attach.tenant;
  copy.policy = attach.policy;
  copy.intents = attach.intents;
  copy.ca_cert_pem = attach.ca_cert_pem;
  copy.ca_key_pem = attach.ca_key_pem;
  copy.listener_fd = attach.listener_fd;
  if (absl::Status s = channel_.Send(ToProxy(std::move(copy)), &seq); !s.ok()) return s;
  return seq;
}

absl::StatusOr<uint32_t> ControlClient::Update(const control::Update& update) {
  uint32_t seq = 0;
  if (absl::Status s = channel_.Send(ToProxy(update), &seq); !s.ok()) return s;
  return seq;
}

absl::StatusOr<uint32_t> ControlClient::Detach(std::string_view env_id) {
  uint32_t seq = 0;
  if (absl::Status s = channel_.Send(ToProxy(control::Detach{std::string(env_id)}), &seq);
      !s.ok()) {
    return s;
  }
  return seq;
}

absl::Status ControlClient::Ping() { return channel_.Send(ToProxy(control::Ping{})); }

}  // namespace esb::governance::control

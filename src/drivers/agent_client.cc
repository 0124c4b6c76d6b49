#include "drivers/agent_client.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <optional>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/channel.h"
#include "common/protocol.h"
#include "common/util.h"

namespace esb {
namespace json = boost::json;

namespace {

// File ops move at most 16 MiB per call; give them a generous but finite deadline.
constexpr int kFileOpTimeoutMs = 60000;
constexpr int kShortOpTimeoutMs = 30000;
// Exec's deadline is the command's own timeout plus this much for spawn, kill and teardown.
constexpr int64_t kExecGraceMs = 5000;
// Writes larger than this are split into several requests (a frame carries ≤ 16 MiB).
constexpr size_t kWriteChunk = 8 << 20;
// While a streaming call is silent its consumer gets an empty chunk this often.
constexpr int64_t kTickMs = 250;
// Commands longer than this go in the request payload instead of the header.
constexpr size_t kMaxCommandInHeader = 32 * 1024;
// How long the ping that checks a silent connection may take before it is given up.
constexpr int kProbeTimeoutMs = 5000;

// SECURITY: the agent lives inside the sandbox, and whatever answers on its socket is treated as
// hostile. Every reply is refused past the size its op can legitimately need, so a lying peer
// cannot make esbd allocate more than that per call.
constexpr uint32_t kHelloFrameBytes = proto::FrameBytesFor(4096, 0);
// OUTPUT: a small header and at most 64 KiB of data; WINDOW: a header only.
constexpr uint32_t kOutputFrameBytes = proto::FrameBytesFor(4096, proto::kMaxChunkBytes);
constexpr uint32_t kControlFrameBytes = proto::FrameBytesFor(4096, 0);
constexpr char kOutdatedMessage[] =
    "agent speaks protocol v1, esbd needs v2: the environment must be recreated";
// Error messages from the agent end up in API answers and logs: keep them short.
constexpr size_t kMaxAgentMessageBytes = 1024;
// Parsing a listing of at most kMaxListPayloadBytes of real entries needs far less than this;
// a payload of empty objects (`[{},{},...]`) runs out of it and is refused.
constexpr size_t kListParseArenaBytes = 16 << 20;

// The agent's message cut to kMaxAgentMessageBytes (at a UTF-8 boundary) with control
// characters replaced: it is sandbox-controlled text on its way to API answers and logs.
std::string BoundedMessage(std::string_view in) {
  std::string out;
  size_t n = std::min(in.size(), kMaxAgentMessageBytes);
  while (n > 0 && n < in.size() && (static_cast<unsigned char>(in[n]) & 0xc0) == 0x80) --n;
  out.reserve(n + 4);
  for (size_t i = 0; i < n; ++i) {
    unsigned char c = static_cast<unsigned char>(in[i]);
    out.push_back(c < 0x20 || c == 0x7f ? '?' : static_cast<char>(c));
  }
  if (n < in.size()) out += "...";
  return out;
}

int64_t IntField(const json::object& o, const char* key, int64_t fallback = 0) {
  const json::value* v = o.if_contains(key);
  if (!v) return fallback;
  if (v->is_int64()) return v->as_int64();
  if (v->is_uint64()) return static_cast<int64_t>(v->as_uint64());
  // SECURITY: sandbox-controlled; casting a double outside int64's range is undefined.
  if (v->is_double()) {
    double d = v->as_double();
    return d > -9.2e18 && d < 9.2e18 ? static_cast<int64_t>(d) : fallback;
  }
  return fallback;
}

bool BoolField(const json::object& o, const char* key) {
  const json::value* v = o.if_contains(key);
  return v && v->is_bool() && v->as_bool();
}

std::string StringField(const json::object& o, const char* key) {
  const json::value* v = o.if_contains(key);
  return v && v->is_string() ? std::string(v->as_string()) : std::string();
}

// An entry as the agent describes it, cut to what a real one can be: a name of at most
// NAME_MAX bytes, one of the four types, no negative sizes.
FileEntry EntryFrom(const json::object& o) {
  FileEntry e;
  e.name = StringField(o, "name");
  if (e.name.size() > 255 * 3) e.name.resize(255 * 3);  // 255 bytes, each may become U+FFFD
  e.type = StringField(o, "type");
  if (e.type != "file" && e.type != "dir" && e.type != "symlink") e.type = "other";
  e.size = std::max<int64_t>(IntField(o, "size"), 0);
  e.mode = static_cast<uint32_t>(IntField(o, "mode")) & 07777;
  e.mtime_ms = IntField(o, "mtime_ms");
  return e;
}

absl::Status ErrorFromResponse(const json::object& header) {
  std::string message = "agent error";
  std::string name;
  if (const json::value* v = header.if_contains("error"); v && v->is_string()) {
    message = BoundedMessage(v->as_string());
  }
  if (const json::value* v = header.if_contains("errno"); v && v->is_string()) {
    name = std::string(v->as_string());
  }
  return ErrnoNameStatus(name, message);
}

// The status for a connection that ended with `error` (ReadFrame's message).
absl::Status ConnectionError(const std::string& error) {
  if (error == "connection closed" || error == "connection closed mid-frame") {
    return absl::UnavailableError(absl::StrCat("agent connection lost (", error,
                                               "): the agent exited or restarted during the call"));
  }
  if (error == "interrupted") return absl::UnavailableError("agent client shut down");
  if (error.rfind("read:", 0) == 0 || error.rfind("poll:", 0) == 0 ||
      error.rfind("write:", 0) == 0) {
    return absl::UnavailableError(absl::StrCat("agent connection failed: ", error));
  }
  if (error == proto::kV1PeerError) return absl::FailedPreconditionError(kOutdatedMessage);
  return absl::InternalError(absl::StrCat("agent protocol: ", BoundedMessage(error)));
}

}  // namespace

bool AgentProtocolOutdated(const absl::Status& status) {
  return status.code() == absl::StatusCode::kFailedPrecondition &&
         absl::StartsWith(status.message(), "agent speaks protocol v");
}

struct AgentClient::CallSpec {
  json::object header;
  std::string payload;
  int64_t deadline_ms = 0;
  // Largest RESPONSE payload this op can need (0: header only).
  uint32_t max_response_payload = 0;
  // Receives OUTPUT frames (and an empty one every kTickMs of silence); false cancels the
  // call. Without it an OUTPUT frame is a protocol violation.
  std::function<bool(const proto::Frame&)> on_output;
  // Sent as INPUT frames after the REQUEST, then EOF (nullptr: no stdin).
  const std::string* input = nullptr;
  // The ping of ProbeSilentConnection (its own timeout probes nothing).
  bool probe = false;
};

struct AgentClient::CallReply {
  proto::Frame response;
};

// One connection to the agent: HELLO, then a reader thread that hands frames to their calls.
class AgentClient::Connection {
 public:
  struct Pending {
    uint32_t stream = 0;
    uint32_t max_response_frame = 0;
    bool streams_output = false;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<proto::Frame> output;       // at most the window (flow control)
    std::optional<proto::Frame> response;  // guarded by mu
    absl::Status failure;                  // the connection broke; guarded by mu
  };

  explicit Connection(int fd)
      : fd_(fd), wake_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)), channel_(fd, wake_.get()) {}
  ~Connection() {
    Close("interrupted");
    uint64_t one = 1;
    ssize_t ignored = write(wake_.get(), &one, sizeof one);
    (void)ignored;
    if (reader_.joinable()) reader_.join();
  }

  // Reads and checks the agent's HELLO, then starts the reader.
  absl::Status Start(int64_t deadline_ms) {
    if (!wake_) return ErrnoStatus("eventfd");
    // Non-blocking: a stalled agent makes a write give up after 30 s (WriteFrame).
    fcntl(fd_.get(), F_SETFL, fcntl(fd_.get(), F_GETFL) | O_NONBLOCK);
    proto::Frame hello;
    std::string error;
    if (!proto::ReadFrame(fd_.get(), &hello, &error, deadline_ms, kHelloFrameBytes)) {
      if (error == "timed out")
        return absl::DeadlineExceededError("reading agent hello: timed out");
      absl::Status s = ConnectionError(error);
      if (AgentProtocolOutdated(s)) return s;
      return absl::Status(s.code(), absl::StrCat("reading agent hello: ", s.message()));
    }
    if (hello.type != proto::FrameType::kHello) {
      return absl::InternalError("agent protocol: expected HELLO");
    }
    int64_t version = IntField(hello.header, "version", 0);
    if (version != proto::kVersion) {
      return absl::FailedPreconditionError(absl::StrCat("agent speaks protocol v", version,
                                                        ", esbd needs v", proto::kVersion,
                                                        ": the environment must be recreated"));
    }
    // The agent answers EBUSY past this many calls in flight: wait for a slot instead.
    max_calls_ = static_cast<size_t>(std::clamp<int64_t>(IntField(hello.header, "max_calls", 64),
                                                         1, 1024));
    if (const json::value* ops = hello.header.if_contains("ops"); ops && ops->is_array()) {
      for (const json::value& op : ops->as_array()) {
        if (op.is_string() && ops_.size() < 64 && op.as_string().size() <= 64) {
          ops_.emplace_back(op.as_string());
        }
      }
    }
    last_frame_ms_ = proto::MonotonicMs();
    reader_ = std::thread([this] { ReadLoop(); });
    return absl::OkStatus();
  }

  // When the agent last sent a frame (of any call) on this connection.
  int64_t last_frame_ms() const { return last_frame_ms_.load(); }
  // One probe of a silent connection at a time (many calls may time out together).
  bool TryStartProbe() { return !probing_.exchange(true); }
  void EndProbe() { probing_ = false; }
  // Gives the connection up: every pending call fails with `why`, the agent reads the end of
  // the stream (it cancels the calls it still runs) and the next call connects again.
  void Abandon(const std::string& why) {
    Close(why, absl::UnavailableError(absl::StrCat("agent connection given up: ", why)));
    ::shutdown(fd_.get(), SHUT_RDWR);
  }

  // Also dead once a write failed (the stream then holds a partial frame): the next call
  // connects again instead of failing on this connection for ever.
  bool dead() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failure_.ok()) return true;
    }
    return channel_.closed();
  }
  const std::vector<std::string>& ops() const { return ops_; }
  proto::Channel& channel() { return channel_; }

  // Registers a call on a fresh stream and sends its REQUEST.
  absl::StatusOr<std::shared_ptr<Pending>> Begin(const CallSpec& spec) {
    auto call = std::make_shared<Pending>();
    call->max_response_frame =
        proto::FrameBytesFor(proto::kMaxHeaderBytes, spec.max_response_payload);
    call->streams_output = static_cast<bool>(spec.on_output);
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Cancelled calls count until their RESPONSE: the agent still runs them.
      auto slot = [&] { return !failure_.ok() || calls_.size() + cancelled_.size() < max_calls_; };
      int64_t left = spec.deadline_ms - proto::MonotonicMs();
      if (!slot() &&
          (left <= 0 || !slots_.wait_for(lock, std::chrono::milliseconds(left), slot))) {
        return absl::DeadlineExceededError(
            absl::StrCat("agent busy: ", max_calls_, " calls in flight until the deadline"));
      }
      if (!failure_.ok()) return failure_;
      do {
        call->stream = next_stream_++;
      } while (call->stream == 0 || calls_.count(call->stream));
      calls_[call->stream] = call;
      channel_.Open(call->stream);
    }
    proto::Frame request;
    request.type = proto::FrameType::kRequest;
    request.stream = call->stream;
    request.header = spec.header;
    request.payload = spec.payload;
    // SECURITY: the agent is sandbox-controlled; a peer that reads slowly gets the call's
    // deadline, not as long as it keeps reading.
    if (!channel_.Send(request, spec.deadline_ms)) {
      Forget(call->stream);
      std::string reason = channel_.close_reason();
      CloseIfBroken();
      return absl::UnavailableError(absl::StrCat("agent request: ", reason));
    }
    return call;
  }

  // A failed write leaves a partial frame on the stream: nothing sent later can be parsed and
  // no pending call can be answered, so every pending call fails now (not at its own deadline,
  // which for a file op is 30 s) and the next call connects again.
  void CloseIfBroken() {
    if (channel_.closed()) Close(channel_.close_reason());
  }

  // Ends a call early: the agent gets CANCEL, frames still on their way are dropped.
  void Cancel(const Pending& call) {
    {
      // One step, so the reader never sees the stream neither live nor cancelled.
      std::lock_guard<std::mutex> lock(mu_);
      channel_.Close(call.stream);
      if (calls_.erase(call.stream) == 0) return;  // answered already
      slots_.notify_one();
      cancelled_[call.stream] = call.max_response_frame;
      // Bounded: an agent that never answers cancelled calls does not grow this forever.
      if (cancelled_.size() > 4096) cancelled_.erase(cancelled_.begin());
    }
    proto::Frame cancel;
    cancel.type = proto::FrameType::kCancel;
    cancel.stream = call.stream;
    if (!channel_.Send(cancel)) CloseIfBroken();
  }

 private:
  // Removes a call; true if it was still registered.
  bool Forget(uint32_t stream) {
    std::lock_guard<std::mutex> lock(mu_);
    channel_.Close(stream);
    slots_.notify_one();
    return calls_.erase(stream) > 0;
  }

  // `status`: what pending calls fail with (default: ConnectionError(error)).
  void Close(const std::string& error, absl::Status status = absl::OkStatus()) {
    std::map<uint32_t, std::shared_ptr<Pending>> calls;
    absl::Status failure;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failure_.ok()) failure_ = status.ok() ? ConnectionError(error) : std::move(status);
      failure = failure_;
      calls.swap(calls_);
      slots_.notify_all();
    }
    channel_.Shutdown(error);
    for (auto& [stream, call] : calls) {
      std::lock_guard<std::mutex> lock(call->mu);
      call->failure = failure;
      call->cv.notify_all();
    }
  }

  uint32_t Limit(proto::FrameType type, uint32_t stream) {
    switch (type) {
      case proto::FrameType::kOutput:
        return kOutputFrameBytes;
      case proto::FrameType::kWindow:
        return kControlFrameBytes;
      case proto::FrameType::kResponse: {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = calls_.find(stream);
        // The late answer of a cancelled call is read (and dropped) within its op's limit; a
        // small frame on a stream never opened is read so Dispatch can name the violation.
        if (it == calls_.end()) {
          auto c = cancelled_.find(stream);
          return c != cancelled_.end() ? c->second : kControlFrameBytes;
        }
        return it->second->max_response_frame;
      }
      default:
        // HELLO again, REQUEST, CANCEL, INPUT: never sent by an agent; a small one is read so
        // Dispatch can name the violation.
        return kControlFrameBytes;
    }
  }

  void ReadLoop() {
    const proto::FrameLimit limit = [this](proto::FrameType type, uint32_t stream) {
      return Limit(type, stream);
    };
    try {
      for (;;) {
        proto::Frame frame;
        std::string error;
        if (!proto::ReadFrame(fd_.get(), &frame, &error, -1, proto::kMaxFrameBytes, limit,
                              wake_.get())) {
          // Woken because a write broke the stream (any writer: a REQUEST, a WINDOW): every
          // pending call fails now with that reason, and the next call connects again.
          if (error == "interrupted" && channel_.closed()) error = channel_.close_reason();
          Close(error);
          return;
        }
        last_frame_ms_ = proto::MonotonicMs();
        if (std::string violation = Dispatch(std::move(frame)); !violation.empty()) {
          Close(violation);
          return;
        }
      }
    } catch (const std::exception& e) {  // bad_alloc: esbd itself is short of memory
      Close(std::string("agent connection dropped: ") + e.what());
    }
  }

  // Hands one frame to its call. Returns a protocol violation or "".
  std::string Dispatch(proto::Frame frame) {
    if (frame.type == proto::FrameType::kWindow) {
      const json::value* bytes = frame.header.if_contains("bytes");
      if (!bytes || !(bytes->is_int64() || bytes->is_uint64()) ||
          (bytes->is_int64() && bytes->as_int64() < 0)) {
        return "WINDOW without bytes";
      }
      channel_.Grant(frame.stream, bytes->to_number<uint64_t>());
      return "";
    }
    if (frame.type != proto::FrameType::kOutput && frame.type != proto::FrameType::kResponse) {
      return "unexpected frame type";
    }
    std::shared_ptr<Pending> call;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = calls_.find(frame.stream);
      if (it == calls_.end()) {
        if (!cancelled_.count(frame.stream)) return "frame for a stream that is not open";
        if (frame.type == proto::FrameType::kResponse && cancelled_.erase(frame.stream)) {
          slots_.notify_one();
        }
        return "";  // the end of a cancelled call
      }
      call = it->second;
      if (frame.type == proto::FrameType::kOutput) {
        if (!call->streams_output)
          return "unexpected frame type (OUTPUT for a call without output)";
        if (!channel_.Received(frame.stream, frame.payload.size())) {
          return "OUTPUT beyond the flow-control window";
        }
      } else {
        calls_.erase(it);
        slots_.notify_one();
        channel_.Close(frame.stream);
      }
    }
    std::lock_guard<std::mutex> lock(call->mu);
    if (frame.type == proto::FrameType::kOutput) {
      call->output.push_back(std::move(frame));
    } else {
      call->response = std::move(frame);
    }
    call->cv.notify_all();
    return "";
  }

  UniqueFd fd_;
  UniqueFd wake_;  // readable: the reader stops
  proto::Channel channel_;
  std::vector<std::string> ops_;
  std::thread reader_;
  std::mutex mu_;
  std::map<uint32_t, std::shared_ptr<Pending>> calls_;  // guarded by mu_
  // Cancelled calls whose RESPONSE has not come yet → its frame limit. Their late frames are
  // dropped. Guarded by mu_.
  std::map<uint32_t, uint32_t> cancelled_;
  uint32_t next_stream_ = 1;  // guarded by mu_
  size_t max_calls_ = 64;     // from the HELLO
  std::condition_variable slots_;  // a call ended (or the connection broke)
  absl::Status failure_;      // guarded by mu_
  std::atomic<int64_t> last_frame_ms_{0};
  std::atomic<bool> probing_{false};
};

namespace {

// A single already-open byte stream (virtio-serial port): usable for one connection.
class SingleFdTransport : public AgentTransport {
 public:
  explicit SingleFdTransport(int fd) : fd_(fd) {}
  absl::StatusOr<int> Connect() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!fd_) {
      return absl::UnavailableError(
          "the agent's port was lost (a broken stream cannot be resynchronised): the "
          "environment must be restarted");
    }
    return fd_.release();
  }

 private:
  std::mutex mu_;
  UniqueFd fd_;
};

class ConnectorTransport : public AgentTransport {
 public:
  explicit ConnectorTransport(AgentClient::Connector connect) : connect_(std::move(connect)) {}
  absl::StatusOr<int> Connect() override { return connect_(); }

 private:
  AgentClient::Connector connect_;
};

}  // namespace

AgentClient::AgentClient(Connector connect)
    : transport_(std::make_unique<ConnectorTransport>(std::move(connect))) {}
AgentClient::AgentClient(std::unique_ptr<AgentTransport> transport)
    : transport_(std::move(transport)) {}
AgentClient::~AgentClient() = default;

std::unique_ptr<AgentTransport> AgentClient::SingleFd(int fd) {
  return std::make_unique<SingleFdTransport>(fd);
}

absl::StatusOr<std::shared_ptr<AgentClient::Connection>> AgentClient::Connected(
    int64_t deadline_ms) {
  // Waits for another caller's connect (and HELLO) no longer than this call's own deadline.
  std::unique_lock<std::timed_mutex> lock(connect_mu_, std::defer_lock);
  if (!lock.try_lock_until(
          std::chrono::steady_clock::now() +
          std::chrono::milliseconds(std::max<int64_t>(deadline_ms - proto::MonotonicMs(), 0)))) {
    return absl::DeadlineExceededError("connecting to the agent: timed out behind another connect");
  }
  if (conn_ && !conn_->dead()) return conn_;
  conn_.reset();
  absl::StatusOr<int> fd = transport_->Connect();
  if (!fd.ok()) return fd.status();
  auto conn = std::make_shared<Connection>(*fd);
  if (absl::Status s = conn->Start(deadline_ms); !s.ok()) return s;
  conn_ = conn;
  return conn;
}

absl::StatusOr<AgentClient::CallReply> AgentClient::Call(const CallSpec& spec) {
  absl::StatusOr<std::shared_ptr<Connection>> conn = Connected(spec.deadline_ms);
  if (!conn.ok()) return conn.status();
  return CallOn(*conn, spec);
}

bool AgentClient::ProbeSilentConnection(const std::shared_ptr<Connection>& conn, int64_t since_ms) {
  // F11: an agent that had stopped answering on its connection (while the connection stayed
  // open) made every call time out for ever. Calls that time out on a silent connection now
  // ask it directly; a live agent answers a ping at once (or says it is busy).
  if (conn->last_frame_ms() >= since_ms || conn->dead() || !conn->TryStartProbe()) return false;
  CallSpec ping;
  ping.header = {{"op", "ping"}};
  ping.probe = true;
  const int64_t start = proto::MonotonicMs();
  ping.deadline_ms = start + kProbeTimeoutMs;
  absl::StatusOr<CallReply> reply = CallOn(conn, ping);
  conn->EndProbe();
  // Only a ping that went out and met silence condemns the connection (not "agent busy", not
  // a connection that broke meanwhile, not one that delivered anything since).
  if (reply.ok() || conn->last_frame_ms() >= start ||
      !absl::StartsWith(reply.status().message(), "agent call timed out")) {
    return false;
  }
  const std::string why = absl::StrCat(
      "the agent stopped answering on its connection (a call "
      "timed out and a ping got no answer in ",
      kProbeTimeoutMs / 1000, " s)");
  LogWarn(absl::StrCat(label_, ": ", why, "; giving the connection up (the next call connects "
                       "again)"));
  conn->Abandon(why);
  return true;
}

absl::StatusOr<AgentClient::CallReply> AgentClient::CallOn(const std::shared_ptr<Connection>& conn,
                                                           const CallSpec& spec) {
  const int64_t started_ms = proto::MonotonicMs();
  absl::StatusOr<std::shared_ptr<Connection::Pending>> started = conn->Begin(spec);
  if (!started.ok()) return started.status();
  std::shared_ptr<Connection::Pending> call = *started;
  // Stdin goes out from a thread of its own: waiting for input credit must never stop this
  // thread from taking output (the agent may be waiting for output credit in turn).
  std::thread input;
  if (spec.input) {
    input = std::thread([conn, call, data = spec.input, deadline = spec.deadline_ms] {
      std::string error;
      if (conn->channel().SendData(proto::FrameType::kInput, call->stream, {}, *data, deadline,
                                   deadline, &error)) {
        proto::Frame eof;
        eof.type = proto::FrameType::kInput;
        eof.stream = call->stream;
        eof.header["eof"] = true;
        if (conn->channel().Send(eof)) return;
      }
      conn->CloseIfBroken();  // a credit timeout leaves the stream whole; a failed write not
    });
  }
  absl::StatusOr<CallReply> result = [&]() -> absl::StatusOr<CallReply> {
    std::unique_lock<std::mutex> lock(call->mu);
    for (;;) {
      if (!call->output.empty()) {
        proto::Frame frame = std::move(call->output.front());
        call->output.pop_front();
        lock.unlock();
        conn->channel().Consumed(call->stream, frame.payload.size());
        bool go_on = spec.on_output(frame);
        lock.lock();
        if (!go_on) {
          lock.unlock();
          conn->Cancel(*call);
          return absl::CancelledError("command cancelled by the output consumer");
        }
        continue;
      }
      if (call->response) {
        CallReply reply{std::move(*call->response)};
        if (reply.response.payload.size() > spec.max_response_payload) {
          return absl::InternalError("agent protocol: oversized response");
        }
        if (const json::value* ok = reply.response.header.if_contains("ok");
            ok && ok->is_bool() && ok->as_bool()) {
          return reply;
        }
        return ErrorFromResponse(reply.response.header);
      }
      if (!call->failure.ok()) return call->failure;
      int64_t now = proto::MonotonicMs();
      if (now >= spec.deadline_ms) {
        lock.unlock();
        conn->Cancel(*call);
        if (!spec.probe && ProbeSilentConnection(conn, started_ms)) {
          return absl::DeadlineExceededError(
              "agent call timed out; the agent did not answer a ping on its connection either, "
              "which was given up (the next call connects again)");
        }
        return absl::DeadlineExceededError("agent call timed out");
      }
      int64_t wait = spec.deadline_ms - now;
      if (spec.on_output) wait = std::min(wait, kTickMs);
      if (call->cv.wait_for(lock, std::chrono::milliseconds(wait)) == std::cv_status::timeout &&
          spec.on_output && call->output.empty() && !call->response && call->failure.ok() &&
          proto::MonotonicMs() < spec.deadline_ms) {
        // Silent command: tick the consumer so it can notice a client that went away.
        lock.unlock();
        bool go_on = spec.on_output(proto::Frame{proto::FrameType::kOutput, call->stream, {}, {}});
        lock.lock();
        if (!go_on) {
          lock.unlock();
          conn->Cancel(*call);
          return absl::CancelledError("command cancelled by the output consumer");
        }
      }
    }
  }();
  if (input.joinable()) {
    conn->Cancel(*call);  // no-op once answered; wakes a sender waiting for credit
    input.join();
  }
  return result;
}

AgentClient::Connector AgentClient::UnixSocket(std::string path, int timeout_ms) {
  return [path = std::move(path), timeout_ms]() -> absl::StatusOr<int> {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (path.empty() || path.size() >= sizeof addr.sun_path) {
      return absl::InvalidArgumentError(absl::StrCat("agent socket path too long: ", path));
    }
    memcpy(addr.sun_path, path.data(), path.size());
    int64_t deadline = proto::MonotonicMs() + timeout_ms;
    for (;;) {
      UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
      if (!fd) return ErrnoStatus("socket");
      if (connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
        int flags = fcntl(fd.get(), F_GETFL);
        fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
        return fd.release();
      }
      int err = errno;
      // EAGAIN: the listen backlog is full; the agent is alive but busy. Retry until the
      // deadline. Anything else means there is no agent (yet).
      if (err != EAGAIN && err != EINTR) {
        return absl::UnavailableError(
            absl::StrCat("connect to agent at ", path, ": ", strerror(err)));
      }
      if (proto::MonotonicMs() >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("connect to agent at ", path, ": timed out"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  };
}

absl::Status AgentClient::Ping(int timeout_ms) {
  CallSpec spec;
  spec.header = {{"op", "ping"}};
  spec.deadline_ms = proto::MonotonicMs() + timeout_ms;
  return Call(spec).status();
}

absl::Status AgentClient::WaitReady(int timeout_ms) {
  int64_t deadline = proto::MonotonicMs() + timeout_ms;
  absl::Status last = absl::DeadlineExceededError("agent not ready");
  for (;;) {
    int64_t left = deadline - proto::MonotonicMs();
    if (left <= 0) break;
    last = Ping(static_cast<int>(std::min<int64_t>(left, 1000)));
    if (last.ok() || AgentProtocolOutdated(last)) return last;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("agent not ready after ", timeout_ms, " ms: ", last.message()));
}

absl::StatusOr<std::vector<std::string>> AgentClient::Capabilities(int timeout_ms) {
  absl::StatusOr<std::shared_ptr<Connection>> conn = Connected(proto::MonotonicMs() + timeout_ms);
  if (!conn.ok()) return conn.status();
  return (*conn)->ops();
}

absl::StatusOr<ExecResult> AgentClient::Exec(const ExecRequest& request, const OutputSink& sink) {
  int64_t timeout_ms = std::max<int64_t>(request.timeout.count(), 1);
  CallSpec spec;
  spec.deadline_ms = proto::MonotonicMs() + timeout_ms + kExecGraceMs;
  json::object env;
  for (const auto& [k, v] : request.env) env[k] = v;
  spec.header = {{"op", "exec"},
                 {"timeout_ms", timeout_ms},
                 {"max_output_bytes", request.max_output_bytes},
                 {"env", std::move(env)}};
  if (request.command.size() > kMaxCommandInHeader) {
    // The header is capped at 64 KiB, so long commands travel in the payload.
    if (request.command.size() > proto::kMaxPayloadBytes) {
      return absl::InvalidArgumentError("command longer than 16 MiB");
    }
    spec.header["command_in_payload"] = true;
    spec.payload = request.command;
  } else {
    spec.header["command"] = request.command;
  }
  if (request.stdin_data) {
    spec.header["stdin"] = true;
    spec.input = &*request.stdin_data;
  }
  ExecResult result;
  spec.on_output = [&](const proto::Frame& frame) {
    Stream stream =
        StringField(frame.header, "stream") == "stderr" ? Stream::kStderr : Stream::kStdout;
    // SECURITY: the peer is inside the sandbox and may not be the real agent (sandbox code
    // runs as the same uid and can replace the socket): never buffer more than the cap.
    std::string& buf = stream == Stream::kStderr ? result.stderr_data : result.stdout_data;
    size_t room = request.max_output_bytes > static_cast<int64_t>(buf.size())
                      ? static_cast<size_t>(request.max_output_bytes) - buf.size()
                      : 0;
    if (frame.payload.size() > room) result.truncated = true;
    buf.append(frame.payload, 0, std::min(room, frame.payload.size()));
    return !sink || sink(stream, frame.payload);  // empty payload: a liveness tick
  };
  absl::StatusOr<CallReply> reply = Call(spec);
  if (!reply.ok()) return reply.status();
  const json::object& h = reply->response.header;
  result.exit_code = static_cast<int>(IntField(h, "exit_code", -1));
  result.timed_out = BoolField(h, "timed_out");
  result.truncated = result.truncated || BoolField(h, "truncated");
  result.duration_ms = IntField(h, "duration_ms");
  return result;
}

absl::Status AgentClient::Write(const std::string& path, std::string_view data, int64_t offset,
                                bool truncate) {
  if (offset < 0) return absl::InvalidArgumentError("negative offset");
  size_t done = 0;
  do {
    size_t n = std::min(kWriteChunk, data.size() - done);
    CallSpec spec;
    spec.deadline_ms = proto::MonotonicMs() + kFileOpTimeoutMs;
    spec.header = {{"op", "write"},
                   {"path", path},
                   {"offset", offset + static_cast<int64_t>(done)},
                   {"truncate", truncate && done == 0}};
    spec.payload.assign(data.substr(done, n));
    if (absl::Status s = Call(spec).status(); !s.ok()) return s;
    done += n;
  } while (done < data.size());
  return absl::OkStatus();
}

absl::StatusOr<FileChunk> AgentClient::Read(const std::string& path, int64_t offset,
                                            int64_t length) {
  if (offset < 0 || length < 0) return absl::InvalidArgumentError("negative offset or length");
  length = std::min<int64_t>(length, proto::kMaxPayloadBytes);
  CallSpec spec;
  spec.deadline_ms = proto::MonotonicMs() + kFileOpTimeoutMs;
  spec.header = {{"op", "read"}, {"path", path}, {"offset", offset}, {"length", length}};
  spec.max_response_payload = static_cast<uint32_t>(length);
  absl::StatusOr<CallReply> reply = Call(spec);
  if (!reply.ok()) return reply.status();
  FileChunk chunk;
  chunk.data = std::move(reply->response.payload);
  chunk.file_size = std::max<int64_t>(IntField(reply->response.header, "size"), 0);
  chunk.eof = BoolField(reply->response.header, "eof");
  return chunk;
}

absl::StatusOr<DirListing> AgentClient::List(const std::string& path) {
  CallSpec spec;
  spec.deadline_ms = proto::MonotonicMs() + kShortOpTimeoutMs;
  spec.header = {{"op", "list"}, {"path", path}};
  spec.max_response_payload = proto::kMaxListPayloadBytes;
  absl::StatusOr<CallReply> reply = Call(spec);
  if (!reply.ok()) return reply.status();
  proto::Frame* response = &reply->response;
  DirListing out;
  out.truncated = BoolField(response->header, "truncated");
  auto take = [&out](const json::array& entries) -> absl::Status {
    if (entries.size() > proto::kMaxListEntries) {
      return absl::InternalError("agent list: more entries than the protocol allows");
    }
    out.entries.reserve(entries.size());
    for (const json::value& e : entries) {
      if (e.is_object()) out.entries.push_back(EntryFrom(e.as_object()));
    }
    return absl::OkStatus();
  };
  if (BoolField(response->header, "entries_in_payload")) {
    // Large listings travel in the payload (the header is capped at 64 KiB).
    // SECURITY: a payload of millions of tiny values (`[{},{},...]`) would cost ~40x its size
    // once parsed: count the values first, then parse into a fixed arena as a hard ceiling.
    if (!JsonShapeWithin(response->payload, proto::kMaxListEntries + 1,
                         (proto::kMaxListEntries + 1) * 16)) {
      return absl::InternalError("agent list: more entries than the protocol allows");
    }
    std::unique_ptr<unsigned char[]> arena(new unsigned char[kListParseArenaBytes]);
    json::static_resource mr(arena.get(), kListParseArenaBytes);
    json::parse_options options;
    options.max_depth = 4;
    boost::system::error_code ec;
    json::value v;
    try {
      v = json::parse(response->payload, ec, &mr, options);
    } catch (const std::bad_alloc&) {
      return absl::InternalError("agent list: entries payload too complex");
    }
    if (ec || !v.is_array()) return absl::InternalError("agent list: bad entries payload");
    if (absl::Status s = take(v.as_array()); !s.ok()) return s;
  } else if (const json::value* v = response->header.if_contains("entries"); v && v->is_array()) {
    if (absl::Status s = take(v->as_array()); !s.ok()) return s;
  }
  return out;
}

absl::StatusOr<FileEntry> AgentClient::Stat(const std::string& path) {
  CallSpec spec;
  spec.deadline_ms = proto::MonotonicMs() + kShortOpTimeoutMs;
  spec.header = {{"op", "stat"}, {"path", path}};
  absl::StatusOr<CallReply> reply = Call(spec);
  if (!reply.ok()) return reply.status();
  FileEntry entry = EntryFrom(reply->response.header);
  size_t slash = path.find_last_of('/');
  entry.name = slash == std::string::npos ? path : path.substr(slash + 1);
  return entry;
}

absl::StatusOr<bool> AgentClient::MakeDir(const std::string& path) {
  CallSpec spec;
  spec.deadline_ms = proto::MonotonicMs() + kShortOpTimeoutMs;
  spec.header = {{"op", "mkdir"}, {"path", path}};
  absl::StatusOr<CallReply> reply = Call(spec);
  if (!reply.ok()) return reply.status();
  return BoolField(reply->response.header, "created");
}

absl::Status AgentClient::Remove(const std::string& path, bool recursive) {
  // The agent stops a recursive remove after 20 s (agent/fs_ops.h); this deadline is longer.
  CallSpec spec;
  spec.deadline_ms = proto::MonotonicMs() + kShortOpTimeoutMs;
  spec.header = {{"op", "remove"}, {"path", path}, {"recursive", recursive}};
  return Call(spec).status();
}

absl::Status AgentClient::Rename(const std::string& source, const std::string& destination,
                                 bool overwrite) {
  CallSpec spec;
  spec.deadline_ms = proto::MonotonicMs() + kShortOpTimeoutMs;
  spec.header = {{"op", "rename"},
                 {"source", source},
                 {"destination", destination},
                 {"overwrite", overwrite}};
  return Call(spec).status();
}

absl::Status AgentClient::Configure(const std::map<std::string, std::string>& env) {
  json::object object;
  for (const auto& [k, v] : env) object[k] = v;
  CallSpec spec;
  spec.deadline_ms = proto::MonotonicMs() + kShortOpTimeoutMs;
  spec.header = {{"op", "configure"}, {"env", std::move(object)}};
  return Call(spec).status();
}

absl::StatusOr<std::string> AgentClient::Spawn(const ProcessRequest& request) {
  if (request.argv.empty()) return absl::InvalidArgumentError("spawn: empty argv");
  json::array argv;
  for (const std::string& a : request.argv) argv.emplace_back(a);
  json::object env;
  for (const auto& [k, v] : request.env) env[k] = v;
  CallSpec spec;
  spec.deadline_ms = proto::MonotonicMs() + kShortOpTimeoutMs;
  spec.header = {
      {"op", "spawn"}, {"argv", std::move(argv)}, {"env", std::move(env)}, {"pty", request.pty}};
  if (!request.cwd.empty()) spec.header["cwd"] = request.cwd;
  if (request.pty) {
    spec.header["rows"] = request.rows;
    spec.header["cols"] = request.cols;
  }
  absl::StatusOr<CallReply> reply = Call(spec);
  if (!reply.ok()) return reply.status();
  std::string id = StringField(reply->response.header, "id");
  // SECURITY: the id comes back in later requests and in API answers: keep it a short token.
  if (id.empty() || id.size() > 64 ||
      id.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789-_") != std::string::npos) {
    return absl::InternalError("agent protocol: bad process id");
  }
  return id;
}

absl::Status AgentClient::Input(const std::string& id, std::string_view data, bool eof) {
  if (data.size() > proto::kMaxPayloadBytes) return absl::InvalidArgumentError("input > 16 MiB");
  CallSpec spec;
  spec.deadline_ms = proto::MonotonicMs() + kShortOpTimeoutMs;
  spec.header = {{"op", "input"}, {"id", id}, {"eof", eof}};
  spec.payload.assign(data);
  return Call(spec).status();
}

absl::Status AgentClient::Signal(const std::string& id, int signal) {
  CallSpec spec;
  spec.deadline_ms = proto::MonotonicMs() + kShortOpTimeoutMs;
  spec.header = {{"op", "signal"}, {"id", id}, {"signal", signal}};
  return Call(spec).status();
}

absl::Status AgentClient::Resize(const std::string& id, int rows, int cols) {
  CallSpec spec;
  spec.deadline_ms = proto::MonotonicMs() + kShortOpTimeoutMs;
  spec.header = {{"op", "resize"}, {"id", id}, {"rows", rows}, {"cols", cols}};
  return Call(spec).status();
}

absl::StatusOr<ProcessStatus> AgentClient::Wait(const std::string& id, int timeout_ms,
                                                const OutputSink& sink) {
  CallSpec spec;
  spec.deadline_ms = proto::MonotonicMs() + std::max(timeout_ms, 0) + kExecGraceMs;
  spec.header = {{"op", "wait"}, {"id", id}, {"timeout_ms", std::max(timeout_ms, 0)}};
  spec.on_output = [&](const proto::Frame& frame) {
    Stream stream =
        StringField(frame.header, "stream") == "stderr" ? Stream::kStderr : Stream::kStdout;
    return !sink || sink(stream, frame.payload);
  };
  absl::StatusOr<CallReply> reply = Call(spec);
  if (!reply.ok()) return reply.status();
  ProcessStatus status;
  status.exited = BoolField(reply->response.header, "exited");
  status.exit_code = static_cast<int>(IntField(reply->response.header, "exit_code", -1));
  status.truncated = BoolField(reply->response.header, "truncated");
  return status;
}

absl::Status AgentClient::Kill(const std::string& id) {
  CallSpec spec;
  spec.deadline_ms = proto::MonotonicMs() + kShortOpTimeoutMs;
  spec.header = {{"op", "kill"}, {"id", id}};
  return Call(spec).status();
}

absl::Status AgentClient::Sync(bool freeze, int64_t max_frozen_ms) {
  CallSpec spec;
  spec.deadline_ms = proto::MonotonicMs() + kShortOpTimeoutMs;
  spec.header = {{"op", "sync"}, {"freeze", freeze}, {"max_frozen_ms", max_frozen_ms}};
  return Call(spec).status();
}

absl::Status AgentClient::Thaw() {
  CallSpec spec;
  spec.deadline_ms = proto::MonotonicMs() + kShortOpTimeoutMs;
  spec.header = {{"op", "thaw"}};
  return Call(spec).status();
}

absl::Status AgentClient::Reseed(std::string_view entropy) {
  if (entropy.size() < 16 || entropy.size() > 4096) {
    return absl::InvalidArgumentError("reseed: entropy must be 16..4096 bytes");
  }
  CallSpec spec;
  spec.deadline_ms = proto::MonotonicMs() + kShortOpTimeoutMs;
  spec.header = {{"op", "reseed"}};
  spec.payload.assign(entropy);
  return Call(spec).status();
}

absl::StatusOr<AgentWalkReply> AgentClient::Walk(const std::string& base, bool contents,
                                                 int64_t max_entries, int64_t max_content_bytes) {
  CallSpec spec;
  spec.deadline_ms = proto::MonotonicMs() + kFileOpTimeoutMs;
  spec.header = {{"op", "walk"},
                 {"base", base},
                 {"contents", contents},
                 {"max_entries", max_entries},
                 {"max_content_bytes", max_content_bytes}};
  spec.max_response_payload = proto::kMaxPayloadBytes;
  absl::StatusOr<CallReply> reply = Call(spec);
  if (!reply.ok()) return reply.status();
  const json::object& h = reply->response.header;
  std::string& payload = reply->response.payload;
  // SECURITY: lengths come from inside the sandbox: they must add up to what was received.
  const int64_t manifest_bytes = IntField(h, "manifest_bytes");
  if (manifest_bytes < 0 || manifest_bytes > static_cast<int64_t>(payload.size())) {
    return absl::InternalError("agent walk: manifest_bytes does not match the payload");
  }
  AgentWalkReply out;
  const json::value* token = h.if_contains("walk");
  if (token && token->is_string() && token->as_string().size() <= 128)
    out.token = std::string(token->as_string());
  out.skipped = std::max<int64_t>(IntField(h, "skipped"), 0);
  out.contents = payload.substr(static_cast<size_t>(manifest_bytes));
  payload.resize(static_cast<size_t>(manifest_bytes));
  out.manifest_json = std::move(payload);
  return out;
}

absl::Status AgentClient::Apply(std::string manifest_json, std::string_view data, bool prune,
                                bool finish) {
  if (manifest_json.size() + data.size() > proto::kMaxPayloadBytes) {
    return absl::InvalidArgumentError("agent apply: larger than one frame");
  }
  CallSpec spec;
  spec.deadline_ms = proto::MonotonicMs() + kFileOpTimeoutMs;
  spec.header = {{"op", "apply"},
                 {"manifest_bytes", static_cast<int64_t>(manifest_json.size())},
                 {"prune", prune},
                 {"finish", finish}};
  spec.payload = std::move(manifest_json);
  spec.payload.append(data);
  return Call(spec).status();
}

absl::StatusOr<std::string> AgentClient::ShellState(int64_t max_bytes) {
  CallSpec spec;
  spec.deadline_ms = proto::MonotonicMs() + kShortOpTimeoutMs;
  // The agent answers EFBIG for a larger state (a larger payload would break the connection).
  spec.header = {{"op", "shell_state"}, {"max_bytes", max_bytes}};
  spec.max_response_payload =
      static_cast<uint32_t>(std::clamp<int64_t>(max_bytes, 0, proto::kMaxPayloadBytes));
  absl::StatusOr<CallReply> reply = Call(spec);
  if (!reply.ok()) return reply.status();
  return std::move(reply->response.payload);
}

absl::Status AgentClient::SetShellState(std::string_view state) {
  CallSpec spec;
  spec.deadline_ms = proto::MonotonicMs() + kShortOpTimeoutMs;
  spec.header = {{"op", "shell_state"}, {"set", true}};
  spec.payload.assign(state);
  return Call(spec).status();
}

absl::Status AgentClient::ReleaseListener() {
  CallSpec spec;
  spec.deadline_ms = proto::MonotonicMs() + kShortOpTimeoutMs;
  spec.header = {{"op", "release_listener"}};
  return Call(spec).status();
}

}  // namespace esb

#include "drivers/agent_client.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
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
// Commands longer than this go in the request payload instead of the header.
constexpr size_t kMaxCommandInHeader = 32 * 1024;

// SECURITY: the agent lives inside the sandbox, and whatever answers on its socket is treated as
// hostile. Every reply is refused past the size its op can legitimately need, so a lying peer
// cannot make esbd allocate more than that per call.
constexpr uint32_t kHelloFrameBytes = proto::FrameBytesFor(4096, 0);
// The agent sends output in chunks of at most 64 KiB.
constexpr uint32_t kMaxOutputPayload = 1 << 20;
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

// One request on a fresh connection: HELLO, REQUEST, OUTPUT*, RESPONSE.
class Call {
 public:
  explicit Call(int fd) : fd_(fd) {}

  absl::Status Start(int64_t deadline_ms) {
    proto::Frame hello;
    std::string error;
    if (!proto::ReadFrame(fd_.get(), &hello, &error, deadline_ms, kHelloFrameBytes)) {
      return TransportError("reading agent hello", error);
    }
    if (hello.type != proto::FrameType::kHello) {
      return absl::InternalError("agent protocol: expected HELLO");
    }
    return absl::OkStatus();
  }

  absl::Status Send(json::object header, std::string payload = "") {
    proto::Frame request;
    request.type = proto::FrameType::kRequest;
    request.header = std::move(header);
    request.payload = std::move(payload);
    std::string error;
    if (!proto::WriteFrame(fd_.get(), request, &error)) {
      return absl::UnavailableError(absl::StrCat("agent request: ", error));
    }
    return absl::OkStatus();
  }

  // Reads frames until the RESPONSE, whose payload may be at most `max_payload` bytes (0 for
  // header-only replies). OUTPUT frames (at most kMaxOutputPayload each) go to `on_output`,
  // which may return false to stop: the call then returns Cancelled and the connection is
  // closed. Without `on_output` an OUTPUT frame is a protocol violation.
  absl::StatusOr<proto::Frame> Receive(
      int64_t deadline_ms, uint32_t max_payload,
      const std::function<bool(const proto::Frame&)>& on_output = nullptr) {
    const uint32_t max_frame = proto::FrameBytesFor(
        proto::kMaxHeaderBytes, on_output ? std::max(max_payload, kMaxOutputPayload) : max_payload);
    for (;;) {
      proto::Frame frame;
      std::string error;
      if (on_output) {
        // While the command is silent, tick the consumer every 250 ms (an empty OUTPUT frame)
        // so it can notice a client that went away and cancel. Poll before reading so a tick
        // never interrupts a frame half-way.
        pollfd p{fd_.get(), POLLIN, 0};
        int64_t left = deadline_ms - proto::MonotonicMs();
        int r = ::poll(&p, 1, static_cast<int>(std::clamp<int64_t>(left, 0, 250)));
        if (r == 0 && left > 0) {
          proto::Frame tick;
          tick.type = proto::FrameType::kOutput;
          if (!on_output(tick)) {
            fd_.reset();  // closing the connection makes the agent kill the process group
            return absl::CancelledError("command cancelled by the output consumer");
          }
          continue;
        }
      }
      if (!proto::ReadFrame(fd_.get(), &frame, &error, deadline_ms, max_frame)) {
        return TransportError("reading agent response", error);
      }
      if (frame.type == proto::FrameType::kResponse) {
        if (frame.payload.size() > max_payload) {
          return absl::InternalError("agent protocol: oversized response");
        }
        if (const json::value* ok = frame.header.if_contains("ok");
            ok && ok->is_bool() && ok->as_bool()) {
          return frame;
        }
        return ErrorFromResponse(frame.header);
      }
      if (frame.type != proto::FrameType::kOutput || !on_output) {
        return absl::InternalError("agent protocol: unexpected frame type");
      }
      if (frame.payload.size() > kMaxOutputPayload) {
        return absl::InternalError("agent protocol: oversized output frame");
      }
      if (on_output && !on_output(frame)) {
        fd_.reset();  // closing the connection makes the agent kill the process group
        return absl::CancelledError("command cancelled by the output consumer");
      }
    }
  }

 private:
  static absl::Status TransportError(const std::string& what, const std::string& error) {
    if (error == "timed out") return absl::DeadlineExceededError(absl::StrCat(what, ": timed out"));
    return absl::UnavailableError(absl::StrCat(what, ": ", error));
  }

  static absl::Status ErrorFromResponse(const json::object& header) {
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

  UniqueFd fd_;
};

int64_t IntField(const json::object& o, const char* key, int64_t fallback = 0) {
  const json::value* v = o.if_contains(key);
  if (!v) return fallback;
  if (v->is_int64()) return v->as_int64();
  if (v->is_uint64()) return static_cast<int64_t>(v->as_uint64());
  if (v->is_double()) return static_cast<int64_t>(v->as_double());
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

}  // namespace

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
  int64_t deadline = proto::MonotonicMs() + timeout_ms;
  absl::StatusOr<int> fd = connect_();
  if (!fd.ok()) return fd.status();
  Call call(*fd);
  if (absl::Status s = call.Start(deadline); !s.ok()) return s;
  if (absl::Status s = call.Send({{"op", "ping"}}); !s.ok()) return s;
  return call.Receive(deadline, 0).status();
}

absl::Status AgentClient::WaitReady(int timeout_ms) {
  int64_t deadline = proto::MonotonicMs() + timeout_ms;
  absl::Status last = absl::DeadlineExceededError("agent not ready");
  for (;;) {
    int64_t left = deadline - proto::MonotonicMs();
    if (left <= 0) break;
    last = Ping(static_cast<int>(std::min<int64_t>(left, 1000)));
    if (last.ok()) return last;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("agent not ready after ", timeout_ms, " ms: ", last.message()));
}

absl::StatusOr<ExecResult> AgentClient::Exec(const ExecRequest& request, const OutputSink& sink) {
  int64_t timeout_ms = std::max<int64_t>(request.timeout.count(), 1);
  int64_t deadline = proto::MonotonicMs() + timeout_ms + kExecGraceMs;
  absl::StatusOr<int> fd = connect_();
  if (!fd.ok()) return fd.status();
  Call call(*fd);
  if (absl::Status s = call.Start(deadline); !s.ok()) return s;
  json::object env;
  for (const auto& [k, v] : request.env) env[k] = v;
  json::object header{{"op", "exec"},
                      {"timeout_ms", timeout_ms},
                      {"max_output_bytes", request.max_output_bytes},
                      {"env", std::move(env)}};
  std::string payload;
  if (request.command.size() > kMaxCommandInHeader) {
    // Extension to the documented format: the header is capped at 64 KiB, so long commands
    // travel in the payload.
    if (request.command.size() > proto::kMaxPayloadBytes) {
      return absl::InvalidArgumentError("command longer than 16 MiB");
    }
    header["command_in_payload"] = true;
    payload = request.command;
  } else {
    header["command"] = request.command;
  }
  if (absl::Status s = call.Send(std::move(header), std::move(payload)); !s.ok()) return s;
  ExecResult result;
  auto on_output = [&](const proto::Frame& frame) {
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
  absl::StatusOr<proto::Frame> response = call.Receive(deadline, 0, on_output);
  if (!response.ok()) return response.status();
  result.exit_code = static_cast<int>(IntField(response->header, "exit_code", -1));
  result.timed_out = BoolField(response->header, "timed_out");
  result.truncated = result.truncated || BoolField(response->header, "truncated");
  result.duration_ms = IntField(response->header, "duration_ms");
  return result;
}

absl::Status AgentClient::Write(const std::string& path, std::string_view data, int64_t offset,
                                bool truncate) {
  if (offset < 0) return absl::InvalidArgumentError("negative offset");
  size_t done = 0;
  do {
    size_t n = std::min(kWriteChunk, data.size() - done);
    int64_t deadline = proto::MonotonicMs() + kFileOpTimeoutMs;
    absl::StatusOr<int> fd = connect_();
    if (!fd.ok()) return fd.status();
    Call call(*fd);
    if (absl::Status s = call.Start(deadline); !s.ok()) return s;
    json::object header{{"op", "write"},
                        {"path", path},
                        {"offset", offset + static_cast<int64_t>(done)},
                        {"truncate", truncate && done == 0}};
    if (absl::Status s = call.Send(std::move(header), std::string(data.substr(done, n))); !s.ok()) {
      return s;
    }
    if (absl::Status s = call.Receive(deadline, 0).status(); !s.ok()) return s;
    done += n;
  } while (done < data.size());
  return absl::OkStatus();
}

absl::StatusOr<FileChunk> AgentClient::Read(const std::string& path, int64_t offset,
                                            int64_t length) {
  if (offset < 0 || length < 0) return absl::InvalidArgumentError("negative offset or length");
  length = std::min<int64_t>(length, proto::kMaxPayloadBytes);
  int64_t deadline = proto::MonotonicMs() + kFileOpTimeoutMs;
  absl::StatusOr<int> fd = connect_();
  if (!fd.ok()) return fd.status();
  Call call(*fd);
  if (absl::Status s = call.Start(deadline); !s.ok()) return s;
  if (absl::Status s =
          call.Send({{"op", "read"}, {"path", path}, {"offset", offset}, {"length", length}});
      !s.ok()) {
    return s;
  }
  absl::StatusOr<proto::Frame> response = call.Receive(deadline, static_cast<uint32_t>(length));
  if (!response.ok()) return response.status();
  FileChunk chunk;
  chunk.data = std::move(response->payload);
  chunk.file_size = std::max<int64_t>(IntField(response->header, "size"), 0);
  chunk.eof = BoolField(response->header, "eof");
  return chunk;
}

absl::StatusOr<DirListing> AgentClient::List(const std::string& path) {
  int64_t deadline = proto::MonotonicMs() + kShortOpTimeoutMs;
  absl::StatusOr<int> fd = connect_();
  if (!fd.ok()) return fd.status();
  Call call(*fd);
  if (absl::Status s = call.Start(deadline); !s.ok()) return s;
  if (absl::Status s = call.Send({{"op", "list"}, {"path", path}}); !s.ok()) return s;
  absl::StatusOr<proto::Frame> response = call.Receive(deadline, proto::kMaxListPayloadBytes);
  if (!response.ok()) return response.status();
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
  int64_t deadline = proto::MonotonicMs() + kShortOpTimeoutMs;
  absl::StatusOr<int> fd = connect_();
  if (!fd.ok()) return fd.status();
  Call call(*fd);
  if (absl::Status s = call.Start(deadline); !s.ok()) return s;
  if (absl::Status s = call.Send({{"op", "stat"}, {"path", path}}); !s.ok()) return s;
  absl::StatusOr<proto::Frame> response = call.Receive(deadline, 0);
  if (!response.ok()) return response.status();
  FileEntry entry = EntryFrom(response->header);
  size_t slash = path.find_last_of('/');
  entry.name = slash == std::string::npos ? path : path.substr(slash + 1);
  return entry;
}

absl::StatusOr<bool> AgentClient::MakeDir(const std::string& path) {
  int64_t deadline = proto::MonotonicMs() + kShortOpTimeoutMs;
  absl::StatusOr<int> fd = connect_();
  if (!fd.ok()) return fd.status();
  Call call(*fd);
  if (absl::Status s = call.Start(deadline); !s.ok()) return s;
  if (absl::Status s = call.Send({{"op", "mkdir"}, {"path", path}}); !s.ok()) return s;
  absl::StatusOr<proto::Frame> response = call.Receive(deadline, 0);
  if (!response.ok()) return response.status();
  return BoolField(response->header, "created");
}

absl::Status AgentClient::Remove(const std::string& path, bool recursive) {
  // The agent stops a recursive remove after 20 s (agent/fs_ops.h); this deadline is longer.
  int64_t deadline = proto::MonotonicMs() + kShortOpTimeoutMs;
  absl::StatusOr<int> fd = connect_();
  if (!fd.ok()) return fd.status();
  Call call(*fd);
  if (absl::Status s = call.Start(deadline); !s.ok()) return s;
  if (absl::Status s = call.Send({{"op", "remove"}, {"path", path}, {"recursive", recursive}});
      !s.ok()) {
    return s;
  }
  return call.Receive(deadline, 0).status();
}

absl::Status AgentClient::Rename(const std::string& source, const std::string& destination,
                                 bool overwrite) {
  int64_t deadline = proto::MonotonicMs() + kShortOpTimeoutMs;
  absl::StatusOr<int> fd = connect_();
  if (!fd.ok()) return fd.status();
  Call call(*fd);
  if (absl::Status s = call.Start(deadline); !s.ok()) return s;
  if (absl::Status s = call.Send({{"op", "rename"},
                                  {"source", source},
                                  {"destination", destination},
                                  {"overwrite", overwrite}});
      !s.ok()) {
    return s;
  }
  return call.Receive(deadline, 0).status();
}

absl::Status AgentClient::Configure(const std::map<std::string, std::string>& env) {
  int64_t deadline = proto::MonotonicMs() + kShortOpTimeoutMs;
  absl::StatusOr<int> fd = connect_();
  if (!fd.ok()) return fd.status();
  Call call(*fd);
  if (absl::Status s = call.Start(deadline); !s.ok()) return s;
  json::object object;
  for (const auto& [k, v] : env) object[k] = v;
  if (absl::Status s = call.Send({{"op", "configure"}, {"env", std::move(object)}}); !s.ok()) {
    return s;
  }
  return call.Receive(deadline, 0).status();
}

}  // namespace esb

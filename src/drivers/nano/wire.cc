#include "drivers/nano/wire.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "common/fd_passing.h"
#include "common/protocol.h"

namespace esb::nano {
namespace {

// The fd rides on the frame's first byte. Peeking at that byte with recvmsg takes the fd (the
// kernel installs a reference for the peek); the codec then reads the frame with plain reads,
// which drop the byte's own reference. `*got_fd` stays -1 when no fd came.
bool PeekPassedFd(int fd, int64_t deadline_ms, int* got_fd, std::string* error) {
  if (deadline_ms >= 0 && !proto::WaitReadable(fd, deadline_ms, error)) return false;
  char byte;
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = control;
  mh.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    // SECURITY: MSG_CMSG_CLOEXEC: a received fd never leaks into a process esbd spawns.
    n = recvmsg(fd, &mh, MSG_PEEK | MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    *error = std::string("recvmsg: ") + strerror(errno);
    return false;
  }
  // n == 0 (EOF): the codec's read reports it.
  for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS &&
        c->cmsg_len == CMSG_LEN(sizeof(int))) {
      std::memcpy(got_fd, CMSG_DATA(c), sizeof(int));
    }
  }
  return true;
}

}  // namespace

bool ToFrame(proto::FrameType type, const Msg& msg, proto::Frame* frame) {
  if (msg.size() > kMaxMsgFields) return false;
  size_t total = 0;
  for (const auto& [k, v] : msg) total += v.size();
  if (total > kMaxMsgBytes) return false;
  frame->type = type;
  frame->stream = kMsgStream;
  frame->header.clear();
  frame->payload.clear();
  frame->payload.reserve(total);
  boost::json::array fields;
  for (const auto& [k, v] : msg) {
    fields.push_back(boost::json::array{boost::json::string(k), v.size()});
    frame->payload += v;
  }
  frame->header["fields"] = std::move(fields);
  return true;
}

bool FromFrame(const proto::Frame& frame, Msg* msg, std::string* error) {
  msg->clear();
  auto fail = [&](const char* why) {
    *error = why;
    msg->clear();
    return false;
  };
  const boost::json::value* fields = frame.header.if_contains("fields");
  if (frame.header.size() != 1 || fields == nullptr || !fields->is_array()) {
    return fail("nano message header is not {\"fields\": [...]}");
  }
  // SECURITY: the peer may be a worker running guest code: the field list must describe
  // exactly the payload, with at most kMaxMsgFields distinct names.
  if (fields->as_array().size() > kMaxMsgFields) return fail("nano message has too many fields");
  size_t pos = 0;
  for (const boost::json::value& f : fields->as_array()) {
    const boost::json::array* pair = f.if_array();
    if (pair == nullptr || pair->size() != 2 || !(*pair)[0].is_string() ||
        !(*pair)[1].is_uint64() && !(*pair)[1].is_int64()) {
      return fail("nano message field is not [name, length]");
    }
    boost::system::error_code ec;
    uint64_t len = (*pair)[1].to_number<uint64_t>(ec);
    if (ec || len > frame.payload.size() - pos) return fail("nano message field length");
    std::string name((*pair)[0].as_string());
    if (!msg->emplace(std::move(name), frame.payload.substr(pos, len)).second) {
      return fail("nano message repeats a field");
    }
    pos += len;
  }
  if (pos != frame.payload.size()) return fail("nano message payload longer than its fields");
  return true;
}

bool SendMsg(int fd, proto::FrameType type, const Msg& msg, int pass_fd) {
  proto::Frame frame;
  if (!ToFrame(type, msg, &frame)) {
    errno = EMSGSIZE;
    return false;
  }
  std::string error;
  errno = 0;
  if (pass_fd < 0) {
    if (proto::WriteFrame(fd, frame, &error, /*deadline_ms=*/-1, kMaxMsgBytes)) return true;
    if (errno == 0) errno = EPIPE;
    return false;
  }
  // Messages that carry an fd are small (spawn, fork): encode the whole frame and send the fd
  // with its first bytes.
  std::string wire = proto::EncodeFrame(frame);
  // SECURITY: the only fd ever passed is a fresh socketpair end for a new worker.
  if (!proto::WriteAllWithFd(fd, wire, pass_fd, &error)) {
    if (errno == 0) errno = EPIPE;
    return false;
  }
  return true;
}

bool RecvMsg(int fd, proto::FrameType type, Msg* msg, int* got_fd, int64_t deadline_ms,
             bool* timed_out) {
  if (got_fd) *got_fd = -1;
  if (timed_out) *timed_out = false;
  std::string error;
  proto::Frame frame;
  bool ok = (got_fd == nullptr || PeekPassedFd(fd, deadline_ms, got_fd, &error)) &&
            proto::ReadFrame(fd, &frame, &error, deadline_ms, proto::MaxFrameBytes(kMaxMsgBytes),
                             nullptr, -1, kMaxMsgBytes);
  if (ok && (frame.type != type || frame.stream != kMsgStream)) {
    ok = false;
    error = "unexpected nano frame type or stream";
  }
  ok = ok && FromFrame(frame, msg, &error);
  if (!ok) {
    if (timed_out && error == "timed out") *timed_out = true;
    if (got_fd && *got_fd >= 0) {
      close(*got_fd);
      *got_fd = -1;
    }
  }
  return ok;
}

int64_t GetInt(const Msg& m, const std::string& key, int64_t def) {
  auto it = m.find(key);
  if (it == m.end() || it->second.empty()) return def;
  char* end = nullptr;
  long long v = std::strtoll(it->second.c_str(), &end, 10);
  if (end == nullptr || *end != '\0') return def;
  return v;
}

std::string GetStr(const Msg& m, const std::string& key) {
  auto it = m.find(key);
  return it == m.end() ? std::string() : it->second;
}

}  // namespace esb::nano

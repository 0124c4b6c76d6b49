#include "drivers/nano/wire.h"

#include <poll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "common/protocol.h"
#include "common/read_growing.h"

namespace esb::nano {
namespace {

void PutU32(std::string* out, uint32_t v) { out->append(reinterpret_cast<const char*>(&v), 4); }

// proto::ReadFull with the wire's error reporting (`*timed_out` on a deadline).
bool ReadFull(int fd, char* buf, size_t len, int64_t deadline_ms, bool* timed_out) {
  std::string error;
  if (proto::ReadFull(fd, buf, len, deadline_ms, &error)) return true;
  if (timed_out && error == "timed out") *timed_out = true;
  return false;
}

}  // namespace
std::string EncodeMsg(const Msg& msg) {
  std::string body;
  for (const auto& [k, v] : msg) {
    PutU32(&body, static_cast<uint32_t>(k.size()));
    body += k;
    PutU32(&body, static_cast<uint32_t>(v.size()));
    body += v;
  }
  return body;
}

bool DecodeMsg(const std::string& body, Msg* msg) {
  msg->clear();
  size_t pos = 0;
  auto take = [&](std::string* out) {
    if (body.size() - pos < 4) return false;
    uint32_t len;
    std::memcpy(&len, body.data() + pos, 4);
    pos += 4;
    if (body.size() - pos < len) return false;
    out->assign(body, pos, len);
    pos += len;
    return true;
  };
  while (pos < body.size()) {
    std::string k, v;
    // SECURITY: workers run guest code; a frame of millions of tiny fields would cost ~50x its
    // size in map nodes. Real messages have a handful of fields.
    if (msg->size() >= kMaxMsgFields) return false;
    if (!take(&k) || !take(&v)) return false;
    (*msg)[std::move(k)] = std::move(v);
  }
  return true;
}

bool SendMsg(int fd, const Msg& msg, int pass_fd) {
  std::string body = EncodeMsg(msg);
  if (body.size() > kMaxMsgBytes) {
    errno = EMSGSIZE;
    return false;
  }
  std::string frame;
  PutU32(&frame, static_cast<uint32_t>(body.size()));
  frame += body;
  size_t done = 0;
  if (pass_fd >= 0) {
    // SECURITY: the only fd ever passed is a fresh socketpair end for a new worker.
    iovec iov{frame.data(), frame.size()};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = control;
    mh.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
    ssize_t n;
    do {
      n = sendmsg(fd, &mh, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n <= 0) return false;
    done = static_cast<size_t>(n);
  }
  std::string error;
  if (!proto::WriteAll(fd, std::string_view(frame).substr(done), &error)) {
    if (errno == 0) errno = EPIPE;
    return false;
  }
  return true;
}

bool RecvMsg(int fd, Msg* msg, int* got_fd, int64_t deadline_ms, bool* timed_out) {
  if (got_fd) *got_fd = -1;
  if (timed_out) *timed_out = false;
  char hdr[4];
  size_t have = 0;
  if (got_fd) {
    // The fd rides on the first byte(s): read the header with recvmsg.
    std::string error;
    if (deadline_ms >= 0 && !proto::WaitReadable(fd, deadline_ms, &error)) {
      if (timed_out && error == "timed out") *timed_out = true;
      return false;
    }
    iovec iov{hdr, sizeof(hdr)};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = control;
    mh.msg_controllen = sizeof(control);
    ssize_t n;
    do {
      n = recvmsg(fd, &mh, MSG_CMSG_CLOEXEC);
    } while (n < 0 && errno == EINTR);
    if (n <= 0) return false;
    have = static_cast<size_t>(n);
    for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS &&
          c->cmsg_len == CMSG_LEN(sizeof(int))) {
        std::memcpy(got_fd, CMSG_DATA(c), sizeof(int));
      }
    }
  }
  if (!ReadFull(fd, hdr + have, sizeof(hdr) - have, deadline_ms, timed_out)) return false;
  uint32_t len;
  std::memcpy(&len, hdr, 4);
  if (len > kMaxMsgBytes) return false;
  // The worker runs guest code: its announced length is not trusted (ReadGrowing).
  std::string body;
  if (!ReadGrowing(len, &body, [&](char* buf, size_t n) {
        return ReadFull(fd, buf, n, deadline_ms, timed_out);
      })) {
    return false;
  }
  return DecodeMsg(body, msg);
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

// Framed protocol codec (docs/agent-protocol.md). Linked into the static agent: standard
// library, POSIX and Boost.JSON only.
#include "common/protocol.h"

#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>

#include "common/read_growing.h"

namespace esb::proto {
namespace {

constexpr size_t kPrefixBytes = 4;             // u32 length
constexpr size_t kFixedBytes = 1 + 4;          // type + header_len
constexpr size_t kCompactThreshold = 1 << 20;  // drop consumed bytes past this

void PutU32(char* out, uint32_t v) {
  out[0] = static_cast<char>((v >> 24) & 0xff);
  out[1] = static_cast<char>((v >> 16) & 0xff);
  out[2] = static_cast<char>((v >> 8) & 0xff);
  out[3] = static_cast<char>(v & 0xff);
}

uint32_t GetU32(const char* in) {
  const auto* p = reinterpret_cast<const unsigned char*>(in);
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

bool ValidType(uint8_t t) { return t >= 1 && t <= 4; }

// Parses the body of one frame (everything after the length prefix). Returns an error message
// or an empty string on success.
std::string ParseBody(std::string_view body, Frame* frame) {
  if (body.size() < kFixedBytes) return "frame too short";
  uint8_t type = static_cast<uint8_t>(body[0]);
  if (!ValidType(type)) return "bad frame type " + std::to_string(type);
  uint32_t header_len = GetU32(body.data() + 1);
  if (header_len > kMaxHeaderBytes) return "frame header too large";
  if (header_len > body.size() - kFixedBytes) return "frame header length exceeds frame";
  if (body.size() - kFixedBytes - header_len > kMaxPayloadBytes) return "frame payload too large";
  std::string_view header_text = body.substr(kFixedBytes, header_len);
  boost::json::error_code ec;
  boost::json::value header = boost::json::parse(header_text, ec);
  if (ec) return "bad frame header JSON: " + ec.message();
  if (!header.is_object()) return "frame header is not a JSON object";
  frame->type = static_cast<FrameType>(type);
  frame->header = std::move(header.as_object());
  frame->payload.assign(body.substr(kFixedBytes + header_len));
  return "";
}

std::string EncodePrefix(const Frame& frame, const std::string& header, size_t payload_size) {
  std::string out(kPrefixBytes + kFixedBytes, '\0');
  PutU32(out.data(), static_cast<uint32_t>(kFixedBytes + header.size() + payload_size));
  out[4] = static_cast<char>(frame.type);
  PutU32(out.data() + 5, static_cast<uint32_t>(header.size()));
  out += header;
  return out;
}

// Waits until `fd` is ready for `events` or the deadline passes. Returns false on timeout or
// poll failure (message in *error).
bool WaitFd(int fd, short events, int64_t deadline_ms, std::string* error) {
  for (;;) {
    int timeout = -1;
    if (deadline_ms >= 0) {
      int64_t left = deadline_ms - MonotonicMs();
      if (left <= 0) {
        if (error) *error = "timed out";
        return false;
      }
      timeout = static_cast<int>(std::min<int64_t>(left, 1 << 30));
    }
    pollfd p{fd, events, 0};
    int r = poll(&p, 1, timeout);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (error) *error = std::string("poll: ") + strerror(errno);
      return false;
    }
    if (r > 0) return true;  // readable, writable, or HUP/ERR (the next call reports it)
  }
}

// Reads exactly n bytes. false on EOF (message "connection closed"), error or deadline.
bool ReadFull(int fd, char* buf, size_t n, int64_t deadline_ms, std::string* error) {
  size_t got = 0;
  while (got < n) {
    if (deadline_ms >= 0 && !WaitFd(fd, POLLIN, deadline_ms, error)) return false;
    ssize_t r = read(fd, buf + got, n - got);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (!WaitFd(fd, POLLIN, deadline_ms, error)) return false;
        continue;
      }
      if (error) *error = std::string("read: ") + strerror(errno);
      return false;
    }
    if (r == 0) {
      if (error) *error = got == 0 ? "connection closed" : "connection closed mid-frame";
      return false;
    }
    got += static_cast<size_t>(r);
  }
  return true;
}

}  // namespace

std::string EncodeFrame(const Frame& frame) {
  std::string out = EncodePrefix(frame, boost::json::serialize(frame.header), frame.payload.size());
  out += frame.payload;
  return out;
}

void FrameDecoder::Feed(std::string_view bytes) {
  if (failed()) return;
  if (offset_ > kCompactThreshold && offset_ * 2 > buffer_.size()) {
    buffer_.erase(0, offset_);
    offset_ = 0;
  }
  buffer_.append(bytes);
}

std::optional<Frame> FrameDecoder::Next() {
  if (failed()) return std::nullopt;
  size_t avail = buffer_.size() - offset_;
  if (avail < kPrefixBytes) return std::nullopt;
  uint32_t length = GetU32(buffer_.data() + offset_);
  if (length < kFixedBytes) {
    error_ = "frame too short";
    return std::nullopt;
  }
  if (length > kMaxFrameBytes) {
    error_ = "frame too large (" + std::to_string(length) + " bytes)";
    return std::nullopt;
  }
  if (avail - kPrefixBytes < length) return std::nullopt;
  Frame frame;
  std::string err =
      ParseBody(std::string_view(buffer_).substr(offset_ + kPrefixBytes, length), &frame);
  if (!err.empty()) {
    error_ = std::move(err);
    return std::nullopt;
  }
  offset_ += kPrefixBytes + length;
  if (offset_ == buffer_.size()) {
    buffer_.clear();
    offset_ = 0;
  }
  return frame;
}

bool WriteFrame(int fd, const Frame& frame, std::string* error) {
  std::string header = boost::json::serialize(frame.header);
  if (header.size() > kMaxHeaderBytes) {
    if (error) *error = "frame header too large";
    return false;
  }
  if (frame.payload.size() > kMaxPayloadBytes) {
    if (error) *error = "frame payload too large";
    return false;
  }
  std::string prefix = EncodePrefix(frame, header, frame.payload.size());
  // Two-part gather write so a 16 MiB payload is never copied.
  iovec iov[2] = {{prefix.data(), prefix.size()},
                  {const_cast<char*>(frame.payload.data()), frame.payload.size()}};
  int iovcnt = frame.payload.empty() ? 1 : 2;
  iovec* cur = iov;
  bool is_socket = true;
  while (iovcnt > 0) {
    ssize_t n;
    if (is_socket) {
      msghdr msg{};
      msg.msg_iov = cur;
      msg.msg_iovlen = iovcnt;
      // MSG_NOSIGNAL: a peer that went away must give EPIPE, not kill the process.
      n = sendmsg(fd, &msg, MSG_NOSIGNAL);
      if (n < 0 && errno == ENOTSOCK) {
        is_socket = false;
        continue;
      }
    } else {
      n = writev(fd, cur, iovcnt);
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        // A send timeout (SO_SNDTIMEO) also lands here on blocking sockets: give up then,
        // wait for writability on non-blocking descriptors.
        pollfd p{fd, POLLOUT, 0};
        int r = poll(&p, 1, 30000);
        if (r > 0) continue;
        if (r < 0 && errno == EINTR) continue;
        if (error) *error = "write: peer not reading";
        return false;
      }
      if (error) *error = std::string("write: ") + strerror(errno);
      return false;
    }
    size_t left = static_cast<size_t>(n);
    while (iovcnt > 0 && left >= cur->iov_len) {
      left -= cur->iov_len;
      ++cur;
      --iovcnt;
    }
    if (iovcnt > 0) {
      cur->iov_base = static_cast<char*>(cur->iov_base) + left;
      cur->iov_len -= left;
    }
  }
  return true;
}

bool ReadFrame(int fd, Frame* frame, std::string* error, int64_t deadline_ms,
               uint32_t max_frame_bytes) {
  char prefix[kPrefixBytes];
  if (!ReadFull(fd, prefix, sizeof prefix, deadline_ms, error)) return false;
  uint32_t length = GetU32(prefix);
  if (length < kFixedBytes) {
    if (error) *error = "frame too short";
    return false;
  }
  if (length > std::min(kMaxFrameBytes, max_frame_bytes)) {
    if (error) *error = "frame too large (" + std::to_string(length) + " bytes)";
    return false;
  }
  std::string body;
  if (!ReadGrowing(length, &body,
                   [&](char* buf, size_t n) { return ReadFull(fd, buf, n, deadline_ms, error); })) {
    return false;
  }
  std::string err = ParseBody(body, frame);
  if (!err.empty()) {
    if (error) *error = std::move(err);
    return false;
  }
  return true;
}

int64_t MonotonicMs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000 + ts.tv_nsec / 1000000;
}

}  // namespace esb::proto

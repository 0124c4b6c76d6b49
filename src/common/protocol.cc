// Framed protocol codec, v2 (docs/agent-protocol.md). Linked into the static agent: standard
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
constexpr size_t kCompactThreshold = 1 << 20;  // drop consumed bytes past this
constexpr int64_t kWriteStallMs = 30000;       // longest wait for a peer that does not read

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

bool ValidType(uint8_t t) { return t >= 1 && t <= 7; }

// Checks the fixed part of a frame (magic, type, stream, header length) against the frame's
// length and the channel's payload bound. Returns an error message or "".
std::string CheckFixed(const char* fixed, uint32_t length, uint32_t max_payload) {
  uint8_t magic = static_cast<uint8_t>(fixed[0]);
  if (magic != kMagic) {
    if (magic >= 1 && magic <= 4) return kV1PeerError;
    return "bad frame magic " + std::to_string(magic);
  }
  uint8_t type = static_cast<uint8_t>(fixed[1]);
  if (!ValidType(type)) return "bad frame type " + std::to_string(type);
  uint32_t stream = GetU32(fixed + 2);
  if ((type == static_cast<uint8_t>(FrameType::kHello)) != (stream == 0)) {
    return "bad stream id for frame type " + std::to_string(type);
  }
  uint32_t header_len = GetU32(fixed + 6);
  if (header_len > kMaxHeaderBytes) return "frame header too large";
  if (header_len > length - kFixedBytes) return "frame header length exceeds frame";
  uint32_t payload_len = length - kFixedBytes - header_len;
  if (payload_len > max_payload) return "frame payload too large";
  auto t = static_cast<FrameType>(type);
  if ((t == FrameType::kOutput || t == FrameType::kInput) && payload_len > kMaxChunkBytes) {
    return "data frame payload larger than 64 KiB";
  }
  if ((t == FrameType::kCancel || t == FrameType::kWindow || t == FrameType::kHello) &&
      payload_len != 0) {
    return "control frame with a payload";
  }
  return "";
}

// Parses one frame from its fixed part (CheckFixed passed) and the rest (header + payload),
// which it consumes. Returns an error message or an empty string on success.
std::string ParseFrame(const char* fixed, std::string rest, Frame* frame) {
  uint32_t header_len = GetU32(fixed + 6);
  std::string_view header_text = std::string_view(rest).substr(0, header_len);
  frame->header.clear();
  if (!header_text.empty()) {
    boost::json::error_code ec;
    boost::json::parse_options options;
    options.max_depth = 16;
    boost::json::value header = boost::json::parse(header_text, ec, {}, options);
    if (ec) return "bad frame header JSON: " + ec.message();
    if (!header.is_object()) return "frame header is not a JSON object";
    frame->header = std::move(header.as_object());
  }
  frame->type = static_cast<FrameType>(fixed[1]);
  frame->stream = GetU32(fixed + 2);
  // Moved, not copied: a 16 MiB payload is held once.
  frame->payload = std::move(rest);
  frame->payload.erase(0, header_len);
  return "";
}

std::string EncodePrefix(const Frame& frame, const std::string& header, size_t payload_size) {
  std::string out(kPrefixBytes + kFixedBytes, '\0');
  PutU32(out.data(), static_cast<uint32_t>(kFixedBytes + header.size() + payload_size));
  out[4] = static_cast<char>(kMagic);
  out[5] = static_cast<char>(frame.type);
  PutU32(out.data() + 6, frame.stream);
  PutU32(out.data() + 10, static_cast<uint32_t>(header.size()));
  out += header;
  return out;
}

std::string SerializeHeader(const Frame& frame) {
  return frame.header.empty() ? std::string() : boost::json::serialize(frame.header);
}

// Waits until `fd` is ready for `events` or the deadline passes. Returns false on timeout,
// wake-up or poll failure (message in *error).
bool WaitFd(int fd, short events, int64_t deadline_ms, std::string* error, int wake_fd = -1) {
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
    pollfd p[2] = {{fd, events, 0}, {wake_fd, POLLIN, 0}};
    int r = poll(p, wake_fd >= 0 ? 2 : 1, timeout);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (error) *error = std::string("poll: ") + strerror(errno);
      return false;
    }
    if (wake_fd >= 0 && p[1].revents) {
      if (error) *error = "interrupted";
      return false;
    }
    if (r > 0) return true;  // readable, writable, or HUP/ERR (the next call reports it)
  }
}

// Writes every byte of `iov` (sockets with MSG_NOSIGNAL, anything else with writev). Blocking
// descriptors with a send timeout and non-blocking ones give up at `deadline_ms` (< 0: 30 s
// from now) in total, so a peer that reads just enough to never stall for long cannot keep
// the writer (and the write lock it holds) forever.
bool WriteIov(int fd, iovec* iov, int iovcnt, std::string* error, int64_t deadline_ms) {
  if (deadline_ms < 0) deadline_ms = MonotonicMs() + kWriteStallMs;
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
        int64_t left = std::min<int64_t>(deadline_ms - MonotonicMs(), kWriteStallMs);
        pollfd p{fd, POLLOUT, 0};
        int r = left > 0 ? poll(&p, 1, static_cast<int>(left)) : 0;
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

}  // namespace

bool WaitReadable(int fd, int64_t deadline_ms, std::string* error) {
  return WaitFd(fd, POLLIN, deadline_ms, error);
}

bool ReadFull(int fd, char* buf, size_t n, int64_t deadline_ms, std::string* error, int wake_fd) {
  size_t got = 0;
  while (got < n) {
    if ((deadline_ms >= 0 || wake_fd >= 0) && !WaitFd(fd, POLLIN, deadline_ms, error, wake_fd)) {
      return false;
    }
    ssize_t r = read(fd, buf + got, n - got);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (!WaitFd(fd, POLLIN, deadline_ms, error, wake_fd)) return false;
        continue;
      }
      // A pty whose other side closed says EIO: that is the end of the stream.
      if (errno == EIO) {
        if (error) *error = got == 0 ? "connection closed" : "connection closed mid-frame";
        return false;
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

std::string EncodeFrame(const Frame& frame) {
  std::string out = EncodePrefix(frame, SerializeHeader(frame), frame.payload.size());
  out += frame.payload;
  return out;
}

namespace {
uint32_t ChannelPayloadBound(uint32_t max_payload_bytes) {
  return std::min(max_payload_bytes, kMaxChannelPayloadBytes);
}
}  // namespace

FrameDecoder::FrameDecoder(uint32_t max_payload_bytes)
    : max_payload_(ChannelPayloadBound(max_payload_bytes)) {}

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
    // A v1 frame may be this short (1 + 4 + header); its type byte still tells.
    if (avail > kPrefixBytes && static_cast<uint8_t>(buffer_[offset_ + 4]) >= 1 &&
        static_cast<uint8_t>(buffer_[offset_ + 4]) <= 4) {
      error_ = kV1PeerError;
    } else {
      error_ = "frame too short";
    }
    return std::nullopt;
  }
  if (length > MaxFrameBytes(max_payload_)) {
    error_ = "frame too large (" + std::to_string(length) + " bytes)";
    return std::nullopt;
  }
  if (avail - kPrefixBytes < kFixedBytes) return std::nullopt;
  if (std::string err = CheckFixed(buffer_.data() + offset_ + kPrefixBytes, length, max_payload_);
      !err.empty()) {
    error_ = std::move(err);
    return std::nullopt;
  }
  if (avail - kPrefixBytes < length) return std::nullopt;
  Frame frame;
  const char* fixed = buffer_.data() + offset_ + kPrefixBytes;
  std::string err = ParseFrame(
      fixed, buffer_.substr(offset_ + kPrefixBytes + kFixedBytes, length - kFixedBytes), &frame);
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

bool WriteFrame(int fd, const Frame& frame, std::string* error, int64_t deadline_ms,
                uint32_t max_payload_bytes) {
  if ((frame.type == FrameType::kHello) != (frame.stream == 0)) {
    if (error) *error = "bad stream id for the frame type";
    return false;
  }
  std::string header = SerializeHeader(frame);
  if (header.size() > kMaxHeaderBytes) {
    if (error) *error = "frame header too large";
    return false;
  }
  size_t limit = frame.type == FrameType::kOutput || frame.type == FrameType::kInput
                     ? kMaxChunkBytes
                     : ChannelPayloadBound(max_payload_bytes);
  if (frame.payload.size() > limit) {
    if (error) *error = "frame payload too large";
    return false;
  }
  std::string prefix = EncodePrefix(frame, header, frame.payload.size());
  // Two-part gather write so a 16 MiB payload is never copied.
  iovec iov[2] = {{prefix.data(), prefix.size()},
                  {const_cast<char*>(frame.payload.data()), frame.payload.size()}};
  return WriteIov(fd, iov, frame.payload.empty() ? 1 : 2, error, deadline_ms);
}

bool WriteAll(int fd, std::string_view data, std::string* error) {
  iovec iov{const_cast<char*>(data.data()), data.size()};
  return data.empty() || WriteIov(fd, &iov, 1, error, -1);
}

bool ReadFrame(int fd, Frame* frame, std::string* error, int64_t deadline_ms,
               uint32_t max_frame_bytes, const FrameLimit& limit, int wake_fd,
               uint32_t max_payload_bytes) {
  uint32_t max_payload = ChannelPayloadBound(max_payload_bytes);
  char prefix[kPrefixBytes + kFixedBytes];
  if (!ReadFull(fd, prefix, kPrefixBytes, deadline_ms, error, wake_fd)) return false;
  uint32_t length = GetU32(prefix);
  // Refused from the length alone (every v1 frame is shorter than this too).
  if (length > std::min(MaxFrameBytes(max_payload), max_frame_bytes)) {
    if (error) *error = "frame too large (" + std::to_string(length) + " bytes)";
    return false;
  }
  if (!ReadFull(fd, prefix + kPrefixBytes, 1, deadline_ms, error, wake_fd)) {
    if (error && *error == "connection closed") *error = "connection closed mid-frame";
    return false;
  }
  uint8_t magic = static_cast<uint8_t>(prefix[4]);
  if (magic != kMagic && magic >= 1 && magic <= 4) {
    if (error) *error = kV1PeerError;
    return false;
  }
  if (length < kFixedBytes) {
    if (error) *error = "frame too short";
    return false;
  }
  if (!ReadFull(fd, prefix + kPrefixBytes + 1, kFixedBytes - 1, deadline_ms, error, wake_fd)) {
    return false;
  }
  if (std::string err = CheckFixed(prefix + kPrefixBytes, length, max_payload); !err.empty()) {
    if (error) *error = std::move(err);
    return false;
  }
  if (limit) {
    uint32_t max = limit(static_cast<FrameType>(prefix[5]), GetU32(prefix + 6));
    if (length > max) {
      if (error) *error = "frame too large (" + std::to_string(length) + " bytes)";
      return false;
    }
  }
  std::string rest;
  if (!ReadGrowing(length - kFixedBytes, &rest, [&](char* buf, size_t n) {
        return ReadFull(fd, buf, n, deadline_ms, error, wake_fd);
      })) {
    if (error && *error == "connection closed") *error = "connection closed mid-frame";
    return false;
  }
  std::string err = ParseFrame(prefix + kPrefixBytes, std::move(rest), frame);
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

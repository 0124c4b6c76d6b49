// Framed, binary-safe protocol between esbd and esb-agent (docs/agent-protocol.md).
// Used by the static agent too, so this header depends only on the standard library and
// Boost.JSON.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <boost/json.hpp>

namespace esb::proto {

enum class FrameType : uint8_t { kHello = 1, kRequest = 2, kOutput = 3, kResponse = 4 };

inline constexpr uint32_t kMaxHeaderBytes = 64 * 1024;
inline constexpr uint32_t kMaxPayloadBytes = 16 * 1024 * 1024;
inline constexpr uint32_t kMaxFrameBytes = 1 + 4 + kMaxHeaderBytes + kMaxPayloadBytes;
inline constexpr int kVersion = 1;
// Directory listings: at most this many entries and this many bytes of entry JSON. The agent
// cuts its listing there (and says `truncated`); esbd refuses replies that exceed either,
// because the peer lives inside the sandbox and may not be the real agent.
inline constexpr size_t kMaxListEntries = 10000;
inline constexpr uint32_t kMaxListPayloadBytes = 4 * 1024 * 1024;

struct Frame {
  FrameType type = FrameType::kRequest;
  boost::json::object header;
  std::string payload;
};

// Serialises a frame (length prefix included).
std::string EncodeFrame(const Frame& frame);

// Incremental decoder: feed bytes, pull complete frames. A protocol violation (oversized
// frame, bad type, bad JSON) puts the decoder in an error state with a message.
class FrameDecoder {
 public:
  void Feed(std::string_view bytes);
  // Returns the next complete frame, or nullopt if more bytes are needed or on error.
  std::optional<Frame> Next();
  bool failed() const { return !error_.empty(); }
  const std::string& error() const { return error_; }

 private:
  std::string buffer_;
  size_t offset_ = 0;
  std::string error_;
};

// Blocking helpers over a connected stream fd (unix socket, pipe, virtio-serial port).
// They retry on EINTR and return false (with a message) on EOF, error or protocol violation.
// `deadline_ms` < 0 means no deadline; otherwise an absolute CLOCK_MONOTONIC time in ms.
bool WriteFrame(int fd, const Frame& frame, std::string* error);
// `max_frame_bytes` refuses longer frames before anything is read; the buffer then grows with
// the bytes that actually arrive, so a peer that announces a large frame and stalls costs
// nothing.
bool ReadFrame(int fd, Frame* frame, std::string* error, int64_t deadline_ms = -1,
               uint32_t max_frame_bytes = kMaxFrameBytes);
// Frame length for a frame whose header is at most `header_bytes` and payload `payload_bytes`.
constexpr uint32_t FrameBytesFor(uint32_t header_bytes, uint32_t payload_bytes) {
  return 1 + 4 + header_bytes + payload_bytes;
}

int64_t MonotonicMs();

}  // namespace esb::proto

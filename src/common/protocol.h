// Framed, binary-safe, multiplexed protocol between esbd and esb-agent, version 2
// (docs/agent-protocol.md). Used by the static agent too, so this header depends only on the
// standard library and Boost.JSON.
#pragma once

#include <boost/json.hpp>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace esb::proto {

enum class FrameType : uint8_t {
  kHello = 1,     // stream 0, agent → host, once per connection
  kRequest = 2,   // opens a stream (host → agent)
  kOutput = 3,    // streaming data of a call (agent → host), counted against the window
  kResponse = 4,  // ends a stream (agent → host), exactly one per REQUEST
  kCancel = 5,    // ends one call early (host → agent); the connection stays up
  kInput = 6,     // stdin bytes or EOF of a call (host → agent), counted against the window
  kWindow = 7,    // grants `bytes` more credit on a stream (either direction)
};

// Byte 4 of every v2 frame (right after the length). A v1 frame has its type (1-4) there, so
// the first frame of either version tells which one the peer speaks.
inline constexpr uint8_t kMagic = 0xE5;
inline constexpr int kVersion = 2;
inline constexpr uint32_t kMaxHeaderBytes = 64 * 1024;
// The agent channel's payload bound (REQUEST and RESPONSE file data).
inline constexpr uint32_t kMaxPayloadBytes = 16 * 1024 * 1024;
// Every channel has its own payload bound, given to the decoder, ReadFrame and WriteFrame: the
// agent channel's is kMaxPayloadBytes (the default everywhere); the nano tier's channel passes
// its own (drivers/nano/wire.h: 80 MiB of output and files). No channel's exceeds this, so a
// frame length always fits a u32 with room to spare.
inline constexpr uint32_t kMaxChannelPayloadBytes = 256u * 1024 * 1024;
// OUTPUT and INPUT payloads: streaming data travels in chunks this size at most, so writers of
// different streams interleave fairly on one byte stream.
inline constexpr uint32_t kMaxChunkBytes = 64 * 1024;
// Flow control: each side may have this many OUTPUT/INPUT payload bytes of one stream in
// flight before the receiver grants more with WINDOW.
inline constexpr uint32_t kInitialWindow = 256 * 1024;
// magic + type + stream + header_len
inline constexpr uint32_t kFixedBytes = 1 + 1 + 4 + 4;
// Longest frame of a channel whose payload bound is `max_payload_bytes`.
constexpr uint32_t MaxFrameBytes(uint32_t max_payload_bytes) {
  return kFixedBytes + kMaxHeaderBytes +
         (max_payload_bytes < kMaxChannelPayloadBytes ? max_payload_bytes
                                                      : kMaxChannelPayloadBytes);
}
inline constexpr uint32_t kMaxFrameBytes = MaxFrameBytes(kMaxPayloadBytes);  // agent channel
// Directory listings: at most this many entries and this many bytes of entry JSON. The agent
// cuts its listing there (and says `truncated`); esbd refuses replies that exceed either,
// because the peer lives inside the sandbox and may not be the real agent.
inline constexpr size_t kMaxListEntries = 10000;
inline constexpr uint32_t kMaxListPayloadBytes = 4 * 1024 * 1024;

// What ReadFrame reports when the peer's first bytes are a v1 frame.
inline constexpr char kV1PeerError[] = "peer speaks protocol v1";

struct Frame {
  FrameType type = FrameType::kRequest;
  uint32_t stream = 0;
  boost::json::object header;
  std::string payload;
};

// Serialises a frame (length prefix included).
std::string EncodeFrame(const Frame& frame);

// Frame length (the u32 prefix) for a header of at most `header_bytes` and a payload of
// `payload_bytes`.
constexpr uint32_t FrameBytesFor(uint32_t header_bytes, uint32_t payload_bytes) {
  return kFixedBytes + header_bytes + payload_bytes;
}

// Longest frame the reader accepts for (type, stream), decided before the body is read.
using FrameLimit = std::function<uint32_t(FrameType type, uint32_t stream)>;

// Incremental decoder: feed bytes, pull complete frames. A protocol violation (oversized
// frame, bad magic or type, bad JSON) puts the decoder in an error state with a message.
class FrameDecoder {
 public:
  // `max_payload_bytes`: the channel's payload bound (capped at kMaxChannelPayloadBytes).
  explicit FrameDecoder(uint32_t max_payload_bytes = kMaxPayloadBytes);
  void Feed(std::string_view bytes);
  // Returns the next complete frame, or nullopt if more bytes are needed or on error.
  std::optional<Frame> Next();
  bool failed() const { return !error_.empty(); }
  const std::string& error() const { return error_; }

 private:
  uint32_t max_payload_;
  std::string buffer_;
  size_t offset_ = 0;
  std::string error_;
};

// Blocking helpers over a connected stream fd (unix socket, pipe, pty, virtio-serial port).
// They retry on EINTR and return false (with a message) on EOF, error or protocol violation.
// `deadline_ms` < 0 means no deadline; otherwise an absolute CLOCK_MONOTONIC time in ms.
// A write gives up at `deadline_ms`, or (< 0) 30 s after it started, however slowly the peer
// keeps reading. `max_payload_bytes`: the channel's payload bound (a longer payload is refused
// before anything is written).
bool WriteFrame(int fd, const Frame& frame, std::string* error, int64_t deadline_ms = -1,
                uint32_t max_payload_bytes = kMaxPayloadBytes);
// `max_frame_bytes` (or `limit`, asked once the type and stream are known) refuses longer
// frames before their body is read; the buffer then grows with the bytes that actually arrive,
// so a peer that announces a large frame and stalls costs nothing. `wake_fd` (>= 0): readable
// means stop waiting (error "interrupted"). `max_payload_bytes`: the channel's payload bound;
// frames longer than MaxFrameBytes(max_payload_bytes) are refused from the length prefix too.
bool ReadFrame(int fd, Frame* frame, std::string* error, int64_t deadline_ms = -1,
               uint32_t max_frame_bytes = kMaxFrameBytes, const FrameLimit& limit = nullptr,
               int wake_fd = -1, uint32_t max_payload_bytes = kMaxPayloadBytes);

// Writes all of `data` (sockets without SIGPIPE; gives up 30 s after it started). Shared by
// the nano wire.
bool WriteAll(int fd, std::string_view data, std::string* error);

// Waits until `fd` is readable (or at EOF/error) or the deadline passes ("timed out").
bool WaitReadable(int fd, int64_t deadline_ms, std::string* error);

// Reads exactly n bytes with a deadline (shared by the nano wire). false with "connection
// closed", "connection closed mid-frame", "timed out", "interrupted" or an errno message.
bool ReadFull(int fd, char* buf, size_t n, int64_t deadline_ms, std::string* error,
              int wake_fd = -1);

int64_t MonotonicMs();

}  // namespace esb::proto

// One end of a protocol-v2 connection (docs/agent-protocol.md, "Flow control"): serialised
// frame writes and per-stream credit in both directions. esbd's AgentClient and the agent's
// server both use it; reading stays with the owner's single reader thread, which reports
// WINDOW frames and received data here. Standard library only (the static agent links it).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>

#include "common/protocol.h"

namespace esb::proto {

class Channel {
 public:
  // `fd` stays the owner's. `wake_fd` (an eventfd, or -1): made readable when the channel
  // shuts down, so the owner's reader (which passes it to ReadFrame) stops too.
  explicit Channel(int fd, int wake_fd = -1) : fd_(fd), wake_fd_(wake_fd) {}

  // Sends one whole frame, serialised with other writers, giving up at `deadline_ms` (< 0: 30 s
  // after the write started). false when the write fails: the byte stream may now hold a
  // partial frame, so the channel shuts down for good — the socket is shut down in both
  // directions and the reader woken, so neither side keeps a connection that can no longer
  // answer (F11). false at once after Shutdown, also for a sender that waited behind the
  // failed write.
  bool Send(const Frame& frame, int64_t deadline_ms = -1);
  // Sends `data` on `stream` as OUTPUT or INPUT frames of at most 64 KiB, each once the peer
  // has granted credit for it. false with *error when the stream or channel closed or
  // `deadline_ms` (absolute MonotonicMs; < 0: none) passed while waiting for credit. Each
  // frame's write gives up at `write_deadline_ms` (< 0: 30 s after it started); the agent
  // passes -1, so a host that reads a moment late never makes it abandon a frame half
  // written (which breaks the connection) because a call's deadline passed meanwhile.
  bool SendData(FrameType type, uint32_t stream, const boost::json::object& header,
                std::string_view data, int64_t deadline_ms, int64_t write_deadline_ms,
                std::string* error);

  // A stream starts with kInitialWindow bytes of credit in each direction.
  void Open(uint32_t stream);
  // Forgets the stream; its blocked senders fail.
  void Close(uint32_t stream);

  // Reader side. A WINDOW frame arrived for `stream`.
  void Grant(uint32_t stream, uint64_t bytes);
  // `bytes` of data arrived on `stream`; false if the peer sent more than it was granted (a
  // protocol violation) or the stream is unknown.
  bool Received(uint32_t stream, size_t bytes);
  // The consumer took `bytes` of the stream's data: grants them back (one WINDOW per half
  // window, so a byte-by-byte consumer does not cost a frame per byte).
  void Consumed(uint32_t stream, size_t bytes);

  // No more frames; every waiting sender fails with `why`; the reader is woken (wake_fd).
  void Shutdown(const std::string& why);
  bool closed() const;
  std::string close_reason() const;

 private:
  struct Credit {
    int64_t send = kInitialWindow;  // bytes we may still send
    int64_t recv = kInitialWindow;  // bytes the peer may still send
    uint64_t consumed = 0;          // taken by our consumer, not yet granted back
  };

  const int fd_;
  const int wake_fd_;
  std::mutex write_mu_;  // one frame at a time on the byte stream
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint32_t, Credit> streams_;
  bool closed_ = false;
  std::string close_reason_;
};

}  // namespace esb::proto

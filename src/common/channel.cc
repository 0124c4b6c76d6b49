#include "common/channel.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

namespace esb::proto {

bool Channel::Send(const Frame& frame, int64_t deadline_ms) {
  if (closed()) return false;
  std::string error;
  bool ok;
  {
    std::lock_guard<std::mutex> lock(write_mu_);
    // A write that failed before ours left a partial frame on the stream: never add to it.
    if (closed()) return false;
    ok = WriteFrame(fd_, frame, &error, deadline_ms);
  }
  if (!ok) {
    Shutdown(error);
    // The stream may hold a partial frame: end it for the peer too (EOF at once), instead of
    // leaving it waiting for answers that can never come. Not a socket (a pty, a virtio port):
    // the woken reader ends the connection.
    ::shutdown(fd_, SHUT_RDWR);
  }
  return ok;
}

bool Channel::SendData(FrameType type, uint32_t stream, const boost::json::object& header,
                       std::string_view data, int64_t deadline_ms, int64_t write_deadline_ms,
                       std::string* error) {
  do {
    size_t n = std::min<size_t>(data.size(), kMaxChunkBytes);
    {
      std::unique_lock<std::mutex> lock(mu_);
      for (;;) {
        if (closed_) {
          *error = "connection closed: " + close_reason_;
          return false;
        }
        auto it = streams_.find(stream);
        if (it == streams_.end()) {
          *error = "stream closed";
          return false;
        }
        // A chunk larger than the credit left waits for it (an empty chunk never waits).
        if (it->second.send >= static_cast<int64_t>(n)) {
          it->second.send -= static_cast<int64_t>(n);
          break;
        }
        if (deadline_ms < 0) {
          cv_.wait(lock);
        } else {
          int64_t left = deadline_ms - MonotonicMs();
          if (left <= 0) {
            *error = "timed out waiting for flow-control credit";
            return false;
          }
          cv_.wait_for(lock, std::chrono::milliseconds(left));
        }
      }
    }
    Frame f;
    f.type = type;
    f.stream = stream;
    f.header = header;
    f.payload.assign(data.substr(0, n));
    if (!Send(f, write_deadline_ms)) {
      *error = "connection closed: " + close_reason();
      return false;
    }
    data.remove_prefix(n);
  } while (!data.empty());
  return true;
}

void Channel::Open(uint32_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  streams_[stream] = Credit{};
}

void Channel::Close(uint32_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  streams_.erase(stream);
  cv_.notify_all();
}

void Channel::Grant(uint32_t stream, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = streams_.find(stream);
  if (it == streams_.end()) return;  // the stream ended while the WINDOW was on its way
  // Never more outstanding than the protocol's window: a peer cannot make us buffer more.
  it->second.send = std::min<int64_t>(
      it->second.send + static_cast<int64_t>(std::min<uint64_t>(bytes, kInitialWindow)),
      kInitialWindow);
  cv_.notify_all();
}

bool Channel::Received(uint32_t stream, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = streams_.find(stream);
  if (it == streams_.end()) return false;
  it->second.recv -= static_cast<int64_t>(bytes);
  return it->second.recv >= 0;
}

void Channel::Consumed(uint32_t stream, size_t bytes) {
  Frame window;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = streams_.find(stream);
    if (it == streams_.end() || closed_) return;
    it->second.consumed += bytes;
    if (it->second.consumed < kInitialWindow / 2) return;
    window.type = FrameType::kWindow;
    window.stream = stream;
    window.header["bytes"] = it->second.consumed;
    it->second.recv += static_cast<int64_t>(it->second.consumed);
    it->second.consumed = 0;
  }
  Send(window);
}

void Channel::Shutdown(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!closed_) {
    closed_ = true;
    close_reason_ = why;
    if (wake_fd_ >= 0) {
      uint64_t one = 1;
      ssize_t ignored = write(wake_fd_, &one, sizeof one);
      (void)ignored;
    }
  }
  cv_.notify_all();
}

bool Channel::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

std::string Channel::close_reason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return close_reason_;
}

}  // namespace esb::proto

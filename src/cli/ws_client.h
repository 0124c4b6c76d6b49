// The CLI's WebSocket client (Boost.Beast, asynchronous on one io_context that the calls
// drive): esbd's terminal (`esb shell`) and the tests that talk to it. Not thread-safe: one
// thread uses a client.
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cli/http_client.h"

namespace esb::cli {

class WebSocketClient {
 public:
  struct Message {
    std::string data;
    bool binary = false;
  };
  // When the daemon refuses the upgrade: its HTTP status and body (an error JSON).
  struct Refusal {
    int status = 0;
    std::string body;
  };

  ~WebSocketClient();
  WebSocketClient(const WebSocketClient&) = delete;
  WebSocketClient& operator=(const WebSocketClient&) = delete;

  // Connects to `endpoint` and upgrades `target` (relative to the endpoint's base path) with
  // `headers` (e.g. Authorization), within `timeout`. Unavailable when the daemon cannot be
  // reached; FailedPrecondition when it answered without upgrading (`refusal` then has its
  // status and body).
  static absl::StatusOr<std::unique_ptr<WebSocketClient>> Connect(
      const Endpoint& endpoint, const std::string& target,
      const std::vector<std::pair<std::string, std::string>>& headers,
      std::chrono::milliseconds timeout, Refusal* refusal = nullptr);

  // Sends one message (queued behind earlier ones), waiting up to `timeout` for it to be
  // written. Unavailable once the connection is closed.
  absl::Status Send(std::string_view data, bool binary,
                    std::chrono::milliseconds timeout = std::chrono::seconds(30));
  // The next message, waiting up to `timeout`: DeadlineExceeded when none came (the
  // connection stays usable), Unavailable once closed (close_code() says how).
  absl::StatusOr<Message> Receive(std::chrono::milliseconds timeout);
  // Starts the closing handshake and waits up to `timeout` for it.
  void Close(int code = 1000, std::chrono::milliseconds timeout = std::chrono::seconds(5));
  // The peer's close code (0: not closed by the peer) and reason.
  int close_code() const;
  std::string close_reason() const;

  // `esb shell`: copies `in_fd` (keystrokes) to binary messages and binary messages to
  // `out_fd`, sends {"type":"resize"} with `window_size()` on SIGWINCH (when `window_size` is
  // set), until the server closes. Text messages go to `on_control`. Returns the close code.
  struct Interactive {
    int in_fd = 0;
    int out_fd = 1;
    std::function<std::optional<std::pair<int, int>>()> window_size;  // rows, cols
    std::function<void(const std::string&)> on_control;
  };
  absl::StatusOr<int> RunInteractive(const Interactive& io);

  struct Impl;

 private:
  explicit WebSocketClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace esb::cli

// Incremental parser for text/event-stream (the SSE mode of execute).
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace esb::cli {

struct SseEvent {
  std::string event = "message";
  std::string data;  // data lines joined with '\n'
};

class SseParser {
 public:
  using Handler = std::function<absl::Status(const SseEvent&)>;
  explicit SseParser(Handler handler) : handler_(std::move(handler)) {}

  // Feeds bytes as they arrive (any split, including inside a line or a CRLF). Calls the
  // handler for every complete event; stops at, and returns, the handler's first error.
  absl::Status Feed(std::string_view bytes);

 private:
  absl::Status Line(std::string_view line);

  Handler handler_;
  std::string line_;
  bool after_cr_ = false;
  SseEvent current_;
  bool has_data_ = false;
};

}  // namespace esb::cli

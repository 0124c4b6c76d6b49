#include "cli/sse.h"

namespace esb::cli {
namespace {
// An SSE line longer than this is not something esbd sends; refuse to buffer without bound.
constexpr size_t kMaxLine = 64u << 20;
}  // namespace

absl::Status SseParser::Feed(std::string_view bytes) {
  for (char c : bytes) {
    if (after_cr_) {
      after_cr_ = false;
      if (c == '\n') continue;  // the LF of a CRLF
    }
    if (c == '\r' || c == '\n') {
      after_cr_ = c == '\r';
      std::string line;
      line.swap(line_);
      if (absl::Status s = Line(line); !s.ok()) return s;
      continue;
    }
    if (line_.size() >= kMaxLine) {
      return absl::ResourceExhaustedError("event stream line too long");
    }
    line_.push_back(c);
  }
  return absl::OkStatus();
}

absl::Status SseParser::Line(std::string_view line) {
  if (line.empty()) {  // blank line: dispatch
    absl::Status s = absl::OkStatus();
    if (has_data_) s = handler_(current_);
    current_ = SseEvent{};
    has_data_ = false;
    return s;
  }
  if (line.front() == ':') return absl::OkStatus();  // comment / keep-alive
  std::string_view field = line;
  std::string_view value;
  if (size_t colon = line.find(':'); colon != std::string_view::npos) {
    field = line.substr(0, colon);
    value = line.substr(colon + 1);
    if (!value.empty() && value.front() == ' ') value.remove_prefix(1);
  }
  if (field == "event") {
    current_.event = std::string(value);
  } else if (field == "data") {
    if (has_data_) current_.data.push_back('\n');
    current_.data.append(value);
    has_data_ = true;
  }
  // "id" and "retry" do not matter to a one-shot client.
  return absl::OkStatus();
}

}  // namespace esb::cli

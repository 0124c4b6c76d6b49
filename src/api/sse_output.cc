#include "api/sse_output.h"

#include <boost/json.hpp>

#include "api/json_util.h"
#include "common/util.h"

namespace esb::api {

SseOutput::SseOutput(ResponseWriter& writer, std::string stdout_event, std::string stderr_event)
    : w_(writer), last_write_ms_(MonotonicMs()) {
  events_[static_cast<int>(Stream::kStdout)] = std::move(stdout_event);
  events_[static_cast<int>(Stream::kStderr)] = std::move(stderr_event);
}

OutputSink SseOutput::Sink() {
  return [this](Stream s, std::string_view chunk) { return OnChunk(s, chunk); };
}

bool SseOutput::OnChunk(Stream s, std::string_view chunk) {
  if (chunk.empty()) {  // a tick while the command is silent: is the client still there?
    if (MonotonicMs() - last_write_ms_ >= 15000) {
      last_write_ms_ = MonotonicMs();
      return w_.WriteComment("keep-alive");
    }
    return !w_.ClientGone();
  }
  last_write_ms_ = MonotonicMs();
  std::string& buf = pending_[static_cast<int>(s)];
  buf.append(chunk);
  size_t n = Utf8CompletePrefix(buf);
  if (n == 0) return w_.ok();
  std::string part = buf.substr(0, n);
  buf.erase(0, n);
  boost::json::object data;
  if (IsValidUtf8(part)) data["data"] = part;
  else data["data_b64"] = Base64Encode(part);
  sent_output_ = true;
  return w_.WriteEvent(events_[static_cast<int>(s)], data);
}

bool SseOutput::Emit(Stream s, std::string_view data) {
  if (data.empty()) return w_.ok();
  bool ok = OnChunk(s, data);
  Flush();
  return ok;
}

void SseOutput::Flush() {
  for (int s = 1; s <= 2; ++s) {
    if (pending_[s].empty()) continue;
    w_.WriteEvent(events_[s], boost::json::object{{"data_b64", Base64Encode(pending_[s])}});
    pending_[s].clear();
    sent_output_ = true;
  }
}

}  // namespace esb::api

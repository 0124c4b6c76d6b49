// Streams a command's output as Server-Sent Events while it runs: one event per chunk
// ({"data": text}, or {"data_b64": ...} for bytes that are not UTF-8), a keep-alive comment
// every 15 s of silence, and cancellation (the sink returns false) once the client is gone.
// Incomplete UTF-8 sequences at the end of a chunk are held back until the rest arrives, so a
// multi-byte character is never split across events. Used by /execute and both run endpoints.
#pragma once

#include <string>
#include <string_view>

#include "api/http_server.h"
#include "drivers/driver.h"

namespace esb::api {

class SseOutput {
 public:
  // Event names for the two streams, e.g. "stdout"/"stderr", or "install" for both.
  SseOutput(ResponseWriter& writer, std::string stdout_event = "stdout",
            std::string stderr_event = "stderr");
  SseOutput(const SseOutput&) = delete;
  SseOutput& operator=(const SseOutput&) = delete;

  // For EnvironmentManager::Exec. Valid while this object lives.
  OutputSink Sink();
  // Whole text at once (tiers that do not stream, e.g. a nano run's output).
  bool Emit(Stream stream, std::string_view data);
  // Sends what is still held back (an unfinished UTF-8 sequence) as data_b64.
  void Flush();
  // True once any output was sent.
  bool sent_output() const { return sent_output_; }

 private:
  bool OnChunk(Stream stream, std::string_view chunk);

  ResponseWriter& w_;
  std::string events_[3];
  std::string pending_[3];
  int64_t last_write_ms_;
  bool sent_output_ = false;
};

}  // namespace esb::api

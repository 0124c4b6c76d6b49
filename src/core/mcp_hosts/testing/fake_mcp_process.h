// Test helper: an in-process stand-in for an MCP server on stdio (a ProcessSession): it parses
// the JSON-RPC lines written to its stdin and answers as a legacy (or modern) server would, with
// scripted misbehaviour per tool: hang, crash mid-call, oversize line, wrong ids, progress,
// server→client requests; and, at the handshake, garbage or a flood on stdout.
#pragma once

#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "boost/json.hpp"
#include "drivers/driver.h"

namespace esb::mcp_hosts::testing {

struct FakeMcpOptions {
  bool modern = false;           // answers server/discover (else -32601)
  bool silent_discover = false;  // ignores server/discover (an old server)
  int garbage_at_start = 0;      // non-JSON lines written at initialize
  int flood_lines_at_start = 0;  // valid notifications written at initialize
  int64_t oversize_bytes = 0;    // tool "big" answers with a line this long; "noisy" writes as
                                 // many bytes on stderr
  int tools = 3;                 // echo, slow, crash (+ more up to `tools`), 2 per page
  std::string progress_message;  // tool "progress" sends this message ("" → "step <i>")
  size_t description_bytes = 0;  // each tool's description this long ("" → "a fake tool")
  std::vector<std::string> names;  // when set: the tools' names instead (`tools` = its size)
};

class FakeMcpProcess : public ProcessSession {
 public:
  explicit FakeMcpProcess(FakeMcpOptions options = {}) : options_(options) {}

  absl::Status Input(std::string_view data, bool) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (exit_) return absl::FailedPreconditionError("ESRCH: process exited");
    in_.append(data);
    size_t nl;
    while ((nl = in_.find('\n')) != std::string::npos) {
      std::string line = in_.substr(0, nl);
      in_.erase(0, nl + 1);
      boost::system::error_code ec;
      boost::json::value v = boost::json::parse(line, ec);
      if (ec || !v.is_object()) continue;
      received.push_back(v.as_object());
      Handle(v.as_object());
    }
    cv_.notify_all();
    return absl::OkStatus();
  }
  absl::Status Resize(int, int) override { return absl::InvalidArgumentError("no pty"); }
  absl::StatusOr<std::optional<int>> Wait(int timeout_ms, const OutputSink& sink) override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                 [&] { return !out_.empty() || exit_.has_value(); });
    while (!out_.empty()) {
      auto [stream, chunk] = std::move(out_.front());
      out_.pop_front();
      lock.unlock();
      const bool go_on = !sink || sink(stream, chunk);
      lock.lock();
      if (!go_on) return std::optional<int>();
    }
    if (exit_) return std::optional<int>(*exit_);
    return std::optional<int>();
  }
  absl::Status Kill() override {
    std::lock_guard<std::mutex> lock(mu_);
    ++kills;
    if (!exit_) exit_ = 137;
    cv_.notify_all();
    return absl::OkStatus();
  }

  // Makes the process exit now with `code` (a crash between calls).
  void Exit(int code, std::string stderr_text = "") {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stderr_text.empty()) out_.emplace_back(Stream::kStderr, std::move(stderr_text));
    if (!exit_) exit_ = code;
    cv_.notify_all();
  }
  // The methods received so far (for assertions).
  std::vector<std::string> Methods() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> out;
    for (const auto& m : received)
      if (const auto* v = m.if_contains("method"); v && v->is_string())
        out.emplace_back(v->as_string());
    return out;
  }
  // The responses the client sent to the server's own requests.
  std::vector<boost::json::object> Responses() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<boost::json::object> out;
    for (const auto& m : received)
      if (!m.contains("method")) out.push_back(m);
    return out;
  }

  int kills = 0;  // under mu_ (read after the client is gone)
  std::vector<boost::json::object> received;

 private:
  void Write(const boost::json::value& v) {
    out_.emplace_back(Stream::kStdout, boost::json::serialize(v) + "\n");
  }
  void Reply(const boost::json::value& id, boost::json::value result) {
    Write(boost::json::object{{"jsonrpc", "2.0"}, {"id", id}, {"result", std::move(result)}});
  }
  void Error(const boost::json::value& id, int code, std::string msg) {
    Write(boost::json::object{{"jsonrpc", "2.0"},
                              {"id", id},
                              {"error", boost::json::object{{"code", code}, {"message", msg}}}});
  }
  void Handle(const boost::json::object& m) {
    const auto* method = m.if_contains("method");
    const boost::json::value id = m.contains("id") ? m.at("id") : boost::json::value();
    if (method == nullptr) {  // a response to one of our requests
      if (ask_id_ && ++ask_answers_ == 2) {
        Reply(*ask_id_,
              boost::json::object{{"content", boost::json::array{boost::json::object{
                                                  {"type", "text"}, {"text", "asked"}}}}});
        ask_id_.reset();
      }
      return;
    }
    const std::string name(method->as_string());
    const boost::json::object params = m.contains("params") && m.at("params").is_object()
                                           ? m.at("params").as_object()
                                           : boost::json::object();
    if (name == "server/discover") {
      if (options_.silent_discover) return;
      if (options_.modern)
        Reply(id, boost::json::object{{"supportedVersions", boost::json::array{"2026-07-28"}},
                                      {"capabilities", boost::json::object{{"tools", {}}}},
                                      {"resultType", "complete"}});
      else
        Error(id, -32601, "Method not found");
    } else if (name == "initialize") {
      for (int i = 0; i < options_.garbage_at_start; ++i)
        out_.emplace_back(Stream::kStdout, absl::StrCat("Server listening... ", i, "\n"));
      for (int i = 0; i < options_.flood_lines_at_start; ++i)
        Write(boost::json::object{{"jsonrpc", "2.0"}, {"method", "notifications/message"}});
      Reply(id, boost::json::object{{"protocolVersion", "2025-06-18"},
                                    {"capabilities", boost::json::object{{"tools", {}}}},
                                    {"serverInfo", boost::json::object{{"name", "fake"}}}});
    } else if (name == "tools/list") {
      static const char* kNames[] = {"echo",     "slow",     "crash", "big",
                                     "wrong_id", "progress", "ask",   "bad name!"};
      int start = 0;
      if (const auto* c = params.if_contains("cursor"); c && c->is_string())
        start = std::stoi(std::string(c->as_string()));
      boost::json::array tools;
      const int count =
          options_.names.empty() ? options_.tools : static_cast<int>(options_.names.size());
      for (int i = start; i < std::min(start + 2, count); ++i)
        tools.push_back(
            boost::json::object{{"name", !options_.names.empty() ? options_.names[i]
                                         : i < 8                 ? std::string(kNames[i])
                                                                 : absl::StrCat("t", i)},
                                {"description", options_.description_bytes == 0
                                                    ? std::string("a fake tool")
                                                    : std::string(options_.description_bytes, 'd')},
                                {"inputSchema", boost::json::object{{"type", "object"}}}});
      boost::json::object r{{"tools", std::move(tools)}};
      if (start + 2 < count) r["nextCursor"] = absl::StrCat(start + 2);
      Reply(id, std::move(r));
    } else if (name == "tools/call") {
      const std::string tool(params.at("name").as_string());
      if (tool == "echo") {
        Reply(id, boost::json::object{
                      {"content", boost::json::array{boost::json::object{
                                      {"type", "text"},
                                      {"text", boost::json::serialize(params.at("arguments"))}}}},
                      {"structuredContent", params.at("arguments")}});
      } else if (tool == "slow") {
        // never answers
      } else if (tool == "crash") {
        out_.emplace_back(Stream::kStderr, "Traceback: boom\n");
        exit_ = 3;
      } else if (tool == "big") {
        out_.emplace_back(Stream::kStdout,
                          std::string(static_cast<size_t>(options_.oversize_bytes), 'x'));
      } else if (tool == "noisy") {
        out_.emplace_back(Stream::kStderr,
                          std::string(static_cast<size_t>(options_.oversize_bytes), 'e'));
      } else if (tool == "wrong_id") {
        Reply(boost::json::value(id.as_int64() + 1000), boost::json::object{});
        Reply(boost::json::value("not-a-number"), boost::json::object{});
      } else if (tool == "progress") {
        const auto& token = params.at("_meta").as_object().at("progressToken");
        for (int i = 1; i <= 3; ++i)
          Write(boost::json::object{
              {"jsonrpc", "2.0"},
              {"method", "notifications/progress"},
              {"params", boost::json::object{{"progressToken", token},
                                             {"progress", i},
                                             {"total", 3},
                                             {"message", options_.progress_message.empty()
                                                             ? absl::StrCat("step ", i)
                                                             : options_.progress_message}}}});
        Reply(id, boost::json::object{{"content", boost::json::array()}});
      } else if (tool == "ask") {
        ask_id_ = id;
        ask_answers_ = 0;
        Write(boost::json::object{{"jsonrpc", "2.0"},
                                  {"id", "s1"},
                                  {"method", "sampling/createMessage"},
                                  {"params", boost::json::object()}});
        Write(boost::json::object{{"jsonrpc", "2.0"}, {"id", "s2"}, {"method", "ping"}});
      } else {
        Error(id, -32602, "Unknown tool");
      }
    }
  }

  const FakeMcpOptions options_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::string in_;
  std::deque<std::pair<Stream, std::string>> out_;
  std::optional<int> exit_;
  std::optional<boost::json::value> ask_id_;
  int ask_answers_ = 0;
};

}  // namespace esb::mcp_hosts::testing

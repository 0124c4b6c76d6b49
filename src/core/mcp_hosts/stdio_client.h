// esbd as the MCP client of a server it runs over stdio (issue 14, docs/design.md "Hosted MCP
// servers"): newline-delimited JSON-RPC on the process's stdin and stdout; stderr is kept as a
// bounded tail for error reports. Everything the process writes is hostile input: every line
// is size-capped, the output rate is capped (flood), lines that are not JSON-RPC are counted
// (garbage); over any cap the process is killed and the reason kept. Every wait has a deadline.
//
//   StdioClient c(std::move(process), limits);      // starts the reader thread
//   absl::Status st = c.Initialize(deadline_ms);      // server/discover, else initialize
//   auto tools = c.ListTools(deadline_ms);            // all pages
//   auto result = c.CallTool("echo", args, ctx, deadline_ms);
//
// Threads: one reader thread per client (it owns the process's Wait); callers block on their
// own thread until their answer, their deadline or their cancellation. Progress notifications
// are delivered on the caller's thread (never the reader's), so a slow consumer cannot stall
// the reader. Server→client requests: `ping` is answered, anything else gets "method not found"
// (esbd offers hosted servers no sampling, roots or elicitation).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "boost/json.hpp"
#include "core/tools/tool_call.h"
#include "drivers/driver.h"

namespace esb::mcp_hosts {

inline constexpr char kModernProtocol[] = "2026-07-28";
inline constexpr char kLegacyProtocol[] = "2025-11-25";

struct ClientLimits {
  int64_t max_message_bytes = 4 << 20;
  int64_t max_output_bytes_per_second = 8 << 20;
  int64_t max_lines_per_second = 2000;
  int max_garbage_lines = 8;
  int max_concurrent_calls = 8;
  int64_t stderr_tail_bytes = 8192;
  int max_tools = 1000;
  int max_list_pages = 100;
  // How long server/discover may stay unanswered before the client falls back to initialize
  // (a legacy server may ignore an unknown method).
  int64_t probe_timeout_ms = 3000;
};

// Why the process ended, once it has.
struct ExitInfo {
  bool ended = false;
  std::optional<int> exit_code;   // 128+N for signal N; none when the wait failed
  std::string reason;             // "exited with code 1", "killed: flooded stdout ...", ...
  bool killed_by_client = false;  // the client killed it (a limit, Kill())
};

// MCP's rule for a tool name (2026-07-28 "Tool names"): 1-128 characters of A-Z a-z 0-9 _ . -.
// Other names cannot travel in the Mcp-Name header a modern tools/call needs.
inline constexpr size_t kMaxToolNameBytes = 128;
bool ValidToolName(std::string_view name);

// A server's tools/list, as esbd keeps it.
struct ToolList {
  std::vector<boost::json::object> tools;  // valid names, each once, in the server's order
  // What was left out and why ("listed twice", "not a valid MCP tool name"): at most
  // kMaxSkippedReported entries, each "<name, escaped and cut>: <reason>"; `skipped_count`
  // counts them all.
  std::vector<std::string> skipped;
  int skipped_count = 0;
};
inline constexpr size_t kMaxSkippedReported = 16;

class StdioClient {
 public:
  // Takes the running process and starts reading its output. `label` names it in errors
  // ("MCP server 'files'").
  StdioClient(std::unique_ptr<ProcessSession> process, ClientLimits limits, std::string label);
  // Kills the process and joins the reader.
  ~StdioClient();
  StdioClient(const StdioClient&) = delete;
  StdioClient& operator=(const StdioClient&) = delete;

  // The handshake: server/discover (modern era); on anything but a modern answer,
  // initialize + notifications/initialized (legacy). Sets protocol().
  absl::Status Initialize(int64_t deadline_ms);
  // tools/list, every page (at most limits.max_list_pages, limits.max_tools tools). Each tool
  // is an object with a string "name". All the tools together may take at most
  // limits.max_message_bytes serialised (a list esbd could not hand on in one answer, and
  // memory a hostile server would otherwise pin: FailedPrecondition naming the limit). A tool
  // whose name is not a valid MCP tool name, or repeats an earlier one, is left out and
  // reported in ToolList::skipped (one server cannot make a name mean two tools).
  absl::StatusOr<ToolList> ListTools(int64_t deadline_ms);
  // tools/call: the result object as the server sent it. Non-OK: the call failed (timeout:
  // DeadlineExceeded, cancelled: Cancelled, a JSON-RPC error: its message, the server died:
  // Unavailable with the exit and stderr tail, too many calls at once: ResourceExhausted).
  // ctx.progress gets the server's progress notifications; ctx.cancelled is polled.
  absl::StatusOr<boost::json::object> CallTool(const std::string& name,
                                               const boost::json::object& arguments,
                                               const tools::CallContext& ctx, int64_t deadline_ms);
  // Kills the process (pending calls fail with `reason`). Idempotent.
  void Kill(const std::string& reason);
  // Waits until the process has ended (true) or `timeout_ms` passed.
  bool WaitEnded(int64_t timeout_ms);
  ExitInfo exit_info() const;
  std::string stderr_tail() const;
  std::string protocol() const;
  // The server said its tools changed (notifications/tools/list_changed) since the last
  // ListTools.
  bool tools_changed() const;
  int calls_in_flight() const;

 private:
  struct Pending {
    std::optional<boost::json::value> result;
    std::optional<boost::json::object> error;
    std::string progress_token;
    std::deque<tools::Progress> progress;
  };
  // One request and its answer. `progress` may be null.
  absl::StatusOr<boost::json::value> Request(const std::string& method, boost::json::object params,
                                             int64_t deadline_ms, const tools::CallContext* ctx);
  absl::Status Send(const boost::json::value& message);
  void ReaderLoop();
  // The reader's sink: false ends the wait (the process is being killed).
  bool OnOutput(Stream stream, std::string_view chunk);
  void OnLine(std::string_view line);
  void OnMessage(const boost::json::object& message);
  void Fail(const std::string& reason);  // kills the process for a limit
  boost::json::object WithMeta(boost::json::object params) const;
  std::string EndedError() const;  // "MCP server 'x' ended: ...; stderr: ..."

  std::unique_ptr<ProcessSession> process_;
  const ClientLimits limits_;
  const std::string label_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<int64_t, Pending*> pending_;
  int64_t next_id_ = 1;
  int in_flight_ = 0;
  std::string protocol_;
  bool modern_ = false;
  bool tools_changed_ = false;
  ExitInfo exit_;
  std::string kill_reason_;  // set by Fail/Kill before the kill
  std::string stderr_tail_;
  // Reader state (reader thread only, except the counters read under mu_).
  std::string line_;
  int garbage_lines_ = 0;
  double byte_tokens_ = 0, line_tokens_ = 0;
  int64_t last_refill_ms_ = 0;
  bool stop_reading_ = false;

  std::mutex write_mu_;  // one message on stdin at a time (lines never interleave)
  std::thread reader_;
};

}  // namespace esb::mcp_hosts

// The terminal route (docs/api.md "Terminal"): GET /environments/{id}/terminal?cols=&rows=,
// upgraded to a WebSocket that carries a shell's PTY. Binary frames are PTY bytes both ways;
// text frames are JSON control messages: the client sends {"type":"resize","cols":c,"rows":r},
// the server {"type":"exit","code":n} (then closes) or {"type":"error","message":...}.
// The core (EnvironmentManager::OpenTerminal) decides and audits; this file moves the bytes.
#include <atomic>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "api/service.h"
#include "common/util.h"

namespace esb::api {

namespace json = boost::json;

namespace {

// The largest message a terminal client may send (keystrokes and pastes come in small pieces;
// a larger one is closed with 1009). Below the server-wide WebSocket cap.
constexpr size_t kMaxTerminalMessageBytes = 64 << 10;
// How long the output side waits for the shell per call before it looks at the input side.
constexpr int kWaitSliceMs = 500;
constexpr std::chrono::milliseconds kReceiveSlice{250};

std::string ControlJson(json::object o) { return json::serialize(o); }

// A 1-1000 query integer, or the default when absent.
absl::StatusOr<int> Dimension(const Request& req, std::string_view name, int fallback) {
  std::optional<std::string> v = req.Query(name);
  if (!v) return fallback;
  int n = 0;
  if (!absl::SimpleAtoi(*v, &n) || n < 1 || n > 1000)
    return absl::InvalidArgumentError(
        absl::StrCat("'", std::string(name), "' must be an integer 1-1000"));
  return n;
}

// One text frame from the client. Only "resize" is defined.
absl::Status HandleControl(EnvironmentManager::Process& term, std::string_view text) {
  boost::system::error_code ec;
  json::value v = json::parse(text, ec);
  if (ec || !v.is_object())
    return absl::InvalidArgumentError("a text frame must be a JSON object with a \"type\"");
  const json::object& o = v.as_object();
  const json::value* type = o.if_contains("type");
  if (type == nullptr || !type->is_string())
    return absl::InvalidArgumentError("a control message needs a string \"type\"");
  if (type->as_string() != "resize")
    return absl::InvalidArgumentError(
        absl::StrCat("unknown control message type '",
                     SanitizeUtf8(std::string_view(type->as_string()).substr(0, 64)),
                     "' (the client may send \"resize\")"));
  const json::value* cols = o.if_contains("cols");
  const json::value* rows = o.if_contains("rows");
  if (cols == nullptr || rows == nullptr || !cols->is_int64() || !rows->is_int64())
    return absl::InvalidArgumentError("resize needs integer \"cols\" and \"rows\" (1-1000)");
  const int64_t c = cols->as_int64(), r = rows->as_int64();
  if (c < 1 || c > 1000 || r < 1 || r > 1000)
    return absl::InvalidArgumentError("resize: \"cols\" and \"rows\" must be 1-1000");
  return term.Resize(static_cast<int>(r), static_cast<int>(c));
}

// Runs one terminal until the shell exits, the client goes away or the terminal idles out.
// The worker thread carries the output; a second thread the client's messages.
void PumpTerminal(EnvironmentManager::Process& term, WebSocket& ws) {
  std::atomic<bool> done{false};
  std::thread input([&] {
    while (!done.load()) {
      absl::StatusOr<WebSocket::Message> m = ws.Receive(kReceiveSlice);
      if (!m.ok()) {
        if (absl::IsDeadlineExceeded(m.status())) {
          if (!term.Idle()) continue;
          ws.Send(ControlJson({{"type", "error"}, {"message", "terminal idle timeout"}}));
          ws.Close(WebSocket::kPolicy, "idle timeout");
          term.Close("idle timeout");
          break;
        }
        term.Close("client closed");  // closed (by either side) or failed
        break;
      }
      if (m->data.size() > kMaxTerminalMessageBytes) {
        ws.Close(WebSocket::kTooBig, absl::StrCat("terminal messages are limited to ",
                                                  kMaxTerminalMessageBytes, " bytes"));
        term.Close("message too big");
        break;
      }
      if (m->binary) {
        if (absl::Status st = term.Input(m->data); !st.ok()) {
          // The shell has exited with input still arriving (typed ahead, or the EOF of a
          // piped stdin): that input has nowhere to go, and the output side is about to
          // report the exit status. Closing here would race that report away.
          if (absl::IsNotFound(st)) continue;
          ws.Close(WebSocket::kError, "the shell does not take input");
          term.Close(absl::StrCat("input failed: ", st.message()));
          break;
        }
        continue;
      }
      if (absl::Status st = HandleControl(term, m->data); !st.ok()) {
        // Bad control input is the client's mistake: say so, keep the terminal.
        ws.Send(ControlJson({{"type", "error"}, {"message", StdView(st.message())}}));
      }
    }
    done = true;
  });
  for (;;) {
    absl::StatusOr<std::optional<int>> st =
        term.Wait(kWaitSliceMs, [&](Stream, std::string_view chunk) {
          if (chunk.empty()) return !done.load();
          return ws.Send(chunk, /*binary=*/true);
        });
    if (const std::string ended = term.ended_by(); !ended.empty() && !done.load()) {
      // esbd ended it (a rewind): an exit message that says why, then a normal close.
      const int code = st.ok() && st->has_value() ? **st : 128 + 9;
      ws.Send(ControlJson({{"type", "exit"}, {"code", code}, {"reason", ended}}));
      ws.Close(WebSocket::kNormal, "ended by esbd");
      break;
    }
    if (!st.ok()) {
      if (!done.load()) {
        ws.Send(
            ControlJson({{"type", "error"},
                         {"message", absl::StrCat("terminal failed: ", st.status().message())}}));
        ws.Close(WebSocket::kError, "terminal failed");
        term.Close(absl::StrCat("failed: ", st.status().message()));
      }
      break;
    }
    if (st->has_value()) {
      ws.Send(ControlJson({{"type", "exit"}, {"code", **st}}));
      ws.Close(WebSocket::kNormal, "exited");
      break;
    }
    if (done.load()) break;
  }
  done = true;
  term.Close("closed");
  input.join();
}

}  // namespace

void ApiService::RegisterTerminal(
    const std::function<void(std::string, std::string_view, RouteFn)>& add) {
  add("GET", "/environments/{id}/terminal", [this](Request& req, const Caller& t) -> Response {
    absl::StatusOr<int> cols = Dimension(req, "cols", 80);
    if (!cols.ok()) return ErrorResponse(400, "bad_request", StdView(cols.status().message()));
    absl::StatusOr<int> rows = Dimension(req, "rows", 24);
    if (!rows.ok()) return ErrorResponse(400, "bad_request", StdView(rows.status().message()));
    // Checked before a shell is started for a request that cannot become a WebSocket.
    if (!absl::StrContains(absl::AsciiStrToLower(req.HeaderOr("Upgrade", "")), "websocket"))
      return ErrorResponse(426, "upgrade_required",
                           "the terminal is a WebSocket: send a WebSocket upgrade request");
    auto term = manager_->OpenTerminal(t, req.Param("id"), *rows, *cols);
    if (!term.ok()) return StatusResponse(term.status());
    std::shared_ptr<EnvironmentManager::Process> shared = *std::move(term);
    return Response::WebSocket([shared](WebSocket& ws) { PumpTerminal(*shared, ws); });
  });
}

}  // namespace esb::api

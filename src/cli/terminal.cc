#include "cli/terminal.h"

#include <signal.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

#include <boost/json.hpp>
#include <cstdlib>
#include <iterator>
#include <optional>

#include "absl/strings/str_cat.h"
#include "cli/format.h"
#include "cli/ws_client.h"

namespace esb::cli {

namespace {

std::optional<std::pair<int, int>> WindowSize(int fd_a, int fd_b) {
  for (int fd : {fd_a, fd_b}) {
    winsize ws{};
    if (fd >= 0 && ::isatty(fd) && ::ioctl(fd, TIOCGWINSZ, &ws) == 0 && ws.ws_row > 0 &&
        ws.ws_col > 0)
      return std::make_pair(static_cast<int>(ws.ws_row), static_cast<int>(ws.ws_col));
  }
  return std::nullopt;
}

// The terminal raw mode changed, for the signal handler and the exit hook: written before
// the handlers are installed, read by them (a handler only calls async-signal-safe tcsetattr).
int g_raw_fd = -1;
termios g_raw_saved{};
volatile sig_atomic_t g_raw_active = 0;

void RestoreRawTty() {
  if (g_raw_active) {
    ::tcsetattr(g_raw_fd, TCSANOW, &g_raw_saved);
    g_raw_active = 0;
  }
}

// SIGTERM, SIGHUP, SIGINT, SIGQUIT while raw: the terminal's mode back, then the signal's
// default action (the process ends by it, as without esb's handler; esbd kills the remote
// shell when the WebSocket drops).
void RestoreAndReraise(int sig) {
  RestoreRawTty();
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

constexpr int kRestoreSignals[] = {SIGTERM, SIGHUP, SIGINT, SIGQUIT};

// Raw mode on a terminal for as long as it lives (keystrokes go to the remote shell as typed:
// no local echo, no line editing, ^C is a byte), restored in the destructor, on the signals
// above and at exit() (however `esb shell` ends, the terminal is left as it was found).
class RawMode {
 public:
  explicit RawMode(int fd) {
    if (fd < 0 || !::isatty(fd) || ::tcgetattr(fd, &saved_) != 0) return;
    termios raw = saved_;
    ::cfmakeraw(&raw);
    g_raw_fd = fd;
    g_raw_saved = saved_;
    g_raw_active = 1;
    static const bool hooked = (std::atexit(RestoreRawTty), true);
    (void)hooked;
    struct sigaction sa {};
    sa.sa_handler = RestoreAndReraise;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < std::size(kRestoreSignals); ++i)
      ::sigaction(kRestoreSignals[i], &sa, &previous_[i]);
    if (::tcsetattr(fd, TCSANOW, &raw) == 0) {
      fd_ = fd;
    } else {
      Undo();
    }
  }
  ~RawMode() {
    if (fd_ >= 0) Undo();
  }
  RawMode(const RawMode&) = delete;
  RawMode& operator=(const RawMode&) = delete;

 private:
  void Undo() {
    RestoreRawTty();
    for (size_t i = 0; i < std::size(kRestoreSignals); ++i)
      ::sigaction(kRestoreSignals[i], &previous_[i], nullptr);
  }
  int fd_ = -1;
  termios saved_{};
  struct sigaction previous_[std::size(kRestoreSignals)]{};
};

std::string RefusalText(const WebSocketClient::Refusal& r) {
  boost::json::error_code ec;
  boost::json::value v = boost::json::parse(r.body, ec);
  std::string message;
  if (!ec && v.is_object()) {
    if (const boost::json::value* m = v.as_object().if_contains("message");
        m != nullptr && m->is_string())
      message = std::string(m->as_string());
  }
  if (message.empty()) message = "esbd refused the terminal";
  std::string text = absl::StrCat(SanitizeCell(message, 2000), " (HTTP ", r.status, ")");
  if (r.status == 401) text += "; set --api-key or ESB_API_KEY";
  return text;
}

}  // namespace

absl::StatusOr<int> RunTerminal(const Endpoint& endpoint, const std::string& target,
                                const std::vector<std::pair<std::string, std::string>>& headers,
                                const TerminalOptions& options) {
  const std::pair<int, int> size =
      WindowSize(options.out_fd, options.in_fd)
          .value_or(std::make_pair(options.default_rows, options.default_cols));
  WebSocketClient::Refusal refusal;
  absl::StatusOr<std::unique_ptr<WebSocketClient>> ws = WebSocketClient::Connect(
      endpoint, absl::StrCat(target, "?cols=", size.second, "&rows=", size.first), headers,
      std::chrono::seconds(30), &refusal);
  if (!ws.ok()) {
    if (refusal.status != 0) return absl::FailedPreconditionError(RefusalText(refusal));
    return ws.status();
  }
  std::optional<int> exit_code;
  std::string errors;
  WebSocketClient::Interactive io;
  io.in_fd = options.in_fd;
  io.out_fd = options.out_fd;
  if (::isatty(options.in_fd) || ::isatty(options.out_fd))
    io.window_size = [&] { return WindowSize(options.out_fd, options.in_fd); };
  io.on_control = [&](const std::string& text) {
    boost::json::error_code ec;
    boost::json::value v = boost::json::parse(text, ec);
    if (ec || !v.is_object()) return;
    const boost::json::object& o = v.as_object();
    const boost::json::value* type = o.if_contains("type");
    if (type == nullptr || !type->is_string()) return;
    if (type->as_string() == "exit") {
      const boost::json::value* code = o.if_contains("code");
      if (code != nullptr && code->is_int64()) exit_code = static_cast<int>(code->as_int64());
    } else if (type->as_string() == "error") {
      const boost::json::value* m = o.if_contains("message");
      if (m != nullptr && m->is_string())
        errors = SanitizeCell(std::string_view(m->as_string()), 400);
    }
  };
  absl::StatusOr<int> close_code;
  {
    RawMode raw(options.in_fd);
    close_code = (*ws)->RunInteractive(io);
  }
  if (exit_code.has_value()) return *exit_code;
  std::string why = absl::StrCat("the terminal closed without an exit status (WebSocket close ",
                                 close_code.ok() ? *close_code : 0);
  if (!(*ws)->close_reason().empty())
    absl::StrAppend(&why, ": ", SanitizeCell((*ws)->close_reason(), 200));
  absl::StrAppend(&why, ")");
  if (!errors.empty()) absl::StrAppend(&why, ": ", errors);
  return absl::UnavailableError(why);
}

}  // namespace esb::cli

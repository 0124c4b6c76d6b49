#include "cli/cli.h"

#include <netinet/in.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/json.hpp>
#include <chrono>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "api/http_server.h"
#include "cli/format.h"
#include "cli/http_client.h"
#include "cli/sse.h"
#include "common/shell_quote.h"
#include "common/util.h"
#include "gtest/gtest.h"

namespace esb::cli {
namespace {

using Args = std::vector<std::string>;

// ---------------------------------------------------------------------------------------------
// Argument parsing

absl::StatusOr<Invocation> Parse(const Args& args,
                                 const std::map<std::string, std::string>& env = {}) {
  return ParseCommandLine(args, env);
}

TEST(ParseTest, DefaultsComeFromEnvironmentThenFlags) {
  auto inv = Parse({"ls"});
  ASSERT_TRUE(inv.ok()) << inv.status();
  EXPECT_EQ(inv->global.url, "http://127.0.0.1:8080");
  EXPECT_EQ(inv->global.api_key, "");

  inv = Parse({"ls"}, {{"ESB_URL", "http://h:1"}, {"ESB_API_KEY", "k1"}});
  ASSERT_TRUE(inv.ok());
  EXPECT_EQ(inv->global.url, "http://h:1");
  EXPECT_EQ(inv->global.api_key, "k1");

  inv = Parse({"--url", "http://x:2", "ls", "--api-key=k2", "--json"}, {{"ESB_URL", "http://h:1"}});
  ASSERT_TRUE(inv.ok());
  EXPECT_EQ(inv->global.url, "http://x:2");
  EXPECT_EQ(inv->global.api_key, "k2");
  EXPECT_TRUE(inv->global.json);
  EXPECT_EQ(inv->command, "ls");
}

TEST(ParseTest, CreateFlagsAreValidated) {
  auto inv = Parse({"create", "--image", "py", "--memory-mb", "512", "--cpu", "0.5", "--ttl=60",
                    "--env", "A=1", "--env", "B=x=y"});
  ASSERT_TRUE(inv.ok()) << inv.status();
  EXPECT_EQ(inv->Value("--image"), "py");
  EXPECT_EQ(inv->Value("--memory-mb"), "512");
  EXPECT_EQ(inv->Value("--ttl"), "60");
  EXPECT_EQ(inv->flags.at("--env"), (Args{"A=1", "B=x=y"}));

  EXPECT_FALSE(Parse({"create", "--memory-mb", "lots"}).ok());
  EXPECT_FALSE(Parse({"create", "--cpu", "1x"}).ok());
  EXPECT_FALSE(Parse({"create", "--cpu", "nan"}).ok());
  EXPECT_FALSE(Parse({"create", "--env", "NOEQUALS"}).ok());
  EXPECT_FALSE(Parse({"create", "--env", "=v"}).ok());
  EXPECT_FALSE(Parse({"create", "--ttl"}).ok());  // missing value
  EXPECT_FALSE(Parse({"create", "extra"}).ok());  // no positionals
  auto bad = Parse({"create", "--bogus"});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("--bogus"), std::string::npos);
}

TEST(ParseTest, UnknownOrMissingCommand) {
  auto r = Parse({"frobnicate"});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("unknown command 'frobnicate'"), std::string::npos);
  EXPECT_FALSE(Parse({}).ok());
  EXPECT_FALSE(Parse({"--memory-mb", "5", "create"}).ok());  // command option before command
}

TEST(ParseTest, ExecCommandForms) {
  auto inv = Parse({"exec", "env_1", "--", "ls", "-la", "/tmp"});
  ASSERT_TRUE(inv.ok()) << inv.status();
  EXPECT_EQ(inv->positionals, Args{"env_1"});
  EXPECT_EQ(inv->command_words, (Args{"ls", "-la", "/tmp"}));

  // Without "--", everything after ENV is the command, options included.
  inv = Parse({"exec", "env_1", "ls", "-la", "--json"});
  ASSERT_TRUE(inv.ok()) << inv.status();
  EXPECT_EQ(inv->command_words, (Args{"ls", "-la", "--json"}));
  EXPECT_FALSE(inv->global.json);

  inv =
      Parse({"exec", "--timeout", "5", "env_1", "--env", "A=b", "--json", "--", "echo", "--", "x"});
  ASSERT_TRUE(inv.ok()) << inv.status();
  EXPECT_EQ(inv->Value("--timeout"), "5");
  EXPECT_EQ(inv->Value("--env"), "A=b");
  EXPECT_TRUE(inv->global.json);
  EXPECT_EQ(inv->command_words, (Args{"echo", "--", "x"}));

  EXPECT_FALSE(Parse({"exec", "env_1"}).ok());
  EXPECT_FALSE(Parse({"exec", "env_1", "--"}).ok());
  EXPECT_FALSE(Parse({"exec", "--", "ls"}).ok());
  EXPECT_FALSE(Parse({"exec", "--timeout", "soon", "env_1", "--", "ls"}).ok());
}

TEST(ParseTest, PositionalCounts) {
  EXPECT_TRUE(Parse({"rm", "a", "b", "c"}).ok());
  EXPECT_FALSE(Parse({"rm"}).ok());
  EXPECT_TRUE(Parse({"cp", "a", "e:b"}).ok());
  EXPECT_FALSE(Parse({"cp", "a"}).ok());
  EXPECT_FALSE(Parse({"cat", "env_1"}).ok());
  EXPECT_TRUE(Parse({"logs", "env_1", "--limit", "5"}).ok());
  EXPECT_TRUE(Parse({"audit", "--q", "pip install", "--since", "1h"}).ok());
  EXPECT_FALSE(Parse({"audit", "--limit", "ten"}).ok());
  EXPECT_TRUE(Parse({"rm", "--", "-weird-id"}).ok());
}

TEST(ParseTest, HelpAndVersion) {
  auto inv = Parse({"--help"});
  ASSERT_TRUE(inv.ok());
  EXPECT_TRUE(inv->global.help);
  inv = Parse({"exec", "--help"});  // help wins over missing arguments
  ASSERT_TRUE(inv.ok());
  EXPECT_TRUE(inv->global.help);
  EXPECT_EQ(inv->command, "exec");
  inv = Parse({"--version"});
  ASSERT_TRUE(inv.ok());
  EXPECT_EQ(inv->command, "version");
}

TEST(CommandTest, JoinCommandQuotesOnlyWhenNeeded) {
  EXPECT_EQ(JoinCommand({"ls | wc -l"}), "ls | wc -l");  // one word: verbatim
  EXPECT_EQ(JoinCommand({"ls", "-la", "/tmp"}), "ls -la /tmp");
  EXPECT_EQ(JoinCommand({"echo", "a b", "it's", "$HOME", ""}), "echo 'a b' 'it'\\''s' '$HOME' ''");
  EXPECT_EQ(ShellQuote("a;rm -rf /"), "'a;rm -rf /'");
}

TEST(CommandTest, SplitRemote) {
  std::string env, path;
  ASSERT_TRUE(SplitRemote("env_1:src/a.py", &env, &path));
  EXPECT_EQ(env, "env_1");
  EXPECT_EQ(path, "src/a.py");
  ASSERT_TRUE(SplitRemote("env_1:", &env, &path));
  EXPECT_EQ(path, "");
  EXPECT_FALSE(SplitRemote("local.txt", &env, &path));
  EXPECT_FALSE(SplitRemote("./a:b", &env, &path));
  EXPECT_FALSE(SplitRemote("/tmp/a:b", &env, &path));
  EXPECT_FALSE(SplitRemote(":x", &env, &path));
}

// ---------------------------------------------------------------------------------------------
// URLs

TEST(UrlTest, ParsesHostPortAndPrefix) {
  auto ep = ParseUrl("http://127.0.0.1:8080");
  ASSERT_TRUE(ep.ok());
  EXPECT_EQ(ep->host, "127.0.0.1");
  EXPECT_EQ(ep->port, "8080");
  EXPECT_EQ(ep->base_path, "");
  EXPECT_EQ(ep->url, "http://127.0.0.1:8080");

  ep = ParseUrl("http://esb.example:9000/api/");
  ASSERT_TRUE(ep.ok());
  EXPECT_EQ(ep->base_path, "/api");
  EXPECT_EQ(ep->url, "http://esb.example:9000/api");

  ep = ParseUrl("localhost");
  ASSERT_TRUE(ep.ok());
  EXPECT_EQ(ep->port, "80");

  ep = ParseUrl("http://[::1]:8080");
  ASSERT_TRUE(ep.ok());
  EXPECT_EQ(ep->host, "::1");
  EXPECT_EQ(ep->host_header, "[::1]:8080");

  EXPECT_FALSE(ParseUrl("https://x:1").ok());
  EXPECT_FALSE(ParseUrl("ftp://x").ok());
  EXPECT_FALSE(ParseUrl("http://x:0").ok());
  EXPECT_FALSE(ParseUrl("http://x:99999").ok());
  EXPECT_FALSE(ParseUrl("http://x:abc").ok());
  EXPECT_FALSE(ParseUrl("http://").ok());
  EXPECT_FALSE(ParseUrl("http://u:p@x").ok());
  EXPECT_FALSE(ParseUrl("http://x/?a=b").ok());
}

TEST(UrlTest, PercentEncode) {
  EXPECT_EQ(PercentEncode("src/a b.py", true), "src/a%20b.py");
  EXPECT_EQ(PercentEncode("../x&y=z", false), "..%2Fx%26y%3Dz");
}

// ---------------------------------------------------------------------------------------------
// Formatting

TEST(FormatTest, RenderTableAlignsColumns) {
  EXPECT_EQ(RenderTable({"ID", "STATE"}, {{"env_1", "running"}, {"e", "x"}}),
            "ID     STATE\n"
            "env_1  running\n"
            "e      x\n");
  EXPECT_EQ(RenderTable({"A", "B"}, {}), "A  B\n");
  EXPECT_EQ(RenderTable({"A", "B"}, {{"é", "1"}}), "A  B\né  1\n");  // counts characters
}

TEST(FormatTest, SanitizeCellDefusesTerminalEscapes) {
  EXPECT_EQ(SanitizeCell("echo hi"), "echo hi");
  EXPECT_EQ(SanitizeCell("a\nb\tc"), "a\\nb c");
  EXPECT_EQ(SanitizeCell("\x1b]0;pwned\x07"), "?]0;pwned?");
  EXPECT_EQ(SanitizeCell("\xc2\x9b"
                         "31m"),
            "?31m");  // C1 CSI
  EXPECT_EQ(SanitizeCell("\xff\xfe"), "??");
  EXPECT_EQ(SanitizeCell("héllo"), "héllo");
  EXPECT_EQ(SanitizeCell("abcdefghij", 6), "abc...");
  EXPECT_EQ(SanitizeCell("ééééééé", 5), "éé...");
  EXPECT_EQ(SanitizeCell("abcdef", 6), "abcdef");
}

TEST(FormatTest, TimesAndSizes) {
  const int64_t now = 1'000'000'000'000;
  EXPECT_EQ(FormatRelative(0, now), "-");
  EXPECT_EQ(FormatRelative(now - 5'000, now), "5s ago");
  EXPECT_EQ(FormatRelative(now + 13 * 60'000, now), "in 13m");
  EXPECT_EQ(FormatRelative(now - 2 * 3'600'000, now), "2h ago");
  EXPECT_EQ(FormatRelative(now - 3 * 86'400'000LL, now), "3d ago");
  EXPECT_EQ(FormatRelative(now + 200, now), "now");
  EXPECT_EQ(FormatDurationMs(850), "850ms");
  EXPECT_EQ(FormatDurationMs(3200), "3.2s");
  EXPECT_EQ(FormatDurationMs(125'000), "2m05s");
  EXPECT_EQ(FormatDurationMs(3'720'000), "1h02m");
  EXPECT_EQ(FormatMiB(512), "512 MiB");
  EXPECT_EQ(FormatMiB(1536), "1.5 GiB");
  EXPECT_EQ(FormatNumber(1.0), "1");
  EXPECT_EQ(FormatNumber(0.25), "0.25");
}

TEST(FormatTest, Base64) {
  std::string out;
  ASSERT_TRUE(Base64Decode("aGVsbG8=", &out));
  EXPECT_EQ(out, "hello");
  ASSERT_TRUE(Base64Decode("/w==", &out));
  EXPECT_EQ(out, "\xff");
  ASSERT_TRUE(Base64Decode("", &out));
  EXPECT_EQ(out, "");
  EXPECT_FALSE(Base64Decode("a$b=", &out));
  EXPECT_FALSE(Base64Decode("aGVs=bG8", &out));
}

// ---------------------------------------------------------------------------------------------
// SSE

TEST(SseTest, ParsesEventsAcrossArbitrarySplits) {
  const std::string stream =
      ": keep-alive\r\n"
      "event: stdout\r\n"
      "data: {\"data\": \"a\"}\r\n"
      "\r\n"
      "event: stderr\n"
      "data:line1\n"
      "data: line2\n"
      "id: 7\n"
      "\n"
      "data: plain\r\r";
  for (size_t step : {1u, 2u, 3u, 7u, 1000u}) {
    std::vector<SseEvent> events;
    SseParser parser([&](const SseEvent& e) {
      events.push_back(e);
      return absl::OkStatus();
    });
    for (size_t i = 0; i < stream.size(); i += step) {
      ASSERT_TRUE(parser.Feed(std::string_view(stream).substr(i, step)).ok());
    }
    ASSERT_EQ(events.size(), 3u) << "step " << step;
    EXPECT_EQ(events[0].event, "stdout");
    EXPECT_EQ(events[0].data, "{\"data\": \"a\"}");
    EXPECT_EQ(events[1].event, "stderr");
    EXPECT_EQ(events[1].data, "line1\nline2");
    EXPECT_EQ(events[2].event, "message");
    EXPECT_EQ(events[2].data, "plain");
  }
}

TEST(SseTest, HandlerErrorStopsParsing) {
  int calls = 0;
  SseParser parser([&](const SseEvent&) {
    ++calls;
    return absl::CancelledError("stop");
  });
  EXPECT_EQ(parser.Feed("data: 1\n\ndata: 2\n\n").code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(calls, 1);
}

// ---------------------------------------------------------------------------------------------
// Commands against a fake transport

struct Canned {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
};

struct FakeDaemon {
  std::vector<HttpRequest> requests;
  std::vector<std::string> uploaded;  // body_file contents, read at send time
  std::deque<Canned> answers;
  absl::Status fail = absl::OkStatus();
};

class FakeTransport final : public HttpTransport {
 public:
  explicit FakeTransport(FakeDaemon* d) : d_(d) {}
  absl::StatusOr<HttpResponse> Send(const HttpRequest& req, BodySink* sink) override {
    d_->requests.push_back(req);
    if (!req.body_file.empty()) {
      std::string data;
      EXPECT_TRUE(ReadFileToString(req.body_file, &data).ok());
      d_->uploaded.push_back(data);
    }
    if (!d_->fail.ok()) return d_->fail;
    if (d_->answers.empty()) return absl::InternalError("fake daemon: no answer queued");
    Canned c = d_->answers.front();
    d_->answers.pop_front();
    HttpResponse r;
    r.status = c.status;
    r.content_type = c.content_type;
    if (sink != nullptr && sink->OnHeaders(c.status, c.content_type)) {
      r.streamed = true;
      for (size_t i = 0; i < c.body.size(); i += 5) {  // small chunks, as a network would
        if (absl::Status s = sink->OnData(std::string_view(c.body).substr(i, 5)); !s.ok()) {
          return s;
        }
      }
    } else {
      r.body = c.body;
    }
    return r;
  }

 private:
  FakeDaemon* d_;
};

class CliTest : public ::testing::Test {
 protected:
  int Run(const Args& args, const std::string& stdin_text = "") {
    in_.str(stdin_text);
    out_.str("");
    err_.str("");
    CliContext ctx;
    ctx.in = &in_;
    ctx.out = &out_;
    ctx.err = &err_;
    ctx.env = {{"ESB_API_KEY", "esb_secret"}};
    ctx.now_ms = Now();
    ctx.transport = [this](const Endpoint& ep) {
      endpoint_ = ep;
      return std::make_unique<FakeTransport>(&daemon_);
    };
    return RunCli(args, ctx);
  }
  void Answer(int status, std::string body, std::string content_type = "application/json") {
    daemon_.answers.push_back({status, std::move(content_type), std::move(body)});
  }
  static std::string Header(const HttpRequest& r, const std::string& name) {
    for (const auto& [k, v] : r.headers) {
      if (k == name) return v;
    }
    return "";
  }
  const HttpRequest& Last() { return daemon_.requests.back(); }

  // The fake clock: 2026-11-18T22:43:20Z.
  static int64_t Now() {
    int64_t ms = 0;
    EXPECT_TRUE(ParseTime("2026-11-18T22:43:20Z", &ms));
    return ms;
  }
  std::istringstream in_;
  std::ostringstream out_;
  std::ostringstream err_;
  FakeDaemon daemon_;
  Endpoint endpoint_;
};

TEST_F(CliTest, CreateSendsSpecAndPrintsId) {
  Answer(201, R"({"environment_id":"env_abc","state":"running"})");
  ASSERT_EQ(Run({"create", "--memory-mb", "1024", "--cpu", "0.5", "--ttl", "600", "--env", "A=1",
                 "--image", "py"}),
            0)
      << err_.str();
  EXPECT_EQ(out_.str(), "env_abc\n");
  const HttpRequest& r = Last();
  EXPECT_EQ(r.method, "POST");
  EXPECT_EQ(r.target, "/environments");
  EXPECT_EQ(Header(r, "Authorization"), "Bearer esb_secret");
  EXPECT_EQ(Header(r, "Content-Type"), "application/json");
  auto body = boost::json::parse(r.body).as_object();
  EXPECT_EQ(body.at("memory_mb").as_int64(), 1024);
  EXPECT_DOUBLE_EQ(body.at("cpu").as_double(), 0.5);
  EXPECT_EQ(body.at("ttl_seconds").as_int64(), 600);
  EXPECT_EQ(body.at("image").as_string(), "py");
  EXPECT_EQ(body.at("env").at("A").as_string(), "1");
  EXPECT_FALSE(body.contains("runtime"));  // unset options are left to the daemon
  EXPECT_EQ(endpoint_.url, "http://127.0.0.1:8080");
}

TEST_F(CliTest, JsonFlagPrintsRawAnswer) {
  Answer(201, R"({"environment_id":"env_abc"})");
  ASSERT_EQ(Run({"create", "--json"}), 0);
  EXPECT_EQ(out_.str(), "{\"environment_id\":\"env_abc\"}\n");
  EXPECT_EQ(Last().body, "{}");
}

TEST_F(CliTest, ApiErrorPrintsServerMessage) {
  Answer(400, R"({"error":true,"code":"bad_request","message":"memory_mb must be 32-16384"})");
  EXPECT_EQ(Run({"create", "--memory-mb", "1"}), kExitError);
  EXPECT_EQ(err_.str(), "esb: memory_mb must be 32-16384 (HTTP 400 bad_request)\n");
  EXPECT_EQ(out_.str(), "");

  Answer(401, R"({"error":true,"code":"unauthorized","message":"missing API key"})");
  EXPECT_EQ(Run({"ls"}), kExitError);
  EXPECT_NE(err_.str().find("ESB_API_KEY"), std::string::npos) << err_.str();

  Answer(502, "<html>bad gateway</html>", "text/html");
  EXPECT_EQ(Run({"ls"}), kExitError);
  EXPECT_EQ(err_.str(), "esb: esbd answered HTTP 502: <html>bad gateway</html>\n");
}

TEST_F(CliTest, ConnectionFailureExitsTwo) {
  daemon_.fail = absl::UnavailableError(
      "cannot connect to esbd at http://127.0.0.1:8080: connection refused (is esbd running? "
      "start it with `make run`)");
  EXPECT_EQ(Run({"ls"}), 2);
  EXPECT_EQ(err_.str(),
            "esb: cannot connect to esbd at http://127.0.0.1:8080: connection refused (is esbd "
            "running? start it with `make run`)\n");
}

TEST_F(CliTest, UsageErrorsExitTwoAndHelpWorks) {
  EXPECT_EQ(Run({"bogus"}), kExitUsage);
  EXPECT_NE(err_.str().find("unknown command"), std::string::npos);
  EXPECT_TRUE(daemon_.requests.empty());

  EXPECT_EQ(Run({"--help"}), 0);
  EXPECT_NE(out_.str().find("Commands:"), std::string::npos);
  for (const char* cmd :
       {"create", "ls", "exec", "cp", "cat", "rm", "logs", "audit", "report", "health"}) {
    EXPECT_EQ(Run({cmd, "--help"}), 0) << cmd;
    EXPECT_EQ(out_.str().rfind("Usage: esb " + std::string(cmd), 0), 0u) << out_.str();
    EXPECT_EQ(Run({"help", cmd}), 0) << cmd;
    EXPECT_FALSE(out_.str().empty());
  }
  EXPECT_EQ(Run({"help", "nope"}), kExitUsage);
  EXPECT_EQ(Run({"--version"}), 0);
  EXPECT_EQ(out_.str(), std::string("esb ") + ESB_VERSION + "\n");
  EXPECT_EQ(Run({"--url", "https://x", "ls"}), kExitUsage);
  EXPECT_TRUE(daemon_.requests.empty());
}

TEST_F(CliTest, ListPrintsTable) {
  Answer(200, R"({"environments":[
    {"environment_id":"env_1","state":"running","runtime":"container","image":"default",
     "limits":{"cpu":1.0,"memory_mb":512},"created_at":"2026-11-18T22:38:20.000Z",
     "expires_at":"2026-11-18T22:58:20.000Z"},
    {"environment_id":"env_2\u001b[31m","state":"destroyed","runtime":"nano","image":"python",
     "limits":{"cpu":0.5,"memory_mb":2048},"created_at":"2026-11-18T20:33:20.000Z",
     "expires_at":"2026-11-18T20:43:20.000Z"}]})");
  ASSERT_EQ(Run({"ls", "--all"}), 0) << err_.str();
  EXPECT_EQ(Last().target, "/environments?all=1");
  EXPECT_EQ(out_.str(),
            "ID          STATE      RUNTIME    IMAGE    CPU  MEMORY   CREATED  EXPIRES\n"
            "env_1       running    container  default  1    512 MiB  5m ago   in 15m\n"
            "env_2?[31m  destroyed  nano       python   0.5  2 GiB    2h ago   -\n");

  Answer(200, R"({"environments":[]})");
  ASSERT_EQ(Run({"ls"}), 0);
  EXPECT_EQ(Last().target, "/environments");
  EXPECT_EQ(out_.str(), "ID  STATE  RUNTIME  IMAGE  CPU  MEMORY  CREATED  EXPIRES\n");

  Answer(200, "not json");
  EXPECT_EQ(Run({"ls"}), kExitError);
}

std::string Sse(const std::string& event, const std::string& data) {
  return "event: " + event + "\ndata: " + data + "\n\n";
}

TEST_F(CliTest, ExecStreamsOutputAndExitsWithCommandCode) {
  Answer(200,
         Sse("stdout", R"({"data":"hello "})") + Sse("stderr", R"({"data":"warn\n"})") +
             Sse("stdout", R"({"data_b64":"d29ybGQK"})") +
             Sse("result", R"({"error":true,"stdout":"hello world\n","stderr":"warn\n",)"
                           R"("exit_code":3,"timed_out":false,"truncated":false})"),
         "text/event-stream");
  EXPECT_EQ(Run({"exec", "--timeout", "30", "env_1", "--", "python3", "-c", "print('hi')"}), 3);
  EXPECT_EQ(out_.str(), "hello world\n");
  EXPECT_EQ(err_.str(), "warn\n");
  const HttpRequest& r = Last();
  EXPECT_EQ(r.method, "POST");
  EXPECT_EQ(r.target, "/environments/env_1/execute");
  EXPECT_EQ(Header(r, "Accept"), "text/event-stream");
  auto body = boost::json::parse(r.body).as_object();
  EXPECT_EQ(body.at("command").as_string(), "python3 -c 'print('\\''hi'\\'')'");
  EXPECT_EQ(body.at("timeout_seconds").as_int64(), 30);
}

TEST_F(CliTest, ExecTimeoutAndStreamErrors) {
  Answer(200, Sse("result", R"({"exit_code":124,"timed_out":true})"), "text/event-stream");
  EXPECT_EQ(Run({"exec", "env_1", "sleep 100"}), 124);
  EXPECT_NE(err_.str().find("timed out"), std::string::npos);

  Answer(200,
         Sse("stdout", R"({"data":"x"})") +
             Sse("error", R"({"error":true,"code":"internal","message":"agent died"})"),
         "text/event-stream");
  EXPECT_EQ(Run({"exec", "env_1", "true"}), kExitError);
  EXPECT_EQ(out_.str(), "x");
  EXPECT_EQ(err_.str(), "esb: agent died\n");

  Answer(200, Sse("stdout", R"({"data":"partial"})"), "text/event-stream");
  EXPECT_EQ(Run({"exec", "env_1", "true"}), kExitError);
  EXPECT_NE(err_.str().find("ended before the command finished"), std::string::npos);

  Answer(404, R"({"error":true,"code":"not_found","message":"environment env_9 not found"})");
  EXPECT_EQ(Run({"exec", "env_9", "true"}), kExitError);
  EXPECT_EQ(err_.str(), "esb: environment env_9 not found (HTTP 404 not_found)\n");

  // A daemon that ignores Accept and answers plain JSON still works.
  Answer(200, R"({"error":false,"stdout":"ok\n","stderr":"","exit_code":0})");
  EXPECT_EQ(Run({"exec", "env_1", "echo ok"}), 0);
  EXPECT_EQ(out_.str(), "ok\n");
}

TEST_F(CliTest, ExecJsonPrintsResult) {
  Answer(200, R"({"error":true,"stdout":"","stderr":"","exit_code":2})");
  EXPECT_EQ(Run({"--json", "exec", "env_1", "--", "false"}), 2);
  EXPECT_EQ(Header(Last(), "Accept"), "application/json");
  EXPECT_EQ(out_.str(), R"({"error":true,"stdout":"","stderr":"","exit_code":2})"
                        "\n");
}

TEST_F(CliTest, RemoveContinuesAfterAFailure) {
  Answer(200, R"({"error":false,"message":"Environment destroyed."})");
  Answer(404, R"({"error":true,"code":"not_found","message":"environment env_x not found"})");
  Answer(200, R"({"error":false,"message":"Environment destroyed."})");
  EXPECT_EQ(Run({"rm", "env_1", "env_x", "env/3"}), kExitError);
  ASSERT_EQ(daemon_.requests.size(), 3u);
  EXPECT_EQ(daemon_.requests[0].method, "DELETE");
  EXPECT_EQ(daemon_.requests[0].target, "/environments/env_1");
  EXPECT_EQ(daemon_.requests[2].target, "/environments/env%2F3");  // ids never break paths
  EXPECT_EQ(out_.str(), "env_1 destroyed\nenv/3 destroyed\n");
  EXPECT_EQ(err_.str(), "esb: env_x: environment env_x not found (HTTP 404 not_found)\n");
}

class TempDir {
 public:
  TempDir() {
    std::string t = (std::filesystem::temp_directory_path() / "esb_cli_XXXXXX").string();
    EXPECT_NE(mkdtemp(t.data()), nullptr);
    path_ = t;
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string File(const std::string& n) const { return path_ + "/" + n; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST_F(CliTest, CopyUploadStreamsTheFile) {
  TempDir dir;
  const std::string local = dir.File("data file.bin");
  ASSERT_TRUE(WriteStringToFile(local, std::string("\0\x01binary", 8)).ok());
  Answer(200, R"({"error":false,"message":"File saved successfully.","bytes":8})");
  ASSERT_EQ(Run({"cp", local, "env_1:in/x y.bin"}), 0) << err_.str();
  const HttpRequest& r = Last();
  EXPECT_EQ(r.method, "PUT");
  EXPECT_EQ(r.target, "/environments/env_1/files/raw?path=in/x%20y.bin");
  EXPECT_EQ(r.body_file, local);
  EXPECT_EQ(Header(r, "Content-Type"), "application/octet-stream");
  EXPECT_EQ(daemon_.uploaded.back(), std::string("\0\x01binary", 8));
  EXPECT_EQ(err_.str(), "copied 8 bytes to env_1:in/x y.bin\n");

  // "ENV:" and "ENV:dir/" keep the local name.
  Answer(200, R"({"bytes":8})");
  ASSERT_EQ(Run({"cp", local, "env_1:"}), 0);
  EXPECT_EQ(Last().target, "/environments/env_1/files/raw?path=data%20file.bin");
  Answer(200, R"({"bytes":8})");
  ASSERT_EQ(Run({"cp", local, "env_1:d/"}), 0);
  EXPECT_EQ(Last().target, "/environments/env_1/files/raw?path=d/data%20file.bin");

  // stdin
  Answer(200, R"({"bytes":3})");
  ASSERT_EQ(Run({"cp", "-", "env_1:s.txt"}, "abc"), 0);
  EXPECT_EQ(Last().body, "abc");

  const size_t before = daemon_.requests.size();
  EXPECT_EQ(Run({"cp", dir.File("missing"), "env_1:x"}), kExitError);
  EXPECT_NE(err_.str().find("missing"), std::string::npos);
  EXPECT_EQ(Run({"cp", dir.path(), "env_1:x"}), kExitUsage);
  EXPECT_EQ(Run({"cp", "a", "b"}), kExitUsage);
  EXPECT_EQ(Run({"cp", "e1:a", "e2:b"}), kExitUsage);
  EXPECT_EQ(daemon_.requests.size(), before);
}

TEST_F(CliTest, CopyDownloadWritesAtomically) {
  TempDir dir;
  Answer(200, "payload\xff", "application/octet-stream");
  ASSERT_EQ(Run({"cp", "env_1:out/r.bin", dir.File("r.bin")}), 0) << err_.str();
  EXPECT_EQ(Last().method, "GET");
  EXPECT_EQ(Last().target, "/environments/env_1/files/raw?path=out/r.bin");
  std::string got;
  ASSERT_TRUE(ReadFileToString(dir.File("r.bin"), &got).ok());
  EXPECT_EQ(got, "payload\xff");

  // Into a directory: keeps the remote name.
  Answer(200, "xyz", "application/octet-stream");
  ASSERT_EQ(Run({"cp", "env_1:a/b/c.txt", dir.path()}), 0) << err_.str();
  ASSERT_TRUE(ReadFileToString(dir.File("c.txt"), &got).ok());
  EXPECT_EQ(got, "xyz");

  // A 404 leaves no file behind (not even a partial one).
  Answer(404, R"({"error":true,"code":"not_found","message":"no such file: nope"})");
  EXPECT_EQ(Run({"cp", "env_1:nope", dir.File("nope")}), kExitError);
  EXPECT_EQ(err_.str(), "esb: no such file: nope (HTTP 404 not_found)\n");
  EXPECT_FALSE(std::filesystem::exists(dir.File("nope")));
  EXPECT_FALSE(std::filesystem::exists(dir.File("nope.esb-partial")));

  // To stdout.
  Answer(200, "to stdout", "application/octet-stream");
  ASSERT_EQ(Run({"cp", "env_1:f", "-"}), 0);
  EXPECT_EQ(out_.str(), "to stdout");
}

TEST_F(CliTest, CatPrintsRawBytes) {
  Answer(200, std::string("line1\nline2\0end", 15), "application/octet-stream");
  ASSERT_EQ(Run({"cat", "env_1", "src/main.py"}), 0);
  EXPECT_EQ(Last().target, "/environments/env_1/files/raw?path=src/main.py");
  EXPECT_EQ(out_.str(), std::string("line1\nline2\0end", 15));
}

constexpr char kAuditBody[] = R"({"entries":[
  {"id":2,"time":"2026-11-22T04:31:00.000Z","tenant":"t","environment_id":"env_1",
   "action":"execute","detail":"pip install numpy\n","exit_code":0,"duration_ms":3200,
   "bytes":10,"status":200},
  {"id":1,"time":"2026-11-22T04:30:00.000Z","tenant":"t","environment_id":"env_1",
   "action":"environment.create","detail":"","exit_code":null,"duration_ms":25,
   "bytes":0,"status":201}]})";

TEST_F(CliTest, LogsShowsOneEnvironmentOldestFirst) {
  Answer(200, kAuditBody);
  ASSERT_EQ(Run({"logs", "env_1"}), 0) << err_.str();
  EXPECT_EQ(Last().target, "/audit?environment_id=env_1&limit=100");
  EXPECT_EQ(out_.str(),
            "TIME                      ACTION              STATUS  EXIT  DURATION  DETAIL\n"
            "2026-11-22T04:30:00.000Z  environment.create  201     -     25ms\n"
            "2026-11-22T04:31:00.000Z  execute             200     0     3.2s      pip install "
            "numpy\\n\n");
}

TEST_F(CliTest, AuditPassesFilters) {
  Answer(200, kAuditBody);
  ASSERT_EQ(Run({"audit", "--since", "15m", "--until", "2026-11-22T05:00:00+01:00", "--env",
                 "env_1", "--q", "pip install", "--limit", "5"}),
            0)
      << err_.str();
  EXPECT_EQ(Last().target,
            "/audit?since=" + PercentEncode(FormatRfc3339(Now() - 15 * 60'000), true) +
                "&until=2026-11-22T04%3A00%3A00.000Z&environment_id=env_1&q=pip%20install"
                "&limit=5");
  EXPECT_NE(out_.str().find("ENVIRONMENT"), std::string::npos);
  // Newest first, as the daemon sent them.
  EXPECT_LT(out_.str().find("04:31:00"), out_.str().find("04:30:00"));

  EXPECT_EQ(Run({"audit", "--since", "yesterday"}), kExitUsage);
  Answer(400, R"({"error":true,"code":"bad_request","message":"invalid audit search query"})");
  EXPECT_EQ(Run({"audit", "--q", "\"unbalanced"}), kExitError);
  EXPECT_NE(err_.str().find("invalid audit search query"), std::string::npos);
}

TEST_F(CliTest, HealthSummarises) {
  Answer(200, R"({"status":"ok","version":"0.1.0","drivers":{"container":"crun","nano":"wasm"}})");
  ASSERT_EQ(Run({"--url", "http://localhost:9999", "health"}), 0) << err_.str();
  EXPECT_EQ(Last().target, "/healthz");
  EXPECT_EQ(out_.str(),
            "esbd 0.1.0 at http://localhost:9999: ok\n"
            "drivers:\n"
            "  container  crun\n"
            "  nano       wasm\n");
}

// ---------------------------------------------------------------------------------------------
// The real Beast transport against a tiny in-process HTTP server

// Serves one connection: reads a request (headers + Content-Length body), answers `reply`
// (raw HTTP bytes, written in pieces with small pauses so the client sees a real stream).
class OneShotServer {
 public:
  explicit OneShotServer(std::vector<std::string> reply_pieces)
      : acceptor_(ioc_, {boost::asio::ip::make_address("127.0.0.1"), 0}) {
    port_ = acceptor_.local_endpoint().port();
    thread_ = std::thread([this, pieces = std::move(reply_pieces)] {
      boost::asio::ip::tcp::socket s(ioc_);
      boost::system::error_code ec;
      acceptor_.accept(s, ec);
      if (ec) return;
      boost::asio::streambuf buf;
      boost::asio::read_until(s, buf, "\r\n\r\n", ec);
      std::string data(boost::asio::buffers_begin(buf.data()),
                       boost::asio::buffers_end(buf.data()));
      const size_t hdr_end = data.find("\r\n\r\n") + 4;
      size_t length = 0;
      if (size_t p = data.find("Content-Length: "); p != std::string::npos && p < hdr_end) {
        length = std::stoul(data.substr(p + 16));
      }
      while (data.size() < hdr_end + length && !ec) {
        char tmp[4096];
        size_t n = s.read_some(boost::asio::buffer(tmp), ec);
        data.append(tmp, n);
      }
      request_ = data;
      for (const std::string& piece : pieces) {
        boost::asio::write(s, boost::asio::buffer(piece), ec);
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      s.shutdown(boost::asio::ip::tcp::socket::shutdown_both, ec);
    });
  }
  ~OneShotServer() {
    if (thread_.joinable()) thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  std::string request() {
    if (thread_.joinable()) thread_.join();
    return request_;
  }

 private:
  boost::asio::io_context ioc_;
  boost::asio::ip::tcp::acceptor acceptor_;
  unsigned short port_ = 0;
  std::thread thread_;
  std::string request_;
};

int RunReal(const Args& args, std::string* out, std::string* err) {
  std::istringstream in;
  std::ostringstream o, e;
  CliContext ctx;
  ctx.in = &in;
  ctx.out = &o;
  ctx.err = &e;
  ctx.transport = MakeBeastTransport;
  int rc = RunCli(args, ctx);
  *out = o.str();
  *err = e.str();
  return rc;
}

std::string Chunk(const std::string& s) {
  std::ostringstream o;
  o << std::hex << s.size() << "\r\n" << s << "\r\n";
  return o.str();
}

TEST(BeastTransportTest, ConnectionRefusedSaysHowToStartEsbd) {
  // Find a port nobody listens on: bind, note it, close.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string url = "http://127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  close(fd);

  std::string out, err;
  EXPECT_EQ(RunReal({"--url", url, "ls"}, &out, &err), 2);
  EXPECT_EQ(err, "esb: cannot connect to esbd at " + url +
                     ": connection refused (is esbd running? start it with `make run`)\n");
}

TEST(BeastTransportTest, ExecOverRealChunkedSse) {
  OneShotServer server({
      "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n",
      Chunk("event: stdout\ndata: {\"data\": \"one\\n\"}\n\nevent: std"),
      Chunk("out\ndata: {\"data\": \"two\\n\"}\n\n"),
      Chunk("event: result\ndata: {\"exit_code\": 7}\n\n"),
      "0\r\n\r\n",
  });
  std::string out, err;
  EXPECT_EQ(RunReal({"--url", server.url(), "--api-key", "k", "exec", "env_1", "--", "echo", "x"},
                    &out, &err),
            7)
      << err;
  EXPECT_EQ(out, "one\ntwo\n");
  const std::string req = server.request();
  EXPECT_EQ(req.rfind("POST /environments/env_1/execute HTTP/1.1\r\n", 0), 0u) << req;
  EXPECT_NE(req.find("Authorization: Bearer k\r\n"), std::string::npos) << req;
  EXPECT_NE(req.find("Accept: text/event-stream\r\n"), std::string::npos) << req;
  EXPECT_NE(req.find("{\"command\":\"echo x\"}"), std::string::npos) << req;
}

// A stream whose writer stays open: proves that output reaches the caller's stream while the
// command still runs (not when the buffer fills or the answer ends).
class GateStream : public std::stringbuf {
 public:
  std::atomic<bool> saw_first{false};

 protected:
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    if (std::string_view(s, static_cast<size_t>(n)).find("first") != std::string_view::npos) {
      saw_first = true;
    }
    return std::stringbuf::xsputn(s, n);
  }
};

TEST(BeastTransportTest, ExecOutputIsLive) {
  boost::asio::io_context ioc;
  boost::asio::ip::tcp::acceptor acceptor(ioc, {boost::asio::ip::make_address("127.0.0.1"), 0});
  const std::string url = "http://127.0.0.1:" + std::to_string(acceptor.local_endpoint().port());
  GateStream gate;
  std::atomic<bool> live{false};
  std::thread server([&] {
    boost::asio::ip::tcp::socket s(ioc);
    boost::system::error_code ec;
    acceptor.accept(s, ec);
    boost::asio::streambuf buf;
    boost::asio::read_until(s, buf, "\r\n\r\n", ec);
    boost::asio::write(
        s,
        boost::asio::buffer(std::string("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                        "Transfer-Encoding: chunked\r\n\r\n") +
                            Chunk("event: stdout\ndata: {\"data\": \"first\\n\"}\n\n")),
        ec);
    // Hold the rest back until the client has shown the first line (or 5 s pass).
    for (int i = 0; i < 500 && !gate.saw_first; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    live = gate.saw_first.load();
    boost::asio::write(
        s, boost::asio::buffer(Chunk("event: result\ndata: {\"exit_code\": 0}\n\n") + "0\r\n\r\n"),
        ec);
  });
  std::istringstream in;
  std::ostream out(&gate);
  std::ostringstream err;
  CliContext ctx;
  ctx.in = &in;
  ctx.out = &out;
  ctx.err = &err;
  ctx.transport = MakeBeastTransport;
  EXPECT_EQ(RunCli({"--url", url, "exec", "env_1", "long-job"}, ctx), 0) << err.str();
  server.join();
  EXPECT_TRUE(live) << "the first output only arrived with the end of the stream";
  EXPECT_EQ(gate.str(), "first\n");
}

TEST(BeastTransportTest, UploadSendsFileBytes) {
  TempDir dir;
  const std::string local = dir.File("f.txt");
  std::string content(100000, 'z');
  ASSERT_TRUE(WriteStringToFile(local, content).ok());
  const std::string answer = R"({"error":false,"bytes":100000})";
  OneShotServer server({"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " +
                        std::to_string(answer.size()) + "\r\n\r\n" + answer});
  std::string out, err;
  EXPECT_EQ(RunReal({"--url", server.url() + "/prefix/", "cp", local, "env_1:f.txt"}, &out, &err),
            0)
      << err;
  const std::string req = server.request();
  EXPECT_EQ(req.rfind("PUT /prefix/environments/env_1/files/raw?path=f.txt HTTP/1.1\r\n", 0), 0u)
      << req.substr(0, 200);
  EXPECT_NE(req.find("Content-Length: 100000\r\n"), std::string::npos);
  EXPECT_EQ(req.substr(req.find("\r\n\r\n") + 4), content);
  EXPECT_EQ(err, "copied 100000 bytes to env_1:f.txt\n");
}

TEST(BeastTransportTest, ApiErrorOverTheWire) {
  const std::string answer =
      R"({"error":true,"code":"not_found","message":"environment env_1 not found"})";
  OneShotServer server(
      {"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\n"
       "Content-Length: " +
       std::to_string(answer.size()) + "\r\n\r\n" + answer});
  std::string out, err;
  EXPECT_EQ(RunReal({"--url", server.url(), "cat", "env_1", "x"}, &out, &err), 1);
  EXPECT_EQ(out, "");
  EXPECT_EQ(err, "esb: environment env_1 not found (HTTP 404 not_found)\n");
}

TEST(BeastTransportTest, DaemonClosingMidStreamIsReported) {
  OneShotServer server({
      "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n",
      Chunk("event: stdout\ndata: {\"data\": \"partial\"}\n\n"),
  });
  std::string out, err;
  EXPECT_EQ(RunReal({"--url", server.url(), "exec", "env_1", "sleep 9"}, &out, &err), 2);
  EXPECT_EQ(out, "partial");
  EXPECT_NE(err.find("connection to esbd at " + server.url() + " failed"), std::string::npos)
      << err;
}

constexpr char kReportBody[] = R"({"tenant":"acme","period":"daily",
  "from":"2026-11-18T00:00:00.000Z","to":"2026-11-19T00:00:00.000Z",
  "totals":{"requests":4,"allowed":1,"blocked":3,"redacted":0,"opaque":0,"errors":0,
            "bytes_up":1230,"bytes_down":9000},
  "environments":[{"environment_id":"env_a","requests":4,"allowed":1,"blocked":3,"redacted":0,
                   "opaque":0,"errors":0,"bytes_up":1230,"bytes_down":9000}],
  "blocks_by_rule":[{"rule":"not_allowed","count":2}],
  "top_hosts":[{"host":"evil\u001b[2J.test","requests":2,"blocked":2,"bytes_up":10,"bytes_down":0}],
  "dlp_findings":[],"days":[]})";

TEST_F(CliTest, ReportPrintsTablesWithHostileHostsDefused) {
  Answer(200, kReportBody);
  ASSERT_EQ(Run({"report", "--env", "env_a", "--date", "2026-11-18"}), 0) << err_.str();
  EXPECT_EQ(Last().target,
            "/reports?period=daily&format=json&environment_id=env_a&date=2026-11-18");
  const std::string out = out_.str();
  EXPECT_NE(out.find("Daily egress report, tenant acme"), std::string::npos) << out;
  EXPECT_NE(out.find("not_allowed"), std::string::npos);
  EXPECT_NE(out.find("9000"), std::string::npos);
  EXPECT_EQ(out.find('\x1b'), std::string::npos) << "no terminal escape from a host name";
  EXPECT_NE(out.find("DLP findings by type: none"), std::string::npos) << out;
}

TEST_F(CliTest, ReportFormatPrintsTheDocumentAsIs) {
  Answer(200, "section,name\r\ntotal,\r\n", "text/csv");
  ASSERT_EQ(Run({"report", "--period", "weekly", "--format", "csv"}), 0) << err_.str();
  EXPECT_EQ(Last().target, "/reports?period=weekly&format=csv");
  EXPECT_EQ(out_.str(), "section,name\r\ntotal,\r\n");
  EXPECT_EQ(Run({"report", "--period", "monthly"}), kExitUsage);
  EXPECT_EQ(Run({"report", "--format", "pdf"}), kExitUsage);
}

TEST_F(CliTest, AuditPassesEgressFilters) {
  Answer(200, kAuditBody);
  ASSERT_EQ(Run({"audit", "--kind", "egress", "--decision", "blocked"}), 0) << err_.str();
  EXPECT_EQ(Last().target, "/audit?kind=egress&decision=blocked");
}

// ---------------------------------------------------------------------------------------------
// Time travel: steps, step, rewind, fork

namespace time_travel {

constexpr char kStepsBody[] = R"({"steps": [
  {"step": 3, "parent": 1, "kind": "execute", "summary": "python train.py\u001b[2J",
   "status": "error", "exit_code": 1, "error": null, "duration_ms": 1200, "capture_ms": 4,
   "tier": "container", "memory": "none", "memory_detail": null, "files_changed": 2,
   "created_at": 1795473790000, "on_head": true},
  {"step": 2, "parent": 1, "kind": "files.write", "summary": "a.txt", "status": "ok",
   "exit_code": null, "memory": "snapshot", "memory_detail": "collected", "files_changed": 1,
   "created_at": 1795473780000, "on_head": false}],
  "head": 3, "next_before": 2})";

}  // namespace time_travel

TEST_F(CliTest, StepsPrintsTheLogWithTheHeadMarkedAndTheNextPage) {
  Answer(200, time_travel::kStepsBody);
  ASSERT_EQ(Run({"steps", "--limit", "2", "env_a"}), 0) << err_.str();
  EXPECT_EQ(Last().method, "GET");
  EXPECT_EQ(Last().target, "/environments/env_a/steps?limit=2");
  const std::string out = out_.str();
  EXPECT_NE(out.find("STEP"), std::string::npos) << out;
  EXPECT_NE(out.find("*3"), std::string::npos) << out;  // the head
  EXPECT_NE(out.find("~2"), std::string::npos) << out;  // off the head (a branch)
  EXPECT_NE(out.find("snapshot (collected)"), std::string::npos) << out;
  EXPECT_NE(out.find("esb steps --before 2 env_a"), std::string::npos) << out;
  EXPECT_EQ(out.find('\x1b'), std::string::npos) << "no terminal escape from a summary";
  Answer(200, time_travel::kStepsBody);
  ASSERT_EQ(Run({"steps", "--json", "--before", "3", "env_a"}), 0);
  EXPECT_EQ(Last().target, "/environments/env_a/steps?before=3");
  EXPECT_EQ(out_.str().substr(0, 10), std::string(time_travel::kStepsBody).substr(0, 10));
  EXPECT_EQ(Run({"steps"}), kExitUsage);
}

TEST_F(CliTest, StepShowsOutputVariablesAndChanges) {
  Answer(200, R"j({"step": 3, "parent": 2, "kind": "run", "summary": "x = 1/0", "status": "error",
    "exit_code": null, "error": "ZeroDivisionError: division by zero", "duration_ms": 30,
    "tier": "container", "memory": "none", "memory_detail": null, "on_head": true,
    "output": {"stdout": "line1\nline2\u001b[31m\n", "stderr": "Traceback\n", "truncated": false},
    "variables": [{"name": "df", "type": "DataFrame", "repr": "shape (3, 2)"}],
    "files": [{"path": "a.txt", "type": "file", "size": 1, "mode": 420, "sha256": "x"}],
    "changes": [{"path": "a.txt", "change": "modified"}], "shell": {"cwd": "/workspace/sub"}})j");
  ASSERT_EQ(Run({"step", "env_a", "3"}), 0) << err_.str();
  EXPECT_EQ(Last().target, "/environments/env_a/steps/3");
  const std::string out = out_.str();
  for (const char* want : {"kind:      run", "error:     ZeroDivisionError", "line2", "Traceback",
                           "DataFrame", "shape (3, 2)", "modified", "a.txt",
                           "shell cwd: /workspace/sub", "files at this step: 1"}) {
    EXPECT_NE(out.find(want), std::string::npos) << want << " in\n" << out;
  }
  EXPECT_EQ(out.find('\x1b'), std::string::npos);
  EXPECT_EQ(Run({"step", "env_a", "-1"}), kExitUsage);
  EXPECT_EQ(Run({"step", "env_a", "x"}), kExitUsage);
  // A window of a large tree: the totals are shown, not the window's size.
  out_.str("");
  Answer(200, R"j({"step": 4, "kind": "execute", "status": "ok", "files_total": 120000,
    "files": [{"path": "a.txt", "type": "file", "size": 1, "mode": 420, "sha256": "x"}],
    "files_next": "a.txt", "changes": [{"path": "a.txt", "change": "added"}],
    "changes_total": 5000, "changes_next": "a.txt"})j");
  ASSERT_EQ(Run({"step", "env_a", "4"}), 0) << err_.str();
  for (const char* want : {"files at this step: 120000", "(1 of 5000 changes shown)"})
    EXPECT_NE(out_.str().find(want), std::string::npos) << want << " in\n" << out_.str();
  Answer(404, R"({"error":true,"code":"not_found","message":"environment env_a has no step 9"})");
  EXPECT_EQ(Run({"step", "env_a", "9"}), kExitError);
  EXPECT_EQ(err_.str(), "esb: environment env_a has no step 9 (HTTP 404 not_found)\n");
}

TEST_F(CliTest, RewindAndForkSendTheStep) {
  Answer(200, R"({"head": 2, "memory": "none", "environment": {"environment_id": "env_a"}})");
  ASSERT_EQ(Run({"rewind", "env_a", "2"}), 0) << err_.str();
  EXPECT_EQ(Last().method, "POST");
  EXPECT_EQ(Last().target, "/environments/env_a/rewind");
  EXPECT_EQ(Last().body, R"({"step":2})");
  EXPECT_NE(out_.str().find("rewound env_a to step 2 (memory: none: files and shell state"),
            std::string::npos)
      << out_.str();
  Answer(201, R"({"environment_id": "env_b", "forked_from": {"environment_id": "env_a",
    "step": 2}, "memory": "none"})");
  ASSERT_EQ(Run({"fork", "env_a", "2"}), 0) << err_.str();
  EXPECT_EQ(Last().target, "/environments/env_a/fork");
  EXPECT_EQ(Last().body, R"({"step":2})");
  EXPECT_EQ(out_.str(), "env_b\n");
  Answer(409, R"({"error":true,"code":"conflict","message":"step capture is off"})");
  EXPECT_EQ(Run({"rewind", "env_a", "0"}), kExitError);
  EXPECT_EQ(err_.str(), "esb: step capture is off (HTTP 409 conflict)\n");
  EXPECT_EQ(Run({"fork", "env_a"}), kExitUsage);
  EXPECT_EQ(Run({"rewind", "env_a", "1.5"}), kExitUsage);
}

// `esb shell` against a real WebSocket server (esbd's HttpServer with a fake terminal route)
// on a real pseudo-terminal: the window size goes in the query, raw mode is on while the shell
// runs and restored after, SIGWINCH sends a resize, keystrokes and output flow both ways, and
// the exit frame's code is esb's exit code.
class ShellTest : public CliTest {
 protected:
  void SetUp() override {
    api::HttpServer::Options o;
    o.access_log = false;
    server_ = std::make_unique<api::HttpServer>(o);
    server_->router().Add("GET", "/environments/{id}/terminal", [this](api::Request& req) {
      if (req.HeaderOr("Authorization", "") != "Bearer esb_secret")
        return api::ErrorResponse(401, "unauthorized", "Missing API key");
      if (req.Param("id") != "env_a" && req.Param("id") != "env_fork")
        return api::ErrorResponse(404, "not_found",
                                  "environment " + req.Param("id") + " not found");
      query_ = req.target();
      return api::Response::WebSocket([this](api::WebSocket& ws) {
        ws.Send("ready\r\n", true);
        std::string typed;
        for (;;) {
          absl::StatusOr<api::WebSocket::Message> m = ws.Receive(std::chrono::seconds(10));
          if (!m.ok()) return;
          if (!m->binary) {
            controls_.push_back(m->data);
            ws.Send("resized\r\n", true);
            continue;
          }
          typed += m->data;
          got_input_ = true;
          ws.Send("echo:" + m->data, true);
          if (typed.find("exit 5") != std::string::npos) {
            ws.Send(R"({"type":"exit","code":5})", false);
            ws.Close(api::WebSocket::kNormal, "exited");
            return;
          }
        }
      });
    });
    ASSERT_TRUE(server_->Start().ok());
  }
  void TearDown() override { server_->Stop(); }
  std::string Url() const { return "http://127.0.0.1:" + std::to_string(server_->tcp_port()); }
  // `esb ARGS` against this server with keystrokes from `in_fd` and output to `out_fd` (its
  // stderr into *err_text); its exit code.
  int RunShell(int in_fd, int out_fd, const Args& args = {"shell", "env_a"},
               std::string* err_text = nullptr) {
    std::istringstream in;
    std::ostringstream out, err;
    CliContext ctx;
    ctx.in = &in;
    ctx.out = &out;
    ctx.err = &err;
    ctx.env = {{"ESB_API_KEY", "esb_secret"}, {"ESB_URL", Url()}};
    ctx.stdin_fd = in_fd;
    ctx.stdout_fd = out_fd;
    ctx.transport = [this](const Endpoint&) { return std::make_unique<FakeTransport>(&daemon_); };
    int rc = RunCli(args, ctx);
    if (err_text) *err_text = err.str();
    return rc;
  }
  // Reads the pty's `master` into *seen until it contains `needle` (10 s).
  static bool ReadUntil(int master, const std::string& needle, std::string* seen) {
    for (int i = 0; i < 100 && seen->find(needle) == std::string::npos; ++i) {
      pollfd p{master, POLLIN, 0};
      if (poll(&p, 1, 100) > 0) {
        char buf[4096];
        ssize_t n = read(master, buf, sizeof buf);
        if (n > 0) seen->append(buf, static_cast<size_t>(n));
      }
    }
    return seen->find(needle) != std::string::npos;
  }
  static void ExpectRaw(int slave) {
    termios during{};
    ASSERT_EQ(tcgetattr(slave, &during), 0);
    EXPECT_EQ(during.c_lflag & (ECHO | ICANON), 0u) << "raw mode while the shell runs";
  }
  static void ExpectModeRestored(int slave, const termios& before) {
    termios after{};
    ASSERT_EQ(tcgetattr(slave, &after), 0);
    EXPECT_EQ(after.c_lflag, before.c_lflag) << "the terminal's mode is restored";
    EXPECT_EQ(after.c_iflag, before.c_iflag);
    EXPECT_EQ(after.c_oflag, before.c_oflag);
  }

  std::unique_ptr<api::HttpServer> server_;
  std::string query_;
  std::vector<std::string> controls_;
  std::atomic<bool> got_input_{false};
};

TEST_F(ShellTest, RawTtyWindowSizeResizeAndExitCode) {
  int master = -1, slave = -1;
  winsize size{};
  size.ws_row = 33;
  size.ws_col = 111;
  ASSERT_EQ(openpty(&master, &slave, nullptr, nullptr, &size), 0);
  termios before{};
  ASSERT_EQ(tcgetattr(slave, &before), 0);
  std::atomic<int> rc{-1};
  std::thread cli([&] { rc = RunShell(slave, slave); });
  // Wait for the connection (the server has sent "ready"), type, resize, exit.
  std::string seen;
  auto read_until = [&](const std::string& needle) { return ReadUntil(master, needle, &seen); };
  ASSERT_TRUE(read_until("ready")) << seen;
  ExpectRaw(slave);
  ASSERT_EQ(write(master, "ls\r", 3), 3);
  ASSERT_TRUE(read_until("echo:ls")) << seen;
  size.ws_row = 40;
  size.ws_col = 120;
  ASSERT_EQ(ioctl(master, TIOCSWINSZ, &size), 0);
  kill(getpid(), SIGWINCH);
  ASSERT_TRUE(read_until("resized")) << seen;
  ASSERT_EQ(write(master, "exit 5\r", 7), 7);
  cli.join();
  EXPECT_EQ(rc.load(), 5);
  EXPECT_NE(query_.find("cols=111&rows=33"), std::string::npos) << query_;
  ASSERT_EQ(controls_.size(), 1u);
  EXPECT_EQ(controls_[0], R"({"type":"resize","rows":40,"cols":120})");
  ExpectModeRestored(slave, before);
  close(master);
  close(slave);
}

// Review (t-term): `esb shell` killed by SIGTERM or SIGHUP (a closed terminal window, a
// supervisor) left the user's terminal raw (no echo, no line editing). It restores the
// terminal's mode and then ends by the signal. A child process runs the CLI on a pty; the
// signal comes while the shell is connected (raw mode on).
TEST_F(ShellTest, SigtermOrSighupRestoresTheTerminalModeAndEndsByTheSignal) {
  for (int sig : {SIGTERM, SIGHUP}) {
    SCOPED_TRACE(strsignal(sig));
    int master = -1, slave = -1;
    ASSERT_EQ(openpty(&master, &slave, nullptr, nullptr, nullptr), 0);
    termios before{};
    ASSERT_EQ(tcgetattr(slave, &before), 0);
    ASSERT_NE(before.c_lflag & (ECHO | ICANON), 0u);
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) _exit(RunShell(slave, slave) == 0 ? 0 : 100);
    std::string seen;
    ASSERT_TRUE(ReadUntil(master, "ready", &seen)) << seen;
    ExpectRaw(slave);
    ASSERT_EQ(kill(pid, sig), 0);
    int status = 0;
    pid_t waited = -1;
    for (int i = 0; i < 100 && waited != pid; ++i) {
      waited = waitpid(pid, &status, WNOHANG);
      if (waited != pid) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (waited != pid) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      FAIL() << "esb shell did not end on the signal";
    }
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == sig) << "status " << status;
    ExpectModeRestored(slave, before);
    close(master);
    close(slave);
  }
}

TEST_F(ShellTest, PipedInputEndsWithEofAndARefusalShowsTheDaemonsMessage) {
  int out_pipe[2];
  ASSERT_EQ(pipe(out_pipe), 0);
  auto run = [&](const Args& args, std::string* err_text) {
    int in_pipe[2];  // keystrokes: "exit 5", then the end of the input
    EXPECT_EQ(pipe(in_pipe), 0);
    EXPECT_EQ(write(in_pipe[1], "exit 5\n", 7), 7);
    close(in_pipe[1]);
    int rc = RunShell(in_pipe[0], out_pipe[1], args, err_text);
    close(in_pipe[0]);
    return rc;
  };
  std::string err;
  EXPECT_EQ(run({"shell", "env_a"}, &err), 5) << err;
  EXPECT_NE(query_.find("cols=80&rows=24"), std::string::npos) << query_;  // not a terminal
  EXPECT_EQ(run({"shell", "env_gone"}, &err), kExitError);
  EXPECT_EQ(err, "esb: environment env_gone not found (HTTP 404)\n");
  // --step forks first (POST .../fork through the HTTP transport), then opens the fork's.
  Answer(201, R"({"environment_id": "env_fork", "memory": "none"})");
  EXPECT_EQ(run({"shell", "--step", "4", "env_a"}, &err), 5) << err;
  EXPECT_EQ(Last().target, "/environments/env_a/fork");
  EXPECT_EQ(Last().body, R"({"step":4})");
  EXPECT_NE(query_.find("/environments/env_fork/terminal"), std::string::npos) << query_;
  EXPECT_NE(err.find("forked env_a at step 4 into env_fork"), std::string::npos) << err;
  close(out_pipe[0]);
  close(out_pipe[1]);
}

}  // namespace
}  // namespace esb::cli

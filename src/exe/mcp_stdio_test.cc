// `esbd mcp-stdio` against a fake transport: what it sends for each message (session, modern
// headers, key), how it writes JSON and SSE answers back, cancellation, and bad input.
#include "exe/mcp_stdio.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <sstream>
#include <thread>

#include "boost/json.hpp"

namespace esb {
namespace {
namespace json = boost::json;

struct Seen {
  std::mutex mu;
  std::vector<cli::HttpRequest> requests;
  std::atomic<bool> slow_aborted{false};
};

class FakeTransport : public cli::HttpTransport {
 public:
  explicit FakeTransport(Seen* seen) : seen_(seen) {}
  absl::StatusOr<cli::HttpResponse> Send(const cli::HttpRequest& req,
                                         cli::BodySink* sink) override {
    {
      std::lock_guard<std::mutex> lock(seen_->mu);
      seen_->requests.push_back(req);
    }
    cli::HttpResponse r;
    if (req.method == "DELETE") {
      r.status = 204;
      return r;
    }
    json::object m = json::parse(req.body).as_object();
    std::string method(m.at("method").as_string());
    if (method == "initialize") {
      r.status = 200;
      r.headers = {{"Mcp-Session-Id", "sess-1"}};
      r.body = R"({"jsonrpc":"2.0","id":1,"result":{"protocolVersion":"2025-11-25"}})";
      return r;
    }
    if (method == "notifications/initialized" || method == "notifications/cancelled") {
      r.status = 202;
      return r;
    }
    if (method == "tools/list") return absl::UnavailableError("cannot connect to esbd");
    if (method == "tools/call" && m.at("params").at("name") == "slow") {
      for (int i = 0; i < 500 && !req.abort->fired(); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      if (req.abort->fired()) {
        seen_->slow_aborted = true;
        return absl::CancelledError("request cancelled");
      }
      r.status = 200;
      r.body = R"({"jsonrpc":"2.0","id":9,"result":{}})";
      return r;
    }
    if (method == "tools/call") {
      r.status = 200;
      r.content_type = "text/event-stream";
      EXPECT_TRUE(sink->OnHeaders(200, r.content_type));
      r.streamed = true;
      EXPECT_TRUE(sink->OnData("id: 0\ndata: \n\nevent: message\ndata: {\"jsonrpc\":\"2.0\","
                               "\"method\":\"notifications/progress\",\"params\":{}}\n\n")
                      .ok());
      EXPECT_TRUE(
          sink->OnData("event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":3,\"result\":{}}\n\n")
              .ok());
      return r;
    }
    r.status = 404;
    r.body = R"({"jsonrpc":"2.0","id":5,"error":{"code":-32601,"message":"nope"}})";
    return r;
  }

 private:
  Seen* seen_;
};

// stdin that delivers `data`, then stays open (blocks) until `until` is true or 5 s passed.
class HeldOpenInput : public std::streambuf {
 public:
  HeldOpenInput(std::string data, std::function<bool()> until)
      : data_(std::move(data)), until_(std::move(until)) {
    setg(data_.data(), data_.data(), data_.data() + data_.size());
  }
  bool released_by_condition = false;

 protected:
  int_type underflow() override {
    for (int i = 0; i < 500; ++i) {
      if (until_()) {
        released_by_condition = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return traits_type::eof();
  }

 private:
  std::string data_;
  std::function<bool()> until_;
};

std::string HeaderOf(const cli::HttpRequest& r, const std::string& name) {
  for (const auto& [k, v] : r.headers) {
    if (k == name) return v;
  }
  return "";
}

std::vector<json::object> Lines(const std::string& out) {
  std::vector<json::object> v;
  std::istringstream s(out);
  std::string line;
  while (std::getline(s, line)) v.push_back(json::parse(line).as_object());
  return v;
}

TEST(McpStdioTest, ForwardsWithSessionAndModernHeadersAndWritesAnswersBack) {
  Seen seen;
  cli::TransportFactory factory = [&seen](const cli::Endpoint&) {
    return std::make_unique<FakeTransport>(&seen);
  };
  McpStdioOptions o;
  o.endpoint = cli::UnixEndpoint("/nonexistent.sock");
  o.api_key = "k1";
  std::istringstream in(
      R"({"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25"}})"
      "\n"
      R"({"jsonrpc":"2.0","method":"notifications/initialized"})"
      "\n"
      R"({"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"x"}})"
      "\n"
      R"({"jsonrpc":"2.0","id":4,"method":"tools/list"})"
      "\n"
      R"({"jsonrpc":"2.0","id":5,"method":"other","params":{"name":"n","_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28"}}})"
      "\n"
      "not json\n");
  std::ostringstream out;
  EXPECT_EQ(RunMcpStdio(o, in, out, factory), 0);
  std::vector<json::object> lines = Lines(out.str());
  auto by_id = [&](int id) -> const json::object* {
    for (const auto& l : lines) {
      if (l.contains("id") && l.at("id").is_int64() && l.at("id").as_int64() == id) return &l;
    }
    return nullptr;
  };
  ASSERT_NE(by_id(1), nullptr);
  ASSERT_NE(by_id(3), nullptr);  // the SSE answer's response
  ASSERT_NE(by_id(4), nullptr);  // unreachable daemon: an error with the id
  EXPECT_EQ(by_id(4)->at("error").at("code"), -32603);
  ASSERT_NE(by_id(5), nullptr);  // a JSON-RPC error answer passes through
  EXPECT_EQ(by_id(5)->at("error").at("code"), -32601);
  int progress = 0, parse_errors = 0;
  for (const auto& l : lines) {
    if (l.contains("method") && l.at("method") == "notifications/progress") ++progress;
    if (l.contains("error") && l.at("error").at("code") == -32700) ++parse_errors;
  }
  EXPECT_EQ(progress, 1);
  EXPECT_EQ(parse_errors, 1);

  std::lock_guard<std::mutex> lock(seen.mu);
  ASSERT_GE(seen.requests.size(), 6u);
  for (const auto& r : seen.requests) EXPECT_EQ(HeaderOf(r, "Authorization"), "Bearer k1");
  EXPECT_EQ(HeaderOf(seen.requests[0], "Mcp-Session-Id"), "");
  EXPECT_EQ(HeaderOf(seen.requests[1], "Mcp-Session-Id"), "sess-1");
  EXPECT_EQ(HeaderOf(seen.requests[1], "MCP-Protocol-Version"), "2025-11-25");
  bool modern_seen = false, delete_seen = false;
  for (const auto& r : seen.requests) {
    if (r.method == "DELETE") {
      delete_seen = true;
      EXPECT_EQ(HeaderOf(r, "Mcp-Session-Id"), "sess-1");
    }
    if (r.body.find("\"other\"") != std::string::npos) {
      modern_seen = true;
      EXPECT_EQ(HeaderOf(r, "MCP-Protocol-Version"), "2026-07-28");
      EXPECT_EQ(HeaderOf(r, "Mcp-Method"), "other");
      EXPECT_EQ(HeaderOf(r, "Mcp-Name"), "n");
      EXPECT_EQ(HeaderOf(r, "Mcp-Session-Id"), "");
    }
  }
  EXPECT_TRUE(modern_seen);
  EXPECT_TRUE(delete_seen);  // stdin closed: the session is ended
}

TEST(McpStdioTest, CancellingAModernCallClosesItsStreamAndAnswersNothing) {
  Seen seen;
  cli::TransportFactory factory = [&seen](const cli::Endpoint&) {
    return std::make_unique<FakeTransport>(&seen);
  };
  McpStdioOptions o;
  o.endpoint = cli::UnixEndpoint("/nonexistent.sock");
  HeldOpenInput buf(
      R"({"jsonrpc":"2.0","id":9,"method":"tools/call","params":{"name":"slow","_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28"}}})"
      "\n"
      R"({"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":9,"_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28"}}})"
      "\n",
      [&seen] { return seen.slow_aborted.load(); });
  std::istream in(&buf);
  std::ostringstream out;
  EXPECT_EQ(RunMcpStdio(o, in, out, factory), 0);
  EXPECT_TRUE(seen.slow_aborted);
  EXPECT_TRUE(buf.released_by_condition);  // aborted by the cancel, before stdin closed
  EXPECT_EQ(out.str(), "");
  std::lock_guard<std::mutex> lock(seen.mu);
  EXPECT_EQ(seen.requests.size(), 1u);  // the modern cancel is the closed stream, not a POST
}

TEST(McpStdioTest, OverlongLineIsAParseErrorAndTheNextLineStillWorks) {
  Seen seen;
  cli::TransportFactory factory = [&seen](const cli::Endpoint&) {
    return std::make_unique<FakeTransport>(&seen);
  };
  McpStdioOptions o;
  o.max_line_bytes = 100;
  std::istringstream in(std::string(1000, 'x') + "\n" +
                        R"({"jsonrpc":"2.0","id":1,"method":"initialize","params":{}})" + "\n");
  std::ostringstream out;
  RunMcpStdio(o, in, out, factory);
  std::vector<json::object> lines = Lines(out.str());
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0].at("error").at("code"), -32700);
  EXPECT_EQ(lines[1].at("id"), 1);
}

// Attack: the MCP client (a model's tool call) puts CR LF in a value the bridge sends as an HTTP
// header (the tool name → Mcp-Name) to add its own headers or a second request to the daemon.
// Over the real transport, against a listener that records every byte: nothing with the
// injected header arrives, and the client gets a JSON-RPC error for that id.
TEST(McpStdioTest, CrLfInToolNameCannotInjectHttpHeaders) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  socklen_t len = sizeof addr;
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  ASSERT_EQ(listen(fd, 8), 0);
  std::mutex mu;
  std::string received;
  std::atomic<bool> done{false};
  std::thread listener([&] {
    while (!done) {
      timeval tv{0, 100'000};
      fd_set set;
      FD_ZERO(&set);
      FD_SET(fd, &set);
      if (select(fd + 1, &set, nullptr, nullptr, &tv) <= 0) continue;
      int c = accept(fd, nullptr, nullptr);
      if (c < 0) continue;
      timeval rt{0, 300'000};
      setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &rt, sizeof rt);
      char buf[4096];
      ssize_t n;
      while ((n = read(c, buf, sizeof buf)) > 0) {
        std::lock_guard<std::mutex> lock(mu);
        received.append(buf, static_cast<size_t>(n));
      }
      const char* answer =
          "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 36\r\n\r\n"
          "{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}";
      (void)!write(c, answer, strlen(answer));
      close(c);
    }
  });
  McpStdioOptions o;
  auto ep = cli::ParseUrl("http://127.0.0.1:" + std::to_string(ntohs(addr.sin_port)));
  ASSERT_TRUE(ep.ok()) << ep.status();
  o.endpoint = *ep;
  std::istringstream in(
      R"({"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"x\r\nX-Injected: 1\r\n\r\nDELETE /environments/e HTTP/1.1","arguments":{},"_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28","io.modelcontextprotocol/clientCapabilities":{}}}})"
      "\n");
  std::ostringstream out;
  EXPECT_EQ(RunMcpStdio(o, in, out, cli::MakeBeastTransport), 0);
  done = true;
  listener.join();
  close(fd);
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(received.find("X-Injected"), std::string::npos) << received;
    EXPECT_EQ(received.find("DELETE"), std::string::npos) << received;
  }
  std::vector<json::object> lines = Lines(out.str());
  ASSERT_EQ(lines.size(), 1u) << out.str();
  EXPECT_EQ(lines[0].at("id"), 7);
  ASSERT_TRUE(lines[0].contains("error")) << out.str();
}

}  // namespace
}  // namespace esb

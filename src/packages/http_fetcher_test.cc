#include "packages/http_fetcher.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/util.h"

namespace esb::packages {
namespace {

// A tiny HTTP/1.1 server on 127.0.0.1:<ephemeral>, one thread per connection, canned routes.
class LoopbackServer {
 public:
  LoopbackServer() {
    listen_.reset(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int one = 1;
    setsockopt(listen_.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    EXPECT_EQ(bind(listen_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    EXPECT_EQ(listen(listen_.get(), 16), 0);
    socklen_t len = sizeof addr;
    getsockname(listen_.get(), reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    acceptor_ = std::thread([this] { AcceptLoop(); });
  }
  ~LoopbackServer() {
    stop_ = true;
    acceptor_.join();
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& t : workers_) t.join();
  }
  std::string Url(const std::string& path) const {
    return "http://127.0.0.1:" + std::to_string(port_) + path;
  }
  int port() const { return port_; }
  static const std::string& BigBody() {
    static const std::string body = [] {
      std::string b;
      for (int i = 0; b.size() < 300'000; ++i) b += std::to_string(i) + ",";
      return b;
    }();
    return body;
  }

 private:
  void AcceptLoop() {
    while (!stop_) {
      pollfd p{listen_.get(), POLLIN, 0};
      if (poll(&p, 1, 20) <= 0) continue;
      int fd = accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      std::lock_guard<std::mutex> lock(mu_);
      workers_.emplace_back([this, fd] { Serve(UniqueFd(fd)); });
    }
  }

  static void SendAll(int fd, std::string_view data) {
    while (!data.empty()) {
      ssize_t n = send(fd, data.data(), data.size(), MSG_NOSIGNAL);
      if (n <= 0) return;
      data.remove_prefix(static_cast<size_t>(n));
    }
  }

  void Serve(UniqueFd fd) {
    std::string req;
    char buf[4096];
    while (req.find("\r\n\r\n") == std::string::npos) {
      pollfd p{fd.get(), POLLIN, 0};
      if (stop_) return;
      if (poll(&p, 1, 20) <= 0) continue;
      ssize_t n = recv(fd.get(), buf, sizeof buf, 0);
      if (n <= 0) return;
      req.append(buf, static_cast<size_t>(n));
      if (req[0] == 0x16) {  // a TLS ClientHello: answer in plain text, as a plain server would
        SendAll(fd.get(), "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
        return;
      }
    }
    std::string path = req.substr(4, req.find(' ', 4) - 4);
    auto reply = [&](const std::string& head, const std::string& body) {
      SendAll(fd.get(), head + "Content-Length: " + std::to_string(body.size()) +
                            "\r\nConnection: close\r\n\r\n" + body);
    };
    if (path == "/ok") {
      reply("HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n", BigBody());
    } else if (path == "/chunked") {
      std::string out = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n";
      for (int i = 0; i < 50; ++i) out += "3e8\r\n" + std::string(1000, 'c') + "\r\n";
      SendAll(fd.get(), out + "0\r\n\r\n");
    } else if (path == "/redirect-local") {
      reply("HTTP/1.1 302 Found\r\nLocation: /ok\r\n", "");
    } else if (path == "/redirect-foreign") {
      reply("HTTP/1.1 302 Found\r\nLocation: http://evil.example:" + std::to_string(port_) +
                "/ok\r\n",
            "");
    } else if (path == "/loop") {
      reply("HTTP/1.1 301 Moved\r\nLocation: /loop\r\n", "");
    } else if (path == "/accept") {
      std::string accept = req.substr(req.find("Accept:") + 8);
      reply("HTTP/1.1 200 OK\r\n", accept.substr(0, accept.find("\r\n")));
    } else if (path == "/hang") {
      while (!stop_) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    } else if (path == "/error") {
      reply("HTTP/1.1 503 Service Unavailable\r\n", "busy");
    } else {
      reply("HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\n", "no such page");
    }
  }

  UniqueFd listen_;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<std::thread> workers_;
};

class BeastHttpFetcherTest : public ::testing::Test {
 protected:
  absl::StatusOr<HttpResult> Get(const std::string& path, std::string* body = nullptr) {
    return fetcher_.Get(server_.Url(path), limits_, [&](std::string_view chunk) {
      ++chunks_;
      if (body != nullptr) body->append(chunk);
      return absl::OkStatus();
    });
  }
  LoopbackServer server_;
  BeastHttpFetcher fetcher_;
  FetchLimits limits_;
  int chunks_ = 0;
};

TEST_F(BeastHttpFetcherTest, StreamsBodyToSink) {
  std::string body;
  auto r = Get("/ok", &body);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->content_type, "application/octet-stream");
  EXPECT_EQ(r->final_url, server_.Url("/ok"));
  EXPECT_EQ(body, LoopbackServer::BigBody());
  EXPECT_GT(chunks_, 1) << "a 300 kB body arrives in several chunks";
}

TEST_F(BeastHttpFetcherTest, ChunkedBody) {
  std::string body;
  auto r = Get("/chunked", &body);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(body, std::string(50'000, 'c'));
}

TEST_F(BeastHttpFetcherTest, SendsAcceptHeader) {
  limits_.accept = "application/vnd.pypi.simple.v1+json";
  std::string body;
  ASSERT_TRUE(Get("/accept", &body).ok());
  EXPECT_EQ(body, "application/vnd.pypi.simple.v1+json");
}

TEST_F(BeastHttpFetcherTest, NotFoundAndServerError) {
  std::string body;
  auto r = Get("/missing", &body);
  EXPECT_TRUE(absl::IsNotFound(r.status())) << r.status();
  EXPECT_NE(std::string(r.status().message()).find("404"), std::string::npos);
  EXPECT_EQ(body, "") << "error bodies do not reach the sink";
  r = Get("/error");
  EXPECT_TRUE(absl::IsUnavailable(r.status())) << r.status();
  EXPECT_TRUE(IsUnreachable(r.status()));
}

TEST_F(BeastHttpFetcherTest, FollowsRedirectToSameHost) {
  std::string body;
  auto r = Get("/redirect-local", &body);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->final_url, server_.Url("/ok"));
  EXPECT_EQ(body.size(), LoopbackServer::BigBody().size());
}

TEST_F(BeastHttpFetcherTest, RefusesRedirectToHostNotAllowed) {
  auto r = Get("/redirect-foreign");
  EXPECT_TRUE(absl::IsPermissionDenied(r.status())) << r.status();
  EXPECT_NE(std::string(r.status().message()).find("evil.example"), std::string::npos);
  EXPECT_EQ(chunks_, 0);
}

TEST_F(BeastHttpFetcherTest, RefusesInitialHostNotAllowed) {
  limits_.allowed_hosts = {"mirror.example"};
  auto r = Get("/ok");
  EXPECT_TRUE(absl::IsPermissionDenied(r.status())) << r.status();
  limits_.allowed_hosts = {"127.0.0.1"};
  EXPECT_TRUE(Get("/ok").ok());
}

TEST_F(BeastHttpFetcherTest, StopsRedirectLoops) {
  auto r = Get("/loop");
  EXPECT_TRUE(absl::IsFailedPrecondition(r.status())) << r.status();
  EXPECT_NE(std::string(r.status().message()).find("redirects"), std::string::npos);
}

TEST_F(BeastHttpFetcherTest, BodyCap) {
  limits_.max_body_bytes = 1000;
  auto r = Get("/ok");  // Content-Length over the cap: refused before reading
  EXPECT_TRUE(absl::IsResourceExhausted(r.status())) << r.status();
  EXPECT_EQ(chunks_, 0);
  limits_.max_body_bytes = 20'000;
  r = Get("/chunked");  // no length: cut off while streaming
  EXPECT_TRUE(absl::IsResourceExhausted(r.status())) << r.status();
}

TEST_F(BeastHttpFetcherTest, TimesOutOnSilentServer) {
  limits_.timeout = std::chrono::milliseconds(300);
  auto start = std::chrono::steady_clock::now();
  auto r = Get("/hang");
  auto took = std::chrono::steady_clock::now() - start;
  EXPECT_TRUE(absl::IsDeadlineExceeded(r.status())) << r.status();
  EXPECT_TRUE(IsUnreachable(r.status()));
  EXPECT_LT(took, std::chrono::seconds(3));
}

TEST_F(BeastHttpFetcherTest, ConnectionRefusedIsUnavailable) {
  int port;
  {
    UniqueFd s(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(bind(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    socklen_t len = sizeof addr;
    getsockname(s.get(), reinterpret_cast<sockaddr*>(&addr), &len);
    port = ntohs(addr.sin_port);
  }  // closed without listening
  auto r = fetcher_.Get("http://127.0.0.1:" + std::to_string(port) + "/", limits_,
                        [](std::string_view) { return absl::OkStatus(); });
  EXPECT_TRUE(absl::IsUnavailable(r.status())) << r.status();
}

TEST_F(BeastHttpFetcherTest, HttpsToPlainServerFailsHandshake) {
  limits_.timeout = std::chrono::milliseconds(2000);
  auto r = fetcher_.Get("https://127.0.0.1:" + std::to_string(server_.port()) + "/ok", limits_,
                        [](std::string_view) { return absl::OkStatus(); });
  EXPECT_FALSE(r.ok());
  EXPECT_TRUE(IsUnreachable(r.status())) << r.status();
}

TEST_F(BeastHttpFetcherTest, SinkErrorAborts) {
  auto r = fetcher_.Get(server_.Url("/ok"), limits_, [](std::string_view) {
    return absl::ResourceExhaustedError("disk full");
  });
  EXPECT_TRUE(absl::IsResourceExhausted(r.status()));
  EXPECT_EQ(std::string(r.status().message()), "disk full");
}

TEST(HttpStatusErrorTest, Mapping) {
  EXPECT_TRUE(absl::IsNotFound(HttpStatusError(404, "u")));
  EXPECT_TRUE(absl::IsNotFound(HttpStatusError(410, "u")));
  EXPECT_TRUE(absl::IsPermissionDenied(HttpStatusError(403, "u")));
  EXPECT_TRUE(absl::IsUnavailable(HttpStatusError(502, "u")));
  EXPECT_TRUE(absl::IsUnavailable(HttpStatusError(429, "u")));
  EXPECT_TRUE(absl::IsFailedPrecondition(HttpStatusError(400, "u")));
}

}  // namespace
}  // namespace esb::packages

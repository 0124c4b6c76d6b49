#include "packages/http_fetcher.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read_until.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/write.hpp>
#include <boost/json.hpp>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/util.h"
#include "governance/control.h"
#include "governance/policy.h"
#include "governance/proxy/proxy.h"
#include "governance/proxy/resolver.h"
#include "governance/tls/ca.h"

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
  // The request targets served so far, in order.
  std::vector<std::string> paths() {
    std::lock_guard<std::mutex> lock(mu_);
    return paths_;
  }
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
    {
      std::lock_guard<std::mutex> lock(mu_);
      paths_.push_back(path);
    }
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
    } else if (path == "/redirect-internal") {
      reply("HTTP/1.1 302 Found\r\nLocation: http://internal.test:" + std::to_string(port_) +
                "/ok\r\n",
            "");
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
  std::vector<std::string> paths_;
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
  // Host and port must match: a bare host means the scheme's default port (80 here), not any
  // service on that machine.
  limits_.allowed_hosts = {"127.0.0.1"};
  r = Get("/ok");
  EXPECT_TRUE(absl::IsPermissionDenied(r.status())) << r.status();
  limits_.allowed_hosts = {"127.0.0.1:" + std::to_string(server_.port() == 1 ? 2 : 1)};
  EXPECT_TRUE(absl::IsPermissionDenied(Get("/ok").status()));
  limits_.allowed_hosts = {"127.0.0.1:" + std::to_string(server_.port())};
  EXPECT_TRUE(Get("/ok").ok());
  EXPECT_GT(chunks_, 0);
}

// Host names go through the resolver (IP literals do not); its addresses are used.
TEST_F(BeastHttpFetcherTest, ResolvesNamesWithTheResolver) {
  std::atomic<int> calls{0};
  BeastHttpFetcher fetcher("", [&calls](const std::string& host)
                                   -> absl::StatusOr<std::vector<std::string>> {
    ++calls;
    if (host == "index.test") return std::vector<std::string>{"127.0.0.1"};
    return absl::UnavailableError("NXDOMAIN");
  });
  const std::string port = std::to_string(server_.port());
  std::string body;
  auto r = fetcher.Get("http://index.test:" + port + "/ok", limits_, [&](std::string_view c) {
    body.append(c);
    return absl::OkStatus();
  });
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(body, LoopbackServer::BigBody());
  EXPECT_EQ(calls.load(), 1);
  limits_.allowed_hosts = {"nowhere.test:" + port};
  r = fetcher.Get("http://nowhere.test:" + port + "/ok", limits_,
                  [](std::string_view) { return absl::OkStatus(); });
  EXPECT_TRUE(absl::IsUnavailable(r.status())) << r.status();
  EXPECT_NE(std::string(r.status().message()).find("cannot resolve host 'nowhere.test'"),
            std::string::npos)
      << r.status();
  limits_.allowed_hosts.clear();
  ASSERT_TRUE(Get("/ok").ok());  // an IP literal: no lookup
  EXPECT_EQ(calls.load(), 2);
}

// Finding: a DNS lookup that hangs was not bounded by the request's timeout (cancel() does not
// stop getaddrinfo, and the io_context waits for it). Now the request gives up in time.
TEST_F(BeastHttpFetcherTest, HangingDnsHonoursTheDeadline) {
  auto release = std::make_shared<std::atomic<bool>>(false);
  BeastHttpFetcher fetcher("", [release](const std::string&)
                                   -> absl::StatusOr<std::vector<std::string>> {
    for (int i = 0; i < 500 && !*release; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return std::vector<std::string>{"127.0.0.1"};
  });
  limits_.timeout = std::chrono::milliseconds(300);
  limits_.allowed_hosts = {"slow.test:" + std::to_string(server_.port())};
  auto start = std::chrono::steady_clock::now();
  auto r = fetcher.Get("http://slow.test:" + std::to_string(server_.port()) + "/ok", limits_,
                       [](std::string_view) { return absl::OkStatus(); });
  auto took = std::chrono::steady_clock::now() - start;
  EXPECT_TRUE(absl::IsDeadlineExceeded(r.status())) << r.status();
  EXPECT_NE(std::string(r.status().message()).find("resolving slow.test"), std::string::npos);
  EXPECT_LT(took, std::chrono::milliseconds(1500));
  // The connect timeout bounds the lookup too.
  limits_.timeout = std::chrono::milliseconds(10'000);
  limits_.connect_timeout = std::chrono::milliseconds(200);
  start = std::chrono::steady_clock::now();
  r = fetcher.Get("http://slow.test:" + std::to_string(server_.port()) + "/ok", limits_,
                  [](std::string_view) { return absl::OkStatus(); });
  EXPECT_TRUE(absl::IsDeadlineExceeded(r.status())) << r.status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(1500));
  *release = true;  // the abandoned lookups end (their answers are dropped)
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

// ---------------------------------------------------------------------------------------------
// Real TLS: a throw-away CA and server certificates made with the `openssl` CLI (a declared
// dependency, so a failure to run it fails the tests rather than skipping them).

namespace asio = boost::asio;
namespace ssl = boost::asio::ssl;
using tcp = asio::ip::tcp;

// The PKI of one test-suite run, in a temp dir removed afterwards.
struct TestPki {
  std::string dir;
  std::string ca_cert;     // the test CA (PEM)
  std::string good_cert;   // SAN IP:127.0.0.1, DNS:localhost, signed by the CA
  std::string good_key;
  std::string wrong_cert;  // SAN DNS:wrong.example, signed by the same CA
  std::string wrong_key;
  std::string index_cert;  // SAN DNS:index.test, signed by the same CA
  std::string index_key;
  std::string error;       // non-empty when generation failed: why
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs `command` (a shell line) in `dir`, stderr to dir/openssl.log. "" on success, else why.
std::string RunIn(const std::string& dir, const std::string& command) {
  const std::string log = dir + "/openssl.log";
  std::string line = "cd '" + dir + "' && " + command + " >>'" + log + "' 2>&1";
  int rc = std::system(line.c_str());
  if (rc == 0) return "";
  return "`" + command + "` failed (system() = " + std::to_string(rc) + "); output:\n" +
         ReadFile(log);
}

TestPki MakeTestPki() {
  TestPki pki;
  char tmpl[] = "/tmp/esb-fetcher-tls-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    pki.error = std::string("mkdtemp: ") + strerror(errno);
    return pki;
  }
  pki.dir = tmpl;
  // Our own config, so the system openssl.cnf cannot change the extensions.
  std::ofstream(pki.dir + "/pki.cnf") << R"([req]
distinguished_name = dn
prompt = no
x509_extensions = ca_ext
[dn]
CN = esb test CA
[ca_ext]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[good_ext]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1,DNS:localhost
authorityKeyIdentifier = keyid
[index_ext]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:index.test
authorityKeyIdentifier = keyid
[wrong_ext]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:wrong.example
authorityKeyIdentifier = keyid
)";
  // P-256 keys: generated in milliseconds, unlike RSA.
  const std::string newkey = "-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes";
  const std::vector<std::string> steps = {
      "openssl req -x509 -config pki.cnf " + newkey +
          " -keyout ca.key -out ca.pem -days 2 -subj '/CN=esb test CA'",
      "openssl req -new -config pki.cnf " + newkey +
          " -keyout good.key -out good.csr -subj '/CN=localhost'",
      "openssl x509 -req -in good.csr -CA ca.pem -CAkey ca.key -set_serial 2 -days 2 "
      "-extfile pki.cnf -extensions good_ext -out good.pem",
      "openssl req -new -config pki.cnf " + newkey +
          " -keyout wrong.key -out wrong.csr -subj '/CN=wrong.example'",
      "openssl x509 -req -in wrong.csr -CA ca.pem -CAkey ca.key -set_serial 3 -days 2 "
      "-extfile pki.cnf -extensions wrong_ext -out wrong.pem",
      "openssl req -new -config pki.cnf " + newkey +
          " -keyout index.key -out index.csr -subj '/CN=index.test'",
      "openssl x509 -req -in index.csr -CA ca.pem -CAkey ca.key -set_serial 4 -days 2 "
      "-extfile pki.cnf -extensions index_ext -out index.pem",
  };
  for (const auto& step : steps) {
    pki.error = RunIn(pki.dir, step);
    if (!pki.error.empty()) return pki;
  }
  pki.ca_cert = pki.dir + "/ca.pem";
  pki.good_cert = pki.dir + "/good.pem";
  pki.good_key = pki.dir + "/good.key";
  pki.wrong_cert = pki.dir + "/wrong.pem";
  pki.wrong_key = pki.dir + "/wrong.key";
  pki.index_cert = pki.dir + "/index.pem";
  pki.index_key = pki.dir + "/index.key";
  return pki;
}

// A TLS server on 127.0.0.1:<ephemeral> presenting `cert`, answering every request with one
// canned 200 response, then closing. Asio in one thread; stopped and joined on destruction.
class TlsLoopbackServer {
 public:
  static constexpr const char* kBody = "hello over TLS";

  TlsLoopbackServer(const std::string& cert, const std::string& key) {
    ctx_.use_certificate_chain_file(cert);
    ctx_.use_private_key_file(key, ssl::context::pem);
    acceptor_.open(tcp::v4());
    acceptor_.bind(tcp::endpoint(asio::ip::make_address_v4("127.0.0.1"), 0));
    acceptor_.listen();
    port_ = acceptor_.local_endpoint().port();
    Accept();
    thread_ = std::thread([this] { ioc_.run(); });
  }
  ~TlsLoopbackServer() {
    ioc_.stop();
    thread_.join();
  }
  int port() const { return port_; }
  // Requests read after a completed handshake.
  int requests() const { return requests_; }
  std::string Url(const std::string& host, const std::string& path) const {
    return "https://" + host + ":" + std::to_string(port_) + path;
  }

 private:
  struct Session {
    explicit Session(tcp::socket s, ssl::context& ctx) : stream(std::move(s), ctx) {}
    ssl::stream<tcp::socket> stream;
    std::string request;
    std::string response;
  };

  void Accept() {
    acceptor_.async_accept([this](boost::system::error_code ec, tcp::socket socket) {
      if (ec) return;
      auto session = std::make_shared<Session>(std::move(socket), ctx_);
      session->stream.async_handshake(
          ssl::stream_base::server, [this, session](boost::system::error_code ec) {
            if (ec) return;  // e.g. the client rejected our certificate
            asio::async_read_until(
                session->stream, asio::dynamic_buffer(session->request), "\r\n\r\n",
                [this, session](boost::system::error_code ec, size_t) {
                  if (ec) return;
                  ++requests_;
                  session->response =
                      std::string("HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n") +
                      "Content-Length: " + std::to_string(std::strlen(kBody)) +
                      "\r\nConnection: close\r\n\r\n" + kBody;
                  asio::async_write(session->stream, asio::buffer(session->response),
                                    [session](boost::system::error_code, size_t) {});
                });
          });
      Accept();
    });
  }

  // Declared so that sessions still queued in ioc_ die before the context they refer to.
  ssl::context ctx_{ssl::context::tls_server};
  asio::io_context ioc_;
  tcp::acceptor acceptor_{ioc_};
  int port_ = 0;
  std::atomic<int> requests_{0};
  std::thread thread_;
};

class TlsFetcherTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { pki_ = new TestPki(MakeTestPki()); }
  static void TearDownTestSuite() {
    if (!pki_->dir.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(pki_->dir, ec);
    }
    delete pki_;
    pki_ = nullptr;
  }
  void SetUp() override {
    ASSERT_TRUE(pki_->error.empty()) << "cannot make the test certificates with the openssl CLI "
                                        "(Debian package `openssl`): "
                                     << pki_->error;
    limits_.timeout = std::chrono::milliseconds(5000);
  }
  absl::StatusOr<HttpResult> Get(BeastHttpFetcher& fetcher, const std::string& url,
                                 std::string* body = nullptr) {
    return fetcher.Get(url, limits_, [body](std::string_view chunk) {
      if (body != nullptr) body->append(chunk);
      return absl::OkStatus();
    });
  }
  static std::string Message(const absl::Status& s) { return std::string(s.message()); }

  static TestPki* pki_;
  FetchLimits limits_;
};
TestPki* TlsFetcherTest::pki_ = nullptr;

TEST_F(TlsFetcherTest, TrustsServerSignedByConfiguredCa) {
  TlsLoopbackServer server(pki_->good_cert, pki_->good_key);
  BeastHttpFetcher fetcher(pki_->ca_cert);
  std::string body;
  auto r = Get(fetcher, server.Url("127.0.0.1", "/x"), &body);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->content_type, "text/plain");
  EXPECT_EQ(body, TlsLoopbackServer::kBody);
  // By DNS name too (SNI + DNS subjectAltName).
  body.clear();
  r = Get(fetcher, server.Url("localhost", "/x"), &body);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(body, TlsLoopbackServer::kBody);
  EXPECT_EQ(server.requests(), 2);
}

// Attack: a server whose certificate chains to a CA we were not told to trust (a MITM, or a
// private mirror without its CA configured). The request must not be sent.
TEST_F(TlsFetcherTest, RejectsCertificateFromUnknownCa) {
  TlsLoopbackServer server(pki_->good_cert, pki_->good_key);
  BeastHttpFetcher fetcher;  // system trust store only
  std::string body;
  auto r = Get(fetcher, server.Url("127.0.0.1", "/x"), &body);
  EXPECT_TRUE(absl::IsFailedPrecondition(r.status())) << r.status();
  EXPECT_FALSE(IsUnreachable(r.status())) << "a trust failure is not an outage";
  EXPECT_NE(Message(r.status()).find("certificate"), std::string::npos) << r.status();
  EXPECT_NE(Message(r.status()).find("verif"), std::string::npos) << r.status();
  EXPECT_NE(Message(r.status()).find("local issuer"), std::string::npos) << r.status();
  EXPECT_EQ(body, "");
  EXPECT_EQ(server.requests(), 0);
}

// Attack: a valid certificate from a trusted CA, but issued for another name.
TEST_F(TlsFetcherTest, RejectsCertificateForAnotherHost) {
  TlsLoopbackServer server(pki_->wrong_cert, pki_->wrong_key);
  BeastHttpFetcher fetcher(pki_->ca_cert);
  for (const char* host : {"127.0.0.1", "localhost"}) {
    SCOPED_TRACE(host);
    auto r = Get(fetcher, server.Url(host, "/x"));
    EXPECT_TRUE(absl::IsFailedPrecondition(r.status())) << r.status();
    EXPECT_NE(Message(r.status()).find("certificate verification failed"), std::string::npos)
        << r.status();
    EXPECT_NE(Message(r.status()).find("mismatch"), std::string::npos) << r.status();
  }
  EXPECT_EQ(server.requests(), 0);
}

// The CA bundle adds to the system trust store, it does not replace it. The "system" store is
// pointed at the test CA with SSL_CERT_FILE (honoured by set_default_verify_paths).
TEST_F(TlsFetcherTest, CaFileAddsToSystemStore) {
  TlsLoopbackServer server(pki_->good_cert, pki_->good_key);
  const char* saved = std::getenv("SSL_CERT_FILE");
  const std::string saved_value = saved != nullptr ? saved : "";
  ASSERT_EQ(setenv("SSL_CERT_FILE", pki_->ca_cert.c_str(), 1), 0);
  BeastHttpFetcher plain;
  auto r1 = Get(plain, server.Url("127.0.0.1", "/x"));
  // An unrelated but valid PEM bundle (the wrong.example certificate) as the extra file.
  BeastHttpFetcher extra(pki_->wrong_cert);
  auto r2 = Get(extra, server.Url("127.0.0.1", "/x"));
  if (saved != nullptr) {
    setenv("SSL_CERT_FILE", saved_value.c_str(), 1);
  } else {
    unsetenv("SSL_CERT_FILE");
  }
  EXPECT_TRUE(r1.ok()) << r1.status();
  EXPECT_TRUE(r2.ok()) << r2.status();
  // And without SSL_CERT_FILE, the extra file alone does not make the server trusted.
  auto r3 = Get(extra, server.Url("127.0.0.1", "/x"));
  EXPECT_TRUE(absl::IsFailedPrecondition(r3.status())) << r3.status();
  EXPECT_EQ(server.requests(), 2);
}

TEST_F(TlsFetcherTest, MissingCaFileIsFailedPrecondition) {
  TlsLoopbackServer server(pki_->good_cert, pki_->good_key);
  const std::string missing = pki_->dir + "/no-such-ca.pem";
  BeastHttpFetcher fetcher(missing);
  auto r = Get(fetcher, server.Url("127.0.0.1", "/x"));
  EXPECT_TRUE(absl::IsFailedPrecondition(r.status())) << r.status();
  EXPECT_NE(Message(r.status()).find(missing), std::string::npos) << r.status();
  EXPECT_NE(Message(r.status()).find("No such file"), std::string::npos) << r.status();
  // Checked before connecting, for http too: port 1 would otherwise be Unavailable.
  r = Get(fetcher, "http://127.0.0.1:1/x");
  EXPECT_TRUE(absl::IsFailedPrecondition(r.status())) << r.status();
  EXPECT_EQ(server.requests(), 0);
}

TEST_F(TlsFetcherTest, InvalidCaFileIsFailedPrecondition) {
  TlsLoopbackServer server(pki_->good_cert, pki_->good_key);
  const std::string garbage = pki_->dir + "/garbage.pem";
  std::ofstream(garbage) << "this is not a certificate\n\x01\x02\x03\n";
  // A PEM file without certificates (only a private key) is as useless.
  const std::string key_only = pki_->good_key;
  for (const std::string& file : {garbage, key_only, pki_->dir}) {
    SCOPED_TRACE(file);
    BeastHttpFetcher fetcher(file);
    auto r = Get(fetcher, server.Url("127.0.0.1", "/x"));
    EXPECT_TRUE(absl::IsFailedPrecondition(r.status())) << r.status();
    EXPECT_NE(Message(r.status()).find("'" + file + "'"), std::string::npos) << r.status();
    EXPECT_NE(Message(r.status()).find("CA bundle"), std::string::npos) << r.status();
  }
  EXPECT_EQ(server.requests(), 0);
}

// ---------------------------------------------------------------------------------------------
// Through an environment's egress proxy (FetchLimits::proxy): the real proxy engine in-process
// (governance/proxy), serving a loopback listener as esbd's netns listener; names map to the
// local servers above through the test's resolver.

namespace gov = esb::governance;

class MapResolver : public gov::proxy::Resolver {
 public:
  // `explicitly`: the name counts as explicitly mapped (like --egress-resolve), so a loopback
  // address is allowed; otherwise the proxy refuses it as a private address.
  void Map(const std::string& name, int port, bool explicitly = true) {
    std::lock_guard<std::mutex> lock(mu_);
    map_[name] = {
        tcp::endpoint(asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)),
        explicitly};
  }
  asio::awaitable<absl::StatusOr<gov::proxy::Resolution>> Resolve(std::string host,
                                                                  uint16_t) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(host);
    if (it == map_.end()) co_return absl::NotFoundError("cannot resolve '" + host + "'");
    gov::proxy::Resolution r;
    r.endpoints.push_back(it->second.first);
    r.overridden = it->second.second;
    co_return r;
  }

 private:
  std::mutex mu_;
  std::map<std::string, std::pair<tcp::endpoint, bool>> map_;
};

UniqueFd ConnectLoopback(int port) {
  UniqueFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return UniqueFd();
  return fd;
}

class ProxiedFetcherTest : public TlsFetcherTest {
 protected:
  void SetUp() override {
    TlsFetcherTest::SetUp();
    auto ca = gov::tls::GenerateCa("EnterSandBox env test");
    ASSERT_TRUE(ca.ok()) << ca.status();
    env_ca_ = *ca;
    resolver_ = std::make_shared<MapResolver>();
    gov::proxy::ProxyOptions o;
    o.threads = 2;
    o.use_system_roots = false;
    o.upstream_ca_file = pki_->ca_cert;  // the proxy verifies the TLS upstreams
    auto proxy = gov::proxy::Proxy::Create(o, resolver_, [this](gov::control::AuditEvent e) {
      std::lock_guard<std::mutex> lock(audit_mu_);
      audit_.push_back(std::move(e));
      audit_cv_.notify_all();
    });
    ASSERT_TRUE(proxy.ok()) << proxy.status();
    proxy_ = *std::move(proxy);
    route_ = std::make_shared<ProxyRoute>();
    route_->ca_pem = env_ca_.cert_pem;
    route_->connect = [this](std::chrono::milliseconds) -> absl::StatusOr<UniqueFd> {
      ++connects_;
      UniqueFd fd = ConnectLoopback(proxy_port_);
      if (!fd) return absl::UnavailableError("cannot connect to the test proxy");
      return fd;
    };
    limits_.proxy = route_;
  }
  void TearDown() override { proxy_.reset(); }

  void Attach(const std::string& policy_json) {
    UniqueFd listener(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(bind(listener.get(), reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    ASSERT_EQ(listen(listener.get(), 16), 0);
    socklen_t len = sizeof a;
    getsockname(listener.get(), reinterpret_cast<sockaddr*>(&a), &len);
    proxy_port_ = ntohs(a.sin_port);
    auto policy = gov::ParseEgressPolicy(boost::json::parse(policy_json));
    ASSERT_TRUE(policy.ok()) << policy.status();
    gov::control::Attach at;
    at.env_id = "env-1";
    at.tenant = "t1";
    at.policy = *policy;
    at.ca_cert_pem = env_ca_.cert_pem;
    at.ca_key_pem = env_ca_.key_pem;
    at.listener_fd = listener.get();
    absl::Status st = proxy_->Attach(std::move(at));
    ASSERT_TRUE(st.ok()) << st;
  }
  // The proxy's audit events once at least n arrived (2 s).
  std::vector<gov::control::AuditEvent> Audit(size_t n) {
    std::unique_lock<std::mutex> lock(audit_mu_);
    audit_cv_.wait_for(lock, std::chrono::seconds(2), [&] { return audit_.size() >= n; });
    return audit_;
  }

  BeastHttpFetcher fetcher_;
  gov::tls::CaPem env_ca_;
  std::shared_ptr<MapResolver> resolver_;
  std::unique_ptr<gov::proxy::Proxy> proxy_;
  std::shared_ptr<ProxyRoute> route_;
  int proxy_port_ = 0;
  std::atomic<int> connects_{0};
  std::mutex audit_mu_;
  std::condition_variable audit_cv_;
  std::vector<gov::control::AuditEvent> audit_;
};

TEST_F(ProxiedFetcherTest, PlainHttpIsAnAbsoluteUriRequestDecidedAndAuditedByTheProxy) {
  LoopbackServer server;
  resolver_->Map("index.test", server.port());
  Attach(R"({"mode":"allowlist","allow":["index.test"]})");
  const std::string url = "http://index.test:" + std::to_string(server.port()) + "/ok";
  std::string body;
  auto r = Get(fetcher_, url, &body);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(body, LoopbackServer::BigBody());
  EXPECT_EQ(connects_.load(), 1);
  EXPECT_EQ(server.paths(), std::vector<std::string>{"/ok"});
  auto events = Audit(1);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].env_id, "env-1");
  EXPECT_EQ(events[0].host, "index.test");
  EXPECT_EQ(events[0].path, "/ok");
  EXPECT_EQ(events[0].decision, "allowed");
  EXPECT_EQ(events[0].status, 200);
}

TEST_F(ProxiedFetcherTest, EachRedirectHopOpensANewProxiedConnection) {
  LoopbackServer server;
  resolver_->Map("index.test", server.port());
  Attach(R"({"allow":["index.test"]})");
  auto r = Get(fetcher_, "http://index.test:" + std::to_string(server.port()) + "/redirect-local");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(connects_.load(), 2);
  EXPECT_EQ(Audit(2).size(), 2u) << "both hops are the environment's egress";
}

TEST_F(ProxiedFetcherTest, BlockedHostIsPermissionDeniedNamingHostAndRuleAndNothingArrives) {
  LoopbackServer server;
  resolver_->Map("index.test", server.port());
  Attach(R"({"allow":["other.test"],"deny":["index.test"]})");
  for (const std::string scheme : {"http", "https"}) {
    auto r = Get(fetcher_, scheme + "://index.test:" + std::to_string(server.port()) + "/ok");
    ASSERT_TRUE(absl::IsPermissionDenied(r.status())) << scheme << ": " << r.status();
    EXPECT_NE(Message(r.status()).find("index.test"), std::string::npos) << r.status();
    EXPECT_NE(Message(r.status()).find("rule 'deny:index.test'"), std::string::npos) << r.status();
    EXPECT_FALSE(IsUnreachable(r.status())) << "a refusal never falls back to cached data";
  }
  EXPECT_TRUE(server.paths().empty());
  auto events = Audit(2);
  ASSERT_EQ(events.size(), 2u);
  for (const auto& e : events) EXPECT_EQ(e.decision, "blocked");
}

TEST_F(ProxiedFetcherTest, HttpsIsInterceptedAndTheLeafVerifiedAgainstTheEnvironmentsCa) {
  TlsLoopbackServer server(pki_->index_cert, pki_->index_key);
  resolver_->Map("index.test", server.port());
  Attach(R"({"allow":["index.test"]})");
  const std::string url = server.Url("index.test", "/simple/");
  std::string body;
  auto r = Get(fetcher_, url, &body);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(body, TlsLoopbackServer::kBody);
  auto events = Audit(1);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().scheme, "https");
  EXPECT_EQ(events.back().path, "/simple/") << "inspected: the proxy saw the request";
  // Without the environment's CA the intercepting leaf is not trusted.
  route_->ca_pem = "";
  r = Get(fetcher_, url);
  EXPECT_TRUE(absl::IsFailedPrecondition(r.status())) << r.status();
}

TEST_F(ProxiedFetcherTest, HttpsTunnelledWithoutInspectionVerifiesTheUpstreamItself) {
  TlsLoopbackServer server(pki_->index_cert, pki_->index_key);
  resolver_->Map("index.test", server.port());
  Attach(R"({"allow":["index.test"],"tls_inspect":false})");
  const std::string url = server.Url("index.test", "/x");
  auto r = Get(fetcher_, url);  // trusts the env CA and the system store: not the test CA
  EXPECT_TRUE(absl::IsFailedPrecondition(r.status())) << r.status();
  BeastHttpFetcher with_ca(pki_->ca_cert);
  std::string body;
  r = Get(with_ca, url, &body);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(body, TlsLoopbackServer::kBody);
}

// Attack: a hostile index redirects esbd's fetch to an internal address. The host list of the
// fetch allows the name, the policy too, but the proxy resolves it and refuses the private
// address: the internal service never sees the request.
TEST_F(ProxiedFetcherTest, RedirectToAPrivateAddressIsRefused) {
  LoopbackServer server;
  resolver_->Map("index.test", server.port());
  resolver_->Map("internal.test", server.port(), /*explicitly=*/false);
  Attach(R"({"allow":["index.test","internal.test"]})");
  const std::string port = std::to_string(server.port());
  limits_.allowed_hosts = {"index.test:" + port, "internal.test:" + port};
  auto r = Get(fetcher_, "http://index.test:" + port + "/redirect-internal");
  ASSERT_TRUE(absl::IsPermissionDenied(r.status())) << r.status();
  EXPECT_NE(Message(r.status()).find("internal.test"), std::string::npos) << r.status();
  EXPECT_NE(Message(r.status()).find("rule 'addr:private'"), std::string::npos) << r.status();
  EXPECT_EQ(server.paths(), std::vector<std::string>{"/redirect-internal"})
      << "the redirect's target was never requested";
}

// A proxy (or whatever answers on its socket) is untrusted too. Answers a test proxy sends.
class HostileProxy {
 public:
  explicit HostileProxy(std::string answer) : answer_(std::move(answer)) {
    thread_ = std::thread([this] {
      while (!stop_) {
        pollfd p{listener_.get(), POLLIN, 0};
        if (poll(&p, 1, 20) <= 0) continue;
        UniqueFd c(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
        if (!c) continue;
        std::string got;
        char buf[4096];
        while (got.find("\r\n\r\n") == std::string::npos && !stop_) {
          pollfd q{c.get(), POLLIN, 0};
          if (poll(&q, 1, 20) <= 0) continue;
          ssize_t n = recv(c.get(), buf, sizeof buf, 0);
          if (n <= 0) break;
          got.append(buf, static_cast<size_t>(n));
        }
        std::string_view out = answer_;
        while (!out.empty() && !stop_) {
          ssize_t n = send(c.get(), out.data(), out.size(), MSG_NOSIGNAL);
          if (n <= 0) break;
          out.remove_prefix(static_cast<size_t>(n));
        }
        while (!stop_) std::this_thread::sleep_for(std::chrono::milliseconds(10));  // hold it
      }
    });
  }
  ~HostileProxy() {
    stop_ = true;
    thread_.join();
  }
  int port() const { return port_; }

 private:
  UniqueFd Listen() {
    UniqueFd l(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(l.get(), reinterpret_cast<sockaddr*>(&a), sizeof a);
    listen(l.get(), 4);
    socklen_t len = sizeof a;
    getsockname(l.get(), reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    return l;
  }
  std::string answer_;
  int port_ = 0;
  UniqueFd listener_ = Listen();
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

TEST_F(ProxiedFetcherTest, HostileProxyAnswersAreBoundedAndFail) {
  auto via = [&](const HostileProxy& p) {
    route_->connect = [port = p.port()](std::chrono::milliseconds) -> absl::StatusOr<UniqueFd> {
      return ConnectLoopback(port);
    };
  };
  limits_.timeout = std::chrono::milliseconds(1500);
  {
    // Bytes after the CONNECT answer, before our ClientHello: not the tunnel we asked for.
    HostileProxy p("HTTP/1.1 200 OK\r\n\r\n\x16\x03\x01 forged server hello");
    via(p);
    auto r = Get(fetcher_, "https://index.test/simple/");
    EXPECT_TRUE(absl::IsUnavailable(r.status())) << r.status();
    EXPECT_NE(Message(r.status()).find("before the TLS handshake"), std::string::npos)
        << r.status();
  }
  {
    // A refusal with an endless body and a hostile rule text: read at most 16 KiB, printable.
    HostileProxy p(
        "HTTP/1.1 403 Forbidden\r\nX-Esb-Blocked: evil\xc3\xa9rule\r\n"
        "Content-Length: 100000000\r\n\r\n" +
        std::string(1 << 20, '{'));
    via(p);
    const auto t0 = std::chrono::steady_clock::now();
    auto r = Get(fetcher_, "http://index.test/simple/");
    EXPECT_TRUE(absl::IsPermissionDenied(r.status())) << r.status();
    EXPECT_NE(Message(r.status()).find("evil??rule"), std::string::npos) << r.status();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(1400));
  }
  {
    // A proxy that never answers: the request's own deadline ends it.
    HostileProxy p("");
    via(p);
    const auto t0 = std::chrono::steady_clock::now();
    auto r = Get(fetcher_, "https://index.test/simple/");
    EXPECT_TRUE(absl::IsDeadlineExceeded(r.status())) << r.status();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(3000));
  }
  {
    // A huge header: the same 64 KiB header limit as for an upstream.
    HostileProxy p("HTTP/1.1 200 OK\r\nX-Big: " + std::string(200'000, 'a') + "\r\n\r\n");
    via(p);
    auto r = Get(fetcher_, "http://index.test/simple/");
    EXPECT_FALSE(r.ok());
  }
}

TEST_F(ProxiedFetcherTest, ProxyUnreachableIsUnavailableAndNoDirectConnectionIsMade) {
  LoopbackServer server;
  route_->connect = [](std::chrono::milliseconds) -> absl::StatusOr<UniqueFd> {
    return absl::UnavailableError("connection refused");
  };
  auto r = Get(fetcher_, server.Url("/ok"));
  EXPECT_TRUE(absl::IsUnavailable(r.status())) << r.status();
  EXPECT_NE(Message(r.status()).find("egress proxy"), std::string::npos) << r.status();
  EXPECT_TRUE(server.paths().empty()) << "never a direct fetch for a governed environment";
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

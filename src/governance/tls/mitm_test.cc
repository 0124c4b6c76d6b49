// End-to-end interception on loopback: a TLS client (the "sandbox") talks through
// AsyncIntercept to a local TLS upstream whose certificate comes from a separate test root
// (trusted by the proxy as an --egress-upstream-ca extra root). Everything runs as coroutines on
// one io_context with a wall-clock bound, so a hang fails the test instead of blocking it.
#include "governance/tls/mitm.h"

#include <gtest/gtest.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/connect.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/read_until.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <thread>

namespace esb::governance::tls {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
namespace ssl = asio::ssl;
using tcp = asio::ip::tcp;
using namespace std::chrono_literals;

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/esb_mitm_test_" + std::to_string(getpid()) + "_" +
         name;
}

std::shared_ptr<const Ca> NewCa(const std::string& cn) {
  auto pem = GenerateCa(cn);
  EXPECT_TRUE(pem.ok()) << pem.status();
  auto ca = Ca::FromPem(pem->cert_pem, pem->key_pem);
  EXPECT_TRUE(ca.ok()) << ca.status();
  return *ca;
}

std::shared_ptr<const Leaf> LeafFrom(const std::shared_ptr<const Ca>& ca, const std::string& host) {
  auto minter = LeafMinter::Create(ca);
  EXPECT_TRUE(minter.ok());
  auto leaf = (*minter)->LeafFor(host);
  EXPECT_TRUE(leaf.ok()) << leaf.status();
  return *leaf;
}

struct ClientOptions {
  std::string sni = "weather.test";  // "" = send no SNI
  std::string verify_host = "weather.test";
  bool trust_env_ca = true;  // false: trust only the upstream test root
  std::vector<std::string> alpn = {"h2", "http/1.1"};
  bool max_tls12 = false;
  bool send_nothing = false;  // connect, then never send a ClientHello
  std::string groups;         // key-exchange groups, first one gets the key share ("" = default)
};

struct Scenario {
  std::string target = "weather.test";
  ClientOptions client;
  std::shared_ptr<const Leaf> upstream_leaf;  // what the upstream serves
  std::chrono::milliseconds deadline = 5s;
};

struct Outcome {
  bool mitm_done = false;
  absl::Status status;
  std::string rule, sni, target;
  bool client_set = false, upstream_set = false;
  std::chrono::milliseconds mitm_elapsed{0};

  bool client_done = false;
  std::string client_error, client_alpn, client_response;
  int client_group = 0;  // NID of the negotiated key-exchange group

  std::string upstream_error, upstream_received;
};

class MitmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    env_ca_ = NewCa("EnterSandBox env test");
    upstream_root_ = NewCa("test upstream root");
    upstream_root_file_ = TempPath("upstream_root.pem");
    std::ofstream(upstream_root_file_) << upstream_root_->cert_pem();
    auto minter = LeafMinter::Create(env_ca_);
    ASSERT_TRUE(minter.ok());
    auto server = InterceptContext::Create(*minter);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ctx_ = *server;
    // Only the test root upstream (no system roots), as an air-gapped site would configure it.
    auto upstream = UpstreamContext::Create(upstream_root_file_, /*use_system_roots=*/false);
    ASSERT_TRUE(upstream.ok()) << upstream.status();
    upstream_ctx_ = *upstream;
  }
  void TearDown() override { std::remove(upstream_root_file_.c_str()); }

  Outcome Run(const Scenario& sc) {
    Outcome out;
    // Contexts first: they must outlive the io_context's streams.
    ssl::context upstream_server(ssl::context::tls_server);
    SSL_CTX_use_certificate(upstream_server.native_handle(), sc.upstream_leaf->cert.get());
    SSL_CTX_use_PrivateKey(upstream_server.native_handle(), sc.upstream_leaf->key.get());
    ssl::context client_ctx(ssl::context::tls_client);
    client_ctx.add_certificate_authority(
        asio::buffer(sc.client.trust_env_ca ? env_ca_->cert_pem() : upstream_root_->cert_pem()));
    client_ctx.set_verify_mode(ssl::verify_peer);
    std::string alpn_wire;
    for (const std::string& p : sc.client.alpn) alpn_wire += char(p.size()) + p;
    SSL_CTX_set_alpn_protos(client_ctx.native_handle(),
                            reinterpret_cast<const unsigned char*>(alpn_wire.data()),
                            alpn_wire.size());
    if (!sc.client.groups.empty()) {
      SSL_CTX_set1_groups_list(client_ctx.native_handle(), sc.client.groups.c_str());
    }
    if (sc.client.max_tls12) {
      SSL_CTX_set_max_proto_version(client_ctx.native_handle(), TLS1_2_VERSION);
    }

    asio::io_context ioc;
    tcp::acceptor proxy_acceptor(ioc, {asio::ip::make_address("127.0.0.1"), 0});
    tcp::acceptor upstream_acceptor(ioc, {asio::ip::make_address("127.0.0.1"), 0});
    const tcp::endpoint proxy_ep = proxy_acceptor.local_endpoint();
    const tcp::endpoint upstream_ep = upstream_acceptor.local_endpoint();

    // The upstream: one TLS connection, one request, one response.
    asio::co_spawn(
        ioc,
        [&]() -> asio::awaitable<void> {
          beast::error_code ec;
          auto tok = asio::redirect_error(asio::use_awaitable, ec);
          tcp::socket sock = co_await upstream_acceptor.async_accept(tok);
          if (ec) co_return;
          ssl::stream<tcp::socket> stream(std::move(sock), upstream_server);
          co_await stream.async_handshake(ssl::stream_base::server, tok);
          if (ec) {
            out.upstream_error = ec.message();
            co_return;
          }
          co_await asio::async_read_until(stream, asio::dynamic_buffer(out.upstream_received),
                                          "\r\n\r\n", tok);
          if (ec) {
            out.upstream_error = ec.message();
            co_return;
          }
          std::string response = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello";
          co_await asio::async_write(stream, asio::buffer(response), tok);
        },
        asio::detached);

    // The proxy: accept the client, connect the upstream, intercept, relay one exchange.
    asio::co_spawn(
        ioc,
        [&]() -> asio::awaitable<void> {
          beast::error_code ec;
          auto tok = asio::redirect_error(asio::use_awaitable, ec);
          tcp::socket client = co_await proxy_acceptor.async_accept(tok);
          if (ec) co_return;
          tcp::socket upstream(ioc);
          co_await upstream.async_connect(upstream_ep, tok);
          if (ec) co_return;
          auto start = std::chrono::steady_clock::now();
          // Named locals, not temporaries inside the co_await expression: GCC 12 miscompiles
          // class temporaries there (an SSO std::string came out pointing into the frame).
          MitmRequest request{server_ctx_, upstream_ctx_, sc.target,
                              std::chrono::steady_clock::now() + sc.deadline};
          beast::tcp_stream client_stream(std::move(client));
          beast::tcp_stream upstream_stream(std::move(upstream));
          MitmResult r = co_await AsyncIntercept(std::move(request), std::move(client_stream),
                                                 std::move(upstream_stream), asio::use_awaitable);
          out.mitm_elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(
              std::chrono::steady_clock::now() - start);
          out.mitm_done = true;
          out.status = r.status;
          out.rule = r.rule;
          out.sni = r.sni;
          out.target = r.target_host;
          out.client_set = r.client != nullptr;
          out.upstream_set = r.upstream != nullptr;
          if (!r.status.ok()) {
            if (r.client != nullptr) {  // answer inside TLS, as esb-proxy does
              http::response<http::string_body> res{http::status::bad_gateway, 11};
              res.set("X-Esb-Blocked", r.rule);
              res.body() = std::string(r.status.message());
              res.prepare_payload();
              co_await http::async_write(*r.client, res, tok);
            }
            co_return;
          }
          beast::flat_buffer cbuf, ubuf;
          http::request<http::string_body> req;
          co_await http::async_read(*r.client, cbuf, req, tok);
          if (ec) co_return;
          co_await http::async_write(*r.upstream, req, tok);
          if (ec) co_return;
          http::response<http::string_body> res;
          co_await http::async_read(*r.upstream, ubuf, res, tok);
          if (ec) co_return;
          co_await http::async_write(*r.client, res, tok);
        },
        asio::detached);

    // The sandbox's client.
    asio::co_spawn(
        ioc,
        [&]() -> asio::awaitable<void> {
          beast::error_code ec;
          auto tok = asio::redirect_error(asio::use_awaitable, ec);
          tcp::socket sock(ioc);
          co_await sock.async_connect(proxy_ep, tok);
          if (ec) co_return;
          if (sc.client.send_nothing) {
            char byte;
            co_await sock.async_read_some(asio::buffer(&byte, 1), tok);
            out.client_error = ec ? ec.message() : "read a byte";
            out.client_done = true;
            co_return;
          }
          ssl::stream<tcp::socket> stream(std::move(sock), client_ctx);
          SSL* ssl = stream.native_handle();
          if (!sc.client.sni.empty()) SSL_set_tlsext_host_name(ssl, sc.client.sni.c_str());
          if (X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), sc.client.verify_host.c_str()) !=
              1) {
            SSL_set1_host(ssl, sc.client.verify_host.c_str());
          }
          co_await stream.async_handshake(ssl::stream_base::client, tok);
          if (ec) {
            out.client_error = ec.message();
            out.client_done = true;
            co_return;
          }
          const unsigned char* alpn = nullptr;
          unsigned int alpn_len = 0;
          SSL_get0_alpn_selected(ssl, &alpn, &alpn_len);
          out.client_alpn.assign(reinterpret_cast<const char*>(alpn), alpn_len);
          out.client_group = SSL_get_negotiated_group(ssl);
          std::string request = "GET /data HTTP/1.1\r\nHost: " + sc.target + "\r\n\r\n";
          co_await asio::async_write(stream, asio::buffer(request), tok);
          char buf[4096];
          for (;;) {
            size_t n = co_await stream.async_read_some(asio::buffer(buf), tok);
            out.client_response.append(buf, n);
            if (ec || out.client_response.find("hello") != std::string::npos ||
                out.client_response.find("X-Esb-Blocked") != std::string::npos) {
              break;
            }
          }
          out.client_done = true;
        },
        asio::detached);

    ioc.run_for(15s);
    ERR_clear_error();
    return out;
  }

  std::shared_ptr<const Ca> env_ca_, upstream_root_;
  std::string upstream_root_file_;
  std::shared_ptr<InterceptContext> server_ctx_;
  std::shared_ptr<UpstreamContext> upstream_ctx_;
};

TEST_F(MitmTest, RelaysBytesBetweenATrustingClientAndAVerifiedUpstream) {
  Scenario sc;
  sc.upstream_leaf = LeafFrom(upstream_root_, "weather.test");
  Outcome out = Run(sc);
  ASSERT_TRUE(out.mitm_done);
  EXPECT_TRUE(out.status.ok()) << out.status;
  EXPECT_EQ(out.rule, "");
  EXPECT_EQ(out.sni, "weather.test");
  EXPECT_EQ(out.target, "weather.test");
  EXPECT_TRUE(out.client_set && out.upstream_set);
  ASSERT_TRUE(out.client_done);
  EXPECT_EQ(out.client_error, "");
  // The client offered h2 and http/1.1: only http/1.1 is ever selected.
  EXPECT_EQ(out.client_alpn, "http/1.1");
  EXPECT_NE(out.client_response.find("HTTP/1.1 200 OK"), std::string::npos) << out.client_response;
  EXPECT_NE(out.client_response.find("hello"), std::string::npos);
  EXPECT_EQ(out.upstream_received.rfind("GET /data HTTP/1.1\r\n", 0), 0u) << out.upstream_received;
  EXPECT_NE(out.upstream_received.find("Host: weather.test"), std::string::npos);
  EXPECT_EQ(server_ctx_->minter().minted(), 1u);

  // A second connection to the same host reuses the cached leaf.
  Outcome again = Run(sc);
  EXPECT_TRUE(again.status.ok()) << again.status;
  EXPECT_NE(again.client_response.find("hello"), std::string::npos);
  EXPECT_EQ(server_ctx_->minter().minted(), 1u);
}

TEST_F(MitmTest, ClientNotTrustingTheEnvCaFails) {
  Scenario sc;
  sc.upstream_leaf = LeafFrom(upstream_root_, "weather.test");
  sc.client.trust_env_ca = false;  // it trusts the real upstream's root, not the env CA
  Outcome out = Run(sc);
  ASSERT_TRUE(out.mitm_done);
  EXPECT_EQ(out.rule, kRuleClientHandshake);
  EXPECT_EQ(out.status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(out.status.message().find("unknown ca"), std::string::npos) << out.status;
  EXPECT_FALSE(out.client_set);
  ASSERT_TRUE(out.client_done);
  EXPECT_NE(out.client_error, "");
  EXPECT_EQ(out.client_response, "");
  EXPECT_EQ(out.upstream_received, "");  // nothing reached the upstream
}

TEST_F(MitmTest, SniMismatchIsRefused) {
  Scenario sc;
  sc.upstream_leaf = LeafFrom(upstream_root_, "weather.test");
  // CONNECT weather.test (the allowed host), then a ClientHello for another one.
  sc.client.sni = "evil.test";
  sc.client.verify_host = "evil.test";
  Outcome out = Run(sc);
  ASSERT_TRUE(out.mitm_done);
  EXPECT_EQ(out.rule, kRuleSniMismatch);
  EXPECT_EQ(out.sni, "evil.test");
  EXPECT_NE(out.status.message().find("does not match the CONNECT target"), std::string::npos)
      << out.status;
  EXPECT_FALSE(out.client_set);
  ASSERT_TRUE(out.client_done);
  // The client is told why (TLS alert unrecognized_name).
  EXPECT_NE(out.client_error.find("unrecognized name"), std::string::npos) << out.client_error;
  EXPECT_EQ(out.upstream_received, "");
  EXPECT_EQ(server_ctx_->minter().minted(), 0u);  // no certificate for evil.test was made
}

TEST_F(MitmTest, SniIsComparedCaseInsensitively) {
  Scenario sc;
  sc.upstream_leaf = LeafFrom(upstream_root_, "weather.test");
  sc.client.sni = "WEATHER.test";
  Outcome out = Run(sc);
  ASSERT_TRUE(out.mitm_done);
  EXPECT_TRUE(out.status.ok()) << out.status;
  EXPECT_NE(out.client_response.find("hello"), std::string::npos);
}

TEST_F(MitmTest, NoSniUsesTheConnectTarget) {
  Scenario sc;
  sc.upstream_leaf = LeafFrom(upstream_root_, "weather.test");
  sc.client.sni = "";
  Outcome out = Run(sc);
  ASSERT_TRUE(out.mitm_done);
  EXPECT_TRUE(out.status.ok()) << out.status;
  EXPECT_EQ(out.sni, "");
  EXPECT_EQ(out.client_error, "");
  EXPECT_NE(out.client_response.find("hello"), std::string::npos);
}

TEST_F(MitmTest, IpLiteralTargetIsVerifiedByAddressOnBothSides) {
  Scenario sc;
  sc.target = "127.0.0.1";
  sc.upstream_leaf = LeafFrom(upstream_root_, "127.0.0.1");
  sc.client.sni = "";  // RFC 6066: no SNI for IP literals
  sc.client.verify_host = "127.0.0.1";
  Outcome out = Run(sc);
  ASSERT_TRUE(out.mitm_done);
  EXPECT_TRUE(out.status.ok()) << out.status;
  EXPECT_NE(out.client_response.find("hello"), std::string::npos);
}

TEST_F(MitmTest, UntrustedUpstreamIsRefused) {
  Scenario sc;
  // The upstream's certificate comes from a root the proxy does not trust.
  sc.upstream_leaf = LeafFrom(NewCa("somebody else's root"), "weather.test");
  Outcome out = Run(sc);
  ASSERT_TRUE(out.mitm_done);
  EXPECT_EQ(out.rule, kRuleUpstreamUnverified);
  EXPECT_EQ(out.status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(out.status.message().find("not trusted"), std::string::npos) << out.status;
  // The client handshake had succeeded: the proxy could answer inside TLS.
  EXPECT_TRUE(out.client_set);
  EXPECT_FALSE(out.upstream_set);
  EXPECT_NE(out.client_response.find("502"), std::string::npos) << out.client_response;
  EXPECT_NE(out.client_response.find("X-Esb-Blocked: tls:upstream_unverified"), std::string::npos);
  EXPECT_EQ(out.upstream_received, "");
}

TEST_F(MitmTest, UpstreamCertificateForAnotherHostIsRefused) {
  Scenario sc;
  sc.upstream_leaf = LeafFrom(upstream_root_, "other.test");  // trusted root, wrong name
  Outcome out = Run(sc);
  ASSERT_TRUE(out.mitm_done);
  EXPECT_EQ(out.rule, kRuleUpstreamUnverified);
  EXPECT_NE(out.status.message().find("hostname mismatch"), std::string::npos) << out.status;
  EXPECT_EQ(out.upstream_received, "");
}

TEST_F(MitmTest, SilentClientTimesOutAtTheDeadline) {
  Scenario sc;
  sc.upstream_leaf = LeafFrom(upstream_root_, "weather.test");
  sc.client.send_nothing = true;
  sc.deadline = 300ms;
  Outcome out = Run(sc);
  ASSERT_TRUE(out.mitm_done);
  EXPECT_EQ(out.rule, kRuleTimeout);
  EXPECT_EQ(out.status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(out.mitm_elapsed, 250ms);
  EXPECT_LT(out.mitm_elapsed, 3s);
  ASSERT_TRUE(out.client_done);  // the proxy closed the connection
  EXPECT_NE(out.client_error, "");
}

TEST_F(MitmTest, H2OnlyClientGetsNoAlpnAndSpeaksHttp11) {
  Scenario sc;
  sc.upstream_leaf = LeafFrom(upstream_root_, "weather.test");
  sc.client.alpn = {"h2"};
  Outcome out = Run(sc);
  ASSERT_TRUE(out.mitm_done);
  EXPECT_TRUE(out.status.ok()) << out.status;
  EXPECT_EQ(out.client_alpn, "");
  EXPECT_NE(out.client_response.find("hello"), std::string::npos);
}

TEST_F(MitmTest, Tls12ClientIsInterceptedToo) {
  Scenario sc;
  sc.upstream_leaf = LeafFrom(upstream_root_, "weather.test");
  sc.client.max_tls12 = true;
  Outcome out = Run(sc);
  ASSERT_TRUE(out.mitm_done);
  EXPECT_TRUE(out.status.ok()) << out.status;
  EXPECT_NE(out.client_response.find("hello"), std::string::npos);

  // And a TLS 1.2 ClientHello with a foreign SNI is refused the same way.
  sc.client.sni = "evil.test";
  sc.client.verify_host = "evil.test";
  Outcome evil = Run(sc);
  ASSERT_TRUE(evil.mitm_done);
  EXPECT_EQ(evil.rule, kRuleSniMismatch);
}

TEST_F(MitmTest, HelloRetryRequestKeepsTheSniCheck) {
  // The client's key share is for P-521, which the interception does not accept: TLS 1.3
  // answers with a HelloRetryRequest and the client sends a second ClientHello.
  Scenario sc;
  sc.upstream_leaf = LeafFrom(upstream_root_, "weather.test");
  sc.client.groups = "P-521:X25519";
  Outcome out = Run(sc);
  ASSERT_TRUE(out.mitm_done);
  EXPECT_TRUE(out.status.ok()) << out.status;
  EXPECT_NE(out.client_response.find("hello"), std::string::npos);
  // X25519 although the first key share was P-521: the retry did happen.
  EXPECT_EQ(out.client_group, NID_X25519);

  sc.client.sni = "evil.test";
  sc.client.verify_host = "evil.test";
  Outcome evil = Run(sc);
  ASSERT_TRUE(evil.mitm_done);
  EXPECT_EQ(evil.rule, kRuleSniMismatch);
}

TEST_F(MitmTest, WildcardTargetIsRefused) {
  Scenario sc;
  sc.target = "*.weather.test";
  sc.upstream_leaf = LeafFrom(upstream_root_, "weather.test");
  Outcome out = Run(sc);
  ASSERT_TRUE(out.mitm_done);
  EXPECT_EQ(out.rule, kRuleBadTarget);
  EXPECT_EQ(out.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(out.client_set);
}

// The callback form of the token; the handler never runs inside the initiating call.
TEST_F(MitmTest, CallbackTokenCompletesAsynchronously) {
  asio::io_context ioc;
  bool returned = false, called_after_return = false;
  std::string rule;
  MitmRequest request{server_ctx_, upstream_ctx_, "bad name!",
                      std::chrono::steady_clock::now() + 1s};
  AsyncIntercept(std::move(request), beast::tcp_stream(ioc), beast::tcp_stream(ioc),
                 [&](MitmResult r) {
                   called_after_return = returned;
                   rule = r.rule;
                 });
  returned = true;
  ioc.run_for(5s);
  EXPECT_TRUE(called_after_return);
  EXPECT_EQ(rule, kRuleBadTarget);
}

// As esb-proxy runs it: a thread pool, one strand per connection, many tunnels at once through
// one environment's InterceptContext and one UpstreamContext.
TEST_F(MitmTest, ConcurrentInterceptionsOnAThreadPool) {
  constexpr int kConnections = 24;
  std::shared_ptr<const Leaf> leaf = LeafFrom(upstream_root_, "weather.test");
  ssl::context upstream_server(ssl::context::tls_server);
  SSL_CTX_use_certificate(upstream_server.native_handle(), leaf->cert.get());
  SSL_CTX_use_PrivateKey(upstream_server.native_handle(), leaf->key.get());
  ssl::context client_ctx(ssl::context::tls_client);
  client_ctx.add_certificate_authority(asio::buffer(env_ca_->cert_pem()));
  client_ctx.set_verify_mode(ssl::verify_peer);

  asio::io_context ioc;
  tcp::acceptor proxy_acceptor(ioc, {asio::ip::make_address("127.0.0.1"), 0});
  tcp::acceptor upstream_acceptor(ioc, {asio::ip::make_address("127.0.0.1"), 0});
  const tcp::endpoint proxy_ep = proxy_acceptor.local_endpoint();
  const tcp::endpoint upstream_ep = upstream_acceptor.local_endpoint();
  std::atomic<int> served{0}, intercepted{0}, answered{0};

  auto serve = [&](tcp::socket sock) -> asio::awaitable<void> {
    beast::error_code ec;
    auto tok = asio::redirect_error(asio::use_awaitable, ec);
    ssl::stream<tcp::socket> stream(std::move(sock), upstream_server);
    co_await stream.async_handshake(ssl::stream_base::server, tok);
    if (ec) co_return;
    std::string request;
    co_await asio::async_read_until(stream, asio::dynamic_buffer(request), "\r\n\r\n", tok);
    if (ec) co_return;
    std::string response = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello";
    co_await asio::async_write(stream, asio::buffer(response), tok);
    if (!ec) ++served;
  };
  auto handle = [&](tcp::socket client) -> asio::awaitable<void> {
    beast::error_code ec;
    auto tok = asio::redirect_error(asio::use_awaitable, ec);
    tcp::socket upstream(client.get_executor());
    co_await upstream.async_connect(upstream_ep, tok);
    if (ec) co_return;
    MitmRequest request{server_ctx_, upstream_ctx_, "weather.test",
                        std::chrono::steady_clock::now() + 10s};
    beast::tcp_stream client_stream(std::move(client));
    beast::tcp_stream upstream_stream(std::move(upstream));
    MitmResult r = co_await AsyncIntercept(std::move(request), std::move(client_stream),
                                           std::move(upstream_stream), asio::use_awaitable);
    if (!r.status.ok()) {
      ADD_FAILURE() << r.rule << ": " << r.status;
      co_return;
    }
    ++intercepted;
    beast::flat_buffer cbuf, ubuf;
    http::request<http::string_body> req;
    co_await http::async_read(*r.client, cbuf, req, tok);
    if (ec) co_return;
    co_await http::async_write(*r.upstream, req, tok);
    if (ec) co_return;
    http::response<http::string_body> res;
    co_await http::async_read(*r.upstream, ubuf, res, tok);
    if (ec) co_return;
    co_await http::async_write(*r.client, res, tok);
  };
  auto client = [&]() -> asio::awaitable<void> {
    beast::error_code ec;
    auto tok = asio::redirect_error(asio::use_awaitable, ec);
    tcp::socket sock(co_await asio::this_coro::executor);
    co_await sock.async_connect(proxy_ep, tok);
    if (ec) co_return;
    ssl::stream<tcp::socket> stream(std::move(sock), client_ctx);
    SSL_set_tlsext_host_name(stream.native_handle(), "weather.test");
    SSL_set1_host(stream.native_handle(), "weather.test");
    co_await stream.async_handshake(ssl::stream_base::client, tok);
    if (ec) co_return;
    std::string request = "GET / HTTP/1.1\r\nHost: weather.test\r\n\r\n";
    co_await asio::async_write(stream, asio::buffer(request), tok);
    std::string response;
    char buf[1024];
    while (!ec && response.find("hello") == std::string::npos) {
      size_t n = co_await stream.async_read_some(asio::buffer(buf), tok);
      response.append(buf, n);
    }
    if (response.find("hello") != std::string::npos) ++answered;
  };
  asio::co_spawn(
      ioc,
      [&]() -> asio::awaitable<void> {
        for (int i = 0; i < kConnections; ++i) {
          beast::error_code ec;
          tcp::socket s = co_await upstream_acceptor.async_accept(
              asio::make_strand(ioc), asio::redirect_error(asio::use_awaitable, ec));
          if (ec) co_return;
          asio::co_spawn(s.get_executor(), serve(std::move(s)), asio::detached);
        }
      },
      asio::detached);
  asio::co_spawn(
      ioc,
      [&]() -> asio::awaitable<void> {
        for (int i = 0; i < kConnections; ++i) {
          beast::error_code ec;
          tcp::socket s = co_await proxy_acceptor.async_accept(
              asio::make_strand(ioc), asio::redirect_error(asio::use_awaitable, ec));
          if (ec) co_return;
          asio::co_spawn(s.get_executor(), handle(std::move(s)), asio::detached);
        }
      },
      asio::detached);
  for (int i = 0; i < kConnections; ++i) {
    asio::co_spawn(asio::make_strand(ioc), client(), asio::detached);
  }
  std::vector<std::thread> pool;
  for (int t = 0; t < 4; ++t) pool.emplace_back([&] { ioc.run_for(30s); });
  for (std::thread& t : pool) t.join();
  EXPECT_EQ(intercepted.load(), kConnections);
  EXPECT_EQ(served.load(), kConnections);
  EXPECT_EQ(answered.load(), kConnections);
  EXPECT_EQ(server_ctx_->minter().minted(), 1u);  // one leaf, shared by every tunnel
}

TEST(UpstreamContextTest, RejectsAnUnreadableOrEmptyCaFile) {
  auto missing = UpstreamContext::Create("/nonexistent/upstream-ca.pem");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(missing.status().message().find("/nonexistent/upstream-ca.pem"), std::string::npos);

  std::string empty = TempPath("empty.pem");
  std::ofstream(empty) << "no certificates here\n";
  auto bad = UpstreamContext::Create(empty);
  EXPECT_FALSE(bad.ok());
  std::remove(empty.c_str());

  auto system_only = UpstreamContext::Create("");
  EXPECT_TRUE(system_only.ok()) << system_only.status();
}

}  // namespace
}  // namespace esb::governance::tls

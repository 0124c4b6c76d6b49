// egress_bench (bash bench/run.sh egress): what esb-proxy adds to a request, measured against
// direct requests to the same local upstream in the same run, interleaved in rounds so both see
// the same machine load.
//   keep-alive:  one kept-alive connection, GET of a small body; direct vs through the proxy
//                (absolute-URI HTTP, policy decision + DLP on URL and headers + audit event).
//   new TLS:     a new TCP+TLS connection per request; direct vs CONNECT + inspected TLS (leaf
//                from the env CA, verified TLS upstream, DLP, audit).
// Prints p50/p90 per path and the added p50 (delta and ratio).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/json.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/util.h"
#include "governance/control.h"
#include "governance/policy.h"
#include "governance/proxy/proxy.h"
#include "governance/tls/ca.h"

namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
namespace ssl = asio::ssl;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using namespace esb;
using namespace esb::governance;

// A small upstream: thread per connection, optional TLS, keep-alive, 64-byte answers.
class Upstream {
 public:
  explicit Upstream(ssl::context* tls) : tls_(tls) {
    acceptor_.open(tcp::v4());
    acceptor_.set_option(tcp::acceptor::reuse_address(true));
    acceptor_.bind(tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
    acceptor_.listen(1024);
    thread_ = std::thread([this] {
      for (;;) {
        tcp::socket s(ioc_);
        boost::system::error_code ec;
        acceptor_.accept(s, ec);
        if (ec) return;
        std::thread([this, s = std::move(s)]() mutable { Serve(std::move(s)); }).detach();
      }
    });
  }
  ~Upstream() {
    ::shutdown(acceptor_.native_handle(), SHUT_RDWR);
    thread_.join();
  }
  uint16_t port() const { return acceptor_.local_endpoint().port(); }

 private:
  template <class Stream>
  static void Loop(Stream& s) {
    beast::flat_buffer buf;
    boost::system::error_code ec;
    for (;;) {
      http::request<http::string_body> req;
      http::read(s, buf, req, ec);
      if (ec) return;
      http::response<http::string_body> res{http::status::ok, 11};
      res.body() = std::string(64, 'x');
      res.keep_alive(req.keep_alive());
      res.prepare_payload();
      http::write(s, res, ec);
      if (ec || !req.keep_alive()) return;
    }
  }
  void Serve(tcp::socket s) {
    s.set_option(tcp::no_delay(true));
    if (tls_ == nullptr) return Loop(s);
    ssl::stream<tcp::socket> t(std::move(s), *tls_);
    boost::system::error_code ec;
    t.handshake(ssl::stream_base::server, ec);
    if (!ec) Loop(t);
  }
  ssl::context* tls_;
  asio::io_context ioc_;
  tcp::acceptor acceptor_{ioc_};
  std::thread thread_;
};

struct Stats {
  std::vector<double> us;
  double P(double q) {
    std::sort(us.begin(), us.end());
    return us.empty() ? 0 : us[static_cast<size_t>(q * (us.size() - 1))];
  }
};

http::response<http::string_body> RoundTrip(auto& stream, beast::flat_buffer& buf,
                                            const std::string& target, const std::string& host) {
  http::request<http::empty_body> req{http::verb::get, target, 11};
  req.set(http::field::host, host);
  http::write(stream, req);
  http::response<http::string_body> res;
  http::read(stream, buf, res);
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  int keepalive_n = argc > 1 ? atoi(argv[1]) : 4000;
  int tls_n = argc > 2 ? atoi(argv[2]) : 400;
  const int kRounds = 20;

  // Upstream root + leaf for bench.test; env CA for the proxy.
  auto root_pem = *tls::GenerateCa("bench upstream root");
  auto root = *tls::Ca::FromPem(root_pem.cert_pem, root_pem.key_pem);
  auto leaf = *(*tls::LeafMinter::Create(root))->LeafFor("bench.test");
  auto env_ca = *tls::GenerateCa("bench env CA");
  char root_file[] = "/tmp/esb-egress-bench-XXXXXX";
  int rfd = mkstemp(root_file);
  if (write(rfd, root_pem.cert_pem.data(), root_pem.cert_pem.size()) < 0) return 1;
  close(rfd);

  ssl::context server_ctx(ssl::context::tls_server);
  SSL_CTX_use_certificate(server_ctx.native_handle(), leaf->cert.get());
  SSL_CTX_use_PrivateKey(server_ctx.native_handle(), leaf->key.get());
  Upstream plain(nullptr), secure(&server_ctx);

  proxy::SystemResolver::Options ro;
  ro.use_system = false;
  ro.overrides.push_back(
      *proxy::ParseResolveOverride("bench.test=127.0.0.1:" + std::to_string(plain.port())));
  proxy::ProxyOptions po;
  po.threads = 2;
  po.upstream_ca_file = root_file;
  po.use_system_roots = false;
  std::atomic<int64_t> audited{0};
  auto px = *proxy::Proxy::Create(po, std::make_shared<proxy::SystemResolver>(ro),
                                  [&](control::AuditEvent) { ++audited; });
  int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  listen(lfd, 1024);
  socklen_t len = sizeof(a);
  getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len);
  uint16_t proxy_port = ntohs(a.sin_port);
  control::Attach at;
  at.env_id = "bench";
  at.policy = *ParseEgressPolicy(boost::json::parse(R"({"allow":["bench.test"]})"));
  at.ca_cert_pem = env_ca.cert_pem;
  at.ca_key_pem = env_ca.key_pem;
  at.listener_fd = lfd;
  if (absl::Status s = px->Attach(std::move(at)); !s.ok()) {
    fprintf(stderr, "attach: %s\n", std::string(s.message()).c_str());
    return 1;
  }

  asio::io_context ioc;
  auto connect = [&](uint16_t port) {
    tcp::socket s(ioc);
    s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
    s.set_option(tcp::no_delay(true));
    return s;
  };

  // ---- keep-alive row
  Stats direct_ka, proxy_ka;
  {
    tcp::socket d = connect(plain.port()), p = connect(proxy_port);
    beast::flat_buffer db, pb;
    for (int i = 0; i < 50; ++i) {  // warm-up
      RoundTrip(d, db, "/w", "bench.test");
      RoundTrip(p, pb, "http://bench.test/w", "bench.test");
    }
    int per_round = keepalive_n / kRounds;
    for (int r = 0; r < kRounds; ++r) {
      for (int i = 0; i < per_round; ++i) {
        auto t0 = Clock::now();
        RoundTrip(d, db, "/r", "bench.test");
        direct_ka.us.push_back(
            std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      }
      for (int i = 0; i < per_round; ++i) {
        auto t0 = Clock::now();
        auto res = RoundTrip(p, pb, "http://bench.test/r", "bench.test");
        if (res.result_int() != 200) {
          fprintf(stderr, "proxy answered %d\n", res.result_int());
          return 1;
        }
        proxy_ka.us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      }
    }
  }

  // ---- new TLS connection row: the TLS upstream's leaf names bench.test, so a second proxy
  // maps bench.test to it.
  px->Detach("bench");
  ro.overrides.clear();
  ro.overrides.push_back(
      *proxy::ParseResolveOverride("bench.test=127.0.0.1:" + std::to_string(secure.port())));
  auto px2 = *proxy::Proxy::Create(po, std::make_shared<proxy::SystemResolver>(ro),
                                   [&](control::AuditEvent) { ++audited; });
  int lfd2 = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  a.sin_port = 0;
  bind(lfd2, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  listen(lfd2, 1024);
  len = sizeof(a);
  getsockname(lfd2, reinterpret_cast<sockaddr*>(&a), &len);
  uint16_t proxy_port2 = ntohs(a.sin_port);
  control::Attach at2;
  at2.env_id = "bench-tls";
  at2.policy = *ParseEgressPolicy(boost::json::parse(R"({"allow":["bench.test"]})"));
  at2.ca_cert_pem = env_ca.cert_pem;
  at2.ca_key_pem = env_ca.key_pem;
  at2.listener_fd = lfd2;
  if (!px2->Attach(std::move(at2)).ok()) return 1;

  ssl::context direct_ctx(ssl::context::tls_client), via_ctx(ssl::context::tls_client);
  direct_ctx.add_certificate_authority(asio::buffer(root_pem.cert_pem));
  direct_ctx.set_verify_mode(ssl::verify_peer);
  via_ctx.add_certificate_authority(asio::buffer(env_ca.cert_pem));
  via_ctx.set_verify_mode(ssl::verify_peer);
  auto tls_request = [&](bool via) {
    tcp::socket s = connect(via ? proxy_port2 : secure.port());
    beast::flat_buffer buf;
    if (via) {
      std::string c = "CONNECT bench.test:443 HTTP/1.1\r\nHost: bench.test:443\r\n\r\n";
      asio::write(s, asio::buffer(c));
      http::response_parser<http::empty_body> p;
      p.skip(true);
      http::read_header(s, buf, p);
      if (p.get().result_int() != 200) throw std::runtime_error("CONNECT refused");
    }
    ssl::stream<tcp::socket&> t(s, via ? via_ctx : direct_ctx);
    SSL_set_tlsext_host_name(t.native_handle(), "bench.test");
    t.set_verify_callback(ssl::host_name_verification("bench.test"));
    t.handshake(ssl::stream_base::client);
    beast::flat_buffer tb;
    http::request<http::empty_body> req{http::verb::get, "/t", 11};
    req.set(http::field::host, "bench.test");
    req.keep_alive(false);
    http::write(t, req);
    http::response<http::string_body> res;
    http::read(t, tb, res);
    boost::system::error_code ec;
    s.close(ec);
    return res.result_int();
  };
  Stats direct_tls, proxy_tls;
  for (int i = 0; i < 10; ++i) {
    tls_request(false);
    tls_request(true);
  }
  int per_round = std::max(1, tls_n / kRounds);
  for (int r = 0; r < kRounds; ++r) {
    for (int i = 0; i < per_round; ++i) {
      auto t0 = Clock::now();
      tls_request(false);
      direct_tls.us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    for (int i = 0; i < per_round; ++i) {
      auto t0 = Clock::now();
      if (tls_request(true) != 200) return 1;
      proxy_tls.us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
  }

  auto row = [](const char* name, Stats& d, Stats& p) {
    double dp50 = d.P(0.5), pp50 = p.P(0.5);
    printf(
        "%-34s direct p50 %8.1f us p90 %8.1f | proxy p50 %8.1f us p90 %8.1f | added p50 "
        "%+8.1f us (x%.2f)  n=%zu+%zu\n",
        name, dp50, d.P(0.9), pp50, p.P(0.9), pp50 - dp50, dp50 > 0 ? pp50 / dp50 : 0, d.us.size(),
        p.us.size());
  };
  printf(
      "egress_bench (same run, interleaved in %d rounds; DLP on with the default rules; "
      "audit events counted: %lld)\n",
      kRounds, static_cast<long long>(audited.load()));
  row("keep-alive GET (HTTP)", direct_ka, proxy_ka);
  row("new TLS connection + GET", direct_tls, proxy_tls);
  unlink(root_file);
  px->Stop();
  px2->Stop();
  return 0;
}

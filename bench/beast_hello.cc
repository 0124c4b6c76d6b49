// The baseline server for bench/transport_bench's /healthz throughput row: the smallest
// reasonable HTTP/1.1 keep-alive server on Boost.Beast (asynchronous, one io_context run by
// --threads threads), answering every request with a small JSON body. No limits, no timeouts,
// no routing: it is what "the transport alone" costs on this machine.
//
//   beast_hello --listen 127.0.0.1:PORT [--threads 2]
#include <sys/resource.h>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

class Session : public std::enable_shared_from_this<Session> {
 public:
  explicit Session(tcp::socket socket) : stream_(std::move(socket)) {}

  void Read() {
    req_ = {};
    http::async_read(
        stream_, buffer_, req_,
        [self = shared_from_this()](beast::error_code ec, size_t) { self->OnRead(ec); });
  }

 private:
  void OnRead(beast::error_code ec) {
    if (ec) return Close();
    res_ = {};
    res_.version(req_.version());
    res_.result(http::status::ok);
    res_.set(http::field::content_type, "application/json");
    res_.body() = "{\"status\":\"ok\"}\n";
    res_.keep_alive(req_.keep_alive());
    res_.prepare_payload();
    http::async_write(stream_, res_, [self = shared_from_this()](beast::error_code ec, size_t) {
      if (ec || !self->res_.keep_alive()) return self->Close();
      self->Read();
    });
  }

  void Close() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  http::request<http::string_body> req_;
  http::response<http::string_body> res_;
};

class Listener {
 public:
  Listener(asio::io_context& ioc, const tcp::endpoint& endpoint) : ioc_(ioc), acceptor_(ioc) {
    acceptor_.open(endpoint.protocol());
    acceptor_.set_option(asio::socket_base::reuse_address(true));
    acceptor_.bind(endpoint);
    acceptor_.listen(asio::socket_base::max_listen_connections);
  }

  void Accept() {
    acceptor_.async_accept(asio::make_strand(ioc_), [this](beast::error_code ec, tcp::socket s) {
      if (!ec) {
        std::make_shared<Session>(std::move(s))->Read();
      } else if (ec == asio::error::no_descriptors) {
        std::fprintf(stderr, "beast_hello: accept: %s\n", ec.message().c_str());
      }
      Accept();
    });
  }

 private:
  asio::io_context& ioc_;
  tcp::acceptor acceptor_;
};

}  // namespace

int main(int argc, char** argv) {
  std::string listen = "127.0.0.1:0";
  int threads = 2;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--listen" && i + 1 < argc) {
      listen = argv[++i];
    } else if (a == "--threads" && i + 1 < argc) {
      threads = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: beast_hello --listen HOST:PORT [--threads N]\n");
      return 2;
    }
  }
  size_t colon = listen.rfind(':');
  if (colon == std::string::npos) {
    std::fprintf(stderr, "beast_hello: --listen needs HOST:PORT\n");
    return 2;
  }
  // Every idle connection costs an fd, as in esbd (which takes its hard limit the same way).
  if (rlimit rl{}; getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  try {
    asio::io_context ioc(threads);
    tcp::endpoint endpoint(asio::ip::make_address(listen.substr(0, colon)),
                           static_cast<unsigned short>(std::atoi(listen.c_str() + colon + 1)));
    Listener listener(ioc, endpoint);
    listener.Accept();
    std::vector<std::thread> pool;
    for (int i = 1; i < threads; ++i) pool.emplace_back([&ioc] { ioc.run(); });
    ioc.run();
    for (auto& t : pool) t.join();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "beast_hello: %s\n", e.what());
    return 1;
  }
  return 0;
}

#include "cli/http_client.h"

#include <sys/socket.h>

#include <algorithm>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/beast/core/error.hpp>
#include <boost/beast/core/file.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
#include <cctype>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"

namespace esb::cli {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = boost::beast::http;
using tcp = asio::ip::tcp;

// A collected (non-streamed) body above this is not an esbd answer we understand.
constexpr size_t kMaxCollectedBody = 256u << 20;
constexpr size_t kChunkSize = 64u << 10;

class BeastTransport final : public HttpTransport {
 public:
  explicit BeastTransport(Endpoint endpoint) : ep_(std::move(endpoint)) {}

  absl::StatusOr<HttpResponse> Send(const HttpRequest& request, BodySink* sink) override {
    // SECURITY: a header name or value is one line: CR, LF or another control byte in one would
    // let its author (e.g. an MCP client's tool name, relayed by `esbd mcp-stdio`) add headers
    // or a second request. Refused before anything is sent.
    auto bad = [](unsigned char c) { return (c < 0x20 && c != '\t') || c == 0x7f; };
    if (std::any_of(request.target.begin(), request.target.end(),
                    [&](unsigned char c) { return bad(c) || c == ' ' || c == '\t'; })) {
      return absl::InvalidArgumentError(
          "cannot send the request: its path has a space or a control character");
    }
    for (const auto& [name, value] : request.headers) {
      if (name.empty() || std::any_of(name.begin(), name.end(), bad) ||
          name.find_first_of(" \t:") != std::string::npos ||
          std::any_of(value.begin(), value.end(), bad)) {
        return absl::InvalidArgumentError(
            "cannot send the request: header '" + name.substr(0, 64) +
            "' has a control character (CR, LF, ...) in its name or value");
      }
    }
    asio::io_context ioc;
    beast::error_code ec;
    if (!ep_.unix_socket.empty()) {
      asio::local::stream_protocol::socket socket(ioc);
      socket.connect(asio::local::stream_protocol::endpoint(ep_.unix_socket), ec);
      if (ec) {
        return absl::UnavailableError("cannot connect to esbd at unix:" + ep_.unix_socket + ": " +
                                      absl::AsciiStrToLower(ec.message()) + " (is esbd running?)");
      }
      return Exchange(socket, request, sink);
    }
    tcp::resolver resolver(ioc);
    tcp::socket socket(ioc);
    auto results = resolver.resolve(ep_.host, ep_.port, ec);
    if (ec) {
      return absl::UnavailableError("cannot connect to esbd at " + ep_.url +
                                    ": cannot resolve host '" + ep_.host + "': " + ec.message());
    }
    asio::connect(socket, results, ec);
    if (ec) {
      std::string why = ec == asio::error::connection_refused
                            ? "connection refused (is esbd running? start it with `make run`)"
                            : absl::AsciiStrToLower(ec.message());
      return absl::UnavailableError("cannot connect to esbd at " + ep_.url + ": " + why);
    }
    return Exchange(socket, request, sink);
  }

 private:
  template <class Socket>
  absl::StatusOr<HttpResponse> Exchange(Socket& socket, const HttpRequest& request,
                                        BodySink* sink) {
    if (request.abort && !request.abort->Attach(socket.native_handle()))
      return absl::CancelledError("request cancelled");
    struct Detach {
      RequestAbort* a;
      ~Detach() {
        if (a) a->Detach();
      }
    } detach{request.abort.get()};
    beast::error_code ec;
    beast::error_code write_ec;
    if (!request.body_file.empty()) {
      http::request<http::file_body> req;
      req.body().open(request.body_file.c_str(), beast::file_mode::scan, ec);
      if (ec) {
        return absl::NotFoundError("cannot read " + request.body_file + ": " + ec.message());
      }
      FillHeaders(request, req);
      req.prepare_payload();
      http::write(socket, req, write_ec);
    } else {
      http::request<http::string_body> req;
      req.body() = request.body;
      FillHeaders(request, req);
      req.prepare_payload();
      http::write(socket, req, write_ec);
    }
    // The daemon may answer (413, 401, ...) and close before it read the whole upload: try to
    // read its answer before reporting the write failure.
    absl::StatusOr<HttpResponse> response = ReadResponse(socket, sink);
    if (request.abort && request.abort->fired()) return absl::CancelledError("request cancelled");
    if (!response.ok() && write_ec) {
      return absl::UnavailableError("connection to esbd at " + ep_.url +
                                    " failed while sending: " + write_ec.message());
    }
    beast::error_code ignored;
    socket.shutdown(Socket::shutdown_both, ignored);
    return response;
  }

  template <class Message>
  void FillHeaders(const HttpRequest& request, Message& req) const {
    req.version(11);
    req.method_string(request.method);
    req.target(ep_.base_path + request.target);
    req.set(http::field::host, ep_.host_header);
    req.set(http::field::user_agent, "esb/" ESB_VERSION);
    req.set(http::field::connection, "close");
    for (const auto& [name, value] : request.headers) req.set(name, value);
  }

  template <class Socket>
  absl::StatusOr<HttpResponse> ReadResponse(Socket& socket, BodySink* sink) {
    beast::flat_buffer buffer;
    http::response_parser<http::buffer_body> parser;
    parser.body_limit(boost::none);  // streamed bodies (downloads) can be large
    beast::error_code ec;
    http::read_header(socket, buffer, parser, ec);
    if (ec) return Lost("reading the answer", ec);

    HttpResponse response;
    response.status = static_cast<int>(parser.get().result_int());
    response.content_type = std::string(parser.get()[http::field::content_type]);
    for (const auto& field : parser.get()) {
      response.headers.emplace_back(std::string(field.name_string()), std::string(field.value()));
    }
    response.streamed = sink != nullptr && sink->OnHeaders(response.status, response.content_type);

    std::string chunk(kChunkSize, '\0');
    while (!parser.is_done()) {
      parser.get().body().data = chunk.data();
      parser.get().body().size = chunk.size();
      // read_some, not read: read would wait until the whole chunk buffer is full, which holds
      // back a live stream.
      http::read_some(socket, buffer, parser, ec);
      if (ec == http::error::need_buffer) ec = {};
      // Hand over what arrived before looking at the error: a stream cut short still shows
      // the output that made it.
      const size_t n = chunk.size() - parser.get().body().size;
      std::string_view data(chunk.data(), n);
      if (n != 0 && response.streamed) {
        if (absl::Status s = sink->OnData(data); !s.ok()) return s;
      } else if (n != 0) {
        if (response.body.size() + n > kMaxCollectedBody) {
          return absl::ResourceExhaustedError("answer from esbd is too large (over 256 MiB)");
        }
        response.body.append(data);
      }
      if (ec) return Lost("reading the answer", ec);
    }
    return response;
  }

  absl::Status Lost(const std::string& what, const beast::error_code& ec) const {
    return absl::UnavailableError("connection to esbd at " + ep_.url + " failed while " + what +
                                  ": " + ec.message());
  }

  Endpoint ep_;
};

bool AllDigits(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<Endpoint> ParseUrl(std::string_view url) {
  std::string_view rest = url;
  const size_t scheme_end = rest.find("://");
  if (scheme_end != std::string_view::npos) {
    std::string scheme = absl::AsciiStrToLower(std::string(rest.substr(0, scheme_end)));
    if (scheme == "https") {
      return absl::InvalidArgumentError(
          "https:// URLs are not supported by esb yet; use http:// (put a TLS-terminating proxy "
          "in front of esbd for remote access)");
    }
    if (scheme != "http") {
      return absl::InvalidArgumentError("unsupported URL scheme '" + scheme + "' in '" +
                                        std::string(url) + "' (expected http://host:port)");
    }
    rest.remove_prefix(scheme_end + 3);
  }
  const size_t auth_end = rest.find_first_of("/?#");
  std::string_view authority = rest.substr(0, auth_end);
  std::string_view path = auth_end == std::string_view::npos ? "" : rest.substr(auth_end);
  if (authority.empty()) {
    return absl::InvalidArgumentError("no host in URL '" + std::string(url) + "'");
  }
  if (authority.find('@') != std::string_view::npos) {
    return absl::InvalidArgumentError("credentials in the URL are not supported; use --api-key");
  }
  if (path.find_first_of("?#") != std::string_view::npos) {
    return absl::InvalidArgumentError("the URL must not have a query or fragment: '" +
                                      std::string(url) + "'");
  }
  Endpoint ep;
  std::string_view port = "80";
  if (authority.front() == '[') {
    const size_t close = authority.find(']');
    if (close == std::string_view::npos) {
      return absl::InvalidArgumentError("bad IPv6 address in URL '" + std::string(url) + "'");
    }
    ep.host = std::string(authority.substr(1, close - 1));
    std::string_view after = authority.substr(close + 1);
    if (!after.empty()) {
      if (after.front() != ':') {
        return absl::InvalidArgumentError("bad URL '" + std::string(url) + "'");
      }
      port = after.substr(1);
    }
  } else {
    const size_t colon = authority.rfind(':');
    ep.host = std::string(authority.substr(0, colon));
    if (colon != std::string_view::npos) port = authority.substr(colon + 1);
  }
  if (ep.host.empty())
    return absl::InvalidArgumentError("no host in URL '" + std::string(url) + "'");
  if (!AllDigits(port) || port.size() > 5 || std::stoi(std::string(port)) < 1 ||
      std::stoi(std::string(port)) > 65535) {
    return absl::InvalidArgumentError("bad port '" + std::string(port) + "' in URL '" +
                                      std::string(url) + "'");
  }
  ep.port = std::string(port);
  ep.host_header = std::string(authority);
  while (!path.empty() && path.back() == '/') path.remove_suffix(1);
  ep.base_path = std::string(path);
  ep.url = "http://" + ep.host_header + ep.base_path;
  return ep;
}

Endpoint UnixEndpoint(std::string path) {
  Endpoint ep;
  ep.url = "unix:" + path;
  ep.host = "localhost";
  ep.host_header = "localhost";
  ep.unix_socket = std::move(path);
  return ep;
}

void RequestAbort::Fire() {
  std::lock_guard<std::mutex> lock(mu_);
  fired_ = true;
  // SECURITY: shutdown only (never close): the fd stays the transport's until it detaches, so a
  // racing Fire cannot hit a reused descriptor.
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

bool RequestAbort::fired() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fired_;
}

bool RequestAbort::Attach(int fd) {
  std::lock_guard<std::mutex> lock(mu_);
  if (fired_) return false;
  fd_ = fd;
  return true;
}

void RequestAbort::Detach() {
  std::lock_guard<std::mutex> lock(mu_);
  fd_ = -1;
}

std::string HttpResponse::Header(std::string_view name) const {
  for (const auto& [k, v] : headers) {
    if (absl::EqualsIgnoreCase(k, absl::string_view(name.data(), name.size()))) return v;
  }
  return "";
}

std::unique_ptr<HttpTransport> MakeBeastTransport(const Endpoint& endpoint) {
  return std::make_unique<BeastTransport>(endpoint);
}

std::string PercentEncode(std::string_view text, bool keep_slash) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : text) {
    if (std::isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~' ||
        (keep_slash && c == '/')) {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 0xf]);
    }
  }
  return out;
}

}  // namespace esb::cli

#include "packages/http_fetcher.h"

#include <openssl/ssl.h>
#include <openssl/x509_vfy.h>

#include <array>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <boost/json.hpp>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "packages/requirement.h"
#include "packages/url.h"

namespace esb::packages {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = boost::beast::http;
namespace ssl = boost::asio::ssl;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;

constexpr size_t kChunkSize = 64 << 10;
constexpr uint32_t kMaxHeaderBytes = 64 << 10;
// What of a proxy's refusal (its JSON body) is read, at most.
constexpr size_t kMaxRefusalBytes = 16 << 10;

#ifndef ESB_VERSION
#define ESB_VERSION "dev"
#endif

// getaddrinfo through Asio's synchronous resolver (which calls it in the calling thread).
absl::StatusOr<std::vector<std::string>> SystemResolve(const std::string& host) {
  asio::io_context ioc;
  tcp::resolver resolver(ioc);
  beast::error_code ec;
  auto results = resolver.resolve(host, "", ec);
  if (ec) return absl::UnavailableError(ec.message());
  std::vector<std::string> out;
  for (const auto& r : results) out.push_back(r.endpoint().address().to_string());
  return out;
}

// Resolves `url`'s host to endpoints, giving up at `deadline`. IP literals need no lookup.
// Otherwise the (uninterruptible) lookup runs on a detached thread that owns everything it
// touches: Asio's own async_resolve would not do, as its cancel() does not stop getaddrinfo and
// destroying the io_context joins the thread running it, i.e. waits for the lookup anyway.
absl::StatusOr<std::vector<tcp::endpoint>> ResolveBefore(
    const Url& url, Clock::time_point deadline,
    const BeastHttpFetcher::HostResolver& resolver) {
  const auto port = static_cast<unsigned short>(std::stoi(url.port));
  beast::error_code ec;
  asio::ip::address literal = asio::ip::make_address(url.host, ec);
  if (!ec) return std::vector<tcp::endpoint>{tcp::endpoint(literal, port)};

  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    absl::StatusOr<std::vector<std::string>> addresses;
  };
  auto shared = std::make_shared<Shared>();
  try {
    std::thread([shared, resolver, host = url.host] {
      auto addresses = resolver ? resolver(host) : SystemResolve(host);
      std::lock_guard<std::mutex> lock(shared->mu);
      shared->addresses = std::move(addresses);
      shared->done = true;
      shared->cv.notify_all();
    }).detach();
  } catch (const std::system_error& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve host '", url.host, "': no thread for the lookup: ", e.what()));
  }
  std::unique_lock<std::mutex> lock(shared->mu);
  if (!shared->cv.wait_until(lock, deadline, [&] { return shared->done; })) {
    return absl::DeadlineExceededError(absl::StrCat("timed out resolving ", url.host));
  }
  if (!shared->addresses.ok()) {
    return absl::UnavailableError(absl::StrCat("cannot resolve host '", url.host,
                                               "': ", shared->addresses.status().message()));
  }
  std::vector<tcp::endpoint> endpoints;
  for (const std::string& a : *shared->addresses) {
    asio::ip::address addr = asio::ip::make_address(a, ec);
    if (!ec) endpoints.emplace_back(addr, port);
  }
  if (endpoints.empty()) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve host '", url.host, "': no addresses"));
  }
  return endpoints;
}

// The client TLS context: system trust store plus, when given, the operator's CA bundle.
// Built per Get (not once per fetcher) so that changes to either are seen without a restart.
// `proxy_ca_pem`: the environment's CA when the request goes through its egress proxy.
absl::StatusOr<std::unique_ptr<ssl::context>> MakeTlsContext(const std::string& ca_file,
                                                             const std::string& proxy_ca_pem) {
  auto ctx = std::make_unique<ssl::context>(ssl::context::tls_client);
  beast::error_code ec;
  // A broken system store is not fatal on its own: a configured CA bundle may still suffice,
  // and otherwise verification fails with a clear reason.
  ctx->set_default_verify_paths(ec);
  ctx->set_verify_mode(ssl::verify_peer);
  if (!proxy_ca_pem.empty()) {
    ctx->add_certificate_authority(asio::buffer(proxy_ca_pem), ec);
    if (ec) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot load the environment's CA certificate: ", ec.message()));
    }
  }
  if (ca_file.empty()) return ctx;
  // OpenSSL reports a missing file only as "system lib"; name the errno ourselves.
  if (FILE* f = std::fopen(ca_file.c_str(), "r"); f == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("cannot read the CA bundle '", ca_file,
                                                      "': ", std::strerror(errno)));
  } else {
    std::fclose(f);
  }
  ctx->load_verify_file(ca_file, ec);
  if (ec) {
    return absl::FailedPreconditionError(absl::StrCat("cannot load the CA bundle '", ca_file,
                                                      "' (expected PEM certificates): ",
                                                      ec.message()));
  }
  return ctx;
}

// Verification results meaning "this certificate's issuer is not trusted here".
bool IssuerUnknown(long verify_result) {
  return verify_result == X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT_LOCALLY ||
         verify_result == X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT ||
         verify_result == X509_V_ERR_DEPTH_ZERO_SELF_SIGNED_CERT ||
         verify_result == X509_V_ERR_SELF_SIGNED_CERT_IN_CHAIN;
}

// Runs one asynchronous operation to completion on `ioc` (so the tcp_stream timeouts apply),
// but never past `deadline`: the stream timeouts should end every operation by then, and this
// makes sure of it (an operation still pending then is reported as a timeout; the caller then
// destroys the stream, and the io_context discards the handler without running it).
template <class Start>
beast::error_code RunOp(asio::io_context& ioc, Clock::time_point deadline, Start&& start) {
  beast::error_code result;
  bool done = false;
  start([&](beast::error_code ec, auto&&...) {
    result = ec;
    done = true;
  });
  ioc.restart();
  ioc.run_until(deadline);
  if (!done) return beast::error::timeout;
  return result;
}

// One request/response on an established stream. What a single hop produced.
struct Hop {
  int status = 0;
  std::string content_type;
  std::string location;
  int64_t body_bytes = 0;
};

class Request {
 public:
  // `tls` (needed for https only) is the context from MakeTlsContext.
  Request(const Url& url, const FetchLimits& limits, Clock::time_point deadline,
          const BodySink& sink, ssl::context* tls, const std::string& ca_file,
          const BeastHttpFetcher::HostResolver& resolver)
      : url_(url), limits_(limits), deadline_(deadline), sink_(sink), tls_(tls),
        ca_file_(ca_file), resolver_(resolver) {}

  absl::StatusOr<Hop> Run() {
    if (limits_.proxy != nullptr) return RunProxied();
    auto resolved =
        ResolveBefore(url_, std::min(deadline_, Clock::now() + limits_.connect_timeout), resolver_);
    if (!resolved.ok()) return resolved.status();
    const std::vector<tcp::endpoint>& endpoints = *resolved;
    if (url_.scheme == "https") {
      if (tls_ == nullptr) return absl::InternalError("https request without a TLS context");
      beast::ssl_stream<beast::tcp_stream> stream(ioc_, *tls_);
      if (auto s = VerifyHost(stream); !s.ok()) return s;
      if (auto s = Connect(beast::get_lowest_layer(stream), endpoints); !s.ok()) return s;
      if (auto s = Handshake(stream); !s.ok()) return s;
      return Exchange(stream, beast::get_lowest_layer(stream));
    }
    beast::tcp_stream stream(ioc_);
    if (auto s = Connect(stream, endpoints); !s.ok()) return s;
    return Exchange(stream, stream);
  }

 private:
  // Through the environment's egress proxy: a fresh proxied connection for this hop, then an
  // absolute-URI request (http) or CONNECT and TLS inside the tunnel (https).
  absl::StatusOr<Hop> RunProxied() {
    if (url_.scheme == "https") {
      if (tls_ == nullptr) return absl::InternalError("https request without a TLS context");
      beast::ssl_stream<beast::tcp_stream> stream(ioc_, *tls_);
      if (auto s = VerifyHost(stream); !s.ok()) return s;
      if (auto s = ConnectProxy(beast::get_lowest_layer(stream)); !s.ok()) return s;
      if (auto s = Tunnel(beast::get_lowest_layer(stream)); !s.ok()) return s;
      if (auto s = Handshake(stream); !s.ok()) return s;
      return Exchange(stream, beast::get_lowest_layer(stream));
    }
    beast::tcp_stream stream(ioc_);
    if (auto s = ConnectProxy(stream); !s.ok()) return s;
    return Exchange(stream, stream, /*absolute_target=*/true);
  }

  absl::Status VerifyHost(beast::ssl_stream<beast::tcp_stream>& stream) {
    SSL* ssl = stream.native_handle();
    // SECURITY: the certificate must name the URL's host (DNS name, or IP address for an IP
    // literal, no partial wildcards). OpenSSL's own check, so a mismatch is reported as
    // such ("hostname mismatch") in the verify result. SNI only for names (RFC 6066 §3).
    X509_VERIFY_PARAM* param = SSL_get0_param(ssl);
    X509_VERIFY_PARAM_set_hostflags(param, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
    if (X509_VERIFY_PARAM_set1_ip_asc(param, url_.host.c_str()) != 1) {
      if (X509_VERIFY_PARAM_set1_host(param, url_.host.c_str(), 0) != 1 ||
          !SSL_set_tlsext_host_name(ssl, url_.host.c_str())) {
        return absl::InternalError("cannot set TLS server name for " + url_.host);
      }
    }
    return absl::OkStatus();
  }

  absl::Status Handshake(beast::ssl_stream<beast::tcp_stream>& stream) {
    if (auto s = Expire(beast::get_lowest_layer(stream), "TLS handshake"); !s.ok()) return s;
    beast::error_code ec = RunOp(ioc_, deadline_, [&](auto handler) {
      stream.async_handshake(ssl::stream_base::client, handler);
    });
    if (ec) {
      long verify = SSL_get_verify_result(stream.native_handle());
      if (verify != X509_V_OK) return Untrusted(verify);
      return Failure(ec, "TLS handshake");
    }
    return absl::OkStatus();
  }

  // A socket connected to the proxy (ProxyRoute::connect), adopted by `stream`.
  absl::Status ConnectProxy(beast::tcp_stream& stream) {
    auto remaining =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now());
    if (remaining <= std::chrono::milliseconds::zero()) return Timeout("connecting to the proxy");
    absl::StatusOr<UniqueFd> fd =
        limits_.proxy->connect(std::min(remaining, limits_.connect_timeout));
    if (!fd.ok()) {
      return absl::Status(absl::IsDeadlineExceeded(fd.status())
                              ? absl::StatusCode::kDeadlineExceeded
                              : absl::StatusCode::kUnavailable,
                          absl::StrCat("cannot reach the environment's egress proxy for ",
                                       url_.ToString(), ": ", fd.status().message()));
    }
    beast::error_code ec;
    stream.socket().assign(tcp::v4(), fd->get(), ec);
    if (ec) return absl::InternalError("cannot adopt the proxy socket: " + ec.message());
    (void)fd->release();  // the stream owns it now
    return absl::OkStatus();
  }

  // CONNECT host:port through the proxy; OK once it answered 2xx (the tunnel is open).
  absl::Status Tunnel(beast::tcp_stream& stream) {
    http::request<http::empty_body> req{http::verb::connect, url_.HostPort(), 11};
    req.set(http::field::host, url_.HostPort());
    req.set(http::field::user_agent, "esbd/" ESB_VERSION);
    if (auto s = Expire(stream, "CONNECT"); !s.ok()) return s;
    beast::error_code ec =
        RunOp(ioc_, deadline_, [&](auto h) { http::async_write(stream, req, h); });
    if (ec) return Failure(ec, "sending CONNECT to the proxy");
    beast::flat_buffer buffer;
    http::response_parser<http::buffer_body> parser;
    parser.header_limit(kMaxHeaderBytes);
    parser.body_limit(boost::none);
    if (auto s = Expire(stream, "waiting for the proxy"); !s.ok()) return s;
    ec =
        RunOp(ioc_, deadline_, [&](auto h) { http::async_read_header(stream, buffer, parser, h); });
    if (ec) return Failure(ec, "reading the proxy's answer to CONNECT");
    const int status = static_cast<int>(parser.get().result_int());
    if (status >= 200 && status < 300) {
      // SECURITY: nothing may precede our ClientHello: bytes here would be a server speaking
      // before the handshake, i.e. not the tunnel we asked for.
      if (buffer.size() != 0) {
        return absl::UnavailableError(absl::StrCat(
            "the egress proxy sent data before the TLS handshake to ", url_.HostPort()));
      }
      return absl::OkStatus();
    }
    return Refused(stream, buffer, parser, status);
  }

  // The proxy's (or, inside a tunnel, the upstream's) non-2xx answer as a Status. A 403 with
  // X-Esb-Blocked on a proxied request is the environment's egress policy refusing it.
  template <class Stream>
  absl::Status Refused(Stream& stream, beast::flat_buffer& buffer,
                       http::response_parser<http::buffer_body>& parser, int status) {
    if (limits_.proxy == nullptr || status != 403 ||
        parser.get().find("X-Esb-Blocked") == parser.get().end()) {
      return HttpStatusError(status, url_.ToString());
    }
    const std::string rule = Printable(std::string(parser.get()["X-Esb-Blocked"]), 200);
    std::string body;
    std::array<char, 4096> chunk;
    while (!parser.is_done() && body.size() < kMaxRefusalBytes) {
      parser.get().body().data = chunk.data();
      parser.get().body().size = chunk.size();
      if (!Expire(beast::get_lowest_layer(stream), "reading the refusal").ok()) break;
      beast::error_code ec =
          RunOp(ioc_, deadline_, [&](auto h) { http::async_read(stream, buffer, parser, h); });
      if (ec == http::error::need_buffer) ec = {};
      body.append(chunk.data(), chunk.size() - parser.get().body().size);
      if (ec) break;
    }
    std::string reason;
    boost::system::error_code jec;
    boost::json::value v = boost::json::parse(body.substr(0, kMaxRefusalBytes), jec);
    if (!jec && v.is_object()) {
      if (const boost::json::value* r = v.as_object().if_contains("reason"); r && r->is_string())
        reason = Printable(std::string(r->as_string()), 300);
    }
    return absl::PermissionDeniedError(absl::StrCat("the environment's egress policy refuses ",
                                                    url_.HostPort(), " (rule '", rule, "')",
                                                    reason.empty() ? "" : ": ", reason));
  }

  absl::Status Connect(beast::tcp_stream& stream, const std::vector<tcp::endpoint>& endpoints) {
    auto remaining = deadline_ - Clock::now();
    if (remaining <= Clock::duration::zero()) return Timeout("connecting");
    stream.expires_after(std::min<Clock::duration>(remaining, limits_.connect_timeout));
    beast::error_code ec = RunOp(ioc_, deadline_, [&](auto handler) {
      stream.async_connect(endpoints, [handler](beast::error_code e, const tcp::endpoint&) {
        handler(e);
      });
    });
    if (ec == beast::error::timeout) {
      return absl::DeadlineExceededError(
          absl::StrCat("timed out after ", limits_.connect_timeout.count(),
                       " ms connecting to ", url_.HostPort()));
    }
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("cannot connect to ", url_.HostPort(), ": ", ec.message()));
    }
    return absl::OkStatus();
  }

  absl::Status Expire(beast::tcp_stream& stream, absl::string_view phase) {
    auto remaining = deadline_ - Clock::now();
    if (remaining <= Clock::duration::zero()) return Timeout(phase);
    stream.expires_after(remaining);
    return absl::OkStatus();
  }

  absl::Status Timeout(absl::string_view phase) {
    return absl::DeadlineExceededError(absl::StrCat("request to ", url_.ToString(),
                                                    " timed out after ", limits_.timeout.count(),
                                                    " ms (", phase, ")"));
  }

  absl::Status Untrusted(long verify_result) {
    std::string msg = absl::StrCat("TLS certificate verification failed for ", url_.HostPort(),
                                   ": ", X509_verify_cert_error_string(verify_result));
    if (IssuerUnknown(verify_result) && limits_.proxy != nullptr) {
      absl::StrAppend(&msg, " (trusted: the environment's CA, the system store",
                      ca_file_.empty() ? "" : absl::StrCat(" and '", ca_file_, "'"), ")");
    } else if (IssuerUnknown(verify_result)) {
      absl::StrAppend(&msg, ca_file_.empty()
                                ? " (the system trust store has no CA for it; for a private CA, "
                                  "configure a CA bundle)"
                                : absl::StrCat(" (trusted: the system store and '", ca_file_,
                                               "')"));
    }
    return absl::FailedPreconditionError(msg);
  }

  absl::Status Failure(beast::error_code ec, absl::string_view phase) {
    if (ec == beast::error::timeout) return Timeout(phase);
    return absl::UnavailableError(
        absl::StrCat("request to ", url_.ToString(), " failed (", phase, "): ", ec.message()));
  }

  // `absolute_target`: the request line carries the whole URL (a plain-http proxy request).
  template <class Stream>
  absl::StatusOr<Hop> Exchange(Stream& stream, beast::tcp_stream& lowest,
                               bool absolute_target = false) {
    http::request<http::empty_body> req{http::verb::get,
                                        absolute_target ? url_.ToString() : url_.target, 11};
    req.set(http::field::host, url_.HostPort());
    req.set(http::field::user_agent, "esbd/" ESB_VERSION);
    req.set(http::field::accept, limits_.accept.empty() ? "*/*" : limits_.accept);
    req.set(http::field::accept_encoding, "identity");
    req.set(http::field::connection, "close");
    if (auto s = Expire(lowest, "sending the request"); !s.ok()) return s;
    beast::error_code ec =
        RunOp(ioc_, deadline_, [&](auto h) { http::async_write(stream, req, h); });
    if (ec) return Failure(ec, "sending the request");

    beast::flat_buffer buffer;
    http::response_parser<http::buffer_body> parser;
    parser.header_limit(kMaxHeaderBytes);
    parser.body_limit(boost::none);  // counted below, for a clear error
    if (auto s = Expire(lowest, "waiting for the response"); !s.ok()) return s;
    ec = RunOp(ioc_, deadline_,
               [&](auto h) { http::async_read_header(stream, buffer, parser, h); });
    if (ec) return Failure(ec, "reading the response header");

    Hop hop;
    const auto& msg = parser.get();
    hop.status = static_cast<int>(msg.result_int());
    hop.content_type = std::string(msg[http::field::content_type]);
    if (hop.status >= 300 && hop.status < 400) {
      hop.location = std::string(msg[http::field::location]);
      return hop;
    }
    if (hop.status < 200 || hop.status >= 300) return Refused(stream, buffer, parser, hop.status);
    if (parser.content_length() && *parser.content_length() >
                                       static_cast<uint64_t>(limits_.max_body_bytes)) {
      return TooLarge(static_cast<int64_t>(*parser.content_length()));
    }
    std::array<char, kChunkSize> chunk;
    while (!parser.is_done()) {
      parser.get().body().data = chunk.data();
      parser.get().body().size = chunk.size();
      if (auto s = Expire(lowest, "reading the body"); !s.ok()) return s;
      ec = RunOp(ioc_, deadline_, [&](auto h) { http::async_read(stream, buffer, parser, h); });
      if (ec == http::error::need_buffer) ec = {};
      if (ec) return Failure(ec, "reading the body");
      size_t n = chunk.size() - parser.get().body().size;
      hop.body_bytes += static_cast<int64_t>(n);
      if (hop.body_bytes > limits_.max_body_bytes) return TooLarge(hop.body_bytes);
      if (n > 0) {
        if (auto s = sink_(std::string_view(chunk.data(), n)); !s.ok()) return s;
      }
    }
    return hop;
  }

  absl::Status TooLarge(int64_t seen) {
    return absl::ResourceExhaustedError(absl::StrCat("response from ", url_.ToString(),
                                                     " exceeds the limit of ",
                                                     limits_.max_body_bytes, " bytes (at least ",
                                                     seen, ")"));
  }

  asio::io_context ioc_;
  const Url& url_;
  const FetchLimits& limits_;
  Clock::time_point deadline_;
  const BodySink& sink_;
  ssl::context* tls_;
  const std::string& ca_file_;
  const BeastHttpFetcher::HostResolver& resolver_;
};

}  // namespace

absl::Status HttpStatusError(int status, const std::string& url) {
  std::string msg = absl::StrCat("HTTP ", status, " from ", url);
  if (status == 404 || status == 410) return absl::NotFoundError(msg);
  if (status == 401 || status == 403) return absl::PermissionDeniedError(msg);
  if (status == 408 || status == 429 || status >= 500) return absl::UnavailableError(msg);
  return absl::FailedPreconditionError(msg);
}

bool IsUnreachable(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status);
}

BeastHttpFetcher::BeastHttpFetcher(std::string ca_file, HostResolver resolver)
    : ca_file_(std::move(ca_file)), resolver_(std::move(resolver)) {}

absl::StatusOr<HttpResult> BeastHttpFetcher::Get(const std::string& url, const FetchLimits& limits,
                                                 const BodySink& sink) {
  const Clock::time_point deadline = Clock::now() + limits.timeout;
  auto first = ParseUrl(url);
  if (!first.ok()) return first.status();
  std::vector<std::string> allowed = limits.allowed_hosts;
  if (allowed.empty()) allowed.push_back(first->HostPort());
  // A configured CA bundle is checked up front, whatever the scheme: a broken trust setting
  // should fail loudly, not only once a redirect reaches https.
  std::unique_ptr<ssl::context> tls;
  auto need_tls = [&]() -> absl::Status {
    if (tls != nullptr) return absl::OkStatus();
    auto made = MakeTlsContext(ca_file_, limits.proxy ? limits.proxy->ca_pem : "");
    if (!made.ok()) return made.status();
    tls = std::move(*made);
    return absl::OkStatus();
  };
  if (!ca_file_.empty() || limits.proxy != nullptr) {
    if (limits.proxy != nullptr && !limits.proxy->connect) {
      return absl::InternalError("proxied fetch without a way to reach the proxy");
    }
    if (auto s = need_tls(); !s.ok()) return s;
  }
  std::string current = url;
  for (int hops = 0;; ++hops) {
    auto u = ParseUrl(current);
    if (!u.ok()) return u.status();
    if (!HostAllowed(*u, allowed)) {
      return absl::PermissionDeniedError(absl::StrCat(
          "host '", u->HostPort(), "' is not in the allowed hosts (",
          absl::StrJoin(allowed, ", "), ")", hops > 0 ? " (redirected from " + url + ")" : ""));
    }
    if (u->scheme == "https") {
      if (auto s = need_tls(); !s.ok()) return s;
    }
    Request request(*u, limits, deadline, sink, tls.get(), ca_file_, resolver_);
    auto hop = request.Run();
    if (!hop.ok()) return hop.status();
    if (hop->status >= 300 && hop->status < 400) {
      if (hop->location.empty()) {
        return absl::FailedPreconditionError(
            absl::StrCat("HTTP ", hop->status, " without Location from ", u->ToString()));
      }
      if (hops >= limits.max_redirects) {
        return absl::FailedPreconditionError(
            absl::StrCat("too many redirects (more than ", limits.max_redirects, ") from ", url));
      }
      auto next = ResolveUrl(u->ToString(), hop->location);
      if (!next.ok()) return next.status();
      if (u->scheme == "https" && next->rfind("https://", 0) != 0) {
        return absl::PermissionDeniedError(
            absl::StrCat("refusing redirect from https to ", *next));
      }
      current = *next;
      continue;
    }
    HttpResult result;
    result.status = hop->status;
    result.content_type = hop->content_type;
    result.final_url = u->ToString();
    result.body_bytes = hop->body_bytes;
    return result;
  }
}

}  // namespace esb::packages

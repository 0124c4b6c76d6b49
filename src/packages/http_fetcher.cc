#include "packages/http_fetcher.h"

#include <openssl/ssl.h>

#include <array>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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

#ifndef ESB_VERSION
#define ESB_VERSION "dev"
#endif

bool HostAllowed(const Url& u, const std::vector<std::string>& allowed) {
  for (const auto& a : allowed) {
    std::string entry = absl::AsciiStrToLower(a);
    if (entry == u.host || entry == u.HostPort() || entry == absl::StrCat(u.host, ":", u.port)) {
      return true;
    }
  }
  return false;
}

// Runs one asynchronous operation to completion on `ioc` (so the tcp_stream timeouts apply).
template <class Start>
beast::error_code RunOp(asio::io_context& ioc, Start&& start) {
  beast::error_code result;
  bool done = false;
  start([&](beast::error_code ec, auto&&...) {
    result = ec;
    done = true;
  });
  ioc.restart();
  ioc.run();
  if (!done) return asio::error::operation_aborted;
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
  Request(const Url& url, const FetchLimits& limits, Clock::time_point deadline,
          const BodySink& sink)
      : url_(url), limits_(limits), deadline_(deadline), sink_(sink) {}

  absl::StatusOr<Hop> Run() {
    tcp::resolver resolver(ioc_);
    tcp::resolver::results_type endpoints;
    {
      // The resolver has no timeout of its own: cancel it with a timer.
      asio::steady_timer timer(ioc_);
      timer.expires_at(std::min(deadline_, Clock::now() + limits_.connect_timeout));
      timer.async_wait([&](beast::error_code ec) {
        if (!ec) resolver.cancel();
      });
      beast::error_code ec = RunOp(ioc_, [&](auto handler) {
        resolver.async_resolve(url_.host, url_.port,
                               [&, handler](beast::error_code e, tcp::resolver::results_type r) {
                                 endpoints = std::move(r);
                                 timer.cancel();
                                 handler(e);
                               });
      });
      if (ec == asio::error::operation_aborted) {
        return absl::DeadlineExceededError(absl::StrCat("timed out resolving ", url_.host));
      }
      if (ec) {
        return absl::UnavailableError(
            absl::StrCat("cannot resolve host '", url_.host, "': ", ec.message()));
      }
    }
    if (url_.scheme == "https") {
      ssl::context ctx(ssl::context::tls_client);
      ctx.set_default_verify_paths();
      ctx.set_verify_mode(ssl::verify_peer);
      beast::ssl_stream<beast::tcp_stream> stream(ioc_, ctx);
      // SNI, and reject certificates that do not name the host.
      if (!SSL_set_tlsext_host_name(stream.native_handle(), url_.host.c_str())) {
        return absl::InternalError("cannot set TLS server name for " + url_.host);
      }
      stream.set_verify_callback(ssl::host_name_verification(url_.host));
      if (auto s = Connect(beast::get_lowest_layer(stream), endpoints); !s.ok()) return s;
      if (auto s = Expire(beast::get_lowest_layer(stream), "TLS handshake"); !s.ok()) return s;
      beast::error_code ec = RunOp(ioc_, [&](auto handler) {
        stream.async_handshake(ssl::stream_base::client, handler);
      });
      if (ec) return Failure(ec, "TLS handshake");
      return Exchange(stream, beast::get_lowest_layer(stream));
    }
    beast::tcp_stream stream(ioc_);
    if (auto s = Connect(stream, endpoints); !s.ok()) return s;
    return Exchange(stream, stream);
  }

 private:
  absl::Status Connect(beast::tcp_stream& stream, const tcp::resolver::results_type& endpoints) {
    auto remaining = deadline_ - Clock::now();
    if (remaining <= Clock::duration::zero()) return Timeout("connecting");
    stream.expires_after(std::min<Clock::duration>(remaining, limits_.connect_timeout));
    beast::error_code ec = RunOp(ioc_, [&](auto handler) {
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

  absl::Status Failure(beast::error_code ec, absl::string_view phase) {
    if (ec == beast::error::timeout) return Timeout(phase);
    return absl::UnavailableError(
        absl::StrCat("request to ", url_.ToString(), " failed (", phase, "): ", ec.message()));
  }

  template <class Stream>
  absl::StatusOr<Hop> Exchange(Stream& stream, beast::tcp_stream& lowest) {
    http::request<http::empty_body> req{http::verb::get, url_.target, 11};
    req.set(http::field::host, url_.HostPort());
    req.set(http::field::user_agent, "esbd/" ESB_VERSION);
    req.set(http::field::accept, limits_.accept.empty() ? "*/*" : limits_.accept);
    req.set(http::field::accept_encoding, "identity");
    req.set(http::field::connection, "close");
    if (auto s = Expire(lowest, "sending the request"); !s.ok()) return s;
    beast::error_code ec = RunOp(ioc_, [&](auto h) { http::async_write(stream, req, h); });
    if (ec) return Failure(ec, "sending the request");

    beast::flat_buffer buffer;
    http::response_parser<http::buffer_body> parser;
    parser.header_limit(kMaxHeaderBytes);
    parser.body_limit(boost::none);  // counted below, for a clear error
    if (auto s = Expire(lowest, "waiting for the response"); !s.ok()) return s;
    ec = RunOp(ioc_, [&](auto h) { http::async_read_header(stream, buffer, parser, h); });
    if (ec) return Failure(ec, "reading the response header");

    Hop hop;
    const auto& msg = parser.get();
    hop.status = static_cast<int>(msg.result_int());
    hop.content_type = std::string(msg[http::field::content_type]);
    if (hop.status >= 300 && hop.status < 400) {
      hop.location = std::string(msg[http::field::location]);
      return hop;
    }
    if (hop.status < 200 || hop.status >= 300) return HttpStatusError(hop.status, url_.ToString());
    if (parser.content_length() && *parser.content_length() >
                                       static_cast<uint64_t>(limits_.max_body_bytes)) {
      return TooLarge(static_cast<int64_t>(*parser.content_length()));
    }
    std::array<char, kChunkSize> chunk;
    while (!parser.is_done()) {
      parser.get().body().data = chunk.data();
      parser.get().body().size = chunk.size();
      if (auto s = Expire(lowest, "reading the body"); !s.ok()) return s;
      ec = RunOp(ioc_, [&](auto h) { http::async_read(stream, buffer, parser, h); });
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

absl::StatusOr<HttpResult> BeastHttpFetcher::Get(const std::string& url, const FetchLimits& limits,
                                                 const BodySink& sink) {
  const Clock::time_point deadline = Clock::now() + limits.timeout;
  auto first = ParseUrl(url);
  if (!first.ok()) return first.status();
  std::vector<std::string> allowed = limits.allowed_hosts;
  if (allowed.empty()) allowed.push_back(first->HostPort());
  std::string current = url;
  for (int hops = 0;; ++hops) {
    auto u = ParseUrl(current);
    if (!u.ok()) return u.status();
    if (!HostAllowed(*u, allowed)) {
      return absl::PermissionDeniedError(absl::StrCat(
          "host '", u->HostPort(), "' is not in the allowed hosts (",
          absl::StrJoin(allowed, ", "), ")", hops > 0 ? " (redirected from " + url + ")" : ""));
    }
    Request request(*u, limits, deadline, sink);
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

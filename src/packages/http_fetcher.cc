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
absl::StatusOr<std::unique_ptr<ssl::context>> MakeTlsContext(const std::string& ca_file) {
  auto ctx = std::make_unique<ssl::context>(ssl::context::tls_client);
  beast::error_code ec;
  // A broken system store is not fatal on its own: a configured CA bundle may still suffice,
  // and otherwise verification fails with a clear reason.
  ctx->set_default_verify_paths(ec);
  ctx->set_verify_mode(ssl::verify_peer);
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
    auto resolved =
        ResolveBefore(url_, std::min(deadline_, Clock::now() + limits_.connect_timeout), resolver_);
    if (!resolved.ok()) return resolved.status();
    const std::vector<tcp::endpoint>& endpoints = *resolved;
    if (url_.scheme == "https") {
      if (tls_ == nullptr) return absl::InternalError("https request without a TLS context");
      beast::ssl_stream<beast::tcp_stream> stream(ioc_, *tls_);
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
      if (auto s = Connect(beast::get_lowest_layer(stream), endpoints); !s.ok()) return s;
      if (auto s = Expire(beast::get_lowest_layer(stream), "TLS handshake"); !s.ok()) return s;
      beast::error_code ec = RunOp(ioc_, deadline_, [&](auto handler) {
        stream.async_handshake(ssl::stream_base::client, handler);
      });
      if (ec) {
        long verify = SSL_get_verify_result(ssl);
        if (verify != X509_V_OK) return Untrusted(verify);
        return Failure(ec, "TLS handshake");
      }
      return Exchange(stream, beast::get_lowest_layer(stream));
    }
    beast::tcp_stream stream(ioc_);
    if (auto s = Connect(stream, endpoints); !s.ok()) return s;
    return Exchange(stream, stream);
  }

 private:
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
    if (IssuerUnknown(verify_result)) {
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

  template <class Stream>
  absl::StatusOr<Hop> Exchange(Stream& stream, beast::tcp_stream& lowest) {
    http::request<http::empty_body> req{http::verb::get, url_.target, 11};
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
    auto made = MakeTlsContext(ca_file_);
    if (!made.ok()) return made.status();
    tls = std::move(*made);
    return absl::OkStatus();
  };
  if (!ca_file_.empty()) {
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

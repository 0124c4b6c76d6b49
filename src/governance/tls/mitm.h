// TLS interception of one CONNECT tunnel (issue 12, governance.md §C3/§D.6).
//
// esb-proxy accepts a CONNECT host:port, checks the policy, resolves and connects the upstream
// itself, writes "HTTP/1.1 200 Connection established" to the client and then calls
// AsyncIntercept with both TCP streams. It performs, under one deadline:
//   1. the server handshake with the client, presenting a leaf for the target minted by the
//      environment's CA; the ClientHello's SNI must equal the CONNECT target (no SNI → the
//      target is used); a mismatch is refused with rule "tls:sni_mismatch";
//   2. the client handshake with the upstream, verified against the system roots plus the
//      extra roots (--egress-upstream-ca) and the target's name; a failure is rule
//      "tls:upstream_unverified" (certificate) or "tls:upstream_handshake" (anything else).
// On success both streams are returned as beast::ssl_stream<beast::tcp_stream>: Beast's
// http::async_read/async_write work on them directly, and the tcp_stream underneath keeps
// expires_after/expires_at for the proxy's per-request deadlines.
//
// Contract for the caller (esb-proxy):
// - The CONNECT request must have been read completely with nothing buffered after it (a
//   client that sends its ClientHello before the 200 would have those bytes stuck in the
//   proxy's read buffer): refuse such a client instead of calling AsyncIntercept.
// - Both streams must use the same executor (a strand, or an io_context run by one thread per
//   connection); the handshakes run on it and the handler is invoked through the token's
//   associated executor (default: that same one).
// - The InterceptContext and UpstreamContext are kept alive by the result (MitmResult) for as
//   long as the streams live.
#pragma once

#include <boost/asio/async_result.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/ssl/stream.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/ssl/ssl_stream.hpp>
#include <chrono>
#include <memory>
#include <string>
#include <utility>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "governance/tls/context.h"

namespace esb::governance::tls {

using SslStream = boost::beast::ssl_stream<boost::beast::tcp_stream>;

// Stable rule ids (audit rows, X-Esb-Blocked).
inline constexpr std::string_view kRuleSniMismatch = "tls:sni_mismatch";
// The client refused our certificate (it does not trust the env CA: alert unknown_ca / bad
// certificate), or spoke something other than TLS, or hung up.
inline constexpr std::string_view kRuleClientHandshake = "tls:client_handshake";
inline constexpr std::string_view kRuleUpstreamUnverified = "tls:upstream_unverified";
inline constexpr std::string_view kRuleUpstreamHandshake = "tls:upstream_handshake";
// The deadline passed during a handshake (status DeadlineExceeded).
inline constexpr std::string_view kRuleTimeout = "tls:timeout";
// The target is not a host a certificate can be minted for.
inline constexpr std::string_view kRuleBadTarget = "tls:bad_target";

struct MitmResult {
  // Keep these first: the streams below hold references into the contexts, and members are
  // destroyed in reverse order.
  std::shared_ptr<InterceptContext> server_ctx;
  std::shared_ptr<UpstreamContext> upstream_ctx;

  // OK: both streams are set and ready for HTTP/1.1. Otherwise `rule` names the failure and
  // `status` explains it (FailedPrecondition for sni_mismatch, upstream_unverified and
  // client_handshake, Unavailable for upstream_handshake, DeadlineExceeded for timeout,
  // InvalidArgument for bad_target).
  absl::Status status;
  std::string rule;

  std::string target_host;  // normalized
  std::string sni;          // what the client sent ("" = no SNI)
  // Set once the client handshake succeeded, even when the upstream one failed afterwards:
  // the proxy can then answer inside TLS (e.g. 502 + X-Esb-Blocked: tls:upstream_unverified).
  std::unique_ptr<SslStream> client;
  // Set on success only.
  std::unique_ptr<SslStream> upstream;
};

struct MitmRequest {
  std::shared_ptr<InterceptContext> server_ctx;    // the environment's
  std::shared_ptr<UpstreamContext> upstream_ctx;   // the process's
  std::string target_host;                         // CONNECT host (IPv6 with or without [])
  std::chrono::steady_clock::time_point deadline;  // for both handshakes together
};

// The non-template core (mitm.cc). `done` runs exactly once, on the streams' executor.
void StartIntercept(MitmRequest request, boost::beast::tcp_stream client,
                    boost::beast::tcp_stream upstream,
                    absl::AnyInvocable<void(MitmResult) &&> done);

// Asio-style initiating function, signature void(MitmResult): works with a callback,
// asio::use_awaitable (co_await returns the MitmResult), asio::use_future, ...
template <class CompletionToken>
auto AsyncIntercept(MitmRequest request, boost::beast::tcp_stream client,
                    boost::beast::tcp_stream upstream, CompletionToken&& token) {
  return boost::asio::async_initiate<CompletionToken, void(MitmResult)>(
      [](auto handler, MitmRequest request, boost::beast::tcp_stream client,
         boost::beast::tcp_stream upstream) {
        auto executor = boost::asio::get_associated_executor(handler, client.get_executor());
        auto work = boost::asio::make_work_guard(executor);
        StartIntercept(
            std::move(request), std::move(client), std::move(upstream),
            [handler = std::move(handler), work = std::move(work)](MitmResult result) mutable {
              auto ex = work.get_executor();
              boost::asio::dispatch(
                  ex, [handler = std::move(handler), result = std::move(result)]() mutable {
                    std::move(handler)(std::move(result));
                  });
              work.reset();
            });
      },
      token, std::move(request), std::move(client), std::move(upstream));
}

}  // namespace esb::governance::tls

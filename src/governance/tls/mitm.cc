#include "governance/tls/mitm.h"

#include <openssl/ssl.h>
#include <openssl/x509_vfy.h>

#include <boost/asio/post.hpp>
#include <boost/beast/core/error.hpp>
#include <optional>

#include "absl/strings/str_cat.h"

namespace esb::governance::tls {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;

// One interception in flight: owns everything until it hands the result to `done`.
class Intercept : public std::enable_shared_from_this<Intercept> {
 public:
  Intercept(MitmRequest request, absl::AnyInvocable<void(MitmResult) &&> done)
      : deadline_(request.deadline), done_(std::move(done)) {
    result_.server_ctx = std::move(request.server_ctx);
    result_.upstream_ctx = std::move(request.upstream_ctx);
    raw_target_ = std::move(request.target_host);
  }

  void Start(beast::tcp_stream client, beast::tcp_stream upstream) {
    auto executor = client.get_executor();
    if (result_.server_ctx == nullptr || result_.upstream_ctx == nullptr) {
      return FailLater(executor, absl::InvalidArgumentError("interception without TLS contexts"),
                       kRuleBadTarget);
    }
    absl::StatusOr<std::string> target = NormalizeHost(raw_target_);
    if (!target.ok()) {
      return FailLater(
          executor,
          absl::InvalidArgumentError(absl::StrCat("cannot intercept TLS for '", raw_target_,
                                                  "': ", target.status().message())),
          kRuleBadTarget);
    }
    result_.target_host = *target;
    state_.target_host = *target;
    upstream_tcp_.emplace(std::move(upstream));
    result_.client = std::make_unique<SslStream>(std::move(client), result_.server_ctx->context());
    InterceptContext::Attach(result_.client->native_handle(), &state_);
    beast::get_lowest_layer(*result_.client).expires_at(deadline_);
    result_.client->async_handshake(
        asio::ssl::stream_base::server,
        [self = shared_from_this()](beast::error_code ec) { self->OnClientHandshake(ec); });
  }

 private:
  void OnClientHandshake(beast::error_code ec) {
    InterceptContext::Attach(result_.client->native_handle(), nullptr);
    result_.sni = state_.sni;
    if (ec) {
      std::unique_ptr<SslStream> dead = std::move(result_.client);
      if (state_.sni_mismatch) {
        return Finish(absl::FailedPreconditionError(absl::StrCat(
                          "TLS server name '", state_.sni, "' does not match the CONNECT target '",
                          state_.target_host, "'")),
                      kRuleSniMismatch);
      }
      if (ec == beast::error::timeout) {
        return Finish(absl::DeadlineExceededError("timed out in the TLS handshake with the client"),
                      kRuleTimeout);
      }
      if (!state_.mint_error.empty()) {
        return Finish(
            absl::InternalError(absl::StrCat("cannot mint a certificate for '", state_.target_host,
                                             "': ", state_.mint_error)),
            kRuleClientHandshake);
      }
      // E.g. "tlsv1 alert unknown ca": the client does not trust the environment CA.
      return Finish(absl::FailedPreconditionError(
                        absl::StrCat("TLS handshake with the client failed: ", ec.message())),
                    kRuleClientHandshake);
    }
    result_.upstream =
        std::make_unique<SslStream>(std::move(*upstream_tcp_), result_.upstream_ctx->context());
    upstream_tcp_.reset();
    if (absl::Status s = UpstreamContext::PrepareConnection(result_.upstream->native_handle(),
                                                            state_.target_host);
        !s.ok()) {
      result_.upstream.reset();
      return Finish(s, kRuleBadTarget);
    }
    beast::get_lowest_layer(*result_.upstream).expires_at(deadline_);
    result_.upstream->async_handshake(
        asio::ssl::stream_base::client,
        [self = shared_from_this()](beast::error_code ec) { self->OnUpstreamHandshake(ec); });
  }

  void OnUpstreamHandshake(beast::error_code ec) {
    if (ec) {
      long verify = SSL_get_verify_result(result_.upstream->native_handle());
      result_.upstream.reset();
      // The client stays usable for the proxy's answer, under the proxy's own deadlines.
      beast::get_lowest_layer(*result_.client).expires_never();
      if (ec == beast::error::timeout) {
        return Finish(absl::DeadlineExceededError(
                          absl::StrCat("timed out in the TLS handshake with ", state_.target_host)),
                      kRuleTimeout);
      }
      if (verify != X509_V_OK) {
        return Finish(absl::FailedPreconditionError(
                          absl::StrCat("the certificate of ", state_.target_host,
                                       " is not trusted: ", X509_verify_cert_error_string(verify))),
                      kRuleUpstreamUnverified);
      }
      return Finish(absl::UnavailableError(absl::StrCat("TLS handshake with ", state_.target_host,
                                                        " failed: ", ec.message())),
                    kRuleUpstreamHandshake);
    }
    // The handshake deadline is over; the proxy sets its own per-request ones.
    beast::get_lowest_layer(*result_.client).expires_never();
    beast::get_lowest_layer(*result_.upstream).expires_never();
    Finish(absl::OkStatus(), "");
  }

  template <class Executor>
  void FailLater(Executor executor, absl::Status status, std::string_view rule) {
    // Complete asynchronously even here, so callers never see the handler run inside the
    // initiating call.
    asio::post(executor, [self = shared_from_this(), status = std::move(status), rule] {
      self->Finish(status, rule);
    });
  }

  void Finish(absl::Status status, std::string_view rule) {
    result_.status = std::move(status);
    result_.rule = std::string(rule);
    std::move(done_)(std::move(result_));
  }

  std::chrono::steady_clock::time_point deadline_;
  absl::AnyInvocable<void(MitmResult) &&> done_;
  std::string raw_target_;
  ServerHandshakeState state_;
  std::optional<beast::tcp_stream> upstream_tcp_;
  MitmResult result_;
};

}  // namespace

void StartIntercept(MitmRequest request, beast::tcp_stream client, beast::tcp_stream upstream,
                    absl::AnyInvocable<void(MitmResult) &&> done) {
  auto op = std::make_shared<Intercept>(std::move(request), std::move(done));
  op->Start(std::move(client), std::move(upstream));
}

}  // namespace esb::governance::tls

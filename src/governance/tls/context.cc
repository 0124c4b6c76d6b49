#include "governance/tls/context.h"

namespace esb::governance::tls {

InterceptContext::InterceptContext(std::shared_ptr<LeafMinter> minter)
    : minter_(std::move(minter)), ctx_(boost::asio::ssl::context::tls_server) {}

absl::StatusOr<std::shared_ptr<InterceptContext>> InterceptContext::Create(
    std::shared_ptr<LeafMinter> minter) {
  return absl::UnimplementedError("InterceptContext: not yet");
}

void InterceptContext::Attach(SSL* ssl, ServerHandshakeState* state) {}

UpstreamContext::UpstreamContext() : ctx_(boost::asio::ssl::context::tls_client) {}

absl::StatusOr<std::shared_ptr<UpstreamContext>> UpstreamContext::Create(
    const std::string& extra_roots_file, bool use_system_roots) {
  return absl::UnimplementedError("UpstreamContext: not yet");
}

absl::Status UpstreamContext::PrepareConnection(SSL* ssl, const std::string& host) {
  return absl::UnimplementedError("UpstreamContext: not yet");
}

}  // namespace esb::governance::tls

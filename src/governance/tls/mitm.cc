#include "governance/tls/mitm.h"

namespace esb::governance::tls {

void StartIntercept(MitmRequest request, boost::beast::tcp_stream client,
                    boost::beast::tcp_stream upstream,
                    absl::AnyInvocable<void(MitmResult) &&> done) {
  MitmResult result;
  result.status = absl::UnimplementedError("TLS interception: not yet");
  std::move(done)(std::move(result));
}

}  // namespace esb::governance::tls

// libFuzzer target for esb-proxy's request-head logic: arbitrary bytes go through the raw-head
// checks (CheckRawHead), Beast's request parser with the proxy's limits, InterpretHead on the
// proxy port and inside a tunnel, PrepareUpstreamHead and BlockResponse. A crash, a sanitizer
// report or an accepted head whose target breaks the invariants below is a finding.
// Build and run: see src/governance/CMakeLists.txt.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "governance/proxy/request.h"

namespace {

using namespace esb::governance::proxy;

void Check(const http::request_header<>& parsed, const TunnelTarget* tunnel) {
  http::request_header<> head = parsed;
  std::variant<RequestTarget, Refusal> r = InterpretHead(head, tunnel);
  if (auto* refusal = std::get_if<Refusal>(&r)) {
    if (refusal->status < 400 || refusal->status > 599) abort();
    auto res = BlockResponse(refusal->status, refusal->rule, "h", refusal->reason, 11, false);
    (void)res;
    return;
  }
  const RequestTarget& t = std::get<RequestTarget>(r);
  // Invariants of an accepted head: a normalised host, a port, an origin-form path.
  if (t.host.empty() || t.port == 0) abort();
  if (!t.connect && (t.path.empty() || t.path[0] != '/')) abort();
  if (tunnel != nullptr && (t.host != tunnel->host || t.port != tunnel->port)) abort();
  for (char c : t.host) {
    if (c >= 'A' && c <= 'Z') abort();
  }
  if (!t.connect) {
    PrepareUpstreamHead(head, t);
    if (head.count(http::field::host) != 1) abort();
    if (head.count(http::field::proxy_authorization) != 0) abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  if (!CheckRawHead(bytes).empty()) return 0;
  http::request_parser<http::empty_body> parser;
  ConfigureRequestParser(parser);
  boost::system::error_code ec;
  parser.put(boost::asio::buffer(bytes.data(), bytes.size()), ec);
  if (ec || !parser.is_header_done()) return 0;
  const http::request_header<>& head = parser.get();
  Check(head, nullptr);
  TunnelTarget tunnel{"api.example.com", 443};
  Check(head, &tunnel);
  TunnelTarget v6{"2001:db8::1", 8443};
  Check(head, &v6);
  return 0;
}

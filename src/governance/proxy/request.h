// The request-head logic of esb-proxy, apart from I/O so that it is unit-tested and fuzzed
// (proxy_fuzz): how a request read from a sandbox is interpreted (absolute-form on the proxy
// port, CONNECT authority-form, origin-form inside an inspected tunnel), which heads are
// refused, how the upstream request is built, and the shape of a block answer.
#pragma once

#include <boost/beast/http.hpp>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>

namespace esb::governance::proxy {

namespace http = boost::beast::http;

inline constexpr size_t kMaxHeaderBytes = 16 << 10;
inline constexpr size_t kMaxHeaderFields = 100;
inline constexpr size_t kMaxTargetBytes = 8 << 10;

// Sets the limits every request parser of the proxy uses (header bytes, body cap; eager off).
void ConfigureRequestParser(http::request_parser<http::empty_body>& parser);

// Raw-bytes checks Beast does not do, on the bytes of a head before they are parsed: obsolete
// line folding and too many fields. Returns the reason or "".
std::string CheckRawHead(std::string_view head);

// Where a request goes.
struct RequestTarget {
  bool connect = false;
  std::string host;  // normalised (governance::NormalizeHost): lower case, no brackets
  bool host_is_ip = false;
  uint16_t port = 0;
  std::string path;  // origin-form "/p?q" ("" for CONNECT)
};

// Why a head is answered with an error instead of forwarded.
struct Refusal {
  int status = 400;
  std::string rule;    // "bad_request", "tls:host_mismatch", ...
  std::string reason;  // human text
};

// The CONNECT target of the inspected tunnel a request arrived in.
struct TunnelTarget {
  std::string host;
  uint16_t port = 0;
};

// Interprets a parsed head: `tunnel` nullptr = the proxy port (absolute-form http:// URIs and
// CONNECT), else a request inside an inspected tunnel to `tunnel` (origin-form or an absolute
// https:// URI; the Host header must name the tunnel's host and port, else 421). Refuses
// ambiguous framing (duplicate Host/Content-Length, Content-Length with Transfer-Encoding, any
// transfer coding but chunked), Upgrade, and malformed targets.
std::variant<RequestTarget, Refusal> InterpretHead(const http::request_header<>& head,
                                                   const TunnelTarget* tunnel);

// Rewrites a client's head into the head sent upstream: origin-form target, Host set to the
// target, hop-by-hop headers removed (Connection and the headers it names, Keep-Alive,
// Proxy-Connection, Proxy-Authorization, TE, Trailer, Upgrade, Expect), HTTP/1.1.
void PrepareUpstreamHead(http::request_header<>& head, const RequestTarget& target);

// Removes hop-by-hop headers from an upstream response before it is relayed.
void PrepareClientResponseHead(http::response_header<>& head);

// The answer to a blocked request: 403 (or `status`), `X-Esb-Blocked: <rule>`, and the JSON body
// {"error": "egress_blocked", "rule", "host", "reason", "hint"} (hint: retrying through another
// route will not help). Non-block errors (400, 421, 502, ...) use error "egress_error"; a 503
// (a fair-share limit: body budget, DLP or resolver busy) adds `Retry-After: 1`.
http::response<http::string_body> BlockResponse(int status, std::string_view rule,
                                                std::string_view host, std::string_view reason,
                                                unsigned version, bool keep_alive);

}  // namespace esb::governance::proxy

#include "governance/proxy/request.h"

#include <algorithm>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "boost/json.hpp"
#include "common/util.h"
#include "governance/policy.h"

namespace esb::governance::proxy {
namespace {

template <class S>
std::string_view SV(const S& s) {
  return std::string_view(s.data(), s.size());
}

Refusal Bad(std::string reason) { return Refusal{400, "bad_request", std::move(reason)}; }

// Splits "host[:port]" / "[v6][:port]"; false if malformed. `port` stays as given if absent.
bool SplitAuthority(std::string_view authority, std::string* host, uint16_t* port, bool* had_port) {
  *had_port = false;
  std::string_view h = authority;
  std::string_view p;
  if (!h.empty() && h.front() == '[') {
    size_t close = h.find(']');
    if (close == std::string_view::npos) return false;
    std::string_view rest = h.substr(close + 1);
    h = h.substr(0, close + 1);
    if (!rest.empty()) {
      if (rest.front() != ':') return false;
      p = rest.substr(1);
      *had_port = true;
    }
  } else {
    size_t colon = h.find(':');
    if (colon != std::string_view::npos) {
      if (h.find(':', colon + 1) != std::string_view::npos) return false;  // bare IPv6
      p = h.substr(colon + 1);
      h = h.substr(0, colon);
      *had_port = true;
    }
  }
  if (*had_port) {
    uint32_t v = 0;
    if (p.empty() || p.size() > 5 || !std::all_of(p.begin(), p.end(), absl::ascii_isdigit) ||
        !absl::SimpleAtoi(AbslView(p), &v) || v == 0 || v > 65535) {
      return false;
    }
    *port = static_cast<uint16_t>(v);
  }
  if (h.empty()) return false;
  *host = std::string(h);
  return true;
}

bool ValidPath(std::string_view path) {
  if (path.empty() || path.front() != '/') return false;
  for (char c : path) {
    auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u == 0x7f || c == '#') return false;
  }
  return true;
}

// Parses "scheme://authority/path?query" (no userinfo). `scheme` out in lower case.
bool ParseAbsolute(std::string_view target, std::string* scheme, std::string* authority,
                   std::string* path) {
  size_t sep = target.find("://");
  if (sep == std::string_view::npos || sep == 0 || sep > 10) return false;
  *scheme = absl::AsciiStrToLower(AbslView(target.substr(0, sep)));
  std::string_view rest = target.substr(sep + 3);
  size_t slash = rest.find_first_of("/?");
  std::string_view auth = rest.substr(0, slash);
  if (auth.find('@') != std::string_view::npos) return false;
  *authority = std::string(auth);
  if (slash == std::string_view::npos) {
    *path = "/";
  } else if (rest[slash] == '?') {
    *path = absl::StrCat("/", AbslView(rest.substr(slash)));
  } else {
    *path = std::string(rest.substr(slash));
  }
  return true;
}

template <class Fields>
void RemoveHopByHop(Fields& f) {
  // Connection-nominated headers first (RFC 9110 §7.6.1).
  std::vector<std::string> named;
  for (auto it = f.find(http::field::connection);
       it != f.end() && it->name() == http::field::connection; ++it) {
    for (absl::string_view t : absl::StrSplit(AbslView(SV(it->value())), ',')) {
      t = absl::StripAsciiWhitespace(t);
      if (!t.empty()) named.emplace_back(std::string(t));
    }
  }
  for (const std::string& n : named) f.erase(n);
  for (std::string_view h : {"connection", "keep-alive", "proxy-connection", "proxy-authorization",
                             "proxy-authenticate", "te", "trailer", "upgrade"}) {
    f.erase(h);
  }
}

}  // namespace

void ConfigureRequestParser(http::request_parser<http::empty_body>& parser) {
  parser.header_limit(static_cast<std::uint32_t>(kMaxHeaderBytes));
  // The body's limit is the policy's max_body_bytes, checked by the proxy once the head is read
  // (Beast's default of 1 MiB for requests would refuse a larger Content-Length as a malformed
  // head, whatever the policy allows).
  parser.body_limit(boost::none);
  parser.eager(false);
}

std::string CheckRawHead(std::string_view head) {
  size_t eoh = head.find("\r\n\r\n");
  if (eoh != std::string_view::npos) head = head.substr(0, eoh);
  if (head.find("\r\n ") != std::string_view::npos ||
      head.find("\r\n\t") != std::string_view::npos) {
    return "obsolete line folding in the request header is not accepted";
  }
  if (static_cast<size_t>(std::count(head.begin(), head.end(), '\n')) > kMaxHeaderFields + 1) {
    return absl::StrCat("too many request header fields (limit ", kMaxHeaderFields, ")");
  }
  return "";
}

std::variant<RequestTarget, Refusal> InterpretHead(const http::request_header<>& head,
                                                   const TunnelTarget* tunnel) {
  int host_count = 0, clen = 0, te = 0;
  std::string te_value;
  for (const auto& f : head) {
    if (f.name() == http::field::host) ++host_count;
    if (f.name() == http::field::content_length) ++clen;
    if (f.name() == http::field::transfer_encoding) {
      ++te;
      te_value = std::string(SV(f.value()));
    }
  }
  if (host_count > 1) return Bad("more than one Host header");
  if (clen > 1) return Bad("more than one Content-Length header");
  if (clen > 0 && te > 0) {
    return Bad("both Content-Length and Transfer-Encoding: the body length is ambiguous");
  }
  if (te > 1 ||
      (te == 1 && !absl::EqualsIgnoreCase(absl::StripAsciiWhitespace(te_value), "chunked"))) {
    return Refusal{501, "bad_request", "only 'Transfer-Encoding: chunked' is supported"};
  }
  if (head.version() != 11 && head.version() != 10) return Bad("unsupported HTTP version");
  if (head.find(http::field::upgrade) != head.end()) {
    return Refusal{501, "unsupported", "protocol upgrades (WebSocket, h2c) are not proxied"};
  }
  std::string_view target = SV(head.target());
  if (target.size() > kMaxTargetBytes)
    return Refusal{414, "bad_request", "request target too long"};

  RequestTarget out;
  std::string authority;
  uint16_t default_port = 80;
  if (head.method() == http::verb::connect) {
    if (tunnel != nullptr) return Bad("CONNECT inside a tunnel");
    out.connect = true;
    authority = std::string(target);
    bool had_port = false;
    std::string host;
    if (!SplitAuthority(authority, &host, &out.port, &had_port) || !had_port) {
      return Bad("CONNECT target must be host:port");
    }
    bool is_ip = false;
    std::optional<std::string> n = NormalizeHost(host, &is_ip);
    if (!n) return Bad(absl::StrCat("invalid host in CONNECT target"));
    out.host = *n;
    out.host_is_ip = is_ip;
    return out;
  }
  if (head.method() == http::verb::unknown) return Refusal{501, "bad_request", "unknown method"};

  std::string host_text;
  bool had_port = false;
  if (tunnel == nullptr) {
    std::string scheme;
    if (!ParseAbsolute(target, &scheme, &authority, &out.path)) {
      return Bad("a proxy request needs an absolute http:// URI (use CONNECT for https)");
    }
    if (scheme != "http") {
      return Bad(absl::StrCat("scheme '", scheme,
                              "' is not proxied as a plain request; "
                              "https goes through CONNECT"));
    }
    if (!SplitAuthority(authority, &host_text, &default_port, &had_port)) {
      return Bad("malformed authority in the request URI");
    }
    out.port = default_port;
  } else {
    out.port = tunnel->port;
    if (!target.empty() && target.front() == '/') {
      out.path = std::string(target);
    } else {
      std::string scheme;
      if (!ParseAbsolute(target, &scheme, &authority, &out.path) || scheme != "https") {
        return Bad("malformed request target");
      }
      uint16_t p = 443;
      if (!SplitAuthority(authority, &host_text, &p, &had_port)) return Bad("malformed URI");
      bool is_ip = false;
      std::optional<std::string> n = NormalizeHost(host_text, &is_ip);
      if (!n || *n != tunnel->host || p != tunnel->port) {
        return Refusal{421, "tls:host_mismatch",
                       "the request URI names another host than the CONNECT target"};
      }
    }
    auto h = head.find(http::field::host);
    if (h == head.end()) {
      if (head.version() >= 11) return Bad("HTTP/1.1 request without a Host header");
      host_text = tunnel->host;
    } else {
      uint16_t p = 443;
      bool host_had_port = false;
      std::string hh;
      if (!SplitAuthority(SV(h->value()), &hh, &p, &host_had_port)) {
        return Bad("malformed Host header");
      }
      bool is_ip = false;
      std::optional<std::string> n = NormalizeHost(hh, &is_ip);
      if (!n || *n != tunnel->host || (host_had_port && p != tunnel->port)) {
        return Refusal{421, "tls:host_mismatch",
                       absl::StrCat("Host header does not match the CONNECT target ", tunnel->host,
                                    ":", tunnel->port)};
      }
    }
    out.host = tunnel->host;
    out.host_is_ip = tunnel->host.find(':') != std::string::npos ||
                     std::all_of(tunnel->host.begin(), tunnel->host.end(),
                                 [](char c) { return absl::ascii_isdigit(c) || c == '.'; });
    if (!ValidPath(out.path)) return Bad("malformed request path");
    return out;
  }
  bool is_ip = false;
  std::optional<std::string> n = NormalizeHost(host_text, &is_ip);
  if (!n) return Bad("invalid host in the request URI");
  out.host = *n;
  out.host_is_ip = is_ip;
  if (!ValidPath(out.path)) return Bad("malformed request path");
  return out;
}

void PrepareUpstreamHead(http::request_header<>& head, const RequestTarget& target) {
  RemoveHopByHop(head);
  head.erase(http::field::expect);
  head.target(target.path);
  std::string host = target.host.find(':') != std::string::npos
                         ? absl::StrCat("[", target.host, "]")
                         : target.host;
  bool default_port = target.port == 80 || target.port == 443;
  head.set(http::field::host, default_port ? host : absl::StrCat(host, ":", target.port));
  head.version(11);
}

void PrepareClientResponseHead(http::response_header<>& head) { RemoveHopByHop(head); }

http::response<http::string_body> BlockResponse(int status, std::string_view rule,
                                                std::string_view host, std::string_view reason,
                                                unsigned version, bool keep_alive) {
  http::response<http::string_body> res{static_cast<http::status>(status), version};
  boost::json::object body;
  if (status == 403) {
    body["error"] = "egress_blocked";
    body["hint"] =
        "This request was refused by the environment's egress policy. Retrying through another "
        "route (a different proxy, a direct connection, another port or address) will not help: "
        "the sandbox has no other way out. Ask the operator to change the policy or activate an "
        "intent.";
  } else {
    body["error"] = "egress_error";
  }
  body["rule"] = rule;
  body["host"] = host;
  body["reason"] = reason;
  res.set(http::field::content_type, "application/json");
  res.set(http::field::cache_control, "no-store");
  if (status == 403) res.set("X-Esb-Blocked", rule);
  // 503 is a fair-share refusal (proxy.h ProxyOptions): the same request fits again shortly.
  if (status == 503) res.set(http::field::retry_after, "1");
  res.body() = boost::json::serialize(body);
  res.keep_alive(keep_alive);
  res.prepare_payload();
  return res;
}

}  // namespace esb::governance::proxy

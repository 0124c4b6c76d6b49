#include "api/host_check.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <string>

#include "api/json_util.h"

namespace esb::api {

bool IsLoopbackHostPort(std::string_view hp) {
  std::string_view host = hp;
  std::string_view port;
  if (hp.starts_with('[')) {
    size_t close = hp.find(']');
    if (close == std::string_view::npos) return false;
    host = hp.substr(1, close - 1);
    std::string_view rest = hp.substr(close + 1);
    if (!rest.empty()) {
      if (rest[0] != ':') return false;
      port = rest.substr(1);
    }
    in6_addr a6{};
    if (inet_pton(AF_INET6, std::string(host).c_str(), &a6) != 1 || !IN6_IS_ADDR_LOOPBACK(&a6))
      return false;
  } else {
    size_t colon = hp.find(':');
    if (colon != std::string_view::npos) {
      host = hp.substr(0, colon);
      port = hp.substr(colon + 1);
    }
    in_addr a4{};
    bool ok = EqualsIgnoreCase(host, "localhost") ||
              (inet_pton(AF_INET, std::string(host).c_str(), &a4) == 1 &&
               (ntohl(a4.s_addr) >> 24) == 127);
    if (!ok) return false;
  }
  if (hp.find(':') != std::string_view::npos && !hp.starts_with('[') && port.empty()) return false;
  if (hp.starts_with('[') && hp.ends_with(':')) return false;
  if (port.size() > 5) return false;
  for (char c : port) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

std::string_view OriginHostPort(std::string_view origin) {
  for (std::string_view scheme : {"http://", "https://"}) {
    if (StartsWithIgnoreCase(origin, scheme)) return origin.substr(scheme.size());
  }
  return {};
}

bool IsLoopbackOrigin(std::string_view origin) {
  std::string_view hp = OriginHostPort(origin);
  return !hp.empty() && IsLoopbackHostPort(hp);
}

}  // namespace esb::api

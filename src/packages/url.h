// Minimal absolute-URL handling for index pages and redirects: http and https only.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace esb::packages {

struct Url {
  std::string scheme;  // "http" or "https" (lowercase)
  std::string host;    // lowercase; IPv6 literals without brackets
  std::string port;    // explicit or the scheme default ("80" / "443")
  std::string target;  // path + query, starts with '/'
  bool default_port = true;

  // "host" or "host:port" when the port is not the default; brackets around IPv6.
  std::string HostPort() const;
  std::string ToString() const;
};

// Parses an absolute http(s) URL. User info ("user@host") is rejected; the fragment dropped.
absl::StatusOr<Url> ParseUrl(std::string_view url);

// RFC 3986 reference resolution of `ref` against the absolute `base`, fragment removed.
// *fragment receives the fragment of `ref` (without '#') when not null.
absl::StatusOr<std::string> ResolveUrl(std::string_view base, std::string_view ref,
                                       std::string* fragment = nullptr);

// Decodes %XX escapes (invalid escapes are kept as they are).
std::string PercentDecode(std::string_view s);

// True when `u` is one of `allowed`: entries are "host", "host:port", "[v6]" or "[v6]:port"
// (a bare IPv6 literal without brackets is a host without port), case-insensitive. Host AND
// port must match: an entry without a port stands for the default port of u's scheme, so
// "mirror.example" admits https://mirror.example/ and http://mirror.example/ but not
// http://mirror.example:8080/ (another service on the same machine). Malformed entries match
// nothing.
bool HostAllowed(const Url& u, const std::vector<std::string>& allowed);

}  // namespace esb::packages

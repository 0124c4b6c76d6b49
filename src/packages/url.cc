#include "packages/url.h"

#include <cctype>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/util.h"

namespace esb::packages {
namespace {

constexpr size_t kMaxUrlLength = 8192;

// RFC 3986 5.2.4.
std::string RemoveDotSegments(std::string_view path) {
  std::vector<std::string_view> out;
  bool absolute = path.starts_with('/');
  bool trailing_slash = false;
  size_t i = absolute ? 1 : 0;
  while (i <= path.size()) {
    size_t slash = path.find('/', i);
    if (slash == std::string_view::npos) slash = path.size();
    std::string_view seg = path.substr(i, slash - i);
    bool last = slash == path.size();
    if (seg == ".") {
      trailing_slash = last;
    } else if (seg == "..") {
      if (!out.empty()) out.pop_back();
      trailing_slash = last;
    } else {
      out.push_back(seg);
      trailing_slash = false;
    }
    i = slash + 1;
  }
  std::string result = absolute ? "/" : "";
  for (size_t k = 0; k < out.size(); ++k) {
    if (k > 0) result += '/';
    result += out[k];
  }
  if (trailing_slash && !result.ends_with('/')) result += '/';
  return result;
}

}  // namespace

std::string Url::HostPort() const {
  std::string h = host.find(':') != std::string::npos ? "[" + host + "]" : host;
  return default_port ? h : absl::StrCat(h, ":", port);
}

std::string Url::ToString() const { return absl::StrCat(scheme, "://", HostPort(), target); }

absl::StatusOr<Url> ParseUrl(std::string_view url) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid URL '", AbslView(url.substr(0, 200)), "': ", why));
  };
  if (url.size() > kMaxUrlLength) return bad("too long");
  for (char c : url) {
    if (static_cast<unsigned char>(c) <= 0x20 || c == 0x7f) {
      return bad("contains spaces or control characters");
    }
  }
  size_t colon = url.find("://");
  if (colon == std::string_view::npos) return bad("not an absolute URL");
  Url u;
  u.scheme = absl::AsciiStrToLower(std::string(url.substr(0, colon)));
  if (u.scheme != "http" && u.scheme != "https") return bad("only http and https are supported");
  std::string_view rest = url.substr(colon + 3);
  if (size_t hash = rest.find('#'); hash != std::string_view::npos) rest = rest.substr(0, hash);
  size_t path_start = rest.find_first_of("/?");
  std::string_view authority = rest.substr(0, path_start);
  u.target = path_start == std::string_view::npos ? "/" : std::string(rest.substr(path_start));
  if (u.target.front() == '?') u.target = "/" + u.target;
  if (authority.find('@') != std::string_view::npos) return bad("user info is not allowed");
  std::string_view host = authority, port;
  if (authority.starts_with('[')) {
    size_t close = authority.find(']');
    if (close == std::string_view::npos) return bad("unterminated IPv6 address");
    host = authority.substr(1, close - 1);
    std::string_view after = authority.substr(close + 1);
    if (!after.empty()) {
      if (after.front() != ':') return bad("garbage after IPv6 address");
      port = after.substr(1);
    }
  } else if (size_t c = authority.rfind(':'); c != std::string_view::npos) {
    host = authority.substr(0, c);
    port = authority.substr(c + 1);
  }
  if (host.empty()) return bad("missing host");
  u.host = absl::AsciiStrToLower(std::string(host));
  if (!port.empty()) {
    if (port.size() > 5) return bad("bad port");
    for (char c : port) {
      if (!std::isdigit(static_cast<unsigned char>(c))) return bad("bad port");
    }
    int p = std::stoi(std::string(port));
    if (p <= 0 || p > 65535) return bad("bad port");
    u.port = std::to_string(p);
  }
  std::string def = u.scheme == "https" ? "443" : "80";
  if (u.port.empty()) u.port = def;
  u.default_port = u.port == def;
  return u;
}

absl::StatusOr<std::string> ResolveUrl(std::string_view base, std::string_view ref,
                                       std::string* fragment) {
  if (fragment != nullptr) fragment->clear();
  if (size_t hash = ref.find('#'); hash != std::string_view::npos) {
    if (fragment != nullptr) *fragment = std::string(ref.substr(hash + 1));
    ref = ref.substr(0, hash);
  }
  // Absolute reference.
  size_t scheme_end = ref.find(':');
  if (scheme_end != std::string_view::npos) {
    bool is_scheme = scheme_end > 0;
    for (size_t i = 0; i < scheme_end && is_scheme; ++i) {
      char c = ref[i];
      is_scheme = std::isalpha(static_cast<unsigned char>(c)) ||
                  (i > 0 && (std::isdigit(static_cast<unsigned char>(c)) || c == '+' ||
                             c == '-' || c == '.'));
    }
    if (is_scheme) {
      auto u = ParseUrl(ref);
      if (!u.ok()) return u.status();
      auto t = u->target;
      size_t q = t.find('?');
      std::string path = RemoveDotSegments(t.substr(0, q));
      u->target = q == std::string::npos ? path : path + t.substr(q);
      return u->ToString();
    }
  }
  auto b = ParseUrl(base);
  if (!b.ok()) return b.status();
  if (ref.starts_with("//")) {
    return ResolveUrl(base, absl::StrCat(b->scheme, ":", AbslView(ref)), nullptr);
  }
  std::string base_path = b->target.substr(0, b->target.find('?'));
  std::string base_query =
      b->target.find('?') == std::string::npos ? "" : b->target.substr(b->target.find('?'));
  std::string target;
  if (ref.empty()) {
    target = b->target;
  } else if (ref.starts_with('?')) {
    target = base_path + std::string(ref);
  } else {
    std::string_view ref_path = ref.substr(0, ref.find('?'));
    std::string ref_query =
        ref.find('?') == std::string_view::npos ? "" : std::string(ref.substr(ref.find('?')));
    std::string merged;
    if (ref_path.starts_with('/')) {
      merged = std::string(ref_path);
    } else {
      merged = base_path.substr(0, base_path.rfind('/') + 1) + std::string(ref_path);
    }
    target = RemoveDotSegments(merged) + ref_query;
    (void)base_query;
  }
  b->target = target.empty() ? "/" : target;
  return b->ToString();
}

namespace {

// Splits an allowed-hosts entry into lowercase host and canonical port ("" when absent).
bool ParseHostEntry(std::string_view entry, std::string* host, std::string* port) {
  std::string e = absl::AsciiStrToLower(absl::StripAsciiWhitespace(AbslView(entry)));
  std::string_view v = e;
  std::string_view h = v, p;
  if (v.starts_with('[')) {
    size_t close = v.find(']');
    if (close == std::string_view::npos) return false;
    h = v.substr(1, close - 1);
    std::string_view after = v.substr(close + 1);
    if (!after.empty()) {
      if (after.front() != ':') return false;
      p = after.substr(1);
      if (p.empty()) return false;
    }
  } else if (size_t c = v.find(':'); c != std::string_view::npos && v.find(':', c + 1) ==
                                                                        std::string_view::npos) {
    h = v.substr(0, c);
    p = v.substr(c + 1);
    if (p.empty()) return false;
  }  // else: no colon, or several (a bare IPv6 literal): all host
  if (h.empty()) return false;
  *host = std::string(h);
  port->clear();
  if (!p.empty()) {
    if (p.size() > 5) return false;
    for (char c : p) {
      if (!std::isdigit(static_cast<unsigned char>(c))) return false;
    }
    int n = std::stoi(std::string(p));
    if (n <= 0 || n > 65535) return false;
    *port = std::to_string(n);
  }
  return true;
}

}  // namespace

bool HostAllowed(const Url& u, const std::vector<std::string>& allowed) {
  const std::string default_port = u.scheme == "https" ? "443" : "80";
  for (const auto& a : allowed) {
    std::string host, port;
    if (!ParseHostEntry(a, &host, &port)) continue;
    if (host == u.host && (port.empty() ? default_port : port) == u.port) return true;
  }
  return false;
}

std::string PercentDecode(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() + 0 && std::isxdigit(static_cast<unsigned char>(s[i + 1])) &&
        std::isxdigit(static_cast<unsigned char>(s[i + 2]))) {
      out += static_cast<char>(std::stoi(std::string(s.substr(i + 1, 2)), nullptr, 16));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

}  // namespace esb::packages

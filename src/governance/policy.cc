#include "governance/policy.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <charconv>

#include "absl/status/status.h"

namespace esb::governance {
namespace {

namespace json = boost::json;

template <class... Args>
std::string Cat(const Args&... args) {
  std::string out;
  (out.append(args), ...);
  return out;
}

absl::Status Invalid(std::string message) { return absl::InvalidArgumentError(std::move(message)); }

std::string Quote(std::string_view s) {
  // Rule texts come from untrusted bodies: cap and strip control bytes before echoing them.
  std::string out = "'";
  for (char c : s.substr(0, 80)) out.push_back(static_cast<unsigned char>(c) < 0x20 ? '?' : c);
  if (s.size() > 80) out.append("...");
  out.push_back('\'');
  return out;
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return out;
}

// Canonical text of an IP literal, or nullopt.
std::optional<std::string> CanonicalIp(std::string_view text) {
  if (text.empty() || text.size() > 45) return std::nullopt;
  std::string s(text);
  char buf[INET6_ADDRSTRLEN];
  in_addr v4;
  if (inet_pton(AF_INET, s.c_str(), &v4) == 1) {
    inet_ntop(AF_INET, &v4, buf, sizeof buf);
    return std::string(buf);
  }
  in6_addr v6;
  if (inet_pton(AF_INET6, s.c_str(), &v6) == 1) {
    inet_ntop(AF_INET6, &v6, buf, sizeof buf);
    return std::string(buf);
  }
  return std::nullopt;
}

// Checks a lower-case DNS name; "" if fine, else the problem.
std::string NameProblem(std::string_view name) {
  if (name.empty()) return "empty host name";
  if (name.size() > kMaxHostLength)
    return Cat("host name longer than ", std::to_string(kMaxHostLength), " characters");
  size_t start = 0;
  std::string_view last;
  while (start <= name.size()) {
    size_t dot = name.find('.', start);
    if (dot == std::string_view::npos) dot = name.size();
    std::string_view label = name.substr(start, dot - start);
    if (label.empty()) return "empty label in host name";
    if (label.size() > kMaxLabelLength)
      return Cat("label longer than ", std::to_string(kMaxLabelLength), " characters");
    for (char c : label) {
      bool ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
      if (!ok) {
        if (c == '*') return "'*' is only allowed as a leading '*.' label";
        return "host names may contain only letters, digits, '-', '_' and '.'";
      }
    }
    if (label.front() == '-' || label.back() == '-') return "a label may not start or end with '-'";
    last = label;
    start = dot + 1;
  }
  // SECURITY: names that inet_aton would read as an address ("127.1", "0x7f000001", "2130706433")
  // are not host names: refusing them keeps a name rule from ever meaning an address.
  if (std::all_of(last.begin(), last.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return "the last label is numeric (an address in disguise?); write IP literals in full";
  in_addr ignored;
  if (inet_aton(std::string(name).c_str(), &ignored) != 0)
    return "numeric address form; write IP literals in dotted-quad form";
  return "";
}

// An IP literal or CIDR range ("10.0.0.0/8") of a rule: the canonical address and the prefix
// (-1 without one) into `rule`, or the problem.
std::string ParseIpRule(std::string_view text, HostRule* rule) {
  size_t slash = text.find('/');
  std::string_view addr = text.substr(0, slash);
  auto ip = CanonicalIp(addr);
  if (!ip)
    return addr.find(':') != std::string_view::npos ? "not a valid IPv6 address"
                                                    : "not a valid IP address";
  rule->kind = HostRule::Kind::kIp;
  rule->host = *ip;
  rule->prefix = -1;
  if (slash == std::string_view::npos) return "";
  const bool v6 = ip->find(':') != std::string::npos;
  const int max = v6 ? 128 : 32;
  std::string_view bits = text.substr(slash + 1);
  int prefix = -1;
  auto [end, ec] = std::from_chars(bits.data(), bits.data() + bits.size(), prefix);
  if (bits.empty() || ec != std::errc() || end != bits.data() + bits.size() || prefix < 0 ||
      prefix > max)
    return Cat("prefix length must be 0..", std::to_string(max));
  unsigned char b[16] = {};
  inet_pton(v6 ? AF_INET6 : AF_INET, ip->c_str(), b);
  const int bytes = v6 ? 16 : 4;
  for (int i = 0; i < bytes; ++i) {
    int keep = std::clamp(prefix - 8 * i, 0, 8);
    unsigned char mask = keep == 0 ? 0 : static_cast<unsigned char>(0xff << (8 - keep));
    if ((b[i] & ~mask) != 0) return "host bits set after the prefix (write the network address)";
  }
  rule->prefix = prefix;
  return "";
}

// Whether canonical IP literal `host` lies in the range network/prefix.
bool InRange(std::string_view host, const std::string& network, int prefix) {
  const bool v6 = network.find(':') != std::string::npos;
  if ((host.find(':') != std::string_view::npos) != v6) return false;
  unsigned char a[16] = {}, n[16] = {};
  if (inet_pton(v6 ? AF_INET6 : AF_INET, std::string(host).c_str(), a) != 1 ||
      inet_pton(v6 ? AF_INET6 : AF_INET, network.c_str(), n) != 1)
    return false;
  for (int i = 0; i < (v6 ? 16 : 4); ++i) {
    int keep = std::clamp(prefix - 8 * i, 0, 8);
    unsigned char mask = keep == 0 ? 0 : static_cast<unsigned char>(0xff << (8 - keep));
    if ((a[i] & mask) != (n[i] & mask)) return false;
  }
  return true;
}

std::string RuleText(const HostRule& r) {
  std::string t = r.kind == HostRule::Kind::kSuffix ? Cat("*.", r.host) : r.host;
  if (r.kind == HostRule::Kind::kIp && r.prefix >= 0) t += "/" + std::to_string(r.prefix);
  if (r.port) {
    if (r.kind == HostRule::Kind::kIp && t.find(':') != std::string::npos) t = Cat("[", t, "]");
    t += ":" + std::to_string(*r.port);
  }
  return t;
}

absl::StatusOr<uint16_t> ParsePort(std::string_view rule, std::string_view text) {
  unsigned value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || value < 1 ||
      value > 65535)
    return Invalid(Cat(Quote(rule), ": port must be 1..65535"));
  return static_cast<uint16_t>(value);
}

std::string Prefixed(std::string_view what, const absl::Status& status) {
  return Cat(what, ": ", std::string(status.message()));
}

// `ranges`: whether CIDR ranges are accepted (deny, tls_exclude). An allow or intent rule names
// single addresses: an allowed IP literal is explicitly allowed even when private or the
// host's own, and "0.0.0.0/0" meant as "the internet" would open all of those.
absl::StatusOr<std::vector<HostRule>> ParseRuleArray(const json::value& value,
                                                     std::string_view what, bool ranges = false) {
  const json::array* arr = value.if_array();
  if (arr == nullptr) return Invalid(Cat(what, " must be an array of host rules (strings)"));
  if (arr->size() > kMaxRulesPerList)
    return Invalid(Cat(what, ": at most ", std::to_string(kMaxRulesPerList), " rules"));
  std::vector<HostRule> out;
  for (size_t i = 0; i < arr->size(); ++i) {
    std::string where = Cat(what, "[", std::to_string(i), "]");
    const json::string* s = (*arr)[i].if_string();
    if (s == nullptr) return Invalid(Cat(where, " must be a string"));
    auto rule = ParseHostRule(std::string_view(*s));
    if (!rule.ok()) return Invalid(Prefixed(where, rule.status()));
    if (rule->prefix >= 0 && !ranges) {
      return Invalid(Cat(where, ": ", Quote(rule->text),
                         ": CIDR ranges are accepted in deny and tls_exclude only (an allowed "
                         "IP literal passes even when private: list single addresses)"));
    }
    if (std::find(out.begin(), out.end(), *rule) == out.end()) out.push_back(*std::move(rule));
  }
  return out;
}

json::array RulesToJson(const std::vector<HostRule>& rules) {
  json::array out;
  for (const HostRule& r : rules) out.emplace_back(r.text);
  return out;
}

bool MatchesAny(const std::vector<HostRule>& rules, std::string_view host, bool is_ip,
                uint16_t port, const HostRule** which) {
  for (const HostRule& r : rules)
    if (r.Matches(host, is_ip, port)) {
      if (which) *which = &r;
      return true;
    }
  return false;
}

absl::StatusOr<int64_t> IntField(const json::value& v, std::string_view what, int64_t min,
                                 int64_t max) {
  int64_t out = 0;
  if (v.is_int64()) {
    out = v.as_int64();
  } else if (v.is_uint64() && v.as_uint64() <= static_cast<uint64_t>(max)) {
    out = static_cast<int64_t>(v.as_uint64());
  } else if (v.is_double() &&
             v.as_double() == static_cast<double>(static_cast<int64_t>(v.as_double()))) {
    out = static_cast<int64_t>(v.as_double());
  } else {
    return Invalid(Cat(what, " must be an integer"));
  }
  if (out < min || out > max)
    return Invalid(
        Cat(what, " must be between ", std::to_string(min), " and ", std::to_string(max)));
  return out;
}

}  // namespace

std::string_view ToString(EgressMode mode) {
  switch (mode) {
    case EgressMode::kBlocked:
      return "blocked";
    case EgressMode::kAllowlist:
      return "allowlist";
    case EgressMode::kOpen:
      return "open";
  }
  return "blocked";
}

std::optional<EgressMode> ParseEgressMode(std::string_view text) {
  for (EgressMode m : {EgressMode::kBlocked, EgressMode::kAllowlist, EgressMode::kOpen})
    if (ToString(m) == text) return m;
  return std::nullopt;
}

bool HostRule::Matches(std::string_view normalized_host, bool host_is_ip, uint16_t p) const {
  if (port && *port != p) return false;
  switch (kind) {
    case Kind::kIp:
      if (!host_is_ip) return false;
      return prefix < 0 ? normalized_host == host : InRange(normalized_host, host, prefix);
    case Kind::kExact:
      return !host_is_ip && normalized_host == host;
    case Kind::kSuffix:
      return !host_is_ip && normalized_host.size() > host.size() + 1 &&
             normalized_host.ends_with(host) &&
             normalized_host[normalized_host.size() - host.size() - 1] == '.';
  }
  return false;
}

absl::StatusOr<HostRule> ParseHostRule(std::string_view text) {
  if (text.empty()) return Invalid("empty host rule");
  if (text.size() > kMaxHostLength + 16)
    return Invalid(
        Cat(Quote(text), ": longer than ", std::to_string(kMaxHostLength + 16), " characters"));
  HostRule rule;
  std::string_view host = text;
  // "[v6]" or "[v6]:port"
  if (host.front() == '[') {
    size_t close = host.find(']');
    if (close == std::string_view::npos) return Invalid(Cat(Quote(text), ": missing ']'"));
    std::string_view rest = host.substr(close + 1);
    host = host.substr(1, close - 1);
    if (!rest.empty()) {
      if (rest.front() != ':') return Invalid(Cat(Quote(text), ": expected ':port' after ']'"));
      auto port = ParsePort(text, rest.substr(1));
      if (!port.ok()) return port.status();
      rule.port = *port;
    }
    if (host.find(':') == std::string_view::npos)
      return Invalid(Cat(Quote(text), ": not an IPv6 address inside '[...]'"));
    if (std::string problem = ParseIpRule(host, &rule); !problem.empty())
      return Invalid(Cat(Quote(text), ": ", problem));
    rule.text = RuleText(rule);
    return rule;
  }
  size_t colons = std::count(host.begin(), host.end(), ':');
  if (colons > 1) {  // bare IPv6, no port
    if (std::string problem = ParseIpRule(host, &rule); !problem.empty())
      return Invalid(Cat(Quote(text), ": ", problem, " (write [addr]:port for a port)"));
    rule.text = RuleText(rule);
    return rule;
  }
  if (colons == 1) {
    size_t colon = host.find(':');
    auto port = ParsePort(text, host.substr(colon + 1));
    if (!port.ok()) return port.status();
    rule.port = *port;
    host = host.substr(0, colon);
  }
  if (size_t slash = host.find('/'); slash != std::string_view::npos) {  // IPv4 CIDR
    if (!CanonicalIp(host.substr(0, slash)))
      return Invalid(Cat(Quote(text), ": '/' only follows an IP address (a CIDR range)"));
    if (std::string problem = ParseIpRule(host, &rule); !problem.empty())
      return Invalid(Cat(Quote(text), ": ", problem));
    rule.text = RuleText(rule);
    return rule;
  }
  if (auto ip = CanonicalIp(host); ip && host.find(':') == std::string_view::npos) {
    rule.kind = HostRule::Kind::kIp;
    rule.host = *ip;
    rule.text = RuleText(rule);
    return rule;
  }
  std::string name = Lower(host);
  if (name == "*.") return Invalid(Cat(Quote(text), ": empty suffix after '*.'"));
  if (name.size() > 1 && name.back() == '.') name.pop_back();
  if (name == "*")
    return Invalid(Cat(Quote(text), ": a bare '*' is not a rule; use \"mode\": \"open\""));
  if (name.starts_with("*.")) {
    rule.kind = HostRule::Kind::kSuffix;
    name = name.substr(2);
    if (name.empty()) return Invalid(Cat(Quote(text), ": empty suffix after '*.'"));
  } else if (name.starts_with("*")) {
    return Invalid(Cat(Quote(text), ": '*' is only allowed as a leading '*.' label"));
  }
  if (std::string problem = NameProblem(name); !problem.empty())
    return Invalid(Cat(Quote(text), ": ", problem));
  rule.host = std::move(name);
  rule.text = RuleText(rule);
  return rule;
}

absl::StatusOr<std::vector<HostRule>> ParseHostRules(const json::value& value,
                                                     std::string_view what) {
  return ParseRuleArray(value, what, /*ranges=*/true);
}

bool EgressPolicy::operator==(const EgressPolicy& other) const {
  return mode == other.mode && allow == other.allow && deny == other.deny &&
         tls_inspect == other.tls_inspect && tls_exclude == other.tls_exclude && dlp == other.dlp &&
         max_body_bytes == other.max_body_bytes;
}

absl::StatusOr<EgressPolicy> ParseEgressPolicy(const json::value& value) {
  return ParseEgressPolicy(value, EgressPolicy{});
}

absl::StatusOr<EgressPolicy> ParseEgressPolicy(const json::value& value, const EgressPolicy& base) {
  const json::object* obj = value.if_object();
  if (obj == nullptr)
    return Invalid("network must be \"none\" or a policy object {\"mode\": ..., \"allow\": [...]}");
  EgressPolicy policy = base;
  for (const auto& [key, v] : *obj) {
    std::string field = Cat("network.", std::string_view(key));
    if (key == "mode") {
      const json::string* s = v.if_string();
      std::optional<EgressMode> mode;
      if (s) mode = ParseEgressMode(std::string_view(*s));
      if (!mode) return Invalid(Cat(field, " must be one of: blocked, allowlist, open"));
      policy.mode = *mode;
    } else if (key == "allow" || key == "deny" || key == "tls_exclude") {
      auto rules = ParseRuleArray(v, field, /*ranges=*/key != "allow");
      if (!rules.ok()) return rules.status();
      (key == "allow"  ? policy.allow
       : key == "deny" ? policy.deny
                       : policy.tls_exclude) = *std::move(rules);
    } else if (key == "tls_inspect") {
      if (!v.is_bool()) return Invalid(Cat(field, " must be true or false"));
      policy.tls_inspect = v.as_bool();
    } else if (key == "dlp") {
      const json::object* d = v.if_object();
      if (d == nullptr) return Invalid(Cat(field, " must be an object"));
      if (json::serialize(*d).size() > kMaxDlpJsonBytes)
        return Invalid(Cat(field, " is larger than ", std::to_string(kMaxDlpJsonBytes), " bytes"));
      policy.dlp = *d;
    } else if (key == "max_body_bytes") {
      auto n = IntField(v, field, 1, kMaxMaxBodyBytes);
      if (!n.ok()) return n.status();
      policy.max_body_bytes = *n;
    } else {
      return Invalid(Cat("unknown field ", Quote(Cat("network.", std::string_view(key))),
                         " (known: mode, allow, deny, tls_inspect, tls_exclude, dlp, "
                         "max_body_bytes)"));
    }
  }
  return policy;
}

json::object ToJson(const EgressPolicy& policy) {
  json::object out;
  out["mode"] = ToString(policy.mode);
  out["allow"] = RulesToJson(policy.allow);
  out["deny"] = RulesToJson(policy.deny);
  out["tls_inspect"] = policy.tls_inspect;
  out["tls_exclude"] = RulesToJson(policy.tls_exclude);
  out["dlp"] = policy.dlp;
  out["max_body_bytes"] = policy.max_body_bytes;
  return out;
}

json::object ToDisplayJson(const EgressPolicy& policy) {
  json::object out = ToJson(policy);
  if (json::array* secrets = out["dlp"].as_object().if_contains("secrets")
                                 ? out["dlp"].as_object()["secrets"].if_array()
                                 : nullptr) {
    for (json::value& s : *secrets) {
      if (json::object* o = s.if_object(); o && o->contains("value")) (*o)["value"] = "***";
    }
  }
  return out;
}

bool TlsExcluded(const EgressPolicy& policy, std::string_view host, uint16_t port) {
  if (!policy.tls_inspect) return true;
  bool is_ip = false;
  auto normalized = NormalizeHost(host, &is_ip);
  return normalized && MatchesAny(policy.tls_exclude, *normalized, is_ip, port, nullptr);
}

absl::Status ValidateIntentName(std::string_view name) {
  if (name.empty()) return Invalid("intent name is empty");
  if (name.size() > kMaxIntentNameLength)
    return Invalid(
        Cat("intent name longer than ", std::to_string(kMaxIntentNameLength), " characters"));
  auto lower_alnum = [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'); };
  if (!lower_alnum(name.front()))
    return Invalid(Cat("intent name ", Quote(name), " must start with [a-z0-9]"));
  for (char c : name)
    if (!lower_alnum(c) && c != '-' && c != '_' && c != '.')
      return Invalid(Cat("intent name ", Quote(name), " may contain only [a-z0-9._-]"));
  return absl::OkStatus();
}

absl::StatusOr<IntentCatalogue> ParseIntentCatalogue(const json::value& value) {
  const json::object* obj = value.if_object();
  if (obj == nullptr) return Invalid("intents must be an object {\"name\": {\"allow\": [...]}}");
  if (obj->size() > kMaxIntentsInCatalogue)
    return Invalid(Cat("intents: at most ", std::to_string(kMaxIntentsInCatalogue), " intents"));
  IntentCatalogue out;
  for (const auto& [key, v] : *obj) {
    std::string name(key);
    std::string where = Cat("intents.", name);
    if (auto st = ValidateIntentName(name); !st.ok()) return Invalid(Prefixed("intents", st));
    const json::object* def = v.if_object();
    if (def == nullptr) return Invalid(Cat(where, " must be an object {\"allow\": [...]}"));
    IntentDefinition intent;
    intent.name = name;
    bool has_allow = false;
    for (const auto& [k, fv] : *def) {
      if (k == "allow") {
        auto rules = ParseRuleArray(fv, Cat(where, ".allow"));
        if (!rules.ok()) return rules.status();
        intent.allow = *std::move(rules);
        has_allow = true;
      } else if (k == "max_ttl_seconds") {
        auto n = IntField(fv, Cat(where, ".max_ttl_seconds"), 1, kMaxIntentTtlSeconds);
        if (!n.ok()) return n.status();
        intent.max_ttl_seconds = *n;
      } else if (k == "description") {
        if (!fv.is_string() || fv.as_string().size() > 1024)
          return Invalid(Cat(where, ".description must be a string of at most 1024 bytes"));
        intent.description = std::string(fv.as_string());
      } else {
        return Invalid(Cat("unknown field ", Quote(Cat(where, ".", std::string_view(k))),
                           " (known: allow, max_ttl_seconds, description)"));
      }
    }
    if (!has_allow || intent.allow.empty())
      return Invalid(Cat(where, ".allow must list at least one host rule"));
    out.emplace(name, std::move(intent));
  }
  return out;
}

json::object ToJson(const IntentCatalogue& catalogue) {
  json::object out;
  for (const auto& [name, def] : catalogue) {
    json::object o;
    o["allow"] = RulesToJson(def.allow);
    o["max_ttl_seconds"] = def.max_ttl_seconds;
    if (!def.description.empty()) o["description"] = def.description;
    out[name] = std::move(o);
  }
  return out;
}

json::object ToJson(const ActiveIntent& intent) {
  json::object out;
  out["intent"] = intent.name;
  out["allow"] = RulesToJson(intent.allow);
  out["expires_ms"] = intent.expires_ms;
  return out;
}

absl::StatusOr<ActiveIntent> ParseActiveIntent(const json::value& value) {
  const json::object* obj = value.if_object();
  if (obj == nullptr) return Invalid("active intent must be an object");
  ActiveIntent out;
  const json::value* name = obj->if_contains("intent");
  const json::value* allow = obj->if_contains("allow");
  const json::value* expires = obj->if_contains("expires_ms");
  if (!name || !name->is_string()) return Invalid("active intent: 'intent' must be a string");
  out.name = std::string(name->as_string());
  if (auto st = ValidateIntentName(out.name); !st.ok()) return st;
  if (!allow) return Invalid("active intent: 'allow' missing");
  auto rules = ParseRuleArray(*allow, "active intent allow");
  if (!rules.ok()) return rules.status();
  out.allow = *std::move(rules);
  if (!expires) return Invalid("active intent: 'expires_ms' missing");
  auto ms = IntField(*expires, "active intent expires_ms", 0, INT64_MAX);
  if (!ms.ok()) return ms.status();
  out.expires_ms = *ms;
  return out;
}

std::optional<std::string> NormalizeHost(std::string_view host, bool* is_ip) {
  if (is_ip) *is_ip = false;
  if (host.empty() || host.size() > kMaxHostLength + 2) return std::nullopt;
  if (host.front() == '[') {
    if (host.size() < 3 || host.back() != ']') return std::nullopt;
    std::string_view inner = host.substr(1, host.size() - 2);
    if (inner.find(':') == std::string_view::npos) return std::nullopt;
    auto ip = CanonicalIp(inner);
    if (ip && is_ip) *is_ip = true;
    return ip;
  }
  if (auto ip = CanonicalIp(host)) {
    if (is_ip) *is_ip = true;
    return ip;
  }
  std::string name = Lower(host);
  if (name.size() > 1 && name.back() == '.') name.pop_back();
  if (!NameProblem(name).empty()) return std::nullopt;
  return name;
}

Decision Decide(const EgressPolicy& policy, std::span<const ActiveIntent> intents, int64_t now_ms,
                std::string_view host, uint16_t port) {
  if (policy.mode == EgressMode::kBlocked) return {false, "mode:blocked"};
  bool is_ip = false;
  std::optional<std::string> normalized = NormalizeHost(host, &is_ip);
  if (!normalized) return {false, "invalid_host"};
  const HostRule* rule = nullptr;
  if (MatchesAny(policy.deny, *normalized, is_ip, port, &rule))
    return {false, Cat("deny:", rule->text)};
  if (policy.mode == EgressMode::kOpen) return {true, "mode:open"};
  if (MatchesAny(policy.allow, *normalized, is_ip, port, &rule))
    return {true, Cat("allow:", rule->text)};
  for (const ActiveIntent& intent : intents)
    if (intent.ActiveAt(now_ms) && MatchesAny(intent.allow, *normalized, is_ip, port, nullptr))
      return {true, Cat("intent:", intent.name)};
  return {false, "not_allowed"};
}

}  // namespace esb::governance

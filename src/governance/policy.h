// The egress policy model (issue 12): what an environment with governed network may reach, the
// intent catalogue, and the one decision function the proxy (and the wheel cache) call.
//
//   auto policy = ParseEgressPolicy(json);            // 400-ready messages on bad input
//   Decision d = Decide(*policy, active_intents, NowMs(), "api.weather.test", 443);
//   if (!d.allowed) Block(d.rule);                     // e.g. "deny:*.evil.test"
//
// Host rules: "example.com" (exact), "*.example.com" (every subdomain, at any depth, NOT the
// apex example.com itself: list both if both are wanted), each with an optional ":port"
// ("*.example.com:443"); IP literals "203.0.113.7", "203.0.113.7:80", "2001:db8::1",
// "[2001:db8::1]:443", and CIDR ranges of them "203.0.113.0/24", "203.0.113.0/24:443",
// "2001:db8::/32", "[2001:db8::/32]:443" (host bits must be zero; deny and tls_exclude only).
// Names are compared case-insensitively, without a trailing dot. A name rule never matches an IP
// literal host and vice versa (the proxy decides on the name the client sent, then checks the
// resolved address separately).
//
// Decision order: mode blocked → refused ("mode:blocked", intents do not lift it); any deny rule
// matching → refused ("deny:<rule>"); mode open → allowed ("mode:open"); an allow rule →
// allowed ("allow:<rule>"); an active intent's rule → allowed ("intent:<name>"); else refused
// ("not_allowed"). An intent is active while now_ms < expires_ms (expired AT expires_ms).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "boost/json.hpp"

namespace esb::governance {

// Limits on untrusted policy input (each refused with a 400-ready message naming the limit).
inline constexpr size_t kMaxRulesPerList = 256;  // allow, deny, tls_exclude, an intent's allow
inline constexpr size_t kMaxHostLength = 253;    // a DNS name, without the "*." and ":port"
inline constexpr size_t kMaxLabelLength = 63;
inline constexpr size_t kMaxIntentNameLength = 63;  // [a-z0-9][a-z0-9._-]*
inline constexpr size_t kMaxIntentsInCatalogue = 256;
inline constexpr size_t kMaxActiveIntents = 32;  // per environment, at once
inline constexpr int64_t kMaxIntentTtlSeconds = 7 * 24 * 3600;
inline constexpr int64_t kDefaultIntentTtlSeconds = 300;  // an activation without ttl_seconds
inline constexpr int64_t kDefaultMaxBodyBytes = 10ll << 20;
inline constexpr int64_t kMaxMaxBodyBytes = 1ll << 30;
inline constexpr size_t kMaxDlpJsonBytes = 256 << 10;  // the serialised `dlp` object

enum class EgressMode { kBlocked, kAllowlist, kOpen };
std::string_view ToString(EgressMode mode);  // "blocked" | "allowlist" | "open"
std::optional<EgressMode> ParseEgressMode(std::string_view text);

// One allow/deny/exclude entry, already validated and normalised.
struct HostRule {
  enum class Kind { kExact, kSuffix, kIp };
  Kind kind = Kind::kExact;
  // kExact: the lower-case name; kSuffix: the lower-case suffix WITHOUT "*." (matches names
  // ending in "." + host); kIp: the canonical address text (inet_ntop form, no brackets).
  std::string host;
  // kIp: the prefix length of a CIDR rule ("10.0.0.0/8", host is then the network address),
  // -1 for one address.
  int prefix = -1;
  std::optional<uint16_t> port;  // nullopt: any port
  std::string text;              // canonical rule text, used in rule ids: "*.example.com:443"

  bool Matches(std::string_view normalized_host, bool host_is_ip, uint16_t port) const;
  bool operator==(const HostRule& other) const { return text == other.text; }
};

// Parses one rule ("*.example.com:443"); error messages name the rule and the problem.
absl::StatusOr<HostRule> ParseHostRule(std::string_view text);
// A list of rules (JSON array of strings), `what` names the field in messages ("deny"). CIDR
// ranges are accepted here; the policy and intent parsers refuse them in allow lists (an
// allowed IP literal passes even when private or the host's own: allow names single addresses).
absl::StatusOr<std::vector<HostRule>> ParseHostRules(const boost::json::value& value,
                                                     std::string_view what);

// The per-environment policy. JSON (api.md "Network policy"):
//   {"mode": "allowlist"|"open"|"blocked", "allow": [...], "deny": [...], "tls_inspect": bool,
//    "tls_exclude": [...], "dlp": {...}, "max_body_bytes": N}
// Absent fields take the defaults below. `dlp` is kept as JSON here (validated by the DLP
// library, governance/dlp/dlp.h, where it is compiled).
struct EgressPolicy {
  EgressMode mode = EgressMode::kAllowlist;
  std::vector<HostRule> allow;
  std::vector<HostRule> deny;
  bool tls_inspect = true;
  std::vector<HostRule> tls_exclude;  // hosts tunnelled without inspection (audited "opaque")
  boost::json::object dlp;
  // Largest request body the proxy forwards (scanned); above it the request is refused.
  int64_t max_body_bytes = kDefaultMaxBodyBytes;

  bool operator==(const EgressPolicy& other) const;
};

// Parses and validates a policy object; unknown fields, wrong types, bad rules and limits are
// errors (absl::InvalidArgument) whose message is meant for a 400 body, e.g.
// "network.allow[2]: '*.': empty suffix after '*.'".
absl::StatusOr<EgressPolicy> ParseEgressPolicy(const boost::json::value& value);
// Same, on top of `base` (fields absent in `value` keep base's values): tenant/daemon defaults.
absl::StatusOr<EgressPolicy> ParseEgressPolicy(const boost::json::value& value,
                                               const EgressPolicy& base);
boost::json::object ToJson(const EgressPolicy& policy);  // complete (store, proxy)
// The same for people and logs (API answers, audit details): the values of registered DLP
// secrets (`dlp.secrets[].value`) are shown as "***" (they are write-only).
boost::json::object ToDisplayJson(const EgressPolicy& policy);
// Whether a CONNECT to host:port is tunnelled without TLS inspection: tls_inspect is off, or a
// tls_exclude rule matches.
bool TlsExcluded(const EgressPolicy& policy, std::string_view host, uint16_t port);

// The intent catalogue (config `intents`, per tenant override): name → the hosts it allows.
//   {"check-weather": {"allow": ["weather.example", "*.weather.example"],
//                      "max_ttl_seconds": 3600, "description": "..."}}
struct IntentDefinition {
  std::string name;
  std::vector<HostRule> allow;
  int64_t max_ttl_seconds = kMaxIntentTtlSeconds;
  std::string description;
};
using IntentCatalogue = std::map<std::string, IntentDefinition, std::less<>>;
absl::StatusOr<IntentCatalogue> ParseIntentCatalogue(const boost::json::value& value);
boost::json::object ToJson(const IntentCatalogue& catalogue);
absl::Status ValidateIntentName(std::string_view name);

// An intent active on an environment until expires_ms (ms since the Unix epoch).
struct ActiveIntent {
  std::string name;
  std::vector<HostRule> allow;
  int64_t expires_ms = 0;

  bool ActiveAt(int64_t now_ms) const { return now_ms < expires_ms; }
  bool operator==(const ActiveIntent&) const = default;
};
boost::json::object ToJson(const ActiveIntent& intent);
absl::StatusOr<ActiveIntent> ParseActiveIntent(const boost::json::value& value);

struct Decision {
  bool allowed = false;
  // "mode:blocked" | "deny:<rule>" | "mode:open" | "allow:<rule>" | "intent:<name>" |
  // "not_allowed" | "invalid_host"
  std::string rule;
};

// Lower-cases, strips one trailing dot and IPv6 brackets; IP literals are returned in
// canonical form. nullopt: not a valid host name or IP literal.
std::optional<std::string> NormalizeHost(std::string_view host, bool* is_ip = nullptr);

// The decision for a connection to host:port at now_ms (see the order at the top).
Decision Decide(const EgressPolicy& policy, std::span<const ActiveIntent> intents, int64_t now_ms,
                std::string_view host, uint16_t port);

}  // namespace esb::governance

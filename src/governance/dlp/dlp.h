// Data-loss prevention for egress traffic: finds secrets (cloud keys, tokens, private keys),
// payment data and PII in URLs, headers and bodies, after decoding them (URL-encoding, JSON
// escapes, gzip/deflate/br, chunked, multipart), and decides per rule: block, redact or log.
//
// Shape (docs/design.md "Egress DLP"): literal-anchored secret rules and registered secret
// values are detected by Vectorscan (detect-only), then located with the rule's RE2;
// number-shaped PII (cards, SSN, phone, IBAN) and e-mail by hand-written scanners over SIMD
// byte-class masks that produce the same candidates as the rules' RE2 patterns; custom
// patterns by one RE2::Set.
// Every candidate is checked by its validator in code (Luhn, mod-97, SSN ranges, entropy,
// context words, the EXAMPLE allowlist). An Engine is compiled once per policy version and is
// immutable: share it across threads.
//
// Results never contain the matched text: a Finding is a rule id, an action and a span.
//
// Config JSON (the "dlp" object of an environment's network policy; unknown keys are errors):
//   {"enabled": true,                              // false: nothing is scanned
//    "rules": {"dlp:email": "redact", "dlp:phone": "off"},   // per-rule action overrides
//    "custom": [{"name": "ticket", "regex": "TCK-[0-9]{6}", "action": "block"}],  // RE2 syntax
//    "secrets": [{"name": "DB_PASSWORD", "value": "..."}],   // blocked wherever they appear
//    "allow": ["literal that is never reported"],  // e.g. a known test card
//    "max_body_bytes": 10485760,                   // decoded bytes scanned per body
//    "on_oversize": "block" | "pass_unscanned",
//    "scan_responses": false}
// Actions are "block" | "redact" | "log" | "off" ("off" disables the rule).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "boost/json.hpp"

namespace esb::governance::dlp {

// Ordered: the decision of a scan is the highest action among its findings.
enum class Action : uint8_t { kNone = 0, kLog = 1, kRedact = 2, kBlock = 3 };
std::string_view ActionName(Action action);  // "off" (kNone), "log", "redact", "block"
std::optional<Action> ParseAction(std::string_view name);

enum class Kind : uint8_t {
  kSecret,       // credentials: cloud keys, tokens, private keys, JWTs
  kFinancial,    // payment cards, IBANs
  kPii,          // SSN, e-mail, phone
  kCustom,       // the environment's custom patterns
  kSecretValue,  // a registered secret value
  kPolicy,       // not content: dlp:oversize, dlp:undecodable
};
std::string_view KindName(Kind kind);  // "secret", "financial", "pii", "custom", ...

// Where the scanned text came from (recorded in findings; decides the decoders of ScanText).
// kHost: a destination host name (absolute-URI host, CONNECT target); the proxy builds the
// text it scans from the name's labels (governance/proxy/host_scan.h).
enum class Where : uint8_t { kUrl, kHeader, kBody, kResponseBody, kHost };
// "url", "header", "body", "response_body", "host"
std::string_view WhereName(Where where);

// Stable rule ids. Built-in rules: dlp:credit_card, dlp:aws_access_key, dlp:aws_secret_key,
// dlp:github_token, dlp:slack_token, dlp:slack_webhook, dlp:google_api_key, dlp:openai_api_key,
// dlp:anthropic_api_key, dlp:private_key, dlp:jwt, dlp:iban, dlp:us_ssn, dlp:email, dlp:phone.
// Custom patterns are "dlp:custom:<name>", registered values "dlp:secret:<name>". Policy rules:
// "dlp:oversize" (a body above max_body_bytes; its action follows on_oversize: block or log,
// and nothing is scanned) and "dlp:undecodable" (corrupt or unsupported Content-Encoding,
// malformed chunked framing, a decompression error; what was decoded is still scanned).
inline constexpr std::string_view kRuleOversize = "dlp:oversize";
inline constexpr std::string_view kRuleUndecodable = "dlp:undecodable";

struct BuiltinRule {
  std::string_view id;
  Kind kind;
  Action default_action;
};
// The built-in rules with their default actions: secrets, cards and policy rules block; IBAN
// and SSN redact; e-mail and phone log.
const std::vector<BuiltinRule>& BuiltinRules();

struct CustomPattern {
  std::string name;   // [A-Za-z0-9_.-]{1,64}; rule id "dlp:custom:<name>"
  std::string regex;  // RE2 syntax, ≤ 1 KiB
  Action action = Action::kBlock;
};

struct SecretValue {
  std::string name;   // [A-Za-z0-9_.-]{1,64}; rule id "dlp:secret:<name>"
  std::string value;  // 8 B ..4 KiB; matched verbatim, as base64 and as hex (always block)
};

enum class OversizePolicy : uint8_t { kBlock, kPassUnscanned };

struct DlpConfig {
  bool enabled = true;
  std::map<std::string, Action> rule_actions;  // rule id → action (overrides the default)
  std::vector<CustomPattern> custom_patterns;  // ≤ 64
  std::vector<SecretValue> secret_values;      // ≤ 256
  std::vector<std::string> allow;              // exact matched texts never reported, ≤ 256
  uint64_t max_body_bytes = 10 * 1024 * 1024;  // decoded bytes; 1 KiB .. 256 MiB
  OversizePolicy on_oversize = OversizePolicy::kBlock;
  bool scan_responses = false;
};

// InvalidArgument naming the offending key ("dlp.custom[1].regex: missing ')'"). A rule id in
// "rules" may omit the "dlp:" prefix; unknown rule ids (and "oversize": see on_oversize) are
// errors.
absl::StatusOr<DlpConfig> ParseDlpConfig(const boost::json::value& json);
// Secret values are rendered as {"name": ..., "value": "***"} unless include_secret_values (the
// API shows the masked form; storage keeps the values).
boost::json::object ToJson(const DlpConfig& config, bool include_secret_values = false);

struct Finding {
  std::string rule_id;
  Action action = Action::kLog;
  Kind kind = Kind::kSecret;
  Where where = Where::kBody;
  // Decoders through which the match was seen, "" for the text as given, else e.g. "url",
  // "json", "json+url", "multipart", "multipart+json"; transport decoding (chunked, gzip,
  // deflate, br) is not listed (offsets are in the transport-decoded body).
  std::string layer;
  // Span in the scanned text (ScanText's input; for bodies the transport-decoded body), the
  // escaped bytes included when the match was seen in a decoded layer.
  size_t offset = 0;
  size_t length = 0;
};

struct Result {
  std::vector<Finding> findings;    // sorted by offset; one per rule and span
  Action decision = Action::kNone;  // block > redact > log > none
  // Set when a finding's action is redact or block: the scanned text with each such span
  // replaced by "[REDACTED:<rule id>]" (log-only findings stay). On kRedact the proxy forwards
  // it; on kBlock it is the audit copy. For bodies it is the transport-decoded body (no chunked
  // framing, no Content-Encoding): send it with Content-Length = size, without Content-Encoding.
  std::optional<std::string> redacted;
  // First blocking rule id ("" if none): the X-Esb-Blocked header value.
  std::string block_rule;
  bool blocked() const { return decision == Action::kBlock; }
};

// How a body is framed and encoded (from the message's headers).
struct BodyInfo {
  Where where = Where::kBody;    // kBody or kResponseBody
  std::string content_type;      // "application/json; charset=utf-8", multipart boundary
  std::string content_encoding;  // "", "identity", "gzip", "x-gzip", "deflate", "br", lists
  bool chunked = false;          // Transfer-Encoding: chunked framing still present
};

class Engine;

// Incremental body scanner: feed the body bytes as they arrive (any split), then Finish(). It
// de-chunks and decompresses on the fly (decoded size capped at max_body_bytes: a decompression
// bomb ends in dlp:oversize, never in memory growth) and buffers the decoded body (bounded by
// the cap) so that a match split across any chunk boundary is found. Not thread-safe; one per
// message. Holds a reference to its Engine.
class BodyScanner {
 public:
  virtual ~BodyScanner() = default;
  // Feeds raw wire bytes. Never fails: problems become findings at Finish().
  virtual void Feed(std::string_view bytes) = 0;
  // True once the decoded size passed max_body_bytes (further Feed()s are counted, not kept).
  virtual bool oversize() const = 0;
  // Scans what was fed; call once.
  virtual Result Finish() = 0;
};

struct EngineOptions {
  // false: every detect pattern goes to the RE2::Set instead of Vectorscan (same rules,
  // locating and validators). The bench's same-run baseline; also a cross-check in the tests.
  bool vectorscan = true;
};

class Engine {
 public:
  // Compiles the built-in rules with the config's overrides, custom patterns and secret values.
  // InvalidArgument for a bad pattern; Internal if Vectorscan or RE2 fail otherwise.
  static absl::StatusOr<std::shared_ptr<const Engine>> Compile(const DlpConfig& config,
                                                               const EngineOptions& options = {});

  // Scans a complete text: a URL (path+query, percent-decoded as well), a header value
  // (percent-decoded as well) or a whole body given as decoded text (JSON escapes and
  // percent-encoding decoded as well). Thread-safe.
  Result ScanText(std::string_view text, Where where) const;

  // A scanner for one message body. Thread-safe (each scanner is independent).
  std::unique_ptr<BodyScanner> NewBodyScanner(const BodyInfo& info) const;

  const DlpConfig& config() const;
  // Action of a rule id after overrides (kNone for unknown or disabled rules).
  Action ActionFor(std::string_view rule_id) const;

  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  struct Impl;  // dlp.cc

 private:
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace esb::governance::dlp

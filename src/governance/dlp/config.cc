// DlpConfig: JSON parsing and rendering, the built-in rule table and the enum names.
#include <algorithm>

#include "governance/dlp/dlp.h"
#include "re2/re2.h"

namespace esb::governance::dlp {
namespace {

constexpr size_t kMaxCustomPatterns = 64;
constexpr size_t kMaxCustomRegexBytes = 1024;
constexpr size_t kMaxSecretValues = 256;
constexpr size_t kMinSecretValueBytes = 8;
constexpr size_t kMaxSecretValueBytes = 4096;
constexpr size_t kMaxAllow = 256;
constexpr size_t kMaxAllowBytes = 1024;
constexpr uint64_t kMinBodyBytes = 1024;
constexpr uint64_t kMaxBodyBytes = 256ull * 1024 * 1024;

// absl::StrCat does not take std::string_view in this Abseil build.
void Append(std::string& out, std::string_view s) { out.append(s); }
void Append(std::string& out, uint64_t n) { out.append(std::to_string(n)); }
void Append(std::string& out, const char* s) { out.append(s); }
template <typename... A>
std::string Cat(const A&... a) {
  std::string out;
  (Append(out, a), ...);
  return out;
}

absl::Status Bad(std::string_view key, std::string_view what) {
  return absl::InvalidArgumentError(Cat(key, ": ", what));
}

bool ValidName(std::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '.' || c == '-';
  });
}

absl::StatusOr<std::string> GetString(const boost::json::object& obj, std::string_view key,
                                      std::string_view path) {
  const boost::json::value* v = obj.if_contains(key);
  if (v == nullptr) return Bad(Cat(path, ".", key), "missing");
  if (!v->is_string()) return Bad(Cat(path, ".", key), "must be a string");
  return std::string(v->get_string());
}

absl::StatusOr<Action> GetAction(const boost::json::value& v, std::string_view path) {
  if (!v.is_string()) return Bad(path, "must be \"block\", \"redact\", \"log\" or \"off\"");
  std::optional<Action> action = ParseAction(std::string_view(v.get_string()));
  if (!action) return Bad(path, "must be \"block\", \"redact\", \"log\" or \"off\"");
  return *action;
}

}  // namespace

std::string_view ActionName(Action action) {
  switch (action) {
    case Action::kNone:
      return "off";
    case Action::kLog:
      return "log";
    case Action::kRedact:
      return "redact";
    case Action::kBlock:
      return "block";
  }
  return "off";
}

std::optional<Action> ParseAction(std::string_view name) {
  if (name == "block") return Action::kBlock;
  if (name == "redact") return Action::kRedact;
  if (name == "log") return Action::kLog;
  if (name == "off") return Action::kNone;
  return std::nullopt;
}

std::string_view KindName(Kind kind) {
  switch (kind) {
    case Kind::kSecret:
      return "secret";
    case Kind::kFinancial:
      return "financial";
    case Kind::kPii:
      return "pii";
    case Kind::kCustom:
      return "custom";
    case Kind::kSecretValue:
      return "secret_value";
    case Kind::kPolicy:
      return "policy";
  }
  return "secret";
}

std::string_view WhereName(Where where) {
  switch (where) {
    case Where::kUrl:
      return "url";
    case Where::kHeader:
      return "header";
    case Where::kBody:
      return "body";
    case Where::kResponseBody:
      return "response_body";
    case Where::kHost:
      return "host";
  }
  return "body";
}

const std::vector<BuiltinRule>& BuiltinRules() {
  static const auto* rules = new std::vector<BuiltinRule>{
      {"dlp:credit_card", Kind::kFinancial, Action::kBlock},
      {"dlp:aws_access_key", Kind::kSecret, Action::kBlock},
      {"dlp:aws_secret_key", Kind::kSecret, Action::kBlock},
      {"dlp:github_token", Kind::kSecret, Action::kBlock},
      {"dlp:slack_token", Kind::kSecret, Action::kBlock},
      {"dlp:slack_webhook", Kind::kSecret, Action::kBlock},
      {"dlp:google_api_key", Kind::kSecret, Action::kBlock},
      {"dlp:openai_api_key", Kind::kSecret, Action::kBlock},
      {"dlp:anthropic_api_key", Kind::kSecret, Action::kBlock},
      {"dlp:private_key", Kind::kSecret, Action::kBlock},
      {"dlp:jwt", Kind::kSecret, Action::kBlock},
      {"dlp:iban", Kind::kFinancial, Action::kRedact},
      {"dlp:us_ssn", Kind::kPii, Action::kRedact},
      {"dlp:email", Kind::kPii, Action::kLog},
      {"dlp:phone", Kind::kPii, Action::kLog},
      {kRuleOversize, Kind::kPolicy, Action::kBlock},
      {kRuleUndecodable, Kind::kPolicy, Action::kBlock},
  };
  return *rules;
}

absl::StatusOr<DlpConfig> ParseDlpConfig(const boost::json::value& json) {
  if (!json.is_object()) return Bad("dlp", "must be an object");
  const boost::json::object& obj = json.get_object();
  DlpConfig config;
  for (const auto& [key, value] : obj) {
    const std::string path = Cat("dlp.", std::string_view(key));
    if (key == "enabled") {
      if (!value.is_bool()) return Bad(path, "must be a boolean");
      config.enabled = value.get_bool();
    } else if (key == "scan_responses") {
      if (!value.is_bool()) return Bad(path, "must be a boolean");
      config.scan_responses = value.get_bool();
    } else if (key == "max_body_bytes") {
      if (!value.is_int64() && !value.is_uint64()) return Bad(path, "must be an integer");
      const bool negative = value.is_int64() && value.get_int64() < 0;
      const uint64_t n = negative           ? 0
                         : value.is_int64() ? static_cast<uint64_t>(value.get_int64())
                                            : value.get_uint64();
      if (n < kMinBodyBytes || n > kMaxBodyBytes) {
        return Bad(path, Cat("must be in [", kMinBodyBytes, ", ", kMaxBodyBytes, "]"));
      }
      config.max_body_bytes = n;
    } else if (key == "on_oversize") {
      if (value.is_string() && value.get_string() == "block") {
        config.on_oversize = OversizePolicy::kBlock;
      } else if (value.is_string() && value.get_string() == "pass_unscanned") {
        config.on_oversize = OversizePolicy::kPassUnscanned;
      } else {
        return Bad(path, "must be \"block\" or \"pass_unscanned\"");
      }
    } else if (key == "rules") {
      if (!value.is_object()) return Bad(path, "must be an object of rule id → action");
      for (const auto& [rule, action_json] : value.get_object()) {
        std::string id(rule);
        if (id.rfind("dlp:", 0) != 0) id = Cat("dlp:", id);
        const std::string rule_path = Cat(path, ".", std::string_view(rule));
        const auto& builtin = BuiltinRules();
        const bool known = std::any_of(builtin.begin(), builtin.end(),
                                       [&](const BuiltinRule& r) { return r.id == id; });
        if (!known) return Bad(rule_path, "unknown rule id");
        if (id == kRuleOversize) return Bad(rule_path, "set by \"on_oversize\"");
        absl::StatusOr<Action> action = GetAction(action_json, rule_path);
        if (!action.ok()) return action.status();
        config.rule_actions[id] = *action;
      }
    } else if (key == "custom") {
      if (!value.is_array()) return Bad(path, "must be an array");
      if (value.get_array().size() > kMaxCustomPatterns) {
        return Bad(path, Cat("at most ", kMaxCustomPatterns, " patterns"));
      }
      size_t i = 0;
      for (const boost::json::value& item : value.get_array()) {
        const std::string item_path = Cat(path, "[", i++, "]");
        if (!item.is_object()) return Bad(item_path, "must be an object");
        CustomPattern pattern;
        for (const auto& [k, v] : item.get_object()) {
          if (k != "name" && k != "regex" && k != "action") {
            return Bad(Cat(item_path, ".", std::string_view(k)), "unknown key");
          }
        }
        absl::StatusOr<std::string> name = GetString(item.get_object(), "name", item_path);
        if (!name.ok()) return name.status();
        if (!ValidName(*name)) return Bad(item_path + ".name", "must match [A-Za-z0-9_.-]{1,64}");
        absl::StatusOr<std::string> regex = GetString(item.get_object(), "regex", item_path);
        if (!regex.ok()) return regex.status();
        if (regex->empty() || regex->size() > kMaxCustomRegexBytes) {
          return Bad(item_path + ".regex", "must be 1..1024 bytes");
        }
        RE2::Options options;
        options.set_log_errors(false);
        RE2 re(*regex, options);
        if (!re.ok()) return Bad(item_path + ".regex", std::string_view(re.error()));
        if (RE2 empty_check(*regex, options); RE2::PartialMatch("", empty_check)) {
          return Bad(item_path + ".regex", "must not match the empty string");
        }
        pattern.name = *name;
        pattern.regex = *regex;
        if (const boost::json::value* a = item.get_object().if_contains("action")) {
          absl::StatusOr<Action> action = GetAction(*a, item_path + ".action");
          if (!action.ok()) return action.status();
          pattern.action = *action;
        }
        for (const CustomPattern& other : config.custom_patterns) {
          if (other.name == pattern.name) return Bad(item_path + ".name", "duplicate name");
        }
        config.custom_patterns.push_back(std::move(pattern));
      }
    } else if (key == "secrets") {
      if (!value.is_array()) return Bad(path, "must be an array");
      if (value.get_array().size() > kMaxSecretValues) {
        return Bad(path, Cat("at most ", kMaxSecretValues, " values"));
      }
      size_t i = 0;
      for (const boost::json::value& item : value.get_array()) {
        const std::string item_path = Cat(path, "[", i++, "]");
        if (!item.is_object()) return Bad(item_path, "must be an object");
        for (const auto& [k, v] : item.get_object()) {
          if (k != "name" && k != "value") {
            return Bad(Cat(item_path, ".", std::string_view(k)), "unknown key");
          }
        }
        absl::StatusOr<std::string> name = GetString(item.get_object(), "name", item_path);
        if (!name.ok()) return name.status();
        if (!ValidName(*name)) return Bad(item_path + ".name", "must match [A-Za-z0-9_.-]{1,64}");
        absl::StatusOr<std::string> secret = GetString(item.get_object(), "value", item_path);
        if (!secret.ok()) return secret.status();
        if (secret->size() < kMinSecretValueBytes || secret->size() > kMaxSecretValueBytes) {
          // The value itself is never echoed back.
          return Bad(item_path + ".value", "must be 8..4096 bytes");
        }
        for (const SecretValue& other : config.secret_values) {
          if (other.name == *name) return Bad(item_path + ".name", "duplicate name");
        }
        config.secret_values.push_back({*name, *secret});
      }
    } else if (key == "allow") {
      if (!value.is_array()) return Bad(path, "must be an array of strings");
      if (value.get_array().size() > kMaxAllow) {
        return Bad(path, Cat("at most ", kMaxAllow, " entries"));
      }
      for (const boost::json::value& item : value.get_array()) {
        if (!item.is_string() || item.get_string().empty() ||
            item.get_string().size() > kMaxAllowBytes) {
          return Bad(path, "entries must be strings of 1..1024 bytes");
        }
        config.allow.emplace_back(item.get_string());
      }
    } else {
      return Bad(path, "unknown key");
    }
  }
  return config;
}

boost::json::object ToJson(const DlpConfig& config, bool include_secret_values) {
  boost::json::object out;
  out["enabled"] = config.enabled;
  boost::json::object rules;
  for (const auto& [id, action] : config.rule_actions) rules[id] = ActionName(action);
  out["rules"] = std::move(rules);
  boost::json::array custom;
  for (const CustomPattern& p : config.custom_patterns) {
    custom.push_back(boost::json::object{
        {"name", p.name}, {"regex", p.regex}, {"action", ActionName(p.action)}});
  }
  out["custom"] = std::move(custom);
  boost::json::array secrets;
  for (const SecretValue& s : config.secret_values) {
    secrets.push_back(boost::json::object{
        {"name", s.name}, {"value", include_secret_values ? std::string_view(s.value) : "***"}});
  }
  out["secrets"] = std::move(secrets);
  boost::json::array allow;
  for (const std::string& a : config.allow) allow.emplace_back(a);
  out["allow"] = std::move(allow);
  out["max_body_bytes"] = config.max_body_bytes;
  out["on_oversize"] = config.on_oversize == OversizePolicy::kBlock ? "block" : "pass_unscanned";
  out["scan_responses"] = config.scan_responses;
  return out;
}

}  // namespace esb::governance::dlp

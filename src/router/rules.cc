#include "router/rules.h"

#include <sys/stat.h>

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "boost/json.hpp"
#include "common/util.h"

namespace esb::router {
namespace {

namespace json = boost::json;

absl::Status Invalid(std::string_view key, std::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("router rules: key \"", AbslView(key), "\": ", AbslView(what)));
}

absl::StatusOr<Tier> ParseTier(const json::object& obj, std::string_view key, Tier fallback,
                               bool required) {
  const json::value* v = obj.if_contains(json::string_view(key.data(), key.size()));
  if (v == nullptr) {
    if (required) return Invalid(key, "missing (want \"heavy\" or \"nano\")");
    return fallback;
  }
  if (const json::string* s = v->if_string()) {
    if (*s == "heavy") return Tier::kHeavy;
    if (*s == "nano") return Tier::kNano;
  }
  return Invalid(key, "must be \"heavy\" or \"nano\"");
}

// True for "a", "a.b_c", "é.x"; false for "", "a..b", ".a", "a-b".
bool IsModuleName(std::string_view s) {
  bool seg_start = true;
  for (unsigned char c : s) {
    bool id_start = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c >= 0x80;
    if (c == '.') {
      if (seg_start) return false;
      seg_start = true;
    } else if (id_start || (!seg_start && c >= '0' && c <= '9')) {
      seg_start = false;
    } else {
      return false;
    }
  }
  return !seg_start;
}

absl::Status ParseNameList(const json::object& obj, std::string_view key, bool required,
                           const std::function<absl::Status(std::string)>& add) {
  const json::value* v = obj.if_contains(json::string_view(key.data(), key.size()));
  if (v == nullptr)
    return required ? Invalid(key, "missing (want a list of names)") : absl::OkStatus();
  const json::array* arr = v->if_array();
  if (arr == nullptr) return Invalid(key, "must be a list of names");
  for (size_t i = 0; i < arr->size(); ++i) {
    const json::string* s = (*arr)[i].if_string();
    if (s == nullptr || !IsModuleName(std::string_view(s->data(), s->size()))) {
      return Invalid(key, absl::StrCat("entry ", i, " is not a dotted module name"));
    }
    if (absl::Status st = add(std::string(s->data(), s->size())); !st.ok()) return st;
  }
  return absl::OkStatus();
}

// "a, b, c +2 more" — keeps reasons short.
std::string JoinShort(const std::vector<std::string>& names, size_t max = 3) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < max; ++i) {
    if (i > 0) out += ", ";
    out += names[i];
  }
  if (names.size() > max) absl::StrAppend(&out, " +", names.size() - max, " more");
  return out;
}

bool HasRequirements(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    size_t hash = line.find('#');
    if (hash != std::string_view::npos) line = line.substr(0, hash);
    if (line.find_first_not_of(" \t\r\f\v") != std::string_view::npos) return true;
    pos = end + 1;
  }
  return false;
}

void AddUnique(std::vector<std::string>* v, const std::string& s) {
  for (const std::string& x : *v) {
    if (x == s) return;
  }
  v->push_back(s);
}

}  // namespace

std::string_view TierName(Tier tier) { return tier == Tier::kNano ? "nano" : "heavy"; }

absl::StatusOr<RouterRules> RouterRules::Parse(std::string_view text) {
  boost::system::error_code ec;
  json::value root = json::parse(json::string_view(text.data(), text.size()), ec);
  if (ec)
    return absl::InvalidArgumentError(absl::StrCat("router rules: invalid JSON: ", ec.message()));
  const json::object* obj = root.if_object();
  if (obj == nullptr)
    return absl::InvalidArgumentError("router rules: top level must be an object");

  static const char* const kKnown[] = {
      "version",        "default_for_unknown", "heavy_modules",
      "nano_modules",   "heavy_capabilities",  "packages_force_heavy",
      "dynamic_import", "relative_import"};
  for (const auto& kv : *obj) {
    std::string_view key(kv.key().data(), kv.key().size());
    if (key.starts_with("_")) continue;  // "_comment" and friends
    bool known = false;
    for (const char* k : kKnown) known |= key == k;
    if (!known) return Invalid(key, "unknown key");
  }
  if (const json::value* v = obj->if_contains("version")) {
    if (!v->is_int64() || v->as_int64() != 1) return Invalid("version", "must be 1");
  }

  RouterRules rules;
  absl::StatusOr<Tier> tier = ParseTier(*obj, "default_for_unknown", Tier::kHeavy, true);
  if (!tier.ok()) return tier.status();
  rules.default_for_unknown_ = *tier;
  tier = ParseTier(*obj, "dynamic_import", Tier::kHeavy, false);
  if (!tier.ok()) return tier.status();
  rules.dynamic_import_ = *tier;
  tier = ParseTier(*obj, "relative_import", Tier::kHeavy, false);
  if (!tier.ok()) return tier.status();
  rules.relative_import_ = *tier;

  if (const json::value* v = obj->if_contains("packages_force_heavy")) {
    if (!v->is_bool()) return Invalid("packages_force_heavy", "must be true or false");
    rules.packages_force_heavy_ = v->get_bool();
  }

  auto add_module = [&rules](std::string_view key, Tier t) {
    return [&rules, key, t](std::string name) -> absl::Status {
      auto [it, inserted] = rules.modules_.emplace(name, t);
      if (!inserted && it->second != t) {
        return Invalid(key, absl::StrCat("\"", name, "\" is also listed in the other tier"));
      }
      return absl::OkStatus();
    };
  };
  if (absl::Status s =
          ParseNameList(*obj, "heavy_modules", true, add_module("heavy_modules", Tier::kHeavy));
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          ParseNameList(*obj, "nano_modules", true, add_module("nano_modules", Tier::kNano));
      !s.ok()) {
    return s;
  }
  if (absl::Status s = ParseNameList(*obj, "heavy_capabilities", false,
                                     [&rules](std::string name) {
                                       rules.heavy_capabilities_.insert(std::move(name));
                                       return absl::OkStatus();
                                     });
      !s.ok()) {
    return s;
  }
  return rules;
}

absl::StatusOr<RouterRules> RouterRules::Load(const std::string& path) {
  std::string text;
  if (absl::Status s = ReadFileToString(path, &text); !s.ok()) return s;
  absl::StatusOr<RouterRules> rules = Parse(text);
  if (!rules.ok()) {
    return absl::Status(rules.status().code(), absl::StrCat(path, ": ", rules.status().message()));
  }
  return rules;
}

RouterRules::Class RouterRules::Classify(std::string_view name, std::string* entry) const {
  std::string candidate(name);
  for (;;) {
    auto it = modules_.find(candidate);
    if (it != modules_.end()) {
      *entry = candidate;
      return it->second == Tier::kNano ? Class::kNano : Class::kHeavy;
    }
    size_t dot = candidate.rfind('.');
    if (dot == std::string::npos) return Class::kUnknown;
    candidate.resize(dot);
  }
}

RouteDecision RouterRules::Decide(const ImportScan& scan, const RouteRequest& request) const {
  const std::string& hint = request.runtime_hint;
  if (hint == "nano") return {Tier::kNano, "runtime nano requested"};
  if (!hint.empty() && hint != "auto")
    return {Tier::kHeavy, absl::StrCat("runtime ", hint, " requested")};

  if (packages_force_heavy_ && !request.packages.empty()) {
    return {Tier::kHeavy, "packages requested"};
  }
  if (packages_force_heavy_ && HasRequirements(request.requirements)) {
    return {Tier::kHeavy, "requirements requested"};
  }

  std::vector<std::string> heavy, unknown;
  std::string entry;
  for (const std::string& name : scan.dotted) {
    switch (Classify(name, &entry)) {
      case Class::kHeavy:
        AddUnique(&heavy, entry);
        break;
      case Class::kUnknown:
        AddUnique(&unknown, name.substr(0, name.find('.')));
        break;
      case Class::kNano:
        break;
    }
  }
  if (!heavy.empty()) {
    return {Tier::kHeavy,
            absl::StrCat(JoinShort(heavy), heavy.size() == 1 ? " needs" : " need", " heavy")};
  }
  std::vector<std::string> caps;
  for (const std::string& cap : scan.capabilities) {
    if (heavy_capabilities_.count(cap)) caps.push_back(cap);
  }
  if (!caps.empty()) {
    return {Tier::kHeavy,
            absl::StrCat(JoinShort(caps), caps.size() == 1 ? " needs" : " need", " heavy")};
  }
  if (scan.has_dynamic_import && dynamic_import_ == Tier::kHeavy) {
    return {Tier::kHeavy, "dynamic import"};
  }
  if (!scan.relative.empty() && relative_import_ == Tier::kHeavy) {
    return {Tier::kHeavy, "relative import"};
  }
  if (!unknown.empty() && default_for_unknown_ == Tier::kHeavy) {
    return {Tier::kHeavy,
            absl::StrCat(unknown.size() == 1 ? "unknown module: " : "unknown modules: ",
                         JoinShort(unknown))};
  }
  if (scan.modules.empty()) return {Tier::kNano, "no imports"};
  return {Tier::kNano, absl::StrCat("imports: ", JoinShort(scan.modules, 5))};
}

absl::StatusOr<std::unique_ptr<RulesHolder>> RulesHolder::Create(std::string path, Clock clock) {
  if (!clock) clock = [] { return MonotonicMs(); };
  std::unique_ptr<RulesHolder> holder(new RulesHolder(std::move(path), std::move(clock)));
  std::lock_guard<std::mutex> lock(holder->mu_);
  if (absl::Status s = holder->CheckLocked(true); !s.ok()) return s;
  if (holder->rules_ == nullptr) {
    return absl::InternalError(absl::StrCat(holder->path_, ": rules not loaded"));
  }
  return holder;
}

std::shared_ptr<const RouterRules> RulesHolder::Current() {
  std::lock_guard<std::mutex> lock(mu_);
  (void)CheckLocked(false);  // errors are kept in last_error_ and logged
  return rules_;
}

absl::Status RulesHolder::MaybeReload(bool force) {
  std::lock_guard<std::mutex> lock(mu_);
  return CheckLocked(force);
}

absl::Status RulesHolder::last_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_error_;
}

absl::Status RulesHolder::CheckLocked(bool force) {
  int64_t now = clock_();
  if (!force && rules_ != nullptr && now - last_check_ms_ < 1000) return absl::OkStatus();
  last_check_ms_ = now;

  struct stat st;
  if (stat(path_.c_str(), &st) != 0) {
    absl::Status s = ErrnoStatus(absl::StrCat("stat ", path_));
    if (last_error_.message() != s.message()) LogWarn(absl::StrCat("router rules: ", s.ToString()));
    last_error_ = s;
    return s;
  }
  FileId id{static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec,
            static_cast<int64_t>(st.st_size), static_cast<uint64_t>(st.st_ino)};
  if (!force && id == seen_) return last_error_;  // unchanged (maybe still the invalid version)
  seen_ = id;

  absl::StatusOr<RouterRules> loaded = RouterRules::Load(path_);
  if (!loaded.ok()) {
    last_error_ = loaded.status();
    if (rules_ != nullptr) {
      LogWarn(absl::StrCat("router rules: keeping previous rules: ", last_error_.ToString()));
    }
    return last_error_;
  }
  rules_ = std::make_shared<const RouterRules>(*std::move(loaded));
  last_error_ = absl::OkStatus();
  return absl::OkStatus();
}

}  // namespace esb::router

#include "core/tools/tool_gate.h"

#include <algorithm>
#include <chrono>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/util.h"
#include "core/environment_manager.h"
#include "governance/dlp/dlp.h"

namespace esb::tools {
namespace json = boost::json;
namespace dlp = governance::dlp;

namespace {

constexpr size_t kMinBase64Length = 16;  // shorter strings carry no key worth decoding
constexpr int kMaxNestedJsonDepth = 4;   // strings holding JSON holding strings holding JSON...
// Bytes of second-pass text per scanned byte at most: the glued values and keys are about twice
// what they came from, each nested JSON level adds as much again, base64 ¾ of its run;
// legitimate arguments (a JSON document as a string near the limit) stay well within this.
constexpr size_t kLayersPerByte = kMaxNestedJsonDepth + 4;

int64_t SteadyMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The nesting depth of `v` (a scalar: 0), without recursion (a hostile in-process caller may
// hand over anything); stops counting past `limit`.
int Depth(const json::value& v, int limit) {
  struct Item {
    const json::value* v;
    int depth;
  };
  std::vector<Item> stack{{&v, 0}};
  int max_depth = 0;
  while (!stack.empty()) {
    Item it = stack.back();
    stack.pop_back();
    if (it.v->is_object()) {
      if (it.depth + 1 > limit) return it.depth + 1;
      max_depth = std::max(max_depth, it.depth + 1);
      for (const auto& kv : it.v->get_object()) stack.push_back({&kv.value(), it.depth + 1});
    } else if (it.v->is_array()) {
      if (it.depth + 1 > limit) return it.depth + 1;
      max_depth = std::max(max_depth, it.depth + 1);
      for (const json::value& x : it.v->get_array()) stack.push_back({&x, it.depth + 1});
    }
  }
  return max_depth;
}

bool IsBase64Char(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '+' || c == '/' || c == '-' ||
         c == '_';
}

// The text of the second pass, each part scanned on its own line(s). Adding stops at `limit`
// bytes in all (sets `cut`).
struct Layers {
  size_t limit = 0;
  std::string values;           // every string value in document order, glued
  std::string keys_and_values;  // each key on a new line, glued to the string values after it
  std::string keys;             // every object key, glued
  std::string decoded;          // nested JSON documents' layers and decoded base64, one a line
  bool cut = false;

  size_t size() const {
    return values.size() + keys_and_values.size() + keys.size() + decoded.size();
  }
  bool Full(size_t more) {
    if (size() + more > limit) cut = true;
    return cut;
  }
  std::string Text() const {
    return absl::StrCat(values, "\n", keys_and_values, "\n", keys, "\n", decoded);
  }
};

void AppendLayers(const json::value& root, int nested, Layers* out);

// What a string may hide: a JSON document (parsed, its layers added) and base64 runs of at
// least kMinBase64Length characters anywhere in it (decoded, then looked into again), up to
// kMaxNestedJsonDepth levels. Runs are decoded from their first character: base64 glued to a
// word ("xyQUtJQ...") decodes misaligned and is not seen.
void AppendHidden(std::string_view s, int nested, Layers* out) {
  if (nested >= kMaxNestedJsonDepth || out->cut) return;
  std::string_view trimmed = s;
  while (!trimmed.empty() && absl::ascii_isspace(static_cast<unsigned char>(trimmed[0]))) {
    trimmed.remove_prefix(1);
  }
  if (!trimmed.empty() && (trimmed[0] == '{' || trimmed[0] == '[') && !out->Full(s.size())) {
    boost::system::error_code ec;
    json::parse_options opts;
    opts.max_depth = kMaxArgumentDepth;
    json::value inner = json::parse(s, ec, {}, opts);
    if (!ec) {
      Layers sub;
      sub.limit = out->limit - std::min(out->limit, out->size());
      AppendLayers(inner, nested + 1, &sub);
      out->decoded.append("\n").append(sub.Text()).append("\n");
      if (sub.cut) out->cut = true;
    }
  }
  size_t i = 0;
  while (i < s.size() && !out->cut) {
    if (!IsBase64Char(s[i])) {
      ++i;
      continue;
    }
    // A line break continues a run after whole groups of 16+ characters (MIME-wrapped base64)
    // and ends it otherwise (a word on the line before).
    std::string run;
    while (i < s.size()) {
      if (IsBase64Char(s[i])) {
        run += s[i];
      } else if ((s[i] != '\n' && s[i] != '\r') || run.size() < kMinBase64Length ||
                 run.size() % 4 != 0) {
        break;
      }
      ++i;
    }
    while (i < s.size() && s[i] == '=') ++i;  // padding: the decoders do without it
    if (run.size() < kMinBase64Length) continue;
    if (run.size() % 4 == 1) run.pop_back();  // a trailing word glued on: not a whole group
    std::string bytes;
    if (!absl::Base64Unescape(run, &bytes) && !absl::WebSafeBase64Unescape(run, &bytes)) continue;
    if (out->Full(bytes.size() + 2)) return;
    out->decoded.append("\n").append(bytes).append("\n");
    AppendHidden(bytes, nested + 1, out);
  }
}

// The layers of `root`: its keys and string values glued in document order (a secret split
// across values, array items, a key and its value, or keys reads whole), and what its strings
// hide (AppendHidden).
void AppendLayers(const json::value& root, int nested, Layers* out) {
  struct Item {
    const json::value* v;
    std::string_view key;  // an object key (v == nullptr)
  };
  std::vector<Item> stack{{&root, {}}};
  while (!stack.empty() && !out->cut) {
    Item it = stack.back();
    stack.pop_back();
    if (it.v == nullptr) {
      if (out->Full(2 * it.key.size() + 1)) return;
      out->keys.append(it.key);
      out->keys_and_values.append("\n").append(it.key);
      AppendHidden(it.key, nested, out);
      continue;
    }
    const json::value* v = it.v;
    if (v->is_object()) {
      const json::object& o = v->get_object();
      // Reverse, so keys and values come off the stack in document order.
      for (auto kv = o.end(); kv != o.begin();) {
        --kv;
        stack.push_back({&kv->value(), {}});
        stack.push_back({nullptr, kv->key()});
      }
    } else if (v->is_array()) {
      const json::array& a = v->get_array();
      for (auto x = a.end(); x != a.begin();) stack.push_back({&*--x, {}});
    } else if (v->is_string()) {
      std::string_view s = v->get_string();
      if (out->Full(2 * s.size())) return;
      out->values.append(s);
      out->keys_and_values.append(s);
      AppendHidden(s, nested, out);
    }
  }
}

// Every string value of `v` replaced by `marker` (the audit copy of arguments whose secret
// could not be cut out in place); keys and structure stay.
json::value MaskStrings(const json::value& v, const std::string& marker, int depth = 0) {
  if (depth > kMaxArgumentDepth) return json::value(marker);
  if (v.is_string()) return json::value(marker);
  if (v.is_object()) {
    json::object o;
    for (const auto& kv : v.get_object()) o[kv.key()] = MaskStrings(kv.value(), marker, depth + 1);
    return o;
  }
  if (v.is_array()) {
    json::array a;
    for (const json::value& x : v.get_array()) a.push_back(MaskStrings(x, marker, depth + 1));
    return a;
  }
  return v;
}

// Cuts `s` to at most `max` bytes at a UTF-8 boundary, marking the cut.
std::string CapText(std::string s, size_t max) {
  if (s.size() <= max) return s;
  const size_t total = s.size();
  size_t n = max;
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
  s.resize(n);
  absl::StrAppend(&s, "…[truncated ", total - n, " bytes]");
  return s;
}

void AddRule(std::vector<std::string>* rules, const std::string& rule) {
  if (std::find(rules->begin(), rules->end(), rule) == rules->end()) rules->push_back(rule);
}

ToolResult ErrorResult(std::string message) {
  ToolResult r;
  r.is_error = true;
  r.content.push_back(json::object{{"type", "text"}, {"text", std::move(message)}});
  return r;
}

// `what`: "arguments contain" | "tool's result contains".
std::string BlockMessage(const std::string& rule, const std::string& what) {
  return absl::StrCat("blocked by data-loss prevention rule ", rule, ": the ", what,
                      " data this environment's policy does not let through a tool call. Do not "
                      "retry with the same data by other means.");
}

// The result as the scanner sees it: content items and structuredContent, with the `data` of
// image and audio items left out (base64 of binary: scanned decoded, in the second pass; kept
// aside by index to restore after a redaction). Every other field of every item (a text item's
// `data`, a resource's `blob`, `_meta`, fields no spec defines) stays in the view.
json::object ScanView(const ToolResult& r, std::vector<std::pair<size_t, json::value>>* media) {
  json::array content;
  for (size_t i = 0; i < r.content.size(); ++i) {
    json::value item = r.content[i];
    if (item.is_object()) {
      json::object& o = item.as_object();
      const json::value* type = o.if_contains("type");
      const bool binary = type != nullptr && (*type == "image" || *type == "audio");
      if (json::value* d = o.if_contains("data"); binary && d != nullptr && d->is_string()) {
        media->emplace_back(i, *d);
        *d = "";
      }
    }
    content.push_back(std::move(item));
  }
  json::object view{{"content", std::move(content)}};
  if (r.structured) view["structuredContent"] = *r.structured;
  return view;
}

}  // namespace

DlpPolicySource DlpPolicyFrom(EnvironmentManager* manager) {
  return [manager](const Caller& caller,
                   const std::string& environment_id) -> absl::StatusOr<json::object> {
    if (!environment_id.empty()) {
      absl::StatusOr<NetworkInfo> net = manager->GetNetwork(caller, environment_id);
      if (net.ok() && net->governed) return net->policy.dlp;
      // Missing or another tenant's: the tenant default (the dispatch says NotFound itself).
      if (!net.ok() && !IsEnvironmentNotFound(net.status())) return net.status();
    }
    return manager->DefaultEgressPolicy(caller.tenant).dlp;
  };
}

ToolCallGate::ToolCallGate(AuditLog* audit, DlpPolicySource policy, GateOptions options)
    : audit_(audit), policy_(std::move(policy)), options_(options) {}

ToolCallGate::~ToolCallGate() = default;

size_t ToolCallGate::cached_engines() const {
  std::lock_guard<std::mutex> lock(cache_mu_);
  return cache_.size();
}

absl::StatusOr<std::shared_ptr<const dlp::Engine>> ToolCallGate::EngineFor(
    const json::object& config) {
  std::string key = json::serialize(config);
  {
    std::lock_guard<std::mutex> lock(cache_mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) {
      cache_order_.splice(cache_order_.begin(), cache_order_, it->second.order);
      return it->second.engine;
    }
  }
  // Compiled outside the lock (Vectorscan takes tens of ms); two racing compiles of one new
  // policy both succeed and one result is kept.
  absl::StatusOr<dlp::DlpConfig> parsed = dlp::ParseDlpConfig(config);
  if (!parsed.ok()) return parsed.status();
  absl::StatusOr<std::shared_ptr<const dlp::Engine>> engine = dlp::Engine::Compile(*parsed);
  if (!engine.ok()) return engine.status();
  std::lock_guard<std::mutex> lock(cache_mu_);
  auto it = cache_.find(key);
  if (it != cache_.end()) return it->second.engine;
  while (cache_.size() >= std::max<size_t>(1, options_.max_cached_engines)) {
    cache_.erase(cache_order_.back());
    cache_order_.pop_back();
  }
  cache_order_.push_front(key);
  cache_.emplace(std::move(key), CacheEntry{*engine, cache_order_.begin()});
  return *engine;
}

absl::StatusOr<ToolResult> ToolCallGate::Call(const GateCall& call, const json::object& arguments,
                                              const CallContext& context,
                                              const Dispatch& dispatch) {
  return Call(call, arguments, context,
              StreamingDispatch([&dispatch](const json::object& args, const CallContext&) {
                return dispatch(args);
              }));
}

absl::StatusOr<ToolResult> ToolCallGate::Call(const GateCall& call, const json::object& arguments,
                                              const CallContext& context,
                                              const StreamingDispatch& dispatch) {
  const int64_t start = SteadyMs();
  ToolCallAuditRow row;
  row.environment_id = call.environment_id;
  row.call.tool = call.tool;
  row.call.server = call.server;
  bool blocked = false;
  bool redacted = false;
  auto finish = [&](absl::StatusOr<ToolResult> out) -> absl::StatusOr<ToolResult> {
    row.duration_ms = SteadyMs() - start;
    if (blocked) {
      row.call.decision = "blocked";
      row.outcome = absl::PermissionDeniedError("blocked by data-loss prevention");
    } else if (!out.ok() || out->is_error) {
      row.call.decision = "error";
      row.outcome = out.ok() ? absl::OkStatus() : out.status();
    } else {
      row.call.decision = redacted ? "redacted" : "allowed";
    }
    row.call.arguments = CapText(std::move(row.call.arguments), options_.max_audit_argument_bytes);
    audit_->RecordToolCall(context.caller, row);
    return out;
  };

  // 1. Arguments too deep to walk are refused before anything else looks at them.
  if (Depth(json::value(arguments), kMaxArgumentDepth) > kMaxArgumentDepth) {
    blocked = true;
    row.call.rule_ids.emplace_back(dlp::kRuleUndecodable);
    row.call.arguments =
        absl::StrCat("[not stored: nested deeper than ", kMaxArgumentDepth, " levels]");
    return finish(ErrorResult(absl::StrCat("arguments are nested deeper than ", kMaxArgumentDepth,
                                           " levels; refused unscanned (",
                                           std::string(dlp::kRuleUndecodable), ")")));
  }

  // 2. The policy and its engine.
  absl::StatusOr<json::object> policy =
      policy_ ? policy_(context.caller, call.environment_id) : json::object();
  if (!policy.ok()) {
    row.call.arguments = "[not stored: the DLP policy could not be loaded]";
    return finish(absl::Status(policy.status().code(),
                               absl::StrCat("tool call refused: the data-loss prevention policy "
                                            "could not be loaded: ",
                                            policy.status().message())));
  }
  absl::StatusOr<std::shared_ptr<const dlp::Engine>> engine = EngineFor(*policy);
  if (!engine.ok()) {
    row.call.arguments = "[not stored: the DLP policy is invalid]";
    return finish(absl::InternalError(
        absl::StrCat("tool call refused: the data-loss prevention policy is invalid: ",
                     engine.status().message())));
  }
  const dlp::Engine& eng = **engine;
  const dlp::DlpConfig& config = eng.config();
  const size_t limit = std::min<uint64_t>(options_.max_scanned_bytes, config.max_body_bytes);

  // 3. Scan the arguments.
  json::object dispatched = arguments;
  std::string serialized = json::serialize(arguments);
  if (!config.enabled) {
    row.call.arguments = serialized;
  } else if (serialized.size() > limit) {
    AddRule(&row.call.rule_ids, std::string(dlp::kRuleOversize));
    row.call.arguments = absl::StrCat("[not stored: ", serialized.size(),
                                      " bytes, above the scan limit of ", limit, " bytes]");
    if (config.on_oversize == dlp::OversizePolicy::kBlock) {
      blocked = true;
      return finish(
          ErrorResult(absl::StrCat("arguments of ", serialized.size(), " bytes are above the ",
                                   limit, "-byte limit of what is scanned; refused unscanned (",
                                   std::string(dlp::kRuleOversize), ")")));
    }
  } else {
    dlp::Result first = eng.ScanText(serialized, dlp::Where::kBody);
    for (const dlp::Finding& f : first.findings) AddRule(&row.call.rule_ids, f.rule_id);
    if (first.blocked()) {
      blocked = true;
      row.call.arguments = first.redacted.value_or("[not stored]");
      return finish(ErrorResult(BlockMessage(first.block_rule, "arguments contain")));
    }
    if (first.decision == dlp::Action::kRedact && first.redacted) {
      boost::system::error_code ec;
      json::value v = json::parse(*first.redacted, ec);
      if (ec || !v.is_object()) {
        // A match that spans JSON structure cannot be cut out as text: fail closed.
        std::string rule;
        for (const dlp::Finding& f : first.findings)
          if (f.action == dlp::Action::kRedact) rule = f.rule_id;
        blocked = true;
        row.call.arguments = json::serialize(
            MaskStrings(json::value(arguments), absl::StrCat("[REDACTED:", rule, "]")));
        return finish(ErrorResult(BlockMessage(rule, "arguments contain")));
      }
      dispatched = std::move(v.as_object());
      redacted = true;
    }
    // Second pass: values joined, nested JSON, base64 — what the first pass cannot see whole.
    Layers layers;
    layers.limit = kLayersPerByte * limit;
    AppendLayers(json::value(dispatched), 0, &layers);
    const bool cut = layers.cut;
    dlp::Result second = eng.ScanText(layers.Text(), dlp::Where::kBody);
    std::string second_block;
    for (const dlp::Finding& f : second.findings) {
      AddRule(&row.call.rule_ids, f.rule_id);
      if (f.action >= dlp::Action::kRedact && second_block.empty()) second_block = f.rule_id;
    }
    if (!second_block.empty()) {
      blocked = true;
      row.call.arguments = json::serialize(
          MaskStrings(json::value(dispatched), absl::StrCat("[REDACTED:", second_block, "]")));
      return finish(ErrorResult(BlockMessage(second_block, "arguments contain")));
    }
    if (cut) {
      AddRule(&row.call.rule_ids, std::string(dlp::kRuleOversize));
      if (config.on_oversize == dlp::OversizePolicy::kBlock) {
        blocked = true;
        row.call.arguments = "[not stored: the decoded arguments are above the scan limit]";
        return finish(ErrorResult(absl::StrCat("the decoded arguments are above the ", limit,
                                               "-byte limit of what is scanned; refused (",
                                               std::string(dlp::kRuleOversize), ")")));
      }
    }
    row.call.arguments = json::serialize(dispatched);
  }

  // 4. Dispatch, with progress messages scanned as part of the result.
  std::mutex progress_mu;  // progress may come from another thread
  CallContext guarded = context;
  if (config.enabled && context.progress) {
    guarded.progress = [&](const Progress& p) {
      Progress sent = p;
      if (p.message.size() <= limit) {
        dlp::Result r = eng.ScanText(p.message, dlp::Where::kBody);
        {
          std::lock_guard<std::mutex> lock(progress_mu);
          for (const dlp::Finding& f : r.findings) AddRule(&row.call.result_rule_ids, f.rule_id);
        }
        if (config.scan_responses && r.blocked()) {
          sent.message = absl::StrCat("[withheld: ", r.block_rule, "]");
        } else if (config.scan_responses && r.decision == dlp::Action::kRedact && r.redacted) {
          sent.message = *r.redacted;
        }
      } else if (config.scan_responses && config.on_oversize == dlp::OversizePolicy::kBlock) {
        sent.message = absl::StrCat("[withheld: ", std::string(dlp::kRuleOversize), "]");
      }
      context.progress(sent);
    };
  }
  absl::StatusOr<ToolResult> out = dispatch(dispatched, guarded);
  guarded.progress = nullptr;
  if (!out.ok()) return finish(std::move(out));
  { std::lock_guard<std::mutex> sync(progress_mu); }  // the sinks' writes to `row` are seen

  // 5. Scan the result: always recorded; acted on only with dlp.scan_responses.
  std::vector<std::pair<size_t, json::value>> media;
  json::object view = ScanView(*out, &media);
  std::string text = json::serialize(view);
  size_t media_bytes = 0;
  for (const auto& [i, d] : media) media_bytes += d.get_string().size();
  row.call.result_bytes = static_cast<int64_t>(text.size() + media_bytes);
  if (!config.enabled) return finish(std::move(out));
  const bool act = config.scan_responses;
  auto withhold = [&](const std::string& rule) {
    blocked = true;
    return finish(ErrorResult(BlockMessage(rule, "tool's result contains")));
  };
  // Images and audio count: their decoded bytes are scanned too.
  if (text.size() + media_bytes > limit) {
    AddRule(&row.call.result_rule_ids, std::string(dlp::kRuleOversize));
    if (act && config.on_oversize == dlp::OversizePolicy::kBlock) {
      blocked = true;
      return finish(ErrorResult(absl::StrCat("the tool's result of ", text.size() + media_bytes,
                                             " bytes is above the scan limit; withheld (",
                                             std::string(dlp::kRuleOversize), ")")));
    }
    return finish(std::move(out));
  }
  dlp::Result res = eng.ScanText(text, dlp::Where::kBody);
  for (const dlp::Finding& f : res.findings) AddRule(&row.call.result_rule_ids, f.rule_id);
  if (act && res.blocked()) return withhold(res.block_rule);
  json::value scanned = view;  // what the second pass reads: the result as it would go out
  if (act && res.decision == dlp::Action::kRedact && res.redacted) {
    boost::system::error_code ec;
    json::value v = json::parse(*res.redacted, ec);
    const json::value* content =
        !ec && v.is_object() ? v.as_object().if_contains("content") : nullptr;
    if (content == nullptr || !content->is_array() ||
        content->get_array().size() != out->content.size()) {
      std::string rule;
      for (const dlp::Finding& f : res.findings)
        if (f.action == dlp::Action::kRedact) rule = f.rule_id;
      return withhold(rule);
    }
    ToolResult r;
    r.is_error = out->is_error;
    r.content = content->get_array();
    for (const auto& [i, d] : media) {
      if (r.content[i].is_object()) r.content[i].as_object()["data"] = d;
    }
    if (const json::value* s = v.as_object().if_contains("structuredContent");
        s != nullptr && s->is_object()) {
      r.structured = s->get_object();
    }
    redacted = true;
    out = std::move(r);
    scanned = std::move(v);
  }
  // Second pass, as for the arguments: glued keys and values, nested JSON, base64 anywhere
  // (a resource's `blob`, a text item's `data`), and the decoded image and audio data. What is
  // found only here cannot be cut out in place: a redact or block action withholds the result.
  Layers layers;
  layers.limit = kLayersPerByte * limit;
  AppendLayers(scanned, 0, &layers);
  for (const auto& [i, d] : media) AppendHidden(d.get_string(), 0, &layers);
  dlp::Result second = eng.ScanText(layers.Text(), dlp::Where::kBody);
  std::string second_block;
  for (const dlp::Finding& f : second.findings) {
    AddRule(&row.call.result_rule_ids, f.rule_id);
    if (f.action >= dlp::Action::kRedact && second_block.empty()) second_block = f.rule_id;
  }
  if (layers.cut) AddRule(&row.call.result_rule_ids, std::string(dlp::kRuleOversize));
  if (!act) return finish(std::move(out));
  if (!second_block.empty()) return withhold(second_block);
  if (layers.cut && config.on_oversize == dlp::OversizePolicy::kBlock) {
    blocked = true;
    return finish(
        ErrorResult(absl::StrCat("the tool's decoded result is above the scan limit; "
                                 "withheld (",
                                 std::string(dlp::kRuleOversize), ")")));
  }
  return finish(std::move(out));
}

}  // namespace esb::tools

#include "api/json_util.h"

#include <charconv>
#include <cmath>
#include <limits>

namespace esb::api {

// ---------------------------------------------------------------------------------------------
// Body parsing

JsonBody ParseJsonObject(std::string_view text, bool allow_empty) {
  if (TrimAscii(text).empty()) {
    if (allow_empty) return JsonBody(boost::json::object());
    return JsonBody(ErrorResponse(400, "bad_request", "request body must be a JSON object"));
  }
  // Strict JSON (no comments, trailing commas or invalid numbers), valid UTF-8 only, and a
  // nesting limit, so that a hostile body is a 400 rather than deep recursion later (renderers,
  // validators) or a crash. The parser itself keeps its stack on the heap.
  boost::json::parse_options popts;
  popts.max_depth = kMaxJsonDepth;
  popts.allow_comments = false;
  popts.allow_trailing_commas = false;
  popts.allow_invalid_utf8 = false;
  boost::json::parser p(boost::json::storage_ptr(), popts);
  boost::json::error_code ec;
  size_t consumed = p.write(text.data(), text.size(), ec);
  if (ec) {
    return JsonBody(ErrorResponse(
        400, "bad_request", Cat("malformed JSON body: ", ec.message(), " at offset ", consumed)));
  }
  boost::json::value v = p.release();
  if (!v.is_object()) {
    return JsonBody(ErrorResponse(400, "bad_request", "request body must be a JSON object"));
  }
  return JsonBody(std::move(v.as_object()));
}

std::optional<Response> CheckJsonContentType(const Request& req) {
  if (!req.has_body()) return std::nullopt;
  std::string ct = req.ContentType();
  if (ct == "application/json" ||
      (ct.starts_with("application/") && std::string_view(ct).ends_with("+json"))) {
    return std::nullopt;
  }
  return ErrorResponse(415, "unsupported_media_type",
                       Cat("request body must be JSON: send Content-Type: application/json (got ",
                           ct.empty() ? std::string("no Content-Type") : Cat("'", ct, "'"), ")"));
}

JsonBody ParseJsonObjectBody(const Request& req, bool allow_empty) {
  if (std::optional<Response> bad = CheckJsonContentType(req)) return JsonBody(std::move(*bad));
  return ParseJsonObject(req.body(), allow_empty);
}

std::string ToJson(const boost::json::value& value) { return boost::json::serialize(value); }

// ---------------------------------------------------------------------------------------------
// JsonFields

const boost::json::value* JsonFields::Lookup(std::string_view name) {
  seen_[std::string(name)] = true;
  const boost::json::value* v = obj_.if_contains(name);
  if (v != nullptr && v->is_null()) return nullptr;
  return v;
}

bool JsonFields::Has(std::string_view name) const {
  const boost::json::value* v = obj_.if_contains(name);
  return v != nullptr && !v->is_null();
}

void JsonFields::Allow(std::string_view name) { seen_[std::string(name)] = true; }

void JsonFields::Fail(std::string message) {
  if (error_.empty()) error_ = std::move(message);
}

std::string JsonFields::RequiredString(std::string_view name) {
  const boost::json::value* v = Lookup(name);
  if (v == nullptr) {
    Fail(Cat("missing required field '", name, "'"));
    return "";
  }
  if (!v->is_string()) {
    Fail(Cat("field '", name, "' must be a string"));
    return "";
  }
  return std::string(v->as_string());
}

std::optional<std::string> JsonFields::OptionalString(std::string_view name) {
  const boost::json::value* v = Lookup(name);
  if (v == nullptr) return std::nullopt;
  if (!v->is_string()) {
    Fail(Cat("field '", name, "' must be a string"));
    return std::nullopt;
  }
  return std::string(v->as_string());
}

std::string JsonFields::OptionalString(std::string_view name, std::string_view fallback) {
  std::optional<std::string> v = OptionalString(name);
  return v ? *v : std::string(fallback);
}

std::string JsonFields::OptionalEnum(std::string_view name, std::string_view fallback,
                                     std::initializer_list<std::string_view> allowed) {
  std::optional<std::string> v = OptionalString(name);
  if (!v) return std::string(fallback);
  for (std::string_view a : allowed) {
    if (*v == a) return *v;
  }
  std::string list;
  for (std::string_view a : allowed) list.append(list.empty() ? "" : ", ").append(a);
  Fail(Cat("field '", name, "' must be one of: ", list));
  return std::string(fallback);
}

std::optional<int64_t> JsonFields::OptionalInt(std::string_view name, int64_t min, int64_t max) {
  const boost::json::value* v = Lookup(name);
  if (v == nullptr) return std::nullopt;
  int64_t n = 0;
  bool in_int64 = true;
  if (v->is_int64()) {
    n = v->as_int64();
  } else if (v->is_uint64()) {
    in_int64 = false;  // > INT64_MAX
  } else if (v->is_double()) {
    double d = v->as_double();
    if (!std::isfinite(d) || std::trunc(d) != d) {
      Fail(Cat("field '", name, "' must be an integer"));
      return std::nullopt;
    }
    if (d < -9.2e18 || d > 9.2e18) {
      in_int64 = false;
    } else {
      n = static_cast<int64_t>(d);
    }
  } else {
    Fail(Cat("field '", name, "' must be an integer"));
    return std::nullopt;
  }
  if (!in_int64 || n < min || n > max) {
    Fail(Cat("field '", name, "' must be between ", min, " and ", max));
    return std::nullopt;
  }
  return n;
}

int64_t JsonFields::OptionalInt(std::string_view name, int64_t fallback, int64_t min, int64_t max) {
  if (!Has(name)) {
    Allow(name);
    return fallback;
  }
  std::optional<int64_t> v = OptionalInt(name, min, max);
  return v ? *v : fallback;
}

int64_t JsonFields::RequiredInt(std::string_view name, int64_t min, int64_t max) {
  if (!Has(name)) {
    Allow(name);
    Fail(Cat("missing required field '", name, "'"));
    return 0;
  }
  std::optional<int64_t> v = OptionalInt(name, min, max);
  return v ? *v : 0;
}

std::optional<double> JsonFields::OptionalDouble(std::string_view name, double min, double max) {
  const boost::json::value* v = Lookup(name);
  if (v == nullptr) return std::nullopt;
  if (!v->is_number()) {
    Fail(Cat("field '", name, "' must be a number"));
    return std::nullopt;
  }
  double d = v->to_number<double>();
  if (!std::isfinite(d) || d < min || d > max) {
    Fail(Cat("field '", name, "' must be between ", min, " and ", max));
    return std::nullopt;
  }
  return d;
}

double JsonFields::OptionalDouble(std::string_view name, double fallback, double min, double max) {
  std::optional<double> v = OptionalDouble(name, min, max);
  return v ? *v : fallback;
}

std::optional<bool> JsonFields::OptionalBool(std::string_view name) {
  const boost::json::value* v = Lookup(name);
  if (v == nullptr) return std::nullopt;
  if (!v->is_bool()) {
    Fail(Cat("field '", name, "' must be true or false"));
    return std::nullopt;
  }
  return v->as_bool();
}

bool JsonFields::OptionalBool(std::string_view name, bool fallback) {
  std::optional<bool> v = OptionalBool(name);
  return v ? *v : fallback;
}

std::map<std::string, std::string> JsonFields::OptionalStringMap(std::string_view name,
                                                                 size_t max_entries) {
  std::map<std::string, std::string> out;
  const boost::json::value* v = Lookup(name);
  if (v == nullptr) return out;
  if (!v->is_object()) {
    Fail(Cat("field '", name, "' must be an object of strings"));
    return out;
  }
  if (v->as_object().size() > max_entries) {
    Fail(Cat("field '", name, "' has more than ", max_entries, " entries"));
    return out;
  }
  for (const auto& kv : v->as_object()) {
    if (!kv.value().is_string()) {
      Fail(Cat("field '", name, "': value of '", std::string_view(kv.key()), "' must be a string"));
      return {};
    }
    out[std::string(kv.key())] = std::string(kv.value().as_string());
  }
  return out;
}

const boost::json::value* JsonFields::OptionalValue(std::string_view name) { return Lookup(name); }

void JsonFields::CheckUnknown() {
  if (!error_.empty()) return;
  for (const auto& kv : obj_) {
    if (seen_.find(std::string_view(kv.key())) == seen_.end()) {
      error_ = Cat("unknown field '", std::string_view(kv.key()), "'");
      return;
    }
  }
}

bool JsonFields::ok() {
  CheckUnknown();
  return error_.empty();
}

const std::string& JsonFields::error() {
  CheckUnknown();
  return error_;
}

Response JsonFields::ErrorResponse() {
  CheckUnknown();
  return esb::api::ErrorResponse(400, "bad_request", error_.empty() ? "bad request" : error_);
}

// ---------------------------------------------------------------------------------------------
// Text helpers

namespace text {
void Append(std::string& out, double d) {
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), d);
  out.append(buf, res.ptr);
}
}  // namespace text

std::vector<std::string_view> SplitString(std::string_view s, char sep, bool skip_empty) {
  std::vector<std::string_view> out;
  size_t start = 0;
  for (;;) {
    size_t end = s.find(sep, start);
    std::string_view piece = s.substr(start, end == std::string_view::npos ? end : end - start);
    if (!piece.empty() || !skip_empty) out.push_back(piece);
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  return out;
}

std::string JoinStrings(const std::vector<std::string>& parts, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i > 0) out.append(sep);
    out.append(parts[i]);
  }
  return out;
}

std::string_view TrimAscii(std::string_view s) {
  auto space = [](char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
  };
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return s;
}

namespace {
char LowerAscii(char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c + 32) : c; }
}  // namespace

std::string ToLowerAscii(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = LowerAscii(c);
  return out;
}

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (LowerAscii(a[i]) != LowerAscii(b[i])) return false;
  }
  return true;
}

bool StartsWithIgnoreCase(std::string_view s, std::string_view prefix) {
  return s.size() >= prefix.size() && EqualsIgnoreCase(s.substr(0, prefix.size()), prefix);
}

// ---------------------------------------------------------------------------------------------
// base64

namespace {

constexpr char kB64Alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

int B64Value(unsigned char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

}  // namespace

std::string Base64Encode(std::string_view data) {
  std::string out;
  out.reserve((data.size() + 2) / 3 * 4);
  const auto* p = reinterpret_cast<const unsigned char*>(data.data());
  size_t i = 0;
  for (; i + 3 <= data.size(); i += 3) {
    uint32_t v = (p[i] << 16) | (p[i + 1] << 8) | p[i + 2];
    out.push_back(kB64Alphabet[(v >> 18) & 63]);
    out.push_back(kB64Alphabet[(v >> 12) & 63]);
    out.push_back(kB64Alphabet[(v >> 6) & 63]);
    out.push_back(kB64Alphabet[v & 63]);
  }
  size_t rest = data.size() - i;
  if (rest == 1) {
    uint32_t v = p[i] << 16;
    out.push_back(kB64Alphabet[(v >> 18) & 63]);
    out.push_back(kB64Alphabet[(v >> 12) & 63]);
    out.append("==");
  } else if (rest == 2) {
    uint32_t v = (p[i] << 16) | (p[i + 1] << 8);
    out.push_back(kB64Alphabet[(v >> 18) & 63]);
    out.push_back(kB64Alphabet[(v >> 12) & 63]);
    out.push_back(kB64Alphabet[(v >> 6) & 63]);
    out.push_back('=');
  }
  return out;
}

absl::StatusOr<std::string> Base64Decode(std::string_view text) {
  size_t pad = 0;
  while (pad < 2 && !text.empty() && text[text.size() - 1 - pad] == '=') ++pad;
  if (pad > 0 && text.size() % 4 != 0) {
    return absl::InvalidArgumentError("invalid base64: bad padding");
  }
  std::string_view body = text.substr(0, text.size() - pad);
  if (body.size() % 4 == 1) return absl::InvalidArgumentError("invalid base64: bad length");
  std::string out;
  out.reserve(body.size() / 4 * 3 + 2);
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < body.size(); ++i) {
    int v = B64Value(static_cast<unsigned char>(body[i]));
    if (v < 0) {
      return absl::InvalidArgumentError(Cat("invalid base64: unexpected character at offset ", i));
    }
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  if (bits > 0 && (acc & ((1u << bits) - 1)) != 0) {
    return absl::InvalidArgumentError("invalid base64: non-zero trailing bits");
  }
  return out;
}

}  // namespace esb::api

// JSON request-body helpers for API routes, plus base64 and UTF-8 utilities.
//
//   auto body = ParseJsonObjectBody(req);          // 400 malformed / not an object, 415 type
//   if (!body.ok()) return body.error();
//   JsonFields f(body.value());
//   std::string path = f.RequiredString("path");
//   std::string content = f.OptionalString("content", "");
//   std::string enc = f.OptionalEnum("encoding", "utf-8", {"utf-8", "base64"});
//   int64_t t = f.OptionalInt("timeout_seconds", 60, 1, 3600);
//   if (!f.ok()) return f.ErrorResponse();         // first problem, or "unknown field 'x'"
#pragma once

#include <cstdint>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "api/http_server.h"
#include "boost/json.hpp"
#include "common/utf8.h"  // IsValidUtf8, SanitizeUtf8 for the routes

namespace esb::api {

// Result of ParseJsonObjectBody: either an object or a ready-made error response.
class JsonBody {
 public:
  explicit JsonBody(boost::json::object obj) : object_(std::move(obj)) {}
  explicit JsonBody(Response error) : error_(std::move(error)) {}
  bool ok() const { return !error_.has_value(); }
  boost::json::object& value() { return object_; }
  const boost::json::object& value() const { return object_; }
  const Response& error() const { return *error_; }

 private:
  boost::json::object object_;
  std::optional<Response> error_;
};

// Parses the request body as a JSON object.
// - empty (or whitespace-only) body: an empty object if `allow_empty`, else 400;
// - a body without Content-Type application/json (or application/*+json): 415, see
//   CheckJsonContentType;
// - malformed JSON (including invalid UTF-8): 400 "malformed JSON body: <reason> at offset N";
// - valid JSON that is not an object: 400 "request body must be a JSON object".
JsonBody ParseJsonObjectBody(const Request& req, bool allow_empty = true);
// SECURITY: JSON routes take only application/json (or application/*+json) bodies; parameters
// such as charset are fine. A browser page on another site can send a form or text/plain body
// without a CORS preflight, never a JSON one, so this is what keeps cross-site requests from
// acting on the API. A request with a body and any other (or no) Content-Type → 415 with a
// message saying what to send; a request without a body passes. Usable on the header alone
// (Request::has_body()), before the body is read.
std::optional<Response> CheckJsonContentType(const Request& req);
// The same checks on a raw string (no content-type check).
// How deeply a JSON request body may nest arrays and objects (deeper → 400).
inline constexpr int kMaxJsonDepth = 32;
JsonBody ParseJsonObject(std::string_view text, bool allow_empty = true);

// Typed, range-checked reads of an object's fields that remember the first error and reject
// fields nobody asked for. Call ok() after reading every field you accept. A JSON null counts as
// "absent" for Optional* readers. Accessors return a neutral value (empty, 0, default) on error.
class JsonFields {
 public:
  explicit JsonFields(const boost::json::object& obj) : obj_(obj) {}

  std::string RequiredString(std::string_view name);
  std::string OptionalString(std::string_view name, std::string_view fallback);
  std::optional<std::string> OptionalString(std::string_view name);
  // One of `allowed`, else 400 "'name' must be one of: a, b".
  std::string OptionalEnum(std::string_view name, std::string_view fallback,
                           std::initializer_list<std::string_view> allowed);

  // Integers: JSON integers, or numbers with an integral value (60.0). Range inclusive.
  int64_t RequiredInt(std::string_view name, int64_t min, int64_t max);
  int64_t OptionalInt(std::string_view name, int64_t fallback, int64_t min, int64_t max);
  std::optional<int64_t> OptionalInt(std::string_view name, int64_t min, int64_t max);
  // Any JSON number. Range inclusive.
  double OptionalDouble(std::string_view name, double fallback, double min, double max);
  std::optional<double> OptionalDouble(std::string_view name, double min, double max);

  bool OptionalBool(std::string_view name, bool fallback);
  std::optional<bool> OptionalBool(std::string_view name);

  // An object whose values are all strings, e.g. "env": {"K": "V"}. At most `max_entries`.
  std::map<std::string, std::string> OptionalStringMap(std::string_view name,
                                                       size_t max_entries = 4096);
  // Raw access (marks the field as known). Null pointer if absent.
  const boost::json::value* OptionalValue(std::string_view name);

  // Marks a field as accepted without reading it.
  void Allow(std::string_view name);
  bool Has(std::string_view name) const;

  // Records a custom validation error (only the first error is kept).
  void Fail(std::string message);

  // True if no error so far and no unknown field. Call after all reads.
  bool ok();
  // The first error message ("" if ok()).
  const std::string& error();
  // 400 bad_request with error().
  Response ErrorResponse();

 private:
  const boost::json::value* Lookup(std::string_view name);  // marks as seen
  void CheckUnknown();

  const boost::json::object& obj_;
  std::map<std::string, bool, std::less<>> seen_;
  std::string error_;
};

// Shortcut for serialising a value to compact JSON text.
std::string ToJson(const boost::json::value& value);

// --- base64 (RFC 4648 standard alphabet) ---
std::string Base64Encode(std::string_view data);
// Accepts padded or unpadded input; rejects characters outside the alphabet (whitespace
// included), misplaced padding and non-zero trailing bits.
absl::StatusOr<std::string> Base64Decode(std::string_view text);

// --- Text helpers on std::string_view ---
// (Debian's Abseil is built with its own absl::string_view, so absl::StrCat/StrSplit/... do not
// accept std::string_view; these cover what the API layer needs.)
namespace text {
inline void Append(std::string& out, std::string_view s) { out.append(s); }
inline void Append(std::string& out, const char* s) { out.append(s); }
inline void Append(std::string& out, const std::string& s) { out.append(s); }
inline void Append(std::string& out, char c) { out.push_back(c); }
inline void Append(std::string& out, bool b) { out.append(b ? "true" : "false"); }
void Append(std::string& out, double d);  // shortest round-trip form ("0.5", "1e+300")
template <class T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
void Append(std::string& out, T v) {
  out.append(std::to_string(v));
}
}  // namespace text

// Concatenates strings, string_views, chars, integers and doubles.
template <class... Args>
std::string Cat(const Args&... args) {
  std::string out;
  (text::Append(out, args), ...);
  return out;
}
std::vector<std::string_view> SplitString(std::string_view s, char sep, bool skip_empty = false);
std::string JoinStrings(const std::vector<std::string>& parts, std::string_view sep);
std::string_view TrimAscii(std::string_view s);
std::string ToLowerAscii(std::string_view s);
bool EqualsIgnoreCase(std::string_view a, std::string_view b);
bool StartsWithIgnoreCase(std::string_view s, std::string_view prefix);

}  // namespace esb::api

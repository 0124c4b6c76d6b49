// The request/response types, their helpers and the router of http_server.h: everything that
// does not touch a socket (the server itself is in server.cc).
#include <poll.h>

#include <algorithm>

#include "api/http/internal.h"
#include "api/http_server.h"
#include "api/json_util.h"
#include "common/util.h"

namespace esb::api {

namespace http_internal {

bool PeerHasClosed(int fd) {
  if (fd < 0) return false;
  pollfd pfd{fd, POLLRDHUP, 0};
  if (poll(&pfd, 1, 0) <= 0) return false;
  return (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

}  // namespace http_internal

// ---------------------------------------------------------------------------------------------
// Request

std::string Request::Param(std::string_view name) const {
  auto it = params_.find(name);
  return it == params_.end() ? std::string() : it->second;
}

std::optional<std::string> Request::Query(std::string_view key) const {
  for (const auto& [k, v] : query_) {
    if (k == key) return v;
  }
  return std::nullopt;
}

std::vector<std::string> Request::QueryAll(std::string_view key) const {
  std::vector<std::string> out;
  for (const auto& [k, v] : query_) {
    if (k == key) out.push_back(v);
  }
  return out;
}

std::optional<std::string> Request::Header(std::string_view name) const {
  for (const auto& [k, v] : headers_) {
    if (EqualsIgnoreCase(k, name)) return v;
  }
  return std::nullopt;
}

std::string Request::HeaderOr(std::string_view name, std::string_view fallback) const {
  std::optional<std::string> v = Header(name);
  return v ? *v : std::string(fallback);
}

bool Request::Accepts(std::string_view mime_type) const {
  for (const auto& [k, v] : headers_) {
    if (!EqualsIgnoreCase(k, "accept")) continue;
    for (std::string_view item : SplitString(v, ',')) {
      std::string_view type = TrimAscii(item.substr(0, item.find(';')));
      if (EqualsIgnoreCase(type, mime_type)) return true;
    }
  }
  return false;
}

std::string Request::ContentType() const {
  std::optional<std::string> v = Header("content-type");
  if (!v) return "";
  std::string_view type = TrimAscii(std::string_view(*v).substr(0, v->find(';')));
  return ToLowerAscii(type);
}

bool Request::ClientGone() const { return http_internal::PeerHasClosed(fd_); }

int64_t Request::ElapsedMs() const { return MonotonicMs() - start_ms_; }

// ---------------------------------------------------------------------------------------------
// Response

bool ResponseWriter::WriteEvent(std::string_view event, const boost::json::value& data) {
  return WriteEventText(event, boost::json::serialize(data));
}

bool ResponseWriter::WriteEventText(std::string_view event, std::string_view data) {
  std::string out;
  out.reserve(event.size() + data.size() + 24);
  if (!event.empty()) {
    out.append("event: ");
    for (char c : event) {
      if (c != '\r' && c != '\n') out.push_back(c);
    }
    out.push_back('\n');
  }
  // Every line of data becomes its own "data:" field; the client joins them with '\n'.
  size_t start = 0;
  for (;;) {
    size_t end = data.find_first_of("\r\n", start);
    std::string_view line = data.substr(start, end == std::string_view::npos ? end : end - start);
    out.append("data: ").append(line).push_back('\n');
    if (end == std::string_view::npos) break;
    start = end + 1;
    if (data[end] == '\r' && start < data.size() && data[start] == '\n') ++start;
  }
  out.push_back('\n');
  return Write(out);
}

bool ResponseWriter::WriteComment(std::string_view text) {
  std::string out = ": ";
  for (char c : text) {
    if (c != '\r' && c != '\n') out.push_back(c);
  }
  out.append("\n\n");
  return Write(out);
}

void Response::SetHeader(std::string_view name, std::string_view value) {
  for (auto& [k, v] : headers) {
    if (EqualsIgnoreCase(k, name)) {
      v = std::string(value);
      return;
    }
  }
  headers.emplace_back(std::string(name), std::string(value));
}

Response Response::Stream(int status, std::string content_type, StreamFn fn) {
  Response r;
  r.status = status;
  r.content_type = std::move(content_type);
  r.stream = std::move(fn);
  return r;
}

Response Response::Sse(StreamFn fn) {
  Response r = Stream(200, "text/event-stream", std::move(fn));
  r.SetHeader("Cache-Control", "no-cache");
  r.SetHeader("X-Accel-Buffering", "no");
  return r;
}

Response Response::Text(int status, std::string body, std::string content_type) {
  Response r;
  r.status = status;
  r.content_type = std::move(content_type);
  r.body = std::move(body);
  return r;
}

Response Response::WebSocket(WebSocketFn fn) {
  Response r;
  r.status = 101;
  r.content_type.clear();
  r.websocket = std::move(fn);
  return r;
}

Response JsonResponse(int status, const boost::json::value& value) {
  Response r;
  r.status = status;
  r.body = boost::json::serialize(value);
  return r;
}

boost::json::object ErrorBody(std::string_view code, std::string_view message) {
  boost::json::object o;
  o["error"] = true;
  o["code"] = code;
  o["message"] = message;
  return o;
}

Response ErrorResponse(int status, std::string_view code, std::string_view message) {
  return JsonResponse(status, ErrorBody(code, message));
}

Response ErrorResponse(int status, std::string_view message) {
  return ErrorResponse(status, ErrorCodeForStatus(status), message);
}

std::string_view ErrorCodeForStatus(int status) {
  switch (status) {
    case 400:
      return "bad_request";
    case 401:
      return "unauthorized";
    case 403:
      return "forbidden";
    case 404:
      return "not_found";
    case 405:
      return "method_not_allowed";
    case 409:
      return "conflict";
    case 413:
      return "payload_too_large";
    case 415:
      return "unsupported_media_type";
    case 422:
      return "unprocessable";
    case 429:
      return "too_many_requests";
    case 503:
      return "unavailable";
    default:
      return status >= 500 ? "internal" : "bad_request";
  }
}

Response StatusResponse(const absl::Status& status) {
  int code = HttpStatusFor(status);  // common/util.h: the one Status → HTTP table
  if (code == 200) return JsonResponse(200, boost::json::object{{"error", false}});
  return ErrorResponse(code, StdView(status.message()));
}

std::optional<std::string> BearerToken(const Request& req) {
  std::optional<std::string> h = req.Header("authorization");
  if (!h) return std::nullopt;
  std::string_view v = TrimAscii(*h);
  if (v.size() < 7 || !EqualsIgnoreCase(v.substr(0, 7), "bearer ")) return std::nullopt;
  std::string_view token = TrimAscii(v.substr(7));
  if (token.empty()) return std::nullopt;
  return std::string(token);
}

// ---------------------------------------------------------------------------------------------
// Router

void Router::Add(std::string method, std::string_view pattern, Handler handler,
                 RouteOptions options) {
  Route r;
  r.method = std::move(method);
  std::string_view p = pattern;
  if (!p.empty() && p.front() == '/') p.remove_prefix(1);
  if (!p.empty() && p.back() == '/') p.remove_suffix(1);
  if (!p.empty()) {
    for (std::string_view seg : SplitString(p, '/')) r.segments.emplace_back(seg);
  }
  r.handler = std::move(handler);
  r.options = options;
  routes_.push_back(std::move(r));
}

Router::Match Router::Find(std::string_view method,
                           const std::vector<std::string>& segments) const {
  Match best;
  int best_score = -1;
  std::vector<std::string> allowed;
  for (const Route& r : routes_) {
    if (r.segments.size() != segments.size()) continue;
    int score = 0;
    bool match = true;
    for (size_t i = 0; i < segments.size(); ++i) {
      const std::string& s = r.segments[i];
      bool is_param = s.size() >= 2 && s.front() == '{' && s.back() == '}';
      if (is_param) continue;
      if (s != segments[i]) {
        match = false;
        break;
      }
      // Earlier literal segments weigh more, so "/a/x/{p}" beats "/a/{q}/y".
      score += 1 << std::min<size_t>(20, segments.size() - i);
    }
    if (!match) continue;
    best.path_known = true;
    if (std::find(allowed.begin(), allowed.end(), r.method) == allowed.end()) {
      allowed.push_back(r.method);
    }
    if (r.method != method || score <= best_score) continue;
    best_score = score;
    best.handler = &r.handler;
    best.options = &r.options;
    best.params.clear();
    for (size_t i = 0; i < segments.size(); ++i) {
      const std::string& s = r.segments[i];
      if (s.size() >= 2 && s.front() == '{' && s.back() == '}') {
        best.params[s.substr(1, s.size() - 2)] = segments[i];
      }
    }
  }
  best.allow = JoinStrings(allowed, ", ");
  return best;
}

}  // namespace esb::api

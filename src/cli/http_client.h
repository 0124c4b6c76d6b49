// The CLI's view of HTTP: a small request/response model, a streaming body sink, and a
// transport interface so the command logic can be tested without a daemon.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace esb::cli {

// Where esbd listens, from --url / ESB_URL ("http://host[:port][/prefix]").
struct Endpoint {
  std::string url;          // normalised, without a trailing slash (used in messages)
  std::string host;         // without brackets for IPv6 literals
  std::string port;         // "8080"
  std::string base_path;    // "" or "/prefix" (no trailing slash)
  std::string host_header;  // "host:port" as sent in the Host header
  // When set, requests go over this unix socket instead of TCP (host_header "localhost").
  std::string unix_socket;
};
absl::StatusOr<Endpoint> ParseUrl(std::string_view url);
// The daemon's unix socket at `path` ("unix:PATH" in messages).
Endpoint UnixEndpoint(std::string path);

// Lets another thread cut a request off while it runs (esbd mcp-stdio cancels a call by closing
// its stream): Fire() shuts the request's connection down, now or as soon as it is made; Send
// then fails with kCancelled. Thread-safe; one request at a time.
class RequestAbort {
 public:
  void Fire();
  bool fired() const;
  // For transports: the connection's fd while it is open (false: already fired).
  bool Attach(int fd);
  void Detach();

 private:
  mutable std::mutex mu_;
  int fd_ = -1;
  bool fired_ = false;
};

struct HttpRequest {
  std::string method;  // "GET", "POST", "PUT", "DELETE"
  std::string target;  // path + query, relative to the endpoint's base path
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
  // When set, the body is streamed from this local file instead of `body`.
  std::string body_file;
  // When set, another thread may cut the request off (RequestAbort::Fire).
  std::shared_ptr<RequestAbort> abort;
};

struct HttpResponse {
  int status = 0;
  std::string content_type;
  std::string body;       // empty when the body was streamed to a sink
  bool streamed = false;  // the body went to BodySink::OnData
  std::vector<std::pair<std::string, std::string>> headers;  // as received
  // The first header of that name (case-insensitive), or "".
  std::string Header(std::string_view name) const;
};

// Receives a response body while it arrives (SSE streams, file downloads).
class BodySink {
 public:
  virtual ~BodySink() = default;
  // Called once the headers are in. true: deliver the body through OnData; false: collect it
  // into HttpResponse::body (error answers, plain JSON).
  virtual bool OnHeaders(int status, const std::string& content_type) = 0;
  // A non-OK status stops the transfer; Send returns it unchanged.
  virtual absl::Status OnData(std::string_view chunk) = 0;
};

// Sends one request. Failures to reach or talk to the daemon are kUnavailable with a
// message meant for the user ("cannot connect to esbd at ...").
class HttpTransport {
 public:
  virtual ~HttpTransport() = default;
  virtual absl::StatusOr<HttpResponse> Send(const HttpRequest& request, BodySink* sink) = 0;
};

using TransportFactory = std::function<std::unique_ptr<HttpTransport>(const Endpoint&)>;

// HTTP/1.1 over TCP (or the endpoint's unix socket) with Boost.Beast (synchronous), one
// connection per request.
std::unique_ptr<HttpTransport> MakeBeastTransport(const Endpoint& endpoint);

// Percent-encodes everything but RFC 3986 unreserved characters (and '/' if keep_slash).
std::string PercentEncode(std::string_view text, bool keep_slash);

}  // namespace esb::cli

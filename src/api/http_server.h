// A small, generic HTTP/1.1 server for esbd: routing with path parameters, JSON helpers,
// streamed (chunked) responses for SSE and downloads, streamed request bodies for uploads,
// WebSocket upgrades, and hard limits and timeouts everywhere. Built on Boost.Beast/Asio
// (implementation in src/api/http/).
//
// Threading model: a small pool of I/O threads (Options::io_threads, each running its own
// io_context) accepts connections on every listener (TCP and/or unix socket) and owns every
// connection while it is idle, sending its request header, lingering after an answer, or
// carrying a WebSocket: all of that is asynchronous, so an idle or slow (slowloris) client costs
// a socket, a timer and a small buffer, never a thread. Once a header is complete and routed,
// the request is handed to a bounded worker pool (threads created on demand up to
// `max_connections`, small stacks, idle ones exit), which runs the route's `before_body` hook,
// reads the body, runs the handler (which may block for minutes, e.g. exec) and writes the
// answer with synchronous, deadline-bounded I/O on the connection's socket; a keep-alive
// connection then goes back to its I/O thread. So a blocking handler never stalls accepting or
// /healthz: the number of requests in progress is bounded by `max_connections` (excess requests
// get a 503), each principal's share of them by `max_requests_per_principal` (429), streams
// (SSE, downloads, WebSockets) by `max_streams` (503), and open connections by a cap derived
// from RLIMIT_NOFILE (beyond which the oldest idle or header-phase connection is closed to admit
// a new one) and a per-peer cap (per IP for TCP, per uid for the unix socket). A
// route's `before_body` hook (authentication) runs on the header alone, so nobody sends a body
// (or upgrades to a WebSocket) before being admitted, and a route that declares no body never
// reads one; buffered bodies share a server-wide memory budget, of which each principal may hold
// only its share. Every socket read and write has a deadline, so a slow or silent client cannot
// hold a worker forever.
//
// Typical use:
//
//   esb::api::HttpServer::Options opts;
//   opts.port = 8080;
//   esb::api::HttpServer server(opts);
//   server.router().Add("POST", "/environments/{id}/execute", [&](esb::api::Request& req) {
//     auto body = esb::api::ParseJsonObjectBody(req);       // json_util.h
//     if (!body.ok()) return body.error();
//     esb::api::JsonFields f(body.value());
//     std::string cmd = f.RequiredString("command");
//     int64_t timeout = f.OptionalInt("timeout_seconds", 60, 1, 3600);
//     if (!f.ok()) return f.ErrorResponse();
//     std::string id = req.Param("id");
//     if (req.Accepts("text/event-stream")) {
//       return esb::api::Response::Sse([&req, id, cmd](esb::api::ResponseWriter& w) {
//         w.WriteEvent("stdout", boost::json::object{{"data", "hi"}});  // false: client gone
//       });
//     }
//     return esb::api::JsonResponse(200, boost::json::object{{"error", false}});
//   });
//   if (absl::Status s = server.Start(); !s.ok()) ...
//   ... server.Stop();
//
// Handlers may throw: the exception becomes a 500 `internal` error and the connection survives.
// Routes must all be added before Start(); the router is read-only afterwards.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "boost/json.hpp"

namespace esb::api {

// ---------------------------------------------------------------------------------------------
// Request side

// Who is on the other end of the connection.
struct PeerInfo {
  bool is_unix = false;      // connected through the unix socket listener
  bool is_loopback = false;  // TCP from 127.0.0.0/8 or ::1 (always false for unix sockets)
  std::string address;       // "127.0.0.1:53422", "[::1]:4000" or "unix"
  // Unix sockets only (SO_PEERCRED); -1 otherwise.
  int64_t uid = -1;
  int64_t gid = -1;
  int64_t pid = -1;
};

// Incremental reader for a raw request body, for routes registered with
// RouteOptions::stream_body (uploads that must not be buffered in memory).
// Enforces the route's size cap and the server's body inactivity timeout.
class BodyReader {
 public:
  virtual ~BodyReader() = default;
  // Reads up to `max` bytes into `buf`. Returns the number of bytes read; 0 means the body is
  // complete. Errors: ResourceExhausted when the body exceeds the cap (answer 413),
  // DeadlineExceeded when the client stalls, Unavailable / InvalidArgument when the client
  // disconnects or sends a malformed body (answer 400; the connection is closed anyway).
  virtual absl::StatusOr<size_t> Read(char* buf, size_t max) = 0;
  // Content-Length if the client sent one (chunked uploads have none).
  virtual std::optional<uint64_t> content_length() const = 0;
  // Bytes delivered so far.
  virtual uint64_t bytes_read() const = 0;
  // True once Read() returned 0.
  virtual bool done() const = 0;
};

class Request {
 public:
  // "GET", "POST", ... exactly as sent (methods are case-sensitive in HTTP).
  const std::string& method() const { return method_; }
  // Percent-decoded path without the query, e.g. "/environments/env_1/files/read".
  const std::string& path() const { return path_; }
  // The request target as sent, e.g. "/environments/env_1/files/read?path=a%20b".
  const std::string& target() const { return target_; }

  // Path parameter from the route pattern ("{id}"), decoded. Empty if there is no such name.
  std::string Param(std::string_view name) const;
  const std::map<std::string, std::string, std::less<>>& params() const { return params_; }

  // Query parameters, decoded ('+' is a space), in order, repeated keys kept.
  const std::vector<std::pair<std::string, std::string>>& query() const { return query_; }
  // First value of `key`, or nullopt if absent.
  std::optional<std::string> Query(std::string_view key) const;
  // All values of `key`, in order.
  std::vector<std::string> QueryAll(std::string_view key) const;
  bool HasQuery(std::string_view key) const { return Query(key).has_value(); }

  // Header lookup, case-insensitive. Repeated headers: Header() returns the first one.
  std::optional<std::string> Header(std::string_view name) const;
  std::string HeaderOr(std::string_view name, std::string_view fallback) const;
  const std::vector<std::pair<std::string, std::string>>& headers() const { return headers_; }
  // True if the Accept header lists `mime_type` (e.g. "text/event-stream"); ignores parameters.
  bool Accepts(std::string_view mime_type) const;
  // The media type of Content-Type, lower-cased, without parameters ("application/json"), or "".
  std::string ContentType() const;

  // The whole body (buffered routes). Empty for stream_body routes: use body_reader().
  const std::string& body() const { return body_; }
  // Non-null only for routes registered with RouteOptions::stream_body.
  BodyReader* body_reader() const { return body_reader_; }

  const PeerInfo& peer() const { return peer_; }

  // Best-effort check, without reading, whether the client has closed its side of the
  // connection (FIN or RST seen). Lets a long blocking handler (exec) notice a client that gave
  // up. Note: a client that half-closes after sending its request also looks gone.
  bool ClientGone() const;

  // Milliseconds since the request's headers were read.
  int64_t ElapsedMs() const;

  // True if the request announced a body (Content-Length > 0 or chunked), even before (or
  // without) the server reading it.
  bool has_body() const { return has_body_ || !body_.empty(); }
  // Whoever a route's `before_body` hook admitted (e.g. the authenticated tenant); "" if unset.
  const std::string& principal() const { return principal_; }

  // --- Filled by the server. Tests that call handlers directly may set them. ---
  Request() = default;
  std::string method_, path_, target_, body_;
  std::map<std::string, std::string, std::less<>> params_;
  std::vector<std::pair<std::string, std::string>> query_;
  std::vector<std::pair<std::string, std::string>> headers_;
  PeerInfo peer_;
  BodyReader* body_reader_ = nullptr;
  bool has_body_ = false;
  std::string principal_;
  int fd_ = -1;
  int64_t start_ms_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Response side

// Writes a streamed response body (HTTP/1.1 chunked transfer encoding). Every write is flushed to
// the socket immediately. All writes return false once the client is gone (disconnect detected
// before writing, send error, or write timeout); after that every write is a no-op returning
// false, so a handler can simply stop when a write fails.
// Thread-safe: other threads (e.g. an exec output callback) may write while the stream function
// runs; once the stream function has returned, writes are refused (return false).
class ResponseWriter {
 public:
  virtual ~ResponseWriter() = default;
  // Raw bytes as one chunk (binary downloads). Empty data is a no-op returning ok().
  virtual bool Write(std::string_view data) = 0;
  // One SSE event: "event: <event>\ndata: <json>\n\n" (the JSON is serialised on one line).
  bool WriteEvent(std::string_view event, const boost::json::value& data);
  // One SSE event with arbitrary text data; embedded newlines become several "data:" lines.
  bool WriteEventText(std::string_view event, std::string_view data);
  // An SSE comment line (": text\n\n"), e.g. as a keep-alive ping every 15 s.
  bool WriteComment(std::string_view text);
  // False once a write failed or the client disconnected.
  virtual bool ok() const = 0;
  // Checks the socket, without writing, for a client disconnect. Returns true if gone.
  virtual bool ClientGone() = 0;
  virtual uint64_t bytes_written() const = 0;
};

// The server side of an upgraded WebSocket connection, for a handler running on a worker thread
// (Response::WebSocket). Every call waits for the I/O thread that owns the connection, with a
// deadline. The server answers pings and sends its own (Options::websocket_idle_timeout: a
// client that answers nothing for that long is dropped). Thread-safe.
class WebSocket {
 public:
  // RFC 6455 close codes the server uses.
  static constexpr int kNormal = 1000;
  static constexpr int kPolicy = 1008;  // e.g. not allowed
  static constexpr int kTooBig = 1009;  // a message over Options::websocket_max_message_bytes
  static constexpr int kError = 1011;   // the handler failed (threw)

  struct Message {
    std::string data;
    bool binary = false;
  };
  virtual ~WebSocket() = default;
  // Sends one message; waits until it was handed to the kernel (backpressure) or
  // Options::write_timeout passed. False once the connection is closed or failed.
  virtual bool Send(std::string_view data, bool binary = false) = 0;
  // The next message from the client, waiting up to `timeout`. DeadlineExceeded when none came
  // in time (the connection stays open); Unavailable once the connection is closed (the message
  // says by whom, with the close code), e.g. after a message over the size limit (1009).
  virtual absl::StatusOr<Message> Receive(std::chrono::milliseconds timeout) = 0;
  // Starts the closing handshake with `code` and `reason` (≤ 123 bytes) and waits for it (up to
  // write_timeout). Idempotent. If the handler returns without closing, the server closes with
  // 1000; if it throws, with 1011.
  virtual void Close(int code = kNormal, std::string_view reason = "") = 0;
  // True once the connection is closed (by either side) or failed.
  virtual bool ClientGone() = 0;
};

struct Response {
  using StreamFn = std::function<void(ResponseWriter&)>;
  using WebSocketFn = std::function<void(esb::api::WebSocket&)>;

  int status = 200;
  std::string content_type = "application/json";
  // Extra headers. Content-Length, Transfer-Encoding and Connection are managed by the server.
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
  // If set, the response is streamed: the server sends the status and headers, then calls
  // `stream` on the connection thread (the Request is still alive, so capturing it by reference
  // is fine), then terminates the chunked body. `body` is ignored. If `stream` throws, an SSE
  // stream gets a final `event: error` with the internal error body; any other stream is cut off
  // without the terminating chunk, so the client sees a failed (not a short) transfer.
  // 204 and 304 answers never carry a body.
  StreamFn stream;
  // If set, the request is upgraded to a WebSocket (it must be a valid upgrade request, else
  // 426): the server answers 101 and calls `websocket` on a worker thread; the connection ends
  // when it returns. Counts as a stream (Options::max_streams). `status`, `body` are ignored.
  WebSocketFn websocket;

  void SetHeader(std::string_view name, std::string_view value);

  // A streamed response with the given content type, e.g. "application/octet-stream".
  static Response Stream(int status, std::string content_type, StreamFn fn);
  // A Server-Sent Events stream (200, text/event-stream, no caching, no proxy buffering).
  static Response Sse(StreamFn fn);
  static Response Text(int status, std::string body, std::string content_type = "text/plain");
  // An upgrade to a WebSocket served by `fn` (see WebSocket).
  static Response WebSocket(WebSocketFn fn);
};

// 200-style JSON answer; the body is `value` serialised.
Response JsonResponse(int status, const boost::json::value& value);
// The error body of docs/api.md: {"error": true, "code": <code>, "message": <message>}.
boost::json::object ErrorBody(std::string_view code, std::string_view message);
Response ErrorResponse(int status, std::string_view code, std::string_view message);
// Same, with the machine code derived from the status (ErrorCodeForStatus).
Response ErrorResponse(int status, std::string_view message);
// 400 → "bad_request", 401 → "unauthorized", 403 → "forbidden", 404 → "not_found", 405 →
// "method_not_allowed", 409 → "conflict", 413 → "payload_too_large", 415 →
// "unsupported_media_type", 422 → "unprocessable", 429 → "too_many_requests", 503 → "unavailable",
// others ≥ 500 → "internal", other 4xx → "bad_request".
std::string_view ErrorCodeForStatus(int status);
// Maps an absl::Status to an error response with the status message, with the one
// Status → HTTP table, HttpStatusFor (common/util.h; the audit log records the same codes).
// (Tenant isolation must be expressed as NotFound by the caller: never 403.)
Response StatusResponse(const absl::Status& status);

// "Authorization: Bearer <token>" → token (scheme matched case-insensitively); nullopt if the
// header is missing, has another scheme, or the token is empty.
std::optional<std::string> BearerToken(const Request& req);

// ---------------------------------------------------------------------------------------------
// Routing

using Handler = std::function<Response(Request&)>;

struct RouteOptions {
  // The route takes a request body (buffered, up to Options::max_body_bytes). A route that does
  // not (the default) answers a request that announces one with 413 on its header, without
  // reading a body byte or holding a thread or any body budget for it. Implied by stream_body.
  bool accepts_body = false;
  // The handler reads the body itself through Request::body_reader(); the server does not
  // buffer it and the JSON body limit does not apply. A Content-Length above
  // `max_stream_body_bytes` is answered 413 before the handler runs.
  bool stream_body = false;
  uint64_t max_stream_body_bytes = 256ull << 20;
  // Called with the parsed header (method, path, params, query, headers, peer; no body yet) before
  // any body byte is read and before "100 Continue". Returning a response answers the request
  // with it, without reading the body (the connection is closed if a body was announced). May
  // set Request::principal_ for the handler. This is where authentication belongs: a client
  // that is not admitted never gets the server to buffer anything for it. Must not throw.
  // The principal it sets ("" without a hook: the anonymous principal) is what the server's
  // per-principal shares (Options::max_requests_per_principal, ...) are counted against.
  std::function<std::optional<Response>(Request&)> before_body;
};

class Router {
 public:
  // `pattern` is a path made of literal segments and "{name}" segments, e.g.
  // "/environments/{id}/files/raw". Literal segments win over parameters when both match.
  // A trailing slash in a request path is ignored ("/environments/" matches "/environments").
  void Add(std::string method, std::string_view pattern, Handler handler,
           RouteOptions options = {});

  struct Match {
    const Handler* handler = nullptr;  // null: no route for this method
    const RouteOptions* options = nullptr;
    std::map<std::string, std::string, std::less<>> params;
    bool path_known = false;  // some route matches the path (→ 405 rather than 404)
    std::string allow;        // "GET, DELETE" for the 405 Allow header
  };
  // `segments` are the request path's segments, already percent-decoded.
  Match Find(std::string_view method, const std::vector<std::string>& segments) const;

 private:
  struct Route {
    std::string method;
    std::vector<std::string> segments;  // "{id}" marks a parameter
    Handler handler;
    RouteOptions options;
  };
  std::vector<Route> routes_;
};

// ---------------------------------------------------------------------------------------------
// Server

class HttpServer {
 public:
  struct Options {
    // TCP listener. port 0 picks an ephemeral port (see tcp_port()); port < 0 disables TCP.
    std::string host = "127.0.0.1";
    int port = 0;
    // Optional unix socket listener, created with `unix_socket_mode`. A stale socket file left by
    // a dead daemon is replaced; a live one is an error.
    std::string unix_socket_path;
    int unix_socket_mode = 0660;

    // I/O threads (each with its own io_context): accepting, idle and header waits, lingering,
    // WebSocket I/O. They never run a handler.
    int io_threads = 2;
    // Requests in progress at once (from admission to the end of the answer), each on a worker
    // thread; more → 503 (idle keep-alive connections and connections still sending their
    // header hold no worker and do not count). Also the worker pool's size cap.
    int max_connections = 1024;
    // Of those, streamed answers (SSE, downloads) and WebSockets at once; more → 503.
    // 0: max_connections.
    int max_streams = 0;
    // Worker threads' stack size (they run handlers only). Up to 8 idle workers wait
    // worker_idle_timeout for work; more than that (after a burst) exit after 250 ms.
    size_t worker_stack_bytes = 256 << 10;
    std::chrono::milliseconds worker_idle_timeout{30'000};
    // Open connections in all (each costs one fd); at the cap the oldest idle or header-phase
    // connection is closed to admit a new one. 0: three quarters of RLIMIT_NOFILE's soft limit.
    int max_open_connections = 0;
    // Open connections from one peer (one IP address over TCP, one uid over the unix socket);
    // beyond it the peer's own oldest idle connection is closed to admit the new one, or, with
    // none idle, the new one is refused with 503. 0: seven eighths of the open-connection cap
    // (one peer can never take the last eighth from the others).
    int max_open_connections_per_peer = 0;
    size_t max_header_bytes = 64 * 1024;               // request line + headers → 400 beyond
    // Header fields per request → 400 beyond, counted on the raw lines before Beast parses
    // them: parsed, each field costs an allocation however short it is, so 64 KiB of "a:"
    // lines (15,000 fields) cost ~1 MB per request.
    size_t max_header_fields = 100;
    uint64_t max_body_bytes = 16ull << 20;             // buffered bodies → 413 beyond
    // Memory for buffered request bodies across all connections; a body that does not fit is
    // answered 503 (retry later). Header buffers of connections still sending their header have
    // their own budget, beyond which the oldest such connection is closed.
    uint64_t max_buffered_body_bytes = 128ull << 20;
    uint64_t max_buffered_header_bytes = 64ull << 20;
    // Fair shares, counted per principal (see RouteOptions::before_body) once a request is
    // admitted: requests one principal may have in progress at once, and the part of
    // max_buffered_body_bytes its buffered bodies may hold. Over its share a principal gets 429
    // with Retry-After, so one tenant cannot take every request thread or the whole body
    // budget from the others. 0: a quarter of max_connections / max_buffered_body_bytes.
    int max_requests_per_principal = 0;
    uint64_t max_buffered_body_bytes_per_principal = 0;
    std::chrono::milliseconds header_timeout{30'000};  // from first byte to end of headers
    std::chrono::milliseconds body_timeout{60'000};    // whole buffered body; stream: per read
    // A buffered body's budget is reserved when its header is admitted; a client that then
    // sends nothing for this long loses the reservation (408).
    std::chrono::milliseconds body_stall_timeout{10'000};
    std::chrono::milliseconds idle_timeout{60'000};    // keep-alive wait for the next request
    std::chrono::milliseconds write_timeout{60'000};   // no write progress for this long → drop
    // A response (or one chunk of a streamed one) must be taken by the client at least this
    // fast over every min_rate_grace window, on top of write_timeout, counted in bytes that
    // left the socket (the kernel's send buffer does not count); a slower reader is reset. So a
    // client reading a trickle cannot hold a thread (and the response's memory). 0: none.
    uint64_t min_write_bytes_per_second = 16 << 10;
    // A request body (buffered or streamed) must arrive at least this fast over every
    // min_rate_grace window, from the end of its header; a trickle is answered 408 and loses
    // its thread and its body budget. 0: no minimum.
    uint64_t min_read_bytes_per_second = 16 << 10;
    // The window over which the minimum rates are checked (consecutive windows, so an early
    // burst does not buy a long trickle afterwards).
    std::chrono::milliseconds min_rate_grace{10'000};
    // Memory for buffered (non-streamed) responses waiting to be taken by their clients, across
    // all connections, and the part of it one principal may hold (0: a quarter). Answers of at
    // most 64 KiB are not counted. A response that does not fit is replaced with 503 (over the
    // server-wide budget) or 429 (over the principal's share) before it is written, so slow
    // readers cannot pile up large answers in memory.
    uint64_t max_buffered_response_bytes = 256ull << 20;
    uint64_t max_buffered_response_bytes_per_principal = 0;
    // Access log lines per second (a token bucket with a burst of as many); lines over it are
    // dropped and summarised once per second ("access log: N requests not logged (M 4xx)").
    // 0: no limit. Errors of the server itself are logged separately and not limited by this.
    int access_log_lines_per_second = 100;
    std::chrono::milliseconds drain_timeout{10'000};   // Stop(): wait for in-flight requests
    // WebSockets: the largest message accepted from a client (larger: closed with 1009), and
    // how long a connection may stay silent: the server pings at half of it, and a client that
    // answers nothing for all of it is dropped.
    size_t websocket_max_message_bytes = 1 << 20;
    std::chrono::milliseconds websocket_idle_timeout{60'000};

    bool access_log = true;  // one esb::Log line per response
    std::string server_name = "esbd";
    // Called after every response (also errors produced by the server itself), e.g. for metrics.
    // `req` may be partially filled for requests that failed to parse. Must not throw.
    std::function<void(const Request& req, int status, int64_t duration_ms)> on_response;
  };

  explicit HttpServer(Options options);
  ~HttpServer();  // calls Stop()
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Add routes here before Start().
  Router& router();

  // Binds the listeners and starts the I/O threads. Fails if a listener cannot be bound.
  absl::Status Start();
  // Stops accepting, closes idle keep-alive connections, and waits up to drain_timeout for
  // in-flight requests (they are answered with "Connection: close"). Connections still busy
  // after that get their sockets shut down, so streaming writers return false, body readers and
  // WebSockets fail; Stop() then waits up to 2 more seconds for their workers. Returns false if
  // some handlers were still running when Stop() returned (they keep the server's internals
  // alive and finish on their own, but must not touch objects the caller destroys). Idempotent.
  bool Stop();

  // The bound TCP port (after Start()), or -1.
  int tcp_port() const;
  // Requests currently being handled (each holds a worker thread).
  int active_connections() const;
  // Connections open in all: idle, sending a header, being handled, or WebSockets.
  int open_connections() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace esb::api

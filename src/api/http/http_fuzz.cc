// libFuzzer target for the HTTP request path: arbitrary bytes go through the real server (the
// Beast parser, the strict-header and smuggling checks, the limits, the router, before_body, body
// reading, JSON parsing, streamed answers and WebSocket upgrades) over a unix socket, into test
// handlers. A crash, a sanitizer report or a hang (the server must answer or close within its
// timeouts) is a finding. Build and run: see src/api/CMakeLists.txt.
#include <poll.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "api/http_server.h"
#include "api/json_util.h"
#include "common/util.h"

namespace {

using namespace esb::api;

std::string g_path;

HttpServer* StartServer() {
  char dir[] = "/tmp/esb-http-fuzz-XXXXXX";
  if (mkdtemp(dir) == nullptr) abort();
  g_path = std::string(dir) + "/s.sock";
  HttpServer::Options o;
  o.port = -1;
  o.unix_socket_path = g_path;
  o.access_log = false;
  o.header_timeout = std::chrono::milliseconds(300);
  o.body_timeout = std::chrono::milliseconds(300);
  o.body_stall_timeout = std::chrono::milliseconds(300);
  o.idle_timeout = std::chrono::milliseconds(300);
  o.write_timeout = std::chrono::milliseconds(300);
  o.websocket_idle_timeout = std::chrono::milliseconds(300);
  o.websocket_max_message_bytes = 4096;
  o.max_header_bytes = 8192;
  o.max_body_bytes = 64 << 10;
  o.max_connections = 8;
  auto* s = new HttpServer(o);  // lives for the whole run
  RouteOptions body;
  body.accepts_body = true;
  body.before_body = [](Request& req) -> std::optional<Response> {
    if (req.HeaderOr("x-who", "") == "nobody") return ErrorResponse(401, "no");
    req.principal_ = req.HeaderOr("x-who", "");
    return std::nullopt;
  };
  RouteOptions stream;
  stream.stream_body = true;
  stream.max_stream_body_bytes = 64 << 10;
  Router& r = s->router();
  r.Add("GET", "/hello", [](Request&) { return JsonResponse(200, boost::json::object{}); });
  r.Add(
      "POST", "/environments/{id}/execute",
      [](Request& req) {
        JsonBody b = ParseJsonObjectBody(req);
        if (!b.ok()) return b.error();
        JsonFields f(b.value());
        std::string cmd = f.RequiredString("command");
        f.OptionalInt("timeout_seconds", 60, 1, 3600);
        if (!f.ok()) return f.ErrorResponse();
        if (req.Accepts("text/event-stream")) {
          return Response::Sse([cmd](ResponseWriter& w) { w.WriteEventText("stdout", cmd); });
        }
        return JsonResponse(200, boost::json::object{{"command", cmd}});
      },
      body);
  r.Add(
      "PUT", "/files/raw",
      [](Request& req) {
        char buf[1024];
        uint64_t total = 0;
        for (;;) {
          absl::StatusOr<size_t> n = req.body_reader()->Read(buf, sizeof(buf));
          if (!n.ok()) return StatusResponse(n.status());
          if (*n == 0) break;
          total += *n;
        }
        return JsonResponse(200, boost::json::object{{"bytes", total}});
      },
      stream);
  r.Add("GET", "/ws", [](Request&) {
    return Response::WebSocket([](WebSocket& w) {
      for (int i = 0; i < 4; ++i) {
        absl::StatusOr<WebSocket::Message> m = w.Receive(std::chrono::milliseconds(100));
        if (!m.ok()) return;
        if (!w.Send(m->data, m->binary)) return;
      }
    });
  });
  if (!s->Start().ok()) abort();
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static HttpServer* server = StartServer();
  (void)server;
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  memcpy(a.sun_path, g_path.data(), g_path.size());
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) abort();
  // Send everything (the server may stop reading early: then the rest is dropped), half-close,
  // and read until the server closes. It must do so within its timeouts.
  size_t off = 0;
  const int64_t deadline = esb::MonotonicMs() + 5000;
  char buf[65536];
  bool eof = false;
  while (!eof) {
    if (esb::MonotonicMs() > deadline) abort();  // the server neither answered nor closed
    pollfd pfd{fd, static_cast<short>(POLLIN | (off < size ? POLLOUT : 0)), 0};
    if (poll(&pfd, 1, 100) < 0) break;
    if (off < size && (pfd.revents & POLLOUT)) {
      ssize_t n = send(fd, data + off, size - off, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) off += static_cast<size_t>(n);
      if (n < 0 && errno != EAGAIN) off = size;
      if (off == size) shutdown(fd, SHUT_WR);
    } else if (off == size && size == 0) {
      shutdown(fd, SHUT_WR);
    }
    if (pfd.revents & (POLLIN | POLLHUP | POLLERR)) {
      ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN)) eof = true;
    }
  }
  close(fd);
  return 0;
}

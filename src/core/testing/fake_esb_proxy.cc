// A stand-in for esb-proxy in egress_proxy_test: the real control protocol (governance/
// control.h), no policy. Every attached listener answers each connection with one HTTP response
// naming the environment, its own uid and what esbd passed it, and reports one audit event that
// claims a forged tenant (esbd must not believe it).
//
//   fake_esb_proxy --control-fd 3 [--egress-resolve X]... [--egress-upstream-ca FILE]
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/util.h"
#include "governance/control.h"

namespace {

using namespace esb;
namespace control = esb::governance::control;

std::string g_args;  // what esbd passed (resolve entries, the CA file's first line)

void Serve(control::ControlChannel* channel, std::string env_id, int listener) {
  while (true) {
    int c = ::accept(listener, nullptr, nullptr);
    if (c < 0) return;  // closed (detach or exit)
    char buf[2048];
    ssize_t n = ::read(c, buf, sizeof(buf));
    std::string first(buf, n > 0 ? static_cast<size_t>(n) : 0);
    first = first.substr(0, first.find('\r'));
    std::string body = absl::StrCat("env=", env_id, " uid=", ::getuid(), " ", g_args, "\n");
    std::string response = absl::StrCat("HTTP/1.1 200 OK\r\nContent-Length: ", body.size(),
                                        "\r\nConnection: close\r\n\r\n", body);
    (void)!::write(c, response.data(), response.size());
    ::close(c);
    control::AuditEvent event;
    event.time_ms = NowUnixMs();
    // A request for /forge is reported as another environment's (a lying proxy).
    event.env_id = first.find("/forge") != std::string::npos ? "forged-env" : env_id;
    event.tenant = "forged-tenant";
    event.method = "GET";
    event.scheme = "http";
    event.host = "fake.test";
    event.port = 80;
    event.path = first;
    event.status = 200;
    event.decision = "allowed";
    event.rule_ids = {"allow:fake.test"};
    event.request_headers = "Host: fake.test\nAuthorization: ***\n";
    channel->Send(control::ToEsbd{event}).IgnoreError();
  }
}

}  // namespace

int main(int argc, char** argv) {
  int fd = -1;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string arg = argv[i];
    if (arg == "--control-fd") {
      absl::SimpleAtoi(argv[i + 1], &fd);
    } else if (arg == "--egress-resolve") {
      absl::StrAppend(&g_args, "resolve=", argv[i + 1], " ");
    } else if (arg == "--egress-upstream-ca") {
      std::ifstream ca(argv[i + 1]);
      std::string line;
      std::getline(ca, line);
      absl::StrAppend(&g_args, "ca=", ca ? line : "unreadable", " ");
    }
  }
  if (fd < 0) return 2;
  control::ControlChannel channel{UniqueFd(fd)};
  std::map<std::string, int> listeners;
  std::vector<std::thread> servers;
  std::atomic<bool> done{false};
  std::thread health([&] {
    const int64_t start = MonotonicMs();
    while (!done) {
      control::Health h;
      h.pid = ::getpid();
      h.uptime_ms = MonotonicMs() - start;
      h.environments = static_cast<int64_t>(listeners.size());
      // Fixed fair-share counters: esbd's test checks they reach EgressHealth (/healthz).
      h.refused_body_budget = 3;
      h.refused_resolve_busy = 5;
      h.audit_dropped = 7;
      channel.Send(control::ToEsbd{h}).IgnoreError();
      for (int i = 0; i < 10 && !done; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  while (true) {
    uint32_t seq = 0;
    absl::StatusOr<control::ToProxy> message = channel.ReceiveToProxy(&seq);
    if (!message.ok()) break;  // esbd closed the control socket: exit
    control::Result result;
    result.seq = seq;
    if (auto* attach = std::get_if<control::Attach>(&*message)) {
      int listener = attach->received_listener.release();
      listeners[attach->env_id] = listener;
      servers.emplace_back(Serve, &channel, attach->env_id, listener);
    } else if (auto* detach = std::get_if<control::Detach>(&*message)) {
      auto it = listeners.find(detach->env_id);
      if (it != listeners.end()) {
        ::shutdown(it->second, SHUT_RDWR);
        ::close(it->second);
        listeners.erase(it);
      }
    } else if (std::holds_alternative<control::Ping>(*message)) {
      continue;
    }
    channel.Send(control::ToEsbd{result}).IgnoreError();
  }
  done = true;
  health.join();
  _exit(0);  // listener threads block in accept: leave without joining
}

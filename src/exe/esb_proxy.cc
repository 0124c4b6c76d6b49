// esb-proxy: the egress proxy of governed environments (docs/design.md "Egress proxy"). Wiring
// only: esbd starts it (as an unprivileged uid: it drops nothing itself) with one end of a
// socketpair as --control-fd; the proxy serves the listeners esbd attaches over it, sends
// audit events and health back, and exits when the control socket closes.
//
//   esb-proxy --control-fd N [--egress-resolve NAME=HOST:PORT]... [--egress-upstream-ca FILE]
//             [--threads N] [--log-level debug|info|warn|error]
#include <signal.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdio>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/util.h"
#include "governance/control.h"
#include "governance/proxy/outbox.h"
#include "governance/proxy/proxy.h"
#include "governance/proxy/resolver.h"

namespace {

using namespace esb;
using namespace esb::governance;

constexpr char kUsage[] =
    "usage: esb-proxy --control-fd N [--egress-resolve NAME=HOST:PORT]...\n"
    "                 [--egress-upstream-ca FILE] [--threads N] [--log-level LEVEL]\n";

int Run(int argc, char** argv) {
  int control_fd = -1;
  proxy::SystemResolver::Options resolver_options;
  proxy::ProxyOptions options;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::cerr << "esb-proxy: " << arg << " needs a value\n" << kUsage;
        exit(2);
      }
      return argv[++i];
    };
    if (arg == "--control-fd") {
      if (!absl::SimpleAtoi(value(), &control_fd) || control_fd < 0) {
        std::cerr << "esb-proxy: --control-fd must be a file descriptor number\n";
        return 2;
      }
    } else if (arg == "--egress-resolve") {
      absl::StatusOr<proxy::ResolveOverride> o = proxy::ParseResolveOverride(value());
      if (!o.ok()) {
        std::cerr << "esb-proxy: " << o.status().message() << "\n";
        return 2;
      }
      resolver_options.overrides.push_back(*o);
    } else if (arg == "--egress-upstream-ca") {
      options.upstream_ca_file = value();
    } else if (arg == "--threads") {
      if (!absl::SimpleAtoi(value(), &options.threads) || options.threads < 1 ||
          options.threads > 64) {
        std::cerr << "esb-proxy: --threads must be 1..64\n";
        return 2;
      }
    } else if (arg == "--log-level") {
      std::string l = value();
      SetLogLevel(l == "debug"   ? LogLevel::kDebug
                  : l == "warn"  ? LogLevel::kWarn
                  : l == "error" ? LogLevel::kError
                                 : LogLevel::kInfo);
    } else if (arg == "--help" || arg == "-h") {
      std::cout << kUsage;
      return 0;
    } else {
      std::cerr << "esb-proxy: unknown argument " << arg << "\n" << kUsage;
      return 2;
    }
  }
  if (control_fd < 0) {
    std::cerr << kUsage;
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);

  control::ControlChannel channel{UniqueFd(control_fd)};
  proxy::Outbox outbox(&channel, proxy::Outbox::Options{});
  auto resolver = std::make_shared<proxy::SystemResolver>(resolver_options);
  absl::StatusOr<std::unique_ptr<proxy::Proxy>> created = proxy::Proxy::Create(
      options, resolver, [&outbox](control::AuditEvent e) { outbox.Push(std::move(e)); });
  if (!created.ok()) {
    LogError(absl::StrCat("esb-proxy: ", created.status().message()));
    return 1;
  }
  proxy::Proxy& px = **created;

  // Health: now (= ready) and every kHealthIntervalMs until the control socket closes.
  std::mutex health_mu;
  std::condition_variable health_cv;
  bool closing = false;
  std::thread health([&] {
    std::unique_lock<std::mutex> lock(health_mu);
    do {
      control::Health h = px.Health();
      h.audit_dropped = outbox.dropped_total();
      outbox.Push(h);
    } while (!health_cv.wait_for(lock, std::chrono::milliseconds(control::kHealthIntervalMs),
                                 [&] { return closing; }));
  });

  int rc = 0;
  for (;;) {
    uint32_t seq = 0;
    absl::StatusOr<control::ToProxy> m = channel.ReceiveToProxy(&seq);
    if (!m.ok()) {
      if (m.status().message() != "control socket closed") {
        LogError(absl::StrCat("esb-proxy: ", m.status().message()));
        rc = 1;
      }
      break;
    }
    absl::Status s;
    if (auto* a = std::get_if<control::Attach>(&*m)) {
      std::string id = a->env_id;
      s = px.Attach(std::move(*a));
      LogInfo(absl::StrCat("esb-proxy: attach ", id, s.ok() ? "" : ": ", s.message()));
    } else if (auto* u = std::get_if<control::Update>(&*m)) {
      s = px.Update(*u);
    } else if (auto* d = std::get_if<control::Detach>(&*m)) {
      s = px.Detach(d->env_id);
    } else {
      control::Health h = px.Health();
      h.audit_dropped = outbox.dropped_total();
      outbox.Push(h);
      continue;
    }
    outbox.Push(control::Result{seq, s.ok(), std::string(s.message())});
  }
  {
    std::lock_guard<std::mutex> lock(health_mu);
    closing = true;
  }
  health_cv.notify_all();
  health.join();
  px.Stop();
  return rc;
}

}  // namespace

int main(int argc, char** argv) { return Run(argc, argv); }

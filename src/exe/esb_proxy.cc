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
#include <deque>
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
#include "governance/proxy/proxy.h"
#include "governance/proxy/resolver.h"

namespace {

using namespace esb;
using namespace esb::governance;

constexpr char kUsage[] =
    "usage: esb-proxy --control-fd N [--egress-resolve NAME=HOST:PORT]...\n"
    "                 [--egress-upstream-ca FILE] [--threads N] [--log-level LEVEL]\n";

// Audit events leave through one writer thread with a bounded queue, so I/O threads never block
// on the control socket. Overflow drops the oldest event (counted and logged).
class Outbox {
 public:
  explicit Outbox(control::ControlChannel* channel) : channel_(channel) {
    thread_ = std::thread([this] { Run(); });
  }
  ~Outbox() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void Push(control::ToEsbd m) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (queue_.size() >= kMaxQueued) {
        queue_.pop_front();
        ++dropped_;
      }
      queue_.push_back(std::move(m));
    }
    cv_.notify_one();
  }

 private:
  static constexpr size_t kMaxQueued = 10000;
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return done_ || !queue_.empty(); });
      if (queue_.empty()) return;
      control::ToEsbd m = std::move(queue_.front());
      queue_.pop_front();
      uint64_t dropped = dropped_;
      dropped_ = 0;
      lock.unlock();
      if (dropped > 0) LogWarn(absl::StrCat("esb-proxy: dropped ", dropped, " audit events"));
      if (absl::Status s = channel_->Send(m); !s.ok()) {
        LogWarn(absl::StrCat("esb-proxy: ", s.message()));
      }
      lock.lock();
    }
  }
  control::ControlChannel* channel_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<control::ToEsbd> queue_;
  uint64_t dropped_ = 0;
  bool done_ = false;
  std::thread thread_;
};

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
  Outbox outbox(&channel);
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
      outbox.Push(px.Health());
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
      outbox.Push(px.Health());
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

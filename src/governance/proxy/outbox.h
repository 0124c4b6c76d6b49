// esb-proxy's messages to esbd (src/exe/esb_proxy.cc): one writer thread, so I/O threads never
// block on the control socket. Results and health have their own small queue and go first.
// Audit events are queued per tenant (one tenant's flood cannot push out another's rows), at
// most max_queued_per_tenant each and max_queued_total in all, sent round-robin between tenants.
// Over a bound, the OLDEST event of that tenant (over the total: of the tenant with the longest
// queue) is dropped and counted per environment; the writer then sends esbd one event per such
// environment with rule "audit:dropped" and the count in its reason, so the gap is recorded in
// the audit log through the one audit path, and dropped_total() goes into Health.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "governance/control.h"

namespace esb::governance::proxy {

class Outbox {
 public:
  struct Options {
    size_t max_queued_per_tenant = 2000;
    size_t max_queued_total = 20000;
    size_t max_queued_control = 1000;  // results and health (the oldest goes first)
  };
  Outbox(control::ControlChannel* channel, Options options);
  ~Outbox();  // sends what is queued (until the channel fails), then joins
  Outbox(const Outbox&) = delete;
  Outbox& operator=(const Outbox&) = delete;

  void Push(control::ToEsbd m);
  int64_t dropped_total() const;

 private:
  struct Dropped {
    std::string tenant;
    int64_t count = 0;
  };
  void PushAudit(control::AuditEvent e);                // mu_ held
  void DropOldest(std::deque<control::AuditEvent>& q);  // mu_ held; q not empty
  std::optional<control::ToEsbd> Next();                // mu_ held
  void Run();

  control::ControlChannel* channel_;
  const Options options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<control::ToEsbd> control_;
  std::map<std::string, std::deque<control::AuditEvent>> tenants_;
  std::deque<std::string> order_;           // tenants with queued events, round-robin
  size_t queued_ = 0;                       // audit events in tenants_
  std::map<std::string, Dropped> dropped_;  // env_id → drops not yet reported
  int64_t dropped_total_ = 0;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace esb::governance::proxy

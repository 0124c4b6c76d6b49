// esb-proxy's outbox (governance/proxy/outbox.h): fair between tenants, and a drop is reported.
#include "governance/proxy/outbox.h"

#include <sys/socket.h>
#include <sys/time.h>

#include <map>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "gtest/gtest.h"

namespace esb::governance::proxy {
namespace {

control::AuditEvent Event(const std::string& tenant, const std::string& env, int i) {
  control::AuditEvent e;
  e.time_ms = 1;
  e.tenant = tenant;
  e.env_id = env;
  e.method = "GET";
  e.host = "h.test";
  e.path = "/" + std::to_string(i);
  e.decision = "allowed";
  return e;
}

// Attack: tenant A floods the audit queue while esbd is not reading (a slow or stalled control
// socket). Before, the one queue dropped the oldest events of whoever came first, so B's rows
// went missing; now every one of B's events arrives, A's drops are counted, and esbd receives
// an "audit:dropped" event for A's environment whose counts add up to exactly what was dropped.
TEST(OutboxTest, TenantFloodingTheAuditQueueLosesOnlyItsOwnEventsAndTheGapIsReported) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  // A small socket buffer, so the writer blocks soon and the queue fills behind it.
  int small = 4096;
  setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
  setsockopt(sv[1], SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  timeval tv{5, 0};
  setsockopt(sv[1], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  control::ControlChannel proxy_end{UniqueFd(sv[0])};
  control::ControlChannel esbd_end{UniqueFd(sv[1])};
  constexpr int kFlood = 2000;
  constexpr int kVictim = 20;
  int64_t dropped = 0;
  {
    Outbox outbox(&proxy_end, Outbox::Options{/*max_queued_per_tenant=*/50,
                                              /*max_queued_total=*/100,
                                              /*max_queued_control=*/10});
    for (int i = 0; i < kFlood; ++i) outbox.Push(Event("ta", "env-a", i));
    for (int i = 0; i < kVictim; ++i) outbox.Push(Event("tb", "env-b", i));
    outbox.Push(control::Health{});  // control messages are never lost behind audit events
    dropped = outbox.dropped_total();
    EXPECT_GE(dropped, kFlood - 50 - 200);  // what fits the socket buffer is not dropped
    // Drain everything, then let the outbox go (its destructor sends what is left).
    std::map<std::string, int> delivered;
    int64_t reported = 0;
    bool health = false;
    while (delivered["tb"] < kVictim || delivered["ta"] + reported < kFlood || !health) {
      absl::StatusOr<control::ToEsbd> m = esbd_end.ReceiveToEsbd();
      ASSERT_TRUE(m.ok()) << m.status() << " (ta " << delivered["ta"] << " + reported " << reported
                          << ", tb " << delivered["tb"] << ")";
      if (std::holds_alternative<control::Health>(*m)) {
        health = true;
        continue;
      }
      ASSERT_TRUE(std::holds_alternative<control::AuditEvent>(*m));
      const control::AuditEvent& e = std::get<control::AuditEvent>(*m);
      if (!e.rule_ids.empty() && e.rule_ids[0] == "audit:dropped") {
        EXPECT_EQ(e.env_id, "env-a");  // only the flooding tenant lost events
        EXPECT_EQ(e.tenant, "ta");
        EXPECT_EQ(e.decision, "error");
        ASSERT_TRUE(absl::StartsWith(e.reason, "audit events dropped: ")) << e.reason;
        std::string n = e.reason.substr(22, e.reason.find(' ', 22) - 22);
        int64_t count = 0;
        ASSERT_TRUE(absl::SimpleAtoi(n, &count)) << e.reason;
        reported += count;
        continue;
      }
      ++delivered[e.tenant];
    }
    EXPECT_EQ(delivered["tb"], kVictim);
    EXPECT_EQ(reported, outbox.dropped_total());
    EXPECT_EQ(delivered["ta"] + reported, kFlood);
  }
}

}  // namespace
}  // namespace esb::governance::proxy

#include "core/recovery.h"

#include <gtest/gtest.h>

#include <set>

#include "drivers/testing/stub_driver.h"

namespace esb {
namespace {

// Attach succeeds for `alive` ids; Destroy fails for `stuck` ids.
class RecoveryDriver : public testing::StubDriver {
 public:
  RecoveryDriver() : StubDriver("container") {}
  absl::Status Attach(const InstanceRef& ref) override {
    if (outdated.count(ref.id)) return SandboxOutdatedError("layout 1");
    return alive.count(ref.id) ? absl::OkStatus() : absl::NotFoundError("gone");
  }
  absl::Status Destroy(const InstanceRef& ref) override {
    if (stuck.count(ref.id)) return absl::UnavailableError("busy");
    destroyed.insert(ref.id);
    return absl::OkStatus();
  }
  std::set<std::string> alive, outdated, stuck, destroyed;
};

class RecoveryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    StoreOptions sopts;
    sopts.retention_s = int64_t{200} * 365 * 86400;
    auto s = Store::Open(":memory:", sopts);
    ASSERT_TRUE(s.ok()) << s.status();
    store = std::move(*s);
  }
  void Put(const std::string& id, const std::string& state, const std::string& runtime,
           const std::string& reason = "") {
    EnvironmentRecord r;
    r.id = id;
    r.tenant = "t";
    r.state = *ParseEnvState(state);
    r.runtime = runtime;
    r.destroy_reason = reason;
    r.created_ms = 1;
    ASSERT_TRUE(store->PutEnvironment(r).ok());
  }
  EnvironmentRecord Get(const std::string& id) {
    auto r = store->GetEnvironment(id);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : EnvironmentRecord{};
  }
  std::unique_ptr<Store> store;
  RecoveryDriver driver;
  std::map<std::string, Driver*> drivers{{"container", &driver}};
};

TEST(RestartCleanupReasonTest, OneReasonPerStateAndMode) {
  EnvironmentRecord r;
  absl::Status ok = absl::OkStatus();
  r.state = EnvState::kRunning;
  EXPECT_EQ(RestartCleanupReason(r, true, RecoveryMode::kReattach, ok), "");
  EXPECT_EQ(RestartCleanupReason(r, true, RecoveryMode::kDestroyAll, ok), "cleanup");
  EXPECT_EQ(RestartCleanupReason(r, true, RecoveryMode::kReattach, absl::NotFoundError("x")),
            "died_while_daemon_down");
  EXPECT_EQ(RestartCleanupReason(r, true, RecoveryMode::kReattach, SandboxOutdatedError("v1")),
            "sandbox_outdated");
  EXPECT_EQ(RestartCleanupReason(r, false, RecoveryMode::kReattach, ok),
            "driver_unavailable_after_restart");
  r.state = EnvState::kPooled;
  EXPECT_EQ(RestartCleanupReason(r, true, RecoveryMode::kDestroyAll, ok),
            "pool_discarded_on_restart");
  r.state = EnvState::kCreating;
  EXPECT_EQ(RestartCleanupReason(r, true, RecoveryMode::kReattach, ok), "create_interrupted");
  r.state = EnvState::kDestroying;
  EXPECT_EQ(RestartCleanupReason(r, true, RecoveryMode::kReattach, ok), "destroy_interrupted");
  r.destroy_reason = "ttl_expired";
  EXPECT_EQ(RestartCleanupReason(r, true, RecoveryMode::kDestroyAll, ok), "ttl_expired");
}

TEST_F(RecoveryTest, StartReattachesTheLiveAndCleansUpTheRest) {
  Put("alive", "running", "container");
  Put("dead", "running", "container");
  Put("old", "running", "container");
  Put("pool", "pooled", "container");
  Put("orphan", "running", "microvm");
  driver.alive = {"alive", "old"};
  driver.outdated = {"old"};
  auto out = RecoverEnvironments(store.get(), drivers, RecoveryMode::kReattach, 42);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->attached.size(), 1u);
  EXPECT_EQ(out->attached[0].record.id, "alive");
  EXPECT_EQ(out->attached[0].driver, &driver);
  EXPECT_EQ(Get("alive").state, EnvState::kRunning);
  EXPECT_EQ(Get("dead").destroy_reason, "died_while_daemon_down");
  EXPECT_EQ(Get("old").destroy_reason, "sandbox_outdated");
  EXPECT_EQ(Get("pool").destroy_reason, "pool_discarded_on_restart");
  EXPECT_EQ(Get("orphan").destroy_reason, "driver_unavailable_after_restart");
  EXPECT_EQ(Get("dead").state, EnvState::kDestroyed);
  EXPECT_EQ(Get("dead").destroyed_ms, 42);
  EXPECT_EQ(driver.destroyed, (std::set<std::string>{"dead", "old", "pool"}));
}

TEST_F(RecoveryTest, CleanupDestroysEvenTheLiveOnes) {
  Put("alive", "running", "container");
  driver.alive = {"alive"};
  auto out = RecoverEnvironments(store.get(), drivers, RecoveryMode::kDestroyAll, 7);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(out->attached.empty());
  EXPECT_EQ(out->destroyed, std::vector<std::string>{"alive"});
  EXPECT_EQ(Get("alive").state, EnvState::kDestroyed);
  EXPECT_EQ(Get("alive").destroy_reason, "cleanup");
  EXPECT_EQ(driver.destroyed.count("alive"), 1u);
}

// A sandbox whose destroy failed may still exist: its record must stay live for a retry, in
// both modes (the old daemon start forgot it; the old cleanup command kept it).
TEST_F(RecoveryTest, FailedDestroyKeepsTheRecordForARetry) {
  Put("stuck", "running", "container");
  driver.stuck = {"stuck"};
  for (RecoveryMode mode : {RecoveryMode::kReattach, RecoveryMode::kDestroyAll}) {
    auto out = RecoverEnvironments(store.get(), drivers, mode, 9);
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->destroy_failed.size(), 1u);
    EXPECT_TRUE(out->destroyed.empty());
    EXPECT_EQ(Get("stuck").state, EnvState::kDestroying);
  }
  auto live = store->ListLiveEnvironments();
  ASSERT_TRUE(live.ok());
  ASSERT_EQ(live->size(), 1u);
  driver.stuck.clear();
  auto out = RecoverEnvironments(store.get(), drivers, RecoveryMode::kReattach, 10);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->destroyed, std::vector<std::string>{"stuck"});
  EXPECT_EQ(Get("stuck").state, EnvState::kDestroyed);
  EXPECT_EQ(Get("stuck").destroy_reason, "died_while_daemon_down");
}

}  // namespace
}  // namespace esb

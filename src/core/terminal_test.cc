// EnvironmentManager's terminals (core/terminal.cc) with a fake driver: the capability check,
// the caps per environment and per tenant (and their release), tenant isolation, the idle
// clock, input retries while the guest's queue is full, the shell killed on destruction, and
// the terminal.open / terminal.close audit rows.
#include <atomic>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/environment_manager.h"
#include "drivers/testing/fake_driver.h"
#include "gtest/gtest.h"

namespace esb {
namespace {

using esb::testing::FakeDriver;

class TerminalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto s = Store::Open(":memory:", StoreOptions{});
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(*s);
    ManagerOptions opts;
    opts.pool_size = 0;
    opts.max_terminals_per_environment = 2;
    opts.max_terminals_per_tenant = 3;
    opts.terminal_idle_timeout_ms = 200;
    manager_ = std::make_unique<EnvironmentManager>(
        store_.get(), std::map<std::string, Driver*>{{"container", &driver_}}, &metrics_, opts);
    ASSERT_TRUE(manager_->Start().ok());
  }
  void TearDown() override { manager_->Stop(); }
  std::string Env(const std::string& tenant = "t") {
    auto info = manager_->Create(tenant, EnvSpec{}, 600);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->record.id : "";
  }
  // The tenant's audit rows of `id` with `action` (polled: rows may be written behind).
  std::vector<AuditEntry> Rows(const std::string& id, const std::string& action, size_t want) {
    std::vector<AuditEntry> rows;
    for (int i = 0; i < 100; ++i) {
      rows.clear();
      AuditQuery q;
      q.tenant = "t";
      q.environment_id = id;
      auto all = store_->QueryAudit(q);
      if (all.ok())
        for (const AuditEntry& e : *all)
          if (e.action == action) rows.push_back(e);
      if (rows.size() >= want) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return rows;
  }

  FakeDriver driver_{"container", {Capability::kExec, Capability::kFiles, Capability::kTerminal}};
  Metrics metrics_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<EnvironmentManager> manager_;
};

TEST_F(TerminalTest, CapsPerEnvironmentAndTenantAreEnforcedAndReleased) {
  const std::string e1 = Env(), e2 = Env();
  auto a = manager_->OpenTerminal("t", e1, 24, 80);
  auto b = manager_->OpenTerminal("t", e1, 24, 80);
  ASSERT_TRUE(a.ok() && b.ok());
  auto c = manager_->OpenTerminal("t", e1, 24, 80);
  EXPECT_TRUE(absl::IsResourceExhausted(c.status())) << c.status();
  EXPECT_TRUE(absl::StrContains(c.status().message(), "max_terminals_per_environment"));
  auto d = manager_->OpenTerminal("t", e2, 24, 80);
  ASSERT_TRUE(d.ok());
  auto e = manager_->OpenTerminal("t", e2, 24, 80);
  EXPECT_TRUE(absl::IsResourceExhausted(e.status())) << e.status();
  EXPECT_TRUE(absl::StrContains(e.status().message(), "max_terminals_per_tenant"));
  // Another tenant has its own share.
  const std::string other = Env("u");
  EXPECT_TRUE(manager_->OpenTerminal("u", other, 24, 80).ok());
  a->reset();  // closing one frees its slot at once
  EXPECT_TRUE(manager_->OpenTerminal("t", e1, 24, 80).ok());
  // a's shell, and those of the two terminals opened above and dropped at once.
  EXPECT_EQ(driver_.log.kills.load(), 3);
}

TEST_F(TerminalTest, AnotherTenantsEnvironmentIsNotFoundAndNotAudited) {
  const std::string id = Env();
  auto t = manager_->OpenTerminal("u", id, 24, 80);
  EXPECT_TRUE(IsEnvironmentNotFound(t.status())) << t.status();
  EXPECT_TRUE(Rows(id, "terminal.open", 0).empty());
}

TEST_F(TerminalTest, RuntimeWithoutTerminalsIsRefusedAndAudited) {
  driver_.caps = CapabilitySet{Capability::kExec};
  const std::string id = Env();
  auto t = manager_->OpenTerminal("t", id, 24, 80);
  EXPECT_TRUE(IsMissingCapability(t.status())) << t.status();
  EXPECT_TRUE(absl::StrContains(t.status().message(), "'terminal'")) << t.status();
  std::vector<AuditEntry> rows = Rows(id, "terminal.open", 1);
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].status, 400);
}

TEST_F(TerminalTest, BadSizesAndAFailedStartReleaseEverything) {
  const std::string id = Env();
  EXPECT_TRUE(absl::IsInvalidArgument(manager_->OpenTerminal("t", id, 0, 80).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(manager_->OpenTerminal("t", id, 24, 1001).status()));
  driver_.fail_open = true;
  for (int i = 0; i < 5; ++i)  // more than the caps: a failed start holds no slot
    EXPECT_TRUE(absl::IsUnavailable(manager_->OpenTerminal("t", id, 24, 80).status()));
  driver_.fail_open = false;
  auto t = manager_->OpenTerminal("t", id, 30, 100);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(driver_.last_request.rows, 30);
  EXPECT_EQ(driver_.last_request.cols, 100);
  EXPECT_TRUE(absl::IsInvalidArgument((*t)->Resize(0, 10)));
  EXPECT_TRUE(Rows(id, "terminal.close", 0).empty());  // none opened until the last one
}

TEST_F(TerminalTest, ExitIsAuditedWithItsCodeAndTheShellIsKilledOnClose) {
  const std::string id = Env();
  {
    auto t = manager_->OpenTerminal("t", id, 24, 80);
    ASSERT_TRUE(t.ok());
    ASSERT_TRUE((*t)->Input("exit 3\n").ok());
    driver_.log.exit_code = 3;
    auto st = (*t)->Wait(100, nullptr);
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(**st, 3);
  }
  EXPECT_EQ(driver_.log.kills.load(), 1);
  std::vector<AuditEntry> open = Rows(id, "terminal.open", 1);
  ASSERT_EQ(open.size(), 1u);
  EXPECT_EQ(open[0].detail, "80x24");
  std::vector<AuditEntry> close = Rows(id, "terminal.close", 1);
  ASSERT_EQ(close.size(), 1u);
  EXPECT_EQ(close[0].exit_code, 3);
  EXPECT_EQ(close[0].detail, "exited");
  EXPECT_EQ(close[0].bytes, 9);  // "exit 3\n" in, "$ " out
}

TEST_F(TerminalTest, IdleAfterTheTimeoutUntilInputOrOutput) {
  const std::string id = Env();
  auto t = manager_->OpenTerminal("t", id, 24, 80);
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE((*t)->Idle());
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  EXPECT_TRUE((*t)->Idle());
  ASSERT_TRUE((*t)->Input("x").ok());
  EXPECT_FALSE((*t)->Idle());
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  ASSERT_TRUE((*t)->Wait(10, nullptr).ok());  // output counts as activity too
  EXPECT_FALSE((*t)->Idle());
  (*t)->Close("idle timeout");
  t->reset();
  std::vector<AuditEntry> close = Rows(id, "terminal.close", 1);
  ASSERT_EQ(close.size(), 1u);
  EXPECT_EQ(close[0].detail, "idle timeout");
}

TEST_F(TerminalTest, InputIsRetriedWhileTheGuestQueueIsFull) {
  const std::string id = Env();
  auto t = manager_->OpenTerminal("t", id, 24, 80);
  ASSERT_TRUE(t.ok());
  driver_.log.busy_inputs = 3;
  EXPECT_TRUE((*t)->Input("keys").ok());
  EXPECT_EQ(driver_.log.inputs.load(), 4);
}

}  // namespace
}  // namespace esb

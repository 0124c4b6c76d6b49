#include "core/environment_manager.h"
#include "core/volumes.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <iostream>
#include <chrono>
#include <condition_variable>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/util.h"

namespace esb {
namespace {

// An in-memory driver that records what the core asks of it.
class FakeDriver : public Driver {
 public:
  std::string name() const override { return "container"; }
  std::string Describe() const override { return "fake"; }
  CapabilitySet Capabilities() const override { return capabilities; }
  absl::StatusOr<InstanceRef> Create(const std::string& id, const EnvSpec& spec) override {
    if (int d = create_delay_ms.load(); d > 0)  // a slow driver widens any check-then-act gap
      std::this_thread::sleep_for(std::chrono::milliseconds(d));
    std::lock_guard<std::mutex> lock(mu);
    if (fail_create) return absl::InternalError("boom");
    alive.insert(id);
    ++creates;
    networks[id] = spec.network;
    for (const VolumeMount& v : spec.volumes) mounted_keys.push_back(v.key + ":" + v.path);
    return InstanceRef{id, "container", absl::StrCat("{\"id\":\"", id, "\"}")};
  }
  absl::Status Destroy(const InstanceRef& ref) override {
    std::lock_guard<std::mutex> lock(mu);
    alive.erase(ref.id);
    destroyed.push_back(ref.id);
    return absl::OkStatus();
  }
  absl::Status Attach(const InstanceRef& ref) override {
    std::lock_guard<std::mutex> lock(mu);
    if (outdated.count(ref.id)) return SandboxOutdatedError("layout 1");
    return alive.count(ref.id) ? absl::OkStatus() : absl::NotFoundError("gone");
  }
  absl::StatusOr<ExecResult> Exec(const InstanceRef& ref, const ExecRequest& req,
                                  const OutputSink& sink) override {
    if (on_exec) on_exec();
    if (fail_exec) return absl::InternalError("exec broke");
    ExecResult r;
    r.exit_code = 0;
    r.stdout_data = req.command;
    if (sink) sink(Stream::kStdout, req.command);
    return r;
  }
  absl::Status WriteFile(const InstanceRef&, const std::string&, std::string_view, int64_t,
                         bool) override {
    return absl::OkStatus();
  }
  absl::StatusOr<FileChunk> ReadFile(const InstanceRef&, const std::string&, int64_t,
                                     int64_t) override {
    return absl::NotFoundError("no such file");
  }
  absl::StatusOr<DirListing> ListDir(const InstanceRef&, const std::string&) override {
    return DirListing{};
  }
  absl::StatusOr<FileEntry> Stat(const InstanceRef&, const std::string&) override {
    return absl::NotFoundError("no such file");
  }
  absl::StatusOr<bool> MakeDir(const InstanceRef&, const std::string&) override { return true; }
  absl::Status Remove(const InstanceRef&, const std::string&, bool) override {
    return absl::NotFoundError("no such file");
  }
  absl::Status Rename(const InstanceRef&, const std::string&, const std::string&, bool) override {
    return absl::NotFoundError("no such file");
  }
  absl::StatusOr<Usage> Stats(const InstanceRef& ref) override {
    std::lock_guard<std::mutex> lock(mu);
    Usage u;
    u.alive = alive.count(ref.id) > 0;
    return u;
  }
  absl::Status Configure(const InstanceRef& ref,
                         const std::map<std::string, std::string>& env) override {
    std::lock_guard<std::mutex> lock(mu);
    configured[ref.id] = env;
    return alive.count(ref.id) ? absl::OkStatus() : absl::NotFoundError("gone");
  }

  absl::Status CreateVolume(const std::string& key, int64_t size_mb) override {
    std::lock_guard<std::mutex> lock(mu);
    if (!volumes.emplace(key, size_mb).second) return absl::AlreadyExistsError("exists");
    return absl::OkStatus();
  }
  absl::Status DeleteVolume(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu);
    volumes.erase(key);
    return absl::OkStatus();
  }

  CapabilitySet capabilities{Capability::kExec, Capability::kFiles};
  std::map<std::string, int64_t> volumes;  // key -> size_mb
  std::vector<std::string> mounted_keys;   // "key:path" of every Create
  std::mutex mu;
  std::set<std::string> alive;
  std::set<std::string> outdated;  // Attach answers SandboxOutdatedError
  std::vector<std::string> destroyed;
  std::map<std::string, std::map<std::string, std::string>> configured;
  int creates = 0;
  bool fail_create = false;
  bool fail_exec = false;
  std::function<void()> on_exec;
  std::map<std::string, NetworkPolicy> networks;  // what each Create was asked to build
  std::atomic<int> create_delay_ms{0};
};

class ManagerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Tests' fake clocks start in 1970: keep the store's retention (real clock) from pruning
    // their destroyed environments.
    StoreOptions sopts;
    sopts.retention_s = int64_t{200} * 365 * 86400;
    auto s = Store::Open(":memory:", sopts);
    ASSERT_TRUE(s.ok()) << s.status();
    store = std::move(*s);
  }
  std::unique_ptr<EnvironmentManager> Make(int pool_size, std::atomic<int64_t>* clock) {
    ManagerOptions opts;
    opts.pool_size = pool_size;
    opts.reaper_interval_ms = 20;
    opts.health_interval_ms = 50;
    opts.default_ttl_s = 60;
    if (clock) opts.now_ms = [clock] { return clock->load(); };
    return std::make_unique<EnvironmentManager>(
        store.get(), std::map<std::string, Driver*>{{"container", &driver}}, &metrics, opts);
  }
  std::unique_ptr<Store> store;
  FakeDriver driver;
  Metrics metrics;
};

TEST_F(ManagerTest, CreateExecDestroyLifecycle) {
  auto m = Make(0, nullptr);
  ASSERT_TRUE(m->Start().ok());
  auto info = m->Create("acme", EnvSpec{}, 0);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->record.state, EnvState::kRunning);
  EXPECT_FALSE(info->pooled);
  auto r = m->Exec("acme", info->record.id, ExecRequest{"echo hi"}, nullptr);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->stdout_data, "echo hi");
  ASSERT_TRUE(m->Destroy("acme", info->record.id).ok());
  EXPECT_TRUE(m->Destroy("acme", info->record.id).ok()) << "destroy must be idempotent";
  auto after = m->Exec("acme", info->record.id, ExecRequest{"x"}, nullptr);
  EXPECT_TRUE(absl::IsNotFound(after.status()));
  EXPECT_NE(after.status().message().find("destroyed"), std::string::npos);
  auto rec = store->GetEnvironment(info->record.id);
  ASSERT_TRUE(rec.ok());
  EXPECT_EQ(rec->state, EnvState::kDestroyed);
  EXPECT_EQ(rec->destroy_reason, "deleted");
  m->Stop();
}

EnvSpec WithVolume(const std::string& name, const std::string& path) {
  EnvSpec spec;
  spec.volumes.push_back(VolumeMount{.name = name, .path = path});
  return spec;
}

TEST_F(ManagerTest, VolumesAreTenantScopedAndNeedTheCapability) {
  auto m = Make(0, nullptr);
  ASSERT_TRUE(m->Start().ok());
  auto missing = m->CreateVolume(Caller("acme"), "data", 32);
  EXPECT_TRUE(IsMissingCapability(missing.status())) << missing.status();
  driver.capabilities.Add(Capability::kVolumes);
  ASSERT_TRUE(m->CreateVolume(Caller("acme"), "data", 32).ok());
  EXPECT_EQ(m->CreateVolume(Caller("acme"), "data", 32).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(m->CreateVolume(Caller("acme"), "x", 8).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto other = m->Create(Caller("evil"), WithVolume("data", "/mnt/d"), 0);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kNotFound) << other.status();
  EXPECT_EQ(m->DeleteVolume(Caller("evil"), "data").code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(m->ListVolumes(Caller("evil"))->empty());
  auto env = m->Create(Caller("acme"), WithVolume("data", "/mnt/d"), 0);
  ASSERT_TRUE(env.ok()) << env.status();
  ASSERT_EQ(driver.mounted_keys.size(), 1u);
  EXPECT_EQ(driver.mounted_keys[0], VolumeKey("acme", "data") + ":/mnt/d")
      << "the driver gets the tenant's key";
  EXPECT_EQ(env->spec.volumes[0].size_mb, 32);
  m->Stop();
}

TEST_F(ManagerTest, AVolumeHasOneHolderEvenUnderConcurrentCreates) {
  driver.capabilities.Add(Capability::kVolumes);
  auto m = Make(0, nullptr);
  ASSERT_TRUE(m->Start().ok());
  ASSERT_TRUE(m->CreateVolume(Caller("t"), "data", 32).ok());
  driver.create_delay_ms = 50;
  std::atomic<int> ok{0}, conflict{0};
  std::vector<std::thread> threads;
  std::vector<std::string> ids(8);
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      auto r = m->Create(Caller("t"), WithVolume("data", "/mnt/d"), 0);
      if (r.ok()) {
        ++ok;
        ids[i] = r->record.id;
      } else if (r.status().code() == absl::StatusCode::kAborted) {
        ++conflict;
      }
    });
  }
  for (auto& t : threads) t.join();
  driver.create_delay_ms = 0;
  EXPECT_EQ(ok.load(), 1);
  EXPECT_EQ(conflict.load(), 7);
  std::string holder;
  for (const std::string& id : ids)
    if (!id.empty()) holder = id;
  EXPECT_EQ((*m->ListVolumes(Caller("t")))[0].mounted_by, holder);
  EXPECT_EQ(m->DeleteVolume(Caller("t"), "data").code(), absl::StatusCode::kAborted);
  ASSERT_TRUE(m->Destroy(Caller("t"), holder).ok());
  EXPECT_TRUE((*m->ListVolumes(Caller("t")))[0].mounted_by.empty());
  EXPECT_TRUE(m->DeleteVolume(Caller("t"), "data").ok());
  EXPECT_TRUE(driver.volumes.empty()) << "the driver deleted it";
  m->Stop();
}

TEST_F(ManagerTest, VolumeHoldersAreKnownAgainAfterARestart) {
  driver.capabilities.Add(Capability::kVolumes);
  std::string id;
  {
    auto m = Make(0, nullptr);
    ASSERT_TRUE(m->Start().ok());
    ASSERT_TRUE(m->CreateVolume(Caller("t"), "data", 32).ok());
    auto env = m->Create(Caller("t"), WithVolume("data", "/mnt/d"), 0);
    ASSERT_TRUE(env.ok());
    id = env->record.id;
    m->Stop();
  }
  auto m2 = Make(0, nullptr);
  ASSERT_TRUE(m2->Start().ok());
  EXPECT_EQ((*m2->ListVolumes(Caller("t")))[0].mounted_by, id);
  EXPECT_EQ(m2->DeleteVolume(Caller("t"), "data").code(), absl::StatusCode::kAborted);
  EXPECT_EQ(m2->Create(Caller("t"), WithVolume("data", "/mnt/e"), 0).status().code(),
            absl::StatusCode::kAborted);
  auto got = m2->Get(Caller("t"), id);
  ASSERT_TRUE(got.ok());
  ASSERT_EQ(got->spec.volumes.size(), 1u) << "the spec (with volumes) round-trips the store";
  EXPECT_EQ(got->spec.volumes[0].path, "/mnt/d");
  m2->Stop();
}

TEST_F(ManagerTest, OtherTenantSeesNotFoundNeverTheEnvironment) {
  auto m = Make(0, nullptr);
  ASSERT_TRUE(m->Start().ok());
  auto info = m->Create("acme", EnvSpec{}, 0);
  ASSERT_TRUE(info.ok());
  const std::string& id = info->record.id;
  EXPECT_TRUE(absl::IsNotFound(m->Get("evil", id).status()));
  EXPECT_TRUE(absl::IsNotFound(m->Exec("evil", id, ExecRequest{"id"}, nullptr).status()));
  EXPECT_TRUE(absl::IsNotFound(m->Destroy("evil", id)));
  EXPECT_TRUE(absl::IsNotFound(m->Heartbeat("evil", id, 10).status()));
  // Marked as "no such environment", unlike a missing file inside one.
  EXPECT_TRUE(IsEnvironmentNotFound(m->Get("evil", id).status()));
  EXPECT_TRUE(IsEnvironmentNotFound(m->ReadFile("evil", id, "x", 0, 10).status()));
  EXPECT_FALSE(IsEnvironmentNotFound(absl::NotFoundError("environment.txt: no such file")));
  EXPECT_FALSE(IsEnvironmentNotFound(absl::OkStatus()));
  auto list = m->List("evil", true);
  ASSERT_TRUE(list.ok());
  EXPECT_TRUE(list->empty());
  EXPECT_TRUE(m->Get("acme", id).ok()) << "the owner still has it";
  m->Stop();
}

TEST_F(ManagerTest, ReaperDestroysExpiredLeaseAndHeartbeatExtends) {
  std::atomic<int64_t> clock{1'000'000};
  auto m = Make(0, &clock);
  ASSERT_TRUE(m->Start().ok());
  auto a = m->Create("t", EnvSpec{}, 10);
  auto b = m->Create("t", EnvSpec{}, 10);
  ASSERT_TRUE(a.ok() && b.ok());
  clock += 8'000;
  ASSERT_TRUE(m->Heartbeat("t", b->record.id, 10).ok());
  clock += 5'000;  // a is 13 s old (expired); b's lease runs to +18 s
  for (int i = 0; i < 100 && m->Get("t", a->record.id)->record.state != EnvState::kDestroyed; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(m->Get("t", a->record.id)->record.state, EnvState::kDestroyed);
  EXPECT_EQ(m->Get("t", a->record.id)->record.destroy_reason, "ttl_expired");
  EXPECT_EQ(m->Get("t", b->record.id)->record.state, EnvState::kRunning);
  m->Stop();
}

TEST_F(ManagerTest, WarmPoolServesMatchingSpecsAndRefills) {
  auto m = Make(2, nullptr);
  ASSERT_TRUE(m->Start().ok());
  for (int i = 0; i < 200 && m->PoolReady() < 2; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(m->PoolReady(), 2);
  EnvSpec with_env;
  with_env.env = {{"K", "V"}};
  auto a = m->Create("t", with_env, 0);
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(a->pooled);
  EXPECT_EQ(driver.configured[a->record.id].at("K"), "V");
  EnvSpec big;
  big.memory_mb = 2048;
  auto b = m->Create("t", big, 0);
  ASSERT_TRUE(b.ok());
  EXPECT_FALSE(b->pooled) << "a different shape must not come from the pool";
  for (int i = 0; i < 200 && m->PoolReady() < 2; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(m->PoolReady(), 2) << "pool refills in the background";
  m->Stop();
  // Pool instances are discarded on shutdown; the two environments stay alive.
  std::lock_guard<std::mutex> lock(driver.mu);
  EXPECT_EQ(driver.alive.size(), 2u);
}

TEST_F(ManagerTest, RestartReattachesLiveAndCleansUpDead) {
  std::string alive_id, dead_id;
  {
    auto m = Make(0, nullptr);
    ASSERT_TRUE(m->Start().ok());
    alive_id = m->Create("t", EnvSpec{}, 0)->record.id;
    dead_id = m->Create("t", EnvSpec{}, 0)->record.id;
    m->Stop();
  }
  {
    std::lock_guard<std::mutex> lock(driver.mu);
    driver.alive.erase(dead_id);  // died while the daemon was down
  }
  auto m2 = Make(0, nullptr);
  ASSERT_TRUE(m2->Start().ok());
  EXPECT_TRUE(m2->Exec("t", alive_id, ExecRequest{"true"}, nullptr).ok());
  auto dead = m2->Get("t", dead_id);
  ASSERT_TRUE(dead.ok());
  EXPECT_EQ(dead->record.state, EnvState::kDestroyed);
  EXPECT_EQ(dead->record.destroy_reason, "died_while_daemon_down");
  m2->Stop();
}

// An environment an older esbd created keeps that esbd's (weaker) sandbox layout: after an
// upgrade it is destroyed, not re-attached, and says why.
TEST_F(ManagerTest, RestartDestroysEnvironmentsOfAnOutdatedSandboxLayout) {
  std::string old_id, new_id;
  {
    auto m = Make(0, nullptr);
    ASSERT_TRUE(m->Start().ok());
    old_id = m->Create("t", EnvSpec{}, 0)->record.id;
    new_id = m->Create("t", EnvSpec{}, 0)->record.id;
    m->Stop();
  }
  {
    std::lock_guard<std::mutex> lock(driver.mu);
    driver.outdated.insert(old_id);  // alive, but of the old layout
  }
  auto m2 = Make(0, nullptr);
  ASSERT_TRUE(m2->Start().ok());
  EXPECT_TRUE(m2->Exec("t", new_id, ExecRequest{"true"}, nullptr).ok());
  auto old = m2->Get("t", old_id);
  ASSERT_TRUE(old.ok());
  EXPECT_EQ(old->record.state, EnvState::kDestroyed);
  EXPECT_EQ(old->record.destroy_reason, "sandbox_outdated");
  EXPECT_FALSE(m2->Exec("t", old_id, ExecRequest{"true"}, nullptr).ok());
  {
    std::lock_guard<std::mutex> lock(driver.mu);
    EXPECT_EQ(driver.alive.count(old_id), 0u) << "the outdated sandbox was not destroyed";
  }
  m2->Stop();
}

TEST_F(ManagerTest, DeadEnvironmentIsNoticedAndCleanedUp) {
  auto m = Make(0, nullptr);
  ASSERT_TRUE(m->Start().ok());
  auto a = m->Create("t", EnvSpec{}, 0);
  ASSERT_TRUE(a.ok());
  {
    std::lock_guard<std::mutex> lock(driver.mu);
    driver.alive.erase(a->record.id);
  }
  for (int i = 0; i < 200 && m->Get("t", a->record.id)->record.state != EnvState::kDestroyed; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(m->Get("t", a->record.id)->record.destroy_reason, "died");
  m->Stop();
}

TEST_F(ManagerTest, CreateFailureIsRecordedAndReported) {
  auto m = Make(0, nullptr);
  ASSERT_TRUE(m->Start().ok());
  driver.fail_create = true;
  auto a = m->Create("t", EnvSpec{}, 0);
  EXPECT_FALSE(a.ok());
  auto list = m->List("t", true);
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].record.state, EnvState::kDestroyed);
  EXPECT_NE((*list)[0].record.destroy_reason.find("create_failed"), std::string::npos);
  m->Stop();
}

TEST_F(ManagerTest, UnknownRuntimeAndLimitsAreRefused) {
  ManagerOptions opts;
  opts.pool_size = 0;
  opts.max_environments_per_tenant = 1;
  EnvironmentManager m(store.get(), {{"container", &driver}}, &metrics, opts);
  ASSERT_TRUE(m.Start().ok());
  EnvSpec nano;
  nano.runtime = DriverKind::kNano;
  EXPECT_TRUE(absl::IsInvalidArgument(m.Create("t", nano, 0).status()));
  ASSERT_TRUE(m.Create("t", EnvSpec{}, 0).ok());
  EXPECT_TRUE(absl::IsResourceExhausted(m.Create("t", EnvSpec{}, 0).status()));
  EXPECT_TRUE(m.Create("other", EnvSpec{}, 0).ok()) << "limits are per tenant";
  m.Stop();
}

// Fires `n` creates for `tenant` at once; returns (succeeded, resource-exhausted).
std::pair<int, int> ConcurrentCreates(EnvironmentManager& m, const std::string& tenant, int n) {
  std::atomic<int> ok{0}, exhausted{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&] {
      while (!go) std::this_thread::yield();
      auto r = m.Create(tenant, EnvSpec{}, 0);
      if (r.ok()) ++ok;
      else if (absl::IsResourceExhausted(r.status())) ++exhausted;
      else ADD_FAILURE() << r.status();
    });
  }
  go = true;
  for (auto& t : threads) t.join();
  return {ok.load(), exhausted.load()};
}

TEST_F(ManagerTest, ConcurrentCreatesAtTheTenantQuotaEdgeCannotOvershootIt) {
  ManagerOptions opts;
  opts.pool_size = 0;
  opts.max_environments_per_tenant = 20;
  EnvironmentManager m(store.get(), {{"container", &driver}}, &metrics, opts);
  ASSERT_TRUE(m.Start().ok());
  for (int i = 0; i < 18; ++i) ASSERT_TRUE(m.Create("t", EnvSpec{}, 0).ok());
  driver.create_delay_ms = 50;
  auto [ok, exhausted] = ConcurrentCreates(m, "t", 40);
  EXPECT_EQ(ok, 2) << "exactly the quota's room succeeds";
  EXPECT_EQ(exhausted, 38);
  EXPECT_EQ(m.List("t", false)->size(), 20u);
  // Failed creates release their reservation: after one goes, one more fits.
  driver.create_delay_ms = 0;
  ASSERT_TRUE(m.Destroy("t", m.List("t", false)->front().record.id).ok());
  driver.fail_create = true;
  EXPECT_FALSE(m.Create("t", EnvSpec{}, 0).ok());
  driver.fail_create = false;
  EXPECT_TRUE(m.Create("t", EnvSpec{}, 0).ok()) << "a failed create must not leak its slot";
  EXPECT_TRUE(absl::IsResourceExhausted(m.Create("t", EnvSpec{}, 0).status()));
  m.Stop();
}

TEST_F(ManagerTest, ConcurrentCreatesAtTheDaemonQuotaEdgeCannotOvershootIt) {
  ManagerOptions opts;
  opts.pool_size = 0;
  opts.max_environments = 10;
  EnvironmentManager m(store.get(), {{"container", &driver}}, &metrics, opts);
  ASSERT_TRUE(m.Start().ok());
  for (int i = 0; i < 7; ++i) ASSERT_TRUE(m.Create("a", EnvSpec{}, 0).ok());
  driver.create_delay_ms = 50;
  std::pair<int, int> b, c;
  std::thread tb([&] { b = ConcurrentCreates(m, "b", 20); });
  std::thread tc([&] { c = ConcurrentCreates(m, "c", 20); });
  tb.join();
  tc.join();
  EXPECT_EQ(b.first + c.first, 3);
  EXPECT_EQ(b.second + c.second, 37);
  EXPECT_EQ(m.StateCounts()["running"], 10);
  m.Stop();
}

TEST_F(ManagerTest, PooledTakesCountAgainstTheQuotaToo) {
  ManagerOptions opts;
  opts.pool_size = 5;
  opts.max_environments_per_tenant = 3;
  EnvironmentManager m(store.get(), {{"container", &driver}}, &metrics, opts);
  ASSERT_TRUE(m.Start().ok());
  for (int i = 0; i < 200 && m.PoolReady() < 5; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(m.PoolReady(), 5);
  auto [ok, exhausted] = ConcurrentCreates(m, "t", 12);
  EXPECT_EQ(ok, 3);
  EXPECT_EQ(exhausted, 9);
  EXPECT_EQ(m.List("t", false)->size(), 3u);
  m.Stop();
}

TEST_F(ManagerTest, ReaperRunsStoreMaintenance) {
  // Audit retention runs from the reaper: a row far past retention disappears by itself.
  StoreOptions sopts;
  sopts.retention_s = 1;
  auto s = Store::Open(":memory:", sopts);
  ASSERT_TRUE(s.ok());
  store = std::move(*s);
  AuditEntry old;
  old.tenant = "t";
  old.action = "execute";
  old.time_ms = 1000;
  ASSERT_TRUE(store->AppendAudit(old).ok());
  ASSERT_EQ(*store->CountAudit("t"), 1);
  auto m = Make(0, nullptr);
  ASSERT_TRUE(m->Start().ok());
  for (int i = 0; i < 200 && *store->CountAudit("t") != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(*store->CountAudit("t"), 0);
  m->Stop();
}


// A store whose environment writes for one id block until released (or 3 s pass): what a
// store busy with audit inserts, row-cap deletes or retention looks like to the manager.
class BlockingStore : public Store {
 public:
  explicit BlockingStore(Store* inner) : inner_(inner) {}
  void BlockWritesOf(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    blocked_id_ = id;
  }
  void Release() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocked_id_.clear();
    }
    cv_.notify_all();
  }
  int blocked_writers() {
    std::lock_guard<std::mutex> lock(mu_);
    return waiting_;
  }
  absl::Status PutEnvironment(const EnvironmentRecord& rec) override {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (rec.id == blocked_id_) {
        ++waiting_;
        cv_.wait_for(lock, std::chrono::seconds(3), [&] { return blocked_id_ != rec.id; });
        --waiting_;
      }
    }
    return inner_->PutEnvironment(rec);
  }
  absl::StatusOr<EnvironmentRecord> GetEnvironment(const std::string& id) override {
    return inner_->GetEnvironment(id);
  }
  absl::StatusOr<std::vector<EnvironmentRecord>> ListLiveEnvironments() override {
    return inner_->ListLiveEnvironments();
  }
  absl::StatusOr<std::vector<EnvironmentRecord>> ListEnvironments(const std::string& tenant,
                                                                  bool destroyed) override {
    return inner_->ListEnvironments(tenant, destroyed);
  }
  absl::Status InsertVolume(const VolumeRecord& rec) override { return inner_->InsertVolume(rec); }
  absl::StatusOr<std::vector<VolumeRecord>> ListVolumes(const std::string& tenant) override {
    return inner_->ListVolumes(tenant);
  }
  absl::Status DeleteVolume(const std::string& tenant, const std::string& name) override {
    return inner_->DeleteVolume(tenant, name);
  }
  absl::Status PutEgress(const EgressRecord& rec) override { return inner_->PutEgress(rec); }
  absl::StatusOr<EgressRecord> GetEgress(const std::string& id) override {
    return inner_->GetEgress(id);
  }
  absl::Status DeleteEgress(const std::string& id) override { return inner_->DeleteEgress(id); }
  absl::StatusOr<ApiKeyRecord> CreateApiKey(const std::string& tenant, const std::string& name,
                                            std::string* secret) override {
    return inner_->CreateApiKey(tenant, name, secret);
  }
  absl::Status ImportApiKey(const std::string& tenant, const std::string& secret,
                            const std::string& name) override {
    return inner_->ImportApiKey(tenant, secret, name);
  }
  absl::StatusOr<ApiKeyRecord> KeyForSecret(const std::string& secret) override {
    return inner_->KeyForSecret(secret);
  }
  absl::StatusOr<std::vector<ApiKeyRecord>> ListApiKeys() override {
    return inner_->ListApiKeys();
  }
  absl::Status RevokeApiKey(const std::string& key_id) override {
    return inner_->RevokeApiKey(key_id);
  }
  absl::StatusOr<int64_t> CountActiveApiKeys() override { return inner_->CountActiveApiKeys(); }
  absl::Status AppendAudit(const AuditEntry& e) override { return inner_->AppendAudit(e); }
  absl::StatusOr<std::vector<AuditEntry>> QueryAudit(const AuditQuery& q) override {
    return inner_->QueryAudit(q);
  }
  absl::Status Maintain() override { return inner_->Maintain(); }
  absl::StatusOr<int64_t> CountAudit(const std::string& tenant) override {
    return inner_->CountAudit(tenant);
  }

 private:
  Store* inner_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::string blocked_id_;
  int waiting_ = 0;
};

TEST_F(ManagerTest, SlowStoreWriteOfOneEnvironmentDoesNotStallLookupsOfOthers) {
  BlockingStore slow(store.get());
  ManagerOptions opts;
  opts.pool_size = 0;
  opts.reaper_interval_ms = 10;  // the reaper walks every environment while the write hangs
  opts.health_interval_ms = 10;
  EnvironmentManager m(&slow, {{"container", &driver}}, &metrics, opts);
  ASSERT_TRUE(m.Start().ok());
  auto a = m.Create("acme", EnvSpec{}, 0);
  auto b = m.Create("globex", EnvSpec{}, 0);
  ASSERT_TRUE(a.ok() && b.ok());
  const std::string a_id = a->record.id, b_id = b->record.id;
  slow.BlockWritesOf(a_id);
  // A's heartbeat now waits in the store, and a create walks the quota meanwhile.
  std::thread heartbeat([&] { EXPECT_TRUE(m.Heartbeat("acme", a_id, 0).ok()); });
  for (int i = 0; i < 200 && slow.blocked_writers() == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_EQ(slow.blocked_writers(), 1) << "the heartbeat's store write must be hanging";
  std::thread create([&] { EXPECT_TRUE(m.Create("initech", EnvSpec{}, 0).ok()); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // quota walk + reaper ticks
  int64_t worst = 0;
  for (int i = 0; i < 5; ++i) {
    int64_t t0 = MonotonicMs();
    auto got = m.Get("globex", b_id);
    auto ran = m.Exec("globex", b_id, ExecRequest{"true"}, nullptr);
    auto listed = m.List("acme", false);  // even the tenant of the hanging environment
    worst = std::max(worst, MonotonicMs() - t0);
    EXPECT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(ran.ok()) << ran.status();
    ASSERT_TRUE(listed.ok()) << listed.status();
    EXPECT_EQ(listed->size(), 1u);
  }
  EXPECT_EQ(slow.blocked_writers(), 1) << "the store write was still hanging throughout";
  std::cout << "Get+Exec+List of other environments while a store write hangs: worst " << worst
            << " ms\n";
  EXPECT_LT(worst, 100);
  slow.Release();
  heartbeat.join();
  create.join();
  m.Stop();
}

// Issue 11: the core is the one audit path. Every action on an environment writes exactly
// one row, with the caller's tenant and principal and the outcome; reads of state do not.
TEST_F(ManagerTest, EveryManagerOperationWritesExactlyOneAuditRow) {
  std::atomic<int64_t> clock{1000000};
  auto m = Make(0, &clock);
  ASSERT_TRUE(m->Start().ok());
  const Caller who("acme", "key_abc", "rest");
  auto count = [&] { return *store->CountAudit("acme"); };
  auto last = [&]() -> AuditEntry {
    AuditQuery q;
    q.tenant = "acme";
    q.limit = 1;
    auto rows = store->QueryAudit(q);
    return rows.ok() && !rows->empty() ? (*rows)[0] : AuditEntry{};
  };
  int64_t n = count();
  auto expect_one = [&](const std::string& action, int status) {
    EXPECT_EQ(count(), n + 1) << action;
    n = count();
    AuditEntry e = last();
    EXPECT_EQ(e.action, action);
    EXPECT_EQ(e.status, status) << action;
    EXPECT_EQ(e.tenant, "acme");
    EXPECT_EQ(e.principal, "key_abc") << action;
  };
  auto info = m->Create(who, EnvSpec{}, 0);
  ASSERT_TRUE(info.ok());
  const std::string id = info->record.id;
  expect_one("environment.create", 200);
  ASSERT_TRUE(m->Exec(who, id, ExecRequest{"true"}, nullptr).ok());
  expect_one("execute", 200);
  ASSERT_TRUE(m->WriteFile(who, id, "a.txt", "x", 0, true).ok());
  expect_one("files.write", 200);
  EXPECT_FALSE(m->ReadFile(who, id, "a.txt", 0, 10).ok());  // the fake has no files
  expect_one("files.read", 404);
  ASSERT_TRUE(m->ListDir(who, id, ".").ok());
  expect_one("files.list", 200);
  {
    auto t = m->OpenTransfer(who, id, "big.bin", "files.upload");
    ASSERT_TRUE(t.ok());
    for (int i = 0; i < 5; ++i) ASSERT_TRUE((*t)->Write("chunk", i * 5, i == 0).ok());
    EXPECT_EQ(count(), n) << "written when the transfer ends";
  }
  expect_one("files.upload", 200);
  EXPECT_EQ(last().bytes, 25);
  EXPECT_TRUE(IsMissingCapability(m->RunCode(who, id, RunRequest{}, nullptr).status()));
  expect_one("run", 400);
  EXPECT_TRUE(IsMissingCapability(
      m->RunOneShot(who, DriverKind::kContainer, RunRequest{}, nullptr).status()));
  expect_one("run", 400);
  // Reads of state and heartbeats are not environment actions.
  ASSERT_TRUE(m->Get(who, id).ok());
  ASSERT_TRUE(m->List(who, false).ok());
  ASSERT_TRUE(m->Heartbeat(who, id, 0).ok());
  ASSERT_TRUE(m->Stats(who, id).ok());
  EXPECT_EQ(count(), n);
  // Steps of a composite operation (Caller::Step) are audited by that operation, not here.
  ASSERT_TRUE(m->Exec(who.Step(), id, ExecRequest{"true"}, nullptr).ok());
  EXPECT_EQ(count(), n);
  // Nothing happens to an environment that is not there for this tenant: no row.
  EXPECT_FALSE(m->Exec(who, "env_nope", ExecRequest{"true"}, nullptr).ok());
  EXPECT_FALSE(m->Exec(Caller("evil"), id, ExecRequest{"true"}, nullptr).ok());
  EXPECT_EQ(count(), n);
  EXPECT_EQ(*store->CountAudit("evil"), 0);
  ASSERT_TRUE(m->Destroy(who, id).ok());
  expect_one("environment.delete", 200);
  // Expiry is the daemon's own action, recorded for the environment's tenant.
  auto doomed = m->Create(who, EnvSpec{}, 10);
  ASSERT_TRUE(doomed.ok());
  expect_one("environment.create", 200);
  clock += 11000;
  for (int i = 0; i < 200 && count() == n; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(count(), n + 1);
  AuditEntry expired = last();
  EXPECT_EQ(expired.action, "environment.expire");
  EXPECT_EQ(expired.principal, "system");
  EXPECT_EQ(expired.environment_id, doomed->record.id);
  m->Stop();
}

// Issue 11: a driver that lacks a capability is refused by the core with a 4xx naming it
// (Unimplemented → 400), before the driver is called; never a 500 or a silent no-op.
TEST_F(ManagerTest, MissingCapabilityIsRefusedNamingIt) {
  driver.capabilities = CapabilitySet{Capability::kFiles};  // no shell, like nano
  auto m = Make(0, nullptr);
  ASSERT_TRUE(m->Start().ok());
  auto info = m->Create("acme", EnvSpec{}, 0);
  ASSERT_TRUE(info.ok());
  auto r = m->Exec("acme", info->record.id, ExecRequest{"echo hi"}, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_TRUE(IsMissingCapability(r.status()));
  EXPECT_NE(r.status().message().find("'exec'"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("'container'"), std::string::npos) << r.status();
  driver.capabilities = CapabilitySet{};
  auto w = m->WriteFile("acme", info->record.id, "f", "x", 0, true);
  EXPECT_TRUE(IsMissingCapability(w)) << w;
  EXPECT_NE(w.message().find("'files'"), std::string::npos) << w;
  // The Driver defaults answer the same refusal for everything a driver does not implement.
  InstanceRef ref{info->record.id, "container", "{}"};
  EXPECT_TRUE(IsMissingCapability(driver.Fork(ref, "x").status()));
  EXPECT_TRUE(IsMissingCapability(driver.Snapshot(ref, SnapshotContent::kMemory).status()));
  EXPECT_TRUE(IsMissingCapability(driver.Restore(SnapshotRef{}, "x").status()));
  EXPECT_TRUE(IsMissingCapability(driver.Pause(ref)));
  EXPECT_TRUE(IsMissingCapability(driver.Resume(ref)));
  EXPECT_TRUE(IsMissingCapability(driver.RunCode(&ref, RunRequest{}, nullptr).status()));
  EXPECT_NE(driver.Pause(ref).message().find("'pause'"), std::string::npos);
  m->Stop();
}

// ---- Egress governance (issue 12) ----

// Records what the core hands to the proxy.
class FakeEgress : public EgressControl {
 public:
  absl::Status Attach(const EgressAttachment& a) override {
    std::lock_guard<std::mutex> lock(mu);
    if (!attach_status.ok()) return attach_status;
    attached[a.env_id] = a;
    ++attaches;
    return absl::OkStatus();
  }
  absl::Status Update(const std::string& id, const governance::EgressPolicy& policy,
                      const std::vector<governance::ActiveIntent>& intents) override {
    std::lock_guard<std::mutex> lock(mu);
    ++updates;
    attached[id].policy = policy;
    attached[id].intents = intents;
    return update_status;
  }
  void Detach(const std::string& id) override {
    std::lock_guard<std::mutex> lock(mu);
    detached.push_back(id);
    attached.erase(id);
  }
  EgressHealth Health() const override { return EgressHealth{}; }
  std::vector<std::string> IntentNames(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu);
    std::vector<std::string> out;
    for (const auto& i : attached[id].intents) out.push_back(i.name);
    return out;
  }
  std::mutex mu;
  std::map<std::string, EgressAttachment> attached;
  std::vector<std::string> detached;
  int attaches = 0, updates = 0;
  absl::Status attach_status, update_status;
};

governance::EgressPolicy Policy(std::string_view json) {
  auto p = governance::ParseEgressPolicy(boost::json::parse(json));
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *p : governance::EgressPolicy{};
}

class EgressManagerTest : public ManagerTest {
 protected:
  std::unique_ptr<EnvironmentManager> MakeGoverned(std::atomic<int64_t>* clock,
                                                   bool with_proxy = true) {
    ManagerOptions opts;
    opts.pool_size = 0;
    opts.reaper_interval_ms = 20;
    opts.health_interval_ms = 50;
    opts.default_ttl_s = 3600;
    if (clock) opts.now_ms = [clock] { return clock->load(); };
    if (with_proxy) opts.egress = &egress;
    opts.make_ca = [this]() -> absl::StatusOr<EgressCaPem> {
      ++cas;
      return EgressCaPem{absl::StrCat("CERT-", cas), absl::StrCat("KEY-", cas)};
    };
    auto catalogue = governance::ParseIntentCatalogue(boost::json::parse(
        R"({"check-weather": {"allow": ["*.weather.test"], "max_ttl_seconds": 600},
            "pip": {"allow": ["pypi.test"]}})"));
    EXPECT_TRUE(catalogue.ok());
    opts.egress_config.intents = *catalogue;
    return std::make_unique<EnvironmentManager>(
        store.get(), std::map<std::string, Driver*>{{"container", &driver}}, &metrics, opts);
  }
  void SetUp() override {
    ManagerTest::SetUp();
    driver.capabilities.Add(Capability::kEgress);
  }
  FakeEgress egress;
  int cas = 0;
};

TEST_F(EgressManagerTest, GovernedCreateMakesACaBuildsTheNetnsAndAttaches) {
  auto m = MakeGoverned(nullptr);
  ASSERT_TRUE(m->Start().ok());
  governance::EgressPolicy policy = Policy(R"({"allow": ["pypi.test"]})");
  auto info = m->Create("acme", EnvSpec{}, 0, &policy);
  ASSERT_TRUE(info.ok()) << info.status();
  const std::string id = info->record.id;
  ASSERT_TRUE(info->egress.has_value());
  EXPECT_TRUE(*info->egress == policy);
  EXPECT_EQ(driver.networks[id].kind, NetworkPolicy::Kind::kGoverned);
  EXPECT_EQ(driver.networks[id].ca_cert_pem, "CERT-1") << "the driver gets the CA cert";
  ASSERT_EQ(egress.attached.count(id), 1u);
  EXPECT_EQ(egress.attached[id].tenant, "acme");
  EXPECT_EQ(egress.attached[id].ca_key_pem, "KEY-1");
  EXPECT_TRUE(egress.attached[id].policy == policy);
  EXPECT_EQ(*m->CaCertificate("acme", id), "CERT-1");
  auto stored = store->GetEgress(id);
  ASSERT_TRUE(stored.ok());
  EXPECT_EQ(stored->ca_key_pem, "KEY-1");
  auto got = m->Get("acme", id);
  ASSERT_TRUE(got.ok());
  ASSERT_TRUE(got->egress.has_value());
  EXPECT_EQ(got->spec.network.kind, NetworkPolicy::Kind::kGoverned);
  // A "none" environment is untouched: no CA, no netns, no proxy.
  auto plain = m->Create("acme", EnvSpec{}, 0);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(driver.networks[plain->record.id].kind, NetworkPolicy::Kind::kNone);
  EXPECT_FALSE(plain->egress.has_value());
  EXPECT_EQ(m->CaCertificate("acme", plain->record.id).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(egress.attached.count(plain->record.id), 0u);
  EXPECT_EQ(cas, 1);
  // Destroy: detached from the proxy, the CA key gone from the store.
  ASSERT_TRUE(m->Destroy("acme", id).ok());
  EXPECT_EQ(egress.detached, std::vector<std::string>{id});
  EXPECT_EQ(store->GetEgress(id).status().code(), absl::StatusCode::kNotFound);
  m->Stop();
}

TEST_F(EgressManagerTest, RuntimeWithoutEgressOrDaemonWithoutProxyIsRefused) {
  governance::EgressPolicy policy = Policy(R"({"allow": ["pypi.test"]})");
  {
    auto m = MakeGoverned(nullptr, /*with_proxy=*/false);
    ASSERT_TRUE(m->Start().ok());
    auto r = m->Create("acme", EnvSpec{}, 0, &policy);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
    EXPECT_NE(r.status().message().find("no egress proxy"), std::string::npos);
    m->Stop();
  }
  driver.capabilities = CapabilitySet{Capability::kExec};  // like nano and gVisor today
  auto m = MakeGoverned(nullptr);
  ASSERT_TRUE(m->Start().ok());
  auto r = m->Create("acme", EnvSpec{}, 0, &policy);
  EXPECT_TRUE(IsMissingCapability(r.status())) << r.status();
  EXPECT_NE(r.status().message().find("'egress'"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("runtime 'container'"), std::string::npos) << r.status();
  EXPECT_EQ(driver.creates, 0);
  EXPECT_EQ(cas, 0);
  m->Stop();
}

TEST_F(EgressManagerTest, AFailedAttachDestroysTheEnvironment) {
  auto m = MakeGoverned(nullptr);
  ASSERT_TRUE(m->Start().ok());
  egress.attach_status = absl::UnavailableError("proxy down");
  governance::EgressPolicy policy;
  auto r = m->Create("acme", EnvSpec{}, 0, &policy);
  ASSERT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_NE(r.status().message().find("proxy down"), std::string::npos);
  ASSERT_EQ(driver.destroyed.size(), 1u);
  EXPECT_TRUE(driver.alive.empty());
  EXPECT_EQ(store->GetEgress(driver.destroyed[0]).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(m->List("acme", false)->empty());
  m->Stop();
}

TEST_F(EgressManagerTest, NetworkIsReplacedLiveButItsKindIsFixedAtCreate) {
  auto m = MakeGoverned(nullptr);
  ASSERT_TRUE(m->Start().ok());
  governance::EgressPolicy policy = Policy(R"({"allow": ["pypi.test"]})");
  auto gov = m->Create("acme", EnvSpec{}, 0, &policy);
  auto plain = m->Create("acme", EnvSpec{}, 0);
  ASSERT_TRUE(gov.ok() && plain.ok());
  const std::string id = gov->record.id;
  governance::EgressPolicy blocked = Policy(R"({"mode": "blocked"})");
  auto set = m->SetNetwork("acme", id, &blocked);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_TRUE(set->policy == blocked);
  EXPECT_TRUE(egress.attached[id].policy == blocked) << "pushed to the proxy";
  EXPECT_TRUE(m->GetNetwork("acme", id)->policy == blocked);
  EXPECT_NE(store->GetEgress(id)->policy_json.find("blocked"), std::string::npos) << "stored";
  auto to_none = m->SetNetwork("acme", id, nullptr);
  EXPECT_EQ(to_none.status().code(), absl::StatusCode::kAborted);
  EXPECT_NE(to_none.status().message().find("\"mode\": \"blocked\""), std::string::npos);
  auto to_policy = m->SetNetwork("acme", plain->record.id, &policy);
  EXPECT_EQ(to_policy.status().code(), absl::StatusCode::kAborted) << to_policy.status();
  EXPECT_TRUE(m->SetNetwork("acme", plain->record.id, nullptr).ok()) << "none stays none";
  EXPECT_FALSE(m->GetNetwork("acme", plain->record.id)->governed);
  // The proxy refusing the change: 503, but the change is stored (a re-attach sends it).
  egress.update_status = absl::UnavailableError("proxy restarting");
  auto failed = m->SetNetwork("acme", id, &policy);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(store->GetEgress(id)->policy_json.find("pypi.test"), std::string::npos);
  m->Stop();
}

TEST_F(EgressManagerTest, IntentsActivateExtendExpireAndDeactivate) {
  std::atomic<int64_t> clock{1'000'000};
  auto m = MakeGoverned(&clock);
  ASSERT_TRUE(m->Start().ok());
  governance::EgressPolicy policy = Policy(R"({"allow": ["pypi.test"]})");
  auto gov = m->Create("acme", EnvSpec{}, 0, &policy);
  ASSERT_TRUE(gov.ok());
  const std::string id = gov->record.id;
  auto unknown = m->ActivateIntent("acme", id, "nope", 60);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("check-weather, pip"), std::string::npos)
      << unknown.status();
  auto too_long = m->ActivateIntent("acme", id, "check-weather", 601);
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_long.status().message().find("1..600"), std::string::npos);
  auto on = m->ActivateIntent("acme", id, "check-weather", 100);
  ASSERT_TRUE(on.ok()) << on.status();
  ASSERT_EQ(on->intents.size(), 1u);
  EXPECT_EQ(on->intents[0].intent.expires_ms, 1'100'000);
  EXPECT_EQ(on->intents[0].scope, "environment");
  ASSERT_EQ(egress.attached[id].intents.size(), 1u);
  // What the proxy decides with what it was given: allowed until the exact expiry instant.
  auto decide = [&](int64_t now) {
    return governance::Decide(egress.attached[id].policy, egress.attached[id].intents, now,
                              "api.weather.test", 443);
  };
  EXPECT_EQ(decide(1'099'999).rule, "intent:check-weather");
  EXPECT_EQ(decide(1'100'000).rule, "not_allowed");
  // Several at once; re-activation extends, never shortens.
  ASSERT_TRUE(m->ActivateIntent("acme", id, "pip", 30).ok());
  ASSERT_TRUE(m->ActivateIntent("acme", id, "check-weather", 10).ok());
  EXPECT_EQ(m->GetNetwork("acme", id)->intents[0].intent.expires_ms, 1'100'000);
  ASSERT_TRUE(m->ActivateIntent("acme", id, "check-weather", 200).ok());
  EXPECT_EQ(m->GetNetwork("acme", id)->intents[0].intent.expires_ms, 1'200'000);
  EXPECT_EQ(egress.IntentNames(id), (std::vector<std::string>{"check-weather", "pip"}));
  // Expiry: pip (30 s) is gone from the listing after its TTL.
  clock += 30'000;
  auto later = m->GetNetwork("acme", id);
  ASSERT_EQ(later->intents.size(), 1u);
  EXPECT_EQ(later->intents[0].intent.name, "check-weather");
  // Explicit deactivation.
  auto off = m->DeactivateIntent("acme", id, "check-weather");
  ASSERT_TRUE(off.ok());
  EXPECT_TRUE(off->intents.empty());
  EXPECT_TRUE(egress.IntentNames(id).empty());
  EXPECT_EQ(m->DeactivateIntent("acme", id, "check-weather").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(store->GetEgress(id)->intents_json, "[]");
  // No TTL given (0): the default, 300 s.
  auto dflt = m->ActivateIntent("acme", id, "pip", 0);
  ASSERT_TRUE(dflt.ok()) << dflt.status();
  EXPECT_EQ(dflt->intents[0].intent.expires_ms, clock.load() + 300'000);
  // Intents on a "none" environment: a conflict.
  auto plain = m->Create("acme", EnvSpec{}, 0);
  EXPECT_EQ(m->ActivateIntent("acme", plain->record.id, "pip", 10).status().code(),
            absl::StatusCode::kAborted);
  m->Stop();
}

TEST_F(EgressManagerTest, ActiveIntentsAreCapped) {
  std::string catalogue = "{";
  for (size_t i = 0; i <= governance::kMaxActiveIntents; ++i)
    catalogue += absl::StrCat(i ? "," : "", "\"i", i, "\": {\"allow\": [\"a.test\"]}");
  catalogue += "}";
  auto m = MakeGoverned(nullptr);
  // Replace the catalogue with a larger one (options are copied at construction: rebuild).
  ManagerOptions opts = m->options();
  opts.egress_config.intents = *governance::ParseIntentCatalogue(boost::json::parse(catalogue));
  m = std::make_unique<EnvironmentManager>(
      store.get(), std::map<std::string, Driver*>{{"container", &driver}}, &metrics, opts);
  ASSERT_TRUE(m->Start().ok());
  governance::EgressPolicy policy;
  auto gov = m->Create("acme", EnvSpec{}, 0, &policy);
  ASSERT_TRUE(gov.ok());
  for (size_t i = 0; i < governance::kMaxActiveIntents; ++i)
    ASSERT_TRUE(m->ActivateIntent("acme", gov->record.id, absl::StrCat("i", i), 60).ok());
  auto over = m->ActivateIntent("acme", gov->record.id,
                                absl::StrCat("i", governance::kMaxActiveIntents), 60);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  m->Stop();
}

TEST_F(EgressManagerTest, CallIntentIsActiveOnlyDuringTheCallEvenWhenItFails) {
  auto m = MakeGoverned(nullptr);
  ASSERT_TRUE(m->Start().ok());
  governance::EgressPolicy policy;
  auto gov = m->Create("acme", EnvSpec{}, 0, &policy);
  ASSERT_TRUE(gov.ok());
  const std::string id = gov->record.id;
  std::vector<std::string> during;
  driver.on_exec = [&] { during = egress.IntentNames(id); };
  ASSERT_TRUE(
      m->Exec("acme", id, ExecRequest{"curl https://api.weather.test"}, nullptr, "check-weather")
          .ok());
  EXPECT_EQ(during, std::vector<std::string>{"check-weather"});
  EXPECT_TRUE(egress.IntentNames(id).empty()) << "removed after the call";
  EXPECT_TRUE(m->GetNetwork("acme", id)->intents.empty());
  driver.fail_exec = true;
  during.clear();
  EXPECT_FALSE(m->Exec("acme", id, ExecRequest{"x"}, nullptr, "check-weather").ok());
  EXPECT_EQ(during, std::vector<std::string>{"check-weather"});
  EXPECT_TRUE(egress.IntentNames(id).empty()) << "removed after a failed call too";
  driver.fail_exec = false;
  // An environment-scoped activation of the same intent outlives the call.
  ASSERT_TRUE(m->ActivateIntent("acme", id, "check-weather", 60).ok());
  ASSERT_TRUE(m->Exec("acme", id, ExecRequest{"x"}, nullptr, "check-weather").ok());
  EXPECT_EQ(during, (std::vector<std::string>{"check-weather", "check-weather"}));
  EXPECT_EQ(egress.IntentNames(id), std::vector<std::string>{"check-weather"});
  // Unknown intent, or on a "none" environment: refused before the command runs.
  during.clear();
  auto unknown = m->Exec("acme", id, ExecRequest{"x"}, nullptr, "nope");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  auto plain = m->Create("acme", EnvSpec{}, 0);
  auto none = m->Exec("acme", plain->record.id, ExecRequest{"x"}, nullptr, "pip");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(during.empty()) << "the command never ran";
  m->Stop();
}

TEST_F(EgressManagerTest, PolicyIntentsAndCaSurviveARestart) {
  std::atomic<int64_t> clock{NowUnixMs()};
  std::string id;
  {
    auto m = MakeGoverned(&clock);
    ASSERT_TRUE(m->Start().ok());
    governance::EgressPolicy policy = Policy(R"({"allow": ["pypi.test"]})");
    auto gov = m->Create("acme", EnvSpec{}, 0, &policy);
    ASSERT_TRUE(gov.ok());
    id = gov->record.id;
    governance::EgressPolicy open = Policy(R"({"mode": "open", "deny": ["*.evil.test"]})");
    ASSERT_TRUE(m->SetNetwork("acme", id, &open).ok());
    ASSERT_TRUE(m->ActivateIntent("acme", id, "check-weather", 600).ok());
    ASSERT_TRUE(m->ActivateIntent("acme", id, "pip", 10).ok());
    m->Stop();
  }
  egress.attached.clear();
  clock += 20'000;  // pip has expired meanwhile
  auto m = MakeGoverned(&clock);
  ASSERT_TRUE(m->Start().ok());
  ASSERT_EQ(egress.attached.count(id), 1u) << "re-attached at start";
  const EgressAttachment& a = egress.attached[id];
  EXPECT_EQ(a.policy.mode, governance::EgressMode::kOpen);
  EXPECT_EQ(a.ca_cert_pem, "CERT-1");
  EXPECT_EQ(a.ca_key_pem, "KEY-1");
  ASSERT_EQ(a.intents.size(), 1u);
  EXPECT_EQ(a.intents[0].name, "check-weather");
  EXPECT_EQ(*m->CaCertificate("acme", id), "CERT-1");
  auto net = m->GetNetwork("acme", id);
  ASSERT_TRUE(net.ok());
  EXPECT_EQ(net->policy.deny.size(), 1u);
  EXPECT_EQ(cas, 1) << "no new CA";
  m->Stop();
}

TEST_F(EgressManagerTest, AnotherTenantsEnvironmentIsNotFoundOnEveryNetworkRoute) {
  auto m = MakeGoverned(nullptr);
  ASSERT_TRUE(m->Start().ok());
  governance::EgressPolicy policy;
  auto gov = m->Create("acme", EnvSpec{}, 0, &policy);
  ASSERT_TRUE(gov.ok());
  const std::string id = gov->record.id;
  governance::EgressPolicy open = Policy(R"({"mode": "open"})");
  EXPECT_TRUE(IsEnvironmentNotFound(m->GetNetwork("evil", id).status()));
  EXPECT_TRUE(IsEnvironmentNotFound(m->SetNetwork("evil", id, &open).status()));
  EXPECT_TRUE(IsEnvironmentNotFound(m->ActivateIntent("evil", id, "pip", 10).status()));
  EXPECT_TRUE(IsEnvironmentNotFound(m->DeactivateIntent("evil", id, "pip").status()));
  EXPECT_TRUE(IsEnvironmentNotFound(m->CaCertificate("evil", id).status()));
  EXPECT_TRUE(
      IsEnvironmentNotFound(m->Exec("evil", id, ExecRequest{"x"}, nullptr, "pip").status()));
  EXPECT_EQ(egress.attached[id].policy.mode, governance::EgressMode::kAllowlist) << "unchanged";
  EXPECT_EQ(*store->CountAudit("evil"), 0);
  m->Stop();
}

// The host-side wheel cache's view of a governed environment (packages): its CA, a connector
// through the driver, and a check that decides on the policy and intents of that instant and
// writes an egress row for a refusal.
TEST_F(EgressManagerTest, HostFetchEgressDecidesOnTheCurrentPolicyAndAuditsARefusal) {
  std::atomic<int64_t> clock{1'000'000};
  auto m = MakeGoverned(&clock);
  ASSERT_TRUE(m->Start().ok());
  governance::EgressPolicy policy = Policy(R"({"allow": ["pypi.test"]})");
  auto gov = m->Create("acme", EnvSpec{}, 0, &policy);
  ASSERT_TRUE(gov.ok());
  const std::string id = gov->record.id;
  auto hf = m->HostFetchEgressFor("acme", id);
  ASSERT_TRUE(hf.ok()) << hf.status();
  ASSERT_TRUE(hf->has_value());
  const auto& route = **hf;
  EXPECT_EQ(route.ca_cert_pem, "CERT-1");
  // The connector asks the environment's driver (this fake one has no egress socket to give).
  EXPECT_FALSE(route.connect(std::chrono::milliseconds(100)).ok());
  EXPECT_TRUE(route.check("https", "pypi.test", 443, "/simple/foo/").ok());
  absl::Status refused = route.check("https", "api.weather.test", 443, "/x");
  EXPECT_TRUE(absl::IsPermissionDenied(refused)) << refused;
  EXPECT_NE(refused.message().find("rule 'not_allowed'"), std::string::npos) << refused;
  // Intents count while active, from the instant they are activated.
  ASSERT_TRUE(m->ActivateIntent("acme", id, "check-weather", 60).ok());
  EXPECT_TRUE(route.check("https", "api.weather.test", 443, "/x").ok());
  // A policy change applies to the next check.
  governance::EgressPolicy deny = Policy(R"({"allow": ["pypi.test"], "deny": ["pypi.test"]})");
  ASSERT_TRUE(m->SetNetwork("acme", id, &deny).ok());
  refused = route.check("https", "pypi.test", 443, "/files/foo-1.0-py3-none-any.whl");
  EXPECT_TRUE(absl::IsPermissionDenied(refused)) << refused;
  EXPECT_NE(refused.message().find("deny:pypi.test"), std::string::npos) << refused;
  // Each refusal is one egress row of the environment, decision blocked, with the rule.
  ASSERT_TRUE(store->Flush().ok());
  AuditQuery q;
  q.tenant = "acme";
  q.kind = "egress";
  q.limit = 100;
  auto rows = store->QueryAudit(q);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 2u);
  const AuditEntry& last = (*rows)[0];
  ASSERT_TRUE(last.egress.has_value());
  EXPECT_EQ(last.environment_id, id);
  EXPECT_EQ(last.egress->decision, "blocked");
  EXPECT_EQ(last.egress->host, "pypi.test");
  EXPECT_EQ(last.egress->path, "/files/foo-1.0-py3-none-any.whl");
  EXPECT_EQ(last.egress->rule_ids, std::vector<std::string>{"deny:pypi.test"});
  EXPECT_EQ(last.egress->intents, std::vector<std::string>{"check-weather"});
  // Not governed: nothing (esbd fetches directly); another tenant's: not found.
  auto plain = m->Create("acme", EnvSpec{}, 0);
  ASSERT_TRUE(plain.ok());
  auto none = m->HostFetchEgressFor("acme", plain->record.id);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  EXPECT_EQ(m->HostFetchEgressFor("other", id).status().code(), absl::StatusCode::kNotFound);
  m->Stop();
}

TEST_F(EgressManagerTest, EveryNetworkChangeIsOneAuditRow) {
  auto m = MakeGoverned(nullptr);
  ASSERT_TRUE(m->Start().ok());
  const Caller who("acme", "key_abc", "rest");
  governance::EgressPolicy policy;
  auto gov = m->Create(who, EnvSpec{}, 0, &policy);
  ASSERT_TRUE(gov.ok());
  const std::string id = gov->record.id;
  auto actions = [&]() {
    AuditQuery q;
    q.tenant = "acme";
    q.limit = 100;
    std::vector<std::string> out;
    auto rows = store->QueryAudit(q);
    EXPECT_TRUE(rows.ok()) << rows.status();
    if (rows.ok())
      for (const AuditEntry& e : *rows) out.insert(out.begin(), e.action);
    return out;
  };
  ASSERT_TRUE(m->SetNetwork(who, id, &policy).ok());
  ASSERT_TRUE(m->ActivateIntent(who, id, "pip", 10).ok());
  ASSERT_TRUE(m->DeactivateIntent(who, id, "pip").ok());
  ASSERT_TRUE(m->Exec(who, id, ExecRequest{"x"}, nullptr, "pip").ok());
  ASSERT_TRUE(m->GetNetwork(who, id).ok());  // a read: no row
  EXPECT_EQ(actions(), (std::vector<std::string>{
                           "environment.create", "network.update", "network.intent.activate",
                           "network.intent.deactivate", "execute", "network.intent.call"}));
  EXPECT_FALSE(m->ActivateIntent(who, id, "nope", 10).ok());
  EXPECT_EQ(actions().back(), "network.intent.activate") << "a refusal is recorded too";
  // A registered DLP secret reaches the proxy and the store, never the audit log.
  governance::EgressPolicy secret =
      Policy(R"({"dlp": {"secrets": [{"name": "TOKEN", "value": "s3cr3t-value-123"}]}})");
  ASSERT_TRUE(m->SetNetwork(who, id, &secret).ok());
  AuditQuery q;
  q.tenant = "acme";
  q.limit = 1;
  auto row = store->QueryAudit(q);
  ASSERT_TRUE(row.ok() && !row->empty());
  EXPECT_EQ((*row)[0].action, "network.update");
  EXPECT_EQ((*row)[0].detail.find("s3cr3t"), std::string::npos) << (*row)[0].detail;
  EXPECT_NE(store->GetEgress(id)->policy_json.find("s3cr3t-value-123"), std::string::npos);
  EXPECT_NE(boost::json::serialize(governance::ToJson(egress.attached[id].policy)).find("s3cr3t"),
            std::string::npos);
  m->Stop();
}

}  // namespace
}  // namespace esb

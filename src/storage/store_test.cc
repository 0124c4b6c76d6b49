#include "storage/store.h"

#include <fcntl.h>
#include <sqlite3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/util.h"
#include "gtest/gtest.h"
#include "storage/sqlite_store.h"
#include "storage/store_test_util.h"

namespace esb {
namespace {

using store_test::RawExec;
using store_test::RawQuery;
using store_test::TempDir;

std::unique_ptr<Store> OpenOrDie(const std::string& path) {
  absl::StatusOr<std::unique_ptr<Store>> store = Store::Open(path);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? std::move(*store) : nullptr;
}

EnvironmentRecord MakeEnv(const std::string& id, const std::string& tenant,
                          const std::string& state, int64_t created_ms) {
  EnvironmentRecord r;
  r.id = id;
  r.tenant = tenant;
  r.state = ParseEnvState(state).value();
  r.runtime = "container";
  r.image = "default";
  r.spec_json = R"({"memory_mb":512})";
  r.driver_state = "bundle=/run/esb/" + id;
  r.created_ms = created_ms;
  r.last_used_ms = created_ms + 1;
  r.expires_ms = created_ms + 900000;
  r.exec_count = 3;
  return r;
}

AuditEntry MakeAudit(const std::string& tenant, const std::string& env, int64_t time_ms,
                     const std::string& action, const std::string& detail) {
  AuditEntry e;
  e.tenant = tenant;
  e.environment_id = env;
  e.time_ms = time_ms;
  e.action = action;
  e.detail = detail;
  e.duration_ms = 7;
  e.bytes = 42;
  e.status = 200;
  return e;
}

AuditQuery Q(const std::string& tenant, int limit, const std::string& keyword = "") {
  AuditQuery q;
  q.tenant = tenant;
  q.limit = limit;
  q.keyword = keyword;
  return q;
}

std::vector<int64_t> Times(const std::vector<AuditEntry>& entries) {
  std::vector<int64_t> out;
  for (const auto& e : entries) out.push_back(e.time_ms);
  return out;
}

TEST(StoreTest, EnvironmentRoundTripAndUpsert) {
  auto store = OpenOrDie(":memory:");
  ASSERT_NE(store, nullptr);
  EnvironmentRecord env = MakeEnv("env_1", "acme", "running", 1000);
  ASSERT_TRUE(store->PutEnvironment(env).ok());

  absl::StatusOr<EnvironmentRecord> got = store->GetEnvironment("env_1");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->tenant, "acme");
  EXPECT_EQ(got->state, EnvState::kRunning);
  EXPECT_EQ(got->spec_json, R"({"memory_mb":512})");
  EXPECT_EQ(got->driver_state, "bundle=/run/esb/env_1");
  EXPECT_EQ(got->expires_ms, 901000);
  EXPECT_EQ(got->exec_count, 3);

  env.state = EnvState::kDestroyed;
  env.destroyed_ms = 5000;
  env.destroy_reason = "ttl_expired";
  ASSERT_TRUE(store->PutEnvironment(env).ok());
  got = store->GetEnvironment("env_1");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->state, EnvState::kDestroyed);
  EXPECT_EQ(got->destroyed_ms, 5000);
  EXPECT_EQ(got->destroy_reason, "ttl_expired");

  EXPECT_EQ(store->GetEnvironment("env_missing").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store->PutEnvironment(EnvironmentRecord{}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(StoreTest, VolumesAreNamedPerTenant) {
  auto store = OpenOrDie(":memory:");
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->InsertVolume({"acme", "data", 64, 1}).ok());
  ASSERT_TRUE(store->InsertVolume({"evil", "data", 32, 2}).ok()) << "same name, other tenant";
  EXPECT_EQ(store->InsertVolume({"acme", "data", 16, 3}).code(), absl::StatusCode::kAlreadyExists);
  auto acme = store->ListVolumes("acme");
  ASSERT_TRUE(acme.ok());
  ASSERT_EQ(acme->size(), 1u);
  EXPECT_EQ((*acme)[0].size_mb, 64);
  EXPECT_EQ(store->ListVolumes("")->size(), 2u);
  EXPECT_EQ(store->DeleteVolume("acme", "nope").code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(store->DeleteVolume("acme", "data").ok());
  EXPECT_TRUE(store->ListVolumes("acme")->empty());
  EXPECT_EQ(store->ListVolumes("evil")->size(), 1u) << "the other tenant's volume stays";
}

TEST(StoreTest, EgressStateSurvivesReopenAndIsDeletedWithTheEnvironment) {
  TempDir dir;
  const std::string path = dir.File("state.db");
  {
    auto store = OpenOrDie(path);
    ASSERT_NE(store, nullptr);
    EXPECT_EQ(store->GetEgress("env_1").status().code(), absl::StatusCode::kNotFound);
    EgressRecord rec{"env_1", "acme", R"({"mode":"allowlist"})", R"([{"intent":"x"}])", "CERT",
                     "KEY",   42};
    ASSERT_TRUE(store->PutEgress(rec).ok());
    rec.policy_json = R"({"mode":"open"})";
    ASSERT_TRUE(store->PutEgress(rec).ok()) << "replace";
  }
  auto store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  auto got = store->GetEgress("env_1");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->tenant, "acme");
  EXPECT_EQ(got->policy_json, R"({"mode":"open"})");
  EXPECT_EQ(got->intents_json, R"([{"intent":"x"}])");
  EXPECT_EQ(got->ca_cert_pem, "CERT");
  EXPECT_EQ(got->ca_key_pem, "KEY");
  EXPECT_EQ(got->updated_ms, 42);
  ASSERT_TRUE(store->DeleteEgress("env_1").ok());
  EXPECT_EQ(store->GetEgress("env_1").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store->DeleteEgress("env_1").ok()) << "idempotent";
}

TEST(StoreTest, ListEnvironmentsIsTenantScoped) {
  auto store = OpenOrDie(":memory:");
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->PutEnvironment(MakeEnv("env_a1", "a", "running", 1)).ok());
  ASSERT_TRUE(store->PutEnvironment(MakeEnv("env_a2", "a", "destroyed", 2)).ok());
  ASSERT_TRUE(store->PutEnvironment(MakeEnv("env_b1", "b", "creating", 3)).ok());

  auto a = store->ListEnvironments("a", false);
  ASSERT_TRUE(a.ok());
  ASSERT_EQ(a->size(), 1u);
  EXPECT_EQ((*a)[0].id, "env_a1");

  auto a_all = store->ListEnvironments("a", true);
  ASSERT_TRUE(a_all.ok());
  ASSERT_EQ(a_all->size(), 2u);
  EXPECT_EQ((*a_all)[1].id, "env_a2");

  auto b = store->ListEnvironments("b", true);
  ASSERT_TRUE(b.ok());
  ASSERT_EQ(b->size(), 1u);
  EXPECT_EQ((*b)[0].id, "env_b1");

  auto nobody = store->ListEnvironments("c", true);
  ASSERT_TRUE(nobody.ok());
  EXPECT_TRUE(nobody->empty());

  auto live = store->ListLiveEnvironments();
  ASSERT_TRUE(live.ok());
  ASSERT_EQ(live->size(), 2u);
  EXPECT_EQ((*live)[0].id, "env_a1");
  EXPECT_EQ((*live)[1].id, "env_b1");
}

TEST(StoreTest, CreateApiKeyStoresOnlyHashAndResolvesTenant) {
  TempDir dir;
  const std::string path = dir.File("esb.db");
  auto store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  std::string secret;
  absl::StatusOr<ApiKeyRecord> key = store->CreateApiKey("acme", "ci", &secret);
  ASSERT_TRUE(key.ok()) << key.status();
  EXPECT_TRUE(std::regex_match(secret, std::regex("esb_[0-9a-f]{40}"))) << secret;
  EXPECT_TRUE(std::regex_match(key->key_id, std::regex("key_[0-9a-f]{16}"))) << key->key_id;
  EXPECT_EQ(key->tenant, "acme");
  EXPECT_FALSE(key->revoked);

  absl::StatusOr<ApiKeyRecord> found = store->KeyForSecret(secret);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->tenant, "acme");
  EXPECT_EQ(found->key_id, key->key_id) << "the public id, for the audit's principal";

  // The secret itself is nowhere in the table; its SHA-256 is.
  EXPECT_EQ(RawQuery(path,
                     "SELECT count(*) FROM api_keys WHERE key_id||tenant||name||"
                     "secret_sha256 LIKE '%" +
                         secret.substr(4) + "%'"),
            "0");
  EXPECT_EQ(RawQuery(path, "SELECT secret_sha256 FROM api_keys"), Sha256Hex(secret));
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");

  std::string other;
  ASSERT_TRUE(store->CreateApiKey("acme", "second", &other).ok());
  EXPECT_NE(other, secret);
  EXPECT_EQ(store->KeyForSecret("esb_" + std::string(40, '0')).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(store->KeyForSecret("").status().code(), absl::StatusCode::kNotFound);
}

TEST(StoreTest, RevokedKeyNoLongerResolves) {
  auto store = OpenOrDie(":memory:");
  ASSERT_NE(store, nullptr);
  std::string s1, s2;
  auto k1 = store->CreateApiKey("acme", "one", &s1);
  auto k2 = store->CreateApiKey("globex", "two", &s2);
  ASSERT_TRUE(k1.ok() && k2.ok());
  EXPECT_EQ(*store->CountActiveApiKeys(), 2);

  ASSERT_TRUE(store->RevokeApiKey(k1->key_id).ok());
  EXPECT_EQ(store->KeyForSecret(s1).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store->KeyForSecret(s2)->tenant, "globex");
  EXPECT_EQ(*store->CountActiveApiKeys(), 1);
  EXPECT_TRUE(store->RevokeApiKey(k1->key_id).ok());  // idempotent
  EXPECT_EQ(store->RevokeApiKey("key_nope").code(), absl::StatusCode::kNotFound);

  auto keys = store->ListApiKeys();
  ASSERT_TRUE(keys.ok());
  ASSERT_EQ(keys->size(), 2u);
  for (const auto& k : *keys) EXPECT_EQ(k.revoked, k.key_id == k1->key_id) << k.key_id;
}

TEST(StoreTest, ImportApiKeyIsIdempotentAndNeverResurrects) {
  auto store = OpenOrDie(":memory:");
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->ImportApiKey("acme", "config-secret-1", "from config").ok());
  ASSERT_TRUE(store->ImportApiKey("acme", "config-secret-1", "from config").ok());
  EXPECT_EQ(store->ListApiKeys()->size(), 1u);
  EXPECT_EQ(store->KeyForSecret("config-secret-1")->tenant, "acme");

  // The same secret cannot silently move to another tenant.
  EXPECT_EQ(store->ImportApiKey("globex", "config-secret-1", "x").code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(store->KeyForSecret("config-secret-1")->tenant, "acme");

  // Revoked stays revoked when the config file is read again.
  const std::string key_id = (*store->ListApiKeys())[0].key_id;
  ASSERT_TRUE(store->RevokeApiKey(key_id).ok());
  ASSERT_TRUE(store->ImportApiKey("acme", "config-secret-1", "from config").ok());
  EXPECT_EQ(store->KeyForSecret("config-secret-1").status().code(), absl::StatusCode::kNotFound);

  EXPECT_EQ(store->ImportApiKey("acme", "", "empty").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->ImportApiKey("acme", "has space", "x").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->ImportApiKey("", "abc", "x").code(), absl::StatusCode::kInvalidArgument);
}

class AuditTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = OpenOrDie(":memory:");
    ASSERT_NE(store_, nullptr);
    Add("acme", "env_1", 1000, "environment.create", "image=default runtime=container");
    Add("acme", "env_1", 2000, "execute", "pip install numpy");
    Add("acme", "env_1", 3000, "files.write", "src/main.py");
    Add("acme", "env_2", 4000, "execute", "python3 /workspace/main.py --fast");
    Add("acme", "env_2", 5000, "environment.delete", "deleted");
    Add("globex", "env_9", 2500, "execute", "pip install secret-stuff");
  }
  void Add(const std::string& tenant, const std::string& env, int64_t t, const std::string& action,
           const std::string& detail) {
    ASSERT_TRUE(store_->AppendAudit(MakeAudit(tenant, env, t, action, detail)).ok());
  }
  std::vector<AuditEntry> Query(AuditQuery q) {
    if (q.tenant.empty()) q.tenant = "acme";
    auto r = store_->QueryAudit(q);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : std::vector<AuditEntry>{};
  }
  std::unique_ptr<Store> store_;
};

TEST_F(AuditTest, NewestFirstAndTenantScoped) {
  auto all = Query({});
  EXPECT_EQ(Times(all), (std::vector<int64_t>{5000, 4000, 3000, 2000, 1000}));
  EXPECT_EQ(all[0].action, "environment.delete");
  EXPECT_EQ(all[0].tenant, "acme");
  EXPECT_EQ(all[0].duration_ms, 7);
  EXPECT_EQ(all[0].bytes, 42);
  EXPECT_EQ(all[0].status, 200);
  EXPECT_FALSE(all[0].exit_code.has_value());

  AuditQuery g;
  g.tenant = "globex";
  auto globex = Query(g);
  ASSERT_EQ(globex.size(), 1u);
  EXPECT_EQ(globex[0].detail, "pip install secret-stuff");

  g.tenant = "nobody";
  EXPECT_TRUE(Query(g).empty());

  AuditQuery none;
  EXPECT_EQ(store_->QueryAudit(none).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(AuditTest, FiltersByTimeRangeAndEnvironment) {
  AuditQuery q;
  q.since_ms = 2000;
  q.until_ms = 4000;
  EXPECT_EQ(Times(Query(q)), (std::vector<int64_t>{4000, 3000, 2000}));

  q = {};
  q.since_ms = 3500;
  EXPECT_EQ(Times(Query(q)), (std::vector<int64_t>{5000, 4000}));

  q = {};
  q.until_ms = 1500;
  EXPECT_EQ(Times(Query(q)), (std::vector<int64_t>{1000}));

  q = {};
  q.environment_id = "env_2";
  EXPECT_EQ(Times(Query(q)), (std::vector<int64_t>{5000, 4000}));

  q = {};
  q.environment_id = "env_9";  // another tenant's environment: invisible
  EXPECT_TRUE(Query(q).empty());

  q = {};
  q.since_ms = 5000;
  q.until_ms = 1000;
  q.tenant = "acme";
  EXPECT_EQ(store_->QueryAudit(q).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(AuditTest, LimitIsValidatedAndApplied) {
  AuditQuery q;
  q.tenant = "acme";
  q.limit = 2;
  EXPECT_EQ(Times(Query(q)), (std::vector<int64_t>{5000, 4000}));
  q.limit = 0;
  EXPECT_EQ(store_->QueryAudit(q).status().code(), absl::StatusCode::kInvalidArgument);
  q.limit = 1001;
  EXPECT_EQ(store_->QueryAudit(q).status().code(), absl::StatusCode::kInvalidArgument);
  q.limit = 1000;
  EXPECT_TRUE(store_->QueryAudit(q).ok());
}

TEST_F(AuditTest, KeywordSearchUsesFts) {
  AuditQuery q;
  q.keyword = "pip";
  auto r = Query(q);
  ASSERT_EQ(r.size(), 1u);  // globex's "pip install" is not visible to acme
  EXPECT_EQ(r[0].detail, "pip install numpy");

  q.keyword = "main.py";  // punctuation in a plain word is not FTS syntax
  EXPECT_EQ(Times(Query(q)), (std::vector<int64_t>{4000, 3000}));

  q.keyword = "/workspace/main.py";
  EXPECT_EQ(Times(Query(q)), (std::vector<int64_t>{4000}));

  q.keyword = "--fast";
  EXPECT_EQ(Times(Query(q)), (std::vector<int64_t>{4000}));

  q.keyword = "execute";  // matches the action column too
  EXPECT_EQ(Times(Query(q)), (std::vector<int64_t>{4000, 2000}));

  q.keyword = "num*";  // FTS5 prefix query passes through
  EXPECT_EQ(Times(Query(q)), (std::vector<int64_t>{2000}));

  q.keyword = "numpy OR deleted";
  EXPECT_EQ(Times(Query(q)), (std::vector<int64_t>{5000, 2000}));

  q.keyword = "execute NOT pip";
  EXPECT_EQ(Times(Query(q)), (std::vector<int64_t>{4000}));

  q.keyword = "\"pip install\"";
  EXPECT_EQ(Times(Query(q)), (std::vector<int64_t>{2000}));

  q.keyword = "PIP";  // case-insensitive
  EXPECT_EQ(Times(Query(q)), (std::vector<int64_t>{2000}));

  q.keyword = "nothing-like-this";
  EXPECT_TRUE(Query(q).empty());

  q.keyword = "execute";  // combined with other filters
  q.environment_id = "env_1";
  EXPECT_EQ(Times(Query(q)), (std::vector<int64_t>{2000}));

  q = {};
  q.keyword = "   ";  // blank keyword = no keyword filter
  EXPECT_EQ(Query(q).size(), 5u);
}

TEST_F(AuditTest, MalformedFtsQueryIsInvalidArgument) {
  for (const char* bad : {"\"unbalanced", "AND", "pip AND", "(pip", "NEAR(", "action:", "*",
                          "pip OR OR numpy", "^", "{nosuchcol}:x"}) {
    AuditQuery q;
    q.tenant = "acme";
    q.keyword = bad;
    auto r = store_->QueryAudit(q);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
        << "query " << bad << ": " << r.status();
  }
  // The store is still fine afterwards.
  AuditQuery q;
  q.keyword = "numpy";
  EXPECT_EQ(Query(q).size(), 1u);
  EXPECT_TRUE(store_->AppendAudit(MakeAudit("acme", "env_3", 6000, "execute", "ls")).ok());
}

TEST(StoreTest, MalformedFtsQueryFailsEvenWhenNothingCouldMatch) {
  auto store = OpenOrDie(":memory:");
  ASSERT_NE(store, nullptr);
  AuditQuery q;
  q.tenant = "empty";
  q.keyword = "\"unbalanced";
  EXPECT_EQ(store->QueryAudit(q).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(store->AppendAudit(MakeAudit("other", "e", 1, "execute", "x")).ok());
  EXPECT_EQ(store->QueryAudit(q).status().code(), absl::StatusCode::kInvalidArgument);
  q.keyword = "fine";
  auto r = store->QueryAudit(q);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->empty());
}

TEST_F(AuditTest, ExitCodeAndDefaultTime) {
  AuditEntry e = MakeAudit("acme", "env_3", 0, "execute", "false");
  e.exit_code = 1;
  const int64_t before = NowUnixMs();
  ASSERT_TRUE(store_->AppendAudit(e).ok());
  AuditQuery q;
  q.environment_id = "env_3";
  auto r = Query(q);
  ASSERT_EQ(r.size(), 1u);
  ASSERT_TRUE(r[0].exit_code.has_value());
  EXPECT_EQ(*r[0].exit_code, 1);
  EXPECT_GE(r[0].time_ms, before);
  EXPECT_GT(r[0].id, 0);

  EXPECT_EQ(store_->AppendAudit(MakeAudit("", "e", 1, "execute", "x")).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->AppendAudit(MakeAudit("acme", "e", 1, "", "x")).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(StoreTest, ConcurrentWritersAreSerialised) {
  StoreOptions opts;
  opts.audit_burst = 1000;  // this test is about serialisation, not the rate limit
  auto opened = Store::Open(":memory:", opts);
  ASSERT_TRUE(opened.ok()) << opened.status();
  auto store = std::move(*opened);
  ASSERT_NE(store, nullptr);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 100; ++i) {
        if (!store
                 ->AppendAudit(MakeAudit("acme", "env_" + std::to_string(t), 1 + i, "execute",
                                         "echo " + std::to_string(i)))
                 .ok()) {
          ++failures;
        }
        if (!store->QueryAudit(Q("acme", 5)).ok()) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  auto r = store->QueryAudit(Q("acme", 1000));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->size(), 400u);
}

TEST(StoreFileTest, DurableAcrossReopenInWalMode) {
  TempDir dir;
  const std::string path = dir.File("state.db");
  std::string secret;
  {
    auto store = OpenOrDie(path);
    ASSERT_NE(store, nullptr);
    ASSERT_TRUE(store->PutEnvironment(MakeEnv("env_1", "acme", "running", 10)).ok());
    ASSERT_TRUE(store->CreateApiKey("acme", "ci", &secret).ok());
    ASSERT_TRUE(store->AppendAudit(MakeAudit("acme", "env_1", 20, "execute", "make test")).ok());
    // While open, the WAL file exists next to the database.
    EXPECT_TRUE(std::filesystem::exists(path + "-wal"));
    EXPECT_EQ(RawQuery(path, "PRAGMA journal_mode"), "wal");
  }
  EXPECT_EQ(RawQuery(path, "PRAGMA journal_mode"), "wal");  // WAL is persistent
  EXPECT_EQ(RawQuery(path, "SELECT version FROM schema_version"),
            std::to_string(LatestSchemaVersion()));
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u) << "database must be owner-only";

  auto store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  auto env = store->GetEnvironment("env_1");
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->state, EnvState::kRunning);
  EXPECT_EQ(store->KeyForSecret(secret)->tenant, "acme");
  auto audit = store->QueryAudit(Q("acme", 100, "make"));
  ASSERT_TRUE(audit.ok()) << audit.status();
  ASSERT_EQ(audit->size(), 1u);
  EXPECT_EQ((*audit)[0].detail, "make test");
  // Reopening did not re-run migrations or duplicate anything.
  EXPECT_EQ(store->ListApiKeys()->size(), 1u);
  EXPECT_EQ(store->ListLiveEnvironments()->size(), 1u);
}

TEST(StoreFileTest, TwoConnectionsShareOneFile) {
  TempDir dir;
  const std::string path = dir.File("shared.db");
  auto a = OpenOrDie(path);
  auto b = OpenOrDie(path);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(a->AppendAudit(MakeAudit("acme", "env_1", 1, "execute", "from a")).ok());
  ASSERT_TRUE(b->AppendAudit(MakeAudit("acme", "env_1", 2, "execute", "from b")).ok());
  // Another store sees b's row once b's write-behind wrote it (within write_behind_ms; a
  // store's own reads flush its queue, not another's): write it now.
  ASSERT_TRUE(b->Flush().ok());
  auto r = a->QueryAudit(Q("acme", 100, "from"));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->size(), 2u);
}

TEST(StoreFileTest, RefusesNewerSchema) {
  TempDir dir;
  const std::string path = dir.File("future.db");
  ASSERT_NE(OpenOrDie(path), nullptr);
  RawExec(path, "UPDATE schema_version SET version = 999");
  auto store = Store::Open(path);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(store.status().message().find("999"), std::string::npos) << store.status();
}

TEST(StoreFileTest, ErrorsNameThePathAndTheProblem) {
  TempDir dir;
  auto missing_dir = Store::Open(dir.File("no/such/dir/x.db"));
  ASSERT_FALSE(missing_dir.ok());
  EXPECT_NE(missing_dir.status().message().find("no/such/dir/x.db"), std::string::npos)
      << missing_dir.status();

  const std::string junk = dir.File("junk.db");
  ASSERT_TRUE(WriteStringToFile(junk, std::string(8192, 'x')).ok());
  auto not_db = Store::Open(junk);
  ASSERT_FALSE(not_db.ok());
  EXPECT_NE(not_db.status().message().find("junk.db"), std::string::npos) << not_db.status();
  EXPECT_NE(not_db.status().message().find("sql"), std::string::npos) << not_db.status();

  EXPECT_FALSE(Store::Open("").ok());
}

std::string Fts(std::string_view q) {
  absl::StatusOr<std::string> r = CheckAuditSearch(q);
  return r.ok() ? *r : "ERROR: " + std::string(r.status().message());
}

TEST(FtsQueryTest, RebuildsTheQueryFromItsOwnTokens) {
  EXPECT_EQ(Fts(""), "");
  EXPECT_EQ(Fts("  \t "), "");
  EXPECT_EQ(Fts("pip"), "\"pip\"");
  EXPECT_EQ(Fts("main.py /tmp/x"), "\"main.py\" AND \"/tmp/x\"");
  EXPECT_EQ(Fts("a OR b"), "\"a\" OR \"b\"");
  EXPECT_EQ(Fts("or"), "\"or\"");  // lowercase is a word, not an operator
  EXPECT_EQ(Fts("PIP*"), "pip*");
  EXPECT_EQ(Fts("AND*"), "and*");
  EXPECT_EQ(Fts("\"pip install\" NOT (numpy OR scipy)"),
            "\"pip install\" NOT (\"numpy\" OR \"scipy\")");
  EXPECT_EQ(Fts("\"http://x\""), "\"http://x\"");
  EXPECT_EQ(Fts("\"say \"\"hi\"\"\""), "\"say  hi \"");  // '""' inside a phrase: a quote
  EXPECT_EQ(Fts("\"\""), "ERROR: invalid audit search query '\"\"': '' contains no word to search");
  EXPECT_EQ(Fts("a:b"), "ERROR: invalid audit search query 'a:b': ':' is search syntax that is "
                        "not supported here (only words, \"phrases\", word*, AND, OR, NOT and "
                        "parentheses); put text in double quotes to search for it");
}

// The bypasses of the first cost check (it split on spaces only, but FTS5 also splits at
// ( ) * + : ^ { } , whatever the spaces): each is refused now.
TEST(AuditHardeningTest, CostCapBypassesWithoutSpacesAreRefused) {
  auto store = OpenOrDie(":memory:");
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->AppendAudit(MakeAudit("acme", "e", 1, "execute", "abcdef main.py")).ok());
  std::string letters = "(abc*)";
  for (char c = 'a'; c <= 'z'; ++c) letters += absl::StrCat("OR(", std::string(1, c), "*)");
  std::string implicit_and = "abc*";
  for (char c = 'a'; c <= 'z'; ++c) implicit_and += absl::StrCat(std::string(1, c), "*");
  std::string many_groups;
  for (int i = 0; i < 17; ++i) many_groups += absl::StrCat(i ? "OR" : "", "(w", i, ")");
  std::string five_prefixes = "(abc*)(abd*)(abe*)(abf*)(abg*)";
  std::string deep = std::string(9, '(') + "x" + std::string(9, ')');
  for (const std::string& bad :
       {letters, implicit_and, std::string("NEAR(a* bcd)"), std::string("NEAR(abc bcd)"),
        many_groups, five_prefixes, std::string("ab.c*"), std::string("ab_c*"),
        std::string("\"x.ab\"*"), std::string("é€a*"), std::string("action:abc*"),
        std::string("^abc"), std::string("+abc"), std::string("{detail}:abc"),
        std::string("a,b"), std::string("abc*def*ghi*jkl*mno*"), deep,
        std::string("\"a b c d e f g h i j k l m n o p q\""),
        // Lone UTF-8 continuation bytes: SQLite decodes each as a character of its own (\xaa is
        // a letter to the tokenizer): 18 tokens however the bytes are arranged.
        [] {
          std::string s = "x";
          for (int i = 0; i < 17; ++i) s += "\xaa\xa9";
          return s;
        }()}) {
    auto r = store->QueryAudit(Q("acme", 10, bad));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad << ": " << r.status();
  }
  // A normal query still works, and finds what it should.
  const std::vector<std::string> goods = {"abc*", "main.py", "(abcdef OR nothing) AND execute",
                                          "\"main py\" NOT zzz",
                                          std::string(8, '(') + "abc*" + std::string(8, ')')};
  for (const std::string& good : goods) {
    auto r = store->QueryAudit(Q("acme", 10, good));
    ASSERT_TRUE(r.ok()) << good << ": " << r.status();
    EXPECT_EQ(r->size(), 1u) << good;
  }
}

// Random strings over the characters FTS5 treats specially: never a crash, never an error from
// SQLite's own parser (whatever passes the check is valid FTS5), and every accepted query, as
// SQLite sees it, holds at most the allowed terms and prefixes, each prefix 3+ letters/digits.
TEST(AuditHardeningTest, RandomPunctuationQueriesAreCheckedOrRefusedNeverRunUnchecked) {
  auto store = OpenOrDie(":memory:");
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->AppendAudit(MakeAudit("acme", "e", 1, "execute", "abc abd xyz")).ok());
  static const char kAlphabet[] = "abcxyz ()*\"+-:^{},.ORANDNOTNEAR_\t\\é";
  std::mt19937 rng(12345);
  int accepted = 0, refused = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string q;
    const int len = static_cast<int>(rng() % 40);
    for (int k = 0; k < len; ++k) q.push_back(kAlphabet[rng() % (sizeof(kAlphabet) - 1)]);
    absl::StatusOr<std::string> fts = CheckAuditSearch(q);
    if (!fts.ok()) {
      ASSERT_EQ(fts.status().code(), absl::StatusCode::kInvalidArgument) << q;
      ++refused;
      continue;
    }
    ++accepted;
    // Independent count over the rebuilt query: outside quotes only operators, parentheses
    // and "stem"* prefixes remain.
    int prefixes = 0, phrases = 0;
    bool quoted = false;
    std::string bare;  // a run of letters/digits outside quotes
    for (size_t k = 0; k <= fts->size(); ++k) {
      const char c = k < fts->size() ? (*fts)[k] : ' ';
      if (quoted) {
        if (c == '"') quoted = false;
        continue;
      }
      if (std::isalnum(static_cast<unsigned char>(c))) {
        bare.push_back(c);
        continue;
      }
      if (c == '*') {
        ++prefixes;
        ASSERT_GE(bare.size(), 3u) << q << " -> " << *fts;
      } else {
        ASSERT_TRUE(bare.empty() || bare == "AND" || bare == "OR" || bare == "NOT")
            << "bare '" << bare << "' in " << *fts;
        ASSERT_NE(std::string(" ()\"").find(c), std::string::npos)
            << "character '" << c << "' outside quotes in " << *fts;
        if (c == '"') {
          quoted = true;
          ++phrases;
        }
      }
      bare.clear();
    }
    ASSERT_FALSE(quoted) << *fts;
    ASSERT_LE(prefixes, kMaxAuditPrefixTerms) << *fts;
    ASSERT_LE(phrases, kMaxAuditQueryTerms) << *fts;
    ASSERT_EQ(CheckAuditSearch(*fts).value_or("refused"), *fts)
        << "the rebuilt query re-checks as itself";
    if (i % 20 == 0) {  // and SQLite accepts it (a fraction: each runs a real search)
      auto r = store->QueryAudit(Q("acme", 10, q));
      ASSERT_TRUE(r.ok()) << q << " -> " << *fts << ": " << r.status();
    }
  }
  std::cout << accepted << " random queries accepted, " << refused << " refused\n";
  EXPECT_GT(accepted, 100);
  EXPECT_GT(refused, 100);
}

// ---------------------------------------------------------------------------------------------
// Hardening (issue 9): audit searches scoped and bounded, audit growth bounded.

std::unique_ptr<Store> OpenWith(const std::string& path, StoreOptions opts) {
  absl::StatusOr<std::unique_ptr<Store>> store = Store::Open(path, std::move(opts));
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? std::move(*store) : nullptr;
}

// ~1 KiB of distinct words that all start with a few common prefixes: the worst case for
// prefix searches (each prefix expands to thousands of index terms).
std::string ManyWords(int row) {
  static const char* kStarts[] = {"abc", "abd", "abe", "xyz"};
  std::string out;
  for (int w = 0; out.size() < 1000; ++w) {
    out += kStarts[w % 4];
    out += std::to_string(row * 131 + w * 7919);
    out += ' ';
  }
  return out;
}

int64_t FileBytes(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? st.st_size : 0;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

TEST(AuditHardeningTest, SearchCostCapsRejectTheAttackQuery) {
  auto store = OpenOrDie(":memory:");
  ASSERT_NE(store, nullptr);
  // The attack: every letter as a prefix.
  std::string attack;
  for (char c = 'a'; c <= 'z'; ++c) attack += absl::StrCat(c == 'a' ? "" : " OR ", std::string(1, c), "*");
  auto r = store->QueryAudit(Q("acme", 1000, attack));
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("at least 3 characters"), std::string::npos) << r.status();
  // Too many terms, too many prefixes, too long, and a group that would escape the scope.
  std::string many;
  for (int i = 0; i < 17; ++i) many += absl::StrCat("w", i, " OR ");
  many += "end";
  EXPECT_EQ(store->QueryAudit(Q("acme", 10, many)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->QueryAudit(Q("acme", 10, "abc* OR abd* OR abe* OR abf* OR abg*")).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->QueryAudit(Q("acme", 10, std::string(300, 'x'))).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto escape = store->QueryAudit(Q("acme", 10, "x) OR (y"));
  EXPECT_EQ(escape.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(escape.status().message().find("unbalanced"), std::string::npos) << escape.status();
  EXPECT_EQ(store->QueryAudit(Q("acme", 10, "\"open quote")).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Within the caps: fine.
  EXPECT_TRUE(store->QueryAudit(Q("acme", 10, "abc* OR (main AND tmp)")).ok());
}

TEST(AuditHardeningTest, FtsIndexIsScopedToTheTenant) {
  StoreOptions opts;
  opts.audit_burst = 1e9;
  auto store = OpenWith(":memory:", opts);
  ASSERT_NE(store, nullptr);
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(store->AppendAudit(MakeAudit("acme", "e", 1 + i, "execute", "secret-plan")).ok());
    ASSERT_TRUE(store->AppendAudit(MakeAudit("evil", "e", 1 + i, "execute", "other")).ok());
  }
  // evil's search for acme's word finds nothing, even through a column filter of its own.
  // Column filters (which could name the scope column) are refused outright.
  EXPECT_EQ(store->QueryAudit(Q("evil", 1000, "{scope action detail}: secret")).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->QueryAudit(Q("evil", 1000, "scope:t61636d65")).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (const char* q : {"secret", "secret OR other", "(secret) OR (other)"}) {
    auto r = store->QueryAudit(Q("evil", 1000, q));
    ASSERT_TRUE(r.ok()) << q << ": " << r.status();
    for (const auto& e : *r) EXPECT_EQ(e.tenant, "evil") << q;
  }
  EXPECT_EQ(store->QueryAudit(Q("evil", 1000, "secret"))->size(), 0u);
  EXPECT_EQ(store->QueryAudit(Q("acme", 1000, "secret"))->size(), 20u);
}

TEST(AuditHardeningTest, ExpensiveSearchIsCutOffByTheDeadline) {
  TempDir dir;
  const std::string path = dir.File("audit.db");
  StoreOptions slow;
  slow.audit_burst = 1e9;
  slow.audit_query_timeout_ms = 60000;
  {
    auto store = OpenWith(path, slow);
    ASSERT_NE(store, nullptr);
    for (int i = 0; i < 4000; ++i) {
      ASSERT_TRUE(store->AppendAudit(MakeAudit("evil", "e", 1 + i, "files.read", ManyWords(i))).ok());
    }
  }
  const std::string expensive = "abc* OR abd* OR abe* OR xyz*";
  int64_t full_ms = 0;
  {
    auto store = OpenWith(path, slow);
    int64_t t0 = MonotonicMs();
    auto r = store->QueryAudit(Q("evil", 1000, expensive));
    full_ms = MonotonicMs() - t0;
    ASSERT_TRUE(r.ok()) << r.status();
  }
  std::cout << "unbounded expensive search: " << full_ms << " ms\n";
  ASSERT_GE(full_ms, 40) << "the test query must cost well over the deadline to prove anything";
  StoreOptions bounded = slow;
  bounded.audit_query_timeout_ms = 5;
  auto store = OpenWith(path, bounded);
  int64_t t0 = MonotonicMs();
  auto r = store->QueryAudit(Q("evil", 1000, expensive));
  int64_t cut_ms = MonotonicMs() - t0;
  std::cout << "bounded expensive search: " << cut_ms << " ms, " << r.status() << "\n";
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_NE(r.status().message().find("too expensive"), std::string::npos);
  EXPECT_LT(cut_ms, full_ms / 2);
  // The connection is usable again afterwards (the deadline does not stick).
  EXPECT_TRUE(store->QueryAudit(Q("evil", 5)).ok());
}

TEST(AuditHardeningTest, ExpensiveSearchLoopDoesNotStallOtherTenantsStoreCalls) {
  TempDir dir;
  const std::string path = dir.File("audit.db");
  StoreOptions opts;
  opts.audit_burst = 1e9;
  auto store = OpenWith(path, opts);  // default 500 ms search deadline
  ASSERT_NE(store, nullptr);
  for (int i = 0; i < 4000; ++i) {
    ASSERT_TRUE(store->AppendAudit(MakeAudit("evil", "e", 1 + i, "files.read", ManyWords(i))).ok());
  }
  ASSERT_TRUE(store->PutEnvironment(MakeEnv("env_victim", "victim", "running", 1)).ok());
  std::atomic<bool> stop{false};
  std::atomic<int> searches{0};
  std::vector<std::thread> attackers;
  for (int t = 0; t < 2; ++t) {
    attackers.emplace_back([&] {
      while (!stop) {
        (void)store->QueryAudit(Q("evil", 1000, "abc* OR abd* OR abe* OR xyz*"));
        ++searches;
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::vector<double> ms;
  for (int i = 0; i < 40; ++i) {
    int64_t t0 = MonotonicMs();
    ASSERT_TRUE(store->ListEnvironments("victim", false).ok());
    ASSERT_TRUE(store->AppendAudit(MakeAudit("victim", "env_victim", 5000 + i, "execute", "ls")).ok());
    ms.push_back(static_cast<double>(MonotonicMs() - t0));
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  stop = true;
  for (auto& t : attackers) t.join();
  std::cout << "victim list+append median " << Median(ms) << " ms, max "
            << *std::max_element(ms.begin(), ms.end()) << " ms; " << searches << " searches\n";
  EXPECT_GT(searches.load(), 0);
  EXPECT_LT(Median(ms), 20.0);
}

TEST(AuditHardeningTest, StoredFieldsAreCappedAndTheCutIsMarked) {
  auto store = OpenOrDie(":memory:");
  ASSERT_NE(store, nullptr);
  const std::string path = "/workspace/" + std::string(4096, 'p');
  ASSERT_TRUE(store->AppendAudit(MakeAudit("acme", std::string(4096, 'e'), 1, "files.read", path)).ok());
  auto r = store->QueryAudit(Q("acme", 1));
  ASSERT_TRUE(r.ok() && r->size() == 1u);
  const AuditEntry& e = (*r)[0];
  EXPECT_LE(e.detail.size(), 1024u + 40u);
  EXPECT_EQ(e.detail.rfind("/workspace/pppp", 0), 0u) << "the head of the field is kept";
  EXPECT_NE(e.detail.find("…[truncated 3083 bytes]"), std::string::npos) << e.detail.substr(1000);
  EXPECT_LE(e.environment_id.size(), 64u + 40u);
  EXPECT_NE(e.environment_id.find("…[truncated"), std::string::npos);
  // A cut never splits a UTF-8 sequence.
  std::string utf8;
  while (utf8.size() < 2000) utf8 += "é";
  ASSERT_TRUE(store->AppendAudit(MakeAudit("acme", "e", 2, "files.read", "x" + utf8)).ok());
  auto u = store->QueryAudit(Q("acme", 1));
  ASSERT_TRUE(u.ok());
  const std::string& d = (*u)[0].detail;
  size_t mark = d.find("…[truncated");
  ASSERT_NE(mark, std::string::npos);
  EXPECT_EQ(mark % 2, 1u) << "cut inside a 2-byte character";
}

// A store whose audit rate limit (10 rows/s per tenant, `burst`) runs on `clock`, which the
// test moves by hand.
StoreOptions RateLimitedOn(const std::atomic<int64_t>& clock, double burst) {
  StoreOptions opts;
  opts.audit_rate_per_s = 10;
  opts.audit_burst = burst;
  opts.now_ms = [&clock] { return clock.load(); };
  return opts;
}

TEST(AuditHardeningTest, OverTheRateSimilarEventsAreSummarisedNotLost) {
  std::atomic<int64_t> clock{1'000'000};
  StoreOptions opts = RateLimitedOn(clock, 20);
  auto store = OpenWith(":memory:", opts);
  ASSERT_NE(store, nullptr);
  for (int i = 0; i < 500; ++i) {
    AuditEntry e = MakeAudit("evil", "env_1", clock, "files.read", "/missing/" + std::to_string(i));
    e.status = 404;
    ASSERT_TRUE(store->AppendAudit(e).ok());
  }
  ASSERT_TRUE(store->AppendAudit(MakeAudit("acme", "e", clock, "execute", "ls")).ok())
      << "another tenant has its own budget";
  EXPECT_EQ(*store->CountAudit("evil"), 20);
  EXPECT_EQ(*store->CountAudit("acme"), 1);
  clock += 11'000;
  ASSERT_TRUE(store->Maintain().ok());
  EXPECT_EQ(*store->CountAudit("evil"), 21);
  auto r = store->QueryAudit(Q("evil", 1, "suppressed"));
  ASSERT_TRUE(r.ok() && r->size() == 1u) << r.status();
  EXPECT_EQ((*r)[0].action, "files.read");
  EXPECT_EQ((*r)[0].status, 404);
  EXPECT_NE((*r)[0].detail.find("480 similar events suppressed"), std::string::npos)
      << (*r)[0].detail;
  EXPECT_NE((*r)[0].detail.find("/missing/20"), std::string::npos) << "names the first one";
  // After the flush, the refilled bucket stores rows again.
  ASSERT_TRUE(store->AppendAudit(MakeAudit("evil", "e", clock, "execute", "ls")).ok());
  EXPECT_EQ(*store->CountAudit("evil"), 22);
}

TEST(AuditHardeningTest, SummaryOfAFloodAgainstOneEnvironmentIsFoundUnderThatEnvironment) {
  std::atomic<int64_t> clock{1'000'000};
  StoreOptions opts = RateLimitedOn(clock, 5);
  auto store = OpenWith(":memory:", opts);
  ASSERT_NE(store, nullptr);
  for (int i = 0; i < 5; ++i) {  // the burst
    ASSERT_TRUE(store->AppendAudit(MakeAudit("evil", "env_other", clock, "execute", "ls")).ok());
  }
  for (int i = 0; i < 300; ++i) {
    AuditEntry e = MakeAudit("evil", i % 3 ? "env_x" : "env_y", clock, "files.read",
                             "/missing/" + std::to_string(i));
    e.status = 404;
    ASSERT_TRUE(store->AppendAudit(e).ok());
  }
  // Many more environments than kinds are kept: the rest share one bounded counter.
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(store->AppendAudit(MakeAudit("evil", "env_n" + std::to_string(i), clock,
                                             "execute", "x")).ok());
  }
  clock += 11'000;
  ASSERT_TRUE(store->Maintain().ok());
  AuditQuery q = Q("evil", 1000, "suppressed");
  q.environment_id = "env_x";
  auto x = store->QueryAudit(q);
  ASSERT_TRUE(x.ok() && x->size() == 1u) << x.status() << " " << (x.ok() ? x->size() : 0);
  EXPECT_EQ((*x)[0].environment_id, "env_x");
  EXPECT_EQ((*x)[0].status, 404);
  EXPECT_NE((*x)[0].detail.find("[200 similar events suppressed"), std::string::npos)
      << (*x)[0].detail;
  q.environment_id = "env_y";
  auto y = store->QueryAudit(q);
  ASSERT_TRUE(y.ok() && y->size() == 1u);
  EXPECT_NE((*y)[0].detail.find("[100 similar events suppressed"), std::string::npos)
      << (*y)[0].detail;
  auto all = store->QueryAudit(Q("evil", 1000, "suppressed"));
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), 32u + 1u) << "32 kinds + one shared bucket, however many environments";
}

AuditEntry ToolRow(int64_t time_ms, const std::string& tool, const std::string& decision) {
  AuditEntry e = MakeAudit("evil", "env_1", time_ms, "tool.call", tool + " " + decision);
  e.status = decision == "blocked" ? 403 : 200;
  ToolCallFields f;
  f.tool = tool;
  f.server = "leaky";
  f.decision = decision;
  if (decision == "blocked") f.rule_ids = {"dlp:aws_access_key"};
  f.arguments = "{}";
  e.tool_call = f;
  return e;
}

AuditQuery ToolQ(const std::string& decision) {
  AuditQuery q = Q("evil", 1000);
  q.kind = "tool";
  q.decision = decision;
  return q;
}

// Review F9: an agent floods cheap tool calls so that the row of its DLP-blocked call is
// suppressed into a summary the decision search cannot find.
TEST(AuditHardeningTest, AttackFloodOfCheapToolCallsCannotHideABlockedCall) {
  std::atomic<int64_t> clock{1'000'000};
  StoreOptions opts = RateLimitedOn(clock, 20);
  auto store = OpenWith(":memory:", opts);
  ASSERT_NE(store, nullptr);
  for (int i = 0; i < 400; ++i) {
    ASSERT_TRUE(store->AppendAudit(ToolRow(clock, "list_environments", "allowed")).ok());
    if (i % 80 == 79) {
      ASSERT_TRUE(store->AppendAudit(ToolRow(clock, "execute_command", "blocked")).ok());
    }
  }
  auto blocked = store->QueryAudit(ToolQ("blocked"));
  ASSERT_TRUE(blocked.ok()) << blocked.status();
  ASSERT_EQ(blocked->size(), 5u) << "every blocked call keeps its own row";
  for (const AuditEntry& e : *blocked) {
    EXPECT_EQ(e.tool_call->tool, "execute_command");
    EXPECT_EQ(e.tool_call->rule_ids, std::vector<std::string>{"dlp:aws_access_key"});
  }
  // The cheap calls' summary keeps its decision and server too.
  clock += 11'000;
  ASSERT_TRUE(store->Maintain().ok());
  auto allowed = store->QueryAudit(ToolQ("allowed"));
  ASSERT_TRUE(allowed.ok());
  ASSERT_EQ(allowed->size(), 21u) << "the burst + one summary";
  const AuditEntry& summary = (*allowed)[0];
  EXPECT_NE(summary.detail.find("[380 similar events suppressed"), std::string::npos)
      << summary.detail;
  ASSERT_TRUE(summary.tool_call.has_value());
  EXPECT_EQ(summary.tool_call->server, "leaky");
  EXPECT_EQ(summary.tool_call->tool, "list_environments");
}

// A flood of blocked calls is itself rate limited (its own bucket) and summarised, the summary
// still found by the decision search and naming the rules; the tenant's row cap still holds.
TEST(AuditHardeningTest, AttackFloodOfBlockedCallsIsSummarisedFoundByDecisionAndBounded) {
  std::atomic<int64_t> clock{1'000'000};
  StoreOptions opts = RateLimitedOn(clock, 20);
  opts.max_audit_rows_per_tenant = 100;
  auto store = OpenWith(":memory:", opts);
  ASSERT_NE(store, nullptr);
  for (int i = 0; i < 500; ++i) {
    ASSERT_TRUE(
        store->AppendAudit(ToolRow(clock, i % 2 ? "execute_command" : "write_file", "blocked"))
            .ok());
  }
  EXPECT_EQ(*store->CountAudit("evil"), 20) << "the DLP bucket's burst, no more";
  clock += 11'000;
  ASSERT_TRUE(store->Maintain().ok());
  auto blocked = store->QueryAudit(ToolQ("blocked"));
  ASSERT_TRUE(blocked.ok());
  ASSERT_EQ(blocked->size(), 21u);
  const AuditEntry& summary = (*blocked)[0];
  EXPECT_NE(summary.detail.find("[480 similar events suppressed"), std::string::npos)
      << summary.detail;
  ASSERT_TRUE(summary.tool_call.has_value());
  EXPECT_EQ(summary.tool_call->decision, "blocked");
  EXPECT_EQ(summary.tool_call->server, "leaky");
  EXPECT_EQ(summary.tool_call->tool, "") << "several tools: none named";
  EXPECT_EQ(summary.tool_call->rule_ids, std::vector<std::string>{"dlp:aws_access_key"});
  // Hours of flooding: the row cap bounds the store.
  for (int s = 0; s < 100; ++s) {
    clock += 11'000;
    for (int i = 0; i < 200; ++i) {
      ASSERT_TRUE(store->AppendAudit(ToolRow(clock, "execute_command", "blocked")).ok());
    }
  }
  ASSERT_TRUE(store->Maintain().ok());
  EXPECT_LE(*store->CountAudit("evil"), 100);
}

TEST(AuditHardeningTest, PerTenantRowCapDropsOldestInBatches) {
  StoreOptions opts;
  opts.audit_burst = 1e9;
  opts.max_audit_rows_per_tenant = 100;
  auto store = OpenWith(":memory:", opts);
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->AppendAudit(MakeAudit("acme", "e", 1, "execute", "keep me")).ok());
  for (int i = 0; i < 1000; ++i) {
    ASSERT_TRUE(store->AppendAudit(MakeAudit("evil", "e", 10 + i, "files.read", "x")).ok());
  }
  int64_t evil = *store->CountAudit("evil");
  EXPECT_LE(evil, 100);
  EXPECT_GE(evil, 95);
  EXPECT_EQ(*store->CountAudit("acme"), 1) << "another tenant's rows are not touched";
  auto newest = store->QueryAudit(Q("evil", 1));
  ASSERT_TRUE(newest.ok());
  EXPECT_EQ((*newest)[0].time_ms, 1009) << "the newest rows are kept";
}

TEST(AuditHardeningTest, RetentionDeletesOldAuditRowsAndOldDestroyedEnvironments) {
  std::atomic<int64_t> clock{100LL * 86400 * 1000};
  StoreOptions opts;
  opts.audit_burst = 1e9;
  opts.retention_s = 7 * 86400;
  opts.now_ms = [&] { return clock.load(); };
  auto store = OpenWith(":memory:", opts);
  ASSERT_NE(store, nullptr);
  const int64_t old_ms = clock - 8LL * 86400 * 1000, new_ms = clock - 1000;
  for (int i = 0; i < 3000; ++i) {  // more than one call's batches (2 x 500)
    ASSERT_TRUE(store->AppendAudit(MakeAudit("acme", "e", old_ms + i, "execute", "old")).ok());
  }
  ASSERT_TRUE(store->AppendAudit(MakeAudit("acme", "e", new_ms, "execute", "new")).ok());
  EnvironmentRecord gone = MakeEnv("env_old", "acme", "destroyed", old_ms);
  gone.destroyed_ms = old_ms + 1;
  EnvironmentRecord recent = MakeEnv("env_recent", "acme", "destroyed", new_ms);
  recent.destroyed_ms = new_ms;
  EnvironmentRecord live = MakeEnv("env_live", "acme", "running", old_ms);
  for (const auto& r : {gone, recent, live}) ASSERT_TRUE(store->PutEnvironment(r).ok());
  ASSERT_TRUE(store->Maintain().ok());
  EXPECT_EQ(*store->CountAudit("acme"), 3001 - 1000) << "one call deletes a bounded batch";
  // The backlog goes on the next ticks, not a minute later.
  for (int tick = 0; tick < 3; ++tick) ASSERT_TRUE(store->Maintain().ok());
  EXPECT_EQ(*store->CountAudit("acme"), 1);
  EXPECT_EQ(store->QueryAudit(Q("acme", 10, "old"))->size(), 0u) << "FTS rows deleted too";
  EXPECT_FALSE(store->GetEnvironment("env_old").ok());
  EXPECT_TRUE(store->GetEnvironment("env_recent").ok());
  EXPECT_TRUE(store->GetEnvironment("env_live").ok()) << "live environments are never pruned";
}

TEST(AuditHardeningTest, ManyConcurrentReadsOfMissing4KiBPathsKeepTheDatabaseBounded) {
  TempDir dir;
  const std::string path = dir.File("esbd.db");
  auto store = OpenOrDie(path);  // default limits, real clock
  ASSERT_NE(store, nullptr);
  const int64_t before = FileBytes(path) + FileBytes(path + "-wal");
  std::atomic<int64_t> attempts{0};
  const int64_t end = MonotonicMs() + 2000;
  std::vector<std::thread> threads;
  for (int t = 0; t < 12; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; MonotonicMs() < end; ++i) {
        AuditEntry e = MakeAudit("evil", "env_1", 0, "files.read",
                                 "/workspace/" + std::to_string(t * 1000000 + i) +
                                     std::string(4096, 'a' + (i % 26)));
        e.status = 404;
        ASSERT_TRUE(store->AppendAudit(e).ok());
        ++attempts;
      }
    });
  }
  for (auto& th : threads) th.join();
  ASSERT_TRUE(store->Maintain().ok());
  const int64_t rows = *store->CountAudit("evil");
  store.reset();  // checkpoints the WAL into the file: what stays on disk
  const int64_t growth = FileBytes(path) + FileBytes(path + "-wal") - before;
  std::cout << attempts << " audit attempts in 2 s → " << rows << " rows, db+wal +" << growth
            << " bytes\n";
  ASSERT_GT(attempts.load(), 1000) << "the attack must actually hammer the log";
  // Burst 200 + 20/s for ~2 s, plus summaries (none yet: they flush 10 s after the first).
  EXPECT_LE(rows, 200 + 20 * 3);
  EXPECT_LT(growth, 1 << 20);
}

TEST(StoreFileTest, MigrationFromV1ScopesTheIndexAndCapsOldDetails) {
  TempDir dir;
  const std::string path = dir.File("v1.db");
  ::close(::open(path.c_str(), O_CREAT | O_WRONLY, 0600));
  RawExec(path, "CREATE TABLE schema_version (id INTEGER PRIMARY KEY CHECK (id = 1), "
                "version INTEGER NOT NULL); INSERT INTO schema_version VALUES (1, 1);" +
                    MigrationSql(1));
  RawExec(path, "INSERT INTO audit (time_ms, tenant, action, detail) VALUES "
                "(1, 'acme', 'execute', 'secret-plan'), (2, 'evil', 'files.read', '" +
                    std::string(4096, 'z') + "'), (3, 'evil', 'files.read', '" +
                    std::string(2000, 'y') + "')");
  StoreOptions opts;
  opts.max_detail_bytes = 300;  // the configured cap, in bytes, as for new rows
  auto store = OpenWith(path, opts);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(RawQuery(path, "SELECT version FROM schema_version"),
            std::to_string(LatestSchemaVersion()));
  EXPECT_EQ(store->QueryAudit(Q("acme", 10, "secret"))->size(), 1u) << "index rebuilt";
  EXPECT_EQ(store->QueryAudit(Q("evil", 10, "secret"))->size(), 0u);
  auto evil = store->QueryAudit(Q("evil", 10));
  ASSERT_TRUE(evil.ok() && evil->size() == 2u);
  // The same rule as AppendAudit (CapField): bytes, the configured cap, the count dropped.
  EXPECT_EQ((*evil)[1].detail, std::string(300, 'z') + "…[truncated 3796 bytes]");
  EXPECT_EQ((*evil)[0].detail, std::string(300, 'y') + "…[truncated 1700 bytes]");
  AuditEntry fresh = MakeAudit("evil", "", 4, "files.read", std::string(4096, 'z'));
  ASSERT_TRUE(store->AppendAudit(fresh).ok());
  EXPECT_EQ((*store->QueryAudit(Q("evil", 1)))[0].detail, (*evil)[1].detail)
      << "an old row and a new one of the same text are stored alike";
  EXPECT_EQ(RawQuery(path, "SELECT count(*) FROM audit_fts WHERE audit_fts MATCH 'scope : t" +
                               std::string("61636d65") + "'"),
            "1");
}


// ---- Write-behind (StoreOptions::write_behind_ms) ----

AuditEntry WriteBehindRow(int i) {
  AuditEntry e;
  e.tenant = "t1";
  e.principal = "dev";
  e.environment_id = "env_wb";
  e.action = "execute";
  e.detail = absl::StrCat("echo ", i);
  e.status = 200;
  return e;
}

EnvironmentRecord WriteBehindEnv(int64_t exec_count, EnvState state) {
  EnvironmentRecord r;
  r.id = "env_wb";
  r.tenant = "t1";
  r.state = state;
  r.runtime = "container";
  r.exec_count = exec_count;
  return r;
}

// What another process sees in the file (no flush of this store's queue).
int64_t RowsOnDisk(const std::string& path) {
  return std::stoll(RawQuery(path, "SELECT count(*) FROM audit"));
}

TEST(WriteBehindTest, ReadsSeeQueuedRowsAndUpdatesAtOnce) {
  TempDir dir;
  StoreOptions o;
  o.write_behind_ms = 60'000;  // the thread would not write them during the test
  auto store = Store::Open(dir.File("esb.db"), o);
  ASSERT_TRUE(store.ok()) << store.status();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE((*store)->AppendAudit(WriteBehindRow(i)).ok());
  ASSERT_TRUE((*store)->PutEnvironmentDeferred(WriteBehindEnv(7, EnvState::kRunning)).ok());
  EXPECT_EQ(RowsOnDisk(dir.File("esb.db")), 0);  // really queued
  AuditQuery q;
  q.tenant = "t1";
  auto rows = (*store)->QueryAudit(q);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(rows->size(), 3u);
  EXPECT_EQ(*(*store)->CountAudit("t1"), 3);
  auto env = (*store)->GetEnvironment("env_wb");
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->exec_count, 7);
}

TEST(WriteBehindTest, TheThreadWritesWithinTheInterval) {
  TempDir dir;
  StoreOptions o;
  o.write_behind_ms = 20;
  auto store = Store::Open(dir.File("esb.db"), o);
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE((*store)->AppendAudit(WriteBehindRow(1)).ok());
  int64_t seen = 0;
  for (int i = 0; i < 200 && seen == 0; ++i) {  // ≤ 2 s, well past 20 ms
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    seen = RowsOnDisk(dir.File("esb.db"));
  }
  EXPECT_EQ(seen, 1);
}

TEST(WriteBehindTest, ClosingTheStoreWritesEverythingQueued) {
  TempDir dir;
  StoreOptions o;
  o.write_behind_ms = 60'000;
  {
    auto store = Store::Open(dir.File("esb.db"), o);
    ASSERT_TRUE(store.ok()) << store.status();
    for (int i = 0; i < 10; ++i) ASSERT_TRUE((*store)->AppendAudit(WriteBehindRow(i)).ok());
    ASSERT_TRUE((*store)->PutEnvironmentDeferred(WriteBehindEnv(3, EnvState::kRunning)).ok());
  }
  EXPECT_EQ(RowsOnDisk(dir.File("esb.db")), 10);
  EXPECT_EQ(RawQuery(dir.File("esb.db"), "SELECT exec_count FROM environments"), "3");
}

// A full queue never drops a row: the caller writes the backlog and its own row itself.
TEST(WriteBehindTest, AFullQueueMakesTheCallerWriteSynchronously) {
  TempDir dir;
  StoreOptions o;
  o.write_behind_ms = 60'000;
  o.max_write_behind_rows = 2;
  auto store = Store::Open(dir.File("esb.db"), o);
  ASSERT_TRUE(store.ok()) << store.status();
  for (int i = 0; i < 5; ++i) ASSERT_TRUE((*store)->AppendAudit(WriteBehindRow(i)).ok());
  // Rows 0 and 1 queued; row 2 found the queue full and wrote 0, 1 and itself; 3, 4 queued.
  EXPECT_EQ(RowsOnDisk(dir.File("esb.db")), 3);
  EXPECT_EQ(*(*store)->CountAudit("t1"), 5);
}

// A deferred counter update queued before a synchronous write of the same environment (e.g.
// its destroy) must never land after it.
TEST(WriteBehindTest, AQueuedUpdateNeverOverwritesALaterSynchronousPut) {
  TempDir dir;
  StoreOptions o;
  o.write_behind_ms = 60'000;
  auto store = Store::Open(dir.File("esb.db"), o);
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE((*store)->PutEnvironmentDeferred(WriteBehindEnv(9, EnvState::kRunning)).ok());
  ASSERT_TRUE((*store)->PutEnvironment(WriteBehindEnv(9, EnvState::kDestroyed)).ok());
  ASSERT_TRUE((*store)->Flush().ok());
  auto env = (*store)->GetEnvironment("env_wb");
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->state, EnvState::kDestroyed);
}

// The rate limit judges a queued row by the time it was appended, not when it is written.
TEST(WriteBehindTest, TheRateLimitUsesTheAppendTime) {
  TempDir dir;
  std::atomic<int64_t> now{1'000'000};
  StoreOptions o;
  o.write_behind_ms = 60'000;
  o.audit_rate_per_s = 1;
  o.audit_burst = 2;
  o.now_ms = [&now] { return now.load(); };
  auto store = Store::Open(dir.File("esb.db"), o);
  ASSERT_TRUE(store.ok()) << store.status();
  for (int i = 0; i < 5; ++i) ASSERT_TRUE((*store)->AppendAudit(WriteBehindRow(i)).ok());
  now += 3'600'000;  // an hour later the bucket would be full again
  // Appended within one instant: 2 admitted, 3 counted for a summary (not yet written).
  EXPECT_EQ(*(*store)->CountAudit("t1"), 2);
}

}  // namespace
}  // namespace esb

// The step log tables (schema v7, issue 13): round trips, tenant scoping, paging, cleanup.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "storage/sqlite_store.h"
#include "storage/store.h"
#include "storage/store_test_util.h"

namespace esb {
namespace {

std::unique_ptr<Store> OpenMemory() {
  absl::StatusOr<std::unique_ptr<Store>> store = Store::Open(":memory:");
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? std::move(*store) : nullptr;
}

StepRecord MakeStep(const std::string& env, const std::string& tenant, int64_t n) {
  StepRecord r;
  r.env_id = env;
  r.tenant = tenant;
  r.n = n;
  if (n > 0) r.parent = n - 1;
  r.kind = n == 0 ? "create" : "execute";
  r.summary = absl::StrCat("echo ", n);
  r.exit_code = n == 3 ? std::optional<int64_t>(1) : std::optional<int64_t>(0);
  r.status = n == 3 ? "error" : "ok";
  if (n == 3) r.error = "exit 1";
  r.started_ms = 1000 + n;
  r.duration_ms = 5;
  r.capture_ms = 2;
  r.tier = "container";
  r.memory = "none";
  r.memory_detail = "off";
  r.files_changed = n;
  r.created_ms = 2000 + n;
  r.manifest_sha = std::string(64, 'a');
  r.state_json = "{}";
  r.detail_json = R"({"input":{}})";
  r.bytes = 10 * n;
  return r;
}

TEST(StepsStoreTest, StepRoundTripKeepsEveryField) {
  auto store = OpenMemory();
  StepRecord in = MakeStep("env_a", "t1", 3);
  in.memory_live = true;
  in.memory = "snapshot";
  in.memory_detail.reset();
  ASSERT_TRUE(store->PutStep(in).ok());
  auto out = store->GetStep("t1", "env_a", 3);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->parent, std::optional<int64_t>(2));
  EXPECT_EQ(out->kind, "execute");
  EXPECT_EQ(out->status, "error");
  EXPECT_EQ(out->exit_code, std::optional<int64_t>(1));
  EXPECT_EQ(out->error, std::optional<std::string>("exit 1"));
  EXPECT_EQ(out->memory, "snapshot");
  EXPECT_FALSE(out->memory_detail.has_value());
  EXPECT_TRUE(out->memory_live);
  EXPECT_EQ(out->files_changed, 3);
  EXPECT_EQ(out->manifest_sha, std::string(64, 'a'));
  EXPECT_EQ(out->detail_json, R"({"input":{}})");
  EXPECT_EQ(out->bytes, 30);
  // Step 0 has no parent (NULL, not 0).
  ASSERT_TRUE(store->PutStep(MakeStep("env_a", "t1", 0)).ok());
  auto zero = store->GetStep("t1", "env_a", 0);
  ASSERT_TRUE(zero.ok());
  EXPECT_FALSE(zero->parent.has_value());
}

TEST(StepsStoreTest, AnotherTenantsStepReadsAsAbsent) {
  auto store = OpenMemory();
  ASSERT_TRUE(store->PutStep(MakeStep("env_a", "t1", 1)).ok());
  ASSERT_TRUE(store->PutStepLog({"env_a", "t1", "{}", 1, 2, 5}).ok());
  EXPECT_TRUE(absl::IsNotFound(store->GetStep("t2", "env_a", 1).status()));
  EXPECT_TRUE(absl::IsNotFound(store->GetStepLog("t2", "env_a").status()));
  auto listed = store->ListSteps("t2", "env_a", -1, 50);
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->empty());
}

TEST(StepsStoreTest, ListIsNewestFirstAndPagesWithBefore) {
  auto store = OpenMemory();
  for (int n = 0; n < 7; ++n) ASSERT_TRUE(store->PutStep(MakeStep("env_a", "t1", n)).ok());
  ASSERT_TRUE(store->PutStep(MakeStep("env_b", "t1", 0)).ok());
  auto page = store->ListSteps("t1", "env_a", -1, 3);
  ASSERT_TRUE(page.ok());
  ASSERT_EQ(page->size(), 3u);
  EXPECT_EQ((*page)[0].n, 6);
  EXPECT_EQ((*page)[2].n, 4);
  auto next = store->ListSteps("t1", "env_a", 4, 3);
  ASSERT_TRUE(next.ok());
  ASSERT_EQ(next->size(), 3u);
  EXPECT_EQ((*next)[0].n, 3);
  auto last = store->ListSteps("t1", "env_a", 1, 3);
  ASSERT_TRUE(last.ok());
  ASSERT_EQ(last->size(), 1u);
  EXPECT_EQ((*last)[0].n, 0);
  EXPECT_EQ(*store->CountSteps("env_a"), 7);
}

TEST(StepsStoreTest, HugeOrNonPositiveLimitIsRefused) {
  auto store = OpenMemory();
  EXPECT_TRUE(absl::IsInvalidArgument(store->ListSteps("t1", "e", -1, 0).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(store->ListSteps("t1", "e", -1, -5).status()));
  EXPECT_TRUE(
      absl::IsInvalidArgument(store->ListSteps("t1", "e", -1, kMaxStepsListed + 1).status()));
}

TEST(StepsStoreTest, StepLogUpsertAndDeleteWithSteps) {
  auto store = OpenMemory();
  ASSERT_TRUE(store->PutStepLog({"env_a", "t1", R"({"capture":true})", std::nullopt, 0, 1}).ok());
  auto log = store->GetStepLog("t1", "env_a");
  ASSERT_TRUE(log.ok());
  EXPECT_FALSE(log->head.has_value());
  ASSERT_TRUE(store->PutStepLog({"env_a", "t1", R"({"capture":true})", 4, 5, 2}).ok());
  log = store->GetStepLog("t1", "env_a");
  ASSERT_TRUE(log.ok());
  EXPECT_EQ(log->head, std::optional<int64_t>(4));
  EXPECT_EQ(log->next_step, 5);
  ASSERT_TRUE(store->PutStep(MakeStep("env_a", "t1", 0)).ok());
  ASSERT_TRUE(store->PutStep(MakeStep("env_b", "t1", 0)).ok());
  ASSERT_EQ(store->ListStepLogs()->size(), 1u);
  ASSERT_TRUE(store->DeleteSteps("env_a").ok());
  EXPECT_TRUE(absl::IsNotFound(store->GetStepLog("t1", "env_a").status()));
  EXPECT_EQ(*store->CountSteps("env_a"), 0);
  EXPECT_EQ(*store->CountSteps("env_b"), 1);
}

TEST(StepsStoreTest, LiveMemoryStepsAndBlobRefsAreListed) {
  auto store = OpenMemory();
  StepRecord live = MakeStep("env_a", "t1", 1);
  live.memory_live = true;
  StepRecord collected = MakeStep("env_a", "t1", 2);
  collected.collected = true;
  collected.manifest_sha = std::string(64, 'b');
  ASSERT_TRUE(store->PutStep(live).ok());
  ASSERT_TRUE(store->PutStep(collected).ok());
  auto lives = store->ListLiveMemorySteps();
  ASSERT_TRUE(lives.ok());
  ASSERT_EQ(lives->size(), 1u);
  EXPECT_EQ((*lives)[0].n, 1);
  auto refs = store->ListStepBlobRefs();
  ASSERT_TRUE(refs.ok());
  ASSERT_EQ(refs->size(), 2u);
  EXPECT_FALSE((*refs)[0].collected);
  EXPECT_TRUE((*refs)[1].collected);
  EXPECT_EQ((*refs)[1].manifest_sha, std::string(64, 'b'));
  EXPECT_EQ((*refs)[1].tenant, "t1") << "the sweep marks per tenant";
}

TEST(StepsStoreFileTest, StepsSurviveReopen) {
  store_test::TempDir dir;
  const std::string path = dir.File("esbd.db");
  {
    auto store = Store::Open(path);
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->PutStep(MakeStep("env_a", "t1", 0)).ok());
    ASSERT_TRUE((*store)->PutStepLog({"env_a", "t1", "{}", 0, 1, 1}).ok());
  }
  auto store = Store::Open(path);
  ASSERT_TRUE(store.ok());
  EXPECT_TRUE((*store)->GetStep("t1", "env_a", 0).ok());
  EXPECT_EQ((*store)->GetStepLog("t1", "env_a")->head, std::optional<int64_t>(0));
}

}  // namespace
}  // namespace esb

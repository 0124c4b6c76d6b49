#include "core/artifact_store.h"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include <gtest/gtest.h>

#include "common/util.h"

namespace esb {
namespace {

class ArtifactStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/esb-artifacts-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    options_.dir = dir_ + "/store";
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  static ArtifactMeta Meta(const std::string& tenant, const std::string& env,
                           const std::string& name) {
    ArtifactMeta m;
    m.tenant = tenant;
    m.environment_id = env;
    m.kind = "image";
    m.name = name;
    m.mime_type = "image/png";
    m.title = "a title";
    m.step = 3;
    return m;
  }

  std::string dir_;
  ArtifactStore::Options options_;
};

TEST_F(ArtifactStoreTest, PutGetReadListRoundTrip) {
  auto store = ArtifactStore::Open(options_);
  ASSERT_TRUE(store.ok()) << store.status();
  auto a = (*store)->Put(Meta("t1", "env1", "figure-1.png"), std::string("\x89PNG\0data", 9));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->id.size(), 28u);
  EXPECT_EQ(a->id.substr(0, 4), "art_");
  EXPECT_EQ(a->size, 9);
  EXPECT_GT(a->created_ms, 0);
  auto b = (*store)->Put(Meta("t1", "env1", "data.csv"), "a,b\n");
  ASSERT_TRUE(b.ok());
  EXPECT_NE(a->id, b->id);

  auto got = (*store)->Get("t1", "env1", a->id);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->name, "figure-1.png");
  EXPECT_EQ(got->title, "a title");
  EXPECT_EQ(got->step, 3);
  auto bytes = (*store)->Read("t1", "env1", a->id);
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(*bytes, std::string("\x89PNG\0data", 9));

  auto list = (*store)->List("t1", "env1");
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0].id, a->id);
  EXPECT_EQ(list[1].id, b->id);
  EXPECT_EQ((*store)->TenantBytes("t1"), 13);
}

TEST_F(ArtifactStoreTest, OtherTenantsAndEnvironmentsSeeNotFound) {
  auto store = ArtifactStore::Open(options_);
  ASSERT_TRUE(store.ok());
  auto a = (*store)->Put(Meta("t1", "env1", "x.png"), "x");
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(absl::IsNotFound((*store)->Get("t2", "env1", a->id).status()));
  EXPECT_TRUE(absl::IsNotFound((*store)->Read("t2", "env1", a->id).status()));
  EXPECT_TRUE(absl::IsNotFound((*store)->Get("t1", "env2", a->id).status()));
  EXPECT_TRUE(absl::IsNotFound((*store)->Get("t1", "env1", "art_000000000000000000000000").status()));
  EXPECT_TRUE(absl::IsNotFound((*store)->Get("t1", "env1", "../../etc/passwd").status()));
  EXPECT_TRUE((*store)->List("t2", "env1").empty());
}

TEST_F(ArtifactStoreTest, LimitsAreEnforcedWithClearErrors) {
  options_.max_artifact_bytes = 10;
  options_.max_tenant_bytes = 15;
  auto store = ArtifactStore::Open(options_);
  ASSERT_TRUE(store.ok());
  auto big = (*store)->Put(Meta("t1", "e", "big.bin"), std::string(11, 'x'));
  ASSERT_TRUE(absl::IsResourceExhausted(big.status()));
  EXPECT_NE(big.status().message().find("big.bin"), absl::string_view::npos);
  ASSERT_TRUE((*store)->Put(Meta("t1", "e", "a"), std::string(10, 'x')).ok());
  auto over = (*store)->Put(Meta("t1", "e", "b"), std::string(6, 'x'));
  ASSERT_TRUE(absl::IsResourceExhausted(over.status()));
  EXPECT_EQ((*store)->TenantBytes("t1"), 10);
  // Another tenant has its own quota.
  EXPECT_TRUE((*store)->Put(Meta("t2", "e", "b"), std::string(6, 'x')).ok());
}

TEST_F(ArtifactStoreTest, SurvivesReopenAndDropsBrokenEntries) {
  std::string id;
  {
    auto store = ArtifactStore::Open(options_);
    ASSERT_TRUE(store.ok());
    auto a = (*store)->Put(Meta("t1", "env1", "keep.png"), "keep");
    ASSERT_TRUE(a.ok());
    id = a->id;
  }
  // Debris: an orphan .bin, a .json without .bin, a corrupt .json, an unrelated file.
  ASSERT_TRUE(WriteStringToFile(options_.dir + "/art_111111111111111111111111.bin", "x").ok());
  ASSERT_TRUE(WriteStringToFile(options_.dir + "/art_222222222222222222222222.json", "{}").ok());
  ASSERT_TRUE(WriteStringToFile(options_.dir + "/art_333333333333333333333333.json", "{not").ok());
  ASSERT_TRUE(WriteStringToFile(options_.dir + "/art_333333333333333333333333.bin", "y").ok());
  ASSERT_TRUE(WriteStringToFile(options_.dir + "/README", "hello").ok());
  auto store = ArtifactStore::Open(options_);
  ASSERT_TRUE(store.ok());
  auto list = (*store)->List("t1", "env1");
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].id, id);
  EXPECT_EQ(*(*store)->Read("t1", "env1", id), "keep");
  EXPECT_EQ((*store)->TenantBytes("t1"), 4);
  struct stat st;
  EXPECT_NE(::stat((options_.dir + "/art_111111111111111111111111.bin").c_str(), &st), 0);
  EXPECT_NE(::stat((options_.dir + "/art_333333333333333333333333.bin").c_str(), &st), 0);
  EXPECT_EQ(::stat((options_.dir + "/README").c_str(), &st), 0);
}

TEST_F(ArtifactStoreTest, SweepDeletesExpiredArtifactsAndFreesQuota) {
  options_.ttl_s = 60;
  auto store = ArtifactStore::Open(options_);
  ASSERT_TRUE(store.ok());
  auto a = (*store)->Put(Meta("t1", "e", "a"), "abc");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ((*store)->Sweep(a->created_ms + 59'000), 0);
  EXPECT_EQ((*store)->Sweep(a->created_ms + 60'000), 1);
  EXPECT_TRUE(absl::IsNotFound((*store)->Get("t1", "e", a->id).status()));
  EXPECT_EQ((*store)->TenantBytes("t1"), 0);
  struct stat st;
  EXPECT_NE(::stat((options_.dir + "/" + a->id + ".bin").c_str(), &st), 0);
}

// A tenant that only writes (never lists or reads artifacts back) must get its quota back
// when its artifacts expire.
TEST_F(ArtifactStoreTest, PutSweepsExpiredArtifactsBeforeRefusingForQuota) {
  options_.ttl_s = 1;
  options_.max_tenant_bytes = 10;
  auto store = ArtifactStore::Open(options_);
  ASSERT_TRUE(store.ok());
  auto first = (*store)->Put(Meta("t1", "e", "a"), std::string(10, 'x'));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(absl::IsResourceExhausted((*store)->Put(Meta("t1", "e", "b"), "y").status()));
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  auto later = (*store)->Put(Meta("t1", "e", "c"), std::string(10, 'z'));
  ASSERT_TRUE(later.ok()) << later.status();
  EXPECT_EQ((*store)->TenantBytes("t1"), 10);
  struct stat st;
  EXPECT_NE(::stat((options_.dir + "/" + first->id + ".bin").c_str(), &st), 0);
}

TEST_F(ArtifactStoreTest, ManyEmptyArtifactsHitTheTenantCountCap) {
  options_.max_tenant_artifacts = 50;
  auto store = ArtifactStore::Open(options_);
  ASSERT_TRUE(store.ok());
  int kept = 0;
  for (int i = 0; i < 200; ++i) {
    auto r = (*store)->Put(Meta("t1", "e", "empty"), "");
    if (r.ok()) ++kept;
    else EXPECT_TRUE(absl::IsResourceExhausted(r.status())) << r.status();
  }
  EXPECT_EQ(kept, 50) << "zero-byte artifacts must not be free";
  EXPECT_TRUE((*store)->Put(Meta("t2", "e", "other"), "").ok()) << "per tenant";
  size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(options_.dir)) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 2u * 51u);
}

TEST_F(ArtifactStoreTest, ConcurrentPutsRespectTheTenantQuota) {
  options_.max_tenant_bytes = 100;
  auto store = ArtifactStore::Open(options_);
  ASSERT_TRUE(store.ok());
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i)
    threads.emplace_back([&] {
      for (int j = 0; j < 5; ++j)
        if ((*store)->Put(Meta("t1", "e", "p"), std::string(10, 'x')).ok()) ++ok;
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 10);
  EXPECT_EQ((*store)->TenantBytes("t1"), 100);
  EXPECT_EQ((*store)->List("t1", "e").size(), 10u);
}

}  // namespace
}  // namespace esb

#include "core/image_discovery.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/util.h"

namespace esb {
namespace {

namespace fs = std::filesystem;

class ImageDiscoveryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/esb-images-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    root = tmpl;
    fs::create_directories(root + "/builds");
  }
  void TearDown() override { fs::remove_all(root); }
  // An artefact directory (exists) under the cache.
  std::string Artefact(const std::string& name) {
    std::string p = root + "/" + name;
    fs::create_directories(p);
    return p;
  }
  void Manifest(const std::string& file, int64_t created, bool complete, const std::string& rootfs,
                const std::string& wasm) {
    ASSERT_TRUE(WriteStringToFile(root + "/builds/" + file,
                                  absl::StrCat(R"({"format": 1, "created_unix_ms": )", created,
                                               R"(, "complete": )", complete ? "true" : "false",
                                               R"(, "artefacts": {"rootfs": ")", rootfs,
                                               R"(", "python_wasm": ")", wasm, R"("}})"))
                    .ok());
  }
  std::string root;
};

TEST_F(ImageDiscoveryTest, PicksTheNewestCompleteBuild) {
  Manifest("a.json", 1000, true, Artefact("rootfs/old"), Artefact("python-wasm/old"));
  Manifest("b.json", 3000, true, Artefact("rootfs/new"), Artefact("python-wasm/new"));
  Manifest("c.json", 2000, true, Artefact("rootfs/mid"), Artefact("python-wasm/mid"));
  auto b = FindNewestImageBuild(root);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->rootfs, root + "/rootfs/new");
  EXPECT_EQ(b->python_wasm, root + "/python-wasm/new");
  EXPECT_EQ(b->manifest, root + "/builds/b.json");
  EXPECT_EQ(b->created_unix_ms, 3000);
}

TEST_F(ImageDiscoveryTest, IgnoresIncompleteAndBrokenBuilds) {
  Manifest("good.json", 1000, true, Artefact("rootfs/good"), Artefact("python-wasm/good"));
  // Newer, but: said incomplete; an artefact gone; an artefact missing; not JSON; relative path.
  Manifest("incomplete.json", 5000, false, Artefact("rootfs/x"), Artefact("python-wasm/x"));
  Manifest("gone.json", 6000, true, Artefact("rootfs/y"), root + "/python-wasm/deleted");
  Manifest("missing.json", 7000, true, Artefact("rootfs/z"), "");
  Manifest("relative.json", 8000, true, "rootfs/good", Artefact("python-wasm/r"));
  ASSERT_TRUE(WriteStringToFile(root + "/builds/junk.json", "{not json").ok());
  ASSERT_TRUE(WriteStringToFile(root + "/builds/.manifest.tmp123", "{}").ok());
  auto b = FindNewestImageBuild(root);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->rootfs, root + "/rootfs/good");
}

TEST_F(ImageDiscoveryTest, NoCompleteBuildIsNotFoundAndSaysWhy) {
  Manifest("incomplete.json", 5000, false, Artefact("rootfs/x"), Artefact("python-wasm/x"));
  auto b = FindNewestImageBuild(root);
  ASSERT_FALSE(b.ok());
  EXPECT_TRUE(absl::IsNotFound(b.status()));
  EXPECT_NE(b.status().ToString().find("incomplete.json: incomplete build"), std::string::npos)
      << b.status();
  EXPECT_NE(b.status().ToString().find("make images"), std::string::npos);
  auto none = FindNewestImageBuild(root + "/nowhere");
  EXPECT_TRUE(absl::IsNotFound(none.status()));
}

}  // namespace
}  // namespace esb

// esbd started as a user or a service unit starts it: no environment variables, images found
// in the image cache by the manifests `make images` writes (core/image_discovery.h).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "integration/daemon.h"

namespace esb::testing {
namespace {

namespace fs = std::filesystem;

void WriteManifest(const std::string& path, int64_t created, bool complete,
                   const std::string& rootfs, const std::string& wasm) {
  std::ofstream(path) << "{\"format\": 1, \"created_unix_ms\": " << created
                      << ", \"complete\": " << (complete ? "true" : "false")
                      << ", \"artefacts\": {\"rootfs\": \"" << rootfs << "\", \"python_wasm\": \""
                      << wasm << "\"}}\n";
}

TEST(EsbdStartTest, EmptyEnvironmentRunsTheNewestCompleteImageBuild) {
  char tmpl[] = "/tmp/esb-cache-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string cache = tmpl;
  fs::create_directories(cache + "/builds");
  // The complete build: the real artefacts when this machine has them (make test exports
  // their paths), so the drivers really start from the discovered build; empty stand-ins
  // otherwise (then only the choice is checked, the drivers say they cannot use them).
  const char* real_rootfs = std::getenv("ESBD_IMAGE_DEFAULT");
  const char* real_wasm = std::getenv("ESBD_PYTHON_WASM");
  const bool real =
      real_rootfs && real_wasm && fs::is_directory(real_rootfs) && fs::is_directory(real_wasm);
  if (!real) {
    std::cout << "[ NOTE ] ESBD_IMAGE_DEFAULT/ESBD_PYTHON_WASM unset: the complete build is made "
                 "of empty stand-ins, so only the choice of build is checked\n";
  }
  std::string rootfs = real ? real_rootfs : cache + "/rootfs/aaaa";
  std::string wasm = real ? real_wasm : cache + "/python-wasm/aaaa";
  fs::create_directories(rootfs);
  fs::create_directories(wasm);
  WriteManifest(cache + "/builds/older-complete.json", 1000, true, rootfs, wasm);
  // Newer, but incomplete (an interrupted `make images`, python.wasm never built), and newer
  // still, complete once but its rootfs since deleted from the cache.
  fs::create_directories(cache + "/rootfs/bbbb");
  WriteManifest(cache + "/builds/newer-incomplete.json", 2000, false, cache + "/rootfs/bbbb", "");
  WriteManifest(cache + "/builds/newest-pruned.json", 3000, true, cache + "/rootfs/cccc", wasm);

  Daemon d;
  Daemon::Options o;
  o.empty_environment = true;
  o.extra_args = {"--image-cache", cache, "--unix-socket", "none"};
  ASSERT_TRUE(d.Start(o));
  std::string log = d.Log();
  EXPECT_NE(log.find("images: using build " + cache + "/builds/older-complete.json"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("images: default rootfs " + rootfs), std::string::npos) << log;
  EXPECT_NE(log.find("images: python.wasm " + wasm), std::string::npos) << log;
  EXPECT_EQ(log.find("no image configured"), std::string::npos) << log;
  HttpResult h = d.Call("GET", "/healthz");
  ASSERT_EQ(h.status, 200);
  if (real) {
    const auto& drivers = h.obj().at("drivers").as_object();
    EXPECT_TRUE(drivers.contains("container")) << h.body;
    EXPECT_TRUE(drivers.contains("nano")) << h.body;
  }
  d.StopAndCleanup();
  fs::remove_all(cache);
}

TEST(EsbdStartTest, EnvironmentAndFlagsStillOverrideTheCache) {
  char tmpl[] = "/tmp/esb-cache-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string cache = tmpl;
  fs::create_directories(cache + "/builds");
  fs::create_directories(cache + "/rootfs/dddd");
  fs::create_directories(cache + "/python-wasm/dddd");
  fs::create_directories(cache + "/mine");
  WriteManifest(cache + "/builds/b.json", 1000, true, cache + "/rootfs/dddd",
                cache + "/python-wasm/dddd");
  Daemon d;
  Daemon::Options o;
  o.empty_environment = true;
  o.extra_args = {"--image-cache", cache,          "--unix-socket",
                  "none",          "--image",      "default=" + cache + "/mine",
                  "--python-wasm", cache + "/mine"};
  ASSERT_TRUE(d.Start(o));
  std::string log = d.Log();
  EXPECT_EQ(log.find("images: using build"), std::string::npos) << log;
  d.StopAndCleanup();
  fs::remove_all(cache);
}

}  // namespace
}  // namespace esb::testing

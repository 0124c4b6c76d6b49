// Unit tests of the files API's mutating operations against a temporary workspace (host mode,
// no sandbox). Attacks are named after what they try and assert that it fails and that nothing
// outside the workspace changed.
#include "agent/fs_ops.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace esb::agent {
namespace {

namespace fs = std::filesystem;

class FsOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/esb-fs-ops-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    ws_ = root_ + "/workspace";
    outside_ = root_ + "/outside";  // stands for /etc: must never change
    fs::create_directories(ws_);
    fs::create_directories(outside_);
    Touch(outside_ + "/passwd", "root:x:0:0\n");
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  static void Touch(const std::string& path, const std::string& data = "x") {
    std::ofstream(path) << data;
  }
  static bool Exists(const std::string& path) {
    struct stat st;
    return lstat(path.c_str(), &st) == 0;
  }
  void ExpectOutsideUntouched() {
    EXPECT_TRUE(fs::is_regular_file(outside_ + "/passwd"));
    EXPECT_EQ(std::distance(fs::directory_iterator(outside_), fs::directory_iterator()), 1)
        << "something was created in or moved into the directory outside the workspace";
  }

  std::string root_, ws_, outside_;
};

TEST_F(FsOpsTest, WorkspaceComponentsNormalisesInsideTheWorkspace) {
  std::vector<std::string> c;
  ASSERT_TRUE(WorkspaceComponents(ws_, "a/./b//c/../d", &c).ok());
  EXPECT_EQ(c, (std::vector<std::string>{"a", "b", "d"}));
  ASSERT_TRUE(WorkspaceComponents(ws_, ws_ + "/x/y", &c).ok());
  EXPECT_EQ(c, (std::vector<std::string>{"x", "y"}));
  ASSERT_TRUE(WorkspaceComponents(ws_, ws_, &c).ok());
  EXPECT_TRUE(c.empty());
  // `..` that leaves and re-enters the workspace is the same path on the text.
  ASSERT_TRUE(WorkspaceComponents(ws_, "../workspace/x", &c).ok());
  EXPECT_EQ(c, (std::vector<std::string>{"x"}));
  EXPECT_EQ(WorkspaceComponents(ws_, "../outside/x", &c).err, EINVAL);
  EXPECT_EQ(WorkspaceComponents(ws_, "/../../..", &c).err, EINVAL);
  EXPECT_EQ(WorkspaceComponents(ws_, "", &c).err, EINVAL);
  EXPECT_EQ(WorkspaceComponents(ws_, std::string(NAME_MAX + 1, 'a'), &c).err, ENAMETOOLONG);
}

TEST_F(FsOpsTest, MakeDirsCreatesParentsAndIsIdempotent) {
  bool created = false;
  FsResult r = MakeDirs(ws_, "a/b/c", &created);
  ASSERT_TRUE(r.ok()) << r.message;
  EXPECT_TRUE(created);
  EXPECT_TRUE(fs::is_directory(ws_ + "/a/b/c"));
  r = MakeDirs(ws_, ws_ + "/a/b/c", &created);
  ASSERT_TRUE(r.ok()) << r.message;
  EXPECT_FALSE(created);
}

TEST_F(FsOpsTest, MakeDirsOnAFileIsEexistAndThroughAFileIsEnotdir) {
  Touch(ws_ + "/f");
  bool created = true;
  EXPECT_EQ(MakeDirs(ws_, "f", &created).err, EEXIST);
  EXPECT_EQ(MakeDirs(ws_, "f/sub", &created).err, ENOTDIR);
}

TEST_F(FsOpsTest, DotDotTraversalIsRefusedInEveryPathField) {
  bool created = false;
  int64_t removed = 0;
  Touch(ws_ + "/a.txt");
  EXPECT_EQ(MakeDirs(ws_, "../outside/new", &created).err, EINVAL);
  EXPECT_EQ(MakeDirs(ws_, "a/../../outside/new", &created).err, EINVAL);
  EXPECT_EQ(Remove(ws_, "../outside/passwd", false, {}, &removed).err, EINVAL);
  EXPECT_EQ(Remove(ws_, "../outside", true, {}, &removed).err, EINVAL);
  EXPECT_EQ(Rename(ws_, "../outside/passwd", "stolen", false).err, EINVAL);
  EXPECT_EQ(Rename(ws_, "a.txt", "../outside/a.txt", false).err, EINVAL);
  EXPECT_EQ(Rename(ws_, ws_ + "/../outside/passwd", "stolen", false).err, EINVAL);
  EXPECT_FALSE(Exists(ws_ + "/stolen"));
  EXPECT_TRUE(Exists(ws_ + "/a.txt"));
  ExpectOutsideUntouched();
}

TEST_F(FsOpsTest, AbsolutePathsOutsideTheWorkspaceAreRefused) {
  bool created = false;
  int64_t removed = 0;
  Touch(ws_ + "/a.txt");
  EXPECT_EQ(MakeDirs(ws_, outside_ + "/new", &created).err, EINVAL);
  EXPECT_EQ(Remove(ws_, outside_ + "/passwd", false, {}, &removed).err, EINVAL);
  EXPECT_EQ(Rename(ws_, outside_ + "/passwd", "stolen", false).err, EINVAL);
  EXPECT_EQ(Rename(ws_, "a.txt", outside_ + "/a.txt", false).err, EINVAL);
  // A sibling whose name merely starts with the workspace's is outside too.
  EXPECT_EQ(MakeDirs(ws_, ws_ + "2/x", &created).err, EINVAL);
  EXPECT_EQ(MakeDirs(ws_, "/etc/esb-fs-ops-test", &created).err, EINVAL);
  EXPECT_FALSE(Exists("/etc/esb-fs-ops-test"));
  ExpectOutsideUntouched();
}

TEST_F(FsOpsTest, NulInAPathIsRefused) {
  bool created = false;
  int64_t removed = 0;
  std::string nul("a\0b", 3);
  EXPECT_EQ(MakeDirs(ws_, nul, &created).err, EINVAL);
  EXPECT_EQ(Remove(ws_, nul, true, {}, &removed).err, EINVAL);
  EXPECT_EQ(Rename(ws_, nul, "b", false).err, EINVAL);
  EXPECT_EQ(Rename(ws_, "b", nul, false).err, EINVAL);
}

TEST_F(FsOpsTest, SymlinkToOutsideAsMkdirParentIsRefused) {
  ASSERT_EQ(symlink(outside_.c_str(), (ws_ + "/link").c_str()), 0);
  ASSERT_EQ(symlink("/", (ws_ + "/root").c_str()), 0);
  bool created = false;
  EXPECT_EQ(MakeDirs(ws_, "link/new", &created).err, ELOOP);
  EXPECT_EQ(MakeDirs(ws_, "root/tmp/esb-fs-ops-escape", &created).err, ELOOP);
  EXPECT_FALSE(Exists("/tmp/esb-fs-ops-escape"));
  // mkdir of the link itself: it exists and is not a directory (never followed).
  EXPECT_EQ(MakeDirs(ws_, "link", &created).err, EEXIST);
  ExpectOutsideUntouched();
}

TEST_F(FsOpsTest, SymlinkToEtcAsMkdirParentIsRefused) {
  ASSERT_EQ(symlink("/etc", (ws_ + "/etc").c_str()), 0);
  bool created = false;
  FsResult r = MakeDirs(ws_, "etc/esb-fs-ops-test", &created);
  EXPECT_EQ(r.err, ELOOP) << r.message;
  EXPECT_FALSE(Exists("/etc/esb-fs-ops-test"));
}

TEST_F(FsOpsTest, SymlinkAsRenameSourceMovesTheLinkNotItsTarget) {
  ASSERT_EQ(symlink(outside_.c_str(), (ws_ + "/link").c_str()), 0);
  FsResult r = Rename(ws_, "link", "moved", false);
  ASSERT_TRUE(r.ok()) << r.message;
  EXPECT_TRUE(fs::is_symlink(ws_ + "/moved"));
  EXPECT_FALSE(Exists(ws_ + "/link"));
  ExpectOutsideUntouched();
}

TEST_F(FsOpsTest, SymlinkAsRenameSourceParentIsRefused) {
  ASSERT_EQ(symlink(outside_.c_str(), (ws_ + "/link").c_str()), 0);
  ASSERT_EQ(symlink("/etc", (ws_ + "/etc").c_str()), 0);
  EXPECT_EQ(Rename(ws_, "link/passwd", "stolen", false).err, ELOOP);
  EXPECT_EQ(Rename(ws_, "etc/passwd", "stolen", false).err, ELOOP);
  EXPECT_FALSE(Exists(ws_ + "/stolen"));
  EXPECT_TRUE(Exists("/etc/passwd"));
  ExpectOutsideUntouched();
}

TEST_F(FsOpsTest, SymlinkAsRenameDestinationParentIsRefused) {
  ASSERT_EQ(symlink(outside_.c_str(), (ws_ + "/link").c_str()), 0);
  ASSERT_EQ(symlink("/", (ws_ + "/root").c_str()), 0);
  Touch(ws_ + "/a.txt");
  EXPECT_EQ(Rename(ws_, "a.txt", "link/a.txt", false).err, ELOOP);
  EXPECT_EQ(Rename(ws_, "a.txt", "link/passwd", true).err, ELOOP);
  EXPECT_EQ(Rename(ws_, "a.txt", "root/tmp/esb-fs-ops-escape", false).err, ELOOP);
  EXPECT_FALSE(Exists("/tmp/esb-fs-ops-escape"));
  EXPECT_TRUE(Exists(ws_ + "/a.txt"));
  ExpectOutsideUntouched();
}

TEST_F(FsOpsTest, SymlinkAsRenameDestinationIsReplacedNotFollowed) {
  ASSERT_EQ(symlink((outside_ + "/passwd").c_str(), (ws_ + "/link").c_str()), 0);
  Touch(ws_ + "/a.txt", "mine");
  EXPECT_EQ(Rename(ws_, "a.txt", "link", false).err, EEXIST);
  FsResult r = Rename(ws_, "a.txt", "link", true);
  ASSERT_TRUE(r.ok()) << r.message;
  EXPECT_TRUE(fs::is_regular_file(fs::symlink_status(ws_ + "/link")));
  std::ifstream in(outside_ + "/passwd");
  std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(content, "root:x:0:0\n");
  ExpectOutsideUntouched();
}

TEST_F(FsOpsTest, RecursiveRemoveOfSymlinkDeletesTheLinkNeverItsTarget) {
  ASSERT_EQ(symlink(outside_.c_str(), (ws_ + "/link").c_str()), 0);
  ASSERT_EQ(symlink("/", (ws_ + "/root").c_str()), 0);
  int64_t removed = 0;
  FsResult r = Remove(ws_, "link", true, {}, &removed);
  ASSERT_TRUE(r.ok()) << r.message;
  r = Remove(ws_, "root", true, {}, &removed);
  ASSERT_TRUE(r.ok()) << r.message;
  EXPECT_EQ(removed, 1);
  EXPECT_FALSE(Exists(ws_ + "/link"));
  EXPECT_FALSE(Exists(ws_ + "/root"));
  ExpectOutsideUntouched();
}

TEST_F(FsOpsTest, RecursiveRemoveOfTreeWithSymlinksStaysInTheTree) {
  fs::create_directories(ws_ + "/tree/sub");
  Touch(ws_ + "/tree/sub/f");
  ASSERT_EQ(symlink(outside_.c_str(), (ws_ + "/tree/sub/out").c_str()), 0);
  ASSERT_EQ(symlink("/", (ws_ + "/tree/root").c_str()), 0);
  int64_t removed = 0;
  FsResult r = Remove(ws_, "tree", true, {}, &removed);
  ASSERT_TRUE(r.ok()) << r.message;
  EXPECT_EQ(removed, 5);
  EXPECT_FALSE(Exists(ws_ + "/tree"));
  ExpectOutsideUntouched();
}

TEST_F(FsOpsTest, RemoveThroughASymlinkedParentIsRefused) {
  ASSERT_EQ(symlink(outside_.c_str(), (ws_ + "/link").c_str()), 0);
  int64_t removed = 0;
  EXPECT_EQ(Remove(ws_, "link/passwd", false, {}, &removed).err, ELOOP);
  ExpectOutsideUntouched();
}

TEST_F(FsOpsTest, RenameOntoProcIsRefused) {
  Touch(ws_ + "/a.txt");
  ASSERT_EQ(symlink("/proc", (ws_ + "/proc").c_str()), 0);
  EXPECT_EQ(Rename(ws_, "a.txt", "/proc/self/fd/0", true).err, EINVAL);
  EXPECT_EQ(Rename(ws_, "a.txt", "/proc/sys/kernel/core_pattern", true).err, EINVAL);
  EXPECT_EQ(Rename(ws_, "a.txt", "proc/self/fd/0", true).err, ELOOP);
  EXPECT_EQ(Rename(ws_, "proc/self/environ", "env", false).err, ELOOP);
  EXPECT_TRUE(Exists(ws_ + "/a.txt"));
}

TEST_F(FsOpsTest, RemoveAndRenameRefuseTheWorkspaceItself) {
  int64_t removed = 0;
  EXPECT_EQ(Remove(ws_, ".", true, {}, &removed).err, EINVAL);
  EXPECT_EQ(Remove(ws_, ws_, true, {}, &removed).err, EINVAL);
  EXPECT_EQ(Remove(ws_, "a/..", true, {}, &removed).err, EINVAL);
  EXPECT_EQ(Rename(ws_, ".", "x", false).err, EINVAL);
  EXPECT_EQ(Rename(ws_, "x", ws_ + "/", false).err, EINVAL);
  EXPECT_TRUE(fs::is_directory(ws_));
}

// Volumes: a second root (stands for /mnt/<vol>) that mkdir, remove and rename reach like the
// workspace, with the same walk from its own descriptor.
TEST_F(FsOpsTest, RootComponentsPicksTheRootThePathIsIn) {
  const std::string vol = root_ + "/vol";
  FsRoots roots(ws_, {vol});
  std::vector<std::string> c;
  std::string r;
  ASSERT_TRUE(RootComponents(roots, "a/b", &r, &c).ok());
  EXPECT_EQ(r, ws_);
  EXPECT_EQ(c, (std::vector<std::string>{"a", "b"}));
  ASSERT_TRUE(RootComponents(roots, vol + "/x/./y/../z", &r, &c).ok());
  EXPECT_EQ(r, vol);
  EXPECT_EQ(c, (std::vector<std::string>{"x", "z"}));
  ASSERT_TRUE(RootComponents(roots, vol, &r, &c).ok());
  EXPECT_TRUE(c.empty());
  EXPECT_EQ(RootComponents(roots, root_ + "/volx/a", &r, &c).err, EINVAL);
  EXPECT_EQ(RootComponents(roots, vol + "/../outside/passwd", &r, &c).err, EINVAL);
  EXPECT_EQ(RootComponents(FsRoots(ws_), vol + "/a", &r, &c).err, EINVAL);
}

TEST_F(FsOpsTest, MkdirRenameRemoveWorkInsideAVolume) {
  const std::string vol = root_ + "/vol";
  fs::create_directories(vol);
  FsRoots roots(ws_, {vol});
  bool created = false;
  FsResult r = MakeDirs(roots, vol + "/d/e", &created);
  ASSERT_TRUE(r.ok()) << r.message;
  EXPECT_TRUE(created);
  EXPECT_TRUE(fs::is_directory(vol + "/d/e"));
  r = Rename(roots, vol + "/d/e", vol + "/f", false);
  ASSERT_TRUE(r.ok()) << r.message;
  EXPECT_TRUE(fs::is_directory(vol + "/f"));
  int64_t removed = 0;
  r = Remove(roots, vol + "/d", true, {}, &removed);
  ASSERT_TRUE(r.ok()) << r.message;
  EXPECT_FALSE(Exists(vol + "/d"));
}

TEST_F(FsOpsTest, SymlinkInAVolumeToWorkspaceOrRootIsNotFollowed) {
  const std::string vol = root_ + "/vol";
  fs::create_directories(vol);
  Touch(ws_ + "/keep");
  ASSERT_EQ(symlink(ws_.c_str(), (vol + "/ws").c_str()), 0);
  ASSERT_EQ(symlink(outside_.c_str(), (vol + "/out").c_str()), 0);
  FsRoots roots(ws_, {vol});
  int64_t removed = 0;
  EXPECT_EQ(Remove(roots, vol + "/ws/keep", false, {}, &removed).err, ELOOP);
  EXPECT_EQ(Remove(roots, vol + "/out/passwd", false, {}, &removed).err, ELOOP);
  EXPECT_EQ(Rename(roots, vol + "/out/passwd", vol + "/p", false).err, ELOOP);
  bool created = false;
  EXPECT_EQ(MakeDirs(roots, vol + "/out/new", &created).err, ELOOP);
  FsResult r = Remove(roots, vol + "/ws", true, {}, &removed);  // the link, not the workspace
  ASSERT_TRUE(r.ok()) << r.message;
  EXPECT_TRUE(Exists(ws_ + "/keep"));
  ExpectOutsideUntouched();
}

TEST_F(FsOpsTest, RenameAcrossRootsAndOfAVolumeRootIsRefused) {
  const std::string vol = root_ + "/vol";
  fs::create_directories(vol);
  Touch(ws_ + "/a");
  Touch(vol + "/b");
  FsRoots roots(ws_, {vol});
  FsResult r = Rename(roots, "a", vol + "/a", false);
  EXPECT_EQ(r.err, EINVAL);
  EXPECT_NE(r.message.find("different roots"), std::string::npos) << r.message;
  EXPECT_EQ(Rename(roots, vol + "/b", ws_ + "/b", false).err, EINVAL);
  EXPECT_EQ(Rename(roots, vol, ws_ + "/v", false).err, EINVAL);
  int64_t removed = 0;
  EXPECT_EQ(Remove(roots, vol, true, {}, &removed).err, EINVAL);
  EXPECT_EQ(Remove(roots, vol + "/.", true, {}, &removed).err, EINVAL);
  EXPECT_TRUE(Exists(ws_ + "/a"));
  EXPECT_TRUE(Exists(vol + "/b"));
}

TEST_F(FsOpsTest, RemoveReportsMissingAndNonEmpty) {
  int64_t removed = 0;
  EXPECT_EQ(Remove(ws_, "missing", false, {}, &removed).err, ENOENT);
  EXPECT_EQ(Remove(ws_, "missing", true, {}, &removed).err, ENOENT);
  fs::create_directories(ws_ + "/d");
  Touch(ws_ + "/d/f");
  EXPECT_EQ(Remove(ws_, "d", false, {}, &removed).err, ENOTEMPTY);
  ASSERT_TRUE(Remove(ws_, "d/f", false, {}, &removed).ok());
  ASSERT_TRUE(Remove(ws_, "d", false, {}, &removed).ok());
  EXPECT_FALSE(Exists(ws_ + "/d"));
}

TEST_F(FsOpsTest, RenameNoReplaceOverwriteAndIntoItself) {
  Touch(ws_ + "/a", "a");
  Touch(ws_ + "/b", "b");
  EXPECT_EQ(Rename(ws_, "a", "b", false).err, EEXIST);
  EXPECT_EQ(Rename(ws_, "missing", "c", false).err, ENOENT);
  ASSERT_TRUE(Rename(ws_, "a", "b", true).ok());
  EXPECT_FALSE(Exists(ws_ + "/a"));
  fs::create_directories(ws_ + "/d/e");
  EXPECT_EQ(Rename(ws_, "d", "d/e/f", false).err, EINVAL);
  ASSERT_TRUE(Rename(ws_, "d", "sub/../d2", false).ok());
  EXPECT_TRUE(fs::is_directory(ws_ + "/d2/e"));
}

TEST_F(FsOpsTest, RecursiveRemoveOfAHugeTreeIsBoundedInTime) {
  // 20,000 files in 100 directories; a 1 ms budget must stop the walk with a clear error,
  // leaving a tree that a second call (normal budget) removes completely.
  for (int d = 0; d < 100; ++d) {
    std::string dir = ws_ + "/huge/d" + std::to_string(d);
    fs::create_directories(dir);
    for (int f = 0; f < 200; ++f) {
      int fd = open((dir + "/f" + std::to_string(f)).c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
      ASSERT_GE(fd, 0);
      close(fd);
    }
  }
  int64_t removed = 0;
  RemoveLimits tight;
  tight.time_budget_ms = 1;
  auto start = std::chrono::steady_clock::now();
  FsResult r = Remove(ws_, "huge", true, tight, &removed);
  auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(r.err, ETIMEDOUT) << r.message;
  EXPECT_NE(r.message.find("call again"), std::string::npos) << r.message;
  EXPECT_LT(removed, 20100);
  EXPECT_LT(took, std::chrono::seconds(2));
  EXPECT_TRUE(Exists(ws_ + "/huge"));
  r = Remove(ws_, "huge", true, {}, &removed);
  ASSERT_TRUE(r.ok()) << r.message;
  EXPECT_FALSE(Exists(ws_ + "/huge"));
}

TEST_F(FsOpsTest, RecursiveRemoveOfATooDeepTreeIsRefused) {
  std::string dir = ws_ + "/deep";
  fs::create_directories(dir);
  int fd = open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  for (int i = 0; i < 40; ++i) {
    ASSERT_EQ(mkdirat(fd, "d", 0755), 0);
    int next = openat(fd, "d", O_PATH | O_DIRECTORY | O_CLOEXEC);
    close(fd);
    fd = next;
    ASSERT_GE(fd, 0);
  }
  close(fd);
  int64_t removed = 0;
  RemoveLimits shallow;
  shallow.max_depth = 16;
  FsResult r = Remove(ws_, "deep", true, shallow, &removed);
  EXPECT_EQ(r.err, ELOOP) << r.message;
  EXPECT_NE(r.message.find("deeper than 16"), std::string::npos) << r.message;
  r = Remove(ws_, "deep", true, {}, &removed);
  ASSERT_TRUE(r.ok()) << r.message;
  EXPECT_EQ(removed, 41);
}

}  // namespace
}  // namespace esb::agent

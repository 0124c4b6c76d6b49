// Time travel's workspace walk and apply (agent/workspace.h) against a temporary workspace (no
// root, no sandbox): a walk then an apply of it elsewhere reproduces files, modes, symlinks and
// mtimes; unchanged files are not read again; apply never follows a planted symlink out of
// the workspace and refuses bad manifests.
#include "agent/workspace.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace esb::agent {
namespace {

namespace fs = std::filesystem;
namespace json = boost::json;

class WorkspaceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/esb-ws-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    ws_ = root_ + "/workspace";
    other_ = root_ + "/other";
    outside_ = root_ + "/outside";
    fs::create_directories(ws_);
    fs::create_directories(other_);
    fs::create_directories(outside_);
    Write(outside_ + "/passwd", "root:x:0:0\n");
  }
  void TearDown() override {
    std::error_code ec;
    fs::permissions(root_, fs::perms::all, ec);
    for (auto it = fs::recursive_directory_iterator(root_, ec);
         it != fs::recursive_directory_iterator(); it.increment(ec)) {
      if (!it->is_symlink())
        fs::permissions(it->path(), fs::perms::owner_all, fs::perm_options::add, ec);
    }
    fs::remove_all(root_, ec);
  }
  static void Write(const std::string& path, const std::string& data) {
    std::ofstream(path, std::ios::binary) << data;
  }
  static std::string Read(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  // The tree as text: path, type, mode, size, content or target, mtime.
  static std::map<std::string, std::string> Tree(const std::string& dir) {
    std::map<std::string, std::string> out;
    for (const auto& e : fs::recursive_directory_iterator(dir)) {
      struct stat st;
      lstat(e.path().c_str(), &st);
      std::string rel = fs::relative(e.path(), dir).string();
      std::string v = std::to_string(st.st_mode) + " " +
                      std::to_string(st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec);
      if (S_ISREG(st.st_mode)) v += " f " + Read(e.path());
      if (S_ISLNK(st.st_mode)) v += " l " + fs::read_symlink(e.path()).string();
      out[rel] = v;
    }
    return out;
  }
  // A walk of `from` with every file's content, as an apply manifest.
  std::vector<ApplyEntry> Manifest(const std::string& from) {
    WalkResult w = WalkWorkspace(from, WalkLimits{}, [](const WalkEntry&) { return true; });
    EXPECT_TRUE(w.status.ok()) << w.status.message;
    std::vector<ApplyEntry> out;
    for (const WalkEntry& e : w.entries) {
      ApplyEntry a;
      a.path = e.path;
      a.type = e.type;
      a.mode = e.mode;
      a.size = e.size;
      a.mtime_ns = e.mtime_ns;
      a.target = e.target;
      a.has_data = e.type == 'f';
      a.data = e.content;
      out.push_back(a);
    }
    return out;
  }

  std::string root_, ws_, other_, outside_;
};

void Populate(const std::string& ws) {
  fs::create_directories(ws + "/src/deep/er");
  std::ofstream(ws + "/a.txt") << "alpha";
  std::ofstream(ws + "/src/main.py") << "print(1)\n";
  std::ofstream(ws + "/src/deep/er/x.bin", std::ios::binary) << std::string("\0\1\2", 3);
  chmod((ws + "/src/main.py").c_str(), 0755);
  chmod((ws + "/src/deep").c_str(), 0750);
  symlink("../a.txt", (ws + "/src/link").c_str());
  symlink("/etc/passwd", (ws + "/abs-link").c_str());
}

TEST_F(WorkspaceTest, WalkReportsEveryEntrySortedWithKeysAndWantedContents) {
  Populate(ws_);
  WalkResult w =
      WalkWorkspace(ws_, WalkLimits{}, [](const WalkEntry& e) { return e.path == "a.txt"; });
  ASSERT_TRUE(w.status.ok()) << w.status.message;
  std::vector<std::string> paths;
  for (const auto& e : w.entries) paths.push_back(e.path);
  EXPECT_EQ(paths, (std::vector<std::string>{"a.txt", "abs-link", "src", "src/deep", "src/deep/er",
                                             "src/deep/er/x.bin", "src/link", "src/main.py"}));
  EXPECT_TRUE(w.entries[0].has_content);
  EXPECT_EQ(w.entries[0].content, "alpha");
  EXPECT_FALSE(w.entries[7].has_content);
  EXPECT_EQ(w.entries[7].mode, 0755u);
  EXPECT_EQ(w.entries[1].type, 'l');
  EXPECT_EQ(w.entries[1].target, "/etc/passwd");
  EXPECT_EQ(w.entries[3].mode, 0750u);
  struct stat st;
  lstat((ws_ + "/a.txt").c_str(), &st);
  EXPECT_EQ(w.entries[0].change_key,
            std::to_string(st.st_ino) + ":" +
                std::to_string(st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec));
}

TEST_F(WorkspaceTest, ApplyReproducesTheTreeExactlyAndRemovesExtras) {
  Populate(ws_);
  std::vector<ApplyEntry> m = Manifest(ws_);
  // The target has extras, a file where a directory should be, a wrong mode and content.
  fs::create_directories(other_ + "/extra/dir");
  Write(other_ + "/extra/dir/f", "x");
  Write(other_ + "/src", "a file where the directory is");
  Write(other_ + "/a.txt", "stale");
  symlink("elsewhere", (other_ + "/abs-link").c_str());
  ApplyStats stats;
  FsResult r = ApplyWorkspace(other_, m, /*prune=*/true, true, &stats);
  ASSERT_TRUE(r.ok()) << r.message;
  EXPECT_EQ(Tree(other_), Tree(ws_));
  EXPECT_GE(stats.removed, 3);
}

TEST_F(WorkspaceTest, ApplyKeepsFilesSentWithoutDataAndRefusesMissingOnes) {
  Populate(ws_);
  fs::copy(ws_, other_,
           fs::copy_options::recursive | fs::copy_options::copy_symlinks |
               fs::copy_options::overwrite_existing);
  std::vector<ApplyEntry> m = Manifest(ws_);
  for (ApplyEntry& e : m) e.has_data = false, e.data.clear();
  ApplyStats stats;
  ASSERT_TRUE(ApplyWorkspace(other_, m, true, true, &stats).ok());
  EXPECT_EQ(stats.written, 0);
  // An entry that already is as the manifest says is not touched at all: its ctime (the
  // change key that lets the next capture and restore skip it) stays.
  struct stat before, after;
  ASSERT_EQ(lstat((other_ + "/src/main.py").c_str(), &before), 0);
  ASSERT_TRUE(ApplyWorkspace(other_, m, true, true, &stats).ok());
  ASSERT_EQ(lstat((other_ + "/src/main.py").c_str(), &after), 0);
  EXPECT_EQ(before.st_ctim.tv_nsec, after.st_ctim.tv_nsec);
  EXPECT_EQ(before.st_ctim.tv_sec, after.st_ctim.tv_sec);
  EXPECT_EQ(Read(other_ + "/src/main.py"), "print(1)\n");
  fs::remove(other_ + "/a.txt");
  FsResult r = ApplyWorkspace(other_, m, true, true, &stats);
  EXPECT_EQ(r.err, ENOENT) << r.message;
}

TEST_F(WorkspaceTest, ApplyThroughAPlantedSymlinkDirectoryIsRefused) {
  // The sandbox replaced the directory "src" by a link to a directory outside.
  symlink(outside_.c_str(), (other_ + "/src").c_str());
  std::vector<ApplyEntry> m(1);
  m[0].path = "src/passwd";
  m[0].has_data = true;
  m[0].data = "pwned";
  m[0].size = 5;
  ApplyStats stats;
  FsResult r = ApplyWorkspace(other_, m, /*prune=*/false, false, &stats);
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(Read(outside_ + "/passwd"), "root:x:0:0\n");
  // With prune the link is removed (it is not in the manifest as a link) and a real directory
  // made in its place.
  std::vector<ApplyEntry> full(2);
  full[0].path = "src";
  full[0].type = 'd';
  full[0].mode = 0755;
  full[1] = m[0];
  ASSERT_TRUE(ApplyWorkspace(other_, full, true, true, &stats).ok());
  EXPECT_EQ(Read(outside_ + "/passwd"), "root:x:0:0\n");
  EXPECT_EQ(Read(other_ + "/src/passwd"), "pwned");
  EXPECT_FALSE(fs::is_symlink(other_ + "/src"));
}

TEST_F(WorkspaceTest, ApplyWritingOverAPlantedFileSymlinkReplacesTheLinkNotItsTarget) {
  symlink((outside_ + "/passwd").c_str(), (other_ + "/f").c_str());
  std::vector<ApplyEntry> m(1);
  m[0].path = "f";
  m[0].has_data = true;
  m[0].data = "new";
  m[0].size = 3;
  m[0].mode = 0644;
  ApplyStats stats;
  EXPECT_FALSE(ApplyWorkspace(other_, m, false, false, &stats).ok());  // not pruned: link refused
  ASSERT_TRUE(ApplyWorkspace(other_, m, true, true, &stats).ok());
  EXPECT_EQ(Read(outside_ + "/passwd"), "root:x:0:0\n");
  EXPECT_EQ(Read(other_ + "/f"), "new");
  EXPECT_FALSE(fs::is_symlink(other_ + "/f"));
}

TEST_F(WorkspaceTest, ApplyRefusesBadPathsUnsortedAndDuplicateEntries) {
  for (const char* bad : {"../x", "/etc/passwd", "a/../../x", "a//b", "./a", "", "a/."}) {
    std::vector<ApplyEntry> m(1);
    m[0].path = bad;
    m[0].has_data = true;
    ApplyStats stats;
    FsResult r = ApplyWorkspace(other_, m, true, true, &stats);
    EXPECT_EQ(r.err, EINVAL) << bad;
  }
  std::vector<ApplyEntry> dup(2);
  dup[0].path = dup[1].path = "a";
  dup[0].has_data = dup[1].has_data = true;
  ApplyStats stats;
  EXPECT_EQ(ApplyWorkspace(other_, dup, true, true, &stats).err, EINVAL);
  std::vector<ApplyEntry> unsorted(2);
  unsorted[0].path = "b";
  unsorted[1].path = "a";
  EXPECT_EQ(ApplyWorkspace(other_, unsorted, true, true, &stats).err, EINVAL);
  EXPECT_EQ(Read(outside_ + "/passwd"), "root:x:0:0\n");
  EXPECT_TRUE(fs::is_empty(other_));
}

TEST_F(WorkspaceTest, ApplyInChunksThenPrune) {
  std::string big(3 << 20, 'z');
  std::vector<ApplyEntry> part(2);
  part[0].path = part[1].path = "big";
  part[0].has_data = part[1].has_data = true;
  part[0].data = big.substr(0, 1 << 20);
  part[1].data = big.substr(1 << 20);
  part[1].offset = 1 << 20;
  ApplyStats stats;
  ASSERT_TRUE(ApplyWorkspace(other_, part, false, false, &stats).ok());
  std::vector<ApplyEntry> fin(1);
  fin[0].path = "big";
  fin[0].size = static_cast<int64_t>(big.size());
  fin[0].mode = 0600;
  ASSERT_TRUE(ApplyWorkspace(other_, fin, true, true, &stats).ok());
  EXPECT_EQ(Read(other_ + "/big"), big);
  fin[0].size = 5;  // a size that does not match is an error, not a silent difference
  EXPECT_EQ(ApplyWorkspace(other_, fin, true, true, &stats).err, EIO);
}

TEST_F(WorkspaceTest, WalkHandlerSendsOnlyChangedFilesAgainstItsBase) {
  Populate(ws_);
  WalkCache cache;
  json::object req;
  req["op"] = "walk";
  proto::Frame first = HandleWalk(ws_, req, &cache);
  ASSERT_TRUE(first.header["ok"].as_bool()) << json::serialize(first.header);
  EXPECT_EQ(first.header["content_bytes"].as_int64(), 5 + 9 + 3);
  req["base"] = first.header["walk"];
  proto::Frame same = HandleWalk(ws_, req, &cache);
  EXPECT_EQ(same.header["content_bytes"].as_int64(), 0);
  Write(ws_ + "/src/main.py", "print(2)\n");
  req["base"] = same.header["walk"];
  proto::Frame changed = HandleWalk(ws_, req, &cache);
  EXPECT_EQ(changed.header["content_bytes"].as_int64(), 9);
  const int64_t mb = changed.header["manifest_bytes"].as_int64();
  EXPECT_EQ(changed.payload.substr(static_cast<size_t>(mb)), "print(2)\n");
  json::value m = json::parse(changed.payload.substr(0, static_cast<size_t>(mb)));
  EXPECT_EQ(m.as_array().size(), 8u);
  // An unknown base (another agent, a restart): everything is sent again.
  req["base"] = "nope";
  EXPECT_EQ(HandleWalk(ws_, req, &cache).header["content_bytes"].as_int64(), 5 + 9 + 3);
}

TEST_F(WorkspaceTest, WalkSkipsNonUtf8NamesAndApplyRemovesThem) {
  Write(ws_ + "/ok", "1");
  Write(ws_ + "/bad\xff", "2");
  WalkResult w = WalkWorkspace(ws_, WalkLimits{}, nullptr);
  ASSERT_TRUE(w.status.ok());
  EXPECT_EQ(w.entries.size(), 1u);
  EXPECT_EQ(w.skipped, 1);
  std::vector<ApplyEntry> m(1);
  m[0].path = "ok";
  m[0].size = 1;
  m[0].mode = 0644;
  ApplyStats stats;
  ASSERT_TRUE(ApplyWorkspace(ws_, m, true, true, &stats).ok());
  EXPECT_FALSE(fs::exists(ws_ + "/bad\xff"));
}

TEST_F(WorkspaceTest, WalkFailsOnADirectoryItCannotReadInsteadOfLosingItsContents) {
  if (geteuid() == 0) GTEST_SKIP() << "root reads a mode-0 directory anyway (CAP_DAC_OVERRIDE)";
  fs::create_directories(ws_ + "/locked");
  Write(ws_ + "/locked/f", "x");
  chmod((ws_ + "/locked").c_str(), 0);
  WalkResult w = WalkWorkspace(ws_, WalkLimits{}, nullptr);
  EXPECT_EQ(w.status.err, EACCES) << w.status.message;
  chmod((ws_ + "/locked").c_str(), 0755);
}

// Review L3: the finish pass stat'ed an entry, then chmod'ed it by name (following links): a
// sandbox swapping the entry for a symlink in between had the target's mode changed. The
// attack races a swapper thread (file <-> symlink to a file outside) against applies.
TEST_F(WorkspaceTest, ChmodAttackSwappingInASymlinkDuringApplyNeverChangesTheTarget) {
  const std::string target = outside_ + "/passwd";
  chmod(target.c_str(), 0644);
  std::vector<ApplyEntry> m(1);
  m[0].path = "f";
  m[0].type = 'f';
  m[0].mode = 0600;  // differs from the swapped-in file's 0644: a chmod is due every time
  m[0].size = 1;
  std::atomic<bool> stop{false};
  std::thread swapper([&] {
    const std::string f = ws_ + "/f", link = ws_ + "/l.tmp", real = ws_ + "/r.tmp";
    while (!stop.load()) {
      symlink(target.c_str(), link.c_str());
      rename(link.c_str(), f.c_str());
      int fd = open(real.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        if (write(fd, "x", 1) != 1) {
        }
        fchmod(fd, 0644);
        close(fd);
      }
      rename(real.c_str(), f.c_str());
    }
  });
  int chmods_reached = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  while (std::chrono::steady_clock::now() < deadline) {
    ApplyStats stats;
    FsResult r = ApplyWorkspace(ws_, m, /*prune=*/false, /*finish=*/true, &stats);
    if (r.ok()) ++chmods_reached;
    struct stat st;
    ASSERT_EQ(stat(target.c_str(), &st), 0);
    if ((st.st_mode & 07777) != 0644) break;
  }
  stop = true;
  swapper.join();
  struct stat st;
  ASSERT_EQ(stat(target.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0644u) << "apply chmod'ed a symlink's target outside";
  EXPECT_GT(chmods_reached, 0) << "the race never let an apply through: the test tested nothing";
}

// Review L3: a file rewritten in place (O_TRUNC) wrote through every hard link to it: a sandbox
// that hard-links a workspace file to another file (outside /workspace when they share a file
// system, as here) had that file overwritten by the restore. Files are replaced instead.
TEST_F(WorkspaceTest, HardLinkAttackApplyNeverWritesThroughALinkToAnotherFile) {
  const std::string target = outside_ + "/passwd";
  ASSERT_EQ(link(target.c_str(), (ws_ + "/a").c_str()), 0);
  ASSERT_EQ(link(target.c_str(), (ws_ + "/b").c_str()), 0);
  std::vector<ApplyEntry> m(2);
  m[0].path = "a";
  m[0].size = 7;
  m[0].mode = 0644;
  m[0].has_data = true;
  m[0].data = "applied";
  m[1].path = "b";
  m[1].size = 11;
  m[1].mode = 0644;  // kept (no data): must still be what it was
  ApplyStats stats;
  FsResult r = ApplyWorkspace(ws_, m, /*prune=*/true, /*finish=*/true, &stats);
  ASSERT_TRUE(r.ok()) << r.message;
  EXPECT_EQ(Read(ws_ + "/a"), "applied");
  EXPECT_EQ(Read(target), "root:x:0:0\n") << "written through a hard link";
  EXPECT_EQ(Read(ws_ + "/b"), "root:x:0:0\n");
  struct stat st;
  ASSERT_EQ(stat((ws_ + "/a").c_str(), &st), 0);
  EXPECT_EQ(st.st_nlink, 1u);
  // A chunk after the first (offset > 0) appends to the file the restore made; a link made to
  // it in between (the sandbox racing the restore) makes the chunk fail, never write through.
  std::vector<ApplyEntry> c(1);
  c[0].path = "c";
  c[0].has_data = true;
  c[0].data = "first";
  ASSERT_TRUE(ApplyWorkspace(ws_, c, false, false, &stats).ok());
  ASSERT_EQ(unlink((ws_ + "/c").c_str()), 0);
  ASSERT_EQ(link(target.c_str(), (ws_ + "/c").c_str()), 0);
  c[0].offset = 5;
  c[0].data = "second";
  r = ApplyWorkspace(ws_, c, false, false, &stats);
  EXPECT_EQ(r.err, EMLINK) << r.message;
  EXPECT_EQ(Read(target), "root:x:0:0\n") << "a chunk wrote through a hard link";
}

TEST_F(WorkspaceTest, WalkStopsAtItsEntryLimit) {
  for (int i = 0; i < 20; ++i) Write(ws_ + "/f" + std::to_string(i), "x");
  WalkLimits limits;
  limits.max_entries = 10;
  WalkResult w = WalkWorkspace(ws_, limits, nullptr);
  EXPECT_EQ(w.status.err, EFBIG);
  EXPECT_TRUE(w.truncated);
}

}  // namespace
}  // namespace esb::agent

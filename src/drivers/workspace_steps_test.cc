// Time travel through the real esb-agent (a child process on a temporary workspace, no root):
// the state after restore equals the state at capture (files, modes, symlinks, mtimes, the
// shell's cwd and variables), a capture of unchanged files stores nothing new, and hostile
// walk replies are refused.
#include "drivers/workspace_steps.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "agent/test_agent_process.h"
#include "drivers/testing/memory_blob_store.h"

namespace esb {
namespace {

namespace fs = std::filesystem;
using ::esb::testing::AgentProcess;
using ::esb::testing::MemoryBlobStore;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteFile(const std::string& path, const std::string& data) {
  std::ofstream(path, std::ios::binary) << data;
}

// The tree as text: mode (type + permissions), mtime, and contents or link target.
std::map<std::string, std::string> Tree(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    struct stat st;
    lstat(e.path().c_str(), &st);
    std::string v = std::to_string(st.st_mode) + " " +
                    std::to_string(st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec);
    if (S_ISREG(st.st_mode)) v += " f " + ReadFile(e.path());
    if (S_ISLNK(st.st_mode)) v += " l " + fs::read_symlink(e.path()).string();
    out[fs::relative(e.path(), dir).string()] = v;
  }
  return out;
}

class WorkspaceStepsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_GT(agent_.pid(), 0) << "could not start " << ESB_AGENT_BINARY;
    ASSERT_TRUE(agent_.WaitReady()) << "agent did not listen on " << agent_.socket_path();
    ws_ = agent_.workspace();
  }
  ExecResult Run(const std::string& command) {
    ExecRequest r;
    r.command = command;
    r.timeout = std::chrono::milliseconds(10000);
    absl::StatusOr<ExecResult> result = client_.Exec(r, nullptr);
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? *result : ExecResult{};
  }
  void Populate() {
    fs::create_directories(ws_ + "/src/pkg");
    WriteFile(ws_ + "/a.txt", "alpha");
    WriteFile(ws_ + "/src/main.py", "print('hi')\n");
    WriteFile(ws_ + "/src/pkg/data.bin", std::string("\0\1\2\3", 4));
    WriteFile(ws_ + "/empty", "");
    chmod((ws_ + "/src/main.py").c_str(), 0755);
    chmod((ws_ + "/src/pkg").c_str(), 0750);
    symlink("../a.txt", (ws_ + "/src/link").c_str());
    symlink("/etc/passwd", (ws_ + "/outside-link").c_str());
  }

  AgentProcess agent_;
  AgentClient client_{AgentClient::UnixSocket(agent_.socket_path())};
  std::string ws_;
  MemoryBlobStore blobs_;
};

TEST_F(WorkspaceStepsTest, RestoreGivesBackExactlyTheCapturedTree) {
  Populate();
  const auto at_capture = Tree(ws_);
  std::string base;
  absl::StatusOr<WorkspaceManifest> m = CaptureAgentWorkspace(client_, blobs_, {}, &base);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->entries.size(), 8u);
  EXPECT_EQ(m->total_bytes, 5 + 12 + 4);
  // Everything changes: contents, a removal, extras, a mode, a link's target, a type.
  WriteFile(ws_ + "/a.txt", "changed!");
  fs::remove(ws_ + "/src/main.py");
  fs::create_directories(ws_ + "/new/dir");
  WriteFile(ws_ + "/new/dir/f", "extra");
  chmod((ws_ + "/src/pkg").c_str(), 0700);
  fs::remove(ws_ + "/src/link");
  symlink("/somewhere/else", (ws_ + "/src/link").c_str());
  fs::remove(ws_ + "/empty");
  fs::create_directories(ws_ + "/empty");
  ASSERT_NE(Tree(ws_), at_capture);
  WorkspaceManifest known;
  ASSERT_TRUE(RestoreAgentWorkspace(client_, blobs_, *m, &base, &known).ok());
  EXPECT_EQ(Tree(ws_), at_capture);
  EXPECT_EQ(known.entries.size(), 4u) << "every file of the step, with its key of now";
  // The next capture knows the rewritten files: nothing is read or stored again.
  const int before = blobs_.puts();
  CaptureOptions options;
  options.previous = &*m;
  absl::StatusOr<WorkspaceManifest> again =
      CaptureAgentWorkspace(client_, blobs_, options, &base, &known);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(blobs_.puts(), before);
  ASSERT_EQ(again->entries.size(), m->entries.size());
  for (size_t i = 0; i < m->entries.size(); ++i)
    EXPECT_EQ(again->entries[i].sha256, m->entries[i].sha256) << m->entries[i].path;
  // And again from there (the restore is idempotent and rewrites nothing unchanged).
  const int puts = blobs_.puts();
  ASSERT_TRUE(RestoreAgentWorkspace(client_, blobs_, *m, &base).ok());
  EXPECT_EQ(Tree(ws_), at_capture);
  EXPECT_EQ(blobs_.puts(), puts);
}

TEST_F(WorkspaceStepsTest, CaptureOfUnchangedFilesStoresNothingNew) {
  Populate();
  std::string base;
  absl::StatusOr<WorkspaceManifest> first = CaptureAgentWorkspace(client_, blobs_, {}, &base);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(blobs_.puts(), 4);  // four files
  CaptureOptions options;
  options.previous = &*first;
  absl::StatusOr<WorkspaceManifest> second = CaptureAgentWorkspace(client_, blobs_, options, &base);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(blobs_.puts(), 4) << "an unchanged workspace was read again";
  WriteFile(ws_ + "/src/main.py", "print('bye')\n");
  options.previous = &*second;
  absl::StatusOr<WorkspaceManifest> third = CaptureAgentWorkspace(client_, blobs_, options, &base);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(blobs_.puts(), 5) << "exactly the one changed file is stored";
  // With another base (an esbd restart: the agent's last walk is not ours) the previous
  // manifest still saves every unchanged file.
  std::string fresh;
  options.previous = &*third;
  ASSERT_TRUE(CaptureAgentWorkspace(client_, blobs_, options, &fresh).ok());
  EXPECT_EQ(blobs_.puts(), 5);
  // The hashes are the host's: the blob of main.py is the SHA-256 of what is there now.
  for (const ManifestEntry& e : third->entries) {
    if (e.path == "src/main.py") EXPECT_EQ(*blobs_.Get(e.sha256), "print('bye')\n");
  }
}

TEST_F(WorkspaceStepsTest, LargeFilesTravelInChunksBothWays) {
  // Larger than one walk's content budget and one apply call: read and written in pieces.
  std::string big(9 << 20, 'x');
  for (size_t i = 0; i < big.size(); i += 4096) big[i] = static_cast<char>('a' + i % 26);
  WriteFile(ws_ + "/big.bin", big);
  WriteFile(ws_ + "/small", "s");
  std::string base;
  absl::StatusOr<WorkspaceManifest> m = CaptureAgentWorkspace(client_, blobs_, {}, &base);
  ASSERT_TRUE(m.ok()) << m.status();
  const auto at_capture = Tree(ws_);
  WriteFile(ws_ + "/big.bin", "short");
  fs::remove(ws_ + "/small");
  ASSERT_TRUE(RestoreAgentWorkspace(client_, blobs_, *m, &base).ok());
  EXPECT_EQ(Tree(ws_), at_capture);
}

TEST_F(WorkspaceStepsTest, CaptureOverTheCapsIsRefused) {
  Populate();
  std::string base;
  CaptureOptions options;
  options.max_files = 3;
  EXPECT_TRUE(
      absl::IsFailedPrecondition(CaptureAgentWorkspace(client_, blobs_, options, &base).status()));
  options.max_files = 100;
  options.max_bytes = 10;
  EXPECT_TRUE(
      absl::IsFailedPrecondition(CaptureAgentWorkspace(client_, blobs_, options, &base).status()));
}

TEST_F(WorkspaceStepsTest, ShellStateComesBack) {
  fs::create_directories(ws_ + "/sub");
  Run("cd sub && export FOO=bar && BAR=plain && greet() { echo hello \"$1\"; }");
  absl::StatusOr<std::string> state = client_.ShellState(256 * 1024);
  ASSERT_TRUE(state.ok()) << state.status();
  Run("cd / && export FOO=other && unset -f greet");
  ASSERT_TRUE(client_.SetShellState(*state).ok());
  ExecResult r = Run("pwd; echo $FOO $BAR; greet you");
  EXPECT_EQ(r.stdout_data, ws_ + "/sub\nbar plain\nhello you\n");
  // A state over the caller's cap is refused by the agent (EFBIG), the connection stays up.
  Run("BIG=$(head -c 300000 /dev/zero | tr '\\0' x)");
  absl::StatusOr<std::string> big = client_.ShellState(256 * 1024);
  EXPECT_TRUE(absl::IsResourceExhausted(big.status())) << big.status();
  EXPECT_TRUE(client_.Ping().ok());
  EXPECT_TRUE(client_.ShellState(1 << 20).ok());
}

TEST_F(WorkspaceStepsTest, RestoreOfACollectedBlobSaysSo) {
  WriteFile(ws_ + "/f", "data");
  std::string base;
  absl::StatusOr<WorkspaceManifest> m = CaptureAgentWorkspace(client_, blobs_, {}, &base);
  ASSERT_TRUE(m.ok());
  MemoryBlobStore empty;
  WriteFile(ws_ + "/f", "other");
  absl::Status s = RestoreAgentWorkspace(client_, empty, *m, &base);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("collected"), std::string_view::npos);
}

TEST_F(WorkspaceStepsTest, RestoreRefusesABadManifest) {
  for (const char* bad : {"../x", "/etc/passwd", "a/../../b", ""}) {
    WorkspaceManifest m;
    m.entries.push_back(ManifestEntry{.path = bad});
    std::string base;
    EXPECT_TRUE(absl::IsInvalidArgument(RestoreAgentWorkspace(client_, blobs_, m, &base))) << bad;
  }
}

// --- hostile walk replies (no agent needed) ---------------------------------------------------

AgentWalkReply Reply(std::string manifest, std::string contents = "") {
  AgentWalkReply r;
  r.manifest_json = std::move(manifest);
  r.contents = std::move(contents);
  return r;
}

TEST(ParseAgentWalkTest, AGoodReplyParses) {
  auto r = ParseAgentWalk(Reply(R"([["d","d",493,0,1,"1:2","",-1],)"
                                R"(["d/f","f",420,999999,1,"3:4","",3],)"
                                R"(["l","l",511,0,1,"5:6","../x",-1]])",
                                "abc"),
                          100);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), 3u);
  EXPECT_EQ((*r)[1].content, "abc");
  EXPECT_EQ((*r)[1].entry.size, 3) << "the size is what was received, not what was claimed";
  EXPECT_EQ((*r)[2].entry.target, "../x");
}

TEST(ParseAgentWalkTest, HostileAgentBadPathsAreRefused) {
  for (const char* path :
       {"../x", "/etc/passwd", "/etc", "a/../b", "./a", "a//b", "a/", "", "a\\u0000b", "x/.."}) {
    std::string m = std::string(R"([[")") + path + R"(","f",420,1,1,"k","",-1]])";
    auto r = ParseAgentWalk(Reply(m), 100);
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << path << ": " << r.status();
  }
}

TEST(ParseAgentWalkTest, HostileAgentDuplicateUnsortedAndOrphanPathsAreRefused) {
  for (const char* m : {
           R"([["a","f",420,1,1,"k","",-1],["a","f",420,1,1,"k","",-1]])",    // duplicate
           R"([["b","f",420,1,1,"k","",-1],["a","f",420,1,1,"k","",-1]])",    // unsorted
           R"([["d/f","f",420,1,1,"k","",-1]])",                              // no parent dir
           R"([["d","f",420,1,1,"k","",-1],["d/f","f",420,1,1,"k","",-1]])",  // parent a file
       }) {
    EXPECT_TRUE(absl::IsInvalidArgument(ParseAgentWalk(Reply(m), 100).status())) << m;
  }
}

TEST(ParseAgentWalkTest, HostileAgentHugeSizesAndBadLengthsAreRefused) {
  for (const auto& [m, contents] : std::vector<std::pair<std::string, std::string>>{
           {R"([["a","f",420,1,1,"k","",1048576]])", "short"},  // contents beyond what came
           {R"([["a","f",420,1,1,"k","",2]])", "abc"},          // contents left over
           {R"([["a","f",420,-5,1,"k","",-1]])", ""},           // negative size
           {R"([["a","f",4096,1,1,"k","",-1]])", ""},           // mode beyond 07777
           {R"([["a","x",420,1,1,"k","",-1]])", ""},            // unknown type
           {R"([["a","l",511,1,1,"k","",-1]])", ""},            // symlink without a target
           {R"([["a","d",493,0,1,"k","",3]])", "abc"},          // contents for a directory
           {R"([["a","f",420,1,1,"k","t",-1]])", ""},           // a target for a file
           {R"([["a","f",420,1,1,"k","",-2]])", ""},            // bad length
           {R"([["a","f",420,1,1,"k",""]])", ""},               // short row
           {R"({"a":1})", ""},                                  // not an array
       }) {
    EXPECT_TRUE(absl::IsInvalidArgument(ParseAgentWalk(Reply(m, contents), 100).status())) << m;
  }
  // A size claim beyond int64 is not a number the reply may carry.
  EXPECT_FALSE(
      ParseAgentWalk(Reply(R"([["a","f",420,99999999999999999999999,1,"k","",-1]])"), 100).ok());
}

TEST(ParseAgentWalkTest, HostileAgentTooManyEntriesIsRefusedBeforeParsing) {
  std::string m = "[";
  for (int i = 0; i < 5000; ++i) m += "[],";
  m += "[]]";
  EXPECT_TRUE(absl::IsFailedPrecondition(ParseAgentWalk(Reply(m), 100).status()));
}

}  // namespace
}  // namespace esb

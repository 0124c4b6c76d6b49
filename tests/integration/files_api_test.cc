// The files API's mkdir / remove / rename / stat against the real daemon, on both tiers
// (container and nano). Each attack is named after what it tries, performs it through the API
// and asserts that it fails and that nothing outside /workspace changed.
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "absl/strings/str_cat.h"
#include "integration/daemon.h"

namespace esb::testing {
namespace {
namespace json = boost::json;

std::string UrlEncode(const std::string& s) {
  static const char* kHex = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : s) {
    if (isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' || c == '/') {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

class FilesApiTest : public SharedDaemonTest<FilesApiTest>,
                     public ::testing::WithParamInterface<std::string> {
 protected:
  void SetUp() override {
    SharedDaemonTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    if (tier() != "container" &&
        !daemon_->Call("GET", "/healthz").obj().at("drivers").as_object().contains(tier())) {
      GTEST_SKIP() << "the " << tier() << " runtime is not available here (nano needs "
                   << "python.wasm, gvisor needs runsc): see GET /healthz 'unavailable'";
    }
    id_ = daemon_->CreateEnv({{"runtime", tier()}});
    ASSERT_FALSE(id_.empty());
  }
  void TearDown() override {
    if (!id_.empty()) daemon_->Call("DELETE", "/environments/" + id_);
  }
  std::string tier() const { return GetParam(); }

  HttpResult Post(const std::string& op, const json::object& body) const {
    return daemon_->Call("POST", absl::StrCat("/environments/", id_, "/files/", op), body);
  }
  HttpResult Mkdir(const std::string& path) const { return Post("mkdir", {{"path", path}}); }
  HttpResult Remove(const std::string& path, bool recursive) const {
    return Post("remove", {{"path", path}, {"recursive", recursive}});
  }
  HttpResult Rename(const std::string& from, const std::string& to, bool overwrite = false) const {
    return Post("rename", {{"source", from}, {"destination", to}, {"overwrite", overwrite}});
  }
  HttpResult Stat(const std::string& path) const {
    return daemon_->Call("GET",
                         absl::StrCat("/environments/", id_, "/files/stat?path=", UrlEncode(path)));
  }
  void Write(const std::string& path, const std::string& content) const {
    HttpResult r = Post("write", {{"path", path}, {"content", content}});
    ASSERT_EQ(r.status, 200) << r.body;
  }
  std::string Read(const std::string& path) const {
    HttpResult r = daemon_->Call(
        "GET", absl::StrCat("/environments/", id_, "/files/read?path=", UrlEncode(path)));
    return r.status == 200 ? r.str("content") : "<" + std::to_string(r.status) + ">";
  }
  // Container tier only: a shell command in the sandbox, its stdout.
  std::string Sh(const std::string& command) const {
    HttpResult r = daemon_->Exec(id_, command);
    EXPECT_EQ(r.status, 200) << r.body;
    return r.str("stdout");
  }

  std::string id_;
};

INSTANTIATE_TEST_SUITE_P(Tiers, FilesApiTest, ::testing::Values("container", "nano"),
                         [](const auto& info) { return info.param; });

TEST_P(FilesApiTest, MkdirStatRenameRemoveRoundTrip) {
  HttpResult r = Mkdir("a/b/c");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(r.flag("created"));
  r = Mkdir("/workspace/a/b/c");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_FALSE(r.flag("created")) << "mkdir -p of an existing directory";

  r = Stat("a/b");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.str("type"), "dir");
  EXPECT_EQ(r.str("name"), "b");

  Write("a/f.txt", "hello");
  r = Stat("a/f.txt");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.str("type"), "file");
  EXPECT_EQ(r.num("size"), 5);
  EXPECT_EQ(r.str("path"), "a/f.txt");
  EXPECT_FALSE(r.str("mode").empty());
  EXPECT_FALSE(r.str("mtime").empty());

  r = Rename("a/f.txt", "a/b/g.txt");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Read("a/b/g.txt"), "hello");
  EXPECT_EQ(Stat("a/f.txt").status, 404);

  r = Remove("a/b/g.txt", false);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Stat("a/b/g.txt").status, 404);
  r = Remove("a", true);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Stat("a").status, 404);
}

TEST_P(FilesApiTest, ErrorsAreTypedNotFoundConflict) {
  HttpResult r = Stat("missing.txt");
  EXPECT_EQ(r.status, 404) << r.body;
  EXPECT_EQ(r.str("code"), "not_found");
  EXPECT_EQ(Remove("missing.txt", false).status, 404);
  EXPECT_EQ(Remove("missing", true).status, 404);
  EXPECT_EQ(Rename("missing.txt", "x.txt").status, 404);

  Write("f.txt", "1");
  Write("g.txt", "2");
  r = Mkdir("f.txt");
  EXPECT_EQ(r.status, 409) << "mkdir over a file: " << r.body;
  EXPECT_EQ(r.str("code"), "conflict");
  r = Rename("f.txt", "g.txt");
  EXPECT_EQ(r.status, 409) << "rename onto an existing file without overwrite: " << r.body;
  EXPECT_EQ(Read("g.txt"), "2");
  r = Rename("f.txt", "g.txt", /*overwrite=*/true);
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Read("g.txt"), "1");

  Write("d/inner.txt", "x");
  r = Remove("d", false);
  EXPECT_EQ(r.status, 409) << "non-empty directory without recursive: " << r.body;
  EXPECT_EQ(r.str("code"), "conflict");
  EXPECT_EQ(Read("d/inner.txt"), "x");
  EXPECT_EQ(Mkdir("g.txt/sub").status, 400) << "a file among the parents";
  EXPECT_EQ(Rename("g.txt", "nodir/g.txt").status, 404) << "the destination's parent is missing";
}

TEST_P(FilesApiTest, DotDotTraversalInEveryPathFieldIsRefused) {
  Write("a.txt", "mine");
  for (const std::string& bad : {"../etc/esb-files-test", "a/../../etc/esb-files-test",
                                 "/workspace/../etc/esb-files-test", "../../../tmp/x"}) {
    SCOPED_TRACE(bad);
    HttpResult r = Mkdir(bad);
    EXPECT_EQ(r.status, 400) << r.body;
    EXPECT_EQ(r.str("code"), "bad_request");
    EXPECT_NE(r.str("message").find("refused"), std::string::npos) << r.body;
    EXPECT_EQ(Remove(bad, true).status, 400);
    EXPECT_EQ(Rename(bad, "stolen").status, 400);
    EXPECT_EQ(Rename("a.txt", bad).status, 400);
  }
  EXPECT_EQ(Remove("..", true).status, 400);
  EXPECT_EQ(Read("a.txt"), "mine");
  EXPECT_EQ(Stat("stolen").status, 404);
  if (tier() != "nano") {
    EXPECT_EQ(Sh("ls /etc/esb-files-test /tmp/x 2>/dev/null; echo done"), "done\n");
  }
}

TEST_P(FilesApiTest, AbsolutePathsOutsideWorkspaceAreRefused) {
  Write("a.txt", "mine");
  for (const std::string& bad :
       {"/etc/esb-files-test", "/tmp/esb-files-test", "/", "/workspace2/x", "/usr/lib"}) {
    SCOPED_TRACE(bad);
    EXPECT_EQ(Mkdir(bad).status, 400);
    EXPECT_EQ(Remove(bad, true).status, 400);
    EXPECT_EQ(Rename(bad, "stolen").status, 400);
    EXPECT_EQ(Rename("a.txt", bad).status, 400);
  }
  EXPECT_EQ(Read("a.txt"), "mine");
  if (tier() != "nano") {
    EXPECT_EQ(Sh("ls -d /etc/esb-files-test /tmp/esb-files-test 2>/dev/null; test -d /usr/lib "
                 "&& echo kept"),
              "kept\n");
  }
}

TEST_P(FilesApiTest, WorkspaceItselfCannotBeRemovedOrRenamed) {
  Write("keep.txt", "k");
  for (const std::string& ws : {".", "/workspace", "/workspace/", "a/.."}) {
    SCOPED_TRACE(ws);
    EXPECT_EQ(Remove(ws, true).status, 400);
    EXPECT_EQ(Rename(ws, "moved").status, 400);
  }
  EXPECT_EQ(Read("keep.txt"), "k");
}

TEST_P(FilesApiTest, NamesWithNulControlOrInvalidUtf8AreRefused) {
  Write("a.txt", "mine");
  const std::string bad[] = {
      std::string("a\0b", 3), "tab\there", "new\nline", "bell\x07", "del\x7f",
      "bad\xff\xfeutf8",      "\xc0\xaf"};
  for (const std::string& name : bad) {
    SCOPED_TRACE(json::serialize(json::string(name)));
    EXPECT_EQ(Mkdir(name).status, 400);
    EXPECT_EQ(Remove(name, false).status, 400);
    EXPECT_EQ(Rename("a.txt", name).status, 400);
    EXPECT_EQ(Rename(name, "b.txt").status, 400);
  }
  EXPECT_EQ(Stat(std::string("a\0b", 3)).status, 400);
  EXPECT_EQ(Stat("bad\xff").status, 400);
  EXPECT_EQ(Read("a.txt"), "mine");
}

TEST_P(FilesApiTest, MissingOrMistypedFieldsAreBadRequests) {
  EXPECT_EQ(Post("mkdir", {}).status, 400);
  EXPECT_EQ(Post("mkdir", {{"path", 3}}).status, 400);
  EXPECT_EQ(Post("mkdir", {{"path", "x"}, {"parents", true}}).status, 400) << "unknown field";
  EXPECT_EQ(Post("remove", {{"path", "x"}, {"recursive", "yes"}}).status, 400);
  EXPECT_EQ(Post("rename", {{"source", "x"}}).status, 400);
  EXPECT_EQ(daemon_->Call("GET", absl::StrCat("/environments/", id_, "/files/stat")).status, 400);
  HttpResult r =
      daemon_->Call("POST", "/environments/nope/files/mkdir", json::object{{"path", "x"}});
  EXPECT_EQ(r.status, 404) << r.body;
}

// --- container tiers only (crun/runc and gVisor, whose kernel resolves paths itself):
// symlinks (the nano memfs has none), /proc, big trees ---------------------------------------

class ContainerFilesApiTest : public FilesApiTest {};
INSTANTIATE_TEST_SUITE_P(Tiers, ContainerFilesApiTest, ::testing::Values("container", "gvisor"),
                         [](const auto& info) { return info.param; });

TEST_P(ContainerFilesApiTest, SymlinkToEtcAsMkdirParentIsRefused) {
  Sh("ln -s /etc etclink; ln -s / rootlink");
  HttpResult r = Mkdir("etclink/esb-files-test");
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_NE(r.str("message").find("symlink"), std::string::npos) << r.body;
  EXPECT_EQ(Mkdir("rootlink/tmp/esb-files-test").status, 400);
  EXPECT_EQ(Mkdir("etclink").status, 409) << "the link itself is not a directory";
  EXPECT_EQ(Sh("ls -d /etc/esb-files-test /tmp/esb-files-test 2>/dev/null; echo done"), "done\n");
}

TEST_P(ContainerFilesApiTest, SymlinkToEtcAsRenameSourceMovesOnlyTheLink) {
  Sh("ln -s /etc etclink; ln -s /etc/passwd pwlink");
  EXPECT_EQ(Rename("etclink/passwd", "stolen").status, 400) << "through a symlinked parent";
  EXPECT_EQ(Rename("etclink/hostname", "/workspace/stolen2").status, 400);
  HttpResult r = Rename("pwlink", "moved");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Sh("readlink moved; test -f /etc/passwd && echo kept; ls stolen 2>/dev/null"),
            "/etc/passwd\nkept\n");
}

TEST_P(ContainerFilesApiTest, SymlinkToRootAsRenameDestinationIsRefused) {
  Write("a.txt", "mine");
  Sh("ln -s / rootlink; ln -s /etc etclink; ln -s /etc/hostname hostlink");
  EXPECT_EQ(Rename("a.txt", "rootlink/tmp/esb-files-test").status, 400);
  EXPECT_EQ(Rename("a.txt", "etclink/esb-files-test", true).status, 400);
  // A symlink as the destination itself is replaced (with overwrite), never written through.
  EXPECT_EQ(Rename("a.txt", "hostlink").status, 409);
  std::string before = Sh("cat /etc/hostname");
  ASSERT_EQ(Rename("a.txt", "hostlink", true).status, 200);
  EXPECT_EQ(Sh("test -L hostlink || cat hostlink; echo; cat /etc/hostname"), "mine\n" + before);
  EXPECT_EQ(Sh("ls /tmp/esb-files-test /etc/esb-files-test 2>/dev/null; echo done"), "done\n");
}

TEST_P(ContainerFilesApiTest, RecursiveRemoveOfSymlinkToRootDeletesOnlyTheLink) {
  Sh("ln -s / rootlink; ln -s /etc etclink; mkdir -p tree/sub; touch tree/sub/f; "
     "ln -s /etc tree/sub/etc; ln -s / tree/root");
  HttpResult r = Remove("rootlink", true);
  ASSERT_EQ(r.status, 200) << r.body;
  ASSERT_EQ(Remove("etclink", true).status, 200);
  ASSERT_EQ(Remove("tree", true).status, 200);
  EXPECT_EQ(Sh("ls -A rootlink etclink tree 2>/dev/null; test -f /etc/passwd && test -d /usr/bin "
               "&& echo intact"),
            "intact\n");
  EXPECT_EQ(Remove("etclink/passwd", false).status, 404) << "the link is gone, /etc/passwd is not";
}

TEST_P(ContainerFilesApiTest, RenameOntoProcIsRefused) {
  Write("a.txt", "mine");
  Sh("ln -s /proc proclink");
  EXPECT_EQ(Rename("a.txt", "/proc/self/fd/0", true).status, 400);
  EXPECT_EQ(Rename("a.txt", "/proc/1/root/etc/passwd", true).status, 400);
  EXPECT_EQ(Rename("a.txt", "proclink/self/fd/0", true).status, 400);
  EXPECT_EQ(Rename("proclink/self/environ", "env.txt").status, 400);
  EXPECT_EQ(Mkdir("proclink/self/x").status, 400);
  EXPECT_EQ(Remove("proclink/self/fd/0", false).status, 400);
  EXPECT_EQ(Read("a.txt"), "mine");
}

TEST_P(ContainerFilesApiTest, RecursiveRemoveOfHugeTreeIsBounded) {
  // 20,000 files in 200 directories (5,000 under gVisor, whose file creation alone is slow):
  // removed within the agent's 20 s budget, or stopped there with a clear 503; either way the
  // call returns in bounded time and a retry finishes.
  const int dirs = tier() == "gvisor" ? 50 : 200;
  HttpResult made = daemon_->Exec(
      id_,
      absl::StrCat("mkdir huge && cd huge && for d in $(seq ", dirs,
                   "); do mkdir $d; (cd $d && touch $(seq 100)); done; find . | wc -l"),
      120);
  ASSERT_EQ(made.status, 200) << made.body;
  ASSERT_EQ(made.str("stdout"), absl::StrCat(dirs * 101 + 1, "\n"));
  auto start = std::chrono::steady_clock::now();
  HttpResult r = Remove("huge", true);
  auto took = std::chrono::steady_clock::now() - start;
  EXPECT_LT(took, std::chrono::seconds(35));
  if (r.status == 503) {
    EXPECT_NE(r.str("message").find("call again"), std::string::npos) << r.body;
    r = Remove("huge", true);
  }
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Stat("huge").status, 404);
}

TEST_P(ContainerFilesApiTest, TreeDeeperThanTheLimitIsRefusedWholly) {
  HttpResult made = daemon_->Exec(
      id_, "p=deep; mkdir deep; for i in $(seq 300); do p=$p/d; done; mkdir -p $p && echo ok");
  ASSERT_EQ(made.str("stdout"), "ok\n") << made.body;
  HttpResult r = Remove("deep", true);
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_NE(r.str("message").find("deeper than"), std::string::npos) << r.body;
  EXPECT_EQ(Stat("deep/d/d/d").status, 200) << "nothing was removed";
}

TEST_P(ContainerFilesApiTest, OperationsAreAudited) {
  ASSERT_EQ(Mkdir("audited").status, 200);
  ASSERT_EQ(Rename("audited", "audited2").status, 200);
  ASSERT_EQ(Remove("audited2", false).status, 200);
  HttpResult a = daemon_->Call("GET", "/audit?environment_id=" + id_);
  ASSERT_EQ(a.status, 200) << a.body;
  std::string actions;
  for (const auto& e : a.obj().at("entries").as_array())
    actions += std::string(e.as_object().at("action").as_string()) + " ";
  EXPECT_NE(actions.find("files.mkdir"), std::string::npos) << actions;
  EXPECT_NE(actions.find("files.rename"), std::string::npos) << actions;
  EXPECT_NE(actions.find("files.remove"), std::string::npos) << actions;
}

}  // namespace
}  // namespace esb::testing

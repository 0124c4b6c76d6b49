// nano tier tests: the MemFs and WASI host in-process (hostile pointers, path escapes), the
// seccomp policy, and the whole driver against a WASI test program (testdata/test_guest.c)
// linked into nano-test-worker; plus real Python when nanobuild's esb-nano-worker exists.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <boost/json.hpp>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/util.h"
#include "drivers/nano/memfs.h"
#include "drivers/nano/nano_driver.h"
#include "drivers/nano/seccomp_policy.h"
#include "drivers/nano/wasi_host.h"
#include "drivers/nano/wire.h"
#include "drivers/testing/memory_blob_store.h"


namespace esb::nano {
namespace {

// ---------------- Wire (nano messages as codec frames) ----------------

class WireTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds_), 0); }
  void TearDown() override {
    for (int fd : fds_) {
      if (fd >= 0) close(fd);
    }
  }
  int fds_[2] = {-1, -1};
};

TEST_F(WireTest, MessagePastTheAgentBoundRoundTripsAsOneCodecFrame) {
  Msg out{
      {"op", "run"}, {"stdout", std::string(20u << 20, 'o')}, {"bin", std::string("a\0\xff", 3)}};
  bool sent = false;
  std::thread writer([&] { sent = SendMsg(fds_[0], proto::FrameType::kResponse, out); });
  // What arrives is a v2 codec frame (magic, RESPONSE, stream 1) on the nano channel's bound.
  proto::Frame frame;
  std::string error;
  ASSERT_TRUE(proto::ReadFrame(fds_[1], &frame, &error, NowMonoMs() + 10000,
                               proto::MaxFrameBytes(kMaxMsgBytes), nullptr, -1, kMaxMsgBytes))
      << error;
  writer.join();
  EXPECT_TRUE(sent);
  EXPECT_EQ(frame.type, proto::FrameType::kResponse);
  EXPECT_EQ(frame.stream, kMsgStream);
  Msg in;
  ASSERT_TRUE(FromFrame(frame, &in, &error)) << error;
  EXPECT_EQ(in, out);
}

TEST_F(WireTest, MessageOverTheNanoBoundIsRefusedOnBothSides) {
  Msg big{{"data", std::string(kMaxMsgBytes + 1, 'x')}};
  errno = 0;
  EXPECT_FALSE(SendMsg(fds_[0], proto::FrameType::kRequest, big));
  EXPECT_EQ(errno, EMSGSIZE);
  // A peer that announces one is refused from the 14-byte prefix, before any body is read.
  proto::Frame f;
  f.type = proto::FrameType::kRequest;
  f.stream = kMsgStream;
  f.payload = "x";
  std::string wire = proto::EncodeFrame(f).substr(0, 14);
  uint32_t length = proto::kFixedBytes + kMaxMsgBytes + 1;
  wire[0] = static_cast<char>(length >> 24);
  wire[1] = static_cast<char>(length >> 16);
  wire[2] = static_cast<char>(length >> 8);
  wire[3] = static_cast<char>(length);
  wire[13] = 0;  // header_len 0
  ASSERT_EQ(write(fds_[0], wire.data(), wire.size()), 14);
  Msg in;
  bool timed_out = true;
  int64_t start = NowMonoMs();
  EXPECT_FALSE(
      RecvMsg(fds_[1], proto::FrameType::kRequest, &in, nullptr, start + 5000, &timed_out));
  EXPECT_FALSE(timed_out);
  EXPECT_LT(NowMonoMs() - start, 1000);
}

TEST_F(WireTest, PassedFdArrivesWithTheMessage) {
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  ASSERT_TRUE(SendMsg(fds_[0], proto::FrameType::kResponse, {{"pid", "7"}}, pipefd[1]));
  close(pipefd[1]);
  ASSERT_TRUE(SendMsg(fds_[0], proto::FrameType::kResponse, {{"ok", "1"}}));
  Msg in;
  int got = -1;
  ASSERT_TRUE(RecvMsg(fds_[1], proto::FrameType::kResponse, &in, &got, NowMonoMs() + 5000));
  EXPECT_EQ(GetStr(in, "pid"), "7");
  ASSERT_GE(got, 0);
  EXPECT_NE(fcntl(got, F_GETFD) & FD_CLOEXEC, 0);
  ASSERT_EQ(write(got, "z", 1), 1);  // the very pipe that was sent
  char c = 0;
  ASSERT_EQ(read(pipefd[0], &c, 1), 1);
  EXPECT_EQ(c, 'z');
  close(got);
  close(pipefd[0]);
  // The next message carries none.
  ASSERT_TRUE(RecvMsg(fds_[1], proto::FrameType::kResponse, &in, &got, NowMonoMs() + 5000));
  EXPECT_EQ(GetStr(in, "ok"), "1");
  EXPECT_EQ(got, -1);
}

TEST_F(WireTest, WrongFrameTypeIsRefused) {
  ASSERT_TRUE(SendMsg(fds_[0], proto::FrameType::kRequest, {{"op", "stat"}}));
  Msg in;
  EXPECT_FALSE(RecvMsg(fds_[1], proto::FrameType::kResponse, &in, nullptr, NowMonoMs() + 5000));
}

TEST(WireFrameTest, HostileFieldListsAreRefused) {
  auto frame = [](const char* header, std::string payload) {
    proto::Frame f;
    f.type = proto::FrameType::kResponse;
    f.stream = kMsgStream;
    f.header = boost::json::parse(header).as_object();
    f.payload = std::move(payload);
    return f;
  };
  std::string many = "{\"fields\":[";
  for (size_t i = 0; i <= kMaxMsgFields; ++i) {
    many += (i ? ",[\"k" : "[\"k") + std::to_string(i) + "\",0]";
  }
  many += "]}";
  const std::pair<std::string, std::string> cases[] = {
      {"{}", ""},
      {"{\"fields\":{}}", ""},
      {"{\"fields\":[],\"x\":1}", ""},
      {"{\"fields\":[[\"a\"]]}", ""},
      {"{\"fields\":[[1,1]]}", "x"},
      {"{\"fields\":[[\"a\",-1]]}", "x"},
      {"{\"fields\":[[\"a\",2]]}", "x"},                     // longer than the payload
      {"{\"fields\":[[\"a\",1]]}", "xy"},                    // payload left over
      {"{\"fields\":[[\"a\",1],[\"a\",1]]}", "xy"},          // repeated name
      {"{\"fields\":[[\"a\",18446744073709551615]]}", "x"},  // length overflow
      {many, ""},
  };
  for (const auto& [header, payload] : cases) {
    Msg msg;
    std::string error;
    EXPECT_FALSE(FromFrame(frame(header.c_str(), payload), &msg, &error)) << header;
    EXPECT_FALSE(error.empty()) << header;
    EXPECT_TRUE(msg.empty()) << header;
  }
  Msg msg;
  std::string error;
  EXPECT_TRUE(FromFrame(frame("{\"fields\":[[\"a\",1],[\"b\",0],[\"c\",1]]}", "xy"), &msg, &error))
      << error;
  EXPECT_EQ(msg, (Msg{{"a", "x"}, {"b", ""}, {"c", "y"}}));
}

// ---------------- MemFs ----------------

TEST(MemFsTest, DotDotNeverLeavesTheRoot) {
  std::vector<std::string> out;
  EXPECT_EQ(MemFs::Normalize({}, "../etc/passwd", false, &out), kNotcapable);
  EXPECT_EQ(MemFs::Normalize({"workspace"}, "../../etc/passwd", false, &out), kNotcapable);
  EXPECT_EQ(MemFs::Normalize({"workspace"}, "a/../../..", false, &out), kNotcapable);
  EXPECT_EQ(MemFs::Normalize({}, "/etc/passwd", false, &out), kNotcapable);
  EXPECT_EQ(MemFs::Normalize({}, std::string("a\0b", 3), false, &out), kInval);
  ASSERT_EQ(MemFs::Normalize({"workspace"}, "./x/../y//z/", false, &out), kOk);
  EXPECT_EQ(JoinPath(out), "/workspace/y/z");
  ASSERT_EQ(MemFs::Normalize({}, "workspace/..", false, &out), kOk);
  EXPECT_TRUE(out.empty());
}

TEST(MemFsTest, WorkspaceQuotaCapsBytesAndFiles) {
  MemFs fs(FsQuota{1000, 3});
  ASSERT_TRUE(fs.AddDir("/workspace", false).ok());  // counts as 1 file
  std::shared_ptr<Node> a, b, c;
  ASSERT_EQ(fs.CreateFile({"workspace", "a"}, false, false, &a), kOk);
  EXPECT_EQ(a->Write(0, std::string(900, 'x')), kOk);
  EXPECT_EQ(a->Write(900, std::string(200, 'x')), kNospc);
  ASSERT_EQ(fs.CreateFile({"workspace", "b"}, false, false, &b), kOk);
  EXPECT_EQ(fs.CreateFile({"workspace", "c"}, false, false, &c), kNospc);
  // Unlinking gives the space back once nothing holds the file.
  a.reset();
  EXPECT_EQ(fs.Unlink({"workspace", "a"}), kOk);
  EXPECT_EQ(fs.quota().used_bytes, 0);
  EXPECT_EQ(b->Write(0, std::string(1000, 'y')), kOk);
}

TEST(MemFsTest, MakeDirsIsMkdirP) {
  MemFs fs;
  ASSERT_TRUE(fs.AddDir("/workspace", false).ok());
  bool created = false;
  ASSERT_EQ(fs.MakeDirs({"workspace", "a", "b"}, &created), kOk);
  EXPECT_TRUE(created);
  ASSERT_EQ(fs.MakeDirs({"workspace", "a", "b"}, &created), kOk);
  EXPECT_FALSE(created);
  std::shared_ptr<Node> f;
  ASSERT_EQ(fs.CreateFile({"workspace", "f"}, false, false, &f), kOk);
  EXPECT_EQ(fs.MakeDirs({"workspace", "f"}, &created), kExist);
  EXPECT_EQ(fs.MakeDirs({"workspace", "f", "g"}, &created), kNotdir);
}

TEST(MemFsTest, MakeDirsOverTheFileCapIsNospc) {
  MemFs fs(FsQuota{1000, 3});
  ASSERT_TRUE(fs.AddDir("/workspace", false).ok());
  bool created = false;
  EXPECT_EQ(fs.MakeDirs({"workspace", "a", "b", "c"}, &created), kNospc);
}

TEST(MemFsTest, RecursiveRemoveGivesTheQuotaBack) {
  MemFs fs(FsQuota{10000, 100});
  ASSERT_TRUE(fs.AddDir("/workspace", false).ok());
  bool created = false;
  ASSERT_EQ(fs.MakeDirs({"workspace", "t", "u"}, &created), kOk);
  std::shared_ptr<Node> f;
  ASSERT_EQ(fs.CreateFile({"workspace", "t", "u", "f"}, false, false, &f), kOk);
  ASSERT_EQ(f->Write(0, std::string(500, 'x')), kOk);
  f.reset();
  EXPECT_EQ(fs.Remove({"workspace", "t"}, false), kNotempty);
  EXPECT_EQ(fs.Remove({"workspace", "missing"}, true), kNoent);
  ASSERT_EQ(fs.Remove({"workspace", "t"}, true), kOk);
  EXPECT_EQ(fs.quota().used_files, 1);  // the workspace itself
  EXPECT_EQ(fs.quota().used_bytes, 0);
  EXPECT_EQ(fs.Remove({}, true), kPerm);
}

TEST(MemFsTest, RecursiveRemoveOfTheReadOnlyTreeIsRefused) {
  MemFs fs;
  ASSERT_TRUE(fs.LoadHostDir(NANO_TESTDATA_DIR "/rotree", "/lib").ok());
  EXPECT_EQ(fs.Remove({"lib"}, true), kRofs);
  std::shared_ptr<Node> n;
  EXPECT_EQ(fs.Lookup({"lib", "hello.txt"}, &n), kOk);
}

TEST(MemFsTest, ReadOnlyTreeRefusesChanges) {
  MemFs fs;
  ASSERT_TRUE(fs.LoadHostDir(NANO_TESTDATA_DIR "/rotree", "/lib").ok());
  std::shared_ptr<Node> n;
  ASSERT_EQ(fs.Lookup({"lib", "hello.txt"}, &n), kOk);
  EXPECT_EQ(n->data, "read-only hello\n");
  EXPECT_EQ(n->Write(0, "x"), kRofs);
  EXPECT_EQ(fs.Unlink({"lib", "hello.txt"}), kRofs);
  EXPECT_EQ(fs.Mkdir({"lib", "d"}), kRofs);
  EXPECT_EQ(fs.CreateFile({"lib", "new"}, false, false, &n), kRofs);
}

TEST(MemFsTest, PackRoundTripAndHostilePacksAreRejected) {
  auto u32 = [](uint32_t v) { return std::string(reinterpret_cast<char*>(&v), 4); };
  auto u64 = [](uint64_t v) { return std::string(reinterpret_cast<char*>(&v), 8); };
  auto entry = [&](std::string path, uint32_t mode, std::string data) {
    return u32(path.size()) + path + u32(mode) + u64(data.size()) + data;
  };
  std::string body = entry("pkg", 1, "") + entry("pkg/mod.pyc", 0, "hello");
  std::string pack = "ESBSTD01" + u32(2) + u32(0) + body;
  MemFs fs;
  ASSERT_TRUE(fs.LoadPack(pack, "/usr/lib/python3.11").ok());
  std::shared_ptr<Node> n;
  ASSERT_EQ(fs.Lookup({"usr", "lib", "python3.11", "pkg", "mod.pyc"}, &n), kOk);
  EXPECT_EQ(n->data, "hello");
  EXPECT_TRUE(n->readonly);
  MemFs fs2;
  EXPECT_FALSE(fs2.LoadPack(pack.substr(0, pack.size() - 2), "/x").ok());
  EXPECT_FALSE(fs2.LoadPack("ESBSTD01" + u32(1) + u32(0) + u32(0xFFFFFFF0u) + "x", "/x").ok());
  EXPECT_FALSE(fs2.LoadPack("ESBSTD01" + u32(1) + u32(0) + entry("../../etc/x", 0, "x"), "/x")
                   .ok());
  EXPECT_FALSE(fs2.LoadPack("ESBSTD01" + u32(1) + u32(0) + entry("/etc/x", 0, "x"), "/x").ok());
  EXPECT_FALSE(fs2.LoadPack("ESBSTD01" + u32(5) + u32(0) + body, "/x").ok());
}

// ---------------- WasiHost with a fake linear memory ----------------

class WasiHostTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(fs_.AddDir("/workspace", false).ok());
    ASSERT_TRUE(host_.Init({{"/", "/"}}).ok());
    buf_.assign(65536, 0);
    mem_.data = buf_.data();
    mem_.pages = 1;
    mem_.max_pages = 1;
    mem_.size = 65536;
    host_.set_memory(&mem_);
    host_.BeginRun("", 1 << 20);
  }
  uint32_t Put(uint32_t at, std::string_view s) {
    std::memcpy(buf_.data() + at, s.data(), s.size());
    return at;
  }
  void PutIov(uint32_t at, uint32_t ptr, uint32_t len) {
    std::memcpy(buf_.data() + at, &ptr, 4);
    std::memcpy(buf_.data() + at + 4, &len, 4);
  }
  MemFs fs_;
  WasiHost host_{&fs_};
  std::vector<uint8_t> buf_;
  wasm_rt_memory_t mem_{};
};

TEST_F(WasiHostTest, HostilePointersGetEfaultNeverACrash) {
  const uint32_t top = 65536;
  PutIov(100, top - 4, 100);  // buffer runs off the end
  EXPECT_EQ(host_.FdWrite(1, 100, 1, 200), kFault);
  PutIov(100, 0xFFFFFFF0u, 0x20);  // wraps in 32 bits
  EXPECT_EQ(host_.FdWrite(1, 100, 1, 200), kFault);
  EXPECT_EQ(host_.FdWrite(1, top - 4, 1, 200), kFault);         // iovec array out of bounds
  EXPECT_EQ(host_.FdWrite(1, 100, 0x20000000u, 200), kInval);   // 8 * n overflows 32 bits
  PutIov(100, Put(300, "ok"), 2);
  EXPECT_EQ(host_.FdWrite(1, 100, 1, 0xFFFFFFFEu), kFault);     // result pointer
  EXPECT_EQ(host_.FdWrite(1, 100, 1, 200), kOk);
  EXPECT_EQ(host_.stdout_data(), "ok");
  EXPECT_EQ(host_.ArgsGet(top, top), kOk);  // no args: nothing written, nothing checked
  host_.set_args({"prog", "arg"});
  EXPECT_EQ(host_.ArgsGet(top - 4, 400), kFault);
  EXPECT_EQ(host_.ArgsSizesGet(top - 2, 400), kFault);
  EXPECT_EQ(host_.ClockTimeGet(0, 1, top - 7), kFault);
  EXPECT_EQ(host_.ClockTimeGet(99, 1, 400), kInval);
  EXPECT_EQ(host_.RandomGet(top - 16, 17), kFault);
  EXPECT_EQ(host_.RandomGet(0x10, 0xFFFFFFF0u), kFault);
  EXPECT_EQ(host_.PathOpen(3, 0, top - 3, 10, 0, 0, 0, 0, 400), kFault);
  EXPECT_EQ(host_.PathOpen(3, 0, Put(500, "workspace"), 9, 0, 0, 0, 0, top), kFault);
  EXPECT_EQ(host_.PathOpen(12345, 0, 500, 9, 0, 0, 0, 0, 400), kBadf);
  EXPECT_EQ(host_.PathOpen(0xFFFFFFFFu, 0, 500, 9, 0, 0, 0, 0, 400), kBadf);
  EXPECT_EQ(host_.FdFilestatGet(3, top - 63), kFault);
  EXPECT_EQ(host_.FdReaddir(3, top - 10, 100, 0, 400), kFault);
  EXPECT_EQ(host_.FdReaddir(3, 0xFFFFFFF0u, 0xFFFFFFF0u, 0, 400), kFault);
  EXPECT_EQ(host_.PollOneoff(600, top, 1, 400), kFault);
  EXPECT_EQ(host_.PollOneoff(600, 1000, 0x7FFFFFFF, 400), kInval);
  EXPECT_EQ(host_.FdPrestatDirName(3, top - 1, 8), kOk);  // only strlen("/") bytes are written
  EXPECT_EQ(host_.FdPrestatDirName(3, top, 8), kFault);
  EXPECT_EQ(host_.FdRead(0, 100, 1, 0xFFFFFFFCu), kFault);
  // Memory that grows is seen at once; memory that "shrinks" (a lying size) is not trusted:
  // bounds come from the page count.
  mem_.size = 0xFFFFFFFFu;
  EXPECT_EQ(host_.RandomGet(top - 8, 9), kFault);
}

TEST_F(WasiHostTest, PathsCannotEscapeThePreopen) {
  uint32_t out = 400;
  EXPECT_EQ(host_.PathOpen(3, 0, Put(500, "../etc/passwd"), 13, 0, 2, 0, 0, out), kNotcapable);
  EXPECT_EQ(host_.PathOpen(3, 0, Put(500, "/etc/passwd"), 11, 0, 2, 0, 0, out), kNotcapable);
  EXPECT_EQ(host_.PathOpen(3, 0, Put(500, "workspace/../../x"), 17, 0, 2, 0, 0, out),
            kNotcapable);
  EXPECT_EQ(host_.PathOpen(3, 0, Put(500, "etc/passwd"), 10, 0, 2, 0, 0, out), kNoent);
  // Open /workspace, then climb from it.
  ASSERT_EQ(host_.PathOpen(3, 0, Put(500, "workspace"), 9, 2, 2, 0, 0, out), kOk);
  uint32_t ws;
  std::memcpy(&ws, buf_.data() + out, 4);
  EXPECT_EQ(host_.PathOpen(ws, 0, Put(500, "../../x"), 7, 0, 2, 0, 0, out), kNotcapable);
  EXPECT_EQ(host_.PathCreateDirectory(ws, Put(500, "../../x"), 7), kNotcapable);
  EXPECT_EQ(host_.PathCreateDirectory(3, Put(500, "rootdir"), 7), kRofs);
  EXPECT_EQ(host_.PathCreateDirectory(ws, Put(500, "d"), 1), kOk);
  EXPECT_EQ(host_.PathRename(ws, Put(500, "d"), 1, 3, Put(600, "../d"), 4), kNotcapable);
}

TEST_F(WasiHostTest, FileRoundTripThroughWasiCalls) {
  uint32_t out = 400;
  // creat | trunc, rights read+write
  ASSERT_EQ(host_.PathOpen(3, 0, Put(500, "workspace/f.txt"), 15, 1 | 8, (1 << 1) | (1 << 6), 0,
                           0, out),
            kOk);
  uint32_t fd;
  std::memcpy(&fd, buf_.data() + out, 4);
  PutIov(100, Put(300, "hello world"), 11);
  ASSERT_EQ(host_.FdWrite(fd, 100, 1, 200), kOk);
  ASSERT_EQ(host_.FdSeek(fd, 6, 0, 208), kOk);
  PutIov(100, 1000, 5);
  ASSERT_EQ(host_.FdRead(fd, 100, 1, 200), kOk);
  EXPECT_EQ(std::string(reinterpret_cast<char*>(buf_.data() + 1000), 5), "world");
  EXPECT_EQ(host_.FdSeek(fd, static_cast<uint64_t>(-100), 1, 208), kInval);
  EXPECT_EQ(host_.FdClose(fd), kOk);
  EXPECT_EQ(host_.FdClose(fd), kBadf);
  EXPECT_EQ(host_.FdClose(3), kOk);  // preopens stay open
  EXPECT_EQ(host_.PathFilestatGet(3, 0, Put(500, "workspace/f.txt"), 15, 2000), kOk);
  uint64_t size;
  std::memcpy(&size, buf_.data() + 2000 + 32, 8);
  EXPECT_EQ(size, 11u);
  EXPECT_EQ(buf_[2000 + 16], 4);  // regular file
}

TEST_F(WasiHostTest, OutputCapTruncatesButReportsSuccess) {
  host_.BeginRun("", 5);
  PutIov(100, Put(300, "0123456789"), 10);
  ASSERT_EQ(host_.FdWrite(1, 100, 1, 200), kOk);
  uint32_t n;
  std::memcpy(&n, buf_.data() + 200, 4);
  EXPECT_EQ(n, 10u);
  EXPECT_EQ(host_.stdout_data(), "01234");
  EXPECT_TRUE(host_.truncated());
}

// ---------------- seccomp policy ----------------

TEST(SeccompTest, ForbiddenSyscallKillsTheProcess) {
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
    if (!ApplyWorkerSeccomp(false).ok()) _exit(3);
    // The attack: open a socket from a confined worker.
    int s = socket(AF_INET, SOCK_STREAM, 0);
    _exit(s >= 0 ? 0 : 4);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  ASSERT_TRUE(WIFSIGNALED(st)) << "status " << st;
  EXPECT_EQ(WTERMSIG(st), SIGSYS);
}

TEST(SeccompTest, OpenAndExecveAreForbiddenButMemoryAndTimeWork) {
  for (int which = 0; which < 3; which++) {
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
      if (!ApplyWorkerSeccomp(false).ok()) _exit(3);
      if (which == 0) {
        std::vector<char> v(64 << 20, 1);  // malloc → mmap
        timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        _exit(v[12345] == 1 ? 0 : 5);
      }
      if (which == 1) (void)!open("/etc/passwd", O_RDONLY);
      if (which == 2) execl("/bin/true", "true", nullptr);
      _exit(0);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    if (which == 0) {
      EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "status " << st;
    } else {
      EXPECT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGSYS) << which << " status " << st;
    }
  }
}

}  // namespace
}  // namespace esb::nano

// ---------------- the driver against the WASI test guest ----------------

namespace esb {
namespace {

NanoDriverOptions TestOptions() {
  NanoDriverOptions o;
  o.worker_path = NANO_TEST_WORKER;
  o.worker_args = {"--hostdir=" NANO_TESTDATA_DIR "/rotree:/lib", "--arg=testguest"};
  o.default_timeout_ms = 10000;
  o.workspace_max_mb = 1;
  o.workspace_max_files = 64;
  o.cgroup_name = "esb-nano-test";
  return o;
}

class NanoDriverTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { driver_ = NewNanoDriver(TestOptions()).release(); }
  static void TearDownTestSuite() {
    delete driver_;
    driver_ = nullptr;
  }
  RunResult RunArgs(std::vector<std::string> argv, int64_t timeout_ms = 0,
                    int64_t memory_mb = 0, int64_t max_out = 0, std::string stdin_data = "") {
    RunRequest r;
    r.argv = std::move(argv);
    r.argv.insert(r.argv.begin(), "testguest");
    r.timeout_ms = timeout_ms;
    r.memory_limit_mb = memory_mb;
    r.max_output_bytes = max_out;
    r.code = std::move(stdin_data);
    absl::StatusOr<RunResult> res = driver_->RunCode(nullptr, r, nullptr);
    EXPECT_TRUE(res.ok()) << res.status();
    return res.ok() ? *res : RunResult{};
  }
  static NanoDriver* driver_;
};
NanoDriver* NanoDriverTest::driver_ = nullptr;

TEST_F(NanoDriverTest, PrintsArgsAndStderr) {
  RunResult r = RunArgs({"print", "x y"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.stdout_data, "hello from wasm argc=3\narg 0 testguest\narg 1 print\narg 2 x y\n");
  EXPECT_EQ(r.stderr_data, "to stderr\n");
  EXPECT_FALSE(r.timed_out);
}

TEST_F(NanoDriverTest, ExitCodesAndStdin) {
  EXPECT_EQ(RunArgs({"exit", "7"}).exit_code, 7);
  EXPECT_EQ(RunArgs({"procexit", "42"}).exit_code, 42);
  EXPECT_EQ(RunArgs({"stdin"}, 0, 0, 0, "some input").stdout_data, "stdin 10 [some input]\n");
}

TEST_F(NanoDriverTest, ClockRandomAndAllImportsLink) {
  RunResult c = RunArgs({"clock"});
  EXPECT_NE(c.stdout_data.find("monotonic_ok 1"), std::string::npos) << c.stdout_data;
  long secs = std::atol(c.stdout_data.c_str() + strlen("realtime "));
  EXPECT_GT(secs, 1700000000);
  std::string r1 = RunArgs({"random"}).stdout_data, r2 = RunArgs({"random"}).stdout_data;
  EXPECT_EQ(r1.size(), 33u);
  EXPECT_NE(r1, r2);
  RunResult a = RunArgs({"allimports"});
  EXPECT_EQ(a.exit_code, 0);
  EXPECT_NE(a.stdout_data.find("accept 52 recv 52 send 52 shutdown 52"), std::string::npos)
      << a.stdout_data;
  EXPECT_NE(a.stdout_data.find("link 58"), std::string::npos) << a.stdout_data;
  EXPECT_NE(a.stdout_data.find("symlink 58"), std::string::npos) << a.stdout_data;
}

TEST_F(NanoDriverTest, FilesInTheWorkspace) {
  RunResult r = RunArgs({"files"});
  EXPECT_EQ(r.exit_code, 0) << r.stderr_data;
  const char* expected[] = {"read 16 [hello file\nmore\n] word=file pos=10", "mkdir 0",
                            "mkdir again -1 errno 20", "rename 0", "stat 0 size 16 isreg 1",
                            "stat old -1 errno 44", "rmdir nonempty -1 errno 55",
                            "entry b.txt", "unlink 0", "rmdir 0", "chdir 0", "relative ok",
                            "stat rel 0"};
  for (const char* e : expected) {
    EXPECT_NE(r.stdout_data.find(e), std::string::npos) << e << "\n" << r.stdout_data;
  }
}

TEST_F(NanoDriverTest, EscapeAttemptsFindNoHostFile) {
  RunResult r = RunArgs({"escape"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.stdout_data.find("escaped 0"), std::string::npos) << r.stdout_data;
  EXPECT_EQ(r.stdout_data.find(": OK"), std::string::npos) << r.stdout_data;
  // raw: absolute path, `..` above the preopen, `..` via a subdir, mkdir above root: all
  // ENOTCAPABLE (76); an embedded NUL: EINVAL (28).
  EXPECT_NE(r.stdout_data.find("raw 76 76 76 76"), std::string::npos) << r.stdout_data;
}

TEST_F(NanoDriverTest, ReadOnlyTree) {
  RunResult r = RunArgs({"readonly"});
  EXPECT_NE(r.stdout_data.find("open /lib/hello.txt: OK read 16"), std::string::npos)
      << r.stdout_data;
  EXPECT_NE(r.stdout_data.find("open ro for write: -1 errno 69"), std::string::npos);
  EXPECT_NE(r.stdout_data.find("create in ro: -1 errno 69"), std::string::npos);
  EXPECT_NE(r.stdout_data.find("mkdir in ro: -1 errno 69"), std::string::npos);
  EXPECT_NE(r.stdout_data.find("unlink in ro: -1 errno 69"), std::string::npos);
  EXPECT_NE(r.stdout_data.find("rename ro->ws: -1 errno 69"), std::string::npos);
  EXPECT_NE(r.stdout_data.find("root workspace"), std::string::npos);
}

TEST_F(NanoDriverTest, HostilePointersFromARealGuest) {
  RunResult r = RunArgs({"hostile"});
  EXPECT_EQ(r.exit_code, 0) << r.stderr_data;
  for (const char* e : {"w1 21", "w2 21", "w3 21", "w4 28", "w5 21", "r1 21", "a2 21", "e1 21",
                        "c1 21", "c2 28", "g1 21", "g2 21", "p1 44", "p2 21", "p3 8", "p4 8",
                        "s1 21", "s2 0", "d1 21", "d2 21", "o1 21", "o2 28", "x1 0", "x2 0",
                        "survived"}) {
    EXPECT_NE(r.stdout_data.find(std::string(e) + "\n"), std::string::npos)
        << e << "\n" << r.stdout_data;
  }
}

TEST_F(NanoDriverTest, WorkspaceCap) {
  RunResult r = RunArgs({"fill"});  // 1 MiB, 64 files
  EXPECT_EQ(r.stdout_data.find("never stopped"), std::string::npos) << r.stdout_data;
  EXPECT_NE(r.stdout_data.find("errno 51"), std::string::npos) << r.stdout_data;  // ENOSPC
}

TEST_F(NanoDriverTest, MemoryCapMakesMallocFail) {
  RunResult r = RunArgs({"alloc"}, 0, 32);
  EXPECT_EQ(r.exit_code, 0) << r.stderr_data;
  long mb = std::atol(r.stdout_data.c_str() + strlen("allocated "));
  EXPECT_GT(mb, 16) << r.stdout_data;
  EXPECT_LT(mb, 32) << r.stdout_data;
}

TEST_F(NanoDriverTest, InfiniteLoopTimesOut) {
  int64_t t0 = nano::NowMonoMs();
  RunResult r = RunArgs({"loop"}, 300);
  int64_t took = nano::NowMonoMs() - t0;
  EXPECT_TRUE(r.timed_out);
  EXPECT_EQ(r.exit_code, 124);
  EXPECT_LT(took, 1200);
  EXPECT_GE(took, 290);
  // A sleep longer than the timeout is cut short too.
  RunResult s = RunArgs({"sleep", "5000"}, 300);
  EXPECT_EQ(s.exit_code, 124);
  EXPECT_LT(s.duration_ms, 1500);
  EXPECT_EQ(RunArgs({"sleep", "30"}).stdout_data, "slept\n");
}

// A guest that never reaches an interrupt check (simulated) is SIGKILLed by the driver after
// timeout + kill_grace_ms; a session gets a fresh worker on its next run.
TEST_F(NanoDriverTest, SigkillBackstop) {
  absl::StatusOr<InstanceRef> ref = driver_->Create("env_backstop", EnvSpec{});
  ASSERT_TRUE(ref.ok()) << ref.status();
  absl::StatusOr<int> pid = driver_->SessionPid(*ref);
  ASSERT_TRUE(pid.ok());
  RunRequest loop;
  loop.argv = {"testguest", "loop"};
  loop.timeout_ms = 200;
  loop.test_no_interrupt = true;
  int64_t t0 = nano::NowMonoMs();
  absl::StatusOr<RunResult> r = driver_->RunCode(&*ref, loop, nullptr);
  int64_t took = nano::NowMonoMs() - t0;
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->timed_out);
  EXPECT_EQ(r->exit_code, 124);
  EXPECT_TRUE(r->instance_reset);
  EXPECT_GE(took, 1100);  // 200 ms + 1000 ms grace
  EXPECT_LT(took, 3000);
  absl::StatusOr<std::string> how = driver_->WorkerStatus(*pid);
  ASSERT_TRUE(how.ok());
  EXPECT_EQ(*how, "signal 9");
  RunRequest ok;
  ok.argv = {"testguest", "exit", "4"};
  r = driver_->RunCode(&*ref, ok, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 4);
  ASSERT_TRUE(driver_->Destroy(*ref).ok());
}

// Several threads share one driver (esbd serves requests concurrently).
TEST_F(NanoDriverTest, ConcurrentRuns) {
  std::vector<std::thread> threads;
  std::atomic<int> good{0};
  for (int t = 0; t < 4; t++) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 10; i++) {
        RunRequest r;
        r.argv = {"testguest", "exit", std::to_string(t * 10 + i)};
        absl::StatusOr<RunResult> res = driver_->RunCode(nullptr, r, nullptr);
        if (res.ok() && res->exit_code == t * 10 + i) {
          good++;
        } else {
          ADD_FAILURE() << (res.ok() ? "exit " + std::to_string(res->exit_code) + " " +
                                           res->stderr_data + res->stdout_data
                                     : res.status().ToString());
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(good.load(), 40);
}

TEST_F(NanoDriverTest, OutputCaps) {
  RunResult r = RunArgs({"bigout", "100000"}, 0, 0, 1000);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_TRUE(r.truncated);
  EXPECT_EQ(r.stdout_data.size(), 1000u);
  EXPECT_EQ(r.stderr_data, "err done\n");
  RunResult big = RunArgs({"bigout", "3000000"});  // default cap 1 MiB
  EXPECT_EQ(big.stdout_data.size(), 1u << 20);
  EXPECT_TRUE(big.truncated);
}

TEST_F(NanoDriverTest, TrapsAreContained) {
  RunResult oob = RunArgs({"trap"});
  EXPECT_EQ(oob.exit_code, 134);
  EXPECT_NE(oob.stderr_data.find("guest trapped"), std::string::npos) << oob.stderr_data;
  RunResult deep = RunArgs({"recurse"});
  EXPECT_EQ(deep.exit_code, 134);
  EXPECT_NE(deep.stderr_data.find("guest trapped"), std::string::npos) << deep.stderr_data;
  // The server and driver are still fine.
  EXPECT_EQ(RunArgs({"exit", "3"}).exit_code, 3);
}

TEST_F(NanoDriverTest, RejectsBadLimits) {
  RunRequest r;
  r.memory_limit_mb = 1 << 20;
  EXPECT_EQ(driver_->RunCode(nullptr, r, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  r.memory_limit_mb = 0;
  r.timeout_ms = -5;
  EXPECT_EQ(driver_->RunCode(nullptr, r, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Sessions: the workspace persists between runs; the driver's file API sees it.
TEST_F(NanoDriverTest, SessionFilesAndLifecycle) {
  EnvSpec spec;
  spec.runtime = DriverKind::kNano;
  spec.memory_mb = 64;
  spec.env = {{"FOO", "bar"}};
  absl::StatusOr<InstanceRef> ref = driver_->Create("env_files", spec);
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ(ref->driver, "nano");
  ASSERT_TRUE(driver_->WriteFile(*ref, "/workspace/dir/in.txt", "from host", 0, true).ok());
  RunRequest cat;
  cat.argv = {"testguest", "cat", "/workspace/dir/in.txt"};
  absl::StatusOr<RunResult> r = driver_->RunCode(&*ref, cat, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->stdout_data, "from host");
  RunRequest env;
  env.argv = {"testguest", "env"};
  r = driver_->RunCode(&*ref, env, nullptr);
  ASSERT_TRUE(r.ok());
  EXPECT_NE(r->stdout_data.find("FOO=bar"), std::string::npos)
      << r->stdout_data << r->stderr_data << r->exit_code;
  RunRequest write;
  write.argv = {"testguest", "write", "out.txt", "guest data"};
  r = driver_->RunCode(&*ref, write, nullptr);
  ASSERT_TRUE(r.ok());
  // cwd is / (read-only) for a plain program.
  EXPECT_EQ(r->stdout_data, "write out.txt: errno 69\n") << r->stderr_data << r->exit_code;
  write.argv = {"testguest", "write", "/workspace/out.txt", "guest data"};
  ASSERT_TRUE(driver_->RunCode(&*ref, write, nullptr).ok());
  absl::StatusOr<FileChunk> chunk = driver_->ReadFile(*ref, "out.txt", 6, 100);
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  EXPECT_EQ(chunk->data, "data");
  EXPECT_EQ(chunk->file_size, 10);
  EXPECT_TRUE(chunk->eof);
  absl::StatusOr<DirListing> ls = driver_->ListDir(*ref, "/workspace");
  ASSERT_TRUE(ls.ok());
  EXPECT_FALSE(ls->truncated);
  std::vector<std::string> names;
  for (const auto& e : ls->entries) names.push_back(e.name + ":" + e.type);
  EXPECT_EQ(names, (std::vector<std::string>{"dir:dir", "out.txt:file"}));
  // Errors: missing file, read-only tree, escape, cap.
  EXPECT_EQ(driver_->ReadFile(*ref, "nope", 0, -1).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(driver_->WriteFile(*ref, "/lib/hello.txt", "x", 0, true).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_FALSE(driver_->ReadFile(*ref, "/../../etc/passwd", 0, -1).ok());
  EXPECT_EQ(driver_->WriteFile(*ref, "big", std::string(2 << 20, 'x'), 0, true).code(),
            absl::StatusCode::kResourceExhausted);
  // No shell.
  absl::StatusOr<ExecResult> ex = driver_->Exec(*ref, ExecRequest{}, nullptr);
  EXPECT_EQ(ex.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(ex.status().message().find("nano environments have no shell"), std::string::npos);
  absl::StatusOr<Usage> u = driver_->Stats(*ref);
  ASSERT_TRUE(u.ok());
  EXPECT_TRUE(u->alive);
  EXPECT_TRUE(driver_->Attach(*ref).ok());
  absl::StatusOr<int> pid = driver_->SessionPid(*ref);
  ASSERT_TRUE(pid.ok());
  ASSERT_TRUE(driver_->Destroy(*ref).ok());
  EXPECT_TRUE(driver_->Destroy(*ref).ok());  // idempotent
  EXPECT_EQ(driver_->RunCode(&*ref, cat, nullptr).status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(driver_->Attach(*ref).ok());
  absl::StatusOr<std::string> how = driver_->WorkerStatus(*pid);
  ASSERT_TRUE(how.ok()) << how.status();
  EXPECT_NE(*how, "running");
}

TEST_F(NanoDriverTest, SessionWorkerIsConfined) {
  absl::StatusOr<InstanceRef> ref = driver_->Create("env_conf", EnvSpec{});
  ASSERT_TRUE(ref.ok()) << ref.status();
  absl::StatusOr<int> pid = driver_->SessionPid(*ref);
  ASSERT_TRUE(pid.ok());
  ASSERT_TRUE(driver_->Stats(*ref).ok());  // answers only once it has confined itself
  std::ifstream in("/proc/" + std::to_string(*pid) + "/status");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string status = ss.str();
  EXPECT_NE(status.find("Seccomp:\t2"), std::string::npos) << status;
  EXPECT_NE(status.find("NoNewPrivs:\t1"), std::string::npos);
  // Guest code is the OOM killer's first choice, whatever esbd's own oom_score_adj is.
  std::ifstream oom("/proc/" + std::to_string(*pid) + "/oom_score_adj");
  int oom_score_adj = 0;
  oom >> oom_score_adj;
  EXPECT_EQ(oom_score_adj, 500);
  if (geteuid() == 0) {
    EXPECT_NE(status.find("Uid:\t65534\t65534\t65534\t65534"), std::string::npos) << status;
  }
  // Its only fd is its channel (plus nothing else).
  int fds = 0;
  for (int i = 0; i < 64; i++) {
    if (access(("/proc/" + std::to_string(*pid) + "/fd/" + std::to_string(i)).c_str(), F_OK) ==
        0) {
      fds++;
    }
  }
  if (geteuid() == 0) {
    EXPECT_EQ(fds, 1);
    // Second layer: the worker sits in the nano cgroup (with aggregate memory/pids caps).
    std::ifstream cg("/proc/" + std::to_string(*pid) + "/cgroup");
    std::stringstream cs;
    cs << cg.rdbuf();
    if (driver_->cgroups().empty()) {
      printf("note: no nano cgroup could be created on this host\n");
    } else {
      EXPECT_NE(cs.str().find("/esb-nano-test"), std::string::npos) << cs.str();
    }
    // And in its own network namespace.
    char a[64] = {0}, b[64] = {0};
    ASSERT_GT(readlink(("/proc/" + std::to_string(*pid) + "/ns/net").c_str(), a, 63), 0);
    ASSERT_GT(readlink("/proc/self/ns/net", b, 63), 0);
    EXPECT_STRNE(a, b);
  }
  ASSERT_TRUE(driver_->Destroy(*ref).ok());
}

// The attack: host-side code in a worker (a bug exploited through the WASI host) tries a
// syscall outside the allowlist. The kernel kills the worker with SIGSYS; the driver reports it
// and the daemon side carries on.
TEST_F(NanoDriverTest, SeccompKillsAWorkerThatTriesAForbiddenSyscall) {
  for (const char* what : {"socket", "open", "execve", "fork"}) {
    absl::StatusOr<InstanceRef> ref = driver_->Create(std::string("env_sc_") + what, EnvSpec{});
    ASSERT_TRUE(ref.ok()) << ref.status();
    absl::StatusOr<int> pid = driver_->SessionPid(*ref);
    ASSERT_TRUE(pid.ok());
    absl::Status st = driver_->TestHook(*ref, what);
    EXPECT_FALSE(st.ok()) << what << ": the worker survived";
    absl::StatusOr<std::string> how;
    for (int i = 0; i < 50; i++) {
      how = driver_->WorkerStatus(*pid);
      if (!how.ok() || *how != "running") break;
      usleep(10000);
    }
    ASSERT_TRUE(how.ok()) << how.status();
    EXPECT_EQ(*how, "signal 31") << what;  // SIGSYS
    ASSERT_TRUE(driver_->Destroy(*ref).ok());
  }
  EXPECT_EQ(RunArgs({"exit", "5"}).exit_code, 5);
}

TEST_F(NanoDriverTest, SessionTimeoutKeepsWorkspace) {
  absl::StatusOr<InstanceRef> ref = driver_->Create("env_to", EnvSpec{});
  ASSERT_TRUE(ref.ok()) << ref.status();
  ASSERT_TRUE(driver_->WriteFile(*ref, "keep.txt", "kept", 0, true).ok());
  RunRequest loop;
  loop.argv = {"testguest", "loop"};
  loop.timeout_ms = 200;
  absl::StatusOr<RunResult> r = driver_->RunCode(&*ref, loop, nullptr);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->exit_code, 124);
  EXPECT_TRUE(r->instance_reset);
  RunRequest cat;
  cat.argv = {"testguest", "cat", "/workspace/keep.txt"};
  r = driver_->RunCode(&*ref, cat, nullptr);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->stdout_data, "kept");
  ASSERT_TRUE(driver_->Destroy(*ref).ok());
}

// Snapshot = copy-on-write clone of the session worker; the copy is independent.
TEST_F(NanoDriverTest, ForkCopiesTheWorkspace) {
  absl::StatusOr<InstanceRef> a = driver_->Create("env_a", EnvSpec{});
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(driver_->WriteFile(*a, "f.txt", "v1", 0, true).ok());
  absl::StatusOr<InstanceRef> b = driver_->Fork(*a, "env_b");
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE(driver_->WriteFile(*a, "f.txt", "v2-a", 0, true).ok());
  absl::StatusOr<FileChunk> fb = driver_->ReadFile(*b, "f.txt", 0, -1);
  ASSERT_TRUE(fb.ok()) << fb.status();
  EXPECT_EQ(fb->data, "v1");
  RunRequest cat;
  cat.argv = {"testguest", "cat", "/workspace/f.txt"};
  absl::StatusOr<RunResult> rb = driver_->RunCode(&*b, cat, nullptr);
  ASSERT_TRUE(rb.ok());
  EXPECT_EQ(rb->stdout_data, "v1");
  absl::StatusOr<int> pb = driver_->SessionPid(*b);
  ASSERT_TRUE(pb.ok());
  ASSERT_TRUE(driver_->Destroy(*a).ok());
  // The copy survives its source.
  rb = driver_->RunCode(&*b, cat, nullptr);
  ASSERT_TRUE(rb.ok());
  EXPECT_EQ(rb->stdout_data, "v1");
  ASSERT_TRUE(driver_->Destroy(*b).ok());
  absl::StatusOr<std::string> how = driver_->WorkerStatus(*pb);
  ASSERT_TRUE(how.ok()) << how.status();
  EXPECT_NE(*how, "running");
}

// Snapshot holds the session as it was; Restore starts independent sessions from it, any
// number of times, and later changes to the source do not reach them.
TEST_F(NanoDriverTest, SnapshotThenRestoreGivesTheStateAtTheSnapshot) {
  ASSERT_TRUE(driver_->Capabilities().Has(Capability::kSnapshot));
  EXPECT_FALSE(driver_->Capabilities().Has(Capability::kExec));
  absl::StatusOr<InstanceRef> a = driver_->Create("env_snap", EnvSpec{});
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(driver_->WriteFile(*a, "f.txt", "at-snapshot", 0, true).ok());
  EXPECT_EQ(driver_->Snapshot(*a, SnapshotContent::kDisk).status().code(),
            absl::StatusCode::kInvalidArgument)
      << "nano cannot split memory from disk";
  absl::StatusOr<SnapshotRef> snap = driver_->Snapshot(*a, SnapshotContent::kMemoryAndDisk);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->content, SnapshotContent::kMemoryAndDisk);
  EXPECT_EQ(snap->source_id, "env_snap");
  ASSERT_TRUE(driver_->WriteFile(*a, "f.txt", "later", 0, true).ok());
  for (const char* id : {"env_r1", "env_r2"}) {
    absl::StatusOr<InstanceRef> r = driver_->Restore(*snap, id);
    ASSERT_TRUE(r.ok()) << r.status();
    absl::StatusOr<FileChunk> f = driver_->ReadFile(*r, "f.txt", 0, -1);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(f->data, "at-snapshot") << id;
    ASSERT_TRUE(driver_->Destroy(*r).ok());
  }
  ASSERT_TRUE(driver_->DeleteSnapshot(*snap).ok());
  EXPECT_FALSE(driver_->Restore(*snap, "env_r3").ok()) << "a deleted snapshot is gone";
  ASSERT_TRUE(driver_->Destroy(*a).ok());
}

TEST_F(NanoDriverTest, OneShotLatency) {
  std::vector<int64_t> us;
  for (int i = 0; i < 50; i++) {
    timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    RunResult r = RunArgs({"print"});
    clock_gettime(CLOCK_MONOTONIC, &t1);
    ASSERT_EQ(r.exit_code, 0);
    us.push_back((t1.tv_sec - t0.tv_sec) * 1000000 + (t1.tv_nsec - t0.tv_nsec) / 1000);
  }
  std::sort(us.begin(), us.end());
  printf("nano one-shot Run() with the C test guest: p50 %.2f ms, p90 %.2f ms (n=50)\n",
         us[25] / 1000.0, us[45] / 1000.0);
  EXPECT_LT(us[25], 50000);
}

}  // namespace
}  // namespace esb

// ---------------- guest ABI 1 (esb_run / esb_reseed / result.json) with a toy guest ----------

namespace esb {
namespace {

// ---------------- Time travel (kSteps) with the WASI test guest ----------------

TEST_F(NanoDriverTest, StepsManifestSkipsUnchangedFilesAndHonoursCaps) {
  EXPECT_TRUE(driver_->Capabilities().Has(Capability::kSteps));
  EXPECT_TRUE(driver_->StepMemory().available);
  EXPECT_EQ(driver_->StepMemory().mechanism, "fork");
  absl::StatusOr<InstanceRef> ref = driver_->Create("steps_caps", EnvSpec{});
  ASSERT_TRUE(ref.ok()) << ref.status();
  for (const char* f : {"a.txt", "d/b.txt", "d/e/c.txt"}) {
    ASSERT_TRUE(driver_->WriteFile(*ref, f, std::string("data of ") + f, 0, true).ok());
  }
  esb::testing::MemoryBlobStore blobs;
  CaptureOptions opts;
  absl::StatusOr<StepState> s1 = driver_->CaptureStep(*ref, opts, blobs);
  ASSERT_TRUE(s1.ok()) << s1.status();
  ASSERT_TRUE(s1->memory.has_value());
  EXPECT_TRUE(s1->memory->live);
  std::vector<std::string> paths;
  for (const ManifestEntry& e : s1->workspace.entries) paths.push_back(e.path);
  EXPECT_EQ(paths, (std::vector<std::string>{"a.txt", "d", "d/b.txt", "d/e", "d/e/c.txt"}));
  EXPECT_EQ(blobs.puts(), 3);
  EXPECT_EQ(*blobs.Get(s1->workspace.entries[2].sha256), "data of d/b.txt");
  // One file changes: only it is read again.
  ASSERT_TRUE(driver_->WriteFile(*ref, "d/b.txt", "changed", 0, true).ok());
  opts.previous = &s1->workspace;
  absl::StatusOr<StepState> s2 = driver_->CaptureStep(*ref, opts, blobs);
  ASSERT_TRUE(s2.ok()) << s2.status();
  EXPECT_EQ(blobs.puts(), 4);
  EXPECT_EQ(*blobs.Get(s2->workspace.entries[2].sha256), "changed");
  EXPECT_EQ(s2->workspace.entries[0].sha256, s1->workspace.entries[0].sha256);
  // Caps: over either, FailedPrecondition and nothing kept.
  CaptureOptions small;
  small.max_files = 3;
  absl::StatusOr<StepState> over = driver_->CaptureStep(*ref, small, blobs);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kFailedPrecondition) << over.status();
  small.max_files = 100;
  small.max_bytes = 10;
  over = driver_->CaptureStep(*ref, small, blobs);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kFailedPrecondition) << over.status();
  // No snapshot_dir configured in this driver: compaction is refused, the snapshot kept.
  EXPECT_EQ(driver_->CompactSnapshot(*s1->memory).status().code(),
            absl::StatusCode::kFailedPrecondition);
  for (const StepState* s : {&*s1, &*s2}) ASSERT_TRUE(driver_->DeleteSnapshot(*s->memory).ok());
  ASSERT_TRUE(driver_->Destroy(*ref).ok());
}

TEST_F(NanoDriverTest, StepsNulByteNameFromTheGuestNeverReachesTheManifest) {
  absl::StatusOr<InstanceRef> ref = driver_->Create("steps_nul", EnvSpec{});
  ASSERT_TRUE(ref.ok()) << ref.status();
  ASSERT_TRUE(driver_->WriteFile(*ref, "ok.txt", "fine", 0, true).ok());
  RunRequest nul;
  nul.argv = {"testguest", "nulname"};
  absl::StatusOr<RunResult> r = driver_->RunCode(&*ref, nul, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  // The MemFs refuses the name (EINVAL = 28), so it never reaches a listing; the listing is
  // length-prefixed and the driver refuses NUL paths anyway (defence in depth).
  EXPECT_EQ(r->stdout_data, "nulname: errno 28\n");
  esb::testing::MemoryBlobStore blobs;
  absl::StatusOr<StepState> s = driver_->CaptureStep(*ref, CaptureOptions{}, blobs);
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->workspace.entries.size(), 1u);
  EXPECT_EQ(s->workspace.entries[0].path, "ok.txt");
  ASSERT_TRUE(driver_->DeleteSnapshot(*s->memory).ok());
  // The session is unharmed.
  absl::StatusOr<FileChunk> c = driver_->ReadFile(*ref, "ok.txt", 0, -1);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->data, "fine");
  ASSERT_TRUE(driver_->Destroy(*ref).ok());
}

TEST_F(NanoDriverTest, StepsCompactOfAGuestWithoutSavableGlobalsIsUnimplemented) {
  NanoDriverOptions o = TestOptions();
  char dir[] = "/tmp/esb-nano-img-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  o.snapshot_dir = std::string(dir) + "/images";
  auto driver = NewNanoDriver(o);
  absl::StatusOr<InstanceRef> ref = driver->Create("steps_noglobals", EnvSpec{});
  ASSERT_TRUE(ref.ok()) << ref.status();
  esb::testing::MemoryBlobStore blobs;
  absl::StatusOr<StepState> s = driver->CaptureStep(*ref, CaptureOptions{}, blobs);
  ASSERT_TRUE(s.ok()) << s.status();
  absl::StatusOr<SnapshotRef> c = driver->CompactSnapshot(*s->memory);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnimplemented) << c.status();
  EXPECT_NE(c.status().message().find("testguest"), std::string::npos) << c.status();
  // Nothing half-written is left behind.
  std::error_code ec;
  int files = 0;
  for (auto it = std::filesystem::directory_iterator(o.snapshot_dir, ec);
       !ec && it != std::filesystem::directory_iterator(); ++it) {
    files++;
  }
  EXPECT_EQ(files, 0);
  ASSERT_TRUE(driver->DeleteSnapshot(*s->memory).ok());
  ASSERT_TRUE(driver->Destroy(*ref).ok());
  std::filesystem::remove_all(dir);
}

class NanoAbiTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    NanoDriverOptions o;
    o.worker_path = NANO_ABI_WORKER;
    o.default_timeout_ms = 10000;
    o.cgroup_name = "esb-nano-test";
    driver_ = NewNanoDriver(o).release();
  }
  static void TearDownTestSuite() {
    delete driver_;
    driver_ = nullptr;
  }
  RunResult Toy(const std::string& code, const InstanceRef* session = nullptr,
                int64_t timeout_ms = 0) {
    RunRequest r;
    r.code = code;
    r.timeout_ms = timeout_ms;
    absl::StatusOr<RunResult> res = driver_->RunCode(session, r, nullptr);
    EXPECT_TRUE(res.ok()) << res.status();
    return res.ok() ? *res : RunResult{};
  }
  static NanoDriver* driver_;
};
NanoDriver* NanoAbiTest::driver_ = nullptr;

TEST_F(NanoAbiTest, OneShotRunsAreFreshAndReseeded) {
  EXPECT_EQ(Toy("set 5").exit_code, 0);
  // A new one-shot run starts from the server's pristine instance, reseeded once and warmed by
  // one empty run (worker.cc: Prepare), so this is the instance's second esb_run.
  EXPECT_EQ(Toy("get").stdout_data, "value 0 reseeds 1 runs 2\n");
  EXPECT_EQ(Toy("cwd").stdout_data, "cwd /\n");
  EXPECT_EQ(Toy("echo hi\nthere").stdout_data, "hi\nthere");
}

TEST_F(NanoAbiTest, StructuredErrorsAndUnsupported) {
  RunResult r = Toy("raise ValueError bad_value");
  EXPECT_EQ(r.exit_code, 1);
  ASSERT_TRUE(r.error.has_value());
  EXPECT_EQ(r.error->type, "ValueError");
  EXPECT_EQ(r.error->message, "bad_value");
  EXPECT_NE(r.error->traceback.find("Traceback"), std::string::npos);
  EXPECT_TRUE(r.unsupported_module.empty());
  RunResult u = Toy("unsupported numpy");
  EXPECT_EQ(u.unsupported_module, "numpy");
  ASSERT_TRUE(u.error.has_value());
  EXPECT_EQ(u.error->type, "ModuleNotFoundError");
  RunResult e = Toy("exit 3");
  EXPECT_EQ(e.exit_code, 3);
  EXPECT_FALSE(e.error.has_value());
}

TEST_F(NanoAbiTest, SessionKeepsStateAcrossRuns) {
  absl::StatusOr<InstanceRef> ref = driver_->Create("abi_s", EnvSpec{});
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ(Toy("set 41", &*ref).exit_code, 0);
  EXPECT_EQ(Toy("get", &*ref).stdout_data, "value 41 reseeds 1 runs 2\n");
  // An error does not reset the session.
  EXPECT_EQ(Toy("raise KeyError k", &*ref).exit_code, 1);
  EXPECT_EQ(Toy("get", &*ref).stdout_data, "value 41 reseeds 1 runs 4\n");
  // Snapshot by fork: the copy continues from the same memory, independently.
  absl::StatusOr<InstanceRef> copy = driver_->Fork(*ref, "abi_copy");
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_EQ(Toy("set 7", &*copy).exit_code, 0);
  EXPECT_EQ(Toy("get", &*copy).stdout_data, "value 7 reseeds 1 runs 6\n");
  EXPECT_EQ(Toy("get", &*ref).stdout_data, "value 41 reseeds 1 runs 5\n");
  // proc_exit discards the instance: fresh interpreter, reseeded again.
  EXPECT_EQ(Toy("procexit 9", &*ref).exit_code, 9);
  EXPECT_EQ(Toy("get", &*ref).stdout_data, "value 0 reseeds 1 runs 1\n");
  // So does a timeout.
  EXPECT_EQ(Toy("set 8", &*ref).exit_code, 0);
  RunResult t = Toy("loop", &*ref, 200);
  EXPECT_EQ(t.exit_code, 124);
  EXPECT_TRUE(t.instance_reset);
  EXPECT_EQ(Toy("get", &*ref).stdout_data, "value 0 reseeds 1 runs 1\n");
  ASSERT_TRUE(driver_->Destroy(*copy).ok());
  ASSERT_TRUE(driver_->Destroy(*ref).ok());
}

TEST_F(NanoAbiTest, ManySessionsAreCheap) {
  std::vector<InstanceRef> refs;
  for (int i = 0; i < 20; i++) {
    absl::StatusOr<InstanceRef> ref = driver_->Create("abi_many_" + std::to_string(i), EnvSpec{});
    ASSERT_TRUE(ref.ok()) << ref.status();
    ASSERT_EQ(Toy("set " + std::to_string(i), &*ref).exit_code, 0);
    refs.push_back(*ref);
  }
  for (int i = 0; i < 20; i++) {
    EXPECT_EQ(Toy("get", &refs[i]).stdout_data,
              "value " + std::to_string(i) + " reseeds 1 runs 2\n");
    ASSERT_TRUE(driver_->Destroy(refs[i]).ok());
  }
}

}  // namespace
}  // namespace esb

// ---------------- real CPython (nanobuild's artefact) ----------------

namespace esb {
namespace {

class NanoPythonTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (std::string(NANO_PYTHON_WORKER).empty()) return;
    absl::StatusOr<NanoDriverOptions> o = PythonNanoOptions(NANO_PYTHON_WORKER, NANO_PYTHON_DIR);
    if (!o.ok()) return;
    o->default_timeout_ms = 20000;
    o->cgroup_name = "esb-nano-test";
    char dir[] = "/tmp/esb-nano-py-XXXXXX";
    if (mkdtemp(dir) != nullptr) {
      image_root_ = dir;
      o->snapshot_dir = image_root_ + "/images";
    }
    driver_ = NewNanoDriver(*o).release();
  }
  static void TearDownTestSuite() {
    delete driver_;
    driver_ = nullptr;
    if (!image_root_.empty()) std::filesystem::remove_all(image_root_);
  }
  void SetUp() override {
    if (driver_ == nullptr) {
      GTEST_SKIP() << "nanobuild's python artefact (" NANO_PYTHON_DIR
                      "/libpython_wasm.a, stdlib.pack) was not present at configure time";
    }
  }
  RunResult Py(const std::string& code, const InstanceRef* session = nullptr,
               int64_t timeout_ms = 0, int64_t memory_mb = 0, int64_t max_out = 0) {
    RunRequest r;
    r.code = code;
    r.timeout_ms = timeout_ms;
    r.memory_limit_mb = memory_mb;
    r.max_output_bytes = max_out;
    absl::StatusOr<RunResult> res = driver_->RunCode(session, r, nullptr);
    EXPECT_TRUE(res.ok()) << res.status();
    return res.ok() ? *res : RunResult{};
  }
  // Time travel helpers.
  std::string Out(const std::string& code, const InstanceRef& ref) {
    RunResult r = Py(code, &ref);
    EXPECT_EQ(r.exit_code, 0) << code << ": " << r.stderr_data;
    return r.stdout_data;
  }
  std::string File(const InstanceRef& ref, const std::string& path) {
    absl::StatusOr<FileChunk> c = driver_->ReadFile(ref, path, 0, -1);
    return c.ok() ? c->data : "<" + c.status().ToString() + ">";
  }
  StepState Capture(const InstanceRef& ref, esb::testing::MemoryBlobStore& blobs,
                    const WorkspaceManifest* previous = nullptr) {
    CaptureOptions o;
    o.previous = previous;
    absl::StatusOr<StepState> s = driver_->CaptureStep(ref, o, blobs);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : StepState{};
  }
  static NanoDriver* driver_;
  static std::string image_root_;
};
NanoDriver* NanoPythonTest::driver_ = nullptr;
std::string NanoPythonTest::image_root_;

TEST_F(NanoPythonTest, PrintOnePlusOne) {
  RunResult r = Py("print(1+1)");
  EXPECT_EQ(r.stdout_data, "2\n");
  EXPECT_EQ(r.exit_code, 0) << r.stderr_data;
  EXPECT_FALSE(r.error.has_value());
}

TEST_F(NanoPythonTest, JsonAndRe) {
  RunResult r = Py("import json, re\n"
                   "print(json.dumps({'a': [1, 2]}, sort_keys=True))\n"
                   "print(re.findall(r'\\d+', 'a1b22c333'))\n"
                   "print(json.loads('{\"x\": 1.5}')['x'] * 2)\n");
  EXPECT_EQ(r.stdout_data, "{\"a\": [1, 2]}\n['1', '22', '333']\n3.0\n") << r.stderr_data;
}

TEST_F(NanoPythonTest, ExceptionIsStructured) {
  RunResult r = Py("def f():\n    return 1/0\nf()\n");
  EXPECT_EQ(r.exit_code, 1);
  ASSERT_TRUE(r.error.has_value()) << r.stderr_data;
  EXPECT_EQ(r.error->type, "ZeroDivisionError");
  EXPECT_EQ(r.error->message, "division by zero");
  EXPECT_NE(r.error->traceback.find("in f"), std::string::npos) << r.error->traceback;
  EXPECT_NE(r.stderr_data.find("ZeroDivisionError"), std::string::npos);
  EXPECT_TRUE(r.unsupported_module.empty());
  RunResult syn = Py("def (:\n");
  ASSERT_TRUE(syn.error.has_value());
  EXPECT_EQ(syn.error->type, "SyntaxError");
}

TEST_F(NanoPythonTest, UnsupportedImportAndFeatures) {
  RunResult r = Py("import numpy as np\n");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.unsupported_module, "numpy");
  ASSERT_TRUE(r.error.has_value());
  EXPECT_EQ(r.error->type, "ModuleNotFoundError");
  RunResult s = Py("import socket\nsocket.create_connection(('1.1.1.1', 80))\n");
  EXPECT_EQ(s.exit_code, 1);
  EXPECT_EQ(s.unsupported_module, "socket") << s.stderr_data;
  RunResult p = Py("import subprocess\nsubprocess.run(['ls'])\n");
  EXPECT_EQ(p.unsupported_module, "subprocess") << p.stderr_data;
  // Caught by the user: not an error.
  RunResult c = Py("try:\n    import pandas\nexcept ImportError:\n    print('no pandas')\n");
  EXPECT_EQ(c.exit_code, 0);
  EXPECT_EQ(c.stdout_data, "no pandas\n");
  EXPECT_TRUE(c.unsupported_module.empty());
}

TEST_F(NanoPythonTest, EscapesAndLimits) {
  RunResult r = Py("import os\n"
                   "print(sorted(os.listdir('/')))\n"
                   "for p in ['/etc/passwd', '../../etc/passwd', '/proc/self/environ']:\n"
                   "    try:\n"
                   "        open(p).read(); print('LEAK', p)\n"
                   "    except OSError as e:\n"
                   "        print(type(e).__name__)\n");
  EXPECT_EQ(r.stdout_data.find("LEAK"), std::string::npos) << r.stdout_data;
  EXPECT_NE(r.stdout_data.find("['.esb', 'tmp', 'usr', 'workspace']"), std::string::npos)
      << r.stdout_data << r.stderr_data;
  RunResult m = Py("x = bytearray(512 * 1024 * 1024)\n", nullptr, 0, 64);
  ASSERT_TRUE(m.error.has_value()) << m.stderr_data;
  EXPECT_EQ(m.error->type, "MemoryError");
  RunResult rec = Py("def f(n):\n    return f(n + 1)\nf(0)\n");
  ASSERT_TRUE(rec.error.has_value()) << rec.stderr_data;
  EXPECT_EQ(rec.error->type, "RecursionError");
  RunResult out = Py("print('x' * 5_000_000)", nullptr, 0, 0, 10000);
  EXPECT_TRUE(out.truncated);
  EXPECT_EQ(out.stdout_data.size(), 10000u);
  int64_t t0 = nano::NowMonoMs();
  RunResult loop = Py("while True:\n    pass\n", nullptr, 500);
  EXPECT_TRUE(loop.timed_out);
  EXPECT_EQ(loop.exit_code, 124);
  EXPECT_LT(nano::NowMonoMs() - t0, 2500);
  RunResult big = Py("x = 10 ** (10 ** 8)\n", nullptr, 500);
  EXPECT_EQ(big.exit_code, 124);
  RunResult nap = Py("import time\ntime.sleep(100)\n", nullptr, 500);
  EXPECT_EQ(nap.exit_code, 124);
  EXPECT_LT(nap.duration_ms, 2500);
  RunResult ok_nap = Py("import time\ntime.sleep(0.05)\nprint('woke')\n");
  EXPECT_EQ(ok_nap.stdout_data, "woke\n") << ok_nap.stderr_data;
  RunResult rnd1 = Py("import random; print(random.random())");
  RunResult rnd2 = Py("import random; print(random.random())");
  EXPECT_NE(rnd1.stdout_data, rnd2.stdout_data);
}

TEST_F(NanoPythonTest, SessionKeepsStateAndFiles) {
  EnvSpec spec;
  spec.runtime = DriverKind::kNano;
  absl::StatusOr<InstanceRef> ref = driver_->Create("py_sess", spec);
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ(Py("x = 41\nimport json\n", &*ref).exit_code, 0);
  EXPECT_EQ(Py("print(x + 1, json.dumps([x]))", &*ref).stdout_data, "42 [41]\n");
  ASSERT_TRUE(driver_->WriteFile(*ref, "data/in.txt", "hello from host", 0, true).ok());
  RunResult r = Py("print(open('data/in.txt').read().upper())\n"
                   "open('/workspace/out.txt', 'w').write('from python')\n",
                   &*ref);
  EXPECT_EQ(r.stdout_data, "HELLO FROM HOST\n") << r.stderr_data;
  absl::StatusOr<FileChunk> c = driver_->ReadFile(*ref, "out.txt", 0, -1);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->data, "from python");
  // Snapshot: fork the session; the copy has x and evolves independently.
  absl::StatusOr<InstanceRef> copy = driver_->Fork(*ref, "py_copy");
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_EQ(Py("x = 100", &*copy).exit_code, 0);
  EXPECT_EQ(Py("print(x)", &*copy).stdout_data, "100\n");
  EXPECT_EQ(Py("print(x)", &*ref).stdout_data, "41\n");
  // A timeout discards the interpreter but keeps the workspace.
  RunResult t = Py("while True: pass", &*ref, 300);
  EXPECT_EQ(t.exit_code, 124);
  EXPECT_TRUE(t.instance_reset);
  RunResult after = Py("print('x' in globals(), open('out.txt').read())", &*ref);
  EXPECT_EQ(after.stdout_data, "False from python\n") << after.stderr_data;
  ASSERT_TRUE(driver_->Destroy(*copy).ok());
  ASSERT_TRUE(driver_->Destroy(*ref).ok());
}

// ---------------- Time travel (kSteps) with CPython ----------------

TEST_F(NanoPythonTest, StepRewindBringsBackVariablesAndFilesAndContinues) {
  absl::StatusOr<InstanceRef> ref = driver_->Create("tt_rewind", EnvSpec{});
  ASSERT_TRUE(ref.ok()) << ref.status();
  esb::testing::MemoryBlobStore blobs;
  Out("x = 1\nhist = ['one']\nopen('a.txt', 'w').write('one')\n", *ref);
  StepState s1 = Capture(*ref, blobs);
  ASSERT_TRUE(s1.memory.has_value());
  EXPECT_TRUE(s1.memory->live);
  EXPECT_GT(s1.memory->bytes, 0);
  Out("x = 2\nhist.append('two')\nopen('a.txt', 'w').write('two')\n"
      "open('b.txt', 'w').write('new')\n",
      *ref);
  StepState s2 = Capture(*ref, blobs, &s1.workspace);
  ASSERT_EQ(s2.workspace.entries.size(), 2u);
  EXPECT_EQ(*blobs.Get(s2.workspace.entries[0].sha256), "two");
  // Rewind in place to step 1: memory and files as they were.
  absl::StatusOr<InstanceRef> back = driver_->RestoreStep(*ref, s1, blobs);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->id, ref->id);
  EXPECT_EQ(Out("print(x, hist)", *back), "1 ['one']\n");
  EXPECT_EQ(File(*back, "a.txt"), "one");
  EXPECT_NE(File(*back, "b.txt").find("NOT_FOUND"), std::string::npos) << File(*back, "b.txt");
  // Continue after the rewind, then rewind again: the step's snapshot is reusable.
  EXPECT_EQ(Out("x += 10\nhist.append('retry')\nprint(x, hist)", *back), "11 ['one', 'retry']\n");
  back = driver_->RestoreStep(*ref, s1, blobs);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(Out("print(x, hist)", *back), "1 ['one']\n");
  // And forward to step 2 (a later step stays usable as a branch).
  back = driver_->RestoreStep(*ref, s2, blobs);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(Out("print(x, hist, open('b.txt').read())", *back), "2 ['one', 'two'] new\n");
  for (const StepState* s : {&s1, &s2}) ASSERT_TRUE(driver_->DeleteSnapshot(*s->memory).ok());
  ASSERT_TRUE(driver_->Destroy(*ref).ok());
}

TEST_F(NanoPythonTest, StepRewindWithoutMemoryRestoresExactFilesAndAFreshInterpreter) {
  absl::StatusOr<InstanceRef> ref = driver_->Create("tt_nomem", EnvSpec{});
  ASSERT_TRUE(ref.ok()) << ref.status();
  esb::testing::MemoryBlobStore blobs;
  Out("x = 1\nimport os\nos.makedirs('d/e', exist_ok=True)\nopen('d/f.txt', 'w').write('f1')\n",
      *ref);
  CaptureOptions o;
  o.memory = false;
  absl::StatusOr<StepState> s1 = driver_->CaptureStep(*ref, o, blobs);
  ASSERT_TRUE(s1.ok()) << s1.status();
  EXPECT_FALSE(s1->memory.has_value());
  Out("open('d/f.txt', 'w').write('f2')\nopen('g.txt', 'w').write('g')\n", *ref);
  absl::StatusOr<InstanceRef> back = driver_->RestoreStep(*ref, *s1, blobs);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(Out("import os\nprint('x' in globals(), sorted(os.listdir('.')), "
                "os.path.isdir('d/e'), open('d/f.txt').read())",
                *back),
            "False ['d'] True f1\n");
  ASSERT_TRUE(driver_->Destroy(*ref).ok());
}

TEST_F(NanoPythonTest, TwoForksOfOneStepDivergeIndependently) {
  absl::StatusOr<InstanceRef> ref = driver_->Create("tt_forksrc", EnvSpec{});
  ASSERT_TRUE(ref.ok()) << ref.status();
  esb::testing::MemoryBlobStore blobs;
  Out("x = 5\nopen('f.txt', 'w').write('five')\n", *ref);
  StepState s = Capture(*ref, blobs);
  Out("x = 6\n", *ref);
  absl::StatusOr<InstanceRef> a = driver_->ForkStep(s, EnvSpec{}, "tt_fork_a", blobs);
  absl::StatusOr<InstanceRef> b = driver_->ForkStep(s, EnvSpec{}, "tt_fork_b", blobs);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(Out("print(x, open('f.txt').read())", *a), "5 five\n");
  EXPECT_EQ(Out("print(x, open('f.txt').read())", *b), "5 five\n");
  Out("x = 'a'\nopen('f.txt', 'w').write('from a')\n", *a);
  Out("x = 'b'\nopen('f.txt', 'w').write('from b')\n", *b);
  EXPECT_EQ(Out("print(x, open('f.txt').read())", *a), "a from a\n");
  EXPECT_EQ(Out("print(x, open('f.txt').read())", *b), "b from b\n");
  EXPECT_EQ(Out("print(x, open('f.txt').read())", *ref), "6 five\n");
  for (const InstanceRef* r : {&*a, &*b, &*ref}) ASSERT_TRUE(driver_->Destroy(*r).ok());
  ASSERT_TRUE(driver_->DeleteSnapshot(*s.memory).ok());
}

TEST_F(NanoPythonTest, CompactedStepRestoresAndForksEqual) {
  absl::StatusOr<InstanceRef> ref = driver_->Create("tt_compact", EnvSpec{});
  ASSERT_TRUE(ref.ok()) << ref.status();
  esb::testing::MemoryBlobStore blobs;
  Out("import random, json\nrandom.seed(7)\nbig = list(range(200000))\n"
      "d = {'k': [1, 2, 3]}\nlog = open('log.txt', 'a')\nlog.write('one\\n')\nlog.flush()\n"
      "import os\nos.makedirs('sub', exist_ok=True)\n"
      "open('sub/x.bin', 'wb').write(bytes(range(256)) * 100)\n",
      *ref);
  StepState s = Capture(*ref, blobs);
  // What comes next from this state, in the original (a run in a fork of the live step).
  absl::StatusOr<InstanceRef> probe = driver_->ForkStep(s, EnvSpec{}, "tt_probe", blobs);
  ASSERT_TRUE(probe.ok()) << probe.status();
  const std::string next = "print(random.random(), len(big), sum(big), d)";
  std::string expected = Out(next, *probe);
  ASSERT_TRUE(driver_->Destroy(*probe).ok());
  absl::StatusOr<SnapshotRef> compact = driver_->CompactSnapshot(*s.memory);
  ASSERT_TRUE(compact.ok()) << compact.status();
  EXPECT_FALSE(compact->live);
  EXPECT_GT(compact->bytes, 0);
  // The live clone is gone.
  EXPECT_FALSE(driver_->SessionPid({s.memory->id, "nano", ""}).ok());
  StepState cs = s;
  cs.memory = *compact;
  Out("big = None\nd = None\nlog.write('two\\n')\nlog.flush()\n", *ref);
  absl::StatusOr<InstanceRef> back = driver_->RestoreStep(*ref, cs, blobs);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(Out(next, *back), expected);
  // The open file came back at its offset; the file system is the step's.
  Out("log.write('after\\n')\nlog.flush()\n", *back);
  EXPECT_EQ(File(*back, "log.txt"), "one\nafter\n");
  EXPECT_EQ(File(*back, "sub/x.bin").size(), 25600u);
  // Two forks of the compacted step, independent of each other and of the session.
  absl::StatusOr<InstanceRef> a = driver_->ForkStep(cs, EnvSpec{}, "tt_cfork_a", blobs);
  absl::StatusOr<InstanceRef> b = driver_->ForkStep(cs, EnvSpec{}, "tt_cfork_b", blobs);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(Out(next, *a), expected);
  Out("d['k'] = 'a'\n", *a);
  EXPECT_EQ(Out("print(d)", *b), "{'k': [1, 2, 3]}\n");
  EXPECT_EQ(Out("print(d)", *a), "{'k': 'a'}\n");
  for (const InstanceRef* r : {&*a, &*b, &*ref}) ASSERT_TRUE(driver_->Destroy(*r).ok());
  ASSERT_TRUE(driver_->DeleteSnapshot(*compact).ok());
  // Deleted: a restore now says the image is gone.
  absl::StatusOr<InstanceRef> gone = driver_->ForkStep(cs, EnvSpec{}, "tt_gone", blobs);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kFailedPrecondition) << gone.status();
}

TEST_F(NanoPythonTest, CompactedStepComesBackAfterARestart) {
  // A first "esbd": capture and compact, then it goes away with its sessions and clones.
  absl::StatusOr<NanoDriverOptions> o = PythonNanoOptions(NANO_PYTHON_WORKER, NANO_PYTHON_DIR);
  ASSERT_TRUE(o.ok()) << o.status();
  o->cgroup_name = "";
  o->snapshot_dir = image_root_ + "/restart-images";
  esb::testing::MemoryBlobStore blobs;
  StepState s;
  InstanceRef ref;
  {
    auto first = NewNanoDriver(*o);
    absl::StatusOr<InstanceRef> r = first->Create("tt_restart", EnvSpec{});
    ASSERT_TRUE(r.ok()) << r.status();
    ref = *r;
    RunRequest run;
    run.code = "survivor = {'step': 1}\nopen('kept.txt', 'w').write('on disk')\n";
    ASSERT_TRUE(first->RunCode(&ref, run, nullptr).ok());
    absl::StatusOr<StepState> c = first->CaptureStep(ref, CaptureOptions{}, blobs);
    ASSERT_TRUE(c.ok()) << c.status();
    s = *c;
    absl::StatusOr<SnapshotRef> img = first->CompactSnapshot(*s.memory);
    ASSERT_TRUE(img.ok()) << img.status();
    s.memory = *img;
  }
  // The second one rewinds the (gone) session to the compacted step.
  auto second = NewNanoDriver(*o);
  EXPECT_FALSE(second->Attach(ref).ok());
  absl::StatusOr<InstanceRef> back = second->RestoreStep(ref, s, blobs);
  ASSERT_TRUE(back.ok()) << back.status();
  RunRequest check;
  check.code = "print(survivor, open('kept.txt').read())";
  absl::StatusOr<RunResult> r = second->RunCode(&*back, check, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->stdout_data, "{'step': 1} on disk\n") << r->stderr_data;
  ASSERT_TRUE(second->DeleteSnapshot(*s.memory).ok());
  ASSERT_TRUE(second->Destroy(*back).ok());
}

// ---------------- Time travel: live clones and images are accounted (review H3) ----------------

// A driver of its own (budgets set per test), its images in a fresh directory.
std::unique_ptr<NanoDriver> BudgetDriver(const std::string& dir, int64_t env_live_mb,
                                         int64_t live_mb, int64_t image_env_mb, int64_t image_mb) {
  absl::StatusOr<NanoDriverOptions> o = PythonNanoOptions(NANO_PYTHON_WORKER, NANO_PYTHON_DIR);
  if (!o.ok()) return nullptr;
  o->cgroup_name = "";
  o->snapshot_dir = dir;
  o->live_snapshot_env_max_mb = env_live_mb;
  o->live_snapshot_max_mb = live_mb;
  o->image_env_max_mb = image_env_mb;
  o->image_max_mb = image_mb;
  return NewNanoDriver(*o);
}

// One step that keeps a new 24 MiB object (the old one is freed, its pages stay with the clones).
RunResult BigStep(NanoDriver& d, const InstanceRef& ref, int n) {
  RunRequest r;
  r.code = absl::StrCat("step = ", n, "\nbig = bytes([", n, "]) * (24 << 20)\n");
  r.timeout_ms = 20000;
  absl::StatusOr<RunResult> res = d.RunCode(&ref, r, nullptr);
  if (res.ok()) return *res;
  RunResult failed;
  failed.exit_code = -1;
  failed.stderr_data = res.status().ToString();
  return failed;
}

std::string RunOn(NanoDriver& d, const InstanceRef& ref, const std::string& code) {
  RunRequest r;
  r.code = code;
  absl::StatusOr<RunResult> res = d.RunCode(&ref, r, nullptr);
  if (!res.ok()) return res.status().ToString();
  return res->stdout_data + res->stderr_data;
}

TEST_F(NanoPythonTest, LiveClonesOfAnEnvironmentKeeping24MiBPerStepStayWithinItsBudget) {
  // The attack: every step leaves 24 MiB that only its frozen clone keeps. With 16 live clones
  // (the core's default; up to 256) that was 384 MiB (6 GiB) of unaccounted RAM per environment.
  auto d = BudgetDriver(image_root_ + "/h3-env", /*env_live_mb=*/64, 0, 1024, 8192);
  ASSERT_NE(d, nullptr);
  absl::StatusOr<InstanceRef> ref = d->Create("h3_env", EnvSpec{});
  ASSERT_TRUE(ref.ok()) << ref.status();
  esb::testing::MemoryBlobStore blobs;
  std::vector<StepState> steps;
  int64_t most = 0;
  for (int n = 1; n <= 6; n++) {
    RunResult r = BigStep(*d, *ref, n);
    ASSERT_EQ(r.exit_code, 0) << r.stderr_data;
    absl::StatusOr<StepState> s = d->CaptureStep(*ref, CaptureOptions{}, blobs);
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_TRUE(s->memory.has_value()) << "step " << n;
    steps.push_back(*s);
    const int64_t live = d->LiveSnapshotBytes("h3_env");
    EXPECT_LE(live, int64_t{64} << 20) << "step " << n;
    most = std::max(most, live);
    // Measured independently: the PSS of the clones still alive.
    int64_t pss = 0;
    for (const StepState& st : steps) {
      absl::StatusOr<int> pid = d->SessionPid({st.memory->id, "nano", ""});
      std::ifstream f(absl::StrCat("/proc/", pid.ok() ? *pid : 0, "/smaps_rollup"));
      for (std::string line; pid.ok() && std::getline(f, line);) {
        if (line.rfind("Pss:", 0) == 0) pss += std::strtoll(line.c_str() + 4, nullptr, 10) << 10;
      }
    }
    EXPECT_LE(pss, int64_t{68} << 20) << "step " << n;
  }
  // The charge is real (PSS of clones holding 24 MiB objects), not zero.
  EXPECT_GE(most, int64_t{30} << 20);
  // The oldest clones went to images the core has to adopt; the newest stayed live.
  std::set<std::string> released = d->ReleasedSnapshots("h3_env");
  EXPECT_GE(released.size(), 3u);
  EXPECT_TRUE(released.count(steps[0].memory->id));
  EXPECT_FALSE(released.count(steps.back().memory->id));
  EXPECT_TRUE(d->HasReleasedSnapshots());
  EXPECT_GT(d->ImageBytes("h3_env"), 0);
  // Before the core adopts it, a released step still comes back exactly (from its image)...
  absl::StatusOr<InstanceRef> back = d->RestoreStep(*ref, steps[0], blobs);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(RunOn(*d, *back, "print(step, len(big), big[-1])"), "1 25165824 1\n");
  // ...and after: CompactSnapshot answers the image (no new dump), which restores too.
  absl::StatusOr<SnapshotRef> adopted = d->CompactSnapshot(*steps[1].memory);
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  EXPECT_FALSE(adopted->live);
  EXPECT_GT(adopted->bytes, 0);
  EXPECT_FALSE(d->ReleasedSnapshots("h3_env").count(steps[1].memory->id));
  StepState cs = steps[1];
  cs.memory = *adopted;
  absl::StatusOr<InstanceRef> fork = d->ForkStep(cs, EnvSpec{}, "h3_fork", blobs);
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_EQ(RunOn(*d, *fork, "print(step, big[0])"), "2 2\n");
  // Releasing everything leaves no image and no charge behind.
  ASSERT_TRUE(d->DeleteSnapshot(*adopted).ok());
  for (size_t i = 0; i < steps.size(); i++) {
    if (i != 1) ASSERT_TRUE(d->DeleteSnapshot(*steps[i].memory).ok());
  }
  EXPECT_EQ(d->LiveSnapshotBytes("h3_env"), 0);
  EXPECT_EQ(d->ImageBytes(), 0);
  EXPECT_FALSE(d->HasReleasedSnapshots());
  EXPECT_TRUE(std::filesystem::is_empty(image_root_ + "/h3-env"));
}

TEST_F(NanoPythonTest, ASecondEnvironmentStillCapturesLiveWhenAnotherFilledTheDriversBudget) {
  auto d =
      BudgetDriver(image_root_ + "/h3-global", /*env_live_mb=*/1024, /*live_mb=*/80, 1024, 8192);
  ASSERT_NE(d, nullptr);
  absl::StatusOr<InstanceRef> a = d->Create("h3_a", EnvSpec{});
  absl::StatusOr<InstanceRef> b = d->Create("h3_b", EnvSpec{});
  ASSERT_TRUE(a.ok() && b.ok());
  esb::testing::MemoryBlobStore blobs;
  std::vector<StepState> kept;
  for (int n = 1; n <= 4; n++) {
    ASSERT_EQ(BigStep(*d, *a, n).exit_code, 0);
    absl::StatusOr<StepState> s = d->CaptureStep(*a, CaptureOptions{}, blobs);
    ASSERT_TRUE(s.ok()) << s.status();
    kept.push_back(*s);
    EXPECT_LE(d->LiveSnapshotBytes(), int64_t{80} << 20) << "step " << n;
  }
  EXPECT_GT(d->LiveSnapshotBytes("h3_a"), int64_t{24} << 20);
  // B runs and its steps still get live memory snapshots: A's oldest clones make room.
  for (int n = 1; n <= 2; n++) {
    ASSERT_EQ(BigStep(*d, *b, 100 + n).exit_code, 0);
    absl::StatusOr<StepState> s = d->CaptureStep(*b, CaptureOptions{}, blobs);
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_TRUE(s->memory.has_value());
    EXPECT_TRUE(s->memory->live);
    kept.push_back(*s);
    EXPECT_LE(d->LiveSnapshotBytes(), int64_t{80} << 20);
  }
  EXPECT_GT(d->LiveSnapshotBytes("h3_b"), 0);
  EXPECT_FALSE(d->ReleasedSnapshots("h3_a").empty());
  EXPECT_TRUE(d->ReleasedSnapshots("h3_b").empty());
  EXPECT_EQ(RunOn(*d, *b, "print(step)"), "102\n");
  for (const StepState& s : kept) ASSERT_TRUE(d->DeleteSnapshot(*s.memory).ok());
  EXPECT_EQ(d->ImageBytes(), 0);
}

TEST_F(NanoPythonTest, CompactionsOverTheImageCapsAreRefusedWithTheReason) {
  esb::testing::MemoryBlobStore blobs;
  // 8 MiB of random bytes per step: images that do not deflate, each about `one` bytes.
  auto step = [&](NanoDriver& d, const InstanceRef& ref) {
    EXPECT_EQ(RunOn(d, ref, "import os\nnoise = os.urandom(8 << 20)\n"), "");
    absl::StatusOr<StepState> s = d.CaptureStep(ref, CaptureOptions{}, blobs);
    EXPECT_TRUE(s.ok() && s->memory) << s.status();
    return s.ok() && s->memory ? *s->memory : SnapshotRef{};
  };
  int64_t one = 0;
  {
    auto probe = BudgetDriver(image_root_ + "/h3-probe", 0, 0, 1024, 8192);
    ASSERT_NE(probe, nullptr);
    absl::StatusOr<InstanceRef> p = probe->Create("h3_probe", EnvSpec{});
    ASSERT_TRUE(p.ok()) << p.status();
    absl::StatusOr<SnapshotRef> img = probe->CompactSnapshot(step(*probe, *p));
    ASSERT_TRUE(img.ok()) << img.status();
    one = img->bytes;
    ASSERT_TRUE(probe->DeleteSnapshot(*img).ok());
  }
  ASSERT_GT(one, int64_t{8} << 20);
  // Caps: one image per environment (not two), two in all (not three).
  const int64_t env_mb = (one * 3 / 2) >> 20, all_mb = (one * 5 / 2) >> 20;
  const std::string dir = image_root_ + "/h3-images";
  auto d = BudgetDriver(dir, 0, 0, env_mb, all_mb);
  ASSERT_NE(d, nullptr);
  absl::StatusOr<InstanceRef> a = d->Create("h3_img_a", EnvSpec{});
  absl::StatusOr<InstanceRef> b = d->Create("h3_img_b", EnvSpec{});
  absl::StatusOr<InstanceRef> c = d->Create("h3_img_c", EnvSpec{});
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  // A step of `ref` (its live snapshot in *live) and the compaction of its memory: an image, or
  // refused with a reason that contains `refused` (nothing is left on disk for it).
  auto compact = [&](const InstanceRef& ref, SnapshotRef* live, const char* refused) {
    *live = step(*d, ref);
    absl::StatusOr<SnapshotRef> img = d->CompactSnapshot(*live);
    if (refused == nullptr) {
      EXPECT_TRUE(img.ok()) << img.status();
    } else {
      EXPECT_EQ(img.status().code(), absl::StatusCode::kResourceExhausted) << img.status();
      EXPECT_NE(img.status().message().find(refused), std::string::npos) << img.status();
    }
    return img.ok() ? *img : SnapshotRef{};
  };
  SnapshotRef a1, a2, b1, c1;
  const SnapshotRef img_a1 = compact(*a, &a1, nullptr);
  // A's second image would pass A's cap.
  compact(*a, &a2, "this environment's memory images");
  EXPECT_EQ(d->ImageBytes("h3_img_a"), img_a1.bytes);
  // B's image fits; C's would pass the cap of all environments.
  const SnapshotRef img_b1 = compact(*b, &b1, nullptr);
  compact(*c, &c1, "of all environments");
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
    files++;
  }
  EXPECT_EQ(files, 2);
  // A refused compaction leaves the live snapshot usable (the core then releases it).
  StepState at_c1;
  at_c1.memory = c1;
  absl::StatusOr<InstanceRef> back = d->RestoreStep(*c, at_c1, blobs);
  ASSERT_TRUE(back.ok()) << back.status();
  // Deleting A's image makes room for C.
  ASSERT_TRUE(d->DeleteSnapshot(img_a1).ok());
  absl::StatusOr<SnapshotRef> img_c1 = d->CompactSnapshot(c1);
  ASSERT_TRUE(img_c1.ok()) << img_c1.status();
  // A restart counts what is on disk (per environment, from the names) and removes leftovers:
  // a half-written image and one the driver made on its own that the core never adopted.
  for (const char* junk : {"/img_0123456789ab_0123456789ab.tmp", "/img_0123456789ab_0123.e"}) {
    std::ofstream(dir + junk) << "junk";
  }
  auto again = BudgetDriver(dir, 0, 0, env_mb, all_mb);
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(again->ImageBytes(), img_b1.bytes + img_c1->bytes);
  EXPECT_EQ(again->ImageBytes("h3_img_c"), img_c1->bytes);
  EXPECT_EQ(again->ImageBytes("h3_img_a"), 0);
  EXPECT_FALSE(std::filesystem::exists(dir + "/img_0123456789ab_0123456789ab.tmp"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/img_0123456789ab_0123.e"));
  ASSERT_TRUE(again->DeleteSnapshot(img_b1).ok());
  ASSERT_TRUE(again->DeleteSnapshot(*img_c1).ok());
  EXPECT_EQ(again->ImageBytes(), 0);
  EXPECT_TRUE(std::filesystem::is_empty(dir));
  (void)d->DeleteSnapshot(a2);
}

TEST_F(NanoPythonTest, CompactOfAFileOpenAfterUnlinkIsUnimplementedWithTheReason) {
  absl::StatusOr<InstanceRef> ref = driver_->Create("tt_unlinked", EnvSpec{});
  ASSERT_TRUE(ref.ok()) << ref.status();
  esb::testing::MemoryBlobStore blobs;
  Out("import os\nf = open('t.txt', 'w')\nos.unlink('t.txt')\n", *ref);
  StepState s = Capture(*ref, blobs);
  absl::StatusOr<SnapshotRef> c = driver_->CompactSnapshot(*s.memory);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnimplemented) << c.status();
  EXPECT_NE(c.status().message().find("no longer at its path"), std::string::npos) << c.status();
  // The live snapshot is still usable.
  absl::StatusOr<InstanceRef> back = driver_->RestoreStep(*ref, s, blobs);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(Out("print(f.closed)", *back), "False\n");
  ASSERT_TRUE(driver_->DeleteSnapshot(*s.memory).ok());
  ASSERT_TRUE(driver_->Destroy(*ref).ok());
}

TEST_F(NanoPythonTest, HostileImageIsRefusedAndTheSessionKeepsItsState) {
  absl::StatusOr<InstanceRef> ref = driver_->Create("tt_hostile", EnvSpec{});
  ASSERT_TRUE(ref.ok()) << ref.status();
  esb::testing::MemoryBlobStore blobs;
  Out("x = 'captured'\n", *ref);
  StepState s = Capture(*ref, blobs);
  absl::StatusOr<SnapshotRef> c = driver_->CompactSnapshot(*s.memory);
  ASSERT_TRUE(c.ok()) << c.status();
  Out("x = 'current'\n", *ref);
  boost::json::object st = boost::json::parse(c->state).as_object();
  std::string path = image_root_ + "/images/" + std::string(st["image"].as_string());
  std::string file;
  ASSERT_TRUE(ReadFileToString(path, &file).ok());
  // Images are deflated on disk: corrupt the raw image, deflate it again.
  std::string good(64u << 20, '\0');
  uLongf raw_len = good.size();
  ASSERT_EQ(uncompress(reinterpret_cast<Bytef*>(good.data()), &raw_len,
                       reinterpret_cast<const Bytef*>(file.data()), file.size()),
            Z_OK);
  good.resize(raw_len);
  auto deflated = [](const std::string& raw) {
    std::string z(compressBound(raw.size()), '\0');
    uLongf n = z.size();
    compress2(reinterpret_cast<Bytef*>(z.data()), &n, reinterpret_cast<const Bytef*>(raw.data()),
              raw.size(), 1);
    z.resize(n);
    return z;
  };
  // Page records: magic(8) + name(8+6) + globals(8+8) + pages(4) + count(4) = offset 46.
  std::string bad_index = good;
  uint32_t huge = 0xfffffff0u;
  memcpy(&bad_index[46], &huge, 4);
  std::string bad_count = good;
  memcpy(&bad_count[42], &huge, 4);
  std::string bad_pages = good;
  memcpy(&bad_pages[38], &huge, 4);
  std::string bad_fs = good;  // the MemFs records' length: past the end
  uint64_t bad_len = uint64_t{1} << 40;
  memcpy(&bad_fs[good.size() - 8], &bad_len, 8);
  // Each is refused (by the driver's inflate or the loading worker's checks, whose message
  // names what is wrong) and the session keeps its state.
  std::vector<std::pair<std::string, std::string>> cases = {
      {file.substr(0, file.size() / 2), "truncated"},
      {file + "trailing", "after the image"},
      {deflated("ESBNIMG0" + good.substr(8)), "magic"},
      {deflated(bad_index), "bad page record"},
      {deflated(bad_count), "more changed pages"},
      {deflated(bad_pages), "does not fit"},
      {deflated(bad_fs), "truncated or trailing"},
      {deflated(good + "trailing"), "truncated or trailing"},
      {std::string("not zlib at all"), "corrupt"}};
  for (const auto& [image, why] : cases) {
    ASSERT_TRUE(WriteStringToFile(path, image, 0600).ok());
    StepState cs = s;
    cs.memory = *c;
    absl::StatusOr<InstanceRef> back = driver_->RestoreStep(*ref, cs, blobs);
    EXPECT_FALSE(back.ok()) << why;
    EXPECT_NE(back.status().message().find(why), std::string::npos) << back.status();
    EXPECT_EQ(Out("print(x)", *ref), "current\n");
  }
  // A deflate bomb (96 MiB of zeros in ~100 KiB) for a 16 MiB session: refused by size while
  // inflating, never held whole.
  ASSERT_TRUE(WriteStringToFile(path, deflated(std::string(96u << 20, '\0')), 0600).ok());
  StepState bomb = s;
  bomb.memory = *c;
  bomb.memory->state = R"({"image":")" + std::string(st["image"].as_string()) +
                       R"(","memory_mb":16,"ws_bytes":1048576})";
  absl::StatusOr<InstanceRef> refused = driver_->RestoreStep(*ref, bomb, blobs);
  EXPECT_NE(refused.status().message().find("larger"), std::string::npos) << refused.status();
  EXPECT_EQ(Out("print(x)", *ref), "current\n");
  // A state naming a file outside the image directory is refused before any open.
  SnapshotRef escape = *c;
  escape.state = R"({"image":"../../etc/passwd","memory_mb":64})";
  StepState es = s;
  es.memory = escape;
  EXPECT_EQ(driver_->RestoreStep(*ref, es, blobs).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(WriteStringToFile(path, file, 0600).ok());
  StepState cs = s;
  cs.memory = *c;
  absl::StatusOr<InstanceRef> back = driver_->RestoreStep(*ref, cs, blobs);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(Out("print(x)", *back), "captured\n");
  ASSERT_TRUE(driver_->DeleteSnapshot(*c).ok());
  ASSERT_TRUE(driver_->Destroy(*ref).ok());
}

TEST_F(NanoPythonTest, VariablesSummaryRunsInAThrowawayCloneNotTheSession) {
  absl::StatusOr<InstanceRef> ref = driver_->Create("tt_vars", EnvSpec{});
  ASSERT_TRUE(ref.ok()) << ref.status();
  esb::testing::MemoryBlobStore blobs;
  const std::string names = "print(sorted(globals()), len(__import__('sys').modules))";
  Out("x = 42\nname = 'nano'\nimport json\n", *ref);
  std::string before = Out(names, *ref);
  StepState s = Capture(*ref, blobs);
  EXPECT_EQ(Out(names, *ref), before);
  // Nor does the frozen step carry anything of the summary.
  absl::StatusOr<InstanceRef> f = driver_->ForkStep(s, EnvSpec{}, "tt_vars_fork", blobs);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(Out(names, *f), before);
  ASSERT_TRUE(driver_->Destroy(*f).ok());
  ASSERT_TRUE(driver_->DeleteSnapshot(*s.memory).ok());
  ASSERT_TRUE(driver_->Destroy(*ref).ok());
  boost::json::value v = boost::json::parse(s.variables_json);
  ASSERT_TRUE(v.is_array()) << s.variables_json;
  std::map<std::string, std::string> repr;
  for (const auto& e : v.as_array()) {
    repr[std::string(e.at("name").as_string())] = std::string(e.at("repr").as_string());
  }
  EXPECT_EQ(repr["x"], "42") << s.variables_json;
  EXPECT_EQ(repr["name"], "'nano'") << s.variables_json;
  EXPECT_EQ(repr.count("json"), 0u) << "modules are left out: " << s.variables_json;
}

// Attack: the summary runs in (a throwaway clone of) the user's session, whose modules the user
// controls: a patched marshal.loads makes it print any JSON array. Only the summary's shape
// (objects with a string "name") is kept, as for the container's kernel.
TEST_F(NanoPythonTest, ForgedVariablesSummaryIsDropped) {
  absl::StatusOr<InstanceRef> ref = driver_->Create("tt_vars_forged", EnvSpec{});
  ASSERT_TRUE(ref.ok()) << ref.status();
  esb::testing::MemoryBlobStore blobs;
  Out("import marshal\n"
      "_orig_loads = marshal.loads\n"
      "marshal.loads = lambda b: compile(\"def summarize(ns): return '[1, 2]'\", 'x', 'exec')\n",
      *ref);
  StepState s = Capture(*ref, blobs);
  EXPECT_EQ(s.variables_json, "");
  if (s.memory) ASSERT_TRUE(driver_->DeleteSnapshot(*s.memory).ok());
  // Without the patch the same session's summary is kept.
  Out("marshal.loads = _orig_loads\nx = 7\n", *ref);
  StepState ok = Capture(*ref, blobs);
  EXPECT_NE(ok.variables_json.find("\"x\""), std::string::npos) << ok.variables_json;
  if (ok.memory) ASSERT_TRUE(driver_->DeleteSnapshot(*ok.memory).ok());
  ASSERT_TRUE(driver_->Destroy(*ref).ok());
}

TEST_F(NanoPythonTest, Latency) {
  for (int i = 0; i < 3; i++) Py("print(1)");  // warm up
  std::vector<int64_t> us;
  for (int i = 0; i < 100; i++) {
    timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    RunResult r = Py("print(1)");
    clock_gettime(CLOCK_MONOTONIC, &t1);
    ASSERT_EQ(r.stdout_data, "1\n");
    us.push_back((t1.tv_sec - t0.tv_sec) * 1000000 + (t1.tv_nsec - t0.tv_nsec) / 1000);
  }
  std::sort(us.begin(), us.end());
  printf("nano one-shot Run(print(1)) with CPython: p50 %.2f ms, p99 %.2f ms (n=100)\n",
         us[50] / 1000.0, us[98] / 1000.0);
  absl::StatusOr<InstanceRef> ref = driver_->Create("py_lat", EnvSpec{});
  ASSERT_TRUE(ref.ok());
  std::vector<int64_t> su;
  for (int i = 0; i < 100; i++) {
    timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    Py("print(1)", &*ref);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    su.push_back((t1.tv_sec - t0.tv_sec) * 1000000 + (t1.tv_nsec - t0.tv_nsec) / 1000);
  }
  std::sort(su.begin(), su.end());
  printf("nano session Run(print(1)) with CPython: p50 %.2f ms, p99 %.2f ms (n=100)\n",
         su[50] / 1000.0, su[98] / 1000.0);
  ASSERT_TRUE(driver_->Destroy(*ref).ok());
}

}  // namespace
}  // namespace esb

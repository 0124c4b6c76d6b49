// Security tests: each one tries an attack from inside a sandbox (or through the API) and
// asserts that it fails, and that the daemon and other environments are unaffected.
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "integration/daemon.h"

namespace esb::testing {
namespace {
namespace json = boost::json;

// One daemon and one victim environment for the whole suite (creating them is the slow part).
class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!Daemon::SkipReason().empty()) return;
    daemon_ = new Daemon();
    if (!daemon_->Start({})) return;
    env_ = daemon_->CreateEnv(json::object{{"memory_mb", 256}, {"pids", 128}, {"disk_mb", 64}});
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
  }
  void SetUp() override {
    std::string why = Daemon::SkipReason();
    if (!why.empty()) GTEST_SKIP() << why;
    ASSERT_TRUE(daemon_ && !env_.empty()) << "suite set-up failed";
  }
  void TearDown() override {
    if (!daemon_ || env_.empty()) return;
    // After every attack the daemon is healthy and the victim still works.
    EXPECT_EQ(daemon_->Call("GET", "/healthz").status, 200);
    EXPECT_EQ(daemon_->Exec(env_, "echo alive").str("stdout"), "alive\n");
  }
  HttpResult Run(const std::string& cmd, int timeout = 30) { return daemon_->Exec(env_, cmd, timeout); }
  std::string Out(const std::string& cmd, int timeout = 30) { return Run(cmd, timeout).str("stdout"); }
  // Runs a python3 snippet in the sandbox and returns its stdout.
  std::string Py(const std::string& code) {
    daemon_->Call("POST", "/environments/" + env_ + "/files/write",
                  json::object{{"path", ".attack.py"}, {"content", code}});
    return Out("python3 .attack.py 2>&1");
  }

  static Daemon* daemon_;
  static std::string env_;
};
Daemon* SecurityTest::daemon_ = nullptr;
std::string SecurityTest::env_;

constexpr char kSyscallPy[] = R"(
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def attempt(name, nr, *args):
    r = libc.syscall(nr, *args)
    print(name, "ok" if r >= 0 else os.strerror(ctypes.get_errno()))
)";

TEST_F(SecurityTest, ReadHostFilesThroughTheFilesApiFails) {
  std::string secret = "/tmp/esb-host-secret-" + std::to_string(getpid());
  std::ofstream(secret) << "HOST-SECRET";
  for (std::string path : {secret, "../../../../../../.." + secret, "/proc/1/root" + secret,
                           "/../" + secret}) {
    HttpResult r = daemon_->Call("GET", "/environments/" + env_ + "/files/read?path=" + path);
    EXPECT_NE(r.status, 200) << path << " → " << r.body;
    EXPECT_EQ(r.body.find("HOST-SECRET"), std::string::npos) << path;
  }
  std::filesystem::remove(secret);
}

TEST_F(SecurityTest, WriteHostFilesWithDotDotTraversalFails) {
  std::string target = "/tmp/esb-escape-" + std::to_string(getpid());
  daemon_->Call("POST", "/environments/" + env_ + "/files/write",
                json::object{{"path", "../../../../../../../../" + target}, {"content", "pwned"}});
  EXPECT_FALSE(std::filesystem::exists(target)) << "a file appeared on the host";
  std::filesystem::remove(target);
}

TEST_F(SecurityTest, SymlinkEscapesStayInsideTheSandbox) {
  ASSERT_EQ(Run("ln -sfn / rootlink && ln -sfn /etc/hostname hostlink").num("exit_code"), 0);
  char host_name[256] = {0};
  gethostname(host_name, sizeof host_name);
  HttpResult r = daemon_->Call("GET", "/environments/" + env_ + "/files/read?path=hostlink");
  EXPECT_EQ(r.str("content").find(host_name), std::string::npos)
      << "read the host's hostname through a symlink: " << r.body;
  // Writing through a symlink to the (read-only) root filesystem must fail.
  HttpResult w = daemon_->Call("POST", "/environments/" + env_ + "/files/write",
                               json::object{{"path", "rootlink/etc/passwd"}, {"content", "x"}});
  EXPECT_NE(w.status, 200) << w.body;
}

TEST_F(SecurityTest, ReadingAFifoOrDeviceIsRefusedWithoutHanging) {
  ASSERT_EQ(Run("mkfifo pipe").num("exit_code"), 0);
  auto start = std::chrono::steady_clock::now();
  HttpResult r = daemon_->Call("GET", "/environments/" + env_ + "/files/read?path=pipe");
  EXPECT_EQ(r.status, 400) << r.body;
  HttpResult dev = daemon_->Call("GET", "/environments/" + env_ + "/files/read?path=/dev/zero");
  EXPECT_EQ(dev.status, 400) << dev.body;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST_F(SecurityTest, BecomeRootFails) {
  EXPECT_EQ(Out("id -u; id -g"), "1000\n1000\n");
  EXPECT_EQ(Out("grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb)' /proc/self/status | awk '{print $2}' | sort -u"),
            "0000000000000000\n");
  EXPECT_EQ(Out("grep NoNewPrivs /proc/self/status | awk '{print $2}'"), "1\n");
  EXPECT_EQ(Out("find / -xdev -perm /6000 -type f 2>/dev/null | wc -l"), "0\n")
      << "no setuid/setgid binaries in the image";
  EXPECT_NE(Run("su -c id root </dev/null").num("exit_code"), 0);
}

TEST_F(SecurityTest, MountUnshareAndNamespaceEscapesFail) {
  EXPECT_NE(Run("mount -t tmpfs none /mnt").num("exit_code"), 0);
  EXPECT_NE(Run("unshare -r id").num("exit_code"), 0);
  EXPECT_NE(Run("unshare -m true").num("exit_code"), 0);
  std::string out = Py(std::string(kSyscallPy) + R"(
attempt("unshare", 272, 0x10000000)         # CLONE_NEWUSER
attempt("setns", 308, 0, 0)
attempt("mount", 165, b"none", b"/mnt", b"tmpfs", 0, 0)
attempt("chroot", 161, b"/tmp")
)");
  EXPECT_EQ(out.find(" ok"), std::string::npos) << out;
}

TEST_F(SecurityTest, PtraceBpfKernelModulesAndKeyringsAreDenied) {
  std::string out = Py(std::string(kSyscallPy) + R"(
attempt("ptrace_attach_pid1", 101, 16, 1, 0, 0)
attempt("bpf", 321, 0, 0, 0)
attempt("init_module", 175, 0, 0, 0)
attempt("finit_module", 313, 0, 0, 0)
attempt("delete_module", 176, b"ext4", 0)
attempt("kexec_load", 246, 0, 0, 0, 0)
attempt("perf_event_open", 298, 0, 0, -1, -1, 0)
attempt("keyctl", 250, 0, 0, 0)
attempt("userfaultfd", 323, 0)
attempt("reboot", 169, 0xfee1dead, 672274793, 0x1234567, 0)
)");
  EXPECT_EQ(out.find(" ok"), std::string::npos) << out;
  EXPECT_NE(out.find("ptrace_attach_pid1"), std::string::npos) << out;
}

TEST_F(SecurityTest, NoNetworkAtAllNotEvenTheHostsLoopback) {
  EXPECT_EQ(Out("ls /sys/class/net"), "lo\n");
  std::string out = Py(
      "import socket\n"
      "for host, port in [('127.0.0.1', " + std::to_string(daemon_->port()) +
      "), ('10.0.2.2', 80), ('8.8.8.8', 53), ('169.254.169.254', 80)]:\n"
      "    s = socket.socket(); s.settimeout(2)\n"
      "    try:\n"
      "        s.connect((host, port)); print(host, 'CONNECTED')\n"
      "    except OSError as e:\n"
      "        print(host, 'blocked', e.errno)\n"
      "try:\n"
      "    socket.getaddrinfo('example.com', 80); print('dns RESOLVED')\n"
      "except OSError:\n"
      "    print('dns blocked')\n");
  EXPECT_EQ(out.find("CONNECTED"), std::string::npos) << out;
  EXPECT_EQ(out.find("RESOLVED"), std::string::npos) << out;
}

TEST_F(SecurityTest, ForkBombIsContainedByThePidsLimit) {
  // Without job control every fork stays in the command's process group, so the timeout's
  // SIGKILL to the group takes the whole bomb down; meanwhile the pids limit refuses forks.
  HttpResult r = Run("bomb() { bomb | bomb & }; bomb; sleep 8", 4);
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(r.flag("timed_out")) << r.body;
  // The daemon and a second environment are fine while/after the bomb goes off.
  std::string other = daemon_->CreateEnv();
  EXPECT_EQ(daemon_->Exec(other, "echo ok").str("stdout"), "ok\n");
  daemon_->Call("DELETE", "/environments/" + other);
}

TEST_F(SecurityTest, MemoryBombIsKilledOrLimited) {
  HttpResult r = Run("python3 -c \"x = bytearray(1024 * 1024 * 1024); print('allocated')\"", 60);
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_NE(r.num("exit_code"), 0) << "1 GiB should not fit in 256 MiB: " << r.body;
  EXPECT_EQ(r.str("stdout").find("allocated"), std::string::npos);
}

TEST_F(SecurityTest, DiskFillOfWorkspaceHitsTheCap) {
  HttpResult r = Run("dd if=/dev/zero of=fill bs=1M count=200 2>&1; rm -f fill", 60);
  EXPECT_NE(r.str("stdout").find("No space left"), std::string::npos) << r.body;
  std::string big(100 << 20, 'x');
  HttpResult put = Http(daemon_->port(), "PUT", "/environments/" + env_ + "/files/raw?path=big",
                        big, {{"Content-Type", "application/octet-stream"}});
  EXPECT_EQ(put.status, 507) << put.body;
  Run("rm -f big");
}

TEST_F(SecurityTest, OutputFloodIsCappedAndTimedOut) {
  HttpResult r = Run("yes flood", 3);
  EXPECT_TRUE(r.flag("timed_out")) << r.body.substr(0, 300);
  EXPECT_TRUE(r.flag("truncated"));
  EXPECT_LE(r.str("stdout").size(), 1u << 20) << "the per-stream cap holds";
}

TEST_F(SecurityTest, WritingTheRootFilesystemFails) {
  EXPECT_NE(Run("touch /usr/bin/evil").num("exit_code"), 0);
  EXPECT_NE(Run("echo x > /etc/passwd").num("exit_code"), 0);
  EXPECT_NE(Run("touch /sbin/esb-agent").num("exit_code"), 0);
}

TEST_F(SecurityTest, MalformedHttpDoesNotHurtTheDaemon) {
  for (std::string garbage :
       {std::string("\x00\x01\x02\xff\r\n\r\n", 8), std::string("GET / HTTP/9.9\r\n\r\n"),
        std::string("POST /environments HTTP/1.1\r\nContent-Length: -5\r\n\r\n"),
        std::string("GET /") + std::string(100000, 'a') + " HTTP/1.1\r\n\r\n",
        std::string("POST /environments HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")}) {
    std::string answer = RawExchange(daemon_->port(), garbage, 5);
    if (!answer.empty()) {
      EXPECT_EQ(answer.rfind("HTTP/1.1 4", 0), 0u) << answer.substr(0, 200);
    }
  }
}

}  // namespace
}  // namespace esb::testing

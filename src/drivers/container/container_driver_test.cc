// Real-container tests of the container driver (CTest label `root`). They build a tiny rootfs
// from host binaries (bash, coreutils and their libraries) and run the real esb-agent.
#include "drivers/container/container_driver.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/fsuid.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/json.hpp>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "common/util.h"
#include "drivers/container/cgroups.h"
#include "drivers/container/netns.h"
#include "drivers/container/oci_spec.h"
#include "drivers/container/runtime.h"
#include "drivers/container/seccomp_profile.h"
#include "drivers/testing/memory_blob_store.h"
#include "governance/tls/ca.h"
#include "gtest/gtest.h"

namespace esb {
namespace {

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------
// Environment of the whole test binary: the rootfs, the agent, and why we might skip.

std::string RunShell(const std::string& cmd) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  pclose(p);
  return out;
}

std::string FindAgent() {
  if (const char* env = getenv("ESB_AGENT_BINARY")) return env;
  std::string built = std::string(ESB_BUILD_DIR) + "/esb-agent";
  return access(built.c_str(), X_OK) == 0 ? built : "";
}

// Copies a host file into the rootfs at the same path (following the rootfs' own symlinks).
void CopyIn(const std::string& rootfs, const std::string& host_path, mode_t mode) {
  std::string dest = rootfs + host_path;
  fs::create_directories(fs::path(dest).parent_path());
  fs::copy_file(host_path, dest, fs::copy_options::overwrite_existing);
  chmod(dest.c_str(), mode);
}

// bash + coreutils + their shared libraries, /etc/passwd with appuser, the syscall probe.
std::string BuildTinyRootfs(const std::string& dir) {
  const std::string rootfs = dir + "/rootfs";
  for (const char* d : {"usr/bin", "usr/sbin", "usr/lib", "usr/lib64", "usr/local/bin", "etc",
                        "proc", "dev", "sys", "tmp", "run", "workspace", "sbin-real"}) {
    fs::create_directories(rootfs + "/" + d);
  }
  fs::remove(rootfs + "/sbin-real");
  chmod((rootfs + "/tmp").c_str(), 01777);  // like a real image (runc keeps this mode)
  for (const char* link : {"bin", "sbin", "lib", "lib64"}) {
    std::string target = std::string("usr/") + link;
    fs::create_symlink(target, rootfs + "/" + link);
  }
  std::set<std::string> libs;
  for (const char* tool : {"bash",     "id", "cat",   "grep", "head",  "tail",     "ls",
                           "mkdir",    "dd", "sleep", "true", "env",   "touch",    "rm",
                           "tr",       "wc", "seq",   "stat", "uname", "hostname", "timeout",
                           "readlink", "mv", "ln",    "kill", "chmod", "find",     "sort"}) {
    std::string path = container::FindExecutable(tool);
    if (path.empty()) continue;
    std::string real = fs::canonical(path).string();
    CopyIn(rootfs, real, 0755);
    if (real.rfind("/usr/bin/", 0) != 0) {
      // e.g. /bin/bash on a non-merged host: also make it reachable under /usr/bin.
      fs::copy_file(real, rootfs + "/usr/bin/" + fs::path(real).filename().string(),
                    fs::copy_options::overwrite_existing);
    }
    for (absl::string_view line : absl::StrSplit(RunShell("ldd " + real), '\n')) {
      for (absl::string_view word :
           absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty())) {
        if (!word.empty() && word[0] == '/') libs.insert(std::string(word));
      }
    }
  }
  for (const std::string& lib : libs) {
    CopyIn(rootfs, fs::canonical(lib).string(), 0755);
    // Keep the name the loader asks for (e.g. /lib64/ld-linux-x86-64.so.2 -> real file).
    std::string dest = rootfs + lib;
    if (!fs::exists(dest)) {
      fs::create_directories(fs::path(dest).parent_path());
      fs::copy_file(fs::canonical(lib), dest);
    }
  }
  fs::create_symlink("bash", rootfs + "/usr/bin/sh");
  std::ofstream(rootfs + "/etc/passwd") << "root:x:0:0:root:/root:/bin/bash\n"
                                           "appuser:x:1000:1000::/workspace:/bin/bash\n";
  std::ofstream(rootfs + "/etc/group") << "root:x:0:\nappuser:x:1000:\n";
  std::ofstream(rootfs + "/etc/hostname") << "image\n";
  // A file of the host's uid 1000 that only its owner may read (UsernsAttackTest).
  std::ofstream(rootfs + "/etc/host-uid-1000-secret") << "secret of host uid 1000\n";
  chown((rootfs + "/etc/host-uid-1000-secret").c_str(), 1000, 1000);
  chmod((rootfs + "/etc/host-uid-1000-secret").c_str(), 0600);
  CopyIn(rootfs, ESB_SYSCALL_PROBE, 0755);
  fs::copy_file(ESB_SYSCALL_PROBE, rootfs + "/usr/local/bin/syscall_probe",
                fs::copy_options::overwrite_existing);
  chmod((rootfs + "/usr/local/bin/syscall_probe").c_str(), 0755);
  return rootfs;
}

struct Shared {
  std::string skip_reason;
  std::string tmp;
  std::string rootfs;
  std::string agent;
};

Shared* g_shared = nullptr;  // set on first use

Shared& Env() {
  static Shared* shared = [] {
    auto* s = new Shared;
    if (geteuid() != 0) {
      s->skip_reason = "needs root (runs real containers)";
      return s;
    }
    if (container::FindExecutable("crun").empty() && container::FindExecutable("runc").empty()) {
      s->skip_reason = "no OCI runtime (crun or runc) installed";
      return s;
    }
    s->agent = FindAgent();
    if (s->agent.empty()) {
      s->skip_reason = "esb-agent not built (set ESB_AGENT_BINARY or build target esb-agent)";
      return s;
    }
    char tmpl[] = "/tmp/esb-container-test-XXXXXX";
    s->tmp = mkdtemp(tmpl);
    chmod(s->tmp.c_str(), 0755);
    s->rootfs = BuildTinyRootfs(s->tmp);
    return s;
  }();
  g_shared = shared;
  return *shared;
}

// Removes the shared temp dir (rootfs, state dirs) when the binary finishes.
class CleanupEnvironment : public ::testing::Environment {
 public:
  void TearDown() override {
    if (g_shared != nullptr && !g_shared->tmp.empty()) {
      std::error_code ec;
      fs::remove_all(g_shared->tmp, ec);
    }
  }
};
const ::testing::Environment* const kCleanup =
    ::testing::AddGlobalTestEnvironment(new CleanupEnvironment);

class ContainerDriverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!Env().skip_reason.empty()) GTEST_SKIP() << Env().skip_reason;
    options_.state_dir = Env().tmp + "/state-" + RandomHex(3);
    options_.agent_binary = Env().agent;
    options_.images["default"] = Env().rootfs;
    if (const char* rt = getenv("ESB_TEST_RUNTIME")) options_.runtime = rt;
    auto driver = NewContainerDriver(options_);
    ASSERT_TRUE(driver.ok()) << driver.status();
    driver_ = std::move(*driver);
    std::printf("[ driver   ] %s: %s\n", driver_->name().c_str(), driver_->Describe().c_str());
  }
  void TearDown() override {
    for (const InstanceRef& ref : live_) {
      if (driver_) driver_->Destroy(ref).IgnoreError();
    }
  }

  InstanceRef MustCreate(const EnvSpec& spec = EnvSpec()) {
    std::string id = "t" + RandomHex(4);
    absl::StatusOr<InstanceRef> ref = driver_->Create(id, spec);
    EXPECT_TRUE(ref.ok()) << ref.status();
    if (!ref.ok()) return InstanceRef{id, "container", ""};
    live_.push_back(*ref);
    return *ref;
  }

  ExecResult MustExec(const InstanceRef& ref, const std::string& command, int timeout_ms = 20000) {
    ExecRequest req;
    req.command = command;
    req.timeout = std::chrono::milliseconds(timeout_ms);
    absl::StatusOr<ExecResult> r = driver_->Exec(ref, req, nullptr);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : ExecResult{};
  }

  void DestroyAndCheckClean(const InstanceRef& ref) {
    ASSERT_TRUE(driver_->Destroy(ref).ok());
    std::vector<std::string> leaks = FindContainerLeaks(options_, ref);
    EXPECT_TRUE(leaks.empty()) << absl::StrJoin(leaks, "\n");
    live_.erase(std::remove_if(live_.begin(), live_.end(),
                               [&](const InstanceRef& r) { return r.id == ref.id; }),
                live_.end());
  }

  ContainerDriverOptions options_;
  std::unique_ptr<Driver> driver_;
  std::vector<InstanceRef> live_;
};

// ---------------------------------------------------------------------------------------

// esbd started with closed stdio gets the agent's listening socket as fd 0, 1 or 2; the
// child's stdio dup2s used to overwrite it before it was moved to fd 3, so the container got
// /dev/null (or the log) as its "socket".
TEST(RunProcessTest, HandedOverFdOnStdioReachesTheChildAsFd3) {
  for (int target = 0; target <= 2; ++target) {
    int sv[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    struct stat st;
    ASSERT_EQ(::fstat(sv[0], &st), 0);
    const std::string socket_name = absl::StrCat("socket:[", st.st_ino, "]");
    int saved = ::fcntl(target, F_DUPFD_CLOEXEC, 10);
    ASSERT_GE(saved, 0);
    ASSERT_EQ(::dup3(sv[0], target, O_CLOEXEC), target);
    container::SpawnOptions options;
    options.pass_fd = target;
    auto r = container::RunProcess(
        {"/bin/sh", "-c", "readlink /proc/self/fd/3; readlink /proc/self/fd/0; ls /proc/self/fd"},
        options);
    ::dup3(saved, target, 0);  // restore the test's own stdio before asserting
    ::close(saved);
    ::close(sv[0]);
    ::close(sv[1]);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->exit_code, 0) << r->output;
    std::vector<std::string> lines = absl::StrSplit(r->output, '\n', absl::SkipEmpty());
    ASSERT_GE(lines.size(), 2u) << r->output;
    EXPECT_EQ(lines[0], socket_name) << "fd " << target << ": " << r->output;
    EXPECT_EQ(lines[1], "/dev/null") << "fd " << target << ": " << r->output;
    // 0-3 and ls's own directory fd only: nothing else crossed.
    EXPECT_EQ(lines.size(), 2u + 5u) << r->output;
  }
}

TEST(ContainerSpecTest, ConfigHasNoCapabilitiesAndReadOnlyRoot) {
  container::BundleParams p;
  p.rootfs = "/img";
  p.cgroups_path = "/esb/x";
  p.workspace_bytes = 8 << 20;
  boost::json::object c = container::BuildOciConfig(p);
  const auto& caps = c["process"].as_object()["capabilities"].as_object();
  for (const char* set : {"bounding", "effective", "inheritable", "permitted", "ambient"}) {
    EXPECT_TRUE(caps.at(set).as_array().empty()) << set;
  }
  EXPECT_TRUE(c["process"].as_object()["noNewPrivileges"].as_bool());
  EXPECT_TRUE(c["root"].as_object()["readonly"].as_bool());
  EXPECT_EQ(c["process"].as_object()["user"].as_object()["uid"].to_number<int64_t>(), 1000);
  std::string json = boost::json::serialize(c);
  EXPECT_TRUE(absl::StrContains(json, "\"size=8192k\"")) << json;
}

TEST(ContainerSpecTest, VolumesGetAPrivateMntTmpfsAndPlainBinds) {
  container::BundleParams p;
  p.rootfs = "/img";
  p.cgroups_path = "/esb/x";
  EXPECT_FALSE(absl::StrContains(boost::json::serialize(container::BuildOciConfig(p)), "/mnt"))
      << "no volumes, no /mnt mount";
  p.volume_binds = {{"/state/envs/e/vol/0", "/mnt/data", false, true},
                    {"/state/envs/e/vol/1", "/mnt/ro", true, false}};
  boost::json::object c = container::BuildOciConfig(p);
  const boost::json::array& mounts = c["mounts"].as_array();
  std::vector<std::string> dests;
  for (const auto& m : mounts) dests.emplace_back(m.as_object().at("destination").as_string());
  auto at = [&](const std::string& d) {
    return std::find(dests.begin(), dests.end(), d) - dests.begin();
  };
  ASSERT_LT(at("/mnt"), at("/mnt/data")) << "the tmpfs first, the volumes on it";
  ASSERT_LT(at("/mnt/data"), static_cast<long>(dests.size()));
  ASSERT_LT(at("/mnt/ro"), static_cast<long>(dests.size()));
  auto opts = [&](const std::string& d) {
    return boost::json::serialize(mounts[at(d)].as_object().at("options"));
  };
  EXPECT_EQ(mounts[at("/mnt")].as_object().at("type").as_string(), "tmpfs");
  EXPECT_EQ(opts("/mnt/data"), R"(["bind","nosuid","nodev","rw","idmap"])");
  EXPECT_EQ(opts("/mnt/ro"), R"(["bind","nosuid","nodev","ro"])");
  std::vector<std::string> required = container::RequiredMountpoints(p);
  EXPECT_NE(std::find(required.begin(), required.end(), "mnt/"), required.end());
  EXPECT_EQ(std::find(required.begin(), required.end(), "mnt/data/"), required.end())
      << "volume mount points are made on the tmpfs, never in the shared image";
}

TEST(ContainerSpecTest, SeccompDeniesAreNotAllowed) {
  const auto& allowed = container::SeccompAllowedSyscalls();
  std::set<std::string> allow(allowed.begin(), allowed.end());
  for (const std::string& name : container::SeccompDeniedSyscalls()) {
    EXPECT_EQ(allow.count(name), 0u) << name << " is both allowed and denied";
  }
  for (const char* must_deny :
       {"mount", "umount2", "ptrace", "unshare", "setns", "bpf", "init_module", "finit_module",
        "delete_module", "kexec_load", "kexec_file_load", "perf_event_open", "keyctl", "add_key",
        "request_key", "userfaultfd", "open_by_handle_at"}) {
    EXPECT_EQ(allow.count(must_deny), 0u) << must_deny;
  }
  EXPECT_EQ(allow.count("clone"), 0u) << "clone must only be allowed with an argument filter";
  EXPECT_EQ(allow.count("clone3"), 0u);
  EXPECT_EQ(allow.count("personality"), 0u);
}

TEST_F(ContainerDriverTest, CreateExecDestroy) {
  InstanceRef ref = MustCreate();
  ExecResult r = MustExec(ref, "echo hello; id -u; hostname; cat /etc/hostname; pwd");
  EXPECT_EQ(r.exit_code, 0) << r.stderr_data;
  EXPECT_EQ(r.stdout_data, "hello\n1000\nsandbox\nsandbox\n/workspace\n");
  ASSERT_TRUE(driver_->WriteFile(ref, "dir/a.txt", "data", 0, true).ok());
  absl::StatusOr<FileChunk> chunk = driver_->ReadFile(ref, "dir/a.txt", 0, 100);
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  EXPECT_EQ(chunk->data, "data");
  absl::StatusOr<Usage> usage = driver_->Stats(ref);
  ASSERT_TRUE(usage.ok()) << usage.status();
  EXPECT_TRUE(usage->alive);
  EXPECT_GT(usage->memory_bytes, 0);
  EXPECT_GE(usage->pids, 1);
  std::printf("[ stats    ] memory %lld bytes, cpu %lld ms, pids %lld\n",
              static_cast<long long>(usage->memory_bytes), static_cast<long long>(usage->cpu_ms),
              static_cast<long long>(usage->pids));
  DestroyAndCheckClean(ref);
  // Idempotent.
  EXPECT_TRUE(driver_->Destroy(ref).ok());
}

// The stdio process seam (Driver::SpawnProcess without a PTY, capability processes): stdin in,
// stdout and stderr apart, the exit code; Resize refused; a killed process's tree is gone.
TEST_F(ContainerDriverTest, SpawnProcessWithPipesKeepsStdoutAndStderrApart) {
  ASSERT_TRUE(driver_->Capabilities().Has(Capability::kProcesses));
  InstanceRef ref = MustCreate();
  ProcessRequest req;
  req.argv = {"sh", "-c", "read line; echo \"out:$line\"; echo \"err:$X\" >&2; exit 5"};
  req.env = {{"X", "y"}};
  auto p = driver_->SpawnProcess(ref, req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(absl::IsInvalidArgument((*p)->Resize(24, 80)));
  ASSERT_TRUE((*p)->Input("hello\n", /*eof=*/true).ok());
  std::string out, err;
  std::optional<int> code;
  for (int i = 0; i < 20 && !code; ++i) {
    auto st = (*p)->Wait(500, [&](Stream s, std::string_view chunk) {
      (s == Stream::kStderr ? err : out).append(chunk);
      return true;
    });
    ASSERT_TRUE(st.ok()) << st.status();
    code = *st;
  }
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 5);
  EXPECT_EQ(out, "out:hello\n");
  EXPECT_EQ(err, "err:y\n");
  // A process that does not end is killed with its children.
  req.argv = {"sh", "-c", "sleep 300 & sleep 300"};
  auto q = driver_->SpawnProcess(ref, req);
  ASSERT_TRUE(q.ok()) << q.status();
  ASSERT_TRUE((*q)->Kill().ok());
  // The kill is a signal to the group: the sleeps are gone (reaped) a moment later, not when
  // Kill returns. A survivor sleeps for 300 s, far past this wait.
  ExecResult ps;
  for (int i = 0; i < 50; ++i) {
    ps = MustExec(ref, "cat /proc/[0-9]*/comm 2>/dev/null | grep -c '^sleep$' || true");
    if (ps.stdout_data == "0\n") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(ps.stdout_data, "0\n") << ps.stdout_data;
  DestroyAndCheckClean(ref);
}

TEST_F(ContainerDriverTest, NoLeaksAfterTenCycles) {
  for (int i = 0; i < 10; ++i) {
    InstanceRef ref = MustCreate();
    EXPECT_EQ(MustExec(ref, "echo $((6*7))").stdout_data, "42\n");
    DestroyAndCheckClean(ref);
  }
  // Nothing of ours is left in the runtime's state or the envs directory.
  EXPECT_TRUE(fs::is_empty(options_.state_dir + "/envs"));
}

TEST_F(ContainerDriverTest, RunsAsUnprivilegedUserWithoutCapabilities) {
  InstanceRef ref = MustCreate();
  ExecResult r =
      MustExec(ref, "id -u; id -g; grep -E '^(Cap|NoNewPrivs|Seccomp)' /proc/self/status");
  EXPECT_EQ(r.exit_code, 0);
  std::vector<std::string> lines = absl::StrSplit(r.stdout_data, '\n', absl::SkipEmpty());
  ASSERT_GE(lines.size(), 2u) << r.stdout_data;
  EXPECT_EQ(lines[0], "1000");
  EXPECT_EQ(lines[1], "1000");
  int caps = 0;
  for (const std::string& line : lines) {
    if (absl::StartsWith(line, "Cap")) {
      ++caps;
      EXPECT_TRUE(absl::EndsWith(line, "0000000000000000")) << line;
    }
  }
  EXPECT_EQ(caps, 5) << r.stdout_data;
  EXPECT_TRUE(absl::StrContains(r.stdout_data, "NoNewPrivs:\t1")) << r.stdout_data;
  EXPECT_TRUE(absl::StrContains(r.stdout_data, "Seccomp:\t2")) << r.stdout_data;
}

TEST_F(ContainerDriverTest, DangerousSyscallsFail) {
  InstanceRef ref = MustCreate();
  ExecResult r = MustExec(ref, "/usr/local/bin/syscall_probe");
  ASSERT_EQ(r.exit_code, 0) << r.stderr_data;
  std::map<std::string, std::string> result;
  for (absl::string_view line : absl::StrSplit(r.stdout_data, '\n', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(line, '=');
    result[kv.first] = kv.second;
  }
  std::printf("[ syscalls ] %s\n", absl::StrJoin(absl::StrSplit(r.stdout_data, '\n'), " ").c_str());
  for (const char* name : {"mount",
                           "umount2",
                           "unshare_user",
                           "unshare_mount",
                           "unshare_net",
                           "setns",
                           "ptrace_traceme",
                           "ptrace_attach",
                           "bpf",
                           "init_module",
                           "finit_module",
                           "delete_module",
                           "kexec_load",
                           "perf_event_open",
                           "keyctl",
                           "add_key",
                           "request_key",
                           "userfaultfd",
                           "open_by_handle_at",
                           "io_uring_setup",
                           "personality_change",
                           "clone_newuser",
                           "clone_newns",
                           "chroot",
                           "swapon",
                           "sethostname",
                           "mknod"}) {
    ASSERT_TRUE(result.count(name)) << name << " missing from: " << r.stdout_data;
    EXPECT_EQ(result[name], "EPERM") << name;
  }
  EXPECT_EQ(result["clone3"], "ENOSYS");
  EXPECT_EQ(result["clone_plain"], "OK");
  EXPECT_EQ(result["fork"], "OK");
  EXPECT_EQ(result["personality_query"], "OK");
  // Address families: vsock is not network-namespaced, packet/alg/key/bluetooth are kernel
  // attack surface; only unix, inet, inet6 and netlink-route work. The kernel answers
  // EAFNOSUPPORT itself for a family it lacks, so the same probe first runs on the host (root,
  // no seccomp): the sandbox's refusal shows the filter only for families the host has.
  auto host_run = container::RunProcess({ESB_SYSCALL_PROBE, "sockets"}, {});
  ASSERT_TRUE(host_run.ok()) << host_run.status();
  std::map<std::string, std::string> host;
  for (absl::string_view line : absl::StrSplit(host_run->output, '\n', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(line, '=');
    host[kv.first] = kv.second;
  }
  ASSERT_EQ(host["socket_unix"], "OK") << host_run->output;
  int shown = 0;
  for (const char* name :
       {"socket_vsock", "socket_vsock_high_bits", "socket_packet", "socket_alg", "socket_key",
        "socket_bluetooth", "socket_appletalk", "socket_unspec", "socketpair_vsock"}) {
    ASSERT_TRUE(result.count(name)) << name << " missing from: " << r.stdout_data;
    EXPECT_EQ(result[name], "EAFNOSUPPORT") << name << " (host: " << host[name] << ")";
    if (host[name] != "EAFNOSUPPORT") ++shown;
  }
  ASSERT_TRUE(host["socket_vsock"] != "EAFNOSUPPORT" || host["socket_packet"] != "EAFNOSUPPORT" ||
              host["socket_alg"] != "EAFNOSUPPORT")
      << "the host kernel has none of AF_VSOCK, AF_PACKET, AF_ALG: the sandbox's EAFNOSUPPORT "
         "cannot be told apart from the kernel's, so this host cannot test the seccomp "
         "socket-family filter. Host probe:\n"
      << host_run->output;
  std::printf("[ families ] refused in the sandbox though the host kernel has them: %d\n", shown);
  EXPECT_EQ(result["socket_netlink_audit"], "EPERM");
  for (const char* name :
       {"socket_unix", "socket_inet", "socket_inet6", "socket_netlink_route", "socketpair_unix"}) {
    EXPECT_EQ(result[name], "OK") << name;
  }
  // The agent (PID 1, same uid) is not dumpable: sandbox code cannot reach its descriptors,
  // one of which is the container's log file on the host.
  ExecResult fds = MustExec(ref,
                            "ls /proc/1/fd 2>&1; echo rc=$?; echo x >> /proc/1/fd/2; "
                            "echo rc=$?");
  EXPECT_TRUE(absl::StrContains(fds.stdout_data, "Permission denied")) << fds.stdout_data;
  EXPECT_FALSE(absl::StrContains(fds.stdout_data, "rc=0")) << fds.stdout_data;
}

// A listener on the host's loopback: the sandbox must not reach it.
class HostListener {
 public:
  HostListener() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a = {};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    listen(fd_, 4);
    socklen_t len = sizeof(a);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
  }
  ~HostListener() { close(fd_); }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

TEST_F(ContainerDriverTest, NetworkIsLoopbackOnly) {
  HostListener host;
  InstanceRef ref = MustCreate();
  ExecResult r = MustExec(ref, "ls /sys/class/net; cat /sys/class/net/lo/flags");
  std::printf("[ network  ] interfaces+lo flags: %s\n", r.stdout_data.c_str());
  std::vector<std::string> lines = absl::StrSplit(r.stdout_data, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u) << r.stdout_data;
  EXPECT_EQ(lines[0], "lo");
  // IFF_UP (0x1) must be set on lo.
  EXPECT_EQ(std::stoi(lines[1], nullptr, 16) & 1, 1) << "lo is down: " << lines[1];
  for (const std::string& target : {absl::StrCat("127.0.0.1/", host.port()),
                                    std::string("10.0.2.2/80"), std::string("8.8.8.8/53")}) {
    ExecResult c =
        MustExec(ref, "timeout 5 bash -c 'exec 3<>/dev/tcp/" + target + "' 2>&1; echo rc=$?");
    EXPECT_FALSE(absl::StrContains(c.stdout_data, "rc=0")) << target << ": " << c.stdout_data;
    std::printf("[ network  ] %s -> %s", target.c_str(), c.stdout_data.c_str());
  }
  // Loopback inside the sandbox works (its own, not the host's).
  ExecResult self = MustExec(ref, "bash -c 'exec 3<>/dev/tcp/127.0.0.1/9' 2>&1; echo rc=$?");
  EXPECT_TRUE(absl::StrContains(self.stdout_data, "refused")) << self.stdout_data;
}

// ---------------------------------------------------------------------------------------
// Governed networks (issue 12): a netns esbd makes, the egress listener inside it.

TEST(ContainerSpecTest, GovernedJoinsTheNetnsPathAndBindsTheTrustBundle) {
  container::BundleParams p;
  p.rootfs = "/img";
  p.cgroups_path = "/esb/x";
  std::string plain = boost::json::serialize(container::BuildOciConfig(p));
  EXPECT_TRUE(absl::StrContains(plain, R"({"type":"network"})")) << plain;
  EXPECT_FALSE(absl::StrContains(plain, "ca-certificates")) << plain;
  p.netns_path = "/run/entersandbox/netns/abc-e1";
  p.ca_bundle_file = "/run/entersandbox/share-x/ca-e1.pem";
  boost::json::object c = container::BuildOciConfig(p);
  std::string json = boost::json::serialize(c);
  EXPECT_TRUE(
      absl::StrContains(json, R"({"type":"network","path":"/run/entersandbox/netns/abc-e1"})"))
      << json;
  bool bound = false;
  for (const auto& m : c["mounts"].as_array()) {
    const auto& o = m.as_object();
    if (o.at("destination").as_string() != "/etc/ssl/certs/ca-certificates.crt") continue;
    bound = true;
    EXPECT_EQ(o.at("source").as_string(), p.ca_bundle_file);
    EXPECT_EQ(boost::json::serialize(o.at("options")),
              R"(["bind","ro","nosuid","nodev","noexec"])");
  }
  EXPECT_TRUE(bound) << json;
  std::vector<std::string> required = container::RequiredMountpoints(p);
  EXPECT_NE(std::find(required.begin(), required.end(), "etc/ssl/certs/ca-certificates.crt"),
            required.end());
}

TEST(NetnsTest, PathsOutsideTheNetnsDirectoryAreRefused) {
  for (const char* bad : {"/tmp/x", "/run/entersandbox/netns/", "/run/entersandbox/netns/../x",
                          "/run/entersandbox/netns/a/b", "/run/entersandbox/netns/.hidden"}) {
    EXPECT_TRUE(absl::IsInvalidArgument(container::CreateNetns(bad))) << bad;
    EXPECT_TRUE(absl::IsInvalidArgument(container::RemoveNetns(bad))) << bad;
    EXPECT_TRUE(absl::IsInvalidArgument(container::OpenListenerInNetns(bad).status())) << bad;
  }
}

TEST(NetnsTest, ListenerLivesInTheNamespaceAndNotInEsbds) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root (creates network namespaces)";
  const std::string path = absl::StrCat(container::kNetnsDir, "/test-", RandomHex(4));
  const fs::path own_netns = fs::read_symlink("/proc/thread-self/ns/net");
  ASSERT_TRUE(container::CreateNetns(path).ok());
  EXPECT_TRUE(absl::IsAlreadyExists(container::CreateNetns(path)));
  const int port = 20000 + static_cast<int>(MonotonicMs() % 20000);
  absl::StatusOr<UniqueFd> listener = container::OpenListenerInNetns(path, "127.0.0.1", port);
  ASSERT_TRUE(listener.ok()) << listener.status();
  // The test's own (host) namespace has nothing there...
  int host = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a = {};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_NE(connect(host, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  close(host);
  // ...the namespace has, and the connection arrives on the listener esbd holds.
  absl::StatusOr<UniqueFd> inside = container::ConnectInNetns(path, 2000, {0}, "127.0.0.1", port);
  ASSERT_TRUE(inside.ok()) << inside.status();
  int accepted = accept(listener->get(), nullptr, nullptr);
  EXPECT_GE(accepted, 0);
  close(accepted);
  inside->reset();
  // The calling thread never left its namespace.
  EXPECT_EQ(fs::read_symlink("/proc/thread-self/ns/net"), own_netns);
  // Closed listener: refused (fails closed); a fresh one can be opened at once.
  listener->reset();
  EXPECT_TRUE(
      absl::IsUnavailable(container::ConnectInNetns(path, 2000, {0}, "127.0.0.1", port).status()));
  absl::StatusOr<UniqueFd> again = container::OpenListenerInNetns(path, "127.0.0.1", port);
  EXPECT_TRUE(again.ok()) << again.status();
  again->reset();
  ASSERT_TRUE(container::RemoveNetns(path).ok());
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(absl::IsNotFound(container::OpenListenerInNetns(path).status()));
  EXPECT_TRUE(container::RemoveNetns(path).ok()) << "idempotent";
}

TEST(NetnsTest, APlainFileIsNeverJoined) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root";
  const std::string path = absl::StrCat(container::kNetnsDir, "/test-", RandomHex(4));
  fs::create_directories(container::kNetnsDir);
  std::ofstream(path) << "";
  absl::StatusOr<UniqueFd> l = container::OpenListenerInNetns(path);
  EXPECT_TRUE(absl::IsFailedPrecondition(l.status())) << l.status();
  EXPECT_TRUE(container::RemoveNetns(path).ok());
}

// ConnectEgressProxy's socket: made inside the namespace, so it reaches the environment's
// listener and nothing of the host's (a host service on the same loopback port is not it).
TEST(NetnsTest, ConnectedSocketReachesOnlyTheNamespacesListener) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root (creates network namespaces)";
  const std::string path = absl::StrCat(container::kNetnsDir, "/test-", RandomHex(4));
  ASSERT_TRUE(container::CreateNetns(path).ok());
  const fs::path own_netns = fs::read_symlink("/proc/thread-self/ns/net");
  // A host listener on 127.0.0.1:<port> in esbd's own namespace.
  int host = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a = {};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(host, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(host, 4), 0);
  socklen_t len = sizeof(a);
  getsockname(host, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  absl::StatusOr<UniqueFd> refused = container::ConnectInNetns(path, 2000, {0}, "127.0.0.1", port);
  EXPECT_TRUE(absl::IsUnavailable(refused.status())) << refused.status();
  // The namespace's own listener on that port: connected, blocking mode, accepted there.
  absl::StatusOr<UniqueFd> listener = container::OpenListenerInNetns(path, "127.0.0.1", port);
  ASSERT_TRUE(listener.ok()) << listener.status();
  absl::StatusOr<UniqueFd> inside = container::ConnectInNetns(path, 2000, {0}, "127.0.0.1", port);
  ASSERT_TRUE(inside.ok()) << inside.status();
  EXPECT_EQ(fcntl(inside->get(), F_GETFL) & O_NONBLOCK, 0);
  int accepted = accept(listener->get(), nullptr, nullptr);
  EXPECT_GE(accepted, 0);
  ASSERT_EQ(write(inside->get(), "x", 1), 1);
  char c = 0;
  EXPECT_EQ(read(accepted, &c, 1), 1);
  close(accepted);
  close(host);
  EXPECT_EQ(fs::read_symlink("/proc/thread-self/ns/net"), own_netns);
  inside->reset();
  listener->reset();
  ASSERT_TRUE(container::RemoveNetns(path).ok());
  EXPECT_TRUE(absl::IsNotFound(container::ConnectInNetns(path, 100, {0}).status()));
}

// Attack: with the proxy down, a sandbox process binds the listener port itself and plays the
// proxy, to feed esbd's shared wheel cache. The connection is refused: the listener that took
// it is not esbd's.
TEST(NetnsTest, AListenerNotOwnedByEsbdIsNotTakenForTheProxy) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root (creates network namespaces)";
  const std::string path = absl::StrCat(container::kNetnsDir, "/test-", RandomHex(4));
  ASSERT_TRUE(container::CreateNetns(path).ok());
  const int port = 20000 + static_cast<int>(MonotonicMs() % 20000);
  UniqueFd fake;
  std::thread t([&] {
    UniqueFd ns(open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!ns || setns(ns.get(), CLONE_NEWNET) != 0) return;
    // SECURITY: test only: this thread (then ended) makes a socket owned by a sandbox-like uid.
    setfsuid(4242);
    UniqueFd l(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    setfsuid(0);
    sockaddr_in a = {};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(l.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 && listen(l.get(), 4) == 0)
      fake = std::move(l);
  });
  t.join();
  ASSERT_TRUE(fake) << "could not make the fake listener";
  absl::StatusOr<UniqueFd> c = container::ConnectInNetns(path, 2000, {0}, "127.0.0.1", port);
  EXPECT_TRUE(absl::IsPermissionDenied(c.status())) << c.status();
  EXPECT_NE(std::string(c.status().message()).find("uid 4242"), std::string::npos) << c.status();
  fake.reset();
  ASSERT_TRUE(container::RemoveNetns(path).ok());
}

// Attack, variant: the fake proxy writes a forged answer and closes at once, so that its side
// is closing (FIN-WAIT, then a time-wait socket, which sock_diag reports as uid 0 whoever
// owned it) while the forged bytes wait in esbd's receive buffer. Only an open connection
// counts (here the closing side is even root's, so the owner check alone would pass).
TEST(NetnsTest, APeerThatAlreadyClosedIsNotTakenForTheProxy) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root (creates network namespaces)";
  const std::string path = absl::StrCat(container::kNetnsDir, "/test-", RandomHex(4));
  ASSERT_TRUE(container::CreateNetns(path).ok());
  const int port = 20000 + static_cast<int>(MonotonicMs() % 20000);
  absl::StatusOr<UniqueFd> listener = container::OpenListenerInNetns(path, "127.0.0.1", port);
  ASSERT_TRUE(listener.ok()) << listener.status();
  UniqueFd client;
  std::thread t([&] {
    UniqueFd ns(open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!ns || setns(ns.get(), CLONE_NEWNET) != 0) return;
    UniqueFd s(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a = {};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) client = std::move(s);
  });
  t.join();
  ASSERT_TRUE(client);
  UniqueFd accepted(accept(listener->get(), nullptr, nullptr));
  ASSERT_TRUE(accepted);
  // Open and owned by root: accepted.
  EXPECT_TRUE(container::CheckAcceptorOwner(path, client.get(), {0}).ok());
  const std::string forged = "HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nforged";
  ASSERT_EQ(write(accepted.get(), forged.data(), forged.size()),
            static_cast<ssize_t>(forged.size()));
  accepted.reset();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // FIN and its ACK on loopback
  absl::Status st = container::CheckAcceptorOwner(path, client.get(), {0});
  EXPECT_FALSE(st.ok()) << "a closed peer passed the check";
  EXPECT_TRUE(absl::IsUnavailable(st)) << st;  // its owner (root) alone would have passed
  client.reset();
  listener->reset();
  ASSERT_TRUE(container::RemoveNetns(path).ok());
}

EnvSpec GovernedSpec(std::string* ca_pem) {
  absl::StatusOr<governance::tls::CaPem> ca = governance::tls::GenerateCa("EnterSandBox test");
  EXPECT_TRUE(ca.ok()) << ca.status();
  EnvSpec spec;
  spec.network.kind = NetworkPolicy::Kind::kGoverned;
  spec.network.ca_cert_pem = ca.ok() ? ca->cert_pem : "";
  if (ca_pem != nullptr) *ca_pem = spec.network.ca_cert_pem;
  return spec;
}

std::string NetnsOf(const ContainerDriverOptions& o, const std::string& id) {
  char hash[9];
  uint32_t h = 2166136261u;
  for (unsigned char c : o.state_dir) h = (h ^ c) * 16777619u;
  snprintf(hash, sizeof(hash), "%08x", h);
  return absl::StrCat(container::kNetnsDir, "/", hash, "-", id);
}

TEST_F(ContainerDriverTest, GovernedSandboxReachesOnlyTheEgressListener) {
  ASSERT_TRUE(driver_->Capabilities().Has(Capability::kEgress));
  HostListener host;
  std::string ca_pem;
  InstanceRef ref = MustCreate(GovernedSpec(&ca_pem));
  const std::string netns = NetnsOf(options_, ref.id);
  ASSERT_TRUE(fs::exists(netns));
  // The sandbox (in its own user namespace, the default) sits in the netns esbd made.
  struct stat st;
  ASSERT_EQ(stat(netns.c_str(), &st), 0);
  ExecResult r = MustExec(ref,
                          "readlink /proc/self/ns/net; ls /sys/class/net; "
                          "cat /sys/class/net/lo/flags; cat /proc/self/uid_map");
  std::vector<std::string> lines = absl::StrSplit(r.stdout_data, '\n', absl::SkipEmpty());
  ASSERT_GE(lines.size(), 4u) << r.stdout_data << r.stderr_data;
  EXPECT_EQ(lines[0], absl::StrCat("net:[", st.st_ino, "]"));
  EXPECT_EQ(lines[1], "lo") << "loopback only";
  EXPECT_EQ(std::stoi(lines[2], nullptr, 16) & 1, 1) << "lo is up";
  if (ContainerUsernsStatus(*driver_).enabled) {
    EXPECT_FALSE(absl::StrContains(lines[3], " 0          0")) << "a user namespace: " << lines[3];
  }
  // The proxy variables and the trust bundle (the tiny image has no system bundle: the env CA).
  ExecResult env = MustExec(ref,
                            "env | grep -iE '^(https?|all|no)_proxy=|^SSL_CERT_FILE=';"
                            "cat /etc/ssl/certs/ca-certificates.crt");
  EXPECT_TRUE(absl::StrContains(env.stdout_data, "HTTPS_PROXY=http://127.0.0.1:3128\n"));
  EXPECT_TRUE(absl::StrContains(env.stdout_data, "HTTP_PROXY=http://127.0.0.1:3128\n"));
  EXPECT_TRUE(absl::StrContains(env.stdout_data, "ALL_PROXY=http://127.0.0.1:3128\n"));
  EXPECT_TRUE(absl::StrContains(env.stdout_data, "NO_PROXY=localhost,127.0.0.1\n"));
  EXPECT_TRUE(absl::StrContains(env.stdout_data, "https_proxy=http://127.0.0.1:3128\n"));
  EXPECT_TRUE(
      absl::StrContains(env.stdout_data, "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt\n"));
  EXPECT_TRUE(absl::StrContains(env.stdout_data, ca_pem)) << env.stdout_data;
  // A caller's base environment cannot drop them.
  ASSERT_TRUE(driver_->Configure(ref, {{"FOO", "bar"}, {"HTTPS_PROXY", "http://evil:1"}}).ok());
  ExecResult env2 = MustExec(ref, "echo $FOO $HTTPS_PROXY");
  EXPECT_EQ(env2.stdout_data, "bar http://127.0.0.1:3128\n");

  // Nothing listens until esbd opens the listener: refused.
  const std::string connect =
      "timeout 5 bash -c 'exec 3<>/dev/tcp/127.0.0.1/3128; cat <&3' 2>&1;"
      " echo rc=$?";
  EXPECT_TRUE(absl::StrContains(MustExec(ref, connect).stdout_data, "refused"));
  absl::StatusOr<UniqueFd> listener = driver_->OpenEgressListener(ref);
  ASSERT_TRUE(listener.ok()) << listener.status();
  std::thread server([fd = listener->get()] {
    int c = accept(fd, nullptr, nullptr);
    if (c >= 0) {
      (void)!write(c, "via-listener\n", 13);
      close(c);
    }
  });
  ExecResult via = MustExec(ref, connect);
  server.join();
  EXPECT_TRUE(absl::StrContains(via.stdout_data, "via-listener\nrc=0")) << via.stdout_data;
  // Bypass attempts: the host's loopback, a routable address, DNS over UDP.
  for (const std::string& target : {absl::StrCat("127.0.0.1/", host.port()),
                                    std::string("10.0.2.2/80"), std::string("8.8.8.8/53")}) {
    ExecResult c =
        MustExec(ref, "timeout 5 bash -c 'exec 3<>/dev/tcp/" + target + "' 2>&1; echo rc=$?");
    EXPECT_FALSE(absl::StrContains(c.stdout_data, "rc=0")) << target << ": " << c.stdout_data;
  }
  ExecResult udp =
      MustExec(ref, "timeout 5 bash -c 'echo x > /dev/udp/8.8.8.8/53' 2>&1; echo rc=$?");
  EXPECT_FALSE(absl::StrContains(udp.stdout_data, "rc=0")) << udp.stdout_data;
  // The listener closed (the proxy died): refused again, and a fresh one can be opened.
  listener->reset();
  EXPECT_TRUE(absl::StrContains(MustExec(ref, connect).stdout_data, "refused"));
  absl::StatusOr<UniqueFd> again = driver_->OpenEgressListener(ref);
  EXPECT_TRUE(again.ok()) << again.status();
  again->reset();
  DestroyAndCheckClean(ref);
  EXPECT_FALSE(fs::exists(netns));
}

TEST_F(ContainerDriverTest, GovernedSandboxWithoutUserNamespaceToo) {
  ContainerDriverOptions o = options_;
  o.user_namespaces = false;
  o.state_dir += "-nouserns";
  auto driver = NewContainerDriver(o);
  ASSERT_TRUE(driver.ok()) << driver.status();
  absl::StatusOr<InstanceRef> ref = (*driver)->Create("g" + RandomHex(3), GovernedSpec(nullptr));
  ASSERT_TRUE(ref.ok()) << ref.status();
  ExecRequest req;
  req.command = "ls /sys/class/net; cat /proc/self/uid_map";
  absl::StatusOr<ExecResult> r = (*driver)->Exec(*ref, req, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(absl::StartsWith(r->stdout_data, "lo\n")) << r->stdout_data;
  absl::StatusOr<UniqueFd> listener = (*driver)->OpenEgressListener(*ref);
  EXPECT_TRUE(listener.ok()) << listener.status();
  listener->reset();
  EXPECT_TRUE((*driver)->Destroy(*ref).ok());
  std::vector<std::string> leaks = FindContainerLeaks(o, *ref);
  EXPECT_TRUE(leaks.empty()) << absl::StrJoin(leaks, "\n");
}

TEST_F(ContainerDriverTest, NonGovernedSandboxHasNoEgressNetnsOrVariables) {
  InstanceRef ref = MustCreate();
  EXPECT_FALSE(fs::exists(NetnsOf(options_, ref.id)));
  EXPECT_FALSE(absl::StrContains(ref.state, "egress")) << ref.state;
  std::string config;
  ASSERT_TRUE(
      ReadFileToString(absl::StrCat(options_.state_dir, "/envs/", ref.id, "/config.json"), &config)
          .ok());
  EXPECT_TRUE(absl::StrContains(config, R"({"type":"network"})")) << config;
  EXPECT_FALSE(absl::StrContains(config, "PROXY")) << config;
  EXPECT_FALSE(absl::StrContains(config, "ca-certificates")) << config;
  ExecResult r = MustExec(ref, "env | grep -ci proxy; echo");
  EXPECT_EQ(r.stdout_data, "0\n\n");
  absl::StatusOr<UniqueFd> l = driver_->OpenEgressListener(ref);
  EXPECT_TRUE(absl::IsFailedPrecondition(l.status())) << l.status();
  DestroyAndCheckClean(ref);
}

TEST_F(ContainerDriverTest, GovernedNetnsSurvivesDriverRestartAndOrphansAreReclaimed) {
  InstanceRef ref = MustCreate(GovernedSpec(nullptr));
  const std::string orphan = NetnsOf(options_, "gone" + RandomHex(3));
  ASSERT_TRUE(container::CreateNetns(orphan).ok());
  ContainerDriverOptions o = options_;
  o.probe = false;
  auto fresh = NewContainerDriver(o);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_FALSE(fs::exists(orphan)) << "the netns of an environment that no longer exists";
  ASSERT_TRUE((*fresh)->Attach(ref).ok());
  absl::StatusOr<UniqueFd> listener = (*fresh)->OpenEgressListener(ref);
  EXPECT_TRUE(listener.ok()) << listener.status();
  listener->reset();
  // A governed sandbox whose netns vanished cannot be served again: not adopted.
  ASSERT_TRUE(container::RemoveNetns(NetnsOf(options_, ref.id)).ok());
  EXPECT_FALSE((*fresh)->Attach(ref).ok());
  ASSERT_TRUE((*fresh)->Destroy(ref).ok());
  EXPECT_TRUE(FindContainerLeaks(o, ref).empty());
  live_.clear();
}

TEST_F(ContainerDriverTest, RootfsIsReadOnlyAndScratchSpaceWritable) {
  InstanceRef ref = MustCreate();
  ExecResult r = MustExec(ref,
                          "touch /usr/x 2>&1; echo rc=$?; touch /etc/x 2>&1; echo rc=$?; "
                          "touch /x 2>&1; echo rc=$?; touch /tmp/x && echo tmp-ok; "
                          "touch /workspace/x && echo ws-ok");
  EXPECT_EQ(r.stdout_data.find("rc=0"), std::string::npos) << r.stdout_data;
  EXPECT_TRUE(absl::StrContains(r.stdout_data, "Read-only file system")) << r.stdout_data;
  EXPECT_TRUE(absl::StrContains(r.stdout_data, "tmp-ok"));
  EXPECT_TRUE(absl::StrContains(r.stdout_data, "ws-ok"));
  // The image on the host is untouched.
  EXPECT_FALSE(fs::exists(Env().rootfs + "/usr/x"));
}

TEST_F(ContainerDriverTest, WorkspaceDiskCapGivesEnospc) {
  EnvSpec spec;
  spec.disk_mb = 16;  // the smallest workspace an environment may ask for (env_limits.h)
  InstanceRef ref = MustCreate(spec);
  ExecResult r = MustExec(ref,
                          "dd if=/dev/zero of=/workspace/big bs=1M count=20 2>&1; "
                          "echo rc=$?");
  EXPECT_TRUE(absl::StrContains(r.stdout_data, "No space left on device")) << r.stdout_data;
  absl::Status w = driver_->WriteFile(ref, "big2", std::string(17 << 20, 'x'), 0, true);
  EXPECT_FALSE(w.ok());
  std::printf("[ disk     ] WriteFile of 17 MiB into a 16 MiB workspace: %s\n",
              w.ToString().c_str());
}

TEST_F(ContainerDriverTest, MemoryLimitStopsMemoryBomb) {
  EnvSpec spec;
  spec.memory_mb = 64;
  InstanceRef ref = MustCreate(spec);
  const int64_t t0 = MonotonicMs();
  ExecRequest req;
  req.command = "tail /dev/zero; echo rc=$?";
  req.timeout = std::chrono::milliseconds(30000);
  absl::StatusOr<ExecResult> r = driver_->Exec(ref, req, nullptr);
  std::printf("[ memory   ] bomb after %lld ms: %s\n", static_cast<long long>(MonotonicMs() - t0),
              r.ok() ? absl::StrCat("exit ", r->exit_code, " out=", r->stdout_data).c_str()
                     : r.status().ToString().c_str());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->timed_out);
  EXPECT_TRUE(absl::StrContains(r->stdout_data, "rc=137")) << r->stdout_data;
  absl::StatusOr<Usage> usage = driver_->Stats(ref);
  ASSERT_TRUE(usage.ok());
  EXPECT_LE(usage->memory_bytes, 64LL << 20);
  // The sandbox (and its agent) survive; the daemon side was never at risk.
  EXPECT_EQ(MustExec(ref, "echo alive").stdout_data, "alive\n");
}

TEST_F(ContainerDriverTest, PidsLimitStopsForkBomb) {
  EnvSpec spec;
  spec.pids = 32;
  InstanceRef ref = MustCreate(spec);
  ExecResult r = MustExec(ref,
                          "for i in $(seq 100); do sleep 30 & done 2>/dev/null; "
                          "echo started",
                          5000);
  absl::StatusOr<Usage> usage = driver_->Stats(ref);
  ASSERT_TRUE(usage.ok());
  std::printf("[ pids     ] fork bomb: exit %d timed_out %d, pids in cgroup %lld\n", r.exit_code,
              r.timed_out, static_cast<long long>(usage->pids));
  EXPECT_LE(usage->pids, 32);
  // The bomb runs until the exec's timeout (a builtin busy loop: no fork needed), so the
  // agent kills its whole process group afterwards.
  ExecResult bomb =
      MustExec(ref, "b(){ b|b& }; b; SECONDS=0; while ((SECONDS < 5)); do :; done", 3000);
  EXPECT_TRUE(bomb.timed_out);
  // The kernel counted refused forks in the container's pids cgroup.
  int64_t refused = -1;
  boost::json::object state = boost::json::parse(ref.state).as_object();
  for (const auto& dir : state["cgroup_dirs"].as_array()) {
    std::string events;
    if (!ReadFileToString(std::string(dir.as_string()) + "/pids.events", &events).ok()) continue;
    std::vector<std::string> kv = absl::StrSplit(events, absl::ByAnyChar(" \n"), absl::SkipEmpty());
    if (kv.size() >= 2 && kv[0] == "max") refused = std::stoll(kv[1]);
  }
  std::printf("[ pids     ] forks refused by the pids limit: %lld\n", (long long)refused);
  EXPECT_GT(refused, 0);
  usage = driver_->Stats(ref);
  ASSERT_TRUE(usage.ok());
  EXPECT_LE(usage->pids, 32);
  // Once the bomb is killed the environment is usable again.
  ExecResult after;
  for (int i = 0; i < 20; ++i) {
    ExecRequest req;
    req.command = "echo ok";
    req.timeout = std::chrono::milliseconds(5000);
    absl::StatusOr<ExecResult> r = driver_->Exec(ref, req, nullptr);
    if (r.ok() && r->stdout_data == "ok\n") {
      after = *r;
      break;
    }
    usleep(250000);
  }
  EXPECT_EQ(after.stdout_data, "ok\n");
}

TEST_F(ContainerDriverTest, FreshDriverReattachesRunningContainer) {
  InstanceRef ref = MustCreate();
  EXPECT_EQ(MustExec(ref, "echo keep > /workspace/k; echo ok").stdout_data, "ok\n");
  ContainerDriverOptions o = options_;
  o.probe = false;
  auto fresh = NewContainerDriver(o);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  ASSERT_TRUE((*fresh)->Attach(ref).ok()) << (*fresh)->Attach(ref);
  ExecRequest req;
  req.command = "cat /workspace/k";
  absl::StatusOr<ExecResult> r = (*fresh)->Exec(ref, req, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->stdout_data, "keep\n");
  driver_.reset();  // the first driver object going away does not stop the container
  ASSERT_TRUE((*fresh)->Attach(ref).ok());
  ASSERT_TRUE((*fresh)->Destroy(ref).ok());
  EXPECT_TRUE(FindContainerLeaks(options_, ref).empty());
  EXPECT_TRUE(absl::IsNotFound((*fresh)->Attach(ref))) << (*fresh)->Attach(ref);
  live_.clear();
}

// ---------------------------------------------------------------------------------------
// User namespaces

// "Uid:" line of /proc/<pid>/status: real, effective, saved, fs.
std::vector<uint32_t> HostIds(int pid, const char* field) {
  std::string status;
  EXPECT_TRUE(ReadFileToString(absl::StrCat("/proc/", pid, "/status"), &status).ok());
  for (absl::string_view line : absl::StrSplit(status, '\n')) {
    if (!absl::ConsumePrefix(&line, field)) continue;
    std::vector<uint32_t> ids;
    for (absl::string_view w : absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty())) {
      uint32_t id = 0;
      if (absl::SimpleAtoi(w, &id)) ids.push_back(id);
    }
    return ids;
  }
  return {};
}

int StatePid(const InstanceRef& ref) {
  return static_cast<int>(boost::json::parse(ref.state).as_object()["pid"].as_int64());
}

TEST_F(ContainerDriverTest, UsernsMapsEachSandboxToItsOwnHostRange) {
  UsernsStatus status = ContainerUsernsStatus(*driver_);
  std::printf("[ userns   ] enabled %d: %s\n", status.enabled, status.reason.c_str());
  ASSERT_TRUE(status.enabled) << "this host runs user namespaces (crun 1.8, kernel 6.x): "
                              << status.reason;
  InstanceRef a = MustCreate();
  InstanceRef b = MustCreate();
  std::set<uint32_t> host_uids;
  for (const InstanceRef& ref : {a, b}) {
    ExecResult r = MustExec(ref,
                            "touch /workspace/f; id -u; cat /proc/self/uid_map; "
                            "stat -c '%u:%g' /workspace /workspace/f");
    EXPECT_EQ(r.exit_code, 0) << r.stderr_data;
    std::printf("[ userns   ] %s: %s", ref.id.c_str(), r.stdout_data.c_str());
    boost::json::object state = boost::json::parse(ref.state).as_object();
    ASSERT_TRUE(state.contains("userns_host_id")) << ref.state;
    const uint32_t base = static_cast<uint32_t>(state["userns_host_id"].as_int64());
    EXPECT_GE(base, options_.userns_uid_base);
    EXPECT_EQ((base - options_.userns_uid_base) % 65536, 0u);
    // Inside: uid 1000 owns /workspace and what it creates; the map is 0..65533 -> base.
    std::vector<std::string> lines = absl::StrSplit(r.stdout_data, '\n', absl::SkipEmpty());
    ASSERT_EQ(lines.size(), 4u) << r.stdout_data;
    EXPECT_EQ(lines[0], "1000");
    EXPECT_EQ(std::vector<std::string>(absl::StrSplit(lines[1], ' ', absl::SkipEmpty())),
              (std::vector<std::string>{"0", absl::StrCat(base), "65534"}));
    EXPECT_EQ(lines[2], "1000:1000");
    EXPECT_EQ(lines[3], "1000:1000");
    // On the host: the sandbox's processes and files have the mapped ids, never 0 or 1000.
    const int pid = StatePid(ref);
    EXPECT_EQ(HostIds(pid, "Uid:"), std::vector<uint32_t>(4, base + 1000));
    EXPECT_EQ(HostIds(pid, "Gid:"), std::vector<uint32_t>(4, base + 1000));
    struct stat st;
    ASSERT_EQ(::stat(absl::StrCat("/proc/", pid, "/root/workspace/f").c_str(), &st), 0);
    EXPECT_EQ(st.st_uid, base + 1000);
    EXPECT_EQ(st.st_gid, base + 1000);
    host_uids.insert(st.st_uid);
    // The files API works as before (the agent serves esbd through the namespace).
    ASSERT_TRUE(driver_->WriteFile(ref, "api.txt", "x", 0, true).ok());
    ASSERT_EQ(::stat(absl::StrCat("/proc/", pid, "/root/workspace/api.txt").c_str(), &st), 0);
    EXPECT_EQ(st.st_uid, base + 1000);
  }
  EXPECT_EQ(host_uids.size(), 2u) << "two sandboxes share host uids";
  DestroyAndCheckClean(a);
  DestroyAndCheckClean(b);
}

// Attack: without a user namespace, sandbox uid 1000 IS host uid 1000 and reads that user's
// files wherever a bind or an image exposes them. The tiny image holds one (0600, host uid 1000).
TEST_F(ContainerDriverTest, UsernsAttackReadHostUid1000File) {
  ASSERT_TRUE(ContainerUsernsStatus(*driver_).enabled);
  InstanceRef ref = MustCreate();
  ExecResult r = MustExec(ref,
                          "stat -c '%u %a' /etc/host-uid-1000-secret; "
                          "cat /etc/host-uid-1000-secret");
  std::printf("[ attack   ] %s%s", r.stdout_data.c_str(), r.stderr_data.c_str());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_FALSE(absl::StrContains(r.stdout_data, "secret")) << r.stdout_data;
  EXPECT_TRUE(absl::StrContains(r.stderr_data, "Permission denied")) << r.stderr_data;
  EXPECT_TRUE(absl::StartsWith(r.stdout_data, "65534 600")) << r.stdout_data;  // unmapped owner
  // The same image without user namespaces: the file is the sandbox user's own.
  ContainerDriverOptions o = options_;
  o.state_dir = Env().tmp + "/state-nouserns-" + RandomHex(3);
  o.user_namespaces = false;
  auto plain = NewContainerDriver(o);
  ASSERT_TRUE(plain.ok()) << plain.status();
  absl::StatusOr<InstanceRef> p = (*plain)->Create("p" + RandomHex(3), EnvSpec());
  ASSERT_TRUE(p.ok()) << p.status();
  ExecRequest req;
  req.command = "cat /etc/host-uid-1000-secret";
  absl::StatusOr<ExecResult> leaked = (*plain)->Exec(*p, req, nullptr);
  ASSERT_TRUE(leaked.ok()) << leaked.status();
  EXPECT_EQ(leaked->stdout_data, "secret of host uid 1000\n");
  EXPECT_EQ(HostIds(StatePid(*p), "Uid:"), std::vector<uint32_t>(4, 1000u));
  EXPECT_TRUE((*plain)->Destroy(*p).ok());
  DestroyAndCheckClean(ref);
}

// Attack: sandbox root (uid 0 inside) reads a root-only host file that is bound into the
// sandbox read-only. Without a user namespace uid 0 is host root and owns the file; with one it
// is an unmapped "other". Run with the environment's own bundle, as uid 0, under the runtime.
TEST_F(ContainerDriverTest, UsernsAttackSandboxRootReadsRootOnlyHostFile) {
  ASSERT_TRUE(ContainerUsernsStatus(*driver_).enabled);
  InstanceRef ref = MustCreate();
  const std::string secret_dir = Env().tmp + "/root-secret-" + RandomHex(3);
  fs::create_directories(secret_dir);
  chmod(secret_dir.c_str(), 0755);  // the runtime must reach it; the file itself is 0600 root
  ASSERT_TRUE(WriteStringToFile(secret_dir + "/key", "host root secret\n", 0600).ok());
  std::string config;
  ASSERT_TRUE(
      ReadFileToString(options_.state_dir + "/envs/" + ref.id + "/config.json", &config).ok());
  boost::json::object state = boost::json::parse(ref.state).as_object();
  container::RuntimeKind kind;
  ASSERT_TRUE(container::ParseRuntimeKind(std::string(state["runtime"].as_string()), &kind));
  auto layout = container::DetectCgroups();
  ASSERT_TRUE(layout.ok());
  const std::string hide =
      kind == container::RuntimeKind::kCrun && layout->mode == container::CgroupMode::kHybrid
          ? layout->v2_mount
          : "";
  auto attempt = [&](bool userns) -> std::string {
    const std::string bundle = Env().tmp + "/rootattack-" + RandomHex(3);
    fs::create_directories(bundle);
    boost::json::object c = boost::json::parse(config).as_object();
    boost::json::object& process = c["process"].as_object();
    process["user"] = boost::json::object{{"uid", 0}, {"gid", 0}};
    process["args"] = boost::json::array{"/usr/bin/cat", "/tmp/secret/key"};
    c["mounts"].as_array().push_back(boost::json::object{{"destination", "/tmp/secret"},
                                                         {"type", "bind"},
                                                         {"source", secret_dir},
                                                         {"options", {"rbind", "ro"}}});
    boost::json::object& linux_section = c["linux"].as_object();
    linux_section["cgroupsPath"] = "/esb/rootattack-" + RandomHex(3);
    if (!userns) {
      linux_section.erase("uidMappings");
      linux_section.erase("gidMappings");
      boost::json::array kept;
      for (const auto& ns : linux_section["namespaces"].as_array()) {
        if (ns.as_object().at("type") != "user") kept.push_back(ns);
      }
      linux_section["namespaces"] = kept;
    }
    EXPECT_TRUE(WriteStringToFile(bundle + "/config.json", boost::json::serialize(c)).ok());
    container::OciRuntime rt(kind, container::FindExecutable(container::RuntimeName(kind)),
                             bundle + "/root", hide);
    const std::string cid = "rootattack-" + RandomHex(3);
    absl::StatusOr<container::ProcessResult> r =
        rt.RunForeground(cid, bundle, bundle + "/log", 30000);
    rt.Delete(cid).IgnoreError();
    container::RemoveCgroup(*layout, linux_section["cgroupsPath"].as_string().c_str(), 2000)
        .IgnoreError();
    EXPECT_TRUE(r.ok()) << r.status();
    std::string log;
    ReadFileToString(bundle + "/log", &log).IgnoreError();
    return absl::StrCat("exit ", r.ok() ? r->exit_code : -1, ": ", log);
  };
  const std::string mapped = attempt(true);
  const std::string plain = attempt(false);
  std::printf("[ attack   ] userns: %s[ attack   ] host uids: %s", mapped.c_str(), plain.c_str());
  EXPECT_TRUE(absl::StartsWith(mapped, "exit 1: ")) << mapped;
  EXPECT_TRUE(absl::StrContains(mapped, "Permission denied")) << mapped;
  EXPECT_FALSE(absl::StrContains(mapped, "host root secret")) << mapped;
  EXPECT_EQ(plain, "exit 0: host root secret\n") << "control: without a user namespace it works";
  DestroyAndCheckClean(ref);
}

// Off (or impossible): sandboxes run as today, and the driver says why.
TEST_F(ContainerDriverTest, UsernsOffRunsWithHostUidsAndSaysWhy) {
  ContainerDriverOptions o = options_;
  o.state_dir = Env().tmp + "/state-nouserns-" + RandomHex(3);
  o.user_namespaces = false;
  auto plain = NewContainerDriver(o);
  ASSERT_TRUE(plain.ok()) << plain.status();
  UsernsStatus status = ContainerUsernsStatus(**plain);
  EXPECT_FALSE(status.enabled);
  EXPECT_TRUE(absl::StrContains(status.reason, "user_namespaces = false")) << status.reason;
  EXPECT_TRUE(absl::StrContains((*plain)->Describe(), "no user namespaces"));
  absl::StatusOr<InstanceRef> p = (*plain)->Create("p" + RandomHex(3), EnvSpec());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(boost::json::parse(p->state).as_object().contains("userns_host_id")) << p->state;
  // A daemon that maps uids does not adopt it after a restart (the core replaces it).
  ContainerDriverOptions mapping = o;
  mapping.user_namespaces = true;
  mapping.probe = false;
  auto restarted = NewContainerDriver(mapping);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  absl::Status st = (*restarted)->Attach(*p);
  EXPECT_TRUE(IsSandboxOutdated(st)) << st;
  ASSERT_TRUE((*plain)->Attach(*p).ok());  // its own kind of daemon still adopts it
  EXPECT_TRUE((*plain)->Destroy(*p).ok());
  EXPECT_TRUE(FindContainerLeaks(o, *p).empty());
}

// Re-attach keeps the range: the registry entry stays with the environment, is re-registered
// if the registry was lost, and a range held by another environment is never adopted.
TEST_F(ContainerDriverTest, UsernsRangeSurvivesRestartAndIsFreedOnDestroy) {
  InstanceRef ref = MustCreate();
  const int64_t host_id = boost::json::parse(ref.state).as_object()["userns_host_id"].as_int64();
  const std::string entry = absl::StrCat(options_.userns_registry, "/", host_id);
  const std::string owner = options_.state_dir + "/envs/" + ref.id;
  std::string text;
  ASSERT_TRUE(ReadFileToString(entry, &text).ok());
  EXPECT_EQ(text, owner);
  ContainerDriverOptions o = options_;
  o.probe = false;
  auto fresh = NewContainerDriver(o);  // a restart: its reclaim keeps the live range
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  ASSERT_TRUE(fs::exists(entry));
  ASSERT_TRUE((*fresh)->Attach(ref).ok());
  ASSERT_EQ(::unlink(entry.c_str()), 0);  // registry lost (e.g. /run wiped by hand)
  ASSERT_TRUE((*fresh)->Attach(ref).ok()) << (*fresh)->Attach(ref);
  ASSERT_TRUE(ReadFileToString(entry, &text).ok());
  EXPECT_EQ(text, owner);
  // Another environment's range. Its owner directory exists: the registry is host-wide, and a
  // driver starting concurrently (another test) frees entries whose owner is gone.
  const std::string other = options_.state_dir + "/other-esbd/envs/other";
  ASSERT_TRUE(fs::create_directories(other));
  ASSERT_TRUE(WriteStringToFile(entry, other, 0600).ok());
  absl::Status st = (*fresh)->Attach(ref);
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  ASSERT_TRUE(WriteStringToFile(entry, owner, 0600).ok());
  ExecRequest req;
  req.command = "id -u";
  absl::StatusOr<ExecResult> r = (*fresh)->Exec(ref, req, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->stdout_data, "1000\n");
  DestroyAndCheckClean(ref);  // FindContainerLeaks also checks the registry entry
  EXPECT_FALSE(fs::exists(entry));
}

// Every range taken: Create refuses (no sharing), and a destroyed environment's range is reused.
TEST_F(ContainerDriverTest, UsernsRangesAreExhaustedNotShared) {
  ContainerDriverOptions o = options_;
  o.state_dir = Env().tmp + "/state-slots-" + RandomHex(3);
  o.userns_registry = Env().tmp + "/registry-" + RandomHex(3);
  o.userns_uid_base = 0x7ffe0000;  // the last two ranges below 2^31: none of a real daemon's
  o.userns_slots = 2;
  auto d = NewContainerDriver(o);
  ASSERT_TRUE(d.ok()) << d.status();
  absl::StatusOr<InstanceRef> one = (*d)->Create("s1", EnvSpec());
  ASSERT_TRUE(one.ok()) << one.status();
  absl::StatusOr<InstanceRef> two = (*d)->Create("s2", EnvSpec());
  ASSERT_TRUE(two.ok()) << two.status();
  absl::StatusOr<InstanceRef> three = (*d)->Create("s3", EnvSpec());
  EXPECT_TRUE(absl::IsResourceExhausted(three.status())) << three.status();
  EXPECT_FALSE(fs::exists(o.state_dir + "/envs/s3"));
  ASSERT_TRUE((*d)->Destroy(*one).ok());
  absl::StatusOr<InstanceRef> again = (*d)->Create("s3", EnvSpec());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(HostIds(StatePid(*again), "Uid:")[0], 0x7ffe0000u + 1000);
  EXPECT_TRUE((*d)->Destroy(*two).ok());
  EXPECT_TRUE((*d)->Destroy(*again).ok());
  // A range whose environment vanished without a destroy (crash) is reclaimed at start.
  const std::string gone = absl::StrCat(o.userns_registry, "/", 0x7fff0000u);
  ASSERT_TRUE(WriteStringToFile(gone, o.state_dir + "/envs/gone", 0600).ok());
  ASSERT_TRUE(NewContainerDriver(o).ok());
  EXPECT_FALSE(fs::exists(gone));
  // Ranges past 2^31, over host uids or not aligned to 65536 are refused.
  for (uint32_t bad : {0x7fff0000u, 1000u, 0x70000100u}) {
    o.userns_uid_base = bad;
    EXPECT_TRUE(absl::IsInvalidArgument(NewContainerDriver(o).status())) << bad;
  }
}

// Issue 9 review: environments created by an esbd before the fd-3 hand-over layout (host log
// as stdio, writable /run/esb bind, agent without the peer check) were re-attached as they
// were after an upgrade. Their state has no "layout"; re-attach refuses them (the core then
// destroys them) and the old layout's agent copies are removed.
TEST_F(ContainerDriverTest, OldLayoutInstanceIsRefusedOnReattach) {
  InstanceRef ref = MustCreate();
  boost::json::object state = boost::json::parse(ref.state).as_object();
  ASSERT_TRUE(state.contains("layout")) << ref.state;
  InstanceRef old = ref;
  state.erase("layout");
  old.state = boost::json::serialize(state);
  const std::string old_copy = options_.state_dir + "/bin/esb-agent-0123abcd-x";
  fs::create_directories(options_.state_dir + "/bin");
  std::ofstream(old_copy) << "old agent";
  ContainerDriverOptions o = options_;
  o.probe = false;
  auto fresh = NewContainerDriver(o);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_FALSE(fs::exists(old_copy)) << "layout-1 agent copy left behind";
  absl::Status st = (*fresh)->Attach(old);
  EXPECT_TRUE(IsSandboxOutdated(st)) << st;
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  EXPECT_TRUE((*fresh)->Attach(ref).ok()) << (*fresh)->Attach(ref);  // the current layout is fine
  EXPECT_FALSE(IsSandboxOutdated(absl::NotFoundError("gone")));
  ASSERT_TRUE((*fresh)->Destroy(old).ok());
  EXPECT_TRUE(FindContainerLeaks(options_, ref).empty());
  live_.clear();
}

// Version skew (issue 10): a restarted esbd that finds an agent still speaking protocol v1 in
// a sandbox says exactly why it cannot use it and reports the environment outdated (the core
// then destroys it), instead of hanging on it. The fake v1 agent takes the place of the
// environment's socket.
TEST_F(ContainerDriverTest, AgentSpeakingProtocolV1IsOutdatedOnReattach) {
  InstanceRef ref = MustCreate();
  const std::string sock = options_.state_dir + "/envs/" + ref.id + "/run/agent.sock";
  ASSERT_EQ(rename(sock.c_str(), (sock + ".real").c_str()), 0) << strerror(errno);
  int listener = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  strncpy(addr.sun_path, sock.c_str(), sizeof addr.sun_path - 1);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(listen(listener, 8), 0);
  std::atomic<bool> stop{false};
  std::thread fake_v1([&] {
    const std::string header = R"({"agent":"esb-agent","version":1,"pid":1})";
    std::string hello;
    for (uint32_t v : {static_cast<uint32_t>(1 + 4 + header.size())}) {
      for (int shift : {24, 16, 8, 0}) hello.push_back(static_cast<char>((v >> shift) & 0xff));
    }
    hello.push_back('\x01');  // v1 HELLO: u32 length, u8 type, u32 header_len, header
    for (int shift : {24, 16, 8, 0}) {
      hello.push_back(static_cast<char>((header.size() >> shift) & 0xff));
    }
    hello += header;
    while (!stop) {
      int fd = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      ssize_t w = write(fd, hello.data(), hello.size());
      (void)w;
      close(fd);
    }
  });
  ContainerDriverOptions o = options_;
  o.probe = false;
  auto fresh = NewContainerDriver(o);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  auto start = std::chrono::steady_clock::now();
  absl::Status st = (*fresh)->Attach(ref);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
  EXPECT_TRUE(IsSandboxOutdated(st)) << st;
  EXPECT_NE(st.message().find(
                "agent speaks protocol v1, esbd needs v2: the environment must be recreated"),
            std::string::npos)
      << st;
  stop = true;
  shutdown(listener, SHUT_RDWR);
  int poke = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);  // wakes accept
  connect(poke, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  close(poke);
  fake_v1.join();
  close(listener);
  ASSERT_EQ(rename((sock + ".real").c_str(), sock.c_str()), 0);
  EXPECT_TRUE((*fresh)->Attach(ref).ok()) << (*fresh)->Attach(ref);  // the real (v2) agent
  ASSERT_TRUE((*fresh)->Destroy(ref).ok());
  live_.clear();
}

TEST_F(ContainerDriverTest, DeadContainerIsReportedAndCleanedUp) {
  InstanceRef ref = MustCreate();
  boost::json::object state = boost::json::parse(ref.state).as_object();
  int pid = static_cast<int>(state["pid"].as_int64());
  ASSERT_GT(pid, 1);
  ASSERT_EQ(kill(pid, SIGKILL), 0);  // the sandbox's init dies behind the driver's back
  for (int i = 0; i < 100 && driver_->Stats(ref).value_or(Usage{}).alive; ++i) usleep(20000);
  absl::StatusOr<Usage> usage = driver_->Stats(ref);
  EXPECT_TRUE(!usage.ok() || !usage->alive);
  absl::Status attach = driver_->Attach(ref);
  EXPECT_FALSE(attach.ok());
  std::printf("[ dead     ] Attach after kill -9: %s\n", attach.ToString().c_str());
  ExecRequest req;
  req.command = "true";
  EXPECT_FALSE(driver_->Exec(ref, req, nullptr).ok());
  DestroyAndCheckClean(ref);
}

TEST_F(ContainerDriverTest, ConcurrentCreatesAreIndependent) {
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  std::vector<std::string> outputs(kThreads);
  std::vector<InstanceRef> refs(kThreads);
  std::vector<absl::Status> results(kThreads);
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      absl::StatusOr<InstanceRef> ref =
          driver_->Create(absl::StrCat("c", i, RandomHex(3)), EnvSpec());
      if (!ref.ok()) {
        results[i] = ref.status();
        return;
      }
      refs[i] = *ref;
      ExecRequest req;
      req.command = absl::StrCat("echo ", i, " > /workspace/n; cat /workspace/n");
      absl::StatusOr<ExecResult> r = driver_->Exec(*ref, req, nullptr);
      if (r.ok()) outputs[i] = r->stdout_data;
      results[i] = driver_->Destroy(*ref);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kThreads; ++i) {
    EXPECT_TRUE(results[i].ok()) << results[i];
    EXPECT_EQ(outputs[i], absl::StrCat(i, "\n"));
    EXPECT_TRUE(FindContainerLeaks(options_, refs[i]).empty());
  }
}

TEST_F(ContainerDriverTest, DestroyHandlesHalfCreatedAndUnknown) {
  // Never created.
  EXPECT_TRUE(driver_->Destroy(InstanceRef{"never", "container", ""}).ok());
  // A directory without a container (daemon died while writing the bundle).
  fs::create_directories(options_.state_dir + "/envs/half/run");
  std::ofstream(options_.state_dir + "/envs/half/config.json") << "{";
  InstanceRef half{"half", "container", "garbage"};
  EXPECT_TRUE(driver_->Destroy(half).ok());
  EXPECT_TRUE(FindContainerLeaks(options_, half).empty());
  // Hostile ids are refused, never used as paths.
  EXPECT_TRUE(absl::IsInvalidArgument(driver_->Destroy(InstanceRef{"../x", "container", ""})));
  EnvSpec spec;
  EXPECT_TRUE(absl::IsInvalidArgument(driver_->Create("a/b", spec).status()));
  spec.image = "nope";
  EXPECT_TRUE(absl::IsInvalidArgument(driver_->Create("x1", spec).status()));
  spec.image = "default";
  spec.cpu = std::nan("");
  EXPECT_TRUE(absl::IsInvalidArgument(driver_->Create("x2", spec).status()));
  spec.cpu = 1;
  spec.memory_mb = 1LL << 60;
  EXPECT_TRUE(absl::IsInvalidArgument(driver_->Create("x3", spec).status()));
  EXPECT_TRUE(FindContainerLeaks(options_, InstanceRef{"x2", "container", ""}).empty());
}

TEST_F(ContainerDriverTest, FailedCreateCleansUp) {
  options_.images["broken"] = Env().tmp + "/does-not-exist";
  auto driver = NewContainerDriver([&] {
    auto o = options_;
    o.probe = false;
    return o;
  }());
  ASSERT_TRUE(driver.ok());
  EnvSpec spec;
  spec.image = "broken";
  absl::StatusOr<InstanceRef> r = (*driver)->Create("broken1", spec);
  EXPECT_FALSE(r.ok());
  std::printf("[ failure  ] %s\n", r.status().ToString().c_str());
  EXPECT_TRUE(FindContainerLeaks(options_, InstanceRef{"broken1", "container", ""}).empty());
}

// Size of a host file (-1 if missing).
int64_t FileSize(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

// Sandbox code used to connect to the agent's socket (a bind of a host directory at /run/esb)
// and drive the agent itself. Now the socket exists only on the host, in a root-only
// directory; the agent serves the listening descriptor esbd handed it.
TEST_F(ContainerDriverTest, SandboxCannotConnectToAgentSocket) {
  InstanceRef ref = MustCreate();
  ExecResult r = MustExec(ref,
                          "/usr/local/bin/syscall_probe connect /run/esb/agent.sock; "
                          "ls -A /run/esb; ls /proc/1/fd 2>&1 | head -1");
  std::printf("[ attack   ] %s", r.stdout_data.c_str());
  EXPECT_TRUE(absl::StrContains(r.stdout_data, "connect=ENOENT")) << r.stdout_data;
  EXPECT_FALSE(absl::StrContains(r.stdout_data, "hello=")) << r.stdout_data;
  EXPECT_FALSE(absl::StrContains(r.stdout_data, "agent.sock")) << r.stdout_data;
  // On the host: root-only directory, a socket only root can connect to.
  const std::string run = options_.state_dir + "/envs/" + ref.id + "/run";
  struct stat st;
  ASSERT_EQ(::stat(run.c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 0u);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  ASSERT_EQ(::lstat((run + "/agent.sock").c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  // The host still reaches the agent (and does so again from a fresh driver: daemon restart).
  auto fresh = NewContainerDriver([&] {
    auto o = options_;
    o.probe = false;
    return o;
  }());
  ASSERT_TRUE(fresh.ok());
  EXPECT_TRUE((*fresh)->Attach(ref).ok());
  DestroyAndCheckClean(ref);
}

// The agent's fds 1/2 were the host file <env>/agent.log: `write path=/proc/self/fd/2`
// (through the API: files/raw) grew it without bound, files/read of /proc/self/fd/1 read it.
TEST_F(ContainerDriverTest, AgentWriteToProcSelfFdCannotGrowHostLog) {
  InstanceRef ref = MustCreate();
  const std::string log = options_.state_dir + "/envs/" + ref.id + "/agent.log";
  const int64_t before = FileSize(log);
  ASSERT_GE(before, 0);
  const std::string chunk(1 << 20, 'x');
  for (const char* path : {"/proc/self/fd/1", "/proc/self/fd/2", "/proc/1/fd/2", "/proc/self/mem",
                           "/proc/1/root/proc/self/fd/2", "/proc/self/cwd/../proc/self/fd/2",
                           "/sys/kernel/uevent_helper", "/proc/self/status", "/proc/1/environ"}) {
    absl::Status w = driver_->WriteFile(ref, path, chunk, 0, false);
    EXPECT_FALSE(w.ok()) << "write " << path;
    EXPECT_FALSE(absl::IsInternal(w)) << w;  // a 4xx, not a 500
    absl::StatusOr<FileChunk> rd = driver_->ReadFile(ref, path, 0, 4096);
    EXPECT_FALSE(rd.ok()) << "read " << path;
    std::printf("[ attack   ] %s: write -> %s; read -> %s\n", path, w.ToString().c_str(),
                rd.status().ToString().c_str());
  }
  for (const char* dir : {"/proc/self/fd", "/proc/1", "/proc", "/sys/fs"}) {
    EXPECT_FALSE(driver_->ListDir(ref, dir).ok()) << "list " << dir;
  }
  // A symlink the sandbox plants into /proc is refused just the same.
  EXPECT_EQ(MustExec(ref, "ln -s /proc/self/fd/2 /workspace/l && echo ok").stdout_data, "ok\n");
  EXPECT_FALSE(driver_->WriteFile(ref, "l", chunk, 0, false).ok());
  EXPECT_FALSE(driver_->ReadFile(ref, "l", 0, 10).ok());
  // Devices and sockets are bad input (400), never a server error.
  absl::StatusOr<FileChunk> tty = driver_->ReadFile(ref, "/dev/tty", 0, 10);
  EXPECT_TRUE(absl::IsInvalidArgument(tty.status())) << tty.status();
  // Ordinary files still work.
  ASSERT_TRUE(driver_->WriteFile(ref, "ok.txt", "fine", 0, true).ok());
  EXPECT_EQ(driver_->ReadFile(ref, "ok.txt", 0, 10)->data, "fine");
  const int64_t after = FileSize(log);
  std::printf("[ attack   ] host agent.log: %lld bytes before, %lld after\n", (long long)before,
              (long long)after);
  EXPECT_EQ(after, before);
  DestroyAndCheckClean(ref);
}

// No process of the sandbox holds the host's start-up log once the agent is up (so sandbox
// code has no way at all to write to it), and the agent's own log is capped inside.
TEST_F(ContainerDriverTest, NoSandboxProcessHoldsHostLog) {
  InstanceRef ref = MustCreate();
  const std::string log = options_.state_dir + "/envs/" + ref.id + "/agent.log";
  MustExec(ref, "sleep 30 >/dev/null 2>&1 & for i in $(seq 2000); do echo spam >&2; done; :");
  boost::json::object state = boost::json::parse(ref.state).as_object();
  int checked = 0;
  for (int pid : container::CgroupPids(*container::DetectCgroups(),
                                       std::string(state["cgroup_path"].as_string()))) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec)) {
      std::string target = fs::read_symlink(e.path(), ec).string();
      EXPECT_NE(target, log) << "pid " << pid << " fd " << e.path().filename();
      ++checked;
    }
  }
  EXPECT_GT(checked, 3);
  // Logging inside the sandbox: 1 MiB + one rotated file at most.
  ExecResult big = MustExec(ref, "ls -l /run/esb/state/agent.log | awk '{print $5}'");
  EXPECT_LE(std::atoll(big.stdout_data.c_str()), 1 << 20) << big.stdout_data;
  DestroyAndCheckClean(ref);
}

// mountinfo inside a sandbox showed the state directory and the environment id (binds of
// <state>/envs/<id>/run and .../hostname and <state>/bin/esb-agent-...).
TEST_F(ContainerDriverTest, MountinfoRevealsNoStateDirOrEnvId) {
  InstanceRef ref = MustCreate();
  ExecResult r = MustExec(ref, "cat /proc/self/mountinfo; cat /etc/hostname");
  EXPECT_FALSE(absl::StrContains(r.stdout_data, options_.state_dir)) << r.stdout_data;
  EXPECT_FALSE(absl::StrContains(r.stdout_data, ref.id)) << r.stdout_data;
  EXPECT_TRUE(absl::EndsWith(r.stdout_data, "sandbox\n")) << r.stdout_data;
  // What remains: the image directory is the root mount's source (documented in design.md).
  int lines_with_host_path = 0;
  for (absl::string_view line : absl::StrSplit(r.stdout_data, '\n')) {
    if (absl::StrContains(line, Env().tmp)) ++lines_with_host_path;
  }
  std::printf("[ mounts   ] lines naming a host path: %d (the image root)\n", lines_with_host_path);
  EXPECT_LE(lines_with_host_path, 1) << r.stdout_data;
  DestroyAndCheckClean(ref);
}

// Start-up errors still reach esbd: the container's stdio is the host log until the agent
// is up, and Create's error shows its tail.
TEST_F(ContainerDriverTest, FailedAgentStartShowsItsLog) {
  std::string broken = Env().tmp + "/broken-agent-" + RandomHex(3);
  ASSERT_TRUE(WriteStringToFile(broken,
                                "#!/bin/bash\necho agent-start-failed-marker >&2\n"
                                "exit 3\n",
                                0755)
                  .ok());
  auto o = options_;
  o.agent_binary = broken;
  o.probe = false;
  auto driver = NewContainerDriver(o);
  ASSERT_TRUE(driver.ok()) << driver.status();
  absl::StatusOr<InstanceRef> r = (*driver)->Create("broken" + RandomHex(2), EnvSpec());
  ASSERT_FALSE(r.ok());
  std::printf("[ failure  ] %s\n", r.status().ToString().c_str());
  // The installed copy is execute-only, so bash cannot read the script: that error is the log.
  EXPECT_TRUE(absl::StrContains(r.status().message(), "agent-start-failed-marker") ||
              absl::StrContains(r.status().message(), "Permission denied"))
      << r.status();
}

// `pids: 32768` was accepted and the parent of all sandboxes had no pids limit.
TEST_F(ContainerDriverTest, PidsAboveDaemonCapAreRefusedAndParentIsLimited) {
  EnvSpec spec;
  spec.pids = options_.max_pids + 1;
  absl::StatusOr<InstanceRef> r = driver_->Create("pidcap" + RandomHex(2), spec);
  EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
  auto layout = container::DetectCgroups();
  ASSERT_TRUE(layout.ok());
  std::string dir = layout->mode == container::CgroupMode::kV2
                        ? layout->v2_mount + options_.cgroup_parent
                        : layout->v1_mounts.at("pids") + options_.cgroup_parent;
  std::string max;
  ASSERT_TRUE(ReadFileToString(dir + "/pids.max", &max).ok());
  std::string pid_max, threads_max;
  ASSERT_TRUE(ReadFileToString("/proc/sys/kernel/pid_max", &pid_max).ok());
  ASSERT_TRUE(ReadFileToString("/proc/sys/kernel/threads-max", &threads_max).ok());
  int64_t expect = std::min(std::stoll(pid_max), std::stoll(threads_max)) / 2;
  std::printf("[ pids     ] %s/pids.max = %s", dir.c_str(), max.c_str());
  EXPECT_EQ(std::stoll(max), expect);
}

// The parent of all sandboxes had no memory limit: 200 environments x memory_mb 16384 with a
// 64 GiB /workspace tmpfs each were accepted on a 24 GiB host (global OOM, tmpfs pages stay).
TEST_F(ContainerDriverTest, MemoryAboveDaemonCapIsRefusedAndParentIsLimited) {
  // Host RAM minus max(2 GiB, 25%) for the host, minus the nano tier's eighth (<= 16 GiB).
  std::string meminfo;
  ASSERT_TRUE(ReadFileToString("/proc/meminfo", &meminfo).ok());
  int64_t host_kb = 0;
  ASSERT_EQ(std::sscanf(meminfo.c_str(), "MemTotal: %" SCNd64 " kB", &host_kb), 1);
  const int64_t host_mb = host_kb / 1024;
  const int64_t all = host_mb - std::max<int64_t>(2048, host_mb / 4);
  const int64_t expect_mb = all - std::min<int64_t>(all / 8, 16384);
  const int64_t cap_mb = expect_mb / 2;
  for (auto [memory, disk] : {std::pair<int64_t, int64_t>{cap_mb + 1, 64}, {256, cap_mb + 1},
                              {16384, 65536}}) {
    EnvSpec spec;
    spec.memory_mb = memory;
    spec.disk_mb = disk;
    absl::StatusOr<InstanceRef> r = driver_->Create("memcap" + RandomHex(2), spec);
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << memory << "/" << disk << ": " << r.status();
    // The answer names the cap that refused it (the one limit table, drivers/env_limits.h).
    EXPECT_TRUE(
        absl::StrContains(r.status().message(), memory > cap_mb ? "max_memory_mb" : "max_disk_mb"))
        << r.status();
  }
  auto layout = container::DetectCgroups();
  ASSERT_TRUE(layout.ok());
  const bool v2 = layout->mode == container::CgroupMode::kV2;
  std::string dir = v2 ? layout->v2_mount + options_.cgroup_parent
                       : layout->v1_mounts.at("memory") + options_.cgroup_parent;
  std::string max;
  ASSERT_TRUE(ReadFileToString(dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes"), &max).ok());
  std::printf("[ memory   ] host %" PRId64 " MiB; %s limit = %s", host_mb, dir.c_str(),
              max.c_str());
  EXPECT_EQ(std::stoll(max), expect_mb << 20);
  EXPECT_LT(std::stoll(max), host_mb << 20);
  std::string swap;
  if (!v2 && ReadFileToString(dir + "/memory.memsw.limit_in_bytes", &swap).ok()) {
    std::printf("[ memory   ] memsw limit = %s", swap.c_str());
    EXPECT_EQ(std::stoll(swap), expect_mb << 20);
  }
  if (!v2) {
    std::string hierarchy;
    ASSERT_TRUE(ReadFileToString(dir + "/memory.use_hierarchy", &hierarchy).ok());
    EXPECT_EQ(hierarchy.substr(0, 1), "1");
  }
}

// With the parent's limit, sandboxes that together fill more tmpfs than it allows fail inside
// the parent (its own OOM/charge failures), not on the host. A private parent limited to
// 160 MiB; two environments of 128 MiB each write 100 MiB to /workspace.
TEST_F(ContainerDriverTest, WorkspaceFillsOfAllSandboxesStayWithinParentLimit) {
  ContainerDriverOptions o = options_;
  o.cgroup_parent = "/esb/memtest-" + RandomHex(3);
  o.total_memory_mb = 160;
  o.max_memory_mb = 128;
  o.max_disk_mb = 128;
  auto driver = NewContainerDriver(o);
  ASSERT_TRUE(driver.ok()) << driver.status();
  std::unique_ptr<Driver> own = std::move(driver_);
  driver_ = std::move(*driver);
  auto layout = container::DetectCgroups();
  ASSERT_TRUE(layout.ok());
  const std::string dir = layout->mode == container::CgroupMode::kV2
                              ? layout->v2_mount + o.cgroup_parent
                              : layout->v1_mounts.at("memory") + o.cgroup_parent;
  EnvSpec spec;
  spec.disk_mb = 128;
  spec.memory_mb = 129;
  EXPECT_TRUE(absl::IsInvalidArgument(driver_->Create("memcap" + RandomHex(2), spec).status()));
  spec.memory_mb = 128;
  InstanceRef a = MustCreate(spec), b = MustCreate(spec);
  const char* fill = "dd if=/dev/zero of=/workspace/fill bs=1M count=100 2>/tmp/dd.err; "
                     "echo rc=$?; tail -1 /tmp/dd.err";
  ExecResult ra = MustExec(a, fill);
  absl::StatusOr<ExecResult> rb = [&] {
    ExecRequest req;
    req.command = fill;
    req.timeout = std::chrono::milliseconds(20000);
    return driver_->Exec(b, req, nullptr);
  }();
  std::string usage, peak, failcnt;
  if (layout->mode == container::CgroupMode::kV2) {
    ReadFileToString(dir + "/memory.current", &usage).IgnoreError();
    ReadFileToString(dir + "/memory.peak", &peak).IgnoreError();
    ReadFileToString(dir + "/memory.events", &failcnt).IgnoreError();
  } else {
    ReadFileToString(dir + "/memory.usage_in_bytes", &usage).IgnoreError();
    ReadFileToString(dir + "/memory.max_usage_in_bytes", &peak).IgnoreError();
    ReadFileToString(dir + "/memory.failcnt", &failcnt).IgnoreError();
  }
  std::printf("[ memory   ] a: exit %d %s", ra.exit_code, ra.stdout_data.c_str());
  std::printf("[ memory   ] b: %s\n", rb.ok() ? absl::StrCat("exit ", rb->exit_code, " ",
                                                                rb->stdout_data).c_str()
                                               : rb.status().ToString().c_str());
  std::printf("[ memory   ] %s usage %s peak %s failcnt/events %s\n", dir.c_str(),
              std::string(absl::StripAsciiWhitespace(usage)).c_str(),
              std::string(absl::StripAsciiWhitespace(peak)).c_str(),
              std::string(absl::StripAsciiWhitespace(failcnt)).c_str());
  // Not both fills succeeded: 200 MiB of tmpfs cannot sit in a 160 MiB parent.
  const bool a_ok = absl::StrContains(ra.stdout_data, "rc=0") &&
                    absl::StrContains(ra.stdout_data, "104857600 bytes");
  const bool b_ok = rb.ok() && absl::StrContains(rb->stdout_data, "rc=0") &&
                    absl::StrContains(rb->stdout_data, "104857600 bytes");
  EXPECT_FALSE(a_ok && b_ok);
  ASSERT_FALSE(peak.empty());
  EXPECT_LE(std::stoll(peak), 160ll << 20);
  EXPECT_GT(std::stoll(peak), 100ll << 20);  // the first fill really happened in this parent
  for (const InstanceRef& ref : live_) driver_->Destroy(ref).IgnoreError();
  live_.clear();
  driver_ = std::move(own);
  for (const auto& [name, mount] : layout->v1_mounts) ::rmdir((mount + o.cgroup_parent).c_str());
  if (!layout->v2_mount.empty()) ::rmdir((layout->v2_mount + o.cgroup_parent).c_str());
}

// Cold Create latency versus the runtime alone running the same bundle.
TEST_F(ContainerDriverTest, MeasureCreateLatency) {
  std::vector<int64_t> create_ms, raw_ms, raw_agent_ms;
  for (int i = 0; i < 5; ++i) {
    int64_t t0 = MonotonicMs();
    InstanceRef ref = MustCreate();
    create_ms.push_back(MonotonicMs() - t0);
    // Same bundle, started directly by the runtime (its own cgroup and run dir).
    std::string bundle = Env().tmp + "/raw-" + RandomHex(3);
    fs::create_directories(bundle + "/run");
    std::string config;
    ASSERT_TRUE(
        ReadFileToString(options_.state_dir + "/envs/" + ref.id + "/config.json", &config).ok());
    boost::json::object c = boost::json::parse(config).as_object();
    c["linux"].as_object()["cgroupsPath"] = "/esb/raw-" + RandomHex(3);
    ASSERT_TRUE(WriteStringToFile(bundle + "/config.json", boost::json::serialize(c)).ok());
    boost::json::object state = boost::json::parse(ref.state).as_object();
    container::RuntimeKind kind;
    ASSERT_TRUE(container::ParseRuntimeKind(std::string(state["runtime"].as_string()), &kind));
    auto layout = container::DetectCgroups();
    ASSERT_TRUE(layout.ok());
    std::string hide =
        kind == container::RuntimeKind::kCrun && layout->mode == container::CgroupMode::kHybrid
            ? layout->v2_mount
            : "";
    container::OciRuntime rt(kind, container::FindExecutable(container::RuntimeName(kind)),
                             bundle + "/root", hide);
    std::string cid = "raw-" + RandomHex(3);
    int listener = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un sun = {};
    sun.sun_family = AF_UNIX;
    std::string sock_path = bundle + "/run/agent.sock";
    ASSERT_LT(sock_path.size(), sizeof(sun.sun_path));
    strcpy(sun.sun_path, sock_path.c_str());
    ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&sun), sizeof(sun)), 0);
    ASSERT_EQ(listen(listener, 8), 0);
    t0 = MonotonicMs();
    absl::StatusOr<int> s =
        rt.RunDetached(cid, bundle, bundle + "/log", bundle + "/rtlog", 30000, listener);
    raw_ms.push_back(MonotonicMs() - t0);
    close(listener);
    ASSERT_TRUE(s.ok()) << s.status();
    // Until the agent's HELLO arrives.
    while (MonotonicMs() - t0 < 10000) {
      int c = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      char byte;
      bool hello =
          connect(c, reinterpret_cast<sockaddr*>(&sun), sizeof(sun)) == 0 && read(c, &byte, 1) == 1;
      close(c);
      if (hello) break;
      usleep(500);
    }
    raw_agent_ms.push_back(MonotonicMs() - t0);
    EXPECT_TRUE(rt.Delete(cid).ok());
    container::RemoveCgroup(*layout, std::string(c["linux"].as_object()["cgroupsPath"].as_string()),
                            2000)
        .IgnoreError();
    fs::remove_all(bundle);
    DestroyAndCheckClean(ref);
  }
  auto median = [](std::vector<int64_t> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  auto minimum = [](const std::vector<int64_t>& v) {
    return *std::min_element(v.begin(), v.end());
  };
  std::printf(
      "[ latency  ] driver Create (bundle+run+agent ping): min %lld / median %lld ms\n"
      "[ latency  ] runtime `run -d` of the same bundle:    min %lld / median %lld ms\n"
      "[ latency  ] runtime `run -d` until the agent's HELLO:  min %lld / median %lld ms\n",
      (long long)minimum(create_ms), (long long)median(create_ms), (long long)minimum(raw_ms),
      (long long)median(raw_ms), (long long)minimum(raw_agent_ms), (long long)median(raw_agent_ms));
}

// The project's real image (images/), when it has been built: ESBD_IMAGE_DEFAULT from the
// environment or from build/images.env.
std::string RealImage() {
  if (const char* env = getenv("ESBD_IMAGE_DEFAULT")) return env;
#ifdef ESB_SOURCE_DIR
  std::ifstream in(std::string(ESB_SOURCE_DIR) + "/build/images.env");
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "ESBD_IMAGE_DEFAULT=")) {
      std::string v = line.substr(strlen("ESBD_IMAGE_DEFAULT="));
      v.erase(std::remove(v.begin(), v.end(), '"'), v.end());
      return v;
    }
  }
#endif
  return "";
}

TEST_F(ContainerDriverTest, RealImageRunsPython) {
  std::string image = RealImage();
  if (image.empty() || !fs::exists(image + "/usr/bin/python3")) {
    GTEST_SKIP() << "real image not built (no ESBD_IMAGE_DEFAULT / build/images.env)";
  }
  ContainerDriverOptions o = options_;
  o.images["real"] = image;
  o.probe = false;
  auto driver = NewContainerDriver(o);
  ASSERT_TRUE(driver.ok()) << driver.status();
  EnvSpec spec;
  spec.image = "real";
  int64_t t0 = MonotonicMs();
  absl::StatusOr<InstanceRef> ref = (*driver)->Create("real" + RandomHex(3), spec);
  ASSERT_TRUE(ref.ok()) << ref.status();
  std::printf("[ image    ] Create on %s: %lld ms\n", image.c_str(),
              static_cast<long long>(MonotonicMs() - t0));
  ExecRequest req;
  req.command = "id -un; python3 -c 'print(1+1)'; touch /usr/x 2>&1 | grep -c Read-only";
  absl::StatusOr<ExecResult> r = (*driver)->Exec(*ref, req, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->stdout_data, "appuser\n2\n1\n") << r->stderr_data;
  EXPECT_TRUE((*driver)->Destroy(*ref).ok());
  EXPECT_TRUE(FindContainerLeaks(o, *ref).empty());
}

TEST(GvisorDriverTest, CreatesOrExplainsWhyNot) {
  if (!Env().skip_reason.empty()) GTEST_SKIP() << Env().skip_reason;
  if (container::FindExecutable("runsc").empty()) GTEST_SKIP() << "runsc (gVisor) not installed";
  ContainerDriverOptions o;
  o.state_dir = Env().tmp + "/gvisor-" + RandomHex(3);
  o.agent_binary = Env().agent;
  o.images["default"] = Env().rootfs;
  o.runtime = "runsc";
  auto driver = NewContainerDriver(o);
  if (!driver.ok()) {
    EXPECT_TRUE(absl::IsUnavailable(driver.status())) << driver.status();
    EXPECT_FALSE(driver.status().message().empty());
    GTEST_SKIP() << "gVisor unavailable here: " << driver.status().message();
  }
  EXPECT_EQ((*driver)->name(), "gvisor");
  UsernsStatus userns = ContainerUsernsStatus(**driver);
  std::printf("[ gvisor   ] userns %d: %s\n", userns.enabled, userns.reason.c_str());
  EXPECT_FALSE(userns.enabled);
  EXPECT_TRUE(absl::StrContains(userns.reason, "gVisor")) << userns.reason;
  std::printf("[ gvisor   ] %s\n", (*driver)->Describe().c_str());
  int64_t t0 = MonotonicMs();
  absl::StatusOr<InstanceRef> ref = (*driver)->Create("g" + RandomHex(3), EnvSpec());
  ASSERT_TRUE(ref.ok()) << ref.status();
  std::printf("[ gvisor   ] Create %lld ms\n", static_cast<long long>(MonotonicMs() - t0));
  ExecRequest req;
  req.command =
      "id -u; uname -r; ls /sys/class/net; /usr/local/bin/syscall_probe; ls /proc/1/fd 2>&1 | "
      "head -2; /usr/local/bin/syscall_probe connect /run/esb/agent.sock";
  absl::StatusOr<ExecResult> r = (*driver)->Exec(*ref, req, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  std::printf("[ gvisor   ] %s", r->stdout_data.c_str());
  EXPECT_TRUE(absl::StartsWith(r->stdout_data, "1000\n")) << r->stdout_data;
  for (const char* refused :
       {"mount=EPERM", "unshare_user=EPERM", "ptrace_attach=EPERM", "bpf=EPERM",
        "clone_newuser=EPERM", "clone3=ENOSYS", "clone_plain=OK"}) {
    EXPECT_TRUE(absl::StrContains(r->stdout_data, refused)) << refused;
  }
  // gVisor refuses connect() to the host-backed agent socket from inside the sandbox.
  EXPECT_TRUE(absl::StrContains(r->stdout_data, "connect=EPERM")) << r->stdout_data;
  EXPECT_FALSE(absl::StrContains(r->stdout_data, "hello=")) << r->stdout_data;
  // Request paths: ordinary files work, /proc is refused (openat2 or its fallback).
  EXPECT_TRUE((*driver)->WriteFile(*ref, "a.txt", "gv", 0, true).ok());
  absl::StatusOr<FileChunk> back = (*driver)->ReadFile(*ref, "a.txt", 0, 10);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->data, "gv");
  for (const char* path : {"/proc/self/fd/2", "/proc/self/status", "/proc/1/fd/1"}) {
    absl::Status w = (*driver)->WriteFile(*ref, path, "x", 0, false);
    absl::StatusOr<FileChunk> rd = (*driver)->ReadFile(*ref, path, 0, 10);
    std::printf("[ gvisor   ] %s: write %s; read %s\n", path, w.ToString().c_str(),
                rd.status().ToString().c_str());
    EXPECT_FALSE(w.ok()) << path;
    EXPECT_FALSE(rd.ok()) << path;
  }
  absl::StatusOr<Usage> usage = (*driver)->Stats(*ref);
  ASSERT_TRUE(usage.ok()) << usage.status();
  std::printf("[ gvisor   ] stats: memory %lld, cpu %lld ms, pids %lld, alive %d\n",
              (long long)usage->memory_bytes, (long long)usage->cpu_ms, (long long)usage->pids,
              usage->alive);
  EXPECT_TRUE(usage->alive);
  EXPECT_TRUE((*driver)->Destroy(*ref).ok());
  EXPECT_TRUE(FindContainerLeaks(o, *ref).empty())
      << absl::StrJoin(FindContainerLeaks(o, *ref), "\n");
}

// --- time travel (kSteps): the state after restore equals the state at capture -------------

// /workspace as text: every entry's path, type, mode, size, mtime and link target, and the
// files' contents.
std::string WorkspaceFingerprint(Driver& driver, const InstanceRef& ref) {
  ExecRequest req;
  req.command =
      "(cd /workspace && find . -mindepth 1 -printf '%p %y %m %s %T@ %l\\n' | LC_ALL=C sort && "
      "find . -type f -printf '%p\\n' | LC_ALL=C sort | while read -r f; do echo \"== $f\"; "
      "cat \"$f\"; done)";
  req.timeout = std::chrono::milliseconds(20000);
  absl::StatusOr<ExecResult> r = driver.Exec(ref, req, nullptr);
  EXPECT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r.ok() ? r->exit_code : -1, 0) << (r.ok() ? r->stderr_data : "");
  return r.ok() ? r->stdout_data : "";
}

// The shell session: cwd, an exported and a plain variable, a function.
std::string ShellFingerprint(Driver& driver, const InstanceRef& ref) {
  ExecRequest req;
  req.command = "pwd; echo \"STEP=$STEP X=$X\"; env | grep -c '^STEP=' ; type greet 2>&1 | head -1";
  req.timeout = std::chrono::milliseconds(20000);
  absl::StatusOr<ExecResult> r = driver.Exec(ref, req, nullptr);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? r->stdout_data : "";
}

constexpr char kStepSetup[] =
    "mkdir -p d/e && printf alpha > a.txt && printf 'in e' > d/e/f && chmod 0750 d && "
    "chmod 0600 d/e/f && ln -s ../a.txt d/link && ln -s /etc/passwd abs && : > empty && "
    "cd d && export STEP=one && X=plain && greet() { echo hi; }";

TEST_F(ContainerDriverTest, StepsAreACapability) {
  EXPECT_TRUE(driver_->Capabilities().Has(Capability::kSteps));
  StepMemorySupport memory = driver_->StepMemory();
  std::printf("[ steps    ] memory: %s\n", memory.reason.c_str());
  EXPECT_FALSE(memory.available);
  // Honest about why: CRIU's state on this host, and the runtime's lack of a checkpoint.
  EXPECT_TRUE(absl::StrContains(memory.reason, "criu")) << memory.reason;
  EXPECT_TRUE(absl::StrContains(memory.reason, "memory \"none\"")) << memory.reason;
}

TEST_F(ContainerDriverTest, RewindGivesBackFilesModesSymlinksAndShell) {
  InstanceRef ref = MustCreate();
  ASSERT_EQ(MustExec(ref, kStepSetup).exit_code, 0);
  testing::MemoryBlobStore blobs;
  absl::StatusOr<StepState> step = driver_->CaptureStep(ref, CaptureOptions{}, blobs);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_FALSE(step->memory.has_value());
  EXPECT_EQ(step->workspace.entries.size(), 7u);
  EXPECT_FALSE(step->shell_state.empty());
  const std::string files = WorkspaceFingerprint(*driver_, ref);
  const std::string shell = ShellFingerprint(*driver_, ref);
  EXPECT_EQ(shell, "/workspace/d\nSTEP=one X=plain\n1\ngreet is a function\n");
  // Everything changes.
  ASSERT_EQ(MustExec(ref,
                     "cd /workspace && rm -rf d && echo changed > a.txt && chmod 0600 a.txt "
                     "&& mkdir extra && ln -s /etc/passwd extra/l && rm abs && mkdir abs && "
                     "cd /tmp && export STEP=two && unset X && unset -f greet")
                .exit_code,
            0);
  ASSERT_NE(WorkspaceFingerprint(*driver_, ref), files);
  ASSERT_NE(ShellFingerprint(*driver_, ref), shell);
  absl::StatusOr<InstanceRef> back = driver_->RestoreStep(ref, *step, blobs);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(WorkspaceFingerprint(*driver_, ref), files);
  EXPECT_EQ(ShellFingerprint(*driver_, ref), shell);
  // Continue after the rewind: the next capture stores only what the new step wrote.
  const int puts = blobs.puts();
  ASSERT_EQ(MustExec(ref, "echo more > /workspace/b.txt").exit_code, 0);
  CaptureOptions next;
  next.previous = &step->workspace;
  absl::StatusOr<StepState> after = driver_->CaptureStep(ref, next, blobs);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(blobs.puts(), puts + 1);
  EXPECT_EQ(after->workspace.entries.size(), 8u);
  // Unchanged again: nothing is stored.
  next.previous = &after->workspace;
  ASSERT_TRUE(driver_->CaptureStep(ref, next, blobs).ok());
  EXPECT_EQ(blobs.puts(), puts + 1);
}

TEST_F(ContainerDriverTest, ForksOfAStepAreEqualAtTheStepAndDivergeIndependently) {
  InstanceRef ref = MustCreate();
  ASSERT_EQ(MustExec(ref, kStepSetup).exit_code, 0);
  testing::MemoryBlobStore blobs;
  absl::StatusOr<StepState> step = driver_->CaptureStep(ref, CaptureOptions{}, blobs);
  ASSERT_TRUE(step.ok()) << step.status();
  const std::string files = WorkspaceFingerprint(*driver_, ref);
  const std::string shell = ShellFingerprint(*driver_, ref);
  std::vector<InstanceRef> forks;
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<InstanceRef> fork =
        driver_->ForkStep(*step, EnvSpec(), "f" + RandomHex(4), blobs);
    ASSERT_TRUE(fork.ok()) << fork.status();
    live_.push_back(*fork);
    forks.push_back(*fork);
    EXPECT_EQ(WorkspaceFingerprint(*driver_, *fork), files);
    EXPECT_EQ(ShellFingerprint(*driver_, *fork), shell);
  }
  ASSERT_EQ(MustExec(forks[0], "echo zero > /workspace/a.txt").exit_code, 0);
  ASSERT_EQ(MustExec(forks[1], "rm /workspace/a.txt && cd /workspace").exit_code, 0);
  EXPECT_EQ(MustExec(forks[0], "cat /workspace/a.txt").stdout_data, "zero\n");
  EXPECT_NE(MustExec(forks[1], "cat /workspace/a.txt").exit_code, 0);
  EXPECT_EQ(WorkspaceFingerprint(*driver_, ref), files);  // the source is untouched
  EXPECT_EQ(ShellFingerprint(*driver_, ref), shell);
}

TEST_F(ContainerDriverTest, APlantedSymlinkCannotMakeARewindWriteOutsideTheWorkspace) {
  InstanceRef ref = MustCreate();
  ASSERT_EQ(MustExec(ref, "mkdir -p /workspace/sub && echo mine > /workspace/sub/f").exit_code, 0);
  testing::MemoryBlobStore blobs;
  absl::StatusOr<StepState> step = driver_->CaptureStep(ref, CaptureOptions{}, blobs);
  ASSERT_TRUE(step.ok()) << step.status();
  // Sandbox code replaces the directory by a link to a directory it may not write through
  // the rewind (here its own /tmp, standing for anything outside the workspace).
  ASSERT_EQ(MustExec(ref,
                     "mkdir -p /tmp/target && rm -rf /workspace/sub && "
                     "ln -s /tmp/target /workspace/sub")
                .exit_code,
            0);
  ASSERT_TRUE(driver_->RestoreStep(ref, *step, blobs).ok());
  EXPECT_EQ(MustExec(ref, "ls -A /tmp/target | wc -l").stdout_data, "0\n");
  EXPECT_EQ(MustExec(ref, "test -L /workspace/sub || cat /workspace/sub/f").stdout_data, "mine\n");
}

TEST_F(ContainerDriverTest, PythonStepKeepsAVariablesSummaryAndRewindRestartsTheKernel) {
  // Needs python3 in the image: the real rootfs (scripts/build-images.sh; tests read
  // build/images.env into the environment), not the tiny one the other tests use.
  const char* image = getenv("ESBD_IMAGE_DEFAULT");
  if (image == nullptr || !fs::exists(std::string(image) + "/usr/bin/python3")) {
    GTEST_SKIP() << "no image with python3 (set ESBD_IMAGE_DEFAULT: . build/images.env)";
  }
  ContainerDriverOptions o = options_;
  o.state_dir = Env().tmp + "/state-py-" + RandomHex(3);
  o.images["default"] = image;
  absl::StatusOr<std::unique_ptr<Driver>> driver = NewContainerDriver(o);
  ASSERT_TRUE(driver.ok()) << driver.status();
  absl::StatusOr<InstanceRef> ref = (*driver)->Create("p" + RandomHex(4), EnvSpec());
  ASSERT_TRUE(ref.ok()) << ref.status();
  auto run = [&](const std::string& code) {
    RunRequest req;
    req.code = code;
    req.timeout_ms = 20000;
    absl::StatusOr<RunResult> r = (*driver)->RunCode(&*ref, req, nullptr);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : RunResult{};
  };
  testing::MemoryBlobStore blobs;
  RunResult first =
      run("x = 41\nnames = ['a', 'b']\nclass C:\n    def __repr__(self): return 'X'\nc = C()");
  ASSERT_EQ(first.exit_code, 0) << (first.error ? first.error->message : "");
  absl::StatusOr<StepState> step = (*driver)->CaptureStep(*ref, CaptureOptions{}, blobs);
  ASSERT_TRUE(step.ok()) << step.status();
  std::printf("[ vars     ] %s\n", step->variables_json.c_str());
  EXPECT_TRUE(absl::StrContains(step->variables_json, R"({"name":"x","type":"int","repr":"41"})"))
      << step->variables_json;
  EXPECT_TRUE(absl::StrContains(step->variables_json, R"("repr":"['a', 'b']")"));
  EXPECT_TRUE(absl::StrContains(step->variables_json, "C object>")) << "a user __repr__ ran";
  // A shell step after it has no summary of its own.
  ASSERT_EQ((*driver)->Exec(*ref, ExecRequest{.command = "true"}, nullptr)->exit_code, 0);
  absl::StatusOr<StepState> shell_step = (*driver)->CaptureStep(*ref, CaptureOptions{}, blobs);
  ASSERT_TRUE(shell_step.ok());
  EXPECT_EQ(shell_step->variables_json, "");
  // An error: the failing frame's locals are in the summary.
  RunResult failed = run("def f(n):\n    half = n / 2\n    return half / 0\nf(8)");
  ASSERT_TRUE(failed.error.has_value());
  absl::StatusOr<StepState> error_step = (*driver)->CaptureStep(*ref, CaptureOptions{}, blobs);
  ASSERT_TRUE(error_step.ok());
  EXPECT_TRUE(absl::StrContains(error_step->variables_json,
                                R"({"name":"half","type":"float","repr":"4.0","frame":"f ()"))
      << error_step->variables_json;
  // Rewind to the first step: memory "none", so the kernel restarts fresh.
  ASSERT_TRUE((*driver)->RestoreStep(*ref, *step, blobs).ok());
  RunResult after = run("'x' in globals()");
  EXPECT_EQ(after.value.value_or(""), "False");
  EXPECT_TRUE(after.kernel_restarted);
  EXPECT_TRUE((*driver)->Destroy(*ref).ok());
}

TEST_F(ContainerDriverTest, CaptureOfAnUnreadableDirectoryFailsInsteadOfLosingItsContents) {
  InstanceRef ref = MustCreate();
  ASSERT_EQ(MustExec(ref,
                     "mkdir /workspace/locked && echo x > /workspace/locked/f && "
                     "chmod 0 /workspace/locked")
                .exit_code,
            0);
  testing::MemoryBlobStore blobs;
  absl::StatusOr<StepState> step = driver_->CaptureStep(ref, CaptureOptions{}, blobs);
  EXPECT_FALSE(step.ok());
  EXPECT_TRUE(absl::StrContains(step.status().message(), "cannot read directory locked"))
      << step.status();
  ASSERT_EQ(MustExec(ref, "chmod 0755 /workspace/locked").exit_code, 0);
  EXPECT_TRUE(driver_->CaptureStep(ref, CaptureOptions{}, blobs).ok());
}

TEST_F(ContainerDriverTest, GvisorStepRewindGivesBackFilesAndShell) {
  if (container::FindExecutable("runsc").empty()) GTEST_SKIP() << "runsc (gVisor) not installed";
  ContainerDriverOptions o = options_;
  o.state_dir = Env().tmp + "/state-gv-" + RandomHex(3);
  o.runtime = "runsc";
  absl::StatusOr<std::unique_ptr<Driver>> driver = NewContainerDriver(o);
  ASSERT_TRUE(driver.ok()) << driver.status();
  StepMemorySupport memory = (*driver)->StepMemory();
  EXPECT_TRUE(memory.available) << memory.reason;
  EXPECT_EQ(memory.mechanism, "runsc checkpoint");
  absl::StatusOr<InstanceRef> ref = (*driver)->Create("g" + RandomHex(4), EnvSpec());
  ASSERT_TRUE(ref.ok()) << ref.status();
  ASSERT_EQ((*driver)->Exec(*ref, ExecRequest{.command = kStepSetup}, nullptr)->exit_code, 0);
  testing::MemoryBlobStore blobs;
  // Files only (memory off, as with max_live_memory 0): the agent's apply path under gVisor.
  absl::StatusOr<StepState> step =
      (*driver)->CaptureStep(*ref, CaptureOptions{.memory = false}, blobs);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_FALSE(step->memory.has_value());
  const std::string files = WorkspaceFingerprint(**driver, *ref);
  const std::string shell = ShellFingerprint(**driver, *ref);
  ASSERT_EQ(
      (*driver)
          ->Exec(*ref, ExecRequest{.command = "cd /workspace && rm -rf d a.txt && cd /"}, nullptr)
          ->exit_code,
      0);
  ASSERT_NE(WorkspaceFingerprint(**driver, *ref), files);
  ASSERT_TRUE((*driver)->RestoreStep(*ref, *step, blobs).ok());
  EXPECT_EQ(WorkspaceFingerprint(**driver, *ref), files);
  EXPECT_EQ(ShellFingerprint(**driver, *ref), shell);
  EXPECT_TRUE((*driver)->Destroy(*ref).ok());
}

// --- gVisor: a memory snapshot per step (runsc checkpoint + restore) ------------------------

class GvisorStepsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!Env().skip_reason.empty()) GTEST_SKIP() << Env().skip_reason;
    if (container::FindExecutable("runsc").empty()) GTEST_SKIP() << "runsc (gVisor) not installed";
    const char* image = getenv("ESBD_IMAGE_DEFAULT");
    python_ = image != nullptr && fs::exists(std::string(image) + "/usr/bin/python3");
    options_.state_dir = Env().tmp + "/gvs-" + RandomHex(3);
    options_.agent_binary = Env().agent;
    options_.images["default"] = python_ ? image : Env().rootfs;
    options_.runtime = "runsc";
  }
  void TearDown() override {
    for (const InstanceRef& ref : live_) {
      if (driver_) driver_->Destroy(ref).IgnoreError();
    }
  }
  void MakeDriver() {
    absl::StatusOr<std::unique_ptr<Driver>> driver = NewContainerDriver(options_);
    ASSERT_TRUE(driver.ok()) << driver.status();
    driver_ = std::move(*driver);
  }
  InstanceRef MustCreate() {
    absl::StatusOr<InstanceRef> ref = driver_->Create("g" + RandomHex(4), EnvSpec());
    EXPECT_TRUE(ref.ok()) << ref.status();
    if (!ref.ok()) return InstanceRef{"none", "gvisor", ""};
    live_.push_back(*ref);
    return *ref;
  }
  ExecResult Sh(const InstanceRef& ref, const std::string& command) {
    ExecRequest req;
    req.command = command;
    req.timeout = std::chrono::milliseconds(20000);
    absl::StatusOr<ExecResult> r = driver_->Exec(ref, req, nullptr);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : ExecResult{};
  }
  RunResult Py(const InstanceRef& ref, const std::string& code) {
    RunRequest req;
    req.code = code;
    req.timeout_ms = 20000;
    absl::StatusOr<RunResult> r = driver_->RunCode(&ref, req, nullptr);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : RunResult{};
  }
  std::string ImageDir(const SnapshotRef& snap) {
    return absl::StrCat(options_.state_dir, "/envs/", snap.source_id, "/images/", snap.id);
  }
  // A ticker in the background (its pid in /tmp/bg) and the shell/Python state of kStepSetup.
  void Setup(const InstanceRef& ref) {
    ASSERT_EQ(Sh(ref,
                 "(while :; do echo t >> /tmp/ticks; sleep 0.1; done) >/dev/null 2>&1 & "
                 "echo $! > /tmp/bg")
                  .exit_code,
              0);
    ASSERT_EQ(Sh(ref, kStepSetup).exit_code, 0);
    if (python_) {
      RunResult r = Py(ref, "x = 41\nimport os\nkernel_pid = os.getpid()");
      ASSERT_EQ(r.exit_code, 0) << (r.error ? r.error->message : "");
    }
  }

  ContainerDriverOptions options_;
  std::unique_ptr<Driver> driver_;
  std::vector<InstanceRef> live_;
  bool python_ = false;
};

TEST_F(GvisorStepsTest, RewindGivesBackVariablesProcessesFilesAndShellFromMemory) {
  MakeDriver();
  if (!python_) std::printf("[ gvisor   ] no python3 image: variables not checked\n");
  InstanceRef ref = MustCreate();
  Setup(ref);
  testing::MemoryBlobStore blobs;
  int64_t t0 = MonotonicMs();
  absl::StatusOr<StepState> step = driver_->CaptureStep(ref, CaptureOptions{}, blobs);
  const int64_t capture_ms = MonotonicMs() - t0;
  ASSERT_TRUE(step.ok()) << step.status();
  ASSERT_TRUE(step->memory.has_value()) << step->memory_reason;
  EXPECT_EQ(step->memory->driver, "gvisor");
  EXPECT_FALSE(step->memory->live);
  EXPECT_GT(step->memory->bytes, 0);
  struct stat st;
  ASSERT_EQ(::stat(ImageDir(*step->memory).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  std::printf("[ gvisor   ] capture with memory %lld ms, image %lld bytes\n",
              static_cast<long long>(capture_ms), static_cast<long long>(step->memory->bytes));
  // The environment ran on after the checkpoint: same processes, same session.
  const std::string files = WorkspaceFingerprint(*driver_, ref);
  const std::string shell = ShellFingerprint(*driver_, ref);
  EXPECT_EQ(shell, "/workspace/d\nSTEP=one X=plain\n1\ngreet is a function\n");
  const std::string bg = Sh(ref, "cat /tmp/bg").stdout_data;
  EXPECT_EQ(Sh(ref, "kill -0 $(cat /tmp/bg) && echo alive").stdout_data, "alive\n");
  if (python_) {
    EXPECT_EQ(Py(ref, "x").value.value_or(""), "41");
  }
  // Everything changes: variables, the background process, files, the shell.
  if (python_) ASSERT_EQ(Py(ref, "x = 99").exit_code, 0);
  ASSERT_EQ(Sh(ref,
               "kill $(cat /tmp/bg); cd /workspace && rm -rf d && echo changed > a.txt && "
               "cd /tmp && export STEP=two && unset X && unset -f greet")
                .exit_code,
            0);
  ASSERT_NE(WorkspaceFingerprint(*driver_, ref), files);
  ASSERT_NE(ShellFingerprint(*driver_, ref), shell);
  t0 = MonotonicMs();
  absl::StatusOr<InstanceRef> back = driver_->RestoreStep(ref, *step, blobs);
  ASSERT_TRUE(back.ok()) << back.status();
  std::printf("[ gvisor   ] rewind (restore from memory) %lld ms\n",
              static_cast<long long>(MonotonicMs() - t0));
  EXPECT_EQ(back->id, ref.id);
  EXPECT_EQ(back->state, ref.state);  // the instance is the same; its pid is the driver's
  if (python_) {
    RunResult x = Py(ref, "(x, kernel_pid == os.getpid())");
    EXPECT_EQ(x.value.value_or(""), "(41, True)");  // from memory: the cell was not re-run
    EXPECT_FALSE(x.kernel_restarted);
  }
  EXPECT_EQ(Sh(ref, "cat /tmp/bg").stdout_data, bg);
  EXPECT_EQ(Sh(ref, "kill -0 $(cat /tmp/bg) && echo alive").stdout_data, "alive\n");
  const std::string ticks = Sh(ref, "wc -l < /tmp/ticks").stdout_data;
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_NE(Sh(ref, "wc -l < /tmp/ticks").stdout_data, ticks) << "the ticker does not run";
  EXPECT_EQ(WorkspaceFingerprint(*driver_, ref), files);
  EXPECT_EQ(ShellFingerprint(*driver_, ref), shell);
  // Continue after the rewind: another step with memory, and the stats see the new pid.
  ASSERT_EQ(Sh(ref, "echo more > /workspace/b.txt").exit_code, 0);
  CaptureOptions next;
  next.previous = &step->workspace;
  absl::StatusOr<StepState> after = driver_->CaptureStep(ref, next, blobs);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(after->memory.has_value()) << after->memory_reason;
  EXPECT_EQ(after->workspace.entries.size(), step->workspace.entries.size() + 1);
  absl::StatusOr<Usage> usage = driver_->Stats(ref);
  ASSERT_TRUE(usage.ok()) << usage.status();
  EXPECT_TRUE(usage->alive);
  // A restarted daemon re-attaches to the restored container (its pid is not the ref's).
  absl::StatusOr<std::unique_ptr<Driver>> again = NewContainerDriver(options_);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE((*again)->Attach(ref).ok());
  // Collection releases an image; destroy removes the rest and leaves nothing behind.
  EXPECT_TRUE(driver_->DeleteSnapshot(*step->memory).ok());
  EXPECT_FALSE(fs::exists(ImageDir(*step->memory)));
  EXPECT_TRUE(driver_->DeleteSnapshot(*step->memory).ok());  // twice: fine
  EXPECT_TRUE(fs::exists(ImageDir(*after->memory)));
  ASSERT_TRUE(driver_->Destroy(ref).ok());
  live_.clear();
  EXPECT_FALSE(fs::exists(ImageDir(*after->memory)));
  std::vector<std::string> leaks = FindContainerLeaks(options_, ref);
  EXPECT_TRUE(leaks.empty()) << absl::StrJoin(leaks, "\n");
}

TEST_F(GvisorStepsTest, ForksOfAMemoryStepAreEqualAtTheStepAndDivergeIndependently) {
  MakeDriver();
  InstanceRef ref = MustCreate();
  Setup(ref);
  testing::MemoryBlobStore blobs;
  absl::StatusOr<StepState> step = driver_->CaptureStep(ref, CaptureOptions{}, blobs);
  ASSERT_TRUE(step.ok()) << step.status();
  ASSERT_TRUE(step->memory.has_value()) << step->memory_reason;
  const std::string files = WorkspaceFingerprint(*driver_, ref);
  const std::string shell = ShellFingerprint(*driver_, ref);
  std::vector<InstanceRef> forks;
  for (int i = 0; i < 2; ++i) {
    const int64_t t0 = MonotonicMs();
    absl::StatusOr<InstanceRef> fork =
        driver_->ForkStep(*step, EnvSpec(), "f" + RandomHex(4), blobs);
    ASSERT_TRUE(fork.ok()) << fork.status();
    std::printf("[ gvisor   ] fork (restore into a new sandbox) %lld ms\n",
                static_cast<long long>(MonotonicMs() - t0));
    live_.push_back(*fork);
    forks.push_back(*fork);
    EXPECT_EQ(WorkspaceFingerprint(*driver_, *fork), files);
    EXPECT_EQ(ShellFingerprint(*driver_, *fork), shell);
    EXPECT_EQ(Sh(*fork, "kill -0 $(cat /tmp/bg) && echo alive").stdout_data, "alive\n");
    if (python_) EXPECT_EQ(Py(*fork, "x").value.value_or(""), "41");
  }
  ASSERT_EQ(Sh(forks[0], "echo zero > /workspace/a.txt").exit_code, 0);
  ASSERT_EQ(Sh(forks[1], "rm /workspace/a.txt && cd /workspace && export STEP=f1").exit_code, 0);
  if (python_) {
    ASSERT_EQ(Py(forks[0], "x = 0").exit_code, 0);
    ASSERT_EQ(Py(forks[1], "x = 1").exit_code, 0);
    EXPECT_EQ(Py(forks[0], "x").value.value_or(""), "0");
    EXPECT_EQ(Py(forks[1], "x").value.value_or(""), "1");
    EXPECT_EQ(Py(ref, "x").value.value_or(""), "41");
  }
  EXPECT_EQ(Sh(forks[0], "cat /workspace/a.txt").stdout_data, "zero\n");
  EXPECT_NE(Sh(forks[1], "cat /workspace/a.txt").exit_code, 0);
  EXPECT_EQ(Sh(forks[1], "echo $STEP").stdout_data, "f1\n");
  EXPECT_EQ(Sh(forks[0], "echo $STEP; pwd").stdout_data, "one\n/workspace/d\n");
  EXPECT_EQ(WorkspaceFingerprint(*driver_, ref), files);  // the source is untouched
  EXPECT_EQ(ShellFingerprint(*driver_, ref), shell);
  // A fork's own step is its own image.
  absl::StatusOr<StepState> fork_step = driver_->CaptureStep(forks[0], CaptureOptions{}, blobs);
  ASSERT_TRUE(fork_step.ok()) << fork_step.status();
  ASSERT_TRUE(fork_step->memory.has_value()) << fork_step->memory_reason;
  EXPECT_EQ(fork_step->memory->source_id, forks[0].id);
  for (const InstanceRef& f : forks) {
    ASSERT_TRUE(driver_->Destroy(f).ok());
    EXPECT_TRUE(FindContainerLeaks(options_, f).empty());
  }
}

TEST_F(GvisorStepsTest, ACheckpointOverTheImageCapKeepsNoMemoryAndTheEnvironmentRunsOn) {
  options_.max_step_image_mb = 0;
  MakeDriver();
  InstanceRef ref = MustCreate();
  Setup(ref);
  testing::MemoryBlobStore blobs;
  absl::StatusOr<StepState> step = driver_->CaptureStep(ref, CaptureOptions{}, blobs);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_FALSE(step->memory.has_value());
  EXPECT_TRUE(absl::StrContains(step->memory_reason, "over the cap of 0 MiB"))
      << step->memory_reason;
  EXPECT_FALSE(fs::exists(options_.state_dir + "/envs/" + ref.id + "/images") &&
               !fs::is_empty(options_.state_dir + "/envs/" + ref.id + "/images"));
  // It ran on from the image: processes and variables are still there.
  EXPECT_EQ(Sh(ref, "kill -0 $(cat /tmp/bg) && echo alive").stdout_data, "alive\n");
  EXPECT_EQ(ShellFingerprint(*driver_, ref),
            "/workspace/d\nSTEP=one X=plain\n1\ngreet is a function\n");
  if (python_) EXPECT_EQ(Py(ref, "x").value.value_or(""), "41");
}

TEST_F(GvisorStepsTest, ACheckpointThatTimesOutKeepsNoMemoryAndTheEnvironmentStillWorks) {
  options_.step_snapshot_timeout_ms = 1;
  MakeDriver();
  InstanceRef ref = MustCreate();
  Setup(ref);
  const std::string files = WorkspaceFingerprint(*driver_, ref);
  testing::MemoryBlobStore blobs;
  absl::StatusOr<StepState> step = driver_->CaptureStep(ref, CaptureOptions{}, blobs);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_FALSE(step->memory.has_value());
  std::printf("[ gvisor   ] reason: %s\n", step->memory_reason.c_str());
  EXPECT_TRUE(absl::StrContains(step->memory_reason, "did not finish in 1 ms"))
      << step->memory_reason;
  // Whatever the killed checkpoint left, the environment works and has this step's files and
  // shell (restarted from them when the sandbox had stopped, which the reason says).
  EXPECT_EQ(Sh(ref, "echo ok").stdout_data, "ok\n");
  EXPECT_EQ(WorkspaceFingerprint(*driver_, ref), files);
  EXPECT_EQ(ShellFingerprint(*driver_, ref),
            "/workspace/d\nSTEP=one X=plain\n1\ngreet is a function\n");
  ASSERT_TRUE(driver_->Destroy(ref).ok());
  live_.clear();
  EXPECT_TRUE(FindContainerLeaks(options_, ref).empty());
}

}  // namespace
}  // namespace esb

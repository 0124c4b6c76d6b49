#include "drivers/nano/worker.h"

#include <fcntl.h>
#include <grp.h>
#include <linux/sched.h>
#include <poll.h>
#include <sched.h>
#include <seccomp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "drivers/nano/guest.h"
#include "drivers/nano/image.h"
#include "drivers/nano/memfs.h"
#include "drivers/nano/seccomp_policy.h"
#include "drivers/nano/wire.h"

// Defined only by test worker binaries (testdata/test_guest_glue.c): lets a test make a worker
// misbehave on the host side (e.g. issue a forbidden syscall) to prove the confinement.
extern "C" __attribute__((weak)) void esb_nano_test_hook(const char* what);

namespace esb::nano {
namespace {

constexpr uint32_t kMaxGuestPages = 65535;  // wasm_rt_memory_t::size is u32
constexpr uid_t kNobody = 65534;
constexpr size_t kReservationBytes = size_t{8} << 30;  // wasm_rt_allocate_memory's reservation

// Process-wide state of a server or worker (wabt's runtime is global anyway).
struct Runtime {
  MemFs fs;
  std::unique_ptr<WasiHost> host;
  void* instance = nullptr;
  uint32_t declared_max_pages = 0;
  uint32_t max_pages = 0;
  bool instance_dirty = false;  // trapped / exited / interrupted: needs a fresh instance
  bool needs_reseed = true;     // fresh instance: call the guest's reseed before running
  std::string result_path;
};
Runtime* g_rt = nullptr;
// The guest's linear memory as instantiated (the Wizer snapshot), copied once by the fork
// server and shared copy-on-write by every worker: compact images hold only the 4 KiB pages
// that differ from it.
std::string g_base;
constexpr size_t kImagePage = 4096;
constexpr char kImageMagic[] = "ESBNIMG1";
// A compact image being built (dump) or received (load) by this worker.
std::string g_image;
int64_t g_confine_us = -1;
bool g_warm_oneshot = true;  // how long the worker took to confine itself (diagnostics)

int64_t NowUs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
}

void OnAlarm(int) { esb_nano_interrupt = 1; }

std::vector<std::string> SplitNul(const std::string& s) {
  std::vector<std::string> out;
  if (s.empty()) return out;
  size_t start = 0;
  while (true) {
    size_t z = s.find('\0', start);
    out.push_back(s.substr(start, z == std::string::npos ? std::string::npos : z - start));
    if (z == std::string::npos) break;
    start = z + 1;
  }
  return out;
}

void Instantiate(Runtime* rt) {
  if (rt->instance) {
    uint8_t* data = esb_nano_guest.memory(rt->instance)->data;
    esb_nano_guest.free_instance(rt->instance);
    // wasm-rt 1.0.32's free unmaps only the used pages of the 8 GiB reservation; release all
    // of it, or every re-instantiation would leak 8 GiB of address space (RLIMIT_AS).
    munmap(data, kReservationBytes);
  }
  rt->instance = esb_nano_guest.new_instance(rt->host->wasi_instance());
  wasm_rt_memory_t* mem = esb_nano_guest.memory(rt->instance);
  rt->declared_max_pages = std::min(mem->max_pages, kMaxGuestPages);
  if (rt->max_pages) mem->max_pages = std::min(rt->declared_max_pages, rt->max_pages);
  rt->host->set_memory(mem);
  rt->instance_dirty = false;
  rt->needs_reseed = true;
  if (esb_nano_call_init(rt->instance) != 0) rt->instance_dirty = true;
}

void SetMemoryCap(Runtime* rt, uint32_t pages) {
  rt->max_pages = pages;
  wasm_rt_memory_t* mem = esb_nano_guest.memory(rt->instance);
  mem->max_pages = pages ? std::min(rt->declared_max_pages, pages) : rt->declared_max_pages;
}

// Guest code must be the OOM killer's first choice, as container sandboxes are (oci_spec.cc):
// the worker would otherwise inherit esbd's lowered oom_score_adj. Raising it needs no
// privilege; done while the fd table still has room and before seccomp.
void PreferForOomKill() {
  int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return;
  (void)!write(fd, "500", 3);
  close(fd);
}

// Limits that hold for the worker's whole life; set before seccomp.
void SetWorkerRlimits() {
  auto set = [](int res, rlim_t v) {
    rlimit r{v, v};
    setrlimit(res, &r);
  };
  set(RLIMIT_CORE, 0);
  set(RLIMIT_FSIZE, 0);
  set(RLIMIT_NOFILE, 16);
  // 8 GiB guard reservation per linear memory + host heap (workspace, output, runtime).
  set(RLIMIT_AS, (rlim_t{8} << 30) + (rlim_t{3} << 30));
}

// Per run: CPU backstop = what the worker used so far + the run's budget.
void SetCpuBackstop(int64_t timeout_ms) {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  rlim_t used = static_cast<rlim_t>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec);
  rlim_t soft = used + static_cast<rlim_t>(timeout_ms / 1000) + 3;
  rlimit cur{};
  getrlimit(RLIMIT_CPU, &cur);
  rlimit r{std::min(soft, cur.rlim_max), cur.rlim_max};
  setrlimit(RLIMIT_CPU, &r);
}

// Second layer when we are root: uid/gid nobody, no groups (the namespaces were entered once by
// the fork server, see RunForkServer).
void DropPrivileges() {
  if (geteuid() != 0) return;
  // SECURITY: the worker has no fs/socket syscalls anyway (seccomp); this makes a host-side
  // bug less useful.
  setgroups(0, nullptr);
  if (setresgid(kNobody, kNobody, kNobody) != 0 || setresuid(kNobody, kNobody, kNobody) != 0) {
    _exit(121);
  }
}

void CloseAllExcept(int keep) {
  // SECURITY: a worker holds exactly one fd: its own channel to the driver.
  if (keep > 0) syscall(SYS_close_range, 0u, static_cast<unsigned>(keep - 1), 0u);
  syscall(SYS_close_range, static_cast<unsigned>(keep + 1), ~0u, 0u);
}

Msg Error(const std::string& message) { return {{"ok", "0"}, {"error", message}}; }

std::string ErrnoName(WasiErrno e) {
  switch (e) {
    case kNoent: return "ENOENT";
    case kNotdir: return "ENOTDIR";
    case kIsdir: return "EISDIR";
    case kExist: return "EEXIST";
    case kRofs: return "EROFS";
    case kNospc: return "ENOSPC";
    case kNotcapable: return "EACCES";
    case kNametoolong: return "ENAMETOOLONG";
    case kNotempty: return "ENOTEMPTY";
    case kAcces:
      return "EACCES";
    case kPerm:
      return "EPERM";
    case kInval:
      return "EINVAL";
    case kLoop:
      return "ELOOP";
    case kFbig:
      return "EFBIG";
    case kNomem:
      return "ENOMEM";
    case kNotsup:
      return "EOPNOTSUPP";
    default: return absl::StrCat("WASI_ERRNO_", static_cast<int>(e));
  }
}

Msg FsError(WasiErrno e, const std::string& path) {
  Msg m = Error(absl::StrCat(path, ": ", ErrnoName(e)));
  m["errno"] = ErrnoName(e);
  return m;
}

Msg FsInvalid(const std::string& message) {
  Msg m = Error(message);
  m["errno"] = "EINVAL";
  return m;
}

// Host-side paths: relative ones are under /workspace.
WasiErrno HostPath(const std::string& path, std::vector<std::string>* comps) {
  std::string full = !path.empty() && path[0] == '/' ? path : "/workspace/" + path;
  return MemFs::Normalize({}, full, true, comps);
}

// Every worker is a fork of the same snapshot: give this one its own `random` state.
int Reseed(Runtime* rt) {
  rt->needs_reseed = false;
  int trap = esb_nano_call_reseed(rt->instance);
  if (trap != 0) rt->instance_dirty = true;
  return trap;
}

// Done by a fresh worker before it waits for its first request, i.e. off the critical path of
// a run: reseed, and (one-shot spares, `warm`) one empty esb_run: the first run of a fresh
// instance costs ~5 ms of CPU whatever the code (measured with print(1): 8 ms → 1.5 ms).
void Prepare(Runtime* rt, bool warm) {
  itimerval it{};
  it.it_value.tv_sec = 5;
  setitimer(ITIMER_REAL, &it, nullptr);
  if (rt->needs_reseed) Reseed(rt);
  if (warm && esb_nano_guest.run != nullptr && !rt->instance_dirty) {
    rt->host->BeginRun("", 0);
    uint32_t status = 0;
    if (esb_nano_call_run(rt->instance, &status) != 0) rt->instance_dirty = true;
    std::vector<std::string> comps;
    if (MemFs::Normalize({}, rt->result_path, true, &comps) == kOk && !comps.empty()) {
      rt->fs.Unlink(comps);
    }
  }
  itimerval off{};
  setitimer(ITIMER_REAL, &off, nullptr);
  esb_nano_interrupt = 0;
}

Msg DoRun(Runtime* rt, const Msg& req) {
  if (rt->instance_dirty) Instantiate(rt);
  int64_t timeout_ms = GetInt(req, "timeout_ms", 30000);
  if (req.count("memory_pages")) {
    SetMemoryCap(rt, static_cast<uint32_t>(GetInt(req, "memory_pages")));
  }
  if (req.count("ws_max_bytes")) {
    rt->fs.set_quota_limits(GetInt(req, "ws_max_bytes"), GetInt(req, "ws_max_files", 4096));
  }
  if (req.count("argv")) rt->host->set_args(SplitNul(GetStr(req, "argv")));
  if (req.count("env")) rt->host->set_env(SplitNul(GetStr(req, "env")));
  rt->host->BeginRun(GetStr(req, "stdin"), GetInt(req, "max_output_bytes", 1 << 20));
  std::vector<std::string> result_comps;
  MemFs::Normalize({}, rt->result_path, true, &result_comps);
  if (!result_comps.empty()) rt->fs.Unlink(result_comps);

  SetCpuBackstop(timeout_ms);
  esb_nano_interrupt = 0;
  itimerval it{};
  it.it_value.tv_sec = timeout_ms / 1000;
  it.it_value.tv_usec = (timeout_ms % 1000) * 1000;
  if (timeout_ms <= 0) it.it_value.tv_usec = 1;
  int64_t t0 = 0;
  {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    t0 = ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
  }
  // Test workers only: simulate a guest that never reaches an interrupt check, to exercise the
  // driver's SIGKILL backstop.
  bool no_alarm = esb_nano_test_hook != nullptr && GetStr(req, "test_no_interrupt") == "1";
  if (!no_alarm) setitimer(ITIMER_REAL, &it, nullptr);
  bool use_run = esb_nano_guest.run != nullptr &&
                 (esb_nano_guest.start == nullptr || GetStr(req, "entry") != "start");
  uint32_t status = 0;
  int trap = 0;
  rusage ru0{};
  getrusage(RUSAGE_SELF, &ru0);
  int64_t reseed_us = -1;
  if (rt->needs_reseed) {
    int64_t r0 = NowUs();
    trap = Reseed(rt);
    reseed_us = NowUs() - r0;
  }
  if (trap == 0) {
    trap = use_run ? esb_nano_call_run(rt->instance, &status)
                   : esb_nano_call_start(rt->instance);
  }
  itimerval off{};
  setitimer(ITIMER_REAL, &off, nullptr);
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  int64_t duration_us = ts.tv_sec * 1000000LL + ts.tv_nsec / 1000 - t0;

  WasiHost* h = rt->host.get();
  Msg rep{{"ok", "1"}};
  int64_t exit_code = status;
  bool timed_out = false;
  if (trap == 0) {
    // `_start` returning normally means exit status 0; `run` returns its status. A plain
    // program's instance is spent after `_start`.
    if (!use_run) rt->instance_dirty = true;
  } else if (h->interrupted() || (esb_nano_interrupt && !h->exited())) {
    timed_out = true;
    exit_code = 124;
    rt->instance_dirty = true;
  } else if (h->exited()) {
    exit_code = h->exit_code();
    rt->instance_dirty = true;
  } else {
    exit_code = 128 + 6;
    rt->instance_dirty = true;
    rep["trap"] = wasm_rt_strerror(static_cast<wasm_rt_trap_t>(trap));
    h->stderr_data() += absl::StrCat("\nnano: guest trapped: ", rep["trap"], "\n");
  }
  esb_nano_interrupt = 0;
  rep["exit_code"] = std::to_string(exit_code);
  rep["timed_out"] = timed_out ? "1" : "0";
  rep["truncated"] = h->truncated() ? "1" : "0";
  rep["duration_us"] = std::to_string(duration_us);
  rep["stdout"] = std::move(h->stdout_data());
  rep["stderr"] = std::move(h->stderr_data());
  rep["instance_reset"] = rt->instance_dirty ? "1" : "0";
  if (g_confine_us >= 0) rep["confine_us"] = std::to_string(g_confine_us);
  if (reseed_us >= 0) rep["reseed_us"] = std::to_string(reseed_us);
  rusage ru1{};
  getrusage(RUSAGE_SELF, &ru1);
  rep["minflt"] = std::to_string(ru1.ru_minflt - ru0.ru_minflt);
  auto us = [](const timeval& t) { return t.tv_sec * 1000000LL + t.tv_usec; };
  rep["cpu_us"] = std::to_string(us(ru1.ru_utime) + us(ru1.ru_stime) - us(ru0.ru_utime) -
                                 us(ru0.ru_stime));
  rep["sys_us"] = std::to_string(us(ru1.ru_stime) - us(ru0.ru_stime));
  std::shared_ptr<Node> result;
  if (!result_comps.empty() && rt->fs.Lookup(result_comps, &result) == kOk && !result->is_dir()) {
    rep["result"] = result->data.substr(0, 1 << 20);
    rt->fs.Unlink(result_comps);
  }
  return rep;
}

Msg DoWrite(Runtime* rt, const Msg& req) {
  std::string path = GetStr(req, "path");
  std::vector<std::string> comps;
  if (WasiErrno e = HostPath(path, &comps); e != kOk) return FsError(e, path);
  if (comps.empty()) return FsError(kIsdir, path);
  // mkdir -p of the parents (only succeeds inside writable dirs).
  for (size_t i = 1; i < comps.size(); i++) {
    std::vector<std::string> up(comps.begin(), comps.begin() + i);
    std::shared_ptr<Node> n;
    if (rt->fs.Lookup(up, &n) == kOk) continue;
    if (WasiErrno e = rt->fs.Mkdir(up); e != kOk) return FsError(e, JoinPath(up));
  }
  std::shared_ptr<Node> node;
  bool truncate = GetInt(req, "truncate", 0) != 0;
  if (WasiErrno e = rt->fs.CreateFile(comps, false, truncate, &node); e != kOk) {
    return FsError(e, path);
  }
  int64_t offset = GetInt(req, "offset", 0);
  if (offset < 0) return Error("negative offset");
  if (WasiErrno e = node->Write(static_cast<uint64_t>(offset), GetStr(req, "data")); e != kOk) {
    return FsError(e, path);
  }
  return {{"ok", "1"}, {"size", std::to_string(node->data.size())}};
}

Msg DoRead(Runtime* rt, const Msg& req) {
  std::string path = GetStr(req, "path");
  std::vector<std::string> comps;
  std::shared_ptr<Node> node;
  if (WasiErrno e = HostPath(path, &comps); e != kOk) return FsError(e, path);
  if (WasiErrno e = rt->fs.Lookup(comps, &node); e != kOk) return FsError(e, path);
  if (node->is_dir()) return FsError(kIsdir, path);
  uint64_t offset = static_cast<uint64_t>(std::max<int64_t>(0, GetInt(req, "offset", 0)));
  int64_t length = GetInt(req, "length", -1);
  uint64_t size = node->data.size();
  uint64_t start = std::min(offset, size);
  uint64_t n = length < 0 ? size - start : std::min<uint64_t>(length, size - start);
  n = std::min<uint64_t>(n, 16 << 20);
  return {{"ok", "1"},
          {"data", node->data.substr(start, n)},
          {"size", std::to_string(size)},
          {"eof", start + n >= size ? "1" : "0"}};
}

// The files API's mkdir/remove/rename act only inside /workspace: `path` normalised (relative
// ones are under /workspace) must stay below it; a `..` above the root or a path elsewhere is
// EINVAL (the memfs has no symlinks, so normalising the text is the whole resolution).
Msg WorkspacePath(const std::string& path, bool allow_root, std::vector<std::string>* comps) {
  if (path.empty()) return FsInvalid("path must not be empty");
  WasiErrno e = HostPath(path, comps);
  if (e == kNotcapable) return FsInvalid(absl::StrCat(path, ": refused: '..' leaves /workspace"));
  if (e != kOk) return FsError(e, path);
  if (comps->empty() || (*comps)[0] != "workspace") {
    return FsInvalid(absl::StrCat(path,
                                  ": refused: outside /workspace (files/mkdir, remove "
                                  "and rename act only inside the workspace)"));
  }
  if (!allow_root && comps->size() == 1) {
    return FsInvalid(absl::StrCat(path, ": refused: the workspace itself"));
  }
  return {{"ok", "1"}};
}

Msg DoMakeDir(Runtime* rt, const Msg& req) {
  std::string path = GetStr(req, "path");
  std::vector<std::string> comps;
  if (Msg m = WorkspacePath(path, true, &comps); GetStr(m, "ok") != "1") return m;
  bool created = false;
  if (WasiErrno e = rt->fs.MakeDirs(comps, &created); e != kOk) return FsError(e, path);
  return {{"ok", "1"}, {"created", created ? "1" : "0"}};
}

Msg DoRemove(Runtime* rt, const Msg& req) {
  std::string path = GetStr(req, "path");
  std::vector<std::string> comps;
  if (Msg m = WorkspacePath(path, false, &comps); GetStr(m, "ok") != "1") return m;
  if (WasiErrno e = rt->fs.Remove(comps, GetInt(req, "recursive", 0) != 0); e != kOk) {
    return FsError(e, path);
  }
  return {{"ok", "1"}};
}

Msg DoRename(Runtime* rt, const Msg& req) {
  std::string source = GetStr(req, "source"), destination = GetStr(req, "destination");
  std::vector<std::string> from, to;
  if (Msg m = WorkspacePath(source, false, &from); GetStr(m, "ok") != "1") return m;
  if (Msg m = WorkspacePath(destination, false, &to); GetStr(m, "ok") != "1") return m;
  std::shared_ptr<Node> node;
  if (WasiErrno e = rt->fs.Lookup(from, &node); e != kOk) return FsError(e, source);
  if (GetInt(req, "overwrite", 0) == 0 && from != to && rt->fs.Lookup(to, &node) == kOk) {
    return FsError(kExist, destination);
  }
  if (WasiErrno e = rt->fs.Rename(from, to); e != kOk) {
    return FsError(e, absl::StrCat(source, " -> ", destination));
  }
  return {{"ok", "1"}};
}

// Metadata of one path (read's path rules: anywhere in the memfs).
Msg DoPathStat(Runtime* rt, const Msg& req) {
  std::string path = GetStr(req, "path");
  std::vector<std::string> comps;
  std::shared_ptr<Node> node;
  if (WasiErrno e = HostPath(path, &comps); e != kOk) return FsError(e, path);
  if (WasiErrno e = rt->fs.Lookup(comps, &node); e != kOk) return FsError(e, path);
  return {{"ok", "1"},
          {"type", node->is_dir() ? "dir" : "file"},
          {"size", std::to_string(node->is_dir() ? 0 : node->data.size())},
          {"mtime_ms", std::to_string(node->mtime_ns / 1000000)},
          {"access", node->readonly ? "r" : "w"}};
}

Msg DoList(Runtime* rt, const Msg& req) {
  std::string path = GetStr(req, "path");
  std::vector<std::string> comps;
  std::shared_ptr<Node> node;
  if (WasiErrno e = HostPath(path, &comps); e != kOk) return FsError(e, path);
  if (WasiErrno e = rt->fs.Lookup(comps, &node); e != kOk) return FsError(e, path);
  if (!node->is_dir()) return FsError(kNotdir, path);
  // entries: name \0 type \0 size \0 mtime_ms \0 ... (4 fields each)
  std::string out;
  for (const auto& [name, child] : node->children) {
    absl::StrAppend(&out, name, std::string(1, '\0'), child->is_dir() ? "dir" : "file",
                    std::string(1, '\0'), child->is_dir() ? 0 : child->data.size(),
                    std::string(1, '\0'), child->mtime_ns / 1000000, std::string(1, '\0'),
                    child->readonly ? "r" : "w", std::string(1, '\0'));
  }
  return {{"ok", "1"}, {"entries", out}};
}

Msg DoStat(Runtime* rt) {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  int64_t cpu_ms = (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000 +
                   (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1000;
  wasm_rt_memory_t* mem = esb_nano_guest.memory(rt->instance);
  return {{"ok", "1"},
          {"guest_memory_bytes", std::to_string(uint64_t{mem->pages} * 65536)},
          {"max_rss_kb", std::to_string(ru.ru_maxrss)},
          {"cpu_ms", std::to_string(cpu_ms)},
          {"workspace_bytes", std::to_string(rt->fs.quota().used_bytes)},
          {"workspace_files", std::to_string(rt->fs.quota().used_files)}};
}

// Time travel: /workspace as manifest entries (nano_driver.cc CaptureStep), each encoded
// (image.h) as u8 type (0 dir, 1 file), str path (relative to /workspace), u64 size, u64
// mtime_ns, str change key "<ino>:<generation>" (it changes whenever a file's contents do).
Msg DoWalk(Runtime* rt, const Msg& req) {
  int64_t max_entries = std::max<int64_t>(0, GetInt(req, "max_entries", 10000));
  std::shared_ptr<Node> ws;
  if (rt->fs.Lookup({"workspace"}, &ws) != kOk || !ws->is_dir()) return Error("no /workspace");
  std::string out;
  ByteWriter w(&out);
  int64_t count = 0;
  bool truncated = false;
  std::vector<std::pair<std::string, std::shared_ptr<Node>>> stack = {{"", ws}};
  while (!stack.empty() && !truncated) {
    auto [prefix, dir] = stack.back();
    stack.pop_back();
    for (const auto& [name, child] : dir->children) {
      if (++count > max_entries) {
        truncated = true;
        break;
      }
      std::string path = prefix.empty() ? name : prefix + "/" + name;
      w.U8(child->is_dir() ? 0 : 1);
      w.Str(path);
      w.U64(child->is_dir() ? 0 : child->data.size());
      w.U64(static_cast<uint64_t>(child->mtime_ns));
      w.Str(absl::StrCat(child->ino, ":", child->generation));
      if (child->is_dir()) stack.push_back({path, child});
    }
  }
  return {{"ok", "1"}, {"entries", out}, {"truncated", truncated ? "1" : "0"}};
}

// Compact image (nano_driver.cc CompactSnapshot): "ESBNIMG1", str guest name, str globals,
// u32 wasm pages, u32 page count + (u32 index, 4096 bytes) per 4 KiB page that differs from
// the base (zeros past its end), str MemFs records, str WASI host state.
Msg DoDump(Runtime* rt) {
  if (esb_nano_guest.save_globals == nullptr) {
    return Error(absl::StrCat("guest ", esb_nano_guest.name, " cannot save its globals"));
  }
  if (rt->instance_dirty) return Error("the instance is being reset: nothing to save");
  uint8_t globals[256];
  size_t glen = esb_nano_guest.save_globals(rt->instance, globals, sizeof globals);
  if (glen == 0) return Error("the guest's globals cannot be saved");
  std::string host, herr;
  if (!rt->host->SaveState(&host, &herr)) return Error(herr);
  wasm_rt_memory_t* mem = esb_nano_guest.memory(rt->instance);
  uint64_t bytes = uint64_t{mem->pages} * 65536;
  g_image.clear();
  ByteWriter w(&g_image);
  w.Raw(kImageMagic, 8);
  w.Str(esb_nano_guest.name);
  w.Str(std::string_view(reinterpret_cast<const char*>(globals), glen));
  w.U32(mem->pages);
  size_t count_at = g_image.size();
  w.U32(0);
  uint32_t count = 0;
  static const char kZero[kImagePage] = {};
  for (uint64_t off = 0; off < bytes; off += kImagePage) {
    const char* page = reinterpret_cast<const char*>(mem->data) + off;
    const char* base = off + kImagePage <= g_base.size() ? g_base.data() + off : kZero;
    if (std::memcmp(page, base, kImagePage) == 0) continue;
    w.U32(static_cast<uint32_t>(off / kImagePage));
    w.Raw(page, kImagePage);
    count++;
  }
  std::memcpy(g_image.data() + count_at, &count, 4);
  w.Str(rt->fs.SaveWritable());
  w.Str(host);
  return {{"ok", "1"},
          {"size", std::to_string(g_image.size())},
          {"changed_pages", std::to_string(count)}};
}

Msg DoDumpChunk(const Msg& req) {
  uint64_t offset = static_cast<uint64_t>(std::max<int64_t>(0, GetInt(req, "offset")));
  uint64_t start = std::min<uint64_t>(offset, g_image.size());
  std::string data = g_image.substr(start, 32u << 20);
  if (start + data.size() >= g_image.size()) {
    g_image.clear();
    g_image.shrink_to_fit();
  }
  return {{"ok", "1"}, {"data", std::move(data)}};
}

// Largest image a session worker accepts: its memory cap, its workspace cap and slack for
// the records and the fd table.
uint64_t MaxImageBytes(Runtime* rt) {
  wasm_rt_memory_t* mem = esb_nano_guest.memory(rt->instance);
  return uint64_t{mem->max_pages} * 65536 * 2 + static_cast<uint64_t>(rt->fs.quota().max_bytes) +
         (16u << 20);
}

Msg DoLoadChunk(Runtime* rt, const Msg& req) {
  std::string data = GetStr(req, "data");
  if (g_image.size() + data.size() > MaxImageBytes(rt)) {
    g_image.clear();
    return Error("image larger than this session's memory and workspace caps allow");
  }
  g_image += data;
  return {{"ok", "1"}};
}

// Rebuilds this (fresh, never run) session worker from the image in g_image. Every field is
// checked; on any failure the instance is marked dirty and the driver kills the worker.
Msg DoLoad(Runtime* rt) {
  std::string image = std::move(g_image);
  g_image.clear();
  ByteReader r(image);
  auto fail = [&](const std::string& why) {
    rt->instance_dirty = true;
    return Error("nano image: " + why);
  };
  if (esb_nano_guest.load_globals == nullptr) {
    return fail(absl::StrCat("guest ", esb_nano_guest.name, " cannot load globals"));
  }
  if (r.Bytes(8) != std::string_view(kImageMagic, 8)) return fail("not an image (magic)");
  if (r.Str() != esb_nano_guest.name) return fail("made by another guest");
  std::string_view globals = r.Str();
  uint32_t pages = r.U32();
  uint32_t count = r.U32();
  if (!r.ok()) return fail("truncated header");
  // A fresh instance: linear memory = the base again, then grown and patched.
  Instantiate(rt);
  if (rt->instance_dirty) return fail("cannot instantiate");
  wasm_rt_memory_t* mem = esb_nano_guest.memory(rt->instance);
  if (pages < mem->pages || pages > mem->max_pages) {
    return fail(absl::StrCat("memory of ", pages, " pages does not fit (", mem->pages, "..",
                             mem->max_pages, ")"));
  }
  if (pages > mem->pages && wasm_rt_grow_memory(mem, pages - mem->pages) == UINT32_MAX) {
    return fail("cannot grow memory");
  }
  uint64_t npages4k = uint64_t{pages} * (65536 / kImagePage);
  if (count > npages4k) return fail("more changed pages than the memory has");
  int64_t prev = -1;
  for (uint32_t i = 0; i < count; i++) {
    uint32_t idx = r.U32();
    std::string_view page = r.Bytes(kImagePage);
    if (!r.ok() || idx >= npages4k || static_cast<int64_t>(idx) <= prev) {
      return fail("bad page record");
    }
    prev = idx;
    std::memcpy(mem->data + uint64_t{idx} * kImagePage, page.data(), kImagePage);
  }
  std::string_view fs = r.Str();
  std::string_view host = r.Str();
  if (!r.ok() || !r.done()) return fail("truncated or trailing bytes");
  if (esb_nano_guest.load_globals(rt->instance, reinterpret_cast<const uint8_t*>(globals.data()),
                                  globals.size()) != 0) {
    return fail("globals do not fit this guest");
  }
  if (absl::Status s = rt->fs.LoadWritable(fs); !s.ok()) return fail(std::string(s.message()));
  std::string herr;
  if (!rt->host->LoadState(host, &herr)) return fail("host state: " + herr);
  rt->needs_reseed = false;  // the image's random state is part of what comes back
  return {{"ok", "1"}};
}

// Confines the calling (freshly forked) process. Failures are fatal: an unconfined worker must
// never run guest code.
std::string g_bpf_oneshot, g_bpf_session;  // precompiled by the server

void Confine(int channel, bool seccomp, bool allow_fork) {
  PreferForOomKill();
  CloseAllExcept(channel);
  DropPrivileges();
  // SECURITY: die with the fork server (set after the uid change, which clears it).
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  SetWorkerRlimits();
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) _exit(122);
  if (seccomp && !LoadSeccompBpf(allow_fork ? g_bpf_session : g_bpf_oneshot).ok()) _exit(123);
}

[[noreturn]] void WorkerLoop(Runtime* rt, int channel, bool oneshot, bool seccomp);

// Session snapshot: a copy-on-write clone of this worker (memory, interpreter, workspace)
// that becomes a sibling (child of the fork server, which reaps and kills it).
Msg DoFork(Runtime* rt, int channel, int new_channel, bool seccomp) {
  if (new_channel < 0) return Error("fork needs a channel fd");
  long pid = syscall(SYS_clone, CLONE_PARENT | SIGCHLD, 0, 0, 0, 0);
  if (pid < 0) {
    close(new_channel);
    return Error(absl::StrCat("clone: ", strerror(errno)));
  }
  if (pid == 0) {
    // SECURITY: the clone inherits the seccomp filter and uid; it keeps only its own channel.
    close(channel);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    WorkerLoop(rt, new_channel, false, seccomp);
  }
  close(new_channel);
  return {{"ok", "1"}, {"pid", std::to_string(pid)}};
}

void WorkerLoop(Runtime* rt, int channel, bool oneshot, bool seccomp) {
  while (true) {
    Msg req;
    int passed = -1;
    if (!RecvMsg(channel, proto::FrameType::kRequest, &req, oneshot ? nullptr : &passed)) _exit(0);
    std::string op = GetStr(req, "op");
    Msg rep;
    if (op == "run") {
      rep = DoRun(rt, req);
    } else if (op == "write") {
      rep = DoWrite(rt, req);
    } else if (op == "read") {
      rep = DoRead(rt, req);
    } else if (op == "list") {
      rep = DoList(rt, req);
    } else if (op == "stat") {
      rep = DoStat(rt);
    } else if (op == "mkdir") {
      rep = DoMakeDir(rt, req);
    } else if (op == "remove") {
      rep = DoRemove(rt, req);
    } else if (op == "rename") {
      rep = DoRename(rt, req);
    } else if (op == "pathstat") {
      rep = DoPathStat(rt, req);
    } else if (op == "env") {
      rt->host->set_env(SplitNul(GetStr(req, "env")));
      rep = {{"ok", "1"}};
    } else if (op == "walk") {
      rep = DoWalk(rt, req);
    } else if (op == "dump" && !oneshot) {
      rep = DoDump(rt);
    } else if (op == "dump_chunk" && !oneshot) {
      rep = DoDumpChunk(req);
    } else if (op == "load_chunk" && !oneshot) {
      rep = DoLoadChunk(rt, req);
    } else if (op == "load" && !oneshot) {
      rep = DoLoad(rt);
    } else if (op == "fork" && !oneshot) {
      rep = DoFork(rt, channel, passed, seccomp);
      passed = -1;
    } else if (op == "test_hook" && esb_nano_test_hook != nullptr) {
      esb_nano_test_hook(GetStr(req, "what").c_str());
      rep = {{"ok", "1"}};
    } else if (op == "exit") {
      _exit(0);
    } else {
      rep = Error("unknown op " + op);
    }
    if (passed >= 0) close(passed);
    if (!SendMsg(channel, proto::FrameType::kResponse, rep)) _exit(0);
    if (oneshot && op == "run") _exit(0);
  }
}

// In the freshly forked child of the server.
[[noreturn]] void StartWorker(Runtime* rt, int channel, const Msg& spawn, bool seccomp) {
  bool oneshot = GetStr(spawn, "mode") != "session";
  if (spawn.count("memory_pages")) {
    SetMemoryCap(rt, static_cast<uint32_t>(GetInt(spawn, "memory_pages")));
  }
  rt->fs.set_quota_limits(GetInt(spawn, "ws_max_bytes", 64 << 20),
                          GetInt(spawn, "ws_max_files", 4096));
  if (spawn.count("env")) rt->host->set_env(SplitNul(GetStr(spawn, "env")));
  signal(SIGPIPE, SIG_IGN);
  struct sigaction sa{};
  sa.sa_handler = OnAlarm;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGALRM, &sa, nullptr);
  int64_t t0 = NowUs();
  Confine(channel, seccomp, !oneshot);
  g_confine_us = NowUs() - t0;
  // Warm-up only pays off when it happens before the request arrives (pre-forked spares).
  Prepare(rt, oneshot && g_warm_oneshot && GetStr(spawn, "warm") == "1");
  WorkerLoop(rt, channel, oneshot, seccomp);
}

}  // namespace

absl::Status ParseServerArgs(int argc, char** argv, ServerOptions* out) {
  bool preopens_given = false, args_given = false;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    auto val = [&](std::string_view flag) -> std::optional<std::string> {
      if (a.rfind(flag, 0) == 0) return a.substr(flag.size());
      return std::nullopt;
    };
    auto pair = [](const std::string& v) {
      size_t c = v.rfind(':');
      return c == std::string::npos ? std::make_pair(v, std::string("/"))
                                    : std::make_pair(v.substr(0, c), v.substr(c + 1));
    };
    if (a == "--server") continue;
    if (a == "--no-seccomp") {
      out->seccomp = false;
    } else if (auto v = val("--fd=")) {
      out->control_fd = std::atoi(v->c_str());
    } else if (auto v = val("--pack=")) {
      out->packs.push_back(pair(*v));
    } else if (auto v = val("--hostdir=")) {
      out->host_dirs.push_back(pair(*v));
    } else if (auto v = val("--writable=")) {
      out->writable_dirs.push_back(*v);
    } else if (auto v = val("--preopen=")) {
      if (!preopens_given) out->preopens.clear();
      preopens_given = true;
      auto [name, path] = pair(*v);
      out->preopens.push_back(Preopen{name, path});
    } else if (auto v = val("--arg=")) {
      if (!args_given) out->args.clear();
      args_given = true;
      out->args.push_back(*v);
    } else if (auto v = val("--env=")) {
      out->env.push_back(*v);
    } else if (a == "--no-warm") {
      out->warm_oneshot = false;
    } else if (a == "--no-prefork") {
      out->spares = 0;
    } else if (auto v = val("--spares=")) {
      out->spares = std::max(0, std::min(16, std::atoi(v->c_str())));
    } else if (auto v = val("--result=")) {
      out->result_path = *v;
    } else {
      return absl::InvalidArgumentError("unknown flag " + a);
    }
  }
  return absl::OkStatus();
}

int RunForkServer(const ServerOptions& options) {
  // esbd may block signals in its threads; the timeout timer needs SIGALRM delivered.
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  static Runtime rt;
  g_rt = &rt;
  for (const auto& [file, mount] : options.packs) {
    std::ifstream in(file, std::ios::binary);
    if (!in) {
      fprintf(stderr, "nano server: cannot open pack %s\n", file.c_str());
      return 2;
    }
    std::stringstream ss;
    ss << in.rdbuf();
    if (absl::Status s = rt.fs.LoadPack(ss.str(), mount); !s.ok()) {
      fprintf(stderr, "nano server: pack %s: %s\n", file.c_str(), s.ToString().c_str());
      return 2;
    }
  }
  for (const auto& [dir, mount] : options.host_dirs) {
    if (absl::Status s = rt.fs.LoadHostDir(dir, mount); !s.ok()) {
      fprintf(stderr, "nano server: %s\n", s.ToString().c_str());
      return 2;
    }
  }
  for (const auto& d : options.writable_dirs) (void)rt.fs.AddDir(d, false);
  if (!options.result_path.empty()) {
    size_t slash = options.result_path.rfind('/');
    if (slash != std::string::npos && slash > 0) {
      (void)rt.fs.AddDir(options.result_path.substr(0, slash), false);
    }
  }
  rt.result_path = options.result_path;
  g_warm_oneshot = options.warm_oneshot;
  rt.host = std::make_unique<WasiHost>(&rt.fs);
  if (absl::Status s = rt.host->Init(options.preopens); !s.ok()) {
    fprintf(stderr, "nano server: %s\n", s.ToString().c_str());
    return 2;
  }
  rt.host->set_args(options.args);
  rt.host->set_env(options.env);
  if (options.seccomp) {
    absl::StatusOr<std::string> a = BuildWorkerSeccompBpf(false), b = BuildWorkerSeccompBpf(true);
    if (!a.ok() || !b.ok()) {
      fprintf(stderr, "nano server: cannot build the seccomp filter\n");
      return 2;
    }
    g_bpf_oneshot = *a;
    g_bpf_session = *b;
  }
  // Transparent huge pages make every worker's first write to a 2 MiB region of the snapshot
  // copy the whole huge page (measured: ~7 ms on the first run of each fork). 4 KiB pages keep
  // copy-on-write proportional to what a run touches. Inherited by every worker.
  prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0);
  wasm_rt_init();
  esb_nano_guest.init_module();
  Instantiate(&rt);
  {
    wasm_rt_memory_t* mem = esb_nano_guest.memory(rt.instance);
    g_base.assign(reinterpret_cast<const char*>(mem->data), uint64_t{mem->pages} * 65536);
  }

  signal(SIGPIPE, SIG_IGN);
  if (geteuid() == 0) {
    // SECURITY: second layer, entered once here (a netns per worker costs milliseconds):
    // the server and every worker get an empty network namespace (no interfaces, not even
    // loopback up) and private IPC/UTS. Failure is not fatal: seccomp already forbids sockets.
    if (unshare(CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS) != 0) {
      fprintf(stderr, "nano server: unshare: %s (continuing)\n", strerror(errno));
    }
  }
  // SECURITY: the server exits when esbd closes (or loses) the control channel, killing its
  // workers; workers also have PDEATHSIG on the server. (No PDEATHSIG on the server itself: it
  // fires when the esbd *thread* that spawned it exits, not when esbd does.)
  int ctl = options.control_fd;
  std::set<pid_t> children;
  std::map<pid_t, int> statuses;  // recently reaped, for "status" queries
  auto reap = [&] {
    int st;
    pid_t p;
    while ((p = waitpid(-1, &st, WNOHANG)) > 0) {
      children.erase(p);
      statuses[p] = st;
      if (statuses.size() > 256) statuses.erase(statuses.begin());
    }
  };
  // Pre-forked one-shot workers wait (confined, reseeded, warmed, blocked on their channel) so
  // that a run does not pay for fork + confinement + warm-up on its critical path.
  struct Spare {
    pid_t pid = -1;
    int driver_fd = -1;
  };
  std::deque<Spare> spares;
  auto make_spare = [&] {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return;
    pid_t pid = fork();
    if (pid == 0) {
      close(ctl);
      close(sv[0]);
      StartWorker(&rt, sv[1], {{"mode", "oneshot"}, {"warm", "1"}}, options.seccomp);
    }
    close(sv[1]);
    if (pid < 0) {
      close(sv[0]);
      return;
    }
    children.insert(pid);
    spares.push_back({pid, sv[0]});
  };
  auto fill_spares = [&] {
    for (auto it = spares.begin(); it != spares.end();) {  // drop dead ones
      if (children.count(it->pid)) {
        ++it;
      } else {
        close(it->driver_fd);
        it = spares.erase(it);
      }
    }
    while (static_cast<int>(spares.size()) < options.spares) {
      size_t before = spares.size();
      make_spare();
      if (spares.size() == before) break;
    }
  };
  fill_spares();
  SendMsg(ctl, proto::FrameType::kResponse, {{"op", "ready"}, {"guest", esb_nano_guest.name}});
  while (true) {
    pollfd p{ctl, POLLIN, 0};
    int r = poll(&p, 1, 200);
    reap();
    if (r < 0 && errno != EINTR) {
      fprintf(stderr, "nano server: poll: %s\n", strerror(errno));
      break;
    }
    if (r <= 0) {
      fill_spares();
      continue;
    }
    Msg req;
    int fd = -1;
    errno = 0;
    if (!RecvMsg(ctl, proto::FrameType::kRequest, &req, &fd)) {
      if (errno != 0) fprintf(stderr, "nano server: control channel: %s\n", strerror(errno));
      break;
    }
    std::string op = GetStr(req, "op");
    Msg rep{{"ok", "1"}};
    if (op == "spawn" && GetStr(req, "mode") != "session") fill_spares();  // drops dead ones
    if (op == "spawn" && GetStr(req, "mode") != "session" && !spares.empty()) {
      // Hand over the oldest pre-forked one-shot worker: its limits arrive with the run
      // request. The fd the driver sent is not needed.
      Spare spare = spares.front();
      spares.pop_front();
      rep["pid"] = std::to_string(spare.pid);
      bool sent = SendMsg(ctl, proto::FrameType::kResponse, rep, spare.driver_fd);
      close(spare.driver_fd);
      if (fd >= 0) close(fd);
      if (!sent) {
        fprintf(stderr, "nano server: reply: %s\n", strerror(errno));
        break;
      }
      fill_spares();
      continue;
    } else if (op == "spawn") {
      if (fd < 0) {
        rep = Error("spawn needs a channel fd");
      } else {
        pid_t pid = fork();
        if (pid == 0) {
          close(ctl);
          StartWorker(&rt, fd, req, options.seccomp);
        }
        close(fd);
        fd = -1;
        if (pid < 0) {
          rep = Error(absl::StrCat("fork: ", strerror(errno)));
        } else {
          children.insert(pid);
          rep["pid"] = std::to_string(pid);
        }
      }
    } else if (op == "adopt") {
      // A session snapshot cloned itself with CLONE_PARENT: it is our child; track it.
      pid_t pid = static_cast<pid_t>(GetInt(req, "pid"));
      siginfo_t si{};
      if (pid > 0 && waitid(P_PID, pid, &si, WEXITED | WNOHANG | WNOWAIT) == 0) {
        children.insert(pid);
      } else {
        rep = Error("not our child");
      }
    } else if (op == "kill") {
      pid_t pid = static_cast<pid_t>(GetInt(req, "pid"));
      // SECURITY: only unreaped children of ours can be signalled, so a pid is never reused.
      if (children.count(pid)) {
        kill(pid, SIGKILL);
        int st = 0;
        waitpid(pid, &st, 0);
        children.erase(pid);
        statuses[pid] = st;
      }
      reap();
      if (statuses.count(pid)) rep["status"] = std::to_string(statuses[pid]);
    } else if (op == "status") {
      pid_t pid = static_cast<pid_t>(GetInt(req, "pid"));
      if (children.count(pid)) {
        rep["running"] = "1";
      } else if (statuses.count(pid)) {
        int st = statuses[pid];
        rep["running"] = "0";
        rep["status"] = std::to_string(st);
        if (WIFSIGNALED(st)) rep["signal"] = std::to_string(WTERMSIG(st));
        if (WIFEXITED(st)) rep["exit"] = std::to_string(WEXITSTATUS(st));
      } else {
        rep = Error("unknown pid");
      }
    } else {
      rep = Error("unknown op " + op);
    }
    if (fd >= 0) close(fd);
    if (!SendMsg(ctl, proto::FrameType::kResponse, rep)) {
      fprintf(stderr, "nano server: reply: %s\n", strerror(errno));
      break;
    }
  }
  for (pid_t c : children) kill(c, SIGKILL);
  while (waitpid(-1, nullptr, 0) > 0) {
  }
  return 0;
}

}  // namespace esb::nano

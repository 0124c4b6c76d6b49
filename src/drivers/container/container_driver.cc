#include "drivers/container/container_driver.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <boost/json.hpp>
#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/host_memory.h"
#include "common/util.h"
#include "drivers/agent_client.h"
#include "drivers/agent_process.h"
#include "drivers/container/cgroups.h"
#include "drivers/container/netns.h"
#include "drivers/container/oci_spec.h"
#include "drivers/container/runtime.h"
#include "drivers/env_limits.h"
#include "drivers/heavy_kernel.h"
#include "drivers/workspace_steps.h"
#include "governance/tls/ca.h"

namespace esb {
namespace container {
namespace {

constexpr uint32_t kSandboxUid = 1000;
constexpr uint32_t kSandboxGid = 1000;
// Size of the tmpfs behind /run/esb (agent socket and the shell's saved state).
constexpr int64_t kRunDirBytes = 16LL << 20;
// Each environment's user namespace owns a range of this many host uids (and gids).
constexpr uint32_t kUsernsRangeSize = 65536;
// Of which sandbox ids 0..65533 are mapped. 65534 ("nobody", the kernel's overflow id) and 65535
// stay unmapped: inside the sandbox the overflow id then only ever names someone from outside
// the namespace (esbd as the agent's peer, root-owned files of the image).
constexpr uint32_t kUsernsMapSize = 65534;

#define ESB_RETURN_IF_ERROR(expr) \
  do {                            \
    absl::Status _st = (expr);    \
    if (!_st.ok()) return _st;    \
  } while (0)

// ---------------------------------------------------------------------------------------
// Small filesystem helpers

bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

absl::Status MakeDir(const std::string& path, mode_t mode) {
  if (::mkdir(path.c_str(), mode) != 0 && errno != EEXIST) return ErrnoStatus("mkdir " + path);
  return absl::OkStatus();
}

absl::Status MakeDirs(const std::string& path, mode_t mode) {
  std::string partial;
  for (absl::string_view part : absl::StrSplit(path, '/', absl::SkipEmpty())) {
    absl::StrAppend(&partial, "/", part);
    ESB_RETURN_IF_ERROR(MakeDir(partial, mode));
  }
  return absl::OkStatus();
}

// Removes a directory tree without following symlinks or crossing into other file systems
// (a leftover mount below it is reported, never descended into).
absl::Status RemoveTree(const std::string& path) {
  if (!Exists(path)) return absl::OkStatus();
  static std::mutex mu;  // nftw's callback has no user pointer
  static std::string* first_error;
  std::lock_guard<std::mutex> lock(mu);
  std::string error;
  first_error = &error;
  auto cb = [](const char* p, const struct stat* sb, int type, struct FTW*) -> int {
    int r = (type == FTW_DP || type == FTW_D) ? ::rmdir(p) : ::unlink(p);
    if (r != 0 && errno != ENOENT && first_error->empty()) {
      *first_error = absl::StrCat(p, ": ", strerror(errno));
    }
    return 0;
  };
  ::nftw(path.c_str(), cb, 16, FTW_DEPTH | FTW_PHYS | FTW_MOUNT);
  first_error = nullptr;
  if (Exists(path)) {
    return absl::InternalError(absl::StrCat("could not remove ", path, ": ", error));
  }
  return absl::OkStatus();
}

// Start time (clock ticks since boot) of a process, 0 if it does not exist or is a zombie.
uint64_t ProcessStartTime(int pid) {
  if (pid <= 0) return 0;
  std::string stat;
  if (!ReadFileToString(absl::StrCat("/proc/", pid, "/stat"), &stat).ok()) return 0;
  size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return 0;
  std::vector<absl::string_view> f = absl::StrSplit(absl::string_view(stat).substr(paren + 2), ' ');
  // f[0] is field 3 (state); starttime is field 22.
  if (f.size() < 20 || f[0] == "Z" || f[0] == "X") return 0;
  uint64_t start = 0;
  return absl::SimpleAtoi(f[19], &start) ? start : 0;
}

uint32_t Fnv1a(absl::string_view s) {
  uint32_t h = 2166136261u;
  for (unsigned char c : s) h = (h ^ c) * 16777619u;
  return h;
}

// Environment ids become path components and runtime container names.
absl::Status ValidateId(const std::string& id) {
  if (id.empty() || id.size() > 64 || id[0] == '.' || id[0] == '-') {
    return absl::InvalidArgumentError("environment id must be 1-64 chars [A-Za-z0-9_.-]");
  }
  for (char c : id) {
    if (!(isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.')) {
      return absl::InvalidArgumentError("environment id must be 1-64 chars [A-Za-z0-9_.-]");
    }
  }
  return absl::OkStatus();
}

// The last `max` bytes of a log, read without loading the whole file (logs are written by
// the sandbox's start-up and must never make esbd allocate their size).
std::string ReadTail(const std::string& path, size_t max = 800) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  struct stat st;
  if (!fd || ::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) return "";
  off_t start = st.st_size > static_cast<off_t>(max) ? st.st_size - static_cast<off_t>(max) : 0;
  std::string text(max, '\0');
  ssize_t n = ::pread(fd.get(), text.data(), max, start);
  text.resize(n > 0 ? static_cast<size_t>(n) : 0);
  return std::string(absl::StripAsciiWhitespace(text));
}

// Binds the agent's listening socket at <run_dir>/agent.sock. run_dir is root-only (0700), so
// only esbd can connect through the path; the agent gets the listening descriptor itself.
absl::StatusOr<UniqueFd> BindAgentSocket(const std::string& run_dir) {
  UniqueFd dir(::open(run_dir.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!dir) return ErrnoStatus("open " + run_dir);
  ::unlinkat(dir.get(), "agent.sock", 0);
  UniqueFd sock(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!sock) return ErrnoStatus("socket");
  struct sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  // Through the directory's descriptor: state paths may exceed sun_path's 108 bytes.
  std::string path = absl::StrCat("/proc/self/fd/", dir.get(), "/agent.sock");
  memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  if (::bind(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoStatus("bind " + run_dir + "/agent.sock");
  }
  if (::fchmodat(dir.get(), "agent.sock", 0600, 0) != 0) return ErrnoStatus("chmod agent.sock");
  if (::listen(sock.get(), 128) != 0) return ErrnoStatus("listen");
  return sock;
}

// ---------------------------------------------------------------------------------------
// User-namespace uid ranges. One host-wide registry directory (every esbd on the host draws
// from it, so two daemons never hand out the same host ids): file <first host id> exists while
// that range is in use and holds its owner, the environment directory. Ranges are aligned to
// 65536, so entries named by their first id cannot overlap, whatever base each daemon has.
// Entries appear atomically (link() of a complete temporary file), so a reader never sees a
// half-written one.

std::string RangePath(const ContainerDriverOptions& o, uint32_t host_id) {
  return absl::StrCat(o.userns_registry, "/", host_id);
}

std::string RangeOwner(const std::string& path) {
  std::string owner;
  if (!ReadFileToString(path, &owner).ok()) return "";
  return owner;
}

bool ValidRangeStart(int64_t host_id) {
  return host_id >= kUsernsRangeSize && host_id + kUsernsRangeSize <= (int64_t{1} << 31) &&
         host_id % kUsernsRangeSize == 0;
}

// Writes `owner` to a fresh temporary file of the registry and returns its path.
absl::StatusOr<std::string> RangeCandidate(const ContainerDriverOptions& o,
                                           const std::string& owner) {
  // The parent (/run/entersandbox) also holds the share, which must stay searchable.
  const std::string parent = o.userns_registry.substr(0, o.userns_registry.rfind('/'));
  if (!parent.empty()) ESB_RETURN_IF_ERROR(MakeDirs(parent, 0755));
  ESB_RETURN_IF_ERROR(MakeDir(o.userns_registry, 0700));
  std::string tmp = absl::StrCat(o.userns_registry, "/.new-", RandomHex(8));
  ESB_RETURN_IF_ERROR(WriteStringToFile(tmp, owner, 0600));
  return tmp;
}

// Takes the first free range of this daemon's (userns_uid_base, userns_slots) for `owner`;
// returns its first host id.
absl::StatusOr<uint32_t> AllocateRange(const ContainerDriverOptions& o, const std::string& owner) {
  absl::StatusOr<std::string> tmp = RangeCandidate(o, owner);
  if (!tmp.ok()) return tmp.status();
  for (uint32_t slot = 0; slot < o.userns_slots; ++slot) {
    const uint32_t host_id = o.userns_uid_base + slot * kUsernsRangeSize;
    if (::link(tmp->c_str(), RangePath(o, host_id).c_str()) == 0) {
      ::unlink(tmp->c_str());
      return host_id;
    }
    if (errno != EEXIST) {
      absl::Status st = ErrnoStatus("link " + RangePath(o, host_id));
      ::unlink(tmp->c_str());
      return st;
    }
  }
  ::unlink(tmp->c_str());
  return absl::ResourceExhaustedError(absl::StrCat("all ", o.userns_slots, " user-namespace uid ",
                                                   "ranges in ", o.userns_registry, " are in use"));
}

// Re-registers a range recorded in an instance's state (re-attach): OK when it is (or now is)
// owned by `owner`, FailedPrecondition when another environment holds it.
absl::Status ClaimRange(const ContainerDriverOptions& o, uint32_t host_id,
                        const std::string& owner) {
  if (RangeOwner(RangePath(o, host_id)) == owner) return absl::OkStatus();
  absl::StatusOr<std::string> tmp = RangeCandidate(o, owner);
  if (!tmp.ok()) return tmp.status();
  const bool linked = ::link(tmp->c_str(), RangePath(o, host_id).c_str()) == 0;
  ::unlink(tmp->c_str());
  if (linked || RangeOwner(RangePath(o, host_id)) == owner) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("user-namespace uid range ", host_id, " of ", owner, " is registered to ",
                   RangeOwner(RangePath(o, host_id)), " in ", o.userns_registry));
}

// Every registry entry: first host id -> owner.
std::map<uint32_t, std::string> ListRanges(const ContainerDriverOptions& o) {
  std::map<uint32_t, std::string> ranges;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(o.userns_registry, ec)) {
    uint32_t host_id = 0;
    if (absl::SimpleAtoi(entry.path().filename().string(), &host_id) && ValidRangeStart(host_id)) {
      ranges[host_id] = RangeOwner(entry.path().string());
    }
  }
  return ranges;
}

// Frees every range owned by `owner` (call only once no process of the owner can be alive).
void ReleaseRanges(const ContainerDriverOptions& o, const std::string& owner) {
  for (const auto& [host_id, range_owner] : ListRanges(o)) {
    if (range_owner == owner) ::unlink(RangePath(o, host_id).c_str());
  }
}

// Frees ranges whose owner directory no longer exists (a daemon or host crash between destroy
// and release), and stale temporary files. Owners create their directory before they allocate
// and remove it only after releasing, so an entry whose owner is gone is free.
void ReclaimRanges(const ContainerDriverOptions& o) {
  int freed = 0;
  for (const auto& [host_id, owner] : ListRanges(o)) {
    if (owner.empty() || owner[0] != '/' || !Exists(owner)) {
      freed += ::unlink(RangePath(o, host_id).c_str()) == 0 ? 1 : 0;
    }
  }
  std::error_code ec;
  const auto stale = std::filesystem::file_time_type::clock::now() - std::chrono::minutes(10);
  for (const auto& entry : std::filesystem::directory_iterator(o.userns_registry, ec)) {
    if (absl::StartsWith(entry.path().filename().string(), ".new-") &&
        entry.last_write_time(ec) < stale) {
      std::filesystem::remove(entry.path(), ec);
    }
  }
  if (freed > 0) {
    LogInfo(absl::StrCat("container driver: freed ", freed,
                         " user-namespace uid ranges of "
                         "environments that no longer exist (",
                         o.userns_registry, ")"));
  }
}

// ---------------------------------------------------------------------------------------
// Agent connection: under gVisor the run/ directory is writable by the sandbox user (crun/runc:
// root-only), so the socket is opened without following symlinks and checked to be a socket
// before esbd connects.

AgentClient::Connector SafeAgentConnector(std::string run_dir, int timeout_ms) {
  return [run_dir = std::move(run_dir), timeout_ms]() -> absl::StatusOr<int> {
    UniqueFd dir(::open(run_dir.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!dir) return ErrnoStatus("open " + run_dir);
    // SECURITY: O_NOFOLLOW + S_ISSOCK: a sandbox-planted symlink cannot redirect esbd (root)
    // to a host socket.
    UniqueFd node(::openat(dir.get(), "agent.sock", O_PATH | O_NOFOLLOW | O_CLOEXEC));
    if (!node) {
      return absl::UnavailableError(absl::StrCat("agent socket not present in ", run_dir));
    }
    struct stat st;
    if (::fstat(node.get(), &st) != 0 || !S_ISSOCK(st.st_mode)) {
      return absl::UnavailableError("agent.sock is not a socket");
    }
    UniqueFd sock(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!sock) return ErrnoStatus("socket");
    struct timeval tv = {timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    ::setsockopt(sock.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    struct sockaddr_un addr = {};
    addr.sun_family = AF_UNIX;
    std::string proc_path = absl::StrCat("/proc/self/fd/", node.get());
    memcpy(addr.sun_path, proc_path.c_str(), proc_path.size() + 1);
    while (::connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EINPROGRESS) {
        return absl::DeadlineExceededError("connect to agent timed out");
      }
      return absl::UnavailableError(absl::StrCat("connect to agent: ", strerror(errno)));
    }
    struct timeval zero = {0, 0};
    ::setsockopt(sock.get(), SOL_SOCKET, SO_SNDTIMEO, &zero, sizeof(zero));
    return sock.release();
  };
}

// ---------------------------------------------------------------------------------------
// Where everything of one environment lives.

struct EnvPaths {
  std::string env_dir, bundle_config, run_dir, agent_log, runtime_log, images, current;
  std::string socket, container_id, cgroup_path;
  std::string netns;   // governed environments: the bind-mounted network namespace
  std::string userns;  // ... and its user namespace, bound only until the container runs
};

EnvPaths PathsFor(const ContainerDriverOptions& o, const std::string& id) {
  EnvPaths p;
  p.env_dir = absl::StrCat(o.state_dir, "/envs/", id);
  p.bundle_config = p.env_dir + "/config.json";
  p.run_dir = p.env_dir + "/run";
  p.agent_log = p.env_dir + "/agent.log";
  p.runtime_log = p.env_dir + "/runtime.log";
  p.images = p.env_dir + "/images";
  p.current = p.env_dir + "/current.json";
  p.socket = p.run_dir + "/agent.sock";
  p.container_id = "esb-" + id;
  // The state_dir hash keeps two daemons (or test runs) with equal ids apart.
  char hash[9];
  snprintf(hash, sizeof(hash), "%08x", Fnv1a(o.state_dir));
  p.cgroup_path = absl::StrCat(o.cgroup_parent, "/", hash, "-", id);
  p.netns = absl::StrCat(kNetnsDir, "/", hash, "-", id);
  p.userns = p.netns + "@user";
  return p;
}

// Persistent volumes: the image of volume `key` ("<16 hex>/<name>") is
// <state_dir>/volumes/<key>.img (the state directory is root-only 0700); while an environment
// uses it, it is loop-mounted at <env_dir>/vol/<i> (also below the 0700 state directory:
// crun opens an idmapped bind's source as host root, so no host user can reach the files).
absl::Status ValidateVolumeKey(const std::string& key) {
  bool ok = key.size() > 17 && key.size() <= 16 + 1 + 63 && key[16] == '/' && key[17] != '-';
  for (size_t i = 0; ok && i < key.size(); ++i) {
    char c = key[i];
    if (i < 16) {
      ok = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
    } else if (i > 16) {
      ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-';
    }
  }
  if (!ok) return absl::InvalidArgumentError("invalid volume key");
  return absl::OkStatus();
}

std::string VolumeImage(const ContainerDriverOptions& o, const std::string& key) {
  return absl::StrCat(o.state_dir, "/volumes/", key, ".img");
}

// Whether a loop device is backed by `image` (then its file system is mounted somewhere, or
// still held by a dying sandbox): a second mount through another loop device would corrupt it.
bool ImageInUse(const std::string& image) {
  char real[PATH_MAX];
  if (::realpath(image.c_str(), real) == nullptr) return false;
  DIR* dir = ::opendir("/sys/block");
  if (dir == nullptr) return true;  // cannot tell: assume in use
  bool used = false;
  while (struct dirent* e = ::readdir(dir)) {
    if (std::string_view(e->d_name).substr(0, 4) != "loop") continue;
    std::string backing;
    if (!ReadFileToString(absl::StrCat("/sys/block/", e->d_name, "/loop/backing_file"), &backing)
             .ok()) {
      continue;
    }
    while (!backing.empty() && backing.back() == '\n') backing.pop_back();
    if (backing == real) used = true;
  }
  ::closedir(dir);
  return used;
}

// Files shared by every sandbox of this driver (agent binary, hostname), on a tmpfs of its own
// below /run, not below the state directory: the runtime resolves bind sources from inside a
// sandbox's user namespace, as an "other" user, and esbd's state directory is 0700.
constexpr char kShareParent[] = "/run/entersandbox";
std::string ShareDir(const std::string& state_dir) {
  char hash[9];
  snprintf(hash, sizeof(hash), "%08x", Fnv1a(state_dir));
  return absl::StrCat(kShareParent, "/share-", hash);
}

// Removes the network namespaces of this state directory whose environment directory is gone
// (a daemon or host crash between an environment's destroy and its netns removal).
void ReclaimNetns(const ContainerDriverOptions& o) {
  const std::string dir_prefix = std::string(kNetnsDir) + "/";
  const std::string hash = PathsFor(o, "x").netns.substr(dir_prefix.size());  // "<hash>-x"
  const std::string prefix = hash.substr(0, hash.size() - 1);                 // "<hash>-"
  int freed = 0;
  for (const std::string& name : ListNetns(prefix)) {
    std::string id = name.substr(prefix.size());
    if (absl::EndsWith(id, "@user")) id.resize(id.size() - 5);
    if (!ValidateId(id).ok() || Exists(PathsFor(o, id).env_dir)) continue;
    if (RemoveNetns(dir_prefix + name).ok()) ++freed;
  }
  if (freed > 0) {
    LogInfo(absl::StrCat("container driver: removed ", freed,
                         " network namespaces of "
                         "environments that no longer exist (",
                         kNetnsDir, ")"));
  }
}

// A governed sandbox's trust bundle (system roots + its CA), bound read-only at
// kCaBundleMountpoint: in the share, which the runtime can reach from inside a user namespace.
std::string CaBundleFile(const std::string& state_dir, const std::string& id) {
  return absl::StrCat(ShareDir(state_dir), "/ca-", id, ".pem");
}

// The variables of a governed sandbox: every client that honours the proxy variables goes
// through the egress proxy's listener (nothing else is reachable), and TLS clients trust the
// environment's CA through the bundle at kCaBundleMountpoint (governance/tls/ca.h).
std::map<std::string, std::string> EgressEnv() {
  const std::string proxy = absl::StrCat("http://", kEgressListenAddress, ":", kEgressListenPort);
  const std::string local = absl::StrCat("localhost,", kEgressListenAddress);
  std::map<std::string, std::string> env = {
      {"HTTP_PROXY", proxy}, {"HTTPS_PROXY", proxy}, {"http_proxy", proxy}, {"https_proxy", proxy},
      {"ALL_PROXY", proxy},  {"all_proxy", proxy},   {"NO_PROXY", local},   {"no_proxy", local}};
  for (const auto& [name, value] : governance::tls::TrustEnvironment(kCaBundleMountpoint)) {
    env[name] = value;
  }
  return env;
}

// A caller's base environment with the egress variables on top (a caller cannot point the
// sandbox's clients elsewhere; there is nowhere else to go anyway).
std::map<std::string, std::string> WithEgressEnv(std::map<std::string, std::string> env) {
  for (auto& [name, value] : EgressEnv()) env[name] = value;
  return env;
}

// The sandbox layout this driver creates, recorded in each instance's state. Layout 2 (issue
// 9): the agent's socket is handed over as fd 3 (no writable /run/esb bind), its stdio is not
// the host log, it checks SO_PEERCRED, and it runs from the share tmpfs. Instances of an older
// layout (no "layout" field) are refused on re-attach (SandboxOutdatedError). Layout 3 (issue
// 11): the heavy tier's Python kernel is bound read-only from the share tmpfs at
// /usr/lib/esb/kernel.py (older instances have no kernel there: RunCode could not work).
constexpr int kSandboxLayout = 3;

// What InstanceRef.state holds.
struct InstanceState {
  int layout = 1;       // absent in states written before layouts were recorded
  std::string runtime;  // crun | runc | runsc
  int pid = 0;
  uint64_t pid_start = 0;
  std::string cgroup_path;
  uint32_t userns_host_id = 0;  // first host id of its range; 0: no user namespace (host uids)
  bool egress = false;          // governed network: its own netns (EnvPaths::netns) + proxy
};

std::string SerializeState(const InstanceState& s, const EnvPaths& p, const CgroupLayout& layout) {
  boost::json::array dirs;
  for (const std::string& d : CgroupDirs(layout, s.cgroup_path)) dirs.emplace_back(d);
  boost::json::object o = {
      {"layout", s.layout},
      {"runtime", s.runtime},
      {"container_id", p.container_id},
      {"bundle", p.env_dir},
      {"socket", p.socket},
      {"pid", s.pid},
      {"pid_start", s.pid_start},
      {"cgroup_path", s.cgroup_path},
      {"cgroup_dirs", dirs},
  };
  if (s.userns_host_id != 0) o["userns_host_id"] = s.userns_host_id;
  if (s.egress) o["egress"] = true;
  return boost::json::serialize(o);
}

// Lenient: a missing or damaged state still lets Destroy clean up by id.
InstanceState ParseState(const std::string& json, const std::string& default_runtime,
                         const EnvPaths& paths) {
  InstanceState s;
  s.runtime = default_runtime;
  s.cgroup_path = paths.cgroup_path;
  boost::system::error_code ec;
  boost::json::value v = boost::json::parse(json, ec);
  if (ec || !v.is_object()) return s;
  const boost::json::object& o = v.as_object();
  if (auto* r = o.if_contains("runtime"); r && r->is_string()) {
    RuntimeKind k;
    if (ParseRuntimeKind(std::string(r->as_string()), &k)) s.runtime = RuntimeName(k);
  }
  if (auto* l = o.if_contains("layout"); l && l->is_int64() && l->as_int64() > 0 &&
                                          l->as_int64() < 1000) {
    s.layout = static_cast<int>(l->as_int64());
  }
  if (auto* p = o.if_contains("pid"); p && p->is_int64()) s.pid = static_cast<int>(p->as_int64());
  if (auto* p = o.if_contains("pid_start")) {
    if (p->is_uint64()) s.pid_start = p->as_uint64();
    if (p->is_int64()) s.pid_start = static_cast<uint64_t>(p->as_int64());
  }
  if (auto* u = o.if_contains("userns_host_id");
      u && u->is_int64() && u->as_int64() > 0 && ValidRangeStart(u->as_int64())) {
    s.userns_host_id = static_cast<uint32_t>(u->as_int64());
  }
  if (auto* e = o.if_contains("egress"); e && e->is_bool()) s.egress = e->as_bool();
  // The cgroup path is recomputed, not trusted from storage, unless it is under our parent.
  if (auto* c = o.if_contains("cgroup_path"); c && c->is_string()) {
    std::string path(c->as_string());
    if (absl::StartsWith(path, paths.cgroup_path.substr(0, paths.cgroup_path.rfind('/') + 1)) &&
        path.find("..") == std::string::npos) {
      s.cgroup_path = path;
    }
  }
  return s;
}

bool ProcessAlive(const InstanceState& s) {
  return s.pid > 0 && s.pid_start != 0 && ProcessStartTime(s.pid) == s.pid_start;
}

// The instance as it runs now: gVisor's restore of a step (rewind, or the restore right after
// a step's checkpoint) replaces the container under the same id, so its pid changes while the
// core's InstanceRef stays as it was; the driver records the current pid in current.json (in
// the root-only environment directory), which wins over the ref's.
InstanceState ParseCurrentState(const std::string& json, const std::string& default_runtime,
                                const EnvPaths& paths) {
  InstanceState s = ParseState(json, default_runtime, paths);
  std::string text;
  if (!ReadFileToString(paths.current, &text).ok()) return s;
  boost::system::error_code ec;
  boost::json::value v = boost::json::parse(text, ec);
  if (ec || !v.is_object()) return s;
  const boost::json::object& o = v.as_object();
  const boost::json::value* pid = o.if_contains("pid");
  const boost::json::value* start = o.if_contains("pid_start");
  if (pid && pid->is_int64() && pid->as_int64() > 0 && pid->as_int64() < INT_MAX && start &&
      (start->is_int64() || start->is_uint64())) {
    s.pid = static_cast<int>(pid->as_int64());
    s.pid_start =
        start->is_uint64() ? start->as_uint64() : static_cast<uint64_t>(start->as_int64());
  }
  return s;
}

absl::Status WriteCurrentState(const EnvPaths& paths, const InstanceState& s) {
  const std::string tmp = paths.current + ".tmp";
  ESB_RETURN_IF_ERROR(WriteStringToFile(
      tmp, boost::json::serialize(boost::json::object{{"pid", s.pid}, {"pid_start", s.pid_start}}),
      0600));
  if (::rename(tmp.c_str(), paths.current.c_str()) != 0) return ErrnoStatus("rename " + tmp);
  return absl::OkStatus();
}

// Bytes of the regular files directly in `dir` (a checkpoint image).
int64_t DirBytes(const std::string& dir) {
  int64_t total = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    struct stat st;
    if (::lstat(entry.path().c_str(), &st) == 0 && S_ISREG(st.st_mode)) total += st.st_size;
  }
  return total;
}

// Removes `name` from the run directory on the host side (never following a link: the sandbox
// user can write there).
void UnlinkInRunDir(const EnvPaths& paths, const char* name) {
  UniqueFd dir(::open(paths.run_dir.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  // SECURITY: unlinkat on the directory's descriptor removes the entry itself, whatever it is.
  if (dir) ::unlinkat(dir.get(), name, 0);
}

bool ExistsInRunDir(const EnvPaths& paths, const char* name) {
  UniqueFd dir(::open(paths.run_dir.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  struct stat st;
  return dir && ::fstatat(dir.get(), name, &st, AT_SYMLINK_NOFOLLOW) == 0;
}

// The agent's state directory (run/state: its log, the shell's saved state, a FIFO) lives on
// the host, outside the checkpoint image, yet the restored sandbox reopens the files it had
// open there: a fork's fresh run/ must have them. Copied into the image directory after the
// checkpoint (run-state/: regular files, run-state-fifo/: the FIFOs' names), at most 16 MiB
// (the run tmpfs's size). The directory is the sandbox user's: nothing is followed, only
// regular files and FIFOs are taken.
absl::Status SaveRunState(const EnvPaths& paths, const std::string& image_dir) {
  UniqueFd dir(
      ::open((paths.run_dir + "/state").c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!dir) return ErrnoStatus("open " + paths.run_dir + "/state");
  ESB_RETURN_IF_ERROR(container::MakeDir(image_dir + "/run-state", 0700));
  ESB_RETURN_IF_ERROR(container::MakeDir(image_dir + "/run-state-fifo", 0700));
  DIR* d = ::fdopendir(::dup(dir.get()));
  if (d == nullptr) return ErrnoStatus("fdopendir");
  std::vector<std::string> names;
  while (struct dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != ".." && names.size() < 64) names.push_back(n);
  }
  ::closedir(d);
  int64_t total = 0;
  for (const std::string& n : names) {
    struct stat st;
    if (::fstatat(dir.get(), n.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (S_ISFIFO(st.st_mode)) {
      ESB_RETURN_IF_ERROR(WriteStringToFile(image_dir + "/run-state-fifo/" + n, "", 0600));
      continue;
    }
    if (!S_ISREG(st.st_mode) || st.st_size > kRunDirBytes - total) continue;
    // SECURITY: O_NOFOLLOW | O_NONBLOCK and a size check on the opened file: a planted link or
    // FIFO swapped in cannot make esbd read elsewhere or block.
    UniqueFd f(::openat(dir.get(), n.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
    if (!f || ::fstat(f.get(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    std::string data(static_cast<size_t>(std::min<int64_t>(st.st_size, kRunDirBytes - total)),
                     '\0');
    ssize_t got = ::pread(f.get(), data.data(), data.size(), 0);
    data.resize(got > 0 ? static_cast<size_t>(got) : 0);
    total += static_cast<int64_t>(data.size());
    ESB_RETURN_IF_ERROR(WriteStringToFile(image_dir + "/run-state/" + n, data, 0600));
  }
  return absl::OkStatus();
}

// Lays the saved files of SaveRunState into `paths`' run/state where they are missing (a
// fork's fresh run/; a rewind's run/ keeps what it has), owned by the sandbox user.
absl::Status SeedRunState(const EnvPaths& paths, const std::string& image_dir) {
  const std::string state = paths.run_dir + "/state";
  if (::mkdir(state.c_str(), 0700) == 0) {
    // SECURITY: a directory esbd just created in the environment's own run/ tmpfs.
    if (::chown(state.c_str(), kSandboxUid, kSandboxGid) != 0) return ErrnoStatus("chown");
  }
  UniqueFd dir(::open(state.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!dir) return ErrnoStatus("open " + state);
  std::error_code ec;
  for (const char* sub : {"run-state", "run-state-fifo"}) {
    const bool fifo = std::string_view(sub) == "run-state-fifo";
    for (const auto& e : std::filesystem::directory_iterator(image_dir + "/" + sub, ec)) {
      const std::string n = e.path().filename().string();
      UniqueFd made;
      if (fifo) {
        if (::mkfifoat(dir.get(), n.c_str(), 0600) != 0) continue;  // exists: kept
        made.reset(::openat(dir.get(), n.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC));
      } else {
        std::string data;
        ESB_RETURN_IF_ERROR(ReadFileToString(e.path().string(), &data));
        made.reset(::openat(dir.get(), n.c_str(),
                            O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
        if (!made) continue;  // exists: kept
        if (::write(made.get(), data.data(), data.size()) != static_cast<ssize_t>(data.size())) {
          return ErrnoStatus("write run state " + n);
        }
      }
      // SECURITY: the file esbd just created (O_EXCL / mkfifo) goes to the sandbox user.
      if (!made || ::fchownat(made.get(), "", kSandboxUid, kSandboxGid, AT_EMPTY_PATH) != 0) {
        return ErrnoStatus("chown run state " + n);
      }
    }
  }
  return absl::OkStatus();
}

// A step's checkpoint image as SnapshotRef::state names it: {"env": id, "image": 16 hex,
// "walk_base": the agent's walk token at the step}. The path is derived, never stored.
struct StepImage {
  std::string env_id, image, walk_base;
};

absl::StatusOr<StepImage> ParseStepImage(const std::string& json) {
  boost::system::error_code ec;
  boost::json::value v = boost::json::parse(json, ec);
  if (ec || !v.is_object()) return absl::InvalidArgumentError("bad gVisor snapshot state");
  const boost::json::object& o = v.as_object();
  StepImage img;
  if (auto* e = o.if_contains("env"); e && e->is_string()) img.env_id = e->as_string();
  if (auto* i = o.if_contains("image"); i && i->is_string()) img.image = i->as_string();
  if (auto* w = o.if_contains("walk_base"); w && w->is_string()) img.walk_base = w->as_string();
  ESB_RETURN_IF_ERROR(ValidateId(img.env_id));
  bool hex = img.image.size() == 16;
  for (char c : img.image) hex = hex && ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'));
  if (!hex) return absl::InvalidArgumentError("bad gVisor snapshot image name");
  return img;
}

// ---------------------------------------------------------------------------------------

absl::StatusOr<std::string> InstallAgent(const std::string& source, const std::string& state_dir,
                                         RuntimeKind kind);
std::string PythonKernelFile(const std::string& state_dir);
bool ShareMounted(const std::string& state_dir);
void UnmountShare(const std::string& state_dir);

class ContainerDriver : public Driver {
 public:
  // `options.agent_binary` is the installed copy; `agent_source` the binary it came from.
  ContainerDriver(ContainerDriverOptions options, CgroupLayout layout, RuntimeKind kind,
                  std::string describe, std::string agent_source, UsernsStatus userns)
      : options_(std::move(options)),
        layout_(std::move(layout)),
        kind_(kind),
        describe_(std::move(describe)),
        agent_source_(std::move(agent_source)),
        userns_(std::move(userns)) {}
  // Running containers keep their binds of the share tmpfs; only the host's mount goes, so a
  // stopped daemon leaves no mount behind (the next one mounts a fresh share).
  ~ContainerDriver() override { UnmountShare(options_.state_dir); }

  std::string name() const override {
    return kind_ == RuntimeKind::kRunsc ? "gvisor" : "container";
  }
  // Shell, files, processes and terminals (agent_process.h), and a persistent Python kernel per
  // environment (heavy_kernel.h). One-shot Python needs an environment (the core makes a throw-away
  // one). Steps (time travel) keep files, the shell state and a variables summary; under gVisor
  // also the memory (a runsc checkpoint per step); elsewhere StepMemory says why not.
  CapabilitySet Capabilities() const override {
    CapabilitySet caps{Capability::kExec, Capability::kFiles, Capability::kPythonSession,
                       Capability::kSteps, Capability::kProcesses};
    // Terminals need a working PTY in the sandbox: under gVisor (this runsc, ptrace platform)
    // the agent's pty is unusable (bash reads EOF at once; /dev/pts answers EINVAL), so
    // gvisor refuses terminals rather than hand out a shell that exits at once.
    if (kind_ != RuntimeKind::kRunsc) caps.Add(Capability::kTerminal);
    if (VolumesSupported()) caps.Add(Capability::kVolumes);
    if (EgressSupported()) caps.Add(Capability::kEgress);
    return caps;
  }
  absl::Status CreateVolume(const std::string& key, int64_t size_mb) override;
  absl::Status DeleteVolume(const std::string& key) override;
  absl::StatusOr<RunResult> RunCode(const InstanceRef* ref, const RunRequest& request,
                                    const OutputSink& sink) override {
    if (ref == nullptr) return Driver::RunCode(ref, request, sink);
    ESB_RETURN_IF_ERROR(ValidateId(ref->id));
    std::string variables;
    absl::StatusOr<RunResult> result = RunHeavyKernel(*this, *ref, request, sink, &variables);
    // The summary waits for the step's CaptureStep (time travel); a cell without one (the
    // kernel died) clears the previous cell's, which no longer describes the session.
    if (result.ok() && !request.once) {
      std::lock_guard<std::mutex> lock(steps_mu_);
      pending_variables_[ref->id] = std::move(variables);
    }
    return result;
  }
  // Time travel (step_state.h; docs/agent-protocol.md "Workspace steps").
  absl::StatusOr<StepState> CaptureStep(const InstanceRef& ref, const CaptureOptions& options,
                                        BlobStore& blobs) override;
  absl::StatusOr<InstanceRef> RestoreStep(const InstanceRef& ref, const StepState& state,
                                          BlobStore& blobs) override;
  absl::StatusOr<InstanceRef> ForkStep(const StepState& state, const EnvSpec& spec,
                                       const std::string& new_id, BlobStore& blobs) override;
  absl::Status DeleteSnapshot(const SnapshotRef& snapshot) override;
  StepMemorySupport StepMemory() const override;
  std::string Describe() const override { return describe_; }
  const UsernsStatus& userns() const { return userns_; }
  // Volumes need mkfs.ext4 and mount, and binds that reach a root-only host directory and keep
  // on-disk ids: crun's idmapped binds in a user namespace, or any runc/crun without one.
  // gVisor (its gofer) and runc with a user namespace (no idmapped binds in 1.1) do not.
  bool VolumesSupported() const {
    if (kind_ == RuntimeKind::kRunsc || FindExecutable("mkfs.ext4").empty() ||
        FindExecutable("mount").empty()) {
      return false;
    }
    return !userns_.enabled || kind_ == RuntimeKind::kCrun;
  }

  // Governed networks: the listener esbd opens in the sandbox's netns is a host kernel socket,
  // which gVisor's own network stack never reaches.
  bool EgressSupported() const { return kind_ != RuntimeKind::kRunsc; }
  absl::StatusOr<UniqueFd> OpenEgressListener(const InstanceRef& ref) override;
  absl::StatusOr<UniqueFd> ConnectEgressProxy(const InstanceRef& ref,
                                              std::chrono::milliseconds timeout,
                                              const std::vector<uid_t>& owners) override;

  absl::StatusOr<InstanceRef> Create(const std::string& id, const EnvSpec& spec) override;
  absl::Status Destroy(const InstanceRef& ref) override;
  absl::Status Attach(const InstanceRef& ref) override;
  absl::StatusOr<ExecResult> Exec(const InstanceRef& ref, const ExecRequest& request,
                                  const OutputSink& sink) override {
    ESB_RETURN_IF_ERROR(ValidateId(ref.id));
    return AgentPtr(ref.id)->Exec(request, sink);
  }
  absl::Status WriteFile(const InstanceRef& ref, const std::string& path, std::string_view data,
                         int64_t offset, bool truncate) override {
    ESB_RETURN_IF_ERROR(ValidateId(ref.id));
    return AgentPtr(ref.id)->Write(path, data, offset, truncate);
  }
  absl::StatusOr<FileChunk> ReadFile(const InstanceRef& ref, const std::string& path,
                                     int64_t offset, int64_t length) override {
    ESB_RETURN_IF_ERROR(ValidateId(ref.id));
    return AgentPtr(ref.id)->Read(path, offset, length);
  }
  absl::StatusOr<DirListing> ListDir(const InstanceRef& ref, const std::string& path) override {
    ESB_RETURN_IF_ERROR(ValidateId(ref.id));
    return AgentPtr(ref.id)->List(path);
  }
  absl::StatusOr<FileEntry> Stat(const InstanceRef& ref, const std::string& path) override {
    ESB_RETURN_IF_ERROR(ValidateId(ref.id));
    return AgentPtr(ref.id)->Stat(path);
  }
  absl::StatusOr<bool> MakeDir(const InstanceRef& ref, const std::string& path) override {
    ESB_RETURN_IF_ERROR(ValidateId(ref.id));
    return AgentPtr(ref.id)->MakeDir(path);
  }
  absl::Status Remove(const InstanceRef& ref, const std::string& path, bool recursive) override {
    ESB_RETURN_IF_ERROR(ValidateId(ref.id));
    return AgentPtr(ref.id)->Remove(path, recursive);
  }
  absl::Status Rename(const InstanceRef& ref, const std::string& source,
                      const std::string& destination, bool overwrite) override {
    ESB_RETURN_IF_ERROR(ValidateId(ref.id));
    return AgentPtr(ref.id)->Rename(source, destination, overwrite);
  }
  absl::StatusOr<Usage> Stats(const InstanceRef& ref) override;
  absl::Status Configure(const InstanceRef& ref,
                         const std::map<std::string, std::string>& env) override {
    ESB_RETURN_IF_ERROR(ValidateId(ref.id));
    if (ParseState(ref.state, RuntimeName(kind_), PathsFor(options_, ref.id)).egress) {
      return AgentPtr(ref.id)->Configure(WithEgressEnv(env));
    }
    return AgentPtr(ref.id)->Configure(env);
  }
  absl::StatusOr<std::unique_ptr<ProcessSession>> SpawnProcess(
      const InstanceRef& ref, const ProcessRequest& request) override {
    ESB_RETURN_IF_ERROR(ValidateId(ref.id));
    if (request.pty && !Capabilities().Has(Capability::kTerminal))
      return MissingCapabilityError(name(), Capability::kTerminal);
    return SpawnAgentProcess(AgentPtr(ref.id), request);
  }

 private:
  // The environment's one multiplexed agent connection (made on first use, remade when the
  // agent restarted), shared by every call.
  std::shared_ptr<AgentClient> AgentPtr(const std::string& id) {
    std::lock_guard<std::mutex> lock(agents_mu_);
    if (suspended_.count(id)) {
      // gVisor: between a checkpoint and the restore nothing may connect (a host connection
      // cannot be saved, and the sandbox is being replaced).
      return std::make_shared<AgentClient>([]() -> absl::StatusOr<int> {
        return absl::UnavailableError("the environment is being checkpointed or restored");
      });
    }
    std::shared_ptr<AgentClient>& client = agents_[id];
    if (!client) {
      client =
          std::make_shared<AgentClient>(SafeAgentConnector(PathsFor(options_, id).run_dir, 2000));
      client->SetLabel("agent of " + id);
    }
    return client;
  }
  void DropAgent(const std::string& id) {
    {
      std::lock_guard<std::mutex> lock(steps_mu_);
      step_bases_.erase(id);
      restored_.erase(id);
      pending_variables_.erase(id);
    }
    std::shared_ptr<AgentClient> client;
    std::lock_guard<std::mutex> lock(agents_mu_);
    auto it = agents_.find(id);
    if (it == agents_.end()) return;
    client = std::move(it->second);
    agents_.erase(it);
  }
  // gVisor step memory (docs/design.md "Time travel": gVisor).
  void Suspend(const std::string& id, bool on) {
    std::lock_guard<std::mutex> lock(agents_mu_);
    if (on) {
      suspended_.insert(id);
      agents_.erase(id);  // its connection closes once no call holds it
    } else {
      suspended_.erase(id);
    }
  }
  // Checkpoints the sandbox after a step into a new image and restores it so it runs on; the
  // image, or nullopt with `*reason`. The environment is left running in every case (after a
  // failure it is restarted from `capture`'s files, which the reason says).
  std::optional<SnapshotRef> CheckpointStep(const InstanceRef& ref, const StepState& capture,
                                            BlobStore& blobs, const std::string& walk_base,
                                            std::string* reason);
  // Replaces whatever runs under the environment's container id by a restore of `image_dir`
  // and waits for its agent (which listens again on SIGUSR1).
  absl::Status RestoreImage(const EnvPaths& paths, InstanceState* state,
                            const std::string& image_dir);
  // Starts the environment's bundle afresh (its /workspace and /tmp empty) and puts back the
  // files and shell state of `target`: the recovery when a checkpoint or restore failed.
  absl::Status ColdRestart(const EnvPaths& paths, InstanceState* state, const StepState& target,
                           BlobStore& blobs);
  absl::StatusOr<InstanceRef> CreateInstance(const std::string& id, const EnvSpec& spec,
                                             const std::string* image_dir);
  const OciRuntime& Runtime(const std::string& name);
  absl::Status PrepareImage(const std::string& rootfs, const BundleParams& params);
  absl::Status WriteBundle(const std::string& id, const EnvSpec& spec, const EnvPaths& paths,
                           const std::string& rootfs, uint32_t userns_host_id, bool egress);
  // Until the agent answers (bounded by agent_timeout_ms). `wake`: after a restore, also
  // SIGUSR1 to the agent (it listens again) until it answers.
  absl::Status WaitForAgent(const EnvPaths& paths, const InstanceState& state, bool wake = false);
  absl::Status DestroyById(const std::string& id, const InstanceState& state);
  // Loop-mounts spec.volumes below the environment directory and adds their binds to `p`.
  absl::Status MountVolumes(const EnvSpec& spec, const EnvPaths& paths, const std::string& rootfs,
                            BundleParams* p);
  void UnmountVolumes(const EnvPaths& paths, std::vector<std::string>* problems);

  // Serialises Create/Destroy of the same id.
  bool Claim(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    return busy_.insert(id).second;
  }
  void Release(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    busy_.erase(id);
  }
  // Releases a successful Claim at the end of a scope; `resume` also ends a Suspend.
  struct ClaimRelease {
    ContainerDriver* d;
    std::string id;
    bool resume = false;
    ~ClaimRelease() {
      if (resume) d->Suspend(id, false);
      d->Release(id);
    }
  };

  const ContainerDriverOptions options_;
  const CgroupLayout layout_;
  const RuntimeKind kind_;
  const std::string describe_;
  const std::string agent_source_;
  const UsernsStatus userns_;
  std::mutex volume_mu_;  // a volume's in-use check and its mount or delete, one at a time

  std::mutex mu_;
  std::set<std::string> busy_;
  std::mutex agents_mu_;
  std::map<std::string, std::shared_ptr<AgentClient>> agents_;  // by environment id
  std::set<std::string> suspended_;  // gVisor: being checkpointed or restored
  // Time travel, by environment id: the agent's last walk (the next capture's base) and the
  // variables summary of the last Python cell not yet captured.
  std::mutex steps_mu_;
  std::map<std::string, std::string> step_bases_;
  std::map<std::string, std::string> pending_variables_;
  // What the last RestoreStep wrote, bound to the step's blobs (until the next capture).
  std::map<std::string, WorkspaceManifest> restored_;
  std::set<std::string> prepared_images_;
  std::map<std::string, std::unique_ptr<OciRuntime>> runtimes_;
};

// The runtime an instance was created with (it may differ from this driver's after a
// restart in which the probe chose another one).
const OciRuntime& ContainerDriver::Runtime(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = runtimes_.find(name);
  if (it != runtimes_.end()) return *it->second;
  RuntimeKind kind = kind_;
  ParseRuntimeKind(name, &kind);
  std::string binary = FindExecutable(RuntimeName(kind));
  if (binary.empty()) binary = absl::StrCat("/usr/bin/", RuntimeName(kind));
  // crun refuses hybrid hosts: hide the cgroup2 mount from it (v1 controllers remain).
  std::string hide =
      (kind == RuntimeKind::kCrun && layout_.mode == CgroupMode::kHybrid) ? layout_.v2_mount : "";
  auto rt = std::make_unique<OciRuntime>(
      kind, binary, absl::StrCat(options_.state_dir, "/runtime/", RuntimeName(kind)), hide);
  const OciRuntime& ref = *rt;
  runtimes_.emplace(name, std::move(rt));
  return ref;
}

BundleParams BaseParams(const std::string& rootfs, const CgroupLayout& layout, RuntimeKind kind) {
  BundleParams p;
  p.rootfs = rootfs;
  p.uid = kSandboxUid;
  p.gid = kSandboxGid;
  p.limit_swap = layout.swap_accounting;
  // gVisor implements neither mqueue mounts nor cgroup namespaces the way runc does.
  p.mqueue = kind != RuntimeKind::kRunsc;
  p.cgroup_namespace = kind != RuntimeKind::kRunsc;
  p.seccomp_clone3_enosys = kind != RuntimeKind::kRunsc;
  return p;
}

// The rootfs is read-only inside the container, and the runtime would otherwise create
// missing mount points by writing into the (shared) image directory while setting up.
absl::Status ContainerDriver::PrepareImage(const std::string& rootfs, const BundleParams& params) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (prepared_images_.count(rootfs)) return absl::OkStatus();
  }
  struct stat st;
  if (::stat(rootfs.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("image directory ", rootfs, " does not exist"));
  }
  std::vector<std::string> created;
  for (const std::string& mp : RequiredMountpoints(params)) {
    bool dir = mp.back() == '/';
    std::string path = rootfs + "/" + (dir ? mp.substr(0, mp.size() - 1) : mp);
    if (Exists(path)) continue;
    if (dir) {
      ESB_RETURN_IF_ERROR(MakeDirs(path, 0755));
      if (mp == "tmp/") ::chmod(path.c_str(), 01777);
    } else {
      ESB_RETURN_IF_ERROR(MakeDirs(path.substr(0, path.rfind('/')), 0755));
      UniqueFd f(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
      if (!f && errno != EEXIST) {
        return absl::FailedPreconditionError(
            absl::StrCat("image ", rootfs, " lacks mount point /", mp,
                         " and it cannot be created: ", strerror(errno)));
      }
    }
    created.push_back("/" + mp);
  }
  if (!created.empty()) {
    LogWarn(absl::StrCat("container: created missing mount points in image ", rootfs, ": ",
                         absl::StrJoin(created, " ")));
  }
  // runc gives a tmpfs the mode of the directory it is mounted on, whatever mode= says.
  if (::stat((rootfs + "/tmp").c_str(), &st) == 0 && (st.st_mode & 07777) != 01777) {
    LogWarn(absl::StrCat("container: ", rootfs, "/tmp has mode ", absl::Hex(st.st_mode & 07777),
                         " (not 1777): with runc, /tmp in sandboxes will not be writable"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  prepared_images_.insert(rootfs);
  return absl::OkStatus();
}

// Sandbox ids 0..kUsernsMapSize-1 -> the range from host_id. uid/gid 1000 and the tmpfs
// uid=/gid= options stay in-namespace ids: the runtime mounts from inside the namespace.
std::vector<IdMapping> RangeMappings(uint32_t host_id) {
  if (host_id == 0) return {};
  return {IdMapping{0, host_id, kUsernsMapSize}};
}

absl::Status ContainerDriver::WriteBundle(const std::string& id, const EnvSpec& spec,
                                          const EnvPaths& paths, const std::string& rootfs,
                                          uint32_t userns_host_id, bool egress) {
  ESB_RETURN_IF_ERROR(container::MakeDir(paths.env_dir, 0700));
  ESB_RETURN_IF_ERROR(container::MakeDir(paths.run_dir, 0700));
  BundleParams p = BaseParams(rootfs, layout_, kind_);
  // SECURITY: with a range, no sandbox uid (root included) is a uid of the host or of another
  // sandbox; the runtime writes the maps before the container's init runs any image code.
  p.id_mappings = RangeMappings(userns_host_id);
  p.env = {"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/workspace",
           "LANG=C.UTF-8", "ESB_ENV_ID=" + id};
  if (kind_ == RuntimeKind::kRunsc) {
    // runsc cannot hand a descriptor to the container: the agent binds its socket on a host
    // directory (--host-uds=create) and checks every peer's SO_PEERCRED instead.
    // SECURITY: run/ is then the only host directory the sandbox user can write to. It is a
    // small tmpfs, so a sandbox cannot fill the host's disk through it (its pages are charged
    // to the writer's memory cgroup); esbd reaches into it only via SafeAgentConnector.
    std::string opts = absl::StrCat("size=", kRunDirBytes / 1024, "k,mode=0700,uid=", kSandboxUid,
                                    ",gid=", kSandboxGid);
    if (::mount("esb-run", paths.run_dir.c_str(), "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                opts.c_str()) != 0) {
      return ErrnoStatus("mount tmpfs on " + paths.run_dir);
    }
    p.run_dir = paths.run_dir;
    p.args = {"/sbin/esb-agent", "--host-uds-peers"};
  } else {
    // SECURITY: nothing of the host is writable or connectable from inside: run/ stays
    // root-only on the host and the agent serves the listening socket esbd hands it as fd 3.
    p.args = {"/sbin/esb-agent", "--listen-fd", "3"};
    p.run_tmpfs_bytes = kRunDirBytes;
  }
  p.memory_bytes = spec.memory_mb << 20;
  p.pids = spec.pids;
  p.cpu = spec.cpu;
  p.workspace_bytes = spec.disk_mb << 20;
  // All tmpfs below are charged to the sandbox's memory cgroup; none is larger than memory_mb.
  p.tmp_bytes = std::min<int64_t>({spec.disk_mb, spec.memory_mb, 256}) << 20;
  p.shm_bytes = std::min<int64_t>(spec.memory_mb / 4, 64) << 20;
  p.cgroups_path = paths.cgroup_path;
  p.agent_binary = options_.agent_binary;
  p.hostname_file = ShareDir(options_.state_dir) + "/hostname";
  p.python_kernel_file = PythonKernelFile(options_.state_dir);
  if (!ShareMounted(options_.state_dir) || !Exists(options_.agent_binary) ||
      !Exists(p.hostname_file) || !Exists(p.python_kernel_file)) {
    // Another driver on this state dir (tests) unmounted the share: mount and fill it again.
    absl::StatusOr<std::string> agent = InstallAgent(agent_source_, options_.state_dir, kind_);
    if (!agent.ok()) return agent.status();
    if (*agent != options_.agent_binary) {
      return absl::FailedPreconditionError("agent binary changed on disk: restart esbd");
    }
  }
  if (egress) {
    // The netns esbd made (loopback only) and the trust bundle with the environment's CA.
    p.netns_path = paths.netns;
    if (userns_host_id != 0) p.userns_path = paths.userns;
    absl::StatusOr<std::string> bundle =
        governance::tls::CombinedBundle(rootfs + kCaBundleMountpoint, spec.network.ca_cert_pem);
    if (!bundle.ok()) return bundle.status();
    p.ca_bundle_file = CaBundleFile(options_.state_dir, id);
    ESB_RETURN_IF_ERROR(WriteStringToFile(p.ca_bundle_file, *bundle, 0644));
    for (const auto& [name, value] : EgressEnv()) p.env.push_back(name + "=" + value);
  }
  if (!spec.volumes.empty()) ESB_RETURN_IF_ERROR(MountVolumes(spec, paths, rootfs, &p));
  // The files API reaches the volumes like the workspace: esbd names their roots on the agent's
  // command line (nothing inside the sandbox can change it).
  for (const VolumeMount& v : spec.volumes) {
    p.args.push_back("--volume-root");
    p.args.push_back(v.path);
  }
  ESB_RETURN_IF_ERROR(PrepareImage(rootfs, p));
  return WriteStringToFile(paths.bundle_config, boost::json::serialize(BuildOciConfig(p)), 0600);
}

absl::Status ContainerDriver::WaitForAgent(const EnvPaths& paths, const InstanceState& state,
                                           bool wake) {
  AgentClient client(SafeAgentConnector(paths.run_dir, 1000));
  const int64_t deadline = MonotonicMs() + options_.agent_timeout_ms;
  absl::Status last;
  for (int attempt = 0;; ++attempt) {
    // After a restore, SIGUSR1 again every ~0.5 s: a signal that arrived before the agent
    // waited is not lost, but one sent while a forged `released` made it wait elsewhere would be.
    if (wake && attempt % 5 == 0) {
      UnlinkInRunDir(paths, "agent.sock");  // the old socket file stays on the host
      Runtime(state.runtime).Kill(paths.container_id, "USR1").IgnoreError();
    }
    const int64_t step = wake ? 100 : 250;
    last = client.WaitReady(
        static_cast<int>(std::min<int64_t>(step, std::max<int64_t>(1, deadline - MonotonicMs()))));
    if (last.ok()) return absl::OkStatus();
    if (!ProcessAlive(state)) {
      return absl::UnavailableError(absl::StrCat(
          wake ? "the restored sandbox exited: " : "the sandbox's agent exited during start: ",
          ReadTail(paths.agent_log)));
    }
    if (MonotonicMs() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          wake ? "the restored " : "", "agent did not answer within ", options_.agent_timeout_ms,
          " ms (", last.message(), "); agent log: ", ReadTail(paths.agent_log)));
    }
  }
}

absl::StatusOr<InstanceRef> ContainerDriver::Create(const std::string& id, const EnvSpec& spec) {
  return CreateInstance(id, spec, nullptr);
}

absl::StatusOr<InstanceRef> ContainerDriver::CreateInstance(const std::string& id,
                                                            const EnvSpec& spec,
                                                            const std::string* image_dir) {
  ESB_RETURN_IF_ERROR(ValidateId(id));
  if (image_dir != nullptr && kind_ != RuntimeKind::kRunsc) {
    return absl::UnimplementedError("only gVisor starts environments from a checkpoint image");
  }
  // The one limit table (drivers/env_limits.h), whoever calls: the API checked it too.
  ESB_RETURN_IF_ERROR(CheckEnvLimits(
      spec, HostEnvLimitCaps(options_.max_memory_mb, options_.max_pids, options_.max_disk_mb)));
  auto image = options_.images.find(spec.image);
  if (image == options_.images.end()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown image '", spec.image, "'"));
  }
  const bool egress = spec.network.kind == NetworkPolicy::Kind::kGoverned;
  if (egress && !EgressSupported()) return MissingCapabilityError(name(), Capability::kEgress);
  if (egress && spec.network.ca_cert_pem.empty()) {
    return absl::InvalidArgumentError("a governed network needs the environment's CA certificate");
  }
  if (!Claim(id)) return absl::FailedPreconditionError("environment " + id + " is busy");
  ClaimRelease releaser{this, id};

  const EnvPaths paths = PathsFor(options_, id);
  if (Exists(paths.env_dir)) {
    return absl::AlreadyExistsError(absl::StrCat("environment ", id, " already exists"));
  }
  const int64_t t0 = MonotonicMs();
  InstanceState state;
  state.layout = kSandboxLayout;
  state.runtime = RuntimeName(kind_);
  state.cgroup_path = paths.cgroup_path;
  const OciRuntime& runtime = Runtime(state.runtime);

  auto fail = [&](absl::Status status) -> absl::Status {
    absl::Status cleanup = DestroyById(id, state);
    if (!cleanup.ok()) {
      LogWarn(absl::StrCat("container: cleanup of failed create ", id, ": ", cleanup.message()));
    }
    return status;
  };

  ESB_RETURN_IF_ERROR(MakeDirs(options_.state_dir + "/envs", 0700));
  // The environment directory exists before its uid range is taken (and goes only after the
  // range is released): ReclaimRanges frees exactly the ranges whose owner directory is gone.
  if (absl::Status s = container::MakeDir(paths.env_dir, 0700); !s.ok()) return fail(s);
  if (userns_.enabled) {
    absl::StatusOr<uint32_t> range = AllocateRange(options_, paths.env_dir);
    if (!range.ok()) return fail(range.status());
    state.userns_host_id = *range;
  }
  if (egress) {
    state.egress = true;
    // SECURITY: the sandbox joins a namespace with loopback only; its one way out is the
    // listener esbd opens there for the egress proxy (OpenEgressListener).
    if (absl::Status s =
            CreateNetns(paths.netns, paths.userns, state.userns_host_id, kUsernsMapSize);
        !s.ok()) {
      return fail(s);
    }
  }
  if (absl::Status s = WriteBundle(id, spec, paths, image->second, state.userns_host_id, egress);
      !s.ok()) {
    return fail(s);
  }
  // SECURITY: the listening socket is the only descriptor of esbd that enters the container
  // (as the agent's fd 3); esbd's copy is closed right after the runtime returns.
  UniqueFd listener;
  if (kind_ != RuntimeKind::kRunsc) {
    absl::StatusOr<UniqueFd> sock = BindAgentSocket(paths.run_dir);
    if (!sock.ok()) return fail(sock.status());
    listener = *std::move(sock);
  }
  if (image_dir != nullptr) {
    if (absl::Status s = SeedRunState(paths, *image_dir); !s.ok()) return fail(s);
  }
  const int64_t t_bundle = MonotonicMs();
  // A fork of a gVisor step: the sandbox is the step's image, restored under the new id with
  // this environment's own bundle (its cgroup, run/ directory and limits).
  absl::StatusOr<int> pid =
      image_dir != nullptr
          ? runtime.RestoreDetached(paths.container_id, paths.env_dir, *image_dir, paths.agent_log,
                                    options_.step_snapshot_timeout_ms)
          : runtime.RunDetached(paths.container_id, paths.env_dir, paths.agent_log,
                                paths.runtime_log, options_.runtime_timeout_ms,
                                listener ? listener.get() : -1);
  listener.reset();  // the container holds it now; esbd connects through the path
  if (egress && state.userns_host_id != 0) {
    // The container's processes keep the user namespace alive; its bind is not needed again.
    if (absl::Status s = RemoveUserns(paths.userns); !s.ok()) return fail(s);
  }
  if (!pid.ok()) return fail(pid.status());
  const int64_t t_run = MonotonicMs();
  state.pid = *pid;
  state.pid_start = ProcessStartTime(*pid);
  if (state.pid_start == 0) {
    return fail(absl::UnavailableError(
        absl::StrCat("container ", paths.container_id,
                     " exited right after start: ", ReadTail(paths.agent_log))));
  }
  if (image_dir != nullptr) {
    // The restored agent waits for SIGUSR1 to listen again; its environment is the step's.
    if (absl::Status s = WaitForAgent(paths, state, /*wake=*/true); !s.ok()) return fail(s);
  } else if (absl::Status s = WaitForAgent(paths, state); !s.ok()) {
    return fail(s);
  }
  if (image_dir == nullptr && (!spec.env.empty() || egress)) {
    absl::Status s = AgentPtr(id)->Configure(egress ? WithEgressEnv(spec.env) : spec.env);
    if (!s.ok()) return fail(s);
  }
  const int64_t t_ready = MonotonicMs();
  LogDebug(absl::StrCat("container: created ", id, " in ", t_ready - t0, " ms (bundle ",
                        t_bundle - t0, ", ", state.runtime, " run ", t_run - t_bundle, ", agent ",
                        t_ready - t_run, ")"));
  return InstanceRef{id, name(), SerializeState(state, paths, layout_)};
}

absl::Status ContainerDriver::MountVolumes(const EnvSpec& spec, const EnvPaths& paths,
                                           const std::string& rootfs, BundleParams* p) {
  if (!VolumesSupported()) return MissingCapabilityError(name(), Capability::kVolumes);
  if (!Exists(rootfs + "/mnt")) {
    return absl::FailedPreconditionError(absl::StrCat("image ", rootfs, " has no /mnt"));
  }
  ESB_RETURN_IF_ERROR(container::MakeDir(paths.env_dir + "/vol", 0700));
  const std::string mount = FindExecutable("mount");
  // One check-then-mount at a time: the core gives a volume to one environment, and this
  // keeps even a confused caller from mounting one image twice.
  std::lock_guard<std::mutex> lock(volume_mu_);
  for (size_t i = 0; i < spec.volumes.size(); ++i) {
    const VolumeMount& v = spec.volumes[i];
    ESB_RETURN_IF_ERROR(ValidateVolumeKey(v.key));
    if (v.path.size() <= 5 || v.path.compare(0, 5, "/mnt/") != 0 ||
        absl::StrContains(v.path, "/.") || absl::StrContains(v.path, "//")) {
      return absl::InvalidArgumentError(absl::StrCat("volume path ", v.path, " is not allowed"));
    }
    const std::string image = VolumeImage(options_, v.key);
    if (!Exists(image)) return absl::NotFoundError(absl::StrCat("volume ", v.name, " not found"));
    if (ImageInUse(image)) {
      return absl::AbortedError(
          absl::StrCat("volume ", v.name, " is mounted by another environment"));
    }
    const std::string dir = absl::StrCat(paths.env_dir, "/vol/", i);
    ESB_RETURN_IF_ERROR(container::MakeDir(dir, 0700));
    SpawnOptions opts;
    opts.timeout_ms = options_.runtime_timeout_ms;
    // SECURITY: nosuid,nodev: nothing on the volume gains privileges or reaches a device; the
    // mount point is below the root-only environment directory.
    absl::StatusOr<ProcessResult> r =
        RunProcess({mount, "-t", "ext4", "-o", "loop,nosuid,nodev", image, dir}, opts);
    if (!r.ok()) return r.status();
    if (r->exit_code != 0) {
      return absl::InternalError(
          absl::StrCat("mounting volume ", v.name, ": ", absl::StripAsciiWhitespace(r->output)));
    }
    p->volume_binds.push_back(VolumeBind{dir, v.path, v.read_only, !p->id_mappings.empty()});
  }
  return absl::OkStatus();
}

void ContainerDriver::UnmountVolumes(const EnvPaths& paths, std::vector<std::string>* problems) {
  const std::string vol = paths.env_dir + "/vol";
  DIR* dir = ::opendir(vol.c_str());
  if (dir == nullptr) return;
  std::vector<std::string> entries;
  while (struct dirent* e = ::readdir(dir)) {
    std::string_view n = e->d_name;
    if (n != "." && n != "..") entries.emplace_back(n);
  }
  ::closedir(dir);
  for (const std::string& entry : entries) {
    const std::string path = absl::StrCat(vol, "/", entry);
    // SECURITY: unmounts only what this driver mounted below the environment's own vol/
    // directory; the sandbox is dead by now, so the file system is left clean (no MNT_DETACH:
    // a lazily unmounted volume could be mounted again while still in use).
    int rc = -1;
    for (int attempt = 0; attempt < 50; ++attempt) {
      rc = ::umount2(path.c_str(), UMOUNT_NOFOLLOW);
      if (rc == 0 || errno != EBUSY) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (rc != 0 && errno != EINVAL && errno != ENOENT) {
      problems->push_back(absl::StrCat("umount volume ", path, ": ", strerror(errno)));
      continue;
    }
    ::rmdir(path.c_str());
  }
}

absl::Status ContainerDriver::CreateVolume(const std::string& key, int64_t size_mb) {
  if (!VolumesSupported()) return MissingCapabilityError(name(), Capability::kVolumes);
  ESB_RETURN_IF_ERROR(ValidateVolumeKey(key));
  if (size_mb < 1 || size_mb > (int64_t{1} << 20)) {
    return absl::InvalidArgumentError("volume size out of range");
  }
  const std::string image = VolumeImage(options_, key);
  ESB_RETURN_IF_ERROR(MakeDirs(image.substr(0, image.rfind('/')), 0700));
  {
    // SECURITY: the image is root's (0600) below the 0700 state directory; O_EXCL never
    // reuses or follows an existing entry.
    UniqueFd f(::open(image.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!f) {
      if (errno == EEXIST) return absl::AlreadyExistsError("volume already exists");
      return ErrnoStatus("create " + image);
    }
    if (::ftruncate(f.get(), size_mb << 20) != 0) {  // sparse: disk is used as files are written
      absl::Status st = ErrnoStatus("truncate " + image);
      ::unlink(image.c_str());
      return st;
    }
  }
  SpawnOptions opts;
  opts.timeout_ms = 60000;
  // -m 0: no blocks reserved for root (the cap is the user's); the root directory belongs to
  // the sandbox user (uid/gid 1000, which idmapped binds keep as 1000 inside).
  absl::StatusOr<ProcessResult> r =
      RunProcess({FindExecutable("mkfs.ext4"), "-q", "-F", "-m", "0", "-E",
                  absl::StrCat("root_owner=", kSandboxUid, ":", kSandboxGid), image},
                 opts);
  if (!r.ok() || r->exit_code != 0) {
    ::unlink(image.c_str());
    if (!r.ok()) return r.status();
    return absl::InternalError(absl::StrCat("mkfs.ext4: ", absl::StripAsciiWhitespace(r->output)));
  }
  return absl::OkStatus();
}

absl::Status ContainerDriver::DeleteVolume(const std::string& key) {
  if (!VolumesSupported()) return MissingCapabilityError(name(), Capability::kVolumes);
  ESB_RETURN_IF_ERROR(ValidateVolumeKey(key));
  const std::string image = VolumeImage(options_, key);
  std::lock_guard<std::mutex> lock(volume_mu_);
  if (ImageInUse(image)) {
    return absl::AbortedError("volume is mounted by an environment");
  }
  if (::unlink(image.c_str()) != 0 && errno != ENOENT) return ErrnoStatus("unlink " + image);
  ::rmdir(image.substr(0, image.rfind('/')).c_str());  // the tenant's directory, once empty
  return absl::OkStatus();
}

absl::Status ContainerDriver::DestroyById(const std::string& id, const InstanceState& state) {
  DropAgent(id);  // its connection ends with the sandbox
  const EnvPaths paths = PathsFor(options_, id);
  const OciRuntime& runtime = Runtime(state.runtime);
  std::vector<std::string> problems;
  // 1. The runtime kills (SIGKILL to the pid namespace's init takes everything with it) and
  //    forgets the container, removing its cgroups.
  if (absl::Status s = runtime.Delete(paths.container_id, options_.runtime_timeout_ms); !s.ok()) {
    problems.push_back(std::string(s.message()));
  }
  // 2. Verify: nothing of it runs any more. Fall back to killing by recorded pid + start time
  //    (never a recycled pid) and by cgroup membership.
  if (ProcessAlive(state)) {
    // SECURITY: the pid is signalled only while its start time matches the container's.
    ::kill(state.pid, SIGKILL);
  }
  if (absl::Status s = RemoveCgroup(layout_, state.cgroup_path, 5000); !s.ok()) {
    problems.push_back(std::string(s.message()));
  }
  for (int i = 0; i < 100 && ProcessAlive(state); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (ProcessAlive(state)) {
    problems.push_back(absl::StrCat("pid ", state.pid, " still alive"));
  } else if (problems.empty()) {
    // SECURITY: a uid range is reused only once nothing of its environment runs any more.
    ReleaseRanges(options_, paths.env_dir);
  }
  // 3. The environment directory (bundle, socket dir, logs). run/ is a tmpfs mount.
  // SECURITY: unmounts only the tmpfs this driver mounted on the env's own run/ directory.
  if (::umount2(paths.run_dir.c_str(), MNT_DETACH | UMOUNT_NOFOLLOW) != 0 && errno != EINVAL &&
      errno != ENOENT) {
    problems.push_back(absl::StrCat("umount ", paths.run_dir, ": ", strerror(errno)));
  }
  // A governed sandbox's network namespace and trust bundle (its processes are gone by now;
  // a listener still held by the egress proxy keeps the namespace alive until it is closed).
  for (const std::string& ns : {paths.userns, paths.netns}) {
    if (!Exists(ns)) continue;
    if (absl::Status s = RemoveNetns(ns); !s.ok()) problems.push_back(std::string(s.message()));
  }
  if (const std::string ca = CaBundleFile(options_.state_dir, id); Exists(ca)) {
    ::unlink(ca.c_str());
  }
  const size_t before_volumes = problems.size();
  UnmountVolumes(paths, &problems);
  // A volume still mounted below the directory keeps it (RemoveTree never crosses a mount,
  // but the contents must not even be walked): the retry unmounts and removes it.
  if (problems.size() == before_volumes) {
    if (absl::Status s = RemoveTree(paths.env_dir); !s.ok()) {
      problems.push_back(std::string(s.message()));
    }
  }
  if (problems.empty()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("destroy ", id, ": ", absl::StrJoin(problems, "; ")));
}

absl::Status ContainerDriver::Destroy(const InstanceRef& ref) {
  ESB_RETURN_IF_ERROR(ValidateId(ref.id));
  // A gVisor step's checkpoint and restore hold the claim for a bounded time: wait for it (the
  // restore would otherwise start the sandbox again after it was destroyed).
  const int64_t until = MonotonicMs() + 2 * int64_t{options_.step_snapshot_timeout_ms} + 10000;
  while (!Claim(ref.id)) {
    if (MonotonicMs() > until) {
      return absl::FailedPreconditionError("environment " + ref.id + " is busy");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  absl::Status s = DestroyById(
      ref.id, ParseCurrentState(ref.state, RuntimeName(kind_), PathsFor(options_, ref.id)));
  Release(ref.id);
  return s;
}

absl::Status ContainerDriver::Attach(const InstanceRef& ref) {
  ESB_RETURN_IF_ERROR(ValidateId(ref.id));
  const EnvPaths paths = PathsFor(options_, ref.id);
  InstanceState state = ParseCurrentState(ref.state, RuntimeName(kind_), paths);
  if (state.layout < kSandboxLayout) {
    // SECURITY: an older esbd's sandbox (host log as stdio, writable /run/esb bind, agent
    // without the peer check) is never adopted, however healthy it is.
    return SandboxOutdatedError(absl::StrCat("environment ", ref.id, " was created with sandbox "
                                             "layout ", state.layout, " (this esbd: ",
                                             kSandboxLayout, ")"));
  }
  absl::StatusOr<ContainerState> cs = Runtime(state.runtime).State(paths.container_id);
  if (absl::IsNotFound(cs.status())) {
    return absl::NotFoundError(absl::StrCat("container of environment ", ref.id, " is gone"));
  }
  if (!cs.ok()) return cs.status();
  if (cs->status != "running") {
    return absl::UnavailableError(
        absl::StrCat("container of environment ", ref.id, " is ", cs->status));
  }
  if (state.pid != 0 && cs->pid != state.pid) {
    return absl::FailedPreconditionError(
        absl::StrCat("container of ", ref.id, " has pid ", cs->pid, ", expected ", state.pid));
  }
  if (state.userns_host_id != 0) {
    // The range stays this environment's (registered again if the registry was lost).
    ESB_RETURN_IF_ERROR(ClaimRange(options_, state.userns_host_id, paths.env_dir));
  } else if (userns_.enabled) {
    // SECURITY: a sandbox whose uids are host uids is not adopted by a daemon that maps them.
    return SandboxOutdatedError(absl::StrCat("environment ", ref.id,
                                             " runs without a user "
                                             "namespace (this esbd maps sandbox uids)"));
  }
  if (state.egress && !Exists(paths.netns)) {
    // Without its bind mount no egress listener can be opened for the sandbox again.
    return absl::FailedPreconditionError(absl::StrCat("the network namespace of environment ",
                                                      ref.id, " (", paths.netns, ") is gone"));
  }
  absl::Status ping = AgentPtr(ref.id)->Ping(2000);
  if (AgentProtocolOutdated(ping)) {
    // An agent of an older esbd still runs in this sandbox: it cannot serve this esbd.
    DropAgent(ref.id);
    return SandboxOutdatedError(absl::StrCat("environment ", ref.id, ": ", ping.message()));
  }
  return ping;
}

absl::StatusOr<UniqueFd> ContainerDriver::OpenEgressListener(const InstanceRef& ref) {
  ESB_RETURN_IF_ERROR(ValidateId(ref.id));
  const EnvPaths paths = PathsFor(options_, ref.id);
  if (!ParseState(ref.state, RuntimeName(kind_), paths).egress) {
    return absl::FailedPreconditionError(
        absl::StrCat("environment ", ref.id, " has no governed network"));
  }
  // SECURITY: the descriptor handed out is a listener inside this environment's own netns (it
  // is the environment's identity at the egress proxy); the caller owns and passes it on.
  return OpenListenerInNetns(paths.netns);
}

absl::StatusOr<UniqueFd> ContainerDriver::ConnectEgressProxy(const InstanceRef& ref,
                                                             std::chrono::milliseconds timeout,
                                                             const std::vector<uid_t>& owners) {
  ESB_RETURN_IF_ERROR(ValidateId(ref.id));
  const EnvPaths paths = PathsFor(options_, ref.id);
  if (!ParseState(ref.state, RuntimeName(kind_), paths).egress) {
    return absl::FailedPreconditionError(
        absl::StrCat("environment ", ref.id, " has no governed network"));
  }
  // SECURITY: the socket is created inside this environment's own netns and can reach only
  // its loopback listener, i.e. its egress proxy, which applies the environment's policy: esbd
  // never opens a host-network connection on the environment's behalf this way.
  absl::StatusOr<UniqueFd> fd =
      ConnectInNetns(paths.netns, static_cast<int>(timeout.count()), owners);
  if (!fd.ok() && absl::IsUnavailable(fd.status())) {
    return absl::UnavailableError(
        absl::StrCat("the egress proxy of environment ", ref.id,
                     " is not reachable (is it restarting?): ", fd.status().message()));
  }
  return fd;
}

// The shell state a step keeps (step_state.h): more is not a shell session's.
constexpr int64_t kMaxStepShellState = 256 * 1024;

absl::StatusOr<StepState> ContainerDriver::CaptureStep(const InstanceRef& ref,
                                                       const CaptureOptions& options,
                                                       BlobStore& blobs) {
  ESB_RETURN_IF_ERROR(ValidateId(ref.id));
  std::shared_ptr<AgentClient> agent = AgentPtr(ref.id);
  // Sandboxes created before time travel run an agent without its ops.
  absl::StatusOr<std::vector<std::string>> ops = agent->Capabilities();
  if (!ops.ok()) return ops.status();
  if (std::find(ops->begin(), ops->end(), "walk") == ops->end()) {
    return absl::FailedPreconditionError(
        "this environment's agent predates time travel (no `walk` op): recreate the "
        "environment to capture steps");
  }
  std::string base;
  WorkspaceManifest known;
  {
    std::lock_guard<std::mutex> lock(steps_mu_);
    base = step_bases_[ref.id];
    if (auto it = restored_.find(ref.id); it != restored_.end()) known = it->second;
  }
  StepState state;
  absl::StatusOr<WorkspaceManifest> workspace =
      CaptureAgentWorkspace(*agent, blobs, options, &base, &known);
  if (!workspace.ok()) return workspace.status();
  state.workspace = std::move(*workspace);
  // A state over the cap is not kept (the rewind then starts a fresh shell in /workspace).
  absl::StatusOr<std::string> shell = agent->ShellState(kMaxStepShellState);
  if (shell.ok()) {
    state.shell_state = std::move(*shell);
  } else if (!absl::IsResourceExhausted(shell.status())) {  // EFBIG: over 256 KiB
    return shell.status();
  }
  {
    std::lock_guard<std::mutex> lock(steps_mu_);
    step_bases_[ref.id] = base;
    restored_.erase(ref.id);  // the core passes this capture as the next one's previous
    if (auto it = pending_variables_.find(ref.id); it != pending_variables_.end()) {
      if (options.variables) state.variables_json = std::move(it->second);
      pending_variables_.erase(it);
    }
  }
  if (kind_ == RuntimeKind::kRunsc && options.memory) {
    // After the files: the image then holds at least what the manifest says (a background
    // process may still write between the walk and the checkpoint; a memory restore gives
    // the image's files, which are the later ones).
    std::string reason;
    state.memory = CheckpointStep(ref, state, blobs, base, &reason);
    if (!state.memory) state.memory_reason = reason;
  }
  return state;
}

std::optional<SnapshotRef> ContainerDriver::CheckpointStep(const InstanceRef& ref,
                                                           const StepState& capture,
                                                           BlobStore& blobs,
                                                           const std::string& walk_base,
                                                           std::string* reason) {
  if (!Claim(ref.id)) {
    *reason = "the environment was busy (being destroyed)";
    return std::nullopt;
  }
  ClaimRelease releaser{this, ref.id, /*resume=*/true};
  const EnvPaths paths = PathsFor(options_, ref.id);
  if (!Exists(paths.env_dir)) {
    *reason = "the environment is gone";
    return std::nullopt;
  }
  InstanceState state = ParseCurrentState(ref.state, RuntimeName(kind_), paths);
  const OciRuntime& runtime = Runtime(state.runtime);
  const std::string image = RandomHex(8);
  const std::string dir = absl::StrCat(paths.images, "/", image);
  if (absl::Status s = container::MakeDir(paths.images, 0700); !s.ok()) {
    *reason = std::string(s.message());
    return std::nullopt;
  }
  if (absl::Status s = container::MakeDir(dir, 0700); !s.ok()) {
    *reason = std::string(s.message());
    return std::nullopt;
  }
  const int64_t t0 = MonotonicMs();
  // gVisor cannot save a socket bound on the host (the agent's) nor a host connection: the
  // agent closes both and marks it with run/released; nothing connects until the restore.
  std::shared_ptr<AgentClient> agent = AgentPtr(ref.id);
  UnlinkInRunDir(paths, "released");
  absl::Status released = agent->ReleaseListener();
  agent.reset();
  Suspend(ref.id, true);
  // Under gVisor's ptrace platform on a loaded host the agent can take seconds to get there
  // (3 s was missed in a full test run beside four builds).
  constexpr int kReleaseWaitMs = 10'000;
  bool marked = false;
  for (int waited = 0;
       released.ok() && waited < kReleaseWaitMs && !(marked = ExistsInRunDir(paths, "released"));
       waited += 10) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  absl::Status checkpoint =
      !released.ok() ? released
      : !marked      ? absl::DeadlineExceededError(absl::StrCat(
                           "the agent did not release its listener in ", kReleaseWaitMs / 1000, " s"))
                : runtime.Checkpoint(paths.container_id, dir, options_.step_snapshot_timeout_ms);
  const int64_t t_checkpoint = MonotonicMs();
  const int64_t bytes = DirBytes(dir);
  if (checkpoint.ok()) checkpoint = SaveRunState(paths, dir);
  absl::Status back;
  if (checkpoint.ok()) {
    back = RestoreImage(paths, &state, dir);
  } else if (marked && absl::IsDeadlineExceeded(checkpoint)) {
    // The killed client does not stop the sandbox's own checkpoint, which may still stop it
    // later: never trust it again, restart it (below).
    back = absl::DeadlineExceededError("the checkpoint was cut off");
  } else if (absl::StatusOr<ContainerState> cs = runtime.State(paths.container_id);
             !cs.ok() || cs->status != "running") {
    back = absl::UnavailableError("the sandbox stopped");  // gVisor stops it on a failure
  } else if (released.ok()) {
    back = WaitForAgent(paths, state, /*wake=*/true);  // never checkpointed: listen again
  }
  if (!back.ok() && checkpoint.ok()) back = RestoreImage(paths, &state, dir);  // once more
  const int64_t t_restore = MonotonicMs();
  if (!checkpoint.ok() || !back.ok()) {
    RemoveTree(dir).IgnoreError();
    *reason = !checkpoint.ok()
                  ? absl::StrCat("runsc checkpoint failed: ", checkpoint.message())
                  : absl::StrCat("the restore after the checkpoint failed: ", back.message());
    if (!back.ok()) {
      // SECURITY/availability: never leave the environment dead: start its bundle afresh with
      // this step's files and shell state (processes and memory are lost, and the step says
      // so).
      absl::Status cold = ColdRestart(paths, &state, capture, blobs);
      absl::StrAppend(reason, cold.ok()
                                  ? "; the sandbox was restarted with this step's files "
                                    "and shell state (processes and memory lost)"
                                  : absl::StrCat("; restarting it failed too: ", cold.message()));
      LogWarn(absl::StrCat("gvisor step of ", ref.id, ": ", *reason));
    }
    return std::nullopt;
  }
  LogDebug(absl::StrCat("gvisor step of ", ref.id, ": release + checkpoint ", t_checkpoint - t0,
                        " ms, restore ", t_restore - t_checkpoint, " ms, image ", bytes, " bytes"));
  if (bytes > options_.max_step_image_mb * (int64_t{1} << 20)) {
    RemoveTree(dir).IgnoreError();
    *reason = absl::StrCat("the checkpoint image is ", bytes >> 20, " MiB, over the cap of ",
                           options_.max_step_image_mb, " MiB (the environment runs on)");
    return std::nullopt;
  }
  SnapshotRef snap;
  snap.id = image;
  snap.driver = name();
  snap.content = SnapshotContent::kMemoryAndDisk;
  snap.source_id = ref.id;
  snap.state = boost::json::serialize(
      boost::json::object{{"env", ref.id}, {"image", image}, {"walk_base", walk_base}});
  snap.bytes = bytes;
  snap.live = false;
  return snap;
}

absl::Status ContainerDriver::RestoreImage(const EnvPaths& paths, InstanceState* state,
                                           const std::string& image_dir) {
  const OciRuntime& runtime = Runtime(state->runtime);
  const int64_t t0 = MonotonicMs();
  ESB_RETURN_IF_ERROR(runtime.Delete(paths.container_id, options_.runtime_timeout_ms));
  const int64_t t_delete = MonotonicMs();
  UnlinkInRunDir(paths, "agent.sock");
  UnlinkInRunDir(paths, "released");
  ESB_RETURN_IF_ERROR(SeedRunState(paths, image_dir));
  absl::StatusOr<int> pid =
      runtime.RestoreDetached(paths.container_id, paths.env_dir, image_dir, paths.agent_log,
                              options_.step_snapshot_timeout_ms);
  if (!pid.ok()) return pid.status();
  const int64_t t_restore = MonotonicMs();
  state->pid = *pid;
  state->pid_start = ProcessStartTime(*pid);
  ESB_RETURN_IF_ERROR(WriteCurrentState(paths, *state));
  absl::Status woke = WaitForAgent(paths, *state, /*wake=*/true);
  LogDebug(absl::StrCat("gvisor restore of ", paths.container_id, ": delete ", t_delete - t0,
                        " ms, runsc restore ", t_restore - t_delete, " ms, agent ",
                        MonotonicMs() - t_restore, " ms"));
  return woke;
}

absl::Status ContainerDriver::ColdRestart(const EnvPaths& paths, InstanceState* state,
                                          const StepState& target, BlobStore& blobs) {
  const OciRuntime& runtime = Runtime(state->runtime);
  ESB_RETURN_IF_ERROR(runtime.Delete(paths.container_id, options_.runtime_timeout_ms));
  UnlinkInRunDir(paths, "agent.sock");
  UnlinkInRunDir(paths, "released");
  absl::StatusOr<int> pid = runtime.RunDetached(paths.container_id, paths.env_dir, paths.agent_log,
                                                paths.runtime_log, options_.runtime_timeout_ms, -1);
  if (!pid.ok()) return pid.status();
  state->pid = *pid;
  state->pid_start = ProcessStartTime(*pid);
  ESB_RETURN_IF_ERROR(WriteCurrentState(paths, *state));
  ESB_RETURN_IF_ERROR(WaitForAgent(paths, *state));
  const std::string id = paths.container_id.substr(4);  // "esb-<id>"
  Suspend(id, false);
  std::shared_ptr<AgentClient> agent = AgentPtr(id);
  std::string base;
  WorkspaceManifest known;
  ESB_RETURN_IF_ERROR(RestoreAgentWorkspace(*agent, blobs, target.workspace, &base, &known));
  ESB_RETURN_IF_ERROR(agent->SetShellState(target.shell_state));
  std::lock_guard<std::mutex> lock(steps_mu_);
  step_bases_[id] = base;
  restored_[id] = std::move(known);
  pending_variables_.erase(id);
  return absl::OkStatus();
}

absl::StatusOr<InstanceRef> ContainerDriver::RestoreStep(const InstanceRef& ref,
                                                         const StepState& state, BlobStore& blobs) {
  ESB_RETURN_IF_ERROR(ValidateId(ref.id));
  if (state.memory && kind_ == RuntimeKind::kRunsc) {
    // Rewind with memory: the sandbox becomes a restore of the step's image (memory, /tmp and
    // /workspace, which are tmpfs inside gVisor's kernel and so in the image).
    absl::StatusOr<StepImage> img = ParseStepImage(state.memory->state);
    if (!img.ok()) return img.status();
    const EnvPaths paths = PathsFor(options_, ref.id);
    const std::string dir = absl::StrCat(PathsFor(options_, img->env_id).images, "/", img->image);
    if (!Exists(dir + "/checkpoint.img")) {
      return absl::FailedPreconditionError("the step's checkpoint image is gone (collected)");
    }
    if (!Claim(ref.id)) return absl::FailedPreconditionError("environment " + ref.id + " is busy");
    ClaimRelease releaser{this, ref.id, /*resume=*/true};
    Suspend(ref.id, true);
    InstanceState current = ParseCurrentState(ref.state, RuntimeName(kind_), paths);
    absl::Status restored = RestoreImage(paths, &current, dir);
    if (!restored.ok()) {
      // Never leave it dead: the step's files and shell state without its memory.
      absl::Status cold = ColdRestart(paths, &current, state, blobs);
      return absl::InternalError(absl::StrCat(
          "restoring the step's memory failed: ", restored.message(),
          cold.ok() ? "; the environment was restarted with the step's files and shell state "
                      "instead (processes and memory lost)"
                    : absl::StrCat("; restarting it failed too: ", cold.message())));
    }
    std::lock_guard<std::mutex> lock(steps_mu_);
    step_bases_[ref.id] = img->walk_base;
    restored_.erase(ref.id);
    pending_variables_.erase(ref.id);
    return ref;  // the same id; its new pid is in current.json
  }
  if (state.memory) {
    return absl::FailedPreconditionError(
        "this driver keeps no memory snapshots of steps; the step cannot have one");
  }
  if (static_cast<int64_t>(state.shell_state.size()) > kMaxStepShellState) {
    return absl::InvalidArgumentError("the step's shell state is larger than 256 KiB");
  }
  std::shared_ptr<AgentClient> agent = AgentPtr(ref.id);
  std::string base;
  WorkspaceManifest known;
  ESB_RETURN_IF_ERROR(RestoreAgentWorkspace(*agent, blobs, state.workspace, &base, &known));
  ESB_RETURN_IF_ERROR(agent->SetShellState(state.shell_state));
  // The Python session restarts fresh (memory "none": live variables do not come back); the
  // next cell reports kernel_restarted.
  ExecRequest reset;
  // (An image without python3 has no Python session to restart.)
  // No kernel ever started here (its directory counts starts): nothing to restart, and no
  // python3 start-up to pay.
  reset.command = absl::StrCat("[ -e ", AbslView(kHeavyKernelDir),
                               "/starts ] || exit 0; command -v python3 >/dev/null 2>&1 || exit 0; "
                               "exec python3 ",
                               AbslView(kHeavyKernelPath), " reset");
  reset.timeout = std::chrono::milliseconds(10000);
  absl::StatusOr<ExecResult> killed = agent->Exec(reset, nullptr);
  if (!killed.ok()) return killed.status();
  if (killed->exit_code != 0) {
    return absl::InternalError(
        absl::StrCat("restarting the Python kernel failed (exit code ", killed->exit_code, ")"));
  }
  // The reset's own exec saved the restored shell state again (unchanged), nothing else.
  std::lock_guard<std::mutex> lock(steps_mu_);
  step_bases_[ref.id] = base;
  restored_[ref.id] = std::move(known);
  pending_variables_.erase(ref.id);
  return ref;
}

absl::StatusOr<InstanceRef> ContainerDriver::ForkStep(const StepState& state, const EnvSpec& spec,
                                                      const std::string& new_id, BlobStore& blobs) {
  if (!state.memory || kind_ != RuntimeKind::kRunsc) {
    return Driver::ForkStep(state, spec, new_id, blobs);
  }
  absl::StatusOr<StepImage> img = ParseStepImage(state.memory->state);
  if (!img.ok()) return img.status();
  const std::string dir = absl::StrCat(PathsFor(options_, img->env_id).images, "/", img->image);
  if (!Exists(dir + "/checkpoint.img")) {
    return absl::FailedPreconditionError("the step's checkpoint image is gone (collected)");
  }
  // The image is only read: several forks of one step are independent sandboxes.
  absl::StatusOr<InstanceRef> ref = CreateInstance(new_id, spec, &dir);
  if (!ref.ok()) return ref.status();
  std::lock_guard<std::mutex> lock(steps_mu_);
  step_bases_[new_id] = img->walk_base;
  return ref;
}

absl::Status ContainerDriver::DeleteSnapshot(const SnapshotRef& snapshot) {
  if (kind_ != RuntimeKind::kRunsc) return Driver::DeleteSnapshot(snapshot);
  absl::StatusOr<StepImage> img = ParseStepImage(snapshot.state);
  if (!img.ok()) return img.status();
  // Gone already (its environment was destroyed, which removes its images): fine.
  return RemoveTree(absl::StrCat(PathsFor(options_, img->env_id).images, "/", img->image));
}

StepMemorySupport ContainerDriver::StepMemory() const {
  StepMemorySupport support;
  if (kind_ == RuntimeKind::kRunsc) {
    // Measured on this runsc (0.0~20221219, ptrace platform): the checkpoint works once the
    // agent released its host-bound socket; per step a checkpoint plus a restore.
    support.available = true;
    support.mechanism = "runsc checkpoint";
    return support;
  }
  static const std::string* criu = new std::string([] {
    const std::string binary = FindExecutable("criu");
    if (binary.empty()) return std::string("criu is not installed");
    SpawnOptions options;
    options.timeout_ms = 10000;
    absl::StatusOr<ProcessResult> r = RunProcess({binary, "check"}, options);
    if (!r.ok()) return absl::StrCat("`criu check` could not run: ", r.status().message());
    if (r->exit_code == 0) return std::string();
    // Debian 12's CRIU 3.17 on kernels >= 6.13 says "Unexpected rt vDSO area bounds" (the
    // vvar split; fixed in CRIU 4.1).
    std::string why(absl::StripAsciiWhitespace(r->output.substr(0, 300)));
    return absl::StrCat("`criu check` fails on this host: ", why);
  }());
  support.reason =
      absl::StrCat(criu->empty() ? "criu check passes" : *criu, "; ", RuntimeName(kind_),
                   kind_ == RuntimeKind::kCrun
                       ? " has no checkpoint command (Debian's crun is built without CRIU)"
                       : ": checkpoints through CRIU are not implemented in this driver yet",
                   ": steps keep files, the shell state and a variables summary (memory \"none\")");
  return support;
}

absl::StatusOr<Usage> ContainerDriver::Stats(const InstanceRef& ref) {
  ESB_RETURN_IF_ERROR(ValidateId(ref.id));
  const EnvPaths paths = PathsFor(options_, ref.id);
  InstanceState state = ParseCurrentState(ref.state, RuntimeName(kind_), paths);
  // A gVisor step's checkpoint stops the sandbox until its restore runs: alive all the same
  // (the reaper would otherwise destroy it as "died" in that window). Checked after the pid:
  // the suspension lasts from before the checkpoint until current.json has the new pid.
  auto alive = [&] {
    if (ProcessAlive(state)) return true;
    {
      std::lock_guard<std::mutex> lock(agents_mu_);
      if (suspended_.count(ref.id) > 0) return true;
    }
    return ProcessAlive(ParseCurrentState(ref.state, RuntimeName(kind_), paths));
  };
  absl::StatusOr<Usage> usage = ReadCgroupUsage(layout_, state.cgroup_path);
  if (!usage.ok()) {
    if (kind_ == RuntimeKind::kRunsc) {
      // runsc may place the sandbox elsewhere; report liveness at least.
      Usage u;
      u.alive = alive();
      return u;
    }
    return usage.status();
  }
  usage->alive = alive();
  return usage;
}

// Makes /run/entersandbox/share-<hash(state_dir)> a small tmpfs of its own (running containers
// keep their binds of it when the driver detaches it). Files bound from it appear in a
// sandbox's /proc/self/mountinfo with their path inside this tmpfs ("/hostname"), not with a
// host path that would reveal the state directory.
bool ShareMounted(const std::string& state_dir) {
  struct stat dir_st, parent_st;
  return ::stat(ShareDir(state_dir).c_str(), &dir_st) == 0 &&
         ::stat(kShareParent, &parent_st) == 0 && dir_st.st_dev != parent_st.st_dev;
}

void UnmountShare(const std::string& state_dir) {
  // SECURITY: detaches only the tmpfs this driver mounted for its own state directory.
  if (ShareMounted(state_dir)) {
    ::umount2(ShareDir(state_dir).c_str(), MNT_DETACH | UMOUNT_NOFOLLOW);
    ::rmdir(ShareDir(state_dir).c_str());
  }
}

absl::Status MountShareDir(const std::string& state_dir) {
  const std::string share = ShareDir(state_dir);
  ESB_RETURN_IF_ERROR(MakeDirs(kShareParent, 0755));
  ::chmod(kShareParent, 0755);  // esbd's own directory; searchable for user namespaces
  ESB_RETURN_IF_ERROR(MakeDirs(share, 0755));
  if (ShareMounted(state_dir)) return absl::OkStatus();  // already our tmpfs
  // SECURITY: a root-owned tmpfs for read-only binds into sandboxes, on a directory named
  // after esbd's own state directory.
  if (::mount("esb-share", share.c_str(), "tmpfs", MS_NOSUID | MS_NODEV,
              "size=65536k,mode=0755,uid=0,gid=0") != 0) {
    return ErrnoStatus("mount tmpfs on " + share);
  }
  return absl::OkStatus();
}

// Copies the agent into the share tmpfs as root:root 0711. A binary its user cannot read
// makes the kernel mark the process non-dumpable at exec, so sandbox code running under the
// same uid cannot open the agent's descriptors via /proc/1/fd or attach to it. The copy also
// keeps running containers independent of rebuilds.
// gVisor's loader reads the binary as the sandbox user, so runsc gets a readable copy (and
// relies on the agent making itself non-dumpable).
absl::StatusOr<std::string> InstallAgent(const std::string& source, const std::string& state_dir,
                                         RuntimeKind kind) {
  std::string data;
  ESB_RETURN_IF_ERROR(ReadFileToString(source, &data));
  ESB_RETURN_IF_ERROR(MountShareDir(state_dir));
  const std::string share = ShareDir(state_dir);
  // The hostname file bound at /etc/hostname (the UTS name itself is set by the runtime).
  if (!Exists(share + "/hostname")) {
    ESB_RETURN_IF_ERROR(WriteStringToFile(share + "/hostname", "sandbox\n", 0644));
  }
  // The heavy tier's Python kernel, read by the sandbox user's python3 (root-owned, 0644, on
  // a read-only bind: sandbox code can run it but never replace it).
  const std::string kernel = PythonKernelFile(state_dir);
  if (!Exists(kernel)) {
    ESB_RETURN_IF_ERROR(WriteStringToFile(kernel, ShippedHeavyKernel(), 0644));
    // SECURITY: root-owned and not writable by the sandbox user, like the agent copy.
    if (::chown(kernel.c_str(), 0, 0) != 0 || ::chmod(kernel.c_str(), 0644) != 0) {
      return ErrnoStatus("chmod " + kernel);
    }
  }
  const mode_t mode = kind == RuntimeKind::kRunsc ? 0755 : 0711;
  std::string dest = absl::StrCat(share, "/esb-agent-", absl::Hex(Fnv1a(data), absl::kZeroPad8),
                                  kind == RuntimeKind::kRunsc ? "-r" : "-x");
  if (Exists(dest)) return dest;
  ESB_RETURN_IF_ERROR(WriteStringToFile(dest, data, mode));
  // SECURITY: execute-only for the sandbox user where the runtime allows it (see above).
  if (::chown(dest.c_str(), 0, 0) != 0 || ::chmod(dest.c_str(), mode) != 0) {
    return ErrnoStatus("chmod " + dest);
  }
  return dest;
}

// The share's copy of kernel.py, named after its content (a rebuilt esbd with another kernel
// gets a new file; running sandboxes keep the one they were created with).
std::string PythonKernelFile(const std::string& state_dir) {
  return absl::StrCat(ShareDir(state_dir), "/esb-kernel-",
                      absl::Hex(Fnv1a(AbslView(ShippedHeavyKernel())), absl::kZeroPad8), ".py");
}

// Sandbox layout 1 ran the agent from <state_dir>/bin/esb-agent-*. No instance of the current
// layout uses those copies, and every layout-1 instance is refused on re-attach and destroyed
// (its agent keeps running from the already mapped binary until then), so they go.
void RemoveLayout1AgentCopies(const std::string& state_dir) {
  const std::string bin = state_dir + "/bin";
  std::error_code ec;
  std::vector<std::filesystem::path> copies;
  for (const auto& entry : std::filesystem::directory_iterator(bin, ec)) {
    if (absl::StartsWith(entry.path().filename().string(), "esb-agent-")) {
      copies.push_back(entry.path());
    }
  }
  int removed = 0;
  for (const auto& path : copies) removed += std::filesystem::remove(path, ec) ? 1 : 0;
  if (removed > 0) {
    LogInfo(absl::StrCat("container driver: removed ", removed, " agent copies of sandbox "
                         "layout 1 from ", bin));
  }
  std::filesystem::remove(bin, ec);  // only if now empty
}

// A number from a /proc/sys file, 0 if unreadable.
int64_t ReadSysctl(const char* path) {
  std::string text;
  int64_t v = 0;
  if (!ReadFileToString(path, &text).ok()) return 0;
  return absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &v) ? v : 0;
}

// Writes `value` to a cgroup file (one write, as the kernel wants it).
absl::Status WriteCgroupFile(const std::string& file, const std::string& value) {
  UniqueFd fd(::open(file.c_str(), O_WRONLY | O_CLOEXEC));
  if (!fd || ::write(fd.get(), value.data(), value.size()) != static_cast<ssize_t>(value.size())) {
    return ErrnoStatus("write " + file);
  }
  return absl::OkStatus();
}

// Puts a pids limit on the parent cgroup of all sandboxes, so that together they can never use
// up the host's pids (each sandbox's own limit alone allows max_pids * environments).
absl::StatusOr<int64_t> LimitParentPids(const CgroupLayout& layout, const std::string& parent,
                                        int64_t limit) {
  if (limit <= 0) {
    int64_t pid_max = ReadSysctl("/proc/sys/kernel/pid_max");
    int64_t threads_max = ReadSysctl("/proc/sys/kernel/threads-max");
    int64_t host = pid_max > 0 && threads_max > 0 ? std::min(pid_max, threads_max)
                                                  : std::max(pid_max, threads_max);
    if (host <= 0) return absl::UnavailableError("cannot read kernel.pid_max/threads-max");
    limit = host / 2;
  }
  std::string dir;
  if (layout.mode == CgroupMode::kV2) {
    dir = layout.v2_mount + parent;
    // The pids controller must be enabled from the root down to the parent's children.
    std::string path = layout.v2_mount;
    for (absl::string_view part : absl::StrSplit(parent, '/', absl::SkipEmpty())) {
      UniqueFd ctl(::open((path + "/cgroup.subtree_control").c_str(), O_WRONLY | O_CLOEXEC));
      if (ctl) (void)!::write(ctl.get(), "+pids", 5);
      path = absl::StrCat(path, "/", part);
      ESB_RETURN_IF_ERROR(MakeDir(path, 0755));
    }
    UniqueFd ctl(::open((dir + "/cgroup.subtree_control").c_str(), O_WRONLY | O_CLOEXEC));
    if (ctl) (void)!::write(ctl.get(), "+pids", 5);
  } else {
    auto it = layout.v1_mounts.find("pids");
    if (it == layout.v1_mounts.end()) {
      return absl::UnavailableError("no pids cgroup hierarchy is mounted");
    }
    dir = it->second + parent;
    ESB_RETURN_IF_ERROR(MakeDirs(dir, 0755));
  }
  const std::string file = dir + "/pids.max";
  std::string value = absl::StrCat(limit);
  // SECURITY: caps every sandbox together below the host's pid space.
  ESB_RETURN_IF_ERROR(WriteCgroupFile(file, value));
  return limit;
}

// Puts a memory limit on the parent cgroup of all sandboxes: each sandbox's own limit alone
// allows max_memory_mb * environments, and tmpfs pages (/workspace) cannot be freed by killing
// processes, so without it a few full workspaces push the host into a global OOM. With it,
// memory pressure from sandboxes ends in OOM kills inside `parent`. Swap too (v1 memsw, v2
// memory.swap.max = 0, like each sandbox) where the kernel accounts it.
absl::StatusOr<int64_t> LimitParentMemory(const CgroupLayout& layout, const std::string& parent,
                                          int64_t limit_mb) {
  if (limit_mb <= 0) limit_mb = DeriveMemoryBudget(HostMemoryMb()).sandboxes_mb;
  if (limit_mb <= 0) return absl::UnavailableError("cannot read MemTotal from /proc/meminfo");
  const std::string bytes = absl::StrCat(limit_mb << 20);
  if (layout.mode == CgroupMode::kV2) {
    const std::string dir = layout.v2_mount + parent;
    // The memory controller must be enabled from the root down to the parent's children.
    std::string path = layout.v2_mount;
    for (absl::string_view part : absl::StrSplit(parent, '/', absl::SkipEmpty())) {
      UniqueFd ctl(::open((path + "/cgroup.subtree_control").c_str(), O_WRONLY | O_CLOEXEC));
      if (ctl) (void)!::write(ctl.get(), "+memory", 7);
      path = absl::StrCat(path, "/", part);
      ESB_RETURN_IF_ERROR(MakeDir(path, 0755));
    }
    UniqueFd ctl(::open((dir + "/cgroup.subtree_control").c_str(), O_WRONLY | O_CLOEXEC));
    if (ctl) (void)!::write(ctl.get(), "+memory", 7);
    // SECURITY: caps every sandbox together (tmpfs included) below the host's RAM.
    ESB_RETURN_IF_ERROR(WriteCgroupFile(dir + "/memory.max", bytes));
    if (Exists(dir + "/memory.swap.max")) {
      ESB_RETURN_IF_ERROR(WriteCgroupFile(dir + "/memory.swap.max", "0"));
    }
    return limit_mb;
  }
  auto it = layout.v1_mounts.find("memory");
  if (it == layout.v1_mounts.end()) {
    return absl::UnavailableError("no memory cgroup hierarchy is mounted");
  }
  const std::string dir = it->second + parent;
  ESB_RETURN_IF_ERROR(MakeDirs(dir, 0755));
  std::string hierarchy;
  if (ReadFileToString(dir + "/memory.use_hierarchy", &hierarchy).ok() &&
      absl::StripAsciiWhitespace(hierarchy) != "1") {
    // Without it a v1 parent's limit does not cover its children.
    ESB_RETURN_IF_ERROR(WriteCgroupFile(dir + "/memory.use_hierarchy", "1"));
  }
  // memsw.limit must stay >= limit: lowering goes limit first, raising memsw first; so try
  // limit, memsw, limit again.
  // SECURITY: caps every sandbox together (tmpfs included) below the host's RAM.
  absl::Status first = WriteCgroupFile(dir + "/memory.limit_in_bytes", bytes);
  if (Exists(dir + "/memory.memsw.limit_in_bytes")) {
    ESB_RETURN_IF_ERROR(WriteCgroupFile(dir + "/memory.memsw.limit_in_bytes", bytes));
  }
  if (!first.ok()) ESB_RETURN_IF_ERROR(WriteCgroupFile(dir + "/memory.limit_in_bytes", bytes));
  return limit_mb;
}

// ---------------------------------------------------------------------------------------
// Probe: run /bin/true from a rootfs made of read-only binds of the host's /usr (and /lib*),
// under exactly the confinement real sandboxes get.

// `userns`: run it in a user namespace with a uid range of its own (taken and released here).
absl::StatusOr<int64_t> Probe(const ContainerDriverOptions& options, const CgroupLayout& layout,
                              const OciRuntime& runtime, bool userns) {
  // In the share: the rootfs must be reachable from inside a user namespace.
  const std::string dir = absl::StrCat(ShareDir(options.state_dir), "/probe-", RandomHex(4));
  const std::string rootfs = dir + "/rootfs";
  const std::string id = "esb-probe-" + RandomHex(4);
  ESB_RETURN_IF_ERROR(MakeDirs(rootfs, 0755));
  struct Cleanup {
    const ContainerDriverOptions& options;
    std::string dir;
    ~Cleanup() {
      ReleaseRanges(options, dir);
      RemoveTree(dir).IgnoreError();
    }
  } cleanup{options, dir};

  BundleParams p = BaseParams(rootfs, layout, runtime.kind());
  if (userns) {
    absl::StatusOr<uint32_t> range = AllocateRange(options, dir);
    if (!range.ok()) return range.status();
    p.id_mappings = RangeMappings(*range);
  }
  p.args = {"/usr/bin/true"};
  p.env = {"PATH=/usr/bin:/bin"};
  p.cgroups_path = absl::StrCat(options.cgroup_parent, "/probe-", RandomHex(4));
  for (const char* top : {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"}) {
    std::string host = absl::StrCat("/", top);
    struct stat st;
    if (::lstat(host.c_str(), &st) != 0) continue;
    if (S_ISLNK(st.st_mode)) {
      char target[4096];
      ssize_t n = ::readlink(host.c_str(), target, sizeof(target) - 1);
      if (n <= 0) continue;
      target[n] = '\0';
      if (::symlink(target, (rootfs + host).c_str()) != 0) return ErrnoStatus("symlink");
    } else if (S_ISDIR(st.st_mode)) {
      p.extra_binds.push_back({host, host, true});
    }
  }
  for (const std::string& mp : RequiredMountpoints(p)) {
    std::string path = rootfs + "/" + mp;
    if (mp.back() == '/') ESB_RETURN_IF_ERROR(MakeDirs(path, 0755));
  }
  ESB_RETURN_IF_ERROR(
      WriteStringToFile(dir + "/config.json", boost::json::serialize(BuildOciConfig(p)), 0600));
  const int64_t t0 = MonotonicMs();
  absl::StatusOr<ProcessResult> r =
      runtime.RunForeground(id, dir, dir + "/probe.log", options.runtime_timeout_ms);
  const int64_t elapsed = MonotonicMs() - t0;
  std::string log = ReadTail(dir + "/probe.log");
  runtime.Delete(id).IgnoreError();
  RemoveCgroup(layout, p.cgroups_path, 2000).IgnoreError();
  if (!r.ok()) return r.status();
  if (r->timed_out) {
    return absl::UnavailableError(absl::StrCat(RuntimeName(runtime.kind()),
                                               " probe timed out after ",
                                               options.runtime_timeout_ms, " ms: ", log));
  }
  if (r->exit_code != 0) {
    return absl::UnavailableError(absl::StrCat(RuntimeName(runtime.kind()),
                                               " could not start a container (exit ", r->exit_code,
                                               "): ", log));
  }
  return elapsed;
}

// The first directory on the way to `path` (itself included) that users other than its owner
// cannot search, with its mode; "" when there is none. The runtime resolves the rootfs and
// every bind source from inside the user namespace, as an unmapped "other" user.
std::string UnsearchableAncestor(const std::string& path) {
  std::string partial;
  for (absl::string_view part : absl::StrSplit(path, '/', absl::SkipEmpty())) {
    absl::StrAppend(&partial, "/", part);
    struct stat st;
    if (::stat(partial.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && !(st.st_mode & S_IXOTH)) {
      char mode[8];
      snprintf(mode, sizeof(mode), "%04o", st.st_mode & 07777);
      return absl::StrCat(partial, " (mode ", mode, ")");
    }
  }
  return "";
}

// What can be known before a container is started: configuration, runtime, kernel, paths.
UsernsStatus UsernsPrecheck(const ContainerDriverOptions& o, RuntimeKind kind) {
  if (!o.user_namespaces) return {false, "off in the configuration (user_namespaces = false)"};
  if (kind == RuntimeKind::kRunsc) {
    // gVisor's sentry implements uids itself: sandbox processes are never host processes, and
    // the sentry and gofer already run in runsc's own user namespace. An OCI "user" namespace
    // in the spec is not applied by this runsc (see docs/design.md).
    return {false, "gVisor: sandbox uids exist only inside the sentry"};
  }
  if (ReadSysctl("/proc/sys/user/max_user_namespaces") <= 0) {
    return {false, "the kernel allows no user namespaces (user.max_user_namespaces = 0)"};
  }
  std::vector<std::string> paths = {ShareDir(o.state_dir)};
  for (const auto& [name, rootfs] : o.images) paths.push_back(rootfs);
  for (const std::string& path : paths) {
    if (std::string dir = UnsearchableAncestor(path); !dir.empty()) {
      return {false, absl::StrCat(dir, " is not searchable by others, so the runtime cannot reach ",
                                  path, " from inside a user namespace (chmod o+x it)")};
    }
  }
  return {true, absl::StrCat("each sandbox's uids/gids 0..", kUsernsMapSize - 1,
                             " map to its own host range of ", kUsernsRangeSize, " from ",
                             o.userns_uid_base, " (", o.userns_slots, " ranges, registry ",
                             o.userns_registry, ")")};
}

}  // namespace
}  // namespace container

UsernsStatus ContainerUsernsStatus(const Driver& driver) {
  if (auto* d = dynamic_cast<const container::ContainerDriver*>(&driver)) return d->userns();
  return {false, "not a container driver"};
}

absl::StatusOr<std::unique_ptr<Driver>> NewContainerDriver(ContainerDriverOptions options) {
  using namespace container;
  if (options.state_dir.empty() || options.state_dir[0] != '/') {
    return absl::InvalidArgumentError("container driver: state_dir must be an absolute path");
  }
  while (options.state_dir.size() > 1 && options.state_dir.back() == '/') {
    options.state_dir.pop_back();
  }
  if (options.cgroup_parent.empty() || options.cgroup_parent[0] != '/' ||
      options.cgroup_parent.find("..") != std::string::npos) {
    return absl::InvalidArgumentError("container driver: cgroup_parent must be absolute");
  }
  if (geteuid() != 0) {
    return absl::UnavailableError(
        "container driver needs root (it runs an OCI runtime with "
        "namespaces and cgroups)");
  }
  if (options.user_namespaces) {
    // Ranges must lie above every ordinary host uid and below 2^31 (tools treat uids as signed).
    const uint64_t end = uint64_t{options.userns_uid_base} +
                         uint64_t{options.userns_slots} * container::kUsernsRangeSize;
    if (!container::ValidRangeStart(options.userns_uid_base) || options.userns_slots == 0 ||
        end > (uint64_t{1} << 31) || options.userns_registry.empty() ||
        options.userns_registry[0] != '/') {
      return absl::InvalidArgumentError(absl::StrCat(
          "container driver: user-namespace ranges must lie within [65536, 2^31), start at a "
          "multiple of 65536, and the registry be an absolute path (userns_uid_base ",
          options.userns_uid_base, ", userns_slots ", options.userns_slots, ")"));
    }
    container::ReclaimRanges(options);
  }
  container::ReclaimNetns(options);
  struct stat st;
  if (options.agent_binary.empty() || ::stat(options.agent_binary.c_str(), &st) != 0 ||
      !S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("container driver: agent binary '", options.agent_binary, "' not found"));
  }
  absl::StatusOr<CgroupLayout> layout = DetectCgroups();
  if (!layout.ok()) return layout.status();
  ESB_RETURN_IF_ERROR(MakeDirs(options.state_dir + "/envs", 0700));
  ::chmod(options.state_dir.c_str(), 0711);
  RemoveLayout1AgentCopies(options.state_dir);
  if (options.max_pids < 16) {
    return absl::InvalidArgumentError("container driver: max_pids must be at least 16");
  }
  absl::StatusOr<int64_t> total_pids =
      LimitParentPids(*layout, options.cgroup_parent, options.total_pids);
  if (!total_pids.ok()) {
    return absl::UnavailableError(absl::StrCat("container driver: cannot limit the pids of ",
                                               options.cgroup_parent, ": ",
                                               total_pids.status().message()));
  }
  options.total_pids = *total_pids;
  LogInfo(absl::StrCat("container driver: pids.max of ", options.cgroup_parent, " = ", *total_pids,
                       " (all sandboxes), per environment <= ", options.max_pids));
  absl::StatusOr<int64_t> total_memory =
      LimitParentMemory(*layout, options.cgroup_parent, options.total_memory_mb);
  if (!total_memory.ok()) {
    return absl::UnavailableError(absl::StrCat("container driver: cannot limit the memory of ",
                                               options.cgroup_parent, ": ",
                                               total_memory.status().message()));
  }
  options.total_memory_mb = *total_memory;
  if (options.max_memory_mb <= 0) {
    options.max_memory_mb = DeriveMemoryBudget(HostMemoryMb()).max_env_mb;
  }
  if (options.max_disk_mb <= 0) options.max_disk_mb = options.max_memory_mb;
  if (options.max_memory_mb < 16 || options.max_memory_mb > options.total_memory_mb) {
    return absl::InvalidArgumentError(absl::StrCat(
        "container driver: max_memory_mb must be 16..", options.total_memory_mb,
        " (the memory limit of all sandboxes), not ", options.max_memory_mb));
  }
  LogInfo(absl::StrCat("container driver: memory limit of ", options.cgroup_parent, " = ",
                       *total_memory, " MiB of ", HostMemoryMb(), " MiB RAM (all sandboxes, swap ",
                       "included), per environment memory_mb <= ", options.max_memory_mb,
                       ", disk_mb <= ", options.max_disk_mb));

  std::vector<RuntimeKind> candidates;
  if (options.runtime == "auto") {
    candidates = {RuntimeKind::kCrun, RuntimeKind::kRunc};
  } else {
    RuntimeKind kind;
    if (!ParseRuntimeKind(options.runtime, &kind)) {
      return absl::InvalidArgumentError(
          "container driver: runtime must be auto, crun, runc or "
          "runsc, not '" +
          options.runtime + "'");
    }
    candidates = {kind};
  }
  std::vector<std::string> failures;
  for (RuntimeKind kind : candidates) {
    std::string binary = FindExecutable(RuntimeName(kind));
    if (binary.empty()) {
      failures.push_back(absl::StrCat(RuntimeName(kind), ": not installed"));
      continue;
    }
    std::string hide =
        (kind == RuntimeKind::kCrun && layout->mode == CgroupMode::kHybrid) ? layout->v2_mount : "";
    absl::StatusOr<std::string> agent = InstallAgent(options.agent_binary, options.state_dir, kind);
    if (!agent.ok()) return agent.status();
    OciRuntime runtime(kind, binary,
                       absl::StrCat(options.state_dir, "/runtime/", RuntimeName(kind)), hide);
    std::string probe_note = "not probed";
    UsernsStatus userns = UsernsPrecheck(options, kind);
    if (options.probe) {
      absl::StatusOr<int64_t> probe = absl::UnknownError("not run");
      if (userns.enabled) {
        probe = Probe(options, *layout, runtime, true);
        if (!probe.ok()) {
          userns = {false, absl::StrCat(RuntimeName(kind),
                                        " cannot start a container in a user "
                                        "namespace here: ",
                                        probe.status().message())};
        }
      }
      if (!userns.enabled) probe = Probe(options, *layout, runtime, false);
      if (!probe.ok()) {
        failures.push_back(absl::StrCat(RuntimeName(kind), ": ", probe.status().message()));
        continue;
      }
      probe_note = absl::StrCat("probe container ", *probe, " ms");
    }
    if (userns.enabled) {
      LogInfo(absl::StrCat("container driver: user namespaces on: ", userns.reason));
    } else {
      LogWarn(absl::StrCat("container driver: user namespaces OFF, sandbox uids are host uids: ",
                           userns.reason));
    }
    std::string describe = absl::StrCat(
        runtime.Version(), kind == RuntimeKind::kRunsc ? " (gVisor, ptrace platform)" : "", "; ",
        CgroupModeName(layout->mode),
        hide.empty() ? "" : absl::StrCat(", ", hide, " hidden from crun"), "; ",
        userns.enabled ? "user namespaces" : "no user namespaces", "; ", probe_note);
    LogInfo("container driver: " + describe);
    std::string source = options.agent_binary;
    options.agent_binary = *agent;
    return std::unique_ptr<Driver>(new ContainerDriver(std::move(options), *std::move(layout), kind,
                                                       describe, std::move(source),
                                                       std::move(userns)));
  }
  UnmountShare(options.state_dir);
  return absl::UnavailableError(
      absl::StrCat("no OCI runtime works on this host: ", absl::StrJoin(failures, "; ")));
}

std::vector<std::string> FindContainerLeaks(const ContainerDriverOptions& options,
                                            const InstanceRef& ref) {
  using namespace container;
  std::vector<std::string> leaks;
  ContainerDriverOptions o = options;
  while (o.state_dir.size() > 1 && o.state_dir.back() == '/') o.state_dir.pop_back();
  const EnvPaths paths = PathsFor(o, ref.id);
  InstanceState state = ParseState(ref.state, "crun", paths);
  if (ProcessAlive(state)) leaks.push_back(absl::StrCat("process ", state.pid, " alive"));
  absl::StatusOr<CgroupLayout> layout = DetectCgroups();
  if (layout.ok()) {
    for (int pid : CgroupPids(*layout, state.cgroup_path)) {
      leaks.push_back(absl::StrCat("process ", pid, " in cgroup ", state.cgroup_path));
    }
    for (const std::string& dir : CgroupDirs(*layout, state.cgroup_path)) {
      if (Exists(dir)) leaks.push_back("cgroup directory " + dir);
    }
  }
  std::string mountinfo;
  if (ReadFileToString("/proc/self/mountinfo", &mountinfo).ok()) {
    for (absl::string_view line : absl::StrSplit(mountinfo, '\n', absl::SkipEmpty())) {
      if (absl::StrContains(line, paths.env_dir)) leaks.push_back("mount: " + std::string(line));
    }
  }
  if (Exists(paths.env_dir)) leaks.push_back("directory " + paths.env_dir);
  if (Exists(paths.netns)) leaks.push_back("network namespace " + paths.netns);
  if (Exists(paths.userns)) leaks.push_back("user namespace " + paths.userns);
  if (Exists(CaBundleFile(o.state_dir, ref.id))) {
    leaks.push_back("trust bundle " + CaBundleFile(o.state_dir, ref.id));
  }
  for (const auto& [host_id, owner] : ListRanges(o)) {
    if (owner == paths.env_dir) {
      leaks.push_back(absl::StrCat("user-namespace uid range ", host_id));
    }
  }
  for (const char* rt : {"crun", "runc", "runsc"}) {
    std::string runtime_state = absl::StrCat(o.state_dir, "/runtime/", rt, "/", paths.container_id);
    if (Exists(runtime_state)) leaks.push_back("runtime state " + runtime_state);
  }
  return leaks;
}

}  // namespace esb

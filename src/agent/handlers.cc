#include "agent/handlers.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/openat2.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "agent/fs_ops.h"
#include "agent/util.h"
#include "common/utf8.h"  // names are bytes; frame headers are UTF-8 JSON

namespace esb::agent {
namespace json = boost::json;

namespace {

// Entries beyond this much JSON go into the payload instead of the header (which is capped
// at 64 KiB by the frame format).
constexpr size_t kMaxEntriesInHeader = 48 * 1024;
constexpr int64_t kMaxOffset = int64_t{1} << 60;

int64_t MtimeMs(const struct stat& st) {
  return int64_t{st.st_mtim.tv_sec} * 1000 + st.st_mtim.tv_nsec / 1000000;
}

const char* TypeName(mode_t mode) {
  if (S_ISREG(mode)) return "file";
  if (S_ISDIR(mode)) return "dir";
  if (S_ISLNK(mode)) return "symlink";
  return "other";
}

json::object StatObject(const struct stat& st) {
  json::object o;
  o["type"] = TypeName(st.st_mode);
  o["size"] = static_cast<int64_t>(st.st_size);
  o["mode"] = static_cast<int64_t>(st.st_mode & 07777);
  o["mtime_ms"] = MtimeMs(st);
  return o;
}

// mkdir -p of every parent of `path`.
int MakeParents(const std::string& path) {
  for (size_t pos = path.find('/', 1); pos != std::string::npos; pos = path.find('/', pos + 1)) {
    std::string dir = path.substr(0, pos);
    if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) return errno;
  }
  return 0;
}

// True if any prefix of the absolute `path` ("/a", "/a/b", ...) is on procfs or sysfs
// (statfs follows symlinks). Only the fallback for kernels without openat2 uses this.
bool PathTouchesKernelFs(const std::string& path) {
  for (size_t pos = path.find('/', 1);; pos = path.find('/', pos + 1)) {
    std::string prefix = pos == std::string::npos ? path : path.substr(0, pos);
    struct statfs sfs;
    if (statfs(prefix.c_str(), &sfs) == 0 && OnKernelFs(sfs.f_type)) return true;
    if (pos == std::string::npos) return false;
  }
}

// openat2 with RESOLVE_NO_MAGICLINKS works here: probed once on "/" (Linux < 5.6 says ENOSYS;
// gVisor's seccomp layer does not know the syscall and answers EPERM).
bool HaveOpenat2() {
  static const bool have = [] {
    open_how how{};
    how.flags = O_PATH | O_CLOEXEC;
    how.resolve = RESOLVE_NO_MAGICLINKS;
    int fd = static_cast<int>(syscall(SYS_openat2, AT_FDCWD, "/", &how, sizeof how));
    if (fd < 0) {
      Log(LogLevel::kWarn, std::string("openat2 unavailable (") + strerror(errno) +
                               "): request paths are checked with statfs instead");
      return false;
    }
    close(fd);
    return true;
  }();
  return have;
}

proto::Frame NotRegular(const std::string& path, const struct stat& st) {
  if (S_ISDIR(st.st_mode)) return ErrorResponse(path + ": is a directory", "EISDIR");
  return ErrorResponse(path + ": not a regular file", "EINVAL");
}

void DiskUsageAt(int dirfd, dev_t dev, int depth, std::set<std::pair<dev_t, ino_t>>* seen,
                 int64_t* total) {
  if (depth > 256) return;
  DIR* dir = fdopendir(dirfd);
  if (!dir) {
    close(dirfd);
    return;
  }
  while (dirent* e = readdir(dir)) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    struct stat st;
    if (fstatat(dirfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (st.st_dev != dev) continue;  // like du -x: other mounts are not the workspace
    if (st.st_nlink > 1 && !S_ISDIR(st.st_mode) && !seen->insert({st.st_dev, st.st_ino}).second) {
      continue;
    }
    *total += int64_t{st.st_blocks} * 512;
    if (S_ISDIR(st.st_mode)) {
      int child = openat(dirfd, e->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (child >= 0) DiskUsageAt(child, dev, depth + 1, seen, total);
    }
  }
  closedir(dir);
}

}  // namespace

std::string Fields::String(const char* key, std::string fallback, bool required) {
  const json::value* v = object_.if_contains(key);
  if (!v || v->is_null()) {
    if (required && error_.empty()) error_ = std::string("missing field ") + key;
    return fallback;
  }
  if (!v->is_string()) {
    if (error_.empty()) error_ = std::string("field ") + key + " must be a string";
    return fallback;
  }
  return std::string(v->as_string());
}

int64_t Fields::Int(const char* key, int64_t fallback, bool required) {
  const json::value* v = object_.if_contains(key);
  if (!v || v->is_null()) {
    if (required && error_.empty()) error_ = std::string("missing field ") + key;
    return fallback;
  }
  if (v->is_int64()) return v->as_int64();
  if (v->is_uint64() && v->as_uint64() <= static_cast<uint64_t>(INT64_MAX)) {
    return static_cast<int64_t>(v->as_uint64());
  }
  if (v->is_double()) {
    double d = v->as_double();
    if (d >= -9e15 && d <= 9e15 && d == static_cast<double>(static_cast<int64_t>(d))) {
      return static_cast<int64_t>(d);
    }
  }
  if (error_.empty()) error_ = std::string("field ") + key + " must be an integer";
  return fallback;
}

bool Fields::Bool(const char* key, bool fallback) {
  const json::value* v = object_.if_contains(key);
  if (!v || v->is_null()) return fallback;
  if (!v->is_bool()) {
    if (error_.empty()) error_ = std::string("field ") + key + " must be a boolean";
    return fallback;
  }
  return v->as_bool();
}

bool Fields::StringMap(const char* key, std::vector<std::pair<std::string, std::string>>* out) {
  out->clear();
  const json::value* v = object_.if_contains(key);
  if (!v || v->is_null()) return true;
  if (!v->is_object()) {
    if (error_.empty()) error_ = std::string("field ") + key + " must be an object";
    return false;
  }
  for (const auto& kv : v->as_object()) {
    if (!kv.value().is_string()) {
      if (error_.empty()) error_ = std::string("field ") + key + " values must be strings";
      return false;
    }
    out->emplace_back(std::string(kv.key()), std::string(kv.value().as_string()));
  }
  return true;
}

proto::Frame OkResponse() {
  proto::Frame f;
  f.type = proto::FrameType::kResponse;
  f.header["ok"] = true;
  return f;
}

proto::Frame ErrorResponse(const std::string& message, const std::string& errno_name) {
  proto::Frame f;
  f.type = proto::FrameType::kResponse;
  f.header["ok"] = false;
  f.header["error"] = esb::SanitizeUtf8(message);
  f.header["errno"] = errno_name;
  return f;
}

proto::Frame ErrnoResponse(const std::string& what, int err) {
  return ErrorResponse(what + ": " + strerror(err), ErrnoName(err));
}

int OpenSandboxPath(const std::string& path, int flags, mode_t mode, bool* kernel_fs) {
  *kernel_fs = false;
  int fd = -1;
  if (HaveOpenat2()) {
    open_how how{};
    how.flags = static_cast<uint64_t>(flags) | O_CLOEXEC;
    how.mode = (flags & O_CREAT) ? mode : 0;
    // SECURITY: no /proc magic links (/proc/self/fd/N, /proc/<pid>/root, ...): a request can
    // never reach a descriptor of the agent (the host's socket) or another mount namespace.
    how.resolve = RESOLVE_NO_MAGICLINKS;
    fd = static_cast<int>(syscall(SYS_openat2, AT_FDCWD, path.c_str(), &how, sizeof how));
    if (fd < 0) return -1;
  } else {
    // Fallback without openat2 (gVisor, Linux < 5.6): refuse paths whose prefixes are on
    // procfs/sysfs. Racy against
    // a concurrent symlink swap, but by then the agent holds no host file: fds 0-2 are
    // /dev/null and the host's socket fails the S_ISREG checks of every handler.
    if (PathTouchesKernelFs(path)) {
      *kernel_fs = true;
      errno = EACCES;
      return -1;
    }
    fd = open(path.c_str(), flags | O_CLOEXEC, mode);
    if (fd < 0) return -1;
  }
  struct statfs sfs;
  if (fstatfs(fd, &sfs) != 0 || OnKernelFs(sfs.f_type)) {
    // SECURITY: procfs/sysfs files (/proc/self/mem, /proc/1/environ, ...) are kernel
    // interfaces of the agent itself, never sandbox files.
    close(fd);
    *kernel_fs = true;
    errno = EACCES;
    return -1;
  }
  return fd;
}

proto::Frame OpenError(const std::string& what, const std::string& rel, int err, bool kernel_fs) {
  if (kernel_fs) {
    return ErrorResponse(rel + ": refused: /proc and /sys are not sandbox files", "EACCES");
  }
  if (err == ELOOP) {
    return ErrorResponse(what + " " + rel + ": refused: symlink loop or /proc magic link", "ELOOP");
  }
  if (err == ENXIO) return ErrorResponse(rel + ": not a regular file", "EINVAL");
  return ErrnoResponse(what + " " + rel, err);
}

bool ResolvePath(const std::string& workspace, const std::string& path, std::string* out) {
  if (path.empty() || path.size() > PATH_MAX || path.find('\0') != std::string::npos) {
    return false;
  }
  *out = path[0] == '/' ? path : workspace + "/" + path;
  return true;
}

proto::Frame HandleWrite(const std::string& workspace, const json::object& header,
                         const std::string& payload) {
  Fields f(header);
  std::string rel = f.String("path", "", true);
  int64_t offset = f.Int("offset", 0);
  bool truncate = f.Bool("truncate", false);
  bool explicit_mode = f.Has("mode");
  int64_t mode = f.Int("mode", 0644);
  int64_t max_bytes = f.Int("max_bytes", -1);
  if (!f.ok()) return ErrorResponse(f.error(), "EINVAL");
  std::string path;
  if (!ResolvePath(workspace, rel, &path)) return ErrorResponse("invalid path", "EINVAL");
  if (offset < 0 || offset > kMaxOffset) return ErrorResponse("invalid offset", "EINVAL");
  if (mode < 0 || mode > 07777) return ErrorResponse("invalid mode", "EINVAL");
  if (max_bytes >= 0 && offset + static_cast<int64_t>(payload.size()) > max_bytes) {
    return ErrorResponse("file would exceed " + std::to_string(max_bytes) + " bytes", "EFBIG");
  }

  // O_NONBLOCK: opening a FIFO must never block the agent; fstat then refuses it.
  const int flags = O_WRONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY;
  const mode_t create_mode = static_cast<mode_t>(mode);
  bool kernel_fs = false;
  Fd fd(OpenSandboxPath(path, flags, 0, &kernel_fs));
  bool created = false;
  for (int attempt = 0; !fd && attempt < 3; ++attempt) {
    if (errno != ENOENT || kernel_fs) return OpenError("open", rel, errno, kernel_fs);
    fd.reset(OpenSandboxPath(path, flags | O_CREAT | O_EXCL, create_mode, &kernel_fs));
    if (fd) {
      created = true;
      break;
    }
    if (errno == ENOENT && !kernel_fs) {
      int err = MakeParents(path);
      if (err) return ErrnoResponse("mkdir parents of " + rel, err);
      fd.reset(OpenSandboxPath(path, flags | O_CREAT | O_EXCL, create_mode, &kernel_fs));
      if (fd) {
        created = true;
        break;
      }
    }
    if (errno == EEXIST && !kernel_fs) {
      fd.reset(OpenSandboxPath(path, flags, 0, &kernel_fs));  // lost a race: open it
    }
  }
  if (!fd) return OpenError("open", rel, errno, kernel_fs);
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return ErrnoResponse("fstat " + rel, errno);
  if (!S_ISREG(st.st_mode)) return NotRegular(rel, st);
  if ((created || explicit_mode) && fchmod(fd.get(), static_cast<mode_t>(mode)) != 0) {
    return ErrnoResponse("chmod " + rel, errno);
  }
  if (truncate && ftruncate(fd.get(), 0) != 0) return ErrnoResponse("truncate " + rel, errno);
  size_t done = 0;
  while (done < payload.size()) {
    ssize_t n = pwrite(fd.get(), payload.data() + done, payload.size() - done,
                       static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoResponse("write " + rel, errno);
    }
    done += static_cast<size_t>(n);
  }
  if (fstat(fd.get(), &st) != 0) return ErrnoResponse("fstat " + rel, errno);
  proto::Frame resp = OkResponse();
  resp.header["size"] = static_cast<int64_t>(st.st_size);
  return resp;
}

proto::Frame HandleRead(const std::string& workspace, const json::object& header) {
  Fields f(header);
  std::string rel = f.String("path", "", true);
  int64_t offset = f.Int("offset", 0);
  int64_t length = f.Int("length", proto::kMaxPayloadBytes);
  if (!f.ok()) return ErrorResponse(f.error(), "EINVAL");
  std::string path;
  if (!ResolvePath(workspace, rel, &path)) return ErrorResponse("invalid path", "EINVAL");
  if (offset < 0 || offset > kMaxOffset) return ErrorResponse("invalid offset", "EINVAL");
  if (length < 0 || length > proto::kMaxPayloadBytes) {
    return ErrorResponse("length must be between 0 and 16 MiB", "EINVAL");
  }
  // O_NONBLOCK: opening a FIFO without a writer must not hang; fstat then refuses it.
  bool kernel_fs = false;
  Fd fd(OpenSandboxPath(path, O_RDONLY | O_NONBLOCK | O_NOCTTY, 0, &kernel_fs));
  if (!fd) return OpenError("open", rel, errno, kernel_fs);
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return ErrnoResponse("fstat " + rel, errno);
  if (!S_ISREG(st.st_mode)) return NotRegular(rel, st);
  int64_t size = st.st_size;
  int64_t want = std::clamp<int64_t>(size - offset, 0, length);
  proto::Frame resp = OkResponse();
  resp.payload.resize(static_cast<size_t>(want));
  size_t got = 0;
  while (got < resp.payload.size()) {
    ssize_t n = pread(fd.get(), resp.payload.data() + got, resp.payload.size() - got,
                      static_cast<off_t>(offset + got));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoResponse("read " + rel, errno);
    }
    if (n == 0) break;  // shrank under us
    got += static_cast<size_t>(n);
  }
  resp.payload.resize(got);
  resp.header["size"] = size;
  resp.header["eof"] = offset + static_cast<int64_t>(got) >= size;
  return resp;
}

proto::Frame HandleList(const std::string& workspace, const json::object& header) {
  Fields f(header);
  std::string rel = f.String("path", ".");
  if (!f.ok()) return ErrorResponse(f.error(), "EINVAL");
  if (rel.empty()) rel = ".";
  std::string path;
  if (!ResolvePath(workspace, rel, &path)) return ErrorResponse("invalid path", "EINVAL");
  bool kernel_fs = false;
  Fd fd(OpenSandboxPath(path, O_RDONLY | O_DIRECTORY | O_NONBLOCK, 0, &kernel_fs));
  if (!fd) return OpenError("open", rel, errno, kernel_fs);
  // The directory actually opened, not a second resolution of `path`.
  char resolved[PATH_MAX];
  std::string self = "/proc/self/fd/" + std::to_string(fd.get());
  ssize_t len = readlink(self.c_str(), resolved, sizeof resolved - 1);
  std::string abs = len > 0 ? std::string(resolved, static_cast<size_t>(len)) : path;
  int dirfd = fd.get();
  DIR* dir = fdopendir(fd.release());
  if (!dir) {
    int err = errno;
    close(dirfd);
    return ErrnoResponse("opendir " + rel, err);
  }
  std::map<std::string, json::object> sorted;
  while (dirent* e = readdir(dir)) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    struct stat st;
    json::object o;
    if (fstatat(dirfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
      o = StatObject(st);
    } else {
      o["type"] = "other";
      o["size"] = 0;
      o["mode"] = 0;
      o["mtime_ms"] = 0;
    }
    o["name"] = esb::SanitizeUtf8(e->d_name);
    sorted.emplace(e->d_name, std::move(o));
  }
  closedir(dir);
  json::array entries;
  size_t bytes = 0;
  bool truncated = false;
  for (auto& [name, o] : sorted) {
    bytes += json::serialize(o).size() + 1;
    if (bytes > proto::kMaxListPayloadBytes - 1024 || entries.size() >= proto::kMaxListEntries) {
      truncated = true;
      break;
    }
    entries.push_back(std::move(o));
  }
  proto::Frame resp = OkResponse();
  resp.header["path"] = esb::SanitizeUtf8(abs);
  if (truncated) resp.header["truncated"] = true;
  if (bytes > kMaxEntriesInHeader) {
    // Extension to the documented format: large listings do not fit the 64 KiB header.
    resp.header["entries_in_payload"] = true;
    resp.payload = json::serialize(entries);
  } else {
    resp.header["entries"] = std::move(entries);
  }
  return resp;
}

proto::Frame HandleStat(const std::string& workspace, const json::object& header) {
  Fields f(header);
  std::string rel = f.String("path", "", true);
  if (!f.ok()) return ErrorResponse(f.error(), "EINVAL");
  std::string path;
  if (!ResolvePath(workspace, rel, &path)) return ErrorResponse("invalid path", "EINVAL");
  // O_PATH: stat needs no read permission; a dangling symlink is reported as the link itself.
  bool kernel_fs = false;
  Fd fd(OpenSandboxPath(path, O_PATH, 0, &kernel_fs));
  if (!fd && errno == ENOENT && !kernel_fs) {
    int err = errno;
    fd.reset(OpenSandboxPath(path, O_PATH | O_NOFOLLOW, 0, &kernel_fs));
    if (!fd && !kernel_fs) errno = err;
  }
  if (!fd) return OpenError("stat", rel, errno, kernel_fs);
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return ErrnoResponse("stat " + rel, errno);
  proto::Frame resp = OkResponse();
  for (auto& kv : StatObject(st)) resp.header[kv.key()] = kv.value();
  return resp;
}

namespace {
proto::Frame FsErrorResponse(const FsResult& r) {
  return ErrorResponse(r.message, ErrnoName(r.err));
}
}  // namespace

proto::Frame HandleMkdir(const FsRoots& roots, const json::object& header) {
  Fields f(header);
  std::string path = f.String("path", "", true);
  if (!f.ok()) return ErrorResponse(f.error(), "EINVAL");
  bool created = false;
  if (FsResult r = MakeDirs(roots, path, &created); !r.ok()) return FsErrorResponse(r);
  proto::Frame resp = OkResponse();
  resp.header["created"] = created;
  return resp;
}

proto::Frame HandleRemove(const FsRoots& roots, const json::object& header) {
  Fields f(header);
  std::string path = f.String("path", "", true);
  bool recursive = f.Bool("recursive", false);
  if (!f.ok()) return ErrorResponse(f.error(), "EINVAL");
  int64_t removed = 0;
  if (FsResult r = Remove(roots, path, recursive, RemoveLimits{}, &removed); !r.ok()) {
    return FsErrorResponse(r);
  }
  proto::Frame resp = OkResponse();
  resp.header["removed"] = removed;
  return resp;
}

proto::Frame HandleRename(const FsRoots& roots, const json::object& header) {
  Fields f(header);
  std::string source = f.String("source", "", true);
  std::string destination = f.String("destination", "", true);
  bool overwrite = f.Bool("overwrite", false);
  if (!f.ok()) return ErrorResponse(f.error(), "EINVAL");
  if (FsResult r = Rename(roots, source, destination, overwrite); !r.ok()) {
    return FsErrorResponse(r);
  }
  return OkResponse();
}

int64_t CountProcesses() {
  pid_t self = getpid();
  std::map<pid_t, pid_t> parent = ReadParentMap();
  if (parent.empty()) return -1;
  if (self == 1) return static_cast<int64_t>(parent.size());
  int64_t count = 0;
  for (const auto& [pid, ppid] : parent) {
    pid_t p = pid;
    for (int hops = 0; hops < 4096 && p > 1; ++hops) {
      if (p == self) {
        ++count;
        break;
      }
      auto it = parent.find(p);
      if (it == parent.end()) break;
      p = it->second;
    }
  }
  return count;
}

int64_t DiskUsage(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return 0;
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    return 0;
  }
  int64_t total = int64_t{st.st_blocks} * 512;
  std::set<std::pair<dev_t, ino_t>> seen;
  DiskUsageAt(fd, st.st_dev, 0, &seen, &total);
  return total;
}

proto::Frame HandleStats(const std::string& workspace, int64_t start_ms) {
  proto::Frame resp = OkResponse();
  resp.header["processes"] = CountProcesses();
  resp.header["workspace_bytes"] = DiskUsage(workspace);
  resp.header["uptime_ms"] = proto::MonotonicMs() - start_ms;
  return resp;
}

}  // namespace esb::agent

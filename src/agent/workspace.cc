#include "agent/workspace.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <set>
#include <string_view>

#include "agent/handlers.h"
#include "agent/util.h"
#include "common/utf8.h"

namespace esb::agent {
namespace {

FsResult Fail(int err, const std::string& message) { return FsResult{err, message}; }
FsResult FailErrno(const std::string& what, int err) {
  return Fail(err, what + ": " + strerror(err));
}

int64_t Ns(const struct timespec& ts) { return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec; }

std::string ChangeKey(const struct stat& st) {
  return std::to_string(st.st_ino) + ":" + std::to_string(Ns(st.st_ctim));
}

// chmod of the inode an O_PATH descriptor holds (never a symlink's target: the descriptor was
// opened O_NOFOLLOW and checked not to be a link).
int ChmodHeld(int fd, mode_t mode) {
  char path[40];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  // SECURITY: /proc/self/fd/N of our own O_PATH descriptor names the inode it pins, nothing
  // a sandbox can swap in after the descriptor was opened and checked.
  return chmod(path, mode);
}

// Sets the mode of entry `name` of `dirfd` itself: opened O_PATH|O_NOFOLLOW (a symlink swapped
// in is refused, never followed), checked to be the inode `expect` that was
// stat'ed, then chmod'ed through that descriptor.
FsResult ChmodNoFollow(int dirfd, const std::string& name, mode_t mode, const std::string& rel,
                       const struct stat& expect) {
  Fd fd(openat(dirfd, name.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC));
  if (!fd) return FailErrno("chmod " + rel, errno);
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return FailErrno("chmod " + rel, errno);
  if (S_ISLNK(st.st_mode)) return Fail(ELOOP, "chmod " + rel + ": is a symlink (not followed)");
  if (st.st_ino != expect.st_ino || st.st_dev != expect.st_dev)
    return Fail(EAGAIN, "chmod " + rel + ": replaced while being restored");
  if ((st.st_mode & 07777) != (mode & 07777) && ChmodHeld(fd.get(), mode) != 0)
    return FailErrno("chmod " + rel, errno);
  return {};
}

// The names in directory `dirfd` (not "." or ".."), read through a duplicate descriptor.
bool ListNames(int dirfd, std::vector<std::string>* names) {
  int fd = openat(dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return false;
  DIR* dir = fdopendir(fd);
  if (!dir) {
    close(fd);
    return false;
  }
  while (dirent* e = readdir(dir)) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    names->emplace_back(e->d_name);
  }
  closedir(dir);
  return true;
}

class Walker {
 public:
  Walker(const WalkLimits& limits, const std::function<bool(const WalkEntry&)>& want,
         WalkResult* out)
      : limits_(limits),
        want_(want),
        out_(out),
        deadline_(std::chrono::steady_clock::now() +
                  std::chrono::milliseconds(limits.time_budget_ms)) {}

  FsResult Dir(int dirfd, const std::string& prefix, int depth, dev_t dev) {
    if (depth > limits_.max_depth) {
      return Fail(ELOOP, "walk: " + prefix + " is deeper than " +
                             std::to_string(limits_.max_depth) + " levels");
    }
    if (std::chrono::steady_clock::now() >= deadline_) {
      return Fail(ETIMEDOUT, "walk: stopped after " + std::to_string(out_->entries.size()) +
                                 " entries (time limit)");
    }
    std::vector<std::string> names;
    if (!ListNames(dirfd, &names))
      return FailErrno("walk " + (prefix.empty() ? "." : prefix), errno);
    for (const std::string& name : names) {
      struct stat st;
      if (fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;  // gone
      if (!IsValidUtf8(name) || st.st_dev != dev ||
          !(S_ISREG(st.st_mode) || S_ISDIR(st.st_mode) || S_ISLNK(st.st_mode))) {
        ++out_->skipped;
        continue;
      }
      if (static_cast<int64_t>(out_->entries.size()) >= limits_.max_entries) {
        out_->truncated = true;
        return Fail(EFBIG, "walk: the workspace has more than " +
                               std::to_string(limits_.max_entries) + " entries");
      }
      WalkEntry e;
      e.path = prefix.empty() ? name : prefix + "/" + name;
      e.mode = st.st_mode & 07777;
      e.mtime_ns = Ns(st.st_mtim);
      e.change_key = ChangeKey(st);
      if (S_ISDIR(st.st_mode)) {
        e.type = 'd';
        out_->entries.push_back(std::move(e));
        // SECURITY: O_NOFOLLOW|O_DIRECTORY: a directory swapped for a symlink after the
        // fstatat is not entered.
        Fd child(openat(dirfd, name.c_str(),
                        O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
        if (!child) {
          if (errno == ELOOP || errno == ENOTDIR || errno == ENOENT) {  // swapped or gone
            out_->entries.pop_back();
            continue;
          }
          // A directory the agent cannot read (e.g. mode 0): its contents would be missing
          // from the manifest and a restore would then remove them. Fail instead.
          return FailErrno("walk: cannot read directory " + out_->entries.back().path, errno);
        }
        const std::string child_prefix = out_->entries.back().path;
        if (FsResult r = Dir(child.get(), child_prefix, depth + 1, dev); !r.ok()) return r;
        continue;
      }
      if (S_ISLNK(st.st_mode)) {
        e.type = 'l';
        char buf[PATH_MAX];
        ssize_t n = readlinkat(dirfd, name.c_str(), buf, sizeof buf);
        if (n < 0 || !IsValidUtf8(std::string_view(buf, static_cast<size_t>(n)))) {
          ++out_->skipped;
          continue;
        }
        e.target.assign(buf, static_cast<size_t>(n));
        e.size = n;
        out_->entries.push_back(std::move(e));
        continue;
      }
      e.type = 'f';
      e.size = st.st_size;
      if (want_ && st.st_size <= limits_.max_file_bytes &&
          content_bytes_ + st.st_size <= limits_.max_content_bytes && want_(e)) {
        ReadContent(dirfd, name, st, &e);
      }
      out_->entries.push_back(std::move(e));
    }
    return {};
  }

 private:
  void ReadContent(int dirfd, const std::string& name, const struct stat& st, WalkEntry* e) {
    // SECURITY: O_NOFOLLOW|O_NONBLOCK, then the same inode as stat'ed and a regular file: a
    // file swapped for a symlink or a FIFO is not read.
    Fd fd(openat(dirfd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC));
    struct stat now;
    if (!fd || fstat(fd.get(), &now) != 0 || !S_ISREG(now.st_mode) || now.st_ino != st.st_ino) {
      return;
    }
    const int64_t cap =
        std::min(limits_.max_file_bytes, limits_.max_content_bytes - content_bytes_);
    std::string data(static_cast<size_t>(std::min<int64_t>(now.st_size, cap)) + 1, '\0');
    size_t got = 0;
    while (got < data.size()) {
      ssize_t n = read(fd.get(), data.data() + got, data.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return;
      if (n == 0) break;
      got += static_cast<size_t>(n);
    }
    if (static_cast<int64_t>(got) > cap) return;  // grew past the budget: the host reads it
    data.resize(got);
    // The bytes read are what the manifest says; the key of the stat taken after reading
    // (a write during the read changes ctime: the next walk reads it again).
    e->size = static_cast<int64_t>(got);
    e->mtime_ns = Ns(now.st_mtim);
    e->change_key = ChangeKey(now);
    content_bytes_ += static_cast<int64_t>(got);
    e->content = std::move(data);
    e->has_content = true;
  }

  const WalkLimits& limits_;
  const std::function<bool(const WalkEntry&)>& want_;
  WalkResult* out_;
  int64_t content_bytes_ = 0;
  const std::chrono::steady_clock::time_point deadline_;
};

std::vector<std::string> Split(const std::string& path) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= path.size()) {
    size_t slash = path.find('/', pos);
    if (slash == std::string::npos) slash = path.size();
    out.push_back(path.substr(pos, slash - pos));
    pos = slash + 1;
  }
  return out;
}

// The directory of the first `count` components, walked from the workspace without following
// symlinks; directories on the way that the agent cannot search or write are made so (the
// pruning apply's last pass sets every mode as the manifest says).
FsResult OpenDirNoFollow(int root, const std::vector<std::string>& comps, size_t count,
                         const std::string& rel, Fd* out) {
  Fd dir(openat(root, ".", O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!dir) return FailErrno(rel, errno);
  for (size_t i = 0; i < count; ++i) {
    // SECURITY: O_NOFOLLOW|O_DIRECTORY: a symlink in a directory's place is refused; the mode
    // is then read and changed on the descriptor, so the chmod reaches this directory only.
    Fd next(openat(dir.get(), comps[i].c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!next) {
      if (errno == ENOTDIR || errno == ELOOP)
        return Fail(ENOTDIR, rel + ": '" + comps[i] + "' is not a directory");
      return FailErrno(rel, errno);
    }
    struct stat st;
    if (fstat(next.get(), &st) != 0) return FailErrno(rel, errno);
    if ((st.st_mode & 0700) != 0700) ChmodHeld(next.get(), (st.st_mode & 07777) | 0700);
    dir = std::move(next);
  }
  *out = std::move(dir);
  return {};
}

// Removes `name` in `dirfd` (a directory with everything in it), never following a link.
FsResult RemoveAt(const std::string& workspace, int dirfd, const std::string& name,
                  const std::string& rel, int64_t* removed) {
  struct stat st;
  if (fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0)
    return errno == ENOENT ? FsResult{} : FailErrno("remove " + rel, errno);
  if (!S_ISDIR(st.st_mode)) {
    // SECURITY: unlinkat removes the entry itself (a symlink, not its target).
    if (unlinkat(dirfd, name.c_str(), 0) != 0 && errno != ENOENT)
      return FailErrno("remove " + rel, errno);
    ++*removed;
    return {};
  }
  int64_t n = 0;
  FsResult r = Remove(FsRoots(workspace), rel, /*recursive=*/true, RemoveLimits{}, &n);
  *removed += n;
  return r;
}

class Pruner {
 public:
  Pruner(const std::string& workspace, const std::map<std::string, const ApplyEntry*>& want,
         dev_t dev, ApplyStats* stats)
      : workspace_(workspace), want_(want), dev_(dev), stats_(stats) {}

  FsResult Dir(int dirfd, const std::string& prefix, int depth) {
    if (depth > 256) return Fail(ELOOP, "apply: the tree is deeper than 256 levels");
    std::vector<std::string> names;
    if (!ListNames(dirfd, &names)) {
      return FailErrno("apply: list " + (prefix.empty() ? std::string(".") : prefix), errno);
    }
    for (const std::string& name : names) {
      const std::string rel = prefix.empty() ? name : prefix + "/" + name;
      struct stat st;
      if (fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
      if (st.st_dev != dev_) continue;  // a volume mounted below: not the workspace's
      auto it = want_.find(rel);
      bool keep = it != want_.end();
      if (keep) {
        const ApplyEntry& e = *it->second;
        if (e.type == 'd') keep = S_ISDIR(st.st_mode);
        if (e.type == 'f') keep = S_ISREG(st.st_mode);
        if (e.type == 'l') {
          keep = false;
          if (S_ISLNK(st.st_mode)) {
            char buf[PATH_MAX];
            ssize_t n = readlinkat(dirfd, name.c_str(), buf, sizeof buf);
            keep = n >= 0 && std::string_view(buf, static_cast<size_t>(n)) == e.target;
          }
        }
      }
      if (!keep) {
        if (FsResult r = RemoveAt(workspace_, dirfd, name, rel, &stats_->removed); !r.ok())
          return r;
        continue;
      }
      if (S_ISDIR(st.st_mode)) {
        // SECURITY: the directory is pinned (O_PATH|O_NOFOLLOW|O_DIRECTORY) before its mode is
        // changed and it is read: a symlink swapped in is neither chmod'ed through nor entered.
        Fd pinned(openat(dirfd, name.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
        if (!pinned) return FailErrno("apply: open " + rel, errno);
        if ((st.st_mode & 0700) != 0700) ChmodHeld(pinned.get(), (st.st_mode & 07777) | 0700);
        Fd child(openat(pinned.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
        if (!child) return FailErrno("apply: open " + rel, errno);
        if (FsResult r = Dir(child.get(), rel, depth + 1); !r.ok()) return r;
      }
    }
    return {};
  }

 private:
  const std::string& workspace_;
  const std::map<std::string, const ApplyEntry*>& want_;
  const dev_t dev_;
  ApplyStats* stats_;
};

FsResult WriteAll(int fd, const ApplyEntry& e) {
  size_t done = 0;
  while (done < e.data.size()) {
    ssize_t n = pwrite(fd, e.data.data() + done, e.data.size() - done,
                       static_cast<off_t>(e.offset + static_cast<int64_t>(done)));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return FailErrno("apply: write " + e.path, errno);
    done += static_cast<size_t>(n);
  }
  return {};
}

// Writes a file's bytes. Offset 0 (a whole file, or its first chunk) makes a new file next to
// it and renames it over the name: a file is replaced, never rewritten in place, so another
// hard link to the old inode (made by sandbox code, possibly to a file elsewhere on the same
// file system) keeps its contents. A later chunk appends to the file the first one made, and
// is refused when that file has gained another link in between.
FsResult WriteFileAt(int dirfd, const ApplyEntry& e, const std::string& name) {
  if (e.offset > 0) {
    // SECURITY: O_NOFOLLOW on the last component, below a directory reached without following
    // links: a symlink in the file's place is refused (ELOOP), never written through.
    Fd fd(openat(dirfd, name.c_str(), O_WRONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC));
    if (!fd) return FailErrno("apply: write " + e.path, errno);
    struct stat st;
    if (fstat(fd.get(), &st) != 0) return FailErrno("apply: write " + e.path, errno);
    if (!S_ISREG(st.st_mode)) return Fail(EINVAL, "apply: " + e.path + " is not a regular file");
    // SECURITY: a second link would be written through (the first chunk made this inode).
    if (st.st_nlink != 1)
      return Fail(EMLINK, "apply: " + e.path + " was hard-linked while being restored");
    return WriteAll(fd.get(), e);
  }
  std::string tmp;
  Fd fd;
  for (int attempt = 0; attempt < 16 && !fd; ++attempt) {
    uint64_t r = 0;
    if (getrandom(&r, sizeof r, 0) != sizeof r) r ^= static_cast<uint64_t>(attempt) << 32;
    char buf[40];
    snprintf(buf, sizeof buf, ".esb-apply-%016llx", static_cast<unsigned long long>(r));
    tmp = buf;
    // SECURITY: O_CREAT|O_EXCL|O_NOFOLLOW: a new inode of ours, never an existing name.
    fd.reset(openat(dirfd, tmp.c_str(),
                    O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NOCTTY | O_CLOEXEC, 0600));
    if (!fd && errno != EEXIST) return FailErrno("apply: write " + e.path, errno);
  }
  if (!fd) return FailErrno("apply: write " + e.path, EEXIST);
  FsResult r = WriteAll(fd.get(), e);
  fd.reset();
  // renameat replaces the entry `name` (a file, or a symlink as a link); a directory there
  // fails (EISDIR) and the caller reports it.
  if (r.ok() && renameat(dirfd, tmp.c_str(), dirfd, name.c_str()) != 0)
    r = FailErrno("apply: write " + e.path, errno);
  if (!r.ok()) unlinkat(dirfd, tmp.c_str(), 0);
  return r;
}

}  // namespace

bool ValidManifestPath(const std::string& path) {
  if (path.empty() || path.size() >= PATH_MAX || path.find('\0') != std::string::npos) return false;
  for (const std::string& c : Split(path)) {
    if (c.empty() || c == "." || c == ".." || c.size() > NAME_MAX) return false;
  }
  return true;
}

WalkResult WalkWorkspace(const std::string& workspace, const WalkLimits& limits,
                         const std::function<bool(const WalkEntry&)>& want_content) {
  WalkResult out;
  // SECURITY: the walk starts at the configured workspace (a mount esbd made).
  Fd root(open(workspace.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  struct stat st;
  if (!root || fstat(root.get(), &st) != 0) {
    out.status = FailErrno("walk: open " + workspace, errno);
    return out;
  }
  Walker walker(limits, want_content, &out);
  out.status = walker.Dir(root.get(), "", 0, st.st_dev);
  std::sort(out.entries.begin(), out.entries.end(),
            [](const WalkEntry& a, const WalkEntry& b) { return a.path < b.path; });
  return out;
}

FsResult ApplyWorkspace(const std::string& workspace, std::vector<ApplyEntry>& entries, bool prune,
                        bool finish, ApplyStats* stats) {
  *stats = {};
  std::map<std::string, const ApplyEntry*> want;
  for (size_t i = 0; i < entries.size(); ++i) {
    const ApplyEntry& e = entries[i];
    if (!ValidManifestPath(e.path)) return Fail(EINVAL, "apply: invalid path '" + e.path + "'");
    if (e.type != 'f' && e.type != 'd' && e.type != 'l')
      return Fail(EINVAL, "apply: " + e.path + ": invalid type");
    if (e.mode > 07777 || e.offset < 0 || e.size < 0)
      return Fail(EINVAL, "apply: " + e.path + ": invalid mode, size or offset");
    if (e.type == 'l' && (e.target.empty() || e.target.size() >= PATH_MAX ||
                          e.target.find('\0') != std::string::npos))
      return Fail(EINVAL, "apply: " + e.path + ": invalid symlink target");
    if (i > 0 && !(entries[i - 1].path < e.path)) {
      // Chunks of one file may repeat its path only in calls that neither prune nor finish.
      if (prune || finish || entries[i - 1].path != e.path)
        return Fail(EINVAL, "apply: entries must be sorted by path, each once: " + e.path);
    }
    want[e.path] = &e;
  }
  // SECURITY: every entry below is reached from the configured workspace without following a
  // symlink.
  Fd root(open(workspace.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  struct stat root_st;
  if (!root || fstat(root.get(), &root_st) != 0)
    return FailErrno("apply: open " + workspace, errno);
  if (prune) {
    // A directory listed with a file or symlink at its path is replaced, and so on: what is
    // not wanted as it is goes first.
    Pruner pruner(workspace, want, root_st.st_dev, stats);
    if (FsResult r = pruner.Dir(root.get(), "", 0); !r.ok()) return r;
  }
  // Parent directory descriptors are reused while consecutive entries share them.
  std::string cached_parent = "\x01";
  Fd parent;
  // Makes `parent` the directory holding `path` (without following a symlink); *name: the
  // last component.
  auto open_parent = [&](const std::string& path, std::string* name) -> FsResult {
    std::vector<std::string> comps = Split(path);
    *name = comps.back();
    const std::string parent_path = path.substr(0, path.size() - name->size());
    if (parent_path != cached_parent) {
      if (FsResult r = OpenDirNoFollow(root.get(), comps, comps.size() - 1, path, &parent);
          !r.ok()) {
        return r;
      }
      cached_parent = parent_path;
    }
    return {};
  };
  for (const ApplyEntry& e : entries) {
    std::string name;
    if (FsResult r = open_parent(e.path, &name); !r.ok()) return r;
    struct stat st;
    const bool exists = fstatat(parent.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0;
    if (e.type == 'd') {
      if (exists && S_ISDIR(st.st_mode)) continue;
      if (exists) return Fail(EEXIST, "apply: " + e.path + " exists and is not a directory");
      if (mkdirat(parent.get(), name.c_str(), 0700) != 0)
        return FailErrno("apply: mkdir " + e.path, errno);
      ++stats->created;
    } else if (e.type == 'l') {
      if (exists && S_ISLNK(st.st_mode)) {
        char buf[PATH_MAX];
        ssize_t n = readlinkat(parent.get(), name.c_str(), buf, sizeof buf);
        if (n >= 0 && std::string_view(buf, static_cast<size_t>(n)) == e.target) continue;
      }
      if (exists && S_ISDIR(st.st_mode))
        return Fail(EEXIST, "apply: " + e.path + " exists and is a directory");
      if (exists && unlinkat(parent.get(), name.c_str(), 0) != 0)
        return FailErrno("apply: replace " + e.path, errno);
      // SECURITY: symlinkat only writes the link text; nothing is resolved.
      if (symlinkat(e.target.c_str(), parent.get(), name.c_str()) != 0)
        return FailErrno("apply: symlink " + e.path, errno);
      ++stats->created;
    } else if (e.has_data) {
      if (exists && !S_ISREG(st.st_mode))
        return Fail(EEXIST, "apply: " + e.path + " exists and is not a regular file");
      if (FsResult r = WriteFileAt(parent.get(), e, name); !r.ok()) return r;
      ++stats->written;
    } else if (finish) {
      if (!exists || !S_ISREG(st.st_mode))
        return Fail(ENOENT, "apply: " + e.path + " is not there and no contents were sent");
    }
  }
  if (!finish) return {};
  // Modes, sizes and mtimes last (deepest first, so a directory's mtime is set after its
  // entries changed), each through its parent's descriptor without following links.
  cached_parent = "\x01";
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    const ApplyEntry& e = *it;
    std::string name;
    if (FsResult r = open_parent(e.path, &name); !r.ok()) return r;
    struct stat st;
    if (fstatat(parent.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0)
      return FailErrno("apply: " + e.path, errno);
    if (e.type == 'f' && st.st_size != e.size) {
      return Fail(EIO, "apply: " + e.path + " has " + std::to_string(st.st_size) +
                           " bytes, the manifest says " + std::to_string(e.size));
    }
    if (e.type != 'l' && (st.st_mode & 07777) != e.mode) {
      // SECURITY: through a descriptor of the inode stat'ed above, never by name (a symlink
      // swapped in meanwhile would have its target chmod'ed).
      if (FsResult r = ChmodNoFollow(parent.get(), name, e.mode, "apply: " + e.path, st); !r.ok()) {
        return r;
      }
    }
    // Only what differs: a utimensat or chmod changes the ctime, and with it the change key
    // that lets the next capture and restore skip an unchanged file.
    const int64_t mtime_now = int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
    if (e.mtime_ns > 0 && mtime_now != e.mtime_ns) {
      struct timespec times[2];
      times[0].tv_sec = 0;
      times[0].tv_nsec = UTIME_OMIT;
      times[1].tv_sec = e.mtime_ns / 1000000000;
      times[1].tv_nsec = e.mtime_ns % 1000000000;
      utimensat(parent.get(), name.c_str(), times, AT_SYMLINK_NOFOLLOW);  // best effort
    }
  }
  return {};
}

namespace {
namespace json = boost::json;

constexpr int64_t kMaxWalkEntries = 100000;
// A walk's answer is one frame (≤ 16 MiB of payload): the manifest's JSON and the contents.
constexpr int64_t kMaxWalkContentBytes = 8 << 20;
constexpr size_t kMaxManifestJson = 6 << 20;

std::string CacheKey(const WalkEntry& e) {
  return std::string(1, e.type) + "|" + e.change_key + "|" + std::to_string(e.size) + "|" +
         std::to_string(e.mtime_ns);
}

}  // namespace

std::string WalkCache::Remember(const std::vector<WalkEntry>& entries) {
  keys_.clear();
  for (const WalkEntry& e : entries) keys_.emplace(e.path, CacheKey(e));
  token_ = std::to_string(getpid()) + "-" + std::to_string(proto::MonotonicMs()) + "-" +
           std::to_string(++counter_);
  return token_;
}

bool WalkCache::Changed(const std::string& token, const WalkEntry& e) const {
  if (token.empty() || token != token_) return true;
  auto it = keys_.find(e.path);
  return it == keys_.end() || it->second != CacheKey(e);
}

proto::Frame HandleWalk(const std::string& workspace, const json::object& header,
                        WalkCache* cache) {
  Fields f(header);
  const std::string base = f.String("base", "");
  const bool contents = f.Bool("contents", true);
  WalkLimits limits;
  limits.max_entries = f.Int("max_entries", 50000);
  limits.max_content_bytes = f.Int("max_content_bytes", 8 << 20);
  limits.max_file_bytes = f.Int("max_file_bytes", 8 << 20);
  if (!f.ok()) return ErrorResponse(f.error(), "EINVAL");
  if (limits.max_entries < 0 || limits.max_entries > kMaxWalkEntries ||
      limits.max_content_bytes < 0 || limits.max_content_bytes > kMaxWalkContentBytes ||
      limits.max_file_bytes < 0) {
    return ErrorResponse("walk: a limit is out of range", "EINVAL");
  }
  std::lock_guard<std::mutex> lock(cache->mu());
  WalkResult walk =
      WalkWorkspace(workspace, limits,
                    contents ? std::function<bool(const WalkEntry&)>(
                                   [&](const WalkEntry& e) { return cache->Changed(base, e); })
                             : nullptr);
  if (!walk.status.ok()) return ErrorResponse(walk.status.message, ErrnoName(walk.status.err));
  json::array manifest;
  manifest.reserve(walk.entries.size());
  std::string data;
  for (const WalkEntry& e : walk.entries) {
    json::array row;
    row.reserve(8);
    row.emplace_back(e.path);
    row.emplace_back(std::string(1, e.type));
    row.emplace_back(static_cast<int64_t>(e.mode));
    row.emplace_back(e.size);
    row.emplace_back(e.mtime_ns);
    row.emplace_back(e.change_key);
    row.emplace_back(e.target);
    row.emplace_back(e.has_content ? static_cast<int64_t>(e.content.size()) : int64_t{-1});
    manifest.emplace_back(std::move(row));
    if (e.has_content) data += e.content;
  }
  std::string text = json::serialize(manifest);
  if (text.size() > kMaxManifestJson) {
    return ErrorResponse(
        "walk: the manifest is larger than " + std::to_string(kMaxManifestJson) + " bytes of JSON",
        "EFBIG");
  }
  proto::Frame resp = OkResponse();
  resp.header["walk"] = cache->Remember(walk.entries);
  resp.header["manifest_bytes"] = static_cast<int64_t>(text.size());
  resp.header["count"] = static_cast<int64_t>(walk.entries.size());
  resp.header["skipped"] = walk.skipped;
  resp.header["content_bytes"] = static_cast<int64_t>(data.size());
  resp.payload = std::move(text);
  resp.payload += data;
  return resp;
}

proto::Frame HandleApply(const std::string& workspace, const json::object& header,
                         const std::string& payload) {
  Fields f(header);
  const int64_t manifest_bytes = f.Int("manifest_bytes", 0, true);
  const bool prune = f.Bool("prune", false);
  const bool finish = f.Bool("finish", prune);
  if (!f.ok()) return ErrorResponse(f.error(), "EINVAL");
  if (manifest_bytes < 0 || manifest_bytes > static_cast<int64_t>(payload.size()))
    return ErrorResponse("apply: manifest_bytes is out of range", "EINVAL");
  boost::system::error_code ec;
  json::value v = json::parse(std::string_view(payload).substr(0, manifest_bytes), ec);
  if (ec || !v.is_array())
    return ErrorResponse("apply: the manifest is not a JSON array", "EINVAL");
  std::vector<ApplyEntry> entries;
  entries.reserve(v.as_array().size());
  size_t data_at = static_cast<size_t>(manifest_bytes);
  for (const json::value& row_value : v.as_array()) {
    const json::array* row = row_value.if_array();
    if (!row || row->size() != 8 || !(*row)[0].is_string() || !(*row)[1].is_string() ||
        !(*row)[2].is_int64() || !(*row)[3].is_int64() || !(*row)[4].is_int64() ||
        !(*row)[5].is_string() || !(*row)[6].is_int64() || !(*row)[7].is_int64()) {
      return ErrorResponse(
          "apply: a manifest entry is not [path, type, mode, size, mtime_ns, "
          "target, data_len, offset]",
          "EINVAL");
    }
    ApplyEntry e;
    e.path = std::string((*row)[0].as_string());
    const std::string type((*row)[1].as_string());
    e.type = type.size() == 1 ? type[0] : '?';
    const int64_t mode = (*row)[2].as_int64();
    e.mode = mode >= 0 && mode <= 07777 ? static_cast<uint32_t>(mode) : 010000;
    e.size = (*row)[3].as_int64();
    e.mtime_ns = (*row)[4].as_int64();
    e.target = std::string((*row)[5].as_string());
    const int64_t len = (*row)[6].as_int64();
    e.offset = (*row)[7].as_int64();
    if (len >= 0) {
      if (static_cast<uint64_t>(len) > payload.size() - data_at)
        return ErrorResponse("apply: the data is shorter than the manifest says", "EINVAL");
      e.has_data = true;
      e.data.assign(payload, data_at, static_cast<size_t>(len));
      data_at += static_cast<size_t>(len);
    }
    entries.push_back(std::move(e));
  }
  if (data_at != payload.size())
    return ErrorResponse("apply: the data is longer than the manifest says", "EINVAL");
  ApplyStats stats;
  FsResult r = ApplyWorkspace(workspace, entries, prune, finish, &stats);
  if (!r.ok()) return ErrorResponse(r.message, ErrnoName(r.err));
  proto::Frame resp = OkResponse();
  resp.header["removed"] = stats.removed;
  resp.header["written"] = stats.written;
  resp.header["created"] = stats.created;
  return resp;
}

}  // namespace esb::agent

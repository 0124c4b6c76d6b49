#include "agent/fs_ops.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <string_view>

#include "agent/util.h"

namespace esb::agent {
namespace {

FsResult Fail(int err, const std::string& message) { return FsResult{err, message}; }
FsResult FailErrno(const std::string& what, int err) {
  return Fail(err, what + ": " + strerror(err));
}

// The directory `components` name, walked from the workspace without following any symlink.
// The workspace itself for no components.
FsResult OpenDir(const std::string& workspace, const std::vector<std::string>& components,
                 size_t count, const std::string& rel, Fd* out) {
  // SECURITY: the walk starts at the configured workspace (a mount esbd made, not a path the
  // sandbox chose); everything below is reached one component at a time with O_NOFOLLOW.
  Fd dir(open(workspace.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!dir) return FailErrno("open workspace " + workspace, errno);
  for (size_t i = 0; i < count; ++i) {
    // SECURITY: O_NOFOLLOW with O_PATH opens a symlink itself instead of following it; it is
    // then refused below, so no component can lead out of the workspace (or into /proc).
    Fd next(openat(dir.get(), components[i].c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC));
    if (!next) return FailErrno(rel, errno);
    struct stat st;
    if (fstat(next.get(), &st) != 0) return FailErrno(rel, errno);
    if (S_ISLNK(st.st_mode)) {
      return Fail(ELOOP, rel + ": refused: '" + components[i] +
                             "' is a symlink (the files API never follows symlinks)");
    }
    if (!S_ISDIR(st.st_mode))
      return Fail(ENOTDIR, rel + ": '" + components[i] + "' is not a directory");
    dir = std::move(next);
  }
  struct statfs sfs;
  if (fstatfs(dir.get(), &sfs) != 0) return FailErrno(rel, errno);
  // SECURITY: kernel interfaces are never sandbox files, even if one were mounted below.
  if (OnKernelFs(sfs.f_type))
    return Fail(EACCES, rel + ": refused: /proc and /sys are not sandbox files");
  *out = std::move(dir);
  return {};
}

// The parent directory of a path with at least one component.
FsResult OpenParent(const std::string& workspace, const std::vector<std::string>& components,
                    const std::string& rel, Fd* out) {
  return OpenDir(workspace, components, components.size() - 1, rel, out);
}

// The components of `comps` below `root` (absolute and normalised); false if not below it.
bool Below(const std::string& root, const std::vector<std::string>& comps,
           std::vector<std::string>* rest) {
  std::vector<std::string> base;
  for (size_t pos = 0; pos < root.size();) {
    size_t slash = root.find('/', pos);
    if (slash == std::string::npos) slash = root.size();
    if (slash > pos) base.push_back(root.substr(pos, slash - pos));
    pos = slash + 1;
  }
  if (comps.size() < base.size() || !std::equal(base.begin(), base.end(), comps.begin())) {
    return false;
  }
  rest->assign(comps.begin() + static_cast<std::ptrdiff_t>(base.size()), comps.end());
  return true;
}

class RemoveWalk {
 public:
  RemoveWalk(const RemoveLimits& limits, const std::string& rel, int64_t* removed)
      : limits_(limits),
        rel_(rel),
        removed_(removed),
        deadline_(std::chrono::steady_clock::now() +
                  std::chrono::milliseconds(limits.time_budget_ms)) {}

  // Removes the entry `name` of the directory `parent` (a directory: with its contents).
  FsResult Entry(int parent, const char* name, int depth) {
    if (std::chrono::steady_clock::now() >= deadline_) {
      return Fail(ETIMEDOUT, "remove " + rel_ + ": stopped after " + std::to_string(*removed_) +
                                 " entries (time limit " +
                                 std::to_string(limits_.time_budget_ms / 1000) +
                                 " s); the rest is still there: call again to continue");
    }
    struct stat st;
    if (fstatat(parent, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) return {};  // removed concurrently
      return FailErrno("remove " + rel_, errno);
    }
    if (S_ISDIR(st.st_mode)) {
      if (depth >= limits_.max_depth) {
        return Fail(ELOOP, "remove " + rel_ + ": refused: the tree is deeper than " +
                               std::to_string(limits_.max_depth) + " levels");
      }
      // SECURITY: O_NOFOLLOW: a directory swapped for a symlink after the fstatat is not
      // entered (ELOOP/ENOTDIR); it is unlinked below like any other non-directory.
      Fd dir(openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
      if (dir) {
        if (FsResult r = Contents(std::move(dir), depth + 1); !r.ok()) return r;
        if (unlinkat(parent, name, AT_REMOVEDIR) == 0) {
          ++*removed_;
          return {};
        }
        if (errno == ENOENT) return {};
        return FailErrno("remove " + rel_, errno == EEXIST ? ENOTEMPTY : errno);
      }
      if (errno != ELOOP && errno != ENOTDIR) return FailErrno("remove " + rel_, errno);
    }
    if (unlinkat(parent, name, 0) == 0) {
      ++*removed_;
      return {};
    }
    if (errno == ENOENT) return {};
    return FailErrno("remove " + rel_, errno);
  }

 private:
  // Empties the directory `dir`. Entries are read again until a pass finds none: unlinking
  // while reading may make some file systems skip entries.
  FsResult Contents(Fd dir, int depth) {
    int fd = dir.get();
    DIR* stream = fdopendir(dir.release());
    if (!stream) {
      int err = errno;
      close(fd);
      return FailErrno("remove " + rel_, err);
    }
    FsResult result;
    for (bool again = true; again && result.ok();) {
      again = false;
      rewinddir(stream);
      errno = 0;
      while (dirent* e = readdir(stream)) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        result = Entry(fd, e->d_name, depth);
        if (!result.ok()) break;
        again = true;
      }
    }
    closedir(stream);
    return result;
  }

  const RemoveLimits& limits_;
  const std::string& rel_;
  int64_t* removed_;
  const std::chrono::steady_clock::time_point deadline_;
};

}  // namespace

FsResult WorkspaceComponents(const std::string& workspace, const std::string& path,
                             std::vector<std::string>* components) {
  components->clear();
  if (path.empty()) return Fail(EINVAL, "path must not be empty");
  if (path.find('\0') != std::string::npos) return Fail(EINVAL, "path must not contain NUL bytes");
  if (path.size() >= PATH_MAX) return Fail(ENAMETOOLONG, "path is longer than PATH_MAX");
  // The path from the root (relative ones are under the workspace), normalised on the text.
  std::string full = path[0] == '/' ? path : workspace + "/" + path;
  std::vector<std::string> comps;
  std::string_view rest = full;
  while (!rest.empty()) {
    size_t slash = rest.find('/');
    std::string_view c = rest.substr(0, slash);
    rest = slash == std::string_view::npos ? std::string_view() : rest.substr(slash + 1);
    if (c.empty() || c == ".") continue;
    if (c == "..") {
      // SECURITY: `..` is resolved on the text, never by the kernel (which would follow
      // symlinks on the way); above the root it is an escape attempt, refused, not clamped.
      if (comps.empty()) return Fail(EINVAL, path + ": refused: '..' above the root");
      comps.pop_back();
      continue;
    }
    if (c.size() > NAME_MAX) return Fail(ENAMETOOLONG, path + ": a name is longer than NAME_MAX");
    comps.emplace_back(c);
  }
  if (!Below(workspace, comps, components)) {
    return Fail(EINVAL, path + ": refused: outside " + workspace +
                            " (files/mkdir, remove and rename act only inside the workspace)");
  }
  return {};
}

FsResult RootComponents(const FsRoots& roots, const std::string& path, std::string* root,
                        std::vector<std::string>* components) {
  std::vector<std::string> all;
  // Normalised from "/": relative paths are joined to the workspace first.
  FsResult r = WorkspaceComponents(
      "/", path[0] == '/' || path.empty() ? path : roots.workspace + "/" + path, &all);
  if (!r.ok()) return r;
  // The longest root the path lies in (a volume is never inside the workspace, but be exact).
  size_t best_len = 0;
  bool found = false;
  std::vector<std::string> below;
  auto consider = [&](const std::string& candidate) {
    std::vector<std::string> rest;
    if (!Below(candidate, all, &rest)) return;
    size_t len = all.size() - rest.size();
    if (found && len <= best_len) return;
    found = true;
    best_len = len;
    *root = candidate;
    below = std::move(rest);
  };
  consider(roots.workspace);
  for (const std::string& v : roots.volumes) consider(v);
  if (!found) {
    std::string names = roots.workspace;
    for (const std::string& v : roots.volumes) names += ", " + v;
    return Fail(EINVAL, path + ": refused: outside " + names +
                            " (files/mkdir, remove and rename act only inside the workspace and"
                            " the sandbox's volumes)");
  }
  *components = std::move(below);
  return {};
}

FsResult MakeDirs(const FsRoots& roots, const std::string& path, bool* created) {
  *created = false;
  std::vector<std::string> comps;
  std::string root;
  if (FsResult r = RootComponents(roots, path, &root, &comps); !r.ok()) return r;
  Fd dir;
  if (FsResult r = OpenDir(root, comps, 0, path, &dir); !r.ok()) return r;
  for (size_t i = 0; i < comps.size(); ++i) {
    const char* name = comps[i].c_str();
    bool made = false;
    if (mkdirat(dir.get(), name, 0755) == 0) {
      made = true;
    } else if (errno != EEXIST) {
      return FailErrno("mkdir " + path, errno);
    }
    // SECURITY: the new (or existing) entry is opened with O_NOFOLLOW: a symlink in its place
    // (planted, or swapped in after the mkdirat) is refused, never entered.
    Fd next(openat(dir.get(), name, O_PATH | O_NOFOLLOW | O_CLOEXEC));
    if (!next) return FailErrno("mkdir " + path, errno);
    struct stat st;
    if (fstat(next.get(), &st) != 0) return FailErrno("mkdir " + path, errno);
    if (!S_ISDIR(st.st_mode)) {
      bool last = i + 1 == comps.size();
      std::string what = S_ISLNK(st.st_mode) ? "a symlink" : "not a directory";
      if (last) return Fail(EEXIST, "mkdir " + path + ": exists and is " + what);
      return Fail(S_ISLNK(st.st_mode) ? ELOOP : ENOTDIR,
                  "mkdir " + path + ": '" + comps[i] + "' is " + what +
                      (S_ISLNK(st.st_mode) ? " (the files API never follows symlinks)" : ""));
    }
    dir = std::move(next);
    *created = made;
  }
  struct statfs sfs;
  if (fstatfs(dir.get(), &sfs) != 0) return FailErrno("mkdir " + path, errno);
  if (OnKernelFs(sfs.f_type))
    return Fail(EACCES, path + ": refused: /proc and /sys are not sandbox files");
  return {};
}

FsResult Remove(const FsRoots& roots, const std::string& path, bool recursive,
                const RemoveLimits& limits, int64_t* removed) {
  *removed = 0;
  std::vector<std::string> comps;
  std::string root;
  if (FsResult r = RootComponents(roots, path, &root, &comps); !r.ok()) return r;
  if (comps.empty()) {
    return Fail(EINVAL, "remove " + path + ": refused: " +
                            (root == roots.workspace ? "the workspace" : "the volume " + root) +
                            " itself");
  }
  Fd parent;
  if (FsResult r = OpenParent(root, comps, path, &parent); !r.ok()) return r;
  const char* name = comps.back().c_str();
  struct stat st;
  if (fstatat(parent.get(), name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
    return FailErrno("remove " + path, errno);
  }
  if (!S_ISDIR(st.st_mode) || !recursive) {
    // SECURITY: unlinkat acts on the entry itself: a symlink is removed, not its target.
    if (unlinkat(parent.get(), name, S_ISDIR(st.st_mode) ? AT_REMOVEDIR : 0) != 0) {
      int err = errno == EEXIST ? ENOTEMPTY : errno;
      if (err == ENOTEMPTY) {
        return Fail(err, "remove " + path + ": directory not empty (use recursive)");
      }
      return FailErrno("remove " + path, err);
    }
    *removed = 1;
    return {};
  }
  RemoveWalk walk(limits, path, removed);
  return walk.Entry(parent.get(), name, 0);
}

FsResult Rename(const FsRoots& roots, const std::string& source, const std::string& destination,
                bool overwrite) {
  std::vector<std::string> from, to;
  std::string from_root, to_root;
  if (FsResult r = RootComponents(roots, source, &from_root, &from); !r.ok()) return r;
  if (FsResult r = RootComponents(roots, destination, &to_root, &to); !r.ok()) return r;
  const std::string what = "rename " + source + " -> " + destination;
  if (from.empty() || to.empty()) {
    return Fail(EINVAL, what + ": refused: a root (the workspace or a volume) itself");
  }
  if (from_root != to_root) {
    // EXDEV in spirit; told as EINVAL (a 400) like the kernel's EXDEV below.
    return Fail(EINVAL, what + ": refused (EXDEV): source and destination are in different " +
                            "roots (" + from_root + ", " + to_root + "); copy, then remove");
  }
  Fd from_dir, to_dir;
  if (FsResult r = OpenParent(from_root, from, source, &from_dir); !r.ok()) return r;
  if (FsResult r = OpenParent(to_root, to, destination, &to_dir); !r.ok()) return r;
  struct stat st;
  if (fstatat(from_dir.get(), from.back().c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    return FailErrno(what, errno);
  }
  if (!overwrite && fstatat(to_dir.get(), to.back().c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
    if (from == to) return {};
    return Fail(EEXIST, what + ": the destination exists");
  }
  // SECURITY: both names are resolved below descriptors of directories inside the workspace;
  // renameat2 follows neither last component, so a symlink is moved as a link.
  unsigned flags = overwrite ? 0 : RENAME_NOREPLACE;
  int rc = renameat2(from_dir.get(), from.back().c_str(), to_dir.get(), to.back().c_str(), flags);
  if (rc != 0 && flags != 0 && (errno == EINVAL || errno == ENOSYS)) {
    // File systems without RENAME_NOREPLACE: the destination was checked just above (a
    // concurrent creator inside the sandbox can only lose its own file).
    rc = renameat(from_dir.get(), from.back().c_str(), to_dir.get(), to.back().c_str());
  }
  if (rc != 0) {
    int err = errno;
    if (err == EXDEV)
      return Fail(EINVAL, what + ": source and destination are on different file systems");
    if (err == EEXIST && !overwrite) return Fail(EEXIST, what + ": the destination exists");
    if (err == EEXIST) err = ENOTEMPTY;
    return FailErrno(what, err);
  }
  return {};
}

}  // namespace esb::agent

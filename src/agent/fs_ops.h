// The files API's mutating operations (mkdir -p, remove, rename), confined to the workspace.
//
// Every path a request names is turned into components below the workspace first (relative
// paths are relative to it; an absolute path must lie inside it; `..` may not climb above it),
// and then walked one component at a time from a descriptor of the workspace with O_NOFOLLOW:
// no symlink is ever followed, in any component, so a link planted by sandbox code (to /etc,
// to /, to /proc/self/fd/N) can name nothing but itself. This is openat2's RESOLVE_BENEATH |
// RESOLVE_NO_SYMLINKS done by hand, so it behaves the same where openat2 is missing (gVisor,
// Linux < 5.6). The last component is acted on through its parent's descriptor (mkdirat,
// unlinkat, renameat2), which never follows it either: removing or renaming a symlink acts on
// the link, never on what it points to.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace esb::agent {

// Outcome of one operation: `err` 0 on success, else the errno the client is told (mapped to
// an HTTP answer by the host), and a message naming the operation and the request's path.
struct FsResult {
  int err = 0;
  std::string message;
  bool ok() const { return err == 0; }
};

// The roots the files API acts in: the workspace, and the mount path of each persistent volume
// (absolute and normalised; told to the agent by esbd on its command line, never by the
// sandbox). A path belongs to the root that is its longest prefix; every walk starts at that
// root's descriptor and never leaves it, and a rename never crosses roots.
struct FsRoots {
  FsRoots(std::string ws) : workspace(std::move(ws)) {}  // NOLINT: implicit, workspace only
  FsRoots(const char* ws) : workspace(ws) {}             // NOLINT
  FsRoots(std::string ws, std::vector<std::string> vols)
      : workspace(std::move(ws)), volumes(std::move(vols)) {}
  std::string workspace;
  std::vector<std::string> volumes;
};

// Bounds of a recursive remove: a tree deeper than `max_depth` is refused (each level holds a
// descriptor), and a walk that has run `time_budget_ms` stops with ETIMEDOUT, leaving the rest
// (calling again continues: what was removed stays removed).
struct RemoveLimits {
  int max_depth = 256;
  int64_t time_budget_ms = 20000;
};

// The components of `path` below `workspace` (an absolute, normalised directory): relative
// paths are joined to the workspace, and the path is normalised on the text (`..` never
// reaches the kernel). Empty for the workspace itself. EINVAL for an empty path, a NUL byte,
// a `..` above the root or a result outside the workspace; ENAMETOOLONG past PATH_MAX /
// NAME_MAX.
FsResult WorkspaceComponents(const std::string& workspace, const std::string& path,
                             std::vector<std::string>* components);

// The root of `roots` that `path` lies in (relative paths are under the workspace) and its
// components below that root, as WorkspaceComponents; EINVAL when it lies in none of them.
FsResult RootComponents(const FsRoots& roots, const std::string& path, std::string* root,
                        std::vector<std::string>* components);

// mkdir -p: creates `path` and its missing parents (mode 0755 before the umask). `*created` is
// false when `path` already was a directory; EEXIST when it exists and is anything else
// (a symlink included).
FsResult MakeDirs(const FsRoots& roots, const std::string& path, bool* created);

// Removes a file, symlink or empty directory; with `recursive` a directory and everything in
// it (never leaving the tree: entries are opened below their parent's descriptor with
// O_NOFOLLOW, a symlink is unlinked). ENOENT when absent, ENOTEMPTY for a non-empty directory
// without `recursive`; a root (the workspace, a volume) itself is never removed (EINVAL).
// `*removed` counts the entries removed (also when the walk stopped at a limit).
FsResult Remove(const FsRoots& roots, const std::string& path, bool recursive,
                const RemoveLimits& limits, int64_t* removed);

// Renames `source` to `destination` (both inside the same root: across roots EXDEV). Without
// `overwrite` an existing destination is EEXIST (RENAME_NOREPLACE); with it, the usual rename(2)
// rules apply (a non-empty directory is ENOTEMPTY).
FsResult Rename(const FsRoots& roots, const std::string& source, const std::string& destination,
                bool overwrite);

}  // namespace esb::agent

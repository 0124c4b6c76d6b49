// Time travel's workspace ops (docs/agent-protocol.md "Workspace steps"): a bounded walk of
// /workspace into a manifest (with the contents of the files the caller wants), and applying
// a manifest back (remove what is not in it, write what differs, symlinks, modes, mtimes).
//
// Both never follow a symlink: every directory is entered from its parent's descriptor with
// O_NOFOLLOW, every entry is stat'ed, read, created or removed relative to its parent's
// descriptor (fstatat/openat/readlinkat/symlinkat/unlinkat with no-follow), so a link planted
// by sandbox code names only itself. Other file systems mounted below the workspace (volumes)
// are neither walked nor touched. Names that are not UTF-8 cannot be told in a JSON manifest:
// the walk skips (and counts) them, and apply removes them as extras.
#pragma once

#include <sys/types.h>

#include <boost/json.hpp>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "agent/fs_ops.h"
#include "common/protocol.h"

namespace esb::agent {

struct WalkEntry {
  std::string path;  // relative to the workspace, '/'-separated
  char type = 'f';   // 'f' file, 'd' directory, 'l' symlink
  uint32_t mode = 0;
  int64_t size = 0;
  int64_t mtime_ns = 0;
  std::string change_key;  // "<ino>:<ctime_ns>"
  std::string target;      // symlinks
  bool has_content = false;
  std::string content;  // files the caller wanted, when they fit the budget
};

struct WalkLimits {
  int64_t max_entries = 50000;
  int max_depth = 128;
  int64_t time_budget_ms = 20000;
  int64_t max_content_bytes = 8 << 20;  // all contents read together
  int64_t max_file_bytes = 8 << 20;     // one file's contents (larger ones: not read)
};

struct WalkResult {
  FsResult status;
  std::vector<WalkEntry> entries;  // sorted by path (byte order)
  int64_t skipped = 0;     // entries not reported: special files, non-UTF-8 names, mount points
  bool truncated = false;  // stopped at max_entries (status is then an error)
};

// Walks `workspace`; `want_content(entry)` (may be null: none) says whether to read a file's
// bytes (read when they fit the budgets; the entry's has_content says so).
WalkResult WalkWorkspace(const std::string& workspace, const WalkLimits& limits,
                         const std::function<bool(const WalkEntry&)>& want_content);

struct ApplyEntry {
  std::string path;
  char type = 'f';
  uint32_t mode = 0644;
  int64_t size = 0;
  int64_t mtime_ns = 0;
  std::string target;
  // Files: bytes to write at `offset` (offset 0 truncates first); !has_data: the file must
  // already be there (a regular file of `size` bytes) and is kept.
  bool has_data = false;
  int64_t offset = 0;
  std::string data;
};

struct ApplyStats {
  int64_t removed = 0;
  int64_t written = 0;  // files whose bytes were written
  int64_t created = 0;  // directories and symlinks made
};

// Puts `entries` (validated here: relative, normalised, unique, types f/d/l) into the
// workspace: directories and symlinks made, files with data written. With `prune`, whatever
// is not in `entries` as it is (extras, a wrong type, a link with another target) is removed
// first. With `finish`, every file listed without data must be there, and at the end every
// entry gets its mode and mtime and each file is checked to have its size. prune + finish in
// one call makes the workspace exactly the manifest; a restore too large for one call sends
// the manifest with prune, then the rest of the files' bytes in chunks (neither flag: a path
// may repeat, one entry per chunk), then the manifest with finish. Parents must be listed
// before their entries (sorted order).
FsResult ApplyWorkspace(const std::string& workspace, std::vector<ApplyEntry>& entries, bool prune,
                        bool finish, ApplyStats* stats);

// True for a manifest path: relative, '/'-separated, no empty, "." or ".." component, no NUL,
// within PATH_MAX / NAME_MAX.
bool ValidManifestPath(const std::string& path);

// The wire form of the ops (docs/agent-protocol.md "Workspace steps").

// The last walk's files, by path: what `walk` with `base` compares against.
class WalkCache {
 public:
  // The token of the walk that `entries` are, remembered as the base of the next one.
  std::string Remember(const std::vector<WalkEntry>& entries);
  // Whether `e` differs from the entry of the same path in walk `token` (unknown token: yes).
  bool Changed(const std::string& token, const WalkEntry& e) const;
  // Locks the cache for one walk (Changed during the walk, then Remember).
  std::mutex& mu() { return mu_; }

 private:
  std::mutex mu_;
  std::string token_;
  uint64_t counter_ = 0;
  std::map<std::string, std::string> keys_;
};

proto::Frame HandleWalk(const std::string& workspace, const boost::json::object& header,
                        WalkCache* cache);
proto::Frame HandleApply(const std::string& workspace, const boost::json::object& header,
                         const std::string& payload);

}  // namespace esb::agent

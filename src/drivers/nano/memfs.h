// In-memory file system of a nano instance: a read-only tree (the guest's standard library,
// loaded from a packed image) plus writable directories (/workspace) whose total size and file
// count are capped. Nothing in it refers to a host file: a path can only ever name a node of
// this tree, and `..` never climbs above the root.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace esb::nano {

// WASI errno values (preview1) used by the FS and the host.
enum WasiErrno : uint16_t {
  kOk = 0,
  k2Big = 1,
  kAcces = 2,
  kBadf = 8,
  kExist = 20,
  kFault = 21,
  kFbig = 22,
  kIntr = 27,
  kInval = 28,
  kIo = 29,
  kIsdir = 31,
  kLoop = 32,
  kMfile = 33,
  kNametoolong = 37,
  kNoent = 44,
  kNomem = 48,
  kNospc = 51,
  kNosys = 52,
  kNotdir = 54,
  kNotempty = 55,
  kNotsup = 58,
  kPerm = 63,
  kRofs = 69,
  kSpipe = 70,
  kXdev = 75,
  kNotcapable = 76,
};

struct FsQuota {
  int64_t max_bytes = 64 << 20;
  int64_t max_files = 4096;  // files + directories
  int64_t used_bytes = 0;
  int64_t used_files = 0;
};

// A file or directory. Shared so that an open fd keeps an unlinked file alive.
struct Node {
  enum class Type { kDir, kFile };
  Node(Type t, bool ro, std::shared_ptr<FsQuota> q);
  ~Node();
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  bool is_dir() const { return type == Type::kDir; }
  // Resizes file data, charging the quota. Returns kNospc when the cap would be exceeded.
  WasiErrno Resize(uint64_t new_size);
  // Writes at `offset` (growing the file), charging the quota.
  WasiErrno Write(uint64_t offset, std::string_view bytes);

  const Type type;
  const bool readonly;
  const uint64_t ino;
  int64_t mtime_ns = 0;
  // Bumped by every change of `data` (Resize, Write): with `ino`, the time-travel manifest's
  // change key (an unchanged key means unchanged contents, so the file is not read again).
  uint64_t generation = 0;
  std::string data;                                        // kFile
  std::map<std::string, std::shared_ptr<Node>> children;   // kDir
  std::shared_ptr<FsQuota> quota;                          // null: not charged (read-only tree)
};

class MemFs {
 public:
  explicit MemFs(FsQuota quota = {});

  std::shared_ptr<Node> root() const { return root_; }
  const FsQuota& quota() const { return *quota_; }
  void set_quota_limits(int64_t max_bytes, int64_t max_files);

  // Splits and normalises `path` relative to `base` (a list of components from the root).
  // Empty components and "." are dropped; ".." pops, and popping above the root is
  // kNotcapable. Absolute paths are accepted only when `allow_absolute` (host-side API).
  static WasiErrno Normalize(const std::vector<std::string>& base, std::string_view path,
                             bool allow_absolute, std::vector<std::string>* out);
  // Looks up a normalised path. kNoent / kNotdir on failure.
  WasiErrno Lookup(const std::vector<std::string>& comps, std::shared_ptr<Node>* out) const;
  // Looks up the parent directory of a normalised non-empty path.
  WasiErrno LookupParent(const std::vector<std::string>& comps, std::shared_ptr<Node>* parent)
      const;

  // Host-side set-up (before any guest runs): builds read-only or writable nodes.
  absl::Status AddDir(std::string_view abs_path, bool readonly);
  absl::Status AddFile(std::string_view abs_path, std::string data, bool readonly);
  // Loads a packed read-only tree (format in images/python-wasm/README.md; see memfs.cc) and
  // mounts it at `mount_point`.
  absl::Status LoadPack(std::string_view pack, std::string_view mount_point);
  // Copies a host directory tree into the FS, read-only (used for tests and unpacked stdlibs).
  absl::Status LoadHostDir(const std::string& host_dir, std::string_view mount_point);

  // Guest-visible operations on writable nodes (also used by the driver's file API).
  WasiErrno Mkdir(const std::vector<std::string>& comps);
  WasiErrno CreateFile(const std::vector<std::string>& comps, bool exclusive, bool truncate,
                       std::shared_ptr<Node>* out);
  WasiErrno Unlink(const std::vector<std::string>& comps);
  WasiErrno Rmdir(const std::vector<std::string>& comps);
  WasiErrno Rename(const std::vector<std::string>& from, const std::vector<std::string>& to);
  // mkdir -p: creates the missing directories of `comps`; `*created` is false when it already
  // was a directory (kExist when it is a file).
  WasiErrno MakeDirs(const std::vector<std::string>& comps, bool* created);
  // A file or empty directory; with `recursive` a directory and everything in it (its nodes
  // give their quota back as they go). The tree is bounded by the quota's file count.
  WasiErrno Remove(const std::vector<std::string>& comps, bool recursive);

  static int64_t NowNs();

  // Time travel (nano_driver.h CompactSnapshot): every writable node (the trees under
  // /workspace, /tmp, /.esb), pre-order, as records of path, type, mtime and contents /
  // rebuilt from such records into this FS: the writable top directories are emptied first,
  // every record is checked (path normalised, parents writable, quota charged), and any
  // error leaves an InvalidArgument (the caller discards the worker).
  std::string SaveWritable() const;
  absl::Status LoadWritable(std::string_view records);

 private:
  std::shared_ptr<FsQuota> quota_;
  std::shared_ptr<Node> root_;
};

// Normalised path as a string ("/a/b"), for messages.
std::string JoinPath(const std::vector<std::string>& comps);

}  // namespace esb::nano

#include "drivers/nano/memfs.h"

#include <dirent.h>
#include <sys/stat.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "drivers/nano/image.h"

namespace esb::nano {
namespace {

constexpr size_t kMaxPathBytes = 4096;
constexpr size_t kMaxNameBytes = 255;
constexpr size_t kMaxDepth = 128;

uint64_t NextIno() {
  static std::atomic<uint64_t> next{1};
  return next++;
}

bool IsWritableDir(const Node& n) { return n.is_dir() && !n.readonly; }

}  // namespace

Node::Node(Type t, bool ro, std::shared_ptr<FsQuota> q)
    : type(t), readonly(ro), ino(NextIno()), mtime_ns(MemFs::NowNs()), quota(std::move(q)) {
  if (quota) quota->used_files++;
}

Node::~Node() {
  if (quota) {
    quota->used_files--;
    quota->used_bytes -= static_cast<int64_t>(data.size());
  }
}

WasiErrno Node::Resize(uint64_t new_size) {
  if (is_dir()) return kIsdir;
  if (readonly) return kRofs;
  if (new_size > (uint64_t{1} << 40)) return kFbig;
  int64_t delta = static_cast<int64_t>(new_size) - static_cast<int64_t>(data.size());
  if (quota && delta > 0 && quota->used_bytes + delta > quota->max_bytes) return kNospc;
  try {
    data.resize(new_size);
  } catch (const std::bad_alloc&) {
    return kNomem;
  }
  if (quota) quota->used_bytes += delta;
  mtime_ns = MemFs::NowNs();
  generation++;
  return kOk;
}

WasiErrno Node::Write(uint64_t offset, std::string_view bytes) {
  if (is_dir()) return kIsdir;
  if (readonly) return kRofs;
  if (offset > (uint64_t{1} << 40)) return kFbig;
  uint64_t end = offset + bytes.size();
  if (end > data.size()) {
    WasiErrno e = Resize(end);
    if (e != kOk) return e;
  }
  std::memcpy(data.data() + offset, bytes.data(), bytes.size());
  mtime_ns = MemFs::NowNs();
  generation++;
  return kOk;
}

MemFs::MemFs(FsQuota quota)
    : quota_(std::make_shared<FsQuota>(quota)),
      root_(std::make_shared<Node>(Node::Type::kDir, true, nullptr)) {}

void MemFs::set_quota_limits(int64_t max_bytes, int64_t max_files) {
  quota_->max_bytes = max_bytes;
  quota_->max_files = max_files;
}

int64_t MemFs::NowNs() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

std::string JoinPath(const std::vector<std::string>& comps) {
  if (comps.empty()) return "/";
  std::string out;
  for (const auto& c : comps) absl::StrAppend(&out, "/", c);
  return out;
}

WasiErrno MemFs::Normalize(const std::vector<std::string>& base, std::string_view path,
                           bool allow_absolute, std::vector<std::string>* out) {
  if (path.size() > kMaxPathBytes) return kNametoolong;
  if (path.find('\0') != std::string_view::npos) return kInval;
  std::vector<std::string> comps;
  if (!path.empty() && path[0] == '/') {
    // SECURITY: WASI paths are relative to a directory fd; an absolute path from the guest is
    // refused rather than reinterpreted, so it can never name anything outside the preopen.
    if (!allow_absolute) return kNotcapable;
  } else {
    comps = base;
  }
  size_t start = 0;
  while (start <= path.size()) {
    size_t slash = path.find('/', start);
    if (slash == std::string_view::npos) slash = path.size();
    std::string_view c = path.substr(start, slash - start);
    start = slash + 1;
    if (c.empty() || c == ".") continue;
    if (c == "..") {
      // SECURITY: `..` at the root is an escape attempt, not a no-op.
      if (comps.empty()) return kNotcapable;
      comps.pop_back();
      continue;
    }
    if (c.size() > kMaxNameBytes) return kNametoolong;
    comps.emplace_back(c);
    if (comps.size() > kMaxDepth) return kNametoolong;
  }
  *out = std::move(comps);
  return kOk;
}

WasiErrno MemFs::Lookup(const std::vector<std::string>& comps,
                        std::shared_ptr<Node>* out) const {
  std::shared_ptr<Node> cur = root_;
  for (const auto& c : comps) {
    if (!cur->is_dir()) return kNotdir;
    auto it = cur->children.find(c);
    if (it == cur->children.end()) return kNoent;
    cur = it->second;
  }
  *out = std::move(cur);
  return kOk;
}

WasiErrno MemFs::LookupParent(const std::vector<std::string>& comps,
                              std::shared_ptr<Node>* parent) const {
  if (comps.empty()) return kInval;
  std::vector<std::string> up(comps.begin(), comps.end() - 1);
  std::shared_ptr<Node> p;
  WasiErrno e = Lookup(up, &p);
  if (e != kOk) return e;
  if (!p->is_dir()) return kNotdir;
  *parent = std::move(p);
  return kOk;
}

absl::Status MemFs::AddDir(std::string_view abs_path, bool readonly) {
  std::vector<std::string> comps;
  if (Normalize({}, abs_path, true, &comps) != kOk) {
    return absl::InvalidArgumentError(absl::StrCat("bad path ", std::string(abs_path)));
  }
  std::shared_ptr<Node> cur = root_;
  for (const auto& c : comps) {
    auto it = cur->children.find(c);
    if (it == cur->children.end()) {
      auto n = std::make_shared<Node>(Node::Type::kDir, readonly, readonly ? nullptr : quota_);
      it = cur->children.emplace(c, std::move(n)).first;
    }
    if (!it->second->is_dir()) return absl::InvalidArgumentError(absl::StrCat(c, " is a file"));
    cur = it->second;
  }
  return absl::OkStatus();
}

absl::Status MemFs::AddFile(std::string_view abs_path, std::string data, bool readonly) {
  std::vector<std::string> comps;
  if (Normalize({}, abs_path, true, &comps) != kOk || comps.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("bad path ", std::string(abs_path)));
  }
  std::vector<std::string> up(comps.begin(), comps.end() - 1);
  if (absl::Status s = AddDir(JoinPath(up), readonly); !s.ok()) return s;
  std::shared_ptr<Node> parent;
  Lookup(up, &parent);
  auto n = std::make_shared<Node>(Node::Type::kFile, readonly, readonly ? nullptr : quota_);
  n->data = std::move(data);
  if (!readonly) quota_->used_bytes += static_cast<int64_t>(n->data.size());
  parent->children[comps.back()] = std::move(n);
  return absl::OkStatus();
}

// stdlib.pack (images/python-wasm/README.md, version 1), little endian:
//   "ESBSTD01", u32 entry_count, u32 reserved; then entry_count entries of
//   u32 path_len, path (relative, '/'-separated), u32 mode (0 file, 1 dir), u64 size, data.
// Every length is checked against what is left of the buffer; paths are normalised like guest
// paths, so `..` or absolute entries cannot land outside the mount point.
absl::Status MemFs::LoadPack(std::string_view pack, std::string_view mount_point) {
  constexpr std::string_view kMagic = "ESBSTD01";
  if (pack.size() < 16 || pack.substr(0, kMagic.size()) != kMagic) {
    return absl::InvalidArgumentError("bad pack magic");
  }
  size_t pos = 8;
  auto take = [&](uint64_t n, std::string_view* out) {
    if (pack.size() - pos < n) return false;
    *out = pack.substr(pos, n);
    pos += n;
    return true;
  };
  auto u32 = [](std::string_view b) {
    uint32_t v;
    std::memcpy(&v, b.data(), 4);
    return v;
  };
  auto u64 = [](std::string_view b) {
    uint64_t v;
    std::memcpy(&v, b.data(), 8);
    return v;
  };
  std::string_view b;
  take(4, &b);
  uint32_t count = u32(b);
  take(4, &b);
  if (absl::Status s = AddDir(mount_point, true); !s.ok()) return s;
  std::vector<std::string> base;
  if (Normalize({}, mount_point, true, &base) != kOk) {
    return absl::InvalidArgumentError("bad mount point");
  }
  for (uint32_t i = 0; i < count; i++) {
    std::string_view path, data;
    if (!take(4, &b) || !take(u32(b), &path)) return absl::InvalidArgumentError("truncated pack");
    if (!take(4, &b)) return absl::InvalidArgumentError("truncated pack");
    uint32_t mode = u32(b);
    if (!take(8, &b)) return absl::InvalidArgumentError("truncated pack");
    if (!take(u64(b), &data)) return absl::InvalidArgumentError("truncated pack data");
    std::vector<std::string> comps;
    if (path.empty() || path[0] == '/' || Normalize(base, path, false, &comps) != kOk ||
        comps.size() <= base.size() || !std::equal(base.begin(), base.end(), comps.begin())) {
      return absl::InvalidArgumentError(absl::StrCat("bad pack path ", std::string(path)));
    }
    std::string full = JoinPath(comps);
    absl::Status s = mode == 1 ? AddDir(full, true) : AddFile(full, std::string(data), true);
    if (!s.ok()) return s;
  }
  if (pos != pack.size()) return absl::InvalidArgumentError("trailing bytes in pack");
  return absl::OkStatus();
}

absl::Status MemFs::LoadHostDir(const std::string& host_dir, std::string_view mount_point) {
  if (absl::Status s = AddDir(mount_point, true); !s.ok()) return s;
  DIR* d = opendir(host_dir.c_str());
  if (!d) return absl::NotFoundError(absl::StrCat("opendir ", host_dir, ": ", strerror(errno)));
  absl::Status status;
  while (dirent* de = readdir(d)) {
    std::string name = de->d_name;
    if (name == "." || name == "..") continue;
    std::string host = host_dir + "/" + name;
    std::string guest = absl::StrCat(std::string(mount_point), "/", name);
    struct stat st;
    if (lstat(host.c_str(), &st) != 0) continue;
    if (S_ISDIR(st.st_mode)) {
      status = LoadHostDir(host, guest);
    } else if (S_ISREG(st.st_mode)) {
      std::ifstream in(host, std::ios::binary);
      std::stringstream ss;
      ss << in.rdbuf();
      status = AddFile(guest, ss.str(), true);
    }  // symlinks and specials are skipped: the guest tree has none.
    if (!status.ok()) break;
  }
  closedir(d);
  return status;
}

WasiErrno MemFs::Mkdir(const std::vector<std::string>& comps) {
  std::shared_ptr<Node> parent;
  if (WasiErrno e = LookupParent(comps, &parent); e != kOk) return e;
  if (parent->children.count(comps.back())) return kExist;
  if (!IsWritableDir(*parent)) return kRofs;
  if (quota_->used_files >= quota_->max_files) return kNospc;
  parent->children[comps.back()] = std::make_shared<Node>(Node::Type::kDir, false, quota_);
  parent->mtime_ns = NowNs();
  return kOk;
}

WasiErrno MemFs::CreateFile(const std::vector<std::string>& comps, bool exclusive, bool truncate,
                            std::shared_ptr<Node>* out) {
  std::shared_ptr<Node> parent;
  if (WasiErrno e = LookupParent(comps, &parent); e != kOk) return e;
  auto it = parent->children.find(comps.back());
  if (it != parent->children.end()) {
    if (exclusive) return kExist;
    if (it->second->is_dir()) return kIsdir;
    if (truncate) {
      if (WasiErrno e = it->second->Resize(0); e != kOk) return e;
    }
    *out = it->second;
    return kOk;
  }
  if (!IsWritableDir(*parent)) return kRofs;
  if (quota_->used_files >= quota_->max_files) return kNospc;
  auto n = std::make_shared<Node>(Node::Type::kFile, false, quota_);
  parent->children[comps.back()] = n;
  parent->mtime_ns = NowNs();
  *out = std::move(n);
  return kOk;
}

WasiErrno MemFs::Unlink(const std::vector<std::string>& comps) {
  std::shared_ptr<Node> parent;
  if (WasiErrno e = LookupParent(comps, &parent); e != kOk) return e;
  auto it = parent->children.find(comps.back());
  if (it == parent->children.end()) return kNoent;
  if (it->second->is_dir()) return kIsdir;
  if (!IsWritableDir(*parent)) return kRofs;
  parent->children.erase(it);
  parent->mtime_ns = NowNs();
  return kOk;
}

WasiErrno MemFs::Rmdir(const std::vector<std::string>& comps) {
  if (comps.empty()) return kPerm;
  std::shared_ptr<Node> parent;
  if (WasiErrno e = LookupParent(comps, &parent); e != kOk) return e;
  auto it = parent->children.find(comps.back());
  if (it == parent->children.end()) return kNoent;
  if (!it->second->is_dir()) return kNotdir;
  if (!IsWritableDir(*parent) || it->second->readonly) return kRofs;
  if (!it->second->children.empty()) return kNotempty;
  parent->children.erase(it);
  parent->mtime_ns = NowNs();
  return kOk;
}

WasiErrno MemFs::Rename(const std::vector<std::string>& from, const std::vector<std::string>& to) {
  std::shared_ptr<Node> fp, tp;
  if (WasiErrno e = LookupParent(from, &fp); e != kOk) return e;
  if (WasiErrno e = LookupParent(to, &tp); e != kOk) return e;
  auto it = fp->children.find(from.back());
  if (it == fp->children.end()) return kNoent;
  if (!IsWritableDir(*fp) || !IsWritableDir(*tp) || it->second->readonly) return kRofs;
  // Moving a directory into itself would detach a cycle from the tree.
  if (it->second->is_dir() && to.size() > from.size() &&
      std::equal(from.begin(), from.end(), to.begin())) {
    return kInval;
  }
  if (from == to) return kOk;
  auto dst = tp->children.find(to.back());
  if (dst != tp->children.end()) {
    if (dst->second->is_dir() != it->second->is_dir()) {
      return dst->second->is_dir() ? kIsdir : kNotdir;
    }
    if (dst->second->is_dir() && !dst->second->children.empty()) return kNotempty;
  }
  std::shared_ptr<Node> n = it->second;
  fp->children.erase(it);
  tp->children[to.back()] = std::move(n);
  fp->mtime_ns = tp->mtime_ns = NowNs();
  return kOk;
}

WasiErrno MemFs::MakeDirs(const std::vector<std::string>& comps, bool* created) {
  *created = false;
  std::shared_ptr<Node> cur = root_;
  for (size_t i = 0; i < comps.size(); i++) {
    auto it = cur->children.find(comps[i]);
    if (it == cur->children.end()) {
      std::vector<std::string> up(comps.begin(), comps.begin() + i + 1);
      if (WasiErrno e = Mkdir(up); e != kOk) return e;
      it = cur->children.find(comps[i]);
      *created = true;
    } else if (!it->second->is_dir()) {
      return i + 1 == comps.size() ? kExist : kNotdir;
    } else {
      *created = false;
    }
    cur = it->second;
  }
  return kOk;
}

WasiErrno MemFs::Remove(const std::vector<std::string>& comps, bool recursive) {
  if (comps.empty()) return kPerm;
  std::shared_ptr<Node> parent;
  if (WasiErrno e = LookupParent(comps, &parent); e != kOk) return e;
  auto it = parent->children.find(comps.back());
  if (it == parent->children.end()) return kNoent;
  if (!it->second->is_dir()) return Unlink(comps);
  if (!recursive) return Rmdir(comps);
  if (!IsWritableDir(*parent) || it->second->readonly) return kRofs;
  parent->children.erase(it);  // the subtree's nodes release their quota when freed
  parent->mtime_ns = NowNs();
  return kOk;
}

// Records: u8 type (0 dir, 1 file), str path ("/workspace/a"), u64 mtime_ns, str data.
std::string MemFs::SaveWritable() const {
  std::string out;
  ByteWriter w(&out);
  std::vector<std::pair<std::string, std::shared_ptr<Node>>> stack = {{"", root_}};
  while (!stack.empty()) {
    auto [path, node] = stack.back();
    stack.pop_back();
    if (!node->readonly && !path.empty()) {
      w.U8(node->is_dir() ? 0 : 1);
      w.Str(path);
      w.U64(static_cast<uint64_t>(node->mtime_ns));
      w.Str(node->is_dir() ? std::string_view() : std::string_view(node->data));
    }
    if (!node->is_dir()) continue;
    // Reverse order on the stack: parents come out before their children, children in order.
    for (auto it = node->children.rbegin(); it != node->children.rend(); ++it) {
      stack.push_back({path + "/" + it->first, it->second});
    }
  }
  return out;
}

absl::Status MemFs::LoadWritable(std::string_view records) {
  auto bad = [](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("nano image: file system: ", why));
  };
  // Empty the writable top directories (writable children of read-only directories).
  std::vector<std::shared_ptr<Node>> dirs = {root_};
  while (!dirs.empty()) {
    std::shared_ptr<Node> d = dirs.back();
    dirs.pop_back();
    for (auto& [name, child] : d->children) {
      if (!child->is_dir()) continue;
      if (child->readonly) {
        dirs.push_back(child);
      } else {
        child->children.clear();
      }
    }
  }
  ByteReader r(records);
  // Set last: creating a child touches its parent's mtime.
  std::vector<std::pair<std::shared_ptr<Node>, int64_t>> mtimes;
  while (!r.done()) {
    uint8_t type = r.U8();
    std::string_view path = r.Str();
    uint64_t mtime = r.U64();
    std::string_view data = r.Str();
    if (!r.ok() || type > 1) return bad("truncated or malformed record");
    std::vector<std::string> comps;
    if (Normalize({}, path, true, &comps) != kOk || comps.empty()) {
      return bad(absl::StrCat("bad path ", std::string(path.substr(0, 256))));
    }
    std::shared_ptr<Node> node;
    if (Lookup(comps, &node) == kOk) {
      // Only a writable top directory survives the emptying above.
      if (type != 0 || !node->is_dir() || node->readonly)
        return bad("duplicate " + JoinPath(comps));
      mtimes.push_back({node, static_cast<int64_t>(mtime)});
      continue;
    }
    WasiErrno e = kOk;
    if (type == 0) {
      e = Mkdir(comps);
    } else {
      e = CreateFile(comps, true, false, &node);
      if (e == kOk) e = node->Write(0, data);
    }
    if (e != kOk) return bad(absl::StrCat(JoinPath(comps), ": wasi errno ", static_cast<int>(e)));
    if (Lookup(comps, &node) == kOk) mtimes.push_back({node, static_cast<int64_t>(mtime)});
  }
  for (auto& [node, mtime] : mtimes) node->mtime_ns = mtime;
  return absl::OkStatus();
}

}  // namespace esb::nano

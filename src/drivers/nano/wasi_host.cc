#include "drivers/nano/wasi_host.h"

#include <sched.h>
#include <sys/random.h>
#include <time.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "drivers/nano/image.h"

volatile int esb_nano_interrupt = 0;

namespace esb::nano {
namespace {

constexpr uint64_t kPageBytes = 65536;
constexpr uint32_t kMaxFds = 1024;
constexpr uint32_t kMaxIovecs = 1024;  // like IOV_MAX
constexpr uint64_t kMaxIoBytes = 64 << 20;
constexpr uint32_t kMaxSubscriptions = 4096;

// Filetypes, rights, flags (preview1).
constexpr uint8_t kFiletypeUnknown = 0;
constexpr uint8_t kFiletypeCharDevice = 2;
constexpr uint8_t kFiletypeDirectory = 3;
constexpr uint8_t kFiletypeRegular = 4;
constexpr uint64_t kRightFdRead = 1 << 1;
constexpr uint64_t kRightFdWrite = 1 << 6;
constexpr uint64_t kAllRights = (uint64_t{1} << 29) - 1;
constexpr uint32_t kOflagCreat = 1, kOflagDirectory = 2, kOflagExcl = 4, kOflagTrunc = 8;
constexpr uint32_t kFdflagAppend = 1;

WasiHost* g_active = nullptr;

int64_t ClockNs(clockid_t id) {
  timespec ts;
  clock_gettime(id, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

}  // namespace

WasiHost::WasiHost(MemFs* fs) : fs_(fs) { g_active = this; }
WasiHost::~WasiHost() {
  if (g_active == this) g_active = nullptr;
}
WasiHost* WasiHost::active() { return g_active; }

absl::Status WasiHost::Init(const std::vector<Preopen>& preopens) {
  fds_.clear();
  auto stdio = [](FdEntry::Kind k) {
    auto e = std::make_unique<FdEntry>();
    e->kind = k;
    e->readable = k == FdEntry::Kind::kStdin;
    e->writable = !e->readable;
    return e;
  };
  fds_.push_back(stdio(FdEntry::Kind::kStdin));
  fds_.push_back(stdio(FdEntry::Kind::kStdout));
  fds_.push_back(stdio(FdEntry::Kind::kStderr));
  for (const Preopen& p : preopens) {
    auto e = std::make_unique<FdEntry>();
    e->kind = FdEntry::Kind::kDir;
    if (MemFs::Normalize({}, p.fs_path, true, &e->path) != kOk ||
        fs_->Lookup(e->path, &e->node) != kOk || !e->node->is_dir()) {
      return absl::InvalidArgumentError(absl::StrCat("preopen ", p.fs_path, " is not a dir"));
    }
    e->preopen_name = p.guest_name;
    e->readable = true;
    fds_.push_back(std::move(e));
  }
  return absl::OkStatus();
}

void WasiHost::BeginRun(std::string stdin_data, int64_t max_output_bytes) {
  stdin_ = std::move(stdin_data);
  stdin_pos_ = 0;
  out_[0].clear();
  out_[1].clear();
  max_output_bytes_ = max_output_bytes;
  truncated_ = false;
  exited_ = false;
  exit_code_ = 0;
  interrupted_ = false;
}

// ---- compact snapshot images ----
// u32 fd count; per fd: u8 present, then u8 kind, str path ("/a/b"), u64 offset, u8 flags
// (1 readable, 2 writable, 4 append), str preopen_name; then u32 argc + strs, u32 envc + strs.

bool WasiHost::SaveState(std::string* out, std::string* error) const {
  ByteWriter w(out);
  w.U32(static_cast<uint32_t>(fds_.size()));
  for (size_t i = 0; i < fds_.size(); i++) {
    const FdEntry* e = fds_[i].get();
    w.U8(e != nullptr);
    if (!e) continue;
    if (e->kind == FdEntry::Kind::kFile || e->kind == FdEntry::Kind::kDir) {
      std::shared_ptr<Node> at;
      if (fs_->Lookup(e->path, &at) != kOk || at != e->node) {
        *error = absl::StrCat("fd ", i, " (", JoinPath(e->path),
                              ") refers to a file that is no longer at its path (unlinked or "
                              "renamed while open): it cannot be written into an image");
        return false;
      }
    }
    w.U8(static_cast<uint8_t>(e->kind));
    w.Str(JoinPath(e->path));
    w.U64(e->offset);
    w.U8((e->readable ? 1 : 0) | (e->writable ? 2 : 0) | (e->append ? 4 : 0));
    w.Str(e->preopen_name);
  }
  for (const auto* list : {&args_, &env_}) {
    w.U32(static_cast<uint32_t>(list->size()));
    for (const std::string& a : *list) w.Str(a);
  }
  return true;
}

bool WasiHost::LoadState(std::string_view in, std::string* error) {
  ByteReader r(in);
  uint32_t n = r.U32();
  if (!r.ok() || n > kMaxFds) {
    *error = "bad fd count";
    return false;
  }
  std::vector<std::unique_ptr<FdEntry>> fds;
  for (uint32_t i = 0; i < n; i++) {
    if (r.U8() == 0) {
      fds.push_back(nullptr);
      continue;
    }
    auto e = std::make_unique<FdEntry>();
    uint8_t kind = r.U8();
    std::string_view path = r.Str();
    e->offset = r.U64();
    uint8_t flags = r.U8();
    e->preopen_name = std::string(r.Str());
    if (!r.ok() || kind > static_cast<uint8_t>(FdEntry::Kind::kDir) || path.size() > 65536 ||
        e->preopen_name.size() > 4096) {
      *error = absl::StrCat("fd ", i, ": malformed");
      return false;
    }
    e->kind = static_cast<FdEntry::Kind>(kind);
    // The standard streams stay on fds 0-2 (the worker's own output buffers).
    bool stdio = e->kind == FdEntry::Kind::kStdin || e->kind == FdEntry::Kind::kStdout ||
                 e->kind == FdEntry::Kind::kStderr;
    if (stdio != (i < 3) || (stdio && static_cast<uint8_t>(e->kind) != i)) {
      *error = absl::StrCat("fd ", i, ": standard stream out of place");
      return false;
    }
    e->readable = flags & 1;
    e->writable = flags & 2;
    e->append = flags & 4;
    if (!stdio) {
      if (MemFs::Normalize({}, path, true, &e->path) != kOk ||
          fs_->Lookup(e->path, &e->node) != kOk ||
          e->node->is_dir() != (e->kind == FdEntry::Kind::kDir) ||
          (e->writable && e->node->readonly)) {
        *error = absl::StrCat("fd ", i, ": ", std::string(path.substr(0, 256)),
                              " is not in the image's file system as recorded");
        return false;
      }
    }
    fds.push_back(std::move(e));
  }
  if (fds.size() < 3) {
    *error = "fewer than 3 fds";
    return false;
  }
  std::vector<std::string> lists[2];
  for (auto& list : lists) {
    uint32_t count = r.U32();
    if (!r.ok() || count > 65536) {
      *error = "bad args/env count";
      return false;
    }
    for (uint32_t i = 0; i < count && r.ok(); i++) list.emplace_back(r.Str());
  }
  if (!r.ok() || !r.done()) {
    *error = "truncated or trailing bytes";
    return false;
  }
  fds_ = std::move(fds);
  args_ = std::move(lists[0]);
  env_ = std::move(lists[1]);
  return true;
}

// ---- memory access ----

uint8_t* WasiHost::Span(uint32_t addr, uint64_t len) {
  if (memory_ == nullptr) return nullptr;
  // SECURITY: 64-bit arithmetic, size from the page count (u32 `size` wraps at 4 GiB): a guest
  // pointer + length can never reach past the end of linear memory.
  uint64_t size = uint64_t{memory_->pages} * kPageBytes;
  if (uint64_t{addr} + len > size) return nullptr;
  return memory_->data + addr;
}

bool WasiHost::Load32(uint32_t addr, uint32_t* v) {
  uint8_t* p = Span(addr, 4);
  if (!p) return false;
  std::memcpy(v, p, 4);
  return true;
}
bool WasiHost::Store8(uint32_t addr, uint8_t v) {
  uint8_t* p = Span(addr, 1);
  if (!p) return false;
  *p = v;
  return true;
}
bool WasiHost::Store16(uint32_t addr, uint16_t v) {
  uint8_t* p = Span(addr, 2);
  if (!p) return false;
  std::memcpy(p, &v, 2);
  return true;
}
bool WasiHost::Store32(uint32_t addr, uint32_t v) {
  uint8_t* p = Span(addr, 4);
  if (!p) return false;
  std::memcpy(p, &v, 4);
  return true;
}
bool WasiHost::Store64(uint32_t addr, uint64_t v) {
  uint8_t* p = Span(addr, 8);
  if (!p) return false;
  std::memcpy(p, &v, 8);
  return true;
}

uint32_t WasiHost::GuestString(uint32_t addr, uint32_t len, std::string_view* out) {
  if (len > 4096) return kNametoolong;
  uint8_t* p = Span(addr, len);
  if (!p) return kFault;
  *out = std::string_view(reinterpret_cast<const char*>(p), len);
  return kOk;
}

WasiHost::FdEntry* WasiHost::GetFd(uint32_t fd) {
  if (fd >= fds_.size()) return nullptr;
  return fds_[fd].get();
}

uint32_t WasiHost::AllocFd(FdEntry entry, uint32_t* fd) {
  for (uint32_t i = 3; i < fds_.size(); i++) {
    if (!fds_[i]) {
      fds_[i] = std::make_unique<FdEntry>(std::move(entry));
      *fd = i;
      return kOk;
    }
  }
  if (fds_.size() >= kMaxFds) return kMfile;
  fds_.push_back(std::make_unique<FdEntry>(std::move(entry)));
  *fd = static_cast<uint32_t>(fds_.size() - 1);
  return kOk;
}

uint32_t WasiHost::ResolvePath(uint32_t fd, uint32_t path, uint32_t path_len,
                               std::vector<std::string>* comps) {
  FdEntry* e = GetFd(fd);
  if (!e) return kBadf;
  if (e->kind != FdEntry::Kind::kDir) return kNotdir;
  std::string_view p;
  if (uint32_t err = GuestString(path, path_len, &p); err != kOk) return err;
  if (p.empty()) return kNoent;
  // SECURITY: resolution is purely lexical inside the MemFs (no symlinks exist); `..` above
  // the root and absolute paths are refused by Normalize.
  return MemFs::Normalize(e->path, p, /*allow_absolute=*/false, comps);
}

uint32_t WasiHost::WriteFilestat(uint32_t out, const Node* node, uint8_t filetype) {
  uint8_t* p = Span(out, 64);
  if (!p) return kFault;
  std::memset(p, 0, 64);
  uint64_t ino = node ? node->ino : 0;
  uint64_t nlink = 1;
  uint64_t size = node && !node->is_dir() ? node->data.size() : 0;
  uint64_t mtim = node ? static_cast<uint64_t>(node->mtime_ns) : 0;
  std::memcpy(p + 8, &ino, 8);
  p[16] = filetype;
  std::memcpy(p + 24, &nlink, 8);
  std::memcpy(p + 32, &size, 8);
  std::memcpy(p + 40, &mtim, 8);
  std::memcpy(p + 48, &mtim, 8);
  std::memcpy(p + 56, &mtim, 8);
  return kOk;
}

// ---- args / environ ----

uint32_t WasiHost::StringList(const std::vector<std::string>& list, uint32_t ptrs,
                              uint32_t buf) {
  uint64_t total = 0;
  for (const auto& s : list) total += s.size() + 1;
  if (!Span(ptrs, uint64_t{4} * list.size()) || !Span(buf, total)) return kFault;
  uint32_t cur = buf;
  for (size_t i = 0; i < list.size(); i++) {
    Store32(ptrs + 4 * static_cast<uint32_t>(i), cur);
    uint8_t* p = Span(cur, list[i].size() + 1);
    std::memcpy(p, list[i].data(), list[i].size());
    p[list[i].size()] = 0;
    cur += static_cast<uint32_t>(list[i].size() + 1);
  }
  return kOk;
}

uint32_t WasiHost::StringListSizes(const std::vector<std::string>& list, uint32_t count_out,
                                   uint32_t size_out) {
  uint64_t total = 0;
  for (const auto& s : list) total += s.size() + 1;
  if (!Span(count_out, 4) || !Span(size_out, 4)) return kFault;
  Store32(count_out, static_cast<uint32_t>(list.size()));
  Store32(size_out, static_cast<uint32_t>(total));
  return kOk;
}

uint32_t WasiHost::ArgsGet(uint32_t argv, uint32_t buf) { return StringList(args_, argv, buf); }
uint32_t WasiHost::ArgsSizesGet(uint32_t c, uint32_t s) { return StringListSizes(args_, c, s); }
uint32_t WasiHost::EnvironGet(uint32_t e, uint32_t buf) { return StringList(env_, e, buf); }
uint32_t WasiHost::EnvironSizesGet(uint32_t c, uint32_t s) {
  return StringListSizes(env_, c, s);
}

// ---- clocks, random, scheduling ----

uint32_t WasiHost::ClockResGet(uint32_t id, uint32_t out) {
  if (id > 3) return kInval;
  return Store64(out, 1000) ? kOk : kFault;
}

uint32_t WasiHost::ClockTimeGet(uint32_t id, uint64_t precision, uint32_t out) {
  static constexpr clockid_t kIds[] = {CLOCK_REALTIME, CLOCK_MONOTONIC, CLOCK_PROCESS_CPUTIME_ID,
                                       CLOCK_THREAD_CPUTIME_ID};
  if (id > 3) return kInval;
  return Store64(out, static_cast<uint64_t>(ClockNs(kIds[id]))) ? kOk : kFault;
}

uint32_t WasiHost::RandomGet(uint32_t buf, uint32_t len) {
  uint8_t* p = Span(buf, len);
  if (!p) return kFault;
  size_t done = 0;
  while (done < len) {
    ssize_t n = getrandom(p + done, std::min<size_t>(len - done, 256), 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return kIo;
    }
    done += static_cast<size_t>(n);
  }
  return kOk;
}

uint32_t WasiHost::SchedYield() {
  sched_yield();
  return kOk;
}

uint32_t WasiHost::PollOneoff(uint32_t in, uint32_t out, uint32_t nsubs, uint32_t nevents_out) {
  if (nsubs == 0) return kInval;
  if (nsubs > kMaxSubscriptions) return kInval;
  uint8_t* subs = Span(in, uint64_t{48} * nsubs);
  uint8_t* evs = Span(out, uint64_t{32} * nsubs);
  if (!subs || !evs || !Span(nevents_out, 4)) return kFault;
  // Only clock subscriptions sleep; fd subscriptions are reported ready at once (our fds never
  // block). The earliest clock deadline wins.
  int64_t now = ClockNs(CLOCK_MONOTONIC);
  int64_t deadline = INT64_MAX;
  uint32_t nevents = 0;
  for (uint32_t i = 0; i < nsubs; i++) {
    const uint8_t* s = subs + 48 * i;
    uint8_t tag = s[8];
    if (tag == 0) {
      uint32_t clock_id;
      uint64_t timeout;
      uint16_t flags;
      std::memcpy(&clock_id, s + 16, 4);
      std::memcpy(&timeout, s + 24, 8);
      std::memcpy(&flags, s + 40, 2);
      int64_t t = static_cast<int64_t>(std::min<uint64_t>(timeout, INT64_MAX / 2));
      int64_t d;
      if (flags & 1) {  // absolute
        int64_t base = clock_id == 0 ? ClockNs(CLOCK_REALTIME) : now;
        d = now + std::max<int64_t>(0, t - base);
      } else {
        d = now + t;
      }
      deadline = std::min(deadline, d);
    } else {
      uint8_t* ev = evs + 32 * nevents++;
      std::memset(ev, 0, 32);
      std::memcpy(ev, s, 8);  // userdata
      ev[10] = tag;
      uint64_t nbytes = 1;
      std::memcpy(ev + 16, &nbytes, 8);
    }
  }
  if (nevents == 0 && deadline != INT64_MAX) {
    while (true) {
      if (esb_nano_interrupt) return kIntr;
      int64_t left = deadline - ClockNs(CLOCK_MONOTONIC);
      if (left <= 0) break;
      int64_t chunk = std::min<int64_t>(left, 10 * 1000 * 1000);
      timespec ts{0, static_cast<long>(chunk)};
      nanosleep(&ts, nullptr);
    }
    // Report the clock subscription that fired.
    for (uint32_t i = 0; i < nsubs; i++) {
      const uint8_t* s = subs + 48 * i;
      if (s[8] != 0) continue;
      uint8_t* ev = evs;
      std::memset(ev, 0, 32);
      std::memcpy(ev, s, 8);
      ev[10] = 0;
      nevents = 1;
      break;
    }
  }
  Store32(nevents_out, nevents);
  return kOk;
}

// ---- fds ----

uint32_t WasiHost::FdAdvise(uint32_t fd, uint64_t, uint64_t, uint32_t) {
  return GetFd(fd) ? kOk : kBadf;
}
uint32_t WasiHost::FdAllocate(uint32_t fd, uint64_t offset, uint64_t len) { return kNotsup; }
uint32_t WasiHost::FdDatasync(uint32_t fd) { return GetFd(fd) ? kOk : kBadf; }
uint32_t WasiHost::FdSync(uint32_t fd) { return GetFd(fd) ? kOk : kBadf; }

uint32_t WasiHost::FdClose(uint32_t fd) {
  FdEntry* e = GetFd(fd);
  if (!e) return kBadf;
  // Preopens and stdio stay: a Wizer snapshot's libc has their numbers baked in.
  if (fd < 3 || !e->preopen_name.empty()) return kOk;
  fds_[fd].reset();
  return kOk;
}

uint32_t WasiHost::FdFdstatGet(uint32_t fd, uint32_t out) {
  FdEntry* e = GetFd(fd);
  if (!e) return kBadf;
  uint8_t* p = Span(out, 24);
  if (!p) return kFault;
  std::memset(p, 0, 24);
  uint8_t type = kFiletypeRegular;
  if (e->kind == FdEntry::Kind::kDir) type = kFiletypeDirectory;
  // stdio: a character device that claims seek/tell rights, i.e. "not a tty" to wasi-libc.
  if (fd < 3 && !e->node) type = kFiletypeCharDevice;
  p[0] = type;
  uint16_t flags = e->append ? kFdflagAppend : 0;
  std::memcpy(p + 2, &flags, 2);
  uint64_t rights = kAllRights;
  std::memcpy(p + 8, &rights, 8);
  std::memcpy(p + 16, &rights, 8);
  return kOk;
}

uint32_t WasiHost::FdFdstatSetFlags(uint32_t fd, uint32_t flags) {
  FdEntry* e = GetFd(fd);
  if (!e) return kBadf;
  e->append = flags & kFdflagAppend;
  return kOk;
}

uint32_t WasiHost::FdFdstatSetRights(uint32_t fd, uint64_t, uint64_t) {
  return GetFd(fd) ? kOk : kBadf;
}

uint32_t WasiHost::FdFilestatGet(uint32_t fd, uint32_t out) {
  FdEntry* e = GetFd(fd);
  if (!e) return kBadf;
  if (!e->node) return WriteFilestat(out, nullptr, kFiletypeCharDevice);
  return WriteFilestat(out, e->node.get(),
                       e->node->is_dir() ? kFiletypeDirectory : kFiletypeRegular);
}

uint32_t WasiHost::FdFilestatSetSize(uint32_t fd, uint64_t size) {
  FdEntry* e = GetFd(fd);
  if (!e) return kBadf;
  if (e->kind != FdEntry::Kind::kFile) return kInval;
  if (!e->writable) return kBadf;
  return e->node->Resize(size);
}

uint32_t WasiHost::FdFilestatSetTimes(uint32_t fd, uint64_t, uint64_t mtim, uint32_t flags) {
  FdEntry* e = GetFd(fd);
  if (!e) return kBadf;
  if (!e->node) return kOk;
  if (e->node->readonly) return kRofs;
  if (flags & 4) e->node->mtime_ns = static_cast<int64_t>(std::min<uint64_t>(mtim, INT64_MAX));
  if (flags & 8) e->node->mtime_ns = MemFs::NowNs();
  return kOk;
}

uint32_t WasiHost::FdPrestatGet(uint32_t fd, uint32_t out) {
  FdEntry* e = GetFd(fd);
  if (!e) return kBadf;
  if (e->preopen_name.empty()) return kBadf;
  uint8_t* p = Span(out, 8);
  if (!p) return kFault;
  std::memset(p, 0, 8);
  uint32_t len = static_cast<uint32_t>(e->preopen_name.size());
  std::memcpy(p + 4, &len, 4);
  return kOk;
}

uint32_t WasiHost::FdPrestatDirName(uint32_t fd, uint32_t path, uint32_t path_len) {
  FdEntry* e = GetFd(fd);
  if (!e || e->preopen_name.empty()) return kBadf;
  uint64_t n = std::min<uint64_t>(path_len, e->preopen_name.size());
  uint8_t* p = Span(path, n);
  if (!p) return kFault;
  std::memcpy(p, e->preopen_name.data(), n);
  return kOk;
}

uint32_t WasiHost::DoRead(FdEntry* e, uint32_t iovs, uint32_t iovs_len, uint64_t* offset,
                          uint32_t out) {
  if (iovs_len > kMaxIovecs) return kInval;
  const uint8_t* vec = Span(iovs, uint64_t{8} * iovs_len);
  if (!vec || !Span(out, 4)) return kFault;
  if (!e->readable) return kBadf;
  if (e->kind == FdEntry::Kind::kDir) return kIsdir;
  const std::string* src;
  size_t pos;
  if (e->kind == FdEntry::Kind::kStdin) {
    src = &stdin_;
    pos = stdin_pos_;
  } else if (e->kind == FdEntry::Kind::kFile) {
    src = &e->node->data;
    pos = static_cast<size_t>(std::min<uint64_t>(*offset, src->size()));
  } else {
    return kBadf;
  }
  uint64_t total = 0;
  for (uint32_t i = 0; i < iovs_len; i++) {
    uint32_t buf, len;
    std::memcpy(&buf, vec + 8 * i, 4);
    std::memcpy(&len, vec + 8 * i + 4, 4);
    uint8_t* dst = Span(buf, len);
    if (!dst) return kFault;
    size_t n = std::min<size_t>(len, src->size() - pos);
    std::memcpy(dst, src->data() + pos, n);
    pos += n;
    total += n;
    if (n < len) break;
  }
  if (e->kind == FdEntry::Kind::kStdin) {
    stdin_pos_ = pos;
  } else {
    *offset = pos;
  }
  Store32(out, static_cast<uint32_t>(total));
  return kOk;
}

uint32_t WasiHost::DoWrite(FdEntry* e, uint32_t iovs, uint32_t iovs_len, uint64_t* offset,
                           uint32_t out) {
  if (iovs_len > kMaxIovecs) return kInval;
  const uint8_t* vec = Span(iovs, uint64_t{8} * iovs_len);
  if (!vec || !Span(out, 4)) return kFault;
  if (!e->writable) return kBadf;
  // Validate every buffer before writing anything, so a fault leaves no partial write.
  uint64_t total = 0;
  for (uint32_t i = 0; i < iovs_len; i++) {
    uint32_t buf, len;
    std::memcpy(&buf, vec + 8 * i, 4);
    std::memcpy(&len, vec + 8 * i + 4, 4);
    if (!Span(buf, len)) return kFault;
    total += len;
  }
  if (total > kMaxIoBytes) return kInval;
  if (e->kind == FdEntry::Kind::kStdout || e->kind == FdEntry::Kind::kStderr) {
    std::string& sink = out_[e->kind == FdEntry::Kind::kStdout ? 0 : 1];
    for (uint32_t i = 0; i < iovs_len; i++) {
      uint32_t buf, len;
      std::memcpy(&buf, vec + 8 * i, 4);
      std::memcpy(&len, vec + 8 * i + 4, 4);
      uint64_t room = static_cast<uint64_t>(max_output_bytes_) -
                      std::min<uint64_t>(sink.size(), max_output_bytes_);
      uint64_t n = std::min<uint64_t>(len, room);
      sink.append(reinterpret_cast<const char*>(Span(buf, len)), n);
      if (n < len) truncated_ = true;
    }
    // The guest is told everything was written: output past the cap is dropped, not an error.
    Store32(out, static_cast<uint32_t>(total));
    return kOk;
  }
  if (e->kind != FdEntry::Kind::kFile) return kBadf;
  uint64_t pos = e->append ? e->node->data.size() : *offset;
  uint64_t written = 0;
  for (uint32_t i = 0; i < iovs_len; i++) {
    uint32_t buf, len;
    std::memcpy(&buf, vec + 8 * i, 4);
    std::memcpy(&len, vec + 8 * i + 4, 4);
    WasiErrno err = e->node->Write(
        pos, std::string_view(reinterpret_cast<const char*>(Span(buf, len)), len));
    if (err != kOk) {
      if (written == 0) return err;
      break;
    }
    pos += len;
    written += len;
  }
  *offset = pos;
  Store32(out, static_cast<uint32_t>(written));
  return kOk;
}

uint32_t WasiHost::FdRead(uint32_t fd, uint32_t iovs, uint32_t iovs_len, uint32_t out) {
  FdEntry* e = GetFd(fd);
  if (!e) return kBadf;
  return DoRead(e, iovs, iovs_len, &e->offset, out);
}

uint32_t WasiHost::FdPread(uint32_t fd, uint32_t iovs, uint32_t iovs_len, uint64_t offset,
                           uint32_t out) {
  FdEntry* e = GetFd(fd);
  if (!e) return kBadf;
  if (e->kind != FdEntry::Kind::kFile) return kSpipe;
  return DoRead(e, iovs, iovs_len, &offset, out);
}

uint32_t WasiHost::FdWrite(uint32_t fd, uint32_t iovs, uint32_t iovs_len, uint32_t out) {
  FdEntry* e = GetFd(fd);
  if (!e) return kBadf;
  return DoWrite(e, iovs, iovs_len, &e->offset, out);
}

uint32_t WasiHost::FdPwrite(uint32_t fd, uint32_t iovs, uint32_t iovs_len, uint64_t offset,
                            uint32_t out) {
  FdEntry* e = GetFd(fd);
  if (!e) return kBadf;
  if (e->kind != FdEntry::Kind::kFile) return kSpipe;
  bool append = e->append;
  e->append = false;
  uint32_t r = DoWrite(e, iovs, iovs_len, &offset, out);
  e->append = append;
  return r;
}

uint32_t WasiHost::FdSeek(uint32_t fd, uint64_t offset, uint32_t whence, uint32_t out) {
  FdEntry* e = GetFd(fd);
  if (!e) return kBadf;
  if (e->kind != FdEntry::Kind::kFile) return e->kind == FdEntry::Kind::kDir ? kBadf : kSpipe;
  if (!Span(out, 8)) return kFault;
  int64_t base;
  switch (whence) {
    case 0: base = 0; break;
    case 1: base = static_cast<int64_t>(e->offset); break;
    case 2: base = static_cast<int64_t>(e->node->data.size()); break;
    default: return kInval;
  }
  int64_t delta = static_cast<int64_t>(offset);
  int64_t target;
  if (__builtin_add_overflow(base, delta, &target) || target < 0) return kInval;
  e->offset = static_cast<uint64_t>(target);
  Store64(out, e->offset);
  return kOk;
}

uint32_t WasiHost::FdTell(uint32_t fd, uint32_t out) {
  FdEntry* e = GetFd(fd);
  if (!e) return kBadf;
  if (e->kind != FdEntry::Kind::kFile) return kSpipe;
  return Store64(out, e->offset) ? kOk : kFault;
}

uint32_t WasiHost::FdRenumber(uint32_t from, uint32_t to) {
  FdEntry* a = GetFd(from);
  FdEntry* b = GetFd(to);
  if (!a || !b) return kBadf;
  if (from < 3 || to < 3 || !a->preopen_name.empty() || !b->preopen_name.empty()) return kNotsup;
  fds_[to] = std::move(fds_[from]);
  return kOk;
}

uint32_t WasiHost::FdReaddir(uint32_t fd, uint32_t buf, uint32_t buf_len, uint64_t cookie,
                             uint32_t out) {
  FdEntry* e = GetFd(fd);
  if (!e) return kBadf;
  if (e->kind != FdEntry::Kind::kDir) return kNotdir;
  uint8_t* dst = Span(buf, buf_len);
  if (!dst || !Span(out, 4)) return kFault;
  std::vector<std::pair<std::string, const Node*>> entries;
  entries.reserve(e->node->children.size() + 2);
  entries.emplace_back(".", e->node.get());
  entries.emplace_back("..", e->node.get());
  for (const auto& [name, child] : e->node->children) entries.emplace_back(name, child.get());
  uint64_t used = 0;
  for (uint64_t i = cookie; i < entries.size() && used < buf_len; i++) {
    const auto& [name, node] = entries[i];
    uint8_t ent[24] = {0};
    uint64_t next = i + 1;
    uint64_t ino = node->ino;
    uint32_t namlen = static_cast<uint32_t>(name.size());
    std::memcpy(ent, &next, 8);
    std::memcpy(ent + 8, &ino, 8);
    std::memcpy(ent + 16, &namlen, 4);
    ent[20] = node->is_dir() ? kFiletypeDirectory : kFiletypeRegular;
    // Entries are truncated at the end of the buffer; the guest sees bufused == buf_len and
    // retries with a bigger buffer, as preview1 specifies.
    uint64_t n = std::min<uint64_t>(24, buf_len - used);
    std::memcpy(dst + used, ent, n);
    used += n;
    n = std::min<uint64_t>(name.size(), buf_len - used);
    std::memcpy(dst + used, name.data(), n);
    used += n;
  }
  Store32(out, static_cast<uint32_t>(used));
  return kOk;
}

// ---- paths ----

uint32_t WasiHost::PathOpen(uint32_t fd, uint32_t dirflags, uint32_t path, uint32_t path_len,
                            uint32_t oflags, uint64_t rights_base, uint64_t rights_inheriting,
                            uint32_t fdflags, uint32_t fd_out) {
  if (!Span(fd_out, 4)) return kFault;
  std::vector<std::string> comps;
  if (uint32_t err = ResolvePath(fd, path, path_len, &comps); err != kOk) return err;
  bool want_write = (rights_base & kRightFdWrite) || (oflags & kOflagTrunc);
  std::shared_ptr<Node> node;
  if (oflags & kOflagCreat) {
    if (comps.empty()) return kIsdir;
    WasiErrno err = fs_->CreateFile(comps, oflags & kOflagExcl, oflags & kOflagTrunc, &node);
    if (err != kOk) return err;
  } else {
    if (WasiErrno err = fs_->Lookup(comps, &node); err != kOk) return err;
    if (oflags & kOflagTrunc && !node->is_dir()) {
      if (WasiErrno err = node->Resize(0); err != kOk) return err;
    }
  }
  if ((oflags & kOflagDirectory) && !node->is_dir()) return kNotdir;
  if (node->is_dir() && want_write) return kIsdir;
  if (want_write && node->readonly) return kRofs;
  FdEntry entry;
  entry.kind = node->is_dir() ? FdEntry::Kind::kDir : FdEntry::Kind::kFile;
  entry.node = std::move(node);
  entry.path = std::move(comps);
  entry.readable = (rights_base & kRightFdRead) || entry.kind == FdEntry::Kind::kDir;
  entry.writable = want_write;
  entry.append = fdflags & kFdflagAppend;
  uint32_t new_fd;
  if (uint32_t err = AllocFd(std::move(entry), &new_fd); err != kOk) return err;
  Store32(fd_out, new_fd);
  return kOk;
}

uint32_t WasiHost::PathFilestatGet(uint32_t fd, uint32_t flags, uint32_t path, uint32_t path_len,
                                   uint32_t out) {
  std::vector<std::string> comps;
  if (uint32_t err = ResolvePath(fd, path, path_len, &comps); err != kOk) return err;
  std::shared_ptr<Node> node;
  if (WasiErrno err = fs_->Lookup(comps, &node); err != kOk) return err;
  return WriteFilestat(out, node.get(), node->is_dir() ? kFiletypeDirectory : kFiletypeRegular);
}

uint32_t WasiHost::PathFilestatSetTimes(uint32_t fd, uint32_t flags, uint32_t path,
                                        uint32_t path_len, uint64_t atim, uint64_t mtim,
                                        uint32_t fst_flags) {
  std::vector<std::string> comps;
  if (uint32_t err = ResolvePath(fd, path, path_len, &comps); err != kOk) return err;
  std::shared_ptr<Node> node;
  if (WasiErrno err = fs_->Lookup(comps, &node); err != kOk) return err;
  if (node->readonly) return kRofs;
  if (fst_flags & 4) node->mtime_ns = static_cast<int64_t>(std::min<uint64_t>(mtim, INT64_MAX));
  if (fst_flags & 8) node->mtime_ns = MemFs::NowNs();
  return kOk;
}

uint32_t WasiHost::PathCreateDirectory(uint32_t fd, uint32_t path, uint32_t path_len) {
  std::vector<std::string> comps;
  if (uint32_t err = ResolvePath(fd, path, path_len, &comps); err != kOk) return err;
  if (comps.empty()) return kExist;
  return fs_->Mkdir(comps);
}

uint32_t WasiHost::PathRemoveDirectory(uint32_t fd, uint32_t path, uint32_t path_len) {
  std::vector<std::string> comps;
  if (uint32_t err = ResolvePath(fd, path, path_len, &comps); err != kOk) return err;
  return fs_->Rmdir(comps);
}

uint32_t WasiHost::PathUnlinkFile(uint32_t fd, uint32_t path, uint32_t path_len) {
  std::vector<std::string> comps;
  if (uint32_t err = ResolvePath(fd, path, path_len, &comps); err != kOk) return err;
  if (comps.empty()) return kIsdir;
  return fs_->Unlink(comps);
}

uint32_t WasiHost::PathRename(uint32_t fd, uint32_t old_path, uint32_t old_len, uint32_t new_fd,
                              uint32_t new_path, uint32_t new_len) {
  std::vector<std::string> from, to;
  if (uint32_t err = ResolvePath(fd, old_path, old_len, &from); err != kOk) return err;
  if (uint32_t err = ResolvePath(new_fd, new_path, new_len, &to); err != kOk) return err;
  if (from.empty() || to.empty()) return kInval;
  return fs_->Rename(from, to);
}

uint32_t WasiHost::PathReadlink(uint32_t fd, uint32_t path, uint32_t path_len, uint32_t buf,
                                uint32_t buf_len, uint32_t out) {
  std::vector<std::string> comps;
  if (uint32_t err = ResolvePath(fd, path, path_len, &comps); err != kOk) return err;
  std::shared_ptr<Node> node;
  if (WasiErrno err = fs_->Lookup(comps, &node); err != kOk) return err;
  return kInval;  // nothing in the MemFs is a symlink
}

}  // namespace esb::nano

// ---- the C ABI wasm2c expects ----

using esb::nano::WasiHost;
using W = Z_wasi_snapshot_preview1_instance_t;
using u32 = uint32_t;
using u64 = uint64_t;

extern "C" {

void esb_nano_interrupted(void) {
  if (WasiHost* h = WasiHost::active()) h->MarkInterrupted();
  wasm_rt_trap(WASM_RT_TRAP_UNREACHABLE);
}

#define ESB_WASI(name, method, params, args) \
  u32 Z_wasi_snapshot_preview1Z_##name params { return w->host->method args; }

ESB_WASI(args_get, ArgsGet, (W* w, u32 a, u32 b), (a, b))
ESB_WASI(args_sizes_get, ArgsSizesGet, (W* w, u32 a, u32 b), (a, b))
ESB_WASI(environ_get, EnvironGet, (W* w, u32 a, u32 b), (a, b))
ESB_WASI(environ_sizes_get, EnvironSizesGet, (W* w, u32 a, u32 b), (a, b))
ESB_WASI(clock_res_get, ClockResGet, (W* w, u32 a, u32 b), (a, b))
ESB_WASI(clock_time_get, ClockTimeGet, (W* w, u32 a, u64 b, u32 c), (a, b, c))
ESB_WASI(fd_advise, FdAdvise, (W* w, u32 a, u64 b, u64 c, u32 d), (a, b, c, d))
ESB_WASI(fd_allocate, FdAllocate, (W* w, u32 a, u64 b, u64 c), (a, b, c))
ESB_WASI(fd_close, FdClose, (W* w, u32 a), (a))
ESB_WASI(fd_datasync, FdDatasync, (W* w, u32 a), (a))
ESB_WASI(fd_fdstat_get, FdFdstatGet, (W* w, u32 a, u32 b), (a, b))
ESB_WASI(fd_fdstat_set_flags, FdFdstatSetFlags, (W* w, u32 a, u32 b), (a, b))
ESB_WASI(fd_fdstat_set_rights, FdFdstatSetRights, (W* w, u32 a, u64 b, u64 c), (a, b, c))
ESB_WASI(fd_filestat_get, FdFilestatGet, (W* w, u32 a, u32 b), (a, b))
ESB_WASI(fd_filestat_set_size, FdFilestatSetSize, (W* w, u32 a, u64 b), (a, b))
ESB_WASI(fd_filestat_set_times, FdFilestatSetTimes, (W* w, u32 a, u64 b, u64 c, u32 d),
         (a, b, c, d))
ESB_WASI(fd_pread, FdPread, (W* w, u32 a, u32 b, u32 c, u64 d, u32 e), (a, b, c, d, e))
ESB_WASI(fd_prestat_get, FdPrestatGet, (W* w, u32 a, u32 b), (a, b))
ESB_WASI(fd_prestat_dir_name, FdPrestatDirName, (W* w, u32 a, u32 b, u32 c), (a, b, c))
ESB_WASI(fd_pwrite, FdPwrite, (W* w, u32 a, u32 b, u32 c, u64 d, u32 e), (a, b, c, d, e))
ESB_WASI(fd_read, FdRead, (W* w, u32 a, u32 b, u32 c, u32 d), (a, b, c, d))
ESB_WASI(fd_readdir, FdReaddir, (W* w, u32 a, u32 b, u32 c, u64 d, u32 e), (a, b, c, d, e))
ESB_WASI(fd_renumber, FdRenumber, (W* w, u32 a, u32 b), (a, b))
ESB_WASI(fd_seek, FdSeek, (W* w, u32 a, u64 b, u32 c, u32 d), (a, b, c, d))
ESB_WASI(fd_sync, FdSync, (W* w, u32 a), (a))
ESB_WASI(fd_tell, FdTell, (W* w, u32 a, u32 b), (a, b))
ESB_WASI(fd_write, FdWrite, (W* w, u32 a, u32 b, u32 c, u32 d), (a, b, c, d))
ESB_WASI(path_create_directory, PathCreateDirectory, (W* w, u32 a, u32 b, u32 c), (a, b, c))
ESB_WASI(path_filestat_get, PathFilestatGet, (W* w, u32 a, u32 b, u32 c, u32 d, u32 e),
         (a, b, c, d, e))
ESB_WASI(path_filestat_set_times, PathFilestatSetTimes,
         (W* w, u32 a, u32 b, u32 c, u32 d, u64 e, u64 f, u32 g), (a, b, c, d, e, f, g))
ESB_WASI(path_open, PathOpen,
         (W* w, u32 a, u32 b, u32 c, u32 d, u32 e, u64 f, u64 g, u32 h, u32 i),
         (a, b, c, d, e, f, g, h, i))
ESB_WASI(path_readlink, PathReadlink, (W* w, u32 a, u32 b, u32 c, u32 d, u32 e, u32 f),
         (a, b, c, d, e, f))
ESB_WASI(path_remove_directory, PathRemoveDirectory, (W* w, u32 a, u32 b, u32 c), (a, b, c))
ESB_WASI(path_rename, PathRename, (W* w, u32 a, u32 b, u32 c, u32 d, u32 e, u32 f),
         (a, b, c, d, e, f))
ESB_WASI(path_unlink_file, PathUnlinkFile, (W* w, u32 a, u32 b, u32 c), (a, b, c))
ESB_WASI(poll_oneoff, PollOneoff, (W* w, u32 a, u32 b, u32 c, u32 d), (a, b, c, d))
ESB_WASI(random_get, RandomGet, (W* w, u32 a, u32 b), (a, b))
ESB_WASI(sched_yield, SchedYield, (W* w), ())

#undef ESB_WASI

// Not offered: links, symlinks, signals, sockets. They exist so every preview1 guest links.
u32 Z_wasi_snapshot_preview1Z_path_link(W*, u32, u32, u32, u32, u32, u32, u32) {
  return esb::nano::kNotsup;
}
u32 Z_wasi_snapshot_preview1Z_path_symlink(W*, u32, u32, u32, u32, u32) {
  return esb::nano::kNotsup;
}
u32 Z_wasi_snapshot_preview1Z_proc_raise(W*, u32) { return esb::nano::kNosys; }
u32 Z_wasi_snapshot_preview1Z_sock_accept(W*, u32, u32, u32) { return esb::nano::kNosys; }
u32 Z_wasi_snapshot_preview1Z_sock_recv(W*, u32, u32, u32, u32, u32, u32) {
  return esb::nano::kNosys;
}
u32 Z_wasi_snapshot_preview1Z_sock_send(W*, u32, u32, u32, u32, u32) { return esb::nano::kNosys; }
u32 Z_wasi_snapshot_preview1Z_sock_shutdown(W*, u32, u32) { return esb::nano::kNosys; }

void Z_wasi_snapshot_preview1Z_proc_exit(W* w, u32 code) {
  w->host->MarkExited(code);
  // Unwinds to the embedder's wasm_rt_impl_try; the host sees exited() and the code.
  wasm_rt_trap(WASM_RT_TRAP_UNREACHABLE);
}

}  // extern "C"

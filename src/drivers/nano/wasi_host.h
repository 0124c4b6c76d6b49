// The WASI preview1 host that wasm2c-generated guests (CPython, test programs) link against.
// One WasiHost per process (wabt's runtime is global). Every guest pointer and length is checked
// against the current size of linear memory with 64-bit arithmetic before it is touched; the
// only file system is a MemFs; there are no sockets, no processes, no host paths.
#pragma once

#include <csignal>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "drivers/nano/memfs.h"
#include "wasm-rt.h"

extern "C" {
// Set asynchronously (SIGALRM handler / watchdog) to stop the guest. The interrupt checks that
// the build inserts at function entries and loop headers call esb_nano_interrupted() when set.
extern volatile int esb_nano_interrupt;
// Never returns: records the interrupt and traps out of the guest.
void esb_nano_interrupted(void);
}

namespace esb::nano {
class WasiHost;
}

// wasm2c passes this to every import. We define it: it just points at the host.
struct Z_wasi_snapshot_preview1_instance_t {
  esb::nano::WasiHost* host;
};

namespace esb::nano {

struct Preopen {
  std::string guest_name;  // what fd_prestat_dir_name reports, e.g. "/"
  std::string fs_path;     // the directory in the MemFs, e.g. "/"
};

class WasiHost {
 public:
  explicit WasiHost(MemFs* fs);
  ~WasiHost();
  WasiHost(const WasiHost&) = delete;
  WasiHost& operator=(const WasiHost&) = delete;

  // Opens fds 0-2 and the preopens (fd 3, 4, ... in order). Call once before the guest starts;
  // fd numbers must match what a Wizer snapshot saw.
  absl::Status Init(const std::vector<Preopen>& preopens);
  void set_memory(wasm_rt_memory_t* memory) { memory_ = memory; }
  void set_args(std::vector<std::string> args) { args_ = std::move(args); }
  void set_env(std::vector<std::string> env) { env_ = std::move(env); }
  // Per run: new stdin contents, empty output buffers with caps, cleared exit state.
  void BeginRun(std::string stdin_data, int64_t max_output_bytes);

  MemFs* fs() { return fs_; }
  Z_wasi_snapshot_preview1_instance_t* wasi_instance() { return &wasi_instance_; }
  std::string& stdout_data() { return out_[0]; }
  std::string& stderr_data() { return out_[1]; }
  bool truncated() const { return truncated_; }
  bool exited() const { return exited_; }
  uint32_t exit_code() const { return exit_code_; }
  bool interrupted() const { return interrupted_; }
  void MarkInterrupted() { interrupted_ = true; }
  void MarkExited(uint32_t code) { exited_ = true; exit_code_ = code; }

  // Time travel (compact snapshot images): the fd table (each open file or directory by its
  // path, with offset and flags), args and env. SaveState fails (false, `error`) when an fd's
  // node is no longer at its path (unlinked or renamed while open): such a file cannot be named
  // in an image. LoadState resolves every path in the (already loaded) MemFs and checks every
  // field; on failure the host is left unusable (the caller discards the worker).
  bool SaveState(std::string* out, std::string* error) const;
  bool LoadState(std::string_view in, std::string* error);

  // The process-wide host (for esb_nano_interrupted, which gets no context).
  static WasiHost* active();

  // ---- preview1 imports (wasm32 ABI: pointers are u32 offsets into linear memory) ----
  uint32_t ArgsGet(uint32_t argv, uint32_t buf);
  uint32_t ArgsSizesGet(uint32_t argc_out, uint32_t size_out);
  uint32_t EnvironGet(uint32_t environ, uint32_t buf);
  uint32_t EnvironSizesGet(uint32_t count_out, uint32_t size_out);
  uint32_t ClockResGet(uint32_t id, uint32_t out);
  uint32_t ClockTimeGet(uint32_t id, uint64_t precision, uint32_t out);
  uint32_t FdAdvise(uint32_t fd, uint64_t offset, uint64_t len, uint32_t advice);
  uint32_t FdAllocate(uint32_t fd, uint64_t offset, uint64_t len);
  uint32_t FdClose(uint32_t fd);
  uint32_t FdDatasync(uint32_t fd);
  uint32_t FdFdstatGet(uint32_t fd, uint32_t out);
  uint32_t FdFdstatSetFlags(uint32_t fd, uint32_t flags);
  uint32_t FdFdstatSetRights(uint32_t fd, uint64_t base, uint64_t inheriting);
  uint32_t FdFilestatGet(uint32_t fd, uint32_t out);
  uint32_t FdFilestatSetSize(uint32_t fd, uint64_t size);
  uint32_t FdFilestatSetTimes(uint32_t fd, uint64_t atim, uint64_t mtim, uint32_t flags);
  uint32_t FdPread(uint32_t fd, uint32_t iovs, uint32_t iovs_len, uint64_t offset, uint32_t out);
  uint32_t FdPrestatGet(uint32_t fd, uint32_t out);
  uint32_t FdPrestatDirName(uint32_t fd, uint32_t path, uint32_t path_len);
  uint32_t FdPwrite(uint32_t fd, uint32_t iovs, uint32_t iovs_len, uint64_t offset, uint32_t out);
  uint32_t FdRead(uint32_t fd, uint32_t iovs, uint32_t iovs_len, uint32_t out);
  uint32_t FdReaddir(uint32_t fd, uint32_t buf, uint32_t buf_len, uint64_t cookie, uint32_t out);
  uint32_t FdRenumber(uint32_t from, uint32_t to);
  uint32_t FdSeek(uint32_t fd, uint64_t offset, uint32_t whence, uint32_t out);
  uint32_t FdSync(uint32_t fd);
  uint32_t FdTell(uint32_t fd, uint32_t out);
  uint32_t FdWrite(uint32_t fd, uint32_t iovs, uint32_t iovs_len, uint32_t out);
  uint32_t PathCreateDirectory(uint32_t fd, uint32_t path, uint32_t path_len);
  uint32_t PathFilestatGet(uint32_t fd, uint32_t flags, uint32_t path, uint32_t path_len,
                           uint32_t out);
  uint32_t PathFilestatSetTimes(uint32_t fd, uint32_t flags, uint32_t path, uint32_t path_len,
                                uint64_t atim, uint64_t mtim, uint32_t fst_flags);
  uint32_t PathOpen(uint32_t fd, uint32_t dirflags, uint32_t path, uint32_t path_len,
                    uint32_t oflags, uint64_t rights_base, uint64_t rights_inheriting,
                    uint32_t fdflags, uint32_t fd_out);
  uint32_t PathReadlink(uint32_t fd, uint32_t path, uint32_t path_len, uint32_t buf,
                        uint32_t buf_len, uint32_t out);
  uint32_t PathRemoveDirectory(uint32_t fd, uint32_t path, uint32_t path_len);
  uint32_t PathRename(uint32_t fd, uint32_t old_path, uint32_t old_len, uint32_t new_fd,
                      uint32_t new_path, uint32_t new_len);
  uint32_t PathUnlinkFile(uint32_t fd, uint32_t path, uint32_t path_len);
  uint32_t PollOneoff(uint32_t in, uint32_t out, uint32_t nsubscriptions, uint32_t nevents_out);
  uint32_t RandomGet(uint32_t buf, uint32_t len);
  uint32_t SchedYield();

 private:
  struct FdEntry {
    enum class Kind { kStdin, kStdout, kStderr, kFile, kDir };
    Kind kind = Kind::kFile;
    std::shared_ptr<Node> node;
    std::vector<std::string> path;  // normalised path of the node (dirs: base for lookups)
    uint64_t offset = 0;
    bool readable = false;
    bool writable = false;
    bool append = false;
    std::string preopen_name;  // non-empty: a preopened directory
  };

  // Bounds-checked access to linear memory. All return false / nullptr when any byte of
  // [addr, addr+len) lies outside the current memory.
  uint8_t* Span(uint32_t addr, uint64_t len);
  bool Load32(uint32_t addr, uint32_t* v);
  bool Store8(uint32_t addr, uint8_t v);
  bool Store16(uint32_t addr, uint16_t v);
  bool Store32(uint32_t addr, uint32_t v);
  bool Store64(uint32_t addr, uint64_t v);
  // Reads a guest path string.
  uint32_t GuestString(uint32_t addr, uint32_t len, std::string_view* out);
  FdEntry* GetFd(uint32_t fd);
  // Resolves a guest path relative to directory fd `fd` into normalised components.
  uint32_t ResolvePath(uint32_t fd, uint32_t path, uint32_t path_len,
                       std::vector<std::string>* comps);
  uint32_t WriteFilestat(uint32_t out, const Node* node, uint8_t filetype);
  uint32_t StringList(const std::vector<std::string>& list, uint32_t ptrs, uint32_t buf);
  uint32_t StringListSizes(const std::vector<std::string>& list, uint32_t count_out,
                           uint32_t size_out);
  uint32_t DoRead(FdEntry* e, uint32_t iovs, uint32_t iovs_len, uint64_t* offset,
                  uint32_t out);
  uint32_t DoWrite(FdEntry* e, uint32_t iovs, uint32_t iovs_len, uint64_t* offset,
                   uint32_t out);
  uint32_t AllocFd(FdEntry entry, uint32_t* fd);

  MemFs* fs_;
  wasm_rt_memory_t* memory_ = nullptr;
  Z_wasi_snapshot_preview1_instance_t wasi_instance_{this};
  std::vector<std::unique_ptr<FdEntry>> fds_;
  std::vector<std::string> args_;
  std::vector<std::string> env_;
  std::string stdin_;
  size_t stdin_pos_ = 0;
  std::string out_[2];
  int64_t max_output_bytes_ = 1 << 20;
  bool truncated_ = false;
  bool exited_ = false;
  uint32_t exit_code_ = 0;
  bool interrupted_ = false;
};

}  // namespace esb::nano

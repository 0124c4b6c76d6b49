// Throwaway WASI host for build.sh's smoke test ONLY (the real host is src/drivers/nano).
// It is NOT a sandbox: paths are resolved under a real directory with openat() and minimal
// checks. It proves that libpython_wasm.a links, instantiates and runs code.
//
//   smoke_host ROOT CODE [TIMEOUT_MS]
//     ROOT: a directory laid out like the guest FS (usr/lib/python3.11, workspace, .esb, tmp)
//     Runs esb_reseed() then esb_run() with CODE on stdin; prints the guest's stdout/stderr,
//     exits with the guest's exit code (124 on interrupt), and prints result.json to fd 3
//     when fd 3 is open.
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "python_wasm.h"
#include "wasm-rt-impl.h"

struct Z_wasi_snapshot_preview1_instance_t {
  wasm_rt_memory_t* mem;
};

// ---- interrupt hook (README "Interrupts") ----
volatile int esb_nano_interrupt;
void esb_nano_interrupted(void) { wasm_rt_trap(WASM_RT_TRAP_EXHAUSTION); }

enum { kSuccess = 0, kBadf = 8, kInval = 28, kIo = 29, kNoent = 44, kNosys = 52, kFault = 21 };

static const char* g_code;
static size_t g_code_len, g_code_off;
static int g_root = -1;
// guest fd -> host fd; 0..2 stdio, 3 = root preopen.
#define MAX_FDS 256
static int g_fds[MAX_FDS];
static char* g_dir_paths[MAX_FDS];

typedef struct Z_wasi_snapshot_preview1_instance_t W;

static int InBounds(W* w, u64 ptr, u64 len) { return ptr + len <= w->mem->size; }
static u8* Mem(W* w) { return w->mem->data; }
#define CHECK(ptr, len) \
  do { if (!InBounds(w, (ptr), (len))) return kFault; } while (0)

static u32 Errno(int e) {
  switch (e) {
    case ENOENT: return kNoent;
    case EBADF: return kBadf;
    case EACCES: return 2;
    case EEXIST: return 20;
    case ENOTDIR: return 54;
    case EISDIR: return 31;
    case EINVAL: return kInval;
    case ENOTEMPTY: return 55;
    default: return kIo;
  }
}

static int HostFd(u32 fd) {
  if (fd >= MAX_FDS) return -1;
  return g_fds[fd];
}

u32 Z_wasi_snapshot_preview1Z_fd_write(W* w, u32 fd, u32 iovs, u32 n, u32 nwritten) {
  CHECK(iovs, (u64)n * 8);
  CHECK(nwritten, 4);
  int hfd = HostFd(fd);
  if (hfd < 0 || fd == 0) return kBadf;
  u32 total = 0;
  for (u32 i = 0; i < n; i++) {
    u32 p, l;
    memcpy(&p, Mem(w) + iovs + 8 * i, 4);
    memcpy(&l, Mem(w) + iovs + 8 * i + 4, 4);
    CHECK(p, l);
    ssize_t r = write(hfd, Mem(w) + p, l);
    if (r < 0) return Errno(errno);
    total += (u32)r;
  }
  memcpy(Mem(w) + nwritten, &total, 4);
  return kSuccess;
}

u32 Z_wasi_snapshot_preview1Z_fd_read(W* w, u32 fd, u32 iovs, u32 n, u32 nread) {
  CHECK(iovs, (u64)n * 8);
  CHECK(nread, 4);
  u32 total = 0;
  for (u32 i = 0; i < n; i++) {
    u32 p, l;
    memcpy(&p, Mem(w) + iovs + 8 * i, 4);
    memcpy(&l, Mem(w) + iovs + 8 * i + 4, 4);
    CHECK(p, l);
    size_t got;
    if (fd == 0) {
      got = g_code_len - g_code_off < l ? g_code_len - g_code_off : l;
      memcpy(Mem(w) + p, g_code + g_code_off, got);
      g_code_off += got;
    } else {
      int hfd = HostFd(fd);
      if (hfd < 0) return kBadf;
      ssize_t r = read(hfd, Mem(w) + p, l);
      if (r < 0) return Errno(errno);
      got = (size_t)r;
    }
    total += (u32)got;
    if (got < l) break;
  }
  memcpy(Mem(w) + nread, &total, 4);
  return kSuccess;
}

u32 Z_wasi_snapshot_preview1Z_fd_prestat_get(W* w, u32 fd, u32 buf) {
  CHECK(buf, 8);
  if (fd != 3) return kBadf;
  u32 tag = 0, len = 1;
  memcpy(Mem(w) + buf, &tag, 4);
  memcpy(Mem(w) + buf + 4, &len, 4);
  return kSuccess;
}

u32 Z_wasi_snapshot_preview1Z_fd_prestat_dir_name(W* w, u32 fd, u32 path, u32 len) {
  CHECK(path, len);
  if (fd != 3) return kBadf;
  if (len < 1) return kInval;
  Mem(w)[path] = '/';
  return kSuccess;
}

static u8 FileType(mode_t m) {
  if (S_ISDIR(m)) return 3;
  if (S_ISREG(m)) return 4;
  if (S_ISCHR(m)) return 2;
  return 0;
}

static void PutFilestat(W* w, u32 buf, const struct stat* st) {
  u8* b = Mem(w) + buf;
  memset(b, 0, 64);
  u64 dev = st->st_dev, ino = st->st_ino, nlink = st->st_nlink, size = st->st_size;
  u64 at = (u64)st->st_atim.tv_sec * 1000000000ull + st->st_atim.tv_nsec;
  u64 mt = (u64)st->st_mtim.tv_sec * 1000000000ull + st->st_mtim.tv_nsec;
  u64 ct = (u64)st->st_ctim.tv_sec * 1000000000ull + st->st_ctim.tv_nsec;
  memcpy(b + 0, &dev, 8);
  memcpy(b + 8, &ino, 8);
  b[16] = FileType(st->st_mode);
  memcpy(b + 24, &nlink, 8);
  memcpy(b + 32, &size, 8);
  memcpy(b + 40, &at, 8);
  memcpy(b + 48, &mt, 8);
  memcpy(b + 56, &ct, 8);
}

u32 Z_wasi_snapshot_preview1Z_fd_fdstat_get(W* w, u32 fd, u32 buf) {
  CHECK(buf, 24);
  int hfd = HostFd(fd);
  if (fd == 0) hfd = 0;
  if (hfd < 0) return kBadf;
  struct stat st;
  if (fstat(hfd, &st) != 0) return Errno(errno);
  u8* b = Mem(w) + buf;
  memset(b, 0, 24);
  b[0] = fd <= 2 ? 2 : FileType(st.st_mode);
  u64 rights = ~0ull;
  memcpy(b + 8, &rights, 8);
  memcpy(b + 16, &rights, 8);
  return kSuccess;
}

u32 Z_wasi_snapshot_preview1Z_fd_filestat_get(W* w, u32 fd, u32 buf) {
  CHECK(buf, 64);
  int hfd = HostFd(fd);
  if (hfd < 0) return kBadf;
  struct stat st;
  if (fstat(hfd, &st) != 0) return Errno(errno);
  PutFilestat(w, buf, &st);
  return kSuccess;
}

static int GuestPath(W* w, u32 path, u32 len, char* out, size_t cap) {
  if (!InBounds(w, path, len) || len + 1 > cap) return -1;
  memcpy(out, Mem(w) + path, len);
  out[len] = 0;
  if (len == 0) strcpy(out, ".");
  return 0;
}

u32 Z_wasi_snapshot_preview1Z_path_filestat_get(W* w, u32 fd, u32 flags, u32 path, u32 len,
                                                u32 buf) {
  CHECK(buf, 64);
  char p[4096];
  if (GuestPath(w, path, len, p, sizeof p) != 0) return kFault;
  int hfd = HostFd(fd);
  if (hfd < 0) return kBadf;
  struct stat st;
  if (fstatat(hfd, p, &st, (flags & 1) ? 0 : AT_SYMLINK_NOFOLLOW) != 0) return Errno(errno);
  PutFilestat(w, buf, &st);
  return kSuccess;
}

u32 Z_wasi_snapshot_preview1Z_path_open(W* w, u32 fd, u32 dirflags, u32 path, u32 len,
                                        u32 oflags, u64 rights, u64 inherit, u32 fdflags,
                                        u32 out_fd) {
  (void)dirflags; (void)inherit;
  CHECK(out_fd, 4);
  char p[4096];
  if (GuestPath(w, path, len, p, sizeof p) != 0) return kFault;
  int hfd = HostFd(fd);
  if (hfd < 0) return kBadf;
  int flags = O_CLOEXEC;
  int want_write = (rights & (1ull << 6)) != 0;  // fd_write
  int want_read = (rights & (1ull << 1)) != 0;   // fd_read
  if (oflags & 2) flags |= O_DIRECTORY;
  if (want_write && want_read) flags |= O_RDWR;
  else if (want_write) flags |= O_WRONLY;
  else flags |= O_RDONLY;
  if (oflags & 1) flags |= O_CREAT;
  if (oflags & 4) flags |= O_EXCL;
  if (oflags & 8) flags |= O_TRUNC;
  if (fdflags & 1) flags |= O_APPEND;
  int nfd = openat(hfd, p, flags, 0644);
  if (nfd < 0 && errno == EISDIR) nfd = openat(hfd, p, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (nfd < 0) return Errno(errno);
  for (u32 i = 4; i < MAX_FDS; i++) {
    if (g_fds[i] < 0) {
      g_fds[i] = nfd;
      memcpy(Mem(w) + out_fd, &i, 4);
      return kSuccess;
    }
  }
  close(nfd);
  return 33;  // EMFILE
}

u32 Z_wasi_snapshot_preview1Z_fd_close(W* w, u32 fd) {
  (void)w;
  if (fd < 4 || fd >= MAX_FDS || g_fds[fd] < 0) return kBadf;
  close(g_fds[fd]);
  g_fds[fd] = -1;
  return kSuccess;
}

u32 Z_wasi_snapshot_preview1Z_fd_seek(W* w, u32 fd, u64 off, u32 whence, u32 out) {
  CHECK(out, 8);
  int hfd = HostFd(fd);
  if (hfd < 0) return kBadf;
  if (fd <= 2) return 70;  // ESPIPE
  off_t r = lseek(hfd, (off_t)off, whence == 0 ? SEEK_SET : whence == 1 ? SEEK_CUR : SEEK_END);
  if (r < 0) return Errno(errno);
  u64 v = (u64)r;
  memcpy(Mem(w) + out, &v, 8);
  return kSuccess;
}

u32 Z_wasi_snapshot_preview1Z_fd_tell(W* w, u32 fd, u32 out) {
  return Z_wasi_snapshot_preview1Z_fd_seek(w, fd, 0, 1, out);
}

u32 Z_wasi_snapshot_preview1Z_fd_readdir(W* w, u32 fd, u32 buf, u32 len, u64 cookie,
                                         u32 used) {
  CHECK(buf, len);
  CHECK(used, 4);
  int hfd = HostFd(fd);
  if (hfd < 0) return kBadf;
  int dfd = dup(hfd);
  DIR* d = fdopendir(dfd);
  if (!d) { close(dfd); return Errno(errno); }
  rewinddir(d);
  u32 off = 0;
  u64 idx = 0;
  struct dirent* e;
  while ((e = readdir(d)) != NULL) {
    idx++;
    if (idx <= cookie) continue;
    u8 hdr[24];
    u64 next = idx, ino = e->d_ino;
    u32 nlen = (u32)strlen(e->d_name);
    memcpy(hdr, &next, 8);
    memcpy(hdr + 8, &ino, 8);
    memcpy(hdr + 16, &nlen, 4);
    hdr[20] = e->d_type == DT_DIR ? 3 : e->d_type == DT_REG ? 4 : 0;
    hdr[21] = hdr[22] = hdr[23] = 0;
    for (u32 k = 0; k < 24 && off < len; k++) Mem(w)[buf + off++] = hdr[k];
    for (u32 k = 0; k < nlen && off < len; k++) Mem(w)[buf + off++] = (u8)e->d_name[k];
    if (off >= len) break;
  }
  closedir(d);
  memcpy(Mem(w) + used, &off, 4);
  return kSuccess;
}

u32 Z_wasi_snapshot_preview1Z_clock_time_get(W* w, u32 id, u64 prec, u32 out) {
  (void)prec;
  CHECK(out, 8);
  struct timespec ts;
  clock_gettime(id == 0 ? CLOCK_REALTIME : CLOCK_MONOTONIC, &ts);
  u64 v = (u64)ts.tv_sec * 1000000000ull + ts.tv_nsec;
  memcpy(Mem(w) + out, &v, 8);
  return kSuccess;
}

u32 Z_wasi_snapshot_preview1Z_clock_res_get(W* w, u32 id, u32 out) {
  (void)id;
  CHECK(out, 8);
  u64 v = 1000;
  memcpy(Mem(w) + out, &v, 8);
  return kSuccess;
}

u32 Z_wasi_snapshot_preview1Z_random_get(W* w, u32 buf, u32 len) {
  CHECK(buf, len);
  u32 off = 0;
  while (off < len) {
    ssize_t r = getrandom(Mem(w) + buf + off, len - off, 0);
    if (r <= 0) return kIo;
    off += (u32)r;
  }
  return kSuccess;
}

u32 Z_wasi_snapshot_preview1Z_args_sizes_get(W* w, u32 argc, u32 size) {
  CHECK(argc, 4);
  CHECK(size, 4);
  memset(Mem(w) + argc, 0, 4);
  memset(Mem(w) + size, 0, 4);
  return kSuccess;
}
u32 Z_wasi_snapshot_preview1Z_args_get(W* w, u32 a, u32 b) { (void)w; (void)a; (void)b; return 0; }
u32 Z_wasi_snapshot_preview1Z_environ_sizes_get(W* w, u32 n, u32 size) {
  return Z_wasi_snapshot_preview1Z_args_sizes_get(w, n, size);
}
u32 Z_wasi_snapshot_preview1Z_environ_get(W* w, u32 a, u32 b) { (void)w; (void)a; (void)b; return 0; }

void Z_wasi_snapshot_preview1Z_proc_exit(W* w, u32 code) {
  (void)w;
  fflush(stdout);
  _exit((int)code);
}

#include "smoke_stubs.inc"  // every other import: ENOSYS (generated by build.sh)

static void OnAlarm(int sig) {
  (void)sig;
  esb_nano_interrupt = 1;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s ROOT CODE [TIMEOUT_MS]\n", argv[0]);
    return 2;
  }
  g_root = open(argv[1], O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (g_root < 0) { perror(argv[1]); return 2; }
  for (int i = 0; i < MAX_FDS; i++) g_fds[i] = -1;
  g_fds[0] = 0; g_fds[1] = 1; g_fds[2] = 2; g_fds[3] = g_root;
  (void)g_dir_paths;
  g_code = argv[2];
  g_code_len = strlen(g_code);

  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  wasm_rt_init();
  Z_python_init_module();
  static Z_python_instance_t inst;
  static struct Z_wasi_snapshot_preview1_instance_t wasi;
  Z_python_instantiate(&inst, &wasi);
  wasi.mem = Z_pythonZ_memory(&inst);
  struct timespec t_inst, t_seed;
  clock_gettime(CLOCK_MONOTONIC, &t_inst);

  if (argc > 3) {
    signal(SIGALRM, OnAlarm);
    long ms = atol(argv[3]);
    struct itimerval it = {{0, 0}, {ms / 1000, (ms % 1000) * 1000}};
    setitimer(ITIMER_REAL, &it, NULL);
  }
  int rc;
  wasm_rt_trap_t trap = wasm_rt_impl_try();
  if (trap == 0) {
    Z_pythonZ_esb_reseed(&inst);
    clock_gettime(CLOCK_MONOTONIC, &t_seed);
    rc = (int)Z_pythonZ_esb_run(&inst);
  } else {
    fflush(stdout);
    fprintf(stderr, "smoke_host: trap %d%s\n", (int)trap,
            esb_nano_interrupt ? " (interrupted: timeout)" : "");
    rc = esb_nano_interrupt ? 124 : 134;
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  fflush(stdout);
#define MS(a, b) (((b).tv_sec - (a).tv_sec) * 1e3 + ((b).tv_nsec - (a).tv_nsec) / 1e6)
  fprintf(stderr, "smoke_host: exit %d in %.2f ms (instantiate %.2f, reseed %.2f, run %.2f)\n",
          rc, MS(t0, t1), MS(t0, t_inst), rc == 124 ? 0.0 : MS(t_inst, t_seed),
          rc == 124 ? 0.0 : MS(t_seed, t1));
  return rc;
}

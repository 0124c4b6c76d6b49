// A small WASI program the nano runtime tests run in place of CPython. Compiled with clang-14
// --target=wasm32-wasi, turned into C by wasm2c, linked into nano-test-worker.
// argv[1] selects what it does; every mode prints what it saw so the tests can assert on it.
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <wasi/api.h>

// proc_raise left wasi-libc's header but is still a preview1 import; declare it directly.
__attribute__((import_module("wasi_snapshot_preview1"), import_name("proc_raise"))) uint16_t
RawProcRaise(uint32_t sig);
// The raw path_open import takes a length (wasi-libc's wrapper takes a C string).
__attribute__((import_module("wasi_snapshot_preview1"), import_name("path_open"))) uint16_t
RawPathOpen(uint32_t fd, uint32_t dirflags, const char* path, uint32_t path_len, uint32_t oflags,
            uint64_t rights_base, uint64_t rights_inheriting, uint32_t fdflags, uint32_t* fd_out);

static int TryOpen(const char* path) {
  int fd = open(path, O_RDONLY);
  if (fd < 0) {
    printf("open %s: errno %d\n", path, errno);
    return 1;
  }
  char buf[64];
  ssize_t n = read(fd, buf, sizeof(buf) - 1);
  buf[n > 0 ? n : 0] = 0;
  printf("open %s: OK read %zd\n", path, n);
  close(fd);
  return 0;
}

static int Escape(void) {
  int opened = 0;
  const char* paths[] = {"../../etc/passwd", "/etc/passwd", "/workspace/../../etc/passwd",
                         "/../../../../etc/hostname", "/proc/self/environ", "../../../../proc/1/cmdline",
                         "/workspace/../../../../../../../../../etc/shadow", "//etc//passwd"};
  for (unsigned i = 0; i < sizeof(paths) / sizeof(paths[0]); i++) opened += !TryOpen(paths[i]);
  // Raw WASI call with an absolute path and with `..` above the preopen.
  __wasi_fd_t fd;
  __wasi_errno_t e1 = __wasi_path_open(3, 0, "/etc/passwd", 0, __WASI_RIGHTS_FD_READ, 0, 0, &fd);
  __wasi_errno_t e2 = __wasi_path_open(3, 0, "../etc/passwd", 0, __WASI_RIGHTS_FD_READ, 0, 0, &fd);
  __wasi_errno_t e3 = __wasi_path_open(3, 0, "workspace/../..", 0, __WASI_RIGHTS_FD_READ, 0, 0, &fd);
  __wasi_errno_t e4 = __wasi_path_create_directory(3, "../x");
  __wasi_errno_t e5 = __wasi_path_open(3, 0, "a\0b", 0, 0, 0, 0, &fd);
  printf("raw %d %d %d %d %d\n", e1, e2, e3, e4, e5);
  printf("escaped %d\n", opened);
  return 0;
}

static int Files(void) {
  FILE* f = fopen("/workspace/a.txt", "w");
  if (!f) { printf("fopen w errno %d\n", errno); return 1; }
  fputs("hello file\n", f);
  fclose(f);
  f = fopen("/workspace/a.txt", "a");
  fputs("more\n", f);
  fclose(f);
  char buf[100] = {0};
  f = fopen("/workspace/a.txt", "r");
  size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fseek(f, 6, SEEK_SET);
  char word[5] = {0};
  fread(word, 1, 4, f);
  long pos = ftell(f);
  fclose(f);
  printf("read %zu [%s] word=%s pos=%ld\n", n, buf, word, pos);
  printf("mkdir %d\n", mkdir("/workspace/sub", 0755));
  printf("mkdir again %d errno %d\n", mkdir("/workspace/sub", 0755), errno);
  printf("rename %d\n", rename("/workspace/a.txt", "/workspace/sub/b.txt"));
  struct stat st;
  printf("stat %d size %lld isreg %d\n", stat("/workspace/sub/b.txt", &st), (long long)st.st_size,
         S_ISREG(st.st_mode));
  printf("stat old %d errno %d\n", stat("/workspace/a.txt", &st), errno);
  printf("rmdir nonempty %d errno %d\n", rmdir("/workspace/sub"), errno);
  DIR* d = opendir("/workspace/sub");
  struct dirent* de;
  while (d && (de = readdir(d))) printf("entry %s\n", de->d_name);
  if (d) closedir(d);
  printf("unlink %d\n", unlink("/workspace/sub/b.txt"));
  printf("rmdir %d\n", rmdir("/workspace/sub"));
  printf("chdir %d\n", chdir("/workspace"));
  f = fopen("rel.txt", "w");
  printf("relative %s\n", f ? "ok" : "fail");
  if (f) fclose(f);
  printf("stat rel %d\n", stat("/workspace/rel.txt", &st));
  return 0;
}

static int ReadOnly(void) {
  TryOpen("/lib/hello.txt");
  int fd = open("/lib/hello.txt", O_WRONLY);
  printf("open ro for write: %d errno %d\n", fd, fd < 0 ? errno : 0);
  fd = open("/lib/new.txt", O_WRONLY | O_CREAT, 0644);
  printf("create in ro: %d errno %d\n", fd, fd < 0 ? errno : 0);
  printf("mkdir in ro: %d errno %d\n", mkdir("/lib/x", 0755), errno);
  printf("unlink in ro: %d errno %d\n", unlink("/lib/hello.txt"), errno);
  printf("rename ro->ws: %d errno %d\n", rename("/lib/hello.txt", "/workspace/h"), errno);
  DIR* d = opendir("/");
  struct dirent* de;
  while (d && (de = readdir(d))) printf("root %s\n", de->d_name);
  if (d) closedir(d);
  return 0;
}

static int Fill(void) {
  static char block[65536];
  memset(block, 'x', sizeof(block));
  long total = 0;
  for (int i = 0; i < 100000; i++) {
    char name[64];
    snprintf(name, sizeof(name), "/workspace/f%d", i);
    int fd = open(name, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) { printf("create stopped at %d errno %d total %ld\n", i, errno, total); return 0; }
    ssize_t n = write(fd, block, sizeof(block));
    close(fd);
    if (n < 0) { printf("write stopped at %d errno %d total %ld\n", i, errno, total); return 0; }
    total += n;
    if (n < (ssize_t)sizeof(block)) { printf("short write at %d total %ld\n", i, total); return 0; }
  }
  printf("never stopped %ld\n", total);
  return 0;
}

static int Alloc(void) {
  long mb = 0;
  static void* volatile head;  // keeps the blocks reachable so malloc is not optimised away
  for (;;) {
    void** p = malloc(1 << 20);
    if (!p) break;
    memset(p, 1, 1 << 20);
    *p = head;
    head = p;
    mb++;
  }
  printf("allocated %ld MiB then malloc failed\n", mb);
  return 0;
}

static int Hostile(void) {
  // Raw imports with pointers and lengths a hostile guest could pass. The host must answer
  // EFAULT (21) / EINVAL / EBADF, never crash, never read outside linear memory.
  uint32_t top = (uint32_t)__builtin_wasm_memory_size(0) * 65536u;
  __wasi_ciovec_t iov = {(const uint8_t*)(uintptr_t)(top - 4), 100};
  size_t n = 0;
  printf("w1 %d\n", __wasi_fd_write(1, &iov, 1, &n));
  iov.buf = (const uint8_t*)(uintptr_t)0xFFFFFFF0u; iov.buf_len = 0x20;
  printf("w2 %d\n", __wasi_fd_write(1, &iov, 1, &n));
  printf("w3 %d\n", __wasi_fd_write(1, (const __wasi_ciovec_t*)(uintptr_t)(top - 4), 1, &n));
  printf("w4 %d\n", __wasi_fd_write(1, &iov, 0x20000000, &n));
  iov.buf = (const uint8_t*)"ok\n"; iov.buf_len = 3;
  printf("w5 %d\n", __wasi_fd_write(1, &iov, 1, (size_t*)(uintptr_t)0xFFFFFFFEu));
  __wasi_iovec_t riov = {(uint8_t*)(uintptr_t)0xFFFFFF00u, 0x1000};
  printf("r1 %d\n", __wasi_fd_read(0, &riov, 1, &n));
  printf("a1 %d\n", __wasi_args_get((uint8_t**)(uintptr_t)top, (uint8_t*)(uintptr_t)top));
  printf("a2 %d\n", __wasi_args_sizes_get((size_t*)(uintptr_t)(top - 2), &n));
  printf("e1 %d\n", __wasi_environ_sizes_get(&n, (size_t*)(uintptr_t)0xFFFFFFFFu));
  __wasi_timestamp_t ts;
  printf("c1 %d\n", __wasi_clock_time_get(0, 1, (__wasi_timestamp_t*)(uintptr_t)(top - 7)));
  printf("c2 %d\n", __wasi_clock_time_get(99, 1, &ts));
  printf("g1 %d\n", __wasi_random_get((uint8_t*)(uintptr_t)(top - 16), 17));
  printf("g2 %d\n", __wasi_random_get((uint8_t*)(uintptr_t)0x10, 0xFFFFFFF0u));
  __wasi_fd_t fd;
  printf("p1 %d\n", __wasi_path_open(3, 0, (const char*)(uintptr_t)(top - 3), 0, 0, 0, 0, &fd));
  printf("p2 %d\n", __wasi_path_open(3, 0, "workspace", 0, 0, 0, 0, (__wasi_fd_t*)(uintptr_t)top));
  printf("p3 %d\n", __wasi_path_open(12345, 0, "x", 0, 0, 0, 0, &fd));
  printf("p4 %d\n", __wasi_path_open(0xFFFFFFFFu, 0, "x", 0, 0, 0, 0, &fd));
  __wasi_filestat_t fst;
  printf("s1 %d\n", __wasi_fd_filestat_get(3, (__wasi_filestat_t*)(uintptr_t)(top - 63)));
  printf("s2 %d\n", __wasi_fd_filestat_get(3, &fst));
  printf("d1 %d\n", __wasi_fd_readdir(3, (uint8_t*)(uintptr_t)(top - 10), 100, 0, &n));
  printf("d2 %d\n", __wasi_fd_readdir(3, (uint8_t*)(uintptr_t)0xFFFFFFF0u, 0xFFFFFFF0u, 0, &n));
  __wasi_subscription_t sub;
  __wasi_event_t ev;
  printf("o1 %d\n", __wasi_poll_oneoff(&sub, (__wasi_event_t*)(uintptr_t)top, 1, &n));
  printf("o2 %d\n", __wasi_poll_oneoff(&sub, &ev, 0x7FFFFFFF, &n));
  printf("x1 %d\n", __wasi_fd_prestat_dir_name(3, (uint8_t*)(uintptr_t)(top - 1), 8));
  printf("x2 %d\n", __wasi_fd_prestat_dir_name(3, (uint8_t*)(uintptr_t)16, 0xFFFFFFFFu));
  printf("survived\n");
  return 0;
}

static int AllImports(void) {
  // Calls every preview1 import once (so all 46 are linked) and prints the errno of the ones
  // the host does not implement.
  __wasi_fd_t fd;
  size_t n;
  char buf[16];
  printf("advise %d allocate %d\n", __wasi_fd_advise(1, 0, 0, 0), __wasi_fd_allocate(3, 0, 1));
  printf("datasync %d sync %d\n", __wasi_fd_datasync(1), __wasi_fd_sync(1));
  printf("setflags %d setrights %d\n", __wasi_fd_fdstat_set_flags(1, 0),
         __wasi_fd_fdstat_set_rights(1, 0, 0));
  printf("settimes %d setsize %d\n", __wasi_fd_filestat_set_times(1, 0, 0, 0),
         __wasi_fd_filestat_set_size(1, 0));
  __wasi_iovec_t iov = {(uint8_t*)buf, sizeof(buf)};
  __wasi_ciovec_t ciov = {(const uint8_t*)"x", 1};
  printf("pread %d pwrite %d\n", __wasi_fd_pread(1, &iov, 1, 0, &n),
         __wasi_fd_pwrite(1, &ciov, 1, 0, &n));
  printf("renumber %d\n", __wasi_fd_renumber(99, 98));
  printf("pathtimes %d link %d\n", __wasi_path_filestat_set_times(3, 0, "workspace", 0, 0, 0),
         __wasi_path_link(3, 0, "workspace", 3, "w2"));
  printf("readlink %d symlink %d\n", __wasi_path_readlink(3, "workspace", (uint8_t*)buf, 16, &n),
         __wasi_path_symlink("/etc/passwd", 3, "workspace/evil"));
  printf("raise %d yield %d\n", RawProcRaise(9), __wasi_sched_yield());
  __wasi_timestamp_t res;
  printf("clockres %d\n", __wasi_clock_res_get(1, &res));
  __wasi_roflags_t rof;
  __wasi_siflags_t sif = 0;
  printf("accept %d recv %d send %d shutdown %d\n", __wasi_sock_accept(3, 0, &fd),
         __wasi_sock_recv(3, &iov, 1, 0, &n, &rof), __wasi_sock_send(3, &ciov, 1, sif, &n),
         __wasi_sock_shutdown(3, 0));
  return 0;
}

#pragma clang diagnostic ignored "-Winfinite-recursion"
static void Recurse(volatile int* depth) {
  volatile char pad[256];
  pad[0] = (char)*depth;
  (*depth)++;
  Recurse(depth);
  pad[1] = pad[0];
}

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "print";
  if (!strcmp(mode, "print")) {
    printf("hello from wasm argc=%d\n", argc);
    for (int i = 0; i < argc; i++) printf("arg %d %s\n", i, argv[i]);
    fprintf(stderr, "to stderr\n");
    return 0;
  }
  if (!strcmp(mode, "exit")) return atoi(argv[2]);
  if (!strcmp(mode, "procexit")) { fflush(stdout); __wasi_proc_exit(atoi(argv[2])); }
  if (!strcmp(mode, "env")) {
    printf("FOO=%s\n", getenv("FOO") ? getenv("FOO") : "(null)");
    printf("HOME=%s\n", getenv("HOME") ? getenv("HOME") : "(null)");
    return 0;
  }
  if (!strcmp(mode, "clock")) {
    struct timespec a, b;
    clock_gettime(CLOCK_REALTIME, &a);
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("realtime %lld monotonic_ok %d\n", (long long)a.tv_sec, b.tv_sec >= 0);
    return 0;
  }
  if (!strcmp(mode, "random")) {
    unsigned char r[16];
    if (__wasi_random_get(r, sizeof(r)) != 0) return 1;
    for (int i = 0; i < 16; i++) printf("%02x", r[i]);
    printf("\n");
    return 0;
  }
  if (!strcmp(mode, "sleep")) {
    struct timespec ts = {0, atoi(argv[2]) * 1000000L};
    nanosleep(&ts, NULL);
    printf("slept\n");
    return 0;
  }
  if (!strcmp(mode, "stdin")) {
    char buf[256];
    ssize_t n = read(0, buf, sizeof(buf));
    printf("stdin %zd [%.*s]\n", n, (int)(n > 0 ? n : 0), buf);
    return 0;
  }
  if (!strcmp(mode, "cat")) {
    FILE* f = fopen(argv[2], "r");
    if (!f) { printf("cat %s: errno %d\n", argv[2], errno); return 1; }
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof(buf), f)) > 0) fwrite(buf, 1, n, stdout);
    fclose(f);
    return 0;
  }
  if (!strcmp(mode, "write")) {
    FILE* f = fopen(argv[2], "w");
    if (!f) { printf("write %s: errno %d\n", argv[2], errno); return 1; }
    fputs(argv[3], f);
    fclose(f);
    printf("wrote %s\n", argv[2]);
    return 0;
  }
  if (!strcmp(mode, "nulname")) {
    // A name with NUL bytes, made through the raw WASI call (libc would stop at the NUL): it
    // looks like extra fields to any NUL-separated listing.
    static const char kName[] = "workspace/evil\0dir\0999\0x";
    uint32_t fd;
    uint16_t e = RawPathOpen(3, 0, kName, sizeof(kName) - 1, __WASI_OFLAGS_CREAT,
                             __WASI_RIGHTS_FD_WRITE, 0, 0, &fd);
    printf("nulname: errno %d\n", e);
    return 0;
  }
  if (!strcmp(mode, "files")) return Files();
  if (!strcmp(mode, "escape")) return Escape();
  if (!strcmp(mode, "readonly")) return ReadOnly();
  if (!strcmp(mode, "fill")) return Fill();
  if (!strcmp(mode, "alloc")) return Alloc();
  if (!strcmp(mode, "hostile")) return Hostile();
  if (!strcmp(mode, "allimports")) return AllImports();
  if (!strcmp(mode, "loop")) {
    volatile unsigned long i = 0;
    for (;;) i++;
  }
  if (!strcmp(mode, "recurse")) {
    volatile int depth = 0;
    Recurse(&depth);
    return 0;
  }
  if (!strcmp(mode, "bigout")) {
    long n = atol(argv[2]);
    for (long i = 0; i < n; i++) putchar('a' + i % 26);
    fprintf(stderr, "err done\n");
    return 0;
  }
  if (!strcmp(mode, "trap")) {
    volatile int* p = (int*)(uintptr_t)0xFFFFFFF0u;
    return *p;
  }
  printf("unknown mode %s\n", mode);
  return 2;
}

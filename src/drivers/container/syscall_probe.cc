// Test helper (static, runs inside a sandbox): attempts the system calls the container must
// refuse and prints "name=RESULT" per line, RESULT being OK or the errno name (EPERM, ...).
#include <errno.h>
#include <fcntl.h>
#include <linux/sched.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/personality.h>
#include <sys/ptrace.h>
#include <sys/stat.h>
#include <sys/swap.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

void Report(const char* name, long result) {
  printf("%s=%s\n", name, result < 0 ? strerrorname_np(errno) : "OK");
}

// A raw clone with the given flags; the child exits at once.
long TryClone(unsigned long flags) {
  long r = syscall(SYS_clone, flags | SIGCHLD, 0, 0, 0, 0);
  if (r == 0) _exit(0);
  if (r > 0) waitpid(static_cast<pid_t>(r), nullptr, 0);
  return r;
}

}  // namespace

int main() {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  Report("mount", mount("none", "/tmp", "tmpfs", 0, ""));
  Report("umount2", umount2("/proc", MNT_DETACH));
  Report("unshare_user", unshare(CLONE_NEWUSER));
  Report("unshare_mount", unshare(CLONE_NEWNS));
  Report("unshare_net", unshare(CLONE_NEWNET));
  int ns = open("/proc/self/ns/net", O_RDONLY);
  Report("setns", setns(ns, 0));
  Report("ptrace_traceme", ptrace(PTRACE_TRACEME, 0, nullptr, nullptr));
  Report("ptrace_attach", ptrace(PTRACE_ATTACH, 1, nullptr, nullptr));
  Report("bpf", syscall(SYS_bpf, 0, nullptr, 0));
  Report("init_module", syscall(SYS_init_module, nullptr, 0, ""));
  Report("finit_module", syscall(SYS_finit_module, -1, "", 0));
  Report("delete_module", syscall(SYS_delete_module, "x", 0));
  Report("kexec_load", syscall(SYS_kexec_load, 0, 0, nullptr, 0));
  Report("perf_event_open", syscall(SYS_perf_event_open, nullptr, 0, -1, -1, 0));
  Report("keyctl", syscall(SYS_keyctl, 0, 0, 0, 0, 0));
  Report("add_key", syscall(SYS_add_key, "user", "x", "y", 1, -2));
  Report("request_key", syscall(SYS_request_key, "user", "x", nullptr, 0));
  Report("userfaultfd", syscall(SYS_userfaultfd, 0));
  Report("open_by_handle_at", syscall(SYS_open_by_handle_at, AT_FDCWD, nullptr, 0));
  Report("io_uring_setup", syscall(SYS_io_uring_setup, 1, nullptr));
  Report("personality_query", personality(0xffffffff));
  Report("personality_change", personality(ADDR_NO_RANDOMIZE));
  Report("clone_newuser", TryClone(CLONE_NEWUSER));
  Report("clone_newns", TryClone(CLONE_NEWNS));
  Report("clone_plain", TryClone(0));
  struct clone_args args = {};
  args.exit_signal = SIGCHLD;
  long c3 = syscall(SYS_clone3, &args, sizeof(args));
  if (c3 == 0) _exit(0);
  Report("clone3", c3);
  Report("chroot", chroot("/"));
  Report("swapon", swapon("/tmp/x", 0));
  Report("sethostname", sethostname("x", 1));
  Report("mknod", mknod("/tmp/null2", S_IFCHR | 0666, makedev(1, 3)));
  Report("fork", TryClone(0));
  return 0;
}

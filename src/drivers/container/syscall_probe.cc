// Test helper (static, runs inside a sandbox): attempts the system calls the container must
// refuse and prints "name=RESULT" per line, RESULT being OK or the errno name (EPERM, ...).
#include <errno.h>
#include <fcntl.h>
#include <linux/netlink.h>
#include <linux/sched.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/personality.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/swap.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
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

long TrySocket(long family, int type, int protocol) {
  long fd = syscall(SYS_socket, family, type, protocol);
  if (fd >= 0) close(static_cast<int>(fd));
  return fd;
}

long TrySocketpair(int family) {
  int sv[2];
  long r = socketpair(family, SOCK_STREAM, 0, sv);
  if (r == 0) close(sv[0]), close(sv[1]);
  return r;
}

// `syscall_probe connect PATH`: connects to a unix socket and reports whether any byte (the
// agent's HELLO) arrives within a second: connect=..., hello=<bytes>.
int ProbeConnect(const char* path) {
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  strncpy(addr.sun_path, path, sizeof addr.sun_path - 1);
  long r = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  Report("connect", r);
  if (r != 0) return 0;
  pollfd p{fd, POLLIN, 0};
  char buf[256];
  ssize_t n = poll(&p, 1, 1000) == 1 ? read(fd, buf, sizeof buf) : -1;
  printf("hello=%zd\n", n < 0 ? 0 : n);
  return 0;
}

}  // namespace

// Address families: only unix, inet, inet6 and netlink-route are a sandbox's business.
// `syscall_probe sockets` runs only these (harmless on the host, where the test learns which
// families the kernel has at all).
static void ProbeSockets() {
  Report("socket_unix", TrySocket(AF_UNIX, SOCK_STREAM, 0));
  Report("socket_inet", TrySocket(AF_INET, SOCK_STREAM, 0));
  Report("socket_inet6", TrySocket(AF_INET6, SOCK_DGRAM, 0));
  Report("socket_netlink_route", TrySocket(AF_NETLINK, SOCK_RAW, NETLINK_ROUTE));
  Report("socket_netlink_audit", TrySocket(AF_NETLINK, SOCK_RAW, NETLINK_AUDIT));
  Report("socket_vsock", TrySocket(40, SOCK_STREAM, 0));
  Report("socket_vsock_high_bits", TrySocket(0x100000000L | 40, SOCK_STREAM, 0));
  Report("socket_packet", TrySocket(17, SOCK_RAW, 0));
  Report("socket_alg", TrySocket(38, SOCK_SEQPACKET, 0));
  Report("socket_key", TrySocket(15, SOCK_RAW, 2));
  Report("socket_bluetooth", TrySocket(31, SOCK_RAW, 0));
  Report("socket_appletalk", TrySocket(5, SOCK_DGRAM, 0));
  Report("socket_unspec", TrySocket(0, SOCK_STREAM, 0));
  Report("socketpair_unix", TrySocketpair(AF_UNIX));
  Report("socketpair_vsock", TrySocketpair(40));
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  if (argc == 3 && strcmp(argv[1], "connect") == 0) return ProbeConnect(argv[2]);
  if (argc == 2 && strcmp(argv[1], "sockets") == 0) return ProbeSockets(), 0;
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
  ProbeSockets();
  return 0;
}

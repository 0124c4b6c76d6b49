#include "drivers/container/seccomp_profile.h"

#include <cerrno>

namespace esb::container {
namespace {

// clone(2) flags that create namespaces: CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS |
// CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET. (CLONE_NEWTIME shares its bit
// with the exit-signal field of clone(2), so it cannot be filtered there; unshare and clone3
// are blocked instead.)
constexpr uint64_t kCloneNamespaceFlags = 0x7E020000ULL;

boost::json::array Strings(const std::vector<std::string>& names) {
  boost::json::array a;
  for (const std::string& n : names) a.emplace_back(n);
  return a;
}

boost::json::object Rule(std::vector<std::string> names, const char* action) {
  return {{"names", Strings(names)}, {"action", action}};
}

}  // namespace

const std::vector<std::string>& SeccompDeniedSyscalls() {
  static const std::vector<std::string> kDenied = {
      // mounting and namespaces
      "mount", "umount", "umount2", "pivot_root", "chroot", "unshare", "setns", "fsopen",
      "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr",
      // debugging other processes
      "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "perf_event_open",
      // kernel code, keys, eBPF, userfaultfd
      "bpf", "init_module", "finit_module", "delete_module", "create_module", "kexec_load",
      "kexec_file_load", "keyctl", "add_key", "request_key", "userfaultfd", "open_by_handle_at",
      "name_to_handle_at", "lookup_dcookie", "uselib",
      // host administration
      "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "syslog", "settimeofday",
      "clock_settime", "clock_adjtime", "adjtimex", "stime", "iopl", "ioperm", "vhangup",
      "nfsservctl", "sethostname", "setdomainname", "_sysctl", "fanotify_init", "modify_ldt",
      "vm86", "vm86old",
      // io_uring bypasses seccomp for the operations it submits
      "io_uring_setup", "io_uring_enter", "io_uring_register"};
  return kDenied;
}

const std::vector<std::string>& SeccompAllowedSyscalls() {
  static const std::vector<std::string> kAllowed = {"accept",
                                                    "accept4",
                                                    "access",
                                                    "alarm",
                                                    "arch_prctl",
                                                    "bind",
                                                    "brk",
                                                    "capget",
                                                    "capset",
                                                    "chdir",
                                                    "chmod",
                                                    "chown",
                                                    "chown32",
                                                    "clock_getres",
                                                    "clock_getres_time64",
                                                    "clock_gettime",
                                                    "clock_gettime64",
                                                    "clock_nanosleep",
                                                    "clock_nanosleep_time64",
                                                    "close",
                                                    "close_range",
                                                    "connect",
                                                    "copy_file_range",
                                                    "creat",
                                                    "dup",
                                                    "dup2",
                                                    "dup3",
                                                    "epoll_create",
                                                    "epoll_create1",
                                                    "epoll_ctl",
                                                    "epoll_ctl_old",
                                                    "epoll_pwait",
                                                    "epoll_pwait2",
                                                    "epoll_wait",
                                                    "epoll_wait_old",
                                                    "eventfd",
                                                    "eventfd2",
                                                    "execve",
                                                    "execveat",
                                                    "exit",
                                                    "exit_group",
                                                    "faccessat",
                                                    "faccessat2",
                                                    "fadvise64",
                                                    "fadvise64_64",
                                                    "fallocate",
                                                    "fchdir",
                                                    "fchmod",
                                                    "fchmodat",
                                                    "fchmodat2",
                                                    "fchown",
                                                    "fchown32",
                                                    "fchownat",
                                                    "fcntl",
                                                    "fcntl64",
                                                    "fdatasync",
                                                    "fgetxattr",
                                                    "flistxattr",
                                                    "flock",
                                                    "fork",
                                                    "fremovexattr",
                                                    "fsetxattr",
                                                    "fstat",
                                                    "fstat64",
                                                    "fstatat64",
                                                    "fstatfs",
                                                    "fstatfs64",
                                                    "fsync",
                                                    "ftruncate",
                                                    "ftruncate64",
                                                    "futex",
                                                    "futex_time64",
                                                    "futex_waitv",
                                                    "futimesat",
                                                    "getcpu",
                                                    "getcwd",
                                                    "getdents",
                                                    "getdents64",
                                                    "getegid",
                                                    "getegid32",
                                                    "geteuid",
                                                    "geteuid32",
                                                    "getgid",
                                                    "getgid32",
                                                    "getgroups",
                                                    "getgroups32",
                                                    "getitimer",
                                                    "getpeername",
                                                    "getpgid",
                                                    "getpgrp",
                                                    "getpid",
                                                    "getppid",
                                                    "getpriority",
                                                    "getrandom",
                                                    "getresgid",
                                                    "getresgid32",
                                                    "getresuid",
                                                    "getresuid32",
                                                    "getrlimit",
                                                    "get_robust_list",
                                                    "getrusage",
                                                    "getsid",
                                                    "getsockname",
                                                    "getsockopt",
                                                    "get_thread_area",
                                                    "gettid",
                                                    "gettimeofday",
                                                    "getuid",
                                                    "getuid32",
                                                    "getxattr",
                                                    "inotify_add_watch",
                                                    "inotify_init",
                                                    "inotify_init1",
                                                    "inotify_rm_watch",
                                                    "io_cancel",
                                                    "ioctl",
                                                    "io_destroy",
                                                    "io_getevents",
                                                    "io_pgetevents",
                                                    "io_pgetevents_time64",
                                                    "ioprio_get",
                                                    "ioprio_set",
                                                    "io_setup",
                                                    "io_submit",
                                                    "ipc",
                                                    "kill",
                                                    "landlock_add_rule",
                                                    "landlock_create_ruleset",
                                                    "landlock_restrict_self",
                                                    "lchown",
                                                    "lchown32",
                                                    "lgetxattr",
                                                    "link",
                                                    "linkat",
                                                    "listen",
                                                    "listxattr",
                                                    "llistxattr",
                                                    "_llseek",
                                                    "lremovexattr",
                                                    "lseek",
                                                    "lsetxattr",
                                                    "lstat",
                                                    "lstat64",
                                                    "madvise",
                                                    "membarrier",
                                                    "memfd_create",
                                                    "mincore",
                                                    "mkdir",
                                                    "mkdirat",
                                                    "mknod",
                                                    "mknodat",
                                                    "mlock",
                                                    "mlock2",
                                                    "mlockall",
                                                    "mmap",
                                                    "mmap2",
                                                    "mprotect",
                                                    "mq_getsetattr",
                                                    "mq_notify",
                                                    "mq_open",
                                                    "mq_timedreceive",
                                                    "mq_timedreceive_time64",
                                                    "mq_timedsend",
                                                    "mq_timedsend_time64",
                                                    "mq_unlink",
                                                    "mremap",
                                                    "msgctl",
                                                    "msgget",
                                                    "msgrcv",
                                                    "msgsnd",
                                                    "msync",
                                                    "munlock",
                                                    "munlockall",
                                                    "munmap",
                                                    "nanosleep",
                                                    "newfstatat",
                                                    "_newselect",
                                                    "open",
                                                    "openat",
                                                    "openat2",
                                                    "pause",
                                                    "pidfd_open",
                                                    "pidfd_send_signal",
                                                    "pipe",
                                                    "pipe2",
                                                    "pkey_alloc",
                                                    "pkey_free",
                                                    "pkey_mprotect",
                                                    "poll",
                                                    "ppoll",
                                                    "ppoll_time64",
                                                    "prctl",
                                                    "pread64",
                                                    "preadv",
                                                    "preadv2",
                                                    "prlimit64",
                                                    "process_mrelease",
                                                    "pselect6",
                                                    "pselect6_time64",
                                                    "pwrite64",
                                                    "pwritev",
                                                    "pwritev2",
                                                    "read",
                                                    "readahead",
                                                    "readlink",
                                                    "readlinkat",
                                                    "readv",
                                                    "recv",
                                                    "recvfrom",
                                                    "recvmmsg",
                                                    "recvmmsg_time64",
                                                    "recvmsg",
                                                    "remap_file_pages",
                                                    "removexattr",
                                                    "rename",
                                                    "renameat",
                                                    "renameat2",
                                                    "restart_syscall",
                                                    "rmdir",
                                                    "rseq",
                                                    "rt_sigaction",
                                                    "rt_sigpending",
                                                    "rt_sigprocmask",
                                                    "rt_sigqueueinfo",
                                                    "rt_sigreturn",
                                                    "rt_sigsuspend",
                                                    "rt_sigtimedwait",
                                                    "rt_sigtimedwait_time64",
                                                    "rt_tgsigqueueinfo",
                                                    "sched_getaffinity",
                                                    "sched_getattr",
                                                    "sched_getparam",
                                                    "sched_get_priority_max",
                                                    "sched_get_priority_min",
                                                    "sched_getscheduler",
                                                    "sched_rr_get_interval",
                                                    "sched_rr_get_interval_time64",
                                                    "sched_setaffinity",
                                                    "sched_setattr",
                                                    "sched_setparam",
                                                    "sched_setscheduler",
                                                    "sched_yield",
                                                    "seccomp",
                                                    "select",
                                                    "semctl",
                                                    "semget",
                                                    "semop",
                                                    "semtimedop",
                                                    "semtimedop_time64",
                                                    "send",
                                                    "sendfile",
                                                    "sendfile64",
                                                    "sendmmsg",
                                                    "sendmsg",
                                                    "sendto",
                                                    "setfsgid",
                                                    "setfsgid32",
                                                    "setfsuid",
                                                    "setfsuid32",
                                                    "setgid",
                                                    "setgid32",
                                                    "setgroups",
                                                    "setgroups32",
                                                    "setitimer",
                                                    "setpgid",
                                                    "setpriority",
                                                    "setregid",
                                                    "setregid32",
                                                    "setresgid",
                                                    "setresgid32",
                                                    "setresuid",
                                                    "setresuid32",
                                                    "setreuid",
                                                    "setreuid32",
                                                    "setrlimit",
                                                    "set_robust_list",
                                                    "setsid",
                                                    "setsockopt",
                                                    "set_thread_area",
                                                    "set_tid_address",
                                                    "setuid",
                                                    "setuid32",
                                                    "setxattr",
                                                    "shmat",
                                                    "shmctl",
                                                    "shmdt",
                                                    "shmget",
                                                    "shutdown",
                                                    "sigaltstack",
                                                    "signalfd",
                                                    "signalfd4",
                                                    "sigpending",
                                                    "sigprocmask",
                                                    "sigreturn",
                                                    "splice",
                                                    "stat",
                                                    "stat64",
                                                    "statfs",
                                                    "statfs64",
                                                    "statx",
                                                    "symlink",
                                                    "symlinkat",
                                                    "sync",
                                                    "sync_file_range",
                                                    "syncfs",
                                                    "sysinfo",
                                                    "tee",
                                                    "tgkill",
                                                    "time",
                                                    "timer_create",
                                                    "timer_delete",
                                                    "timer_getoverrun",
                                                    "timer_gettime",
                                                    "timer_gettime64",
                                                    "timer_settime",
                                                    "timer_settime64",
                                                    "timerfd_create",
                                                    "timerfd_gettime",
                                                    "timerfd_gettime64",
                                                    "timerfd_settime",
                                                    "timerfd_settime64",
                                                    "times",
                                                    "tkill",
                                                    "truncate",
                                                    "truncate64",
                                                    "ugetrlimit",
                                                    "umask",
                                                    "uname",
                                                    "unlink",
                                                    "unlinkat",
                                                    "utime",
                                                    "utimensat",
                                                    "utimensat_time64",
                                                    "utimes",
                                                    "vfork",
                                                    "vmsplice",
                                                    "wait4",
                                                    "waitid",
                                                    "waitpid",
                                                    "write",
                                                    "writev"};
  return kAllowed;
}

const std::vector<SocketFamilyRule>& SocketFamilyRules() {
  static const std::vector<SocketFamilyRule> kRules = [] {
    std::vector<SocketFamilyRule> v;
    auto allow = [&](uint64_t family) {
      v.push_back({family, "SCMP_CMP_EQ", true, 0, true, 0, nullptr});
    };
    auto refuse = [&](uint64_t family, const char* op) {
      v.push_back({family, op, false, EAFNOSUPPORT, true, 0, nullptr});
    };
    allow(1);   // AF_UNIX
    allow(2);   // AF_INET (socketpair: the kernel answers EOPNOTSUPP)
    allow(10);  // AF_INET6
    // AF_NETLINK, socket() with protocol NETLINK_ROUTE only: getifaddrs() (Node's
    // os.networkInterfaces(), Python's psutil, `ip addr`) reads the sandbox's own network
    // namespace through it; changing anything needs CAP_NET_ADMIN, which sandboxes lack.
    // Other netlink protocols match no rule: EPERM (the default action). (libseccomp refuses
    // a second rule on the same argument values with another action: "File exists".)
    v.push_back({16, "SCMP_CMP_EQ", true, 0, false, 0, "SCMP_CMP_EQ"});
    refuse(0, "SCMP_CMP_EQ");
    for (uint64_t f = 3; f <= 9; ++f) refuse(f, "SCMP_CMP_EQ");
    for (uint64_t f = 11; f <= 15; ++f) refuse(f, "SCMP_CMP_EQ");
    // 17 and up (AF_PACKET 17, AF_BLUETOOTH 31, AF_ALG 38, AF_VSOCK 40, upper-half garbage).
    refuse(16, "SCMP_CMP_GT");
    return v;
  }();
  return kRules;
}

boost::json::object BuildSeccompProfile(bool explicit_denies, bool clone3_enosys) {
  boost::json::array syscalls;
  syscalls.push_back(Rule(SeccompAllowedSyscalls(), "SCMP_ACT_ALLOW"));

  // clone: allowed only without namespace flags (fork, vfork-style and thread creation).
  boost::json::object clone = Rule({"clone"}, "SCMP_ACT_ALLOW");
  clone["args"] = boost::json::array{boost::json::object{{"index", 0},
                                                         {"value", kCloneNamespaceFlags},
                                                         {"valueTwo", 0},
                                                         {"op", "SCMP_CMP_MASKED_EQ"}}};
  syscalls.push_back(clone);

  // clone3 passes its flags in memory that seccomp cannot inspect: ENOSYS makes glibc fall
  // back to clone(2), which is filtered above.
  if (clone3_enosys) {
    boost::json::object clone3 = Rule({"clone3"}, "SCMP_ACT_ERRNO");
    clone3["errnoRet"] = ENOSYS;
    syscalls.push_back(clone3);
  } else {
    syscalls.push_back(Rule({"clone3"}, "SCMP_ACT_ALLOW"));
  }

  // socket/socketpair: only the address families a sandbox needs; everything else (AF_VSOCK,
  // which no network namespace confines, AF_PACKET, AF_ALG, AF_KEY, AF_BLUETOOTH, ...) fails
  // with EAFNOSUPPORT. The comparisons are on all 64 bits, so garbage in the upper half of
  // the register (which the kernel would drop) cannot smuggle a family past the allow rules.
  // socketcall(2) (32-bit x86 only) hides its arguments in memory and is not allowed at all.
  for (const SocketFamilyRule& rule : SocketFamilyRules()) {
    boost::json::array names = {"socket"};
    if (rule.socketpair) names.emplace_back("socketpair");
    boost::json::object r = {{"names", names},
                             {"action", rule.allow ? "SCMP_ACT_ALLOW" : "SCMP_ACT_ERRNO"}};
    if (!rule.allow) r["errnoRet"] = rule.errno_value;
    boost::json::array args = {boost::json::object{
        {"index", 0}, {"value", rule.family}, {"valueTwo", 0}, {"op", rule.op}}};
    if (rule.protocol_op != nullptr) {
      args.push_back(boost::json::object{
          {"index", 2}, {"value", rule.protocol}, {"valueTwo", 0}, {"op", rule.protocol_op}});
    }
    r["args"] = args;
    syscalls.push_back(r);
  }

  // personality: only PER_LINUX (0) and the query value 0xffffffff.
  for (uint64_t persona : {0x0ULL, 0xffffffffULL}) {
    boost::json::object p = Rule({"personality"}, "SCMP_ACT_ALLOW");
    p["args"] = boost::json::array{boost::json::object{
        {"index", 0}, {"value", persona}, {"valueTwo", 0}, {"op", "SCMP_CMP_EQ"}}};
    syscalls.push_back(p);
  }

  if (explicit_denies) {
    boost::json::object deny = Rule(SeccompDeniedSyscalls(), "SCMP_ACT_ERRNO");
    deny["errnoRet"] = EPERM;
    syscalls.push_back(deny);
  }

  boost::json::array arches;
  // Only the native ABI. The 32-bit ABIs (reachable from any 64-bit process through
  // `int 0x80`) multiplex socket(2) through socketcall(2), whose arguments live in memory:
  // libseccomp folds every socket rule into one socketcall rule there, so the family filter
  // above could not hold (and runtimes refuse the profile: "File exists"). Syscalls of other
  // ABIs get the runtime's bad-architecture action (the process is killed).
#if defined(__x86_64__)
  arches = {"SCMP_ARCH_X86_64"};
#elif defined(__aarch64__)
  arches = {"SCMP_ARCH_AARCH64"};
#endif
  return {{"defaultAction", "SCMP_ACT_ERRNO"},
          {"defaultErrnoRet", EPERM},
          {"architectures", arches},
          {"syscalls", syscalls}};
}

}  // namespace esb::container

#include "drivers/nano/seccomp_policy.h"

#include <linux/sched.h>
#include <seccomp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>

#include <linux/filter.h>
#include <linux/seccomp.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace esb::nano {

namespace {

// Builds the filter; the caller loads or exports it.
absl::StatusOr<scmp_filter_ctx> BuildFilter(bool allow_fork) {
  scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_KILL_PROCESS);
  if (!ctx) return absl::InternalError("seccomp_init failed");
  int rc = 0;
  auto allow = [&](int nr) { rc |= seccomp_rule_add(ctx, SCMP_ACT_ALLOW, nr, 0); };
  // I/O on the one inherited channel (no open/socket syscalls exist in the list).
  for (int nr : {SCMP_SYS(read), SCMP_SYS(write), SCMP_SYS(readv), SCMP_SYS(writev),
                 SCMP_SYS(recvmsg), SCMP_SYS(sendto), SCMP_SYS(sendmsg), SCMP_SYS(recvfrom),
                 SCMP_SYS(close), SCMP_SYS(poll), SCMP_SYS(ppoll)}) {
    allow(nr);
  }
  // Memory: linear memory reservation/growth and the host heap. Never executable.
  rc |= seccomp_rule_add(ctx, SCMP_ACT_ALLOW, SCMP_SYS(mmap), 1,
                         SCMP_A2(SCMP_CMP_MASKED_EQ, PROT_EXEC, 0));
  rc |= seccomp_rule_add(ctx, SCMP_ACT_ALLOW, SCMP_SYS(mprotect), 1,
                         SCMP_A2(SCMP_CMP_MASKED_EQ, PROT_EXEC, 0));
  for (int nr : {SCMP_SYS(munmap), SCMP_SYS(mremap), SCMP_SYS(madvise), SCMP_SYS(brk)}) allow(nr);
  // Time, randomness, sleeping, signals for the timeout timer and trap recovery.
  for (int nr : {SCMP_SYS(clock_gettime), SCMP_SYS(clock_getres), SCMP_SYS(clock_nanosleep),
                 SCMP_SYS(nanosleep), SCMP_SYS(gettimeofday), SCMP_SYS(getrandom),
                 SCMP_SYS(futex), SCMP_SYS(sched_yield), SCMP_SYS(rt_sigreturn),
                 SCMP_SYS(rt_sigprocmask), SCMP_SYS(setitimer), SCMP_SYS(getitimer),
                 SCMP_SYS(getrusage), SCMP_SYS(restart_syscall), SCMP_SYS(exit),
                 SCMP_SYS(exit_group)}) {
    allow(nr);
  }
  // RLIMIT_CPU backstop on itself only.
  rc |= seccomp_rule_add(ctx, SCMP_ACT_ALLOW, SCMP_SYS(prlimit64), 1, SCMP_A0(SCMP_CMP_EQ, 0));
  if (allow_fork) {
    rc |= seccomp_rule_add(ctx, SCMP_ACT_ALLOW, SCMP_SYS(clone), 1,
                           SCMP_A0(SCMP_CMP_EQ, CLONE_PARENT | SIGCHLD));
    rc |= seccomp_rule_add(ctx, SCMP_ACT_ALLOW, SCMP_SYS(prctl), 1,
                           SCMP_A0(SCMP_CMP_EQ, PR_SET_PDEATHSIG));
  }
  if (rc != 0) {
    seccomp_release(ctx);
    return absl::InternalError("seccomp_rule_add failed");
  }
  return ctx;
}

}  // namespace

absl::Status ApplyWorkerSeccomp(bool allow_fork) {
  absl::StatusOr<scmp_filter_ctx> ctx = BuildFilter(allow_fork);
  if (!ctx.ok()) return ctx.status();
  // SECURITY: from here on the worker can only compute, allocate and talk on its channel.
  int rc = seccomp_load(*ctx);
  seccomp_release(*ctx);
  if (rc != 0) return absl::InternalError(absl::StrCat("seccomp_load: ", strerror(-rc)));
  return absl::OkStatus();
}

absl::StatusOr<std::string> BuildWorkerSeccompBpf(bool allow_fork) {
  absl::StatusOr<scmp_filter_ctx> ctx = BuildFilter(allow_fork);
  if (!ctx.ok()) return ctx.status();
  int fds[2];
  if (pipe(fds) != 0) {
    seccomp_release(*ctx);
    return absl::InternalError("pipe");
  }
  int rc = seccomp_export_bpf(*ctx, fds[1]);
  seccomp_release(*ctx);
  close(fds[1]);
  std::string bpf;
  char buf[4096];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof(buf))) > 0) bpf.append(buf, n);
  close(fds[0]);
  if (rc != 0 || bpf.empty() || bpf.size() % sizeof(sock_filter) != 0) {
    return absl::InternalError("seccomp_export_bpf failed");
  }
  return bpf;
}

absl::Status LoadSeccompBpf(const std::string& bpf) {
  sock_fprog prog{};
  prog.len = static_cast<unsigned short>(bpf.size() / sizeof(sock_filter));
  prog.filter = reinterpret_cast<sock_filter*>(const_cast<char*>(bpf.data()));
  // SECURITY: the worker allowlist, precompiled by the server; requires no_new_privs.
  if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0) != 0) {
    return absl::InternalError(absl::StrCat("PR_SET_SECCOMP: ", strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace esb::nano

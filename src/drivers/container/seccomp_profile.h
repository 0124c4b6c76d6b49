// The seccomp profile every container runs under, in OCI `linux.seccomp` form.
// An allowlist in the spirit of Docker's default profile, minus everything a process without
// capabilities has no business calling; the default action is ERRNO(EPERM).
#pragma once

#include <boost/json.hpp>
#include <string>
#include <vector>

namespace esb::container {

// Syscalls denied outright with EPERM (also absent from the allowlist). Listed explicitly so
// the intent is reviewable and testable.
const std::vector<std::string>& SeccompDeniedSyscalls();
// Syscalls allowed unconditionally.
const std::vector<std::string>& SeccompAllowedSyscalls();

// One seccomp rule on socket(2) (and socketpair(2)) by address family (argument 0) and,
// optionally, protocol (argument 2).
struct SocketFamilyRule {
  uint64_t family;
  const char* op;  // comparison of argument 0 with `family`
  bool allow;      // else ERRNO(errno_value)
  int errno_value;
  bool socketpair;  // the rule covers socketpair too
  uint64_t protocol;
  const char* protocol_op;  // nullptr: no condition on the protocol
};
// Allowed families: AF_UNIX, AF_INET, AF_INET6 and AF_NETLINK/NETLINK_ROUTE (socket only);
// every other family: EAFNOSUPPORT. socketpair(AF_NETLINK) matches no rule: EPERM (default).
const std::vector<SocketFamilyRule>& SocketFamilyRules();

// `linux.seccomp` object for the host architecture. `explicit_denies`: also emit rules for
// SeccompDeniedSyscalls() (same action as the default; some runtimes reject such rules).
// `clone3_enosys`: make clone3 fail with ENOSYS (else it is allowed; only for gVisor).
boost::json::object BuildSeccompProfile(bool explicit_denies = true, bool clone3_enosys = true);

}  // namespace esb::container

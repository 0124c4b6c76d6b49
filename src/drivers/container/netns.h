// Network namespaces of governed environments (issue 12; docs/design.md "Egress").
//
// esbd creates each one itself (the OCI runtime joins it through namespaces[].path and assumes
// it is set up): loopback up, nothing else, no route anywhere. It is kept alive by a bind mount
// of its nsfs file at <kNetnsDir>/<name>, so a listener can be opened in it again at any time
// (after an egress proxy restart or an esbd restart) and the namespace outlives esbd like the
// container does.
// A sandbox with a user namespace (the default) must own its network namespace, as it does when
// the runtime makes both: the runtime mounts a fresh sysfs, which the kernel allows only to an
// owner of the network namespace (else crun falls back to binding the host's /sys, showing the
// host's interfaces and cgroup mounts). So esbd makes the user namespace too, with the
// sandbox's id map, creates the network namespace inside it, and the runtime joins both (the
// user namespace's bind goes once the container runs: its processes keep it alive). Sandbox
// processes have no capabilities, so owning it lets them change nothing, exactly as before.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/util.h"

namespace esb::container {

inline constexpr char kNetnsDir[] = "/run/entersandbox/netns";
// Where the egress proxy listens inside every governed sandbox.
inline constexpr char kEgressListenAddress[] = "127.0.0.1";
inline constexpr uint16_t kEgressListenPort = 3128;

// Creates a network namespace with loopback up and bind-mounts it at `path` (below kNetnsDir).
// userns_host_id == 0: owned by esbd's user namespace (a helper thread unshares it: that
// affects only the thread). Else inside a new user namespace mapping ids 0..map_size-1 to
// userns_host_id.. (made by a short-lived child process), itself bound at `user_path`.
// AlreadyExists when `path` exists.
absl::Status CreateNetns(const std::string& path, const std::string& user_path = "",
                         uint32_t userns_host_id = 0, uint32_t map_size = 0);

// Unmounts and removes `path`; OK when it does not exist. The namespace itself goes when its
// last user (the container's processes, a listener) is gone.
absl::Status RemoveNetns(const std::string& path);

// A listening TCP socket on address:port inside the namespace bound at `path` (a helper thread
// joins it with setns, creates the socket, and goes back). Retries EADDRINUSE for up to
// `busy_wait_ms` (a listener of a dying proxy may still hold the port).
absl::StatusOr<UniqueFd> OpenListenerInNetns(const std::string& path,
                                             const std::string& address = kEgressListenAddress,
                                             uint16_t port = kEgressListenPort,
                                             int busy_wait_ms = 3000);

// A TCP socket created inside the namespace bound at `path` (the same helper-thread setns as
// OpenListenerInNetns) and connected there to address:port — the environment's egress listener
// by default — within `timeout_ms` (DeadlineExceeded); blocking mode on return. Nothing but
// that one peer inside the sandbox's own loopback can be reached through it. The peer socket
// must be owned by one of `owners` (sock_diag: an accepted socket belongs to whoever accepted
// it, one still queued to its listener's owner), else PermissionDenied: who listens there is
// not who was meant to (a sandbox process binds the port while the proxy is down).
absl::StatusOr<UniqueFd> ConnectInNetns(const std::string& path, int timeout_ms,
                                        const std::vector<uid_t>& owners,
                                        const std::string& address = kEgressListenAddress,
                                        uint16_t port = kEgressListenPort);

// ConnectInNetns' check of `fd` (a TCP socket connected inside the namespace at `path`): the
// socket at the other end must be an open connection owned by one of `owners` (sock_diag from
// inside the namespace). PermissionDenied for another owner, Unavailable when it is not open.
absl::Status CheckAcceptorOwner(const std::string& path, int fd, const std::vector<uid_t>& owners);

// A bound user namespace file (CreateNetns' user_path): unmounted and removed, OK if absent.
absl::Status RemoveUserns(const std::string& user_path);

// The names bound below kNetnsDir that start with `prefix` (restart cleanup).
std::vector<std::string> ListNetns(const std::string& prefix);

}  // namespace esb::container

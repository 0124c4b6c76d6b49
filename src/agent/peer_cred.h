// Who may drive the agent, judged from a connection's SO_PEERCRED when the sandbox runs in a
// user namespace (the uid-0 rule in Agent::PeerAllowed covers sandboxes without one).
#pragma once

#include <sys/socket.h>

#include <cstdint>
#include <string_view>

namespace esb::agent {

// True when the text of a /proc/<pid>/{uid,gid}_map covers `id`.
bool IdMapped(std::string_view id_map, uint32_t id);

// esbd (host root) is not mapped into a sandbox's user namespace, so the kernel reports it to
// the agent as the overflow uid and gid with pid 0 (outside the sandbox's pid namespace). Such
// a peer is accepted only when this process's namespace maps neither overflow id: then no
// process of the sandbox can ever present these credentials (its pids are non-zero and its
// ids mapped), and who can reach the socket from outside is decided by the host path's
// permissions (a root-only directory) or by holding the descriptor.
bool IsUnmappedOutsidePeer(const ucred& cred, std::string_view uid_map, std::string_view gid_map,
                           uint32_t overflow_uid, uint32_t overflow_gid);

// The same for this process: reads /proc/self/{uid,gid}_map and the kernel's overflow ids
// once, at the first call.
bool IsUnmappedOutsidePeer(const ucred& cred);

}  // namespace esb::agent

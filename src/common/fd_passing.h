// Passing a file descriptor along a stream of frames on a unix socket (SCM_RIGHTS).
#ifndef ESB_COMMON_FD_PASSING_H_
#define ESB_COMMON_FD_PASSING_H_

#include <string>
#include <string_view>

namespace esb::proto {

// Writes `bytes` (one encoded frame) to the stream socket `sock` with `pass_fd` attached to
// its first byte, then the rest; the receiver pairs the fd with that frame. Retries EINTR; on
// failure returns false with *error set (errno as left by the failing call).
// SECURITY: the caller owns `pass_fd` and decides that the peer may have it; it stays open here.
bool WriteAllWithFd(int sock, std::string_view bytes, int pass_fd, std::string* error);

}  // namespace esb::proto

#endif  // ESB_COMMON_FD_PASSING_H_

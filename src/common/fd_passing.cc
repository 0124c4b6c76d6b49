#include "common/fd_passing.h"

#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cstring>

#include "common/protocol.h"

namespace esb::proto {

bool WriteAllWithFd(int sock, std::string_view bytes, int pass_fd, std::string* error) {
  if (bytes.empty()) {
    *error = "nothing to carry the fd";
    errno = EINVAL;
    return false;
  }
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
  ssize_t n;
  do {
    n = sendmsg(sock, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n <= 0) {
    *error = n < 0 ? strerror(errno) : "short write";
    if (n == 0) errno = EPIPE;
    return false;
  }
  // The fd went with the first chunk; the rest is plain bytes.
  return WriteAll(sock, bytes.substr(static_cast<size_t>(n)), error);
}

}  // namespace esb::proto

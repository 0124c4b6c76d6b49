#include "drivers/container/netns.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/nsfs.h>
#include <linux/sock_diag.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace esb::container {
namespace {

absl::Status MakeDirs(const std::string& path, mode_t mode) {
  std::string partial;
  for (absl::string_view part : absl::StrSplit(path, '/', absl::SkipEmpty())) {
    absl::StrAppend(&partial, "/", part);
    if (::mkdir(partial.c_str(), mode) != 0 && errno != EEXIST) {
      return ErrnoStatus("mkdir " + partial);
    }
  }
  return absl::OkStatus();
}

// Only names below kNetnsDir: every mount and unlink here is confined to esbd's directory.
absl::Status CheckPath(const std::string& path) {
  const std::string dir = std::string(kNetnsDir) + "/";
  const std::string name = path.size() > dir.size() ? path.substr(dir.size()) : "";
  if (!absl::StartsWith(path, dir) || name.empty() || name[0] == '.' ||
      name.find('/') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("network namespace path ", path, " is not a name directly below ", kNetnsDir));
  }
  return absl::OkStatus();
}

// Sets IFF_UP on the loopback interface of the calling thread's network namespace; 0 or an
// errno. Plain system calls only (also run in a forked child).
int LoopbackUp() {
  const int sock = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (sock < 0) return errno;
  struct ifreq ifr = {};
  ifr.ifr_name[0] = 'l';
  ifr.ifr_name[1] = 'o';
  int err = 0;
  if (::ioctl(sock, SIOCGIFFLAGS, &ifr) != 0) {
    err = errno;
  } else {
    ifr.ifr_flags |= IFF_UP;
    if (::ioctl(sock, SIOCSIFFLAGS, &ifr) != 0) err = errno;
  }
  ::close(sock);
  return err;
}

absl::Status MakeMountTarget(const std::string& path) {
  // SECURITY: O_EXCL|O_NOFOLLOW: a fresh root-owned file in esbd's own directory is the only
  // mount target (never an existing entry or a symlink's target).
  UniqueFd f(::open(path.c_str(), O_RDONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0444));
  if (!f) {
    if (errno == EEXIST) return absl::AlreadyExistsError(path + " already exists");
    return ErrnoStatus("create " + path);
  }
  return absl::OkStatus();
}

absl::Status RemoveBind(const std::string& path) {
  if (absl::Status s = CheckPath(path); !s.ok()) return s;
  // SECURITY: unmounts only an nsfs bind esbd made on its own file below kNetnsDir.
  if (::umount2(path.c_str(), MNT_DETACH | UMOUNT_NOFOLLOW) != 0 && errno != EINVAL &&
      errno != ENOENT) {
    return ErrnoStatus("umount " + path);
  }
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return ErrnoStatus("unlink " + path);
  return absl::OkStatus();
}

// One byte over a pipe, waiting at most 5 s (the peer is our own helper or parent).
bool ReadByte(int fd, char expected) {
  struct pollfd p = {fd, POLLIN, 0};
  char c = 0;
  return ::poll(&p, 1, 5000) == 1 && ::read(fd, &c, 1) == 1 && c == expected;
}

absl::Status WriteProcFile(const std::string& path, const std::string& text) {
  UniqueFd f(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
  if (!f || ::write(f.get(), text.data(), text.size()) != static_cast<ssize_t>(text.size())) {
    return ErrnoStatus("write " + path);
  }
  return absl::OkStatus();
}

// The user-namespaced variant of CreateNetns: a forked child unshares a user namespace (its
// maps written by esbd), then a network namespace inside it, brings lo up as the namespace's
// creator, and esbd binds both before the child exits.
absl::Status CreateInUserns(const std::string& path, const std::string& user_path, uint32_t host_id,
                            uint32_t map_size) {
  int to_child[2], to_parent[2];
  if (::pipe2(to_child, O_CLOEXEC) != 0) return ErrnoStatus("pipe");
  UniqueFd child_r(to_child[0]), parent_w(to_child[1]);
  if (::pipe2(to_parent, O_CLOEXEC) != 0) return ErrnoStatus("pipe");
  UniqueFd parent_r(to_parent[0]), child_w(to_parent[1]);
  const pid_t pid = ::fork();
  if (pid < 0) return ErrnoStatus("fork");
  if (pid == 0) {
    // The child: system calls only (esbd is multi-threaded).
    char c = 0;
    // SECURITY: the new user namespace maps exactly the sandbox's own host id range.
    if (::unshare(CLONE_NEWUSER) != 0) _exit(10);
    if (::write(child_w.get(), "u", 1) != 1) _exit(11);
    if (::read(child_r.get(), &c, 1) != 1 || c != 'm') _exit(12);
    if (::unshare(CLONE_NEWNET) != 0) _exit(13);
    if (LoopbackUp() != 0) _exit(14);
    if (::write(child_w.get(), "n", 1) != 1) _exit(15);
    if (::read(child_r.get(), &c, 1) != 1) _exit(16);
    _exit(0);
  }
  child_r.reset();
  child_w.reset();
  absl::Status status;
  const std::string map = absl::StrCat("0 ", host_id, " ", map_size, "\n");
  if (!ReadByte(parent_r.get(), 'u')) {
    status = absl::InternalError("netns helper: unshare(CLONE_NEWUSER) failed");
  } else if (status = WriteProcFile(absl::StrCat("/proc/", pid, "/uid_map"), map); !status.ok()) {
  } else if (status = WriteProcFile(absl::StrCat("/proc/", pid, "/gid_map"), map); !status.ok()) {
  } else if (::write(parent_w.get(), "m", 1) != 1 || !ReadByte(parent_r.get(), 'n')) {
    status = absl::InternalError("netns helper: the network namespace could not be made");
  } else {
    const std::string user_src = absl::StrCat("/proc/", pid, "/ns/user");
    const std::string net_src = absl::StrCat("/proc/", pid, "/ns/net");
    // SECURITY: binds the helper's two namespaces (its own uid range; loopback only) on esbd's
    // root-owned files; nothing else.
    if (::mount(user_src.c_str(), user_path.c_str(), nullptr, MS_BIND, nullptr) != 0) {
      status = ErrnoStatus("bind-mount the user namespace on " + user_path);
    } else if (::mount(net_src.c_str(), path.c_str(), nullptr, MS_BIND, nullptr) != 0) {
      status = ErrnoStatus("bind-mount the network namespace on " + path);
    }
  }
  (void)!::write(parent_w.get(), "x", 1);
  parent_w.reset();
  int wstatus = 0;
  if (!status.ok()) ::kill(pid, SIGKILL);  // SECURITY: our own unreaped child
  ::waitpid(pid, &wstatus, 0);
  return status;
}

}  // namespace

absl::Status CreateNetns(const std::string& path, const std::string& user_path,
                         uint32_t userns_host_id, uint32_t map_size) {
  if (absl::Status s = CheckPath(path); !s.ok()) return s;
  if (userns_host_id != 0) {
    if (absl::Status s = CheckPath(user_path); !s.ok()) return s;
    if (map_size == 0) return absl::InvalidArgumentError("empty user namespace map");
  }
  if (absl::Status s = MakeDirs(kNetnsDir, 0755); !s.ok()) return s;
  if (absl::Status s = MakeMountTarget(path); !s.ok()) return s;
  if (userns_host_id != 0) {
    absl::Status status = MakeMountTarget(user_path);
    if (status.ok()) status = CreateInUserns(path, user_path, userns_host_id, map_size);
    if (!status.ok()) {
      RemoveBind(user_path).IgnoreError();
      RemoveBind(path).IgnoreError();
    }
    return status;
  }
  absl::Status status;
  // unshare(CLONE_NEWNET) changes only the calling thread's namespace: a thread of its own,
  // which ends right after, so no other work of esbd ever runs in the sandbox's namespace.
  std::thread helper([&] {
    // SECURITY: this thread alone enters the new namespace and exits afterwards.
    if (::unshare(CLONE_NEWNET) != 0) {
      status = ErrnoStatus("unshare(CLONE_NEWNET)");
      return;
    }
    if (int err = LoopbackUp(); err != 0) {
      status = ErrnoStatus("bring lo up in the new network namespace", err);
      return;
    }
    const std::string self = absl::StrCat("/proc/self/task/", ::syscall(SYS_gettid), "/ns/net");
    // SECURITY: binds the namespace (loopback only) on esbd's root-owned file; nothing else.
    if (::mount(self.c_str(), path.c_str(), nullptr, MS_BIND, nullptr) != 0) {
      status = ErrnoStatus("bind-mount the network namespace on " + path);
    }
  });
  helper.join();
  if (!status.ok()) ::unlink(path.c_str());
  return status;
}

absl::Status RemoveNetns(const std::string& path) { return RemoveBind(path); }

absl::Status RemoveUserns(const std::string& user_path) { return RemoveBind(user_path); }

namespace {

// A TCP socket created inside the network namespace bound at `path`: a helper thread joins it
// with setns, creates the socket and goes back (and ends). The socket belongs to that
// namespace for its whole life (bind, listen and connect act there), wherever it is used.
absl::StatusOr<UniqueFd> SocketInNetns(const std::string& path, int domain = AF_INET,
                                       int type = SOCK_STREAM, int protocol = 0) {
  if (absl::Status s = CheckPath(path); !s.ok()) return s;
  UniqueFd ns(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  if (!ns) {
    if (errno == ENOENT) return absl::NotFoundError(path + ": no network namespace");
    return ErrnoStatus("open " + path);
  }
  // SECURITY: only an nsfs network namespace is ever joined (a plain file left behind by an
  // interrupted create answers ENOTTY here).
  if (::ioctl(ns.get(), NS_GET_NSTYPE) != CLONE_NEWNET) {
    return absl::FailedPreconditionError(path + " is not a network namespace");
  }
  absl::StatusOr<UniqueFd> result = absl::InternalError("netns socket thread did not run");
  std::thread helper([&] {
    UniqueFd home(::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC));
    if (!home) {
      result = ErrnoStatus("open /proc/thread-self/ns/net");
      return;
    }
    // SECURITY: this helper thread alone enters the sandbox's namespace, creates one socket
    // there and goes back (and ends): the socket stays in the sandbox's namespace, esbd does
    // not.
    if (::setns(ns.get(), CLONE_NEWNET) != 0) {
      result = ErrnoStatus("setns into " + path);
      return;
    }
    UniqueFd sock(::socket(domain, type | SOCK_CLOEXEC, protocol));
    if (!sock) {
      result = ErrnoStatus("socket in " + path);
    } else {
      result = std::move(sock);
    }
    // SECURITY: back to esbd's own namespace before the thread ends (belt and braces: the
    // thread is never reused).
    if (::setns(home.get(), CLONE_NEWNET) != 0) {
      LogError(absl::StrCat("setns back from ", path, ": ", strerror(errno)));
    }
  });
  helper.join();
  return result;
}

absl::StatusOr<sockaddr_in> Ipv4(const std::string& address, uint16_t port) {
  struct sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  if (::inet_pton(AF_INET, address.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError("address must be an IPv4 literal: " + address);
  }
  return addr;
}

}  // namespace

// The owner uid of the socket on the other end of the connected loopback TCP socket `fd` in
// the namespace at `path`, asked through sock_diag (a netlink socket made in that namespace):
// a socket still queued on a listener is owned by the listener's owner, an accepted one by
// whoever accepted it, so this is who serves the port. Must be one of `owners`, else
// PermissionDenied.
absl::Status CheckAcceptorOwner(const std::string& path, int fd, const std::vector<uid_t>& owners) {
  sockaddr_in local = {}, peer = {};
  socklen_t len = sizeof(local);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) != 0)
    return ErrnoStatus("getsockname");
  len = sizeof(peer);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) != 0)
    return ErrnoStatus("getpeername");
  absl::StatusOr<UniqueFd> diag = SocketInNetns(path, AF_NETLINK, SOCK_DGRAM, NETLINK_SOCK_DIAG);
  if (!diag.ok()) return diag.status();
  struct {
    nlmsghdr nlh;
    inet_diag_req_v2 req;
  } msg = {};
  msg.nlh.nlmsg_len = sizeof(msg);
  msg.nlh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  msg.nlh.nlmsg_flags = NLM_F_REQUEST;  // one socket, by its exact address pair
  msg.req.sdiag_family = AF_INET;
  msg.req.sdiag_protocol = IPPROTO_TCP;
  msg.req.idiag_states = ~0u;
  // The peer's view: its local end is our peer address, its remote end is us.
  msg.req.id.idiag_sport = peer.sin_port;
  msg.req.id.idiag_dport = local.sin_port;
  msg.req.id.idiag_src[0] = peer.sin_addr.s_addr;
  msg.req.id.idiag_dst[0] = local.sin_addr.s_addr;
  msg.req.id.idiag_cookie[0] = INET_DIAG_NOCOOKIE;
  msg.req.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  sockaddr_nl kernel = {};
  kernel.nl_family = AF_NETLINK;
  if (::sendto(diag->get(), &msg, sizeof(msg), 0, reinterpret_cast<sockaddr*>(&kernel),
               sizeof(kernel)) != static_cast<ssize_t>(sizeof(msg)))
    return ErrnoStatus("sock_diag request");
  struct pollfd p = {diag->get(), POLLIN, 0};
  if (::poll(&p, 1, 2000) != 1) return absl::UnavailableError("sock_diag: no answer");
  alignas(nlmsghdr) char buf[8192];
  const ssize_t n = ::recv(diag->get(), buf, sizeof(buf), 0);
  if (n < 0) return ErrnoStatus("sock_diag answer");
  auto* h = reinterpret_cast<nlmsghdr*>(buf);
  if (!NLMSG_OK(h, static_cast<unsigned>(n)))
    return absl::UnavailableError("sock_diag: malformed answer");
  if (h->nlmsg_type == NLMSG_ERROR) {
    const auto* err = static_cast<const nlmsgerr*>(NLMSG_DATA(h));
    return ErrnoStatus("sock_diag lookup of the egress listener's connection", -err->error);
  }
  if (h->nlmsg_type != SOCK_DIAG_BY_FAMILY || h->nlmsg_len < NLMSG_LENGTH(sizeof(inet_diag_msg)))
    return absl::UnavailableError("sock_diag: unexpected answer");
  const auto* info = static_cast<const inet_diag_msg*>(NLMSG_DATA(h));
  // An open connection only: a peer that already closed may have become a time-wait socket,
  // which sock_diag reports as uid 0 whoever owned it (and its bytes may still be queued).
  if (info->idiag_state != TCP_ESTABLISHED) {
    return absl::UnavailableError(absl::StrCat("the egress listener's side of the connection in ",
                                               path, " is not open (TCP state ",
                                               static_cast<int>(info->idiag_state), ")"));
  }
  if (std::find(owners.begin(), owners.end(), info->idiag_uid) == owners.end()) {
    return absl::PermissionDeniedError(absl::StrCat("the socket that took the connection to port ",
                                                    ntohs(peer.sin_port), " in ", path,
                                                    " is owned by uid ", info->idiag_uid,
                                                    ", neither esbd's nor the egress proxy's (a "
                                                    "process in the sandbox holds the port?)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<UniqueFd> OpenListenerInNetns(const std::string& path, const std::string& address,
                                             uint16_t port, int busy_wait_ms) {
  auto addr = Ipv4(address, port);
  if (!addr.ok()) return addr.status();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(busy_wait_ms);
  while (true) {
    absl::StatusOr<UniqueFd> sock = SocketInNetns(path);
    if (!sock.ok()) return sock.status();
    int one = 1;
    ::setsockopt(sock->get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(sock->get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr)) != 0) {
      const int err = errno;
      if (err != EADDRINUSE || std::chrono::steady_clock::now() >= deadline) {
        return ErrnoStatus(absl::StrCat("bind ", address, ":", port, " in ", path), err);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    if (::listen(sock->get(), 256) != 0) return ErrnoStatus("listen in " + path);
    return sock;
  }
}

absl::StatusOr<UniqueFd> ConnectInNetns(const std::string& path, int timeout_ms,
                                        const std::vector<uid_t>& owners,
                                        const std::string& address, uint16_t port) {
  auto addr = Ipv4(address, port);
  if (!addr.ok()) return addr.status();
  absl::StatusOr<UniqueFd> sock = SocketInNetns(path, AF_INET, SOCK_STREAM | SOCK_NONBLOCK);
  if (!sock.ok()) return sock.status();
  const std::string what = absl::StrCat(address, ":", port, " in ", path);
  if (::connect(sock->get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr)) != 0) {
    if (errno != EINPROGRESS) return ErrnoStatus("connect to " + what);
    struct pollfd p = {sock->get(), POLLOUT, 0};
    int n;
    do {
      n = ::poll(&p, 1, std::max(timeout_ms, 0));
    } while (n < 0 && errno == EINTR);
    if (n < 0) return ErrnoStatus("poll connecting to " + what);
    if (n == 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("timed out after ", timeout_ms, " ms connecting to ", what));
    }
    int err = 0;
    socklen_t len = sizeof(err);
    if (::getsockopt(sock->get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    if (err != 0) return ErrnoStatus("connect to " + what, err);
  }
  // SECURITY: the socket that took the connection must be esbd's listener's or the proxy's,
  // not one a sandbox process bound on the port while the proxy was down: such a fake proxy
  // could otherwise feed esbd's shared wheel cache.
  if (absl::Status st = CheckAcceptorOwner(path, sock->get(), owners); !st.ok()) return st;
  // Blocking again: the caller decides how it waits.
  const int flags = ::fcntl(sock->get(), F_GETFL);
  if (flags < 0 || ::fcntl(sock->get(), F_SETFL, flags & ~O_NONBLOCK) != 0) {
    return ErrnoStatus("fcntl on the socket to " + what);
  }
  return sock;
}

std::vector<std::string> ListNetns(const std::string& prefix) {
  std::vector<std::string> names;
  DIR* dir = ::opendir(kNetnsDir);
  if (dir == nullptr) return names;
  while (struct dirent* e = ::readdir(dir)) {
    std::string name = e->d_name;
    if (name != "." && name != ".." && absl::StartsWith(name, prefix)) names.push_back(name);
  }
  ::closedir(dir);
  return names;
}

}  // namespace esb::container

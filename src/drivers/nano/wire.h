// The framed protocol between the nano driver (in esbd), the fork server and its workers, over
// unix stream sockets. A message is a string→bytes map (binary safe); one frame is
//   u32 little-endian body length, body = repeated (u32 key_len, key, u32 value_len, value).
// A frame may carry one file descriptor (SCM_RIGHTS), attached to its first byte. The byte
// stream itself (deadline reads, growing reads, writes without SIGPIPE, the clock) is the agent
// protocol's codec (common/protocol.h); only the body format and the fd passing are nano's:
// its messages (up to 80 MiB of program output and files) do not fit the agent frame's 16 MiB.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "common/protocol.h"

namespace esb::nano {

using Msg = std::map<std::string, std::string>;

inline constexpr uint32_t kMaxMsgBytes = 80u << 20;
inline constexpr size_t kMaxMsgFields = 256;

std::string EncodeMsg(const Msg& msg);
bool DecodeMsg(const std::string& body, Msg* msg);

// Sends one frame (and `pass_fd` if >= 0). Returns false on error (errno set).
bool SendMsg(int fd, const Msg& msg, int pass_fd = -1);
// Receives one frame. `deadline_ms` is an absolute CLOCK_MONOTONIC time in ms (< 0: none).
// `*got_fd` (if non-null) receives a passed fd or -1. Returns false on EOF/error/timeout
// (`*timed_out` tells the last apart).
bool RecvMsg(int fd, Msg* msg, int* got_fd = nullptr, int64_t deadline_ms = -1,
             bool* timed_out = nullptr);

inline int64_t NowMonoMs() { return proto::MonotonicMs(); }

// Helpers for typed fields.
int64_t GetInt(const Msg& m, const std::string& key, int64_t def = 0);
std::string GetStr(const Msg& m, const std::string& key);

}  // namespace esb::nano

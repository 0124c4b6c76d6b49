// The messages between the nano driver (in esbd), the fork server and its workers, over unix
// stream sockets. A message (a string→bytes map, binary safe) travels as one frame of the agent
// protocol's codec (common/protocol.h, docs/agent-protocol.md "The nano channel"): REQUEST
// (driver → server/worker) or RESPONSE (server/worker → driver) on stream 1; the header lists
// the fields, `{"fields":[[name, byte length], ...]}`, and the payload is their values,
// concatenated in that order. The nano channel's payload bound is its own (kMaxMsgBytes: up to
// 80 MiB of program output and files), not the agent channel's 16 MiB. A frame may carry one
// file descriptor (SCM_RIGHTS) alongside its first byte: that part is nano's alone.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "common/protocol.h"

namespace esb::nano {

using Msg = std::map<std::string, std::string>;

// The nano channel's payload bound (the codec refuses longer frames from their length prefix).
inline constexpr uint32_t kMaxMsgBytes = 80u << 20;
// SECURITY: workers run guest code; a frame of millions of tiny fields would cost ~50x its size
// in map nodes. Real messages have a handful of fields.
inline constexpr size_t kMaxMsgFields = 256;
inline constexpr uint32_t kMsgStream = 1;

// Message ↔ frame. ToFrame fails (false) on more than kMaxMsgFields fields or a payload over
// kMaxMsgBytes; FromFrame on any header that is not a well-formed field list for exactly the
// payload (wrong shape, repeated or too many names, lengths that do not add up).
bool ToFrame(proto::FrameType type, const Msg& msg, proto::Frame* frame);
bool FromFrame(const proto::Frame& frame, Msg* msg, std::string* error);

// Sends one message as a `type` frame (and `pass_fd` if >= 0). Returns false on error (errno
// set).
bool SendMsg(int fd, proto::FrameType type, const Msg& msg, int pass_fd = -1);
// Receives one message, which must be a `type` frame. `deadline_ms` is an absolute
// CLOCK_MONOTONIC time in ms (< 0: none). `*got_fd` (if non-null) receives a passed fd or -1.
// Returns false on EOF/error/timeout (`*timed_out` tells the last apart).
bool RecvMsg(int fd, proto::FrameType type, Msg* msg, int* got_fd = nullptr,
             int64_t deadline_ms = -1, bool* timed_out = nullptr);

inline int64_t NowMonoMs() { return proto::MonotonicMs(); }

// Helpers for typed fields.
int64_t GetInt(const Msg& m, const std::string& key, int64_t def = 0);
std::string GetStr(const Msg& m, const std::string& key);

}  // namespace esb::nano

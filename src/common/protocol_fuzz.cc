// libFuzzer entry point for the v2 frame decoder: whatever an agent (or whatever answers on its
// socket) sends, FrameDecoder and ReadFrame must refuse or accept without crashing, and every
// frame they accept must re-encode to the same bytes and decode again to the same frame.
// Build and run: see src/common/CMakeLists.txt.
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "common/protocol.h"

namespace {

// JSON numbers past the double range (1E1072) parse as infinity, which has no JSON spelling:
// such a header is accepted (as any number is) but cannot round-trip.
bool HasNonFinite(const boost::json::value& v) {
  if (v.is_double()) return !std::isfinite(v.as_double());
  if (v.is_array()) {
    for (const auto& e : v.as_array()) {
      if (HasNonFinite(e)) return true;
    }
  }
  if (v.is_object()) {
    for (const auto& kv : v.as_object()) {
      if (HasNonFinite(kv.value())) return true;
    }
  }
  return false;
}

// The two payload bounds a channel uses: the agent channel's and the nano tier's
// (drivers/nano/wire.h, kMaxMsgBytes; not linked here, the fuzzer needs only the codec).
constexpr uint32_t kNanoChannelPayload = 80u << 20;

void CheckFrame(const esb::proto::Frame& f, uint32_t max_payload) {
  using esb::proto::FrameType;
  if ((f.type == FrameType::kHello) != (f.stream == 0)) abort();
  if ((f.type == FrameType::kOutput || f.type == FrameType::kInput) &&
      f.payload.size() > esb::proto::kMaxChunkBytes) {
    abort();
  }
  if (f.payload.size() > max_payload) abort();
  if (HasNonFinite(f.header)) return;
  // Round trip: what was accepted encodes to a frame that decodes to the same thing.
  esb::proto::FrameDecoder again(max_payload);
  again.Feed(esb::proto::EncodeFrame(f));
  std::optional<esb::proto::Frame> g = again.Next();
  if (!g || g->type != f.type || g->stream != f.stream || g->payload != f.payload ||
      g->header != f.header) {
    abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  // 1. The incremental decoder, fed in pieces whose sizes come from the input's first byte,
  // on the agent channel or (the first byte's top bit) the nano channel's bound.
  size_t step = size > 0 ? (data[0] % 17) + 1 : 1;
  uint32_t max_payload =
      size > 0 && (data[0] & 0x80) ? kNanoChannelPayload : esb::proto::kMaxPayloadBytes;
  esb::proto::FrameDecoder decoder(max_payload);
  for (size_t i = 0; i < in.size(); i += step) {
    decoder.Feed(in.substr(i, step));
    while (std::optional<esb::proto::Frame> f = decoder.Next()) CheckFrame(*f, max_payload);
    if (decoder.failed()) break;
  }
  if (decoder.failed() && decoder.error().empty()) abort();
  // 2. The blocking reader over a socketpair, with a per-type limit as esbd uses it.
  int sv[2];
  if (size <= 150000 && socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0) {
    ssize_t w = write(sv[0], data, size);
    (void)w;
    close(sv[0]);
    for (int n = 0; n < 64; ++n) {
      esb::proto::Frame f;
      std::string error;
      if (!esb::proto::ReadFrame(
              sv[1], &f, &error, esb::proto::MonotonicMs() + 1000,
              esb::proto::MaxFrameBytes(max_payload),
              [](esb::proto::FrameType type, uint32_t) -> uint32_t {
                return type == esb::proto::FrameType::kResponse ? 1 << 16 : 1 << 20;
              },
              -1, max_payload)) {
        if (error.empty()) abort();
        break;
      }
      CheckFrame(f, max_payload);
    }
    close(sv[1]);
  }
  return 0;
}

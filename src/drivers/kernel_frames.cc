#include "drivers/kernel_frames.h"

#include <cstdint>

namespace esb {
namespace {

constexpr size_t kHeader = 9;            // tag + 8 hex digits
constexpr uint64_t kMaxFrame = 1 << 20;  // kernel.py's FRAME_MAX

// The length in a header, or -1 if the 8 bytes are not lowercase hex or exceed kMaxFrame.
int64_t FrameLength(std::string_view hex) {
  uint64_t n = 0;
  for (char c : hex) {
    int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (v < 0) return -1;
    n = n * 16 + static_cast<uint64_t>(v);
  }
  return n > kMaxFrame ? -1 : static_cast<int64_t>(n);
}

}  // namespace

bool KernelFrameDecoder::Feed(std::string_view data) {
  if (raw_) return data.empty() || out_(Stream::kStdout, data);
  buf_.append(data);
  size_t pos = 0;
  bool ok = true;
  while (ok && buf_.size() - pos >= kHeader) {
    const char tag = buf_[pos];
    const int64_t n = FrameLength(std::string_view(buf_).substr(pos + 1, 8));
    if ((tag != 'O' && tag != 'E') || n < 0) {
      // Not a frame: from here on everything is plain stdout.
      raw_ = true;
      std::string rest = buf_.substr(pos);
      buf_.clear();
      return out_(Stream::kStdout, rest);
    }
    if (buf_.size() - pos - kHeader < static_cast<size_t>(n)) break;
    if (n > 0)
      ok = out_(tag == 'O' ? Stream::kStdout : Stream::kStderr,
                std::string_view(buf_).substr(pos + kHeader, static_cast<size_t>(n)));
    pos += kHeader + static_cast<size_t>(n);
  }
  buf_.erase(0, pos);
  return ok;
}

}  // namespace esb

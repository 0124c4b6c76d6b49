// kernel.py's output framing (src/api/kernel.py, write_frame): the kernel client writes the
// cell's stdout and stderr to ONE pipe (its stdout) as frames — 'O' or 'E', 8 lowercase hex
// digits of length, then that many bytes — because the exec's two pipes cannot keep the
// order in which the cell wrote to each.
#pragma once

#include <string>
#include <string_view>

#include "drivers/driver.h"

namespace esb {

class KernelFrameDecoder {
 public:
  // `out` gets each frame's bytes with its stream, in order.
  explicit KernelFrameDecoder(OutputSink out) : out_(std::move(out)) {}

  // Feeds bytes of the kernel client's stdout as they arrive (any split). Returns false when
  // `out` did (stop the exec). Bytes that are not frames (a kernel.py that does not frame,
  // e.g. an old copy) are passed on as stdout from there on, never lost.
  bool Feed(std::string_view data);

  // Bytes of an unfinished frame still held (the output was cut, e.g. by the exec's cap).
  size_t pending() const { return buf_.size(); }

 private:
  OutputSink out_;
  std::string buf_;
  bool raw_ = false;
};

}  // namespace esb

// Reading a length-prefixed message from an untrusted peer without trusting the length.
// Header-only and standard-library only: the static agent and the nano worker use it too.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>

namespace esb {

// Reads `length` bytes into `*out` with `read_full(char* buf, size_t n) -> bool`, growing the
// buffer in steps (256 KiB, then doubling) as bytes arrive. SECURITY: memory follows the bytes
// the peer actually sends, not the length it announced, so announcing a large message and
// stalling costs nothing.
template <typename ReadFull>
bool ReadGrowing(size_t length, std::string* out, ReadFull read_full) {
  constexpr size_t kStep = 256 * 1024;
  out->clear();
  while (out->size() < length) {
    const size_t have = out->size();
    const size_t next = std::min(length, have < kStep ? kStep : have * 2);
    out->resize(next);
    if (!read_full(out->data() + have, next - have)) return false;
  }
  return true;
}

}  // namespace esb

// Byte encoding of nano's compact snapshot images (nano_driver.h CompactSnapshot): little-endian
// fixed-width integers and length-prefixed strings. The reader checks every length against what
// is left, so a truncated or hostile image fails cleanly (ok() false) instead of reading past
// the end.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace esb::nano {

class ByteWriter {
 public:
  explicit ByteWriter(std::string* out) : out_(out) {}
  void U8(uint8_t v) { out_->push_back(static_cast<char>(v)); }
  void U32(uint32_t v) { Raw(&v, 4); }
  void U64(uint64_t v) { Raw(&v, 8); }
  void Str(std::string_view s) {
    U64(s.size());
    out_->append(s);
  }
  void Raw(const void* p, size_t n) { out_->append(static_cast<const char*>(p), n); }

 private:
  std::string* out_;
};

class ByteReader {
 public:
  explicit ByteReader(std::string_view in) : in_(in) {}
  bool ok() const { return ok_; }
  bool done() const { return in_.empty(); }
  uint8_t U8() {
    uint8_t v = 0;
    Raw(&v, 1);
    return v;
  }
  uint32_t U32() {
    uint32_t v = 0;
    Raw(&v, 4);
    return v;
  }
  uint64_t U64() {
    uint64_t v = 0;
    Raw(&v, 8);
    return v;
  }
  // A view into the input (valid while the input is).
  std::string_view Str() { return Bytes(U64()); }
  std::string_view Bytes(uint64_t n) {
    if (!ok_ || n > in_.size()) {
      ok_ = false;
      return {};
    }
    std::string_view v = in_.substr(0, n);
    in_.remove_prefix(n);
    return v;
  }
  void Raw(void* p, size_t n) {
    std::string_view v = Bytes(n);
    if (ok_) std::memcpy(p, v.data(), n);
  }

 private:
  std::string_view in_;
  bool ok_ = true;
};

}  // namespace esb::nano

#include "governance/dlp/decoders.h"

#include <brotli/decode.h>
#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <numeric>

#include "absl/strings/ascii.h"
#include "common/util.h"

namespace esb::governance::dlp {
namespace {

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) {
    s.remove_suffix(1);
  }
  return s;
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xc0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xe0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else {
    out->push_back(static_cast<char>(0xf0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  }
}

// Appends decoded bytes [out_before, out->size()) to the map, all pointing at `src`.
void MapTo(size_t out_before, const std::string& out, uint32_t src, OffsetMap* map) {
  if (map == nullptr) return;
  for (size_t i = out_before; i < out.size(); ++i) map->push_back(src);
}

// Appends in[from, to) unchanged, each byte mapped to itself: the bulk of a text between its
// escapes (one copy instead of a byte at a time).
void CopyRun(std::string_view in, size_t from, size_t to, std::string* out, OffsetMap* map) {
  out->append(in.data() + from, to - from);
  if (map == nullptr) return;
  const size_t at = map->size();
  map->resize(at + (to - from));
  std::iota(map->begin() + static_cast<std::ptrdiff_t>(at), map->end(),
            static_cast<uint32_t>(from));
}

int ParseHex4(std::string_view s) {
  if (s.size() < 4) return -1;
  int v = 0;
  for (int i = 0; i < 4; ++i) {
    const int h = HexValue(s[i]);
    if (h < 0) return -1;
    v = v * 16 + h;
  }
  return v;
}

}  // namespace

bool UrlDecode(std::string_view in, size_t plus_from, std::string* out, OffsetMap* map) {
  bool changed = false;
  out->clear();
  out->reserve(in.size());
  if (map != nullptr) {
    map->clear();
    map->reserve(in.size() + 1);
  }
  for (size_t i = 0; i < in.size();) {
    if (in[i] != '%' && in[i] != '+') {
      size_t run = i + 1;
      while (run < in.size() && in[run] != '%' && in[run] != '+') ++run;
      CopyRun(in, i, run, out, map);
      i = run;
      continue;
    }
    const size_t before = out->size();
    const char c = in[i];
    if (c == '%' && i + 2 < in.size() && HexValue(in[i + 1]) >= 0 && HexValue(in[i + 2]) >= 0) {
      out->push_back(static_cast<char>(HexValue(in[i + 1]) * 16 + HexValue(in[i + 2])));
      MapTo(before, *out, static_cast<uint32_t>(i), map);
      i += 3;
      changed = true;
      continue;
    }
    if (c == '+' && i >= plus_from) {
      out->push_back(' ');
      changed = true;
    } else {
      out->push_back(c);
    }
    MapTo(before, *out, static_cast<uint32_t>(i), map);
    ++i;
  }
  if (map != nullptr) map->push_back(static_cast<uint32_t>(in.size()));
  return changed;
}

bool JsonUnescape(std::string_view in, std::string* out, OffsetMap* map) {
  bool changed = false;
  out->clear();
  out->reserve(in.size());
  if (map != nullptr) {
    map->clear();
    map->reserve(in.size() + 1);
  }
  for (size_t i = 0; i < in.size();) {
    if (in[i] != '\\') {
      const void* escape = std::memchr(in.data() + i, '\\', in.size() - i);
      const size_t run = escape == nullptr
                             ? in.size()
                             : static_cast<size_t>(static_cast<const char*>(escape) - in.data());
      CopyRun(in, i, run, out, map);
      i = run;
      continue;
    }
    const size_t before = out->size();
    if (i + 1 >= in.size()) {
      out->push_back(in[i]);
      MapTo(before, *out, static_cast<uint32_t>(i), map);
      ++i;
      continue;
    }
    const char e = in[i + 1];
    size_t used = 2;
    switch (e) {
      case '"':
      case '\\':
      case '/':
        out->push_back(e);
        break;
      case 'b':
        out->push_back('\b');
        break;
      case 'f':
        out->push_back('\f');
        break;
      case 'n':
        out->push_back('\n');
        break;
      case 'r':
        out->push_back('\r');
        break;
      case 't':
        out->push_back('\t');
        break;
      case 'u': {
        const int hi = ParseHex4(in.substr(i + 2));
        if (hi < 0) {
          used = 0;
          break;
        }
        used = 6;
        uint32_t cp = static_cast<uint32_t>(hi);
        if (hi >= 0xd800 && hi <= 0xdbff) {
          const int lo = (i + 7 < in.size() && in[i + 6] == '\\' && in[i + 7] == 'u')
                             ? ParseHex4(in.substr(i + 8))
                             : -1;
          if (lo >= 0xdc00 && lo <= 0xdfff) {
            cp = 0x10000 + ((static_cast<uint32_t>(hi) - 0xd800) << 10) +
                 (static_cast<uint32_t>(lo) - 0xdc00);
            used = 12;
          } else {
            cp = 0xfffd;
          }
        } else if (hi >= 0xdc00 && hi <= 0xdfff) {
          cp = 0xfffd;
        }
        AppendUtf8(cp, out);
        break;
      }
      default:
        used = 0;
    }
    if (used == 0) {  // not an escape: keep the backslash
      out->push_back('\\');
      MapTo(before, *out, static_cast<uint32_t>(i), map);
      ++i;
      continue;
    }
    changed = true;
    MapTo(before, *out, static_cast<uint32_t>(i), map);
    i += used;
  }
  if (map != nullptr) map->push_back(static_cast<uint32_t>(in.size()));
  return changed;
}

bool Base64Decode(std::string_view in, std::string* out, OffsetMap* map) {
  out->clear();
  if (map != nullptr) map->clear();
  uint32_t acc = 0;
  int bits = 0;
  size_t group_start = 0;
  int group_chars = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const char c = in[i];
    int v;
    if (c >= 'A' && c <= 'Z') {
      v = c - 'A';
    } else if (c >= 'a' && c <= 'z') {
      v = c - 'a' + 26;
    } else if (c >= '0' && c <= '9') {
      v = c - '0' + 52;
    } else if (c == '+' || c == '-') {
      v = 62;
    } else if (c == '/' || c == '_') {
      v = 63;
    } else if (c == '=' || c == '\r' || c == '\n' || c == ' ' || c == '\t') {
      continue;
    } else {
      return false;
    }
    if (group_chars == 0) group_start = i;
    group_chars = (group_chars + 1) % 4;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out->push_back(static_cast<char>((acc >> bits) & 0xff));
      if (map != nullptr) map->push_back(static_cast<uint32_t>(group_start));
    }
  }
  if (map != nullptr) map->push_back(static_cast<uint32_t>(in.size()));
  return !out->empty();
}

namespace {

class ChunkedDecoder : public StreamStage {
 public:
  absl::Status Feed(std::string_view in, const Sink& out) override {
    if (!error_.ok()) return error_;
    size_t i = 0;
    while (i < in.size() && stopped_ == false) {
      const char c = in[i];
      switch (state_) {
        case State::kSize:
          if (HexValue(c) >= 0) {
            if (++line_len_ > 16) return Fail("chunk size too long");
            size_ = size_ * 16 + static_cast<uint64_t>(HexValue(c));
            digits_ = true;
          } else if (c == ';' || c == ' ' || c == '\t') {
            if (!digits_) return Fail("chunk size missing");
            state_ = State::kExtension;
          } else if (c == '\r') {
            if (!digits_) return Fail("chunk size missing");
            state_ = State::kSizeLf;
          } else {
            return Fail("bad chunk size");
          }
          ++i;
          break;
        case State::kExtension:
          if (++line_len_ > kMaxLine) return Fail("chunk extension too long");
          if (c == '\r') state_ = State::kSizeLf;
          ++i;
          break;
        case State::kSizeLf:
          if (c != '\n') return Fail("chunk size line not CRLF-terminated");
          ++i;
          line_len_ = 0;
          digits_ = false;
          if (size_ == 0) {
            state_ = State::kTrailer;
          } else {
            state_ = State::kData;
          }
          break;
        case State::kData: {
          const size_t n = static_cast<size_t>(std::min<uint64_t>(size_, in.size() - i));
          if (!out(in.substr(i, n))) stopped_ = true;
          size_ -= n;
          i += n;
          if (size_ == 0) state_ = State::kDataCr;
          break;
        }
        case State::kDataCr:
          if (c != '\r') return Fail("chunk data not followed by CRLF");
          state_ = State::kDataLf;
          ++i;
          break;
        case State::kDataLf:
          if (c != '\n') return Fail("chunk data not followed by CRLF");
          state_ = State::kSize;
          ++i;
          break;
        case State::kTrailer:
          // Trailer lines until an empty line; their content is not body data.
          if ((trailer_bytes_ += 1) > kMaxTrailers) return Fail("trailers too long");
          if (c == '\n') {
            if (line_len_ == 0 || (line_len_ == 1 && last_ == '\r')) {
              state_ = State::kDone;
            }
            line_len_ = 0;
          } else {
            ++line_len_;
          }
          last_ = c;
          ++i;
          break;
        case State::kDone:
          return Fail("data after the last chunk");
      }
    }
    return absl::OkStatus();
  }

  absl::Status Finish(const Sink& out) override {
    if (!error_.ok()) return error_;
    if (stopped_ || state_ == State::kDone) return absl::OkStatus();
    return Fail("chunked body ends before its last chunk");
  }

 private:
  enum class State { kSize, kExtension, kSizeLf, kData, kDataCr, kDataLf, kTrailer, kDone };
  static constexpr size_t kMaxLine = 4096;
  static constexpr size_t kMaxTrailers = 64 * 1024;

  absl::Status Fail(std::string_view what) {
    error_ = absl::InvalidArgumentError(std::string("chunked: ") + std::string(what));
    return error_;
  }

  State state_ = State::kSize;
  uint64_t size_ = 0;
  size_t line_len_ = 0;
  size_t trailer_bytes_ = 0;
  bool digits_ = false;
  bool stopped_ = false;
  char last_ = 0;
  absl::Status error_;
};

constexpr size_t kOutChunk = 16 * 1024;

class ZlibDecoder : public StreamStage {
 public:
  // gzip: windowBits 15+16 (multi-member); deflate: zlib-wrapped or raw, detected from the
  // first two bytes (servers send both).
  explicit ZlibDecoder(bool gzip) : gzip_(gzip) {}
  ~ZlibDecoder() override {
    if (initialised_) inflateEnd(&z_);
  }

  absl::Status Feed(std::string_view in, const Sink& out) override {
    if (!error_.ok() || stopped_) return error_;
    if (!initialised_) {
      header_.append(in);
      if (header_.size() < 2) return absl::OkStatus();
      int bits = 15 + 16;
      if (!gzip_) {
        const auto b0 = static_cast<unsigned char>(header_[0]);
        const auto b1 = static_cast<unsigned char>(header_[1]);
        const bool zlib_wrapped = (b0 & 0x0f) == 8 && ((b0 << 8) | b1) % 31 == 0;
        bits = zlib_wrapped ? 15 : -15;
      }
      if (inflateInit2(&z_, bits) != Z_OK) return Fail("inflateInit2 failed");
      initialised_ = true;
      std::string pending = std::move(header_);
      return Inflate(pending, out);
    }
    return Inflate(in, out);
  }

  absl::Status Finish(const Sink& out) override {
    if (!error_.ok() || stopped_) return error_;
    if (!initialised_) {
      if (header_.empty()) return absl::OkStatus();  // empty body
      return Fail("truncated stream");
    }
    if (!ended_) return Fail("truncated stream");
    return absl::OkStatus();
  }

 private:
  absl::Status Fail(std::string_view what) {
    error_ =
        absl::InvalidArgumentError(std::string(gzip_ ? "gzip: " : "deflate: ") + std::string(what));
    return error_;
  }

  absl::Status Inflate(std::string_view in, const Sink& out) {
    char buf[kOutChunk];
    z_.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
    z_.avail_in = static_cast<uInt>(in.size());
    while (z_.avail_in > 0) {
      if (ended_) {
        // gzip allows several members back to back; anything after a deflate stream is junk
        // the receiver ignores too.
        if (!gzip_) return absl::OkStatus();
        if (inflateReset(&z_) != Z_OK) return Fail("inflateReset failed");
        ended_ = false;
      }
      z_.next_out = reinterpret_cast<Bytef*>(buf);
      z_.avail_out = sizeof(buf);
      const int rc = inflate(&z_, Z_NO_FLUSH);
      if (rc != Z_OK && rc != Z_STREAM_END && rc != Z_BUF_ERROR) {
        return Fail(z_.msg != nullptr ? z_.msg : "corrupt stream");
      }
      const size_t produced = sizeof(buf) - z_.avail_out;
      if (produced > 0 && !out(std::string_view(buf, produced))) {
        stopped_ = true;
        return absl::OkStatus();
      }
      if (rc == Z_STREAM_END) ended_ = true;
      if (rc == Z_BUF_ERROR && produced == 0) break;  // needs more input
    }
    // Flush output that is ready without more input (avail_in == 0 but output pending).
    for (;;) {
      if (ended_) break;
      z_.next_out = reinterpret_cast<Bytef*>(buf);
      z_.avail_out = sizeof(buf);
      const int rc = inflate(&z_, Z_NO_FLUSH);
      const size_t produced = sizeof(buf) - z_.avail_out;
      if (rc != Z_OK && rc != Z_STREAM_END && rc != Z_BUF_ERROR) {
        return Fail(z_.msg != nullptr ? z_.msg : "corrupt stream");
      }
      if (produced > 0 && !out(std::string_view(buf, produced))) {
        stopped_ = true;
        return absl::OkStatus();
      }
      if (rc == Z_STREAM_END) ended_ = true;
      if (produced == 0) break;
    }
    return absl::OkStatus();
  }

  bool gzip_;
  bool initialised_ = false;
  bool ended_ = false;
  bool stopped_ = false;
  std::string header_;
  z_stream z_{};
  absl::Status error_;
};

class BrotliStage : public StreamStage {
 public:
  BrotliStage() : state_(BrotliDecoderCreateInstance(nullptr, nullptr, nullptr)) {}
  ~BrotliStage() override {
    if (state_ != nullptr) BrotliDecoderDestroyInstance(state_);
  }

  absl::Status Feed(std::string_view in, const Sink& out) override {
    if (!error_.ok() || stopped_) return error_;
    if (state_ == nullptr) return Fail("out of memory");
    if (!in.empty()) fed_any_ = true;
    size_t avail_in = in.size();
    const auto* next_in = reinterpret_cast<const uint8_t*>(in.data());
    uint8_t buf[kOutChunk];
    for (;;) {
      size_t avail_out = sizeof(buf);
      uint8_t* next_out = buf;
      const BrotliDecoderResult rc = BrotliDecoderDecompressStream(state_, &avail_in, &next_in,
                                                                   &avail_out, &next_out, nullptr);
      const size_t produced = sizeof(buf) - avail_out;
      if (produced > 0 && !out(std::string_view(reinterpret_cast<const char*>(buf), produced))) {
        stopped_ = true;
        return absl::OkStatus();
      }
      if (rc == BROTLI_DECODER_RESULT_ERROR) {
        return Fail(BrotliDecoderErrorString(BrotliDecoderGetErrorCode(state_)));
      }
      if (rc == BROTLI_DECODER_RESULT_SUCCESS) {
        ended_ = true;
        return absl::OkStatus();  // trailing bytes are ignored, as the receiver does
      }
      if (rc == BROTLI_DECODER_RESULT_NEEDS_MORE_INPUT) return absl::OkStatus();
      // NEEDS_MORE_OUTPUT: loop.
    }
  }

  absl::Status Finish(const Sink& out) override {
    if (!error_.ok() || stopped_) return error_;
    if (!ended_ && fed_any_) return Fail("truncated stream");
    return absl::OkStatus();
  }

 private:
  absl::Status Fail(std::string_view what) {
    error_ = absl::InvalidArgumentError("br: " + std::string(what));
    return error_;
  }

  BrotliDecoderState* state_;
  bool ended_ = false;
  bool stopped_ = false;
  bool fed_any_ = false;
  absl::Status error_;
};

}  // namespace

std::unique_ptr<StreamStage> NewChunkedDecoder() { return std::make_unique<ChunkedDecoder>(); }

absl::StatusOr<std::vector<std::unique_ptr<StreamStage>>> NewContentDecoders(
    std::string_view content_encoding) {
  std::vector<std::string> codings;
  std::string_view rest = content_encoding;
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    const std::string coding = absl::AsciiStrToLower(AbslView(Trim(rest.substr(0, comma))));
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    if (coding.empty() || coding == "identity") continue;
    codings.push_back(coding);
  }
  if (codings.size() > 4) {
    return absl::InvalidArgumentError("more than 4 content codings");
  }
  std::vector<std::unique_ptr<StreamStage>> stages;
  for (auto it = codings.rbegin(); it != codings.rend(); ++it) {
    if (*it == "gzip" || *it == "x-gzip") {
      stages.push_back(std::make_unique<ZlibDecoder>(true));
    } else if (*it == "deflate") {
      stages.push_back(std::make_unique<ZlibDecoder>(false));
    } else if (*it == "br") {
      stages.push_back(std::make_unique<BrotliStage>());
    } else {
      return absl::InvalidArgumentError("unsupported content coding \"" + *it + "\"");
    }
  }
  return stages;
}

std::string MultipartBoundary(std::string_view content_type) {
  const std::string lower = absl::AsciiStrToLower(AbslView(content_type));
  if (lower.rfind("multipart/", 0) != 0) return "";
  size_t pos = lower.find("boundary=");
  while (pos != std::string::npos && pos > 0 && lower[pos - 1] != ';' && lower[pos - 1] != ' ' &&
         lower[pos - 1] != '\t') {
    pos = lower.find("boundary=", pos + 1);
  }
  if (pos == std::string::npos) return "";
  std::string_view value = content_type.substr(pos + 9);
  if (!value.empty() && value.front() == '"') {
    value.remove_prefix(1);
    const size_t end = value.find('"');
    if (end == std::string_view::npos) return "";
    value = value.substr(0, end);
  } else {
    value = Trim(value.substr(0, value.find(';')));
  }
  if (value.empty() || value.size() > 70) return "";  // RFC 2046: 1..70 characters
  return std::string(value);
}

absl::StatusOr<std::vector<MultipartPart>> ParseMultipart(std::string_view body,
                                                          std::string_view boundary,
                                                          size_t max_parts) {
  const std::string delimiter = "--" + std::string(boundary);
  // The first delimiter starts the body or follows a preamble line.
  size_t pos = 0;
  if (body.substr(0, delimiter.size()) != delimiter) {
    pos = body.find("\n" + delimiter);
    if (pos == std::string_view::npos) {
      return absl::InvalidArgumentError("multipart: first boundary missing");
    }
    pos += 1;
  }
  std::vector<MultipartPart> parts;
  const std::string next_delimiter = "\r\n" + delimiter;
  while (true) {
    pos += delimiter.size();
    if (body.substr(pos, 2) == "--") break;  // close delimiter
    const size_t line_end = body.find('\n', pos);
    if (line_end == std::string_view::npos) break;
    size_t headers_start = line_end + 1;
    size_t headers_end = body.find("\r\n\r\n", headers_start);
    size_t content_start = headers_end == std::string_view::npos ? headers_end : headers_end + 4;
    if (body.substr(headers_start, 2) == "\r\n") {  // no headers
      headers_end = headers_start;
      content_start = headers_start + 2;
    }
    if (headers_end == std::string_view::npos) break;
    MultipartPart part;
    std::string_view headers = body.substr(headers_start, headers_end - headers_start);
    while (!headers.empty()) {
      const size_t eol = headers.find("\r\n");
      const std::string_view line = headers.substr(0, eol);
      headers = eol == std::string_view::npos ? std::string_view() : headers.substr(eol + 2);
      const size_t colon = line.find(':');
      if (colon == std::string_view::npos) continue;
      const std::string name = absl::AsciiStrToLower(AbslView(Trim(line.substr(0, colon))));
      const std::string value = absl::AsciiStrToLower(AbslView(Trim(line.substr(colon + 1))));
      if (name == "content-type") {
        part.content_type = std::string(Trim(std::string_view(value).substr(0, value.find(';'))));
      } else if (name == "content-transfer-encoding") {
        part.content_transfer_encoding = value;
      }
    }
    size_t end = body.find(next_delimiter, content_start);
    const bool last = end == std::string_view::npos;
    if (last) end = body.size();
    part.offset = content_start;
    part.length = end - content_start;
    parts.push_back(std::move(part));
    if (last || parts.size() >= max_parts) break;
    pos = end + 2;
  }
  return parts;
}

}  // namespace esb::governance::dlp

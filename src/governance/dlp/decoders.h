// Decoders run before the detectors (docs/design.md "DLP"). Content decoders (URL, JSON
// escapes, base64) turn a complete text into a decoded view and, on request, a map from each
// decoded byte to the offset of its source bytes (so a finding in the view can be redacted in
// the source). Transport decoders (chunked framing, gzip/deflate/br) are streaming stages with
// bounded memory. Internal to the DLP library.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace esb::governance::dlp {

// A decoded view's map: map[i] is the source offset of decoded byte i's escape; map[size] is
// the source size. The source span of decoded [b, e) is [map[b], map[e]).
using OffsetMap = std::vector<uint32_t>;

// Percent-decoding (%XX; malformed escapes stay as they are). '+' becomes ' ' at source
// offsets ≥ plus_from (the query string or a form body; use npos for none). Returns whether
// anything changed; `out` and `map` (optional) are then filled.
bool UrlDecode(std::string_view in, size_t plus_from, std::string* out, OffsetMap* map);

// JSON string escapes anywhere in the text: \" \\ \/ \b \f \n \r \t and \uXXXX (surrogate
// pairs joined, UTF-8 output; lone surrogates become U+FFFD). Malformed escapes stay.
bool JsonUnescape(std::string_view in, std::string* out, OffsetMap* map);

// Base64 (standard or URL-safe alphabet, padding optional, whitespace skipped). False if a byte
// outside the alphabet appears or nothing decodes.
bool Base64Decode(std::string_view in, std::string* out, OffsetMap* map);

// Receives decoded bytes; returns false to stop the producer (the size cap was reached).
using Sink = std::function<bool(std::string_view)>;

// A streaming decoder stage. Feed() may be called with any split of the input. An error is
// final: the stage ignores later input.
class StreamStage {
 public:
  virtual ~StreamStage() = default;
  virtual absl::Status Feed(std::string_view in, const Sink& out) = 0;
  // End of input: an error if the encoded stream is incomplete.
  virtual absl::Status Finish(const Sink& out) = 0;
};

// HTTP/1.1 chunked transfer coding (RFC 9112 §7.1): hex size lines (extensions skipped),
// CRLF-terminated data, trailers. Size lines ≤ 4 KiB, trailers ≤ 64 KiB.
std::unique_ptr<StreamStage> NewChunkedDecoder();

// Content-Encoding stages in decoding order for a header value such as "gzip", "br",
// "deflate", "gzip, br" (applied right to left). "identity" and "" add nothing.
// InvalidArgument for an unsupported coding or more than 4 codings.
absl::StatusOr<std::vector<std::unique_ptr<StreamStage>>> NewContentDecoders(
    std::string_view content_encoding);

// multipart/* boundary from a Content-Type value ("" if not multipart or none).
std::string MultipartBoundary(std::string_view content_type);

struct MultipartPart {
  size_t offset = 0;  // of the part's body in the whole body
  size_t length = 0;
  std::string content_type;               // lower-cased, parameters dropped
  std::string content_transfer_encoding;  // lower-cased
};

// Splits a multipart body (RFC 2046) into parts, at most max_parts. InvalidArgument when the
// first boundary is missing; a missing close delimiter ends the last part at the body's end.
absl::StatusOr<std::vector<MultipartPart>> ParseMultipart(std::string_view body,
                                                          std::string_view boundary,
                                                          size_t max_parts = 1000);

}  // namespace esb::governance::dlp

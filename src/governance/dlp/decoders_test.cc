#include "governance/dlp/decoders.h"

#include <gtest/gtest.h>

#include "governance/dlp/dlp_test_util.h"

namespace esb::governance::dlp {
namespace {

using testing::Brotli;
using testing::Chunked;
using testing::Gzip;

TEST(DlpDecodersTest, UrlDecodeWithMap) {
  std::string out;
  OffsetMap map;
  ASSERT_TRUE(UrlDecode("a%41b+c?d+e%zz%4", 7, &out, &map));
  EXPECT_EQ(out, "aAb+c?d e%zz%4");
  ASSERT_EQ(map.size(), out.size() + 1);
  EXPECT_EQ(map[1], 1u);  // 'A' comes from "%41" at offset 1
  EXPECT_EQ(map[2], 4u);
  EXPECT_EQ(map.back(), 16u);
  EXPECT_FALSE(UrlDecode("plain+text", std::string_view::npos, &out, nullptr));
}

TEST(DlpDecodersTest, JsonUnescape) {
  std::string out;
  OffsetMap map;
  ASSERT_TRUE(JsonUnescape(R"(a\"b\\c\/d\n\u0041\u00e9\ud83d\ude00\ud800x\q)", &out, &map));
  EXPECT_EQ(out, "a\"b\\c/d\nA\xc3\xa9\xf0\x9f\x98\x80\xef\xbf\xbdx\\q");
  ASSERT_EQ(map.size(), out.size() + 1);
  EXPECT_EQ(map[1], 1u);   // \" at 1
  EXPECT_EQ(map[2], 3u);   // b
  EXPECT_EQ(map[8], 12u);  // 'A' from \u0041 at 12
  EXPECT_EQ(map[9], 18u);  // the 2 bytes of é from \u00e9 at 18
  EXPECT_EQ(map[10], 18u);
  EXPECT_FALSE(JsonUnescape("no escapes", &out, nullptr));
  // A truncated \u escape stays as it is.
  ASSERT_FALSE(JsonUnescape(R"(\u12)", &out, nullptr));
}

TEST(DlpDecodersTest, Base64) {
  std::string out;
  OffsetMap map;
  ASSERT_TRUE(Base64Decode("aGVs\r\nbG8=", &out, &map));
  EXPECT_EQ(out, "hello");
  EXPECT_EQ(map[3], 6u);                             // "bG8=" group starts at 6
  ASSERT_TRUE(Base64Decode("-_-_", &out, nullptr));  // URL-safe alphabet
  EXPECT_FALSE(Base64Decode("not base64!", &out, nullptr));
}

std::string Drain(StreamStage& stage, std::string_view in, size_t piece, absl::Status* status) {
  std::string out;
  Sink sink = [&](std::string_view bytes) {
    out.append(bytes);
    return true;
  };
  *status = absl::OkStatus();
  for (size_t i = 0; i < in.size() && status->ok(); i += piece) {
    *status = stage.Feed(in.substr(i, piece), sink);
  }
  if (status->ok()) *status = stage.Finish(sink);
  return out;
}

TEST(DlpDecodersTest, ChunkedAnySplit) {
  const std::string body = "hello chunked world, " + std::string(300, 'x');
  const std::string wire = Chunked(body, 17);
  for (size_t piece = 1; piece <= wire.size(); piece += 7) {
    absl::Status status;
    auto stage = NewChunkedDecoder();
    EXPECT_EQ(Drain(*stage, wire, piece, &status), body) << piece;
    EXPECT_TRUE(status.ok()) << status;
  }
}

TEST(DlpDecodersTest, ChunkedRejectsMalformedFraming) {
  for (const char* bad : {"g\r\nabc\r\n0\r\n\r\n", "3\nabc\r\n0\r\n\r\n", "3\r\nabcd\r\n0\r\n\r\n",
                          "11111111111111111\r\n", "\r\n", "3\r\nabc\r\n"}) {
    absl::Status status;
    auto stage = NewChunkedDecoder();
    Drain(*stage, bad, 1000, &status);
    EXPECT_FALSE(status.ok()) << bad;
  }
}

TEST(DlpDecodersTest, ContentDecodersAnySplitAndStacked) {
  const std::string body = testing::Token(testing::kAlnum, 20000, 77);
  struct Case {
    const char* encoding;
    std::string wire;
  } cases[] = {{"gzip", Gzip(body)},
               {"deflate", testing::ZlibDeflate(body)},
               {"deflate", testing::RawDeflate(body)},
               {"br", Brotli(body)},
               {"GZIP , br", Brotli(Gzip(body))},
               {"gzip", Gzip(body.substr(0, 100)) + Gzip(body.substr(100))}};  // two members
  for (const Case& c : cases) {
    for (size_t piece : {size_t{1}, size_t{333}, size_t{1} << 20}) {
      auto stages = NewContentDecoders(c.encoding);
      ASSERT_TRUE(stages.ok()) << stages.status();
      std::string data = c.wire;
      for (auto& stage : *stages) {
        absl::Status status;
        data = Drain(*stage, data, piece, &status);
        ASSERT_TRUE(status.ok()) << c.encoding << ": " << status;
      }
      EXPECT_EQ(data, body) << c.encoding << " piece " << piece;
    }
  }
}

TEST(DlpDecodersTest, ContentDecodersRejectUnknownAndTooMany) {
  EXPECT_FALSE(NewContentDecoders("zstd").ok());
  EXPECT_FALSE(NewContentDecoders("compress").ok());
  EXPECT_FALSE(NewContentDecoders("gzip,gzip,gzip,gzip,gzip").ok());
  auto none = NewContentDecoders("identity");
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

TEST(DlpDecodersTest, SinkStopEndsDecoding) {
  auto stages = NewContentDecoders("gzip");
  ASSERT_TRUE(stages.ok());
  const std::string wire = Gzip(std::string(1 << 20, 'a'));
  size_t received = 0;
  int calls = 0;
  absl::Status status = (*stages)[0]->Feed(wire, [&](std::string_view bytes) {
    received += bytes.size();
    return ++calls < 2;
  });
  EXPECT_TRUE(status.ok());
  EXPECT_EQ(calls, 2);
  EXPECT_LE(received, 64u * 1024);
}

TEST(DlpDecodersTest, MultipartBoundaryAndParts) {
  EXPECT_EQ(MultipartBoundary("multipart/form-data; boundary=abc"), "abc");
  EXPECT_EQ(MultipartBoundary("Multipart/Mixed; charset=x; boundary=\"a b\""), "a b");
  EXPECT_EQ(MultipartBoundary("application/json; boundary=abc"), "");
  EXPECT_EQ(MultipartBoundary("multipart/form-data; xboundary=abc"), "");

  const std::string body =
      "preamble\r\n--B\r\nContent-Type: Application/JSON; charset=utf-8\r\n\r\n{\"a\":1}\r\n"
      "--B\r\nContent-Transfer-Encoding: BASE64\r\n\r\naGVsbG8=\r\n--B\r\n\r\nno "
      "headers\r\n--B--\r\n";
  auto parts = ParseMultipart(body, "B");
  ASSERT_TRUE(parts.ok()) << parts.status();
  ASSERT_EQ(parts->size(), 3u);
  EXPECT_EQ((*parts)[0].content_type, "application/json");
  EXPECT_EQ(body.substr((*parts)[0].offset, (*parts)[0].length), "{\"a\":1}");
  EXPECT_EQ((*parts)[1].content_transfer_encoding, "base64");
  EXPECT_EQ(body.substr((*parts)[1].offset, (*parts)[1].length), "aGVsbG8=");
  EXPECT_EQ(body.substr((*parts)[2].offset, (*parts)[2].length), "no headers");
  EXPECT_FALSE(ParseMultipart("no boundary here", "B").ok());
  // A part count bound.
  std::string many;
  for (int i = 0; i < 50; ++i) many += "--B\r\n\r\nx\r\n";
  auto limited = ParseMultipart(many + "--B--", "B", 10);
  ASSERT_TRUE(limited.ok());
  EXPECT_EQ(limited->size(), 10u);
}

}  // namespace
}  // namespace esb::governance::dlp

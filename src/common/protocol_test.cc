#include "common/protocol.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

namespace esb::proto {
namespace {

std::string U32(uint32_t v) {
  std::string s(4, '\0');
  s[0] = static_cast<char>(v >> 24);
  s[1] = static_cast<char>(v >> 16);
  s[2] = static_cast<char>(v >> 8);
  s[3] = static_cast<char>(v);
  return s;
}

// A frame built by hand, so the tests do not trust EncodeFrame to check the decoder.
std::string RawFrame(uint8_t type, std::string_view header, std::string_view payload) {
  std::string out = U32(static_cast<uint32_t>(1 + 4 + header.size() + payload.size()));
  out.push_back(static_cast<char>(type));
  out += U32(static_cast<uint32_t>(header.size()));
  out += header;
  out += payload;
  return out;
}

std::string AllBytes() {
  std::string s;
  for (int i = 0; i < 256; ++i) s.push_back(static_cast<char>(i));
  return s;
}

TEST(ProtocolTest, EncodeMatchesTheDocumentedLayout) {
  Frame f;
  f.type = FrameType::kOutput;
  f.header["stream"] = "stdout";
  f.payload = "hi";
  EXPECT_EQ(EncodeFrame(f), RawFrame(3, R"({"stream":"stdout"})", "hi"));
}

TEST(ProtocolTest, RoundTripIsBinarySafeEvenFedByteByByte) {
  Frame a;
  a.type = FrameType::kRequest;
  a.header["op"] = "write";
  a.header["path"] = "x\n\"y\"";
  a.payload = AllBytes();
  Frame b;
  b.type = FrameType::kResponse;
  b.header["ok"] = true;
  std::string wire = EncodeFrame(a) + EncodeFrame(b);

  FrameDecoder decoder;
  std::vector<Frame> frames;
  for (char c : wire) {
    decoder.Feed(std::string_view(&c, 1));
    while (auto f = decoder.Next()) frames.push_back(std::move(*f));
  }
  ASSERT_FALSE(decoder.failed()) << decoder.error();
  ASSERT_EQ(frames.size(), 2u);
  EXPECT_EQ(frames[0].type, FrameType::kRequest);
  EXPECT_EQ(frames[0].header.at("path").as_string(), "x\n\"y\"");
  EXPECT_EQ(frames[0].payload, AllBytes());
  EXPECT_EQ(frames[1].type, FrameType::kResponse);
  EXPECT_TRUE(frames[1].header.at("ok").as_bool());
  EXPECT_EQ(frames[1].payload, "");
}

TEST(ProtocolTest, IncompleteFrameWaitsForMoreBytes) {
  FrameDecoder decoder;
  std::string wire = RawFrame(1, "{}", "abc");
  decoder.Feed(wire.substr(0, wire.size() - 1));
  EXPECT_FALSE(decoder.Next().has_value());
  EXPECT_FALSE(decoder.failed());
  decoder.Feed(wire.substr(wire.size() - 1));
  auto f = decoder.Next();
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->payload, "abc");
}

struct BadFrame {
  const char* name;
  std::string wire;
};

TEST(ProtocolTest, GarbageAndOversizedFramesFailTheDecoder) {
  const BadFrame cases[] = {
      {"oversized length", U32(kMaxFrameBytes + 1)},
      {"huge length", U32(0xffffffff) + "xxxx"},
      {"length too short", U32(2) + "ab"},
      {"zero type", RawFrame(0, "{}", "")},
      {"unknown type", RawFrame(9, "{}", "")},
      {"header not JSON", RawFrame(2, "{nope", "")},
      {"header not an object", RawFrame(2, "[1,2]", "")},
      {"header invalid UTF-8", RawFrame(2, "{\"a\":\"\xff\"}", "")},
      {"header longer than frame", U32(9) + "\x02" + U32(100) + "{}xx"},
      {"header over 64 KiB",
       RawFrame(2, "{\"a\":\"" + std::string(kMaxHeaderBytes, 'x') + "\"}", "")},
      {"deeply nested JSON", RawFrame(2, std::string(10000, '[') + std::string(10000, ']'), "")},
  };
  for (const auto& c : cases) {
    FrameDecoder decoder;
    decoder.Feed(c.wire);
    EXPECT_FALSE(decoder.Next().has_value()) << c.name;
    EXPECT_TRUE(decoder.failed()) << c.name;
    EXPECT_FALSE(decoder.error().empty()) << c.name;
    // The decoder stays failed.
    decoder.Feed(RawFrame(1, "{}", ""));
    EXPECT_FALSE(decoder.Next().has_value()) << c.name;
  }
}

TEST(ProtocolTest, LargestPayloadIsAccepted) {
  Frame f;
  f.type = FrameType::kResponse;
  f.payload.assign(kMaxPayloadBytes, 'z');
  FrameDecoder decoder;
  decoder.Feed(EncodeFrame(f));
  auto got = decoder.Next();
  ASSERT_TRUE(got.has_value()) << decoder.error();
  EXPECT_EQ(got->payload.size(), kMaxPayloadBytes);
}

class SocketPairTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds_), 0); }
  void TearDown() override {
    if (fds_[0] >= 0) close(fds_[0]);
    if (fds_[1] >= 0) close(fds_[1]);
  }
  int fds_[2] = {-1, -1};
};

TEST_F(SocketPairTest, WriteFrameReadFrameRoundTrip) {
  Frame out;
  out.type = FrameType::kRequest;
  out.header["op"] = "ping";
  out.payload = std::string(3 << 20, 'q') + AllBytes();  // larger than the socket buffer
  std::string error;
  std::thread writer([&] { EXPECT_TRUE(WriteFrame(fds_[0], out, &error)) << error; });
  Frame in;
  std::string read_error;
  ASSERT_TRUE(ReadFrame(fds_[1], &in, &read_error, MonotonicMs() + 5000)) << read_error;
  writer.join();
  EXPECT_EQ(in.type, FrameType::kRequest);
  EXPECT_EQ(in.header.at("op").as_string(), "ping");
  EXPECT_EQ(in.payload, out.payload);
}

TEST_F(SocketPairTest, ReadFrameHonoursTheDeadline) {
  Frame in;
  std::string error;
  int64_t start = MonotonicMs();
  EXPECT_FALSE(ReadFrame(fds_[1], &in, &error, start + 100));
  EXPECT_EQ(error, "timed out");
  EXPECT_GE(MonotonicMs() - start, 90);
  EXPECT_LT(MonotonicMs() - start, 2000);
  // A partial frame also times out rather than hanging.
  std::string partial = RawFrame(1, "{}", "abc").substr(0, 7);
  ASSERT_EQ(write(fds_[0], partial.data(), partial.size()), static_cast<ssize_t>(partial.size()));
  EXPECT_FALSE(ReadFrame(fds_[1], &in, &error, MonotonicMs() + 100));
  EXPECT_EQ(error, "timed out");
}

TEST_F(SocketPairTest, ReadFrameReportsEofAndGarbage) {
  std::string garbage = U32(0x7fffffff) + "junk";
  ASSERT_EQ(write(fds_[0], garbage.data(), garbage.size()), static_cast<ssize_t>(garbage.size()));
  Frame in;
  std::string error;
  EXPECT_FALSE(ReadFrame(fds_[1], &in, &error, MonotonicMs() + 1000));
  EXPECT_NE(error.find("too large"), std::string::npos) << error;

  close(fds_[0]);
  fds_[0] = -1;
  error.clear();
  EXPECT_FALSE(ReadFrame(fds_[1], &in, &error, MonotonicMs() + 1000));
  EXPECT_FALSE(error.empty());
}

TEST_F(SocketPairTest, WriteFrameToClosedPeerFailsWithoutSigpipe) {
  close(fds_[1]);
  fds_[1] = -1;
  Frame out;
  out.type = FrameType::kOutput;
  out.payload = "x";
  std::string error;
  EXPECT_FALSE(WriteFrame(fds_[0], out, &error));  // would kill the test with SIGPIPE otherwise
  EXPECT_FALSE(error.empty());
}

TEST_F(SocketPairTest, WriteFrameRefusesOversizedFrames) {
  Frame out;
  out.payload.assign(kMaxPayloadBytes + 1, 'x');
  std::string error;
  EXPECT_FALSE(WriteFrame(fds_[0], out, &error));
  EXPECT_NE(error.find("too large"), std::string::npos);
}

}  // namespace
}  // namespace esb::proto

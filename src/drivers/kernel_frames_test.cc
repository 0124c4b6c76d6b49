#include "drivers/kernel_frames.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

namespace esb {
namespace {

using Events = std::vector<std::pair<Stream, std::string>>;

std::string Frame(char tag, const std::string& data) {
  char header[10];
  std::snprintf(header, sizeof header, "%c%08zx", tag, data.size());
  return std::string(header, 9) + data;
}

struct Recorder {
  Events events;
  OutputSink Sink() {
    return [this](Stream s, std::string_view d) {
      events.emplace_back(s, std::string(d));
      return true;
    };
  }
};

TEST(KernelFrameDecoderTest, KeepsTheOrderAcrossStreams) {
  Recorder rec;
  KernelFrameDecoder d(rec.Sink());
  const std::string raw = Frame('E', "e1\n") + Frame('O', "o1\n") + Frame('E', "e2\n");
  ASSERT_TRUE(d.Feed(raw));
  EXPECT_EQ(
      rec.events,
      (Events{{Stream::kStderr, "e1\n"}, {Stream::kStdout, "o1\n"}, {Stream::kStderr, "e2\n"}}));
  EXPECT_EQ(d.pending(), 0u);
}

TEST(KernelFrameDecoderTest, AnySplitOfTheBytesGivesTheSameFrames) {
  const std::string raw = Frame('O', "héllo\n") + Frame('E', "") +
                          Frame('E', std::string(300, 'x')) + Frame('O', "end");
  Recorder whole;
  KernelFrameDecoder(whole.Sink()).Feed(raw);
  for (size_t step : {1u, 2u, 7u, 9u, 10u, 64u}) {
    Recorder rec;
    KernelFrameDecoder d(rec.Sink());
    for (size_t i = 0; i < raw.size(); i += step) ASSERT_TRUE(d.Feed(raw.substr(i, step)));
    EXPECT_EQ(rec.events, whole.events) << "step " << step;
    EXPECT_EQ(d.pending(), 0u);
  }
  EXPECT_EQ(whole.events.size(), 3u);  // the empty frame carries nothing
}

TEST(KernelFrameDecoderTest, ACutFrameIsHeldNotEmitted) {
  Recorder rec;
  KernelFrameDecoder d(rec.Sink());
  std::string f = Frame('O', "0123456789");
  ASSERT_TRUE(d.Feed(f.substr(0, 14)));
  EXPECT_TRUE(rec.events.empty());
  EXPECT_EQ(d.pending(), 14u);
}

TEST(KernelFrameDecoderTest, BytesThatAreNotFramesPassThroughAsStdout) {
  Recorder rec;
  KernelFrameDecoder d(rec.Sink());
  ASSERT_TRUE(d.Feed(Frame('O', "ok\n") + "Traceback (most recent"));
  ASSERT_TRUE(d.Feed(" call last)\n"));
  EXPECT_EQ(rec.events, (Events{{Stream::kStdout, "ok\n"},
                                {Stream::kStdout, "Traceback (most recent"},
                                {Stream::kStdout, " call last)\n"}}));
  // An absurd length is not a frame either (no buffering of gigabytes on the host).
  Recorder big;
  KernelFrameDecoder d2(big.Sink());
  ASSERT_TRUE(d2.Feed("Offffffff..."));
  EXPECT_EQ(big.events, (Events{{Stream::kStdout, "Offffffff..."}}));
}

TEST(KernelFrameDecoderTest, StopsWhenTheSinkSaysSo) {
  int calls = 0;
  KernelFrameDecoder d([&](Stream, std::string_view) { return ++calls < 2; });
  EXPECT_FALSE(d.Feed(Frame('O', "a") + Frame('O', "b") + Frame('O', "c")));
  EXPECT_EQ(calls, 2);
}

}  // namespace
}  // namespace esb

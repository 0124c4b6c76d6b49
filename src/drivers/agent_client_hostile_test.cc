// AgentClient against a lying agent. Whatever answers on the agent's socket lives inside the
// sandbox, so every reply is hostile input: these tests play a peer that answers with
// oversized, amplifying or malformed frames and assert esbd refuses them without spending
// memory or time on them.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <functional>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/protocol.h"
#include "drivers/agent_client.h"
#include "drivers/testing/memory_blob_store.h"
#include "drivers/workspace_steps.h"

namespace esb {
namespace {

namespace json = boost::json;

std::string U32(uint32_t v) {
  std::string out;
  for (int shift : {24, 16, 8, 0}) out.push_back(static_cast<char>((v >> shift) & 0xff));
  return out;
}

// Encodes a v2 frame by hand so a test can announce lengths the real encoder would refuse.
// HELLO goes on stream 0; everything else on `stream` (the client's first call is stream 1).
std::string RawFrame(proto::FrameType type, const std::string& header, const std::string& payload,
                     uint32_t announced_length = 0, uint32_t stream = 1) {
  uint32_t length =
      announced_length ? announced_length
                       : static_cast<uint32_t>(proto::kFixedBytes + header.size() + payload.size());
  std::string out = U32(length);
  out.push_back(static_cast<char>(proto::kMagic));
  out.push_back(static_cast<char>(type));
  out += U32(type == proto::FrameType::kHello ? 0 : stream);
  out += U32(static_cast<uint32_t>(header.size()));
  return out + header + payload;
}

// The HELLO of a v1 agent, in the v1 layout (u32 length, u8 type, u32 header_len, header).
std::string V1Hello() {
  std::string header = R"({"agent":"esb-agent","version":1,"pid":1})";
  return U32(static_cast<uint32_t>(1 + 4 + header.size())) + "\x01" +
         U32(static_cast<uint32_t>(header.size())) + header;
}

std::string Hello() {
  return RawFrame(proto::FrameType::kHello, R"({"agent":"esb-agent","version":2,"pid":1})", "");
}

bool WriteAll(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

// A fake agent: each connection gets a socketpair whose far end is served by `script`
// (which reads the request and writes whatever it likes) on its own thread.
class LyingAgent {
 public:
  using Script = std::function<void(int fd)>;
  explicit LyingAgent(Script script) : script_(std::move(script)) {}
  ~LyingAgent() {
    for (std::thread& t : threads_) t.join();
  }
  AgentClient Client() {
    return AgentClient([this]() -> absl::StatusOr<int> {
      int sv[2];
      if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
        return absl::InternalError("socketpair");
      }
      threads_.emplace_back([this, fd = sv[1]] {
        script_(fd);
        ::close(fd);
      });
      return sv[0];
    });
  }

 private:
  Script script_;
  std::vector<std::thread> threads_;
};

// Reads the client's request so the reply comes after it (as the real agent's would).
void ReadRequest(int fd) {
  proto::Frame request;
  std::string error;
  proto::ReadFrame(fd, &request, &error, proto::MonotonicMs() + 5000);
}

// A fake agent that says HELLO, reads the request and answers with `reply` (raw frames).
LyingAgent::Script Replying(std::string reply) {
  return [reply = std::move(reply)](int fd) {
    WriteAll(fd, Hello());
    ReadRequest(fd);
    WriteAll(fd, reply);
  };
}

int64_t StatusKb(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field, 0) == 0) return std::stoll(line.substr(strlen(field) + 1));
  }
  return -1;
}

// Resets the peak-RSS counter (VmHWM) so a test can measure its own peak.
void ResetPeakRss() { std::ofstream("/proc/self/clear_refs") << "5"; }

TEST(LyingAgentTest, ListOfMillionsOfEmptyObjectsIsRefusedWithoutAmplification) {
  // The attack from the hardening issue: a 4 MiB payload of `[{},{},...]` made esbd build a
  // 112 MB answer with 1.4 M entries and grow by ~900 MiB.
  std::string payload = "[";
  while (payload.size() < proto::kMaxListPayloadBytes - 8) payload += "{},";
  payload += "{}]";
  LyingAgent agent(
      Replying(RawFrame(proto::FrameType::kResponse,
                        R"({"ok":true,"path":"/workspace","entries_in_payload":true})", payload)));
  AgentClient client = agent.Client();
  ResetPeakRss();
  const int64_t rss_before = StatusKb("VmRSS:");
  absl::StatusOr<DirListing> listing = client.List(".");
  const int64_t peak = StatusKb("VmHWM:");
  EXPECT_FALSE(listing.ok());
  EXPECT_EQ(listing.status().code(), absl::StatusCode::kInternal) << listing.status();
  // The payload itself (4 MiB) is read; nothing near the 40x of a parsed array may follow.
  EXPECT_LT(peak - rss_before, 24 * 1024) << "peak RSS grew by " << (peak - rss_before) << " KiB";
}

TEST(LyingAgentTest, ListBeyondTheEntryLimitIsRefused) {
  std::string entry = R"({"name":"f","type":"file","size":1,"mode":420,"mtime_ms":0})";
  std::string payload = "[";
  for (size_t i = 0; i <= proto::kMaxListEntries; ++i) payload += (i ? "," : "") + entry;
  payload += "]";
  LyingAgent agent(
      Replying(RawFrame(proto::FrameType::kResponse,
                        R"({"ok":true,"path":"/workspace","entries_in_payload":true})", payload)));
  AgentClient client = agent.Client();
  EXPECT_FALSE(client.List(".").ok());
}

TEST(LyingAgentTest, ListEntriesAreCutToWhatARealEntryCanBe) {
  std::string payload = R"([{"name":")" + std::string(100000, 'n') +
                        R"(","type":"char-device","size":-5,"mode":1048575,"mtime_ms":1}])";
  LyingAgent agent(Replying(
      RawFrame(proto::FrameType::kResponse,
               R"({"ok":true,"path":"/x","entries_in_payload":true,"truncated":true})", payload)));
  AgentClient client = agent.Client();
  absl::StatusOr<DirListing> listing = client.List(".");
  ASSERT_TRUE(listing.ok()) << listing.status();
  ASSERT_EQ(listing->entries.size(), 1u);
  EXPECT_TRUE(listing->truncated);
  EXPECT_LE(listing->entries[0].name.size(), 765u);
  EXPECT_EQ(listing->entries[0].type, "other");
  EXPECT_EQ(listing->entries[0].size, 0);
  EXPECT_EQ(listing->entries[0].mode, 07777u);
}

TEST(LyingAgentTest, OversizedFrameForAHeaderOnlyReplyIsRefusedBeforeReading) {
  // Announces a 16 MiB RESPONSE to a ping and sends nothing of it: the client must refuse the
  // length itself (not fail later on the missing bytes).
  LyingAgent agent(
      Replying(RawFrame(proto::FrameType::kResponse, R"({"ok":true})", "", proto::kMaxFrameBytes)));
  AgentClient client = agent.Client();
  auto start = std::chrono::steady_clock::now();
  absl::Status s = client.Ping(10000);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(std::string(s.message()).find("too large"), std::string::npos) << s;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(1000));
}

TEST(LyingAgentTest, ReadReplyLargerThanRequestedIsRefused) {
  LyingAgent agent(Replying(RawFrame(
      proto::FrameType::kResponse, R"({"ok":true,"size":5,"eof":true})", std::string(4096, 'x'))));
  AgentClient client = agent.Client();
  EXPECT_FALSE(client.Read("f", 0, 100).ok());
}

TEST(LyingAgentTest, HugeHelloIsRefused) {
  LyingAgent agent([&](int fd) {
    WriteAll(fd,
             RawFrame(proto::FrameType::kHello,
                      R"({"agent":"esb-agent","pad":")" + std::string(60000, 'p') + R"("})", ""));
  });
  AgentClient client = agent.Client();
  EXPECT_FALSE(client.Ping(2000).ok());
}

TEST(LyingAgentTest, OutputFramesLargerThanTheAgentSendsAreRefused) {
  // Announced beyond 64 KiB: refused from the frame's prefix.
  LyingAgent agent(Replying(RawFrame(proto::FrameType::kOutput, R"({"stream":"stdout"})",
                                     std::string(proto::kMaxChunkBytes + 1, 'o'))));
  AgentClient client = agent.Client();
  ExecRequest request;
  request.command = "true";
  request.timeout = std::chrono::milliseconds(2000);
  request.max_output_bytes = 1 << 20;
  absl::StatusOr<ExecResult> r = client.Exec(request, nullptr);
  EXPECT_FALSE(r.ok());
}

TEST(LyingAgentTest, OutputFrameOnANonExecCallIsAProtocolError) {
  LyingAgent agent(Replying(RawFrame(proto::FrameType::kOutput, R"({"stream":"stdout"})", "x")));
  AgentClient client = agent.Client();
  EXPECT_EQ(client.Ping(2000).code(), absl::StatusCode::kInternal);
}

TEST(LyingAgentTest, ErrorMessagesAreCutAndControlCharactersReplaced) {
  std::string message = "\x1b[31mred\n" + std::string(60000, 'm');
  LyingAgent agent([&](int fd) {
    WriteAll(fd, Hello());
    ReadRequest(fd);
    json::object header{{"ok", false}, {"error", message}, {"errno", "ENOENT"}};
    WriteAll(fd, RawFrame(proto::FrameType::kResponse, json::serialize(header), ""));
  });
  AgentClient client = agent.Client();
  absl::StatusOr<FileEntry> st = client.Stat("x");
  ASSERT_EQ(st.status().code(), absl::StatusCode::kNotFound);
  std::string got(st.status().message());
  EXPECT_LE(got.size(), 1100u);
  EXPECT_EQ(got.find('\x1b'), std::string::npos);
  EXPECT_EQ(got.find('\n'), std::string::npos);
}

// Version skew: an agent of an older esbd (protocol v1) is named, not waited for.
TEST(LyingAgentTest, AgentSpeakingV1IsRecognisedAndNamed) {
  LyingAgent agent([](int fd) {
    WriteAll(fd, V1Hello());
    char buf[256];
    while (::read(fd, buf, sizeof buf) > 0) {  // a v1 agent would wait for its REQUEST
    }
  });
  AgentClient client = agent.Client();
  auto start = std::chrono::steady_clock::now();
  absl::Status s = client.WaitReady(10000);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(2000));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(s.message(),
            "agent speaks protocol v1, esbd needs v2: the environment must be recreated");
  EXPECT_TRUE(AgentProtocolOutdated(s));
  EXPECT_FALSE(AgentProtocolOutdated(absl::FailedPreconditionError("other")));
}

TEST(LyingAgentTest, HelloWithAnotherVersionIsNamed) {
  LyingAgent agent([](int fd) {
    WriteAll(fd, RawFrame(proto::FrameType::kHello, R"({"agent":"esb-agent","version":7})", ""));
  });
  AgentClient client = agent.Client();
  absl::Status s = client.Ping(2000);
  EXPECT_TRUE(AgentProtocolOutdated(s)) << s;
  EXPECT_NE(s.message().find("v7"), std::string::npos) << s;
}

TEST(LyingAgentTest, FrameForAStreamThatIsNotOpenIsAProtocolError) {
  LyingAgent agent(Replying(RawFrame(proto::FrameType::kResponse, R"({"ok":true})", "", 0, 99)));
  AgentClient client = agent.Client();
  absl::Status s = client.Ping(2000);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("not open"), std::string::npos) << s;
}

// The agent may send at most one window of output before esbd grants more; a peer that keeps
// sending while the consumer is busy is cut off instead of filling esbd's memory.
TEST(LyingAgentTest, OutputPastTheWindowIsAProtocolError) {
  LyingAgent agent([](int fd) {
    WriteAll(fd, Hello());
    ReadRequest(fd);
    std::string chunk = RawFrame(proto::FrameType::kOutput, R"({"stream":"stdout"})",
                                 std::string(proto::kMaxChunkBytes, 'o'));
    for (int i = 0; i < 64; ++i) {  // 4 MiB, 16 windows, without waiting for one
      if (!WriteAll(fd, chunk)) break;
    }
  });
  AgentClient client = agent.Client();
  ExecRequest request;
  request.command = "flood";
  request.timeout = std::chrono::milliseconds(5000);
  request.max_output_bytes = 64 << 20;
  bool first = true;
  absl::StatusOr<ExecResult> r = client.Exec(request, [&](Stream, std::string_view) {
    if (first) std::this_thread::sleep_for(std::chrono::milliseconds(300));  // a slow consumer
    first = false;
    return true;
  });
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << r.status();
  EXPECT_NE(r.status().message().find("window"), std::string::npos) << r.status();
}

// The agent dies (or its connection drops) while calls wait: each fails at once, with a message
// that says what happened; none waits for its deadline.
TEST(LyingAgentTest, ConnectionLostMidCallFailsEveryPendingCallPromptly) {
  std::atomic<int> requests{0};
  LyingAgent agent([&](int fd) {
    WriteAll(fd, Hello());
    for (int i = 0; i < 5; ++i) {
      ReadRequest(fd);
      ++requests;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  });  // returning closes the connection
  AgentClient client = agent.Client();
  ASSERT_TRUE(true);
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(5);
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 5; ++i) {
    threads.emplace_back([&, i] {
      if (i % 2) {
        ExecRequest request;
        request.command = "sleep 100";
        request.timeout = std::chrono::milliseconds(60000);
        results[i] = client.Exec(request, nullptr).status();
      } else {
        results[i] = client.Stat("x").status();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(3000));
  for (const absl::Status& s : results) {
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_NE(s.message().find("agent connection lost"), std::string::npos) << s;
  }
}

// A peer that reads its socket just fast enough to never stall a write for 30 s (64 KiB every
// 200 ms, for 15 s) and never answers.
void TrickleReader(int fd) {
  WriteAll(fd, Hello());
  const int64_t stop = proto::MonotonicMs() + 15000;
  std::string buf(64 * 1024, '\0');
  while (proto::MonotonicMs() < stop) {
    if (::read(fd, buf.data(), buf.size()) <= 0) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

// A peer that reads its socket just fast enough to never stall a write for 30 s (64 KiB every
// 200 ms) must not hold a call past the call's deadline: before, a 16 MiB request took ~50 s
// to trickle out, and every other call on the connection waited behind it for the write lock.
TEST(LyingAgentTest, TrickleReadingAgentCannotHoldACallPastItsDeadline) {
  LyingAgent agent(TrickleReader);
  AgentClient client = agent.Client();
  ASSERT_TRUE(client.Capabilities().ok());
  auto start = std::chrono::steady_clock::now();
  absl::Status exec_status, stat_status;
  std::thread exec([&] {
    ExecRequest request;
    request.command = std::string(proto::kMaxPayloadBytes - 1024, 'x');  // in the payload
    request.timeout = std::chrono::milliseconds(1000);                   // deadline: 6 s
    exec_status = client.Exec(request, nullptr).status();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  std::thread stat([&] { stat_status = client.Stat("x").status(); });
  exec.join();
  stat.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(10000));
  EXPECT_FALSE(exec_status.ok());
  EXPECT_FALSE(stat_status.ok());
}

// The same peer, with the small call sent FIRST (so it is not queued behind the big write but
// waiting for its answer): when the big write hits its deadline the connection holds a partial
// frame and can never answer, so the waiting call fails then too instead of at its own 30 s
// deadline. (Seen under load: the order above flipped and the stat took 30.3 s.)
TEST(LyingAgentTest, BrokenWriteFailsCallsAlreadyWaitingForAnswers) {
  LyingAgent agent(TrickleReader);
  AgentClient client = agent.Client();
  ASSERT_TRUE(client.Capabilities().ok());
  auto start = std::chrono::steady_clock::now();
  absl::Status exec_status, stat_status;
  std::thread stat([&] { stat_status = client.Stat("x").status(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the stat is on the wire
  std::thread exec([&] {
    ExecRequest request;
    request.command = std::string(proto::kMaxPayloadBytes - 1024, 'x');  // in the payload
    request.timeout = std::chrono::milliseconds(1000);                   // deadline: 6 s
    exec_status = client.Exec(request, nullptr).status();
  });
  exec.join();
  stat.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(10000));
  EXPECT_FALSE(exec_status.ok());
  EXPECT_EQ(stat_status.code(), absl::StatusCode::kUnavailable) << stat_status;
}

// Attack F11 (REVIEW-issue14.md): an agent that keeps its connection open and reads every
// request but answers none (as the agent did after a broken write left its side half-open)
// made every call of the environment time out, for ever. A call that times out on a connection
// that said nothing meanwhile now pings it; silence there too gives the connection up, its
// pending calls fail at once, and the next call connects again (here to an agent that answers).
TEST(LyingAgentTest, AgentSilentOnAnOpenConnectionIsGivenUpAndTheNextCallReconnects) {
  std::atomic<int> connections{0};
  LyingAgent agent([&](int fd) {
    WriteAll(fd, Hello());
    const bool silent = connections++ == 0;
    for (;;) {
      proto::Frame f;
      std::string error;
      // The silent one reads until esbd gives the connection up (the end of the stream).
      if (!proto::ReadFrame(fd, &f, &error, proto::MonotonicMs() + 30000)) return;
      if (silent || f.type != proto::FrameType::kRequest) continue;
      WriteAll(fd, RawFrame(proto::FrameType::kResponse, R"({"ok":true})", "", 0, f.stream));
    }
  });
  AgentClient client = agent.Client();
  absl::Status pending;
  std::thread other([&] {
    ExecRequest request;  // a call already waiting on the connection when it is given up
    request.command = "sleep 100";
    request.timeout = std::chrono::milliseconds(60000);
    pending = client.Exec(request, nullptr).status();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  auto start = std::chrono::steady_clock::now();
  absl::Status first = client.Ping(1000);
  auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(first.code(), absl::StatusCode::kDeadlineExceeded) << first;
  EXPECT_NE(first.message().find("given up"), std::string::npos) << first;
  EXPECT_LT(took, std::chrono::milliseconds(1000 + 5000 + 2000));
  other.join();
  EXPECT_EQ(pending.code(), absl::StatusCode::kUnavailable) << pending;
  EXPECT_NE(pending.message().find("stopped answering"), std::string::npos) << pending;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(8000));
  EXPECT_TRUE(client.Ping(2000).ok());
  EXPECT_EQ(connections.load(), 2);
}

// A live agent that merely does not answer one call in time is not given up: the probe's ping
// answers, so the timed-out call fails alone and the connection stays.
TEST(LyingAgentTest, ACallTimingOutOnALiveConnectionKeepsTheConnection) {
  std::atomic<int> connections{0};
  LyingAgent agent([&](int fd) {
    ++connections;
    WriteAll(fd, Hello());
    for (;;) {
      proto::Frame f;
      std::string error;
      if (!proto::ReadFrame(fd, &f, &error, proto::MonotonicMs() + 30000)) return;
      if (f.type != proto::FrameType::kRequest) continue;
      const json::value* op = f.header.if_contains("op");
      if (op && op->is_string() && op->as_string() == "exec") continue;  // never answered
      WriteAll(fd, RawFrame(proto::FrameType::kResponse, R"({"ok":true})", "", 0, f.stream));
    }
  });
  AgentClient client = agent.Client();
  ExecRequest request;
  request.command = "true";
  request.timeout = std::chrono::milliseconds(100);  // deadline: 5.1 s
  absl::Status st = client.Exec(request, nullptr).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_EQ(st.message().find("given up"), std::string::npos) << st;
  EXPECT_TRUE(client.Ping(2000).ok());
  EXPECT_EQ(connections.load(), 1);
}

// Numbers out of int64's range (1e300) used to be cast from double, which is undefined
// behaviour (on x86 an exit code of 1e300 came out as 0, i.e. success). They are ignored.
TEST(LyingAgentTest, OutOfRangeNumbersInARepliesAreIgnoredNotCast) {
  LyingAgent agent(Replying(RawFrame(proto::FrameType::kResponse,
                                     R"({"ok":true,"exit_code":1e300,"duration_ms":-1e300})", "")));
  AgentClient client = agent.Client();
  ExecRequest request;
  request.command = "true";
  request.timeout = std::chrono::milliseconds(2000);
  absl::StatusOr<ExecResult> r = client.Exec(request, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, -1);
  EXPECT_EQ(r->duration_ms, 0);
}

// A peer that accepts but never says HELLO: every call gives up at its own deadline. Before,
// a short call queued on the connect lock behind a long call's HELLO wait (here a ping with a
// 500 ms deadline waited the ~5 s of an exec's), so the wait was bounded by someone else's
// deadline, not its own.
TEST(LyingAgentTest, SilentAgentCannotQueueCallsPastTheirDeadlines) {
  LyingAgent agent([](int fd) {
    char byte;
    ::recv(fd, &byte, 1, 0);  // until the client gives up and closes
  });
  AgentClient client = agent.Client();
  absl::Status exec_status, ping_status;
  std::thread exec([&] {
    ExecRequest request;
    request.command = "true";
    request.timeout = std::chrono::milliseconds(1);  // deadline: 5 s (the grace)
    exec_status = client.Exec(request, nullptr).status();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  auto start = std::chrono::steady_clock::now();
  ping_status = client.Ping(500);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(1500));
  EXPECT_EQ(ping_status.code(), absl::StatusCode::kDeadlineExceeded) << ping_status;
  exec.join();
  EXPECT_EQ(exec_status.code(), absl::StatusCode::kDeadlineExceeded) << exec_status;
}

TEST(LyingAgentTest, AnnouncedLengthIsNotAllocatedUpFront) {
  // proto::ReadFrame on its own: a peer announcing the maximum frame and sending 10 bytes
  // costs about those bytes until the deadline, not 16 MiB.
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  std::string bytes = RawFrame(proto::FrameType::kResponse, "{}", "",
                               proto::FrameBytesFor(2, proto::kMaxPayloadBytes));
  ASSERT_TRUE(WriteAll(sv[1], bytes + "0123456789"));
  ResetPeakRss();
  const int64_t rss_before = StatusKb("VmRSS:");
  proto::Frame frame;
  std::string error;
  EXPECT_FALSE(proto::ReadFrame(sv[0], &frame, &error, proto::MonotonicMs() + 300));
  EXPECT_EQ(error, "timed out");
  EXPECT_LT(StatusKb("VmHWM:") - rss_before, 4 * 1024);
  ::close(sv[0]);
  ::close(sv[1]);
}

// --- time travel's walk (drivers/workspace_steps.h) against a lying agent ------------------

LyingAgent::Script WalkReply(const std::string& manifest, const std::string& contents,
                             int64_t manifest_bytes = -1) {
  if (manifest_bytes < 0) manifest_bytes = static_cast<int64_t>(manifest.size());
  return Replying(
      RawFrame(proto::FrameType::kResponse,
               R"({"ok":true,"walk":"w1","manifest_bytes":)" + std::to_string(manifest_bytes) + "}",
               manifest + contents));
}

TEST(LyingAgentTest, WalkWhoseLengthsDoNotAddUpIsRefused) {
  LyingAgent agent(WalkReply("[]", "", 1 << 20));
  AgentClient client = agent.Client();
  EXPECT_FALSE(client.Walk("", true, 100, 1 << 20).ok());
}

TEST(LyingAgentTest, CaptureFromAWalkWithAnEscapingPathStoresNothing) {
  for (const char* path : {"../etc/passwd", "/etc/shadow", "a/../../x"}) {
    LyingAgent agent(
        WalkReply(std::string(R"([[")") + path + R"(","f",420,3,1,"k","",3]])", "abc"));
    AgentClient client = agent.Client();
    testing::MemoryBlobStore blobs;
    std::string base;
    absl::StatusOr<WorkspaceManifest> m = CaptureAgentWorkspace(client, blobs, {}, &base);
    EXPECT_TRUE(absl::IsInvalidArgument(m.status())) << path << ": " << m.status();
    EXPECT_EQ(blobs.puts(), 0) << path;
  }
}

TEST(LyingAgentTest, CaptureTakesSizesAndHashesFromTheBytesNotTheAgent) {
  // Claims an exabyte for a 3-byte file (and would claim any hash it liked: there is no field).
  LyingAgent agent(WalkReply(R"([["a","f",420,1152921504606846976,1,"k","",3]])", "abc"));
  AgentClient client = agent.Client();
  testing::MemoryBlobStore blobs;
  std::string base;
  absl::StatusOr<WorkspaceManifest> m = CaptureAgentWorkspace(client, blobs, {}, &base);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->entries.size(), 1u);
  EXPECT_EQ(m->entries[0].size, 3);
  EXPECT_EQ(m->total_bytes, 3);
  EXPECT_EQ(m->entries[0].sha256,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");  // sha256("abc")
  EXPECT_EQ(base, "w1");
}

TEST(LyingAgentTest, CaptureWithDuplicatePathsStoresNothing) {
  LyingAgent agent(WalkReply(R"([["a","f",420,1,1,"k","",1],["a","f",420,1,1,"k","",1]])", "xy"));
  AgentClient client = agent.Client();
  testing::MemoryBlobStore blobs;
  std::string base;
  EXPECT_TRUE(absl::IsInvalidArgument(CaptureAgentWorkspace(client, blobs, {}, &base).status()));
  EXPECT_EQ(blobs.puts(), 0);
}

// A fake agent serving any number of calls on its connection: `answer` gets each request
// and gives the reply's header and payload (an empty header ends the connection).
using Answer = std::function<std::pair<std::string, std::string>(const proto::Frame&)>;
LyingAgent::Script Serving(Answer answer) {
  return [answer = std::move(answer)](int fd) {
    WriteAll(fd, Hello());
    for (;;) {
      proto::Frame request;
      std::string error;
      if (!proto::ReadFrame(fd, &request, &error, proto::MonotonicMs() + 10000)) return;
      auto [header, payload] = answer(request);
      if (header.empty()) return;
      if (!WriteAll(fd,
                    RawFrame(proto::FrameType::kResponse, header, payload, 0, request.stream))) {
        return;
      }
    }
  };
}

std::string Op(const proto::Frame& f) {
  const json::value* op = f.header.if_contains("op");
  return op && op->is_string() ? std::string(op->as_string()) : "";
}

// A blob store with a small per-blob cap.
class SmallBlobs : public testing::MemoryBlobStore {
 public:
  explicit SmallBlobs(int64_t max) : max_(max) {}
  int64_t max_blob_bytes() const override { return max_; }

 private:
  int64_t max_;
};

// Attack (review H2): a file whose reads never end (it grows as fast as it is read, or the
// agent simply lies: size 1, never eof) made a capture read until the environment's max_bytes
// (up to 64 GiB) into esbd. The capture now stops at the blob store's per-blob cap, stores
// nothing and says which file and why; and a file the agent says is huge (sparse) is not read.
TEST(LyingAgentTest, CaptureOfAFileWhoseReadNeverEndsStopsAtTheBlobCap) {
  constexpr int64_t kCap = 6 << 20;
  std::atomic<int64_t> served{0};
  LyingAgent agent(Serving([&](const proto::Frame& f) -> std::pair<std::string, std::string> {
    if (Op(f) == "walk") {
      std::string manifest = R"([["endless","f",420,1,1,"k","",-1]])";
      return {R"({"ok":true,"walk":"w1","manifest_bytes":)" + std::to_string(manifest.size()) + "}",
              manifest};
    }
    if (Op(f) == "read") {
      const int64_t length = f.header.at("length").as_int64();
      served += length;
      return {R"({"ok":true,"size":1,"eof":false})", std::string(length, 'z')};
    }
    return {"", ""};
  }));
  AgentClient client = agent.Client();
  SmallBlobs blobs(kCap);
  CaptureOptions options;
  options.max_bytes = int64_t{64} << 30;  // the environment's cap is no bound here
  std::string base;
  absl::StatusOr<WorkspaceManifest> m = CaptureAgentWorkspace(client, blobs, options, &base);
  EXPECT_TRUE(absl::IsFailedPrecondition(m.status())) << m.status();
  EXPECT_NE(m.status().message().find("'endless' is larger than the per-file cap"),
            std::string_view::npos)
      << m.status();
  EXPECT_LE(served.load(), kCap + 1) << "esbd read past the per-blob cap";
  EXPECT_GE(served.load(), kCap);
  EXPECT_EQ(blobs.puts(), 0);
  EXPECT_EQ(CaptureBytesHeld(), 0) << "the capture's reservation is given back";
}

TEST(LyingAgentTest, CaptureOfAFileClaimedHugeOrSparseReadsNothing) {
  std::atomic<int64_t> served{0};
  LyingAgent agent(Serving([&](const proto::Frame& f) -> std::pair<std::string, std::string> {
    if (Op(f) == "walk") {
      // A sparse file of 1 TiB.
      std::string manifest = R"([["sparse","f",420,1099511627776,1,"k","",-1]])";
      return {R"({"ok":true,"walk":"w1","manifest_bytes":)" + std::to_string(manifest.size()) + "}",
              manifest};
    }
    if (Op(f) == "read") served += f.header.at("length").as_int64();
    return {"", ""};
  }));
  AgentClient client = agent.Client();
  SmallBlobs blobs(1 << 20);
  CaptureOptions options;
  options.max_bytes = int64_t{64} << 30;
  std::string base;
  absl::StatusOr<WorkspaceManifest> m = CaptureAgentWorkspace(client, blobs, options, &base);
  EXPECT_TRUE(absl::IsFailedPrecondition(m.status())) << m.status();
  EXPECT_NE(m.status().message().find("'sparse' is larger than the per-file cap"),
            std::string_view::npos)
      << m.status();
  EXPECT_EQ(served.load(), 0) << "a file over the cap is never read";
  EXPECT_EQ(blobs.puts(), 0);
}

// A blob store that counts what it hands out, so a test can tell how many bytes of blobs
// esbd holds at once during a restore (handed out, not yet sent to the agent).
class CountingBlobs : public testing::MemoryBlobStore {
 public:
  absl::StatusOr<std::string> Get(std::string_view sha256) override {
    auto data = MemoryBlobStore::Get(sha256);
    if (data.ok()) Handed(data->size());
    return data;
  }
  absl::StatusOr<std::string> ReadRange(std::string_view sha256, int64_t offset,
                                        int64_t length) override {
    auto all = MemoryBlobStore::Get(sha256);  // not counted: the range is what the caller gets
    if (!all.ok()) return all.status();
    std::string out = offset >= static_cast<int64_t>(all->size())
                          ? std::string()
                          : all->substr(static_cast<size_t>(offset), static_cast<size_t>(length));
    Handed(out.size());
    return out;
  }
  void Handed(size_t n) {
    handed += static_cast<int64_t>(n);
    peak = std::max<int64_t>(peak, handed - sent.load());
  }
  std::atomic<int64_t> handed{0}, sent{0}, peak{0};
};

// Review H2: a restore read every blob it had to write before sending any (the whole
// workspace, up to max_bytes, in esbd at once). Now blobs are read as they go out: what esbd
// holds at any time is about one apply call (8 MiB) and one piece, whatever the workspace.
TEST(LyingAgentTest, RestoreOfALargeWorkspaceHoldsABoundedAmountOfBlobs) {
  CountingBlobs blobs;
  WorkspaceManifest target;
  int64_t total = 0;
  for (int i = 0; i < 12; ++i) {
    // 12 files of 3 MiB and one of 20 MiB: 56 MiB in all.
    const int64_t size = i == 11 ? 20 << 20 : 3 << 20;
    std::string data(static_cast<size_t>(size), static_cast<char>('a' + i));
    ManifestEntry e;
    e.path = absl::StrCat("f", i < 10 ? "0" : "", i);
    e.mode = 0644;
    e.size = size;
    e.sha256 = *blobs.Put(data);
    target.entries.push_back(e);
    total += size;
  }
  target.total_bytes = total;
  std::atomic<int64_t> applied{0};
  LyingAgent agent(Serving([&](const proto::Frame& f) -> std::pair<std::string, std::string> {
    if (Op(f) == "walk") return {R"({"ok":true,"walk":"w1","manifest_bytes":2})", "[]"};
    if (Op(f) == "apply") {
      const int64_t manifest = f.header.at("manifest_bytes").as_int64();
      const int64_t data = static_cast<int64_t>(f.payload.size()) - manifest;
      blobs.sent += data;
      applied += data;
      return {R"({"ok":true})", ""};
    }
    return {"", ""};
  }));
  AgentClient client = agent.Client();
  std::string base;
  absl::Status st = RestoreAgentWorkspace(client, blobs, target, &base);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(applied.load(), total) << "every byte went out once";
  EXPECT_LE(blobs.peak.load(), int64_t{16} << 20)
      << "esbd held " << blobs.peak.load() << " bytes of blobs at once (of " << total << ")";
}

}  // namespace
}  // namespace esb

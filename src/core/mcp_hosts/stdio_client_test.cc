// esbd's stdio MCP client (core/mcp_hosts/stdio_client.h) against an in-process fake server:
// the era probe and fallback, pagination, calls, progress, cancellation, and every hostile
// behaviour: garbage and floods on stdout, an oversize line, a hang (timeout), a crash mid-call,
// answers with wrong ids, server→client requests it does not serve.
#include "core/mcp_hosts/stdio_client.h"

#include <atomic>
#include <thread>

#include "absl/strings/match.h"
#include "common/util.h"
#include "core/mcp_hosts/testing/fake_mcp_process.h"
#include "gtest/gtest.h"

namespace esb::mcp_hosts {
namespace {

namespace json = boost::json;
using testing::FakeMcpOptions;
using testing::FakeMcpProcess;

struct Harness {
  explicit Harness(FakeMcpOptions o = {}, ClientLimits limits = {}) {
    auto p = std::make_unique<FakeMcpProcess>(o);
    fake = p.get();
    limits.probe_timeout_ms = 300;
    client = std::make_unique<StdioClient>(std::move(p), limits, "MCP server 'fake'");
  }
  int64_t Deadline(int64_t ms = 2000) { return MonotonicMs() + ms; }
  FakeMcpProcess* fake;  // owned by client
  std::unique_ptr<StdioClient> client;
};

tools::CallContext Ctx() { return tools::CallContext{.caller = Caller("t")}; }

TEST(StdioClientTest, LegacyServerFallsBackToInitializeAndListsEveryPage) {
  Harness h({.tools = 5});
  ASSERT_TRUE(h.client->Initialize(h.Deadline()).ok());
  EXPECT_EQ(h.client->protocol(), "2025-06-18");
  const auto methods = h.fake->Methods();
  ASSERT_GE(methods.size(), 3u);
  EXPECT_EQ(methods[0], "server/discover");
  EXPECT_EQ(methods[1], "initialize");
  EXPECT_EQ(methods[2], "notifications/initialized");
  auto tools = h.client->ListTools(h.Deadline());
  ASSERT_TRUE(tools.ok()) << tools.status();
  ASSERT_EQ(tools->tools.size(), 5u);  // three pages of two
  EXPECT_EQ(json::value_to<std::string>(tools->tools[4].at("name")), "wrong_id");
  EXPECT_EQ(tools->skipped_count, 0);
}

TEST(StdioClientTest, ModernServerIsUsedWithoutInitialize) {
  Harness h({.modern = true});
  ASSERT_TRUE(h.client->Initialize(h.Deadline()).ok());
  EXPECT_EQ(h.client->protocol(), kModernProtocol);
  for (const std::string& m : h.fake->Methods()) EXPECT_NE(m, "initialize");
  auto tools = h.client->ListTools(h.Deadline());
  ASSERT_TRUE(tools.ok());
  // Modern requests carry the protocol version in _meta.
  const json::object& last = h.fake->received.back();
  EXPECT_EQ(last.at("params").at("_meta").at("io.modelcontextprotocol/protocolVersion"),
            kModernProtocol);
}

TEST(StdioClientTest, ServerIgnoringDiscoverStillStartsAfterTheProbeTimeout) {
  Harness h({.silent_discover = true});
  const int64_t t0 = MonotonicMs();
  ASSERT_TRUE(h.client->Initialize(h.Deadline(5000)).ok());
  EXPECT_GE(MonotonicMs() - t0, 250);
  EXPECT_EQ(h.client->protocol(), "2025-06-18");
}

TEST(StdioClientTest, CallReturnsTheResultAndProgressComesOnTheCallersThread) {
  Harness h;
  ASSERT_TRUE(h.client->Initialize(h.Deadline()).ok());
  auto r = h.client->CallTool("echo", json::object{{"x", 1}}, Ctx(), h.Deadline());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->at("structuredContent").at("x"), 1);

  std::vector<std::string> seen;
  const auto caller_thread = std::this_thread::get_id();
  bool same_thread = true;
  tools::CallContext ctx = Ctx();
  ctx.progress = [&](const tools::Progress& p) {
    seen.push_back(p.message);
    same_thread = same_thread && std::this_thread::get_id() == caller_thread;
  };
  auto p = h.client->CallTool("progress", {}, ctx, h.Deadline());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(seen, (std::vector<std::string>{"step 1", "step 2", "step 3"}));
  EXPECT_TRUE(same_thread);
}

TEST(StdioClientTest, HangingCallTimesOutSendsCancelledAndTheClientStaysUsable) {
  Harness h;
  ASSERT_TRUE(h.client->Initialize(h.Deadline()).ok());
  auto r = h.client->CallTool("slow", {}, Ctx(), h.Deadline(300));
  EXPECT_TRUE(absl::IsDeadlineExceeded(r.status())) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "did not answer tools/call in time"));
  EXPECT_EQ(h.fake->Methods().back(), "notifications/cancelled");
  EXPECT_TRUE(h.client->CallTool("echo", {}, Ctx(), h.Deadline()).ok());
  EXPECT_EQ(h.client->calls_in_flight(), 0);
}

TEST(StdioClientTest, CancelledCallEndsAndTellsTheServer) {
  Harness h;
  ASSERT_TRUE(h.client->Initialize(h.Deadline()).ok());
  tools::CallContext ctx = Ctx();
  const int64_t t0 = MonotonicMs();
  ctx.cancelled = [&] { return MonotonicMs() - t0 > 200; };
  auto r = h.client->CallTool("slow", {}, ctx, h.Deadline(10000));
  EXPECT_TRUE(absl::IsCancelled(r.status())) << r.status();
  EXPECT_LT(MonotonicMs() - t0, 2000);
  EXPECT_EQ(h.fake->Methods().back(), "notifications/cancelled");
}

TEST(StdioClientTest, CrashMidCallFailsThePendingCallWithExitCodeAndStderr) {
  Harness h;
  ASSERT_TRUE(h.client->Initialize(h.Deadline()).ok());
  auto r = h.client->CallTool("crash", {}, Ctx(), h.Deadline(5000));
  ASSERT_TRUE(absl::IsUnavailable(r.status())) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "exited with code 3")) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "Traceback: boom")) << r.status();
  ASSERT_TRUE(h.client->WaitEnded(2000));
  EXPECT_EQ(h.client->exit_info().exit_code, 3);
  // Later calls fail at once with the same reason.
  auto again = h.client->CallTool("echo", {}, Ctx(), h.Deadline());
  EXPECT_TRUE(absl::IsUnavailable(again.status()));
}

TEST(StdioClientTest, GarbageOnStdoutKillsTheServerWithAClearReason) {
  Harness h({.garbage_at_start = 20}, ClientLimits{.max_garbage_lines = 8});
  auto st = h.client->Initialize(h.Deadline());
  ASSERT_FALSE(st.ok());
  ASSERT_TRUE(h.client->WaitEnded(2000));
  const ExitInfo exit = h.client->exit_info();
  EXPECT_TRUE(exit.killed_by_client);
  EXPECT_TRUE(absl::StrContains(exit.reason, "not JSON-RPC")) << exit.reason;
  EXPECT_TRUE(absl::StrContains(exit.reason, "Server listening")) << exit.reason;
  EXPECT_GE(h.fake->kills, 1);
}

TEST(StdioClientTest, AFewGarbageLinesAreToleratedAndShownInTheStderrTail) {
  Harness h({.garbage_at_start = 2}, ClientLimits{.max_garbage_lines = 8});
  ASSERT_TRUE(h.client->Initialize(h.Deadline()).ok());
  EXPECT_TRUE(absl::StrContains(h.client->stderr_tail(), "not JSON-RPC on stdout"));
}

TEST(StdioClientTest, LineFloodKillsTheServer) {
  Harness h({.flood_lines_at_start = 5000}, ClientLimits{.max_lines_per_second = 100});
  EXPECT_FALSE(h.client->Initialize(h.Deadline()).ok());
  ASSERT_TRUE(h.client->WaitEnded(2000));
  EXPECT_TRUE(absl::StrContains(h.client->exit_info().reason, "flooded"))
      << h.client->exit_info().reason;
}

TEST(StdioClientTest, OversizeLineKillsTheServerAndFailsTheCall) {
  Harness h({.oversize_bytes = 300000},
            ClientLimits{.max_message_bytes = 64 << 10, .max_output_bytes_per_second = 1 << 30});
  ASSERT_TRUE(h.client->Initialize(h.Deadline()).ok());
  auto r = h.client->CallTool("big", {}, Ctx(), h.Deadline());
  ASSERT_TRUE(absl::IsUnavailable(r.status())) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "max_message_bytes")) << r.status();
}

TEST(StdioClientTest, ByteFloodOnStderrKillsTheServer) {
  Harness h({.oversize_bytes = 1 << 20},
            ClientLimits{.max_message_bytes = 64 << 10, .max_output_bytes_per_second = 64 << 10});
  ASSERT_TRUE(h.client->Initialize(h.Deadline()).ok());
  // 1 MiB at once is over the burst allowance (max(2 x rate, 2 x max_message_bytes) = 128 KiB).
  auto r = h.client->CallTool("noisy", {}, Ctx(), h.Deadline());
  ASSERT_TRUE(absl::IsUnavailable(r.status())) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "flooded its output")) << r.status();
  // The stderr tail stays bounded.
  EXPECT_LE(h.client->stderr_tail().size(), ClientLimits{}.stderr_tail_bytes);
}

TEST(StdioClientTest, OutputWithinTheBurstAllowanceIsNoFlood) {
  Harness h({.oversize_bytes = 100 << 10},
            ClientLimits{.max_message_bytes = 64 << 10, .max_output_bytes_per_second = 64 << 10});
  ASSERT_TRUE(h.client->Initialize(h.Deadline()).ok());
  auto r = h.client->CallTool("noisy", {}, Ctx(), h.Deadline(300));
  EXPECT_TRUE(absl::IsDeadlineExceeded(r.status())) << r.status();  // noisy never answers
  EXPECT_FALSE(h.client->exit_info().ended);
}

TEST(StdioClientTest, AnswersWithWrongIdsAreDroppedAndTheCallTimesOut) {
  Harness h;
  ASSERT_TRUE(h.client->Initialize(h.Deadline()).ok());
  auto r = h.client->CallTool("wrong_id", {}, Ctx(), h.Deadline(300));
  EXPECT_TRUE(absl::IsDeadlineExceeded(r.status())) << r.status();
  EXPECT_FALSE(h.client->exit_info().ended);
  EXPECT_TRUE(h.client->CallTool("echo", {}, Ctx(), h.Deadline()).ok());
}

TEST(StdioClientTest, ServerRequestsGetMethodNotFoundExceptPing) {
  Harness h;
  ASSERT_TRUE(h.client->Initialize(h.Deadline()).ok());
  auto r = h.client->CallTool("ask", {}, Ctx(), h.Deadline());
  ASSERT_TRUE(r.ok()) << r.status();
  auto responses = h.fake->Responses();
  ASSERT_EQ(responses.size(), 2u);
  for (const json::object& resp : responses) {
    if (resp.at("id") == "s1") {
      EXPECT_EQ(resp.at("error").at("code"), -32601);
      EXPECT_TRUE(absl::StrContains(json::value_to<std::string>(resp.at("error").at("message")),
                                    "sampling/createMessage"));
    } else {
      EXPECT_EQ(resp.at("id"), "s2");
      EXPECT_TRUE(resp.at("result").is_object());
    }
  }
}

TEST(StdioClientTest, ConcurrentCallsAreCapped) {
  Harness h({}, ClientLimits{.max_concurrent_calls = 2});
  ASSERT_TRUE(h.client->Initialize(h.Deadline()).ok());
  std::atomic<int> done{0};
  std::vector<std::thread> slow;
  for (int i = 0; i < 2; ++i)
    slow.emplace_back([&] {
      h.client->CallTool("slow", {}, Ctx(), MonotonicMs() + 1000).IgnoreError();
      ++done;
    });
  while (h.client->calls_in_flight() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  auto r = h.client->CallTool("echo", {}, Ctx(), h.Deadline());
  EXPECT_TRUE(absl::IsResourceExhausted(r.status())) << r.status();
  for (auto& t : slow) t.join();
  EXPECT_TRUE(h.client->CallTool("echo", {}, Ctx(), h.Deadline()).ok());
}

TEST(StdioClientTest, ServerErrorAnswerIsReportedWithItsMessage) {
  Harness h;
  ASSERT_TRUE(h.client->Initialize(h.Deadline()).ok());
  auto r = h.client->CallTool("nope", {}, Ctx(), h.Deadline());
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(absl::StrContains(r.status().message(), "Unknown tool")) << r.status();
}

TEST(StdioClientTest, KillFailsPendingCallsAtOnce) {
  Harness h;
  ASSERT_TRUE(h.client->Initialize(h.Deadline()).ok());
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    h.client->Kill("stopped by the test");
  });
  const int64_t t0 = MonotonicMs();
  auto r = h.client->CallTool("slow", {}, Ctx(), h.Deadline(10000));
  killer.join();
  EXPECT_TRUE(absl::IsUnavailable(r.status())) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "stopped by the test")) << r.status();
  EXPECT_LT(MonotonicMs() - t0, 3000);
}

// Attack: a hostile server lists tools with descriptions just under the line limit, page after
// page, to pin (max_list_pages x max_message_bytes) of esbd's memory per server. The whole list
// is capped at max_message_bytes: the listing fails with the reason, nothing is kept.
TEST(StdioClientTest, HugeToolListCannotPinMemoryAcrossPages) {
  ClientLimits limits;
  limits.max_message_bytes = 8 << 10;
  Harness h({.tools = 8, .description_bytes = 3000}, limits);  // each page fits one line
  ASSERT_TRUE(h.client->Initialize(h.Deadline()).ok());
  auto tools = h.client->ListTools(h.Deadline());
  ASSERT_FALSE(tools.ok());
  EXPECT_TRUE(absl::StrContains(tools.status().message(), "mcp.max_message_bytes"))
      << tools.status();
  // The same list with short descriptions is fine.
  Harness ok({.tools = 8}, limits);
  ASSERT_TRUE(ok.client->Initialize(ok.Deadline()).ok());
  auto small = ok.client->ListTools(ok.Deadline());
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->tools.size(), 7u);  // and "bad name!", skipped
}

// Attack (review F3): a hosted server lists names MCP forbids (a newline, 200 characters, a
// path) and one name twice. They would reach clients unchanged (a "a\nb" cannot even travel in
// the Mcp-Name header), and a repeated name would list one tool twice, the first winning calls.
// esbd keeps valid names once and says what it left out, escaped.
TEST(StdioClientTest, InvalidAndRepeatedToolNamesAreLeftOutAndReported) {
  Harness h(
      {.names = {"echo", "a\nb", std::string(200, 'x'), "../../etc", "echo", "ok.tool-2", "slow"}});
  ASSERT_TRUE(h.client->Initialize(h.Deadline()).ok());
  auto tools = h.client->ListTools(h.Deadline());
  ASSERT_TRUE(tools.ok()) << tools.status();
  std::vector<std::string> kept;
  for (const json::object& t : tools->tools) kept.push_back(std::string(t.at("name").as_string()));
  EXPECT_EQ(kept, (std::vector<std::string>{"echo", "ok.tool-2", "slow"}));
  EXPECT_EQ(tools->skipped_count, 4);
  ASSERT_EQ(tools->skipped.size(), 4u);
  EXPECT_TRUE(absl::StartsWith(tools->skipped[0], "a\\nb: not a valid MCP tool name"))
      << tools->skipped[0];
  EXPECT_TRUE(absl::StartsWith(tools->skipped[1], std::string(64, 'x') + "...: not a valid"))
      << tools->skipped[1];
  EXPECT_TRUE(absl::StartsWith(tools->skipped[2], "../../etc: not a valid")) << tools->skipped[2];
  EXPECT_EQ(tools->skipped[3], "echo: listed twice (the first one is kept)");
  // The report is bounded, the count is not.
  std::vector<std::string> many(40, "dup");
  Harness m({.names = many});
  ASSERT_TRUE(m.client->Initialize(m.Deadline()).ok());
  auto dups = m.client->ListTools(m.Deadline());
  ASSERT_TRUE(dups.ok()) << dups.status();
  EXPECT_EQ(dups->tools.size(), 1u);
  EXPECT_EQ(dups->skipped_count, 39);
  EXPECT_EQ(dups->skipped.size(), kMaxSkippedReported);
}

}  // namespace
}  // namespace esb::mcp_hosts

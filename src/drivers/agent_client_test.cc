// AgentClient against the real esb-agent, started as a child process on a temporary socket.
#include "drivers/agent_client.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <pty.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <chrono>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "agent/test_agent_process.h"
#include "common/protocol.h"

namespace esb {
namespace {

using ::esb::testing::AgentProcess;
using ::esb::testing::ProcessGone;

class AgentClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_GT(agent_.pid(), 0) << "could not start " << ESB_AGENT_BINARY;
    ASSERT_TRUE(agent_.WaitReady()) << "agent did not listen on " << agent_.socket_path();
  }

  ExecResult Run(const std::string& command, int timeout_ms = 10000,
                 std::map<std::string, std::string> env = {}) {
    ExecRequest request;
    request.command = command;
    request.timeout = std::chrono::milliseconds(timeout_ms);
    request.env = std::move(env);
    absl::StatusOr<ExecResult> result = client_.Exec(request, nullptr);
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? *result : ExecResult{};
  }

  std::string ReadHostFile(const std::string& rel) {
    std::ifstream in(agent_.workspace() + "/" + rel, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  AgentProcess agent_;
  // Counts connections: protocol v2 makes one per agent, whatever the number of calls.
  std::atomic<int> connects_{0};
  AgentClient client_{[this, connect = AgentClient::UnixSocket(agent_.socket_path())]() {
    ++connects_;
    return connect();
  }};
};

int64_t RssKb() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

TEST_F(AgentClientTest, PingAndWaitReady) {
  EXPECT_TRUE(client_.Ping().ok());
  EXPECT_TRUE(client_.WaitReady(1000).ok());
}

TEST_F(AgentClientTest, ConnectToMissingSocketIsUnavailable) {
  AgentClient missing(AgentClient::UnixSocket(agent_.dir() + "/nope.sock", 100));
  EXPECT_EQ(missing.Ping().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(missing.WaitReady(100).code(), absl::StatusCode::kDeadlineExceeded);
}

TEST_F(AgentClientTest, ExecSeparatesStreamsAndExitCodes) {
  ExecResult r = Run("echo out; echo err >&2; exit 7");
  EXPECT_EQ(r.stdout_data, "out\n");
  EXPECT_EQ(r.stderr_data, "err\n");
  EXPECT_EQ(r.exit_code, 7);
  EXPECT_FALSE(r.timed_out);
  EXPECT_FALSE(r.truncated);

  EXPECT_EQ(Run("true").exit_code, 0);
  EXPECT_EQ(Run("false").exit_code, 1);
  EXPECT_EQ(Run("kill -9 $$").exit_code, 128 + 9);
  EXPECT_EQ(Run("nosuchcommand-xyz").exit_code, 127);
}

TEST_F(AgentClientTest, ExecEnvironment) {
  ExecResult r = Run("echo \"$HOME|$USER|$PATH\"; pwd; [ -t 0 ] || cat");
  EXPECT_EQ(r.stdout_data.substr(0, r.stdout_data.find('|')), agent_.workspace());
  EXPECT_NE(r.stdout_data.find("/usr/bin"), std::string::npos);
  EXPECT_NE(r.stdout_data.find("\n" + agent_.workspace() + "\n"), std::string::npos);
  EXPECT_EQ(r.exit_code, 0);  // stdin is /dev/null: cat ends at once
}

TEST_F(AgentClientTest, ShellStatePersistsAcrossCalls) {
  ASSERT_EQ(Run("mkdir -p sub/dir && cd sub/dir").exit_code, 0);
  EXPECT_EQ(Run("pwd").stdout_data, agent_.workspace() + "/sub/dir\n");

  ASSERT_EQ(Run("export EXPORTED='a b'; PLAIN=$'line1\\nline2 \"q\" \\'s\\''; "
                "arr=(x 'y z'); declare -A assoc=([k]=v)")
                .exit_code,
            0);
  EXPECT_EQ(
      Run("echo \"$EXPORTED\"; printf '%s|' \"$PLAIN\" \"${arr[1]}\" \"${assoc[k]}\"").stdout_data,
      "a b\nline1\nline2 \"q\" 's'|y z|v|");
  EXPECT_EQ(Run("env | grep '^EXPORTED='; env | grep -c '^PLAIN=' || true").stdout_data,
            "EXPORTED=a b\n0\n");

  ASSERT_EQ(Run("greet() { echo \"hello $1\"; }; alias hi='echo aliased'").exit_code, 0);
  EXPECT_EQ(Run("greet world; hi there").stdout_data, "hello world\naliased there\n");

  // The user's own `exit N` still saves the state and returns N.
  ExecResult r = Run("cd /tmp; AFTER_EXIT=1; exit 3");
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_EQ(Run("pwd; echo $AFTER_EXIT").stdout_data, "/tmp\n1\n");

  // A command with its own EXIT trap still has its state saved, and its trap still runs.
  r = Run("TRAPPED=1; trap 'echo bye' EXIT");
  EXPECT_EQ(r.stdout_data, "bye\n");
  EXPECT_EQ(Run("echo $TRAPPED").stdout_data, "1\n");
  // `set -e` ending the command early also saves.
  r = Run("set -e; SET_E=1; false; echo unreachable");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.stdout_data, "");
  EXPECT_EQ(Run("echo $SET_E; [[ $- == *e* ]] || echo errexit-off").stdout_data,
            "1\nerrexit-off\n");

  // Readonly and bash-internal variables are not saved (restoring them would fail or lie).
  ASSERT_EQ(Run("readonly RO=1; echo $BASHPID > /dev/null").exit_code, 0);
  r = Run("echo \"ro=${RO-unset}\"; echo $SHLVL");
  EXPECT_EQ(r.stdout_data, "ro=unset\n1\n");
  EXPECT_EQ(r.stderr_data, "");
}

TEST_F(AgentClientTest, PerExecEnvAppliesOnceAndConfigureIsBase) {
  ASSERT_TRUE(client_.Configure({{"BASE", "from-configure"}}).ok());
  EXPECT_EQ(Run("echo $BASE").stdout_data, "from-configure\n");
  EXPECT_EQ(Run("echo $ONCE-$BASE", 10000, {{"ONCE", "x'y"}, {"BASE", "over"}}).stdout_data,
            "x'y-over\n");
  EXPECT_EQ(Run("echo \"${ONCE-unset}-$BASE\"").stdout_data, "unset-from-configure\n");
  // A later configure wins over the value saved in the shell state.
  ASSERT_TRUE(client_.Configure({{"BASE", "second"}}).ok());
  EXPECT_EQ(Run("echo $BASE").stdout_data, "second\n");
  // Bad names are refused.
  EXPECT_EQ(client_.Configure({{"BAD-NAME", "x"}}).code(), absl::StatusCode::kInvalidArgument);
  ExecRequest request;
  request.command = "true";
  request.env = {{"1BAD", "x"}};
  EXPECT_EQ(client_.Exec(request, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(AgentClientTest, TimeoutKillsTheWholeProcessGroup) {
  auto start = std::chrono::steady_clock::now();
  ExecResult r = Run("sleep 100 & echo $! > bg.pid; sleep 100", 500);
  auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_TRUE(r.timed_out);
  EXPECT_EQ(r.exit_code, 124);
  EXPECT_LT(elapsed, std::chrono::milliseconds(2500));
  EXPECT_GE(elapsed, std::chrono::milliseconds(450));
  pid_t bg = std::stoi(ReadHostFile("bg.pid"));
  EXPECT_TRUE(ProcessGone(bg, 2000)) << "background sleep " << bg << " survived the timeout";
  // The session still works afterwards.
  EXPECT_EQ(Run("echo alive").stdout_data, "alive\n");
}

TEST_F(AgentClientTest, BackgroundJobHoldingThePipesDoesNotHangExec) {
  auto start = std::chrono::steady_clock::now();
  ExecResult r = Run("sleep 3 & echo started");
  EXPECT_EQ(r.stdout_data, "started\n");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(1500));
}

TEST_F(AgentClientTest, OutputIsCappedPerStream) {
  ExecRequest request;
  request.command = "head -c 300000 /dev/zero; echo tail >&2";
  request.max_output_bytes = 1000;
  absl::StatusOr<ExecResult> r = client_.Exec(request, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->stdout_data, std::string(1000, '\0'));
  EXPECT_EQ(r->stderr_data, "tail\n");
  EXPECT_TRUE(r->truncated);
  EXPECT_EQ(r->exit_code, 0);  // the rest was drained, not left blocking the writer
}

TEST_F(AgentClientTest, OutputStreamsAsItComes) {
  ExecRequest request;
  request.command = "echo first; sleep 0.5; echo second";
  std::vector<std::pair<std::string, int64_t>> seen;
  int ticks = 0;
  auto start = proto::MonotonicMs();
  absl::StatusOr<ExecResult> r = client_.Exec(request, [&](Stream, std::string_view data) {
    if (data.empty()) {
      ++ticks;  // liveness tick while the command is silent
      return true;
    }
    seen.emplace_back(std::string(data), proto::MonotonicMs() - start);
    return true;
  });
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_GE(ticks, 1) << "the 0.5 s of silence produced at least one tick";
  EXPECT_EQ(seen[0].first, "first\n");
  EXPECT_LT(seen[0].second + 300, seen[1].second);  // the first chunk came before the sleep
}

TEST_F(AgentClientTest, SinkReturningFalseCancelsAndKillsTheGroup) {
  ExecRequest request;
  request.command = "echo $$ > shell.pid; echo go; sleep 100";
  auto start = std::chrono::steady_clock::now();
  absl::StatusOr<ExecResult> r =
      client_.Exec(request, [](Stream, std::string_view) { return false; });
  EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  pid_t shell = std::stoi(ReadHostFile("shell.pid"));
  EXPECT_TRUE(ProcessGone(shell, 2000)) << "shell " << shell << " survived cancellation";
  EXPECT_EQ(Run("echo next").stdout_data, "next\n");
}

TEST_F(AgentClientTest, ConcurrentExecsAreSerialised) {
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([this] {
      AgentClient client(AgentClient::UnixSocket(agent_.socket_path()));
      ExecRequest request;
      request.command = "echo start >> order.log; sleep 0.2; echo end >> order.log";
      absl::StatusOr<ExecResult> r = client.Exec(request, nullptr);
      EXPECT_TRUE(r.ok()) << r.status();
    });
  }
  // File operations are not serialised behind the running execs.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(client_.Write("side.txt", "x", 0, true).ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(150));
  for (auto& t : threads) t.join();
  EXPECT_EQ(ReadHostFile("order.log"), "start\nend\nstart\nend\nstart\nend\n");
}

TEST_F(AgentClientTest, QueuedExecTimeoutCountsFromArrival) {
  std::thread first([this] {
    AgentClient client(AgentClient::UnixSocket(agent_.socket_path()));
    ExecRequest request;
    request.command = "sleep 1";
    EXPECT_TRUE(client.Exec(request, nullptr).ok());
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  auto start = std::chrono::steady_clock::now();
  ExecResult r = Run("echo ran > queued.txt", 300);
  EXPECT_TRUE(r.timed_out);
  EXPECT_EQ(r.exit_code, 124);
  first.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(2500));
  EXPECT_EQ(ReadHostFile("queued.txt"), "");  // it never ran
}

TEST_F(AgentClientTest, BinarySafeFileRoundTrip) {
  std::string all;
  for (int i = 0; i < 256; ++i) all.push_back(static_cast<char>(i));
  ASSERT_TRUE(client_.Write("bin/all.bytes", all, 0, true).ok());
  absl::StatusOr<FileChunk> chunk = client_.Read("bin/all.bytes", 0, 1 << 20);
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  EXPECT_EQ(chunk->data, all);
  EXPECT_EQ(chunk->file_size, 256);
  EXPECT_TRUE(chunk->eof);

  // 5 MiB of pseudo-random bytes, written and read back in 1 MiB chunks.
  std::string big(5 << 20, '\0');
  uint32_t x = 12345;
  for (char& c : big) {
    x = x * 1103515245 + 12345;
    c = static_cast<char>(x >> 24);
  }
  const int64_t kChunk = 1 << 20;
  for (int64_t off = 0; off < static_cast<int64_t>(big.size()); off += kChunk) {
    ASSERT_TRUE(
        client_.Write("big.bin", std::string_view(big).substr(off, kChunk), off, off == 0).ok());
  }
  std::string back;
  for (int64_t off = 0;; off += kChunk) {
    absl::StatusOr<FileChunk> c = client_.Read("big.bin", off, kChunk);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->file_size, static_cast<int64_t>(big.size()));
    back += c->data;
    if (c->eof) break;
    ASSERT_LT(off, int64_t{10} << 20);
  }
  EXPECT_TRUE(back == big) << "5 MiB round trip differs";
  EXPECT_EQ(ReadHostFile("big.bin").size(), big.size());

  // Truncate + offset semantics.
  ASSERT_TRUE(client_.Write("t.txt", "hello world", 0, true).ok());
  ASSERT_TRUE(client_.Write("t.txt", "HELLO", 0, false).ok());
  EXPECT_EQ(ReadHostFile("t.txt"), "HELLO world");
  ASSERT_TRUE(client_.Write("t.txt", "new", 0, true).ok());
  EXPECT_EQ(ReadHostFile("t.txt"), "new");
  chunk = client_.Read("t.txt", 1, 1);
  ASSERT_TRUE(chunk.ok());
  EXPECT_EQ(chunk->data, "e");
  EXPECT_FALSE(chunk->eof);
  chunk = client_.Read("t.txt", 10, 5);
  ASSERT_TRUE(chunk.ok());
  EXPECT_EQ(chunk->data, "");
  EXPECT_TRUE(chunk->eof);
}

TEST_F(AgentClientTest, ReadOfFifoIsRefusedWithoutHanging) {
  std::string fifo = agent_.workspace() + "/pipe";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0644), 0);
  auto start = std::chrono::steady_clock::now();
  absl::StatusOr<FileChunk> r = client_.Read("pipe", 0, 100);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  absl::Status w = client_.Write("pipe", "data", 0, false);
  EXPECT_EQ(w.code(), absl::StatusCode::kInvalidArgument) << w;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
}

TEST_F(AgentClientTest, FileErrorsMapToStatusCodes) {
  EXPECT_EQ(client_.Read("missing.txt", 0, 10).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_.Stat("missing.txt").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_.List("missing-dir").status().code(), absl::StatusCode::kNotFound);
  ASSERT_EQ(mkdir((agent_.workspace() + "/adir").c_str(), 0755), 0);
  EXPECT_EQ(client_.Read("adir", 0, 10).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_.Write("adir", "x", 0, false).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_.Read("/dev/zero", 0, 10).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(AgentClientTest, ListAndStat) {
  ASSERT_TRUE(client_.Write("d/b.txt", "12345", 0, true).ok());
  ASSERT_TRUE(client_.Write("d/a.txt", "1", 0, true).ok());
  ASSERT_EQ(mkdir((agent_.workspace() + "/d/sub").c_str(), 0700), 0);
  ASSERT_EQ(symlink("a.txt", (agent_.workspace() + "/d/link").c_str()), 0);
  absl::StatusOr<DirListing> listing = client_.List("d");
  ASSERT_TRUE(listing.ok()) << listing.status();
  const std::vector<FileEntry>* entries = &listing->entries;
  ASSERT_EQ(entries->size(), 4u);
  EXPECT_EQ((*entries)[0].name, "a.txt");
  EXPECT_EQ((*entries)[1].name, "b.txt");
  EXPECT_EQ((*entries)[1].type, "file");
  EXPECT_EQ((*entries)[1].size, 5);
  EXPECT_EQ((*entries)[1].mode, 0644u);
  EXPECT_EQ((*entries)[2].name, "link");
  EXPECT_EQ((*entries)[2].type, "symlink");
  EXPECT_EQ((*entries)[3].name, "sub");
  EXPECT_EQ((*entries)[3].type, "dir");
  EXPECT_EQ((*entries)[3].mode, 0700u);
  EXPECT_GT((*entries)[1].mtime_ms, (time(nullptr) - 60) * int64_t{1000});

  absl::StatusOr<FileEntry> st = client_.Stat("d/b.txt");
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->name, "b.txt");
  EXPECT_EQ(st->type, "file");
  EXPECT_EQ(st->size, 5);
  st = client_.Stat(agent_.workspace() + "/d");
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->type, "dir");
}

TEST_F(AgentClientTest, ListingSurvivesNonUtf8FileNames) {
  ASSERT_EQ(mkdir((agent_.workspace() + "/odd").c_str(), 0755), 0);
  std::ofstream(agent_.workspace() + "/odd/bad\xff\xfe.bin") << "x";
  std::ofstream(agent_.workspace() + "/odd/ok-\xc3\xa9.txt") << "y";
  absl::StatusOr<DirListing> listing = client_.List("odd");
  ASSERT_TRUE(listing.ok()) << listing.status();
  const std::vector<FileEntry>* entries = &listing->entries;
  ASSERT_EQ(entries->size(), 2u);
  EXPECT_EQ((*entries)[0].name, "bad\xef\xbf\xbd\xef\xbf\xbd.bin");
  EXPECT_EQ((*entries)[1].name, "ok-\xc3\xa9.txt");
}

TEST_F(AgentClientTest, LargeDirectoryListing) {
  // Enough entries that the listing no longer fits the 64 KiB frame header.
  ASSERT_EQ(Run("mkdir many && cd many && for i in $(seq 1 3000); do : > "
                "file-with-a-longish-name-$i; done")
                .exit_code,
            0);
  absl::StatusOr<DirListing> listing = client_.List("many");
  ASSERT_TRUE(listing.ok()) << listing.status();
  EXPECT_EQ(listing->entries.size(), 3000u);
  EXPECT_FALSE(listing->truncated);
}

TEST_F(AgentClientTest, LargeCommand) {
  // Longer than one argv string may be (128 KiB): goes through a file.
  std::string command = "X='" + std::string(200000, 'a') + "'; echo ${#X}";
  EXPECT_EQ(Run(command).stdout_data, "200000\n");
}

TEST_F(AgentClientTest, ExecRoundTripLatency) {
  // Measures `echo hi` end to end (connect, hello, request, bash, response). The agent starts
  // the next shell ahead of time after each exec, so calls are spaced the way an AI agent
  // spaces them (the target is <= 3 ms on an idle machine); back-to-back calls pay for the
  // shell start-up. The assertion is loose because test machines are shared.
  ASSERT_EQ(Run("echo warm").exit_code, 0);
  for (int gap_ms : {20, 0}) {
    std::vector<double> ms;
    for (int i = 0; i < 40; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(gap_ms));
      auto start = std::chrono::steady_clock::now();
      ExecResult r = Run("echo hi");
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count());
      ASSERT_EQ(r.stdout_data, "hi\n");
    }
    std::sort(ms.begin(), ms.end());
    std::printf(
        "exec round trip, %d ms between calls, %zu calls: min %.2f ms, p50 %.2f ms, "
        "p90 %.2f ms\n",
        gap_ms, ms.size(), ms.front(), ms[ms.size() / 2], ms[ms.size() * 9 / 10]);
    EXPECT_LT(ms[ms.size() / 2], 100.0);
  }
}

// ---------------------------------------------------------------------------------------
// Protocol v2: one multiplexed connection.

TEST_F(AgentClientTest, HundredConcurrentCallsFromManyThreadsShareOneConnection) {
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 10; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 10; ++i) {
        std::string name = "c" + std::to_string(t) + "_" + std::to_string(i);
        bool good = false;
        switch (i % 4) {
          case 0:
            good = client_.Ping().ok();
            break;
          case 1: {
            absl::StatusOr<FileChunk> back;
            good = client_.Write(name, name, 0, true).ok() &&
                   (back = client_.Read(name, 0, 100)).ok() && back->data == name;
            break;
          }
          case 2:
            good = client_.Stat(".").ok();
            break;
          default: {
            ExecRequest request;
            request.command = "echo " + name;
            absl::StatusOr<ExecResult> r = client_.Exec(request, nullptr);
            good = r.ok() && r->stdout_data == name + "\n";
          }
        }
        if (good) ++ok;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 100);
  EXPECT_EQ(connects_.load(), 1);
}

// More calls than the agent's cap (64 in flight, from its HELLO) wait for a slot in esbd
// instead of coming back EBUSY.
TEST_F(AgentClientTest, CallsBeyondTheAgentsCapWaitForASlot) {
  std::atomic<int> ok{0};
  std::vector<std::string> errors;
  std::mutex mu;
  std::vector<std::thread> threads;
  for (int t = 0; t < 80; ++t) {
    threads.emplace_back([&] {
      ExecRequest request;  // serialised in the agent: the others hold their slots meanwhile
      request.command = "true";
      absl::StatusOr<ExecResult> r = client_.Exec(request, nullptr);
      if (r.ok() && r->exit_code == 0) {
        ++ok;
      } else {
        std::lock_guard<std::mutex> lock(mu);
        errors.push_back(r.status().ToString());
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 80) << (errors.empty() ? "" : errors[0]);
}

TEST_F(AgentClientTest, CancelInTheMiddleWhileOtherCallsContinue) {
  std::atomic<bool> stop{false};
  std::atomic<int> pings{0}, failures{0};
  std::thread other([&] {
    while (!stop) {
      if (client_.Ping().ok() && client_.Stat(".").ok()) {
        ++pings;
      } else {
        ++failures;
      }
    }
  });
  ExecRequest request;
  request.command = "echo $$ > shell.pid; echo go; sleep 100";
  auto start = std::chrono::steady_clock::now();
  absl::StatusOr<ExecResult> r = client_.Exec(request, [](Stream, std::string_view data) {
    return data.empty() || data != "go\n";  // cancel on the first real output
  });
  EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled) << r.status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  pid_t shell = std::stoi(ReadHostFile("shell.pid"));
  EXPECT_TRUE(ProcessGone(shell, 2000)) << "shell " << shell << " survived cancellation";
  int before = pings.load();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  stop = true;
  other.join();
  EXPECT_GT(pings.load(), before) << "calls stopped after the cancel";
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(Run("echo next").stdout_data, "next\n");
  EXPECT_EQ(connects_.load(), 1) << "the cancel closed the connection";
}

TEST_F(AgentClientTest, TimeoutCancelsTheCallNotTheConnection) {
  ExecRequest request;
  request.command = "sleep 100";
  request.timeout = std::chrono::milliseconds(100);
  absl::StatusOr<ExecResult> r = client_.Exec(request, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->timed_out);
  EXPECT_TRUE(client_.Ping().ok());
  EXPECT_EQ(connects_.load(), 1);
}

// A command that floods output through a consumer that is slow: flow control holds the agent
// at one window, so esbd's memory stays flat and a ping on the same connection still answers
// quickly.
TEST_F(AgentClientTest, FloodingStreamDoesNotStarvePingsOrGrowMemory) {
  ASSERT_TRUE(client_.Ping().ok());
  const int64_t rss_before = RssKb();
  std::atomic<bool> stop{false};
  std::atomic<int64_t> consumed{0};
  std::thread flood([&] {
    ExecRequest request;
    request.command = "yes flood-flood-flood-flood-flood";
    request.timeout = std::chrono::milliseconds(20000);
    request.max_output_bytes = int64_t{1} << 30;
    absl::StatusOr<ExecResult> r = client_.Exec(request, [&](Stream, std::string_view data) {
      consumed += static_cast<int64_t>(data.size());
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // a slow SSE client
      return !stop.load();
    });
    EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled) << r.status();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  std::vector<int64_t> latencies;
  for (int i = 0; i < 50; ++i) {
    int64_t t0 = proto::MonotonicMs();
    ASSERT_TRUE(client_.Ping().ok());
    latencies.push_back(proto::MonotonicMs() - t0);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const int64_t rss_during = RssKb();
  stop = true;
  flood.join();
  std::sort(latencies.begin(), latencies.end());
  EXPECT_LT(latencies[latencies.size() * 99 / 100], 200) << "p99 ping latency in ms";
  // ~1 s at one 64 KiB chunk per 20 ms: a few MiB consumed; without flow control `yes` would
  // have pushed hundreds of MiB into esbd by now.
  EXPECT_LT(consumed.load(), 16 << 20);
  EXPECT_LT(rss_during - rss_before, 24 * 1024) << "RSS grew by KiB";
  // The cancel reached the agent although its exec was blocked waiting for output credit: the
  // next exec (serialised behind it) runs at once, not after the flood's 20 s timeout.
  auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(Run("echo next").stdout_data, "next\n");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
  EXPECT_EQ(connects_.load(), 1);
}

TEST_F(AgentClientTest, ExecStdin) {
  ExecRequest request;
  request.command = "tr a-z A-Z; echo; wc -c < /dev/null";
  request.stdin_data = "hello stdin";
  absl::StatusOr<ExecResult> r = client_.Exec(request, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->stdout_data, "HELLO STDIN\n0\n");
  // Binary and larger than several windows.
  std::string data;
  for (int i = 0; i < 3 << 20; ++i) data.push_back(static_cast<char>(i * 7));
  request.command = "sha256sum | cut -c1-16";
  request.stdin_data = data;
  r = client_.Exec(request, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(client_.Write("in.bin", data, 0, true).ok());
  EXPECT_EQ(r->stdout_data, Run("sha256sum < in.bin | cut -c1-16").stdout_data);
  // A command that does not read its stdin still finishes.
  request.command = "echo ignored";
  r = client_.Exec(request, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->stdout_data, "ignored\n");
}

TEST_F(AgentClientTest, AgentKilledMidCallFailsEveryPendingCallWithAClearError) {
  ASSERT_TRUE(client_.Ping().ok());
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(6);
  for (int i = 0; i < 6; ++i) {
    threads.emplace_back([&, i] {
      ExecRequest request;  // serialised by the agent: one runs, the others queue
      request.command = "echo $$ >> shells.pid; sleep 30";
      request.timeout = std::chrono::milliseconds(60000);
      results[i] = client_.Exec(request, nullptr).status();
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  auto start = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(agent_.pid(), SIGKILL), 0);
  for (auto& t : threads) t.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  for (const absl::Status& s : results) {
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_NE(s.message().find("agent connection lost"), std::string::npos) << s;
  }
  std::istringstream shells(ReadHostFile("shells.pid"));
  for (pid_t pid; shells >> pid;) kill(-pid, SIGKILL);  // the agent cannot clean up any more
  // The next call reconnects and says there is no agent.
  EXPECT_EQ(client_.Ping(500).code(), absl::StatusCode::kUnavailable);
}

TEST_F(AgentClientTest, ReconnectsAfterTheAgentRestarts) {
  ASSERT_TRUE(client_.Ping().ok());
  AgentProcess& first = agent_;
  std::string dir = first.dir();
  ASSERT_EQ(kill(first.pid(), SIGTERM), 0);
  ASSERT_NE(first.Wait(5000), -1);
  AgentProcess second({}, dir);
  ASSERT_TRUE(second.WaitReady());
  EXPECT_TRUE(client_.WaitReady(5000).ok());
  EXPECT_EQ(Run("echo again").stdout_data, "again\n");
  EXPECT_EQ(connects_.load(), 2);
}

// `spawn` of an interactive Python driven through `input` and `wait` (output streamed to a
// sink), then its exit status.
TEST_F(AgentClientTest, SpawnPythonInteractiveDrivenThroughInputAndOutput) {
  ProcessRequest request;
  request.argv = {"python3", "-i", "-u", "-q"};
  absl::StatusOr<std::string> id = client_.Spawn(request);
  ASSERT_TRUE(id.ok()) << id.status();
  std::string out, err;
  auto sink = [&](Stream s, std::string_view data) {
    (s == Stream::kStderr ? err : out).append(data);
    return true;
  };
  ASSERT_TRUE(client_.Input(*id, "x = 6 * 7\nprint(x)\n", false).ok());
  for (int i = 0; i < 50 && out.find("42\n") == std::string::npos; ++i) {
    absl::StatusOr<ProcessStatus> w = client_.Wait(*id, 100, sink);
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_FALSE(w->exited) << "python exited early: " << err;
  }
  EXPECT_EQ(out, "42\n");
  EXPECT_NE(err.find(">>> "), std::string::npos) << err;  // the interactive prompt
  // State persists between inputs: it is one process.
  ASSERT_TRUE(client_.Input(*id, "print(x + 1)\nimport sys; sys.exit(3)\n", true).ok());
  absl::StatusOr<ProcessStatus> w = client_.Wait(*id, 5000, sink);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE(w->exited);
  EXPECT_EQ(w->exit_code, 3);
  EXPECT_EQ(out, "42\n43\n");
  EXPECT_FALSE(client_.Signal(*id, SIGTERM).ok()) << "signal to a process that exited";
}

// A PTY whose size changes: the process sees the new size (TIOCSWINSZ + SIGWINCH).
TEST_F(AgentClientTest, PtySizeChanges) {
  ProcessRequest request;
  request.argv = {"bash", "--noprofile", "--norc", "-c",
                  "stty size; read -r line; stty size; echo got:$line"};
  request.pty = true;
  request.rows = 24;
  request.cols = 80;
  absl::StatusOr<std::string> id = client_.Spawn(request);
  ASSERT_TRUE(id.ok()) << id.status();
  std::string out;
  auto sink = [&](Stream, std::string_view data) {
    out.append(data);
    return true;
  };
  for (int i = 0; i < 50 && out.find("24 80") == std::string::npos; ++i) {
    ASSERT_TRUE(client_.Wait(*id, 100, sink).ok());
  }
  EXPECT_NE(out.find("24 80"), std::string::npos) << out;
  ASSERT_TRUE(client_.Resize(*id, 40, 100).ok());
  // The line typed at the terminal lets the script go on and print its size again.
  ASSERT_TRUE(client_.Input(*id, "hello\r", false).ok());
  absl::StatusOr<ProcessStatus> w = client_.Wait(*id, 5000, sink);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE(w->exited);
  EXPECT_NE(out.find("40 100"), std::string::npos) << out;
  EXPECT_NE(out.find("got:hello"), std::string::npos) << out;
  // A pipe process has no terminal to resize; an unknown id is NotFound.
  EXPECT_EQ(client_.Resize("999999", 10, 10).code(), absl::StatusCode::kNotFound);
}

TEST_F(AgentClientTest, KillEndsASpawnedTree) {
  ProcessRequest request;
  request.argv = {"bash", "-c", "setsid sleep 100 & echo $!; sleep 100"};
  absl::StatusOr<std::string> id = client_.Spawn(request);
  ASSERT_TRUE(id.ok()) << id.status();
  std::string out;
  for (int i = 0; i < 50 && out.find('\n') == std::string::npos; ++i) {
    ASSERT_TRUE(client_
                    .Wait(*id, 100,
                          [&](Stream, std::string_view d) {
                            out.append(d);
                            return true;
                          })
                    .ok());
  }
  pid_t escapee = std::atoi(out.c_str());
  ASSERT_GT(escapee, 1) << out;
  ASSERT_TRUE(client_.Kill(*id).ok());
  absl::StatusOr<ProcessStatus> w = client_.Wait(*id, 5000, nullptr);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE(w->exited);
  EXPECT_TRUE(ProcessGone(escapee, 3000)) << "setsid escapee survived kill";
}

TEST_F(AgentClientTest, SyncFreezesAndThawsAndReseedMixesEntropy) {
  ASSERT_TRUE(client_.Sync(/*freeze=*/false).ok());
  ASSERT_TRUE(client_.Sync(/*freeze=*/true, 10000).ok());
  ASSERT_TRUE(client_.Thaw().ok());
  EXPECT_EQ(Run("echo thawed").stdout_data, "thawed\n");
  EXPECT_TRUE(client_.Reseed(std::string(32, '\x5a')).ok());
  EXPECT_EQ(client_.Reseed("short").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_.Spawn(ProcessRequest{}).status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::vector<std::string>> ops = client_.Capabilities();
  ASSERT_TRUE(ops.ok());
  for (const char* op :
       {"spawn", "input", "signal", "resize", "wait", "kill", "sync", "thaw", "reseed"}) {
    EXPECT_NE(std::find(ops->begin(), ops->end(), op), ops->end()) << op;
  }
}

// The microVM transport: one already-open byte stream, no listening socket. The agent serves
// it with --serve-fd; esbd uses AgentClient::SingleFd.
class SingleFdAgent {
 public:
  // Starts the agent on `agent_end` (closed here) as its fd 3.
  explicit SingleFdAgent(int agent_end) {
    char tmpl[] = "/tmp/esb-agent-fd-XXXXXX";
    dir_ = mkdtemp(tmpl);
    std::string ws = dir_ + "/workspace";
    mkdir(ws.c_str(), 0755);
    std::vector<std::string> args = {
        ESB_AGENT_BINARY, "--serve-fd",    "3",           "--workspace", ws,
        "--state-dir",    dir_ + "/state", "--log-level", "warn"};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, agent_end, 3);
    if (posix_spawn(&pid_, args[0].c_str(), &actions, nullptr, argv.data(), environ) != 0) {
      pid_ = -1;
    }
    posix_spawn_file_actions_destroy(&actions);
    close(agent_end);
  }
  ~SingleFdAgent() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  pid_t pid() const { return pid_; }

 private:
  std::string dir_;
  pid_t pid_ = -1;
};

void ExerciseSingleFd(AgentClient& client, pid_t agent_pid) {
  ASSERT_TRUE(client.WaitReady(5000).ok());
  absl::StatusOr<std::vector<std::string>> ops = client.Capabilities();
  ASSERT_TRUE(ops.ok()) << ops.status();
  EXPECT_NE(std::find(ops->begin(), ops->end(), "exec"), ops->end());
  std::string all;
  for (int i = 0; i < 256; ++i) all.push_back(static_cast<char>(i));
  all += std::string(100000, '\r') + std::string(100000, '\x03');  // CR and ^C: raw bytes
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::string name = "f" + std::to_string(t);
      absl::StatusOr<FileChunk> back;
      ExecRequest request;
      request.command = "printf 'a\\r\\nb'; echo " + name;
      absl::StatusOr<ExecResult> r = client.Exec(request, nullptr);
      if (client.Write(name, all, 0, true).ok() && (back = client.Read(name, 0, 1 << 20)).ok() &&
          back->data == all && r.ok() && r->stdout_data == "a\r\nb" + name + "\n") {
        ++ok;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 4);
  // The agent dies: pending and later calls fail clearly (a port cannot be reopened).
  ExecRequest request;
  request.command = "sleep 30";
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    kill(agent_pid, SIGKILL);
  });
  absl::StatusOr<ExecResult> r = client.Exec(request, nullptr);
  killer.join();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  absl::Status after = client.Ping(500);
  EXPECT_EQ(after.code(), absl::StatusCode::kUnavailable) << after;
  EXPECT_NE(after.message().find("port was lost"), std::string::npos) << after;
}

TEST(AgentSingleFdTest, ServesEverythingOverASocketpair) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  SingleFdAgent agent(sv[1]);
  ASSERT_GT(agent.pid(), 0);
  AgentClient client(AgentClient::SingleFd(sv[0]));
  ExerciseSingleFd(client, agent.pid());
}

TEST(AgentSingleFdTest, ServesEverythingOverARawPty) {
  int master = -1, slave = -1;
  ASSERT_EQ(openpty(&master, &slave, nullptr, nullptr, nullptr), 0);
  termios t;
  ASSERT_EQ(tcgetattr(slave, &t), 0);
  cfmakeraw(&t);  // no line discipline: a byte stream like a virtio-serial port
  ASSERT_EQ(tcsetattr(slave, TCSANOW, &t), 0);
  fcntl(master, F_SETFD, FD_CLOEXEC);
  SingleFdAgent agent(slave);
  ASSERT_GT(agent.pid(), 0);
  AgentClient client(AgentClient::SingleFd(master));
  ExerciseSingleFd(client, agent.pid());
}

}  // namespace
}  // namespace esb

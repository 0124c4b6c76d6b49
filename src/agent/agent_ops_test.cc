// The agent's machinery for the spawn/input/signal/resize/wait/kill, sync and reseed ops
// (process_table.h, quiesce.h, reseed.h), in process: real processes (python3, sh, cat, head)
// started through the real esb-agent binary as exec shim, reaped by a real Reaper. This
// process is a child subreaper, as the agent is, so orphans come back to it.
#include <errno.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>

#include "agent/process_table.h"
#include "agent/quiesce.h"
#include "agent/reaper.h"
#include "agent/reseed.h"
#include "agent/util.h"
#include "common/protocol.h"

namespace esb::agent {
namespace {

Reaper* g_reaper = nullptr;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// /proc state letter of `pid`, 0 once it is gone.
char ProcState(pid_t pid) {
  std::string stat = ReadFile("/proc/" + std::to_string(pid) + "/stat");
  size_t paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() ? 0 : stat[paren + 2];
}

bool Eventually(const std::function<bool()>& pred, int timeout_ms = 5000) {
  const int64_t deadline = proto::MonotonicMs() + timeout_ms;
  while (!pred()) {
    if (proto::MonotonicMs() >= deadline) return false;
    usleep(5000);
  }
  return true;
}

// Collects one process's output and exit, as an op handler would.
struct Sink {
  std::mutex mu;
  std::condition_variable cv;
  std::string text[3];  // stdout, stderr, pty
  int64_t bytes = 0;
  bool ended = false;
  bool output_after_exit = false;
  ExitInfo exit;
  int drained = 0;
  // Called after counting each chunk (outside mu), e.g. to grant credit.
  std::function<void(uint64_t id, size_t n)> after_chunk;
  bool keep_text = true;

  void Attach(SpawnSpec* spec) {
    spec->on_output = [this](uint64_t id, OutputStream s, std::string_view d) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (ended) output_after_exit = true;
        if (keep_text) text[static_cast<int>(s)].append(d);
        bytes += static_cast<int64_t>(d.size());
      }
      cv.notify_all();
      if (after_chunk) after_chunk(id, d.size());
    };
    spec->on_exit = [this](uint64_t, const ExitInfo& e) {
      {
        std::lock_guard<std::mutex> lock(mu);
        ended = true;
        exit = e;
      }
      cv.notify_all();
    };
    spec->on_input_drained = [this](uint64_t) {
      {
        std::lock_guard<std::mutex> lock(mu);
        ++drained;
      }
      cv.notify_all();
    };
  }
  bool WaitUntil(const std::function<bool()>& pred, int timeout_ms = 10000) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::milliseconds(timeout_ms), pred);
  }
  bool WaitText(OutputStream s, const std::string& needle, int timeout_ms = 10000) {
    return WaitUntil([&] { return text[static_cast<int>(s)].find(needle) != std::string::npos; },
                     timeout_ms);
  }
  bool WaitEnded(int timeout_ms = 10000) {
    return WaitUntil([&] { return ended; }, timeout_ms);
  }
  std::string Text(OutputStream s) {
    std::lock_guard<std::mutex> lock(mu);
    return text[static_cast<int>(s)];
  }
  int64_t Bytes() {
    std::lock_guard<std::mutex> lock(mu);
    return bytes;
  }
};

class ProcessTableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/esb-ops-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    workspace_ = tmpl;
    options_.workspace = workspace_;
    options_.shim = ESB_AGENT_BINARY;
    options_.user = "tester";
  }
  void TearDown() override {
    table_.reset();  // before the sinks its callbacks use
    std::filesystem::remove_all(workspace_);
  }
  ProcessTable& table() {
    if (!table_) table_ = std::make_unique<ProcessTable>(options_, g_reaper);
    return *table_;
  }
  // Spawns with a fresh sink attached; fails the test if the spawn fails.
  uint64_t Spawn(SpawnSpec spec, Sink** sink_out = nullptr) {
    Sink& sink = sinks_.emplace_back();
    sink.Attach(&spec);
    if (sink_out) *sink_out = &sink;
    uint64_t id = 0;
    OpStatus s = table().Spawn(std::move(spec), &id);
    EXPECT_TRUE(s.ok) << s.error;
    return id;
  }
  static SpawnSpec Cmd(std::vector<std::string> argv, bool pty = false) {
    SpawnSpec spec;
    spec.argv = std::move(argv);
    spec.pty = pty;
    return spec;
  }
  pid_t Pid(uint64_t id) {
    ProcessInfo info;
    EXPECT_TRUE(table().Info(id, &info).ok);
    return info.pid;
  }

  std::string workspace_;
  ProcessTableOptions options_;
  std::deque<Sink> sinks_;  // declared before table_: destroyed after it
  std::unique_ptr<ProcessTable> table_;
};

// issue 10: a `spawn` of `python3 -i` driven through input/output.
TEST_F(ProcessTableTest, InteractivePythonOverPipes) {
  Sink* sink;
  uint64_t id = Spawn(Cmd({"python3", "-i", "-q"}), &sink);
  ASSERT_GT(id, 0u);
  int64_t pending = -1;
  OpStatus s = table().WriteInput(id, "print(6*7)\n", &pending);
  ASSERT_TRUE(s.ok) << s.error;
  EXPECT_EQ(pending, 0);
  ASSERT_TRUE(sink->WaitText(OutputStream::kStdout, "42\n")) << sink->Text(OutputStream::kStdout);
  // The interactive prompt goes to stderr: the streams are kept apart.
  EXPECT_TRUE(sink->WaitText(OutputStream::kStderr, ">>>"));
  ASSERT_TRUE(table().WriteInput(id, "import os; print(os.getcwd())\n").ok);
  ASSERT_TRUE(sink->WaitText(OutputStream::kStdout, workspace_ + "\n"));
  ASSERT_TRUE(table().CloseInput(id).ok);  // EOF: python -i exits 0
  ExitInfo exit;
  ASSERT_TRUE(table().Wait(id, 10000, &exit).ok);
  EXPECT_TRUE(exit.exited);
  EXPECT_EQ(exit.exit_code, 0);
  EXPECT_EQ(exit.signal, 0);
  ASSERT_TRUE(sink->WaitEnded());
  EXPECT_FALSE(sink->output_after_exit);
  EXPECT_EQ(table().WriteInput(id, "x\n").errno_name, "ESRCH");
}

// issue 10: a PTY whose size changes.
TEST_F(ProcessTableTest, PtySizeChangesBetweenReads) {
  Sink* sink;
  SpawnSpec spec = Cmd({"sh", "-c", "stty size; read x; stty size"}, true);
  spec.rows = 24;
  spec.cols = 80;
  uint64_t id = Spawn(std::move(spec), &sink);
  ASSERT_TRUE(sink->WaitText(OutputStream::kPty, "24 80")) << sink->Text(OutputStream::kPty);
  OpStatus s = table().Resize(id, 50, 132);
  ASSERT_TRUE(s.ok) << s.error;
  ASSERT_TRUE(table().WriteInput(id, "\n").ok);
  ASSERT_TRUE(sink->WaitText(OutputStream::kPty, "50 132")) << sink->Text(OutputStream::kPty);
  ExitInfo exit;
  ASSERT_TRUE(table().Wait(id, 10000, &exit).ok);
  EXPECT_EQ(exit.exit_code, 0);
  ASSERT_TRUE(sink->WaitEnded());
  EXPECT_TRUE(sink->Text(OutputStream::kStdout).empty());  // a PTY is one stream
  EXPECT_EQ(table().Resize(id, 10, 10).errno_name, "ESRCH");
  EXPECT_EQ(table().Resize(id, 0, 10).errno_name, "EINVAL");
}

// The PTY is the controlling terminal of the process's own session (/dev/tty opens, the
// process leads its session), TERM says so, and a resize reaches the foreground job as
// SIGWINCH; CloseInput sends the terminal's EOF.
TEST_F(ProcessTableTest, PtyIsTheControllingTerminal) {
  Sink* sink;
  uint64_t id = Spawn(Cmd({"python3", "-c",
                           "import os, select, signal, sys\n"
                           "open('/dev/tty').close()\n"
                           "print('ctty', os.getsid(0) == os.getpid(), os.environ['TERM'])\n"
                           "signal.signal(signal.SIGWINCH, lambda s, f: print('winch', "
                           "os.get_terminal_size(0)))\n"
                           "print('ready', flush=True)\n"
                           // Python runs a handler at its next check, not inside a blocking
                           // read() begun after the signal: wait for input in short slices.
                           "while not select.select([0], [], [], 0.05)[0]: pass\n"
                           "print('read', repr(sys.stdin.read()))\n"},
                          true),
                      &sink);
  ASSERT_TRUE(sink->WaitText(OutputStream::kPty, "ready")) << sink->Text(OutputStream::kPty);
  EXPECT_NE(sink->Text(OutputStream::kPty).find("ctty True xterm-256color"), std::string::npos)
      << sink->Text(OutputStream::kPty);
  ASSERT_TRUE(table().Resize(id, 30, 100).ok);
  ASSERT_TRUE(sink->WaitText(OutputStream::kPty, "columns=100, lines=30"))
      << sink->Text(OutputStream::kPty) << "\nstatus:\n"
      << ReadFile("/proc/" + std::to_string(Pid(id)) + "/status")
      << "wchan: " << ReadFile("/proc/" + std::to_string(Pid(id)) + "/wchan");
  ASSERT_TRUE(table().WriteInput(id, "abc\n").ok);
  ASSERT_TRUE(table().CloseInput(id).ok);  // ^D at the start of a line: EOF
  ASSERT_TRUE(sink->WaitText(OutputStream::kPty, "read 'abc\\n'"))
      << sink->Text(OutputStream::kPty);
  ExitInfo exit;
  ASSERT_TRUE(table().Wait(id, 10000, &exit).ok);
  EXPECT_EQ(exit.exit_code, 0);
}

TEST_F(ProcessTableTest, ResizeOfAPipeProcessIsRefused) {
  uint64_t id = Spawn(Cmd({"sleep", "100"}));
  OpStatus s = table().Resize(id, 10, 10);
  EXPECT_EQ(s.errno_name, "EINVAL");
  EXPECT_NE(s.error.find("no terminal"), std::string::npos) << s.error;
}

TEST_F(ProcessTableTest, SignalTermEndsTheProcessAndOnlyAllowedSignalsPass) {
  Sink* sink;
  uint64_t id = Spawn(Cmd({"sleep", "100"}), &sink);
  EXPECT_EQ(table().Signal(id, SIGSEGV).errno_name, "EINVAL");
  EXPECT_EQ(table().Signal(id, 64).errno_name, "EINVAL");
  EXPECT_EQ(table().Signal(12345, SIGTERM).errno_name, "ENOENT");
  ExitInfo exit;
  ASSERT_TRUE(table().Wait(id, 0, &exit).ok);
  EXPECT_FALSE(exit.exited);
  OpStatus s = table().Signal(id, SIGTERM);
  ASSERT_TRUE(s.ok) << s.error;
  ASSERT_TRUE(table().Wait(id, 10000, &exit).ok);
  EXPECT_TRUE(exit.exited);
  EXPECT_EQ(exit.signal, SIGTERM);
  EXPECT_EQ(exit.exit_code, -1);
  EXPECT_EQ(table().Signal(id, SIGTERM).errno_name, "ESRCH");
  EXPECT_EQ(ProcessTable::SignalFromName("term"), SIGTERM);
  EXPECT_EQ(ProcessTable::SignalFromName("SIGWINCH"), SIGWINCH);
  EXPECT_EQ(ProcessTable::SignalFromName("SEGV"), 0);
  EXPECT_EQ(ProcessTable::SignalFromName("SIGSIGINT"), 0);
}

// Kill ends what the process started too: a double-forked, setsid grandchild.
TEST_F(ProcessTableTest, KillEndsADoubleForkedSetsidGrandchild) {
  Sink* sink;
  uint64_t id = Spawn(
      Cmd({"sh", "-c", "(setsid sh -c 'echo $$ > gc.pid; exec sleep 1000' &); sleep 1000"}), &sink);
  const std::string pid_file = workspace_ + "/gc.pid";
  ASSERT_TRUE(Eventually([&] { return ReadFile(pid_file).find('\n') != std::string::npos; }));
  const pid_t gc = std::stoi(ReadFile(pid_file));
  ASSERT_GT(gc, 1);
  ASSERT_TRUE(Eventually([&] { return ProcState(gc) == 'S'; }));
  // Its parent (the subshell) exited: the grandchild was reparented to the spawned process,
  // a subreaper.
  ASSERT_TRUE(Eventually([&] {
    std::string stat = ReadFile("/proc/" + std::to_string(gc) + "/stat");
    size_t paren = stat.rfind(')');
    return paren != std::string::npos && std::stoi(stat.substr(paren + 4)) == Pid(id);
  }));
  ASSERT_TRUE(table().Kill(id).ok);
  ExitInfo exit;
  ASSERT_TRUE(table().Wait(id, 10000, &exit).ok);
  EXPECT_EQ(exit.signal, SIGKILL);
  EXPECT_TRUE(Eventually([&] {
    char st = ProcState(gc);
    return st == 0 || st == 'Z';
  })) << "grandchild "
      << gc << " survived the kill";
  ASSERT_TRUE(sink->WaitEnded());
  EXPECT_TRUE(table().Kill(id).ok);  // idempotent once exited
}

TEST_F(ProcessTableTest, KillAllEndsEveryProcess) {
  uint64_t a = Spawn(Cmd({"sleep", "100"}));
  uint64_t b = Spawn(Cmd({"sh", "-c", "sleep 100 & sleep 100"}));
  uint64_t c = Spawn(Cmd({"cat"}, true));
  table().KillAll();
  for (uint64_t id : {a, b, c}) {
    ExitInfo exit;
    ASSERT_TRUE(table().Wait(id, 10000, &exit).ok);
    EXPECT_TRUE(exit.exited) << id;
    EXPECT_EQ(exit.signal, SIGKILL) << id;
  }
}

// A consumer that stops granting credit stops the reads: the table holds at most the credit,
// the writer blocks on a full pipe; credit lets it finish.
TEST_F(ProcessTableTest, OutputFloodWithAPausedConsumerStaysBoundedThenResumes) {
  constexpr int64_t kWindow = 64 * 1024;
  constexpr int64_t kTotal = 16 << 20;
  Sink* sink;
  std::atomic<bool> resumed{false};
  SpawnSpec spec = Cmd({"sh", "-c", "head -c 16777216 /dev/zero; echo done >&2"});
  spec.output_window = kWindow;
  Sink& s = sinks_.emplace_back();
  s.keep_text = false;
  s.Attach(&spec);
  sink = &s;
  s.after_chunk = [&](uint64_t id, size_t n) {
    if (resumed) table_->GrantOutput(id, static_cast<int64_t>(n));
  };
  uint64_t id = 0;
  ASSERT_TRUE(table().Spawn(std::move(spec), &id).ok);
  ASSERT_TRUE(Eventually([&] { return sink->Bytes() == kWindow; })) << sink->Bytes();
  usleep(300000);
  EXPECT_EQ(sink->Bytes(), kWindow);  // nothing beyond the credit was read
  ProcessInfo info;
  ASSERT_TRUE(table().Info(id, &info).ok);
  EXPECT_EQ(info.output_credit, 0);
  EXPECT_EQ(info.state, "running");  // blocked writing into the full pipe
  // `head` is blocked in write(): its written byte count does not move.
  pid_t head = -1;
  for (const auto& [pid, proc] : ReadProcessTable()) {
    if (proc.ppid == info.pid) head = pid;
  }
  ASSERT_GT(head, 0);
  auto wchar = [&] {
    std::string io = ReadFile("/proc/" + std::to_string(head) + "/io");
    size_t at = io.find("wchar: ");
    return at == std::string::npos ? -1LL : std::stoll(io.substr(at + 7));
  };
  int64_t w1 = wchar();
  usleep(200000);
  EXPECT_EQ(wchar(), w1);
  EXPECT_LE(w1, kWindow + 1024 * 1024);  // credit + the pipe's buffer
  // Resume: grant as the consumer consumes.
  resumed = true;
  ASSERT_TRUE(table().GrantOutput(id, kWindow).ok);
  ExitInfo exit;
  ASSERT_TRUE(table().Wait(id, 20000, &exit).ok);
  EXPECT_EQ(exit.exit_code, 0);
  ASSERT_TRUE(sink->WaitEnded(20000));
  EXPECT_EQ(sink->Bytes(), kTotal + 5);  // 16 MiB of stdout and "done\n" on stderr
}

TEST_F(ProcessTableTest, PauseOutputHoldsOutputUntilResume) {
  Sink* sink;
  uint64_t id = Spawn(Cmd({"sh", "-c", "read x; echo $x"}), &sink);
  ASSERT_TRUE(table().PauseOutput(id).ok);
  ASSERT_TRUE(table().WriteInput(id, "hello\n").ok);
  ExitInfo exit;
  ASSERT_TRUE(table().Wait(id, 10000, &exit).ok);  // exited; its output waits in the pipe
  usleep(300000);  // longer than the exit grace: a paused stream is not cut
  EXPECT_EQ(sink->Text(OutputStream::kStdout), "");
  EXPECT_FALSE(sink->ended);
  ASSERT_TRUE(table().ResumeOutput(id).ok);
  ASSERT_TRUE(sink->WaitEnded());
  EXPECT_EQ(sink->Text(OutputStream::kStdout), "hello\n");
}

// A consumer that never resumes must not hold a process slot forever: kill drops the output.
TEST_F(ProcessTableTest, KillOfAnExitedProcessDropsHeldOutputAndEndsIt) {
  Sink* sink;
  uint64_t id = Spawn(Cmd({"sh", "-c", "read x; echo held"}), &sink);
  ASSERT_TRUE(table().PauseOutput(id).ok);
  ASSERT_TRUE(table().WriteInput(id, "go\n").ok);  // output only after the pause
  ExitInfo exit;
  ASSERT_TRUE(table().Wait(id, 10000, &exit).ok);
  ASSERT_TRUE(exit.exited);
  ProcessInfo info;
  ASSERT_TRUE(table().Info(id, &info).ok);
  EXPECT_EQ(info.state, "exited");
  ASSERT_TRUE(table().Kill(id).ok);
  ASSERT_TRUE(sink->WaitEnded());
  EXPECT_EQ(sink->Text(OutputStream::kStdout), "");
  ASSERT_TRUE(table().Info(id, &info).ok);
  EXPECT_EQ(info.state, "ended");
  EXPECT_EQ(info.exit.exit_code, 0);
}

TEST_F(ProcessTableTest, MaxProcessesIsEnforcedWithAClearError) {
  options_.max_processes = 3;
  std::vector<uint64_t> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(Spawn(Cmd({"sleep", "100"})));
  EXPECT_TRUE(ids[0] < ids[1] && ids[1] < ids[2]);
  uint64_t id = 0;
  OpStatus s = table().Spawn(Cmd({"sleep", "100"}), &id);
  EXPECT_FALSE(s.ok);
  EXPECT_EQ(s.errno_name, "EAGAIN");
  EXPECT_NE(s.error.find("at most 3"), std::string::npos) << s.error;
  ASSERT_TRUE(table().Kill(ids[0]).ok);
  ASSERT_TRUE(sinks_[0].WaitEnded());
  uint64_t again = Spawn(Cmd({"sleep", "100"}));
  EXPECT_GT(again, ids[2]);  // ids are never reused
}

TEST_F(ProcessTableTest, WaitTimesOutWhileTheProcessRuns) {
  uint64_t id = Spawn(Cmd({"sleep", "100"}));
  const int64_t start = proto::MonotonicMs();
  ExitInfo exit;
  OpStatus s = table().Wait(id, 300, &exit);
  ASSERT_TRUE(s.ok) << s.error;
  EXPECT_FALSE(exit.exited);
  EXPECT_GE(proto::MonotonicMs() - start, 300);
  EXPECT_EQ(table().Wait(999, 0, &exit).errno_name, "ENOENT");
}

TEST_F(ProcessTableTest, ExitedStatusesAreKeptForALateWaitButBounded) {
  options_.max_exited = 2;
  std::vector<uint64_t> ids;
  for (int code : {3, 4, 5}) {
    Sink* sink;
    ids.push_back(Spawn(Cmd({"sh", "-c", "exit " + std::to_string(code)}), &sink));
    ASSERT_TRUE(sink->WaitEnded());
  }
  ExitInfo exit;
  // The oldest was dropped once a third ended.
  EXPECT_EQ(table().Wait(ids[0], 0, &exit).errno_name, "ENOENT");
  ASSERT_TRUE(table().Wait(ids[1], 0, &exit).ok);
  EXPECT_EQ(exit.exit_code, 4);
  ASSERT_TRUE(table().Wait(ids[2], 0, &exit).ok);
  EXPECT_EQ(exit.exit_code, 5);
  EXPECT_EQ(table().List().size(), 2u);
}

// Input never blocks the caller: what the pipe does not take is queued up to the cap, beyond
// which a write is refused whole (EAGAIN); the drained callback says when to send more.
TEST_F(ProcessTableTest, InputBackpressureIsBoundedAndDrains) {
  options_.max_pending_input = 256 * 1024;
  Sink* sink;
  // Reads nothing until told (via a file), then everything.
  uint64_t id = Spawn(Cmd({"sh", "-c", "while [ ! -e go ]; do sleep 0.01; done; wc -c"}), &sink);
  const std::string chunk(64 * 1024, 'x');
  int64_t accepted = 0, pending = 0;
  OpStatus s;
  for (int i = 0; i < 100; ++i) {
    s = table().WriteInput(id, chunk, &pending);
    if (!s.ok) break;
    accepted += static_cast<int64_t>(chunk.size());
  }
  ASSERT_FALSE(s.ok);
  EXPECT_EQ(s.errno_name, "EAGAIN");
  EXPECT_GT(pending, 0);
  EXPECT_LE(pending, options_.max_pending_input);
  EXPECT_LE(accepted, options_.max_pending_input + 1024 * 1024);  // queue + pipe buffer
  EXPECT_EQ(table().WriteInput(id, std::string(options_.max_pending_input + 1, 'x')).errno_name,
            "EINVAL");
  std::ofstream(workspace_ + "/go").put('\n');
  ASSERT_TRUE(sink->WaitUntil([&] { return sink->drained > 0; }));
  ASSERT_TRUE(table().CloseInput(id).ok);
  ASSERT_TRUE(sink->WaitEnded());
  EXPECT_EQ(std::stoll(sink->Text(OutputStream::kStdout)), accepted);
}

TEST_F(ProcessTableTest, InputAfterCloseInputIsRefused) {
  uint64_t id = Spawn(Cmd({"sleep", "100"}));
  ASSERT_TRUE(table().CloseInput(id).ok);
  EXPECT_EQ(table().WriteInput(id, "y").errno_name, "EPIPE");
  EXPECT_EQ(table().WriteInput(777, "y").errno_name, "ENOENT");
}

// "input" with eof is a write then a close: the process may read the write and exit before
// the close. Closing the input of an exited process succeeds; writing to it does not.
TEST_F(ProcessTableTest, ClosingTheInputOfAnExitedProcessSucceeds) {
  uint64_t id = Spawn(Cmd({"true"}));
  ExitInfo exit;
  ASSERT_TRUE(table().Wait(id, 10000, &exit).ok);
  ASSERT_TRUE(exit.exited);
  EXPECT_TRUE(table().CloseInput(id).ok);
  EXPECT_EQ(table().WriteInput(id, "y").errno_name, "ESRCH");
  EXPECT_EQ(table().CloseInput(777).errno_name, "ENOENT");
}

TEST_F(ProcessTableTest, SpecIsCheckedWithExecPathRules) {
  ASSERT_EQ(mkdir((workspace_ + "/sub").c_str(), 0755), 0);
  Sink* sink;
  SpawnSpec spec = Cmd({"sh", "-c", "pwd; echo $FOO $HOME"});
  spec.cwd = "sub";
  spec.env["FOO"] = "bar";
  Spawn(std::move(spec), &sink);
  ASSERT_TRUE(sink->WaitEnded());
  EXPECT_EQ(sink->Text(OutputStream::kStdout), workspace_ + "/sub\nbar " + workspace_ + "\n");

  uint64_t id;
  auto spawn_error = [&](SpawnSpec bad) { return table().Spawn(std::move(bad), &id).errno_name; };
  SpawnSpec bad = Cmd({"true"});
  bad.cwd = "/proc/self";
  EXPECT_EQ(spawn_error(bad), "EACCES");
  bad.cwd = "/proc/self/root/tmp";  // a magic link
  EXPECT_EQ(spawn_error(bad), "ELOOP");
  bad.cwd = "missing";
  EXPECT_EQ(spawn_error(bad), "ENOENT");
  EXPECT_EQ(spawn_error(Cmd({"no-such-command-esb"})), "ENOENT");
  EXPECT_EQ(spawn_error(Cmd({})), "EINVAL");
  EXPECT_EQ(spawn_error(Cmd({std::string("a\0b", 3)})), "EINVAL");
  bad = Cmd({"true"});
  bad.env["A=B"] = "x";
  EXPECT_EQ(spawn_error(bad), "EINVAL");
  bad = Cmd({"true"}, true);
  bad.rows = 0;
  EXPECT_EQ(spawn_error(bad), "EINVAL");
  bad = Cmd({"true"});
  bad.output_window = 0;
  EXPECT_EQ(spawn_error(bad), "EINVAL");
}

TEST_F(ProcessTableTest, ConfigureSetsTheBaseEnvironmentUnderTheSpecs) {
  table().Configure({{"A", "base"}, {"B", "base"}});
  Sink* sink;
  SpawnSpec spec = Cmd({"sh", "-c", "echo $A $B $USER $TERM"});
  spec.env["B"] = "spec";
  Spawn(std::move(spec), &sink);
  ASSERT_TRUE(sink->WaitEnded());
  EXPECT_EQ(sink->Text(OutputStream::kStdout), "base spec tester dumb\n");
}

// A process that exits while a background child keeps its stdout open ends after the grace.
TEST_F(ProcessTableTest, BackgroundChildHoldingTheOutputDoesNotDelayTheEnd) {
  Sink* sink;
  uint64_t id = Spawn(Cmd({"sh", "-c", "echo main; sleep 5 & exit 7"}), &sink);
  ExitInfo exit;
  ASSERT_TRUE(table().Wait(id, 10000, &exit).ok);
  EXPECT_EQ(exit.exit_code, 7);
  ASSERT_TRUE(sink->WaitEnded(2000));
  EXPECT_EQ(sink->exit.exit_code, 7);
  EXPECT_EQ(sink->Text(OutputStream::kStdout), "main\n");
}

// ---- sync ----

class FreezerTest : public ProcessTableTest {};

// For failure messages: every process under this one, with its state and wait channel.
std::string Descendants() {
  std::string out;
  std::map<pid_t, ProcInfo> table = ReadProcessTable();
  for (const auto& [pid, info] : table) {
    pid_t p = info.ppid;
    while (p > 1 && p != getpid()) p = table.count(p) ? table[p].ppid : 0;
    if (p != getpid()) continue;
    std::string dir = "/proc/" + std::to_string(pid);
    out += "\n" + std::to_string(pid) + " ppid " + std::to_string(info.ppid) + " " + info.state +
           " wchan " + ReadFile(dir + "/wchan") + " " + ReadFile(dir + "/cmdline");
  }
  return out;
}

// For failure messages: what did not stop, and where it waits.
std::string NotStopped(const FreezeResult& f) {
  std::string out;
  for (pid_t p : f.not_stopped) {
    std::string dir = "/proc/" + std::to_string(p);
    out += "\n" + ReadFile(dir + "/stat") + " wchan " + ReadFile(dir + "/wchan");
  }
  return out;
}

TEST_F(FreezerTest, FreezeStopsACountingProcessAndThawResumesIt) {
  Spawn(Cmd({"sh", "-c", "i=0; while :; do i=$((i+1)); echo $i > count; sleep 0.01; done"}));
  uint64_t stopped_before = Spawn(Cmd({"sleep", "100"}));
  ASSERT_TRUE(table().Signal(stopped_before, SIGSTOP).ok);
  ASSERT_TRUE(Eventually([&] { return ProcState(Pid(stopped_before)) == 'T'; }));
  const std::string count = workspace_ + "/count";
  auto value = [&] {
    std::string text = ReadFile(count);
    return text.empty() || text.back() != '\n' ? -1 : std::stoi(text);
  };
  ASSERT_TRUE(Eventually([&] { return value() > 3; }));

  Freezer freezer;
  FreezeResult f = freezer.Freeze(2000, 60000);
  ASSERT_TRUE(f.ok) << f.error << NotStopped(f);
  EXPECT_TRUE(freezer.frozen());
  EXPECT_GE(f.stopped, 1);
  EXPECT_GE(f.already_stopped, 1);
  std::vector<PathSync> synced = SyncFilesystems({workspace_});
  ASSERT_EQ(synced.size(), 1u);
  EXPECT_TRUE(synced[0].ok) << synced[0].error;
  int frozen_value = value();
  usleep(300000);
  EXPECT_EQ(value(), frozen_value) << "the counter ran while frozen";
  EXPECT_EQ(freezer.Freeze(100, 100).errno_name, "EBUSY");

  ThawResult t = freezer.Thaw();
  EXPECT_TRUE(t.was_frozen);
  EXPECT_EQ(t.resumed, f.stopped);
  EXPECT_TRUE(Eventually([&] { return value() > frozen_value; })) << Descendants();
  // What was stopped before the freeze stays stopped.
  usleep(100000);
  EXPECT_EQ(ProcState(Pid(stopped_before)), 'T');
  EXPECT_FALSE(freezer.Thaw().was_frozen);  // idempotent
}

TEST_F(FreezerTest, AFreezeNobodyThawsEndsByItself) {
  Spawn(Cmd({"sh", "-c", "i=0; while :; do i=$((i+1)); echo $i > count; sleep 0.01; done"}));
  const std::string count = workspace_ + "/count";
  auto value = [&] {
    std::string text = ReadFile(count);
    return text.empty() || text.back() != '\n' ? -1 : std::stoi(text);
  };
  ASSERT_TRUE(Eventually([&] { return value() > 0; }));
  Freezer freezer;
  FreezeResult f = freezer.Freeze(2000, 200);
  ASSERT_TRUE(f.ok) << f.error << NotStopped(f);
  int frozen_value = value();
  EXPECT_TRUE(Eventually([&] { return value() > frozen_value; }, 3000))
      << "still frozen after max_frozen_ms" << Descendants();
  EXPECT_FALSE(freezer.frozen());
  ThawResult t = freezer.Thaw();
  EXPECT_FALSE(t.was_frozen);
  EXPECT_TRUE(t.auto_thawed);
}

TEST(SyncTest, SyncFilesystemsReportsEachPath) {
  std::vector<PathSync> r = SyncFilesystems({"/tmp", "/nonexistent-esb-path"});
  ASSERT_EQ(r.size(), 2u);
  EXPECT_TRUE(r[0].ok) << r[0].error;
  EXPECT_FALSE(r[1].ok);
  EXPECT_EQ(r[1].errno_name, "ENOENT");
}

// ---- reseed ----

std::string RandomBytes(size_t n) {
  std::string out(n, '\0');
  Fd fd(open("/dev/urandom", O_RDONLY | O_CLOEXEC));
  EXPECT_TRUE(fd);
  EXPECT_EQ(read(fd.get(), out.data(), n), static_cast<ssize_t>(n));
  return out;
}

const ReseedStep* FindStep(const std::vector<ReseedStep>& steps, const std::string& name) {
  for (const auto& s : steps) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

TEST(ReseedTest, MixesHostBytesIntoTheKernelPoolAndReportsHow) {
  Reseeder reseeder;
  ReseedResult r = reseeder.Reseed(RandomBytes(64));
  ASSERT_TRUE(r.ok) << r.error;
  const ReseedStep* add = FindStep(r.kernel, "RNDADDENTROPY");
  const ReseedStep* write = FindStep(r.kernel, "write /dev/urandom");
  const ReseedStep* crng = FindStep(r.kernel, "RNDRESEEDCRNG");
  ASSERT_TRUE(add && write && crng);
  for (const auto& s : r.kernel) {
    std::cout << "[reseed] " << s.name << ": " << s.status
              << (s.detail.empty() ? "" : " (" + s.detail + ")") << "\n";
  }
  if (geteuid() == 0) {
    // Root on the host has CAP_SYS_ADMIN: the bytes are credited, no fallback is needed.
    EXPECT_EQ(add->status, "ok") << add->detail;
    EXPECT_EQ(write->status, "skipped");
    EXPECT_EQ(crng->status, "ok") << crng->detail;
  } else {
    EXPECT_EQ(add->status, "failed");
    EXPECT_EQ(add->errno_name, "EPERM");
    EXPECT_EQ(write->status, "ok") << write->detail;
  }
}

TEST(ReseedTest, RefusesTooFewOrTooManyBytes) {
  Reseeder reseeder;
  EXPECT_EQ(reseeder.Reseed(RandomBytes(8)).errno_name, "EINVAL");
  EXPECT_EQ(reseeder.Reseed(std::string(4097, 'x')).errno_name, "EINVAL");
}

// The userspace extension point: a hook that tells a process caching a generator (here a
// Python process seeded identically, as every clone of a snapshot would be) to reseed.
TEST_F(ProcessTableTest, ReseedHooksReachAProcessThatCachesEntropy) {
  Sink* sink;
  uint64_t id = Spawn(Cmd({"python3", "-c",
                           "import random, select, signal, sys\n"
                           "random.seed(1)\n"
                           "def reseed(s, f):\n"
                           "    random.seed()\n"
                           "    print('reseeded', flush=True)\n"
                           "signal.signal(signal.SIGUSR1, reseed)\n"
                           "print('ready', flush=True)\n"
                           "while not select.select([0], [], [], 0.05)[0]: pass\n"
                           "sys.stdin.read()\n"}),
                      &sink);
  ASSERT_TRUE(sink->WaitText(OutputStream::kStdout, "ready"));
  Reseeder reseeder;
  reseeder.AddHook("python kernel", [&](std::string* detail) {
    OpStatus s = table().Signal(id, SIGUSR1);
    *detail = s.ok ? "sent SIGUSR1" : s.error;
    return s.ok;
  });
  reseeder.AddHook("gone process", [&](std::string* detail) {
    OpStatus s = table().Signal(999, SIGUSR1);
    *detail = s.error;
    return s.ok;
  });
  ReseedResult r = reseeder.Reseed(RandomBytes(32));
  ASSERT_TRUE(r.ok) << r.error;
  ASSERT_EQ(r.hooks.size(), 2u);
  EXPECT_EQ(r.hooks[0].name, "python kernel");
  EXPECT_EQ(r.hooks[0].status, "ok");
  EXPECT_EQ(r.hooks[1].status, "failed");
  EXPECT_NE(r.hooks[1].detail.find("no process 999"), std::string::npos);
  EXPECT_TRUE(sink->WaitText(OutputStream::kStdout, "reseeded"));
  ASSERT_TRUE(table().CloseInput(id).ok);
  ExitInfo exit;
  ASSERT_TRUE(table().Wait(id, 10000, &exit).ok);
  EXPECT_EQ(exit.exit_code, 0);
}

// ---- as PID 1 (the production shape) ----

// Runs inside a new PID namespace as its PID 1 (see the test below): the Freezer's kill(-1)
// sweep and KillTree's freeze-the-sandbox path. Returns 0, or 20 + the number of the failed
// check (unshare itself exits 1 when it cannot create the namespaces).
int Pid1Helper(const std::string& workspace) {
  auto fail = [](int code, const std::string& what) {
    std::cerr << "pid1 helper: check " << code << " failed: " << what << "\n";
    return 20 + code;
  };
  if (getpid() != 1) return fail(1, "not PID 1");
  signal(SIGPIPE, SIG_IGN);
  auto* reaper = new Reaper();  // its thread lives as long as the process
  reaper->Start();
  ProcessTableOptions options;
  options.workspace = workspace;
  options.shim = ESB_AGENT_BINARY;
  ProcessTable table(options, reaper);
  uint64_t counter = 0, stopped = 0, tree = 0;
  SpawnSpec spec;
  spec.argv = {"sh", "-c", "i=0; while :; do i=$((i+1)); echo $i > count; sleep 0.01; done"};
  if (!table.Spawn(spec, &counter).ok) return fail(2, "spawn counter");
  spec.argv = {"sleep", "100"};
  if (!table.Spawn(spec, &stopped).ok || !table.Signal(stopped, SIGSTOP).ok) {
    return fail(3, "spawn and stop sleep");
  }
  ProcessInfo info;
  table.Info(stopped, &info);
  const pid_t stopped_pid = info.pid;
  if (!Eventually([&] { return ProcState(stopped_pid) == 'T'; })) return fail(4, "SIGSTOP");
  auto value = [&] {
    std::string text = ReadFile(workspace + "/count");
    return text.empty() || text.back() != '\n' ? -1 : std::stoi(text);
  };
  if (!Eventually([&] { return value() > 3; })) return fail(5, "counter never counted");

  Freezer freezer;
  FreezeResult f = freezer.Freeze(2000, 60000);
  if (!f.ok) return fail(6, "freeze: " + f.error);
  if (f.already_stopped < 1) return fail(7, "the stopped sleep was not seen as stopped before");
  int frozen = value();
  usleep(300000);
  if (value() != frozen) return fail(8, "counter ran while frozen");
  ThawResult t = freezer.Thaw();
  if (t.resumed < 1) return fail(9, "thaw resumed nothing");
  if (!Eventually([&] { return value() > frozen; })) return fail(10, "counter did not resume");
  usleep(100000);
  if (ProcState(stopped_pid) != 'T') return fail(11, "thaw resumed a process stopped before");

  // KillTree as PID 1: the whole sandbox is frozen for the kill, then everything else resumes.
  spec.argv = {"sh", "-c", "(setsid sh -c 'echo $$ > gc.pid; exec sleep 1000' &); sleep 1000"};
  if (!table.Spawn(spec, &tree).ok) return fail(12, "spawn tree");
  const std::string pid_file = workspace + "/gc.pid";
  if (!Eventually([&] { return ReadFile(pid_file).find('\n') != std::string::npos; })) {
    return fail(13, "grandchild never started");
  }
  const pid_t gc = std::stoi(ReadFile(pid_file));
  if (!table.Kill(tree).ok) return fail(14, "kill");
  ExitInfo exit;
  if (!table.Wait(tree, 5000, &exit).ok || exit.signal != SIGKILL) return fail(15, "not killed");
  if (!Eventually([&] {
        char st = ProcState(gc);
        return st == 0 || st == 'Z';
      })) {
    return fail(16, "grandchild survived");
  }
  int after_kill = value();
  if (!Eventually([&] { return value() > after_kill; })) {
    return fail(17, "counter stayed frozen after the kill");
  }
  if (ProcState(stopped_pid) != 'T') return fail(18, "the kill resumed a process stopped before");
  table.KillAll();
  if (!table.Wait(counter, 5000, &exit).ok || !exit.exited) return fail(19, "kill all");
  return 0;
}

// The Freezer and KillTree as the agent runs them in a sandbox: PID 1 of a PID namespace, with
// the namespace's own /proc (a user namespace makes this work without root).
TEST_F(ProcessTableTest, FreezeThawAndKillTreeAsPid1) {
  std::vector<std::string> args = {
      "unshare",      "--user",       "--map-root-user", "--pid",         "--fork",
      "--mount-proc", "--kill-child", "/proc/self/exe",  "--pid1-helper", workspace_};
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  ASSERT_GT(n, 0);
  args[7] = std::string(self, static_cast<size_t>(n));
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = g_reaper->Spawn(
      [&]() -> pid_t {
        pid_t child = -1;
        return posix_spawnp(&child, "unshare", nullptr, nullptr, argv.data(), environ) == 0 ? child
                                                                                            : -1;
      },
      -1);
  ASSERT_GT(pid, 0);
  int status = 0;
  ASSERT_TRUE(g_reaper->Wait(pid, &status, 60000)) << "helper hung";
  ASSERT_TRUE(WIFEXITED(status)) << "helper died of signal " << WTERMSIG(status);
  if (WEXITSTATUS(status) == 1) {
    // unshare itself failed (exit 1) before the helper ran.
    GTEST_SKIP() << "cannot create user+PID namespaces here (unshare -U -r -p -f failed); "
                    "PID 1 behaviour not tested";
  }
  EXPECT_EQ(WEXITSTATUS(status), 0) << "see the helper's message above";
}

}  // namespace
}  // namespace esb::agent

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--pid1-helper") {
    return esb::agent::Pid1Helper(argv[2]);
  }
  ::testing::InitGoogleTest(&argc, argv);
  // As the agent: orphans come back to this process, SIGPIPE is ignored, one Reaper reaps.
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  signal(SIGPIPE, SIG_IGN);
  esb::agent::g_reaper = new esb::agent::Reaper();  // its thread lives as long as the process
  esb::agent::g_reaper->Start();
  return RUN_ALL_TESTS();
}

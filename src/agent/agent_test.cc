// esb-agent over the raw framed protocol: the binary is started as a child process on a
// temporary socket (src/agent/test_agent_process.h). The friendlier API-level tests live in
// src/drivers/agent_client_test.cc.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>

#include <atomic>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "agent/reaper.h"
#include "agent/test_agent_process.h"
#include "agent/util.h"
#include "common/protocol.h"

namespace esb::agent {
namespace {

namespace json = boost::json;
using ::esb::testing::AgentProcess;
using ::esb::testing::ProcessGone;

// One connection, hello already read.
class Conn {
 public:
  explicit Conn(const AgentProcess& agent) : Conn(agent.Connect()) {}
  // Takes over a connected socket.
  explicit Conn(int fd) : fd_(fd) {
    if (fd_ >= 0) {
      std::string error;
      ok_ = proto::ReadFrame(fd_, &hello_, &error, proto::MonotonicMs() + 5000);
    }
  }
  ~Conn() {
    if (fd_ >= 0) close(fd_);
  }
  bool ok() const { return ok_; }
  int fd() const { return fd_; }
  const proto::Frame& hello() const { return hello_; }
  void Close() {
    close(fd_);
    fd_ = -1;
  }

  // Sends a REQUEST on a new stream (returned in *stream when asked).
  bool Send(json::object header, std::string payload = "", uint32_t* stream = nullptr) {
    proto::Frame f;
    f.type = proto::FrameType::kRequest;
    f.stream = next_stream_++;
    f.header = std::move(header);
    f.payload = std::move(payload);
    if (stream) *stream = f.stream;
    return Write(f);
  }

  bool Write(const proto::Frame& f) {
    std::string error;
    return proto::WriteFrame(fd_, f, &error);
  }

  // Sends a control frame (CANCEL, WINDOW, INPUT) on `stream`.
  bool Control(proto::FrameType type, uint32_t stream, json::object header = {},
               std::string payload = "") {
    proto::Frame f;
    f.type = type;
    f.stream = stream;
    f.header = std::move(header);
    f.payload = std::move(payload);
    return Write(f);
  }

  // Reads up to and including the RESPONSE; OUTPUT frames are appended to *outputs (and their
  // credit granted back, as esbd does).
  proto::Frame Response(std::vector<proto::Frame>* outputs = nullptr, int timeout_ms = 10000) {
    for (;;) {
      proto::Frame f;
      std::string error;
      if (!proto::ReadFrame(fd_, &f, &error, proto::MonotonicMs() + timeout_ms)) {
        ADD_FAILURE() << "no response: " << error;
        return f;
      }
      if (f.type == proto::FrameType::kResponse) return f;
      if (f.type == proto::FrameType::kOutput && !f.payload.empty()) {
        Control(proto::FrameType::kWindow, f.stream, {{"bytes", f.payload.size()}});
      }
      if (outputs) outputs->push_back(std::move(f));
    }
  }

  proto::Frame Call(json::object header, std::string payload = "") {
    EXPECT_TRUE(Send(std::move(header), std::move(payload)));
    return Response();
  }

  // True if the agent closed the connection within the timeout.
  bool ClosedByPeer(int timeout_ms = 3000) {
    proto::Frame f;
    std::string error;
    bool got = proto::ReadFrame(fd_, &f, &error, proto::MonotonicMs() + timeout_ms);
    return !got && error != "timed out";
  }

  bool RawWrite(std::string_view bytes) {
    return write(fd_, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size());
  }

 private:
  int fd_ = -1;
  bool ok_ = false;
  proto::Frame hello_;
  uint32_t next_stream_ = 1;
};

bool Ok(const proto::Frame& f) {
  const json::value* v = f.header.if_contains("ok");
  return v && v->is_bool() && v->as_bool();
}

std::string Errno(const proto::Frame& f) {
  const json::value* v = f.header.if_contains("errno");
  return v && v->is_string() ? std::string(v->as_string()) : "";
}

std::string ReadHostFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class AgentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_GT(agent_.pid(), 0) << "could not start " << ESB_AGENT_BINARY;
    ASSERT_TRUE(agent_.WaitReady()) << "agent did not listen on " << agent_.socket_path();
  }
  bool Alive() {
    Conn c(agent_);
    return c.ok() && Ok(c.Call({{"op", "ping"}}));
  }
  AgentProcess agent_;
};

// gVisor's checkpoint cannot save the agent's host-bound socket nor a host connection: on
// release_listener the agent gives both up, marks it next to its socket, and listens again
// only on SIGUSR1 (from outside the sandbox when it is PID 1).
TEST(AgentReleaseTest, ReleaseClosesListenerAndConnectionsAndSigusr1ListensAgain) {
  AgentProcess agent({}, "", ESB_AGENT_BINARY, {"--host-uds-peers"});
  ASSERT_GT(agent.pid(), 0);
  ASSERT_TRUE(agent.WaitReady());
  const std::string marker = agent.dir() + "/run/released";
  Conn other(agent);  // a second host connection: it must be closed too
  ASSERT_TRUE(other.ok());
  Conn c(agent);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(Ok(c.Call({{"op", "release_listener"}})));
  for (int i = 0; i < 500 && !std::filesystem::exists(marker); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(std::filesystem::exists(marker));
  EXPECT_FALSE(std::filesystem::exists(agent.socket_path()));
  EXPECT_TRUE(other.ClosedByPeer());
  EXPECT_TRUE(c.ClosedByPeer());
  EXPECT_LT(agent.Connect(), 0);
  ASSERT_EQ(kill(agent.pid(), SIGUSR1), 0);
  ASSERT_TRUE(agent.WaitReady());
  Conn again(agent);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(Ok(again.Call({{"op", "ping"}})));
  EXPECT_FALSE(std::filesystem::exists(marker));
  // A second release works the same way.
  ASSERT_TRUE(Ok(again.Call({{"op", "release_listener"}})));
  EXPECT_TRUE(again.ClosedByPeer());
  ASSERT_EQ(kill(agent.pid(), SIGUSR1), 0);
  ASSERT_TRUE(agent.WaitReady());
}

// Only the gVisor layout's own socket can be released (not an inherited listener, nor here).
TEST_F(AgentTest, ReleaseListenerIsRefusedWithoutHostUdsPeers) {
  Conn c(agent_);
  proto::Frame r = c.Call({{"op", "release_listener"}});
  EXPECT_FALSE(Ok(r));
  EXPECT_EQ(Errno(r), "EINVAL");
  EXPECT_TRUE(Alive());
}

TEST_F(AgentTest, SaysHelloAndAnswersPing) {
  Conn c(agent_);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c.hello().type, proto::FrameType::kHello);
  EXPECT_EQ(c.hello().header.at("agent").as_string(), "esb-agent");
  EXPECT_EQ(c.hello().header.at("version").as_int64(), proto::kVersion);
  EXPECT_EQ(c.hello().header.at("pid").as_int64(), agent_.pid());
  EXPECT_EQ(c.hello().stream, 0u);
  std::set<std::string> ops;
  for (const json::value& op : c.hello().header.at("ops").as_array()) {
    ops.insert(std::string(op.as_string()));
  }
  for (const char* op : {"ping", "exec", "write", "read", "list", "stat", "stats", "configure"}) {
    EXPECT_TRUE(ops.count(op)) << op;
  }
  // Several requests on one connection.
  EXPECT_TRUE(Ok(c.Call({{"op", "ping"}})));
  EXPECT_TRUE(Ok(c.Call({{"op", "ping"}})));
  std::vector<proto::Frame> outputs;
  ASSERT_TRUE(c.Send({{"op", "exec"}, {"command", "echo hi"}}));
  proto::Frame r = c.Response(&outputs);
  EXPECT_TRUE(Ok(r));
  EXPECT_EQ(r.header.at("exit_code").as_int64(), 0);
  ASSERT_EQ(outputs.size(), 1u);
  EXPECT_EQ(outputs[0].header.at("stream").as_string(), "stdout");
  EXPECT_EQ(outputs[0].payload, "hi\n");
}

TEST_F(AgentTest, MalformedFramesCloseOnlyThatConnection) {
  auto u32 = [](uint32_t v) {
    std::string s(4, '\0');
    for (int i = 0; i < 4; ++i) s[i] = static_cast<char>(v >> (24 - 8 * i));
    return s;
  };
  // magic, type, stream 1, header length, header
  auto frame = [&](char type, const std::string& header, uint32_t stream = 1) {
    return u32(static_cast<uint32_t>(10 + header.size())) + "\xE5" + type + u32(stream) +
           u32(static_cast<uint32_t>(header.size())) + header;
  };
  const std::vector<std::string> garbage = {
      u32(0xffffffff) + "xxxxxxxxxxxxxx",  // absurd length
      u32(proto::kMaxFrameBytes + 1),      // just over the limit
      frame('\x09', "{}"),                 // unknown type
      frame('\x02', "{no}"),               // bad JSON
      frame('\x02', "[]"),                 // header is not an object
      frame('\x01', "{}", 0),              // HELLO from the client
      frame('\x03', "{}"),                 // OUTPUT from the client
      frame('\x04', "{}"),                 // RESPONSE from the client
      frame('\x02', "{}", 0),              // REQUEST on stream 0
      u32(7) + "\x02" + u32(2) + "{}",     // a v1 frame
      u32(2) + "ab",                       // shorter than the fixed part
      std::string("GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
  };
  for (const std::string& g : garbage) {
    Conn c(agent_);
    ASSERT_TRUE(c.ok());
    ASSERT_TRUE(c.RawWrite(g));
    EXPECT_TRUE(c.ClosedByPeer()) << "agent kept a connection after garbage";
    EXPECT_TRUE(Alive()) << "agent died after garbage";
  }
  // A connection that sends half a frame and vanishes does not hurt either.
  {
    Conn c(agent_);
    ASSERT_TRUE(c.RawWrite(u32(100) + "\xE5\x02"));
  }
  EXPECT_TRUE(Alive());
  EXPECT_EQ(waitpid(agent_.pid(), nullptr, WNOHANG), 0);
}

TEST_F(AgentTest, BadRequestsGetErrnoErrors) {
  Conn c(agent_);
  ASSERT_TRUE(c.ok());
  // An op this agent does not serve: ENOSYS (esbd tells an older agent from a bad request).
  proto::Frame r = c.Call({{"op", "no-such-op"}});
  EXPECT_FALSE(Ok(r));
  EXPECT_EQ(Errno(r), "ENOSYS");
  EXPECT_FALSE(r.header.at("error").as_string().empty());
  EXPECT_EQ(Errno(c.Call({{"noop", 1}})), "EINVAL");
  EXPECT_EQ(Errno(c.Call({{"op", "exec"}})), "EINVAL");  // no command
  EXPECT_EQ(Errno(c.Call({{"op", "exec"}, {"command", "true"}, {"timeout_ms", "soon"}})), "EINVAL");
  EXPECT_EQ(Errno(c.Call({{"op", "exec"}, {"command", "true"}, {"env", {{"A", 1}}}})), "EINVAL");
  EXPECT_EQ(Errno(c.Call({{"op", "read"}})), "EINVAL");  // no path
  EXPECT_EQ(Errno(c.Call({{"op", "read"}, {"path", "x"}, {"length", int64_t{1} << 30}})), "EINVAL");
  EXPECT_EQ(Errno(c.Call({{"op", "read"}, {"path", "x"}, {"offset", -1}})), "EINVAL");
  EXPECT_EQ(Errno(c.Call({{"op", "write"}, {"path", ""}})), "EINVAL");
  EXPECT_EQ(Errno(c.Call({{"op", "configure"}, {"env", "nope"}})), "EINVAL");
  // The connection is still usable after error responses.
  EXPECT_TRUE(Ok(c.Call({{"op", "ping"}})));
}

TEST_F(AgentTest, WriteOptions) {
  Conn c(agent_);
  ASSERT_TRUE(c.ok());
  proto::Frame r = c.Call({{"op", "write"}, {"path", "a/b/c.txt"}, {"mode", 0600}}, "hello");
  ASSERT_TRUE(Ok(r)) << json::serialize(r.header);
  EXPECT_EQ(r.header.at("size").as_int64(), 5);
  struct stat st;
  ASSERT_EQ(stat((agent_.workspace() + "/a/b/c.txt").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);

  r = c.Call({{"op", "write"}, {"path", "a/b/c.txt"}, {"offset", 10}}, "X");
  ASSERT_TRUE(Ok(r));
  EXPECT_EQ(r.header.at("size").as_int64(), 11);
  EXPECT_EQ(ReadHostFile(agent_.workspace() + "/a/b/c.txt"), std::string("hello\0\0\0\0\0X", 11));

  r = c.Call({{"op", "write"}, {"path", "big"}, {"max_bytes", 4}}, "12345");
  EXPECT_EQ(Errno(r), "EFBIG");
  r = c.Call({{"op", "write"}, {"path", "big"}, {"max_bytes", 5}}, "12345");
  EXPECT_TRUE(Ok(r));
  r = c.Call({{"op", "write"}, {"path", "big"}, {"offset", 3}, {"max_bytes", 5}}, "123");
  EXPECT_EQ(Errno(r), "EFBIG");
  r = c.Call({{"op", "write"}, {"path", "a"}}, "x");  // a directory
  EXPECT_EQ(Errno(r), "EISDIR");
  r = c.Call({{"op", "write"}, {"path", "big/sub"}}, "x");  // parent is a file
  EXPECT_EQ(Errno(r), "ENOTDIR");
}

// Collects an exec's stdout.
std::string ExecStdout(Conn& c, const std::string& command, int64_t timeout_ms,
                       proto::Frame* response = nullptr) {
  EXPECT_TRUE(c.Send({{"op", "exec"}, {"command", command}, {"timeout_ms", timeout_ms}}));
  std::vector<proto::Frame> outputs;
  proto::Frame r = c.Response(&outputs, static_cast<int>(timeout_ms) + 10000);
  if (response) *response = r;
  std::string out;
  for (const auto& f : outputs) {
    if (f.header.at("stream").as_string() == "stdout") out += f.payload;
  }
  return out;
}

// `setsid` and double-fork escapees of a command that times out used to outlive it (they left
// the process group the timeout kills) and died only with the environment.
TEST_F(AgentTest, TimeoutKillsSetsidAndDoubleForkEscapees) {
  Conn c(agent_);
  ASSERT_TRUE(c.ok());
  // A background job of a command that completes normally keeps running (servers).
  std::string kept = ExecStdout(c, "nohup sleep 1000 >/dev/null 2>&1 & echo $!", 10000);
  pid_t server = std::atoi(kept.c_str());
  ASSERT_GT(server, 1) << kept;
  proto::Frame r;
  std::string pids = ExecStdout(c,
                                "setsid sleep 1000 >/dev/null 2>&1 & echo $!; "
                                "( sleep 1001 >/dev/null 2>&1 & echo $! ); "
                                "( setsid bash -c 'sleep 1002 & echo $!' & ) ; sleep 0.3; "
                                "sleep 100",
                                1000, &r);
  EXPECT_TRUE(r.header.at("timed_out").as_bool());
  std::vector<pid_t> escapees;
  std::istringstream in(pids);
  for (pid_t p; in >> p;) escapees.push_back(p);
  ASSERT_EQ(escapees.size(), 3u) << pids;
  for (pid_t p : escapees) EXPECT_TRUE(ProcessGone(p, 3000)) << "pid " << p << " survived";
  // A later exec sees them gone too, and the normally completed job is still alive.
  std::string check =
      ExecStdout(c,
                 "for p in " + std::to_string(escapees[0]) + " " + std::to_string(escapees[1]) +
                     " " + std::to_string(escapees[2]) + " " + std::to_string(server) +
                     "; do kill -0 $p 2>/dev/null && echo alive $p; done; :",
                 10000);
  EXPECT_EQ(check, "alive " + std::to_string(server) + "\n");
  kill(server, SIGKILL);
}

TEST_F(AgentTest, ClientDisconnectMidExecKillsTheProcessGroup) {
  Conn c(agent_);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(c.Send({{"op", "exec"},
                      {"command",
                       "sleep 100 & echo $! > bg.pid; echo $$ > sh.pid; echo go; "
                       "sleep 100"},
                      {"timeout_ms", 60000}}));
  proto::Frame out;
  std::string error;
  ASSERT_TRUE(proto::ReadFrame(c.fd(), &out, &error, proto::MonotonicMs() + 5000)) << error;
  EXPECT_EQ(out.payload, "go\n");
  c.Close();
  pid_t sh = std::stoi(ReadHostFile(agent_.workspace() + "/sh.pid"));
  pid_t bg = std::stoi(ReadHostFile(agent_.workspace() + "/bg.pid"));
  EXPECT_TRUE(ProcessGone(sh, 3000));
  EXPECT_TRUE(ProcessGone(bg, 3000));
  EXPECT_TRUE(Alive());
}

// A timeout or a cancel used to SIGKILL the shell's children first and the shell itself only
// a round later: in between, bash saw its `sleep` die and ran the next command. The shell's
// next command here is a builtin (no fork), so it needs microseconds; the kill must freeze
// the shell before it kills the command it waits for.
TEST_F(AgentTest, TimeoutAndCancelNeverLetTheShellRunItsNextCommand) {
  constexpr int kRounds = 8;
  for (int i = 0; i < kRounds; ++i) {
    Conn c(agent_);
    ASSERT_TRUE(c.ok());
    proto::Frame r;
    ExecStdout(c, "sleep 30.25; echo ran > timeout_marker_" + std::to_string(i), 150, &r);
    EXPECT_TRUE(r.header.at("timed_out").as_bool());
  }
  for (int i = 0; i < kRounds; ++i) {
    Conn c(agent_);
    ASSERT_TRUE(c.ok());
    std::string sh_pid = "cancel_sh_" + std::to_string(i);
    ASSERT_TRUE(c.Send({{"op", "exec"},
                        {"command", "echo $$ > " + sh_pid + "; echo go; sleep 30.25; echo ran > " +
                                        "cancel_marker_" + std::to_string(i)},
                        {"timeout_ms", 60000}}));
    proto::Frame out;
    std::string error;
    ASSERT_TRUE(proto::ReadFrame(c.fd(), &out, &error, proto::MonotonicMs() + 5000)) << error;
    ASSERT_EQ(out.payload, "go\n");
    c.Close();
    pid_t sh = std::stoi(ReadHostFile(agent_.workspace() + "/" + sh_pid));
    EXPECT_TRUE(ProcessGone(sh, 3000));
  }
  // No marker, and no process of these commands is left (stopped or not).
  Conn c(agent_);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(ExecStdout(c, "ls | grep marker; pgrep -fc 'sleep 30[.]25'; :", 10000), "0\n");
}

TEST_F(AgentTest, ReapsOrphansWithoutLeavingZombies) {
  Conn c(agent_);
  ASSERT_TRUE(c.ok());
  // Double forks: the subshells exit at once, their sleeps are reparented to the agent.
  proto::Frame r =
      c.Call({{"op", "exec"}, {"command", "for i in 1 2 3 4 5; do (sleep 0.1 &); done; true"}});
  ASSERT_TRUE(Ok(r));
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  int zombies = 0;
  DIR* proc = opendir("/proc");
  ASSERT_NE(proc, nullptr);
  while (dirent* e = readdir(proc)) {
    std::string stat = ReadHostFile(std::string("/proc/") + e->d_name + "/stat");
    size_t paren = stat.rfind(')');
    if (paren == std::string::npos) continue;
    char state = 0;
    int ppid = 0;
    if (sscanf(stat.c_str() + paren + 1, " %c %d", &state, &ppid) == 2 && ppid == agent_.pid() &&
        state == 'Z') {
      ++zombies;
    }
  }
  closedir(proc);
  EXPECT_EQ(zombies, 0);
  // Exit statuses still reach their waiters after the orphans were reaped.
  r = c.Call({{"op", "exec"}, {"command", "exit 42"}});
  EXPECT_EQ(r.header.at("exit_code").as_int64(), 42);
}

TEST_F(AgentTest, StatsReportProcessesWorkspaceAndUptime) {
  Conn c(agent_);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(Ok(c.Call({{"op", "write"}, {"path", "blob"}}, std::string(1 << 20, 'x'))));
  proto::Frame r = c.Call({{"op", "stats"}});
  ASSERT_TRUE(Ok(r));
  int64_t idle = r.header.at("processes").as_int64();
  EXPECT_GE(idle, 1);  // at least the agent
  EXPECT_GE(r.header.at("workspace_bytes").as_int64(), 1 << 20);
  EXPECT_GT(r.header.at("uptime_ms").as_int64(), 0);

  ASSERT_TRUE(Ok(c.Call({{"op", "exec"}, {"command", "sleep 5 & sleep 5 & true"}})));
  r = c.Call({{"op", "stats"}});
  EXPECT_GE(r.header.at("processes").as_int64(), idle + 2);
}

TEST_F(AgentTest, SigtermKillsSessionsAndExitsZero) {
  Conn c(agent_);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(Ok(c.Call({{"op", "exec"}, {"command", "sleep 100 & echo $! > bg.pid"}})));
  pid_t bg = std::stoi(ReadHostFile(agent_.workspace() + "/bg.pid"));
  ASSERT_EQ(kill(bg, 0), 0);
  ASSERT_EQ(kill(agent_.pid(), SIGTERM), 0);
  int status = agent_.Wait(5000);
  ASSERT_NE(status, -1) << "agent did not exit on SIGTERM";
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  // The sleep was reparented to init when the agent exited; it must have been killed first.
  EXPECT_TRUE(ProcessGone(bg, 3000));
}

TEST(AgentRestartTest, StateFileLetsARestartedAgentResumeTheSession) {
  char tmpl[] = "/tmp/esb-agent-restart-XXXXXX";
  std::string dir = mkdtemp(tmpl);
  {
    AgentProcess first({}, dir);
    ASSERT_TRUE(first.WaitReady());
    Conn c(first);
    ASSERT_TRUE(c.ok());
    ASSERT_TRUE(Ok(
        c.Call({{"op", "exec"}, {"command", "mkdir -p sub && cd sub && export KEPT=$'x\\ny'"}})));
    // Written after the response: wait for it.
    for (int i = 0; i < 200; ++i) {
      if (ReadHostFile(dir + "/state/shell.state").find("KEPT") != std::string::npos) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_NE(ReadHostFile(dir + "/state/shell.state").find("KEPT"), std::string::npos);
  }
  {
    AgentProcess second({}, dir);
    ASSERT_TRUE(second.WaitReady());
    Conn c(second);
    ASSERT_TRUE(c.ok());
    std::vector<proto::Frame> outputs;
    ASSERT_TRUE(c.Send({{"op", "exec"}, {"command", "pwd; printf '%s' \"$KEPT\""}}));
    ASSERT_TRUE(Ok(c.Response(&outputs)));
    std::string out;
    for (const auto& f : outputs) out += f.payload;
    EXPECT_EQ(out, dir + "/workspace/sub\nx\ny");
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

// Protocol v2: one connection carries many calls at once; answers come back by stream id, in
// whatever order they finish.
TEST_F(AgentTest, HundredInterleavedCallsOnOneConnection) {
  Conn c(agent_);
  ASSERT_TRUE(c.ok());
  std::map<uint32_t, std::string> expect;  // stream → what its answer must carry
  uint32_t slow = 0;
  ASSERT_TRUE(c.Send({{"op", "exec"}, {"command", "sleep 0.3; echo slow"}}, "", &slow));
  std::string slow_out;
  size_t answered_before_slow = 0;
  bool slow_done = false;
  // Reads one frame and checks it against what its stream expects.
  auto read_one = [&]() {
    proto::Frame f;
    std::string error;
    ASSERT_TRUE(proto::ReadFrame(c.fd(), &f, &error, proto::MonotonicMs() + 10000)) << error;
    if (f.stream == slow) {
      if (f.type == proto::FrameType::kOutput) slow_out += f.payload;
      if (f.type == proto::FrameType::kResponse) slow_done = true;
      return;
    }
    ASSERT_EQ(f.type, proto::FrameType::kResponse);
    auto it = expect.find(f.stream);
    ASSERT_NE(it, expect.end()) << "answer on an unknown or finished stream " << f.stream;
    ASSERT_TRUE(Ok(f)) << json::serialize(f.header);
    if (!it->second.empty()) EXPECT_EQ(f.header.at("type").as_string(), it->second);
    expect.erase(it);
    if (!slow_done) ++answered_before_slow;
  };
  // 100 calls, up to 48 in flight at once (the agent answers EBUSY past its cap of 64).
  const int64_t cap = c.hello().header.at("max_calls").as_int64();
  ASSERT_GT(cap, 48);
  for (int i = 0; i < 100; ++i) {
    while (expect.size() >= 48) {
      ASSERT_NO_FATAL_FAILURE(read_one());
    }
    uint32_t s = 0;
    std::string name = "m" + std::to_string(i);
    switch (i % 3) {
      case 0:
        ASSERT_TRUE(c.Send({{"op", "ping"}}, "", &s));
        expect[s] = "";
        break;
      case 1:
        ASSERT_TRUE(c.Send({{"op", "write"}, {"path", name}}, name, &s));
        expect[s] = "";
        break;
      default:
        ASSERT_TRUE(c.Send({{"op", "stat"}, {"path", "."}}, "", &s));
        expect[s] = "dir";
    }
  }
  while (!expect.empty() || !slow_done) {
    ASSERT_NO_FATAL_FAILURE(read_one());
  }
  // Everything but the slow exec answered before it (none waited behind it).
  EXPECT_EQ(answered_before_slow, 100u);
  EXPECT_EQ(slow_out, "slow\n");
  EXPECT_EQ(ReadHostFile(agent_.workspace() + "/m97"), "m97");
}

// CANCEL ends one exec (its process tree is killed, as a disconnect did in v1) and answers
// ECANCELED; the connection and the other calls on it go on.
TEST_F(AgentTest, CancelEndsOneExecAndTheConnectionStaysUp) {
  Conn c(agent_);
  ASSERT_TRUE(c.ok());
  uint32_t s = 0;
  ASSERT_TRUE(c.Send({{"op", "exec"},
                      {"command",
                       "sleep 100 & echo $! > bg.pid; echo $$ > sh.pid; echo go; "
                       "sleep 100; touch ran"},
                      {"timeout_ms", 60000}},
                     "", &s));
  proto::Frame out;
  std::string error;
  ASSERT_TRUE(proto::ReadFrame(c.fd(), &out, &error, proto::MonotonicMs() + 5000)) << error;
  ASSERT_EQ(out.payload, "go\n");
  ASSERT_TRUE(c.Control(proto::FrameType::kCancel, s));
  proto::Frame r = c.Response(nullptr, 5000);
  EXPECT_EQ(r.stream, s);
  EXPECT_EQ(Errno(r), "ECANCELED");
  pid_t sh = std::stoi(ReadHostFile(agent_.workspace() + "/sh.pid"));
  pid_t bg = std::stoi(ReadHostFile(agent_.workspace() + "/bg.pid"));
  EXPECT_TRUE(ProcessGone(sh, 3000));
  EXPECT_TRUE(ProcessGone(bg, 3000));
  // Same connection: still serving, and the cancelled command's next step never ran.
  EXPECT_TRUE(Ok(c.Call({{"op", "ping"}})));
  EXPECT_EQ(ExecStdout(c, "ls ran 2>/dev/null; echo done", 10000), "done\n");
  // A CANCEL for a call that already answered is harmless.
  ASSERT_TRUE(c.Control(proto::FrameType::kCancel, s));
  EXPECT_TRUE(Ok(c.Call({{"op", "ping"}})));
}

TEST_F(AgentTest, ExecReadsStdinFromInputFrames) {
  Conn c(agent_);
  ASSERT_TRUE(c.ok());
  uint32_t s = 0;
  ASSERT_TRUE(
      c.Send({{"op", "exec"}, {"command", "wc -c; cat >/dev/null"}, {"stdin", true}}, "", &s));
  std::string data(600 * 1024, 'i');  // more than one window: the agent must grant credit
  size_t sent = 0;
  int64_t credit = proto::kInitialWindow;
  while (sent < data.size()) {
    size_t n = std::min<size_t>({proto::kMaxChunkBytes, data.size() - sent,
                                 static_cast<size_t>(std::max<int64_t>(credit, 0))});
    if (n == 0) {
      proto::Frame w;
      std::string error;
      ASSERT_TRUE(proto::ReadFrame(c.fd(), &w, &error, proto::MonotonicMs() + 5000)) << error;
      ASSERT_EQ(w.type, proto::FrameType::kWindow);
      credit += w.header.at("bytes").to_number<int64_t>();
      continue;
    }
    ASSERT_TRUE(c.Control(proto::FrameType::kInput, s, {}, data.substr(sent, n)));
    sent += n;
    credit -= static_cast<int64_t>(n);
  }
  ASSERT_TRUE(c.Control(proto::FrameType::kInput, s, {{"eof", true}}));
  std::vector<proto::Frame> outputs;  // WINDOW frames may still come before the answer
  proto::Frame r = c.Response(&outputs);
  std::string out;
  for (const auto& f : outputs) {
    if (f.type == proto::FrameType::kOutput) out += f.payload;
  }
  EXPECT_TRUE(Ok(r));
  EXPECT_EQ(out, std::to_string(data.size()) + "\n");
  // Without stdin an exec reads EOF at once (as /dev/null did).
  EXPECT_EQ(ExecStdout(c, "cat; echo end", 5000), "end\n");
}

// A host (or whatever answers on its socket) that sends stdin past the window it was granted
// breaks the protocol: the connection is closed and its calls are cancelled.
TEST_F(AgentTest, InputPastTheWindowClosesTheConnection) {
  Conn c(agent_);
  ASSERT_TRUE(c.ok());
  uint32_t first = 0, queued = 0;
  ASSERT_TRUE(
      c.Send({{"op", "exec"}, {"command", "echo $$ > first.pid; echo go; sleep 100"}}, "", &first));
  proto::Frame out;
  std::string error;
  ASSERT_TRUE(proto::ReadFrame(c.fd(), &out, &error, proto::MonotonicMs() + 5000)) << error;
  // Queued behind the first exec, this one takes no stdin yet, so it grants no credit.
  ASSERT_TRUE(c.Send({{"op", "exec"}, {"command", "cat"}, {"stdin", true}}, "", &queued));
  std::string chunk(proto::kMaxChunkBytes, 'x');
  for (uint32_t sent = 0; sent <= proto::kInitialWindow; sent += proto::kMaxChunkBytes) {
    c.Control(proto::FrameType::kInput, queued, {}, chunk);
  }
  EXPECT_TRUE(c.ClosedByPeer());
  pid_t sh = std::stoi(ReadHostFile(agent_.workspace() + "/first.pid"));
  EXPECT_TRUE(ProcessGone(sh, 3000)) << "the closed connection's exec kept running";
  EXPECT_TRUE(Alive());
}

// Calls beyond the agent's cap are answered "busy" at once; the others are not disturbed.
TEST_F(AgentTest, CallsOverTheCapAreAnsweredBusy) {
  Conn c(agent_);
  ASSERT_TRUE(c.ok());
  const int64_t cap = c.hello().header.at("max_calls").as_int64();
  std::vector<uint32_t> streams;
  for (int64_t i = 0; i < cap + 5; ++i) {
    uint32_t s = 0;
    // Execs are serialised: the first sleeps, the rest hold their threads while queued.
    ASSERT_TRUE(c.Send({{"op", "exec"}, {"command", "sleep 30"}}, "", &s));
    streams.push_back(s);
  }
  int busy = 0;
  int64_t start = proto::MonotonicMs();
  while (busy < 5) {
    proto::Frame f;
    std::string error;
    ASSERT_TRUE(proto::ReadFrame(c.fd(), &f, &error, proto::MonotonicMs() + 5000)) << error;
    ASSERT_EQ(f.type, proto::FrameType::kResponse);
    EXPECT_EQ(Errno(f), "EBUSY");
    EXPECT_NE(f.header.at("error").as_string().find("busy"), std::string::npos);
    ++busy;
  }
  EXPECT_LT(proto::MonotonicMs() - start, 2000);
  for (uint32_t s : streams) c.Control(proto::FrameType::kCancel, s);
  int cancelled = 0;
  while (cancelled < cap) {
    proto::Frame f;
    std::string error;
    ASSERT_TRUE(proto::ReadFrame(c.fd(), &f, &error, proto::MonotonicMs() + 10000)) << error;
    if (f.type == proto::FrameType::kResponse) ++cancelled;
  }
  EXPECT_TRUE(Ok(c.Call({{"op", "ping"}})));
}

// Attack F11 (REVIEW-issue14.md): hosted MCP servers flooded their stdout while esbd's stdio
// client took it with 1-second `wait`s. A wait kept sending past its deadline, and an OUTPUT
// frame that met a full socket then gave its write up mid-frame: the agent's channel shut down
// for writing while its reader went on serving, so every later call on the connection ran and
// had its answer dropped (esbd saw no EOF; every call timed out, for ever). Here the host stops
// reading for a moment (as a busy esbd does) while a flooding process's short wait sends.
TEST_F(AgentTest, FloodedWaitWhileTheHostLagsDoesNotSilenceTheConnection) {
  Conn c(agent_);
  ASSERT_TRUE(c.ok());
  proto::Frame spawned =
      c.Call({{"op", "spawn"}, {"argv", json::array{"yes", std::string(500, 'F')}}});
  ASSERT_TRUE(Ok(spawned)) << json::serialize(spawned.header);
  const std::string id(spawned.header.at("id").as_string());
  uint32_t wait = 0;
  for (int round = 0; round < 3; ++round) {
    ASSERT_TRUE(c.Send({{"op", "wait"}, {"id", id}, {"timeout_ms", 200}}, "", &wait));
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));  // nothing read meanwhile
    uint32_t ping = 0;
    ASSERT_TRUE(c.Send({{"op", "ping"}}, "", &ping));
    bool wait_answered = false, ping_answered = false;
    const int64_t deadline = proto::MonotonicMs() + 5000;
    while (!wait_answered || !ping_answered) {
      proto::Frame f;
      std::string error;
      ASSERT_TRUE(proto::ReadFrame(c.fd(), &f, &error, deadline))
          << "round " << round << ": the agent stopped answering on this connection: " << error;
      if (f.type == proto::FrameType::kOutput) {
        ASSERT_EQ(f.stream, wait);
        c.Control(proto::FrameType::kWindow, f.stream, {{"bytes", f.payload.size()}});
      } else if (f.type == proto::FrameType::kResponse && f.stream == wait) {
        wait_answered = true;
        EXPECT_TRUE(Ok(f)) << json::serialize(f.header);
        EXPECT_FALSE(f.header.at("exited").as_bool());
      } else if (f.type == proto::FrameType::kResponse && f.stream == ping) {
        ping_answered = true;
        EXPECT_TRUE(Ok(f));
      }
    }
  }
  // An ordinary exec on the same connection still answers at once.
  int64_t start = proto::MonotonicMs();
  EXPECT_EQ(ExecStdout(c, "echo alive", 5000), "alive\n");
  EXPECT_LT(proto::MonotonicMs() - start, 5000);
  EXPECT_TRUE(Ok(c.Call({{"op", "kill"}, {"id", id}})));
}

// The agent keeps the output queues of at most 256 spawned processes. It used to forget the
// oldest first, running or not: a long-lived process (a terminal, a hosted server) outlived by
// 256 later spawns (a crash-looping hosted server restarts often) lost its output for good —
// `wait` then answered without it and the process blocked once its window was full.
TEST_F(AgentTest, ARunningProcessKeepsItsOutputAfterManyLaterSpawns) {
  Conn c(agent_);
  ASSERT_TRUE(c.ok());
  proto::Frame cat = c.Call({{"op", "spawn"}, {"argv", json::array{"cat"}}});
  ASSERT_TRUE(Ok(cat)) << json::serialize(cat.header);
  const std::string cat_id(cat.header.at("id").as_string());
  for (int i = 0; i < 260; ++i) {
    proto::Frame s = c.Call({{"op", "spawn"}, {"argv", json::array{"true"}}});
    ASSERT_TRUE(Ok(s)) << i << ": " << json::serialize(s.header);
    proto::Frame w = c.Call({{"op", "wait"}, {"id", s.header.at("id")}, {"timeout_ms", 5000}});
    ASSERT_TRUE(Ok(w) && w.header.at("exited").as_bool()) << i << ": " << json::serialize(w.header);
  }
  ASSERT_TRUE(Ok(c.Call({{"op", "input"}, {"id", cat_id}}, "still here\n")));
  std::string out;
  const int64_t deadline = proto::MonotonicMs() + 5000;
  while (out.find("still here\n") == std::string::npos && proto::MonotonicMs() < deadline) {
    EXPECT_TRUE(c.Send({{"op", "wait"}, {"id", cat_id}, {"timeout_ms", 200}}));
    std::vector<proto::Frame> outputs;
    proto::Frame r = c.Response(&outputs);
    ASSERT_TRUE(Ok(r)) << json::serialize(r.header);
    for (const auto& f : outputs) out += f.payload;
  }
  EXPECT_EQ(out, "still here\n");
  EXPECT_TRUE(Ok(c.Call({{"op", "kill"}, {"id", cat_id}})));
}

TEST_F(AgentTest, ManyConcurrentConnections) {
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 32; ++i) {
    threads.emplace_back([&, i] {
      Conn c(agent_);
      if (!c.ok()) return;
      std::string name = "f" + std::to_string(i);
      if (!Ok(c.Call({{"op", "write"}, {"path", name}}, name))) return;
      proto::Frame r = c.Call({{"op", "read"}, {"path", name}});
      if (Ok(r) && r.payload == name) ++ok;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 32);
}

// The production shape: the agent is PID 1 of its own PID namespace (a user namespace makes
// this work without root). Orphans must be reaped and SIGTERM must still stop it (PID 1 gets
// no default signal actions).
TEST(AgentPid1Test, RunsAsPid1InAPidNamespace) {
  AgentProcess agent(
      {"unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc", "--kill-child"});
  if (agent.pid() <= 0 || !agent.WaitReady(3000)) {
    GTEST_SKIP() << "cannot create user+PID namespaces here (unshare -U -r -p -f failed); "
                    "PID 1 behaviour not tested";
  }
  Conn c(agent);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c.hello().header.at("pid").as_int64(), 1);
  ASSERT_TRUE(
      Ok(c.Call({{"op", "exec"}, {"command", "for i in 1 2 3 4; do (sleep 0.1 &); done; true"}})));
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  std::vector<proto::Frame> outputs;
  ASSERT_TRUE(
      c.Send({{"op", "exec"}, {"command", "cat /proc/[0-9]*/stat | awk '$3 == \"Z\"' | wc -l"}}));
  proto::Frame r = c.Response(&outputs);
  ASSERT_TRUE(Ok(r));
  ASSERT_EQ(outputs.size(), 1u);
  EXPECT_EQ(outputs[0].payload, "0\n") << "zombies left in the namespace";
  r = c.Call({{"op", "exec"}, {"command", "exit 5"}});
  EXPECT_EQ(r.header.at("exit_code").as_int64(), 5);

  // SIGTERM to the agent (its host pid is unshare's only child).
  std::string children = ReadHostFile("/proc/" + std::to_string(agent.pid()) + "/task/" +
                                      std::to_string(agent.pid()) + "/children");
  ASSERT_FALSE(children.empty());
  pid_t host_pid = std::stoi(children);
  ASSERT_EQ(kill(host_pid, SIGTERM), 0);
  int status = agent.Wait(5000);
  ASSERT_NE(status, -1) << "agent (PID 1) ignored SIGTERM";
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace esb::agent

namespace esb::agent {
namespace {

// An abstract unix address unique to this test process.
sockaddr_un AbstractAddress(socklen_t* len) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::string name =
      "esb-agent-test-" + std::to_string(getpid()) + "-" + std::to_string(proto::MonotonicMs());
  memcpy(addr.sun_path + 1, name.data(), name.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return addr;
}

int ConnectTo(const sockaddr_un& addr, socklen_t len) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), len) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// The container driver's layout: the host binds the socket and hands the listening fd to the
// agent (fd 3); the agent's stderr is a host file until it is up. Sandbox code (any uid but 0)
// is refused, the host file is no longer held, and request paths cannot reach /proc.
TEST(AgentListenFdTest, ServesOnlyRootOnInheritedSocketAndDropsHostLog) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root (a second uid connects to the agent)";
  char tmpl[] = "/tmp/esb-agent-fd-XXXXXX";
  std::string dir = mkdtemp(tmpl);
  std::string host_log = dir + "/host.log";
  mkdir((dir + "/ws").c_str(), 0755);
  socklen_t len = 0;
  sockaddr_un addr = AbstractAddress(&len);
  int listener = socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), len), 0);
  ASSERT_EQ(listen(listener, 16), 0);
  int log_fd = open(host_log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
  ASSERT_GE(log_fd, 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, log_fd, 1);
  posix_spawn_file_actions_adddup2(&actions, log_fd, 2);
  posix_spawn_file_actions_adddup2(&actions, listener, 3);
  std::vector<std::string> args = {ESB_AGENT_BINARY, "--listen-fd", "3",
                                   "--workspace",    dir + "/ws",   "--state-dir",
                                   dir + "/state",   "--log-level", "info"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  ASSERT_EQ(posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&actions);
  close(listener);
  close(log_fd);

  // Root (esbd) is served.
  int fd = -1;
  for (int i = 0; i < 500 && fd < 0; ++i) {
    fd = ConnectTo(addr, len);
    if (fd < 0) usleep(10000);
  }
  Conn root(fd);
  ASSERT_TRUE(root.ok());
  EXPECT_TRUE(Ok(root.Call({{"op", "ping"}})));

  // Any other uid gets the connection closed before a single byte.
  pid_t child = fork();
  if (child == 0) {
    if (setresgid(65534, 65534, 65534) != 0 || setresuid(65534, 65534, 65534) != 0) _exit(3);
    int c = ConnectTo(addr, len);
    if (c < 0) _exit(4);
    pollfd p{c, POLLIN, 0};
    char byte;
    if (poll(&p, 1, 3000) != 1) _exit(5);
    _exit(read(c, &byte, 1) == 0 ? 0 : 1);  // 0: closed without HELLO
  }
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;

  // No descriptor of the agent refers to the host log any more.
  for (int n = 0; n < 3; ++n) {
    char target[256] = {};
    std::string link = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(n);
    ASSERT_GT(readlink(link.c_str(), target, sizeof target - 1), 0);
    EXPECT_STREQ(target, "/dev/null") << link;
  }
  const std::string before = ReadHostFile(host_log);

  // Request paths through /proc are refused; nothing reaches the host log.
  const std::string mib(1 << 20, 'x');
  for (const char* path : {"/proc/self/fd/2", "/proc/self/fd/1", "/proc/self/mem"}) {
    proto::Frame w = root.Call({{"op", "write"}, {"path", path}}, mib);
    EXPECT_FALSE(Ok(w)) << path;
  }
  proto::Frame r = root.Call({{"op", "read"}, {"path", "/proc/self/status"}});
  EXPECT_FALSE(Ok(r));
  EXPECT_EQ(Errno(r), "EACCES");
  EXPECT_EQ(Errno(root.Call({{"op", "read"}, {"path", "/proc/self/fd/2"}})), "ELOOP");
  EXPECT_FALSE(Ok(root.Call({{"op", "stat"}, {"path", "/proc/self/fd/2"}})));
  EXPECT_EQ(Errno(root.Call({{"op", "stat"}, {"path", "/proc/self"}})), "EACCES");
  EXPECT_EQ(Errno(root.Call({{"op", "list"}, {"path", "/proc/self/fd"}})), "EACCES");
  EXPECT_EQ(Errno(root.Call({{"op", "list"}, {"path", "/sys"}})), "EACCES");
  EXPECT_TRUE(Ok(root.Call({{"op", "write"}, {"path", "f"}}, "data")));
  EXPECT_TRUE(Ok(root.Call({{"op", "stat"}, {"path", "f"}})));
  EXPECT_EQ(ReadHostFile(host_log), before);
  // The refusal was logged inside (the sandbox's own, capped log).
  EXPECT_NE(ReadHostFile(dir + "/state/agent.log").find("refused connection from uid 65534"),
            std::string::npos);
  std::printf("[ host log ] %zu bytes, unchanged by the attacks\n", before.size());

  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

// The agent's log inside the sandbox is capped: one file plus one rotated generation.
// The state letter of /proc/<pid>/stat ('Z' for a zombie), 0 once the pid is gone.
char ProcState(pid_t pid) {
  std::string stat = ReadHostFile("/proc/" + std::to_string(pid) + "/stat");
  size_t paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() ? 0 : stat[paren + 2];
}

// A timeout or hang-up after the exec's shell was reaped used to signal its pid (and process
// group), which by then may belong to another process. Signals go through
// Reaper::WhileUnreaped, and the reaper may not free (reap) a pid while that runs: an exited
// child stays a zombie, its pid reserved, until the signaller is done.
TEST(ReaperTest, APidIsNotFreedWhileItsSignallerRuns) {
  // In a child process: the reaper collects every child of its process (waitid(P_ALL)).
  pid_t tester = fork();
  ASSERT_GE(tester, 0);
  if (tester == 0) {
    auto* reaper = new esb::agent::Reaper();  // its thread lives as long as this process
    reaper->Start();
    pid_t child = reaper->Spawn(
        [] {
          pid_t p = fork();
          if (p == 0) {
            pause();
            _exit(0);
          }
          return p;
        },
        -1);
    if (child <= 0) _exit(2);
    char during = 0;
    bool ran = reaper->WhileUnreaped(child, [&] {
      kill(child, SIGKILL);
      usleep(200000);  // the reaper thread sees the exit meanwhile, but must not reap it yet
      during = ProcState(child);
    });
    if (!ran) _exit(3);
    if (during != 'Z') _exit(4);
    int status = 0;
    if (!reaper->Wait(child, &status, 5000) || !WIFSIGNALED(status)) _exit(5);
    if (reaper->WhileUnreaped(child, [] { _exit(6); })) _exit(7);  // reaped: never runs
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(tester, &status, 0), tester);
  ASSERT_TRUE(WIFEXITED(status)) << "tester died of signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "2: spawn failed, 3: not run for a live child, 4: the pid was reaped while its "
         "signaller ran, 5: status lost, 6/7: run for a reaped pid";
}

TEST(AgentLogTest, RedirectedLogRotatesAtItsCap) {
  char tmpl[] = "/tmp/esb-agent-log-XXXXXX";
  std::string dir = mkdtemp(tmpl);
  std::string log = dir + "/agent.log";
  pid_t child = fork();
  if (child == 0) {  // RedirectLog replaces fds 0-2: not in the test process itself
    if (!RedirectLog(log, 4096)) _exit(2);
    for (int i = 0; i < 2000; ++i) Log(LogLevel::kWarn, "line " + std::to_string(i));
    _exit(0);
  }
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  struct stat st;
  ASSERT_EQ(stat(log.c_str(), &st), 0);
  EXPECT_LE(st.st_size, 4096);
  ASSERT_EQ(stat((log + ".1").c_str(), &st), 0);
  EXPECT_LE(st.st_size, 4096);
  EXPECT_NE(ReadHostFile(log).find("line 1999"), std::string::npos);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

}  // namespace
}  // namespace esb::agent

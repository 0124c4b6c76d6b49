#include "integration/egress/upstream.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/shell_quote.h"

namespace esb::testing {
namespace json = boost::json;
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool HasVar(const std::vector<std::string>& env, const std::string& name) {
  for (const std::string& e : env)
    if (e.rfind(name + "=", 0) == 0) return true;
  return false;
}

}  // namespace

ShellResult RunShell(const std::string& command, const std::vector<std::string>& env,
                     int timeout_s) {
  std::vector<std::string> vars = env;
  if (!HasVar(vars, "PATH")) vars.push_back("PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin");
  if (!HasVar(vars, "HOME")) vars.push_back("HOME=/tmp");
  std::vector<std::string> args = {"/usr/bin/timeout", "-k", "5",    std::to_string(timeout_s),
                                   "/bin/bash",        "-c", command};
  ShellResult result;
  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return result;
  pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out[1], 1);
    ::dup2(out[1], 2);
    int null = ::open("/dev/null", O_RDONLY);
    ::dup2(null, 0);
    std::vector<char*> argv, envp;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& v : vars) envp.push_back(v.data());
    envp.push_back(nullptr);
    ::execve(argv[0], argv.data(), envp.data());
    ::_exit(127);
  }
  ::close(out[1]);
  if (pid < 0) {
    ::close(out[0]);
    return result;
  }
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(out[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    result.output.append(buf, n);
  }
  ::close(out[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

EgressUpstream::~EgressUpstream() { Stop(); }

std::string EgressUpstream::Start(const std::vector<std::string>& names) {
  char tmpl[] = "/tmp/esb-upstream-XXXXXX";
  if (!::mkdtemp(tmpl)) return "mkdtemp failed";
  dir_ = tmpl;
  std::string name_list;
  for (const std::string& n : names) name_list += (name_list.empty() ? "" : ",") + n;
  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return "pipe failed";
  pid_ = ::fork();
  if (pid_ == 0) {
    ::dup2(out[1], 1);
    std::string script = std::string(ESB_SOURCE_DIR) + "/tests/integration/egress/upstream.py";
    if (name_list.empty())
      ::execlp("python3", "python3", script.c_str(), dir_.c_str(), nullptr);
    else
      ::execlp("python3", "python3", script.c_str(), dir_.c_str(), "--names", name_list.c_str(),
               nullptr);
    ::_exit(127);
  }
  ::close(out[1]);
  std::string line;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (line.find('\n') == std::string::npos) {
    int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                    deadline - std::chrono::steady_clock::now())
                                    .count());
    pollfd p{out[0], POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, left) <= 0) break;
    char c;
    if (::read(out[0], &c, 1) != 1) break;
    line += c;
  }
  ::close(out[0]);
  if (line.rfind("PORT ", 0) != 0) {
    Stop();
    return "egress/upstream.py did not start (needs python3, openssl and git); it printed: " + line;
  }
  port_ = std::stoi(line.substr(5));
  return "";
}

void EgressUpstream::Stop() {
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  if (!dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
    dir_.clear();
  }
}

std::vector<std::string> EgressUpstream::ResolveArgs(const std::vector<std::string>& names) const {
  std::vector<std::string> args;
  for (const std::string& n : names) {
    args.push_back("--egress-resolve");
    args.push_back(n + "=127.0.0.1:" + std::to_string(port_));
  }
  return args;
}

std::string EgressUpstream::AddGitRepo(const std::string& name,
                                       const std::map<std::string, std::string>& files) const {
  const std::string work = dir_ + "/work-" + name;
  std::filesystem::create_directories(work);
  for (const auto& [path, content] : files) {
    std::filesystem::path p = std::filesystem::path(work) / path;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << content;
  }
  const std::string bare = dir_ + "/git/" + name + ".git";
  ShellResult r = RunShell(
      "set -e; git init -q -b main " + ShellQuote(work) + "; cd " + ShellQuote(work) +
      "; git add -A; git -c user.name=esb-test -c user.email=test@esb.invalid commit -q -m "
      "initial; git clone -q --bare . " +
      ShellQuote(bare) + "; git -C " + ShellQuote(bare) + " symbolic-ref HEAD refs/heads/main");
  return r.exit_code == 0 ? "" : "git: " + r.output;
}

std::string EgressUpstream::Received() const { return ReadFile(dir_ + "/received.bin"); }

std::vector<json::object> EgressUpstream::Requests() const {
  std::vector<json::object> rows;
  std::istringstream in(ReadFile(dir_ + "/requests.jsonl"));
  std::string line;
  while (std::getline(in, line)) {
    boost::system::error_code ec;
    json::value v = json::parse(line, ec);
    if (!ec && v.is_object()) rows.push_back(v.as_object());
  }
  return rows;
}

}  // namespace esb::testing

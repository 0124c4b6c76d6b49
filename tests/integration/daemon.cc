#include "integration/daemon.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

namespace esb::testing {
namespace json = boost::json;
namespace {

int Connect(int port, const std::string& unix_path) {
  if (!unix_path.empty()) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", unix_path.c_str());
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      close(fd);
      return -1;
    }
    return fd;
  }
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

bool SendAll(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += n;
  }
  return true;
}

// Reads until EOF or the deadline.
std::string ReadAll(int fd, int timeout_s) {
  std::string out;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  char buf[65536];
  for (;;) {
    int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                    deadline - std::chrono::steady_clock::now())
                                    .count());
    if (left <= 0) break;
    pollfd p{fd, POLLIN, 0};
    int r = poll(&p, 1, left);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, n);
  }
  return out;
}

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string Dechunk(const std::string& body) {
  std::string out;
  size_t pos = 0;
  while (pos < body.size()) {
    size_t eol = body.find("\r\n", pos);
    if (eol == std::string::npos) break;
    size_t len = std::strtoul(body.substr(pos, eol - pos).c_str(), nullptr, 16);
    pos = eol + 2;
    if (len == 0) break;
    out.append(body, pos, len);
    pos += len + 2;
  }
  return out;
}

}  // namespace

const json::object& HttpResult::obj() const {
  static const json::object kEmpty;
  return json.is_object() ? json.as_object() : kEmpty;
}
std::string HttpResult::str(const char* key) const {
  auto* v = obj().if_contains(key);
  return v && v->is_string() ? std::string(v->as_string()) : "";
}
int64_t HttpResult::num(const char* key) const {
  auto* v = obj().if_contains(key);
  return v && v->is_int64() ? v->as_int64() : v && v->is_uint64() ? v->as_uint64() : -1;
}
bool HttpResult::flag(const char* key) const {
  auto* v = obj().if_contains(key);
  return v && v->is_bool() && v->as_bool();
}

std::vector<SseEvent> ParseSse(const std::string& body) {
  std::vector<SseEvent> events;
  std::istringstream in(body);
  std::string line, event, data;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) {
      if (!event.empty() || !data.empty()) {
        boost::system::error_code ec;
        json::value v = json::parse(data, ec);
        events.push_back({event, ec ? json::value(data) : v});
      }
      event.clear();
      data.clear();
    } else if (line.rfind("event:", 0) == 0) {
      event = line.substr(line[6] == ' ' ? 7 : 6);
    } else if (line.rfind("data:", 0) == 0) {
      if (!data.empty()) data += "\n";
      data += line.substr(line[5] == ' ' ? 6 : 5);
    }
  }
  return events;
}

HttpResult Http(int port, const std::string& method, const std::string& target,
                const std::string& body, const std::map<std::string, std::string>& headers,
                const std::string& unix_path, int timeout_s) {
  HttpResult r;
  int fd = Connect(port, unix_path);
  if (fd < 0) {
    r.error = std::string("connect: ") + strerror(errno);
    return r;
  }
  std::string req = method + " " + target + " HTTP/1.1\r\nConnection: close\r\n";
  bool has_type = false;
  bool has_host = false;
  for (const auto& [k, v] : headers) {
    req += k + ": " + v + "\r\n";
    has_type = has_type || Lower(k) == "content-type";
    has_host = has_host || Lower(k) == "host";
  }
  if (!has_host) req += "Host: 127.0.0.1\r\n";
  if (!body.empty() && !has_type) req += "Content-Type: application/json\r\n";
  if (!body.empty() || method == "POST" || method == "PUT")
    req += "Content-Length: " + std::to_string(body.size()) + "\r\n";
  req += "\r\n";
  if (!SendAll(fd, req) || !SendAll(fd, body)) {
    // The server may answer early (413) and close: still read what it said.
  }
  std::string raw = ReadAll(fd, timeout_s);
  close(fd);
  size_t hdr_end = raw.find("\r\n\r\n");
  if (raw.size() < 12 || hdr_end == std::string::npos) {
    r.error = "no HTTP answer";
    return r;
  }
  r.status = std::atoi(raw.substr(9, 3).c_str());
  std::istringstream hs(raw.substr(0, hdr_end));
  std::string line;
  std::getline(hs, line);
  while (std::getline(hs, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string value = line.substr(colon + 1);
    while (!value.empty() && value.front() == ' ') value.erase(0, 1);
    r.headers[Lower(line.substr(0, colon))] = value;
  }
  r.body = raw.substr(hdr_end + 4);
  if (Lower(r.headers["transfer-encoding"]) == "chunked") r.body = Dechunk(r.body);
  boost::system::error_code ec;
  r.json = json::parse(r.body, ec);
  if (ec) r.json = nullptr;
  return r;
}

std::string TwoTenantsConfig(const std::string& members) {
  std::string config = std::string(R"({"keys": [{"key": ")") + kTenantKeyA +
                       R"(", "tenant": "a"}, {"key": ")" + kTenantKeyB + R"(", "tenant": "b"}])";
  if (!members.empty()) config += ", " + members;
  return config + "}";
}

std::map<std::string, std::string> BearerAuth(const std::string& key) {
  return {{"Authorization", "Bearer " + key}};
}

std::string RawExchange(int port, const std::string& bytes, int timeout_s) {
  int fd = Connect(port, "");
  if (fd < 0) return "";
  SendAll(fd, bytes);
  shutdown(fd, SHUT_WR);
  std::string out = ReadAll(fd, timeout_s);
  close(fd);
  return out;
}

Daemon::~Daemon() {
  if (pid_ > 0) StopAndCleanup();
  if (own_state_ && !state_dir_.empty()) std::filesystem::remove_all(state_dir_);
}

std::string Daemon::SkipReason() {
  if (geteuid() != 0) return "needs root (OCI runtimes create namespaces and cgroups)";
  const char* image = std::getenv("ESBD_IMAGE_DEFAULT");
  if (!image || !*image)
    return "ESBD_IMAGE_DEFAULT is not set (run via `make test`, which builds the rootfs image)";
  if (!std::filesystem::exists(std::string(image) + "/bin/bash"))
    return std::string("ESBD_IMAGE_DEFAULT=") + image + " is not a built rootfs";
  return "";
}

namespace {
// The port in esbd's start-up line "esbd <version> listening on http://127.0.0.1:<port>" written
// to `log_path` after byte `offset` (a restarted daemon appends to its old log); 0 if not yet.
int ListeningPort(const std::string& log_path, uintmax_t offset) {
  std::ifstream in(log_path);
  in.seekg(static_cast<std::streamoff>(offset));
  std::string line;
  constexpr std::string_view kMark = " listening on http://127.0.0.1:";
  while (std::getline(in, line)) {
    size_t at = line.find(kMark);
    if (at == std::string::npos) continue;
    int port = std::atoi(line.c_str() + at + kMark.size());
    if (port > 0 && port < 65536) return port;
  }
  return 0;
}
}  // namespace

bool Daemon::Start(const Options& options, const std::string& reuse_state_dir) {
  if (reuse_state_dir.empty()) {
    char tmpl[] = "/tmp/esb-it-XXXXXX";
    state_dir_ = mkdtemp(tmpl);
    own_state_ = true;
  } else {
    state_dir_ = reuse_state_dir;
  }
  // esbd binds port 0 and the port it got is read from its log: choosing a free port here and
  // passing it races with every other test's daemons and client connections (CI saw it).
  const std::string log_path = state_dir_ + "/esbd.log";
  std::error_code size_ec;
  const uintmax_t log_offset =
      std::filesystem::exists(log_path) ? std::filesystem::file_size(log_path, size_ec) : 0;
  port_ = 0;

  std::vector<std::string> args = {std::string(ESB_BUILD_DIR) + "/esbd",
                                   "--listen",
                                   "127.0.0.1:0",
                                   "--state-dir",
                                   state_dir_,
                                   "--pool-size",
                                   std::to_string(options.pool_size)};
  if (!options.config_json.empty()) {
    std::string path = state_dir_ + "/config.json";
    std::ofstream(path) << options.config_json;
    args.push_back("--config");
    args.push_back(path);
  }
  for (const auto& a : options.extra_args) args.push_back(a);
  pid_ = fork();
  if (pid_ == 0) {
    int log = open((state_dir_ + "/esbd.log").c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    dup2(log, 1);
    dup2(log, 2);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    char* no_env[] = {nullptr};
    if (options.empty_environment)
      execve(argv[0], argv.data(), no_env);
    else
      execv(argv[0], argv.data());
    _exit(127);
  }
  for (int i = 0; i < 600; ++i) {
    if (port_ == 0) port_ = ListeningPort(log_path, size_ec ? 0 : log_offset);
    if (port_ != 0 && Http(port_, "GET", "/healthz", "", {}, "", 2).status == 200) return true;
    int st;
    if (waitpid(pid_, &st, WNOHANG) == pid_) {
      pid_ = -1;
      ADD_FAILURE() << "esbd exited during start-up; log:\n" << Log();
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ADD_FAILURE() << "esbd did not become healthy; log:\n" << Log();
  return false;
}

void Daemon::Stop() {
  if (pid_ <= 0) return;
  kill(pid_, SIGTERM);
  for (int i = 0; i < 300; ++i) {
    int st;
    if (waitpid(pid_, &st, WNOHANG) == pid_) {
      pid_ = -1;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ADD_FAILURE() << "esbd did not stop within 15 s of SIGTERM";
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

void Daemon::StopAndCleanup() {
  Stop();
  std::string cmd = std::string(ESB_BUILD_DIR) + "/esbd --state-dir " + state_dir_ +
                    " cleanup >>" + state_dir_ + "/cleanup.log 2>&1";
  if (std::system(cmd.c_str()) != 0) ADD_FAILURE() << "esbd cleanup failed";
}

HttpResult Daemon::Call(const std::string& method, const std::string& target,
                        const json::value& body,
                        const std::map<std::string, std::string>& headers) const {
  std::map<std::string, std::string> h = headers;
  if (!api_key.empty() && !h.count("Authorization")) h["Authorization"] = "Bearer " + api_key;
  return Http(port_, method, target, body.is_null() ? "" : json::serialize(body), h);
}

std::string Daemon::CreateEnv(const json::object& body) const {
  HttpResult r = Call("POST", "/environments", body);
  EXPECT_EQ(r.status, 201) << r.body;
  return r.str("environment_id");
}

HttpResult Daemon::Exec(const std::string& id, const std::string& command, int timeout_s) const {
  return Call("POST", "/environments/" + id + "/execute",
              json::object{{"command", command}, {"timeout_seconds", timeout_s}});
}

std::string Daemon::Log() const {
  std::ifstream in(state_dir_ + "/esbd.log");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  return s.size() > 20000 ? s.substr(s.size() - 20000) : s;
}

}  // namespace esb::testing

// Test harness: runs the real esbd binary and talks HTTP to it.
#pragma once

#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

#include <boost/json.hpp>
#include <gtest/gtest.h>

namespace esb::testing {

struct HttpResult {
  int status = 0;          // 0: connection failed
  std::string body;
  std::map<std::string, std::string> headers;  // lower-case names
  boost::json::value json;  // parsed body when it is JSON, else null
  std::string error;        // transport error
  const boost::json::object& obj() const;  // json as object (empty object if not one)
  std::string str(const char* key) const;  // obj()[key] as string ("" if absent)
  int64_t num(const char* key) const;      // obj()[key] as integer (-1 if absent)
  bool flag(const char* key) const;        // obj()[key] as bool (false if absent)
};

struct SseEvent {
  std::string event;
  boost::json::value data;
};
std::vector<SseEvent> ParseSse(const std::string& body);

// Raw HTTP over TCP to 127.0.0.1:port (or a unix socket when `unix_path` is set). Sends
// "Host: 127.0.0.1" and, with a body, "Content-Type: application/json" unless `headers` has them.
HttpResult Http(int port, const std::string& method, const std::string& target,
                const std::string& body = "",
                const std::map<std::string, std::string>& headers = {},
                const std::string& unix_path = "", int timeout_s = 120);
// Sends raw bytes and returns whatever the server answers (for malformed-request tests).
std::string RawExchange(int port, const std::string& bytes, int timeout_s = 10);

// Tenants "a" and "b" with one API key each: where isolation tests start.
inline constexpr char kTenantKeyA[] = "esb_tenant_a_secret_0001";
inline constexpr char kTenantKeyB[] = "esb_tenant_b_secret_0002";
// A daemon config with those two keys; `members` are more members of its object
// (R"("mcp": {...})"), "" for none.
std::string TwoTenantsConfig(const std::string& members = "");
// The Authorization header that presents `key`.
std::map<std::string, std::string> BearerAuth(const std::string& key);

class Daemon {
 public:
  struct Options {
    int pool_size = 0;
    std::string config_json;  // written to a file and passed with --config when set
    std::vector<std::string> extra_args;
    // Start esbd with no environment variables at all (as `env -i` would), as a user or a
    // service unit starts it.
    bool empty_environment = false;
  };
  Daemon() = default;
  ~Daemon();
  // Why the test cannot run here (not root, no image), or "" when it can.
  static std::string SkipReason();
  // Starts esbd (free port, fresh state dir unless `state_dir` is reused) and waits for /healthz.
  bool Start(const Options& options, const std::string& reuse_state_dir = "");
  // SIGTERM and wait. Environments keep running (by design).
  void Stop();
  // Stop() and destroy every environment left in the state dir (`esbd cleanup`).
  void StopAndCleanup();

  HttpResult Call(const std::string& method, const std::string& target,
                  const boost::json::value& body = nullptr,
                  const std::map<std::string, std::string>& headers = {}) const;
  // POST /environments with `body`; returns the id or "" (and fails the test).
  std::string CreateEnv(const boost::json::object& body = {}) const;
  HttpResult Exec(const std::string& id, const std::string& command, int timeout_s = 60) const;
  std::string Log() const;

  int port() const { return port_; }
  const std::string& state_dir() const { return state_dir_; }
  pid_t pid() const { return pid_; }
  std::string api_key;  // sent as Bearer when non-empty

 private:
  int port_ = 0;
  pid_t pid_ = -1;
  std::string state_dir_;
  bool own_state_ = false;
};

// A suite whose tests share one daemon (default options): started before the first test,
// stopped and its leftover environments cleaned up after the last; every test is skipped with
// the reason when this machine cannot run it. Use: class FooTest : public SharedDaemonTest<FooTest>.
// A derived SetUp must call SharedDaemonTest::SetUp() first and return if IsSkipped(). A suite
// that needs other daemon options declares its own public `static Daemon::Options SuiteOptions()`.
template <typename Suite>
class SharedDaemonTest : public ::testing::Test {
 protected:
  static Daemon::Options SuiteOptions() { return {}; }
  static void SetUpTestSuite() {
    if (!Daemon::SkipReason().empty()) return;
    daemon_ = new Daemon();
    if (!daemon_->Start(Suite::SuiteOptions())) {
      delete daemon_;
      daemon_ = nullptr;
    }
  }
  static void TearDownTestSuite() {
    if (daemon_) daemon_->StopAndCleanup();
    delete daemon_;
    daemon_ = nullptr;
  }
  void SetUp() override {
    std::string why = Daemon::SkipReason();
    if (!why.empty()) GTEST_SKIP() << why;
    ASSERT_NE(daemon_, nullptr) << "suite set-up failed";
  }
  static Daemon* daemon_;
};
template <typename Suite>
Daemon* SharedDaemonTest<Suite>::daemon_ = nullptr;

}  // namespace esb::testing

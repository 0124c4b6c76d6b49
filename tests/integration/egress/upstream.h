// The egress tests' local "internet": egress/upstream.py started in a temp dir. One port serves
// HTTP and HTTPS (certificates from a test root CA made at start), a git smart-HTTP server over
// bare repositories the test creates, the PEP 503 index of package_index.py and an echo that
// records every byte it received.
#pragma once

#include <sys/types.h>

#include <boost/json.hpp>
#include <map>
#include <string>
#include <vector>

namespace esb::testing {

struct ShellResult {
  int exit_code = -1;  // 124: timed out; -1: could not run
  std::string output;  // stdout and stderr, interleaved
};
// Runs `command` with bash under `timeout`, with exactly the environment `env` (NAME=value
// entries; PATH and HOME are set when absent): the developer's own proxy or CA variables
// never leak into a test.
ShellResult RunShell(const std::string& command, const std::vector<std::string>& env = {},
                     int timeout_s = 60);

class EgressUpstream {
 public:
  EgressUpstream() = default;
  EgressUpstream(const EgressUpstream&) = delete;
  EgressUpstream& operator=(const EgressUpstream&) = delete;
  ~EgressUpstream();

  // Starts it in a fresh temp dir with a leaf certificate for `names` (plus localhost and
  // 127.0.0.1); "" on success, else why it did not come up.
  std::string Start(const std::vector<std::string>& names = {});
  void Stop();

  int port() const { return port_; }
  const std::string& dir() const { return dir_; }
  // The test root CA's certificate (PEM): what a client or esbd's --egress-upstream-ca trusts.
  std::string root_ca() const { return dir_ + "/root.pem"; }
  // "--egress-resolve NAME=127.0.0.1:PORT" for each name, ready for Daemon::Options.
  std::vector<std::string> ResolveArgs(const std::vector<std::string>& names) const;

  // Creates the bare repository <name>.git (served at /<name>.git) with `files` committed on
  // its default branch main. "" on success, else git's output.
  std::string AddGitRepo(const std::string& name,
                         const std::map<std::string, std::string>& files) const;

  // Every byte received so far, on every connection (after TLS decryption).
  std::string Received() const;
  // One object per request answered so far: method, path, host, tls, sni, body_len, status.
  std::vector<boost::json::object> Requests() const;

 private:
  pid_t pid_ = -1;
  int port_ = 0;
  std::string dir_;
};

}  // namespace esb::testing

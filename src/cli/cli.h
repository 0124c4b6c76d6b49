// `esb`, the command-line client of esbd's REST API. Everything but main() lives here so it
// can be driven by tests: arguments, environment and streams in, exit code out.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cli/http_client.h"

namespace esb::cli {

// Exit codes (besides `esb exec`, which exits with the command's own code).
inline constexpr int kExitOk = 0;
inline constexpr int kExitError = 1;    // the daemon answered with an error
inline constexpr int kExitUsage = 2;    // bad command line
inline constexpr int kExitConnect = 2;  // esbd not reachable

inline constexpr char kDefaultUrl[] = "http://127.0.0.1:8080";

struct GlobalOptions {
  std::string url;      // --url, else $ESB_URL, else kDefaultUrl
  std::string api_key;  // --api-key, else $ESB_API_KEY
  bool json = false;    // --json: print the daemon's raw JSON
  bool help = false;    // --help / -h
};

// One parsed command line.
struct Invocation {
  GlobalOptions global;
  std::string command;  // "create", "ls", ...; "help" / "version" too
  std::map<std::string, std::vector<std::string>> flags;  // "--memory-mb" -> {"512"}
  std::vector<std::string> positionals;
  std::vector<std::string> command_words;  // exec: the command after ENV / "--"

  bool Has(const std::string& flag) const { return flags.count(flag) != 0; }
  // Last value of a flag, or "" if absent.
  std::string Value(const std::string& flag) const;
};

// Parses argv[1..]. `env` supplies ESB_URL / ESB_API_KEY. Errors are usage errors.
absl::StatusOr<Invocation> ParseCommandLine(const std::vector<std::string>& args,
                                            const std::map<std::string, std::string>& env);

// How `esb exec` turns its words into the shell command esbd runs: a single word is used
// verbatim (so `esb exec E -- 'ls | wc -l'` keeps its pipe); several words are each
// shell-quoted when needed and joined with spaces (argv semantics, like `docker exec`).
std::string JoinCommand(const std::vector<std::string>& words);

// cp arguments: "ENV:PATH" is remote when the part before the first ':' is non-empty and
// has no '/' (so "./a:b" and "/tmp/a:b" stay local).
bool SplitRemote(const std::string& arg, std::string* env, std::string* path);

struct CliContext {
  std::istream* in = nullptr;
  std::ostream* out = nullptr;
  std::ostream* err = nullptr;
  std::map<std::string, std::string> env;  // ESB_URL, ESB_API_KEY
  TransportFactory transport;              // MakeBeastTransport in the real binary
  int64_t now_ms = 0;                      // for "5m ago"; 0 = the real clock
  // `esb shell`: the terminal's file descriptors (raw mode when stdin is a terminal).
  int stdin_fd = 0;
  int stdout_fd = 1;
};

// Runs one command line (argv without argv[0]) and returns the process exit code.
int RunCli(const std::vector<std::string>& args, CliContext& ctx);

// Usage text: general (command "") or per command; "" for an unknown command.
std::string UsageText(const std::string& command);

}  // namespace esb::cli

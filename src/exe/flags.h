// esbd's command line: flags over the ESBD_* environment over the config file over the
// embedded defaults (core/config.h), and the positional command (`keys ...`, `cleanup`).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/config.h"

namespace esb {

// The text of `esbd --help`.
extern const char kEsbdUsage[];

struct CommandLine {
  bool help = false;
  bool version = false;
  std::string config_path;           // --config or ESBD_CONFIG ("" when none)
  std::vector<std::string> command;  // e.g. {"keys", "add", "--tenant", "t"}; empty: serve
  // TEST ONLY: /mcp also serves the MCP conformance suite's fixture tools.
  bool mcp_conformance_fixtures = false;
};

// Parses `args` (argv without argv[0]) into `config`: reads the config file named by --config
// (or ESBD_CONFIG), applies the environment through `getenv_fn`, then the flags. Unknown flags
// before the command are errors; everything from the first positional word on is the command.
absl::StatusOr<CommandLine> ParseCommandLine(
    const std::vector<std::string>& args, const std::function<const char*(const char*)>& getenv_fn,
    DaemonConfig* config);

}  // namespace esb

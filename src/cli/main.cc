// esb: wiring only. The logic is in cli.cc (RunCli), which the tests drive directly.
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "cli/cli.h"

int main(int argc, char** argv) {
  esb::cli::CliContext ctx;
  ctx.in = &std::cin;
  ctx.out = &std::cout;
  ctx.err = &std::cerr;
  for (const char* name : {"ESB_URL", "ESB_API_KEY"}) {
    if (const char* v = std::getenv(name); v != nullptr) ctx.env[name] = v;
  }
  ctx.transport = esb::cli::MakeBeastTransport;
  std::vector<std::string> args(argv + 1, argv + argc);
  const int rc = esb::cli::RunCli(args, ctx);
  std::cout.flush();
  return rc;
}

// `esbd keys add|list|revoke`: API key administration on the state database.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "storage/store.h"

namespace esb {

// Runs `args` (starting with "keys") against `store`; prints results to `out` and problems to
// `err`. Returns the process exit code (0 ok, 2 usage or store error).
int RunKeysCommand(Store* store, const std::vector<std::string>& args, std::ostream& out,
                   std::ostream& err);

}  // namespace esb

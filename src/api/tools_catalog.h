// Seed 004's meta-tools (environment.execute_command / write_file / read_file), served at
// GET /tools so planners can fetch the catalogue from the daemon. The same definitions ship in
// the Python SDK (sdk/python/agentbox/tools.py); an SDK end-to-end test checks they agree.
#pragma once

#include <boost/json.hpp>

namespace esb::api {

// {"tools": [neutral], "openai": [function tools], "anthropic": [tools]}
boost::json::object ToolsCatalog();

}  // namespace esb::api

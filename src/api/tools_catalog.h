// Seed 004's meta-tools (environment.execute_command / write_file / read_file), served at
// GET /tools so planners can fetch the catalogue from the daemon. The definitions live in one
// file, sdk/tools.json, embedded here at build time and read by the Python SDK (agentbox/tools.json
// links to it), so the two cannot drift apart.
#pragma once

#include <boost/json.hpp>
#include <string_view>

namespace esb::api {

// sdk/tools.json's bytes, as embedded at build time.
std::string_view ToolsCatalogSource();

// {"tools": [neutral], "openai": [function tools], "anthropic": [tools]}. The vendor formats
// are derived as the SDK derives them: name with '.' as '_' (both vendors accept only
// ^[a-zA-Z0-9_-]+$), description followed by the output description.
boost::json::object ToolsCatalog();

}  // namespace esb::api

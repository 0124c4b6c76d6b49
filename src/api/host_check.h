// Names of this machine in Host and Origin headers: the one check behind dev mode's DNS
// rebinding protection (service.cc) and the MCP endpoint's Origin/Host validation.
#pragma once

#include <string_view>

namespace esb::api {

// "localhost", "127.x.y.z" or "[::1]" (any IPv6 loopback), each optionally with ":port": the
// names a page served from this machine has. Anything else is a DNS-rebinding name or a remote
// one.
bool IsLoopbackHostPort(std::string_view host_port);

// "http(s)://" followed by IsLoopbackHostPort: a page served from this machine.
bool IsLoopbackOrigin(std::string_view origin);

// The "host[:port]" of an origin "http(s)://host[:port]"; empty if `origin` is not one.
std::string_view OriginHostPort(std::string_view origin);

}  // namespace esb::api

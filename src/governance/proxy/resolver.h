// Name resolution for esb-proxy. The sandbox never resolves anything: clients send the name in
// the CONNECT line or the absolute URI, and the proxy resolves it here, then refuses addresses
// the sandbox must not reach (private, loopback, link-local, metadata, ULA, mapped, ...) unless
// the destination was explicitly allowed (an --egress-resolve override, or an IP literal an
// allow/intent rule names).
#pragma once

#include <atomic>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "governance/proxy/quota.h"

namespace esb::governance::proxy {

namespace asio = boost::asio;

// True for addresses an egress connection may not reach unless explicitly allowed: IPv4
// 0/8, 10/8, 100.64/10 (CGNAT), 127/8, 169.254/16 (link-local, 169.254.169.254 metadata),
// 172.16/12, 192.0.0/24, 192.0.2/24, 192.168/16, 198.18/15, 198.51.100/24, 203.0.113/24,
// 224/4, 240/4; IPv6 ::, ::1, ::ffff:0:0/96 (mapped), ::/96 (compatible), 64:ff9b::/96 (NAT64),
// 100::/64, 2001:db8::/32, 2002::/16 (6to4), 2001::/32 (Teredo), fc00::/7 (ULA, incl. the
// fd00:ec2::254 metadata address), fe80::/10, fec0::/10, ff00::/8.
bool IsForbiddenAddress(const asio::ip::address& address);

// One --egress-resolve NAME=HOST:PORT mapping ("[::1]:8443" for IPv6). The name is normalised
// (lower case, no trailing dot); HOST must be an IP literal.
struct ResolveOverride {
  std::string name;
  asio::ip::tcp::endpoint endpoint;
};
absl::StatusOr<ResolveOverride> ParseResolveOverride(std::string_view text);

struct Resolution {
  std::vector<asio::ip::tcp::endpoint> endpoints;  // in the order to try
  // The destination was mapped by an override: private addresses are allowed.
  bool overridden = false;
};

// Who a lookup is for: a resolver shares its threads fairly between tenants.
struct ResolveScope {
  std::string tenant;
  std::string env_id;
};

// Injectable (tests map names to 127.0.0.1 upstreams).
class Resolver {
 public:
  virtual ~Resolver() = default;
  // Resolves `host` (a normalised name; IP literals never reach the resolver) for `port`.
  // NotFound for unknown names, DeadlineExceeded, Unavailable when overloaded.
  virtual asio::awaitable<absl::StatusOr<Resolution>> Resolve(std::string host, uint16_t port) = 0;
  // The same for one tenant's environment (the proxy calls this). Unavailable when the
  // tenant's share is used up. Default: Resolve (no per-tenant share).
  virtual asio::awaitable<absl::StatusOr<Resolution>> ResolveFor(ResolveScope scope,
                                                                 std::string host, uint16_t port) {
    co_return co_await Resolve(std::move(host), port);
  }
};

// Overrides first, then the system's getaddrinfo on a small dedicated FairPool (blocking calls
// never run on the proxy's I/O threads), with a deadline and a bound on lookups in flight. The
// pool serves tenants round-robin, runs at most max_running_per_tenant lookups of one tenant at
// once (a tenant resolving slow names holds at most that many threads) and queues at most
// max_queued_per_tenant more (over it: Unavailable at once). A lookup whose deadline passed
// while it was queued is not started.
class SystemResolver : public Resolver {
 public:
  using Lookup = std::function<absl::StatusOr<Resolution>(const std::string& host, uint16_t port)>;
  struct Options {
    std::vector<ResolveOverride> overrides;
    bool use_system = true;  // false: only overrides (tests; NotFound otherwise)
    int threads = 4;
    int max_running_per_tenant = 2;
    size_t max_queued_per_tenant = 16;
    int max_in_flight = 64;  // queued or running, all tenants
    std::chrono::milliseconds timeout{5000};
    Lookup lookup;  // tests: replaces getaddrinfo (unset: getaddrinfo)
  };
  explicit SystemResolver(Options options);
  ~SystemResolver() override;

  asio::awaitable<absl::StatusOr<Resolution>> Resolve(std::string host, uint16_t port) override;
  asio::awaitable<absl::StatusOr<Resolution>> ResolveFor(ResolveScope scope, std::string host,
                                                         uint16_t port) override;

 private:
  Options options_;
  std::map<std::string, asio::ip::tcp::endpoint, std::less<>> overrides_;
  std::shared_ptr<std::atomic<int>> in_flight_;
  FairPool pool_;  // last: joined first (its jobs use in_flight_)
};

}  // namespace esb::governance::proxy

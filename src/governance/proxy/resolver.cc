#include "governance/proxy/resolver.h"

#include <netdb.h>
#include <sys/socket.h>

#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/util.h"
#include "governance/policy.h"

namespace esb::governance::proxy {
namespace {

bool InV4(uint32_t a, uint32_t net, int bits) {
  uint32_t mask = bits == 0 ? 0 : ~uint32_t{0} << (32 - bits);
  return (a & mask) == (net & mask);
}

constexpr uint32_t V4(int a, int b, int c, int d) {
  return (uint32_t(a) << 24) | (uint32_t(b) << 16) | (uint32_t(c) << 8) | uint32_t(d);
}

bool ForbiddenV4(uint32_t a) {
  static constexpr struct {
    uint32_t net;
    int bits;
  } kRanges[] = {
      {V4(0, 0, 0, 0), 8},     {V4(10, 0, 0, 0), 8},      {V4(100, 64, 0, 0), 10},
      {V4(127, 0, 0, 0), 8},   {V4(169, 254, 0, 0), 16},  {V4(172, 16, 0, 0), 12},
      {V4(192, 0, 0, 0), 24},  {V4(192, 0, 2, 0), 24},    {V4(192, 168, 0, 0), 16},
      {V4(198, 18, 0, 0), 15}, {V4(198, 51, 100, 0), 24}, {V4(203, 0, 113, 0), 24},
      {V4(224, 0, 0, 0), 4},   {V4(240, 0, 0, 0), 4},
  };
  for (const auto& r : kRanges) {
    if (InV4(a, r.net, r.bits)) return true;
  }
  return false;
}

bool InV6(const asio::ip::address_v6::bytes_type& b, std::initializer_list<uint8_t> prefix,
          int bits) {
  int i = 0;
  for (uint8_t p : prefix) {
    int take = std::min(8, bits - i * 8);
    if (take <= 0) break;
    uint8_t mask = static_cast<uint8_t>(0xff << (8 - take));
    if ((b[i] & mask) != (p & mask)) return false;
    ++i;
  }
  return true;
}

}  // namespace

bool IsForbiddenAddress(const asio::ip::address& address) {
  if (address.is_v4()) return ForbiddenV4(address.to_v4().to_uint());
  const asio::ip::address_v6::bytes_type b = address.to_v6().to_bytes();
  // ::/96 covers :: and ::1 and the deprecated IPv4-compatible form; ::ffff:0:0/96 mapped.
  if (InV6(b, {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, 96)) return true;
  if (InV6(b, {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff}, 96)) return true;
  if (InV6(b, {0x00, 0x64, 0xff, 0x9b, 0, 0, 0, 0, 0, 0, 0, 0}, 96)) return true;  // NAT64
  if (InV6(b, {0x00, 0x64, 0xff, 0x9b, 0x00, 0x01}, 48)) return true;  // local-use NAT64
  if (InV6(b, {0x01, 0x00, 0, 0, 0, 0, 0, 0}, 64)) return true;        // discard
  if (InV6(b, {0x20, 0x01, 0x0d, 0xb8}, 32)) return true;              // documentation
  if (InV6(b, {0x20, 0x01, 0x00, 0x00}, 32)) return true;              // Teredo
  if (InV6(b, {0x20, 0x02}, 16)) return true;                          // 6to4
  if (InV6(b, {0xfc}, 7)) return true;                                 // ULA
  if (InV6(b, {0xfe, 0x80}, 10)) return true;                          // link-local
  if (InV6(b, {0xfe, 0xc0}, 10)) return true;                          // site-local
  if (InV6(b, {0xff}, 8)) return true;                                 // multicast
  return false;
}

absl::StatusOr<ResolveOverride> ParseResolveOverride(std::string_view text) {
  size_t eq = text.find('=');
  if (eq == std::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--egress-resolve '", AbslView(text), "': want NAME=HOST:PORT"));
  }
  std::optional<std::string> name = NormalizeHost(text.substr(0, eq));
  std::string_view target = text.substr(eq + 1);
  size_t colon = target.rfind(':');
  if (!name || colon == std::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--egress-resolve '", AbslView(text), "': want NAME=HOST:PORT"));
  }
  std::string_view host = target.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  uint32_t port = 0;
  boost::system::error_code ec;
  asio::ip::address address = asio::ip::make_address(std::string(host), ec);
  if (ec || !absl::SimpleAtoi(AbslView(target.substr(colon + 1)), &port) || port == 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--egress-resolve '", AbslView(text), "': HOST must be an IP address and PORT 1..65535"));
  }
  return ResolveOverride{*name, asio::ip::tcp::endpoint(address, static_cast<uint16_t>(port))};
}

SystemResolver::SystemResolver(Options options)
    : options_(std::move(options)),
      in_flight_(std::make_shared<std::atomic<int>>(0)),
      pool_(FairPool::Options{options_.threads, options_.max_running_per_tenant,
                              options_.max_queued_per_tenant}) {
  for (const ResolveOverride& o : options_.overrides) overrides_[o.name] = o.endpoint;
}

SystemResolver::~SystemResolver() { pool_.Shutdown(); }

namespace {

struct PendingLookup {
  explicit PendingLookup(asio::any_io_executor ex) : timer(ex) {}
  asio::steady_timer timer;
  bool done = false;  // touched only on the caller's executor
  std::atomic<bool> abandoned{false};  // the caller gave up (deadline): do not start it
  absl::StatusOr<Resolution> result = absl::UnknownError("unset");
};

absl::StatusOr<Resolution> GetAddrInfo(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_ADDRCONFIG;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0) {
    return absl::NotFoundError(absl::StrCat("cannot resolve '", host, "': ", gai_strerror(rc)));
  }
  Resolution out;
  for (addrinfo* a = res; a != nullptr && out.endpoints.size() < 16; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      const auto* sin = reinterpret_cast<const sockaddr_in*>(a->ai_addr);
      out.endpoints.emplace_back(asio::ip::address_v4(ntohl(sin->sin_addr.s_addr)), port);
    } else if (a->ai_family == AF_INET6) {
      const auto* sin6 = reinterpret_cast<const sockaddr_in6*>(a->ai_addr);
      asio::ip::address_v6::bytes_type bytes;
      std::memcpy(bytes.data(), &sin6->sin6_addr, 16);
      out.endpoints.emplace_back(asio::ip::address_v6(bytes), port);
    }
  }
  freeaddrinfo(res);
  if (out.endpoints.empty()) {
    return absl::NotFoundError(absl::StrCat("cannot resolve '", host, "': no address"));
  }
  return out;
}

}  // namespace

asio::awaitable<absl::StatusOr<Resolution>> SystemResolver::Resolve(std::string host,
                                                                    uint16_t port) {
  ResolveScope scope;
  co_return co_await ResolveFor(std::move(scope), std::move(host), port);
}

asio::awaitable<absl::StatusOr<Resolution>> SystemResolver::ResolveFor(ResolveScope scope,
                                                                       std::string host,
                                                                       uint16_t port) {
  if (auto it = overrides_.find(host); it != overrides_.end()) {
    Resolution r;
    r.endpoints.push_back(it->second);
    r.overridden = true;
    co_return r;
  }
  if (!options_.use_system) {
    co_return absl::NotFoundError(absl::StrCat("cannot resolve '", host, "'"));
  }
  if (in_flight_->fetch_add(1) >= options_.max_in_flight) {
    in_flight_->fetch_sub(1);
    co_return absl::UnavailableError("resolver overloaded");
  }
  auto ex = co_await asio::this_coro::executor;
  auto lookup = std::make_shared<PendingLookup>(ex);
  lookup->timer.expires_after(options_.timeout);
  // getaddrinfo blocks and cannot be cancelled: it runs on the pool and posts its result back;
  // a lookup that outlives the deadline finishes in the background and is dropped.
  bool queued = pool_.Submit(scope.tenant, [lookup, host, port, in_flight = in_flight_,
                                            fn = options_.lookup] {
    if (lookup->abandoned.load()) {
      in_flight->fetch_sub(1);
      return;
    }
    absl::StatusOr<Resolution> r = fn ? fn(host, port) : GetAddrInfo(host, port);
    in_flight->fetch_sub(1);
    asio::post(lookup->timer.get_executor(), [lookup, r = std::move(r)]() mutable {
      lookup->result = std::move(r);
      lookup->done = true;
      lookup->timer.cancel();
    });
  });
  if (!queued) {
    in_flight_->fetch_sub(1);
    co_return absl::UnavailableError(
        "resolver busy: this tenant has too many names being resolved; retry shortly");
  }
  boost::system::error_code ec;
  co_await lookup->timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
  if (!lookup->done) {
    lookup->abandoned = true;
    co_return absl::DeadlineExceededError(absl::StrCat("resolving '", host, "' timed out"));
  }
  co_return std::move(lookup->result);
}

}  // namespace esb::governance::proxy

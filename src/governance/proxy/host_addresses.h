// The proxy host's own addresses (docs/design.md "Egress proxy", "The host's own addresses").
//
// esb-proxy connects from the host's network namespace, so a sandbox that asks for the host's
// public address (or any other address of one of its interfaces) would reach esbd and every
// other service listening on the host. Those addresses are refused like private ranges (rule
// "addr:host") unless the destination was explicitly allowed. They are read with getifaddrs
// when the proxy starts and again when the copy is older than the refresh period (interfaces
// and DHCP leases change while the proxy runs).
#pragma once

#include <boost/asio/ip/address.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <set>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace esb::governance::proxy {

namespace asio = boost::asio;

// Every address of every local interface (getifaddrs; IPv4 and IPv6, any state).
absl::StatusOr<std::vector<asio::ip::address>> SystemInterfaceAddresses();

class HostAddresses {
 public:
  using Source = std::function<absl::StatusOr<std::vector<asio::ip::address>>()>;
  // `source` nullptr: SystemInterfaceAddresses.
  HostAddresses(Source source, std::chrono::milliseconds refresh);

  // Reads the addresses now; on failure the previous set is kept and the error returned.
  absl::Status Refresh();
  // True for an address of the host (refreshing first if the copy is stale), for 0.0.0.0 and
  // :: (which reach the host's own listeners), and for the IPv4-mapped form of either.
  // Interface scope ids are ignored (fe80::1%eth0 is fe80::1).
  bool Contains(const asio::ip::address& address);

 private:
  using Key = std::vector<uint8_t>;  // the address's bytes: 4 (IPv4, also mapped) or 16
  static Key KeyOf(const asio::ip::address& address);

  Source source_;
  std::chrono::milliseconds refresh_;
  std::mutex mu_;
  std::set<Key> keys_;                            // guarded by mu_
  std::chrono::steady_clock::time_point read_{};  // guarded by mu_
};

}  // namespace esb::governance::proxy

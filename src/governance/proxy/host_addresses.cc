#include "governance/proxy/host_addresses.h"

#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace esb::governance::proxy {

absl::StatusOr<std::vector<asio::ip::address>> SystemInterfaceAddresses() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {
    return absl::InternalError(absl::StrCat("getifaddrs: ", std::strerror(errno)));
  }
  std::vector<asio::ip::address> out;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr) continue;
    if (i->ifa_addr->sa_family == AF_INET) {
      const auto* sin = reinterpret_cast<const sockaddr_in*>(i->ifa_addr);
      asio::ip::address_v4::bytes_type b;
      std::memcpy(b.data(), &sin->sin_addr, b.size());
      out.emplace_back(asio::ip::address_v4(b));
    } else if (i->ifa_addr->sa_family == AF_INET6) {
      const auto* sin6 = reinterpret_cast<const sockaddr_in6*>(i->ifa_addr);
      asio::ip::address_v6::bytes_type b;
      std::memcpy(b.data(), &sin6->sin6_addr, b.size());
      out.emplace_back(asio::ip::address_v6(b));
    }
  }
  freeifaddrs(list);
  return out;
}

HostAddresses::HostAddresses(Source source, std::chrono::milliseconds refresh)
    : source_(source ? std::move(source) : Source(SystemInterfaceAddresses)), refresh_(refresh) {}

HostAddresses::Key HostAddresses::KeyOf(const asio::ip::address& address) {
  if (address.is_v4()) {
    auto b = address.to_v4().to_bytes();
    return Key(b.begin(), b.end());
  }
  asio::ip::address_v6 v6 = address.to_v6();
  if (v6.is_v4_mapped()) {
    auto b = asio::ip::make_address_v4(asio::ip::v4_mapped, v6).to_bytes();
    return Key(b.begin(), b.end());
  }
  auto b = v6.to_bytes();  // without the scope id
  return Key(b.begin(), b.end());
}

absl::Status HostAddresses::Refresh() {
  absl::StatusOr<std::vector<asio::ip::address>> addresses = source_();
  std::lock_guard<std::mutex> lock(mu_);
  read_ = std::chrono::steady_clock::now();  // a failure is retried after the period too
  if (!addresses.ok()) return addresses.status();
  std::set<Key> keys;
  for (const asio::ip::address& a : *addresses) keys.insert(KeyOf(a));
  keys_ = std::move(keys);
  return absl::OkStatus();
}

bool HostAddresses::Contains(const asio::ip::address& address) {
  if (address.is_unspecified()) return true;
  Key key = KeyOf(address);
  if (key == Key(4, 0)) return true;  // ::ffff:0.0.0.0
  bool stale;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stale = std::chrono::steady_clock::now() - read_ >= refresh_;
  }
  if (stale) (void)Refresh();  // a failure keeps the previous set
  std::lock_guard<std::mutex> lock(mu_);
  return keys_.count(key) > 0;
}

}  // namespace esb::governance::proxy

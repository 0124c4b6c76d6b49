// The one place that knows which isolation drivers this esbd has: built in main, where each
// driver registers its name, its tier, how it is probed (a factory that builds it or says why it
// cannot work on this host) and, once built, its description. The environment manager, the API
// (/healthz, "runtime X is not available: why"), `esbd cleanup` and the start-up log all ask the
// registry instead of keeping their own lists.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "drivers/driver.h"

namespace esb {

class DriverRegistry {
 public:
  // Which kind of sandbox a driver runs: a whole Linux userland (heavy: containers, gVisor,
  // microVMs) or the nano tier (CPython on wasm in a confined worker).
  enum class Tier { kHeavy, kNano };

  // Builds the driver, or answers why it cannot work here (the reason is shown to API users
  // and logged, so it says what to do: "build one with `make images`", ...).
  using Probe = std::function<absl::StatusOr<std::unique_ptr<Driver>>()>;

  struct Entry {
    std::string name;  // "container", "gvisor", "nano", "microvm"
    Tier tier = Tier::kHeavy;
    Driver* driver = nullptr;  // null when unavailable
    std::string description;   // Driver::Describe() when available
    std::string unavailable;   // why not, when driver is null
  };

  DriverRegistry() = default;
  DriverRegistry(const DriverRegistry&) = delete;
  DriverRegistry& operator=(const DriverRegistry&) = delete;

  // Runs `probe` now and records the driver (owned by the registry) or the reason it is
  // unavailable. Registering a name twice replaces the earlier entry.
  void Register(std::string name, Tier tier, const Probe& probe);
  // Records a driver that cannot work here without probing anything (not built, no image).
  void RegisterUnavailable(std::string name, Tier tier, std::string why);

  // The driver registered as `name`, or null when it is unknown or unavailable.
  Driver* Find(std::string_view name) const;
  // The entry of `name`, or null when nothing registered it.
  const Entry* Lookup(std::string_view name) const;
  // Available drivers by name (what the environment manager routes to). Not owned.
  std::map<std::string, Driver*> Available() const;
  // Every registered driver, available or not, in registration order.
  const std::vector<Entry>& entries() const { return entries_; }

 private:
  Entry* Slot(std::string name, Tier tier);

  std::vector<Entry> entries_;
  std::vector<std::unique_ptr<Driver>> owned_;
};

const char* DriverTierName(DriverRegistry::Tier tier);

}  // namespace esb

#include "core/driver_registry.h"

#include <algorithm>

namespace esb {

DriverRegistry::Entry* DriverRegistry::Slot(std::string name, Tier tier) {
  auto it = std::find_if(entries_.begin(), entries_.end(),
                         [&](const Entry& e) { return e.name == name; });
  if (it == entries_.end()) {
    entries_.push_back(Entry{});
    it = entries_.end() - 1;
  }
  *it = Entry{};
  it->name = std::move(name);
  it->tier = tier;
  return &*it;
}

void DriverRegistry::Register(std::string name, Tier tier, const Probe& probe) {
  Entry* e = Slot(std::move(name), tier);
  absl::StatusOr<std::unique_ptr<Driver>> built = probe();
  if (!built.ok()) {
    e->unavailable = std::string(built.status().message());
    return;
  }
  if (*built == nullptr) {
    e->unavailable = "its probe built nothing";
    return;
  }
  e->driver = built->get();
  e->description = e->driver->Describe();
  owned_.push_back(std::move(*built));
}

void DriverRegistry::RegisterUnavailable(std::string name, Tier tier, std::string why) {
  Slot(std::move(name), tier)->unavailable = std::move(why);
}

const DriverRegistry::Entry* DriverRegistry::Lookup(std::string_view name) const {
  for (const Entry& e : entries_)
    if (e.name == name) return &e;
  return nullptr;
}

Driver* DriverRegistry::Find(std::string_view name) const {
  const Entry* e = Lookup(name);
  return e ? e->driver : nullptr;
}

std::map<std::string, Driver*> DriverRegistry::Available() const {
  std::map<std::string, Driver*> out;
  for (const Entry& e : entries_)
    if (e.driver) out[e.name] = e.driver;
  return out;
}

const char* DriverTierName(DriverRegistry::Tier tier) {
  return tier == DriverRegistry::Tier::kNano ? "nano" : "heavy";
}

}  // namespace esb

// The two enumerations every layer talks about: an environment's lifecycle state and the kind
// of driver (isolation technology) it runs on. Typed everywhere inside esbd; text only at the
// edges (SQLite rows, JSON specs, the API, logs) through ToString / Parse below.
#pragma once

#include <optional>
#include <string_view>

namespace esb {

enum class EnvState { kCreating, kPooled, kRunning, kDestroying, kDestroyed };

inline std::string_view ToString(EnvState state) {
  switch (state) {
    case EnvState::kCreating:
      return "creating";
    case EnvState::kPooled:
      return "pooled";
    case EnvState::kRunning:
      return "running";
    case EnvState::kDestroying:
      return "destroying";
    case EnvState::kDestroyed:
      return "destroyed";
  }
  return "destroyed";
}

inline std::optional<EnvState> ParseEnvState(std::string_view text) {
  for (EnvState s : {EnvState::kCreating, EnvState::kPooled, EnvState::kRunning,
                     EnvState::kDestroying, EnvState::kDestroyed})
    if (ToString(s) == text) return s;
  return std::nullopt;
}

// The driver an environment runs on ("runtime" in the API and the store).
enum class DriverKind { kContainer, kGvisor, kNano, kMicrovm };

inline std::string_view ToString(DriverKind kind) {
  switch (kind) {
    case DriverKind::kContainer:
      return "container";
    case DriverKind::kGvisor:
      return "gvisor";
    case DriverKind::kNano:
      return "nano";
    case DriverKind::kMicrovm:
      return "microvm";
  }
  return "container";
}

inline std::optional<DriverKind> ParseDriverKind(std::string_view text) {
  for (DriverKind k :
       {DriverKind::kContainer, DriverKind::kGvisor, DriverKind::kNano, DriverKind::kMicrovm})
    if (ToString(k) == text) return k;
  return std::nullopt;
}

}  // namespace esb

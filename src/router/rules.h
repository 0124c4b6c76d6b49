// Routing rules for `runtime: "auto"`: which tier (nano or heavy) runs a snippet, decided from
// its imports (router/imports.h) and the request. Routing is an optimisation, never a security
// decision: both tiers are isolated. Rules live in a JSON file (config/router.json), reloadable.
//
// File format (every key but the "_"-prefixed comments is checked; unknown keys are errors):
//   {"version": 1,
//    "default_for_unknown": "heavy" | "nano",   // module in neither list
//    "heavy_modules": ["numpy", "urllib.request", ...],  // only the heavy tier has these
//    "nano_modules": ["json", "re", "urllib", ...],       // nano provides these
//    "heavy_capabilities": ["os.system", ...],   // optional; ImportScan::capabilities entries
//    "packages_force_heavy": true,               // optional (default true)
//    "dynamic_import": "heavy" | "nano",         // optional (default "heavy")
//    "relative_import": "heavy" | "nano"}        // optional (default "heavy")
// A dotted name is classified by its longest listed prefix: with "urllib" in nano_modules and
// "urllib.request" in heavy_modules, `import urllib.parse` is nano, `from urllib import request`
// is heavy.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "router/imports.h"

namespace esb::router {

enum class Tier { kNano, kHeavy };
std::string_view TierName(Tier tier);  // "nano" / "heavy"

struct RouteRequest {
  // "auto" or "" → decided by the rules; "nano" → nano; anything else ("heavy", "container",
  // "gvisor", "microvm") → heavy. The API validates the value and rejects nano + packages.
  std::string runtime_hint;
  std::vector<std::string> packages;
  std::string requirements;  // requirements.txt text; counts if any non-comment line
};

struct RouteDecision {
  Tier tier = Tier::kHeavy;
  // Short and human-readable: "imports: json, re", "numpy needs heavy", "packages requested",
  // "dynamic import", "unknown module: foo", "no imports", "runtime nano requested".
  std::string reason;
  std::string_view tier_name() const { return TierName(tier); }
};

class RouterRules {
 public:
  // Errors are InvalidArgument and name the offending key (and entry).
  static absl::StatusOr<RouterRules> Parse(std::string_view json);
  // Parse() of a file; errors are prefixed with the path.
  static absl::StatusOr<RouterRules> Load(const std::string& path);

  // Order: explicit runtime hint; packages/requirements; heavy modules; heavy capabilities;
  // dynamic import; relative import; unknown modules (default_for_unknown); else nano.
  RouteDecision Decide(const ImportScan& scan, const RouteRequest& request) const;

  Tier default_for_unknown() const { return default_for_unknown_; }

 private:
  enum class Class { kUnknown, kNano, kHeavy };
  // Longest listed dotted prefix of `name`; the matched entry goes to *entry.
  Class Classify(std::string_view name, std::string* entry) const;

  std::unordered_map<std::string, Tier> modules_;
  std::unordered_set<std::string> heavy_capabilities_;
  Tier default_for_unknown_ = Tier::kHeavy;
  Tier dynamic_import_ = Tier::kHeavy;
  Tier relative_import_ = Tier::kHeavy;
  bool packages_force_heavy_ = true;
};

// Holds the current rules and reloads the file when its mtime, size or inode changes, checking
// at most once per second. An invalid new file keeps the old rules; the error is returned by
// MaybeReload(), kept in last_error() and logged once per file version.
class RulesHolder {
 public:
  using Clock = std::function<int64_t()>;  // monotonic milliseconds

  // Fails if the file cannot be loaded now.
  static absl::StatusOr<std::unique_ptr<RulesHolder>> Create(std::string path,
                                                             Clock clock = nullptr);

  // The rules to use for one decision (after a rate-limited change check). Thread-safe.
  std::shared_ptr<const RouterRules> Current();

  // Checks the file now if at least a second has passed since the last check (or `force`).
  // OK if unchanged or reloaded; the load error if the changed file is invalid.
  absl::Status MaybeReload(bool force = false);

  absl::Status last_error() const;

 private:
  struct FileId {
    int64_t mtime_ns = -1;
    int64_t size = -1;
    uint64_t inode = 0;
    bool operator==(const FileId&) const = default;
  };
  RulesHolder(std::string path, Clock clock) : path_(std::move(path)), clock_(std::move(clock)) {}
  absl::Status CheckLocked(bool force);

  const std::string path_;
  const Clock clock_;
  mutable std::mutex mu_;
  std::shared_ptr<const RouterRules> rules_;
  FileId seen_;
  int64_t last_check_ms_ = 0;
  absl::Status last_error_;
};

}  // namespace esb::router

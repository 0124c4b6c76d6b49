// `packages: [...]` on the run endpoints: installs Python distributions into a container
// environment before the code runs, without giving the sandbox any network.
//
// The sandbox's network stays closed. esbd itself fetches wheels from the one package index
// the operator configured (packages.index_url: a local or corporate PEP 503 mirror), caches
// them on the host per (package, version, python) (packages/wheel_cache.h), copies them into
// the sandbox and runs pip there with --no-index --find-links, as appuser, into ~/.local.
// pip resolves dependencies: when it reports "No matching distribution found for X", X is
// fetched the same way and pip runs again (bounded rounds). A second environment asking for
// the same packages installs them from the host cache without touching the network.
// For a governed environment (a network policy) every fetch goes through that environment's
// egress proxy instead, and a cache hit is handed over only if its policy allows the file's
// host (EnvironmentManager::HostFetchEgressFor, WheelCache::Egress).
//
// Everything that comes out of the sandbox (the probe's answer, pip's output) is the sandbox
// user's to forge: it is parsed without regexes or recursion, bounded, and never widens what
// the request asked for beyond one fetched dependency per round. A requirement with extras
// ("pandas[excel]") always goes through pip, which fetches what the extras need.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/environment_manager.h"
#include "packages/wheel_cache.h"

namespace esb::packages {

// One distribution a run asked for: provided by esbd (`from_cache`: from the host's wheel
// cache rather than the index) or already in the image (`preinstalled`).
struct InstalledPackage {
  std::string name;
  std::string version;
  bool from_cache = false;
  bool preinstalled = false;
};

class PackageInstaller {
 public:
  struct Options {
    int max_packages = 32;  // requirements per request
    int max_rounds = 40;    // pip runs per install (one per missing dependency)
    // The whole install, host-side fetches included (each passed the remaining time).
    int64_t timeout_ms = 600'000;
  };
  // `cache` may be null (no package index configured): then only requirements the image
  // already satisfies are accepted. Each wheel fetched over the network is audited
  // ("package.fetch", the audit trail of egress) through the manager's AuditLog.
  PackageInstaller(EnvironmentManager* manager, WheelCache* cache, Options options)
      : manager_(manager), cache_(cache), options_(options) {}

  // Checks the requirement strings without installing anything (InvalidArgument naming the
  // bad one).
  absl::Status Validate(const std::vector<std::string>& requirements) const;

  // Installs into environment `env_id` for `caller` (its steps are not audited one by one);
  // pip's output goes to `progress` as it runs. Answers one entry per distribution.
  absl::StatusOr<std::vector<InstalledPackage>> Install(
      const Caller& caller, const std::string& env_id, const std::vector<std::string>& requirements,
      const OutputSink& progress);

 private:
  EnvironmentManager* manager_;
  WheelCache* cache_;
  Options options_;
};

}  // namespace esb::packages

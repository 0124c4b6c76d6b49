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
//
// Everything that comes out of the sandbox (the probe's answer, pip's output) is the sandbox
// user's to forge: it is parsed without regexes or recursion, bounded, and never widens what
// the request asked for beyond one fetched dependency per round. A requirement with extras
// ("pandas[excel]") always goes through pip, which fetches what the extras need.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <boost/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/environment_manager.h"
#include "packages/wheel_cache.h"

namespace esb::api {

class PackageInstaller {
 public:
  struct Options {
    int max_packages = 32;      // requirements per request
    int max_rounds = 40;        // pip runs per install (one per missing dependency)
    // The whole install, host-side fetches included (each passed the remaining time).
    int64_t timeout_ms = 600'000;
  };
  // Called for each wheel fetched over the network (the audit trail of egress).
  using FetchAudit = std::function<void(const std::string& tenant, const std::string& env_id,
                                        const packages::Wheel& wheel)>;

  // `cache` may be null (no package index configured): then only requirements the image
  // already satisfies are accepted.
  PackageInstaller(EnvironmentManager* manager, packages::WheelCache* cache, Options options,
                   FetchAudit audit = nullptr)
      : manager_(manager), cache_(cache), options_(options), audit_(std::move(audit)) {}

  // Checks the requirement strings without installing anything (InvalidArgument naming the
  // bad one).
  absl::Status Validate(const std::vector<std::string>& requirements) const;

  // Installs into environment `env_id`; pip's output goes to `progress` as it runs. Answers
  // one entry per distribution: {name, version, from_cache} for wheels esbd provided, or
  // {name, version, preinstalled: true} for ones the image already had.
  absl::StatusOr<boost::json::array> Install(const std::string& tenant,
                                             const std::string& env_id,
                                             const std::vector<std::string>& requirements,
                                             const OutputSink& progress);

 private:
  EnvironmentManager* manager_;
  packages::WheelCache* cache_;
  Options options_;
  FetchAudit audit_;
};

}  // namespace esb::api

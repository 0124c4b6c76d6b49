// POST /run (one-shot Python) and POST /environments/{id}/run (stateful Python in a nano
// environment). One-shot runs go to the nano tier when it can serve them and to a throw-away
// container otherwise:
//   runtime "nano"            → nano only (an unsupported module is reported, not rerouted)
//   runtime "heavy"/"container" → a fresh container environment, destroyed afterwards
//   runtime "auto" (default)  → the adaptive router (router/rules.h) reads the code's imports
//                               without running it and picks a tier from config/router.json;
//                               if nano then reports a module or capability it cannot provide,
//                               the code reruns on heavy — safe because a one-shot nano run has
//                               no effects outside its own instance. `packages` force heavy.
// Routing is an optimisation, never a security decision: both tiers are isolated.
// Every answer says where it ran and why: {"tier": "nano", "reason": "..."}.
// Heavy runs go through kernel.py (heavy_kernel.h): the final expression's value, a DataFrame
// as a table, and artifacts (figures, files under /workspace/artifacts) copied into the host's
// ArtifactStore. `packages` are installed first by the PackageInstaller. With
// `Accept: text/event-stream` the output streams as SSE and the answer is the last event.
#pragma once

#include "api/http_server.h"
#include "api/package_installer.h"
#include "api/service.h"
#include "core/artifact_store.h"
#include "core/environment_manager.h"
#include "drivers/nano/nano_driver.h"
#include "router/rules.h"

namespace esb::api {

struct RunDeps {
  EnvironmentManager* manager = nullptr;
  ApiService* service = nullptr;
  NanoDriver* nano = nullptr;            // null: no nano tier on this host
  router::RulesHolder* rules = nullptr;  // null: no router (auto tries nano first, falls back)
  ArtifactStore* artifacts = nullptr;    // null: artifacts are reported as not kept
  PackageInstaller* installer = nullptr; // null: no package index, `packages` is refused
};

RunHandler MakeRunHandler(const RunDeps& deps);

}  // namespace esb::api

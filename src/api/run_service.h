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
#pragma once

#include "api/http_server.h"
#include "api/service.h"
#include "core/environment_manager.h"
#include "drivers/nano/nano_driver.h"
#include "router/rules.h"

namespace esb::api {

// `nano` may be null (no nano tier on this host); `rules` may be null (no router: auto tries
// nano first and falls back).
RunHandler MakeRunHandler(EnvironmentManager* manager, NanoDriver* nano,
                          router::RulesHolder* rules, ApiService* service);

}  // namespace esb::api

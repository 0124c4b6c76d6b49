// The one restart-cleanup policy: what becomes of each environment the store still records as
// live (not destroyed) when esbd starts, or when `esbd cleanup` runs with the daemon stopped.
//
//   state        start (kReattach)                        `esbd cleanup` (kDestroyAll)
//   running      re-attached; if that fails destroyed as   destroyed ("cleanup")
//                "sandbox_outdated" or "died_while_daemon_down"
//   pooled       destroyed ("pool_discarded_on_restart")   the same
//   creating     destroyed ("create_interrupted")          the same
//   destroying   destroyed (its reason, else "destroy_interrupted")
//   no driver    marked destroyed ("driver_unavailable_after_restart"): nothing can reach it
//
// A destroy the driver refuses leaves the record "destroying" with its reason: the next start
// or cleanup tries again (and a running daemon's reaper retries it), so a sandbox whose destroy
// failed is never forgotten while it may still exist.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "drivers/driver.h"
#include "storage/store.h"

namespace esb {

enum class RecoveryMode { kReattach, kDestroyAll };

struct RecoveredEnvironment {
  EnvironmentRecord record;
  InstanceRef ref;
  Driver* driver = nullptr;
};

struct RecoveryOutcome {
  std::vector<RecoveredEnvironment> attached;        // kReattach: running again
  std::vector<RecoveredEnvironment> destroy_failed;  // left "destroying" for a retry
  std::vector<std::string> destroyed;                // ids marked destroyed
};

// The reason a record found live is cleaned up, or "" when it is to be re-attached (only a
// running environment in kReattach mode whose driver exists). `attach` is the driver's answer
// to Attach (consulted only then).
std::string RestartCleanupReason(const EnvironmentRecord& record, bool has_driver,
                                 RecoveryMode mode, const absl::Status& attach);

// Applies the policy to every live record of `store`, with `drivers` (name → driver, not
// owned). Store write failures are logged; a failure to list the records is returned.
absl::StatusOr<RecoveryOutcome> RecoverEnvironments(Store* store,
                                                    const std::map<std::string, Driver*>& drivers,
                                                    RecoveryMode mode, int64_t now_ms);

}  // namespace esb

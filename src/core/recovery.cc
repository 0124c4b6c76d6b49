#include "core/recovery.h"

#include "absl/strings/str_cat.h"
#include "common/util.h"

namespace esb {

std::string RestartCleanupReason(const EnvironmentRecord& record, bool has_driver,
                                 RecoveryMode mode, const absl::Status& attach) {
  if (!has_driver) return "driver_unavailable_after_restart";
  if (record.state == EnvState::kRunning) {
    if (mode == RecoveryMode::kDestroyAll) return "cleanup";
    if (attach.ok()) return "";
    // SECURITY: an environment created by an older esbd keeps that esbd's sandbox layout (and
    // its weaknesses); it is destroyed rather than adopted.
    return IsSandboxOutdated(attach) ? "sandbox_outdated" : "died_while_daemon_down";
  }
  if (record.state == EnvState::kPooled) return "pool_discarded_on_restart";
  if (record.state == EnvState::kCreating) return "create_interrupted";
  return record.destroy_reason.empty() ? "destroy_interrupted" : record.destroy_reason;
}

absl::StatusOr<RecoveryOutcome> RecoverEnvironments(Store* store,
                                                    const std::map<std::string, Driver*>& drivers,
                                                    RecoveryMode mode, int64_t now_ms) {
  auto live = store->ListLiveEnvironments();
  if (!live.ok()) return live.status();
  RecoveryOutcome out;
  auto persist = [store](const EnvironmentRecord& rec) {
    if (absl::Status st = store->PutEnvironment(rec); !st.ok())
      LogError(absl::StrCat("persisting environment ", rec.id, ": ", st.ToString()));
  };
  for (EnvironmentRecord& rec : *live) {
    auto it = drivers.find(rec.runtime);
    Driver* driver = it == drivers.end() ? nullptr : it->second;
    InstanceRef ref{rec.id, rec.runtime, rec.driver_state};
    absl::Status attach = absl::OkStatus();
    if (driver && rec.state == EnvState::kRunning && mode == RecoveryMode::kReattach) {
      attach = driver->Attach(ref);
    }
    std::string reason = RestartCleanupReason(rec, driver != nullptr, mode, attach);
    if (reason.empty()) {
      out.attached.push_back({rec, ref, driver});
      continue;
    }
    if (!attach.ok()) {
      LogWarn(absl::StrCat("environment ", rec.id, " could not be re-attached (", reason,
                           "): ", attach.ToString()));
    }
    if (driver) {
      if (absl::Status st = driver->Destroy(ref); !st.ok()) {
        LogWarn(absl::StrCat("cleanup of ", rec.id, " failed (will retry): ", st.ToString()));
        rec.state = EnvState::kDestroying;
        rec.destroy_reason = reason;
        persist(rec);
        out.destroy_failed.push_back({rec, ref, driver});
        continue;
      }
    }
    rec.state = EnvState::kDestroyed;
    rec.destroyed_ms = now_ms;
    rec.destroy_reason = reason;
    persist(rec);
    // A governed environment's egress state (its CA key) goes with it (no-op for the others).
    if (absl::Status st = store->DeleteEgress(rec.id); !st.ok())
      LogError(absl::StrCat("deleting egress state of ", rec.id, ": ", st.ToString()));
    out.destroyed.push_back(rec.id);
  }
  return out;
}

}  // namespace esb

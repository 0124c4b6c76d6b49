// Time travel (issue 13; docs/design.md "Time travel"): the types the core's step log shows
// the API. The log itself is EnvironmentManager's (environment_manager_steps.cc): each mutating
// call on an environment whose capture is on becomes a step with the state its driver captured
// (Driver::CaptureStep), stored in the steps table (storage) and the blob store (blob_store.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/snapshots/manifest.h"
#include "storage/store.h"

namespace esb {

// Per-environment settings (the `steps` object at create; defaults as docs/api.md "Steps").
struct StepSettings {
  bool capture = true;
  int64_t max_steps = 200;                 // steps that keep their state
  int64_t max_bytes = int64_t{512} << 20;  // bytes of blobs and snapshots they add
  int64_t max_live_memory = 16;            // live memory snapshots (older: compacted)
  int64_t ttl_s = 0;                       // 0: as long as the environment
};
// Bounds of each setting (the API refuses values outside, 400).
inline constexpr int64_t kMaxStepsSetting = 10000;
inline constexpr int64_t kMaxStepBytesSetting = int64_t{64} << 30;
inline constexpr int64_t kMaxLiveMemorySetting = 256;
inline constexpr int64_t kMaxStepTtlSetting = 365LL * 86400;
// Step rows kept per environment at most (summaries of collected steps included): beyond it
// the oldest collected rows are deleted (step 0 stays).
inline constexpr int64_t kMaxStepRowsPerEnvironment = 2000;
// Caps of what a step stores about its call.
inline constexpr size_t kMaxStepSummaryBytes = 1024;
inline constexpr size_t kMaxStepInputBytes = 16 * 1024;
inline constexpr size_t kMaxStepOutputBytes = 16 * 1024;  // per stream: the tail
inline constexpr size_t kMaxStepDiffBytes = 256 * 1024;
inline constexpr int64_t kMaxStepDiffFileBytes = 1 << 20;

std::string StepSettingsToJson(const StepSettings& settings);
absl::StatusOr<StepSettings> StepSettingsFromJson(const std::string& json);
// InvalidArgument naming the setting that is out of bounds.
absl::Status ValidateStepSettings(const StepSettings& settings);

// An environment's time travel as its JSON shows it.
struct StepsStatus {
  bool capture = false;  // effective: requested and the runtime has the steps capability
  std::optional<int64_t> head;
  int64_t count = 0;
  std::string memory = "none";  // "snapshot" when the runtime takes memory snapshots here
  std::string memory_reason;    // why not (or why capture is off)
};

struct StepPage {
  std::vector<StepRecord> steps;  // newest first
  std::vector<bool> on_head;      // per step: an ancestor of (or) the head
  std::optional<int64_t> head;
  std::optional<int64_t> next_before;
};

struct StepDetail {
  StepRecord record;
  bool on_head = false;
  std::string variables_json;  // "" = null
  bool has_files = false;      // false: no manifest (the step has no state)
  WorkspaceManifest files;
  std::vector<ManifestChange> changes;
  std::vector<AuditEntry> audit;   // the environment's rows in the step's time window
  std::vector<AuditEntry> egress;  // its egress rows in that window
  std::string cwd;                 // from the shell state, when it says
};

struct StepFileDiff {
  std::string path;
  std::string change;  // "added" | "modified" | "deleted" | "unchanged"
  bool binary = false;
  bool truncated = false;
  std::string diff;
};

// A file whose blob was collected by retention: 410 at the API.
absl::Status StepCollectedError(std::string_view message);
bool IsStepCollected(const absl::Status& status);

}  // namespace esb

// Time travel (issue 13; docs/design.md "Time travel"): the types the core's step log shows
// the API. The log itself is EnvironmentManager's (environment_manager_steps.cc): each mutating
// call on an environment whose capture is on becomes a step with the state its driver captured
// (Driver::CaptureStep), stored in the steps table (storage) and the blob store (blob_store.h).
#pragma once

#include <cstdint>
#include <functional>
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
// Files and changes one GET of a step shows (the rest: in windows, StepListWindow).
inline constexpr int64_t kDefaultStepFilesListed = 1000;
inline constexpr int64_t kMaxStepFilesListed = 10000;

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

// A window of a step's file tree or changes, by path (byte order): the paths after `after`
// ("" = from the first), at most `limit` (1..kMaxStepFilesListed).
struct StepListWindow {
  std::string after;
  int64_t limit = kDefaultStepFilesListed;
};

struct StepDetail {
  StepRecord record;
  bool on_head = false;
  std::string variables_json;  // "" = null
  bool has_files = false;      // false: no manifest (the step has no state)
  WorkspaceManifest files;     // the window asked for
  int64_t files_total = 0;     // entries in the whole tree
  std::optional<std::string> files_next;  // more after this path (the next window's `after`)
  std::vector<ManifestChange> changes;    // the window asked for
  int64_t changes_total = 0;
  std::optional<std::string> changes_next;
  std::vector<AuditEntry> audit;   // the environment's rows in the step's time window
  std::vector<AuditEntry> egress;  // its egress rows in that window
  std::string cwd;                 // from the shell state, when it says
};

// A file of a step, read in ranges (the files route streams it; esbd never holds it whole).
struct StepFile {
  int64_t size = 0;
  bool symlink = false;
  std::string target;  // a symlink's link text (its whole answer)
  // At most `length` bytes from `offset` (a file); StepCollectedError (410) when its blob went,
  // DataLoss when it is corrupt (verified when reading from offset 0).
  std::function<absl::StatusOr<std::string>(int64_t offset, int64_t length)> read;
};

struct StepFileDiff {
  std::string path;
  // "added" | "modified" | "deleted"; empty: the same at the step and its parent (the API
  // says null, with an empty diff).
  std::string change;
  bool binary = false;
  bool truncated = false;
  std::string diff;
};

// A file whose blob was collected by retention: 410 at the API.
absl::Status StepCollectedError(std::string_view message);
bool IsStepCollected(const absl::Status& status);
// A stored part of a step's state (`what`: "the contents of 'p' at step n") that cannot be
// read: NotFound → StepCollectedError; DataLoss → logged, DataLoss (410 "corrupt" at the API);
// anything else unchanged.
absl::Status StepStateGone(const absl::Status& status, std::string_view what);

}  // namespace esb

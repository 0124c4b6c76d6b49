// Internal to the core (environment_manager*.cc): a mutating call's step in progress.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "core/environment_manager.h"

namespace esb {

struct StepGuard {
  std::shared_ptr<EnvironmentManager::LiveEnv> env;
  std::unique_lock<std::recursive_timed_mutex> lock;
  StepRecord rec;  // kind, summary, started_ms, detail_json's input filled by BeginStep
  int64_t t0_mono = 0;
  bool thread_marked = false;  // this guard marked its thread as inside a step of env
  const void* previous = nullptr;
  ~StepGuard();
};

// What a call's outcome says about its step.
struct StepOutcome {
  absl::Status status;
  std::optional<int64_t> exit_code;
  std::string error;  // beyond status: e.g. a Python exception
  std::string stdout_data, stderr_data;
  bool truncated = false;
  std::string artifacts_json;  // JSON array, "" = []
  std::string tier;
};

// Restores this thread's "inside a step of" mark to `previous` (a guard handed to another
// owner, e.g. a file transfer, marks no thread).
void ResetStepThread(const void* previous);

// Fills the step's outcome fields (status, exit code, error, output tails, duration).
void ApplyStepOutcome(StepGuard& guard, const StepOutcome& outcome);

}  // namespace esb

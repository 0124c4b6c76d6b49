#include "drivers/driver.h"

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace esb {
namespace {
constexpr char kMissingCapabilityUrl[] = "type.entersandbox/missing_capability";
}  // namespace

std::string_view NetworkPolicyName(const NetworkPolicy& policy) {
  switch (policy.kind) {
    case NetworkPolicy::Kind::kNone:
      return "none";
    case NetworkPolicy::Kind::kGoverned:
      return "governed";
  }
  return "none";
}

std::optional<NetworkPolicy> ParseNetworkPolicy(std::string_view name) {
  if (name == "none") return NetworkPolicy{NetworkPolicy::Kind::kNone};
  if (name == "governed") return NetworkPolicy{NetworkPolicy::Kind::kGoverned};
  return std::nullopt;
}

std::string_view CapabilityName(Capability capability) {
  switch (capability) {
    case Capability::kExec:
      return "exec";
    case Capability::kFiles:
      return "files";
    case Capability::kPythonSession:
      return "python_session";
    case Capability::kPythonOneShot:
      return "python_oneshot";
    case Capability::kSnapshot:
      return "snapshot";
    case Capability::kFork:
      return "fork";
    case Capability::kPause:
      return "pause";
    case Capability::kEgress:
      return "egress";
    case Capability::kTerminal:
      return "terminal";
    case Capability::kVolumes:
      return "volumes";
    case Capability::kSteps:
      return "steps";
    case Capability::kProcesses:
      return "processes";
  }
  return "unknown";
}

std::vector<std::string> CapabilitySet::Names() const {
  std::vector<std::string> out;
  for (Capability c : kAllCapabilities)
    if (Has(c)) out.emplace_back(CapabilityName(c));
  return out;
}

// What lacking a capability means for the user, after the capability's name.
std::string_view CapabilityHint(Capability capability) {
  switch (capability) {
    case Capability::kExec:
      return " (its environments have no shell; run Python with POST /environments/{id}/run)";
    case Capability::kPythonSession:
      return " (its environments run no Python cells; use /execute)";
    case Capability::kEgress:
      return " (its environments have no network at all: a network policy needs runtime "
             "'container'; or create this one with \"network\": \"none\")";
    default:
      return "";
  }
}

absl::Status MissingCapabilityError(std::string_view driver, Capability capability) {
  absl::Status st = absl::UnimplementedError(absl::StrCat(
      "the '", std::string(driver), "' runtime lacks the capability '",
      std::string(CapabilityName(capability)), "'", std::string(CapabilityHint(capability))));
  st.SetPayload(kMissingCapabilityUrl, absl::Cord(std::string(CapabilityName(capability))));
  return st;
}

bool IsMissingCapability(const absl::Status& status) {
  return status.GetPayload(kMissingCapabilityUrl).has_value();
}

std::string_view SnapshotContentName(SnapshotContent content) {
  switch (content) {
    case SnapshotContent::kMemory:
      return "memory";
    case SnapshotContent::kDisk:
      return "disk";
    case SnapshotContent::kMemoryAndDisk:
      return "memory+disk";
  }
  return "memory+disk";
}

absl::StatusOr<RunResult> Driver::RunCode(const InstanceRef* ref, const RunRequest&,
                                          const OutputSink&) {
  return MissingCapabilityError(name(),
                                ref ? Capability::kPythonSession : Capability::kPythonOneShot);
}

absl::StatusOr<SnapshotRef> Driver::Snapshot(const InstanceRef&, SnapshotContent) {
  return MissingCapabilityError(name(), Capability::kSnapshot);
}

absl::StatusOr<InstanceRef> Driver::Restore(const SnapshotRef&, const std::string&) {
  return MissingCapabilityError(name(), Capability::kSnapshot);
}

absl::Status Driver::DeleteSnapshot(const SnapshotRef&) {
  return MissingCapabilityError(name(), Capability::kSnapshot);
}

absl::StatusOr<InstanceRef> Driver::Fork(const InstanceRef&, const std::string&) {
  return MissingCapabilityError(name(), Capability::kFork);
}

absl::StatusOr<StepState> Driver::CaptureStep(const InstanceRef&, const CaptureOptions&,
                                              BlobStore&) {
  return MissingCapabilityError(name(), Capability::kSteps);
}

absl::StatusOr<InstanceRef> Driver::RestoreStep(const InstanceRef&, const StepState&, BlobStore&) {
  return MissingCapabilityError(name(), Capability::kSteps);
}

absl::StatusOr<InstanceRef> Driver::ForkStep(const StepState& state, const EnvSpec& spec,
                                             const std::string& new_id, BlobStore& blobs) {
  if (!Capabilities().Has(Capability::kSteps))
    return MissingCapabilityError(name(), Capability::kSteps);
  absl::StatusOr<InstanceRef> created = Create(new_id, spec);
  if (!created.ok()) return created.status();
  absl::StatusOr<InstanceRef> restored = RestoreStep(*created, state, blobs);
  if (!restored.ok()) (void)Destroy(*created);
  return restored;
}

absl::StatusOr<SnapshotRef> Driver::CompactSnapshot(const SnapshotRef&) {
  return absl::UnimplementedError(
      absl::StrCat("the '", name(), "' runtime keeps memory snapshots only live"));
}

StepMemorySupport Driver::StepMemory() const {
  return {.available = false, .mechanism = "", .reason = "this runtime has no memory snapshots"};
}

std::set<std::string> Driver::ReleasedSnapshots(const std::string&) { return {}; }

bool Driver::HasReleasedSnapshots() { return false; }

absl::Status Driver::Pause(const InstanceRef&) {
  return MissingCapabilityError(name(), Capability::kPause);
}

absl::Status Driver::Resume(const InstanceRef&) {
  return MissingCapabilityError(name(), Capability::kPause);
}

absl::Status Driver::CreateVolume(const std::string&, int64_t) {
  return MissingCapabilityError(name(), Capability::kVolumes);
}

absl::Status Driver::DeleteVolume(const std::string&) {
  return MissingCapabilityError(name(), Capability::kVolumes);
}

absl::StatusOr<std::unique_ptr<ProcessSession>> Driver::SpawnProcess(
    const InstanceRef&, const ProcessRequest& request) {
  return MissingCapabilityError(name(),
                                request.pty ? Capability::kTerminal : Capability::kProcesses);
}

absl::StatusOr<UniqueFd> Driver::OpenEgressListener(const InstanceRef&) {
  return MissingCapabilityError(name(), Capability::kEgress);
}

absl::StatusOr<UniqueFd> Driver::ConnectEgressProxy(const InstanceRef&, std::chrono::milliseconds,
                                                    const std::vector<uid_t>&) {
  return MissingCapabilityError(name(), Capability::kEgress);
}

}  // namespace esb

// Test helper: a Driver whose every call answers Unimplemented, so a test's fake overrides only
// the calls it is about (the registry's probes, the restart policy's Attach/Destroy).
#pragma once

#include <string>

#include "drivers/driver.h"

namespace esb::testing {

class StubDriver : public Driver {
 public:
  explicit StubDriver(std::string name = "stub") : name_(std::move(name)) {}
  std::string name() const override { return name_; }
  CapabilitySet Capabilities() const override { return {}; }
  std::string Describe() const override { return "stub " + name_; }
  absl::StatusOr<InstanceRef> Create(const std::string&, const EnvSpec&) override {
    return Unimplemented();
  }
  absl::Status Destroy(const InstanceRef&) override { return Unimplemented(); }
  absl::Status Attach(const InstanceRef&) override { return Unimplemented(); }
  absl::StatusOr<ExecResult> Exec(const InstanceRef&, const ExecRequest&,
                                  const OutputSink&) override {
    return Unimplemented();
  }
  absl::Status WriteFile(const InstanceRef&, const std::string&, std::string_view, int64_t,
                         bool) override {
    return Unimplemented();
  }
  absl::StatusOr<FileChunk> ReadFile(const InstanceRef&, const std::string&, int64_t,
                                     int64_t) override {
    return Unimplemented();
  }
  absl::StatusOr<DirListing> ListDir(const InstanceRef&, const std::string&) override {
    return Unimplemented();
  }
  absl::StatusOr<FileEntry> Stat(const InstanceRef&, const std::string&) override {
    return Unimplemented();
  }
  absl::StatusOr<bool> MakeDir(const InstanceRef&, const std::string&) override {
    return Unimplemented();
  }
  absl::Status Remove(const InstanceRef&, const std::string&, bool) override {
    return Unimplemented();
  }
  absl::Status Rename(const InstanceRef&, const std::string&, const std::string&,
                      bool) override {
    return Unimplemented();
  }
  absl::StatusOr<Usage> Stats(const InstanceRef&) override { return Unimplemented(); }
  absl::Status Configure(const InstanceRef&, const std::map<std::string, std::string>&) override {
    return Unimplemented();
  }

 private:
  static absl::Status Unimplemented() { return absl::UnimplementedError("stub driver"); }
  std::string name_;
};

}  // namespace esb::testing

// Test helper: a fake Driver for core tests (no sandboxes): instances in a set, in-memory files,
// scripted Exec and RunCode, configurable capabilities, and process sessions (terminals) that
// record their input and kills, or that a test's `spawn` hook makes. Fields are public for tests to
// script and inspect (under `mu`).
#pragma once

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "drivers/driver.h"

namespace esb::testing {

// What the terminal sessions of a FakeDriver did.
struct SessionLog {
  std::atomic<int> kills{0};
  std::atomic<int> inputs{0};
  std::atomic<int> busy_inputs{0};  // Input answers Unavailable this many more times
  std::atomic<int> exit_code{-1};   // >= 0: Wait reports this exit
};

class FakeSession : public ProcessSession {
 public:
  explicit FakeSession(SessionLog* log) : log_(log) {}
  ~FakeSession() override { Kill().IgnoreError(); }
  absl::Status Input(std::string_view, bool) override {
    ++log_->inputs;
    if (log_->busy_inputs.load() > 0) {
      --log_->busy_inputs;
      return absl::UnavailableError("EAGAIN: input queue full");
    }
    return absl::OkStatus();
  }
  absl::Status Resize(int, int) override { return absl::OkStatus(); }
  absl::StatusOr<std::optional<int>> Wait(int, const OutputSink& sink) override {
    if (sink) sink(Stream::kStdout, "$ ");
    if (log_->exit_code.load() >= 0) return std::optional<int>(log_->exit_code.load());
    return std::optional<int>();
  }
  absl::Status Kill() override {
    if (!killed_) ++log_->kills;
    killed_ = true;
    return absl::OkStatus();
  }

 private:
  SessionLog* log_;
  bool killed_ = false;
};

class FakeDriver : public Driver {
 public:
  FakeDriver(std::string name, CapabilitySet caps) : caps(caps), name_(std::move(name)) {}
  std::string name() const override { return name_; }
  std::string Describe() const override { return "fake " + name_; }
  CapabilitySet Capabilities() const override { return caps; }
  absl::StatusOr<InstanceRef> Create(const std::string& id, const EnvSpec& spec) override {
    std::lock_guard<std::mutex> lock(mu);
    if (fail_create) return absl::UnavailableError("create failed");
    alive.insert(id);
    ++creates;
    last_spec = spec;
    return InstanceRef{id, name_, "{}"};
  }
  absl::Status Destroy(const InstanceRef& ref) override {
    std::lock_guard<std::mutex> lock(mu);
    alive.erase(ref.id);
    return absl::OkStatus();
  }
  absl::Status Attach(const InstanceRef&) override { return absl::OkStatus(); }
  absl::StatusOr<ExecResult> Exec(const InstanceRef&, const ExecRequest& req,
                                  const OutputSink&) override {
    std::lock_guard<std::mutex> lock(mu);
    execs.push_back(req.command);
    ExecResult r;
    r.exit_code = exec_exit_code;
    r.stderr_data = "no pip here";
    return r;
  }
  absl::Status WriteFile(const InstanceRef& ref, const std::string& path, std::string_view data,
                         int64_t offset, bool truncate) override {
    std::lock_guard<std::mutex> lock(mu);
    std::string& f = files[ref.id + ":" + path];
    if (truncate) f.clear();
    f.resize(std::max<size_t>(f.size(), offset + data.size()));
    f.replace(offset, data.size(), data);
    return absl::OkStatus();
  }
  absl::StatusOr<FileChunk> ReadFile(const InstanceRef& ref, const std::string& path,
                                     int64_t offset, int64_t length) override {
    std::lock_guard<std::mutex> lock(mu);
    auto it = files.find(ref.id + ":" + path);
    if (it == files.end()) return absl::NotFoundError("no such file");
    FileChunk c;
    c.file_size = static_cast<int64_t>(it->second.size());
    c.data = it->second.substr(std::min<size_t>(offset, it->second.size()), length);
    c.eof = offset + static_cast<int64_t>(c.data.size()) >= c.file_size;
    return c;
  }
  absl::StatusOr<DirListing> ListDir(const InstanceRef&, const std::string&) override {
    return absl::NotFoundError("no dir");
  }
  absl::StatusOr<FileEntry> Stat(const InstanceRef&, const std::string&) override {
    return absl::NotFoundError("no file");
  }
  absl::StatusOr<bool> MakeDir(const InstanceRef&, const std::string&) override { return true; }
  absl::Status Remove(const InstanceRef&, const std::string&, bool) override {
    return absl::OkStatus();
  }
  absl::Status Rename(const InstanceRef&, const std::string&, const std::string&, bool) override {
    return absl::OkStatus();
  }
  absl::StatusOr<Usage> Stats(const InstanceRef&) override { return Usage{.alive = true}; }
  absl::Status Configure(const InstanceRef&, const std::map<std::string, std::string>&) override {
    return absl::OkStatus();
  }
  absl::StatusOr<RunResult> RunCode(const InstanceRef* ref, const RunRequest& request,
                                    const OutputSink&) override {
    {
      std::lock_guard<std::mutex> lock(mu);
      runs.push_back({ref ? ref->id : "", request.once});
    }
    if (run_error) return *run_error;
    RunResult r;
    r.exit_code = 0;
    r.stdout_data = "ran on " + name_;
    if (name_ == "nano" && absl::StrContains(request.code, "import numpy")) {
      r.exit_code = 1;
      r.unsupported_module = "numpy";
    }
    if (ref && !report.empty()) {
      // Like kernel.py: the files exist while the caller collects them.
      for (const ReportedArtifact& a : report)
        WriteFile(*ref, a.path, "PNGDATA", 0, true).IgnoreError();
      if (request.on_artifacts) request.on_artifacts(report);
    }
    return r;
  }

  absl::StatusOr<std::unique_ptr<ProcessSession>> SpawnProcess(
      const InstanceRef& ref, const ProcessRequest& request) override {
    if (!caps.Has(request.pty ? Capability::kTerminal : Capability::kProcesses))
      return MissingCapabilityError(name_,
                                    request.pty ? Capability::kTerminal : Capability::kProcesses);
    {
      std::lock_guard<std::mutex> lock(mu);
      last_request = request;
    }
    if (fail_open) return absl::UnavailableError("agent gone");
    if (spawn) return spawn(ref, request);
    return std::unique_ptr<ProcessSession>(new FakeSession(&log));
  }

  CapabilitySet caps;
  std::mutex mu;
  std::set<std::string> alive;
  int creates = 0;
  bool fail_create = false;
  EnvSpec last_spec;
  int exec_exit_code = 1;
  std::vector<std::string> execs;
  std::map<std::string, std::string> files;
  std::vector<std::pair<std::string, bool>> runs;  // (environment id or "", once)
  std::optional<absl::Status> run_error;
  std::vector<ReportedArtifact> report;
  SessionLog log;  // of the terminals
  ProcessRequest last_request;
  bool fail_open = false;  // SpawnProcess fails
  // Makes the sessions of SpawnProcess when set (else FakeSession). Set before use.
  std::function<absl::StatusOr<std::unique_ptr<ProcessSession>>(const InstanceRef&,
                                                                const ProcessRequest&)>
      spawn;

 private:
  std::string name_;
};

}  // namespace esb::testing

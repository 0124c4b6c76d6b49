// The run pipeline's decisions (tier choice, nano → heavy fallback, throw-away environments and
// their cleanup on every path, packages, limits, capabilities, audit) with fake drivers: no
// root, no sandboxes.
#include "core/run/run_pipeline.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <mutex>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "drivers/testing/fake_driver.h"

namespace esb::run {
namespace {

using FakeTier = esb::testing::FakeDriver;

class RunPipelineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    StoreOptions sopts;
    auto s = Store::Open(":memory:", sopts);
    ASSERT_TRUE(s.ok()) << s.status();
    store = std::move(*s);
    Reset({});
  }
  void Reset(ManagerOptions opts) {
    opts.pool_size = 0;
    drivers = {{"nano", &nano}, {"container", &heavy}, {"gvisor", &shell_only}};
    manager = std::make_unique<EnvironmentManager>(store.get(), drivers, &metrics, opts);
    installer = std::make_unique<packages::PackageInstaller>(manager.get(), nullptr,
                                                             packages::PackageInstaller::Options{});
    pipeline = std::make_unique<RunPipeline>(
        RunDeps{.manager = manager.get(), .installer = installer.get()});
  }
  absl::StatusOr<RunOutcome> Run(RunSpec spec, const Caller& caller = Caller("acme")) {
    auto plan = pipeline->Prepare(caller, std::move(spec));
    if (!plan.ok()) return plan.status();
    return pipeline->Execute(caller, *plan, RunStreams{});
  }
  RunSpec Code(std::string code, std::string runtime = "") {
    RunSpec s;
    s.code = std::move(code);
    s.runtime = std::move(runtime);
    return s;
  }
  std::vector<AuditEntry> AuditRows() {
    AuditQuery q;
    q.tenant = "acme";
    q.limit = 1000;
    return store->QueryAudit(q).value_or(std::vector<AuditEntry>{});
  }

  std::unique_ptr<Store> store;
  Metrics metrics;
  FakeTier nano{"nano",
                {Capability::kFiles, Capability::kPythonSession, Capability::kPythonOneShot}};
  FakeTier heavy{"container", {Capability::kExec, Capability::kFiles, Capability::kPythonSession}};
  FakeTier shell_only{"gvisor", {Capability::kExec, Capability::kFiles}};
  std::map<std::string, Driver*> drivers;
  std::unique_ptr<EnvironmentManager> manager;
  std::unique_ptr<packages::PackageInstaller> installer;
  std::unique_ptr<RunPipeline> pipeline;
};

TEST_F(RunPipelineTest, AutoWithoutRulesRunsOnNanoAndCreatesNoEnvironment) {
  auto o = Run(Code("print(1)"));
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->tier, "nano");
  EXPECT_EQ(o->reason, "auto: no routing rules, nano first");
  EXPECT_EQ(o->result.stdout_data, "ran on nano");
  EXPECT_EQ(heavy.creates, 0);
  ASSERT_EQ(nano.runs.size(), 1u);
  EXPECT_EQ(nano.runs[0].first, "") << "a one-shot nano run has no environment";
}

TEST_F(RunPipelineTest, AutoFallsBackToAThrowAwayHeavyEnvironmentWhichIsDestroyed) {
  auto o = Run(Code("import numpy\nnumpy.zeros(1)"));
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->tier, "heavy");
  EXPECT_TRUE(absl::StrContains(o->reason, "nano cannot provide 'numpy', reran on heavy"))
      << o->reason;
  EXPECT_EQ(o->result.stdout_data, "ran on container");
  EXPECT_EQ(heavy.creates, 1);
  ASSERT_EQ(heavy.runs.size(), 1u);
  EXPECT_TRUE(heavy.runs[0].second) << "a one-shot heavy run is a fresh process (once)";
  EXPECT_TRUE(heavy.alive.empty()) << "the throw-away environment is destroyed";
  auto listed = manager->List("acme", /*include_destroyed=*/true);
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].record.destroy_reason, "run_finished");
}

TEST_F(RunPipelineTest, RuntimeNanoReportsAnUnsupportedModuleAndDoesNotFallBack) {
  auto o = Run(Code("import numpy", "nano"));
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->tier, "nano");
  EXPECT_EQ(o->result.unsupported_module, "numpy");
  EXPECT_EQ(heavy.creates, 0);
}

TEST_F(RunPipelineTest, RuntimeHeavyGoesStraightToHeavyWithTheRequestedMemory) {
  RunSpec s = Code("print(1)", "heavy");
  s.memory_mb = 300;
  auto o = Run(s);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->tier, "heavy");
  EXPECT_EQ(o->reason, "runtime heavy requested");
  EXPECT_TRUE(nano.runs.empty());
  EXPECT_EQ(heavy.last_spec.memory_mb, 300);
  EXPECT_TRUE(heavy.alive.empty());
}

TEST_F(RunPipelineTest, ThrowAwayEnvironmentIsDestroyedWhenTheRunFails) {
  heavy.run_error = absl::UnavailableError("agent gone");
  auto o = Run(Code("print(1)", "heavy"));
  EXPECT_EQ(o.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(heavy.creates, 1);
  EXPECT_TRUE(heavy.alive.empty()) << "destroyed on the failure path too";
}

TEST_F(RunPipelineTest, ThrowAwayEnvironmentIsDestroyedWhenThePackageInstallFails) {
  RunSpec s = Code("import six", "heavy");
  s.packages = {"six"};
  heavy.exec_exit_code = 1;  // the installer's probe fails: pip is missing
  auto o = Run(s);
  EXPECT_EQ(o.status().code(), absl::StatusCode::kFailedPrecondition) << o.status();
  EXPECT_TRUE(absl::StrContains(o.status().message(), "installed packages")) << o.status();
  EXPECT_EQ(heavy.creates, 1);
  EXPECT_TRUE(heavy.runs.empty()) << "the code does not run when its packages failed";
  EXPECT_TRUE(heavy.alive.empty());
}

TEST_F(RunPipelineTest, AFailedCreateLeavesNothingBehind) {
  heavy.fail_create = true;
  auto o = Run(Code("print(1)", "heavy"));
  EXPECT_EQ(o.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(heavy.alive.empty());
  EXPECT_TRUE(heavy.runs.empty());
}

TEST_F(RunPipelineTest, ThrowAwayEnvironmentsCountAgainstTheTenantQuota) {
  ManagerOptions opts;
  opts.max_environments_per_tenant = 1;
  Reset(opts);
  ASSERT_TRUE(manager->Create("acme", EnvSpec{}, 0).ok());
  auto o = Run(Code("print(1)", "heavy"));
  EXPECT_EQ(o.status().code(), absl::StatusCode::kResourceExhausted) << o.status();
}

TEST_F(RunPipelineTest, PackagesNeedTheHeavyTier) {
  RunSpec s = Code("import six", "nano");
  s.packages = {"six"};
  EXPECT_EQ(Run(s).status().code(), absl::StatusCode::kInvalidArgument);
  s.runtime = "auto";  // auto without rules: packages force heavy
  heavy.exec_exit_code = 1;
  auto o = Run(s);
  EXPECT_EQ(heavy.creates, 1) << "went to heavy";
  EXPECT_TRUE(nano.runs.empty());
  s.packages = {"not a requirement!!"};
  EXPECT_EQ(Run(s).status().code(), absl::StatusCode::kInvalidArgument) << "validated first";
}

TEST_F(RunPipelineTest, AMissingTierIsATypedRefusal) {
  // Without the nano tier: runtime "nano" is refused as tier-unavailable.
  auto with_drivers = [&](std::map<std::string, Driver*> only) {
    pipeline.reset();
    installer.reset();
    drivers = std::move(only);
    ManagerOptions opts;
    opts.pool_size = 0;
    manager = std::make_unique<EnvironmentManager>(store.get(), drivers, &metrics, opts);
    pipeline = std::make_unique<RunPipeline>(RunDeps{.manager = manager.get()});
  };
  with_drivers({{"container", &heavy}});
  auto o = Run(Code("print(1)", "nano"));
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument) << o.status();
  EXPECT_TRUE(IsTierUnavailable(o.status())) << o.status();
  // Without the container driver: a heavy run is refused the same way.
  with_drivers({{"nano", &nano}});
  o = Run(Code("print(1)", "heavy"));
  EXPECT_TRUE(IsTierUnavailable(o.status())) << o.status();
  // Other refusals are not.
  RunSpec s = Code("print(1)");
  s.timeout_ms = 0;
  o = Run(s);
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(IsTierUnavailable(o.status()));
}

TEST_F(RunPipelineTest, PackagesWithoutAnInstallerAreRefused) {
  pipeline = std::make_unique<RunPipeline>(RunDeps{.manager = manager.get()});
  RunSpec s = Code("import six", "heavy");
  s.packages = {"six"};
  auto o = Run(s);
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(heavy.creates, 0);
}

TEST_F(RunPipelineTest, LimitsAreCheckedBeforeAnythingRuns) {
  RunSpec s = Code("print(1)");
  s.timeout_ms = 0;
  EXPECT_EQ(Run(s).status().code(), absl::StatusCode::kInvalidArgument);
  s.timeout_ms = kMaxRunTimeoutMs + 1;
  EXPECT_EQ(Run(s).status().code(), absl::StatusCode::kInvalidArgument);
  s.timeout_ms = 1000;
  s.memory_mb = 8;
  EXPECT_EQ(Run(s).status().code(), absl::StatusCode::kInvalidArgument);
  s.memory_mb = 0;
  s.figure_formats = {"gif"};
  EXPECT_EQ(Run(s).status().code(), absl::StatusCode::kInvalidArgument);
  s.figure_formats = {"svg"};
  s.runtime = "microvm";
  EXPECT_EQ(Run(s).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(nano.runs.empty());
  EXPECT_EQ(heavy.creates, 0);
}

TEST_F(RunPipelineTest, AllowedModulesRefuseOtherImportsAndDynamicOnes) {
  RunSpec s = Code("import os\nimport json");
  s.allowed_modules = std::vector<std::string>{"json"};
  auto o = Run(s);
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(o.status().message(), "os")) << o.status();
  s.code = "name = 'os'\nm = __import__(name)";
  EXPECT_EQ(Run(s).status().code(), absl::StatusCode::kInvalidArgument);
  s.code = "import json";
  EXPECT_TRUE(Run(s).ok());
}

TEST_F(RunPipelineTest, EnvironmentRunsUseTheEnvironmentsTier) {
  EnvSpec spec;
  spec.runtime = DriverKind::kNano;
  auto env = manager->Create("acme", spec, 0);
  ASSERT_TRUE(env.ok()) << env.status();
  RunSpec s = Code("x = 1");
  s.environment_id = env->record.id;
  auto o = Run(s);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->tier, "nano");
  EXPECT_EQ(o->reason, "stateful nano session");
  ASSERT_EQ(nano.runs.size(), 1u);
  EXPECT_EQ(nano.runs[0].first, env->record.id);
  s.packages = {"six"};
  EXPECT_EQ(Run(s).status().code(), absl::StatusCode::kInvalidArgument)
      << "no packages in a nano environment";
  // Another tenant's environment is not there.
  s.packages.clear();
  EXPECT_TRUE(IsEnvironmentNotFound(Run(s, Caller("evil")).status()));
}

TEST_F(RunPipelineTest, EnvironmentWithoutAPythonSessionIsRefusedNamingTheCapability) {
  EnvSpec spec;
  spec.runtime = DriverKind::kGvisor;
  auto env = manager->Create("acme", spec, 0);
  ASSERT_TRUE(env.ok()) << env.status();
  RunSpec s = Code("x = 1");
  s.environment_id = env->record.id;
  auto o = Run(s);
  ASSERT_FALSE(o.ok());
  EXPECT_TRUE(IsMissingCapability(o.status())) << o.status();
  EXPECT_EQ(o.status().code(), absl::StatusCode::kUnimplemented) << "a 400, never a 500";
  EXPECT_TRUE(absl::StrContains(o.status().message(), "python_session")) << o.status();
  EXPECT_TRUE(absl::StrContains(o.status().message(), "gvisor")) << o.status();
}

TEST_F(RunPipelineTest, HeavyArtifactsAreCopiedIntoTheStoreBeforeCleanup) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("esb-run-test-" + RandomHex(6))).string();
  ArtifactStore::Options aopts;
  aopts.dir = dir;
  auto store_or = ArtifactStore::Open(aopts);
  ASSERT_TRUE(store_or.ok()) << store_or.status();
  pipeline = std::make_unique<RunPipeline>(RunDeps{
      .manager = manager.get(), .artifacts = store_or->get(), .installer = installer.get()});
  heavy.report = {ReportedArtifact{.path = "/tmp/.esb-kernel/result-x-art/figure-1.png",
                                   .name = "figure-1.png",
                                   .kind = "image",
                                   .mime_type = "image/png"},
                  ReportedArtifact{.error = "figure 2 could not be saved"}};
  auto o = Run(Code("plot()", "heavy"));
  ASSERT_TRUE(o.ok()) << o.status();
  ASSERT_EQ(o->artifacts.size(), 1u);
  EXPECT_EQ(o->artifacts[0].name, "figure-1.png");
  EXPECT_EQ(o->artifacts[0].size, 7);
  EXPECT_EQ(o->artifacts[0].tenant, "acme");
  EXPECT_EQ(o->artifacts[0].step, 1) << "the run that produced it";
  ASSERT_EQ(o->artifact_errors.size(), 1u);
  EXPECT_EQ(o->artifact_errors[0], "figure 2 could not be saved");
  std::filesystem::remove_all(dir);
}

TEST_F(RunPipelineTest, ARunIsOneAuditRowWithItsCallerAndTier) {
  Caller who("acme", "key_1234", "rest");
  auto o = Run(Code("import numpy"), who);  // nano, then a throw-away heavy environment
  ASSERT_TRUE(o.ok()) << o.status();
  std::vector<AuditEntry> rows = AuditRows();
  ASSERT_EQ(rows.size(), 1u) << "create/run/destroy of the throw-away environment are steps";
  EXPECT_EQ(rows[0].action, "run");
  EXPECT_EQ(rows[0].principal, "key_1234");
  EXPECT_EQ(rows[0].detail, "[heavy] import numpy");
  EXPECT_EQ(rows[0].status, 200);
  ASSERT_TRUE(rows[0].exit_code.has_value());
  // A refused run (after Prepare) is audited with its outcome too.
  heavy.run_error = absl::UnavailableError("agent gone");
  EXPECT_FALSE(Run(Code("print(1)", "heavy"), who).ok());
  rows = AuditRows();
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].status, 503);
}

// Issue 12: "intent" on an environment run is active for the run only (pushed to the proxy
// before, removed after), and refused before anything runs when it cannot be.
class RecordingEgress : public EgressControl {
 public:
  absl::Status Attach(const EgressAttachment&) override { return absl::OkStatus(); }
  absl::Status Update(const std::string&, const governance::EgressPolicy&,
                      const std::vector<governance::ActiveIntent>& intents) override {
    std::string names;
    for (const auto& i : intents) names += i.name + ";";
    pushed.push_back(names);
    return absl::OkStatus();
  }
  void Detach(const std::string&) override {}
  EgressHealth Health() const override { return EgressHealth{}; }
  std::vector<std::string> pushed;  // the intents of each Update
};

TEST_F(RunPipelineTest, AnIntentIsActiveForTheRunOnly) {
  FakeTier governed{
      "container",
      {Capability::kExec, Capability::kFiles, Capability::kPythonSession, Capability::kEgress}};
  RecordingEgress egress;
  ManagerOptions opts;
  opts.pool_size = 0;
  opts.egress = &egress;
  opts.make_ca = []() -> absl::StatusOr<EgressCaPem> { return EgressCaPem{"CERT", "KEY"}; };
  opts.egress_config.intents =
      *governance::ParseIntentCatalogue(boost::json::parse(R"({"pip": {"allow": ["pypi.test"]}})"));
  drivers = {{"nano", &nano}, {"container", &governed}};
  manager = std::make_unique<EnvironmentManager>(store.get(), drivers, &metrics, opts);
  pipeline = std::make_unique<RunPipeline>(RunDeps{.manager = manager.get()});
  governance::EgressPolicy policy;
  EnvSpec spec;
  spec.runtime = DriverKind::kContainer;
  auto env = manager->Create("acme", spec, 0, &policy);
  ASSERT_TRUE(env.ok()) << env.status();
  RunSpec s = Code("import urllib.request");
  s.environment_id = env->record.id;
  s.intent = "pip";
  auto o = Run(s);
  ASSERT_TRUE(o.ok()) << o.status();
  ASSERT_EQ(governed.runs.size(), 1u) << "the run ran";
  EXPECT_EQ(egress.pushed, (std::vector<std::string>{"pip;", ""}));
  // Unknown intent: refused, nothing runs, the run's row records it.
  s.intent = "nope";
  EXPECT_EQ(Run(s).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(governed.runs.size(), 1u);
  EXPECT_EQ(AuditRows()[0].action, "run");
  EXPECT_EQ(AuditRows()[0].status, 400);
  // One-shot runs have no network.
  RunSpec once = Code("1");
  once.intent = "pip";
  auto refused = pipeline->Prepare("acme", once);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("needs an environment"), std::string::npos);
}

}  // namespace
}  // namespace esb::run

// api/mcp/esb_tools.h: esbd's own tools over the core with fake drivers — the catalogue,
// argument validation, tenants, streaming, images, DLP and the one audit row per call, and the
// hosted-tools tools with and without m-hosted's function.
#include "api/mcp/esb_tools.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <mutex>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"
#include "api/service.h"
#include "api/tools_catalog.h"
#include "core/driver_registry.h"
#include "drivers/testing/fake_driver.h"
#include "governance/dlp/dlp_test_util.h"
#include "packages/installer.h"
#include "storage/store.h"

namespace esb::api::mcp {
namespace {

namespace json = boost::json;
using tools::CallContext;
using tools::ToolResult;

// A heavy fake whose commands echo (streamed in two chunks) and whose directories list.
class EchoDriver : public esb::testing::FakeDriver {
 public:
  using FakeDriver::FakeDriver;
  absl::StatusOr<ExecResult> Exec(const InstanceRef& ref, const ExecRequest& req,
                                  const OutputSink& sink) override {
    {
      std::lock_guard<std::mutex> lock(mu);
      execs.push_back(req.command);
    }
    ExecResult r;
    r.exit_code = absl::StrContains(req.command, "false") ? 3 : 0;
    r.stdout_data = "out:" + req.command + "\n";
    if (sink) {
      sink(Stream::kStdout, "out:");
      sink(Stream::kStdout, req.command + "\n");
    }
    return r;
  }
  absl::StatusOr<DirListing> ListDir(const InstanceRef& ref, const std::string& path) override {
    std::lock_guard<std::mutex> lock(mu);
    DirListing l;
    const std::string prefix = ref.id + ":" + path + "/";
    for (const auto& [k, v] : files) {
      if (k.starts_with(prefix))
        l.entries.push_back({k.substr(prefix.size()), "file", static_cast<int64_t>(v.size())});
    }
    if (l.entries.empty()) return absl::NotFoundError("no such directory");
    return l;
  }
};

class HostedFake : public tools::ToolProvider {
 public:
  absl::StatusOr<std::vector<tools::ToolDefinition>> ListTools(const Caller&) override {
    return std::vector<tools::ToolDefinition>{
        json::object{{"name", "fs.read"},
                     {"server", "fs"},
                     {"tool", "read"},
                     {"description", "reads"},
                     {"inputSchema", json::object{{"type", "object"}}}}};
  }
  absl::StatusOr<ToolResult> CallTool(std::string_view name, const json::object& arguments,
                                      const CallContext&) override {
    if (name != "fs.read") return absl::NotFoundError("no such tool");
    calls.emplace_back(std::string(name), arguments);
    ToolResult r;
    r.content.push_back(json::object{{"type", "text"}, {"text", "hosted says hi"}});
    return r;
  }
  std::vector<std::pair<std::string, json::object>> calls;
};

class EsbToolsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto s = Store::Open(":memory:");
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(*s);
    registry_.Register(
        "container", DriverRegistry::Tier::kHeavy, []() -> absl::StatusOr<std::unique_ptr<Driver>> {
          return std::make_unique<EchoDriver>(
              "container",
              CapabilitySet{Capability::kExec, Capability::kFiles, Capability::kPythonSession});
        });
    registry_.Register("nano", DriverRegistry::Tier::kNano,
                       []() -> absl::StatusOr<std::unique_ptr<Driver>> {
                         return std::make_unique<esb::testing::FakeDriver>(
                             "nano", CapabilitySet{Capability::kFiles, Capability::kPythonSession,
                                                   Capability::kPythonOneShot});
                       });
    heavy_ = static_cast<EchoDriver*>(registry_.Find("container"));
    ManagerOptions mopts;
    mopts.pool_size = 0;
    manager_ =
        std::make_unique<EnvironmentManager>(store_.get(), registry_.Available(), &metrics_, mopts);
    ServiceOptions sopts;
    sopts.images = {{"default", ""}};
    sopts.drivers = &registry_;
    api_ = std::make_unique<ApiService>(manager_.get(), store_.get(), &metrics_, sopts);
    dir_ =
        std::filesystem::temp_directory_path() / ("esb_tools_test_" + std::to_string(::getpid()));
    ArtifactStore::Options aopts;
    aopts.dir = dir_.string();
    auto a = ArtifactStore::Open(aopts);
    ASSERT_TRUE(a.ok()) << a.status();
    artifacts_ = std::move(*a);
    installer_ = std::make_unique<packages::PackageInstaller>(
        manager_.get(), nullptr, packages::PackageInstaller::Options{});
    pipeline_ = std::make_unique<run::RunPipeline>(run::RunDeps{
        .manager = manager_.get(), .artifacts = artifacts_.get(), .installer = installer_.get()});
    gate_ = std::make_unique<tools::ToolCallGate>(&manager_->audit(),
                                                  tools::DlpPolicyFrom(manager_.get()));
    Make(nullptr);
  }
  void TearDown() override {
    tools_.reset();
    std::filesystem::remove_all(dir_);
  }

  void Make(EnvironmentToolsFn hosted) {
    tools_ = std::make_unique<EsbTools>(EsbToolsDeps{.manager = manager_.get(),
                                                     .api = api_.get(),
                                                     .gate = gate_.get(),
                                                     .pipeline = pipeline_.get(),
                                                     .artifacts = artifacts_.get(),
                                                     .environment_tools = std::move(hosted)});
  }

  ToolResult Call(std::string_view name, json::object args, const Caller& caller = kAcme) {
    CallContext ctx{caller};
    ctx.progress = [this](const tools::Progress& p) {
      std::lock_guard<std::mutex> lock(progress_mu_);
      progress_.push_back(p);
    };
    auto r = tools_->CallTool(name, args, ctx);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : ToolResult{};
  }

  std::string CreateEnv(const Caller& caller = kAcme) {
    ToolResult r = Call("create_environment", json::object{}, caller);
    EXPECT_FALSE(r.is_error) << json::serialize(r.content);
    if (!r.structured) return "";
    return std::string(r.structured->at("environment_id").as_string());
  }

  std::vector<AuditEntry> Rows(const std::string& tenant = "acme") {
    AuditQuery q;
    q.tenant = tenant;
    q.limit = 1000;
    return store_->QueryAudit(q).value_or(std::vector<AuditEntry>{});
  }

  static inline const Caller kAcme{"acme", "key_a", "mcp"};
  static inline const Caller kOther{"other", "key_o", "mcp"};
  std::unique_ptr<Store> store_;
  Metrics metrics_;
  DriverRegistry registry_;
  EchoDriver* heavy_ = nullptr;
  std::unique_ptr<EnvironmentManager> manager_;
  std::unique_ptr<ApiService> api_;
  std::filesystem::path dir_;
  std::unique_ptr<ArtifactStore> artifacts_;
  std::unique_ptr<packages::PackageInstaller> installer_;
  std::unique_ptr<run::RunPipeline> pipeline_;
  std::unique_ptr<tools::ToolCallGate> gate_;
  std::unique_ptr<EsbTools> tools_;
  std::mutex progress_mu_;
  std::vector<tools::Progress> progress_;
};

TEST_F(EsbToolsTest, ListsTheCatalogue) {
  auto list = tools_->ListTools(kAcme);
  ASSERT_TRUE(list.ok());
  json::array mcp = McpTools();
  ASSERT_EQ(list->size(), mcp.size());
  for (size_t i = 0; i < mcp.size(); ++i) EXPECT_EQ(json::value((*list)[i]), mcp[i]);
}

TEST_F(EsbToolsTest, AnUnknownToolIsNotFound) {
  CallContext ctx{kAcme};
  EXPECT_EQ(tools_->CallTool("rm_rf", {}, ctx).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(EsbToolsTest, EnvironmentLifecycleAndOneAuditRowPerCall) {
  const std::string id = CreateEnv();
  ASSERT_FALSE(id.empty());
  ToolResult list = Call("list_environments", {});
  ASSERT_TRUE(list.structured);
  ASSERT_EQ(list.structured->at("environments").as_array().size(), 1u);
  EXPECT_EQ(list.structured->at("environments").at(0).at("environment_id"), id.c_str());
  ToolResult del = Call("delete_environment", json::object{{"environment_id", id}});
  EXPECT_FALSE(del.is_error);
  EXPECT_EQ(del.structured->at("message"), "Environment deleted.");
  EXPECT_TRUE(Call("list_environments", {}).structured->at("environments").as_array().empty());
  // Every call wrote exactly one row, the tool call's (the core's own rows are its steps).
  std::vector<AuditEntry> rows = Rows();
  ASSERT_EQ(rows.size(), 4u);
  for (const AuditEntry& r : rows) {
    EXPECT_EQ(r.action, "tool.call");
    EXPECT_EQ(r.principal, "key_a");
    ASSERT_TRUE(r.tool_call);
    EXPECT_EQ(r.tool_call->server, "esbd");
    EXPECT_EQ(r.tool_call->decision, "allowed");
  }
  EXPECT_EQ(rows[0].tool_call->tool, "list_environments");
  EXPECT_EQ(rows[1].tool_call->tool, "delete_environment");
  EXPECT_EQ(rows[1].environment_id, id);
  EXPECT_EQ(rows[3].tool_call->tool, "create_environment");
}

TEST_F(EsbToolsTest, ATenantNeverSeesAnothersEnvironments) {
  const std::string id = CreateEnv();
  EXPECT_TRUE(
      Call("list_environments", {}, kOther).structured->at("environments").as_array().empty());
  ToolResult theirs =
      Call("execute_command", json::object{{"environment_id", id}, {"command", "ls"}}, kOther);
  ToolResult missing = Call(
      "execute_command", json::object{{"environment_id", "env_nope"}, {"command", "ls"}}, kOther);
  EXPECT_TRUE(theirs.is_error);
  EXPECT_TRUE(missing.is_error);
  // The same answer as for an id that does not exist (modulo the id itself).
  std::string a = std::string(theirs.structured->at("message").as_string());
  std::string b = std::string(missing.structured->at("message").as_string());
  EXPECT_EQ(absl::StrReplaceAll(a, {{id, "X"}}), absl::StrReplaceAll(b, {{"env_nope", "X"}}));
  EXPECT_TRUE(Call("delete_environment", json::object{{"environment_id", id}}, kOther).is_error);
  EXPECT_TRUE(heavy_->execs.empty());
  EXPECT_EQ(Call("list_environments", {}).structured->at("environments").as_array().size(), 1u);
}

TEST_F(EsbToolsTest, ExecuteStreamsProgressAndAnswersSeed004sShape) {
  const std::string id = CreateEnv();
  ToolResult r = Call("execute_command", json::object{{"environment_id", id}, {"command", "ls"}});
  EXPECT_FALSE(r.is_error);
  ASSERT_TRUE(r.structured);
  EXPECT_EQ(
      *r.structured,
      (json::object{{"error", false}, {"stdout", "out:ls\n"}, {"stderr", ""}, {"exit_code", 0}}));
  EXPECT_EQ(json::parse(r.content.at(0).at("text").as_string()), json::value(*r.structured));
  ASSERT_EQ(progress_.size(), 2u);
  EXPECT_EQ(progress_[0].message, "out:");
  EXPECT_EQ(progress_[1].message, "ls\n");
  EXPECT_LT(progress_[0].progress, progress_[1].progress);
  ToolResult failed =
      Call("execute_command", json::object{{"environment_id", id}, {"command", "false"}});
  EXPECT_TRUE(failed.is_error);
  EXPECT_EQ(failed.structured->at("exit_code"), 3);
  EXPECT_EQ(failed.structured->at("error"), true);
}

TEST_F(EsbToolsTest, BadArgumentsAreToolErrorsAndNeverReachTheCore) {
  const std::string id = CreateEnv();
  struct Case {
    const char* tool;
    json::object args;
    const char* says;
  } cases[] = {
      {"execute_command", {{"environment_id", id}}, "missing required argument 'command'"},
      {"execute_command", {{"command", "ls"}}, "missing required argument 'environment_id'"},
      {"execute_command", {{"environment_id", id}, {"command", 7}}, "'command' must be a string"},
      {"execute_command", {{"environment_id", id}, {"command", ""}}, "'command' must not be empty"},
      {"execute_command",
       {{"environment_id", id}, {"command", "ls"}, {"timeout_seconds", 0}},
       "'timeout_seconds' must be at least 1"},
      {"execute_command",
       {{"environment_id", id}, {"command", "ls"}, {"timeout_seconds", 1.5}},
       "'timeout_seconds' must be an integer"},
      {"execute_command",
       {{"environment_id", id}, {"command", "ls"}, {"sudo", true}},
       "unknown argument 'sudo'"},
      {"execute_command",
       {{"environment_id", json::array{}}, {"command", "ls"}},
       "'environment_id' must be a string"},
      {"write_file",
       {{"environment_id", id}, {"path", "a"}},
       "missing required argument 'content'"},
      {"run_code", {{"code", "1"}, {"tier", "gpu"}}, "'tier' must be one of"},
      {"run_code", {{"code", "1"}, {"packages", json::array{1}}}, "'packages[0]' must be a string"},
      {"create_environment", {{"ttl_seconds", 5}}, "'ttl_seconds' must be at least 10"},
      {"call_environment_tool", {{"environment_id", id}, {"name", "nodot"}}, "'name' must match"},
      {"call_environment_tool",
       {{"environment_id", id}, {"name", "fs.read"}, {"arguments", "x"}},
       "'arguments' must be an object"},
  };
  for (const Case& c : cases) {
    ToolResult r = Call(c.tool, c.args);
    EXPECT_TRUE(r.is_error) << c.tool << " " << json::serialize(c.args);
    const std::string text =
        r.content.empty() ? "" : std::string(r.content.at(0).at("text").as_string());
    EXPECT_NE(text.find(c.says), std::string::npos) << text;
  }
  EXPECT_TRUE(heavy_->execs.empty());
  EXPECT_EQ(heavy_->creates, 1);
  // Each refused call is audited as an error.
  AuditQuery q;
  q.tenant = "acme";
  q.kind = "tool";
  q.decision = "error";
  EXPECT_EQ(store_->QueryAudit(q)->size(), std::size(cases));
}

TEST_F(EsbToolsTest, FilesRoundTrip) {
  const std::string id = CreateEnv();
  ToolResult w = Call(
      "write_file",
      json::object{{"environment_id", id}, {"path", "src/main.py"}, {"content", "print(42)\n"}});
  EXPECT_EQ(*w.structured,
            (json::object{{"error", false}, {"message", "File saved successfully."}}));
  ToolResult r = Call("read_file", json::object{{"environment_id", id}, {"path", "src/main.py"}});
  EXPECT_EQ(*r.structured, (json::object{{"error", false}, {"content", "print(42)\n"}}));
  ToolResult l = Call("list_files", json::object{{"environment_id", id}, {"path", "src"}});
  EXPECT_FALSE(l.is_error);
  EXPECT_EQ(l.structured->at("entries"),
            (json::array{json::object{{"name", "main.py"}, {"type", "file"}, {"size", 10}}}));
  ToolResult missing = Call("read_file", json::object{{"environment_id", id}, {"path", "nope"}});
  EXPECT_TRUE(missing.is_error);
  EXPECT_EQ(missing.structured->at("error"), true);
  EXPECT_TRUE(missing.structured->contains("content"));
  // Binary and oversized files are refused with what to do instead.
  ASSERT_TRUE(manager_->WriteFile(kAcme, id, "bin", std::string("\xff\xfe\x00", 3), 0, true).ok());
  ToolResult bin = Call("read_file", json::object{{"environment_id", id}, {"path", "bin"}});
  EXPECT_TRUE(bin.is_error);
  EXPECT_NE(bin.structured->at("content").as_string().find("not UTF-8"), std::string::npos);
  ASSERT_TRUE(manager_->WriteFile(kAcme, id, "big", std::string((1 << 20) + 1, 'x'), 0, true).ok());
  ToolResult big = Call("read_file", json::object{{"environment_id", id}, {"path", "big"}});
  EXPECT_TRUE(big.is_error);
  EXPECT_NE(big.structured->at("content").as_string().find("execute_command"), std::string::npos);
}

TEST_F(EsbToolsTest, RunCodeSaysTierAndReasonAndReturnsFiguresAsImages) {
  ToolResult once = Call("run_code", json::object{{"code", "print(1)"}, {"tier", "nano"}});
  EXPECT_FALSE(once.is_error) << json::serialize(once.content);
  EXPECT_EQ(once.structured->at("tier"), "nano");
  EXPECT_FALSE(once.structured->at("reason").as_string().empty());
  EXPECT_EQ(once.structured->at("stdout"), "ran on nano");

  const std::string id = CreateEnv();
  heavy_->report = {ReportedArtifact{
      .path = "/tmp/fig-1.png", .name = "figure-1.png", .kind = "image", .mime_type = "image/png"}};
  ToolResult r = Call("run_code", json::object{{"code", "plot()"}, {"environment_id", id}});
  EXPECT_FALSE(r.is_error) << json::serialize(r.content);
  EXPECT_EQ(r.structured->at("tier"), "heavy");
  ASSERT_EQ(r.structured->at("artifacts").as_array().size(), 1u);
  ASSERT_EQ(r.content.size(), 2u);
  const json::value& image = r.content.at(1);
  EXPECT_EQ(image.at("type"), "image");
  EXPECT_EQ(image.at("mimeType"), "image/png");
  std::string bytes;
  ASSERT_TRUE(absl::Base64Unescape(std::string(image.at("data").as_string()), &bytes));
  EXPECT_EQ(bytes, "PNGDATA");
  // One row for the run (the tool call), none of the pipeline's own.
  for (const AuditEntry& row : Rows()) EXPECT_EQ(row.action, "tool.call");
}

TEST_F(EsbToolsTest, APlantedAwsKeyIsBlockedBeforeTheCommandRuns) {
  const std::string id = CreateEnv();
  const std::string key = governance::dlp::testing::AwsKeyId();
  ToolResult r =
      Call("execute_command", json::object{{"environment_id", id}, {"command", "export K=" + key}});
  EXPECT_TRUE(r.is_error);
  EXPECT_NE(r.content.at(0).at("text").as_string().find("dlp:aws_access_key"), std::string::npos);
  EXPECT_TRUE(heavy_->execs.empty());
  AuditEntry row = Rows().at(0);
  EXPECT_EQ(row.tool_call->decision, "blocked");
  EXPECT_EQ(row.environment_id, id);
  EXPECT_EQ(row.tool_call->arguments.find(key), std::string::npos);
}

TEST_F(EsbToolsTest, HostedToolsWithoutMHostedAreAToolError) {
  const std::string id = CreateEnv();
  for (const char* tool : {"list_environment_tools", "call_environment_tool"}) {
    json::object args{{"environment_id", id}};
    if (std::string(tool) == "call_environment_tool") args["name"] = "fs.read";
    ToolResult r = Call(tool, args);
    EXPECT_TRUE(r.is_error) << tool;
    EXPECT_EQ(r.structured->at("message"), kHostedUnavailable);
  }
}

TEST_F(EsbToolsTest, HostedToolsAreListedAndCalledThroughTheInjectedFunction) {
  const std::string id = CreateEnv();
  auto hosted = std::make_shared<HostedFake>();
  std::vector<std::pair<std::string, std::string>> asked;  // (tenant, environment)
  Make([&](const Caller& caller,
           const std::string& env) -> absl::StatusOr<std::shared_ptr<tools::ToolProvider>> {
    asked.emplace_back(caller.tenant, env);
    if (caller.tenant != "acme" || env != id) return absl::NotFoundError("no environment");
    return hosted;
  });
  ToolResult list = Call("list_environment_tools", json::object{{"environment_id", id}});
  EXPECT_FALSE(list.is_error);
  EXPECT_EQ(list.structured->at("tools").at(0).at("name"), "fs.read");
  ToolResult call =
      Call("call_environment_tool", json::object{{"environment_id", id},
                                                 {"name", "fs.read"},
                                                 {"arguments", json::object{{"path", "a"}}}});
  EXPECT_FALSE(call.is_error);
  EXPECT_EQ(call.content.at(0).at("text"), "hosted says hi");
  ASSERT_EQ(hosted->calls.size(), 1u);
  EXPECT_EQ(hosted->calls[0].second, (json::object{{"path", "a"}}));
  ToolResult unknown =
      Call("call_environment_tool", json::object{{"environment_id", id}, {"name", "fs.nope"}});
  EXPECT_TRUE(unknown.is_error);
  ToolResult theirs = Call("list_environment_tools", json::object{{"environment_id", id}}, kOther);
  EXPECT_TRUE(theirs.is_error);
  EXPECT_EQ(hosted->calls.size(), 1u);
}

}  // namespace
}  // namespace esb::api::mcp

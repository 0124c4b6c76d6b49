// Hosted MCP servers (core/mcp_hosts/hosts.h) on a fake driver whose processes are fake MCP
// servers: start and the namespaced registry, calls, a crash and the restart, giving up after
// max_restarts, a failed first start, the limits, tenant isolation, a runtime without the
// processes capability, a rewind-like close, the environment's deletion, the audit rows.
#include "core/mcp_hosts/hosts.h"

#include <thread>

#include "absl/strings/match.h"
#include "core/mcp_hosts/testing/fake_mcp_process.h"
#include "core/tools/tool_gate.h"
#include "drivers/testing/fake_driver.h"
#include "governance/dlp/dlp_test_util.h"
#include "gtest/gtest.h"

namespace esb::mcp_hosts {
namespace {

namespace json = boost::json;
using esb::testing::FakeDriver;
using testing::FakeMcpOptions;
using testing::FakeMcpProcess;

class HostsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto s = Store::Open(":memory:", StoreOptions{});
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(*s);
    driver_.spawn =
        [this](const InstanceRef&,
               const ProcessRequest& req) -> absl::StatusOr<std::unique_ptr<ProcessSession>> {
      std::lock_guard<std::mutex> lock(fakes_mu_);
      if (req.argv[0] == "missing") return absl::NotFoundError("ENOENT: no such command");
      FakeMcpOptions o = options_;
      if (req.argv[0] == "garbage") o.garbage_at_start = 50;
      auto p = std::make_unique<FakeMcpProcess>(o);
      fakes_.push_back(p.get());
      return std::unique_ptr<ProcessSession>(std::move(p));
    };
    ManagerOptions opts;
    opts.pool_size = 0;
    manager_ = std::make_unique<EnvironmentManager>(
        store_.get(), std::map<std::string, Driver*>{{"container", &driver_}, {"nano", &nano_}},
        &metrics_, opts);
    ASSERT_TRUE(manager_->Start().ok());
    McpConfig config;
    config.max_servers_per_environment = 2;
    config.max_restarts = 1;
    config.start_timeout_s = 5;
    config.call_timeout_s = 1;
    hosts_ = std::make_unique<McpHosts>(manager_.get(), config);
  }
  void TearDown() override {
    hosts_.reset();
    manager_->Stop();
  }
  std::string Env(const std::string& tenant = "t", DriverKind kind = DriverKind::kContainer) {
    EnvSpec spec;
    spec.runtime = kind;
    auto info = manager_->Create(tenant, spec, 600);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->record.id : "";
  }
  ServerSpec Spec(std::string name, std::string command = "python3") {
    return ServerSpec{.name = std::move(name), .command = std::move(command), .args = {"s.py"}};
  }
  FakeMcpProcess* Fake(size_t i) {
    std::lock_guard<std::mutex> lock(fakes_mu_);
    return i < fakes_.size() ? fakes_[i] : nullptr;
  }
  // Polls until the server is in `state` (with `restarts` when >= 0), or 10 s pass.
  ServerInfo WaitState(const std::string& env, const std::string& name, const std::string& state,
                       int restarts = -1) {
    ServerInfo info;
    for (int i = 0; i < 500; ++i) {
      auto got = hosts_->Get("t", env, name);
      if (got.ok()) info = *got;
      if (got.ok() && got->state == state && (restarts < 0 || got->restarts == restarts)) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return info;
  }
  std::vector<std::string> AuditActions(const std::string& env) {
    AuditQuery q;
    q.tenant = "t";
    q.environment_id = env;
    std::vector<std::string> out;
    auto rows = store_->QueryAudit(q);
    if (rows.ok())
      for (const AuditEntry& e : *rows) out.push_back(e.action);
    return out;
  }

  FakeDriver driver_{"container", {Capability::kExec, Capability::kFiles, Capability::kProcesses}};
  FakeDriver nano_{"nano", {Capability::kExec}};
  FakeMcpOptions options_{.tools = 8};
  std::mutex fakes_mu_;
  std::vector<FakeMcpProcess*> fakes_;  // owned by the clients (alive while their server is)
  Metrics metrics_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<EnvironmentManager> manager_;
  std::unique_ptr<McpHosts> hosts_;
};

TEST_F(HostsTest, StartListsNamespacedToolsAndCallsThem) {
  const std::string env = Env();
  auto info = hosts_->Start("t", env, Spec("files"));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state, "ready") << info->error;
  EXPECT_EQ(info->tools, 7);  // "bad name!" is not an MCP tool name: left out, and said so
  ASSERT_EQ(info->skipped_tools.size(), 1u);
  EXPECT_TRUE(absl::StartsWith(info->skipped_tools[0], "bad name!: not a valid MCP tool name"))
      << info->skipped_tools[0];
  EXPECT_EQ(info->protocol, "2025-06-18");
  EXPECT_EQ(driver_.last_request.argv, (std::vector<std::string>{"python3", "s.py"}));
  EXPECT_FALSE(driver_.last_request.pty);

  auto tools = hosts_->Tools("t", env);
  ASSERT_TRUE(tools.ok());
  ASSERT_EQ(tools->size(), 7u);
  EXPECT_EQ((*tools)[0].server, "files");
  EXPECT_EQ((*tools)[0].tool, "echo");

  auto r = hosts_->CallTool("t", env, "files.echo", json::object{{"a", "b"}},
                            tools::CallContext{.caller = Caller("t")});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->is_error);
  ASSERT_TRUE(r->structured.has_value());
  EXPECT_EQ(r->structured->at("a"), "b");

  EXPECT_TRUE(absl::IsNotFound(
      hosts_->CallTool("t", env, "files.nope", {}, {.caller = Caller("t")}).status()));
  EXPECT_TRUE(absl::IsNotFound(
      hosts_->CallTool("t", env, "other.echo", {}, {.caller = Caller("t")}).status()));
  EXPECT_TRUE(
      absl::IsNotFound(hosts_->CallTool("t", env, "echo", {}, {.caller = Caller("t")}).status()));

  // The providers: namespaced for the environment, unchanged for one server.
  auto envp = hosts_->EnvironmentProvider("t", env);
  ASSERT_TRUE(envp.ok());
  auto defs = (*envp)->ListTools("t");
  ASSERT_TRUE(defs.ok());
  EXPECT_EQ((*defs)[0].at("name"), "files.echo");
  auto onep = hosts_->ServerProvider("t", env, "files");
  ASSERT_TRUE(onep.ok());
  auto own = (*onep)->ListTools("t");
  ASSERT_TRUE(own.ok());
  EXPECT_EQ(own->size(), 7u);  // both views leave "bad name!" out
  EXPECT_EQ((*own)[0].at("name"), "echo");
  auto call = (*onep)->CallTool("echo", {}, {.caller = Caller("t")});
  ASSERT_TRUE(call.ok()) << call.status();
}

// A valid name that does not fit the registry's <server>.<tool> (128 characters) stays on the
// server's own endpoint, leaves the environment's registry, and the server's info says so.
TEST_F(HostsTest, AToolNameTooLongToNamespaceIsOnlyOnItsServersEndpoint) {
  const std::string long_name(125, 'y');  // valid alone; "files." + it is 131 characters
  options_.names = {"echo", long_name};
  const std::string env = Env();
  auto info = hosts_->Start("t", env, Spec("files"));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->tools, 2);
  EXPECT_EQ(info->skipped_tools_count, 1);
  ASSERT_EQ(info->skipped_tools.size(), 1u);
  EXPECT_TRUE(absl::StrContains(info->skipped_tools[0], "not in the environment's registry"))
      << info->skipped_tools[0];
  auto tools = hosts_->Tools("t", env);
  ASSERT_TRUE(tools.ok());
  ASSERT_EQ(tools->size(), 1u);
  EXPECT_EQ((*tools)[0].tool, "echo");
  auto own = hosts_->ServerProvider("t", env, "files");
  ASSERT_TRUE(own.ok());
  auto defs = (*own)->ListTools("t");
  ASSERT_TRUE(defs.ok());
  ASSERT_EQ(defs->size(), 2u);
  EXPECT_EQ((*defs)[1].at("name").as_string(), long_name);
}

TEST_F(HostsTest, HangingCallTimesOutAsAToolError) {
  const std::string env = Env();
  ASSERT_TRUE(hosts_->Start("t", env, Spec("s")).ok());
  auto r = hosts_->CallTool("t", env, "s.slow", {}, {.caller = Caller("t")});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->is_error);
  const std::string text = json::value_to<std::string>(r->content[0].at("text"));
  EXPECT_TRUE(absl::StrContains(text, "call timeout 1 s")) << text;
}

TEST_F(HostsTest, CrashMidCallFailsTheCallThenTheServerRestartsThenGivesUp) {
  const std::string env = Env();
  ASSERT_EQ(hosts_->Start("t", env, Spec("s"))->state, "ready");
  auto r = hosts_->CallTool("t", env, "s.crash", {}, {.caller = Caller("t")});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->is_error);
  const std::string text = json::value_to<std::string>(r->content[0].at("text"));
  EXPECT_TRUE(absl::StrContains(text, "exited with code 3")) << text;
  EXPECT_TRUE(absl::StrContains(text, "Traceback: boom")) << text;

  // Restarted once (backoff 1 s), and usable again.
  ServerInfo info = WaitState(env, "s", "ready", 1);
  ASSERT_EQ(info.state, "ready") << info.error;
  EXPECT_EQ(info.restarts, 1);
  EXPECT_TRUE(hosts_->CallTool("t", env, "s.echo", {}, {.caller = Caller("t")}).ok());

  // Crashes again: max_restarts (1) is used up → failed, with the reason and the stderr tail.
  hosts_->CallTool("t", env, "s.crash", {}, {.caller = Caller("t")}).IgnoreError();
  info = WaitState(env, "s", "failed");
  ASSERT_EQ(info.state, "failed");
  EXPECT_TRUE(absl::StrContains(info.error, "exited with code 3")) << info.error;
  EXPECT_TRUE(absl::StrContains(info.stderr_tail, "boom")) << info.stderr_tail;
  auto refused = hosts_->CallTool("t", env, "s.echo", {}, {.caller = Caller("t")});
  EXPECT_TRUE(absl::IsUnavailable(refused.status())) << refused.status();
  auto actions = AuditActions(env);
  EXPECT_GE(std::count(actions.begin(), actions.end(), "mcp.server.exit"), 2);
  EXPECT_GE(std::count(actions.begin(), actions.end(), "mcp.server.failed"), 1);
  EXPECT_GE(std::count(actions.begin(), actions.end(), "mcp.server.start"), 2);
}

TEST_F(HostsTest, FirstStartThatFailsIsReportedFailedWithoutRetries) {
  const std::string env = Env();
  auto info = hosts_->Start("t", env, Spec("bad", "missing"));
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state, "failed");
  EXPECT_TRUE(absl::StrContains(info->error, "no such command")) << info->error;
  auto g = hosts_->Start("t", env, Spec("noisy", "garbage"));
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->state, "failed");
  EXPECT_TRUE(absl::StrContains(g->error, "not JSON-RPC")) << g->error;
  EXPECT_EQ(g->restarts, 0);
}

TEST_F(HostsTest, LimitsNamesAndCapabilities) {
  const std::string env = Env();
  ASSERT_TRUE(hosts_->Start("t", env, Spec("a")).ok());
  EXPECT_TRUE(absl::IsAlreadyExists(hosts_->Start("t", env, Spec("a")).status()));
  ASSERT_TRUE(hosts_->Start("t", env, Spec("b")).ok());
  auto third = hosts_->Start("t", env, Spec("c"));
  EXPECT_TRUE(absl::IsResourceExhausted(third.status())) << third.status();
  EXPECT_TRUE(absl::StrContains(third.status().message(), "max_servers_per_environment"));
  EXPECT_TRUE(absl::IsInvalidArgument(hosts_->Start("t", env, Spec("Bad.Name")).status()));
  ServerSpec bad_env = Spec("x");
  bad_env.env["1BAD"] = "v";
  EXPECT_TRUE(absl::IsInvalidArgument(hosts_->Start("t", env, bad_env).status()));
  // Another environment has its own count.
  EXPECT_TRUE(hosts_->Start("t", Env(), Spec("c")).ok());
  // A runtime without processes (nano): a 400 naming the capability.
  const std::string nano = Env("t", DriverKind::kNano);
  auto refused = hosts_->Start("t", nano, Spec("a"));
  EXPECT_TRUE(IsMissingCapability(refused.status())) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "processes"));
}

TEST_F(HostsTest, AnotherTenantSeesNothing) {
  const std::string env = Env();
  ASSERT_TRUE(hosts_->Start("t", env, Spec("s")).ok());
  EXPECT_TRUE(absl::IsNotFound(hosts_->List("u", env).status()));
  EXPECT_TRUE(absl::IsNotFound(hosts_->Get("u", env, "s").status()));
  EXPECT_TRUE(absl::IsNotFound(hosts_->Tools("u", env).status()));
  EXPECT_TRUE(absl::IsNotFound(hosts_->Stop("u", env, "s")));
  EXPECT_TRUE(
      absl::IsNotFound(hosts_->CallTool("u", env, "s.echo", {}, {.caller = Caller("u")}).status()));
  EXPECT_TRUE(absl::IsNotFound(hosts_->Start("u", env, Spec("z")).status()));
  EXPECT_TRUE(absl::IsNotFound(hosts_->EnvironmentProvider("u", env).status()));
  EXPECT_TRUE(absl::IsNotFound(hosts_->ServerProvider("u", env, "s").status()));
  // A provider obtained by the owner still checks the caller of each call.
  auto p = hosts_->ServerProvider("t", env, "s");
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(absl::IsNotFound((*p)->CallTool("echo", {}, {.caller = Caller("u")}).status()));
  EXPECT_TRUE(absl::IsNotFound((*p)->ListTools("u").status()));
  EXPECT_TRUE(hosts_->Get("t", env, "s").ok());
}

TEST_F(HostsTest, StopEndsTheServerAndItsCalls) {
  const std::string env = Env();
  ASSERT_TRUE(hosts_->Start("t", env, Spec("s")).ok());
  ASSERT_TRUE(hosts_->Stop("t", env, "s").ok());
  EXPECT_TRUE(absl::IsNotFound(hosts_->Get("t", env, "s").status()));
  EXPECT_TRUE(hosts_->List("t", env)->empty());
  // The name is free again.
  EXPECT_EQ(hosts_->Start("t", env, Spec("s"))->state, "ready");
  auto actions = AuditActions(env);
  EXPECT_EQ(std::count(actions.begin(), actions.end(), "mcp.server.stop"), 1);
}

TEST_F(HostsTest, DeletingTheEnvironmentEndsItsServers) {
  const std::string env = Env();
  ASSERT_TRUE(hosts_->Start("t", env, Spec("s")).ok());
  ASSERT_TRUE(manager_->Destroy("t", env).ok());
  Fake(0)->Exit(137);  // the instance's processes die with it
  for (int i = 0; i < 200; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    auto p = hosts_->ServerProvider("t", env, "s");
    if (absl::IsNotFound(p.status())) break;
  }
  EXPECT_TRUE(absl::IsNotFound(hosts_->List("t", env).status()));
  // Freed from the daemon's count too: a new environment can host servers.
  EXPECT_TRUE(hosts_->Start("t", Env(), Spec("s")).ok());
}

TEST_F(HostsTest, EveryCallGoesThroughTheGateAndAPlantedKeyIsNeverDispatched) {
  tools::ToolCallGate gate(&manager_->audit(), nullptr);
  hosts_->SetCallGate(&gate);
  const std::string env = Env();
  ASSERT_EQ(hosts_->Start("t", env, Spec("s"))->state, "ready");
  const std::string key = governance::dlp::testing::AwsKeyId();
  auto r =
      hosts_->CallTool("t", env, "s.echo", json::object{{"token", key}}, {.caller = Caller("t")});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->is_error);
  EXPECT_TRUE(absl::StrContains(json::value_to<std::string>(r->content[0].at("text")),
                                "dlp:aws_access_key"));
  for (const std::string& m : Fake(0)->Methods()) EXPECT_NE(m, "tools/call");
  // An innocent call is dispatched; each call is one tool.call row naming the hosted server.
  auto ok = hosts_->CallTool("t", env, "s.echo", json::object{{"a", 1}}, {.caller = Caller("t")});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_FALSE(ok->is_error);
  auto actions = AuditActions(env);
  EXPECT_EQ(std::count(actions.begin(), actions.end(), "tool.call"), 2);
}

TEST_F(HostsTest, CrashBetweenCallsIsRestarted) {
  const std::string env = Env();
  ASSERT_TRUE(hosts_->Start("t", env, Spec("s")).ok());
  Fake(0)->Exit(1, "bye\n");
  ServerInfo info = WaitState(env, "s", "ready", 1);
  EXPECT_EQ(info.state, "ready");
  EXPECT_EQ(info.restarts, 1);
  EXPECT_TRUE(hosts_->CallTool("t", env, "s.echo", {}, {.caller = Caller("t")}).ok());
}

// Attack: a hosted server (hostile: it runs in the sandbox) streams a secret in its progress
// messages while its result is clean. The progress is part of the result: the gate must see
// it (the rule recorded in the call's audit row) and, with dlp.scan_responses, withhold it.
TEST_F(HostsTest, HostedServerProgressCannotSmuggleASecretPastTheGate) {
  const std::string key = absl::StrCat("AKIAZ7Q4", "MXR2VN6LPT3K");  // a made-up AWS key id
  options_.progress_message = absl::StrCat("aws_access_key_id = ", key);
  tools::ToolCallGate gate(&manager_->audit(), [](const Caller&, const std::string&) {
    return absl::StatusOr<json::object>(json::object{{"scan_responses", true}});
  });
  hosts_->SetCallGate(&gate);
  const std::string env = Env();
  ASSERT_TRUE(hosts_->Start("t", env, Spec("files")).ok());
  std::mutex mu;
  std::vector<std::string> seen;
  tools::CallContext ctx{.caller = Caller("t")};
  ctx.progress = [&](const tools::Progress& p) {
    std::lock_guard<std::mutex> lock(mu);
    seen.push_back(p.message);
  };
  auto r = hosts_->CallTool("t", env, "files.progress", {}, ctx);
  ASSERT_TRUE(r.ok()) << r.status();
  {
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_FALSE(seen.empty());
    for (const std::string& m : seen) {
      EXPECT_FALSE(absl::StrContains(m, key)) << "the secret reached the caller: " << m;
      EXPECT_TRUE(absl::StrContains(m, "withheld")) << m;
    }
  }
  AuditQuery q;
  q.tenant = "t";
  q.environment_id = env;
  auto rows = store_->QueryAudit(q);
  ASSERT_TRUE(rows.ok());
  bool recorded = false;
  for (const AuditEntry& e : *rows) {
    if (e.action != "tool.call" || !e.tool_call) continue;
    for (const std::string& rule : e.tool_call->result_rule_ids)
      recorded = recorded || rule == "dlp:aws_access_key";
  }
  EXPECT_TRUE(recorded) << "the call's audit row does not name the rule its progress hit";
}

// Attack: one tenant fills the daemon's hosted-server slots (mcp.max_servers) from many
// environments, so every other tenant's start is refused. A tenant's share is capped.
TEST_F(HostsTest, OneTenantCannotTakeEveryHostedServerSlot) {
  McpConfig config;
  config.max_servers = 8;
  config.max_servers_per_environment = 1;
  config.start_timeout_s = 5;
  ASSERT_EQ(MaxServersPerTenant(config), 2);
  McpHosts hosts(manager_.get(), config);
  for (int i = 0; i < 2; ++i) {
    auto info = hosts.Start("t", Env("t"), Spec("s"));
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->state, "ready") << info->error;
  }
  auto refused = hosts.Start("t", Env("t"), Spec("s"));
  EXPECT_TRUE(absl::IsResourceExhausted(refused.status())) << refused.status();
  auto other = hosts.Start("u", Env("u"), Spec("s"));
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(other->state, "ready") << other->error;
}

}  // namespace
}  // namespace esb::mcp_hosts

#include "router/rules.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <string>

#include "common/util.h"

namespace esb::router {
namespace {

constexpr char kRules[] = R"({
  "_comment": "test rules",
  "version": 1,
  "default_for_unknown": "heavy",
  "heavy_modules": ["numpy", "pandas", "scipy", "socket", "urllib.request"],
  "nano_modules": ["json", "re", "math", "os", "urllib", "importlib"],
  "heavy_capabilities": ["os.system"]
})";

RouterRules MustParse(std::string_view json) {
  absl::StatusOr<RouterRules> rules = RouterRules::Parse(json);
  EXPECT_TRUE(rules.ok()) << rules.status();
  return rules.ok() ? *std::move(rules) : RouterRules::Parse(kRules).value();
}

RouteDecision Route(std::string_view code, RouteRequest request = {}) {
  return MustParse(kRules).Decide(ExtractImports(code), request);
}

void ExpectRoute(std::string_view code, Tier tier, std::string_view reason,
                 RouteRequest request = {}) {
  RouteDecision d = Route(code, std::move(request));
  EXPECT_EQ(d.tier_name(), TierName(tier)) << code;
  EXPECT_EQ(d.reason, reason) << code;
}

TEST(RouterRulesTest, JsonAndReGoToNano) {
  ExpectRoute("import json, re\n", Tier::kNano, "imports: json, re");
}

TEST(RouterRulesTest, NoImportsGoToNano) { ExpectRoute("print(1)\n", Tier::kNano, "no imports"); }

TEST(RouterRulesTest, PandasNeedsHeavy) {
  ExpectRoute("import json\nimport pandas as pd\n", Tier::kHeavy, "pandas needs heavy");
  ExpectRoute("from scipy.stats import norm\nimport numpy\n", Tier::kHeavy,
              "scipy, numpy need heavy");
}

TEST(RouterRulesTest, LongestPrefixWins) {
  ExpectRoute("import urllib.parse\n", Tier::kNano, "imports: urllib");
  ExpectRoute("from urllib import request\n", Tier::kHeavy, "urllib.request needs heavy");
  ExpectRoute("import urllib.request\n", Tier::kHeavy, "urllib.request needs heavy");
}

TEST(RouterRulesTest, UnknownModuleUsesDefault) {
  ExpectRoute("import json, leftpad\n", Tier::kHeavy, "unknown module: leftpad");
  std::string nano_default = kRules;
  nano_default.replace(nano_default.find("\"heavy\""), 7, "\"nano\"");
  RouterRules rules = MustParse(nano_default);
  EXPECT_EQ(rules.default_for_unknown(), Tier::kNano);
  RouteDecision d = rules.Decide(ExtractImports("import json, leftpad\n"), {});
  EXPECT_EQ(d.tier, Tier::kNano);
  EXPECT_EQ(d.reason, "imports: json, leftpad");
}

TEST(RouterRulesTest, PackagesAndRequirementsForceHeavy) {
  ExpectRoute("import json\n", Tier::kHeavy, "packages requested", {"auto", {"leftpad"}, ""});
  ExpectRoute("import json\n", Tier::kHeavy, "requirements requested",
              {"", {}, "# pinned\nleftpad==1.0\n"});
  ExpectRoute("import json\n", Tier::kNano, "imports: json", {"", {}, "# only a comment\n\n"});
  RouterRules rules = MustParse(std::string(kRules).insert(1, "\"packages_force_heavy\": false,"));
  EXPECT_EQ(rules.Decide(ExtractImports("import json"), {"auto", {"x"}, ""}).tier, Tier::kNano);
}

// Dynamic imports go heavy by default: the module is unknown until run time, and a wrong nano
// guess costs a failed run plus a rerun, while heavy always works.
TEST(RouterRulesTest, DynamicImportGoesHeavy) {
  ExpectRoute("m = __import__(name)\n", Tier::kHeavy, "dynamic import");
  ExpectRoute("import importlib\nimportlib.import_module('json')\n", Tier::kNano,
              "imports: importlib, json");
  RouterRules rules = MustParse(std::string(kRules).insert(1, "\"dynamic_import\": \"nano\","));
  EXPECT_EQ(rules.Decide(ExtractImports("exec(code)\n"), {}).tier, Tier::kNano);
}

TEST(RouterRulesTest, RelativeImportGoesHeavy) {
  ExpectRoute("from . import helper\n", Tier::kHeavy, "relative import");
}

TEST(RouterRulesTest, CapabilitiesNeedHeavy) {
  ExpectRoute("import os\nos.system('ls')\n", Tier::kHeavy, "os.system needs heavy");
  ExpectRoute("import os\nos.getcwd()\n", Tier::kNano, "imports: os");
  ExpectRoute("import socket\n", Tier::kHeavy, "socket needs heavy");
}

TEST(RouterRulesTest, ExplicitRuntimeWins) {
  ExpectRoute("import pandas\n", Tier::kNano, "runtime nano requested", {"nano", {}, ""});
  ExpectRoute("import json\n", Tier::kHeavy, "runtime container requested", {"container", {}, ""});
}

TEST(RouterRulesTest, ReasonsStayShort) {
  ExpectRoute("import json, re, math, os, importlib, urllib\n", Tier::kNano,
              "imports: json, re, math, os, importlib +1 more");
  ExpectRoute("import a1, a2, a3, a4, a5\n", Tier::kHeavy, "unknown modules: a1, a2, a3 +2 more");
}

TEST(RouterRulesTest, DefaultConfigFileParses) {
  absl::StatusOr<RouterRules> rules = RouterRules::Load(ESB_ROUTER_CONFIG);
  ASSERT_TRUE(rules.ok()) << rules.status();
  auto decide = [&](std::string_view code) { return rules->Decide(ExtractImports(code), {}).tier; };
  EXPECT_EQ(decide("import json, re\nfrom collections import Counter\n"), Tier::kNano);
  EXPECT_EQ(decide("import pandas as pd\n"), Tier::kHeavy);
  EXPECT_EQ(decide("import subprocess\n"), Tier::kHeavy);
  EXPECT_EQ(decide("import threading\n"), Tier::kHeavy);
  EXPECT_EQ(decide("import os\nos.system('x')\n"), Tier::kHeavy);
  EXPECT_EQ(decide("from urllib.parse import quote\n"), Tier::kNano);
  EXPECT_EQ(decide("import urllib.request\n"), Tier::kHeavy);
  EXPECT_EQ(decide("import some_unknown_pkg\n"), Tier::kHeavy);
}

TEST(RouterRulesTest, ParseErrorsNameTheKey) {
  struct Bad {
    const char* json;
    const char* needle;
  };
  const Bad cases[] = {
      {"not json", "invalid JSON"},
      {"[]", "top level"},
      {R"({"heavy_modules": [], "nano_modules": []})", "\"default_for_unknown\": missing"},
      {R"({"default_for_unknown": "maybe", "heavy_modules": [], "nano_modules": []})",
       "\"default_for_unknown\": must be"},
      {R"({"default_for_unknown": "heavy", "nano_modules": []})", "\"heavy_modules\": missing"},
      {R"({"default_for_unknown": "heavy", "heavy_modules": "numpy", "nano_modules": []})",
       "\"heavy_modules\": must be a list"},
      {R"({"default_for_unknown": "heavy", "heavy_modules": ["ok", 3], "nano_modules": []})",
       "\"heavy_modules\": entry 1"},
      {R"({"default_for_unknown": "heavy", "heavy_modules": ["a..b"], "nano_modules": []})",
       "\"heavy_modules\": entry 0"},
      {R"({"default_for_unknown": "heavy", "heavy_modules": ["x"], "nano_modules": ["x"]})",
       "\"nano_modules\": \"x\" is also listed"},
      {R"({"default_for_unknown": "heavy", "heavy_modules": [], "nano_modules": [],
           "heavy_module": []})",
       "\"heavy_module\": unknown key"},
      {R"({"default_for_unknown": "heavy", "heavy_modules": [], "nano_modules": [],
           "packages_force_heavy": "yes"})",
       "\"packages_force_heavy\""},
      {R"({"default_for_unknown": "heavy", "heavy_modules": [], "nano_modules": [],
           "version": 2})",
       "\"version\""},
  };
  for (const Bad& c : cases) {
    absl::StatusOr<RouterRules> r = RouterRules::Parse(c.json);
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(r.status().message()).find(c.needle), std::string::npos)
        << r.status() << " should mention " << c.needle;
  }
}

TEST(RouterRulesTest, LoadMissingFileNamesPath) {
  absl::StatusOr<RouterRules> r = RouterRules::Load("/nonexistent/router.json");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(std::string(r.status().message()).find("/nonexistent/router.json"), std::string::npos)
      << r.status();
}

class RulesHolderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/router_test.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    path_ = dir_ + "/router.json";
  }
  void TearDown() override {
    unlink(path_.c_str());
    rmdir(dir_.c_str());
  }
  void Write(std::string_view text) { ASSERT_TRUE(WriteStringToFile(path_, text).ok()); }

  std::string dir_, path_;
  int64_t now_ms_ = 1000000;
};

TEST_F(RulesHolderTest, ReloadsOnChangeAndKeepsOldRulesOnError) {
  Write(kRules);
  auto holder = RulesHolder::Create(path_, [this] { return now_ms_; });
  ASSERT_TRUE(holder.ok()) << holder.status();
  ImportScan scan = ExtractImports("import leftpad\n");
  EXPECT_EQ((*holder)->Current()->Decide(scan, {}).tier, Tier::kHeavy);

  // New rules: leftpad is nano. Not seen until a second has passed.
  std::string v2 = kRules;
  v2.replace(v2.find("\"json\""), 6, "\"json\", \"leftpad\"");
  Write(v2);
  now_ms_ += 500;
  EXPECT_EQ((*holder)->Current()->Decide(scan, {}).tier, Tier::kHeavy);
  now_ms_ += 600;
  EXPECT_EQ((*holder)->Current()->Decide(scan, {}).tier, Tier::kNano);
  EXPECT_TRUE((*holder)->last_error().ok());

  // A broken file keeps the previous rules and says why.
  Write(R"({"default_for_unknown": "heavy", "heavy_modules": [], "nano_modulez": []})");
  now_ms_ += 1000;
  absl::Status s = (*holder)->MaybeReload();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(std::string(s.message()).find("nano_modulez"), std::string::npos) << s;
  EXPECT_NE(std::string(s.message()).find(path_), std::string::npos) << s;
  EXPECT_EQ((*holder)->Current()->Decide(scan, {}).tier, Tier::kNano);
  EXPECT_FALSE((*holder)->last_error().ok());

  // Fixed again: reloads and clears the error.
  Write(kRules);
  now_ms_ += 1000;
  EXPECT_TRUE((*holder)->MaybeReload().ok());
  EXPECT_EQ((*holder)->Current()->Decide(scan, {}).tier, Tier::kHeavy);
  EXPECT_TRUE((*holder)->last_error().ok());

  // Deleted file: old rules stay, error reported.
  unlink(path_.c_str());
  now_ms_ += 1000;
  EXPECT_FALSE((*holder)->MaybeReload().ok());
  EXPECT_NE((*holder)->Current(), nullptr);
}

TEST_F(RulesHolderTest, CreateFailsOnInvalidFile) {
  Write("{");
  auto holder = RulesHolder::Create(path_);
  EXPECT_FALSE(holder.ok());
  EXPECT_FALSE(RulesHolder::Create(dir_ + "/missing.json").ok());
}

}  // namespace
}  // namespace esb::router

#include "api/tools_catalog.h"

#include <gtest/gtest.h>

#include <cctype>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

namespace esb::api {
namespace {

namespace json = boost::json;

std::string ReadCatalogueFile() {
  std::ifstream in(std::string(ESB_SOURCE_DIR) + "/sdk/tools.json", std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The Python SDK reads sdk/tools.json (sdk/python/tests/test_tools.py checks that side): the
// daemon must serve exactly that file, not a copy that can drift.
TEST(ToolsCatalogTest, EmbedsTheOneCatalogueFile) {
  std::string file = ReadCatalogueFile();
  ASSERT_FALSE(file.empty()) << "cannot read sdk/tools.json";
  EXPECT_EQ(std::string(ToolsCatalogSource()), file);
  json::object catalog = ToolsCatalog();
  json::array planner;
  const json::value parsed = json::parse(file);
  for (const json::value& t : parsed.at("tools").as_array())
    if (t.at("planner").as_bool()) planner.push_back(t);
  EXPECT_EQ(catalog.at("tools"), planner);
  EXPECT_EQ(catalog.at("mcp"), McpTools());
}

TEST(ToolsCatalogTest, EveryEntryHasAValidScopeAndSchema) {
  json::array tools = json::parse(ReadCatalogueFile()).as_object().at("tools").as_array();
  ASSERT_EQ(tools.size(), 10u);
  for (const json::value& t : tools) {
    const json::object& o = t.as_object();
    std::string name(o.at("name").as_string());
    SCOPED_TRACE(name);
    const std::string scope(o.at("scope").as_string());
    EXPECT_TRUE(scope == "environment" || scope == "daemon");
    EXPECT_TRUE(o.at("planner").is_bool());
    EXPECT_EQ(name.substr(0, name.find('.')), scope == "environment" ? "environment" : "esbd");
    const json::object& schema = o.at("input_schema").as_object();
    EXPECT_EQ(schema.at("type"), "object");
    EXPECT_EQ(schema.at("additionalProperties"), false);
    EXPECT_TRUE(schema.at("properties").is_object());
    // environment_id is the MCP view's to add (required), never the file's for those tools.
    if (scope == "environment")
      EXPECT_FALSE(schema.at("properties").as_object().contains("environment_id"));
  }
}

// The names and order CONTEXT/docs promise on /mcp, MCP's name rules, environment_id first
// and required on every environment tool.
TEST(ToolsCatalogTest, McpViewListsEveryToolWithEnvironmentIdOnEnvironmentTools) {
  json::array mcp = McpTools();
  const char* names[] = {"create_environment",   "list_environments", "delete_environment",
                         "execute_command",      "write_file",        "read_file",
                         "list_files",           "run_code",          "list_environment_tools",
                         "call_environment_tool"};
  ASSERT_EQ(mcp.size(), std::size(names));
  for (size_t i = 0; i < mcp.size(); ++i) {
    const json::object& t = mcp[i].as_object();
    SCOPED_TRACE(names[i]);
    EXPECT_EQ(t.at("name"), names[i]);
    const std::string name(t.at("name").as_string());
    EXPECT_LE(name.size(), 128u);
    for (char c : name)
      EXPECT_TRUE(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.');
    const json::object& schema = t.at("inputSchema").as_object();
    const json::object& props = schema.at("properties").as_object();
    const bool env_scoped = i >= 3 && i != 7;  // all but the lifecycle tools and run_code
    if (env_scoped) {
      EXPECT_EQ(props.begin()->key(), "environment_id");
      EXPECT_EQ(props.at("environment_id"), EnvironmentIdSchema());
      EXPECT_EQ(schema.at("required").as_array().at(0), "environment_id");
    } else if (std::string(names[i]) != "delete_environment" &&
               std::string(names[i]) != "run_code") {
      EXPECT_FALSE(props.contains("environment_id"));
    }
    EXPECT_FALSE(t.at("description").as_string().empty());
  }
  // run_code's tier and the environment it may run in.
  const json::object& run = mcp[7].at("inputSchema").at("properties").as_object();
  EXPECT_EQ(run.at("tier").at("enum"), (json::array{"auto", "nano", "heavy"}));
  EXPECT_EQ(mcp[7].at("inputSchema").at("required"), json::array{"code"});
}

TEST(ToolsCatalogTest, VendorFormatsAreDerivedFromTheNeutralOnes) {
  json::object catalog = ToolsCatalog();
  const json::array& tools = catalog.at("tools").as_array();
  const json::array& openai = catalog.at("openai").as_array();
  const json::array& anthropic = catalog.at("anthropic").as_array();
  ASSERT_EQ(tools.size(), 4u);
  ASSERT_EQ(openai.size(), tools.size());
  ASSERT_EQ(anthropic.size(), tools.size());
  const char* wire[] = {"environment_execute_command", "environment_write_file",
                        "environment_read_file", "environment_list_files"};
  for (size_t i = 0; i < tools.size(); ++i) {
    const json::object& t = tools[i].as_object();
    std::string description = std::string(t.at("description").as_string()) + " " +
                              std::string(t.at("output_description").as_string());
    const json::object& fn = openai[i].as_object().at("function").as_object();
    EXPECT_EQ(openai[i].as_object().at("type"), "function");
    EXPECT_EQ(fn.at("name"), wire[i]);
    EXPECT_EQ(fn.at("description"), description.c_str());
    EXPECT_EQ(fn.at("parameters"), t.at("input_schema"));
    EXPECT_EQ(anthropic[i].as_object().at("name"), wire[i]);
    EXPECT_EQ(anthropic[i].as_object().at("description"), description.c_str());
    EXPECT_EQ(anthropic[i].as_object().at("input_schema"), t.at("input_schema"));
  }
}

}  // namespace
}  // namespace esb::api

#include "api/tools_catalog.h"

#include <gtest/gtest.h>

#include <fstream>
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
  EXPECT_EQ(catalog.at("tools"), json::parse(file).as_object().at("tools"));
}

TEST(ToolsCatalogTest, VendorFormatsAreDerivedFromTheNeutralOnes) {
  json::object catalog = ToolsCatalog();
  const json::array& tools = catalog.at("tools").as_array();
  const json::array& openai = catalog.at("openai").as_array();
  const json::array& anthropic = catalog.at("anthropic").as_array();
  ASSERT_EQ(tools.size(), 3u);
  ASSERT_EQ(openai.size(), tools.size());
  ASSERT_EQ(anthropic.size(), tools.size());
  const char* wire[] = {"environment_execute_command", "environment_write_file",
                        "environment_read_file"};
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

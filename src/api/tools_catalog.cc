#include "api/tools_catalog.h"

#include <string>

namespace esb::api {
namespace json = boost::json;
namespace {

std::string WireName(const json::string& name) {
  std::string s(name);
  for (char& c : s)
    if (c == '.') c = '_';
  return s;
}

}  // namespace

json::object ToolsCatalog() {
  // A broken catalogue fails the build's tests (tools_catalog_test), never a request.
  json::array tools = json::parse(ToolsCatalogSource()).as_object().at("tools").as_array();
  json::array openai, anthropic;
  for (const auto& t : tools) {
    const json::object& o = t.as_object();
    std::string wire = WireName(o.at("name").as_string());
    std::string description = std::string(o.at("description").as_string()) + " " +
                              std::string(o.at("output_description").as_string());
    openai.push_back(json::object{
        {"type", "function"},
        {"function",
         json::object{
             {"name", wire}, {"description", description}, {"parameters", o.at("input_schema")}}}});
    anthropic.push_back(json::object{
        {"name", wire}, {"description", description}, {"input_schema", o.at("input_schema")}});
  }
  return json::object{{"tools", std::move(tools)},
                      {"openai", std::move(openai)},
                      {"anthropic", std::move(anthropic)}};
}

}  // namespace esb::api

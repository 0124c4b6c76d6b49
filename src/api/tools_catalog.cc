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

std::string McpName(const json::string& name) {
  std::string s(name);
  return s.substr(s.find('.') + 1);
}

std::string Description(const json::object& tool) {
  return std::string(tool.at("description").as_string()) + " " +
         std::string(tool.at("output_description").as_string());
}

// A broken catalogue fails the build's tests (tools_catalog_test), never a request.
json::array CatalogueTools() {
  return json::parse(ToolsCatalogSource()).as_object().at("tools").as_array();
}

}  // namespace

json::object EnvironmentIdSchema() {
  return json::object{
      {"type", "string"},
      {"minLength", 1},
      {"maxLength", 64},
      {"description",
       "The environment to act on: an id from create_environment or list_environments."}};
}

json::array McpTools() {
  json::array out;
  for (const json::value& t : CatalogueTools()) {
    const json::object& o = t.as_object();
    json::object schema = o.at("input_schema").as_object();
    if (o.at("scope").as_string() == "environment") {
      json::object props{{"environment_id", EnvironmentIdSchema()}};
      for (const auto& kv : schema["properties"].as_object()) props[kv.key()] = kv.value();
      json::array required{"environment_id"};
      if (const json::value* r = schema.if_contains("required"))
        for (const json::value& x : r->as_array()) required.push_back(x);
      schema["properties"] = std::move(props);
      schema["required"] = std::move(required);
    }
    json::object tool{{"name", McpName(o.at("name").as_string())},
                      {"description", Description(o)},
                      {"inputSchema", std::move(schema)}};
    if (const json::value* a = o.if_contains("annotations")) tool["annotations"] = *a;
    out.push_back(std::move(tool));
  }
  return out;
}

json::object ToolsCatalog() {
  json::array tools, openai, anthropic;
  for (const auto& t : CatalogueTools()) {
    const json::object& o = t.as_object();
    if (!o.at("planner").as_bool()) continue;
    std::string wire = WireName(o.at("name").as_string());
    std::string description = Description(o);
    openai.push_back(json::object{
        {"type", "function"},
        {"function",
         json::object{
             {"name", wire}, {"description", description}, {"parameters", o.at("input_schema")}}}});
    anthropic.push_back(json::object{
        {"name", wire}, {"description", description}, {"input_schema", o.at("input_schema")}});
    tools.push_back(o);
  }
  return json::object{{"tools", std::move(tools)},
                      {"openai", std::move(openai)},
                      {"anthropic", std::move(anthropic)},
                      {"mcp", McpTools()}};
}

}  // namespace esb::api

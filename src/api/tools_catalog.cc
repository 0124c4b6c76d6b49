#include "api/tools_catalog.h"

#include <string>

namespace esb::api {
namespace json = boost::json;
namespace {

// Descriptions are seed 004's words.
constexpr char kTools[] = R"json([
 {"name": "environment.execute_command",
  "description": "Executes any shell command within the secure, stateful environment. This is the primary tool for all actions like listing files, running scripts, using git, etc. Maintains a persistent working directory and state for the lifetime of the environment.",
  "input_schema": {"type": "object",
   "properties": {
    "command": {"type": "string", "description": "The full shell command to execute."},
    "timeout_seconds": {"type": "integer", "default": 60, "minimum": 1, "maximum": 3600,
                        "description": "Seconds before the command is killed (default 60)."}},
   "required": ["command"], "additionalProperties": false},
  "output_description": "Returns {'error': bool, 'stdout': str, 'stderr': str, 'exit_code': int}. `error` is true if the exit code is not 0."},
 {"name": "environment.write_file",
  "description": "Creates or overwrites a file with the provided content. Useful for creating Python scripts, shell scripts, or configuration files that will be executed later.",
  "input_schema": {"type": "object",
   "properties": {
    "path": {"type": "string", "description": "The relative path within the workspace (e.g., 'src/main.py')."},
    "content": {"type": "string", "description": "The full content of the file."}},
   "required": ["path", "content"], "additionalProperties": false},
  "output_description": "Returns {'error': bool, 'message': 'File saved successfully.' or 'Error message'}."},
 {"name": "environment.read_file",
  "description": "Reads the entire content of a file from the workspace. Use this to inspect code, view logs, or get the output of a script that writes to a file.",
  "input_schema": {"type": "object",
   "properties": {
    "path": {"type": "string", "description": "The relative path of the file to read."}},
   "required": ["path"], "additionalProperties": false},
  "output_description": "Returns {'error': bool, 'content': 'The file content' or 'Error message'}."}
])json";

// OpenAI and Anthropic accept only ^[a-zA-Z0-9_-]+$ as tool names.
std::string WireName(const json::string& name) {
  std::string s(name);
  for (char& c : s)
    if (c == '.') c = '_';
  return s;
}

}  // namespace

json::object ToolsCatalog() {
  json::array tools = json::parse(kTools).as_array();
  json::array openai, anthropic;
  for (const auto& t : tools) {
    const json::object& o = t.as_object();
    std::string wire = WireName(o.at("name").as_string());
    openai.push_back(json::object{
        {"type", "function"},
        {"function", json::object{{"name", wire},
                                  {"description", o.at("description")},
                                  {"parameters", o.at("input_schema")}}}});
    anthropic.push_back(json::object{{"name", wire},
                                     {"description", o.at("description")},
                                     {"input_schema", o.at("input_schema")}});
  }
  return json::object{{"tools", std::move(tools)},
                      {"openai", std::move(openai)},
                      {"anthropic", std::move(anthropic)}};
}

}  // namespace esb::api

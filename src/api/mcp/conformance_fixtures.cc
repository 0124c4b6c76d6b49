#include "api/mcp/conformance_fixtures.h"

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <thread>

#include "api/mcp/mcp_call.h"

namespace esb::api::mcp {
namespace {
namespace json = boost::json;

// A 1x1 red PNG and a 44-byte silent WAV header with 2 samples.
constexpr const char* kPng =
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg"
    "==";
constexpr const char* kWav = "UklGRigAAABXQVZFZm10IBAAAAABAAEAQB8AAEAfAAABAAgAZGF0YQQAAACAgICA";

json::object Text(std::string_view text) { return json::object{{"type", "text"}, {"text", text}}; }

json::object EmptySchema() {
  return json::object{{"type", "object"}, {"properties", json::object()}};
}

void Sleep(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

struct Fixture {
  json::object definition;
  std::function<absl::StatusOr<tools::ToolResult>(const json::object&, const tools::CallContext&)>
      call;
};

std::vector<Fixture> MakeFixtures() {
  std::vector<Fixture> f;
  auto add = [&f](std::string name, std::string description, json::object schema, auto fn) {
    f.push_back(
        {json::object{
             {"name", name}, {"description", description}, {"inputSchema", std::move(schema)}},
         fn});
  };
  auto ok = [](json::array content) {
    tools::ToolResult r;
    r.content = std::move(content);
    return absl::StatusOr<tools::ToolResult>(std::move(r));
  };
  add("test_simple_text", "Returns simple text content (conformance fixture)", EmptySchema(),
      [ok](const json::object&, const tools::CallContext&) {
        return ok({Text("This is a simple text response for testing.")});
      });
  add("test_image_content", "Returns image content (conformance fixture)", EmptySchema(),
      [ok](const json::object&, const tools::CallContext&) {
        return ok({json::object{{"type", "image"}, {"data", kPng}, {"mimeType", "image/png"}}});
      });
  add("test_audio_content", "Returns audio content (conformance fixture)", EmptySchema(),
      [ok](const json::object&, const tools::CallContext&) {
        return ok({json::object{{"type", "audio"}, {"data", kWav}, {"mimeType", "audio/wav"}}});
      });
  add("test_embedded_resource", "Returns an embedded resource (conformance fixture)", EmptySchema(),
      [ok](const json::object&, const tools::CallContext&) {
        return ok({json::object{{"type", "resource"},
                                {"resource", json::object{{"uri", "test://embedded-resource"},
                                                          {"mimeType", "text/plain"},
                                                          {"text",
                                                           "This is an embedded resource "
                                                           "content."}}}}});
      });
  add("test_multiple_content_types", "Returns text, image and resource (conformance fixture)",
      EmptySchema(), [ok](const json::object&, const tools::CallContext&) {
        return ok({Text("Multiple content types test:"),
                   json::object{{"type", "image"}, {"data", kPng}, {"mimeType", "image/png"}},
                   json::object{
                       {"type", "resource"},
                       {"resource", json::object{{"uri", "test://mixed-content-resource"},
                                                 {"mimeType", "application/json"},
                                                 {"text", "{\"test\":\"data\",\"value\":123}"}}}}});
      });
  add("test_error_handling", "Always fails as a tool (conformance fixture)", EmptySchema(),
      [](const json::object&, const tools::CallContext&) {
        tools::ToolResult r;
        r.is_error = true;
        r.content.push_back(Text("This tool intentionally returns an error for testing"));
        return absl::StatusOr<tools::ToolResult>(std::move(r));
      });
  add("test_tool_with_progress", "Reports progress 0, 50, 100 of 100 (conformance fixture)",
      EmptySchema(), [ok](const json::object&, const tools::CallContext& ctx) {
        for (int p : {0, 50, 100}) {
          if (ctx.cancelled && ctx.cancelled()) return ok({Text("cancelled")});
          if (ctx.progress) ctx.progress({static_cast<double>(p), 100.0, ""});
          if (p != 100) Sleep(50);
        }
        return ok({Text("Progress test completed")});
      });
  // Logs three messages while it runs.
  auto logging = [ok](const json::object&, const tools::CallContext&) {
    const McpCallExtras* call = CurrentCall();
    for (const char* m :
         {"Tool execution started", "Tool processing data", "Tool execution completed"}) {
      if (call && call->log) call->log("info", "conformance", json::value(m));
      Sleep(20);
    }
    return ok({Text("Logging test completed")});
  };
  add("test_tool_with_logging", "Sends three log messages (conformance fixture)", EmptySchema(),
      logging);
  add("test_logging_tool",
      "Sends log messages only when the request asks for a level "
      "(2026-07-28 conformance fixture)",
      EmptySchema(), logging);
  add("test_missing_capability",
      "Needs the client's sampling capability (2026-07-28 conformance fixture)", EmptySchema(),
      [ok](const json::object&, const tools::CallContext&) -> absl::StatusOr<tools::ToolResult> {
        const McpCallExtras* call = CurrentCall();
        if (!call || !call->client_capabilities ||
            !call->client_capabilities->contains("sampling")) {
          return MissingClientCapability(json::object{{"sampling", json::object()}});
        }
        return ok({Text("the client declared sampling")});
      });
  // 2026-07-28 has no server-to-client requests on a response stream: esbd answers with the
  // result (the suite checks that the stream carries no independent request).
  add("test_streaming_elicitation",
      "Answers without sending the client a request on the stream (2026-07-28 conformance "
      "fixture)",
      EmptySchema(), [ok](const json::object&, const tools::CallContext&) {
        return ok({Text("esbd sends no server-to-client requests on a response stream")});
      });
  // 2026-07-28 multi-round calls (SEP-2322): ask the client, then answer from its responses.
  // `Ask` returns true (and the tool answers with the input requests) while an answer under one
  // of `requests`' keys is missing or `state` does not match the round.
  auto elicit = [](std::string message, std::string field, std::string type) {
    return json::object{
        {"method", "elicitation/create"},
        {"params", json::object{{"message", message},
                                {"requestedSchema",
                                 json::object{{"type", "object"},
                                              {"properties",
                                               json::object{{field, json::object{{"type", type}}}}},
                                              {"required", json::array{json::value(field)}}}}}}};
  };
  auto sample = [](std::string text, int max_tokens) {
    return json::object{
        {"method", "sampling/createMessage"},
        {"params", json::object{{"messages",
                                 json::array{json::object{
                                     {"role", "user"},
                                     {"content", json::object{{"type", "text"}, {"text", text}}}}}},
                                {"maxTokens", max_tokens}}}};
  };
  auto roots = [] { return json::object{{"method", "roots/list"}, {"params", json::object()}}; };
  // The client's answer under `key` (its result object), or null.
  auto answer = [](std::string_view key) -> const json::object* {
    const McpCallExtras* call = CurrentCall();
    if (!call || !call->input_responses) return nullptr;
    const json::value* v = call->input_responses->if_contains(key);
    return v && v->is_object() ? &v->as_object() : nullptr;
  };
  auto state = [] {
    const McpCallExtras* call = CurrentCall();
    return call ? call->request_state : std::string();
  };
  // Asks for `requests` (with `next_state`) unless every key is answered and the round's state
  // is `expect_state`; false when the request cannot carry input requests (legacy).
  auto need = [answer, state](const json::object& requests, const std::string& expect_state,
                              const std::string& next_state) -> std::optional<bool> {
    bool all = state() == expect_state;
    for (const auto& [k, v] : requests) all = all && answer(k) != nullptr;
    if (all) return false;
    if (!RequireInput(requests, next_state)) return std::nullopt;
    return true;
  };
  auto legacy = [] {
    tools::ToolResult r;
    r.is_error = true;
    r.content.push_back(
        Text("this tool asks the client for input, which only 2026-07-28 requests can carry"));
    return absl::StatusOr<tools::ToolResult>(std::move(r));
  };
  auto text_of = [](const json::object* o, std::string_view field) -> std::string {
    if (!o) return "";
    const json::value* c = o->if_contains("content");
    if (c && c->is_object()) {
      if (const json::value* f = c->as_object().if_contains(field); f && f->is_string())
        return std::string(f->as_string());
    }
    return "";
  };
  add("test_input_required_result_elicitation", "Asks the client's name (SEP-2322 fixture)",
      EmptySchema(), [=](const json::object&, const tools::CallContext&) {
        auto asked = need(
            json::object{{"user_name", elicit("What is your name?", "name", "string")}}, "", "");
        if (!asked) return legacy();
        if (*asked) return ok({});
        return ok({Text("Hello, " + text_of(answer("user_name"), "name") + "!")});
      });
  add("test_input_required_result_sampling", "Asks the client's model (SEP-2322 fixture)",
      EmptySchema(), [=](const json::object&, const tools::CallContext&) {
        auto asked =
            need(json::object{{"capital_question", sample("What is the capital of France?", 100)}},
                 "", "");
        if (!asked) return legacy();
        if (*asked) return ok({});
        return ok({Text("LLM response: " + text_of(answer("capital_question"), "text"))});
      });
  add("test_input_required_result_list_roots", "Asks the client's roots (SEP-2322 fixture)",
      EmptySchema(), [=](const json::object&, const tools::CallContext&) {
        auto asked = need(json::object{{"client_roots", roots()}}, "", "");
        if (!asked) return legacy();
        if (*asked) return ok({});
        std::string uris;
        if (const json::value* r = answer("client_roots")->if_contains("roots");
            r && r->is_array()) {
          for (const auto& root : r->as_array()) {
            if (root.is_object() && root.as_object().contains("uri"))
              uris += (uris.empty() ? "" : ", ") + json::serialize(root.as_object().at("uri"));
          }
        }
        return ok({Text("client roots: " + uris)});
      });
  add("test_input_required_result_request_state", "Round-trips requestState (SEP-2322 fixture)",
      EmptySchema(), [=](const json::object&, const tools::CallContext&) {
        auto asked = need(json::object{{"confirm", elicit("Please confirm", "ok", "boolean")}},
                          "confirm-pending", "confirm-pending");
        if (!asked) return legacy();
        if (*asked) return ok({});
        return ok({Text("state-ok: the request state came back intact")});
      });
  add("test_input_required_result_multiple_inputs",
      "Asks for several inputs at once (SEP-2322 fixture)", EmptySchema(),
      [=](const json::object&, const tools::CallContext&) {
        auto asked =
            need(json::object{{"user_name", elicit("What is your name?", "name", "string")},
                              {"greeting", sample("Generate a greeting", 50)},
                              {"client_roots", roots()}},
                 "multiple-pending", "multiple-pending");
        if (!asked) return legacy();
        if (*asked) return ok({});
        return ok({Text("got all three inputs")});
      });
  add("test_input_required_result_multi_round", "Asks twice (SEP-2322 fixture)", EmptySchema(),
      [=](const json::object&, const tools::CallContext&) {
        if (state() == "round-2" && answer("step2"))
          return ok({Text("done after two rounds: " + text_of(answer("step2"), "color"))});
        std::optional<bool> asked;
        if (state() == "round-1" && answer("step1")) {
          asked = need(json::object{{"step2", elicit("Step 2: What is your favorite color?",
                                                     "color", "string")}},
                       "round-2", "round-2");
        } else {
          asked =
              need(json::object{{"step1", elicit("Step 1: What is your name?", "name", "string")}},
                   "round-1", "round-1");
        }
        if (!asked) return legacy();
        return ok({});
      });
  add("test_input_required_result_tampered_state",
      "Rejects an altered requestState (SEP-2322 fixture; the endpoint signs it)", EmptySchema(),
      [=](const json::object&, const tools::CallContext&) {
        auto asked = need(json::object{{"confirm", elicit("Please confirm", "ok", "boolean")}},
                          "tamper-check", "tamper-check");
        if (!asked) return legacy();
        if (*asked) return ok({});
        return ok({Text("state-ok")});
      });
  add("test_input_required_result_capabilities",
      "Asks only for what the client declared (SEP-2322 fixture)", EmptySchema(),
      [=](const json::object&, const tools::CallContext&) {
        const McpCallExtras* call = CurrentCall();
        const json::object* caps = call ? call->client_capabilities : nullptr;
        json::object requests;
        if (caps && caps->contains("elicitation"))
          requests["user_name"] = elicit("What is your name?", "name", "string");
        if (caps && caps->contains("sampling"))
          requests["greeting"] = sample("Generate a greeting", 50);
        if (caps && caps->contains("roots")) requests["client_roots"] = roots();
        if (requests.empty()) return ok({Text("the client declared no capability to ask with")});
        auto asked = need(requests, "capabilities", "capabilities");
        if (!asked) return legacy();
        if (*asked) return ok({});
        return ok({Text("got the declared inputs")});
      });
  // JSON Schema 2020-12 keywords must reach the client unchanged.
  json::error_code ec;
  json::value schema = json::parse(R"({
    "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
    "$defs": {"address": {"$anchor": "addressDef", "type": "object",
              "properties": {"street": {"type": "string"}, "city": {"type": "string"}}}},
    "properties": {"name": {"type": "string"}, "address": {"$ref": "#/$defs/address"},
                   "contactMethod": {"type": "string", "enum": ["phone", "email"]},
                   "phone": {"type": "string"}, "email": {"type": "string"}},
    "allOf": [{"anyOf": [{"required": ["phone"]}, {"required": ["email"]}]}],
    "if": {"properties": {"contactMethod": {"const": "phone"}}, "required": ["contactMethod"]},
    "then": {"required": ["phone"]}, "else": {"required": ["email"]},
    "additionalProperties": false})",
                                   ec);
  add("json_schema_2020_12_tool", "Has a JSON Schema 2020-12 inputSchema (conformance fixture)",
      schema.as_object(), [ok](const json::object&, const tools::CallContext&) {
        return ok({Text("json_schema_2020_12_tool called")});
      });
  // SEP-2243: parameters mirrored in Mcp-Param-* headers (checked by the endpoint).
  json::value header_schema = json::parse(R"({
    "type": "object",
    "properties": {"region": {"type": "string", "x-mcp-header": "Region"},
                   "query": {"type": "string"}},
    "required": ["region"]})",
                                          ec);
  add("test_custom_headers",
      "Mirrors 'region' in the Mcp-Param-Region header (conformance "
      "fixture)",
      header_schema.as_object(), [ok](const json::object& args, const tools::CallContext&) {
        const json::value* region = args.if_contains("region");
        std::string r = region && region->is_string() ? std::string(region->as_string()) : "";
        return ok({Text("region: " + r)});
      });
  return f;
}

class Fixtures final : public tools::ToolProvider {
 public:
  Fixtures() : fixtures_(MakeFixtures()) {}
  absl::StatusOr<std::vector<tools::ToolDefinition>> ListTools(const Caller&) override {
    std::vector<tools::ToolDefinition> out;
    for (const Fixture& f : fixtures_) out.push_back(f.definition);
    return out;
  }
  absl::StatusOr<tools::ToolResult> CallTool(std::string_view name, const json::object& arguments,
                                             const tools::CallContext& context) override {
    for (const Fixture& f : fixtures_) {
      if (f.definition.at("name").as_string() == name) return f.call(arguments, context);
    }
    return absl::NotFoundError("unknown tool '" + std::string(name) + "'");
  }

 private:
  std::vector<Fixture> fixtures_;
};

}  // namespace

std::shared_ptr<tools::ToolProvider> NewConformanceFixtures() {
  return std::make_shared<Fixtures>();
}

}  // namespace esb::api::mcp

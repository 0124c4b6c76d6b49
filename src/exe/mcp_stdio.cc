#include "exe/mcp_stdio.h"

#include <atomic>
#include <condition_variable>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "boost/json.hpp"
#include "cli/sse.h"
#include "common/util.h"

namespace esb {
namespace {
namespace json = boost::json;

constexpr std::string_view kMetaVersion = "io.modelcontextprotocol/protocolVersion";

std::optional<json::value> ParseMessage(std::string_view text) {
  json::parse_options popts;
  popts.max_depth = 64;
  json::parser p(json::storage_ptr(), popts);
  json::error_code ec;
  p.write(text.data(), text.size(), ec);
  if (ec) return std::nullopt;
  return p.release();
}

json::object Error(const json::value& id, int code, std::string message) {
  return json::object{{"jsonrpc", "2.0"},
                      {"id", id},
                      {"error", json::object{{"code", code}, {"message", std::move(message)}}}};
}

class Bridge {
 public:
  Bridge(const McpStdioOptions& o, std::ostream& out, const cli::TransportFactory& t)
      : o_(o), out_(out), transport_(t) {}

  int Run(std::istream& in) {
    std::string line;
    bool too_long = false;
    std::streambuf* sb = in.rdbuf();
    for (;;) {
      int c = sb->sbumpc();
      if (c == std::char_traits<char>::eof()) break;
      if (c != '\n') {
        if (line.size() >= o_.max_line_bytes) {
          too_long = true;
          line.clear();
        }
        if (!too_long) line.push_back(static_cast<char>(c));
        continue;
      }
      if (too_long) {
        Write(Error(nullptr, -32700, "message longer than the bridge's line limit"));
        too_long = false;
      } else if (!line.empty() && line != "\r") {
        Dispatch(line);
      }
      line.clear();
    }
    if (!line.empty() && !too_long) Dispatch(line);
    // stdin closed: the client is gone. Stop what runs, end the session.
    {
      std::unique_lock<std::mutex> lock(mu_);
      for (auto& [k, call] : inflight_) call->Fire();
      cv_.wait_for(lock, std::chrono::seconds(10), [this] { return running_ == 0; });
    }
    std::string session;
    {
      std::lock_guard<std::mutex> lock(mu_);
      session = session_id_;
    }
    if (!session.empty()) {
      cli::HttpRequest del{.method = "DELETE", .target = o_.path};
      del.headers = BaseHeaders();
      del.headers.emplace_back("Mcp-Session-Id", session);
      auto t = transport_(o_.endpoint);
      (void)t->Send(del, nullptr);
    }
    return 0;
  }

 private:
  std::vector<std::pair<std::string, std::string>> BaseHeaders() const {
    std::vector<std::pair<std::string, std::string>> h;
    if (!o_.api_key.empty()) h.emplace_back("Authorization", "Bearer " + o_.api_key);
    return h;
  }

  void Write(const json::object& message) {
    std::string line = json::serialize(message);
    std::lock_guard<std::mutex> lock(out_mu_);
    out_ << line << '\n';
    out_.flush();
  }

  void Dispatch(const std::string& line) {
    std::optional<json::value> v = ParseMessage(line);
    if (!v) return Write(Error(nullptr, -32700, "parse error: not one JSON value"));
    if (!v->is_object())
      return Write(Error(nullptr, -32600, "one JSON-RPC message (an object) per line"));
    json::object& m = v->as_object();
    const json::value* idp = m.if_contains("id");
    json::value id = idp ? *idp : json::value();
    const json::value* mp = m.if_contains("method");
    std::string method = mp && mp->is_string() ? std::string(mp->as_string()) : "";
    const json::object* params = nullptr;
    if (const json::value* p = m.if_contains("params"); p && p->is_object())
      params = &p->as_object();
    const json::object* meta = nullptr;
    if (params) {
      if (const json::value* mm = params->if_contains("_meta"); mm && mm->is_object())
        meta = &mm->as_object();
    }
    const json::value* mv = meta ? meta->if_contains(kMetaVersion) : nullptr;
    const bool modern = mv && mv->is_string();

    cli::HttpRequest req{.method = "POST", .target = o_.path, .body = line};
    req.headers = BaseHeaders();
    req.headers.emplace_back("Content-Type", "application/json");
    req.headers.emplace_back("Accept", "application/json, text/event-stream");
    if (modern) {
      req.headers.emplace_back("MCP-Protocol-Version", std::string(mv->as_string()));
      if (!method.empty()) req.headers.emplace_back("Mcp-Method", method);
      if (params) {
        const char* key = method == "resources/read" ? "uri" : "name";
        if (const json::value* n = params->if_contains(key); n && n->is_string())
          req.headers.emplace_back("Mcp-Name", std::string(n->as_string()));
      }
    } else {
      std::lock_guard<std::mutex> lock(mu_);
      if (!session_id_.empty()) req.headers.emplace_back("Mcp-Session-Id", session_id_);
      if (!protocol_version_.empty())
        req.headers.emplace_back("MCP-Protocol-Version", protocol_version_);
    }

    if (method == "notifications/cancelled" && params) {
      // The modern HTTP cancel is closing the call's stream; a legacy session also gets the
      // notification itself (below).
      if (const json::value* rid = params->if_contains("requestId")) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = inflight_.find(json::serialize(*rid));
        if (it != inflight_.end()) {
          it->second->cancelled = true;
          if (it->second->modern) it->second->Fire();
        }
      }
      if (modern) return;
    }
    const bool is_request = idp != nullptr && !method.empty();
    auto call = std::make_shared<Call>();
    call->modern = modern;
    call->abort = std::make_shared<cli::RequestAbort>();
    req.abort = call->abort;
    std::string key = json::serialize(id);
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return running_ < o_.max_concurrent; });
      ++running_;
      if (is_request) inflight_[key] = call;
    }
    // Notifications and responses go in order on this thread; requests on their own.
    auto work = [this, req = std::move(req), call, key, id, is_request,
                 initialize = method == "initialize"]() {
      Forward(req, *call, id, is_request, initialize);
      std::lock_guard<std::mutex> lock(mu_);
      if (is_request) {
        auto it = inflight_.find(key);
        if (it != inflight_.end() && it->second == call) inflight_.erase(it);
      }
      --running_;
      cv_.notify_all();
    };
    if (is_request && !initialize_pending(method)) {
      std::thread(std::move(work)).detach();
    } else {
      work();
    }
  }

  // initialize runs inline: what follows needs its session.
  static bool initialize_pending(const std::string& method) { return method == "initialize"; }

  struct Call {
    bool modern = false;
    std::atomic<bool> cancelled{false};
    std::atomic<bool> answered{false};
    std::shared_ptr<cli::RequestAbort> abort;
    void Fire() { abort->Fire(); }
  };

  class Sink : public cli::BodySink {
   public:
    Sink(Bridge* b, Call* c)
        : b_(b), c_(c), parser_([this](const cli::SseEvent& e) { return OnEvent(e); }) {}
    bool OnHeaders(int status, const std::string& content_type) override {
      return status == 200 && content_type.find("text/event-stream") != std::string::npos;
    }
    absl::Status OnData(std::string_view chunk) override { return parser_.Feed(chunk); }

   private:
    absl::Status OnEvent(const cli::SseEvent& e) {
      if (e.data.empty()) return absl::OkStatus();  // priming / keep-alive
      std::optional<json::value> v = ParseMessage(e.data);
      if (!v || !v->is_object()) return absl::OkStatus();
      if (v->as_object().contains("result") || v->as_object().contains("error"))
        c_->answered = true;
      b_->Write(v->as_object());
      return absl::OkStatus();
    }
    Bridge* b_;
    Call* c_;
    cli::SseParser parser_;
  };

  void Forward(const cli::HttpRequest& req, Call& call, const json::value& id, bool is_request,
               bool initialize) {
    Sink sink(this, &call);
    auto t = transport_(o_.endpoint);
    absl::StatusOr<cli::HttpResponse> r = t->Send(req, &sink);
    if (!r.ok()) {
      if (call.cancelled || absl::IsCancelled(r.status())) return;
      LogWarn("mcp-stdio: " + std::string(StdView(r.status().message())));
      if (is_request) Write(Error(id, -32603, std::string(StdView(r.status().message()))));
      return;
    }
    if (r->streamed) {
      if (is_request && !call.answered && !call.cancelled)
        Write(Error(id, -32603, "esbd ended the stream without an answer"));
      return;
    }
    if (r->status == 202 || r->status == 204) return;
    std::optional<json::value> v = ParseMessage(r->body);
    if (v && v->is_object() && v->as_object().contains("jsonrpc")) {
      if (initialize && r->status == 200) {
        std::lock_guard<std::mutex> lock(mu_);
        session_id_ = r->Header("Mcp-Session-Id");
        const json::value* res = v->as_object().if_contains("result");
        if (res && res->is_object()) {
          if (const json::value* pv = res->as_object().if_contains("protocolVersion");
              pv && pv->is_string())
            protocol_version_ = std::string(pv->as_string());
        }
      }
      if (is_request || v->as_object().contains("error")) Write(v->as_object());
      return;
    }
    if (is_request) {
      std::string why = r->body.substr(0, 300);
      if (v && v->is_object()) {
        if (const json::value* msg = v->as_object().if_contains("message"); msg && msg->is_string())
          why = std::string(msg->as_string());
      }
      Write(Error(id, -32603, "esbd answered HTTP " + std::to_string(r->status) + ": " + why));
    }
  }

  const McpStdioOptions& o_;
  std::ostream& out_;
  const cli::TransportFactory& transport_;
  std::mutex out_mu_;
  std::mutex mu_;
  std::condition_variable cv_;
  int running_ = 0;
  std::map<std::string, std::shared_ptr<Call>> inflight_;
  std::string session_id_, protocol_version_;
};

}  // namespace

int RunMcpStdio(const McpStdioOptions& options, std::istream& in, std::ostream& out,
                const cli::TransportFactory& transport) {
  Bridge bridge(options, out, transport);
  return bridge.Run(in);
}

}  // namespace esb

#include "core/audit.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/util.h"
#include "governance/audit_redact.h"

namespace esb {

void AuditLog::Record(const Caller& caller, const AuditEvent& event) {
  if (!caller.audited || caller.tenant.empty()) return;
  AuditEntry e;
  e.time_ms = NowUnixMs();
  e.tenant = caller.tenant;
  e.principal = caller.principal;
  e.environment_id = event.environment_id;
  e.action = event.action;
  e.detail = event.detail;  // the store caps stored fields (and marks the cut): one place
  e.exit_code = event.exit_code;
  e.duration_ms = event.duration_ms;
  e.bytes = event.bytes;
  e.status = HttpStatusFor(event.outcome);
  absl::Status st = store_->AppendAudit(e);
  if (!st.ok()) {
    metrics_->CountError("audit");
    LogError(absl::StrCat("audit append failed: ", st.ToString()));
  }
}

void AuditLog::RecordToolCall(const Caller& caller, const ToolCallAuditRow& row) {
  std::vector<std::string> rules = row.call.rule_ids;
  rules.insert(rules.end(), row.call.result_rule_ids.begin(), row.call.result_rule_ids.end());
  metrics_->CountToolCall(row.call.server == "esbd" ? "esbd" : "hosted", row.call.decision, rules);
  if (!caller.audited || caller.tenant.empty()) return;
  AuditEntry e;
  e.time_ms = NowUnixMs();
  e.tenant = caller.tenant;
  e.principal = caller.principal;
  e.environment_id = row.environment_id;
  e.action = "tool.call";
  e.detail = absl::StrCat(row.call.server, ".", row.call.tool, " ", row.call.decision);
  for (const std::string& rule : rules) absl::StrAppend(&e.detail, " ", rule);
  e.duration_ms = row.duration_ms;
  e.bytes = row.call.result_bytes;
  // A DLP block is a 403 as for egress (HttpStatusFor maps PermissionDenied to 400: EACCES).
  e.status = row.call.decision == "blocked" ? 403 : HttpStatusFor(row.outcome);
  e.tool_call = row.call;
  absl::Status st = store_->AppendAudit(e);
  if (!st.ok()) {
    metrics_->CountError("audit");
    LogError(absl::StrCat("audit append (tool call) failed: ", st.ToString()));
  }
}

std::string_view ToString(EgressDecision decision) {
  switch (decision) {
    case EgressDecision::kAllowed:
      return "allowed";
    case EgressDecision::kBlocked:
      return "blocked";
    case EgressDecision::kRedacted:
      return "redacted";
    case EgressDecision::kOpaque:
      return "opaque";
    case EgressDecision::kError:
      return "error";
  }
  return "error";
}

std::optional<EgressDecision> ParseEgressDecision(std::string_view name) {
  for (EgressDecision d :
       {EgressDecision::kAllowed, EgressDecision::kBlocked, EgressDecision::kRedacted,
        EgressDecision::kOpaque, EgressDecision::kError}) {
    if (ToString(d) == name) return d;
  }
  return std::nullopt;
}

void AuditLog::RecordEgress(const EgressAuditRow& row) {
  if (row.tenant.empty()) {
    metrics_->CountError("audit");
    LogError("audit append (egress) dropped: the event names no tenant");
    return;
  }
  metrics_->CountEgress(ToString(row.decision), row.rule_ids, row.added_latency_us);
  AuditEntry e;
  e.time_ms = row.time_ms != 0 ? row.time_ms : NowUnixMs();
  e.tenant = row.tenant;
  e.principal = "proxy";
  e.environment_id = row.environment_id;
  e.action = "egress";
  EgressFields& f = e.egress.emplace();
  f.intents = row.intents;
  f.method = row.method;
  f.scheme = row.scheme;
  f.host = row.host;
  f.port = row.port;
  // Masked again here (the proxy should have): the one rule, whoever built the event.
  f.path = governance::MaskUrlQuery(row.path);
  f.decision = std::string(ToString(row.decision));
  f.rule_ids = row.rule_ids;
  f.reason = row.reason;
  f.bytes_up = row.bytes_up;
  f.bytes_down = row.bytes_down;
  f.added_latency_us = row.added_latency_us;
  std::string_view rest = row.request_headers;
  while (!rest.empty()) {
    const size_t nl = rest.find('\n');
    std::string_view line = rest.substr(0, nl);
    rest = nl == std::string_view::npos ? std::string_view() : rest.substr(nl + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos) {
      // Not a header line: nothing tells what it holds, so nothing of it is kept.
      absl::StrAppend(&f.headers, "[masked]\n");
      continue;
    }
    std::string_view name = line.substr(0, colon);
    std::string_view value = line.substr(colon + 1);
    while (!value.empty() && (value.front() == ' ' || value.front() == '\t'))
      value.remove_prefix(1);
    absl::StrAppend(&f.headers, AbslView(name), ": ", governance::MaskHeaderValue(name, value),
                    "\n");
  }
  f.body = row.body;  // the store caps it at kMaxEgressBodyBytes (cut marked)
  if (row.body_truncated) f.body += "…[truncated]";
  f.body_bytes = row.body_bytes;
  f.body_sha256 = row.body_sha256;
  // The one-line summary in `detail` makes the row readable (and searchable) like any other.
  e.detail = absl::StrCat(row.method, " ", row.scheme.empty() ? "" : row.scheme + "://", row.host,
                          ":", row.port, f.path, " -> ", row.status, " ", f.decision,
                          row.rule_ids.empty() ? "" : " [", absl::StrJoin(row.rule_ids, " "),
                          row.rule_ids.empty() ? "" : "]");
  e.duration_ms = row.duration_ms;
  e.bytes = row.bytes_up + row.bytes_down;
  e.status = row.status;
  absl::Status st = store_->AppendAudit(e);
  if (!st.ok()) {
    metrics_->CountError("audit");
    LogError(absl::StrCat("audit append (egress) failed: ", st.ToString()));
  }
}

}  // namespace esb

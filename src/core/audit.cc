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
  if (row.tenant.empty()) return;
  AuditEntry e;
  e.time_ms = row.time_ms != 0 ? row.time_ms : NowUnixMs();
  e.tenant = row.tenant;
  e.principal = "proxy";
  e.environment_id = row.environment_id;
  e.action = "egress";
  e.detail = absl::StrCat(row.method, " ", row.host, ":", row.port,
                          governance::MaskUrlQuery(row.path), " ", AbslView(ToString(row.decision)),
                          " [", absl::StrJoin(row.rule_ids, " "), "]");
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

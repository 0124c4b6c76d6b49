#include "core/audit.h"

#include "absl/strings/str_cat.h"
#include "common/util.h"

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

}  // namespace esb

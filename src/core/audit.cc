#include "core/audit.h"

#include "absl/strings/str_cat.h"
#include "common/util.h"

namespace esb {

int AuditStatusFor(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnimplemented:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kAborted:
      return 409;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kCancelled:
      return 499;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
      return 503;
    default:
      return 500;
  }
}

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
  e.status = AuditStatusFor(event.outcome);
  absl::Status st = store_->AppendAudit(e);
  if (!st.ok()) {
    metrics_->CountError("audit");
    LogError(absl::StrCat("audit append failed: ", st.ToString()));
  }
}

}  // namespace esb

// Store on SQLite: one connection guarded by a mutex, WAL journal, prepared statements cached
// per SQL text, schema versioned with forward-only migrations.
#include "storage/sqlite_store.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sqlite3.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/json.hpp>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/utf8.h"
#include "common/util.h"
#include "storage/secret_box.h"
#include "storage/store.h"

namespace esb {
namespace {

// Migration N (1-based) brings the schema from version N-1 to N. Never edit a shipped entry:
// append a new one.
constexpr const char* kMigrations[] = {
    // v1: environments, API keys, audit log with an external-content FTS5 index kept in sync
    // by triggers (so every writer, even a manual sqlite3 session, keeps it consistent).
    R"sql(
CREATE TABLE environments (
  id             TEXT PRIMARY KEY NOT NULL,
  tenant         TEXT NOT NULL,
  state          TEXT NOT NULL,
  runtime        TEXT NOT NULL DEFAULT '',
  image          TEXT NOT NULL DEFAULT '',
  spec_json      TEXT NOT NULL DEFAULT '{}',
  driver_state   TEXT NOT NULL DEFAULT '',
  created_ms     INTEGER NOT NULL DEFAULT 0,
  last_used_ms   INTEGER NOT NULL DEFAULT 0,
  expires_ms     INTEGER NOT NULL DEFAULT 0,
  destroyed_ms   INTEGER NOT NULL DEFAULT 0,
  destroy_reason TEXT NOT NULL DEFAULT '',
  exec_count     INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX environments_by_tenant ON environments(tenant, state, created_ms);
CREATE INDEX environments_by_state ON environments(state);

CREATE TABLE api_keys (
  key_id        TEXT PRIMARY KEY NOT NULL,
  tenant        TEXT NOT NULL,
  name          TEXT NOT NULL DEFAULT '',
  secret_sha256 TEXT NOT NULL UNIQUE,
  created_ms    INTEGER NOT NULL,
  revoked_ms    INTEGER NOT NULL DEFAULT 0
);

CREATE TABLE audit (
  id             INTEGER PRIMARY KEY AUTOINCREMENT,
  time_ms        INTEGER NOT NULL,
  tenant         TEXT NOT NULL,
  environment_id TEXT NOT NULL DEFAULT '',
  action         TEXT NOT NULL,
  detail         TEXT NOT NULL DEFAULT '',
  exit_code      INTEGER,
  duration_ms    INTEGER NOT NULL DEFAULT 0,
  bytes          INTEGER NOT NULL DEFAULT 0,
  status         INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX audit_by_tenant_time ON audit(tenant, time_ms, id);
CREATE INDEX audit_by_tenant_env_time ON audit(tenant, environment_id, time_ms, id);

CREATE VIRTUAL TABLE audit_fts USING fts5(
  action, detail, content='audit', content_rowid='id', tokenize='unicode61 remove_diacritics 2');
CREATE TRIGGER audit_fts_insert AFTER INSERT ON audit BEGIN
  INSERT INTO audit_fts(rowid, action, detail) VALUES (new.id, new.action, new.detail);
END;
CREATE TRIGGER audit_fts_delete AFTER DELETE ON audit BEGIN
  INSERT INTO audit_fts(audit_fts, rowid, action, detail)
    VALUES ('delete', old.id, old.action, old.detail);
END;
CREATE TRIGGER audit_fts_update AFTER UPDATE ON audit BEGIN
  INSERT INTO audit_fts(audit_fts, rowid, action, detail)
    VALUES ('delete', old.id, old.action, old.detail);
  INSERT INTO audit_fts(rowid, action, detail) VALUES (new.id, new.action, new.detail);
END;
)sql",
    // v2: audit searches are scoped to a tenant inside the FTS index: every row carries its
    // tenant as one token ('t' + hex of the name: one token per tenant, no two tenants alike)
    // in the `scope` column, and every MATCH is ANDed with it. An index on time for retention,
    // one on destroyed environments for their retention. Details stored before v2 are cut as new
    // rows are (esb_cap_detail: CapField with the configured max_detail_bytes, registered on the
    // writer connection; the FTS index is rebuilt from the cut text).
    R"sql(
DROP TRIGGER audit_fts_insert;
DROP TRIGGER audit_fts_delete;
DROP TRIGGER audit_fts_update;
DROP TABLE audit_fts;
ALTER TABLE audit ADD COLUMN scope TEXT GENERATED ALWAYS AS ('t' || lower(hex(tenant))) VIRTUAL;
UPDATE audit SET detail = esb_cap_detail(detail) WHERE esb_cap_detail(detail) != detail;
CREATE INDEX audit_by_time ON audit(time_ms);
CREATE INDEX environments_by_destroyed ON environments(state, destroyed_ms);
CREATE VIRTUAL TABLE audit_fts USING fts5(
  scope, action, detail, content='audit', content_rowid='id',
  tokenize='unicode61 remove_diacritics 2');
INSERT INTO audit_fts(audit_fts) VALUES ('rebuild');
CREATE TRIGGER audit_fts_insert AFTER INSERT ON audit BEGIN
  INSERT INTO audit_fts(rowid, scope, action, detail)
    VALUES (new.id, new.scope, new.action, new.detail);
END;
CREATE TRIGGER audit_fts_delete AFTER DELETE ON audit BEGIN
  INSERT INTO audit_fts(audit_fts, rowid, scope, action, detail)
    VALUES ('delete', old.id, old.scope, old.action, old.detail);
END;
CREATE TRIGGER audit_fts_update AFTER UPDATE ON audit BEGIN
  INSERT INTO audit_fts(audit_fts, rowid, scope, action, detail)
    VALUES ('delete', old.id, old.scope, old.action, old.detail);
  INSERT INTO audit_fts(rowid, scope, action, detail)
    VALUES (new.id, new.scope, new.action, new.detail);
END;
)sql",
    // v3: who made each audited call (issue 11: the core's one audit path records the
    // principal — the API key's public id, "dev" for dev mode, "system" for the daemon).
    R"sql(
ALTER TABLE audit ADD COLUMN principal TEXT NOT NULL DEFAULT '';
)sql",
    // v4: persistent volumes (issue 11), named per tenant; which environment mounts one is
    // derived from the live environments' specs, not stored twice.
    R"sql(
CREATE TABLE volumes (
  tenant     TEXT NOT NULL,
  name       TEXT NOT NULL,
  size_mb    INTEGER NOT NULL,
  created_ms INTEGER NOT NULL DEFAULT 0,
  PRIMARY KEY (tenant, name)
);
)sql",
    // v5: egress governance (issue 12): per governed environment its policy, CA (PEM pair) and
    // explicitly activated intents with their expiry, so all three survive a restart.
    R"sql(
CREATE TABLE env_egress (
  env_id       TEXT PRIMARY KEY NOT NULL,
  tenant       TEXT NOT NULL,
  policy_json  TEXT NOT NULL,
  intents_json TEXT NOT NULL DEFAULT '[]',
  ca_cert_pem  TEXT NOT NULL DEFAULT '',
  ca_key_pem   TEXT NOT NULL DEFAULT '',
  updated_ms   INTEGER NOT NULL DEFAULT 0
);
)sql",
    // v6: egress audit rows (issue 12). The audit row (action "egress", principal "proxy")
    // keeps who/when/status/duration and a one-line summary in `detail` (so the existing
    // search finds host and rules); this side table keeps the request's fields, deleted with
    // its audit row (trigger: retention and row caps delete from `audit` only). tenant,
    // environment_id and time_ms are repeated here so reports aggregate this table alone by
    // its own indexes. egress_fts indexes host, path, headers and body (all after masking and
    // redaction), scoped per tenant like audit_fts (v2). stored_bytes (headers + body as
    // stored) is what the per-tenant budget of stored egress text counts. Independent of v5.
    R"sql(
CREATE TABLE audit_egress (
  audit_id         INTEGER PRIMARY KEY NOT NULL,
  tenant           TEXT NOT NULL,
  environment_id   TEXT NOT NULL DEFAULT '',
  time_ms          INTEGER NOT NULL,
  intents          TEXT NOT NULL DEFAULT '[]',
  method           TEXT NOT NULL DEFAULT '',
  scheme           TEXT NOT NULL DEFAULT '',
  host             TEXT NOT NULL DEFAULT '',
  port             INTEGER NOT NULL DEFAULT 0,
  path             TEXT NOT NULL DEFAULT '',
  decision         TEXT NOT NULL DEFAULT '',
  rule_ids         TEXT NOT NULL DEFAULT '[]',
  reason           TEXT NOT NULL DEFAULT '',
  bytes_up         INTEGER NOT NULL DEFAULT 0,
  bytes_down       INTEGER NOT NULL DEFAULT 0,
  added_latency_us INTEGER NOT NULL DEFAULT 0,
  headers          TEXT NOT NULL DEFAULT '',
  body             TEXT NOT NULL DEFAULT '',
  body_bytes       INTEGER NOT NULL DEFAULT 0,
  body_sha256      TEXT NOT NULL DEFAULT '',
  stored_bytes     INTEGER NOT NULL DEFAULT 0,
  scope            TEXT GENERATED ALWAYS AS ('t' || lower(hex(tenant))) VIRTUAL
);
CREATE INDEX audit_egress_by_tenant_time ON audit_egress(tenant, time_ms);
CREATE INDEX audit_egress_by_tenant_env_time ON audit_egress(tenant, environment_id, time_ms);
CREATE TRIGGER audit_egress_follow_delete AFTER DELETE ON audit BEGIN
  DELETE FROM audit_egress WHERE audit_id = old.id;
END;
CREATE VIRTUAL TABLE egress_fts USING fts5(
  scope, host, path, headers, body, content='audit_egress', content_rowid='audit_id',
  tokenize='unicode61 remove_diacritics 2');
CREATE TRIGGER egress_fts_insert AFTER INSERT ON audit_egress BEGIN
  INSERT INTO egress_fts(rowid, scope, host, path, headers, body)
    VALUES (new.audit_id, new.scope, new.host, new.path, new.headers, new.body);
END;
CREATE TRIGGER egress_fts_delete AFTER DELETE ON audit_egress BEGIN
  INSERT INTO egress_fts(egress_fts, rowid, scope, host, path, headers, body)
    VALUES ('delete', old.audit_id, old.scope, old.host, old.path, old.headers, old.body);
END;
CREATE TRIGGER egress_fts_update AFTER UPDATE ON audit_egress BEGIN
  INSERT INTO egress_fts(egress_fts, rowid, scope, host, path, headers, body)
    VALUES ('delete', old.audit_id, old.scope, old.host, old.path, old.headers, old.body);
  INSERT INTO egress_fts(rowid, scope, host, path, headers, body)
    VALUES (new.audit_id, new.scope, new.host, new.path, new.headers, new.body);
END;
)sql",
    // v7: time travel (issue 13). env_steps: one row per environment with a step log (its
    // settings, head and next step number); steps: one row per step, keyed (env_id, n), with
    // the tenant repeated so that every read is tenant-scoped by the key it filters on.
    // Blobs (workspace manifests and file contents) live on disk, content-addressed; a row names
    // them in manifest_sha and state_json. Independent of v5/v6.
    R"sql(
CREATE TABLE env_steps (
  env_id        TEXT PRIMARY KEY NOT NULL,
  tenant        TEXT NOT NULL,
  settings_json TEXT NOT NULL DEFAULT '{}',
  head          INTEGER,
  next_step     INTEGER NOT NULL DEFAULT 0,
  updated_ms    INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE steps (
  env_id        TEXT NOT NULL,
  n             INTEGER NOT NULL,
  tenant        TEXT NOT NULL,
  parent        INTEGER,
  kind          TEXT NOT NULL,
  summary       TEXT NOT NULL DEFAULT '',
  status        TEXT NOT NULL DEFAULT 'ok',
  exit_code     INTEGER,
  error         TEXT,
  started_ms    INTEGER NOT NULL DEFAULT 0,
  duration_ms   INTEGER NOT NULL DEFAULT 0,
  capture_ms    INTEGER NOT NULL DEFAULT 0,
  tier          TEXT NOT NULL DEFAULT '',
  memory        TEXT NOT NULL DEFAULT 'none',
  memory_detail TEXT,
  memory_live   INTEGER NOT NULL DEFAULT 0,
  files_changed INTEGER NOT NULL DEFAULT 0,
  created_ms    INTEGER NOT NULL DEFAULT 0,
  manifest_sha  TEXT NOT NULL DEFAULT '',
  state_json    TEXT NOT NULL DEFAULT '',
  detail_json   TEXT NOT NULL DEFAULT '{}',
  bytes         INTEGER NOT NULL DEFAULT 0,
  collected     INTEGER NOT NULL DEFAULT 0,
  PRIMARY KEY (env_id, n)
);
CREATE INDEX steps_live_memory ON steps(memory_live) WHERE memory_live = 1;
)sql",
    // v8: tool calls (issue 14). A "tool.call" audit row (core/tools/tool_gate.h) keeps what
    // the tool gate saw as one JSON object (tool, server, decision, rule ids, redacted
    // arguments, result size); NULL on every other row. Its detail (FTS-indexed like every
    // row's) names the tool, the decision and the rules. Independent of v5..v7.
    R"sql(
ALTER TABLE audit ADD COLUMN tool_call TEXT;
)sql",
};
constexpr int kLatestVersion = static_cast<int>(sizeof(kMigrations) / sizeof(kMigrations[0]));

constexpr int kBusyTimeoutMs = 5000;
// Stored caps of the audit fields a caller (URL path, request) can make long.
constexpr size_t kMaxActionBytes = 64;
constexpr size_t kMaxEnvironmentIdBytes = 64;
// ... and of the egress fields (the sandbox chooses hosts, paths, headers and bodies).
constexpr size_t kMaxEgressShortBytes = 32;  // method, scheme, decision
constexpr size_t kMaxEgressHostBytes = 255;
constexpr size_t kMaxEgressPathBytes = 4096;
constexpr size_t kMaxEgressReasonBytes = 512;
constexpr size_t kMaxEgressListItems = 32;  // intents, rule ids
constexpr size_t kMaxEgressListItemBytes = 256;
constexpr int kMaxReportDays = 400;
// Rows deleted per statement by retention and row caps: each deletes its FTS rows too, and
// holds the writer mutex meanwhile, so keep it short (~tens of ms).
constexpr int kDeleteBatch = 500;
// A kind of suppressed audit event is summarised at most this long after its first one.
constexpr int64_t kSuppressFlushMs = 10000;
constexpr int64_t kRetentionIntervalMs = 60000;
constexpr int kRetentionBatchesPerCall = 2;
// Distinct (environment, action, status) kinds counted per tenant while over the rate; beyond:
// one bucket.
constexpr size_t kMaxSuppressedKinds = 32;

// Collapses whitespace and cuts long SQL so it fits in an error message.
std::string SqlForMessage(std::string_view sql) {
  std::string out;
  bool space = false;
  for (char c : sql) {
    if (std::isspace(static_cast<unsigned char>(c))) {
      space = !out.empty();
      continue;
    }
    if (space) out.push_back(' ');
    space = false;
    out.push_back(c);
    if (out.size() >= 160) {
      out += "...";
      break;
    }
  }
  return out;
}

absl::StatusCode CodeForSqlite(int rc) {
  switch (rc & 0xff) {
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
      return absl::StatusCode::kUnavailable;
    case SQLITE_FULL:
    case SQLITE_NOMEM:
    case SQLITE_TOOBIG:
      return absl::StatusCode::kResourceExhausted;
    case SQLITE_CONSTRAINT:
      return absl::StatusCode::kAlreadyExists;
    case SQLITE_CORRUPT:
    case SQLITE_NOTADB:
      return absl::StatusCode::kDataLoss;
    case SQLITE_PERM:
    case SQLITE_READONLY:
    case SQLITE_AUTH:
      return absl::StatusCode::kPermissionDenied;
    case SQLITE_CANTOPEN:
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kInternal;
  }
}

// "sqlite step failed: <errmsg> (<rc name>) [sql: ...]"
absl::Status SqlError(sqlite3* db, int rc, std::string_view op, std::string_view sql) {
  const char* msg = db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
  return absl::Status(CodeForSqlite(rc),
                      absl::StrCat("sqlite ", std::string(op), " failed: ", msg, " (",
                                   sqlite3_errstr(rc), ") [sql: ", SqlForMessage(sql), "]"));
}

// A cached prepared statement in use. Resets and clears bindings when it goes out of scope so
// the next user of the same SQL starts clean.
class Stmt {
 public:
  Stmt(sqlite3* db, sqlite3_stmt* stmt, std::string_view sql) : db_(db), stmt_(stmt), sql_(sql) {}
  Stmt(Stmt&& o) noexcept
      : db_(o.db_), stmt_(std::exchange(o.stmt_, nullptr)), sql_(o.sql_), bind_rc_(o.bind_rc_) {}
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;
  Stmt& operator=(Stmt&&) = delete;
  ~Stmt() {
    if (stmt_ != nullptr) {
      sqlite3_reset(stmt_);
      sqlite3_clear_bindings(stmt_);
    }
  }

  Stmt& Bind(int index, std::string_view value) {
    Check(sqlite3_bind_text64(stmt_, index, value.data(), value.size(), SQLITE_TRANSIENT,
                              SQLITE_UTF8));
    return *this;
  }
  Stmt& Bind(int index, const char* value) { return Bind(index, std::string_view(value)); }
  Stmt& Bind(int index, const std::string& value) { return Bind(index, std::string_view(value)); }
  Stmt& Bind(int index, int64_t value) {
    Check(sqlite3_bind_int64(stmt_, index, value));
    return *this;
  }
  Stmt& Bind(int index, int value) { return Bind(index, static_cast<int64_t>(value)); }
  Stmt& Bind(int index, std::optional<int64_t> value) {
    if (value.has_value()) return Bind(index, *value);
    Check(sqlite3_bind_null(stmt_, index));
    return *this;
  }
  Stmt& BindOptText(int index, const std::optional<std::string>& value) {
    if (value.has_value()) return Bind(index, std::string_view(*value));
    Check(sqlite3_bind_null(stmt_, index));
    return *this;
  }

  // true: a row is available; false: done.
  absl::StatusOr<bool> Step() {
    if (bind_rc_ != SQLITE_OK) return SqlError(db_, bind_rc_, "bind", sql_);
    int rc = sqlite3_step(stmt_);
    if (rc == SQLITE_ROW) return true;
    if (rc == SQLITE_DONE) return false;
    last_rc_ = rc;
    return SqlError(db_, rc, "step", sql_);
  }
  // Runs a statement that returns no rows (or ignores them).
  absl::Status Run() {
    while (true) {
      absl::StatusOr<bool> row = Step();
      if (!row.ok()) return row.status();
      if (!*row) return absl::OkStatus();
    }
  }

  std::string Text(int col) const {
    const unsigned char* p = sqlite3_column_text(stmt_, col);
    if (p == nullptr) return "";
    return std::string(reinterpret_cast<const char*>(p),
                       static_cast<size_t>(sqlite3_column_bytes(stmt_, col)));
  }
  int64_t Int(int col) const { return sqlite3_column_int64(stmt_, col); }
  double Double(int col) const { return sqlite3_column_double(stmt_, col); }
  bool IsNull(int col) const { return sqlite3_column_type(stmt_, col) == SQLITE_NULL; }
  int last_rc() const { return last_rc_; }
  const char* errmsg() const { return sqlite3_errmsg(db_); }

 private:
  void Check(int rc) {
    if (rc != SQLITE_OK && bind_rc_ == SQLITE_OK) bind_rc_ = rc;
  }

  sqlite3* db_;
  sqlite3_stmt* stmt_;
  std::string_view sql_;  // points into the statement cache's key (stable)
  int bind_rc_ = SQLITE_OK;
  int last_rc_ = SQLITE_OK;
};

constexpr const char* kEnvColumns =
    "id, tenant, state, runtime, image, spec_json, driver_state, created_ms, last_used_ms, "
    "expires_ms, destroyed_ms, destroy_reason, exec_count";

EnvironmentRecord EnvFromRow(const Stmt& s) {
  EnvironmentRecord r;
  r.id = s.Text(0);
  r.tenant = s.Text(1);
  // A state this esbd does not know (an older or newer esbd's): treated as an interrupted
  // destroy, so the restart cleanup finishes it instead of serving it.
  r.state = ParseEnvState(s.Text(2)).value_or(EnvState::kDestroying);
  r.runtime = s.Text(3);
  r.image = s.Text(4);
  r.spec_json = s.Text(5);
  r.driver_state = s.Text(6);
  r.created_ms = s.Int(7);
  r.last_used_ms = s.Int(8);
  r.expires_ms = s.Int(9);
  r.destroyed_ms = s.Int(10);
  r.destroy_reason = s.Text(11);
  r.exec_count = s.Int(12);
  return r;
}

constexpr const char* kStepLogColumns =
    "env_id, tenant, settings_json, head, next_step, updated_ms";

StepLogRecord StepLogFromRow(const Stmt& s) {
  StepLogRecord r;
  r.env_id = s.Text(0);
  r.tenant = s.Text(1);
  r.settings_json = s.Text(2);
  if (!s.IsNull(3)) r.head = s.Int(3);
  r.next_step = s.Int(4);
  r.updated_ms = s.Int(5);
  return r;
}

constexpr const char* kStepColumns =
    "env_id, n, tenant, parent, kind, summary, status, exit_code, error, started_ms, "
    "duration_ms, capture_ms, tier, memory, memory_detail, memory_live, files_changed, "
    "created_ms, manifest_sha, state_json, detail_json, bytes, collected";

StepRecord StepFromRow(const Stmt& s) {
  StepRecord r;
  r.env_id = s.Text(0);
  r.n = s.Int(1);
  r.tenant = s.Text(2);
  if (!s.IsNull(3)) r.parent = s.Int(3);
  r.kind = s.Text(4);
  r.summary = s.Text(5);
  r.status = s.Text(6);
  if (!s.IsNull(7)) r.exit_code = s.Int(7);
  if (!s.IsNull(8)) r.error = s.Text(8);
  r.started_ms = s.Int(9);
  r.duration_ms = s.Int(10);
  r.capture_ms = s.Int(11);
  r.tier = s.Text(12);
  r.memory = s.Text(13);
  if (!s.IsNull(14)) r.memory_detail = s.Text(14);
  r.memory_live = s.Int(15) != 0;
  r.files_changed = s.Int(16);
  r.created_ms = s.Int(17);
  r.manifest_sha = s.Text(18);
  r.state_json = s.Text(19);
  r.detail_json = s.Text(20);
  r.bytes = s.Int(21);
  r.collected = s.Int(22) != 0;
  return r;
}

ApiKeyRecord KeyFromRow(const Stmt& s) {
  ApiKeyRecord r;
  r.key_id = s.Text(0);
  r.tenant = s.Text(1);
  r.name = s.Text(2);
  r.created_ms = s.Int(3);
  r.revoked = s.Int(4) != 0;
  return r;
}

// A secret must be sendable in an Authorization header: printable ASCII, no spaces.
absl::Status ValidateSecret(std::string_view secret) {
  if (secret.empty()) return absl::InvalidArgumentError("API key secret is empty");
  for (char c : secret) {
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError("API key secret must be printable ASCII without spaces");
    }
  }
  return absl::OkStatus();
}

// Cuts `text` to at most `max` bytes at a UTF-8 boundary and marks the cut with the number of
// bytes dropped, so a reader of the audit log knows the stored text is not the whole.
std::string CapField(std::string_view text, size_t max) {
  if (text.size() <= max) return std::string(text);
  size_t cut = max;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xc0) == 0x80) --cut;
  return absl::StrCat(AbslView(text.substr(0, cut)), "…[truncated ", text.size() - cut, " bytes]");
}

// A list of strings as a JSON array (the stored form of intents and rule ids: reports split it
// with json_each), at most kMaxEgressListItems items of at most kMaxEgressListItemBytes each.
std::string ToJsonArray(const std::vector<std::string>& items) {
  boost::json::array arr;
  for (size_t i = 0; i < items.size() && i < kMaxEgressListItems; ++i) {
    arr.emplace_back(SanitizeUtf8(CapField(items[i], kMaxEgressListItemBytes)));
  }
  return boost::json::serialize(arr);
}

std::vector<std::string> FromJsonArray(const std::string& text) {
  std::vector<std::string> out;
  boost::system::error_code ec;
  boost::json::value v = boost::json::parse(text, ec);
  if (ec || !v.is_array()) return out;
  for (const auto& item : v.as_array()) {
    if (item.is_string()) out.emplace_back(item.as_string());
  }
  return out;
}

// One SQLite connection with its prepared-statement cache and a deadline that its progress
// handler enforces (0 = none).
struct Conn {
  sqlite3* db = nullptr;
  std::map<std::string, sqlite3_stmt*> cache;  // keys are stable: Stmt keeps a view of them
  std::atomic<int64_t> deadline_ms{0};         // MonotonicMs() after which statements stop

  explicit Conn(sqlite3* d) : db(d) {
    sqlite3_busy_timeout(db, kBusyTimeoutMs);
    // Checked every 1000 VM instructions: a runaway statement (an FTS query a tenant wrote)
    // stops with SQLITE_INTERRUPT once its deadline has passed.
    sqlite3_progress_handler(
        db, 1000,
        [](void* p) -> int {
          const int64_t d = static_cast<Conn*>(p)->deadline_ms.load(std::memory_order_relaxed);
          return d != 0 && MonotonicMs() > d ? 1 : 0;
        },
        this);
  }
  Conn(const Conn&) = delete;
  Conn& operator=(const Conn&) = delete;
  ~Conn() {
    for (auto& [sql, stmt] : cache) sqlite3_finalize(stmt);
    // Closing the last connection checkpoints the WAL into the main file.
    sqlite3_close_v2(db);
  }

  absl::StatusOr<Stmt> Prepare(const std::string& sql) {
    auto it = cache.find(sql);
    if (it == cache.end()) {
      sqlite3_stmt* stmt = nullptr;
      int rc = sqlite3_prepare_v3(db, sql.c_str(), static_cast<int>(sql.size()),
                                  SQLITE_PREPARE_PERSISTENT, &stmt, nullptr);
      if (rc != SQLITE_OK) {
        sqlite3_finalize(stmt);
        return SqlError(db, rc, "prepare", sql);
      }
      it = cache.emplace(sql, stmt).first;
    }
    return Stmt(db, it->second, it->first);
  }
};

// The FTS token that every audit row of `tenant` carries in its `scope` column (the same
// expression as the generated column of migration v2: 't' || lower(hex(tenant))).
std::string ScopeToken(std::string_view tenant) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "t";
  for (unsigned char c : tenant) {
    out.push_back(kHex[c >> 4]);
    out.push_back(kHex[c & 0xf]);
  }
  return out;
}

class SqliteStore final : public Store {
 public:
  SqliteStore(sqlite3* db, StoreOptions options)
      : options_(std::move(options)), writer_(db) {
    if (!options_.now_ms) options_.now_ms = NowUnixMs;
  }
  ~SqliteStore() override {
    // The write-behind thread stops, then whatever it had queued is written here.
    {
      std::lock_guard<std::mutex> q(queue_mu_);
      stopping_ = true;
    }
    queue_cv_.notify_all();
    if (writer_thread_.joinable()) writer_thread_.join();
    {
      std::lock_guard<std::mutex> lock(mu_);
      FlushLocked().IgnoreError();  // logged there
    }
    // Readers first: the writer's close is the last one and checkpoints the WAL.
    readers_.clear();
  }

  // Starts the write-behind thread (after Init/OpenReaders; none with write_behind_ms 0).
  void StartWriteBehind() {
    if (options_.write_behind_ms <= 0) return;
    writer_thread_ = std::thread([this] { WriteBehindLoop(); });
  }

  absl::Status Flush() override {
    std::lock_guard<std::mutex> lock(mu_);
    return FlushLocked();
  }

  absl::Status PutEnvironmentDeferred(const EnvironmentRecord& rec) override {
    if (rec.id.empty()) return absl::InvalidArgumentError("PutEnvironment: empty id");
    if (options_.write_behind_ms <= 0) return PutEnvironment(rec);
    bool was_empty;
    {
      std::lock_guard<std::mutex> q(queue_mu_);
      was_empty = QueueEmptyLocked();
      // One per environment id (bounded by the environments the core holds): the newest wins.
      queued_envs_[rec.id] = rec;
    }
    if (was_empty) queue_cv_.notify_one();
    return absl::OkStatus();
  }

  absl::Status Init(bool is_file) {
    if (is_file) {
      absl::StatusOr<std::string> mode = QueryText("PRAGMA journal_mode=WAL");
      if (!mode.ok()) return mode.status();
      wal_ = absl::AsciiStrToLower(*mode) == "wal";
      if (!wal_) {
        LogWarn(absl::StrCat("storage: SQLite refused WAL mode (journal_mode=", *mode,
                             "); continuing with the rollback journal (audit searches share "
                             "the writer's connection)"));
      }
    }
    if (auto s = Exec("PRAGMA synchronous=NORMAL; PRAGMA foreign_keys=ON;"); !s.ok()) return s;
    // The one rule for cutting stored details (CapField), for migrations that cut old rows.
    int rc = sqlite3_create_function_v2(
        writer_.db, "esb_cap_detail", 1, SQLITE_UTF8 | SQLITE_DETERMINISTIC | SQLITE_DIRECTONLY,
        this,
        [](sqlite3_context* ctx, int, sqlite3_value** argv) {
          auto* self = static_cast<SqliteStore*>(sqlite3_user_data(ctx));
          const unsigned char* text = sqlite3_value_text(argv[0]);
          if (text == nullptr) {
            sqlite3_result_null(ctx);
            return;
          }
          std::string capped =
              CapField(std::string_view(reinterpret_cast<const char*>(text),
                                        static_cast<size_t>(sqlite3_value_bytes(argv[0]))),
                       self->options_.max_detail_bytes);
          sqlite3_result_text64(ctx, capped.data(), capped.size(), SQLITE_TRANSIENT, SQLITE_UTF8);
        },
        nullptr, nullptr, nullptr);
    if (rc != SQLITE_OK) return SqlError(writer_.db, rc, "create_function", "esb_cap_detail");
    return Migrate();
  }

  // Opens the read-only connections audit searches use (after Init: the schema exists).
  absl::Status OpenReaders(const std::string& path) {
    // Without WAL a reader's shared lock would block the writer: then there are none.
    if (!wal_) return absl::OkStatus();
    for (int i = 0; i < options_.audit_readers; ++i) {
      sqlite3* db = nullptr;
      int rc = sqlite3_open_v2(path.c_str(), &db,
                               SQLITE_OPEN_READONLY | SQLITE_OPEN_NOMUTEX | SQLITE_OPEN_URI,
                               nullptr);
      if (rc != SQLITE_OK) {
        absl::Status s(CodeForSqlite(rc),
                       absl::StrCat("sqlite open (read-only) failed: ",
                                    db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc)));
        sqlite3_close_v2(db);
        return s;
      }
      readers_.push_back(std::make_unique<Conn>(db));
      free_readers_.push_back(readers_.back().get());
    }
    return absl::OkStatus();
  }

  absl::Status PutEnvironment(const EnvironmentRecord& rec) override {
    if (rec.id.empty()) return absl::InvalidArgumentError("PutEnvironment: empty id");
    std::lock_guard<std::mutex> lock(mu_);
    {
      // A queued deferred update of this id is older (the core writes one environment's
      // snapshots in order) and must not land after this one. One the write-behind thread has
      // already taken is being written under mu_, i.e. before this.
      std::lock_guard<std::mutex> q(queue_mu_);
      queued_envs_.erase(rec.id);
    }
    return WriteEnvironmentLocked(rec);
  }

  // Caller holds mu_.
  absl::Status WriteEnvironmentLocked(const EnvironmentRecord& rec) {
    auto stmt = Prepare(
        "INSERT INTO environments (id, tenant, state, runtime, image, spec_json, driver_state, "
        "created_ms, last_used_ms, expires_ms, destroyed_ms, destroy_reason, exec_count) "
        "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13) "
        "ON CONFLICT(id) DO UPDATE SET tenant=excluded.tenant, state=excluded.state, "
        "runtime=excluded.runtime, image=excluded.image, spec_json=excluded.spec_json, "
        "driver_state=excluded.driver_state, created_ms=excluded.created_ms, "
        "last_used_ms=excluded.last_used_ms, expires_ms=excluded.expires_ms, "
        "destroyed_ms=excluded.destroyed_ms, destroy_reason=excluded.destroy_reason, "
        "exec_count=excluded.exec_count");
    if (!stmt.ok()) return stmt.status();
    stmt->Bind(1, rec.id)
        .Bind(2, rec.tenant)
        .Bind(3, ToString(rec.state))
        .Bind(4, rec.runtime)
        .Bind(5, rec.image)
        .Bind(6, rec.spec_json)
        .Bind(7, rec.driver_state)
        .Bind(8, rec.created_ms)
        .Bind(9, rec.last_used_ms)
        .Bind(10, rec.expires_ms)
        .Bind(11, rec.destroyed_ms)
        .Bind(12, rec.destroy_reason)
        .Bind(13, rec.exec_count);
    return stmt->Run();
  }

  absl::StatusOr<EnvironmentRecord> GetEnvironment(const std::string& id) override {
    std::lock_guard<std::mutex> lock(mu_);
    FlushLocked().IgnoreError();  // reads see queued writes (a failure is logged there)
    auto stmt = Prepare(absl::StrCat("SELECT ", kEnvColumns, " FROM environments WHERE id = ?1"));
    if (!stmt.ok()) return stmt.status();
    stmt->Bind(1, id);
    absl::StatusOr<bool> row = stmt->Step();
    if (!row.ok()) return row.status();
    if (!*row) return absl::NotFoundError(absl::StrCat("environment ", id, " not found"));
    return EnvFromRow(*stmt);
  }

  absl::StatusOr<std::vector<EnvironmentRecord>> ListLiveEnvironments() override {
    std::lock_guard<std::mutex> lock(mu_);
    FlushLocked().IgnoreError();
    auto stmt = Prepare(absl::StrCat("SELECT ", kEnvColumns,
                                     " FROM environments WHERE state != 'destroyed' "
                                     "ORDER BY created_ms, id"));
    if (!stmt.ok()) return stmt.status();
    return CollectEnvs(*stmt);
  }

  absl::StatusOr<std::vector<EnvironmentRecord>> ListEnvironments(const std::string& tenant,
                                                                  bool include_destroyed) override {
    std::lock_guard<std::mutex> lock(mu_);
    FlushLocked().IgnoreError();
    // Live ones all (the quota bounds them), destroyed ones the newest kMaxListedDestroyed.
    auto stmt = Prepare(absl::StrCat(
        "SELECT * FROM (SELECT ", kEnvColumns,
        " FROM environments WHERE tenant = ?1 AND state != 'destroyed' UNION ALL "
        "SELECT * FROM (SELECT ", kEnvColumns,
        " FROM environments WHERE ?2 AND tenant = ?1 AND state = 'destroyed' "
        "ORDER BY destroyed_ms DESC LIMIT ?3)) ORDER BY created_ms, id"));
    if (!stmt.ok()) return stmt.status();
    stmt->Bind(1, tenant).Bind(2, include_destroyed ? 1 : 0).Bind(3, kMaxListedDestroyed);
    return CollectEnvs(*stmt);
  }

  absl::Status InsertVolume(const VolumeRecord& rec) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto stmt = Prepare(
        "INSERT INTO volumes (tenant, name, size_mb, created_ms) VALUES (?1, ?2, ?3, ?4) "
        "ON CONFLICT(tenant, name) DO NOTHING");
    if (!stmt.ok()) return stmt.status();
    stmt->Bind(1, rec.tenant).Bind(2, rec.name).Bind(3, rec.size_mb).Bind(4, rec.created_ms);
    if (absl::Status st = stmt->Run(); !st.ok()) return st;
    if (sqlite3_changes(writer_.db) == 0) {
      return absl::AlreadyExistsError(absl::StrCat("volume ", rec.name, " already exists"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<VolumeRecord>> ListVolumes(const std::string& tenant) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto stmt = Prepare(
        "SELECT tenant, name, size_mb, created_ms FROM volumes WHERE ?1 = '' OR tenant = ?1 "
        "ORDER BY tenant, name");
    if (!stmt.ok()) return stmt.status();
    stmt->Bind(1, tenant);
    std::vector<VolumeRecord> out;
    while (true) {
      absl::StatusOr<bool> row = stmt->Step();
      if (!row.ok()) return row.status();
      if (!*row) return out;
      out.push_back(VolumeRecord{stmt->Text(0), stmt->Text(1), stmt->Int(2), stmt->Int(3)});
    }
  }

  absl::Status DeleteVolume(const std::string& tenant, const std::string& name) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto stmt = Prepare("DELETE FROM volumes WHERE tenant = ?1 AND name = ?2");
    if (!stmt.ok()) return stmt.status();
    stmt->Bind(1, tenant).Bind(2, name);
    if (absl::Status st = stmt->Run(); !st.ok()) return st;
    if (sqlite3_changes(writer_.db) == 0) {
      return absl::NotFoundError(absl::StrCat("volume ", name, " not found"));
    }
    return absl::OkStatus();
  }

  absl::Status PutEgress(const EgressRecord& rec) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto stmt = Prepare(
        "INSERT OR REPLACE INTO env_egress (env_id, tenant, policy_json, intents_json, "
        "ca_cert_pem, ca_key_pem, updated_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)");
    if (!stmt.ok()) return stmt.status();
    std::string ca_key = rec.ca_key_pem;
    if (!secret_key_.empty() && !ca_key.empty()) {
      absl::StatusOr<std::string> sealed = SealSecret(secret_key_, rec.env_id, ca_key);
      if (!sealed.ok()) return sealed.status();
      ca_key = *std::move(sealed);
    }
    stmt->Bind(1, rec.env_id)
        .Bind(2, rec.tenant)
        .Bind(3, rec.policy_json)
        .Bind(4, rec.intents_json)
        .Bind(5, rec.ca_cert_pem)
        .Bind(6, ca_key)
        .Bind(7, rec.updated_ms);
    return stmt->Run();
  }

  absl::Status PutStepLog(const StepLogRecord& rec) override {
    if (rec.env_id.empty()) return absl::InvalidArgumentError("PutStepLog: empty env_id");
    std::lock_guard<std::mutex> lock(mu_);
    auto stmt = Prepare(
        "INSERT OR REPLACE INTO env_steps (env_id, tenant, settings_json, head, next_step, "
        "updated_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6)");
    if (!stmt.ok()) return stmt.status();
    stmt->Bind(1, rec.env_id)
        .Bind(2, rec.tenant)
        .Bind(3, rec.settings_json)
        .Bind(4, rec.head)
        .Bind(5, rec.next_step)
        .Bind(6, rec.updated_ms);
    return stmt->Run();
  }

  absl::StatusOr<StepLogRecord> GetStepLog(const std::string& tenant,
                                           const std::string& env_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto stmt = Prepare(absl::StrCat("SELECT ", kStepLogColumns,
                                     " FROM env_steps WHERE env_id = ?1 AND tenant = ?2"));
    if (!stmt.ok()) return stmt.status();
    stmt->Bind(1, env_id).Bind(2, tenant);
    absl::StatusOr<bool> row = stmt->Step();
    if (!row.ok()) return row.status();
    if (!*row) return absl::NotFoundError(absl::StrCat("no step log for ", env_id));
    return StepLogFromRow(*stmt);
  }

  absl::StatusOr<std::vector<StepLogRecord>> ListStepLogs() override {
    std::lock_guard<std::mutex> lock(mu_);
    auto stmt =
        Prepare(absl::StrCat("SELECT ", kStepLogColumns, " FROM env_steps ORDER BY env_id"));
    if (!stmt.ok()) return stmt.status();
    std::vector<StepLogRecord> out;
    while (true) {
      absl::StatusOr<bool> row = stmt->Step();
      if (!row.ok()) return row.status();
      if (!*row) return out;
      out.push_back(StepLogFromRow(*stmt));
    }
  }

  absl::Status PutStep(const StepRecord& r) override {
    if (r.env_id.empty() || r.n < 0) return absl::InvalidArgumentError("PutStep: bad key");
    std::lock_guard<std::mutex> lock(mu_);
    auto stmt = Prepare(
        "INSERT OR REPLACE INTO steps (env_id, n, tenant, parent, kind, summary, status, "
        "exit_code, error, started_ms, duration_ms, capture_ms, tier, memory, memory_detail, "
        "memory_live, files_changed, created_ms, manifest_sha, state_json, detail_json, bytes, "
        "collected) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, "
        "?16, ?17, ?18, ?19, ?20, ?21, ?22, ?23)");
    if (!stmt.ok()) return stmt.status();
    stmt->Bind(1, r.env_id)
        .Bind(2, r.n)
        .Bind(3, r.tenant)
        .Bind(4, r.parent)
        .Bind(5, r.kind)
        .Bind(6, r.summary)
        .Bind(7, r.status)
        .Bind(8, r.exit_code)
        .BindOptText(9, r.error)
        .Bind(10, r.started_ms)
        .Bind(11, r.duration_ms)
        .Bind(12, r.capture_ms)
        .Bind(13, r.tier)
        .Bind(14, r.memory)
        .BindOptText(15, r.memory_detail)
        .Bind(16, r.memory_live ? 1 : 0)
        .Bind(17, r.files_changed)
        .Bind(18, r.created_ms)
        .Bind(19, r.manifest_sha)
        .Bind(20, r.state_json)
        .Bind(21, r.detail_json)
        .Bind(22, r.bytes)
        .Bind(23, r.collected ? 1 : 0);
    return stmt->Run();
  }

  absl::StatusOr<StepRecord> GetStep(const std::string& tenant, const std::string& env_id,
                                     int64_t n) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto stmt = Prepare(absl::StrCat("SELECT ", kStepColumns,
                                     " FROM steps WHERE env_id = ?1 AND n = ?2 AND tenant = ?3"));
    if (!stmt.ok()) return stmt.status();
    stmt->Bind(1, env_id).Bind(2, n).Bind(3, tenant);
    absl::StatusOr<bool> row = stmt->Step();
    if (!row.ok()) return row.status();
    if (!*row) return absl::NotFoundError(absl::StrCat("step ", n, " of ", env_id, " not found"));
    return StepFromRow(*stmt);
  }

  absl::StatusOr<std::vector<StepRecord>> ListSteps(const std::string& tenant,
                                                    const std::string& env_id, int64_t before,
                                                    int limit) override {
    if (limit < 1 || limit > kMaxStepsListed)
      return absl::InvalidArgumentError(
          absl::StrCat("limit must be between 1 and ", kMaxStepsListed));
    std::lock_guard<std::mutex> lock(mu_);
    auto stmt =
        Prepare(absl::StrCat("SELECT ", kStepColumns,
                             " FROM steps WHERE env_id = ?1 AND tenant = ?2 AND (?3 < 0 OR n < ?3) "
                             "ORDER BY n DESC LIMIT ?4"));
    if (!stmt.ok()) return stmt.status();
    stmt->Bind(1, env_id).Bind(2, tenant).Bind(3, before).Bind(4, limit);
    return CollectSteps(*stmt);
  }

  absl::StatusOr<int64_t> CountSteps(const std::string& env_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto stmt = Prepare("SELECT count(*) FROM steps WHERE env_id = ?1");
    if (!stmt.ok()) return stmt.status();
    stmt->Bind(1, env_id);
    absl::StatusOr<bool> row = stmt->Step();
    if (!row.ok()) return row.status();
    return *row ? stmt->Int(0) : 0;
  }

  absl::Status DeleteStep(const std::string& env_id, int64_t n) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto stmt = Prepare("DELETE FROM steps WHERE env_id = ?1 AND n = ?2");
    if (!stmt.ok()) return stmt.status();
    stmt->Bind(1, env_id).Bind(2, n);
    return stmt->Run();
  }

  absl::Status DeleteSteps(const std::string& env_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (const char* sql :
         {"DELETE FROM steps WHERE env_id = ?1", "DELETE FROM env_steps WHERE env_id = ?1"}) {
      auto stmt = Prepare(sql);
      if (!stmt.ok()) return stmt.status();
      stmt->Bind(1, env_id);
      if (absl::Status st = stmt->Run(); !st.ok()) return st;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<StepRecord>> ListLiveMemorySteps() override {
    std::lock_guard<std::mutex> lock(mu_);
    auto stmt = Prepare(absl::StrCat("SELECT ", kStepColumns,
                                     " FROM steps WHERE memory_live = 1 ORDER BY env_id, n"));
    if (!stmt.ok()) return stmt.status();
    return CollectSteps(*stmt);
  }

  absl::StatusOr<std::vector<StepRecord>> ListStepBlobRefs() override {
    std::lock_guard<std::mutex> lock(mu_);
    auto stmt = Prepare(
        "SELECT env_id, n, manifest_sha, state_json, collected, tenant FROM steps ORDER BY "
        "env_id, n");
    if (!stmt.ok()) return stmt.status();
    std::vector<StepRecord> out;
    while (true) {
      absl::StatusOr<bool> row = stmt->Step();
      if (!row.ok()) return row.status();
      if (!*row) return out;
      StepRecord r;
      r.env_id = stmt->Text(0);
      r.n = stmt->Int(1);
      r.manifest_sha = stmt->Text(2);
      r.state_json = stmt->Text(3);
      r.collected = stmt->Int(4) != 0;
      r.tenant = stmt->Text(5);
      out.push_back(std::move(r));
    }
  }

  absl::StatusOr<EgressRecord> GetEgress(const std::string& env_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto stmt = Prepare(
        "SELECT env_id, tenant, policy_json, intents_json, ca_cert_pem, ca_key_pem, updated_ms "
        "FROM env_egress WHERE env_id = ?1");
    if (!stmt.ok()) return stmt.status();
    stmt->Bind(1, env_id);
    absl::StatusOr<bool> row = stmt->Step();
    if (!row.ok()) return row.status();
    if (!*row) return absl::NotFoundError(absl::StrCat("no egress state for ", env_id));
    EgressRecord rec{stmt->Text(0), stmt->Text(1), stmt->Text(2), stmt->Text(3),
                     stmt->Text(4), stmt->Text(5), stmt->Int(6)};
    if (IsSealed(rec.ca_key_pem)) {
      if (secret_key_.empty()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "the CA key of ", env_id, " is sealed and no state key file is configured"));
      }
      absl::StatusOr<std::string> key = OpenSecret(secret_key_, rec.env_id, rec.ca_key_pem);
      if (!key.ok()) {
        return absl::Status(key.status().code(),
                            absl::StrCat("the CA key of ", env_id, ": ", key.status().message()));
      }
      rec.ca_key_pem = *std::move(key);
    }
    return rec;
  }

  // Loads the state key (StoreOptions::secret_key_file), checks it against the sealed rows and
  // seals the rows stored in plaintext before (a one-time migration; secure_delete so that
  // the replaced plaintext does not stay in free space, and the WAL is truncated).
  absl::Status InitSecrets() {
    if (options_.secret_key_file.empty()) return absl::OkStatus();
    const std::string& file = options_.secret_key_file;
    std::lock_guard<std::mutex> lock(mu_);
    absl::StatusOr<std::string> sealed_count =
        QueryText("SELECT count(*) FROM env_egress WHERE substr(ca_key_pem, 1, 3) = 'v1:'");
    if (!sealed_count.ok()) return sealed_count.status();
    const bool any_sealed = *sealed_count != "0";
    absl::StatusOr<std::string> key = LoadOrCreateSecretKey(file, /*create=*/!any_sealed);
    if (!key.ok()) {
      if (any_sealed && absl::IsNotFound(key.status())) {
        return absl::FailedPreconditionError(
            absl::StrCat("the state key ", file, " is missing but ", *sealed_count,
                         " environment CA keys in the database are sealed with it: restore it"));
      }
      return key.status();
    }
    if (any_sealed) {
      auto probe = Prepare(
          "SELECT env_id, ca_key_pem FROM env_egress WHERE substr(ca_key_pem, 1, 3) = 'v1:' "
          "LIMIT 1");
      if (!probe.ok()) return probe.status();
      absl::StatusOr<bool> row = probe->Step();
      if (!row.ok()) return row.status();
      if (*row) {
        absl::StatusOr<std::string> opened = OpenSecret(*key, probe->Text(0), probe->Text(1));
        if (!opened.ok()) {
          return absl::FailedPreconditionError(
              absl::StrCat("the state key ", file,
                           " does not open the environment CA keys sealed in the "
                           "database (",
                           opened.status().message(), "): restore the original key file"));
        }
      }
    }
    secret_key_ = *std::move(key);
    std::vector<std::pair<std::string, std::string>> plain;
    {
      auto stmt = Prepare(
          "SELECT env_id, ca_key_pem FROM env_egress WHERE ca_key_pem != '' AND "
          "substr(ca_key_pem, 1, 3) != 'v1:'");
      if (!stmt.ok()) return stmt.status();
      for (;;) {
        absl::StatusOr<bool> row = stmt->Step();
        if (!row.ok()) return row.status();
        if (!*row) break;
        plain.emplace_back(stmt->Text(0), stmt->Text(1));
      }
    }
    if (plain.empty()) return absl::OkStatus();
    if (auto st = Exec("PRAGMA secure_delete=ON; BEGIN IMMEDIATE"); !st.ok()) return st;
    for (const auto& [env_id, pem] : plain) {
      absl::StatusOr<std::string> sealed = SealSecret(secret_key_, env_id, pem);
      auto stmt = Prepare("UPDATE env_egress SET ca_key_pem = ?2 WHERE env_id = ?1");
      absl::Status st = !sealed.ok() ? sealed.status() : stmt.status();
      if (st.ok()) {
        stmt->Bind(1, env_id).Bind(2, *sealed);
        st = stmt->Run();
      }
      if (!st.ok()) {
        Exec("ROLLBACK").IgnoreError();
        return st;
      }
    }
    if (auto st = Exec("COMMIT"); !st.ok()) return st;
    if (wal_) Exec("PRAGMA wal_checkpoint(TRUNCATE)").IgnoreError();
    Exec("PRAGMA secure_delete=OFF").IgnoreError();
    LogInfo(absl::StrCat("storage: sealed ", plain.size(),
                         " environment CA keys stored in plaintext before"));
    return absl::OkStatus();
  }

  absl::Status DeleteEgress(const std::string& env_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto stmt = Prepare("DELETE FROM env_egress WHERE env_id = ?1");
    if (!stmt.ok()) return stmt.status();
    stmt->Bind(1, env_id);
    return stmt->Run();
  }

  absl::StatusOr<ApiKeyRecord> CreateApiKey(const std::string& tenant, const std::string& name,
                                            std::string* secret) override {
    if (tenant.empty()) return absl::InvalidArgumentError("CreateApiKey: empty tenant");
    std::string new_secret = absl::StrCat("esb_", RandomHex(20));
    ApiKeyRecord rec;
    rec.key_id = absl::StrCat("key_", RandomHex(8));
    rec.tenant = tenant;
    rec.name = name;
    rec.created_ms = NowUnixMs();
    std::lock_guard<std::mutex> lock(mu_);
    if (auto s = InsertKey(rec, Sha256Hex(new_secret)); !s.ok()) return s;
    if (secret != nullptr) *secret = std::move(new_secret);
    return rec;
  }

  absl::Status ImportApiKey(const std::string& tenant, const std::string& secret,
                            const std::string& name) override {
    if (tenant.empty()) return absl::InvalidArgumentError("ImportApiKey: empty tenant");
    if (auto s = ValidateSecret(secret); !s.ok()) return s;
    const std::string hash = Sha256Hex(secret);
    std::lock_guard<std::mutex> lock(mu_);
    auto stmt = Prepare("SELECT key_id, tenant FROM api_keys WHERE secret_sha256 = ?1");
    if (!stmt.ok()) return stmt.status();
    stmt->Bind(1, hash);
    absl::StatusOr<bool> row = stmt->Step();
    if (!row.ok()) return row.status();
    if (*row) {
      // Idempotent for the same tenant. A revoked key stays revoked: re-reading the config
      // file must not resurrect it.
      if (stmt->Text(1) != tenant) {
        return absl::AlreadyExistsError(absl::StrCat("API key '", name, "' (", stmt->Text(0),
                                                     ") is already registered for another "
                                                     "tenant"));
      }
      return absl::OkStatus();
    }
    ApiKeyRecord rec;
    rec.key_id = absl::StrCat("key_", RandomHex(8));
    rec.tenant = tenant;
    rec.name = name;
    rec.created_ms = NowUnixMs();
    return InsertKey(rec, hash);
  }

  absl::StatusOr<ApiKeyRecord> KeyForSecret(const std::string& secret) override {
    if (secret.empty()) return absl::NotFoundError("no API key given");
    const std::string hash = Sha256Hex(secret);
    std::lock_guard<std::mutex> lock(mu_);
    auto stmt = Prepare(
        "SELECT key_id, tenant, name, created_ms FROM api_keys "
        "WHERE secret_sha256 = ?1 AND revoked_ms = 0");
    if (!stmt.ok()) return stmt.status();
    stmt->Bind(1, hash);
    absl::StatusOr<bool> row = stmt->Step();
    if (!row.ok()) return row.status();
    if (!*row) return absl::NotFoundError("unknown or revoked API key");
    ApiKeyRecord rec;
    rec.key_id = stmt->Text(0);
    rec.tenant = stmt->Text(1);
    rec.name = stmt->Text(2);
    rec.created_ms = stmt->Int(3);
    return rec;
  }

  absl::StatusOr<std::vector<ApiKeyRecord>> ListApiKeys() override {
    std::lock_guard<std::mutex> lock(mu_);
    auto stmt = Prepare(
        "SELECT key_id, tenant, name, created_ms, revoked_ms FROM api_keys "
        "ORDER BY created_ms, key_id");
    if (!stmt.ok()) return stmt.status();
    std::vector<ApiKeyRecord> out;
    while (true) {
      absl::StatusOr<bool> row = stmt->Step();
      if (!row.ok()) return row.status();
      if (!*row) break;
      out.push_back(KeyFromRow(*stmt));
    }
    return out;
  }

  absl::Status RevokeApiKey(const std::string& key_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    {
      auto stmt = Prepare("SELECT revoked_ms FROM api_keys WHERE key_id = ?1");
      if (!stmt.ok()) return stmt.status();
      stmt->Bind(1, key_id);
      absl::StatusOr<bool> row = stmt->Step();
      if (!row.ok()) return row.status();
      if (!*row) return absl::NotFoundError(absl::StrCat("API key ", key_id, " not found"));
      if (stmt->Int(0) != 0) return absl::OkStatus();  // already revoked: idempotent
    }
    auto stmt = Prepare("UPDATE api_keys SET revoked_ms = ?2 WHERE key_id = ?1");
    if (!stmt.ok()) return stmt.status();
    stmt->Bind(1, key_id).Bind(2, NowUnixMs());
    return stmt->Run();
  }

  absl::StatusOr<int64_t> CountActiveApiKeys() override {
    std::lock_guard<std::mutex> lock(mu_);
    auto stmt = Prepare("SELECT count(*) FROM api_keys WHERE revoked_ms = 0");
    if (!stmt.ok()) return stmt.status();
    absl::StatusOr<bool> row = stmt->Step();
    if (!row.ok()) return row.status();
    return *row ? stmt->Int(0) : 0;
  }

  absl::Status AppendAudit(const AuditEntry& e) override {
    if (e.tenant.empty()) return absl::InvalidArgumentError("AppendAudit: empty tenant");
    if (e.action.empty()) return absl::InvalidArgumentError("AppendAudit: empty action");
    AuditEntry row = e;
    row.time_ms = e.time_ms != 0 ? e.time_ms : options_.now_ms();
    row.action = CapField(e.action, kMaxActionBytes);
    row.environment_id = CapField(e.environment_id, kMaxEnvironmentIdBytes);
    row.detail = CapField(e.detail, options_.max_detail_bytes);
    row.principal = CapField(e.principal, kMaxActionBytes);
    if (row.egress) CapEgress(&*row.egress);
    if (row.tool_call) CapToolCall(&*row.tool_call);
    const int64_t now = options_.now_ms();  // the rate is judged by the time of the call
    if (options_.write_behind_ms > 0) {
      {
        std::lock_guard<std::mutex> q(queue_mu_);
        if (queued_audit_.size() < options_.max_write_behind_rows) {
          const bool was_empty = QueueEmptyLocked();
          queued_audit_.push_back({std::move(row), now});
          if (was_empty) queue_cv_.notify_one();
          return absl::OkStatus();
        }
      }
      // Queue full: this caller writes the backlog and its own row (never dropped).
    }
    std::lock_guard<std::mutex> lock(mu_);
    FlushLocked().IgnoreError();
    return AppendAuditLocked(row, now);
  }

  // Cuts every egress field to its stored cap (cut marked), text as valid UTF-8.
  static void CapEgress(EgressFields* f) {
    f->method = CapField(SanitizeUtf8(f->method), kMaxEgressShortBytes);
    f->scheme = CapField(SanitizeUtf8(f->scheme), kMaxEgressShortBytes);
    f->decision = CapField(SanitizeUtf8(f->decision), kMaxEgressShortBytes);
    f->host = CapField(SanitizeUtf8(f->host), kMaxEgressHostBytes);
    f->path = CapField(SanitizeUtf8(f->path), kMaxEgressPathBytes);
    f->reason = CapField(SanitizeUtf8(f->reason), kMaxEgressReasonBytes);
    f->headers = CapField(SanitizeUtf8(f->headers), kMaxEgressHeadersBytes);
    f->body = CapField(SanitizeUtf8(f->body), kMaxEgressBodyBytes);
    f->body_sha256 = CapField(SanitizeUtf8(f->body_sha256), 2 * kMaxEgressShortBytes);
    if (f->intents.size() > kMaxEgressListItems) f->intents.resize(kMaxEgressListItems);
    if (f->rule_ids.size() > kMaxEgressListItems) f->rule_ids.resize(kMaxEgressListItems);
  }

  static void CapToolCall(ToolCallFields* f) {
    f->tool = CapField(SanitizeUtf8(f->tool), kMaxEgressListItemBytes);
    f->server = CapField(SanitizeUtf8(f->server), kMaxEgressListItemBytes);
    f->decision = CapField(SanitizeUtf8(f->decision), kMaxEgressShortBytes);
    f->arguments = CapField(SanitizeUtf8(f->arguments), kMaxToolArgumentsBytes);
    if (f->rule_ids.size() > kMaxEgressListItems) f->rule_ids.resize(kMaxEgressListItems);
    if (f->result_rule_ids.size() > kMaxEgressListItems) {
      f->result_rule_ids.resize(kMaxEgressListItems);
    }
  }

  static std::string ToolCallJson(const ToolCallFields& f) {
    namespace json = boost::json;
    auto list = [](const std::vector<std::string>& items) {
      json::array a;
      for (const std::string& item : items) a.emplace_back(CapField(item, kMaxEgressListItemBytes));
      return a;
    };
    return json::serialize(json::object{{"tool", f.tool},
                                        {"server", f.server},
                                        {"decision", f.decision},
                                        {"rule_ids", list(f.rule_ids)},
                                        {"result_rule_ids", list(f.result_rule_ids)},
                                        {"arguments", f.arguments},
                                        {"result_bytes", f.result_bytes}});
  }

  static ToolCallFields ToolCallFromJson(const std::string& text) {
    namespace json = boost::json;
    ToolCallFields f;
    boost::system::error_code ec;
    json::value v = json::parse(text, ec);
    if (ec || !v.is_object()) return f;
    const json::object& o = v.as_object();
    auto str = [&](const char* key) -> std::string {
      const json::value* x = o.if_contains(key);
      return x && x->is_string() ? std::string(x->get_string()) : std::string();
    };
    auto list = [&](const char* key) {
      std::vector<std::string> out;
      const json::value* x = o.if_contains(key);
      if (x && x->is_array()) {
        for (const json::value& item : x->get_array())
          if (item.is_string()) out.emplace_back(item.get_string());
      }
      return out;
    };
    f.tool = str("tool");
    f.server = str("server");
    f.decision = str("decision");
    f.rule_ids = list("rule_ids");
    f.result_rule_ids = list("result_rule_ids");
    f.arguments = str("arguments");
    const json::value* bytes = o.if_contains("result_bytes");
    if (bytes && bytes->is_int64()) f.result_bytes = bytes->get_int64();
    return f;
  }

  // The rate limit, summaries and row cap of one audit row judged at `now`. Caller holds mu_.
  absl::Status AppendAuditLocked(const AuditEntry& row, int64_t now) {
    TenantAudit& t = tenants_[row.tenant];
    // Token bucket, refilled by the time since the tenant's last row; egress rows have theirs.
    const bool egress = row.egress.has_value();
    // DLP decisions on tool calls have their own bucket (same rate as the API's): a flood of
    // cheap calls cannot crowd a blocked call out of its row; a flood of blocked calls is
    // summarised (by server and decision, still found by kind=tool&decision=blocked) and
    // bounded by the same rate and the tenant's row cap as every other row.
    Bucket& b = egress ? t.egress : IsDlpDecision(row) ? t.dlp : t.api;
    const double burst = egress ? options_.egress_burst : options_.audit_burst;
    const double rate = egress ? options_.egress_rate_per_s : options_.audit_rate_per_s;
    if (b.refill_ms == 0) {
      b.tokens = burst;
    } else if (now > b.refill_ms) {
      b.tokens = std::min(burst, b.tokens + (now - b.refill_ms) * rate / 1000.0);
    }
    b.refill_ms = std::max(b.refill_ms, now);
    if (b.tokens < 1) {
      Suppress(t, row, now);
      return absl::OkStatus();
    }
    b.tokens -= 1;
    // Summaries go out at most every kSuppressFlushMs per tenant (else each admitted row
    // would bring one along and double the rate).
    if (!t.suppressed.empty() && now - t.suppressed_since_ms >= kSuppressFlushMs) {
      if (absl::Status s = FlushSuppressed(row.tenant, t); !s.ok()) return s;
    }
    return InsertAudit(row, t);
  }

  absl::StatusOr<std::vector<AuditEntry>> QueryAudit(const AuditQuery& q) override {
    if (q.tenant.empty()) return absl::InvalidArgumentError("audit query needs a tenant");
    FlushIfQueued();
    if (q.limit < 1 || q.limit > kMaxAuditLimit) {
      return absl::InvalidArgumentError(
          absl::StrCat("audit limit must be between 1 and ", kMaxAuditLimit, ", got ", q.limit));
    }
    if (q.since_ms < 0 || q.until_ms < 0 || (q.until_ms != 0 && q.until_ms < q.since_ms)) {
      return absl::InvalidArgumentError("audit time range is empty or negative");
    }
    if (!q.kind.empty() && q.kind != "egress" && q.kind != "tool") {
      return absl::InvalidArgumentError(
          absl::StrCat("audit kind must be \"egress\", \"tool\" or empty, got \"", q.kind, "\""));
    }
    if (q.before_time_ms < 0 || q.before_id < 0) {
      return absl::InvalidArgumentError("audit cursor is negative");
    }
    std::string fts;
    if (!q.keyword.empty()) {
      absl::StatusOr<std::string> user = CheckAuditSearch(q.keyword);
      if (!user.ok()) return user.status();
      // The user's expression is balanced (checked), so it cannot break out of the group:
      // the index only yields this tenant's rows.
      if (!user->empty()) fts = absl::StrCat("scope : ", ScopeToken(q.tenant), " AND (", *user, ")");
    }
    const bool tool_only = q.kind == "tool";
    const bool egress_only = !tool_only && (q.kind == "egress" || !q.decision.empty());
    std::string sql =
        "SELECT a.id, a.time_ms, a.tenant, a.environment_id, a.action, a.detail, a.exit_code, "
        "a.duration_ms, a.bytes, a.status, a.principal, e.audit_id, e.intents, e.method, "
        "e.scheme, e.host, e.port, e.path, e.decision, e.rule_ids, e.reason, e.bytes_up, "
        "e.bytes_down, e.added_latency_us, e.headers, e.body, e.body_bytes, e.body_sha256, "
        "a.tool_call "
        "FROM audit a LEFT JOIN audit_egress e ON e.audit_id = a.id "
        "WHERE a.tenant = ?1 AND (?2 = 0 OR a.time_ms >= ?2) AND (?3 = 0 OR a.time_ms <= ?3) "
        "AND (?4 = '' OR a.environment_id = ?4) "
        "AND (?7 = 0 OR a.time_ms < ?7 OR (a.time_ms = ?7 AND a.id < ?8)) ";
    // Suppressed summaries of egress rows (action "egress", no side row) are egress rows too:
    // a flood stays visible. A decision only side rows have.
    if (egress_only) sql += "AND a.action = 'egress' ";
    if (tool_only) sql += "AND a.action = 'tool.call' ";
    if (!q.decision.empty()) {
      sql +=
          tool_only ? "AND json_extract(a.tool_call, '$.decision') = ?9 " : "AND e.decision = ?9 ";
    }
    if (!fts.empty()) {
      sql +=
          "AND (a.id IN (SELECT rowid FROM audit_fts WHERE audit_fts MATCH ?6) OR a.id IN "
          "(SELECT rowid FROM egress_fts WHERE egress_fts MATCH ?6)) ";
    }
    sql += "ORDER BY a.time_ms DESC, a.id DESC LIMIT ?5";

    absl::StatusOr<std::unique_ptr<SearchSlot>> slot = BeginSearch(q.tenant);
    if (!slot.ok()) return slot.status();
    Conn* conn = (*slot)->conn();
    if (!fts.empty()) {
      // SQLite may never evaluate the MATCH when no row passes the other filters, so a bad
      // query would succeed on an empty log and fail on a full one: check it on its own.
      auto check = conn->Prepare("SELECT rowid FROM audit_fts WHERE audit_fts MATCH ?1 LIMIT 1");
      if (!check.ok()) return check.status();
      check->Bind(1, fts);
      absl::StatusOr<bool> row = check->Step();
      if (!row.ok()) return SearchFailure(*check, row.status(), q.keyword);
    }
    auto stmt = conn->Prepare(sql);
    if (!stmt.ok()) return stmt.status();
    stmt->Bind(1, q.tenant)
        .Bind(2, q.since_ms)
        .Bind(3, q.until_ms)
        .Bind(4, q.environment_id)
        .Bind(5, q.limit)
        .Bind(7, q.before_time_ms)
        .Bind(8, q.before_id);
    if (!fts.empty()) stmt->Bind(6, fts);
    if (!q.decision.empty()) stmt->Bind(9, q.decision);
    std::vector<AuditEntry> out;
    size_t body_budget = kMaxAuditResultBodyBytes;
    while (true) {
      absl::StatusOr<bool> row = stmt->Step();
      if (!row.ok()) return SearchFailure(*stmt, row.status(), q.keyword);
      if (!*row) break;
      AuditEntry e;
      e.id = stmt->Int(0);
      e.time_ms = stmt->Int(1);
      e.tenant = stmt->Text(2);
      e.environment_id = stmt->Text(3);
      e.action = stmt->Text(4);
      e.detail = stmt->Text(5);
      if (!stmt->IsNull(6)) e.exit_code = stmt->Int(6);
      e.duration_ms = stmt->Int(7);
      e.bytes = stmt->Int(8);
      e.status = static_cast<int>(stmt->Int(9));
      e.principal = stmt->Text(10);
      if (!stmt->IsNull(11)) {
        EgressFields& f = e.egress.emplace();
        f.intents = FromJsonArray(stmt->Text(12));
        f.method = stmt->Text(13);
        f.scheme = stmt->Text(14);
        f.host = stmt->Text(15);
        f.port = static_cast<int>(stmt->Int(16));
        f.path = stmt->Text(17);
        f.decision = stmt->Text(18);
        f.rule_ids = FromJsonArray(stmt->Text(19));
        f.reason = stmt->Text(20);
        f.bytes_up = stmt->Int(21);
        f.bytes_down = stmt->Int(22);
        f.added_latency_us = stmt->Int(23);
        f.headers = stmt->Text(24);
        f.body = stmt->Text(25);
        f.body_bytes = stmt->Int(26);
        f.body_sha256 = stmt->Text(27);
        if (f.body.size() > body_budget) {
          f.body.clear();
          f.body_omitted = true;
        } else {
          body_budget -= f.body.size();
        }
      }
      if (!stmt->IsNull(28)) e.tool_call = ToolCallFromJson(stmt->Text(28));
      out.push_back(std::move(e));
    }
    return out;
  }

  absl::StatusOr<EgressReport> ReportEgress(const EgressReportQuery& q) override {
    if (q.tenant.empty()) return absl::InvalidArgumentError("egress report needs a tenant");
    if (q.from_ms < 0 || q.to_ms <= q.from_ms) {
      return absl::InvalidArgumentError("egress report time range is empty or negative");
    }
    if (q.top_n < 1 || q.top_n > kMaxReportTopN) {
      return absl::InvalidArgumentError(
          absl::StrCat("egress report top_n must be between 1 and ", kMaxReportTopN));
    }
    FlushIfQueued();
    absl::StatusOr<std::unique_ptr<SearchSlot>> slot = BeginSearch(q.tenant);
    if (!slot.ok()) return slot.status();
    Conn* conn = (*slot)->conn();
    // Every statement reads audit_egress e (by its (tenant, time_ms) index) with the same
    // filter, ?1..?4; ?5 is a statement's LIMIT.
    auto from = [](std::string_view tables) {
      return absl::StrCat(" FROM ", AbslView(tables),
                          " WHERE e.tenant = ?1 AND e.time_ms >= ?2 AND e.time_ms < ?3 "
                          "AND (?4 = '' OR e.environment_id = ?4) ");
    };
    constexpr const char* kSums =
        "count(*), total(e.decision = 'allowed'), total(e.decision = 'blocked'), "
        "total(e.decision = 'redacted'), total(e.decision = 'opaque'), "
        "total(e.decision = 'error'), total(e.bytes_up), total(e.bytes_down)";
    auto run = [&](const std::string& sql, int64_t limit,
                   const std::function<void(const Stmt&)>& each) -> absl::Status {
      auto stmt = conn->Prepare(sql);
      if (!stmt.ok()) return stmt.status();
      stmt->Bind(1, q.tenant).Bind(2, q.from_ms).Bind(3, q.to_ms).Bind(4, q.environment_id);
      if (limit > 0) stmt->Bind(5, limit);
      while (true) {
        absl::StatusOr<bool> row = stmt->Step();
        if (!row.ok()) return SearchFailure(*stmt, row.status(), "");
        if (!*row) return absl::OkStatus();
        each(*stmt);
      }
    };
    // total() is a float: sums of integers far below 2^53 convert back exactly.
    auto num = [](const Stmt& s, int col) { return static_cast<int64_t>(s.Double(col)); };
    auto summary = [&](const Stmt& s, int first, EgressReport::Summary* out) {
      out->requests = s.Int(first);
      out->allowed = num(s, first + 1);
      out->blocked = num(s, first + 2);
      out->redacted = num(s, first + 3);
      out->opaque = num(s, first + 4);
      out->errors = num(s, first + 5);
      out->bytes_up = num(s, first + 6);
      out->bytes_down = num(s, first + 7);
    };
    EgressReport r;
    const std::string egress = from("audit_egress e");
    const std::string rules = from("audit_egress e, json_each(e.rule_ids) j");
    absl::Status st = run(absl::StrCat("SELECT ", kSums, egress), 0,
                          [&](const Stmt& s) { summary(s, 0, &r.totals); });
    if (st.ok()) {
      st = run(absl::StrCat("SELECT e.environment_id, ", kSums, egress,
                            "GROUP BY e.environment_id ORDER BY count(*) DESC, e.environment_id "
                            "LIMIT ?5"),
               kMaxReportEnvironments, [&](const Stmt& s) {
                 EgressReport::Summary env;
                 env.environment_id = s.Text(0);
                 summary(s, 1, &env);
                 r.environments.push_back(std::move(env));
               });
    }
    if (st.ok()) {
      // The rules that blocked: every rule id of a blocked row except the permitting ones.
      st = run(absl::StrCat("SELECT j.value, count(*)", rules,
                            "AND e.decision = 'blocked' AND substr(j.value, 1, 6) != 'allow:' "
                            "AND substr(j.value, 1, 7) != 'intent:' AND j.value != 'mode:open' "
                            "GROUP BY j.value ORDER BY count(*) DESC, j.value LIMIT ?5"),
               q.top_n, [&](const Stmt& s) {
                 r.blocks_by_rule.push_back({s.Text(0), s.Int(1)});
               });
    }
    if (st.ok()) {
      st = run(absl::StrCat("SELECT e.host, count(*), total(e.decision = 'blocked'), "
                            "total(e.bytes_up), total(e.bytes_down)",
                            egress, "GROUP BY e.host ORDER BY count(*) DESC, e.host LIMIT ?5"),
               q.top_n, [&](const Stmt& s) {
                 r.top_hosts.push_back({s.Text(0), s.Int(1), num(s, 2), num(s, 3), num(s, 4)});
               });
    }
    if (st.ok()) {
      st = run(absl::StrCat("SELECT j.value, count(*)", rules,
                            "AND substr(j.value, 1, 4) = 'dlp:' "
                            "GROUP BY j.value ORDER BY count(*) DESC, j.value LIMIT ?5"),
               q.top_n, [&](const Stmt& s) {
                 r.dlp_findings.push_back({s.Text(0), s.Int(1)});
               });
    }
    if (st.ok()) {
      // Days of a report are few (daily: 1, weekly: 7); the LIMIT only bounds a long range.
      st = run(absl::StrCat("SELECT e.time_ms / 86400000 * 86400000 AS day, count(*), "
                            "total(e.decision = 'blocked'), total(e.bytes_up), "
                            "total(e.bytes_down)",
                            egress, "GROUP BY day ORDER BY day LIMIT ?5"),
               kMaxReportDays, [&](const Stmt& s) {
                 r.days.push_back({s.Int(0), s.Int(1), num(s, 2), num(s, 3), num(s, 4)});
               });
    }
    if (!st.ok()) return st;
    return r;
  }

  absl::Status Maintain() override {
    std::lock_guard<std::mutex> lock(mu_);
    FlushLocked().IgnoreError();
    const int64_t now = options_.now_ms();
    for (auto& [tenant, t] : tenants_) {
      if (!t.suppressed.empty() && now - t.suppressed_since_ms >= kSuppressFlushMs) {
        if (absl::Status s = FlushSuppressed(tenant, t); !s.ok()) return s;
      }
    }
    if (!retention_backlog_ && last_retention_ms_ != 0 &&
        now - last_retention_ms_ < kRetentionIntervalMs) {
      return absl::OkStatus();
    }
    last_retention_ms_ = now;
    return ApplyRetention(now - options_.retention_s * 1000);
  }

  absl::StatusOr<int64_t> CountAudit(const std::string& tenant) override {
    std::lock_guard<std::mutex> lock(mu_);
    FlushLocked().IgnoreError();
    auto stmt = Prepare("SELECT count(*) FROM audit WHERE ?1 = '' OR tenant = ?1");
    if (!stmt.ok()) return stmt.status();
    stmt->Bind(1, tenant);
    absl::StatusOr<bool> row = stmt->Step();
    if (!row.ok()) return row.status();
    return *row ? stmt->Int(0) : 0;
  }

 private:
  bool QueueEmptyLocked() const { return queued_audit_.empty() && queued_envs_.empty(); }

  // Searches see queued rows: only then do they wait for the writer's mutex.
  void FlushIfQueued() {
    bool queued;
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      queued = !QueueEmptyLocked();
    }
    if (queued) {
      std::lock_guard<std::mutex> lock(mu_);
      FlushLocked().IgnoreError();  // logged there
    }
  }

  // A running audit search or report: the tenant's one search slot and a connection (a reader,
  // or the writer for in-memory databases) with the search deadline set. Released when
  // destroyed.
  class SearchSlot {
   public:
    SearchSlot(SqliteStore* store, std::string tenant)
        : store_(store), tenant_(std::move(tenant)) {}
    SearchSlot(const SearchSlot&) = delete;
    SearchSlot& operator=(const SearchSlot&) = delete;
    ~SearchSlot() {
      if (conn_ != nullptr) {
        conn_->deadline_ms.store(0);
        if (conn_ == &store_->writer_) {
          writer_lock_.unlock();
        } else {
          std::lock_guard<std::mutex> lock(store_->readers_mu_);
          store_->free_readers_.push_back(conn_);
        }
      }
      {
        std::lock_guard<std::mutex> lock(store_->readers_mu_);
        store_->searching_.erase(tenant_);
      }
      store_->readers_cv_.notify_all();
    }
    Conn* conn() const { return conn_; }

   private:
    friend class SqliteStore;
    SqliteStore* store_;
    std::string tenant_;
    Conn* conn_ = nullptr;
    std::unique_lock<std::mutex> writer_lock_;
  };

  absl::StatusOr<std::unique_ptr<SearchSlot>> BeginSearch(const std::string& tenant) {
    // One search at a time per tenant (a second one waits, boundedly), so one tenant cannot
    // hold every reader.
    {
      std::unique_lock<std::mutex> lock(readers_mu_);
      if (!readers_cv_.wait_for(lock, std::chrono::milliseconds(options_.audit_query_timeout_ms),
                                [&] { return !searching_.count(tenant); })) {
        return absl::ResourceExhaustedError(
            "an audit search of this tenant is already running; retry when it has finished");
      }
      searching_.insert(tenant);
    }
    auto slot = std::make_unique<SearchSlot>(this, tenant);
    // A reader connection (never the writer's mutex), or the writer for in-memory databases.
    if (readers_.empty()) {
      slot->writer_lock_ = std::unique_lock<std::mutex>(mu_);
      slot->conn_ = &writer_;
    } else {
      std::unique_lock<std::mutex> lock(readers_mu_);
      if (!readers_cv_.wait_for(lock, std::chrono::milliseconds(options_.audit_query_timeout_ms),
                                [this] { return !free_readers_.empty(); })) {
        return absl::UnavailableError("audit search is busy; retry shortly");
      }
      slot->conn_ = free_readers_.back();
      free_readers_.pop_back();
    }
    slot->conn_->deadline_ms.store(MonotonicMs() + options_.audit_query_timeout_ms);
    return slot;
  }

  // The error of a failed search statement: too expensive (stopped at its deadline), the
  // caller's bad FTS syntax, or ours.
  absl::Status SearchFailure(const Stmt& stmt, absl::Status status, std::string_view keyword) {
    if ((stmt.last_rc() & 0xff) == SQLITE_INTERRUPT) {
      return absl::DeadlineExceededError(absl::StrCat(
          "audit query too expensive: stopped after ", options_.audit_query_timeout_ms,
          " ms; narrow it (fewer terms, longer prefixes, a time range or an environment_id)"));
    }
    // FTS5 reports bad query syntax ("fts5: syntax error near ...", "no such column") as a
    // plain SQLITE_ERROR while stepping: that is the caller's mistake, not ours.
    if (!keyword.empty() && (stmt.last_rc() & 0xff) == SQLITE_ERROR) {
      return absl::InvalidArgumentError(
          absl::StrCat("invalid audit search query '", AbslView(keyword), "': ", stmt.errmsg()));
    }
    return status;
  }

  // The write-behind thread: once something is queued, waits write_behind_ms for more, then
  // writes it all in one transaction.
  void WriteBehindLoop() {
    std::unique_lock<std::mutex> q(queue_mu_);
    for (;;) {
      queue_cv_.wait(q, [this] { return stopping_ || !QueueEmptyLocked(); });
      if (stopping_) return;  // the destructor writes what is left
      queue_cv_.wait_for(q, std::chrono::milliseconds(options_.write_behind_ms),
                         [this] { return stopping_; });
      if (stopping_) return;
      q.unlock();
      {
        std::lock_guard<std::mutex> lock(mu_);
        FlushLocked().IgnoreError();  // logged there
      }
      q.lock();
    }
  }

  // Writes everything queued, in one transaction. Caller holds mu_ (lock order: mu_, then
  // queue_mu_). A failure is logged with what it cost; the first error is returned.
  absl::Status FlushLocked() {
    std::vector<QueuedAudit> audit;
    std::map<std::string, EnvironmentRecord> envs;
    {
      std::lock_guard<std::mutex> q(queue_mu_);
      if (QueueEmptyLocked()) return absl::OkStatus();
      audit.swap(queued_audit_);
      envs.swap(queued_envs_);
    }
    absl::Status first = Exec("BEGIN");
    const bool in_txn = first.ok();
    auto note = [&first](absl::Status s) {
      if (!s.ok() && first.ok()) first = std::move(s);
    };
    for (const auto& [id, rec] : envs) note(WriteEnvironmentLocked(rec));
    for (const QueuedAudit& a : audit) note(AppendAuditLocked(a.row, a.now));
    if (in_txn) {
      absl::Status commit = Exec("COMMIT");
      if (!commit.ok()) {
        Exec("ROLLBACK").IgnoreError();
        for (auto& [tenant, t] : tenants_) t.rows = -1;  // recount: the inserts are gone
        note(commit);
      }
    }
    if (!first.ok()) {
      LogError(absl::StrCat("storage: write-behind of ", audit.size(), " audit rows and ",
                            envs.size(), " environment updates failed (", first.ToString(),
                            ")", in_txn ? "" : "; written without a transaction"));
    }
    return first;
  }

  // Audit rows of one kind not stored one by one (over the rate limit).
  struct Suppressed {
    int64_t count = 0;
    int64_t first_ms = 0;
    int64_t last_ms = 0;
    int64_t bytes = 0;
    std::string first_detail;
    // Tool-call rows: the tool (if all were the same tool) and the rules hit (<= 32 each).
    std::optional<ToolCallFields> tool_call;
  };
  struct Bucket {
    double tokens = 0;
    int64_t refill_ms = 0;
  };
  // (environment_id, action, status, tool server, tool decision): a summary keeps its
  // environment, so a search of one environment's audit finds the flood against it, and a tool
  // summary its server and decision, so kind=tool&decision=... finds it.
  using SuppressedKind = std::tuple<std::string, std::string, int, std::string, std::string>;
  // Per-tenant audit accounting; guarded by mu_.
  struct TenantAudit {
    Bucket api;         // audit rows of API calls and the daemon
    Bucket egress;      // egress rows
    Bucket dlp;         // tool-call rows whose decision is blocked or redacted
    int64_t rows = -1;  // rows stored for the tenant; -1: not counted yet
    // Bytes of egress headers and bodies stored for the tenant; -1: not counted yet (after
    // rows were deleted: recounted on the next egress row).
    int64_t egress_stored_bytes = -1;
    int64_t suppressed_since_ms = 0;
    std::map<SuppressedKind, Suppressed> suppressed;
  };

  static bool IsDlpDecision(const AuditEntry& row) {
    return row.tool_call &&
           (row.tool_call->decision == "blocked" || row.tool_call->decision == "redacted");
  }

  void Suppress(TenantAudit& t, const AuditEntry& row, int64_t now) {
    SuppressedKind kind{row.environment_id, row.action, row.status,
                        row.tool_call ? row.tool_call->server : "",
                        row.tool_call ? row.tool_call->decision : ""};
    if (t.suppressed.size() >= kMaxSuppressedKinds && !t.suppressed.count(kind)) {
      // Bounded: every further kind shares one counter; DLP decisions one per decision (two),
      // so a flood of many kinds cannot take a blocked call out of the decision search.
      kind = IsDlpDecision(row) ? SuppressedKind{"", "tool.call", 0, "", row.tool_call->decision}
                                : SuppressedKind{"", "audit.other", 0, "", ""};
    }
    if (t.suppressed.empty()) t.suppressed_since_ms = now;
    Suppressed& sup = t.suppressed[kind];
    if (sup.count++ == 0) {
      sup.first_ms = row.time_ms;
      sup.first_detail = CapField(row.detail, 200);
      if (row.tool_call && std::get<1>(kind) == "tool.call") {
        sup.tool_call.emplace();
        sup.tool_call->tool = row.tool_call->tool;
        sup.tool_call->server = std::get<3>(kind);
        sup.tool_call->decision = std::get<4>(kind);
      }
    }
    sup.last_ms = std::max(sup.last_ms, row.time_ms);
    sup.bytes += row.bytes;
    if (sup.tool_call && row.tool_call) {
      ToolCallFields& f = *sup.tool_call;
      if (f.tool != row.tool_call->tool) f.tool.clear();  // several tools: none named
      f.result_bytes += row.tool_call->result_bytes;
      auto merge = [](std::vector<std::string>* into, const std::vector<std::string>& from) {
        for (const std::string& id : from) {
          if (into->size() >= kMaxEgressListItems) return;
          if (std::find(into->begin(), into->end(), id) == into->end()) into->push_back(id);
        }
      };
      merge(&f.rule_ids, row.tool_call->rule_ids);
      merge(&f.result_rule_ids, row.tool_call->result_rule_ids);
    }
  }

  // Writes one summary row per suppressed kind ("N similar events suppressed ..."). Caller
  // holds mu_.
  absl::Status FlushSuppressed(const std::string& tenant, TenantAudit& t) {
    auto pending = std::move(t.suppressed);
    t.suppressed.clear();
    for (const auto& [kind, sup] : pending) {
      AuditEntry row;
      row.time_ms = sup.last_ms;
      row.tenant = tenant;
      row.environment_id = std::get<0>(kind);
      row.action = std::get<1>(kind);
      row.status = std::get<2>(kind);
      row.bytes = sup.bytes;
      row.detail = absl::StrCat("[", sup.count, " similar events suppressed by the audit rate limit",
                                " between ", FormatRfc3339(sup.first_ms), " and ",
                                FormatRfc3339(sup.last_ms), "; first: ", sup.first_detail, "]");
      if (sup.tool_call) {
        row.tool_call = *sup.tool_call;
        row.tool_call->arguments = absl::StrCat("[not stored: summary of ", sup.count, " calls]");
      }
      if (absl::Status s = InsertAudit(row, t); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // Inserts one (already capped) row and enforces the tenant's row cap. Caller holds mu_.
  absl::Status InsertAudit(const AuditEntry& e, TenantAudit& t) {
    // The FTS row is written by the trigger inside this same statement (atomic).
    auto stmt = Prepare(
        "INSERT INTO audit (time_ms, tenant, environment_id, action, detail, exit_code, "
        "duration_ms, bytes, status, principal, tool_call) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, "
        "?8, ?9, ?10, ?11)");
    if (!stmt.ok()) return stmt.status();
    stmt->Bind(1, e.time_ms)
        .Bind(2, e.tenant)
        .Bind(3, e.environment_id)
        .Bind(4, e.action)
        .Bind(5, e.detail)
        .Bind(6, e.exit_code)
        .Bind(7, e.duration_ms)
        .Bind(8, e.bytes)
        .Bind(9, e.status)
        .Bind(10, e.principal);
    stmt->BindOptText(
        11, e.tool_call ? std::optional<std::string>(ToolCallJson(*e.tool_call)) : std::nullopt);
    if (absl::Status s = stmt->Run(); !s.ok()) return s;
    if (e.egress) {
      if (absl::Status s = InsertEgress(sqlite3_last_insert_rowid(writer_.db), e, t); !s.ok()) {
        return s;
      }
    }
    if (t.rows < 0) {
      auto count = Prepare("SELECT count(*) FROM audit WHERE tenant = ?1");
      if (!count.ok()) return count.status();
      count->Bind(1, e.tenant);
      absl::StatusOr<bool> row = count->Step();
      if (!row.ok()) return row.status();
      t.rows = *row ? count->Int(0) : 0;
    } else {
      ++t.rows;
    }
    if (t.rows <= options_.max_audit_rows_per_tenant) return absl::OkStatus();
    // Over the cap: drop the oldest 5% (at least one row, at most one short batch), so the
    // delete is rare and short; a larger excess (a lowered cap) goes batch by batch.
    const int64_t batch = std::clamp<int64_t>(
        std::max(t.rows - options_.max_audit_rows_per_tenant,
                 options_.max_audit_rows_per_tenant / 20),
        1, kDeleteBatch);
    auto del = Prepare(
        "DELETE FROM audit WHERE id IN (SELECT id FROM audit WHERE tenant = ?1 "
        "ORDER BY time_ms, id LIMIT ?2)");
    if (!del.ok()) return del.status();
    del->Bind(1, e.tenant).Bind(2, batch);
    if (absl::Status s = del->Run(); !s.ok()) return s;
    t.rows -= sqlite3_changes(writer_.db);
    t.egress_stored_bytes = -1;  // some of them may have been egress rows
    return absl::OkStatus();
  }

  // The egress side row of audit row `id` (inside the caller's statement sequence; the FTS
  // row is written by the trigger). Caller holds mu_.
  absl::Status InsertEgress(int64_t id, const AuditEntry& e, TenantAudit& t) {
    const EgressFields& f = *e.egress;
    // The tenant's budget of stored egress headers and bodies: beyond it a row keeps its
    // fields, sizes and hash but not its headers and body (the row cap alone would let a
    // tenant store max_audit_rows_per_tenant × 80 KiB).
    if (t.egress_stored_bytes < 0) {
      auto sum = Prepare("SELECT total(stored_bytes) FROM audit_egress WHERE tenant = ?1");
      if (!sum.ok()) return sum.status();
      sum->Bind(1, e.tenant);
      absl::StatusOr<bool> row = sum->Step();
      if (!row.ok()) return row.status();
      t.egress_stored_bytes = *row ? static_cast<int64_t>(sum->Double(0)) : 0;
    }
    std::string_view headers = f.headers;
    std::string_view body = f.body;
    if (t.egress_stored_bytes + static_cast<int64_t>(headers.size() + body.size()) >
        options_.max_egress_stored_bytes_per_tenant) {
      headers = "";
      body = kEgressBudgetFullMarker;
    }
    const int64_t stored = static_cast<int64_t>(headers.size() + body.size());
    t.egress_stored_bytes += stored;
    auto stmt = Prepare(
        "INSERT INTO audit_egress (audit_id, tenant, environment_id, time_ms, intents, method, "
        "scheme, host, port, path, decision, rule_ids, reason, bytes_up, bytes_down, "
        "added_latency_us, headers, body, body_bytes, body_sha256, stored_bytes) VALUES (?1, ?2, "
        "?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21)");
    if (!stmt.ok()) return stmt.status();
    stmt->Bind(1, id)
        .Bind(2, e.tenant)
        .Bind(3, e.environment_id)
        .Bind(4, e.time_ms)
        .Bind(5, ToJsonArray(f.intents))
        .Bind(6, f.method)
        .Bind(7, f.scheme)
        .Bind(8, f.host)
        .Bind(9, f.port)
        .Bind(10, f.path)
        .Bind(11, f.decision)
        .Bind(12, ToJsonArray(f.rule_ids))
        .Bind(13, f.reason)
        .Bind(14, f.bytes_up)
        .Bind(15, f.bytes_down)
        .Bind(16, f.added_latency_us)
        .Bind(17, headers)
        .Bind(18, body)
        .Bind(19, f.body_bytes)
        .Bind(20, f.body_sha256)
        .Bind(21, stored);
    return stmt->Run();
  }

  // Deletes audit rows and destroyed environments older than `cutoff_ms`, in short batches, a
  // few per call so that the writer mutex is never held long; a backlog (e.g. the first start
  // after retention was shortened) is worked off on the following ticks. Caller holds mu_.
  absl::Status ApplyRetention(int64_t cutoff_ms) {
    retention_backlog_ = false;
    const char* kDeletes[] = {
        "DELETE FROM audit WHERE id IN (SELECT id FROM audit WHERE time_ms < ?1 LIMIT ?2)",
        "DELETE FROM environments WHERE id IN (SELECT id FROM environments "
        "WHERE state = 'destroyed' AND destroyed_ms < ?1 LIMIT ?2)"};
    int64_t audit_deleted = 0;
    for (const char* sql : kDeletes) {
      for (int round = 0;; ++round) {
        if (round == kRetentionBatchesPerCall) {
          retention_backlog_ = true;  // the rest on the next call
          break;
        }
        auto stmt = Prepare(sql);
        if (!stmt.ok()) return stmt.status();
        stmt->Bind(1, cutoff_ms).Bind(2, kDeleteBatch);
        if (absl::Status s = stmt->Run(); !s.ok()) return s;
        const int n = sqlite3_changes(writer_.db);
        if (sql == kDeletes[0]) audit_deleted += n;
        if (n < kDeleteBatch) break;
      }
    }
    if (audit_deleted > 0) {
      for (auto& [tenant, t] : tenants_) {
        t.rows = -1;  // recount on the next insert
        t.egress_stored_bytes = -1;
      }
    }
    return absl::OkStatus();
  }

  // Returns a cached prepared statement of the writer for `sql`. Caller holds mu_ (or is in
  // Init).
  absl::StatusOr<Stmt> Prepare(const std::string& sql) { return writer_.Prepare(sql); }

  // Runs one or more statements without parameters (pragmas, migrations, transactions).
  absl::Status Exec(std::string_view sql) {
    std::string text(sql);
    char* err = nullptr;
    int rc = sqlite3_exec(writer_.db, text.c_str(), nullptr, nullptr, &err);
    if (rc == SQLITE_OK) return absl::OkStatus();
    std::string msg = err != nullptr ? err : sqlite3_errstr(rc);
    sqlite3_free(err);
    return absl::Status(CodeForSqlite(rc),
                        absl::StrCat("sqlite exec failed: ", msg, " (", sqlite3_errstr(rc),
                                     ") [sql: ", SqlForMessage(sql), "]"));
  }

  absl::StatusOr<std::string> QueryText(const std::string& sql) {
    auto stmt = Prepare(sql);
    if (!stmt.ok()) return stmt.status();
    absl::StatusOr<bool> row = stmt->Step();
    if (!row.ok()) return row.status();
    return *row ? stmt->Text(0) : std::string();
  }

  absl::Status Migrate() {
    if (auto s = Exec("CREATE TABLE IF NOT EXISTS schema_version ("
                      "  id INTEGER PRIMARY KEY CHECK (id = 1), version INTEGER NOT NULL);"
                      "INSERT OR IGNORE INTO schema_version (id, version) VALUES (1, 0);");
        !s.ok()) {
      return s;
    }
    for (int target = 1; target <= kLatestVersion; ++target) {
      // BEGIN IMMEDIATE takes the write lock first, so two daemons opening the same file
      // cannot both apply a migration.
      if (auto s = Exec("BEGIN IMMEDIATE"); !s.ok()) return s;
      absl::Status s = ApplyMigration(target);
      if (!s.ok()) {
        (void)Exec("ROLLBACK");
        return s;
      }
      if (s = Exec("COMMIT"); !s.ok()) {
        (void)Exec("ROLLBACK");
        return s;
      }
    }
    return absl::OkStatus();
  }

  // Inside a transaction: applies migration `target` unless the schema is already there.
  absl::Status ApplyMigration(int target) {
    absl::StatusOr<std::string> v = QueryText("SELECT version FROM schema_version WHERE id = 1");
    if (!v.ok()) return v.status();
    int version = std::atoi(v->c_str());
    if (version > kLatestVersion) {
      return absl::FailedPreconditionError(
          absl::StrCat("database schema version ", version, " is newer than this esbd supports (",
                       kLatestVersion, "); upgrade esbd or use another database"));
    }
    if (version >= target) return absl::OkStatus();
    if (auto s = Exec(kMigrations[target - 1]); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("schema migration to version ", target, ": ", s.message()));
    }
    return Exec(absl::StrCat("UPDATE schema_version SET version = ", target, " WHERE id = 1"));
  }

  absl::Status InsertKey(const ApiKeyRecord& rec, const std::string& hash) {
    auto stmt = Prepare(
        "INSERT INTO api_keys (key_id, tenant, name, secret_sha256, created_ms) "
        "VALUES (?1, ?2, ?3, ?4, ?5)");
    if (!stmt.ok()) return stmt.status();
    stmt->Bind(1, rec.key_id)
        .Bind(2, rec.tenant)
        .Bind(3, rec.name)
        .Bind(4, hash)
        .Bind(5, rec.created_ms);
    return stmt->Run();
  }

  static absl::StatusOr<std::vector<StepRecord>> CollectSteps(Stmt& stmt) {
    std::vector<StepRecord> out;
    while (true) {
      absl::StatusOr<bool> row = stmt.Step();
      if (!row.ok()) return row.status();
      if (!*row) break;
      out.push_back(StepFromRow(stmt));
    }
    return out;
  }

  static absl::StatusOr<std::vector<EnvironmentRecord>> CollectEnvs(Stmt& stmt) {
    std::vector<EnvironmentRecord> out;
    while (true) {
      absl::StatusOr<bool> row = stmt.Step();
      if (!row.ok()) return row.status();
      if (!*row) break;
      out.push_back(EnvFromRow(stmt));
    }
    return out;
  }

  StoreOptions options_;
  std::mutex mu_;  // the writer connection and tenants_
  std::string secret_key_;  // set once by InitSecrets (before any other use); "" = none
  Conn writer_;
  std::map<std::string, TenantAudit> tenants_;
  int64_t last_retention_ms_ = 0;
  bool wal_ = false;
  bool retention_backlog_ = false;  // the last retention pass stopped at its batch limit

  // Read-only connections for audit searches; guarded by readers_mu_.
  std::vector<std::unique_ptr<Conn>> readers_;
  std::mutex readers_mu_;
  std::condition_variable readers_cv_;
  std::vector<Conn*> free_readers_;
  std::set<std::string> searching_;  // tenants with an audit search running

  // Write-behind queue (StoreOptions::write_behind_ms); guarded by queue_mu_, taken after mu_.
  struct QueuedAudit {
    AuditEntry row;  // already capped
    int64_t now;     // when it was appended: the rate limit's clock
  };
  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::vector<QueuedAudit> queued_audit_;
  std::map<std::string, EnvironmentRecord> queued_envs_;
  bool stopping_ = false;
  std::thread writer_thread_;
};

// Audit search grammar (the only FTS5 that reaches SQLite is rebuilt from these tokens):
//   query   := or
//   or      := and ("OR" and)*
//   and     := not (["AND"] not)*          (adjacent terms are ANDed)
//   not     := primary ("NOT" primary)*
//   primary := WORD | WORD* | "PHRASE" | "(" query ")"   (groups nest at most kMaxGroupDepth)
// A WORD is a run of anything but whitespace and the characters below; it is searched as a
// phrase of the words the tokenizer finds in it ("main.py" finds main followed by py). A prefix
// WORD* has at least kMinAuditPrefixChars ASCII letters or digits and nothing else (FTS5 would
// split "a.b*" into "a" and the 1-character prefix "b*"). Everything else FTS5 treats as syntax
// outside quotes (column filters, NEAR, ^, +, {}, ',', '*' elsewhere) is refused.
constexpr int kMaxGroupDepth = 8;

bool IsSearchSyntaxChar(char c) {
  return c == '"' || c == '(' || c == ')' || c == '*' || c == ':' || c == '^' || c == '+' ||
         c == '{' || c == '}' || c == ',';
}

bool IsAsciiAlnum(char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0; }

// An upper bound of the number of tokens FTS5's unicode61 tokenizer makes of `text`: runs of
// ASCII letters and digits count one each; every non-ASCII character counts as one more (the
// tokenizer may split at it: not every character is a letter to it). Characters as SQLite
// decodes them, valid UTF-8 or not: a lead byte and all continuation bytes after it are one, a
// continuation byte without a lead is one on its own.
int CountSearchTokens(std::string_view text) {
  int n = 0;
  bool in_run = false;       // in a run of ASCII letters/digits
  bool in_sequence = false;  // after a lead byte (its continuation bytes belong to it)
  for (char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0xc0) {
      ++n;
      in_sequence = true;
      in_run = false;
    } else if (u >= 0x80) {
      if (!in_sequence) ++n;
      in_run = false;
    } else {
      in_sequence = false;
      if (IsAsciiAlnum(c)) {
        if (!in_run) ++n;
        in_run = true;
      } else {
        in_run = false;
      }
    }
  }
  return n;
}

struct SearchToken {
  enum Kind { kPhrase, kPrefix, kAnd, kOr, kNot, kOpen, kClose } kind;
  std::string text;  // kPhrase: the text (no '"'); kPrefix: the lowercase ASCII stem
};

absl::Status SearchError(std::string_view keyword, std::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("invalid audit search query '", AbslView(keyword), "': ", AbslView(why)));
}

absl::StatusOr<std::vector<SearchToken>> LexAuditSearch(std::string_view q) {
  std::vector<SearchToken> out;
  size_t i = 0;
  while (i < q.size()) {
    const char c = q[i];
    if (c == ' ' || c == '\t' || c == '\r' || c == '\n') {
      ++i;
    } else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      return SearchError(q, "control characters are not allowed");
    } else if (c == '(' || c == ')') {
      out.push_back({c == '(' ? SearchToken::kOpen : SearchToken::kClose, ""});
      ++i;
    } else if (c == '"') {
      // A phrase: everything up to the closing quote is text ('""' is a literal quote, which
      // the tokenizer drops anyway).
      std::string text;
      size_t j = i + 1;
      for (;; ++j) {
        if (j >= q.size()) return SearchError(q, "unbalanced quotes");
        if (q[j] == '"') {
          if (j + 1 < q.size() && q[j + 1] == '"') {
            text.push_back(' ');
            ++j;
            continue;
          }
          break;
        }
        if (static_cast<unsigned char>(q[j]) < 0x20 || q[j] == 0x7f) {
          return SearchError(q, "control characters are not allowed");
        }
        text.push_back(q[j]);
      }
      i = j + 1;
      if (i < q.size() && q[i] == '*') {
        return SearchError(q, "a prefix search is word* (letters and digits only), not \"...\"*");
      }
      out.push_back({SearchToken::kPhrase, std::move(text)});
    } else if (IsSearchSyntaxChar(c)) {
      return SearchError(
          q, absl::StrCat("'", std::string(1, c),
                          "' is search syntax that is not supported here (only words, \"phrases\", "
                          "word*, AND, OR, NOT and parentheses); put text in double quotes to "
                          "search for it"));
    } else {
      size_t j = i;
      while (j < q.size() && !IsSearchSyntaxChar(q[j]) && static_cast<unsigned char>(q[j]) > 0x20 &&
             q[j] != 0x7f) {
        ++j;
      }
      std::string word(q.substr(i, j - i));
      i = j;
      if (i < q.size() && q[i] == '*') {
        ++i;
        if (word.size() < static_cast<size_t>(kMinAuditPrefixChars) ||
            !std::all_of(word.begin(), word.end(), IsAsciiAlnum)) {
          return SearchError(q, absl::StrCat("'", word, "*': a prefix search needs at least ",
                                             kMinAuditPrefixChars,
                                             " characters before '*', all letters or digits"));
        }
        out.push_back({SearchToken::kPrefix, absl::AsciiStrToLower(word)});
      } else if (word == "AND") {
        out.push_back({SearchToken::kAnd, ""});
      } else if (word == "OR") {
        out.push_back({SearchToken::kOr, ""});
      } else if (word == "NOT") {
        out.push_back({SearchToken::kNot, ""});
      } else if (word == "NEAR") {
        return SearchError(q, "NEAR is not supported");
      } else {
        out.push_back({SearchToken::kPhrase, std::move(word)});
      }
    }
  }
  return out;
}

// Recursive-descent check of the grammar above over `tokens`; writes the FTS5 query.
class AuditSearchParser {
 public:
  AuditSearchParser(std::string_view keyword, const std::vector<SearchToken>& tokens)
      : keyword_(keyword), tokens_(tokens) {}

  absl::StatusOr<std::string> Parse() {
    if (tokens_.empty()) return std::string();
    if (absl::Status s = Or(0); !s.ok()) return s;
    if (pos_ != tokens_.size()) {
      return SearchError(keyword_, tokens_[pos_].kind == SearchToken::kClose
                                       ? "unbalanced parentheses"
                                       : "unexpected operator");
    }
    if (terms_ > kMaxAuditQueryTerms || prefixes_ > kMaxAuditPrefixTerms) {
      return absl::InvalidArgumentError(absl::StrCat(
          "audit search has ", terms_, " terms (", prefixes_, " prefix terms); at most ",
          kMaxAuditQueryTerms, " terms and ", kMaxAuditPrefixTerms, " prefix terms are allowed"));
    }
    return out_;
  }

 private:
  bool At(SearchToken::Kind k) const { return pos_ < tokens_.size() && tokens_[pos_].kind == k; }
  bool AtPrimary() const {
    return At(SearchToken::kPhrase) || At(SearchToken::kPrefix) || At(SearchToken::kOpen);
  }

  absl::Status Or(int depth) {
    if (absl::Status s = And(depth); !s.ok()) return s;
    while (At(SearchToken::kOr)) {
      ++pos_;
      out_ += " OR ";
      if (absl::Status s = And(depth); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  absl::Status And(int depth) {
    if (absl::Status s = Not(depth); !s.ok()) return s;
    while (At(SearchToken::kAnd) || AtPrimary()) {
      if (At(SearchToken::kAnd)) ++pos_;
      out_ += " AND ";
      if (absl::Status s = Not(depth); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  absl::Status Not(int depth) {
    if (absl::Status s = Primary(depth); !s.ok()) return s;
    while (At(SearchToken::kNot)) {
      ++pos_;
      out_ += " NOT ";
      if (absl::Status s = Primary(depth); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  absl::Status Primary(int depth) {
    if (pos_ >= tokens_.size()) return SearchError(keyword_, "an operator needs a term after it");
    const SearchToken& t = tokens_[pos_];
    switch (t.kind) {
      case SearchToken::kPhrase: {
        const int n = CountSearchTokens(t.text);
        if (n == 0) {
          return SearchError(keyword_, absl::StrCat("'", t.text, "' contains no word to search"));
        }
        terms_ += n;
        out_ += absl::StrCat("\"", t.text, "\"");
        ++pos_;
        return absl::OkStatus();
      }
      case SearchToken::kPrefix:
        ++terms_;
        ++prefixes_;
        out_ += absl::StrCat(t.text, "*");  // lowercase: never an operator
        ++pos_;
        return absl::OkStatus();
      case SearchToken::kOpen: {
        if (depth + 1 > kMaxGroupDepth) {
          return SearchError(keyword_, absl::StrCat("parentheses nest deeper than ",
                                                    kMaxGroupDepth));
        }
        ++pos_;
        out_ += "(";
        if (absl::Status s = Or(depth + 1); !s.ok()) return s;
        if (!At(SearchToken::kClose)) return SearchError(keyword_, "unbalanced parentheses");
        ++pos_;
        out_ += ")";
        return absl::OkStatus();
      }
      case SearchToken::kClose:
        return SearchError(keyword_, "unbalanced parentheses");
      default:
        return SearchError(keyword_, "an operator needs a term before and after it");
    }
  }

  std::string_view keyword_;
  const std::vector<SearchToken>& tokens_;
  size_t pos_ = 0;
  int terms_ = 0;
  int prefixes_ = 0;
  std::string out_;
};

}  // namespace

int LatestSchemaVersion() { return kLatestVersion; }

std::string MigrationSql(int version) {
  if (version < 1 || version > kLatestVersion) return "";
  return kMigrations[version - 1];
}

absl::StatusOr<std::string> CheckAuditSearch(std::string_view keyword) {
  if (keyword.size() > kMaxAuditKeywordBytes) {
    return absl::InvalidArgumentError(absl::StrCat("audit search 'q' is longer than ",
                                                   kMaxAuditKeywordBytes, " bytes"));
  }
  absl::StatusOr<std::vector<SearchToken>> tokens = LexAuditSearch(keyword);
  if (!tokens.ok()) return tokens.status();
  return AuditSearchParser(keyword, *tokens).Parse();
}

namespace {
std::string HexOf(const unsigned char* digest, unsigned int len) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(len * 2);
  for (unsigned int i = 0; i < len; ++i) {
    out.push_back(kHex[digest[i] >> 4]);
    out.push_back(kHex[digest[i] & 0xf]);
  }
  return out;
}
[[noreturn]] void Sha256Failed() {
  // Only fails if OpenSSL cannot allocate; never store a weak substitute.
  LogError("storage: SHA-256 failed");
  std::abort();
}
}  // namespace

Sha256Stream::Sha256Stream() : ctx_(EVP_MD_CTX_new()) {
  if (ctx_ == nullptr ||
      EVP_DigestInit_ex(static_cast<EVP_MD_CTX*>(ctx_), EVP_sha256(), nullptr) != 1)
    Sha256Failed();
}
Sha256Stream::~Sha256Stream() { EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_)); }
void Sha256Stream::Update(std::string_view data) {
  if (EVP_DigestUpdate(static_cast<EVP_MD_CTX*>(ctx_), data.data(), data.size()) != 1)
    Sha256Failed();
}
std::string Sha256Stream::HexDigest() {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(ctx_), digest, &len) != 1) Sha256Failed();
  return HexOf(digest, len);
}

std::string Sha256Hex(std::string_view data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_Digest(data.data(), data.size(), digest, &len, EVP_sha256(), nullptr) != 1)
    Sha256Failed();
  return HexOf(digest, len);
}

absl::StatusOr<std::unique_ptr<Store>> Store::Open(const std::string& path,
                                                   StoreOptions options) {
  if (path.empty()) return absl::InvalidArgumentError("database path is empty");
  const bool is_memory = path == ":memory:" || path.starts_with("file::memory:") ||
                         path.find("mode=memory") != std::string::npos;
  const bool is_uri = path.starts_with("file:");
  if (!is_memory && !is_uri) {
    // The database holds key hashes and the audit log: create it owner-only. SQLite gives
    // the -wal and -shm files the same permissions as the main file.
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return ErrnoStatus(absl::StrCat("open database ", path));
    ::close(fd);
  }
  sqlite3* db = nullptr;
  int rc = sqlite3_open_v2(
      path.c_str(), &db,
      SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX | SQLITE_OPEN_URI, nullptr);
  if (rc != SQLITE_OK) {
    absl::Status s(CodeForSqlite(rc),
                   absl::StrCat("sqlite open ", path, " failed: ",
                                db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc)));
    sqlite3_close_v2(db);
    return s;
  }
  auto store = std::make_unique<SqliteStore>(db, std::move(options));
  if (absl::Status s = store->Init(!is_memory); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("open database ", path, ": ", s.message()));
  }
  if (absl::Status s = store->InitSecrets(); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("open database ", path, ": ", s.message()));
  }
  if (!is_memory) {
    if (absl::Status s = store->OpenReaders(path); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("open database ", path, ": ", s.message()));
    }
  }
  store->StartWriteBehind();
  return std::unique_ptr<Store>(std::move(store));
}

}  // namespace esb

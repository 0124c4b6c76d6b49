#include "core/snapshots/manifest.h"

#include <algorithm>
#include <boost/json.hpp>

#include "absl/strings/str_cat.h"
#include "common/util.h"
#include "core/snapshots/blob_store.h"

namespace esb {

namespace json = boost::json;

bool IsValidManifestPath(std::string_view path) {
  if (path.empty() || path.size() > 4096 || path.front() == '/' || path.back() == '/') return false;
  size_t start = 0;
  while (start <= path.size()) {
    size_t end = path.find('/', start);
    if (end == std::string_view::npos) end = path.size();
    std::string_view comp = path.substr(start, end - start);
    if (comp.empty() || comp == "." || comp == "..") return false;
    start = end + 1;
  }
  return path.find('\0') == std::string_view::npos;
}

absl::Status ValidateManifest(const WorkspaceManifest& m) {
  if (m.entries.size() > kMaxManifestEntries)
    return absl::InvalidArgumentError(absl::StrCat("manifest has ", m.entries.size(),
                                                   " entries (max ", kMaxManifestEntries, ")"));
  const std::string* prev = nullptr;
  for (const ManifestEntry& e : m.entries) {
    if (!IsValidManifestPath(e.path))
      return absl::InvalidArgumentError(absl::StrCat("manifest: bad path '", e.path, "'"));
    if (prev && !(*prev < e.path))
      return absl::InvalidArgumentError(
          absl::StrCat("manifest: paths not sorted or repeated at '", e.path, "'"));
    if (e.size < 0 || e.mode > 07777)
      return absl::InvalidArgumentError(absl::StrCat("manifest: bad size or mode of ", e.path));
    if (e.type == ManifestEntry::Type::kFile && !IsBlobKey(e.sha256))
      return absl::InvalidArgumentError(absl::StrCat("manifest: bad sha256 of ", e.path));
    prev = &e.path;
  }
  return absl::OkStatus();
}

namespace {
const char* TypeCode(ManifestEntry::Type t) {
  switch (t) {
    case ManifestEntry::Type::kDir:
      return "d";
    case ManifestEntry::Type::kSymlink:
      return "l";
    default:
      return "f";
  }
}
}  // namespace

std::string EncodeManifest(const WorkspaceManifest& m) {
  json::array entries;
  entries.reserve(m.entries.size());
  for (const ManifestEntry& e : m.entries) {
    entries.push_back(json::array{
        json::string(e.path), TypeCode(e.type), static_cast<int64_t>(e.mode), e.size, e.mtime_ns,
        json::string(e.sha256), json::string(e.target), json::string(e.change_key)});
  }
  return json::serialize(json::object{{"v", 1}, {"t", m.total_bytes}, {"e", std::move(entries)}});
}

absl::StatusOr<WorkspaceManifest> DecodeManifest(std::string_view text) {
  boost::system::error_code ec;
  json::value v = json::parse(json::string_view(text.data(), text.size()), ec);
  auto bad = [](std::string_view why) {
    return absl::DataLossError(absl::StrCat("stored manifest is malformed: ", AbslView(why)));
  };
  if (ec || !v.is_object()) return bad("not a JSON object");
  const json::object& o = v.as_object();
  const json::value* ver = o.if_contains("v");
  const json::value* ents = o.if_contains("e");
  if (!ver || !ver->is_int64() || ver->as_int64() != 1) return bad("unknown version");
  if (!ents || !ents->is_array()) return bad("no entries");
  WorkspaceManifest m;
  if (const json::value* t = o.if_contains("t"); t && t->is_int64()) m.total_bytes = t->as_int64();
  if (ents->as_array().size() > kMaxManifestEntries) return bad("too many entries");
  m.entries.reserve(ents->as_array().size());
  for (const json::value& ev : ents->as_array()) {
    if (!ev.is_array() || ev.as_array().size() != 8) return bad("entry shape");
    const json::array& a = ev.as_array();
    if (!a[0].is_string() || !a[1].is_string() || !a[2].is_int64() || !a[3].is_int64() ||
        !a[4].is_int64() || !a[5].is_string() || !a[6].is_string() || !a[7].is_string())
      return bad("entry field types");
    ManifestEntry e;
    e.path = std::string(a[0].as_string());
    std::string_view type(a[1].as_string().data(), a[1].as_string().size());
    if (type == "f")
      e.type = ManifestEntry::Type::kFile;
    else if (type == "d")
      e.type = ManifestEntry::Type::kDir;
    else if (type == "l")
      e.type = ManifestEntry::Type::kSymlink;
    else
      return bad("entry type");
    if (a[2].as_int64() < 0 || a[2].as_int64() > 07777) return bad("mode");
    e.mode = static_cast<uint32_t>(a[2].as_int64());
    e.size = a[3].as_int64();
    e.mtime_ns = a[4].as_int64();
    e.sha256 = std::string(a[5].as_string());
    e.target = std::string(a[6].as_string());
    e.change_key = std::string(a[7].as_string());
    m.entries.push_back(std::move(e));
  }
  if (absl::Status st = ValidateManifest(m); !st.ok()) return bad(StdView(st.message()));
  return m;
}

std::vector<ManifestChange> DiffManifests(const WorkspaceManifest& parent,
                                          const WorkspaceManifest& child) {
  std::vector<ManifestChange> out;
  size_t i = 0, j = 0;
  const auto& a = parent.entries;
  const auto& b = child.entries;
  while (i < a.size() || j < b.size()) {
    if (j == b.size() || (i < a.size() && a[i].path < b[j].path)) {
      out.push_back({a[i++].path, "deleted"});
    } else if (i == a.size() || b[j].path < a[i].path) {
      out.push_back({b[j++].path, "added"});
    } else {
      const ManifestEntry& x = a[i++];
      const ManifestEntry& y = b[j++];
      bool same = x.type == y.type && x.mode == y.mode && x.target == y.target &&
                  (x.type != ManifestEntry::Type::kFile || x.sha256 == y.sha256);
      if (!same) out.push_back({y.path, "modified"});
    }
  }
  return out;
}

const ManifestEntry* FindEntry(const WorkspaceManifest& m, std::string_view path) {
  auto it = std::lower_bound(m.entries.begin(), m.entries.end(), path,
                             [](const ManifestEntry& e, std::string_view p) { return e.path < p; });
  if (it == m.entries.end() || it->path != path) return nullptr;
  return &*it;
}

namespace {
std::vector<std::string_view> SplitLines(std::string_view s) {
  std::vector<std::string_view> out;
  size_t start = 0;
  while (start < s.size()) {
    size_t nl = s.find('\n', start);
    if (nl == std::string_view::npos) nl = s.size() - 1;
    out.push_back(s.substr(start, nl - start + 1));
    start = nl + 1;
  }
  return out;
}
}  // namespace

std::string UnifiedDiff(std::string_view path, std::string_view before, std::string_view after,
                        size_t max_bytes, bool* truncated) {
  *truncated = false;
  std::vector<std::string_view> x = SplitLines(before), y = SplitLines(after);
  // Common prefix and suffix first; the middle by LCS when small enough, else replaced whole
  // (the diff stays correct, only less minimal).
  size_t pre = 0;
  while (pre < x.size() && pre < y.size() && x[pre] == y[pre]) ++pre;
  size_t suf = 0;
  while (suf < x.size() - pre && suf < y.size() - pre &&
         x[x.size() - 1 - suf] == y[y.size() - 1 - suf])
    ++suf;
  std::vector<std::string_view> mx(x.begin() + pre, x.end() - suf);
  std::vector<std::string_view> my(y.begin() + pre, y.end() - suf);
  std::vector<std::pair<char, std::string_view>> ops;
  if (mx.size() * my.size() <= 1'000'000) {
    std::vector<std::vector<uint32_t>> l(mx.size() + 1, std::vector<uint32_t>(my.size() + 1));
    for (size_t i = mx.size(); i-- > 0;)
      for (size_t j = my.size(); j-- > 0;)
        l[i][j] = mx[i] == my[j] ? l[i + 1][j + 1] + 1 : std::max(l[i + 1][j], l[i][j + 1]);
    size_t i = 0, j = 0;
    while (i < mx.size() || j < my.size()) {
      if (i < mx.size() && j < my.size() && mx[i] == my[j]) {
        ops.push_back({' ', mx[i]});
        ++i, ++j;
      } else if (i < mx.size() && (j == my.size() || l[i + 1][j] >= l[i][j + 1])) {
        ops.push_back({'-', mx[i++]});  // deletions before insertions, as diff(1)
      } else {
        ops.push_back({'+', my[j++]});
      }
    }
  } else {
    for (auto line : mx) ops.push_back({'-', line});
    for (auto line : my) ops.push_back({'+', line});
  }
  std::string out = absl::StrCat("--- a/", AbslView(path), "\n+++ b/", AbslView(path), "\n");
  if (ops.empty()) return out;
  // One hunk around the changed middle with up to 3 lines of context each side.
  const size_t ctx_before = std::min<size_t>(3, pre);
  const size_t ctx_after = std::min<size_t>(3, suf);
  size_t old_count = ctx_before + ctx_after, new_count = ctx_before + ctx_after;
  for (const auto& [op, line] : ops) {
    if (op != '+') ++old_count;
    if (op != '-') ++new_count;
  }
  absl::StrAppend(&out, "@@ -", pre - ctx_before + (old_count ? 1 : 0), ",", old_count, " +",
                  pre - ctx_before + (new_count ? 1 : 0), ",", new_count, " @@\n");
  auto emit = [&](char op, std::string_view line) {
    if (*truncated) return;
    if (out.size() + line.size() + 2 > max_bytes) {
      *truncated = true;
      return;
    }
    out.push_back(op);
    out.append(line);
    if (line.empty() || line.back() != '\n') out.append("\n\\ No newline at end of file\n");
  };
  for (size_t k = pre - ctx_before; k < pre; ++k) emit(' ', x[k]);
  for (const auto& [op, line] : ops) emit(op, line);
  for (size_t k = x.size() - suf; k < x.size() - suf + ctx_after; ++k) emit(' ', x[k]);
  return out;
}

}  // namespace esb

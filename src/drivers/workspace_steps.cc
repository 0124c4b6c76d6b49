#include "drivers/workspace_steps.h"

#include <algorithm>
#include <boost/json.hpp>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/protocol.h"
#include "common/utf8.h"
#include "common/util.h"
#include "drivers/heavy_kernel.h"

namespace esb {
namespace json = boost::json;
namespace {

// The agent's own bounds (src/agent/workspace.cc): 100,000 entries, 6 MiB of manifest JSON,
// 8 MiB of contents per walk.
constexpr int64_t kMaxAgentEntries = 100000;
constexpr int64_t kWalkContentBudget = 8 << 20;
constexpr size_t kMaxChangeKey = 64;
constexpr size_t kMaxTarget = 4095;
// One apply call carries at most this much file data (with its manifest: < 16 MiB).
constexpr size_t kApplyDataBudget = 8 << 20;

absl::Status Bad(std::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("the agent's workspace manifest is invalid: ",
                                                 SanitizeUtf8(why.substr(0, 300))));
}

char TypeChar(ManifestEntry::Type t) {
  return t == ManifestEntry::Type::kDir ? 'd' : t == ManifestEntry::Type::kSymlink ? 'l' : 'f';
}

// Bytes of sandbox files all captures hold at once (each holds at most one file, ≤ one blob).
class HeldBytes {
 public:
  // false when there was no room within `wait`.
  bool Reserve(int64_t n, std::chrono::milliseconds wait) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, wait, [&] { return held_ == 0 || held_ + n <= kMaxCaptureBytesHeld; })
               ? (held_ += n, true)
               : false;
  }
  void Release(int64_t n) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      held_ -= n;
    }
    cv_.notify_all();
  }
  int64_t held() {
    std::lock_guard<std::mutex> lock(mu_);
    return held_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t held_ = 0;
};
HeldBytes& CaptureHeld() {
  static HeldBytes* held = new HeldBytes();
  return *held;
}
constexpr auto kCaptureRoomWait = std::chrono::seconds(10);

// A file over the blob store's per-blob cap: the step keeps no state, and says why.
absl::Status TooLarge(std::string_view path, int64_t max_file) {
  return absl::FailedPreconditionError(
      absl::StrCat("'", SanitizeUtf8(path.substr(0, 300)), "' is larger than the per-file cap of ",
                   max_file, " bytes (files over it are not captured)"));
}

bool Unchanged(const ManifestEntry& now, const ManifestEntry& before) {
  return now.type == ManifestEntry::Type::kFile && before.type == ManifestEntry::Type::kFile &&
         !now.change_key.empty() && now.change_key == before.change_key &&
         now.size == before.size && now.mtime_ns == before.mtime_ns && !before.sha256.empty();
}

}  // namespace

int64_t CaptureBytesHeld() { return CaptureHeld().held(); }

bool ValidWorkspacePath(std::string_view path) {
  if (path.empty() || path.size() > 4095 || path.find('\0') != std::string_view::npos ||
      !IsValidUtf8(path)) {
    return false;
  }
  size_t pos = 0;
  while (pos <= path.size()) {
    size_t slash = path.find('/', pos);
    if (slash == std::string_view::npos) slash = path.size();
    std::string_view c = path.substr(pos, slash - pos);
    if (c.empty() || c == "." || c == ".." || c.size() > 255) return false;
    pos = slash + 1;
  }
  return true;
}

absl::StatusOr<std::vector<WalkedEntry>> ParseAgentWalk(const AgentWalkReply& reply,
                                                        int64_t max_entries) {
  max_entries = std::clamp<int64_t>(max_entries, 0, kMaxAgentEntries);
  // SECURITY: counted before parsing: a row is one array of 8 values, so anything with more
  // containers or separators than max_entries rows can hold is refused unparsed.
  const size_t rows = static_cast<size_t>(max_entries);
  if (!JsonShapeWithin(reply.manifest_json, rows + 1, rows * 9 + 1)) {
    return absl::FailedPreconditionError(
        absl::StrCat("the workspace has more than ", max_entries, " entries"));
  }
  json::parse_options options;
  options.max_depth = 3;
  boost::system::error_code ec;
  json::value v = json::parse(reply.manifest_json, ec, {}, options);
  if (ec || !v.is_array()) return Bad("not a JSON array");
  const json::array& arr = v.as_array();
  if (arr.size() > rows) {
    return absl::FailedPreconditionError(
        absl::StrCat("the workspace has more than ", max_entries, " entries"));
  }
  std::vector<WalkedEntry> out;
  out.reserve(arr.size());
  std::set<std::string, std::less<>> dirs;
  size_t content_at = 0;
  for (const json::value& row_value : arr) {
    const json::array* row = row_value.if_array();
    if (!row || row->size() != 8 || !(*row)[0].is_string() || !(*row)[1].is_string() ||
        !(*row)[2].is_int64() || !(*row)[3].is_int64() || !(*row)[4].is_int64() ||
        !(*row)[5].is_string() || !(*row)[6].is_string() || !(*row)[7].is_int64()) {
      return Bad("an entry is not [path, type, mode, size, mtime_ns, change_key, target, len]");
    }
    WalkedEntry w;
    ManifestEntry& e = w.entry;
    e.path = std::string((*row)[0].as_string());
    if (!ValidWorkspacePath(e.path)) return Bad(absl::StrCat("bad path '", e.path, "'"));
    if (!out.empty() && !(out.back().entry.path < e.path)) {
      return Bad(absl::StrCat("paths not sorted or repeated at '", e.path, "'"));
    }
    // Every entry lies in a listed directory (or the workspace itself).
    if (size_t slash = e.path.rfind('/');
        slash != std::string::npos && !dirs.count(std::string_view(e.path).substr(0, slash))) {
      return Bad(absl::StrCat("'", e.path, "' is not inside a listed directory"));
    }
    const std::string_view type = (*row)[1].as_string();
    if (type == "f") {
      e.type = ManifestEntry::Type::kFile;
    } else if (type == "d") {
      e.type = ManifestEntry::Type::kDir;
      dirs.insert(e.path);
    } else if (type == "l") {
      e.type = ManifestEntry::Type::kSymlink;
    } else {
      return Bad(absl::StrCat("bad type of '", e.path, "'"));
    }
    const int64_t mode = (*row)[2].as_int64();
    if (mode < 0 || mode > 07777) return Bad(absl::StrCat("bad mode of '", e.path, "'"));
    e.mode = static_cast<uint32_t>(mode);
    e.size = (*row)[3].as_int64();
    if (e.size < 0) return Bad(absl::StrCat("negative size of '", e.path, "'"));
    e.mtime_ns = (*row)[4].as_int64();
    const std::string_view key = (*row)[5].as_string();
    if (key.size() > kMaxChangeKey || !IsValidUtf8(key))
      return Bad(absl::StrCat("bad change key of '", e.path, "'"));
    e.change_key = std::string(key);
    const std::string_view target = (*row)[6].as_string();
    if (e.type == ManifestEntry::Type::kSymlink) {
      if (target.empty() || target.size() > kMaxTarget ||
          target.find('\0') != std::string_view::npos) {
        return Bad(absl::StrCat("bad symlink target of '", e.path, "'"));
      }
      e.target = std::string(target);
      e.size = static_cast<int64_t>(target.size());
    } else if (!target.empty()) {
      return Bad(absl::StrCat("a target for '", e.path, "', which is not a symlink"));
    }
    if (e.type == ManifestEntry::Type::kDir) e.size = 0;
    const int64_t len = (*row)[7].as_int64();
    if (len >= 0) {
      // SECURITY: contents must lie inside what was received, in order, each byte once.
      if (e.type != ManifestEntry::Type::kFile ||
          static_cast<uint64_t>(len) > reply.contents.size() - content_at) {
        return Bad(absl::StrCat("contents of '", e.path, "' beyond what was sent"));
      }
      w.has_content = true;
      w.content = std::string_view(reply.contents).substr(content_at, static_cast<size_t>(len));
      content_at += static_cast<size_t>(len);
      e.size = len;  // what was received is the size, whatever the agent claimed
    } else if (len != -1) {
      return Bad(absl::StrCat("bad content length of '", e.path, "'"));
    }
    out.push_back(std::move(w));
  }
  if (content_at != reply.contents.size()) return Bad("more contents than entries claim");
  return out;
}

absl::StatusOr<WorkspaceManifest> CaptureAgentWorkspace(AgentClient& agent, BlobStore& blobs,
                                                        const CaptureOptions& options,
                                                        std::string* base,
                                                        const WorkspaceManifest* known) {
  const int64_t max_files = std::clamp<int64_t>(options.max_files, 0, kMaxAgentEntries);
  const int64_t max_file = std::max<int64_t>(blobs.max_blob_bytes(), 0);
  absl::StatusOr<AgentWalkReply> reply =
      agent.Walk(*base, /*contents=*/true, max_files, kWalkContentBudget);
  if (!reply.ok()) {
    if (absl::IsResourceExhausted(reply.status()) ||
        reply.status().message().find("EFBIG") != std::string_view::npos) {
      return absl::FailedPreconditionError(
          absl::StrCat("the workspace is too large to capture: ", reply.status().message()));
    }
    return reply.status();
  }
  absl::StatusOr<std::vector<WalkedEntry>> walked = ParseAgentWalk(*reply, max_files);
  if (!walked.ok()) return walked.status();
  std::map<std::string_view, const ManifestEntry*> previous;
  if (options.previous) {
    for (const ManifestEntry& p : options.previous->entries) previous.emplace(p.path, &p);
  }
  std::map<std::string_view, const ManifestEntry*> also;
  if (known) {
    for (const ManifestEntry& p : known->entries) also.emplace(p.path, &p);
  }
  WorkspaceManifest out;
  out.entries.reserve(walked->size());
  for (WalkedEntry& w : *walked) {
    ManifestEntry& e = w.entry;
    if (e.type == ManifestEntry::Type::kFile) {
      auto it = previous.find(e.path);
      auto it2 = also.find(e.path);
      if (it != previous.end() && Unchanged(e, *it->second)) {
        e.sha256 = it->second->sha256;
      } else if (it2 != also.end() && Unchanged(e, *it2->second)) {
        e.sha256 = it2->second->sha256;
      } else {
        // Released after the blob is stored (the bytes are held until then).
        int64_t reserved = 0;
        struct Unreserve {
          int64_t& n;
          ~Unreserve() { CaptureHeld().Release(n); }
        } unreserve{reserved};
        std::string fetched;
        std::string_view data = w.content;
        if (w.has_content && static_cast<int64_t>(data.size()) > max_file) {
          return TooLarge(e.path, max_file);
        }
        if (!w.has_content) {
          // Not sent inline (over the walk's budget, or changed against another base): read
          // it, at most one blob and what the byte cap leaves. SECURITY: a file the sandbox
          // says is larger (sparse, growing) is never read; one that grows while it is read,
          // or a Read that never ends, is cut at the cap (what was received counts).
          const int64_t room = std::max<int64_t>(options.max_bytes - out.total_bytes, 0);
          if (e.size > max_file) return TooLarge(e.path, max_file);
          absl::StatusOr<std::string> whole = ReadWholeSandboxFile(
              [&](int64_t offset, int64_t length) -> absl::StatusOr<FileChunk> {
                if (!CaptureHeld().Reserve(length, kCaptureRoomWait)) {
                  return absl::UnavailableError(
                      "esbd is reading too many large files for steps at once");
                }
                reserved += length;
                return agent.Read(e.path, offset, length);
              },
              std::min(room, max_file));
          if (absl::IsResourceExhausted(whole.status())) {
            if (room > max_file) return TooLarge(e.path, max_file);
            return absl::FailedPreconditionError(absl::StrCat(
                "the workspace holds more than ", options.max_bytes, " bytes of files"));
          }
          if (!whole.ok()) return whole.status();
          fetched = std::move(*whole);
          data = fetched;
        }
        absl::StatusOr<std::string> sha = blobs.Put(data);
        if (!sha.ok()) return sha.status();
        e.sha256 = std::move(*sha);
        e.size = static_cast<int64_t>(data.size());
      }
      out.total_bytes += e.size;
      if (out.total_bytes > options.max_bytes) {
        return absl::FailedPreconditionError(
            absl::StrCat("the workspace holds more than ", options.max_bytes, " bytes of files"));
      }
    }
    out.entries.push_back(std::move(e));
  }
  *base = reply->token;
  return out;
}

absl::Status RestoreAgentWorkspace(AgentClient& agent, BlobStore& blobs,
                                   const WorkspaceManifest& target, std::string* base,
                                   WorkspaceManifest* now_known) {
  for (size_t i = 0; i < target.entries.size(); ++i) {
    const ManifestEntry& e = target.entries[i];
    if (!ValidWorkspacePath(e.path) || (i > 0 && !(target.entries[i - 1].path < e.path)) ||
        e.mode > 07777) {
      return absl::InvalidArgumentError(
          absl::StrCat("the step's manifest is invalid at '", SanitizeUtf8(e.path), "'"));
    }
  }
  // What is there now: files untouched since the capture keep their bytes.
  absl::StatusOr<AgentWalkReply> now = agent.Walk("", /*contents=*/false, kMaxAgentEntries, 0);
  std::map<std::string, ManifestEntry> current;
  if (now.ok()) {
    absl::StatusOr<std::vector<WalkedEntry>> walked = ParseAgentWalk(*now, kMaxAgentEntries);
    if (!walked.ok()) return walked.status();
    for (WalkedEntry& w : *walked) current.emplace(w.entry.path, std::move(w.entry));
    // The next capture's base: the files this restore does not rewrite are unchanged since.
    *base = now->token;
  } else if (!absl::IsFailedPrecondition(now.status()) &&
             now.status().message().find("EFBIG") == std::string_view::npos) {
    return now.status();  // too large to list: everything is written
  }

  // The files whose bytes go out, in path order. Their blobs are checked here (a collected
  // one fails the restore before anything is written) but read later, a piece at a time:
  // esbd holds at most one apply call's data (8 MiB) and one piece of a blob, however large
  // the workspace and its files.
  std::vector<const ManifestEntry*> writes;
  for (const ManifestEntry& e : target.entries) {
    if (e.type != ManifestEntry::Type::kFile) continue;
    auto it = current.find(e.path);
    ManifestEntry probe = e;
    probe.sha256 = "-";
    if (it != current.end() && Unchanged(it->second, probe)) continue;
    if (!blobs.Has(e.sha256)) {
      return absl::FailedPreconditionError(
          absl::StrCat("the contents of '", SanitizeUtf8(e.path), "' at this step were collected"));
    }
    writes.push_back(&e);
  }
  // Bytes [offset, offset + n) of a file's blob (verified from its start when offset is 0).
  auto piece = [&](const ManifestEntry& e, int64_t offset,
                   int64_t n) -> absl::StatusOr<std::string> {
    absl::StatusOr<std::string> data = blobs.ReadRange(e.sha256, offset, n);
    if (absl::IsNotFound(data.status())) {
      return absl::FailedPreconditionError(
          absl::StrCat("the contents of '", SanitizeUtf8(e.path), "' at this step were collected"));
    }
    if (!data.ok()) return data.status();
    if (static_cast<int64_t>(data->size()) != n) {
      return absl::DataLossError(
          absl::StrCat("the stored contents of '", SanitizeUtf8(e.path), "' have another size"));
    }
    return data;
  };

  auto row = [](const ManifestEntry& e, int64_t len, int64_t offset) {
    return json::array{e.path,
                       std::string(1, TypeChar(e.type)),
                       static_cast<int64_t>(e.mode),
                       e.size,
                       e.mtime_ns,
                       e.target,
                       len,
                       offset};
  };
  // First call: the whole manifest (prune), with the bytes of every file that fits.
  std::set<const ManifestEntry*> inline_files;
  size_t inline_bytes = 0;
  for (const ManifestEntry* e : writes) {
    if (e->size < 0 || inline_bytes + static_cast<uint64_t>(e->size) > kApplyDataBudget) continue;
    inline_bytes += static_cast<size_t>(e->size);
    inline_files.insert(e);
  }
  std::string data;
  data.reserve(inline_bytes);
  json::array manifest;
  manifest.reserve(target.entries.size());
  for (const ManifestEntry& e : target.entries) {
    if (inline_files.count(&e)) {
      absl::StatusOr<std::string> bytes = piece(e, 0, e.size);
      if (!bytes.ok()) return bytes.status();
      manifest.push_back(row(e, e.size, 0));
      data += *bytes;
    } else {
      manifest.push_back(row(e, -1, 0));
    }
  }
  const bool all_inline = inline_files.size() == writes.size();
  // Afterwards: the files as they are now (new change keys for what was written), bound to
  // the step's blobs, so that the next capture does not read them again.
  auto learn = [&]() -> absl::Status {
    if (!now_known) return absl::OkStatus();
    now_known->entries.clear();
    if (writes.empty()) return absl::OkStatus();  // nothing rewritten: the keys are the step's
    absl::StatusOr<AgentWalkReply> after = agent.Walk("", /*contents=*/false, kMaxAgentEntries, 0);
    if (!after.ok()) return absl::OkStatus();  // only an optimisation
    absl::StatusOr<std::vector<WalkedEntry>> walked = ParseAgentWalk(*after, kMaxAgentEntries);
    if (!walked.ok()) return absl::OkStatus();
    std::map<std::string_view, const ManifestEntry*> wanted;
    for (const ManifestEntry& e : target.entries) wanted.emplace(e.path, &e);
    for (WalkedEntry& w : *walked) {
      auto it = wanted.find(w.entry.path);
      if (it == wanted.end() || w.entry.type != ManifestEntry::Type::kFile ||
          it->second->type != ManifestEntry::Type::kFile || w.entry.size != it->second->size ||
          w.entry.mtime_ns != it->second->mtime_ns) {
        continue;
      }
      w.entry.sha256 = it->second->sha256;
      now_known->entries.push_back(std::move(w.entry));
    }
    *base = after->token;
    return absl::OkStatus();
  };
  {
    absl::Status s = agent.Apply(json::serialize(manifest), data, true, all_inline);
    manifest.clear();
    data.clear();
    data.shrink_to_fit();
    if (!s.ok()) return s;
  }
  if (all_inline) return learn();
  // The rest in chunks, read from the store as they go out, then the manifest again to finish
  // (modes, mtimes, sizes checked).
  json::array chunk_rows;
  std::string chunk_data;
  auto flush = [&]() -> absl::Status {
    if (chunk_rows.empty()) return absl::OkStatus();
    absl::Status s = agent.Apply(json::serialize(chunk_rows), chunk_data, false, false);
    chunk_rows.clear();
    chunk_data.clear();
    return s;
  };
  for (const ManifestEntry* e : writes) {
    if (inline_files.count(e)) continue;
    int64_t offset = 0;
    do {
      const int64_t n = std::min<int64_t>(
          static_cast<int64_t>(kApplyDataBudget - chunk_data.size()), e->size - offset);
      absl::StatusOr<std::string> bytes = piece(*e, offset, n);
      if (!bytes.ok()) return bytes.status();
      chunk_rows.push_back(row(*e, n, offset));
      chunk_data += *bytes;
      offset += n;
      if (chunk_data.size() >= kApplyDataBudget) {
        if (absl::Status s = flush(); !s.ok()) return s;
      }
    } while (offset < e->size);
  }
  if (absl::Status s = flush(); !s.ok()) return s;
  json::array final_rows;
  final_rows.reserve(target.entries.size());
  for (const ManifestEntry& e : target.entries) final_rows.push_back(row(e, -1, 0));
  if (absl::Status s = agent.Apply(json::serialize(final_rows), "", false, true); !s.ok()) return s;
  return learn();
}

}  // namespace esb

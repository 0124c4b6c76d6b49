#include "core/artifact_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>

#include <boost/json.hpp>

#include "absl/strings/str_cat.h"
#include "common/util.h"

namespace esb {
namespace json = boost::json;
namespace {

bool ValidId(std::string_view id) {
  if (id.size() != 28 || id.substr(0, 4) != "art_") return false;
  return std::all_of(id.begin() + 4, id.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

json::object ToJson(const ArtifactMeta& m) {
  return {{"id", m.id},         {"tenant", m.tenant}, {"environment_id", m.environment_id},
          {"kind", m.kind},     {"name", m.name},     {"mime_type", m.mime_type},
          {"title", m.title},   {"size", m.size},     {"step", m.step},
          {"created_ms", m.created_ms}};
}

bool FromJson(const json::value& v, ArtifactMeta* m) {
  if (!v.is_object()) return false;
  const json::object& o = v.as_object();
  auto str = [&](const char* k, std::string* out) {
    const json::value* x = o.if_contains(k);
    if (!x || !x->is_string()) return false;
    *out = std::string(x->as_string());
    return true;
  };
  auto num = [&](const char* k, int64_t* out) {
    const json::value* x = o.if_contains(k);
    if (!x || !x->is_int64()) return false;
    *out = x->as_int64();
    return true;
  };
  return str("id", &m->id) && str("tenant", &m->tenant) &&
         str("environment_id", &m->environment_id) && str("kind", &m->kind) &&
         str("name", &m->name) && str("mime_type", &m->mime_type) && str("title", &m->title) &&
         num("size", &m->size) && num("step", &m->step) && num("created_ms", &m->created_ms);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ArtifactStore>> ArtifactStore::Open(const Options& options) {
  if (options.dir.empty()) return absl::InvalidArgumentError("artifact store: empty directory");
  if (::mkdir(options.dir.c_str(), 0700) != 0 && errno != EEXIST)
    return ErrnoStatus(absl::StrCat("artifact store: mkdir ", options.dir));
  std::unique_ptr<ArtifactStore> store(new ArtifactStore(options));
  DIR* d = ::opendir(options.dir.c_str());
  if (!d) return ErrnoStatus(absl::StrCat("artifact store: opendir ", options.dir));
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) names.emplace_back(e->d_name);
  ::closedir(d);
  const int64_t now = NowUnixMs();
  for (const std::string& name : names) {
    if (name.size() < 5) continue;
    std::string id = name.substr(0, name.rfind('.'));
    std::string ext = name.substr(name.rfind('.') + 1);
    if (!ValidId(id)) continue;
    if (ext == "bin") {
      // An orphan (its .json never written): remove it.
      struct stat st;
      if (::stat(store->PathOf(id, "json").c_str(), &st) != 0)
        ::unlink(store->PathOf(id, "bin").c_str());
      continue;
    }
    if (ext != "json") continue;
    std::string text;
    ArtifactMeta m;
    boost::system::error_code ec;
    struct stat st;
    bool ok = ReadFileToString(store->PathOf(id, "json"), &text).ok();
    json::value v = ok ? json::parse(text, ec) : json::value();
    ok = ok && !ec && FromJson(v, &m) && m.id == id &&
         ::stat(store->PathOf(id, "bin").c_str(), &st) == 0 && st.st_size == m.size &&
         now - m.created_ms < options.ttl_s * 1000;
    if (!ok) {
      ::unlink(store->PathOf(id, "json").c_str());
      ::unlink(store->PathOf(id, "bin").c_str());
      continue;
    }
    store->tenant_bytes_[m.tenant] += m.size;
    store->tenant_count_[m.tenant] += 1;
    store->by_id_[id] = std::move(m);
  }
  std::vector<const ArtifactMeta*> loaded;
  for (const auto& [id, m] : store->by_id_) loaded.push_back(&m);
  std::stable_sort(loaded.begin(), loaded.end(), [](const ArtifactMeta* a, const ArtifactMeta* b) {
    return a->created_ms < b->created_ms;
  });
  for (const ArtifactMeta* m : loaded) store->order_[m->id] = store->next_order_++;
  return store;
}

std::string ArtifactStore::PathOf(const std::string& id, std::string_view ext) const {
  return absl::StrCat(options_.dir, "/", id, ".", AbslView(ext));
}

absl::StatusOr<ArtifactMeta> ArtifactStore::Put(ArtifactMeta meta, std::string_view data) {
  const int64_t size = static_cast<int64_t>(data.size());
  if (size > options_.max_artifact_bytes)
    return absl::ResourceExhaustedError(
        absl::StrCat("artifact '", meta.name, "' is ", size, " bytes; the limit is ",
                     options_.max_artifact_bytes));
  meta.id = absl::StrCat("art_", RandomHex(12));
  meta.size = size;
  meta.created_ms = NowUnixMs();
  // Expired artifacts must not count against the quota, even for a tenant that never reads
  // artifacts back (the read paths sweep too).
  MaybeSweep();
  auto reserve = [&]() -> bool {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t& used = tenant_bytes_[meta.tenant];
    int64_t& count = tenant_count_[meta.tenant];
    if (used + size > options_.max_tenant_bytes || count >= options_.max_tenant_artifacts)
      return false;
    used += size;  // reserved now, so concurrent Puts cannot overshoot together
    ++count;
    return true;
  };
  if (!reserve()) {
    Sweep(meta.created_ms);
    if (!reserve()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "artifact '", meta.name, "' not kept: the tenant's artifacts already use ",
          TenantBytes(meta.tenant), " of ", options_.max_tenant_bytes, " bytes or ",
          options_.max_tenant_artifacts, " artifacts (they expire after ", options_.ttl_s,
          " s)"));
    }
  }
  absl::Status st = WriteStringToFile(PathOf(meta.id, "bin"), data, 0600);
  if (st.ok()) st = WriteStringToFile(PathOf(meta.id, "json"), json::serialize(ToJson(meta)), 0600);
  std::lock_guard<std::mutex> lock(mu_);
  if (!st.ok()) {
    tenant_bytes_[meta.tenant] -= size;
    tenant_count_[meta.tenant] -= 1;
    ::unlink(PathOf(meta.id, "bin").c_str());
    return st;
  }
  by_id_[meta.id] = meta;
  order_[meta.id] = next_order_++;
  return meta;
}

absl::StatusOr<ArtifactMeta> ArtifactStore::Get(const std::string& tenant,
                                                const std::string& environment_id,
                                                const std::string& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end() || it->second.tenant != tenant ||
      it->second.environment_id != environment_id)
    return absl::NotFoundError(
        absl::StrCat("artifact ", id, " not found in environment ", environment_id));
  return it->second;
}

absl::StatusOr<std::string> ArtifactStore::Read(const std::string& tenant,
                                                const std::string& environment_id,
                                                const std::string& id) const {
  auto meta = Get(tenant, environment_id, id);
  if (!meta.ok()) return meta.status();
  std::string data;
  if (absl::Status st = ReadFileToString(PathOf(id, "bin"), &data); !st.ok()) {
    if (absl::IsNotFound(st))  // swept between Get and here
      return absl::NotFoundError(absl::StrCat("artifact ", id, " has expired"));
    return st;
  }
  return data;
}

absl::StatusOr<UniqueFd> ArtifactStore::Open(const std::string& tenant,
                                             const std::string& environment_id,
                                             const std::string& id) const {
  auto meta = Get(tenant, environment_id, id);
  if (!meta.ok()) return meta.status();
  UniqueFd fd(::open(PathOf(id, "bin").c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (!fd) {
    if (errno == ENOENT)  // swept between Get and here
      return absl::NotFoundError(absl::StrCat("artifact ", id, " has expired"));
    return ErrnoStatus(absl::StrCat("open artifact ", id));
  }
  return fd;
}

std::vector<ArtifactMeta> ArtifactStore::List(const std::string& tenant,
                                              const std::string& environment_id) const {
  std::vector<ArtifactMeta> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, m] : by_id_)
    if (m.tenant == tenant && m.environment_id == environment_id) out.push_back(m);
  std::sort(out.begin(), out.end(), [this](const ArtifactMeta& a, const ArtifactMeta& b) {
    return order_.at(a.id) < order_.at(b.id);
  });
  return out;
}

void ArtifactStore::RemoveLocked(const std::string& id) {
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return;
  tenant_bytes_[it->second.tenant] -= it->second.size;
  tenant_count_[it->second.tenant] -= 1;
  ::unlink(PathOf(id, "json").c_str());
  ::unlink(PathOf(id, "bin").c_str());
  by_id_.erase(it);
  order_.erase(id);
}

int ArtifactStore::Sweep(int64_t now_ms) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> expired;
  for (const auto& [id, m] : by_id_)
    if (now_ms - m.created_ms >= options_.ttl_s * 1000) expired.push_back(id);
  for (const std::string& id : expired) RemoveLocked(id);
  return static_cast<int>(expired.size());
}

void ArtifactStore::MaybeSweep() {
  const int64_t now = NowUnixMs();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (now - last_sweep_ms_ < 60'000) return;
    last_sweep_ms_ = now;
  }
  Sweep(now);
}

int64_t ArtifactStore::TenantBytes(const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tenant_bytes_.find(tenant);
  return it == tenant_bytes_.end() ? 0 : it->second;
}

}  // namespace esb

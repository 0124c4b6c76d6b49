#include "core/image_discovery.h"

#include <boost/json.hpp>
#include <filesystem>
#include <optional>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/util.h"

namespace esb {
namespace {

namespace fs = std::filesystem;
namespace json = boost::json;

// Manifests are a few hundred bytes; anything much larger is not ours.
constexpr uintmax_t kMaxManifestBytes = 64 << 10;
// A cache holds a handful of builds; do not read an unbounded directory.
constexpr int kMaxManifests = 1000;

// Parses one manifest; the reason it does not describe a usable build otherwise.
absl::StatusOr<ImageBuild> ReadManifest(const fs::path& path) {
  std::error_code ec;
  uintmax_t size = fs::file_size(path, ec);
  if (ec) return absl::NotFoundError(ec.message());
  if (size > kMaxManifestBytes) return absl::InvalidArgumentError("too large");
  std::string text;
  if (absl::Status st = ReadFileToString(path.string(), &text); !st.ok()) return st;
  json::value v = json::parse(text, ec);
  if (ec || !v.is_object()) return absl::InvalidArgumentError("not a JSON object");
  const json::object& o = v.as_object();
  const json::value* format = o.if_contains("format");
  if (!format || !format->is_int64() || format->as_int64() != 1)
    return absl::InvalidArgumentError("unknown format");
  const json::value* complete = o.if_contains("complete");
  if (!complete || !complete->is_bool() || !complete->as_bool())
    return absl::FailedPreconditionError("incomplete build");
  ImageBuild b;
  b.manifest = path.string();
  if (const json::value* c = o.if_contains("created_unix_ms"); c && c->is_int64())
    b.created_unix_ms = c->as_int64();
  const json::value* art = o.if_contains("artefacts");
  if (!art || !art->is_object()) return absl::InvalidArgumentError("no artefacts");
  for (auto [key, out] : {std::pair<const char*, std::string*>{"rootfs", &b.rootfs},
                          {"python_wasm", &b.python_wasm}}) {
    const json::value* p = art->as_object().if_contains(key);
    if (!p || !p->is_string() || p->as_string().empty() || p->as_string()[0] != '/')
      return absl::FailedPreconditionError(absl::StrCat("no ", key));
    *out = std::string(p->as_string());
    if (!fs::is_directory(*out, ec))
      return absl::FailedPreconditionError(absl::StrCat(key, " ", *out, " is gone"));
  }
  return b;
}

}  // namespace

absl::StatusOr<ImageBuild> FindNewestImageBuild(const std::string& cache_root) {
  fs::path dir = fs::path(cache_root) / "builds";
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) {
    return absl::NotFoundError(absl::StrCat("no image builds in ", dir.string(), " (", ec.message(),
                                            "): run `make images`"));
  }
  std::vector<std::string> skipped;
  std::optional<ImageBuild> best;
  int seen = 0;
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec || ++seen > kMaxManifests) break;
    const fs::path& p = it->path();
    if (p.extension() != ".json" || !it->is_regular_file(ec)) continue;
    auto b = ReadManifest(p);
    if (!b.ok()) {
      if (skipped.size() < 5)
        skipped.push_back(absl::StrCat(p.filename().string(), ": ", b.status().message()));
      continue;
    }
    if (!best || b->created_unix_ms > best->created_unix_ms ||
        (b->created_unix_ms == best->created_unix_ms && b->manifest > best->manifest)) {
      best = std::move(*b);
    }
  }
  if (best) return *best;
  return absl::NotFoundError(
      absl::StrCat("no complete image build in ", dir.string(),
                   skipped.empty() ? "" : absl::StrCat(" (", absl::StrJoin(skipped, "; "), ")"),
                   ": run `make images`"));
}

}  // namespace esb

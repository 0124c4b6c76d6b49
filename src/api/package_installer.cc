#include "api/package_installer.h"

#include <fcntl.h>
#include <unistd.h>

#include <regex>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/util.h"
#include "packages/requirement.h"

namespace esb::api {
namespace json = boost::json;
namespace {

// Wheels are copied into a directory of their own per install (concurrent installs in one
// environment must not delete each other's), removed afterwards.
constexpr char kWheelDirPrefix[] = "/tmp/.esb-wheels-";
constexpr int64_t kCopyChunk = 4 << 20;

// Which requirements the sandbox's Python already satisfies (the image's Debian packages, an
// earlier install). Uses pip's vendored `packaging`, so specifiers and markers are judged
// exactly as pip would. Prints one JSON line: [{"req", "name", "installed", "ok"}].
constexpr std::string_view kProbe = R"PY(
import json, sys, importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
out = []
for text in sys.argv[1:]:
    r = Requirement(text)
    if r.marker is not None and not r.marker.evaluate():
        out.append({"req": text, "name": r.name, "installed": None, "ok": True})
        continue
    try:
        v = md.version(r.name)
    except md.PackageNotFoundError:
        out.append({"req": text, "name": r.name, "installed": None, "ok": False})
        continue
    out.append({"req": text, "name": r.name, "installed": v,
                "ok": r.specifier.contains(v, prereleases=True)})
print(json.dumps(out))
)PY";

std::string Tail(const std::string& text, int lines) {
  size_t pos = text.size();
  for (int i = 0; i < lines && pos > 0; ++i) {
    pos = text.rfind('\n', pos - 1);
    if (pos == std::string::npos) return text;
  }
  return text.substr(pos + 1);
}

}  // namespace

absl::Status PackageInstaller::Validate(const std::vector<std::string>& requirements) const {
  if (static_cast<int>(requirements.size()) > options_.max_packages)
    return absl::InvalidArgumentError(absl::StrCat("'packages' lists ", requirements.size(),
                                                   " requirements; the limit is ",
                                                   options_.max_packages));
  for (size_t i = 0; i < requirements.size(); ++i) {
    auto r = packages::ParseRequirement(requirements[i]);
    if (!r.ok())
      return absl::InvalidArgumentError(
          absl::StrCat("packages[", i, "]: ", r.status().message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<json::array> PackageInstaller::Install(const std::string& tenant,
                                                      const std::string& env_id,
                                                      const std::vector<std::string>& requirements,
                                                      const OutputSink& progress) {
  if (absl::Status st = Validate(requirements); !st.ok()) return st;
  const int64_t deadline = MonotonicMs() + options_.timeout_ms;
  auto remaining = [&]() { return std::max<int64_t>(1000, deadline - MonotonicMs()); };
  auto say = [&](std::string_view line) {
    if (progress) progress(Stream::kStderr, absl::StrCat(AbslView(line), "\n"));
  };
  std::vector<std::string> quoted;
  for (const std::string& r : requirements) quoted.push_back(ShellQuote(r));

  // 1. What the sandbox already has.
  ExecRequest probe;
  probe.command =
      absl::StrCat("python3 -c ", ShellQuote(kProbe), " ", absl::StrJoin(quoted, " "));
  probe.timeout = std::chrono::milliseconds(std::min<int64_t>(remaining(), 60'000));
  auto pr = manager_->Exec(tenant, env_id, probe, nullptr);
  if (!pr.ok()) return pr.status();
  boost::system::error_code ec;
  json::value probed = json::parse(pr->stdout_data, ec);
  if (ec || pr->exit_code != 0 || !probed.is_array())
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot check the sandbox's installed packages (is python3-pip in the image?): ",
        Tail(pr->stderr_data, 5)));
  json::array result;
  std::vector<std::string> missing;
  for (const json::value& v : probed.as_array()) {
    if (!v.is_object()) continue;
    const json::object& o = v.as_object();
    const json::value* ok = o.if_contains("ok");
    const json::value* installed = o.if_contains("installed");
    if (ok && ok->is_bool() && ok->as_bool()) {
      if (installed && installed->is_string())
        result.push_back(json::object{{"name", o.at("name")},
                                      {"version", *installed},
                                      {"preinstalled", true}});
    } else if (const json::value* req = o.if_contains("req"); req && req->is_string()) {
      missing.emplace_back(req->as_string());
    }
  }
  if (missing.empty()) return result;
  if (cache_ == nullptr)
    return absl::FailedPreconditionError(absl::StrCat(
        "not in the sandbox image: ", absl::StrJoin(missing, ", "),
        "; installing packages needs a package index, and this daemon has none configured "
        "(set packages.index_url in the esbd config)"));

  // 2. Fetch (host cache or index), copy into the sandbox, let pip resolve; repeat for each
  //    dependency pip reports missing.
  const std::string wheel_dir = absl::StrCat(kWheelDirPrefix, RandomHex(6));
  std::set<std::string> copied;  // file names already in wheel_dir
  auto provide = [&](const packages::Requirement& req) -> absl::StatusOr<bool> {
    auto wheel = cache_->Fetch(req);
    if (!wheel.ok()) return wheel.status();
    if (copied.count(wheel->filename)) return false;  // no progress: pip already had it
    if (!wheel->from_cache && audit_) audit_(tenant, env_id, *wheel);
    say(absl::StrCat("esb: ", wheel->name, " ", wheel->version,
                     wheel->from_cache ? (wheel->offline ? " (host cache; index unreachable)"
                                                         : " (host cache)")
                                       : " (downloaded from the package index)"));
    UniqueFd fd(::open(wheel->path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) return ErrnoStatus(absl::StrCat("open cached wheel ", wheel->path));
    const std::string dest = absl::StrCat(wheel_dir, "/", wheel->filename);
    std::string buf(kCopyChunk, '\0');
    int64_t offset = 0;
    for (;;) {
      ssize_t n = ::read(fd.get(), buf.data(), buf.size());
      if (n < 0) return ErrnoStatus(absl::StrCat("read cached wheel ", wheel->path));
      if (n == 0 && offset > 0) break;
      if (absl::Status st = manager_->WriteFile(tenant, env_id, dest,
                                                std::string_view(buf.data(), n), offset,
                                                offset == 0);
          !st.ok())
        return st;
      offset += n;
      if (n == 0) break;
    }
    copied.insert(wheel->filename);
    result.push_back(json::object{{"name", wheel->name},
                                  {"version", wheel->version},
                                  {"from_cache", wheel->from_cache}});
    return true;
  };
  auto cleanup = [&]() {
    ExecRequest rm;
    rm.command = absl::StrCat("rm -rf ", wheel_dir);
    rm.timeout = std::chrono::milliseconds(10'000);
    manager_->Exec(tenant, env_id, rm, nullptr).IgnoreError();
  };
  absl::Status failure;
  for (const std::string& text : missing) {
    auto req = packages::ParseRequirement(text);
    if (!req.ok()) return req.status();
    if (auto st = provide(*req); !st.ok()) {
      failure = st.status();
      break;
    }
  }
  static const std::regex kMissing(R"(No matching distribution found for ([^\r\n]+))");
  for (int round = 0; failure.ok(); ++round) {
    if (round >= options_.max_rounds) {
      failure = absl::ResourceExhaustedError(absl::StrCat(
          "pip still reported missing dependencies after ", options_.max_rounds, " rounds"));
      break;
    }
    if (MonotonicMs() >= deadline) {
      failure = absl::DeadlineExceededError(absl::StrCat(
          "installing packages took longer than ", options_.timeout_ms / 1000, " s"));
      break;
    }
    ExecRequest pip;
    pip.command = absl::StrCat(
        "python3 -m pip install --user --no-index --find-links ", wheel_dir,
        " --no-cache-dir --disable-pip-version-check --no-warn-script-location --no-input"
        " --progress-bar off ",
        absl::StrJoin(quoted, " "));
    pip.timeout = std::chrono::milliseconds(remaining());
    pip.max_output_bytes = 1 << 20;
    auto r = manager_->Exec(tenant, env_id, pip, progress);
    if (!r.ok()) {
      failure = r.status();
      break;
    }
    if (r->exit_code == 0) break;
    const std::string output = r->stdout_data + r->stderr_data;
    std::smatch m;
    if (r->timed_out || !std::regex_search(output, m, kMissing)) {
      failure = absl::FailedPreconditionError(
          absl::StrCat("pip install failed (exit ", r->exit_code, r->timed_out ? ", timed out" : "",
                       "):\n", Tail(output, 15)));
      break;
    }
    std::string dep = m[1];
    while (!dep.empty() && (dep.back() == ' ' || dep.back() == '.')) dep.pop_back();
    auto req = packages::ParseRequirement(dep);
    if (!req.ok()) {
      failure = absl::FailedPreconditionError(
          absl::StrCat("pip needs '", dep, "', which esbd cannot fetch: ",
                       req.status().message()));
      break;
    }
    auto progressed = provide(*req);
    if (!progressed.ok()) {
      failure = progressed.status();
      break;
    }
    if (!*progressed) {
      failure = absl::FailedPreconditionError(absl::StrCat(
          "pip cannot satisfy '", dep, "' with the wheels the index offers:\n", Tail(output, 15)));
      break;
    }
  }
  cleanup();
  if (!failure.ok()) return failure;
  return result;
}

}  // namespace esb::api

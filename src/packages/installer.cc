#include "packages/installer.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/util.h"
#include "packages/requirement.h"
#include "packages/url.h"

namespace esb::packages {
namespace {

// Wheels are copied into a directory of their own per install (concurrent installs in one
// environment must not delete each other's), removed afterwards.
constexpr char kWheelDirPrefix[] = "/tmp/.esb-wheels-";
constexpr int64_t kCopyChunk = 4 << 20;
// Sandbox output quoted in error messages at most (pip's output can be a megabyte of one line).
constexpr size_t kMaxQuotedOutput = 4000;

// Which requirements the sandbox's Python already satisfies (the image's Debian packages, an
// earlier install). Uses pip's vendored `packaging`, so specifiers and markers are judged
// exactly as pip would. Prints one JSON array with one entry per argument, in order (the
// format ParseProbeAnswer reads): {"skip": true} when the marker is false here,
// {"installed": version-or-null, "ok": bool}, or {"error": why} for a requirement `packaging`
// rejects — per entry, so one bad entry is reported as such instead of failing the whole probe.
// Extras are not checked here: the host sends a requirement with extras through pip.
constexpr std::string_view kProbe = R"PY(
import json, sys, importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
out = []
for text in sys.argv[1:]:
    try:
        r = Requirement(text)
        # "extra" only has a value inside a distribution's own metadata; older packaging
        # raises when it is undefined, newer treats it as "".
        if r.marker is not None and not r.marker.evaluate({"extra": ""}):
            out.append({"skip": True})
            continue
        try:
            v = md.version(r.name)
        except md.PackageNotFoundError:
            out.append({"installed": None, "ok": False})
            continue
        try:
            ok = bool(r.specifier.contains(v, prereleases=True))
        except Exception:
            ok = False  # a version packaging cannot parse: let pip decide
        out.append({"installed": v, "ok": ok})
    except Exception as e:
        out.append({"error": "%s: %s" % (type(e).__name__, e)})
print(json.dumps(out))
)PY";

// The last `lines` lines of `text`, and at most kMaxQuotedOutput bytes of them.
std::string Tail(std::string_view text, int lines) {
  if (text.size() > kMaxQuotedOutput) text = text.substr(text.size() - kMaxQuotedOutput);
  size_t pos = text.size();
  for (int i = 0; i < lines && pos > 0; ++i) {
    pos = text.rfind('\n', pos - 1);
    if (pos == std::string_view::npos) return std::string(text);
  }
  return std::string(text.substr(pos + 1));
}

// Runs `fn` when the scope ends, on every return path.
class ScopeExit {
 public:
  explicit ScopeExit(std::function<void()> fn) : fn_(std::move(fn)) {}
  ~ScopeExit() { fn_(); }
  ScopeExit(const ScopeExit&) = delete;
  ScopeExit& operator=(const ScopeExit&) = delete;

 private:
  std::function<void()> fn_;
};

}  // namespace

absl::Status PackageInstaller::Validate(const std::vector<std::string>& requirements) const {
  if (static_cast<int>(requirements.size()) > options_.max_packages)
    return absl::InvalidArgumentError(absl::StrCat("'packages' lists ", requirements.size(),
                                                   " requirements; the limit is ",
                                                   options_.max_packages));
  for (size_t i = 0; i < requirements.size(); ++i) {
    auto r = ParseRequirement(requirements[i]);
    if (!r.ok())
      return absl::InvalidArgumentError(absl::StrCat("packages[", i, "]: ", r.status().message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<InstalledPackage>> PackageInstaller::Install(
    const Caller& caller, const std::string& env_id, const std::vector<std::string>& requirements,
    const OutputSink& progress) {
  // pip's probes, copies and runs are steps of the one audited action that asked for the
  // packages (a run); each wheel fetched over the network is audited on its own.
  const Caller step = caller.Step();
  if (absl::Status st = Validate(requirements); !st.ok()) return st;
  std::vector<Requirement> parsed;
  for (const std::string& text : requirements) {
    auto r = ParseRequirement(text);
    if (!r.ok()) return r.status();  // Validate said it was fine
    parsed.push_back(std::move(*r));
  }
  const int64_t deadline = MonotonicMs() + options_.timeout_ms;
  // The same deadline for the host-side fetches (each also capped by the cache's http_timeout).
  const auto fetch_deadline =
      WheelCache::Clock::now() + std::chrono::milliseconds(options_.timeout_ms);
  auto remaining = [&]() { return std::max<int64_t>(1000, deadline - MonotonicMs()); };
  auto out_of_time = [&]() -> absl::Status {
    if (MonotonicMs() < deadline) return absl::OkStatus();
    return absl::DeadlineExceededError(
        absl::StrCat("installing packages took longer than ", options_.timeout_ms / 1000, " s"));
  };
  auto say = [&](std::string_view line) {
    if (progress) progress(Stream::kStderr, absl::StrCat(AbslView(line), "\n"));
  };
  std::vector<std::string> quoted;
  for (const std::string& r : requirements) quoted.push_back(ShellQuote(r));

  // 1. What the sandbox already has. Everything the probe prints is the sandbox's to forge:
  //    its entries are matched to our own requirements by position and only tell, for each,
  //    whether pip needs to act; names, counts and requirement texts stay ours.
  ExecRequest probe;
  probe.command = absl::StrCat("python3 -c ", ShellQuote(kProbe), " ", absl::StrJoin(quoted, " "));
  probe.timeout = std::chrono::milliseconds(std::min<int64_t>(remaining(), 60'000));
  auto pr = manager_->Exec(step, env_id, probe, nullptr);
  if (!pr.ok()) return pr.status();
  if (pr->exit_code != 0 || pr->timed_out)
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot check the sandbox's installed packages (is python3-pip in the image?): ",
        pr->timed_out ? "timed out; " : "", Tail(pr->stderr_data, 5)));
  auto probed = ParseProbeAnswer(pr->stdout_data, requirements.size());
  if (!probed.ok())
    return absl::FailedPreconditionError(
        absl::StrCat(probed.status().message(), "; stderr: ", Tail(pr->stderr_data, 5)));
  std::vector<InstalledPackage> result;
  std::vector<size_t> to_fetch;  // indices into `parsed` whose distribution is missing
  bool need_pip = false;
  for (size_t i = 0; i < parsed.size(); ++i) {
    const ProbeEntry& e = (*probed)[i];
    const Requirement& req = parsed[i];
    switch (e.kind) {
      case ProbeEntry::Kind::kInvalid:
        return absl::InvalidArgumentError(
            absl::StrCat("packages[", i, "] '", Printable(req.display, 100),
                         "': the sandbox's Python rejects the requirement: ", e.error));
      case ProbeEntry::Kind::kSkip:
        break;
      case ProbeEntry::Kind::kSatisfied:
        result.push_back(
            InstalledPackage{.name = req.name, .version = e.installed, .preinstalled = true});
        // The base distribution is there, but its extras' dependencies may not be: pip
        // decides, asking for what it lacks like for any dependency.
        if (!req.extras.empty()) need_pip = true;
        break;
      case ProbeEntry::Kind::kMissing:
        to_fetch.push_back(i);
        need_pip = true;
        break;
    }
  }
  if (!need_pip) return result;
  if (cache_ == nullptr && !to_fetch.empty()) {
    std::vector<std::string> names;
    for (size_t i : to_fetch) names.push_back(parsed[i].display);
    return absl::FailedPreconditionError(absl::StrCat(
        "not in the sandbox image: ", absl::StrJoin(names, ", "),
        "; installing packages needs a package index, and this daemon has none configured "
        "(set packages.index_url in the esbd config)"));
  }

  // A governed environment's fetches are its egress: through its proxy (policy, DLP, audit),
  // and a cache hit only if its policy allows the file's host now. Never a direct fetch.
  std::optional<WheelCache::Egress> egress;
  if (cache_ != nullptr) {
    auto governed = manager_->HostFetchEgressFor(caller, env_id);
    if (!governed.ok()) return governed.status();
    if (governed->has_value()) {
      auto route = std::make_shared<ProxyRoute>();
      route->connect = (*governed)->connect;
      route->ca_pem = (*governed)->ca_cert_pem;
      egress = WheelCache::Egress{
          std::move(route), [check = (*governed)->check](const std::string& url) -> absl::Status {
            auto u = ParseUrl(url);
            if (!u.ok())
              return absl::PermissionDeniedError(absl::StrCat(
                  "refusing a cached file of unknown origin (", u.status().message(), ")"));
            uint32_t port = 0;
            if (!absl::SimpleAtoi(u->port, &port) || port == 0 || port > 65535)
              return absl::PermissionDeniedError("refusing a cached file with a bad port");
            return check(u->scheme, u->host, static_cast<uint16_t>(port), u->target);
          }};
    }
  }

  // 2. Fetch (host cache or index), copy into the sandbox, let pip resolve; repeat for each
  //    dependency pip reports missing.
  const std::string wheel_dir = absl::StrCat(kWheelDirPrefix, RandomHex(6));
  bool wrote = false;  // wheel_dir may exist in the sandbox
  ScopeExit cleanup([&] {
    if (!wrote) return;
    ExecRequest rm;
    rm.command = absl::StrCat("rm -rf ", wheel_dir);
    rm.timeout = std::chrono::milliseconds(10'000);
    manager_->Exec(step, env_id, rm, nullptr).IgnoreError();
  });
  std::set<std::string> copied;  // file names already in wheel_dir
  auto provide = [&](const Requirement& req) -> absl::StatusOr<bool> {
    if (cache_ == nullptr)
      return absl::FailedPreconditionError(absl::StrCat(
          "pip needs '", Printable(req.display, 200),
          "', which is not in the sandbox image; installing packages needs a package index, "
          "and this daemon has none configured (set packages.index_url in the esbd config)"));
    if (absl::Status st = out_of_time(); !st.ok()) return st;
    // `wheel` holds a lease on the cached file until the copy below is done.
    auto wheel = cache_->Fetch(req, fetch_deadline, egress ? &*egress : nullptr);
    if (!wheel.ok()) return wheel.status();
    if (copied.count(wheel->filename)) return false;  // no progress: pip already had it
    if (!wheel->from_cache) {
      // Egress on the sandbox's behalf: its own row, even inside an operation audited whole.
      Caller fetcher = caller;
      fetcher.audited = true;
      manager_->audit().Record(
          fetcher, {.environment_id = env_id,
                    .action = "package.fetch",
                    .detail = absl::StrCat(wheel->name, "==", wheel->version, " ", wheel->filename),
                    .bytes = wheel->size});
    }
    say(absl::StrCat("esb: ", wheel->name, " ", wheel->version,
                     wheel->from_cache
                         ? (wheel->offline ? " (host cache; index unreachable)" : " (host cache)")
                     : egress ? " (downloaded through the environment's egress proxy)"
                              : " (downloaded from the package index)"));
    UniqueFd fd(::open(wheel->path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) return ErrnoStatus(absl::StrCat("open cached wheel ", wheel->path));
    const std::string dest = absl::StrCat(wheel_dir, "/", wheel->filename);
    std::string buf(kCopyChunk, '\0');
    int64_t offset = 0;
    for (;;) {
      if (absl::Status st = out_of_time(); !st.ok()) return st;
      ssize_t n = ::read(fd.get(), buf.data(), buf.size());
      if (n < 0) return ErrnoStatus(absl::StrCat("read cached wheel ", wheel->path));
      if (n == 0 && offset > 0) break;
      wrote = true;
      if (absl::Status st = manager_->WriteFile(step, env_id, dest, std::string_view(buf.data(), n),
                                                offset, offset == 0);
          !st.ok())
        return st;
      offset += n;
      if (n == 0) break;
    }
    copied.insert(wheel->filename);
    result.push_back(InstalledPackage{
        .name = wheel->name, .version = wheel->version, .from_cache = wheel->from_cache});
    return true;
  };
  for (size_t i : to_fetch) {
    if (auto st = provide(parsed[i]); !st.ok()) return st.status();
  }
  for (int round = 0;; ++round) {
    if (round >= options_.max_rounds)
      return absl::FailedPreconditionError(absl::StrCat(
          "pip still reported missing dependencies after ", options_.max_rounds,
          " rounds (one dependency is fetched per round; the limit is ", options_.max_rounds, ")"));
    if (absl::Status st = out_of_time(); !st.ok()) return st;
    ExecRequest pip;
    pip.command = absl::StrCat(
        "python3 -m pip install --user --no-index --find-links ", wheel_dir,
        " --no-cache-dir --disable-pip-version-check --no-warn-script-location --no-input"
        " --progress-bar off ",
        absl::StrJoin(quoted, " "));
    pip.timeout = std::chrono::milliseconds(remaining());
    pip.max_output_bytes = 1 << 20;
    auto r = manager_->Exec(step, env_id, pip, progress);
    if (!r.ok()) return r.status();
    if (r->exit_code == 0) break;
    const std::string output = r->stdout_data + r->stderr_data;
    // Plain string search: pip's output is the sandbox's, a megabyte on one line if it likes
    // (std::regex recursed once per character there and overflowed the stack).
    std::optional<std::string_view> dep =
        r->timed_out ? std::nullopt : FindMissingDistribution(output);
    if (!dep)
      return absl::FailedPreconditionError(absl::StrCat("pip install failed (exit ", r->exit_code,
                                                        r->timed_out ? ", timed out" : "", "):\n",
                                                        Tail(output, 15)));
    if (dep->size() > kMaxRequirementLength)
      return absl::FailedPreconditionError(
          absl::StrCat("pip reported a missing dependency of ", dep->size(), " characters ('",
                       Printable(*dep, 100), "'); esbd fetches requirements of at most ",
                       kMaxRequirementLength));
    auto req = ParseRequirement(*dep);
    if (!req.ok())
      return absl::FailedPreconditionError(
          absl::StrCat("pip needs '", Printable(*dep, 200),
                       "', which esbd cannot fetch: ", req.status().message()));
    auto progressed = provide(*req);
    if (!progressed.ok()) return progressed.status();
    if (!*progressed)
      return absl::FailedPreconditionError(
          absl::StrCat("pip cannot satisfy '", Printable(*dep, 200),
                       "' with the wheels the index offers:\n", Tail(output, 15)));
  }
  return result;
}

}  // namespace esb::packages

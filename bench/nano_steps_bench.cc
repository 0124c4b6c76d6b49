// Time travel on the nano tier (issue 13; `bash bench/run.sh nano-steps`): what a step pays for
// its capture, rewind and fork latency and the bytes kept per step, through NanoDriver directly
// (no daemon). Baselines are measured in the same run, interleaved with the measured rows.
//   nano_steps_bench <esb-nano-worker> <python-wasm artefact dir> [steps=40]
// The session holds a 100,000-entry dict (~20 MB of guest heap) and 50 files; each step
// changes one dict entry and rewrites one 4 KiB file (the typical small agent step).
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <string>
#include <vector>

#include "drivers/heavy_kernel.h"
#include "drivers/nano/nano_driver.h"
#include "drivers/testing/memory_blob_store.h"

namespace {

double NowMs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

struct Stat {
  std::vector<double> v;
  double P(double q) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
  }
};

void Row(const char* name, Stat& s, const std::string& ratio = "") {
  size_t n = s.v.size();
  double p50 = s.P(0.5), p99 = s.P(0.99);
  printf("| %-46s | %5zu | %9.2f | %9.2f | %-24s |\n", name, n, p50, p99, ratio.c_str());
}

[[noreturn]] void Die(const std::string& what) {
  fprintf(stderr, "nano_steps_bench: %s\n", what.c_str());
  exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) Die("usage: nano_steps_bench <esb-nano-worker> <python-wasm dir> [steps]");
  int steps = argc > 3 ? std::max(5, atoi(argv[3])) : 40;
  absl::StatusOr<esb::NanoDriverOptions> o = esb::PythonNanoOptions(argv[1], argv[2]);
  if (!o.ok()) Die(o.status().ToString());
  char dir[] = "/tmp/esb-nano-steps-bench-XXXXXX";
  if (mkdtemp(dir) == nullptr) Die("mkdtemp");
  o->snapshot_dir = std::string(dir) + "/images";
  o->cgroup_name = "";
  auto driver = esb::NewNanoDriver(*o);
  esb::testing::MemoryBlobStore blobs;
  absl::StatusOr<esb::InstanceRef> ref = driver->Create("bench_steps", esb::EnvSpec{});
  if (!ref.ok()) Die(ref.status().ToString());
  auto run = [&](const std::string& code) {
    esb::RunRequest r;
    r.code = code;
    absl::StatusOr<esb::RunResult> res = driver->RunCode(&*ref, r, nullptr);
    if (!res.ok() || res->exit_code != 0) {
      Die("run failed: " + (res.ok() ? res->stderr_data : res.status().ToString()));
    }
  };
  run("data = {i: str(i) * 3 for i in range(100000)}\nn = 0\n"
      "for i in range(50): open(f'f{i}.txt', 'w').write('x' * 4096)\n");
  const std::string step =
      "n += 1\ndata[n] = 'changed'\nopen(f'f{n % 50}.txt', 'w').write(str(n) * 1024)\n";
  esb::CaptureOptions copts;
  std::vector<esb::StepState> kept;
  Stat plain, with_capture, capture_only, rewind, fork, compact, restore_compact, vars_ms;
  // Warm-up: a few steps of each kind.
  for (int i = 0; i < 3; i++) run(step);
  for (int i = 0; i < steps; i++) {
    double t0 = NowMs();
    run(step);
    plain.v.push_back(NowMs() - t0);
    t0 = NowMs();
    run(step);
    double t1 = NowMs();
    copts.previous = kept.empty() ? nullptr : &kept.back().workspace;
    absl::StatusOr<esb::StepState> s = driver->CaptureStep(*ref, copts, blobs);
    double t2 = NowMs();
    if (!s.ok()) Die(s.status().ToString());
    with_capture.v.push_back(t2 - t0);
    capture_only.v.push_back(t2 - t1);
    kept.push_back(std::move(*s));
  }
  bool have_vars = !kept.back().variables_json.empty();
  // Where the summary's time goes: the same summary timed inside the guest (in a fork).
  std::string inside;
  if (have_vars) {
    absl::StatusOr<esb::InstanceRef> probe = driver->Fork(*ref, "bench_probe");
    if (!probe.ok()) Die(probe.status().ToString());
    std::string hex;
    for (unsigned char c : std::string(esb::EsbVarsSource())) {
      static const char kHex[] = "0123456789abcdef";
      hex.push_back(kHex[c >> 4]);
      hex.push_back(kHex[c & 15]);
    }
    esb::RunRequest r;
    r.code = "import time, marshal\nt0 = time.perf_counter()\ncode = compile(bytes.fromhex('" +
             hex +
             "').decode(), 'esb_vars.py', 'exec')\nt1 = time.perf_counter()\nns = {}\n"
             "exec(code, ns)\nt2 = time.perf_counter()\nj = ns['summarize'](dict(globals()))\n"
             "t3 = time.perf_counter()\nprint(f'compile {(t1-t0)*1e3:.2f} ms, module exec "
             "{(t2-t1)*1e3:.2f} ms, summarize {(t3-t2)*1e3:.2f} ms, {len(j)} bytes of JSON')\n";
    absl::StatusOr<esb::RunResult> res = driver->RunCode(&*probe, r, nullptr);
    inside = res.ok() ? res->stdout_data + res->stderr_data + "\n" : res.status().ToString() + "\n";
    (void)driver->Destroy(*probe);
  }
  // Capture without the variables summary (what the summary itself costs).
  for (int i = 0; i < std::min(steps, 20); i++) {
    esb::CaptureOptions nv = copts;
    nv.variables = false;
    nv.previous = &kept.back().workspace;
    double t0 = NowMs();
    absl::StatusOr<esb::StepState> s = driver->CaptureStep(*ref, nv, blobs);
    vars_ms.v.push_back(NowMs() - t0);
    if (!s.ok()) Die(s.status().ToString());
    (void)driver->DeleteSnapshot(*s->memory);
  }
  // Bytes kept: the live clones' PSS now (after `steps` more steps dirtied pages), vs at capture.
  int64_t pss_at_capture = 0, pss_now = 0;
  const double measure_t0 = NowMs();
  for (const esb::StepState& s : kept) {
    pss_at_capture += s.memory->bytes;
    absl::StatusOr<int> pid = driver->SessionPid({s.memory->id, "nano", ""});
    std::string text;
    if (pid.ok()) {
      FILE* f = fopen(("/proc/" + std::to_string(*pid) + "/smaps_rollup").c_str(), "r");
      char line[256];
      while (f && fgets(line, sizeof line, f)) {
        if (strncmp(line, "Private_Dirty:", 14) == 0) pss_now += atoll(line + 14) * 1024;
      }
      if (f) fclose(f);
    }
  }
  // What the driver's live-memory accounting costs a capture: one smaps_rollup per live clone
  // of the environment (this loop reads the same file for every kept clone).
  const double measure_ms = NowMs() - measure_t0;
  const int64_t charged = driver->LiveSnapshotBytes("bench_steps");
  // Rewind and fork latency from live steps.
  for (int i = 0; i < steps; i++) {
    const esb::StepState& s = kept[static_cast<size_t>(i) % kept.size()];
    double t0 = NowMs();
    absl::StatusOr<esb::InstanceRef> back = driver->RestoreStep(*ref, s, blobs);
    rewind.v.push_back(NowMs() - t0);
    if (!back.ok()) Die(back.status().ToString());
    t0 = NowMs();
    absl::StatusOr<esb::InstanceRef> f = driver->ForkStep(s, esb::EnvSpec{}, "bench_fork", blobs);
    fork.v.push_back(NowMs() - t0);
    if (!f.ok()) Die(f.status().ToString());
    (void)driver->Destroy(*f);
  }
  // Compact the older half; restore from the images.
  int64_t image_bytes = 0;
  int compacted = 0;
  for (size_t i = 0; i < kept.size() / 2; i++) {
    double t0 = NowMs();
    absl::StatusOr<esb::SnapshotRef> c = driver->CompactSnapshot(*kept[i].memory);
    compact.v.push_back(NowMs() - t0);
    if (!c.ok()) Die(c.status().ToString());
    kept[i].memory = *c;
    image_bytes += c->bytes;
    compacted++;
  }
  for (int i = 0; i < compacted; i++) {
    double t0 = NowMs();
    absl::StatusOr<esb::InstanceRef> back = driver->RestoreStep(*ref, kept[i], blobs);
    restore_compact.v.push_back(NowMs() - t0);
    if (!back.ok()) Die(back.status().ToString());
  }
  printf("| %-46s | %5s | %9s | %9s | %-24s |\n", "nano time travel (ms)", "n", "p50", "p99",
         "ratio (p50)");
  printf("|%s|%s|%s|%s|%s|\n", std::string(48, '-').c_str(), std::string(7, '-').c_str(),
         std::string(11, '-').c_str(), std::string(11, '-').c_str(), std::string(26, '-').c_str());
  char ratio[64];
  snprintf(ratio, sizeof ratio, "%.2fx the plain step", with_capture.P(0.5) / plain.P(0.5));
  Row("step + capture (memory, files, variables)", with_capture, ratio);
  Row("baseline: the same step, capture off", plain);
  Row("capture alone", capture_only);
  Row("capture alone, variables summary off", vars_ms);
  Row("rewind in place to a live step", rewind);
  Row("fork a live step (new session)", fork);
  Row("compact a live step to an image", compact);
  Row("rewind in place to a compacted step", restore_compact);
  printf("\nvariables summary: %s\n",
         have_vars ? "captured (esb_vars.py embedded)" : "not captured (esb_vars.py not embedded)");
  if (!inside.empty()) printf("variables summary timed inside the guest: %s", inside.c_str());
  printf(
      "bytes kept per live step: %.2f MiB PSS at capture (shared with the session), "
      "%.2f MiB private after %d more steps (n=%zu)\n",
      pss_at_capture / 1048576.0 / kept.size(), pss_now / 1048576.0 / kept.size(), steps,
      kept.size());
  printf(
      "live-memory accounting: %.2f MiB charged to the environment for %zu live clones (PSS, "
      "re-measured at each capture: %.2f ms for all of them)\n",
      charged / 1048576.0, kept.size(), measure_ms);
  printf("bytes kept per compacted step: %.2f MiB image (page diff vs base + MemFs; n=%d)\n",
         compacted ? image_bytes / 1048576.0 / compacted : 0.0, compacted);
  printf("blobs: %zu distinct file contents for %zu steps (unchanged files not re-read)\n",
         blobs.size(), kept.size());
  for (const esb::StepState& s : kept) (void)driver->DeleteSnapshot(*s.memory);
  (void)driver->Destroy(*ref);
  std::filesystem::remove_all(dir);
  return 0;
}

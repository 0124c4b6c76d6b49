// Time travel on gVisor (issue 13): what a step's memory snapshot costs (a `runsc checkpoint`
// of the sandbox plus the restore that lets it run on), against the same step captured with
// files only and against the step itself, and rewind / fork latency from a step's image; same
// run, through the container driver (root, runsc installed). The sandbox runs the image's
// Python kernel with a small namespace and a background process, like an agent's session.
//   gvisor_step_bench IMAGE_ROOTFS [--steps 8] [--files 200] [--phases]
// Prints one markdown table (ms, p50/p99, ratio to the step itself) and the image bytes.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "common/util.h"
#include "drivers/container/container_driver.h"
#include "drivers/testing/memory_blob_store.h"

namespace {

double Ms(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

struct Series {
  std::string name;
  std::vector<double> v;
  double P(double q) const {
    std::vector<double> s = v;
    std::sort(s.begin(), s.end());
    if (s.empty()) return 0;
    return s[std::min(s.size() - 1, static_cast<size_t>(q * static_cast<double>(s.size())))];
  }
};

void Row(const Series& s, const Series* base) {
  char ratio[64] = "";
  if (base && base->P(0.5) > 0)
    snprintf(ratio, sizeof ratio, "%.1fx step", s.P(0.5) / base->P(0.5));
  printf("| %-58s | %3zu | %8.1f | %8.1f | %-11s |\n", s.name.c_str(), s.v.size(), s.P(0.5),
         s.P(0.99), ratio);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argv[1][0] != '/') {
    fprintf(stderr, "usage: gvisor_step_bench IMAGE_ROOTFS [--steps N] [--files N]\n");
    return 2;
  }
  const std::string image = argv[1];
  // --phases: the driver's debug lines (each checkpoint's and restore's split) on stderr.
  for (int i = 2; i < argc; ++i) {
    if (!strcmp(argv[i], "--phases")) esb::SetLogLevel(esb::LogLevel::kDebug);
  }
  int steps = 8, files = 200;
  for (int i = 2; i + 1 < argc; ++i) {
    if (!strcmp(argv[i], "--steps")) steps = std::max(2, atoi(argv[i + 1]));
    if (!strcmp(argv[i], "--files")) files = std::max(1, atoi(argv[i + 1]));
  }
  char tmpl[] = "/tmp/esb-gvisor-bench-XXXXXX";
  if (!mkdtemp(tmpl)) return 1;
  esb::ContainerDriverOptions o;
  o.state_dir = tmpl;
  o.agent_binary = ESB_AGENT_BINARY;
  o.images["default"] = image;
  o.runtime = "runsc";
  absl::StatusOr<std::unique_ptr<esb::Driver>> driver = esb::NewContainerDriver(o);
  if (!driver.ok()) {
    fprintf(stderr, "gVisor driver: %s\n", driver.status().ToString().c_str());
    return 1;
  }
  esb::Driver& d = **driver;
  std::vector<esb::InstanceRef> made;
  auto cleanup = [&] {
    for (const esb::InstanceRef& r : made) d.Destroy(r).IgnoreError();
    std::error_code ec;
    std::filesystem::remove_all(tmpl, ec);
  };
  absl::StatusOr<esb::InstanceRef> ref = d.Create("gbench" + std::to_string(getpid()), {});
  if (!ref.ok()) {
    fprintf(stderr, "create: %s\n", ref.status().ToString().c_str());
    cleanup();
    return 1;
  }
  made.push_back(*ref);
  auto exec = [&](const esb::InstanceRef& r, const std::string& command) {
    esb::ExecRequest req;
    req.command = command;
    req.timeout = std::chrono::milliseconds(60000);
    absl::StatusOr<esb::ExecResult> res = d.Exec(r, req, nullptr);
    return res.ok() && res->exit_code == 0;
  };
  esb::RunRequest cell;
  cell.code = "import json\ndata = {i: str(i) * 10 for i in range(20000)}\nx = 41";
  cell.timeout_ms = 30000;
  absl::StatusOr<esb::RunResult> ran = d.RunCode(&*ref, cell, nullptr);
  if (!ran.ok() || ran->exit_code != 0 ||
      !exec(*ref, "mkdir -p /workspace/src && for i in $(seq 1 " + std::to_string(files) +
                      "); do head -c 2048 /dev/urandom | base64 > /workspace/src/f$i.txt; done; "
                      "(while :; do sleep 1; done) >/dev/null 2>&1 &")) {
    fprintf(stderr, "setting up the sandbox failed\n");
    cleanup();
    return 1;
  }
  esb::testing::MemoryBlobStore blobs;
  Series step{"step: exec rewriting one file (no capture) [baseline]", {}};
  Series files_only{"capture, files + shell only (memory off)", {}};
  Series memory{"capture with memory (release, checkpoint, restore)", {}};
  Series rewind{"rewind to a step from its image", {}};
  Series fork{"fork of a step (restore into a new sandbox)", {}};
  Series bytes{"", {}};
  std::vector<esb::StepState> history;
  for (int s = 0; s < steps; ++s) {
    const std::string write = "head -c 2048 /dev/urandom | base64 > /workspace/src/f" +
                              std::to_string(1 + s % files) + ".txt";
    auto a = std::chrono::steady_clock::now();
    if (!exec(*ref, write)) return 1;
    auto b = std::chrono::steady_clock::now();
    esb::CaptureOptions options;
    options.previous = history.empty() ? nullptr : &history.back().workspace;
    options.memory = false;
    absl::StatusOr<esb::StepState> plain = d.CaptureStep(*ref, options, blobs);
    auto c = std::chrono::steady_clock::now();
    options.memory = true;
    absl::StatusOr<esb::StepState> full = d.CaptureStep(*ref, options, blobs);
    auto e = std::chrono::steady_clock::now();
    if (!plain.ok() || !full.ok() || !full->memory) {
      fprintf(stderr, "capture: %s %s\n", plain.status().ToString().c_str(),
              full.ok() ? full->memory_reason.c_str() : full.status().ToString().c_str());
      cleanup();
      return 1;
    }
    step.v.push_back(Ms(b - a));
    files_only.v.push_back(Ms(c - b));
    memory.v.push_back(Ms(e - c));
    bytes.v.push_back(static_cast<double>(full->memory->bytes));
    history.push_back(*full);
  }
  for (int s = 0; s < std::min(steps, 6); ++s) {
    const esb::StepState& target = history[history.size() - 1 - (s % 2 == 0 ? 1 : 0)];
    auto a = std::chrono::steady_clock::now();
    absl::StatusOr<esb::InstanceRef> back = d.RestoreStep(*ref, target, blobs);
    rewind.v.push_back(Ms(std::chrono::steady_clock::now() - a));
    if (!back.ok()) {
      fprintf(stderr, "rewind: %s\n", back.status().ToString().c_str());
      cleanup();
      return 1;
    }
  }
  for (int s = 0; s < std::min(steps, 4); ++s) {
    auto a = std::chrono::steady_clock::now();
    absl::StatusOr<esb::InstanceRef> f =
        d.ForkStep(history[static_cast<size_t>(s)], {}, "gfork" + std::to_string(s), blobs);
    fork.v.push_back(Ms(std::chrono::steady_clock::now() - a));
    if (!f.ok()) {
      fprintf(stderr, "fork: %s\n", f.status().ToString().c_str());
      cleanup();
      return 1;
    }
    made.push_back(*f);
    d.Destroy(*f).IgnoreError();
    made.pop_back();
  }
  char load[64] = "?\n";
  if (FILE* f = fopen("/proc/loadavg", "r")) {
    if (!fgets(load, sizeof load, f)) strcpy(load, "?\n");
    fclose(f);
  }
  printf("gVisor (%s); %d files in /workspace, a 20k-entry dict in the kernel; load %s",
         d.Describe().c_str(), files, load);
  printf("| %-58s | %3s | %8s | %8s | %-11s |\n", "gVisor step (ms)", "n", "p50", "p99", "ratio");
  printf("|%s|%s|%s|%s|%s|\n", std::string(60, '-').c_str(), std::string(5, '-').c_str(),
         std::string(10, '-').c_str(), std::string(10, '-').c_str(), std::string(13, '-').c_str());
  Row(step, nullptr);
  Row(files_only, &step);
  Row(memory, &step);
  Row(rewind, &step);
  Row(fork, &step);
  printf("checkpoint image per step: p50 %.1f MB (on disk, counted in the step's bytes)\n",
         bytes.P(0.5) / 1e6);
  cleanup();
  return 0;
}

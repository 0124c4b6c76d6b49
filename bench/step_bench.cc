// Time travel's per-step cost on the container tier's path (issue 13): the real esb-agent
// (a child process serving its unix socket, as in a sandbox) with a 2,000-file / ~50 MB
// workspace on tmpfs (/dev/shm, like a sandbox's /workspace), driven by the host side esbd
// uses (AgentClient + drivers/workspace_steps: walk, parse, validate, SHA-256 host-side, blob
// store). Rows, same run: an exec that rewrites one file (the step itself, no capture: the
// baseline), the capture after it, both together, a capture with nothing changed, a rewind
// to the previous step (one file differs), the first full capture, and bytes stored per step.
//   step_bench [--files 2000] [--file-bytes 25600] [--steps 40]
//   step_bench --container IMAGE_ROOTFS [...]   the same through the container driver (root):
//     a crun sandbox of that image, Exec then CaptureStep / RestoreStep (shell state included)
// The blob store is in memory (drivers/testing/memory_blob_store.h): the core's disk store
// adds one file write of the changed file's size per step.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "agent/test_agent_process.h"
#include "drivers/agent_client.h"
#include "drivers/container/container_driver.h"
#include "drivers/testing/memory_blob_store.h"
#include "drivers/workspace_steps.h"

namespace {

double Ms(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

struct Series {
  std::string name;
  std::vector<double> ms;
  double P(double q) const {
    std::vector<double> v = ms;
    std::sort(v.begin(), v.end());
    if (v.empty()) return 0;
    size_t i = std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())));
    return v[i];
  }
};

void Row(const Series& s, const Series* base) {
  char ratio[64] = "";
  if (base && base->P(0.5) > 0)
    snprintf(ratio, sizeof ratio, "%.2fx exec", s.P(0.5) / base->P(0.5));
  printf("| %-52s | %5zu | %8.2f | %8.2f | %-12s |\n", s.name.c_str(), s.ms.size(), s.P(0.5),
         s.P(0.99), ratio);
}

}  // namespace

int ContainerBench(const std::string& image, int files, int file_bytes, int steps);

int main(int argc, char** argv) {
  int files = 2000, file_bytes = 25600, steps = 40;
  std::string container;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--files")) files = atoi(argv[i + 1]);
    if (!strcmp(argv[i], "--file-bytes")) file_bytes = atoi(argv[i + 1]);
    if (!strcmp(argv[i], "--steps")) steps = atoi(argv[i + 1]);
    if (!strcmp(argv[i], "--container")) container = argv[i + 1];
  }
  if (!container.empty()) return ContainerBench(container, files, file_bytes, steps);
  char tmpl[] = "/dev/shm/esb-step-bench-XXXXXX";
  if (!mkdtemp(tmpl)) {
    perror("mkdtemp");
    return 1;
  }
  esb::testing::AgentProcess agent({}, tmpl);
  if (agent.pid() <= 0 || !agent.WaitReady()) {
    fprintf(stderr, "could not start %s\n", ESB_AGENT_BINARY);
    return 1;
  }
  const std::string ws = agent.workspace();
  std::mt19937 rng(42);
  std::string alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  for (int i = 0; i < files; ++i) {
    std::string dir = ws + "/d" + std::to_string(i / 100);
    std::filesystem::create_directories(dir);
    std::string data(static_cast<size_t>(file_bytes), 'x');
    for (char& c : data) c = alphabet[rng() % 64];
    std::ofstream(dir + "/f" + std::to_string(i) + ".txt") << data;
  }
  esb::AgentClient client(esb::AgentClient::UnixSocket(agent.socket_path()));
  esb::testing::MemoryBlobStore blobs;
  std::string base;
  auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<esb::WorkspaceManifest> first =
      esb::CaptureAgentWorkspace(client, blobs, {}, &base);
  Series full{"first capture (all files read and hashed)",
              {Ms(std::chrono::steady_clock::now() - t0)}};
  if (!first.ok()) {
    fprintf(stderr, "capture: %s\n", first.status().ToString().c_str());
    return 1;
  }
  std::vector<esb::WorkspaceManifest> history{*first};
  Series exec{"step: exec rewriting one file (no capture) [baseline]", {}};
  Series capture{"capture after it (one file changed)", {}};
  Series total{"step + capture", {}};
  Series idle{"capture, nothing changed", {}};
  Series rewind{"rewind to the previous step (one file differs)", {}};
  Series stored{"", {}};
  for (int s = 0; s < steps; ++s) {
    const int victim = static_cast<int>(rng() % static_cast<unsigned>(files));
    esb::ExecRequest req;
    req.command = "head -c " + std::to_string(file_bytes) + " /dev/urandom | base64 -w0 > d" +
                  std::to_string(victim / 100) + "/f" + std::to_string(victim) + ".txt";
    req.timeout = std::chrono::milliseconds(10000);
    auto a = std::chrono::steady_clock::now();
    absl::StatusOr<esb::ExecResult> r = client.Exec(req, nullptr);
    auto b = std::chrono::steady_clock::now();
    if (!r.ok() || r->exit_code != 0) {
      fprintf(stderr, "exec failed\n");
      return 1;
    }
    const size_t bytes_before = blobs.size();
    esb::CaptureOptions options;
    options.previous = &history.back();
    absl::StatusOr<esb::WorkspaceManifest> m =
        esb::CaptureAgentWorkspace(client, blobs, options, &base);
    auto c = std::chrono::steady_clock::now();
    if (!m.ok()) {
      fprintf(stderr, "capture: %s\n", m.status().ToString().c_str());
      return 1;
    }
    exec.ms.push_back(Ms(b - a));
    capture.ms.push_back(Ms(c - b));
    total.ms.push_back(Ms(c - a));
    stored.ms.push_back(static_cast<double>(blobs.size() - bytes_before));
    history.push_back(*m);
    options.previous = &history.back();
    auto d = std::chrono::steady_clock::now();
    absl::StatusOr<esb::WorkspaceManifest> same =
        esb::CaptureAgentWorkspace(client, blobs, options, &base);
    idle.ms.push_back(Ms(std::chrono::steady_clock::now() - d));
    if (!same.ok()) return 1;
  }
  // Rewind: alternately to the step before and back to the last one.
  for (int s = 0; s < std::min(steps, 20); ++s) {
    const esb::WorkspaceManifest& target = history[history.size() - 1 - (s % 2 == 0 ? 1 : 0)];
    auto a = std::chrono::steady_clock::now();
    absl::Status st = esb::RestoreAgentWorkspace(client, blobs, target, &base);
    rewind.ms.push_back(Ms(std::chrono::steady_clock::now() - a));
    if (!st.ok()) {
      fprintf(stderr, "restore: %s\n", st.ToString().c_str());
      return 1;
    }
  }
  int64_t total_bytes = first->total_bytes;
  printf("workspace: %d files, %.1f MB on tmpfs; %d steps; load %s", files,
         static_cast<double>(total_bytes) / 1e6, steps, [] {
           static char buf[64] = "?\n";
           if (FILE* f = fopen("/proc/loadavg", "r")) {
             if (!fgets(buf, sizeof buf, f)) strcpy(buf, "?\n");
             fclose(f);
           }
           return buf;
         }());
  printf("| %-52s | %5s | %8s | %8s | %-12s |\n", "step (ms)", "n", "p50", "p99", "ratio (p50)");
  printf("|%s|%s|%s|%s|%s|\n", std::string(54, '-').c_str(), std::string(7, '-').c_str(),
         std::string(10, '-').c_str(), std::string(10, '-').c_str(), std::string(14, '-').c_str());
  Row(exec, nullptr);
  Row(capture, &exec);
  Row(total, &exec);
  Row(idle, &exec);
  Row(rewind, &exec);
  Row(full, &exec);
  printf("new blobs per step: p50 %.0f (the changed file; ~%d bytes)\n", stored.P(0.5), file_bytes);
  std::error_code ec;
  std::filesystem::remove_all(tmpl, ec);
  return 0;
}

int ContainerBench(const std::string& image, int files, int file_bytes, int steps) {
  char tmpl[] = "/tmp/esb-step-bench-state-XXXXXX";
  if (!mkdtemp(tmpl)) return 1;
  esb::ContainerDriverOptions o;
  o.state_dir = tmpl;
  o.agent_binary = ESB_AGENT_BINARY;
  o.images["default"] = image;
  o.runtime = "crun";
  absl::StatusOr<std::unique_ptr<esb::Driver>> driver = esb::NewContainerDriver(o);
  if (!driver.ok()) {
    fprintf(stderr, "driver: %s\n", driver.status().ToString().c_str());
    return 1;
  }
  esb::EnvSpec spec;
  spec.disk_mb = 512;
  absl::StatusOr<esb::InstanceRef> ref =
      (*driver)->Create("bench" + std::to_string(getpid()), spec);
  if (!ref.ok()) {
    fprintf(stderr, "create: %s\n", ref.status().ToString().c_str());
    return 1;
  }
  auto exec = [&](const std::string& command) {
    esb::ExecRequest req;
    req.command = command;
    req.timeout = std::chrono::milliseconds(120000);
    absl::StatusOr<esb::ExecResult> r = (*driver)->Exec(*ref, req, nullptr);
    return r.ok() && r->exit_code == 0;
  };
  const int dirs = (files + 99) / 100;
  if (!exec("cd /workspace && for d in $(seq 0 " + std::to_string(dirs - 1) +
            "); do mkdir -p d$d; done && for i in $(seq 0 " + std::to_string(files - 1) +
            "); do head -c " + std::to_string(file_bytes * 3 / 4) +
            " /dev/urandom | base64 -w0 > d$((i / 100))/f$i.txt; done")) {
    fprintf(stderr, "populating the workspace failed\n");
    return 1;
  }
  esb::testing::MemoryBlobStore blobs;
  auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<esb::StepState> first = (*driver)->CaptureStep(*ref, {}, blobs);
  Series full{"first capture (all files read and hashed)",
              {Ms(std::chrono::steady_clock::now() - t0)}};
  if (!first.ok()) {
    fprintf(stderr, "capture: %s\n", first.status().ToString().c_str());
    return 1;
  }
  std::vector<esb::StepState> history{*first};
  Series step{"step: Exec rewriting one file (no capture) [baseline]", {}};
  Series capture{"CaptureStep after it (one file changed)", {}};
  Series rewind{"RestoreStep to the previous step (incl. kernel reset)", {}};
  std::mt19937 rng(7);
  for (int s = 0; s < steps; ++s) {
    const int victim = static_cast<int>(rng() % static_cast<unsigned>(files));
    auto a = std::chrono::steady_clock::now();
    if (!exec("head -c " + std::to_string(file_bytes * 3 / 4) +
              " /dev/urandom | base64 -w0 > "
              "/workspace/d" +
              std::to_string(victim / 100) + "/f" + std::to_string(victim) + ".txt")) {
      return 1;
    }
    auto b = std::chrono::steady_clock::now();
    esb::CaptureOptions options;
    options.previous = &history.back().workspace;
    absl::StatusOr<esb::StepState> m = (*driver)->CaptureStep(*ref, options, blobs);
    auto c = std::chrono::steady_clock::now();
    if (!m.ok()) {
      fprintf(stderr, "capture: %s\n", m.status().ToString().c_str());
      return 1;
    }
    step.ms.push_back(Ms(b - a));
    capture.ms.push_back(Ms(c - b));
    history.push_back(*m);
  }
  for (int s = 0; s < std::min(steps, 10); ++s) {
    const esb::StepState& target = history[history.size() - 1 - (s % 2 == 0 ? 1 : 0)];
    auto a = std::chrono::steady_clock::now();
    absl::StatusOr<esb::InstanceRef> back = (*driver)->RestoreStep(*ref, target, blobs);
    rewind.ms.push_back(Ms(std::chrono::steady_clock::now() - a));
    if (!back.ok()) {
      fprintf(stderr, "restore: %s\n", back.status().ToString().c_str());
      return 1;
    }
  }
  printf("container (crun, %s): %d files, %.1f MB on the sandbox's tmpfs /workspace; %d steps\n",
         image.c_str(), files, static_cast<double>(first->workspace.total_bytes) / 1e6, steps);
  printf("| %-52s | %5s | %8s | %8s | %-12s |\n", "step (ms)", "n", "p50", "p99", "ratio (p50)");
  Row(step, nullptr);
  Row(capture, &step);
  Row(rewind, &step);
  Row(full, &step);
  (*driver)->Destroy(*ref).IgnoreError();
  driver->reset();
  std::error_code ec;
  std::filesystem::remove_all(tmpl, ec);
  return 0;
}

// Time travel through esbd, per driver (bash bench/run.sh steps-e2e): for each driver this host
// has (nano; container on crun and on runc; gvisor), the same steps on two environments of the
// same daemon, one recording steps and one with "steps": false, alternating call by call, so
// the capture's cost is a ratio measured in the same run; then rewind and fork latency, and
// the bytes the blob store keeps per step. Everything goes through HTTP and the
// EnvironmentManager, as a client sees it.
//
// The step: a files/write of one 4 KiB file into a workspace of 200 files (nano: its memfs),
// and, on drivers with a shell, an execute that changes one of them. Bytes per step: the growth
// of <state_dir>/blobs over the recording environment's steps (manifests, changed contents,
// shell states), divided by the number of steps.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "integration/daemon.h"

namespace json = boost::json;
using esb::testing::Daemon;
using esb::testing::HttpResult;

namespace {

double NowMs() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int64_t DirBytes(const std::string& dir) {
  int64_t total = 0;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, ec);
       it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    if (it->is_regular_file(ec)) total += static_cast<int64_t>(it->file_size(ec));
  }
  return total;
}

bool OnPath(const std::string& name) {
  for (const char* d : {"/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin"})
    if (access((std::string(d) + "/" + name).c_str(), X_OK) == 0) return true;
  return false;
}

struct Row {
  std::string driver, memory, note;
  double step_on = 0, step_off = 0, capture = 0, rewind = 0, fork = 0;
  double bytes_per_step = 0;
};

struct Case {
  const char* name;
  const char* runtime;
  const char* oci;
};

std::string Create(Daemon& d, const std::string& runtime, bool capture, std::string* memory) {
  json::object body{{"runtime", runtime}};
  if (!capture) body["steps"] = false;
  HttpResult r = d.Call("POST", "/environments", body);
  if (r.status != 201) {
    std::fprintf(stderr, "create %s: %d %s\n", runtime.c_str(), r.status, r.body.c_str());
    return "";
  }
  if (memory) *memory = std::string(r.obj().at("steps").as_object().at("memory").as_string());
  return r.str("environment_id");
}

bool Write(Daemon& d, const std::string& id, const std::string& path, const std::string& data) {
  HttpResult r = d.Call("POST", "/environments/" + id + "/files/write",
                        json::object{{"path", path}, {"content", data}});
  return r.status == 200;
}

// One step of the workload; its wall time in ms (-1: failed).
double Step(Daemon& d, const std::string& id, bool shell, int i) {
  const std::string content(4096, static_cast<char>('a' + i % 26));
  const double t0 = NowMs();
  bool ok = Write(d, id, "data/f" + std::to_string(i % 200) + ".txt", content);
  if (ok && shell) {
    HttpResult r = d.Exec(id, "echo " + std::to_string(i) + " >> data/f0.txt");
    ok = r.status == 200;
  }
  return ok ? NowMs() - t0 : -1;
}

Row Measure(Daemon& d, const Case& c, int steps) {
  Row row;
  row.driver = c.name;
  const bool shell = std::string(c.runtime) != "nano";
  std::string on = Create(d, c.runtime, true, &row.memory);
  std::string off = Create(d, c.runtime, false, nullptr);
  if (on.empty() || off.empty()) {
    row.note = "create failed";
    return row;
  }
  // The workspace: 200 files of 4 KiB in both environments (not timed).
  for (const std::string& id : {on, off}) {
    for (int i = 0; i < 200; ++i)
      Write(d, id, "data/f" + std::to_string(i) + ".txt", std::string(4096, 'x'));
  }
  const int64_t blobs_before = DirBytes(d.state_dir() + "/blobs");
  std::vector<double> t_on, t_off;
  for (int i = 0; i < steps; ++i) {  // alternating: the same load on both
    double a = Step(d, on, shell, i), b = Step(d, off, shell, i);
    if (a >= 0) t_on.push_back(a);
    if (b >= 0) t_off.push_back(b);
  }
  const int64_t blobs_after = DirBytes(d.state_dir() + "/blobs");
  row.step_on = Median(t_on);
  row.step_off = Median(t_off);
  // capture_ms as esbd measured it, per step (the median over the recorded steps).
  HttpResult list = d.Call("GET", "/environments/" + on + "/steps?limit=1000");
  std::vector<double> cap;
  int64_t head = -1;
  if (list.status == 200) {
    for (const json::value& v : list.obj().at("steps").as_array()) {
      const json::object& s = v.as_object();
      if (s.at("kind").as_string() != "create")
        cap.push_back(s.at("capture_ms").to_number<double>());
    }
    head = list.num("head");
  }
  row.capture = Median(cap);
  const int recorded = static_cast<int>(cap.size());
  row.bytes_per_step = recorded > 0 ? double(blobs_after - blobs_before) / recorded : 0;
  // Rewind: alternately to an older step and back to the head.
  std::vector<double> rw;
  for (int i = 0; i < 10 && head > 2; ++i) {
    const int64_t target = (i % 2 == 0) ? head - 2 : head;
    const double t0 = NowMs();
    HttpResult r =
        d.Call("POST", "/environments/" + on + "/rewind", json::object{{"step", target}});
    if (r.status == 200) rw.push_back(NowMs() - t0);
  }
  row.rewind = Median(rw);
  std::vector<double> fk;
  for (int i = 0; i < 5 && head > 0; ++i) {
    const double t0 = NowMs();
    HttpResult r = d.Call("POST", "/environments/" + on + "/fork", json::object{{"step", head}});
    if (r.status == 201) {
      fk.push_back(NowMs() - t0);
      d.Call("DELETE", "/environments/" + r.str("environment_id"));
    }
  }
  row.fork = Median(fk);
  if (t_on.size() != static_cast<size_t>(steps) || rw.empty() || fk.empty())
    row.note = "some calls failed";
  d.Call("DELETE", "/environments/" + on);
  d.Call("DELETE", "/environments/" + off);
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::max(5, std::atoi(argv[1])) : 30;
  if (std::string why = Daemon::SkipReason(); !why.empty()) {
    std::fprintf(stderr, "steps-e2e: %s\n", why.c_str());
    return 2;
  }
  const Case cases[] = {{"nano", "nano", "crun"},
                        {"crun", "container", "crun"},
                        {"runc", "container", "runc"},
                        {"gvisor", "gvisor", "crun"}};
  std::map<std::string, Daemon*> daemons;
  std::vector<Row> rows;
  for (const Case& c : cases) {
    Row row;
    row.driver = c.name;
    if (!OnPath(c.oci)) {
      row.note = std::string(c.oci) + " is not installed";
      rows.push_back(row);
      continue;
    }
    Daemon*& d = daemons[c.oci];
    if (d == nullptr) {
      d = new Daemon();
      // Caps above the run's steps: nothing collected while measuring.
      if (!d->Start({.extra_args = {"--runtime", c.oci}})) {
        row.note = std::string("esbd --runtime ") + c.oci + " did not start";
        rows.push_back(row);
        continue;
      }
    }
    HttpResult h = d->Call("GET", "/healthz");
    const json::value* desc =
        h.status == 200 ? h.obj().at("drivers").as_object().if_contains(c.runtime) : nullptr;
    if (desc == nullptr) {
      row.note = "unavailable on this host";
      rows.push_back(row);
      continue;
    }
    std::fprintf(stderr, "steps-e2e: %s (%d steps)...\n", c.name, steps);
    rows.push_back(Measure(*d, c, steps));
  }
  for (auto& [oci, d] : daemons) {
    if (d) d->StopAndCleanup();
    delete d;
  }
  std::printf(
      "| driver | memory | step, capture on (ms) | same step, capture off (ms) | ratio | "
      "capture_ms (esbd) | rewind (ms) | fork (ms) | bytes kept / step |\n"
      "|---|---|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    if (r.step_on == 0 && !r.note.empty()) {
      std::printf("| %s | — | — | — | — | — | — | — | — (%s) |\n", r.driver.c_str(),
                  r.note.c_str());
      continue;
    }
    std::printf("| %s | %s | %.1f | %.1f | %.2fx | %.1f | %.1f | %.1f | %.0f%s%s |\n",
                r.driver.c_str(), r.memory.c_str(), r.step_on, r.step_off,
                r.step_off > 0 ? r.step_on / r.step_off : 0, r.capture, r.rewind, r.fork,
                r.bytes_per_step, r.note.empty() ? "" : " — ", r.note.c_str());
  }
  return 0;
}

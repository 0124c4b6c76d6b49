// Time travel in the core (issue 13): the step log, rewind, fork, retention and restart, with a
// deterministic fake kSteps driver (an in-memory workspace and a "memory" of variables).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/util.h"
#include "core/environment_manager.h"
#include "core/snapshots/blob_store.h"
#include "core/snapshots/manifest.h"
#include "storage/sqlite_store.h"

namespace esb {
namespace {

// One instance: its files (path → contents; directories have no contents) and its variables.
struct Instance {
  std::map<std::string, std::string> files;
  std::set<std::string> dirs;
  std::map<std::string, std::string> vars;
  std::string cwd = "/workspace";
};

std::string EncodeVars(const std::map<std::string, std::string>& vars) {
  std::string out;
  for (const auto& [k, v] : vars) absl::StrAppend(&out, k, "=", v, ";");
  return out;
}
std::map<std::string, std::string> DecodeVars(const std::string& text) {
  std::map<std::string, std::string> out;
  for (absl::string_view kv : absl::StrSplit(text, ';', absl::SkipEmpty())) {
    std::pair<std::string, std::string> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
    out[p.first] = p.second;
  }
  return out;
}

// Exec commands: "write <path> <text>", "set <var> <value>", "cd <dir>", "fail", "sleep <ms>".
class StepsDriver : public Driver {
 public:
  std::string name() const override { return "container"; }
  std::string Describe() const override { return "fake steps"; }
  CapabilitySet Capabilities() const override {
    if (on_capabilities) {  // once (e.g. inside a create's step set-up)
      auto hook = std::move(on_capabilities);
      on_capabilities = nullptr;
      hook();
    }
    return caps;
  }
  absl::StatusOr<InstanceRef> Create(const std::string& id, const EnvSpec&) override {
    std::lock_guard<std::mutex> lock(mu);
    instances[id] = Instance{};
    return InstanceRef{id, "container", id};
  }
  absl::Status Destroy(const InstanceRef& ref) override {
    std::lock_guard<std::mutex> lock(mu);
    instances.erase(ref.id);
    return absl::OkStatus();
  }
  absl::Status Attach(const InstanceRef& ref) override {
    std::lock_guard<std::mutex> lock(mu);
    return instances.count(ref.id) ? absl::OkStatus() : absl::NotFoundError("gone");
  }
  absl::StatusOr<ExecResult> Exec(const InstanceRef& ref, const ExecRequest& req,
                                  const OutputSink&) override {
    std::vector<std::string> w = absl::StrSplit(req.command, absl::MaxSplits(' ', 2));
    ExecResult r;
    r.exit_code = 0;
    if (w[0] == "sleep") {
      in_flight++;
      max_in_flight = std::max(max_in_flight.load(), in_flight.load());
      std::this_thread::sleep_for(std::chrono::milliseconds(std::stoi(w[1])));
      in_flight--;
      return r;
    }
    std::lock_guard<std::mutex> lock(mu);
    Instance& in = instances.at(ref.id);
    if (w[0] == "write") in.files[w[1]] = w.size() > 2 ? w[2] : "";
    if (w[0] == "set") in.vars[w[1]] = w[2];
    if (w[0] == "cd") in.cwd = w[1];
    if (w[0] == "fail") {
      r.exit_code = 3;
      r.stderr_data = "it failed";
    }
    r.stdout_data = "ran " + req.command;
    return r;
  }
  absl::Status WriteFile(const InstanceRef& ref, const std::string& path, std::string_view data,
                         int64_t offset, bool truncate) override {
    std::lock_guard<std::mutex> lock(mu);
    std::string& f = instances.at(ref.id).files[path];
    if (truncate) f.clear();
    f.resize(std::max<size_t>(f.size(), offset));
    f.replace(offset, data.size(), data);
    return absl::OkStatus();
  }
  absl::StatusOr<FileChunk> ReadFile(const InstanceRef& ref, const std::string& path, int64_t,
                                     int64_t) override {
    std::lock_guard<std::mutex> lock(mu);
    auto& files = instances.at(ref.id).files;
    auto it = files.find(path);
    if (it == files.end()) return absl::NotFoundError("no such file");
    FileChunk c;
    c.data = it->second;
    c.eof = true;
    return c;
  }
  absl::StatusOr<DirListing> ListDir(const InstanceRef&, const std::string&) override {
    return DirListing{};
  }
  absl::StatusOr<FileEntry> Stat(const InstanceRef&, const std::string&) override {
    return absl::NotFoundError("no");
  }
  absl::StatusOr<bool> MakeDir(const InstanceRef& ref, const std::string& path) override {
    std::lock_guard<std::mutex> lock(mu);
    return instances.at(ref.id).dirs.insert(path).second;
  }
  absl::Status Remove(const InstanceRef& ref, const std::string& path, bool) override {
    std::lock_guard<std::mutex> lock(mu);
    Instance& in = instances.at(ref.id);
    if (!in.files.erase(path) && !in.dirs.erase(path)) return absl::NotFoundError("no");
    return absl::OkStatus();
  }
  absl::Status Rename(const InstanceRef& ref, const std::string& from, const std::string& to,
                      bool) override {
    std::lock_guard<std::mutex> lock(mu);
    Instance& in = instances.at(ref.id);
    auto it = in.files.find(from);
    if (it == in.files.end()) return absl::NotFoundError("no");
    in.files[to] = it->second;
    in.files.erase(it);
    return absl::OkStatus();
  }
  absl::StatusOr<Usage> Stats(const InstanceRef&) override { return Usage{}; }
  absl::Status Configure(const InstanceRef&, const std::map<std::string, std::string>&) override {
    return absl::OkStatus();
  }

  absl::StatusOr<StepState> CaptureStep(const InstanceRef& ref, const CaptureOptions& opts,
                                        BlobStore& blobs) override {
    if (fail_capture) return absl::InternalError("the agent went away");
    std::lock_guard<std::mutex> lock(mu);
    ++captures;
    const Instance& in = instances.at(ref.id);
    StepState s;
    std::map<std::string, ManifestEntry> entries;
    for (const std::string& d : in.dirs) {
      ManifestEntry e;
      e.path = d;
      e.type = ManifestEntry::Type::kDir;
      e.mode = 0755;
      entries[d] = e;
    }
    for (const auto& [p, data] : in.files) {
      ManifestEntry e;
      e.path = p;
      e.mode = 0644;
      e.size = static_cast<int64_t>(data.size());
      // Like the container driver: a file whose change key is the previous manifest's reuses
      // its blob without storing it again.
      const ManifestEntry* before = nullptr;
      if (reuse_previous) {
        e.change_key = Sha256Hex(data);
        if (opts.previous) before = FindEntry(*opts.previous, p);
      }
      if (before && before->change_key == e.change_key) {
        e.sha256 = before->sha256;
      } else {
        auto sha = blobs.Put(data);
        if (!sha.ok()) return sha.status();
        e.sha256 = *sha;
      }
      s.workspace.total_bytes += e.size;
      entries[p] = e;
    }
    for (auto& [p, e] : entries) s.workspace.entries.push_back(e);
    s.shell_state = absl::StrCat("{\"cwd\":\"", in.cwd, "\"}");
    s.variables_json = "[";
    bool first = true;
    for (const auto& [k, v] : in.vars) {
      absl::StrAppend(&s.variables_json, first ? "" : ",", "{\"name\":\"", k,
                      "\",\"type\":\"str\",\"repr\":\"", v, "\"}");
      first = false;
    }
    s.variables_json += "]";
    if (opts.memory && memory && !memory_refused.empty()) {
      s.memory_reason = memory_refused;  // e.g. gVisor's image over its cap
    } else if (opts.memory && memory) {
      SnapshotRef snap;
      snap.id = absl::StrCat("snap", ++snapshots_made);
      snap.driver = "container";
      snap.source_id = ref.id;
      snap.state = EncodeVars(in.vars);
      snap.bytes = on_disk ? image_bytes : 1000;
      snap.live = !on_disk;  // on disk: like gVisor's checkpoint images
      live_snapshots.insert(snap.id);
      snapshot_source[snap.id] = ref.id;
      s.memory = snap;
    }
    if (after_capture) {  // e.g. a Destroy racing the capture (run without mu, once)
      auto hook = std::move(after_capture);
      after_capture = nullptr;
      mu.unlock();
      hook();
      mu.lock();
    }
    return s;
  }
  // Files come back from the manifest's blobs; variables only with the memory snapshot.
  absl::Status Apply(Instance& in, const StepState& state, BlobStore& blobs) {
    in.files.clear();
    in.dirs.clear();
    for (const ManifestEntry& e : state.workspace.entries) {
      if (e.type == ManifestEntry::Type::kDir) {
        in.dirs.insert(e.path);
        continue;
      }
      auto data = blobs.Get(e.sha256);
      if (!data.ok()) return data.status();
      in.files[e.path] = *data;
    }
    in.vars = state.memory ? DecodeVars(state.memory->state) : std::map<std::string, std::string>{};
    auto cwd = state.shell_state.find("\"cwd\":\"");
    if (cwd != std::string::npos) {
      size_t start = cwd + 7;
      in.cwd = state.shell_state.substr(start, state.shell_state.find('"', start) - start);
    }
    return absl::OkStatus();
  }
  absl::StatusOr<InstanceRef> RestoreStep(const InstanceRef& ref, const StepState& state,
                                          BlobStore& blobs) override {
    if (before_restore) {  // e.g. a Destroy racing the rewind (run without mu, once)
      auto hook = std::move(before_restore);
      before_restore = nullptr;
      hook();
    }
    std::lock_guard<std::mutex> lock(mu);
    ++restores;
    if (!restore_error.ok()) return restore_error;
    // Like nano, the restore installs an instance under the id (whether or not one was there).
    if (absl::Status st = Apply(instances[ref.id], state, blobs); !st.ok()) return st;
    return ref;
  }
  absl::StatusOr<InstanceRef> ForkStep(const StepState& state, const EnvSpec&,
                                       const std::string& new_id, BlobStore& blobs) override {
    if (during_fork) {  // e.g. calls on the source while the fork is made (run without mu, once)
      auto hook = std::move(during_fork);
      during_fork = nullptr;
      hook();
    }
    std::lock_guard<std::mutex> lock(mu);
    if (state.memory && deleted_snapshots.count(state.memory->id))
      return absl::FailedPreconditionError("the memory snapshot was released during the fork");
    if (!restore_error.ok()) return restore_error;
    Instance in;
    if (absl::Status st = Apply(in, state, blobs); !st.ok()) return st;
    instances[new_id] = in;
    return InstanceRef{new_id, "container", new_id};
  }
  absl::StatusOr<SnapshotRef> CompactSnapshot(const SnapshotRef& s) override {
    if (compact_delay_ms > 0) {  // a slow dump (nano's can take up to 60 s)
      compacting = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(compact_delay_ms));
      compacting = false;
    }
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = released.find(s.id); it != released.end()) {
      const bool kept = it->second;
      released.erase(it);
      if (!kept) return absl::FailedPreconditionError("released over the memory budget");
    } else if (!compact) {
      return absl::UnimplementedError("only live");
    }
    live_snapshots.erase(s.id);
    SnapshotRef c = s;
    c.live = false;
    c.bytes = 100;
    ++compacted;
    return c;
  }
  absl::Status DeleteSnapshot(const SnapshotRef& s) override {
    std::lock_guard<std::mutex> lock(mu);
    live_snapshots.erase(s.id);
    deleted_snapshots.insert(s.id);
    return absl::OkStatus();
  }
  std::set<std::string> ReleasedSnapshots(const std::string& source_id) override {
    std::lock_guard<std::mutex> lock(mu);
    std::set<std::string> out;
    for (const auto& [id, kept] : released) {
      if (snapshot_source[id] == source_id) out.insert(id);
    }
    return out;
  }
  bool HasReleasedSnapshots() override {
    std::lock_guard<std::mutex> lock(mu);
    return !released.empty();
  }
  StepMemorySupport StepMemory() const override {
    if (!memory) return {.available = false, .mechanism = "", .reason = "no memory here"};
    return {.available = true, .mechanism = "fake", .reason = ""};
  }

  Instance Get(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu);
    return instances.at(id);
  }
  size_t Count(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu);
    return instances.count(id);
  }

  CapabilitySet caps{Capability::kExec, Capability::kFiles, Capability::kSteps};
  std::mutex mu;
  std::map<std::string, Instance> instances;
  std::set<std::string> live_snapshots, deleted_snapshots;
  // Live snapshots the driver released on its own (id → compacted (true) or dropped), and
  // whose instance each snapshot was taken from.
  std::map<std::string, bool> released;
  std::map<std::string, std::string> snapshot_source;
  int snapshots_made = 0, captures = 0, restores = 0, compacted = 0;
  bool memory = true, compact = true, reuse_previous = false;
  int compact_delay_ms = 0;
  std::atomic<bool> compacting{false};
  bool on_disk = false;        // memory snapshots are images on disk (live false)
  int64_t image_bytes = 1000;  // their size, with on_disk
  std::string memory_refused;  // set: no memory snapshot, this reason instead
  absl::Status restore_error;  // RestoreStep and ForkStep answer it when set
  std::function<void()> after_capture, before_restore, during_fork;
  mutable std::function<void()> on_capabilities;
  std::atomic<bool> fail_capture{false};
  std::atomic<int> in_flight{0}, max_in_flight{0};
};

class StepsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = (std::filesystem::temp_directory_path() / ("esb_steps_" + RandomHex(6))).string();
    std::filesystem::create_directories(dir);
    StoreOptions sopts;
    sopts.write_behind_ms = 0;
    auto s = Store::Open(dir + "/esbd.db", sopts);
    ASSERT_TRUE(s.ok()) << s.status();
    store = std::move(*s);
    auto b = DiskBlobStore::Open({.dir = dir + "/blobs"});
    ASSERT_TRUE(b.ok()) << b.status();
    blobs = std::move(*b);
  }
  void TearDown() override {
    if (m) m->Stop();
    m.reset();
    store.reset();
    std::filesystem::remove_all(dir);
  }
  EnvironmentManager& Start(int64_t reaper_interval_ms = 3600000) {
    ManagerOptions opts;
    opts.pool_size = 0;
    opts.reaper_interval_ms = reaper_interval_ms;
    opts.default_ttl_s = 600;
    opts.blobs = blobs.get();
    opts.steps_worker_interval_ms = worker_interval_ms;
    m = std::make_unique<EnvironmentManager>(
        store.get(), std::map<std::string, Driver*>{{"container", &driver}}, &metrics, opts);
    EXPECT_TRUE(m->Start().ok());
    return *m;
  }
  std::string NewEnv(const std::string& tenant = "acme", const StepSettings* s = nullptr) {
    auto info = m->Create(tenant, EnvSpec{}, 0, nullptr, s);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->record.id : "";
  }
  void Run(const std::string& id, const std::string& cmd) {
    auto r = m->Exec("acme", id, ExecRequest{cmd}, nullptr);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  // Rewinds `id` to step n: its memory comes back, with `var` = `value`.
  void ExpectRewindRestoresMemory(const std::string& id, int64_t n, const std::string& var,
                                  const std::string& value) {
    auto r = m->Rewind("acme", id, n);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->memory, "snapshot");
    EXPECT_EQ(driver.Get(id).vars[var], value);
  }
  std::vector<StepRecord> All(const std::string& id) {
    auto page = m->ListSteps("acme", id, -1, 1000);
    EXPECT_TRUE(page.ok()) << page.status();
    return page.ok() ? page->steps : std::vector<StepRecord>{};
  }

  std::string dir;
  int64_t worker_interval_ms = 3600000;  // the steps threads: tests call them directly
  std::unique_ptr<Store> store;
  std::unique_ptr<DiskBlobStore> blobs;
  StepsDriver driver;
  Metrics metrics;
  std::unique_ptr<EnvironmentManager> m;
};

TEST_F(StepsTest, CreateIsStepZeroAndEveryMutatingCallIsAStep) {
  Start();
  std::string id = NewEnv();
  auto info = m->Get("acme", id);
  ASSERT_TRUE(info.ok());
  EXPECT_TRUE(info->steps.capture);
  EXPECT_EQ(info->steps.head, std::optional<int64_t>(0));
  EXPECT_EQ(info->steps.memory, "snapshot");
  Run(id, "write a.txt hello");
  ASSERT_TRUE(m->WriteFile("acme", id, "b.txt", "bee", 0, true).ok());
  ASSERT_TRUE(m->MakeDir("acme", id, "sub").ok());
  ASSERT_TRUE(m->RenameFile("acme", id, "b.txt", "c.txt", false).ok());
  ASSERT_TRUE(m->RemoveFile("acme", id, "c.txt", false).ok());
  // Reads make no steps.
  ASSERT_TRUE(m->ReadFile("acme", id, "a.txt", 0, 100).ok());
  ASSERT_TRUE(m->ListDir("acme", id, ".").ok());
  std::vector<StepRecord> steps = All(id);
  ASSERT_EQ(steps.size(), 6u);
  const std::vector<std::string> kinds = {"files.remove", "files.rename", "files.mkdir",
                                          "files.write",  "execute",      "create"};
  for (size_t i = 0; i < steps.size(); ++i) {
    EXPECT_EQ(steps[i].kind, kinds[i]);
    EXPECT_EQ(steps[i].n, static_cast<int64_t>(5 - i));
    EXPECT_EQ(steps[i].memory, "snapshot");
    if (steps[i].n > 0) EXPECT_EQ(steps[i].parent, std::optional<int64_t>(steps[i].n - 1));
  }
  EXPECT_FALSE(steps.back().parent.has_value());
  EXPECT_EQ(steps[4].summary, "write a.txt hello");
  EXPECT_EQ(steps[4].exit_code, std::optional<int64_t>(0));
  EXPECT_EQ(steps[4].files_changed, 1);
  EXPECT_EQ(m->Get("acme", id)->steps.head, std::optional<int64_t>(5));
  EXPECT_EQ(m->Get("acme", id)->steps.count, 6);
}

TEST_F(StepsTest, AFailingCommandIsAnErrorStepWithItsOutput) {
  Start();
  std::string id = NewEnv();
  Run(id, "fail");
  auto d = m->GetStep("acme", id, 1);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->record.status, "error");
  EXPECT_EQ(d->record.exit_code, std::optional<int64_t>(3));
  EXPECT_NE(d->record.detail_json.find("it failed"), std::string::npos);
  EXPECT_NE(d->record.detail_json.find("\"command\":\"fail\""), std::string::npos);
}

TEST_F(StepsTest, StepShowsFilesChangesVariablesAndCwd) {
  Start();
  std::string id = NewEnv();
  Run(id, "write a.txt one\n");
  Run(id, "set x 41");
  Run(id, "write a.txt one\ntwo\n");
  Run(id, "cd /workspace/sub");
  auto d = m->GetStep("acme", id, 3);
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_TRUE(d->has_files);
  ASSERT_EQ(d->files.entries.size(), 1u);
  EXPECT_EQ(d->files.entries[0].path, "a.txt");
  ASSERT_EQ(d->changes.size(), 1u);
  EXPECT_EQ(d->changes[0].change, "modified");
  EXPECT_EQ(d->variables_json, R"([{"name":"x","type":"str","repr":"41"}])");
  EXPECT_EQ(m->GetStep("acme", id, 4)->cwd, "/workspace/sub");
  // The file as it was at steps 1 and 3, and the diff of step 3 against 2.
  EXPECT_EQ(*m->ReadStepFile("acme", id, 1, "a.txt"), "one\n");
  EXPECT_EQ(*m->ReadStepFile("acme", id, 3, "/workspace/a.txt"), "one\ntwo\n");
  auto diff = m->DiffStepFile("acme", id, 3, "a.txt");
  ASSERT_TRUE(diff.ok()) << diff.status();
  EXPECT_EQ(diff->change, "modified");
  EXPECT_FALSE(diff->binary);
  EXPECT_NE(diff->diff.find("+two\n"), std::string::npos) << diff->diff;
  EXPECT_NE(diff->diff.find(" one\n"), std::string::npos) << diff->diff;
  EXPECT_TRUE(absl::IsNotFound(m->ReadStepFile("acme", id, 0, "a.txt").status()))
      << "absent at step 0";
}

TEST_F(StepsTest, RewindRestoresTheStateAndKeepsLaterStepsAsABranch) {
  Start();
  std::string id = NewEnv();
  Run(id, "write a.txt v1");
  Run(id, "set x 1");
  Run(id, "write a.txt v2");
  Run(id, "set x 2");
  auto r = m->Rewind("acme", id, 2);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->head, 2);
  EXPECT_EQ(r->memory, "snapshot");
  EXPECT_EQ(r->environment.steps.head, std::optional<int64_t>(2));
  Instance now = driver.Get(id);
  EXPECT_EQ(now.files["a.txt"], "v1");
  EXPECT_EQ(now.vars["x"], "1");
  // Continue after the rewind: the next step's parent is 2; 3 and 4 stay, off the head.
  Run(id, "write a.txt v3");
  std::vector<StepRecord> steps = All(id);
  ASSERT_EQ(steps.size(), 6u);
  EXPECT_EQ(steps[0].n, 5);
  EXPECT_EQ(steps[0].parent, std::optional<int64_t>(2));
  auto page = m->ListSteps("acme", id, -1, 10);
  ASSERT_TRUE(page.ok());
  std::map<int64_t, bool> on_head;
  for (size_t i = 0; i < page->steps.size(); ++i) on_head[page->steps[i].n] = page->on_head[i];
  EXPECT_TRUE(on_head[5] && on_head[2] && on_head[0]);
  EXPECT_FALSE(on_head[3] || on_head[4]);
  // The branch's state is still there: rewind to 4 brings x=2 and v2 back.
  ASSERT_TRUE(m->Rewind("acme", id, 4).ok());
  now = driver.Get(id);
  EXPECT_EQ(now.files["a.txt"], "v2");
  EXPECT_EQ(now.vars["x"], "2");
}

TEST_F(StepsTest, AFailingStepThenRewindToTheStepBeforeAndACorrectedRetry) {
  Start();
  std::string id = NewEnv();
  Run(id, "write data.csv 1,2,3");
  Run(id, "write data.csv garbage");
  Run(id, "fail");
  ASSERT_EQ(All(id)[0].status, "error");
  ASSERT_TRUE(m->Rewind("acme", id, 1).ok());
  EXPECT_EQ(driver.Get(id).files["data.csv"], "1,2,3");
  Run(id, "write out.txt ok");
  auto steps = All(id);
  EXPECT_EQ(steps[0].status, "ok");
  EXPECT_EQ(steps[0].parent, std::optional<int64_t>(1));
}

TEST_F(StepsTest, TwoForksOfOneStepAreIndependent) {
  Start();
  std::string id = NewEnv();
  Run(id, "write a.txt base");
  Run(id, "set x 7");
  auto f1 = m->Fork("acme", id, 2);
  auto f2 = m->Fork("acme", id, 2);
  ASSERT_TRUE(f1.ok()) << f1.status();
  ASSERT_TRUE(f2.ok()) << f2.status();
  EXPECT_EQ(f1->source_id, id);
  EXPECT_EQ(f1->step, 2);
  EXPECT_EQ(f1->memory, "snapshot");
  const std::string a = f1->environment.record.id, b = f2->environment.record.id;
  ASSERT_NE(a, b);
  EXPECT_EQ(driver.Get(a).files["a.txt"], "base");
  EXPECT_EQ(driver.Get(a).vars["x"], "7");
  Run(a, "write a.txt forkA");
  Run(b, "write a.txt forkB");
  EXPECT_EQ(driver.Get(a).files["a.txt"], "forkA");
  EXPECT_EQ(driver.Get(b).files["a.txt"], "forkB");
  EXPECT_EQ(driver.Get(id).files["a.txt"], "base");
  // The fork has its own log: step 0 kind "fork", then its own steps.
  auto fa = All(a);
  ASSERT_EQ(fa.size(), 2u);
  EXPECT_EQ(fa[1].kind, "fork");
  EXPECT_EQ(fa[1].summary, absl::StrCat("fork of ", id, " at step 2"));
  EXPECT_EQ(All(id).size(), 3u) << "forks add nothing to the source's log";
  auto other = m->Fork("evil", id, 2);
  EXPECT_TRUE(IsEnvironmentNotFound(other.status())) << other.status();
}

// A driver that cannot bring a step back because part of its state is gone (an image or blob
// collected, a live snapshot lost) makes rewind and fork answer "collected" (410 at the API),
// not a 400 or 404 that would blame the request; other driver errors pass unchanged.
TEST_F(StepsTest, RewindOrForkOfAStepWhoseStateIsGoneSaysCollected) {
  Start();
  std::string id = NewEnv();
  Run(id, "write a.txt base");
  for (absl::Status gone : {absl::FailedPreconditionError("memory image is gone"),
                            absl::NotFoundError("no blob"), absl::DataLossError("size differs")}) {
    driver.restore_error = gone;
    auto r = m->Rewind("acme", id, 1);
    EXPECT_TRUE(IsStepCollected(r.status())) << r.status();
    auto f = m->Fork("acme", id, 1);
    EXPECT_TRUE(IsStepCollected(f.status())) << f.status();
  }
  driver.restore_error = absl::UnavailableError("agent busy");
  auto r = m->Rewind("acme", id, 1);
  EXPECT_TRUE(absl::IsUnavailable(r.status())) << r.status();
  EXPECT_FALSE(IsStepCollected(r.status()));
  driver.restore_error = absl::OkStatus();
  EXPECT_TRUE(m->Rewind("acme", id, 1).ok());
}

// Attack: destroy an environment while its step is being captured, or while it is being
// rewound. Nothing the capture or the restore made outlives it: no memory snapshot left held
// (a frozen nano worker), no instance re-installed under its id, no step row.
TEST_F(StepsTest, DestroyRacingACaptureOrARewindLeavesNothingBehind) {
  Start();
  std::string id = NewEnv();
  Run(id, "write a.txt base");
  driver.after_capture = [&] { ASSERT_TRUE(m->Destroy("acme", id).ok()); };
  Run(id, "set x 1");
  EXPECT_TRUE(driver.live_snapshots.empty())
      << "the racing capture's snapshot is released (and the destroyed steps' ones)";
  EXPECT_FALSE(m->ListSteps("acme", id, -1, 10).ok());

  std::string id2 = NewEnv();
  Run(id2, "write a.txt base");
  Run(id2, "write a.txt later");
  driver.before_restore = [&] { ASSERT_TRUE(m->Destroy("acme", id2).ok()); };
  auto r = m->Rewind("acme", id2, 1);
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(driver.Count(id2), 0u) << "the instance the restore installed is destroyed";
}

TEST_F(StepsTest, ACaptureFailureNeverFailsTheCall) {
  Start();
  std::string id = NewEnv();
  driver.fail_capture = true;
  auto r = m->Exec("acme", id, ExecRequest{"write a.txt x"}, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  auto steps = All(id);
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0].status, "ok");
  EXPECT_EQ(steps[0].memory, "none");
  ASSERT_TRUE(steps[0].memory_detail.has_value());
  EXPECT_NE(steps[0].memory_detail->find("capture failed: the agent went away"), std::string::npos);
  auto rewind = m->Rewind("acme", id, 1);
  EXPECT_EQ(rewind.status().code(), absl::StatusCode::kAborted) << "a step without state: 409";
  driver.fail_capture = false;
  Run(id, "write b.txt y");
  EXPECT_EQ(*m->ReadStepFile("acme", id, 2, "b.txt"), "y");
}

TEST_F(StepsTest, CaptureOffRecordsNothingAndRewindIsAConflict) {
  Start();
  StepSettings off;
  off.capture = false;
  std::string id = NewEnv("acme", &off);
  Run(id, "write a.txt x");
  EXPECT_TRUE(All(id).empty());
  auto info = m->Get("acme", id);
  EXPECT_FALSE(info->steps.capture);
  EXPECT_FALSE(info->steps.memory_reason.empty());
  EXPECT_EQ(m->Rewind("acme", id, 0).status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(m->Fork("acme", id, 0).status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(driver.captures, 0);
}

TEST_F(StepsTest, ARuntimeWithoutStepsSaysWhy) {
  driver.caps = {Capability::kExec, Capability::kFiles};
  Start();
  std::string id = NewEnv();
  Run(id, "write a.txt x");
  auto info = m->Get("acme", id);
  EXPECT_FALSE(info->steps.capture);
  EXPECT_NE(info->steps.memory_reason.find("does not record steps"), std::string::npos)
      << info->steps.memory_reason;
  EXPECT_TRUE(All(id).empty());
}

TEST_F(StepsTest, NoMemoryOnThisHostIsHonestOnEveryStep) {
  driver.memory = false;
  Start();
  std::string id = NewEnv();
  Run(id, "set x 1");
  for (const StepRecord& s : All(id)) {
    EXPECT_EQ(s.memory, "none");
    EXPECT_EQ(s.memory_detail, std::optional<std::string>("unsupported: no memory here"));
  }
  EXPECT_EQ(m->Get("acme", id)->steps.memory, "none");
  auto r = m->Rewind("acme", id, 0);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->memory, "none");
}

// gVisor: a step's memory is a checkpoint image on disk, counted in the step's bytes, so
// max_bytes collects old images (and releases them) like old file contents.
TEST_F(StepsTest, AnOnDiskMemoryImageCountsTowardsMaxBytes) {
  driver.on_disk = true;
  driver.image_bytes = 15000;
  Start();
  StepSettings s;
  s.max_bytes = 20000;  // two images do not fit
  std::string id = NewEnv("acme", &s);
  Run(id, "set x 1");
  auto steps = All(id);
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_GE(steps[0].bytes, 15000) << "the image counts";
  EXPECT_EQ(steps[0].memory, "snapshot");
  EXPECT_FALSE(steps[0].collected);
  EXPECT_TRUE(steps[1].collected) << "over max_bytes the oldest image goes";
  EXPECT_EQ(steps[1].memory, "none");
  EXPECT_EQ(driver.deleted_snapshots.size(), 1u);
}

// A driver that was asked for memory and took none says why, on the step.
TEST_F(StepsTest, ADriverSaysWhyAStepHasNoMemory) {
  driver.memory_refused = "the checkpoint image is 9 MiB, over the cap of 1 MiB";
  Start();
  std::string id = NewEnv();
  for (const StepRecord& r : All(id)) {
    EXPECT_EQ(r.memory, "none");
    EXPECT_EQ(r.memory_detail,
              std::optional<std::string>(
                  "unsupported: the checkpoint image is 9 MiB, over the cap of 1 MiB"));
  }
}

TEST_F(StepsTest, RetentionCollectsOldStepsAndTheirBlobsButNeverTheHead) {
  Start();
  StepSettings s;
  s.max_steps = 3;
  std::string id = NewEnv("acme", &s);
  Run(id, "write only1.txt first");  // step 1: only1.txt exists only here
  Run(id, "write gone.txt z");
  ASSERT_TRUE(m->RemoveFile("acme", id, "only1.txt", false).ok());
  Run(id, "write b.txt b");
  Run(id, "write c.txt c");
  auto steps = All(id);
  ASSERT_EQ(steps.size(), 6u) << "collected steps keep their summaries";
  int with_state = 0;
  for (const StepRecord& r : steps) {
    if (!r.collected) ++with_state;
    if (r.n <= 2) {
      EXPECT_TRUE(r.collected) << r.n;
      EXPECT_EQ(r.memory_detail, std::optional<std::string>("collected"));
      EXPECT_EQ(r.memory, "none");
    }
  }
  EXPECT_EQ(with_state, 3);
  EXPECT_GE(driver.deleted_snapshots.size(), 3u) << "their memory snapshots were released";
  // only1.txt's contents are referenced by collected steps only: swept, then 410 at step 1.
  const int64_t before = blobs->total_bytes();
  m->SweepStepBlobs();
  EXPECT_LT(blobs->total_bytes(), before);
  auto gone = m->ReadStepFile("acme", id, 1, "only1.txt");
  EXPECT_TRUE(IsStepCollected(gone.status())) << gone.status();
  // Manifests stay: the tree of a collected step is still listed.
  auto d = m->GetStep("acme", id, 1);
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->has_files);
  EXPECT_EQ(m->Rewind("acme", id, 1).status().code(), absl::StatusCode::kAborted);
  // Steps that keep their state are intact, the head included.
  EXPECT_EQ(*m->ReadStepFile("acme", id, 5, "c.txt"), "c");
  EXPECT_EQ(*m->ReadStepFile("acme", id, 3, "gone.txt"), "z");
  ASSERT_TRUE(m->Rewind("acme", id, 3).ok());
  EXPECT_EQ(driver.Get(id).files.count("b.txt"), 0u);
}

TEST_F(StepsTest, MaxBytesAndTtlCollectToo) {
  Start();
  StepSettings s;
  s.max_bytes = 20000;  // two 15000-byte versions of one file do not fit
  std::string id = NewEnv("acme", &s);
  Run(id, "write big.bin " + std::string(15000, 'x'));
  Run(id, "write big.bin " + std::string(15000, 'y'));
  auto steps = All(id);
  EXPECT_FALSE(steps[0].collected) << "the head is never collected";
  EXPECT_TRUE(steps[1].collected) << "over max_bytes the oldest go";
  StepSettings t;
  t.ttl_s = 1;
  std::string id2 = NewEnv("acme", &t);
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  Run(id2, "write a.txt a");
  auto s2 = All(id2);
  EXPECT_TRUE(s2[1].collected) << "step 0 outlived ttl_s";
  EXPECT_FALSE(s2[0].collected);
}

TEST_F(StepsTest, LiveMemoryOverTheCapIsCompactedOldestFirst) {
  Start();
  StepSettings s;
  s.max_live_memory = 2;
  std::string id = NewEnv("acme", &s);
  for (int i = 0; i < 4; ++i) Run(id, absl::StrCat("set x ", i));
  EXPECT_EQ(driver.compacted, 0) << "never on the call's path";
  m->CompactStepMemory();  // what the reaper does every tick
  EXPECT_EQ(driver.live_snapshots.size(), 2u);
  EXPECT_EQ(driver.compacted, 3);
  auto steps = All(id);
  EXPECT_EQ(steps[0].memory, "snapshot");
  EXPECT_TRUE(steps[0].memory_live);
  EXPECT_EQ(steps.back().memory, "snapshot") << "compacted, still a snapshot";
  EXPECT_FALSE(steps.back().memory_live);
  // A driver that cannot compact: the oldest are released and say "collected".
  driver.compact = false;
  Run(id, "set x 9");
  m->CompactStepMemory();
  auto after = All(id);
  EXPECT_EQ(after[2].memory, "none");
  EXPECT_EQ(after[2].memory_detail, std::optional<std::string>("collected"));
  // Rewind to a compacted step still restores memory.
  ExpectRewindRestoresMemory(id, 1, "x", "0");
}

// A driver that compacts or releases live snapshots on its own (nano over its live-memory
// budget, review H3): the steps say so — at the environment's next step, or through the reaper
// when the environment is idle — instead of claiming a live snapshot that is gone.
TEST_F(StepsTest, LiveSnapshotsTheDriverReleasedOnItsOwnAreReconciledHonestly) {
  Start();
  std::string id = NewEnv();
  std::string idle = NewEnv();
  for (int i = 0; i < 3; ++i) Run(id, absl::StrCat("set x ", i));
  Run(idle, "set y 1");
  {
    std::lock_guard<std::mutex> lock(driver.mu);
    // snap1/snap2: the two step 0s; snap3..5: steps 1..3 of `id`; snap6: step 1 of `idle`.
    driver.released["snap3"] = true;   // step 1 of `id` went to an image
    driver.released["snap4"] = false;  // step 2 of `id` was dropped
    driver.released["snap6"] = false;  // the head of `idle` was dropped
  }
  Run(id, "set x 9");  // its retention reconciles on the call's path
  auto steps = All(id);
  ASSERT_EQ(steps.size(), 5u);
  EXPECT_EQ(steps[3].memory, "snapshot");
  EXPECT_FALSE(steps[3].memory_live) << "compacted by the driver";
  EXPECT_EQ(steps[2].memory, "none");
  EXPECT_EQ(steps[2].memory_detail, std::optional<std::string>("collected"));
  EXPECT_TRUE(steps[0].memory_live);
  EXPECT_TRUE(driver.HasReleasedSnapshots()) << "the idle environment's is still pending";
  m->CompactStepMemory();  // the reaper visits the idle environment
  EXPECT_FALSE(driver.HasReleasedSnapshots());
  auto idle_steps = All(idle);
  EXPECT_EQ(idle_steps[0].memory, "none");
  EXPECT_EQ(idle_steps[0].memory_detail, std::optional<std::string>("collected"));
  // Rewind to the step compacted by the driver still restores its memory.
  ExpectRewindRestoresMemory(id, 1, "x", "0");
}

TEST_F(StepsTest, RestartMarksLiveMemoryLostAndKeepsTheLog) {
  Start();
  std::string id = NewEnv();
  Run(id, "write a.txt x");
  Run(id, "set x 1");
  m->Stop();
  m.reset();
  Start();  // the driver's instance is still alive: re-attached
  auto steps = All(id);
  ASSERT_EQ(steps.size(), 3u);
  for (const StepRecord& s : steps) {
    EXPECT_EQ(s.memory, "none");
    EXPECT_EQ(s.memory_detail, std::optional<std::string>("lost_on_restart"));
  }
  auto info = m->Get("acme", id);
  EXPECT_EQ(info->steps.head, std::optional<int64_t>(2));
  EXPECT_EQ(*m->ReadStepFile("acme", id, 1, "a.txt"), "x");
  // Files come back without memory.
  auto r = m->Rewind("acme", id, 1);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->memory, "none");
  Run(id, "write b.txt y");
  EXPECT_EQ(All(id)[0].parent, std::optional<int64_t>(1));
}

// After a restart, the log of an environment that did not survive is dropped, and its snapshots
// that outlive a process (compacted images on disk) are released with it, not left behind.
TEST_F(StepsTest, RestartReleasesTheCompactedSnapshotsOfAnEnvironmentThatDidNotSurvive) {
  Start();
  StepSettings s;
  s.max_live_memory = 1;
  std::string id = NewEnv("acme", &s);
  for (int i = 0; i < 3; ++i) Run(id, absl::StrCat("set x ", i));
  m->CompactStepMemory();
  ASSERT_GE(driver.compacted, 2);
  m->Stop();
  m.reset();
  ASSERT_TRUE(driver.Destroy(InstanceRef{id, "container", id}).ok());  // it died meanwhile
  driver.deleted_snapshots.clear();
  Start();
  EXPECT_EQ(driver.deleted_snapshots.size(), static_cast<size_t>(driver.compacted));
  EXPECT_EQ(*store->CountSteps(id), 0);
}

TEST_F(StepsTest, DestroyDropsTheLogAndReleasesSnapshots) {
  Start();
  std::string id = NewEnv();
  Run(id, "set x 1");
  ASSERT_FALSE(driver.live_snapshots.empty());
  ASSERT_TRUE(m->Destroy("acme", id).ok());
  EXPECT_TRUE(driver.live_snapshots.empty());
  EXPECT_EQ(*store->CountSteps(id), 0);
  EXPECT_TRUE(IsEnvironmentNotFound(m->ListSteps("acme", id, -1, 10).status()));
}

TEST_F(StepsTest, MutatingCallsOnOneEnvironmentAreSerialisedSoHistoryIsLinear) {
  Start();
  std::string id = NewEnv();
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) threads.emplace_back([&] { Run(id, "sleep 30"); });
  for (auto& t : threads) t.join();
  EXPECT_EQ(driver.max_in_flight.load(), 1);
  auto steps = All(id);
  ASSERT_EQ(steps.size(), 5u);
  for (const StepRecord& s : steps)
    if (s.n > 0) EXPECT_EQ(s.parent, std::optional<int64_t>(s.n - 1));
}

TEST_F(StepsTest, ReadsNeverWaitForARunningCall) {
  Start();
  std::string id = NewEnv();
  Run(id, "write a.txt x");
  std::thread slow([&] { Run(id, "sleep 1500"); });
  while (driver.in_flight.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const int64_t t0 = MonotonicMs();
  auto page = m->ListSteps("acme", id, -1, 10);
  auto step = m->GetStep("acme", id, 1);
  auto info = m->Get("acme", id);
  auto file = m->ReadStepFile("acme", id, 1, "a.txt");
  const int64_t took = MonotonicMs() - t0;
  slow.join();
  ASSERT_TRUE(page.ok()) << page.status();
  EXPECT_EQ(page->head, std::optional<int64_t>(1));
  ASSERT_EQ(page->steps.size(), 2u);
  EXPECT_TRUE(page->on_head[0]);
  ASSERT_TRUE(step.ok());
  EXPECT_TRUE(step->on_head);
  EXPECT_EQ(info->steps.head, std::optional<int64_t>(1));
  EXPECT_EQ(*file, "x");
  EXPECT_LT(took, 1000) << "the reads waited for the running call";
  EXPECT_EQ(All(id).size(), 3u);
}

TEST_F(StepsTest, ACompositeStepIsOneStep) {
  Start();
  std::string id = NewEnv();
  {
    auto c = m->BeginCompositeStep("acme", id, "packages.install", "pip install six");
    ASSERT_NE(c, nullptr);
    Run(id, "write site/six.py x");
    ASSERT_TRUE(m->WriteFile("acme", id, "site/six.dist", "y", 0, true).ok());
    c->Finish(absl::OkStatus());
  }
  auto steps = All(id);
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0].kind, "packages.install");
  EXPECT_EQ(steps[0].summary, "pip install six");
  EXPECT_EQ(steps[0].files_changed, 2);
}

// --- attacks ---------------------------------------------------------------------------------

TEST_F(StepsTest, AnotherTenantsStepsAreNotFound) {
  Start();
  std::string id = NewEnv();
  Run(id, "write secret.txt s3cret");
  EXPECT_TRUE(IsEnvironmentNotFound(m->ListSteps("evil", id, -1, 10).status()));
  EXPECT_TRUE(IsEnvironmentNotFound(m->GetStep("evil", id, 1).status()));
  EXPECT_TRUE(IsEnvironmentNotFound(m->ReadStepFile("evil", id, 1, "secret.txt").status()));
  EXPECT_TRUE(IsEnvironmentNotFound(m->DiffStepFile("evil", id, 1, "secret.txt").status()));
  EXPECT_TRUE(IsEnvironmentNotFound(m->Rewind("evil", id, 0).status()));
  EXPECT_EQ(driver.restores, 0);
}

TEST_F(StepsTest, PathTraversalInStepFilesIsRefused) {
  Start();
  std::string id = NewEnv();
  Run(id, "write a.txt x");
  const std::vector<std::string> attacks = {"../etc/passwd",
                                            "/etc/passwd",
                                            "a/../../etc/shadow",
                                            "./a.txt",
                                            "/workspace/../etc/passwd",
                                            "a.txt/",
                                            "",
                                            std::string("a\0b", 3)};
  for (const std::string& p : attacks) {
    auto r = m->ReadStepFile("acme", id, 1, p);
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << p << ": " << r.status();
    EXPECT_TRUE(absl::IsInvalidArgument(m->DiffStepFile("acme", id, 1, p).status())) << p;
  }
}

TEST_F(StepsTest, NegativeStepsAndHugeLimitsAreRefused) {
  Start();
  std::string id = NewEnv();
  EXPECT_TRUE(absl::IsInvalidArgument(m->GetStep("acme", id, -1).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(m->Rewind("acme", id, -1).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(m->Fork("acme", id, -5).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(m->ListSteps("acme", id, -1, 1 << 30).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(m->ListSteps("acme", id, -1, 0).status()));
  EXPECT_TRUE(absl::IsNotFound(m->GetStep("acme", id, int64_t{1} << 50).status()));
  EXPECT_TRUE(absl::IsNotFound(m->Rewind("acme", id, 999).status()));
}

TEST_F(StepsTest, AHostileManifestFromADriverIsRefusedNotStored) {
  WorkspaceManifest bad;
  bad.entries.push_back({.path = "../escape", .sha256 = std::string(64, 'a')});
  EXPECT_FALSE(ValidateManifest(bad).ok());
  WorkspaceManifest unsorted;
  unsorted.entries.push_back({.path = "b", .sha256 = std::string(64, 'a')});
  unsorted.entries.push_back({.path = "a", .sha256 = std::string(64, 'a')});
  EXPECT_FALSE(ValidateManifest(unsorted).ok());
  WorkspaceManifest badkey;
  badkey.entries.push_back({.path = "a", .sha256 = "../../etc/passwd"});
  EXPECT_FALSE(ValidateManifest(badkey).ok());
  EXPECT_FALSE(DecodeManifest("{\"v\":1,\"e\":[[\"/abs\",\"f\",420,1,0,\"\",\"\",\"\"]]}").ok());
}

// H1: a tenant flooding the shared blob store fills only its own share (checked before any
// Put); its captures are then refused with a clear detail, and another tenant's steps still
// capture files and memory.
TEST_F(StepsTest, OneTenantFloodingTheStepStoreCannotStopAnotherTenantsCaptures) {
  auto small = DiskBlobStore::Open(
      {.dir = dir + "/small", .max_total_bytes = 400000, .max_tenant_bytes = 100000});
  ASSERT_TRUE(small.ok()) << small.status();
  blobs = std::move(*small);
  Start();
  StepSettings greedy;
  greedy.max_bytes = kMaxStepBytesSetting;  // more than the store holds: clamped to the share
  greedy.max_steps = kMaxStepsSetting;
  std::vector<std::string> flooders = {NewEnv("mallory", &greedy), NewEnv("mallory", &greedy)};
  auto log = store->GetStepLog("mallory", flooders[0]);
  ASSERT_TRUE(log.ok());
  EXPECT_NE(log->settings_json.find("\"max_bytes\":100000"), std::string::npos)
      << log->settings_json;
  int refused = 0;
  for (int i = 0; i < 12; ++i) {
    const std::string& id = flooders[i % 2];
    auto r = m->Exec("mallory", id,
                     ExecRequest{absl::StrCat("write f", i, ".bin ", std::string(30000, 'a' + i))},
                     nullptr);
    ASSERT_TRUE(r.ok()) << "a refused capture never fails the call: " << r.status();
    EXPECT_LE(blobs->tenant_bytes("mallory"), 100000) << "the share is checked before a Put";
  }
  for (const std::string& id : flooders) {
    auto page = m->ListSteps("mallory", id, -1, 100);
    ASSERT_TRUE(page.ok());
    for (const StepRecord& r : page->steps) {
      if (r.memory_detail && absl::StartsWith(*r.memory_detail,
                                              "unsupported: capture refused: "
                                              "this tenant's share"))
        ++refused;
    }
  }
  EXPECT_GT(refused, 0) << "the flood's captures say why they were refused";
  // The other tenant captures as usual: files, variables and memory.
  std::string id = NewEnv("acme");
  Run(id, "write notes.txt " + std::string(30000, 'n'));
  Run(id, "set x 7");
  auto steps = All(id);
  ASSERT_EQ(steps.size(), 3u);
  for (const StepRecord& r : steps) {
    EXPECT_FALSE(r.manifest_sha.empty()) << r.n << ": " << r.memory_detail.value_or("");
    EXPECT_EQ(r.memory, "snapshot") << r.n;
  }
  EXPECT_EQ(*m->ReadStepFile("acme", id, 2, "notes.txt"), std::string(30000, 'n'));
  EXPECT_TRUE(m->Rewind("acme", id, 1).ok());
  // The flood gave back its older steps; once swept, the flooder's share has room again.
  m->SweepStepBlobs();
  EXPECT_LT(blobs->tenant_bytes("mallory"), 100000);
}

// M1: after steps without state, the base of the next capture is an older step's manifest. When
// retention collects that step and the sweep removes its blobs, the next capture must not reuse
// them (its step would name blobs that are gone).
TEST_F(StepsTest, CaptureNeverReusesTheBlobsOfACollectedBaseStep) {
  driver.reuse_previous = true;
  Start();
  StepSettings s;
  s.ttl_s = 1;
  std::string id = NewEnv("acme", &s);
  Run(id, "write a.txt alpha");  // step 1: the base from here on
  driver.fail_capture = true;
  Run(id, "set x 1");  // step 2: no state
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  Run(id, "set x 2");  // step 3: no state; step 1 expired and is collected
  ASSERT_TRUE(All(id)[2].collected);
  m->SweepStepBlobs();
  ASSERT_FALSE(blobs->ForTenant("acme").Has(Sha256Hex("alpha"))) << "swept with step 1";
  driver.fail_capture = false;
  Run(id, "write b.txt beta");  // step 4
  auto a = m->ReadStepFile("acme", id, 4, "a.txt");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(*a, "alpha");
  ASSERT_TRUE(m->Rewind("acme", id, 4).ok());
  EXPECT_EQ(driver.Get(id).files["a.txt"], "alpha");
}

// M1: a manifest the sweep cannot read may name blobs a step still needs: its tenant keeps
// everything that sweep (fails closed); other tenants are swept as usual.
TEST_F(StepsTest, SweepFailsClosedOnAManifestItCannotRead) {
  Start();
  std::string id = NewEnv();
  Run(id, "write keep.txt precious");
  { ASSERT_TRUE(blobs->ForTenant("acme").Put("acme orphan").ok()); }
  { ASSERT_TRUE(blobs->ForTenant("other").Put("other orphan").ok()); }
  const std::string sha = All(id)[0].manifest_sha;
  const std::string path = absl::StrCat(dir, "/blobs/t/", DiskBlobStore::TenantTag("acme"), "/",
                                        sha.substr(0, 2), "/", sha);
  std::string original;
  ASSERT_TRUE(ReadFileToString(path, &original).ok());
  ASSERT_TRUE(WriteStringToFile(path, "{not a manifest", 0600).ok());  // DataLoss on read
  m->SweepStepBlobs();
  EXPECT_TRUE(blobs->ForTenant("acme").Has(Sha256Hex("precious")));
  EXPECT_TRUE(blobs->ForTenant("acme").Has(Sha256Hex("acme orphan"))) << "nothing swept";
  EXPECT_FALSE(blobs->ForTenant("other").Has(Sha256Hex("other orphan")));
  ASSERT_TRUE(WriteStringToFile(path, original, 0600).ok());
  m->SweepStepBlobs();
  EXPECT_TRUE(blobs->ForTenant("acme").Has(Sha256Hex("precious")));
  EXPECT_FALSE(blobs->ForTenant("acme").Has(Sha256Hex("acme orphan")));
  EXPECT_EQ(*m->ReadStepFile("acme", id, 1, "keep.txt"), "precious");
}

// M2: compaction (a dump can take up to 60 s) runs on its own thread: the reaper still expires
// another environment on time while it runs.
TEST_F(StepsTest, ASlowCompactionDoesNotDelayTheReapersExpiryOfAnotherEnvironment) {
  driver.compact_delay_ms = 2000;
  worker_interval_ms = 50;
  Start(/*reaper_interval_ms=*/50);
  StepSettings s;
  s.max_live_memory = 1;
  std::string busy = NewEnv("acme", &s);
  for (int i = 0; i < 3; ++i) Run(busy, absl::StrCat("set x ", i));
  const int64_t t0 = MonotonicMs();
  while (!driver.compacting && MonotonicMs() - t0 < 2000)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_TRUE(driver.compacting) << "the compactor started";
  auto info = m->Create("acme", EnvSpec{}, 1);  // expires in 1 s
  ASSERT_TRUE(info.ok()) << info.status();
  const int64_t created = MonotonicMs();
  auto expired = [&] {
    auto got = m->Get("acme", info->record.id);
    return !got.ok() || got->record.state == EnvState::kDestroyed;
  };
  while (!expired() && MonotonicMs() - created < 5000)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const int64_t took = MonotonicMs() - created;
  EXPECT_TRUE(expired());
  EXPECT_EQ(m->Get("acme", info->record.id)->record.destroy_reason, "ttl_expired");
  EXPECT_LT(took, 1800) << "expired on time";
  EXPECT_TRUE(driver.compacting) << "while the slow compaction was still running";
}

// ttl_s is enforced by the sweeper thread: steps older than it are collected without a new step.
TEST_F(StepsTest, StepTtlIsEnforcedWithoutANewStep) {
  worker_interval_ms = 50;
  Start();
  StepSettings s;
  s.ttl_s = 1;
  std::string id = NewEnv("acme", &s);
  Run(id, "write a.txt a");
  Run(id, "write b.txt b");
  ASSERT_FALSE(All(id)[1].collected);
  const int64_t t0 = MonotonicMs();
  auto collected = [&] {
    auto steps = All(id);
    return steps[1].collected && steps[2].collected;
  };
  while (!collected() && MonotonicMs() - t0 < 4000)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  auto steps = All(id);
  ASSERT_EQ(steps.size(), 3u) << "no step was added";
  EXPECT_TRUE(steps[1].collected);
  EXPECT_TRUE(steps[2].collected);
  EXPECT_FALSE(steps[0].collected) << "the head is never collected";
  EXPECT_EQ(steps[1].memory_detail, std::optional<std::string>("collected"));
}

// Review L1: an environment was published before its step log was set up, so a call racing
// the create could record a step with the default settings (capture on) although the create
// said "steps": false. The settings are now in effect before any call can see the environment.
TEST_F(StepsTest, ACallRacingTheCreateCannotStepWithDefaultSettings) {
  Start();
  StepSettings off;
  off.capture = false;
  std::string seen;
  std::thread racer;
  std::future<absl::StatusOr<ExecResult>> raced;
  bool raced_in_time = false;
  driver.on_capabilities = [&] {  // inside the create's step set-up
    std::string id;
    {
      std::lock_guard<std::mutex> lock(driver.mu);
      ASSERT_EQ(driver.instances.size(), 1u);
      id = driver.instances.begin()->first;
    }
    auto visible = m->ListSteps("acme", id, -1, 10);  // finds published environments only
    seen = visible.ok() ? "visible" : "hidden";
    std::promise<absl::StatusOr<ExecResult>> p;
    raced = p.get_future();
    racer = std::thread([&, id, p = std::move(p)]() mutable {
      p.set_value(m->Exec("acme", id, ExecRequest{"write a.txt raced"}, nullptr));
    });
    raced_in_time = raced.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  };
  std::string id = NewEnv("acme", &off);
  racer.join();
  EXPECT_EQ(seen, "hidden") << "the environment was visible before its step settings applied";
  EXPECT_TRUE(raced_in_time) << "the racing call waited for the create's step set-up";
  absl::StatusOr<ExecResult> r = raced.get();
  EXPECT_TRUE(IsEnvironmentNotFound(r.status())) << r.status();
  Run(id, "write b.txt after");
  EXPECT_TRUE(All(id).empty());
  EXPECT_EQ(driver.captures, 0);
  EXPECT_FALSE(m->Get("acme", id)->steps.capture);
}

// Review L4: a fork held the source's step lock while the new environment was created
// (seconds for a container), so the source could not work meanwhile. It now holds it only to
// read the step, and pins the step so that retention keeps what the fork copies from.
TEST_F(StepsTest, TheSourceKeepsWorkingWhileAForkIsMadeAndItsStepStaysPinned) {
  Start();
  StepSettings s;
  s.max_steps = 2;
  std::string id = NewEnv("acme", &s);
  Run(id, "write a.txt base");
  Run(id, "set x 7");
  std::future<absl::StatusOr<ExecResult>> during;
  std::thread source;
  bool finished_during_fork = false;
  driver.during_fork = [&] {  // a slow create: the source works meanwhile
    std::promise<absl::StatusOr<ExecResult>> p;
    during = p.get_future();
    source = std::thread([&, p = std::move(p)]() mutable {
      auto r = m->Exec("acme", id, ExecRequest{"write a.txt moved-on"}, nullptr);
      if (r.ok()) r = m->Exec("acme", id, ExecRequest{"write c.txt more"}, nullptr);
      p.set_value(std::move(r));
    });
    finished_during_fork = during.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  };
  auto f = m->Fork("acme", id, 1);
  source.join();
  EXPECT_TRUE(finished_during_fork) << "calls on the source waited for the fork";
  ASSERT_TRUE(during.get().ok());
  ASSERT_TRUE(f.ok()) << f.status() << " (the step was collected during the fork?)";
  EXPECT_EQ(driver.Get(f->environment.record.id).files["a.txt"], "base");
  EXPECT_EQ(driver.Get(id).files["a.txt"], "moved-on");
  // Unpinned after the fork: the next step's retention collects it (max_steps 2).
  Run(id, "write d.txt last");
  auto one = m->GetStep("acme", id, 1);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->record.memory_detail, std::optional<std::string>("collected"));
}

// Review M5: a step's file tree and changes come in windows (a workspace of 100,000 entries
// was rendered whole), with the total and the cursor of the next window.
TEST_F(StepsTest, AStepsFilesAndChangesComeInWindows) {
  Start();
  std::string id = NewEnv();
  for (int i = 0; i < 25; ++i) driver.instances.at(id).files[absl::StrCat("f", 100 + i)] = "x";
  Run(id, "write g.txt y");  // step 1: 26 files added
  std::vector<std::string> seen;
  StepListWindow w;
  w.limit = 10;
  for (int page = 0; page < 5; ++page) {
    auto d = m->GetStep("acme", id, 1, w, w);
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->files_total, 26);
    EXPECT_EQ(d->changes_total, 26);
    EXPECT_LE(d->files.entries.size(), 10u);
    EXPECT_EQ(d->changes.size(), d->files.entries.size());
    for (const ManifestEntry& e : d->files.entries) seen.push_back(e.path);
    if (!d->files_next) break;
    EXPECT_EQ(*d->files_next, d->files.entries.back().path);
    w.after = *d->files_next;
  }
  ASSERT_EQ(seen.size(), 26u);
  EXPECT_TRUE(std::is_sorted(seen.begin(), seen.end()));
  EXPECT_EQ(std::set<std::string>(seen.begin(), seen.end()).size(), 26u);
  auto all = m->GetStep("acme", id, 1);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->files.entries.size(), 26u) << "the default window holds a small tree";
  EXPECT_FALSE(all->files_next.has_value());
}

// Review M4: what retention or the disk lost answers 410 ("collected", or DataLoss: "corrupt"),
// an unchanged path's diff has no change, and a directory is a bad request.
TEST_F(StepsTest, GoneCorruptUnchangedAndDirectoryAnswers) {
  Start();
  std::string id = NewEnv();
  Run(id, "write a.txt base");
  Run(id, "write b.txt other");  // step 2: a.txt unchanged
  auto d = m->DiffStepFile("acme", id, 2, "a.txt");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->change, "") << "unchanged: no change";
  EXPECT_EQ(d->diff, "");
  auto f = m->OpenStepFile("acme", id, 2, "a.txt");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->size, 4);
  EXPECT_EQ(*f->read(0, 100), "base");
  EXPECT_EQ(*f->read(1, 2), "as");
  ASSERT_TRUE(driver.MakeDir({id, "container", id}, "dir").ok());
  Run(id, "write c.txt z");
  EXPECT_TRUE(absl::IsInvalidArgument(m->OpenStepFile("acme", id, 3, "dir").status()));
  // The blob of a.txt corrupted on disk: DataLoss (410 "corrupt"), not a bare 500.
  const std::string key = Sha256Hex("base");
  const std::string tag = DiskBlobStore::TenantTag("acme");
  const std::string blob_path = dir + "/blobs/t/" + tag + "/" + key.substr(0, 2) + "/" + key;
  std::ofstream(blob_path) << "BASE";
  auto bad = m->OpenStepFile("acme", id, 1, "a.txt");
  ASSERT_TRUE(bad.ok());
  auto read = bad->read(0, 100);
  EXPECT_TRUE(absl::IsDataLoss(read.status())) << read.status();
  auto bad_diff = m->DiffStepFile("acme", id, 1, "a.txt");
  EXPECT_TRUE(absl::IsDataLoss(bad_diff.status())) << bad_diff.status();
  // Removed: collected (410).
  ASSERT_TRUE(std::filesystem::remove(blob_path));
  auto gone = bad->read(0, 100);
  EXPECT_TRUE(IsStepCollected(gone.status())) << gone.status();
  EXPECT_TRUE(IsStepCollected(m->ReadStepFile("acme", id, 1, "a.txt").status()));
}

}  // namespace
}  // namespace esb

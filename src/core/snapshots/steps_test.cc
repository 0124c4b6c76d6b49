// Time travel in the core (issue 13): the step log, rewind, fork, retention and restart, with a
// deterministic fake kSteps driver (an in-memory workspace and a "memory" of variables).
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/util.h"
#include "core/environment_manager.h"
#include "core/snapshots/blob_store.h"
#include "core/snapshots/manifest.h"

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
  CapabilitySet Capabilities() const override { return caps; }
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
      auto sha = blobs.Put(data);
      if (!sha.ok()) return sha.status();
      e.sha256 = *sha;
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
    std::lock_guard<std::mutex> lock(mu);
    if (!restore_error.ok()) return restore_error;
    Instance in;
    if (absl::Status st = Apply(in, state, blobs); !st.ok()) return st;
    instances[new_id] = in;
    return InstanceRef{new_id, "container", new_id};
  }
  absl::StatusOr<SnapshotRef> CompactSnapshot(const SnapshotRef& s) override {
    std::lock_guard<std::mutex> lock(mu);
    if (!compact) return absl::UnimplementedError("only live");
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
  int snapshots_made = 0, captures = 0, restores = 0, compacted = 0;
  bool memory = true, compact = true;
  bool on_disk = false;        // memory snapshots are images on disk (live false)
  int64_t image_bytes = 1000;  // their size, with on_disk
  std::string memory_refused;  // set: no memory snapshot, this reason instead
  absl::Status restore_error;  // RestoreStep and ForkStep answer it when set
  std::function<void()> after_capture, before_restore;
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
  EnvironmentManager& Start() {
    ManagerOptions opts;
    opts.pool_size = 0;
    opts.reaper_interval_ms = 3600000;
    opts.default_ttl_s = 600;
    opts.blobs = blobs.get();
    opts.blob_sweep_grace_ms = 0;
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
  std::vector<StepRecord> All(const std::string& id) {
    auto page = m->ListSteps("acme", id, -1, 1000);
    EXPECT_TRUE(page.ok()) << page.status();
    return page.ok() ? page->steps : std::vector<StepRecord>{};
  }

  std::string dir;
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
  auto r = m->Rewind("acme", id, 1);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->memory, "snapshot");
  EXPECT_EQ(driver.Get(id).vars["x"], "0");
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

}  // namespace
}  // namespace esb

// nano_cpython_test: CPython's own regression tests (images/python-wasm/out/stdlib-tests.pack)
// run inside the nano tier through the real host: NanoDriver → fork server → seccomp-confined
// one-shot worker → wasm2c CPython. One gtest per test module; each module is one Run() of a
// small runner that imports `test.<module>`, runs it the way regrtest would (its test_main() if
// it has one, else the module's tests / load_tests) with regrtest's default of no `-u`
// resources, and prints one JSON summary line.
//
// What is asserted:
//   - every module: the run finished (no timeout, no trap), the summary line was printed and at
//     least one test ran;
//   - failures + errors <= AllowedProblems(module): 0 for every module except the few whose
//     known problems are listed there (and explained in docs/nano-cpython-tests.md); the
//     failing tests' ids and exception lines are always printed, never hidden.
//
// Environment: ESBD_PYTHON_WASM = the artefact dir (skipped with a message if unset);
// ESB_BUILD_DIR = the build dir holding esb-nano-worker (default: this build's dir);
// ESB_CPY_MODULES = optional comma-separated subset; ESB_CPY_TIMEOUT_MS (default 180000);
// ESB_CPY_RESOURCES=cpu,decimal: like regrtest -u (default none);
// ESB_CPY_STRICT=1: no known problems allowed; ESB_CPY_SKIPS=1: print skip reasons;
// ESB_CPY_VERBOSE=1: print the failing tests' tracebacks.
// Each module prints one line `CPYTEST|module|run|failures|errors|skipped|seconds|verdict`.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include <boost/json.hpp>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "drivers/nano/nano_driver.h"

namespace esb {
namespace {

const std::vector<std::string>& AllModules() {
  static const std::vector<std::string> kModules = {
      "test_json",       "test_re",        "test_datetime",  "test_collections",
      "test_math",       "test_dataclasses", "test_decimal", "test_fractions",
      "test_statistics", "test_itertools", "test_functools", "test_string",
      "test_textwrap",   "test_base64",    "test_heapq",     "test_bisect",
      "test_enum",       "test_typing",    "test_operator",  "test_copy",
      "test_difflib",    "test_int",       "test_float",     "test_csv",
      "test_hashlib",    "test_random",    "test_struct",    "test_long",
      "test_cmath",      "test_zlib",      "test_binascii",  "test_unicodedata",
      "test_calendar",   "test_pprint",    "test_list",      "test_dict",
      "test_set",        "test_tuple",     "test_sort",      "test_abc",
      "test_shlex",      "test_fnmatch",   "test_keyword",   "test_types",
      "test_genericalias", "test_fstring", "test_format",    "test_contextlib",
      "test_exceptions", "test_grammar",   "test_glob",      "test_pathlib",
      "test_tempfile",
      // Not test_unittest: build.sh strips unittest/test from stdlib.pack, so it has no tests.
  };
  return kModules;
}

// Failures + errors a module may have today (measured under nano, analysed in
// docs/nano-cpython-tests.md); every module not listed must pass fully. A module that gets
// worse than this fails the test; ESB_CPY_STRICT=1 demands zero everywhere.
int AllowedProblems(const std::string& mod) {
  static const std::map<std::string, int> kKnown = {
      {"test_difflib", 1},     // test_difflib_expect.html is not in stdlib-tests.pack
      {"test_random", 2},      // randv2_32.pck is not in stdlib-tests.pack
      {"test_format", 1},      // _testcapi is not built for the guest
      {"test_exceptions", 4},  // _testcapi is not built for the guest
      {"test_contextlib", 4},  // test/data/ not packed; stdlib is .pyc only (no source lines)
      {"test_pathlib", 6},     // wasi-libc futimens(NULL) sets mtime 0; no hard links (design)
  };
  if (getenv("ESB_CPY_STRICT") != nullptr) return 0;
  auto it = kKnown.find(mod);
  return it == kKnown.end() ? 0 : it->second;
}

// The runner executed in the guest. `@MOD@` / `@RES@` are replaced by the module name and the
// resource list.
constexpr char kRunner[] = R"PY(
import importlib, io, json, sys, time, traceback, unittest
import test.support as support
support.use_resources = @RES@   # regrtest's default is [] (no -u resources)
MOD = 'test.@MOD@'
acc = {'module': MOD, 'run': 0, 'failures': 0, 'errors': 0, 'skipped': 0,
       'expected_failures': 0, 'unexpected_successes': 0, 'problems': [], 'skip_reasons': {},
       'tracebacks': []}

def _last_line(tb):
    # The exception line (and an assertion's message after it), not the whole traceback.
    lines = [l for l in tb.strip().splitlines() if l.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i][:1] not in (' ', '\t') and ':' in lines[i] and 'Traceback' not in lines[i]:
            return ' | '.join(x.strip() for x in lines[i:])[:500]
    return lines[-1][:500] if lines else ''

def _record(r):
    acc['run'] += r.testsRun
    acc['failures'] += len(r.failures)
    acc['errors'] += len(r.errors)
    acc['skipped'] += len(r.skipped)
    for _, why in r.skipped:
        why = str(why)[:120]
        acc['skip_reasons'][why] = acc['skip_reasons'].get(why, 0) + 1
    acc['expected_failures'] += len(r.expectedFailures)
    acc['unexpected_successes'] += len(r.unexpectedSuccesses)
    for kind, items in (('FAIL', r.failures), ('ERROR', r.errors)):
        for test, tb in items:
            acc['problems'].append('%s %s: %s' % (kind, test, _last_line(tb)))
            acc['tracebacks'].append('%s %s\n%s' % (kind, test, tb[-3000:]))

def _run_suite(suite):
    _record(unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(suite))

support._run_suite = _run_suite
t0 = time.monotonic()
try:
    m = importlib.import_module(MOD)
    main = getattr(m, 'test_main', None)
    if main is not None:
        main()
    else:
        _run_suite(unittest.TestLoader().loadTestsFromModule(m))
except BaseException as e:
    acc['errors'] += 1
    acc['problems'].append('ERROR (module level) %s: %s' % (
        type(e).__name__, _last_line(traceback.format_exc())))
    acc['tracebacks'].append(traceback.format_exc()[-3000:])
acc['seconds'] = round(time.monotonic() - t0, 2)
sys.stdout.flush()
print('\nESB-CPY-RESULT ' + json.dumps(acc))
)PY";

std::string Env(const char* name) {
  const char* v = getenv(name);
  return v ? v : "";
}

class CpythonRegrtest : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() {
    artefact_dir_ = Env("ESBD_PYTHON_WASM");
    if (artefact_dir_.empty()) {
      skip_reason_ = "ESBD_PYTHON_WASM (the python-wasm artefact dir, e.g. "
                     "images/python-wasm/out) is not set";
      return;
    }
    std::string build = Env("ESB_BUILD_DIR");
    if (build.empty()) build = ESB_BUILD_DIR;
    std::string worker = build + "/esb-nano-worker";
    std::string tests_pack = artefact_dir_ + "/stdlib-tests.pack";
    if (access(tests_pack.c_str(), R_OK) != 0) {
      skip_reason_ = tests_pack + " is missing (build.sh did not produce the tests pack)";
      return;
    }
    absl::StatusOr<NanoDriverOptions> o = PythonNanoOptions(worker, artefact_dir_);
    if (!o.ok()) {
      skip_reason_ = "PythonNanoOptions: " + o.status().ToString();
      return;
    }
    // The tests pack uses the same layout as stdlib.pack (test/...), so `import test.test_x`
    // finds it when it is mounted at the same point.
    o->worker_args.push_back("--pack=" + tests_pack + ":/usr/lib/python3.11");
    o->max_timeout_ms = 1800000;
    o->workspace_max_mb = 256;
    o->workspace_max_files = 20000;
    o->cgroup_name = "esb-nano-test";
    driver_ = NewNanoDriver(*o).release();
  }
  static void TearDownTestSuite() {
    delete driver_;
    driver_ = nullptr;
  }
  void SetUp() override {
    if (driver_ == nullptr) GTEST_SKIP() << skip_reason_;
    std::string only = Env("ESB_CPY_MODULES");
    if (!only.empty()) {
      std::vector<std::string> mods = absl::StrSplit(only, ',', absl::SkipEmpty());
      if (std::find(mods.begin(), mods.end(), GetParam()) == mods.end()) {
        GTEST_SKIP() << GetParam() << " not in ESB_CPY_MODULES";
      }
    }
  }
  static NanoDriver* driver_;
  static std::string artefact_dir_;
  static std::string skip_reason_;
};
NanoDriver* CpythonRegrtest::driver_ = nullptr;
std::string CpythonRegrtest::artefact_dir_;
std::string CpythonRegrtest::skip_reason_;

TEST_P(CpythonRegrtest, Module) {
  const std::string mod = GetParam();
  std::string code = kRunner;
  code.replace(code.find("@MOD@"), 5, mod);
  // ESB_CPY_RESOURCES=cpu,decimal is regrtest's `-u cpu,decimal` (names only: [a-z,]).
  std::string res = "[]";
  std::string want = Env("ESB_CPY_RESOURCES");
  if (!want.empty() && want.find_first_not_of("abcdefghijklmnopqrstuvwxyz,") == want.npos) {
    res = "[";
    std::vector<std::string> names = absl::StrSplit(want, ',', absl::SkipEmpty());
    for (const std::string& n : names) absl::StrAppend(&res, "'", n, "',");
    res += "]";
  }
  code.replace(code.find("@RES@"), 5, res);
  RunRequest req;
  req.code = code;
  std::string t = Env("ESB_CPY_TIMEOUT_MS");
  req.timeout_ms = t.empty() ? 180000 : std::atoll(t.c_str());
  req.memory_limit_mb = 2048;
  req.max_output_bytes = 16 << 20;
  auto start = std::chrono::steady_clock::now();
  absl::StatusOr<RunResult> r = driver_->RunCode(nullptr, req, nullptr);
  double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->timed_out) << mod << " timed out after " << req.timeout_ms << " ms";
  EXPECT_EQ(r->exit_code, 0) << r->stderr_data.substr(0, 4000);

  size_t at = r->stdout_data.rfind("ESB-CPY-RESULT ");
  if (at == std::string::npos) {
    printf("CPYTEST|%s|-|-|-|-|%.1f|no result (exit %d%s)\n", mod.c_str(), wall, r->exit_code,
           r->timed_out ? ", timed out" : "");
    ADD_FAILURE() << mod << ": no summary line; exit " << r->exit_code << "\nstderr tail:\n"
                  << r->stderr_data.substr(r->stderr_data.size() > 3000
                                               ? r->stderr_data.size() - 3000 : 0);
    return;
  }
  std::string line = r->stdout_data.substr(at + 15);
  line = line.substr(0, line.find('\n'));
  boost::system::error_code ec;
  boost::json::value v = boost::json::parse(line, ec);
  ASSERT_FALSE(ec) << "bad summary line: " << line;
  const boost::json::object& o = v.as_object();
  auto num = [&](const char* k) { return o.at(k).to_number<int64_t>(); };
  int64_t run = num("run"), failures = num("failures"), errors = num("errors");
  int64_t skipped = num("skipped");
  printf("CPYTEST|%s|%lld|%lld|%lld|%lld|%.1f|%s\n", mod.c_str(), static_cast<long long>(run),
         static_cast<long long>(failures), static_cast<long long>(errors),
         static_cast<long long>(skipped), wall,
         failures + errors == 0 ? "pass" : "FAIL");
  for (const auto& p : o.at("problems").as_array()) {
    printf("  %s\n", std::string(p.as_string()).c_str());
  }
  if (getenv("ESB_CPY_VERBOSE") != nullptr) {
    for (const auto& tb : o.at("tracebacks").as_array()) {
      printf("----\n%s\n", std::string(tb.as_string()).c_str());
    }
  }
  if (getenv("ESB_CPY_SKIPS") != nullptr) {
    for (const auto& [why, n] : o.at("skip_reasons").as_object()) {
      printf("  skipped %lld: %s\n", static_cast<long long>(n.to_number<int64_t>()),
             std::string(why).c_str());
    }
  }
  fflush(stdout);
  EXPECT_GT(run, 0) << mod << " ran no tests";
  int allowed = AllowedProblems(mod);
  EXPECT_LE(failures + errors, allowed)
      << mod << ": " << failures << " failures + " << errors << " errors, " << allowed
      << " known (listed above)";
  if (failures + errors > 0 && failures + errors <= allowed) {
    printf("  (%s: %lld known problem(s), see docs/nano-cpython-tests.md)\n", mod.c_str(),
           static_cast<long long>(failures + errors));
  }
}

INSTANTIATE_TEST_SUITE_P(Nano, CpythonRegrtest, ::testing::ValuesIn(AllModules()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace esb

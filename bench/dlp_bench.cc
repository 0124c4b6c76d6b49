// DLP throughput (issue 12): the default rule set on 64 KiB bodies of mixed text, MB/s per core
// (thread CPU time, so other load on the machine does not count), the engine (Vectorscan for
// secrets, the number and e-mail scanners for PII, RE2 to locate and validators)
// vs the same engine with every detect pattern in one RE2::Set, same corpus, same run,
// alternating rounds. Also the secret-only and PII-only rule subsets, to show where time goes,
// and the default set on a second corpus: chat-style JSON request bodies (prose and code with
// JSON escapes, so the JSON view is decoded and scanned too; dlp_test_util.h ChatJson).
//   dlp_bench [--bodies N] [--body-kib K] [--rounds R] [--config DLP_JSON [--corpus chat]]
//             [--profile 1]
// --profile 1 runs only our engine (for `perf record`; no baseline, no ratio).
// --config replaces the rule sets by one DLP config (e.g. '{"rules": {"phone": "off"}}') on
// the mixed corpus (--corpus chat: on the chat corpus).
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "governance/dlp/dlp.h"
#include "governance/dlp/dlp_test_util.h"

namespace dlp = esb::governance::dlp;

namespace {

double ThreadSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

struct Round {
  double mb_per_s;
  size_t findings;
};

Round ScanAll(const dlp::Engine& engine, const std::vector<std::string>& bodies) {
  size_t bytes = 0, findings = 0;
  const double start = ThreadSeconds();
  for (const std::string& body : bodies) {
    findings += engine.ScanText(body, dlp::Where::kBody).findings.size();
    bytes += body.size();
  }
  const double seconds = ThreadSeconds() - start;
  return {bytes / seconds / 1e6, findings};
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::shared_ptr<const dlp::Engine> Compile(const std::string& rules_json, bool vectorscan) {
  auto config = dlp::ParseDlpConfig(boost::json::parse(rules_json));
  if (!config.ok()) {
    std::fprintf(stderr, "config: %s\n", std::string(config.status().message()).c_str());
    std::exit(1);
  }
  auto engine = dlp::Engine::Compile(*config, dlp::EngineOptions{.vectorscan = vectorscan});
  if (!engine.ok()) {
    std::fprintf(stderr, "compile: %s\n", std::string(engine.status().message()).c_str());
    std::exit(1);
  }
  return *engine;
}

}  // namespace

int main(int argc, char** argv) {
  size_t n_bodies = 512, body_kib = 64;
  int rounds = 3;
  std::string only_config;
  bool profile = false;
  bool chat_only = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--bodies")) n_bodies = std::stoul(argv[i + 1]);
    if (!std::strcmp(argv[i], "--body-kib")) body_kib = std::stoul(argv[i + 1]);
    if (!std::strcmp(argv[i], "--rounds")) rounds = std::stoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--config")) only_config = argv[i + 1];
    if (!std::strcmp(argv[i], "--profile")) profile = std::strcmp(argv[i + 1], "0") != 0;
    if (!std::strcmp(argv[i], "--corpus")) chat_only = !std::strcmp(argv[i + 1], "chat");
  }
  std::vector<std::string> bodies, chat;
  for (size_t i = 0; i < n_bodies; ++i) {
    // A planted sample in every 4th body, cycling through the 15 detectors.
    const int plant = i % 4 == 0 ? static_cast<int>(i / 4) : -1;
    bodies.push_back(dlp::testing::MixedText(body_kib * 1024, i + 1, plant));
    chat.push_back(dlp::testing::ChatJson(body_kib * 1024, i + 1, plant));
  }
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    char buf[64] = {};
    if (std::fgets(buf, sizeof(buf), f) != nullptr) std::printf("load average at start: %s", buf);
    std::fclose(f);
  }
  std::printf(
      "corpus: %zu bodies x %zu KiB of mixed text (seeded; ~15%% numeric tokens, hex, "
      "base64, JSON punctuation), a planted sample in every 4th body; the chat corpus: as many "
      "chat-style JSON bodies of prose and code with JSON escapes, same plants\n",
      n_bodies, body_kib);

  const char* kPii = R"("credit_card": "off", "iban": "off", "us_ssn": "off", "email": "off",
                        "phone": "off")";
  const char* kSecrets = R"("aws_access_key": "off", "aws_secret_key": "off",
      "github_token": "off", "slack_token": "off", "slack_webhook": "off",
      "google_api_key": "off", "openai_api_key": "off", "anthropic_api_key": "off",
      "private_key": "off", "jwt": "off")";
  struct Set {
    std::string name;
    std::string json;
    const std::vector<std::string>* corpus;
  };
  std::vector<Set> sets = {
      {"all 15 rules (default)", "{}", &bodies},
      {"10 secret rules", std::string("{\"rules\": {") + kPii + "}}", &bodies},
      {"5 PII/financial rules", std::string("{\"rules\": {") + kSecrets + "}}", &bodies},
      {"chat JSON, all 15 rules", "{}", &chat},
  };
  if (!only_config.empty()) sets = {{"--config", only_config, chat_only ? &chat : &bodies}};
  std::printf("%-24s | %-28s | %9s | %9s | %8s\n", "rule set", "engine", "min MB/s", "med MB/s",
              "findings");
  std::printf("%s\n", std::string(90, '-').c_str());
  for (const Set& set : sets) {
    auto vs = Compile(set.json, true);
    auto re2 = Compile(set.json, false);
    std::vector<double> vs_rates, re2_rates;
    size_t vs_findings = 0, re2_findings = 0;
    for (int r = 0; r < rounds; ++r) {
      const Round a = ScanAll(*vs, *set.corpus);
      const Round b = profile ? Round{1, a.findings} : ScanAll(*re2, *set.corpus);
      vs_rates.push_back(a.mb_per_s);
      re2_rates.push_back(b.mb_per_s);
      vs_findings = a.findings;
      re2_findings = b.findings;
    }
    std::printf("%-24s | %-28s | %9.0f | %9.0f | %8zu\n", set.name.c_str(),
                "ours: Vectorscan + scanners", *std::min_element(vs_rates.begin(), vs_rates.end()),
                Median(vs_rates), vs_findings);
    std::printf("%-24s | %-28s | %9.0f | %9.0f | %8zu\n", "", "RE2::Set only (baseline)",
                *std::min_element(re2_rates.begin(), re2_rates.end()), Median(re2_rates),
                re2_findings);
    std::printf("%-24s | ratio (median): %.2fx; target 1000 MB/s per core: %s\n", "",
                Median(vs_rates) / Median(re2_rates), Median(vs_rates) >= 1000 ? "met" : "NOT met");
    if (vs_findings != re2_findings) {
      std::printf("WARNING: the engines disagree on the findings (%zu vs %zu)\n", vs_findings,
                  re2_findings);
    }
  }
  return 0;
}

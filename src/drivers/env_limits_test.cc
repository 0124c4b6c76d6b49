#include "drivers/env_limits.h"

#include <gtest/gtest.h>

#include <cmath>

namespace esb {
namespace {

EnvLimitCaps Caps() {
  EnvLimitCaps c;
  c.cpus = 4;
  c.max_memory_mb = 2048;
  c.max_pids = 512;
  c.max_disk_mb = 1024;
  return c;
}

TEST(EnvLimitsTest, OneRangePerLimit) {
  EnvLimitTable t = EnvLimits(Caps());
  EXPECT_EQ(t.cpu.min, 0.1);
  EXPECT_EQ(t.cpu.max, 4);
  EXPECT_EQ(t.memory_mb.min, 32);
  EXPECT_EQ(t.memory_mb.max, 2048);
  EXPECT_EQ(t.pids.min, 16);
  EXPECT_EQ(t.pids.max, 512);
  EXPECT_EQ(t.disk_mb.min, 16);
  EXPECT_EQ(t.disk_mb.max, 1024);
  EnvLimitCaps none = Caps();
  none.cpus = 0;  // unknown CPU count: one CPU
  EXPECT_EQ(EnvLimits(none).cpu.max, 1);
}

TEST(EnvLimitsTest, EdgesAreInsideAndOneStepOutIsRefusedWithTheRange) {
  EnvSpec ok;
  ok.cpu = 4;
  ok.memory_mb = 32;
  ok.pids = 512;
  ok.disk_mb = 16;
  EXPECT_TRUE(CheckEnvLimits(ok, Caps()).ok());
  struct Case {
    EnvSpec spec;
    std::string message;
  };
  std::vector<Case> cases;
  auto with = [&](auto set, std::string message) {
    EnvSpec s = ok;
    set(s);
    cases.push_back({s, message});
  };
  with([](EnvSpec& s) { s.cpu = 4.5; }, "cpu 4.5 is outside 0.1..4 (the host's CPUs)");
  with([](EnvSpec& s) { s.cpu = 0.05; }, "cpu 0.05 is outside");
  with([](EnvSpec& s) { s.cpu = std::nan(""); }, "cpu nan is outside");
  with([](EnvSpec& s) { s.memory_mb = 31; }, "memory_mb 31 is outside 32..2048 (max_memory_mb)");
  with([](EnvSpec& s) { s.memory_mb = 1LL << 60; }, "memory_mb");
  with([](EnvSpec& s) { s.pids = 513; }, "pids 513 is outside 16..512 (max_pids)");
  with([](EnvSpec& s) { s.pids = 15; }, "pids 15");
  with([](EnvSpec& s) { s.disk_mb = 1025; }, "disk_mb 1025 is outside 16..1024 (max_disk_mb)");
  with([](EnvSpec& s) { s.disk_mb = -1; }, "disk_mb -1");
  for (const Case& c : cases) {
    absl::Status st = CheckEnvLimits(c.spec, Caps());
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << c.message;
    EXPECT_NE(std::string(st.message()).find(c.message), std::string::npos) << st;
  }
}

}  // namespace
}  // namespace esb

#include "core/driver_registry.h"

#include <gtest/gtest.h>

#include "drivers/testing/stub_driver.h"

namespace esb {
namespace {

using Tier = DriverRegistry::Tier;

TEST(DriverRegistryTest, ProbedDriverIsAvailableWithItsDescription) {
  DriverRegistry r;
  r.Register("container", Tier::kHeavy,
             [] { return std::make_unique<testing::StubDriver>("container"); });
  ASSERT_NE(r.Find("container"), nullptr);
  EXPECT_EQ(r.Find("container")->name(), "container");
  const DriverRegistry::Entry* e = r.Lookup("container");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->description, "stub container");
  EXPECT_EQ(e->tier, Tier::kHeavy);
  EXPECT_TRUE(e->unavailable.empty());
  EXPECT_EQ(r.Available().size(), 1u);
}

TEST(DriverRegistryTest, FailedProbeRecordsWhyAndOffersNoDriver) {
  DriverRegistry r;
  r.Register("gvisor", Tier::kHeavy, []() -> absl::StatusOr<std::unique_ptr<Driver>> {
    return absl::UnavailableError("runsc is not installed");
  });
  r.RegisterUnavailable("microvm", Tier::kHeavy, "not built yet");
  EXPECT_EQ(r.Find("gvisor"), nullptr);
  EXPECT_EQ(r.Lookup("gvisor")->unavailable, "runsc is not installed");
  EXPECT_EQ(r.Lookup("microvm")->unavailable, "not built yet");
  EXPECT_TRUE(r.Available().empty());
  EXPECT_EQ(r.Lookup("nano"), nullptr);  // never registered
  EXPECT_EQ(r.Find("nano"), nullptr);
}

TEST(DriverRegistryTest, EntriesKeepRegistrationOrderAndTiers) {
  DriverRegistry r;
  r.Register("container", Tier::kHeavy, [] { return std::make_unique<testing::StubDriver>(); });
  r.Register("nano", Tier::kNano, [] { return std::make_unique<testing::StubDriver>(); });
  r.RegisterUnavailable("microvm", Tier::kHeavy, "no");
  ASSERT_EQ(r.entries().size(), 3u);
  EXPECT_EQ(r.entries()[0].name, "container");
  EXPECT_EQ(r.entries()[1].name, "nano");
  EXPECT_EQ(r.entries()[1].tier, Tier::kNano);
  EXPECT_EQ(DriverTierName(r.entries()[1].tier), "nano");
  EXPECT_EQ(r.entries()[2].name, "microvm");
  EXPECT_EQ(r.Available().count("nano"), 1u);
  EXPECT_EQ(r.Available().count("microvm"), 0u);
}

TEST(DriverRegistryTest, RegisteringANameAgainReplacesTheEntry) {
  DriverRegistry r;
  r.RegisterUnavailable("nano", Tier::kNano, "no python.wasm");
  r.Register("nano", Tier::kNano, [] { return std::make_unique<testing::StubDriver>("nano"); });
  EXPECT_EQ(r.entries().size(), 1u);
  EXPECT_NE(r.Find("nano"), nullptr);
  EXPECT_TRUE(r.Lookup("nano")->unavailable.empty());
}

}  // namespace
}  // namespace esb

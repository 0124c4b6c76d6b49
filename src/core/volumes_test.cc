#include "core/volumes.h"

#include <gtest/gtest.h>

#include <string>

namespace esb {
namespace {

TEST(VolumesTest, NamesAreLowercaseDigitsAndDashes) {
  EXPECT_TRUE(ValidateVolumeName("data").ok());
  EXPECT_TRUE(ValidateVolumeName("a-1").ok());
  EXPECT_TRUE(ValidateVolumeName(std::string(63, 'a')).ok());
  for (const char* bad : {"", "-x", "Data", "a_b", "a/b", "..", "a.b", "a b", "\xc3\xa9"}) {
    EXPECT_EQ(ValidateVolumeName(bad).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_FALSE(ValidateVolumeName(std::string(64, 'a')).ok());
}

TEST(VolumesTest, PathsStayBelowMnt) {
  EXPECT_TRUE(ValidateVolumePath("/mnt/data").ok());
  EXPECT_TRUE(ValidateVolumePath("/mnt/a/b.c_d-E").ok());
  for (const char* bad : {"",
                          "/",
                          "/mnt",
                          "/mnt/",
                          "mnt/data",
                          "/proc",
                          "/sys/x",
                          "/dev/shm",
                          "/run/esb",
                          "/workspace",
                          "/workspace/data",
                          "/etc",
                          "/mnt/../etc",
                          "/mnt/./x",
                          "/mnt/a//b",
                          "/mnt/a/",
                          "/mnt/a/..",
                          "/mntx/data",
                          "/mnt/a b",
                          "/mnt/a\nb"}) {
    EXPECT_EQ(ValidateVolumePath(bad).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_FALSE(ValidateVolumePath("/mnt/" + std::string(251, 'a')).ok());
  EXPECT_TRUE(ValidateVolumePath("/mnt/" + std::string(250, 'a')).ok());
}

TEST(VolumesTest, SizeWithinLimit) {
  EXPECT_TRUE(ValidateVolumeSize(16, 1024).ok());
  EXPECT_TRUE(ValidateVolumeSize(1024, 1024).ok());
  EXPECT_FALSE(ValidateVolumeSize(15, 1024).ok());
  EXPECT_FALSE(ValidateVolumeSize(1025, 1024).ok());
  EXPECT_FALSE(ValidateVolumeSize(-1, 1024).ok());
}

TEST(VolumesTest, KeysSeparateTenants) {
  EXPECT_NE(VolumeKey("acme", "data"), VolumeKey("evil", "data"));
  EXPECT_EQ(VolumeKey("acme", "data"), VolumeKey("acme", "data"));
  EXPECT_EQ(VolumeKey("acme", "data").size(), 16u + 1 + 4);
  EXPECT_EQ(VolumeKey("acme", "data").substr(16), "/data");
}

}  // namespace
}  // namespace esb

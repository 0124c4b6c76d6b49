#include "packages/wheel.h"

#include <gtest/gtest.h>

namespace esb::packages {
namespace {

int Score(const char* filename, const Target& t = Target{}) {
  auto w = ParseWheelFilename(filename);
  EXPECT_TRUE(w.ok()) << filename << ": " << w.status();
  return w.ok() ? WheelScore(*w, t) : -2;
}

TEST(WheelFilenameTest, Parses) {
  auto w = ParseWheelFilename("Foo_Bar-1.2.3-py2.py3-none-any.whl");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->name, "foo-bar");
  EXPECT_EQ(w->version.ToString(), "1.2.3");
  EXPECT_EQ(w->build_tag, "");
  EXPECT_EQ(w->python_tags, (std::vector<std::string>{"py2", "py3"}));
  EXPECT_EQ(w->abi_tags, (std::vector<std::string>{"none"}));
  EXPECT_EQ(w->platform_tags, (std::vector<std::string>{"any"}));

  w = ParseWheelFilename(
      "numpy-1.26.4-1-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->build_tag, "1");
  EXPECT_EQ(w->platform_tags.size(), 2u);
}

TEST(WheelFilenameTest, Rejects) {
  for (const char* bad : {"foo-1.0.tar.gz", "foo-1.0-py3-none.whl", "foo-1.0-x-py3-none-any.whl",
                          "../foo-1.0-py3-none-any.whl", "foo-bar-1.0-1-2-py3-none-any.whl",
                          "foo-notaversion-py3-none-any.whl", "foo-1.0--none-any.whl",
                          "foo/x-1.0-py3-none-any.whl", ".foo-1.0-py3-none-any.whl"}) {
    EXPECT_FALSE(ParseWheelFilename(bad).ok()) << bad;
  }
}

TEST(WheelScoreTest, Compatibility) {
  EXPECT_GE(Score("a-1-py3-none-any.whl"), 0);
  EXPECT_GE(Score("a-1-py2.py3-none-any.whl"), 0);
  EXPECT_GE(Score("a-1-py311-none-any.whl"), 0);
  EXPECT_EQ(Score("a-1-py312-none-any.whl"), -1);
  EXPECT_EQ(Score("a-1-py2-none-any.whl"), -1);
  EXPECT_GE(Score("a-1-cp311-cp311-manylinux_2_17_x86_64.whl"), 0);
  EXPECT_GE(Score("a-1-cp311-cp311-manylinux1_x86_64.whl"), 0);
  EXPECT_GE(Score("a-1-cp311-cp311-manylinux2010_x86_64.whl"), 0);
  EXPECT_GE(Score("a-1-cp311-cp311-manylinux2014_x86_64.whl"), 0);
  EXPECT_GE(Score("a-1-cp311-cp311-manylinux_2_36_x86_64.whl"), 0);
  EXPECT_EQ(Score("a-1-cp311-cp311-manylinux_2_37_x86_64.whl"), -1);
  EXPECT_EQ(Score("a-1-cp311-cp311-linux_x86_64.whl"), -1);
  EXPECT_EQ(Score("a-1-cp311-cp311-manylinux2014_aarch64.whl"), -1);
  EXPECT_EQ(Score("a-1-cp311-cp311-musllinux_1_1_x86_64.whl"), -1);
  EXPECT_EQ(Score("a-1-cp311-cp311-win_amd64.whl"), -1);
  EXPECT_EQ(Score("a-1-cp310-cp310-manylinux2014_x86_64.whl"), -1);
  EXPECT_EQ(Score("a-1-cp312-cp312-manylinux2014_x86_64.whl"), -1);
  EXPECT_GE(Score("a-1-cp38-abi3-manylinux2014_x86_64.whl"), 0);
  EXPECT_EQ(Score("a-1-cp312-abi3-manylinux2014_x86_64.whl"), -1);
  EXPECT_EQ(Score("a-1-pp39-pypy39_pp73-manylinux2014_x86_64.whl"), -1);
  EXPECT_EQ(Score("a-1-cp311-cp310-manylinux2014_x86_64.whl"), -1);
  EXPECT_EQ(Score("a-1-py3-abi3-any.whl"), -1);
  // A multi-platform wheel is compatible if one tag is.
  EXPECT_GE(Score("a-1-cp311-cp311-macosx_11_0_arm64.manylinux2014_x86_64.whl"), 0);
  Target arm;
  arm.arch = "aarch64";
  EXPECT_GE(Score("a-1-cp311-cp311-manylinux2014_aarch64.whl", arm), 0);
  Target old_glibc;
  old_glibc.glibc_minor = 12;
  EXPECT_EQ(Score("a-1-cp311-cp311-manylinux2014_x86_64.whl", old_glibc), -1);
  EXPECT_GE(Score("a-1-cp311-cp311-manylinux2010_x86_64.whl", old_glibc), 0);
}

TEST(WheelScoreTest, Ordering) {
  int native = Score("a-1-cp311-cp311-manylinux_2_17_x86_64.whl");
  int abi3_new = Score("a-1-cp311-abi3-manylinux_2_17_x86_64.whl");
  int abi3_old = Score("a-1-cp38-abi3-manylinux_2_17_x86_64.whl");
  int pure = Score("a-1-py3-none-any.whl");
  EXPECT_GT(native, abi3_new);
  EXPECT_GT(abi3_new, abi3_old);
  EXPECT_GT(abi3_old, pure);
  EXPECT_GT(Score("a-1-cp311-cp311-manylinux_2_28_x86_64.whl"),
            Score("a-1-cp311-cp311-manylinux2014_x86_64.whl"));
}

TEST(SdistTest, Versions) {
  EXPECT_TRUE(IsSdistFilename("foo-1.0.tar.gz"));
  EXPECT_FALSE(IsSdistFilename("foo-1.0-py3-none-any.whl"));
  EXPECT_EQ(SdistVersion("foo-bar-1.0.tar.gz", "foo-bar"), "1.0");
  EXPECT_EQ(SdistVersion("Foo_Bar-2.0rc1.zip", "foo-bar"), "2.0rc1");
  EXPECT_EQ(SdistVersion("foo-1.0.tar.gz", "foo-bar"), "");
}

}  // namespace
}  // namespace esb::packages

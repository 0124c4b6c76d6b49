// The heavy kernel as esbd ships it: kernel.py with esb_vars.py's source prepended, and the
// validation of the variables summary a cell reports (sandbox-written, hostile).
#include "drivers/heavy_kernel.h"

#include <gtest/gtest.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <fstream>
#include <string>

namespace esb {
namespace {

TEST(ShippedHeavyKernelTest, CarriesEsbVarsSourceExactlyAndStillParses) {
  const std::string& shipped = ShippedHeavyKernel();
  ASSERT_EQ(shipped.rfind("_ESB_VARS_SOURCE = '", 0), 0u);
  EXPECT_NE(shipped.find(std::string(HeavyKernelSource())), std::string::npos);
  char path[] = "/tmp/esb-shipped-kernel-XXXXXX";
  int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  std::ofstream(path, std::ios::binary) << shipped;
  char vars[] = "/tmp/esb-vars-source-XXXXXX";
  fd = mkstemp(vars);
  ASSERT_GE(fd, 0);
  close(fd);
  std::ofstream(vars, std::ios::binary) << EsbVarsSource();
  // The literal is the file's exact text, and the kernel still compiles with it in front.
  const std::string check = std::string("/usr/bin/python3 -c \"import ast,sys; t=open('") + path +
                            "',encoding='utf-8').read(); m=ast.parse(t); v=m.body[0].value.value; "
                            "sys.exit(0 if v==open('" +
                            vars + "',encoding='utf-8').read() else 3)\"";
  EXPECT_EQ(system(check.c_str()), 0) << check;
  unlink(path);
  unlink(vars);
}

TEST(ValidVariablesJsonTest, KeepsASummaryAndDropsAnythingElse) {
  EXPECT_EQ(ValidVariablesJson(R"([{"name":"x","type":"int","repr":"1"}])"),
            R"([{"name":"x","type":"int","repr":"1"}])");
  EXPECT_EQ(ValidVariablesJson("[]"), "[]");
  for (const std::string bad :
       {std::string(""), std::string("{}"), std::string("[1]"), std::string(R"([{"type":"int"}])"),
        std::string("[{"), std::string(R"([{"name":1}])")}) {
    EXPECT_EQ(ValidVariablesJson(bad), "") << bad;
  }
  // Over 64 KiB, or a shape bomb, is refused unparsed.
  std::string big = R"([{"name":")" + std::string(70000, 'a') + R"("}])";
  EXPECT_EQ(ValidVariablesJson(big), "");
  std::string bomb = "[";
  for (int i = 0; i < 10000; ++i) bomb += "[],";
  bomb += "[]]";
  EXPECT_EQ(ValidVariablesJson(bomb), "");
}

}  // namespace
}  // namespace esb

// libFuzzer entry point: ExtractImports must accept any bytes without crashing, and its output
// must be self-consistent. Build and run: see src/router/CMakeLists.txt.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "router/imports.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view src(reinterpret_cast<const char*>(data), size);
  esb::router::ImportScan scan = esb::router::ExtractImports(src);
  // Every top-level module comes from some dotted name; nothing is empty.
  for (const auto& m : scan.modules) {
    if (m.empty() || m.find('.') != std::string::npos) abort();
  }
  for (const auto& d : scan.dotted) {
    if (d.empty() || d.front() == '.' || d.back() == '.') abort();
  }
  for (const auto& r : scan.relative) {
    if (r.level < 1) abort();
  }
  if (scan.warnings.size() > esb::router::kMaxWarnings) abort();
  return 0;
}

// router_scan FILE...: prints one tab-separated line per file with what ExtractImports found:
// path, dynamic flag (0/1), dotted names, relative imports (level:module), warning count.
// A debugging aid and the engine of the ast cross-check test (crosscheck_ast.py).
#include <fstream>
#include <iostream>
#include <sstream>

#include "router/imports.h"

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::ifstream in(argv[i], std::ios::binary);
    if (!in) {
      std::cerr << "router_scan: cannot read " << argv[i] << "\n";
      return 1;
    }
    std::stringstream buf;
    buf << in.rdbuf();
    esb::router::ImportScan scan = esb::router::ExtractImports(buf.str());
    std::cout << argv[i] << '\t' << scan.has_dynamic_import << '\t';
    for (const std::string& d : scan.dotted) std::cout << d << ' ';
    std::cout << '\t';
    for (const auto& r : scan.relative) std::cout << r.level << ':' << r.module << ' ';
    std::cout << '\t' << scan.warnings.size() << '\n';
  }
  return 0;
}

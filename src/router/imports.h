// Static import extraction for Python source: which modules a snippet needs, found by a
// tokenizer that knows Python's lexical structure (strings, comments, continuations), without
// executing or fully parsing the code. Used by the router to pick the nano or heavy tier.
//
// Depends only on the C++ standard library so the fuzz target can link it alone.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace esb::router {

// `from . import x` → {1, "", {"x"}}; `from ..pkg.mod import y, z` → {2, "pkg.mod", {"y", "z"}};
// `importlib.import_module(".sub")` → {1, "sub", {}}.
struct RelativeImport {
  int level = 0;
  std::string module;
  std::vector<std::string> names;
};

struct ImportScan {
  // Top-level absolute module names in first-seen order, unique: `import a.b` → "a".
  std::vector<std::string> modules;
  // Absolute dotted names in first-seen order, unique: `import a.b` → "a.b";
  // `from x.y import z` → "x.y" and "x.y.z" (z may be a submodule or just an attribute).
  std::vector<std::string> dotted;
  // Relative imports in first-seen order, unique by (level, module); names merged.
  std::vector<RelativeImport> relative;
  // Process/OS capabilities used through attribute access or from-import that are not module
  // names themselves: "os.system", "os.popen", "os.fork", "os.exec*", "os.spawn*", ...
  std::vector<std::string> capabilities;
  // An import whose module name is not a string literal (`__import__(name)`,
  // `importlib.import_module(f"x{n}")`), a bare reference to `__import__`/`import_module`
  // outside an import statement (`f = importlib.import_module`), or a call to
  // exec()/eval() (which can import anything).
  bool has_dynamic_import = false;
  // Lexical problems seen (unterminated string, unbalanced bracket, NUL byte, ...), at most
  // kMaxWarnings; the scan still reports everything it recognised.
  std::vector<std::string> warnings;
};

inline constexpr size_t kMaxWarnings = 20;

// Never throws, never crashes on any byte sequence; time and memory are linear in the input.
// Imports inside string literals and comments are never reported. Code inside f-string
// replacement fields is scanned as code (it runs): f"{__import__('os')}" reports "os".
// `from __future__ import ...` is ignored.
ImportScan ExtractImports(std::string_view python_source);

}  // namespace esb::router

#include "router/imports.h"

#include <gtest/gtest.h>

#include <chrono>
#include <random>
#include <string>
#include <vector>

namespace esb::router {
namespace {

using Names = std::vector<std::string>;

// One import pattern: the source and the top-level modules it must report (in order).
struct Case {
  const char* name;
  std::string source;
  Names modules;
  bool dynamic = false;
};

std::ostream& operator<<(std::ostream& os, const Case& c) { return os << c.name; }

const std::vector<Case>& Cases() {
  static const std::vector<Case> cases = {
      // --- statements
      {"Plain", "import json\n", {"json"}},
      {"Dotted", "import os.path\n", {"os"}},
      {"DeepDotted", "import xml.etree.ElementTree\n", {"xml"}},
      {"Aliased", "import numpy as np\n", {"numpy"}},
      {"DottedAliased", "import a.b as c, d\n", {"a", "d"}},
      {"Multiple", "import json, re, sys\n", {"json", "re", "sys"}},
      {"SpacesAroundDots", "import  a . b  as  c\n", {"a"}},
      {"NoTrailingNewline", "import json", {"json"}},
      {"FromImport", "from collections import OrderedDict\n", {"collections"}},
      {"FromDotted", "from os.path import join\n", {"os"}},
      {"FromStar", "from math import *\n", {"math"}},
      {"FromAliased", "from datetime import datetime as dt, date\n", {"datetime"}},
      {"FromParens", "from typing import (List, Dict)\n", {"typing"}},
      {"FromParensMultiline",
       "from typing import (\n    List,\n    Dict as D,  # comment\n    Optional,\n)\nimport re\n",
       {"typing", "re"}},
      {"FromBackslashContinuation",
       "from typing import List, \\\n    Dict\nimport re\n",
       {"typing", "re"}},
      {"ImportBackslashContinuation", "import json, \\\n  re\n", {"json", "re"}},
      {"BackslashBetweenFromAndImport", "from json \\\n import dumps\n", {"json"}},
      {"Semicolons", "import a; import b;import c\n", {"a", "b", "c"}},
      {"SemicolonAfterExpr", "x = 1; import json\n", {"json"}},
      {"FutureIgnored", "from __future__ import annotations\nimport json\n", {"json"}},
      {"Duplicates", "import json\nimport json\nfrom json import dumps\n", {"json"}},
      {"OrderPreserved", "import zlib\nimport abc\nimport math\n", {"zlib", "abc", "math"}},
      // --- nesting and blocks
      {"InsideDef", "def f():\n    import pandas\n    return pandas\n", {"pandas"}},
      {"InsideClass", "class A:\n    import json\n", {"json"}},
      {"InsideIf", "if True:\n\timport json\n", {"json"}},
      {"InsideTryExcept",
       "try:\n    import ujson as json\nexcept ImportError:\n    import json\n",
       {"ujson", "json"}},
      {"InsideWith", "with open('f') as fh:\n        import csv\n", {"csv"}},
      {"DeepIndentation",
       "if a:\n  if b:\n    for x in y:\n      while z:\n        import re\n",
       {"re"}},
      {"OneLineCompound", "if x: import json\ntry: import re\nexcept: pass\n", {"json", "re"}},
      {"AfterLambdaColon", "f = lambda: 0\nimport json\n", {"json"}},
      {"YieldFromIsNotImport", "def g():\n    yield from range(3)\nimport re\n", {"re"}},
      {"RaiseFromIsNotImport", "try:\n  pass\nexcept E as e:\n  raise X from e\n", {}},
      // --- dynamic imports
      {"DunderImport", "m = __import__('json')\n", {"json"}},
      {"DunderImportDotted", "m = __import__(\"os.path\")\n", {"os"}},
      {"ImportlibImportModule",
       "import importlib\nm = importlib.import_module('pandas')\n",
       {"importlib", "pandas"}},
      {"BareImportModule",
       "from importlib import import_module\nimport_module('re')\n",
       {"importlib", "re"}},
      {"ImportModuleWithPackageArg", "importlib.import_module('json', package=None)\n", {"json"}},
      {"ConcatenatedLiteral", "__import__('js' 'on')\n", {"json"}},
      {"NestedDunderImport", "__import__(__import__('os').environ['M'])\n", {"os"}, true},
      {"DynamicVariable", "name = 'json'\n__import__(name)\n", {}, true},
      {"DynamicFString", "importlib.import_module(f'mod_{n}')\n", {}, true},
      {"DynamicConcatenation", "__import__('a' + b)\n", {}, true},
      {"DunderImportReference", "imp = __import__\n", {}, true},
      {"ImportModuleReferenceIsDynamic", "f = importlib.import_module\nf('json')\n", {}, true},
      {"ExecIsDynamic", "exec(code)\n", {}, true},
      {"EvalIsDynamic", "eval('1+1')\n", {}, true},
      {"MethodNamedEvalIsNotDynamic", "model.eval()\nre.compile('x')\n", {}},
      {"DefinedImportModuleIsNotCall", "def import_module(x):\n    pass\n", {}},
      {"FStringFieldCodeIsScanned", "s = f\"{__import__('socket').gethostname()}\"\n", {"socket"}},
      // --- strings and comments: nothing inside is reported
      {"InComment", "# import numpy\nimport json  # import pandas\n", {"json"}},
      {"InSingleQuoted", "s = 'import numpy'\n", {}},
      {"InDoubleQuoted", "s = \"from pandas import DataFrame\"\n", {}},
      {"InTripleDouble", "\"\"\"\nimport numpy\nfrom scipy import x\n\"\"\"\nimport re\n", {"re"}},
      {"InTripleSingle", "'''\nimport numpy\n'''\n", {}},
      {"InRawString", "p = r'\\' import numpy'\nimport re\n", {"re"}},
      {"InRawTriple", "p = r\"\"\"\\\"\"\" import numpy\"\"\"\n", {}},
      {"InBytes", "b = b'import numpy'\nc = Rb\"import scipy\"\n", {}},
      {"InFStringLiteralPart", "s = f'import numpy {x} import scipy'\n", {}},
      {"FStringNestedBraces", "s = f\"{ {'a': 1}['a'] } {x:{w}.{p}} {{import numpy}}\"\n", {}},
      {"FStringSameQuotesPy312", "s = f\"{d[\"k\"]} import numpy\"\nimport re\n", {"re"}},
      {"FStringNested", "s = f'{f\"{x!r:>{w}}\"}'\nimport json\n", {"json"}},
      {"FStringTripleMultiline", "s = f'''\n{x}\nimport numpy\n'''\nimport re\n", {"re"}},
      {"FStringNamedEscape", "s = f'\\N{BULLET} import numpy'\nimport re\n", {"re"}},
      {"EscapedQuotes", "s = 'it\\'s import numpy'\nimport re\n", {"re"}},
      {"StringContinuation", "s = 'abc \\\nimport numpy'\nimport re\n", {"re"}},
      {"DocstringInDef",
       "def f():\n    \"\"\"Use: import numpy as np.\"\"\"\n    import re\n",
       {"re"}},
      {"HashInString", "s = '#'; import json\n", {"json"}},
      {"PrefixUpperCase", "s = U'import a' + F'import b' + BR'import c'\n", {}},
      // --- lexical oddities
      {"UnicodeIdentifiers", "import modülé\nfrom 数据 import 表\n", {"modülé", "数据"}},
      {"Tabs", "if x:\n\timport\tjson\n", {"json"}},
      {"WindowsLineEndings",
       "import json\r\nfrom re import (\r\n  sub)\r\nimport csv\r\n",
       {"json", "re", "csv"}},
      {"OldMacLineEndings", "import json\rimport re\r", {"json", "re"}},
      {"UnterminatedStringAtEof", "import json\ns = 'import numpy", {"json"}},
      {"UnterminatedTripleAtEof", "import json\ns = \"\"\"import numpy\n", {"json"}},
      {"UnterminatedLineStringRecovers", "s = 'oops\nimport re\n", {"re"}},
      {"DeeplyNestedBrackets",
       std::string(500, '(') + std::string(500, ')') + "\nimport json\n",
       {"json"}},
      {"UnclosedBracketStillFindsImports",
       "x = (1,\nimport json\nfrom re import sub\n",
       {"json", "re"}},
      {"NulBytes", std::string("import json\0\nimport re\n", 23), {"json", "re"}},
      {"EmptyInput", "", {}},
      {"AttributeNamedImportLike", "x.importer = 1\nimporting = 2\n", {}},
      {"Python2Print", "print 'import numpy'\nimport json\n", {"json"}},
      {"NumbersAndDots", "x = 1.5e-3 + .5\nimport json\n", {"json"}},
      {"Ellipsis", "def f(): ...\nimport json\n", {"json"}},
  };
  return cases;
}

class ImportPatternTest : public ::testing::TestWithParam<Case> {};

TEST_P(ImportPatternTest, ReportsExactlyTheseModules) {
  const Case& c = GetParam();
  ImportScan scan = ExtractImports(c.source);
  EXPECT_EQ(scan.modules, c.modules) << "source:\n" << c.source;
  EXPECT_EQ(scan.has_dynamic_import, c.dynamic) << "source:\n" << c.source;
}

INSTANTIATE_TEST_SUITE_P(Patterns, ImportPatternTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.name);
                         });

TEST(ImportScanTest, AtLeastFiftyPatterns) { EXPECT_GE(Cases().size(), 50u); }

TEST(ImportScanTest, DottedNames) {
  ImportScan scan =
      ExtractImports("import a.b as c, d\nfrom x.y import z, w as v\nfrom q import *\n");
  EXPECT_EQ(scan.dotted, (Names{"a.b", "d", "x.y", "x.y.z", "x.y.w", "q"}));
  EXPECT_EQ(scan.modules, (Names{"a", "d", "x", "q"}));
}

TEST(ImportScanTest, RelativeImportsWithLevels) {
  ImportScan scan = ExtractImports(
      "from . import x\nfrom .. import y, z\nfrom ..pkg.mod import (a,\n b)\nfrom ...p import q\n"
      "from .import w\nfrom . import x\n");
  EXPECT_TRUE(scan.modules.empty());
  ASSERT_EQ(scan.relative.size(), 4u);
  EXPECT_EQ(scan.relative[0].level, 1);
  EXPECT_EQ(scan.relative[0].module, "");
  EXPECT_EQ(scan.relative[0].names, (Names{"x", "w"}));
  EXPECT_EQ(scan.relative[1].level, 2);
  EXPECT_EQ(scan.relative[1].names, (Names{"y", "z"}));
  EXPECT_EQ(scan.relative[2].level, 2);
  EXPECT_EQ(scan.relative[2].module, "pkg.mod");
  EXPECT_EQ(scan.relative[2].names, (Names{"a", "b"}));
  EXPECT_EQ(scan.relative[3].level, 3);  // "..." lexes as three dots
  EXPECT_EQ(scan.relative[3].module, "p");
}

TEST(ImportScanTest, RelativeImportModuleLiteral) {
  ImportScan scan = ExtractImports("importlib.import_module('..sib', __package__)\n");
  ASSERT_EQ(scan.relative.size(), 1u);
  EXPECT_EQ(scan.relative[0].level, 2);
  EXPECT_EQ(scan.relative[0].module, "sib");
  EXPECT_FALSE(scan.has_dynamic_import);
}

TEST(ImportScanTest, InvalidLiteralNameIsDynamic) {
  EXPECT_TRUE(ExtractImports("__import__('not a module')\n").has_dynamic_import);
  EXPECT_TRUE(ExtractImports("__import__('')\n").has_dynamic_import);
  EXPECT_TRUE(ExtractImports("__import__(b'json')\n").has_dynamic_import);
  EXPECT_TRUE(ExtractImports("__import__('js\\x6fn')\n").has_dynamic_import);
}

TEST(ImportScanTest, Capabilities) {
  ImportScan scan = ExtractImports(
      "import os\nos.system('ls')\nos.execvp('a', [])\nfrom os import popen\nos.path.join('a')\n"
      "import subprocess, socket\n");
  EXPECT_EQ(scan.capabilities, (Names{"os.system", "os.execvp", "os.popen"}));
  EXPECT_EQ(scan.modules, (Names{"os", "subprocess", "socket"}));
  EXPECT_TRUE(ExtractImports("s = 'os.system'\n").capabilities.empty());
}

TEST(ImportScanTest, WarningsForBrokenInput) {
  EXPECT_TRUE(ExtractImports("import json\n").warnings.empty());
  EXPECT_FALSE(ExtractImports("s = 'abc").warnings.empty());
  EXPECT_FALSE(ExtractImports("x = (1,\n").warnings.empty());
  EXPECT_FALSE(ExtractImports("x = 1)\n").warnings.empty());
  EXPECT_FALSE(ExtractImports(std::string("a\0b", 3)).warnings.empty());
  std::string many;
  for (int i = 0; i < 1000; ++i) many += ")\n";
  EXPECT_EQ(ExtractImports(many).warnings.size(), kMaxWarnings);
}

TEST(ImportScanTest, InvalidUtf8NamesAreDroppedWithWarning) {
  ImportScan scan = ExtractImports("import \xff\xfe\nimport json\n");
  EXPECT_EQ(scan.modules, (Names{"json"}));
  EXPECT_FALSE(scan.warnings.empty());
}

TEST(ImportScanTest, DeepFStringNestingIsBounded) {
  std::string src;
  for (int i = 0; i < 200; ++i) src += (i % 2 ? "f'{" : "f\"{");
  src += "x";
  for (int i = 199; i >= 0; --i) src += (i % 2 ? "}'" : "}\"");
  src += "\nimport json\n";
  ImportScan scan = ExtractImports(src);
  EXPECT_EQ(scan.modules, (Names{"json"}));
}

// Linear time on large inputs of several shapes (10 MB each). Typically well under a second
// each; the worst (700k distinct modules) takes ~3 s on this loaded VM, hence the loose bound.
TEST(ImportScanTest, TenMegabytesIsFast) {
  const size_t kSize = 10 << 20;
  std::vector<std::string> inputs;
  std::string imports;
  for (int i = 0; imports.size() < kSize; ++i) imports += "import m" + std::to_string(i) + "\n";
  inputs.push_back(std::move(imports));
  inputs.push_back(std::string(kSize, '('));
  inputs.push_back("'''" + std::string(kSize, 'a'));
  inputs.push_back("f'" + std::string(kSize, '{'));
  std::string fields;
  while (fields.size() < kSize) fields += "f'{x:{y}}' ";
  inputs.push_back(std::move(fields));
  inputs.push_back("import " + std::string(kSize, 'a'));
  std::string dots = "import a";
  while (dots.size() < kSize) dots += ".b";
  inputs.push_back(std::move(dots));
  for (const std::string& in : inputs) {
    auto start = std::chrono::steady_clock::now();
    ImportScan scan = ExtractImports(in);
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(secs, 10.0) << "input starting " << in.substr(0, 20);
  }
}

// Deterministic smoke fuzz: 20k random and mutated inputs must not crash and must give
// self-consistent results. (The libFuzzer target router_fuzz does this for real.)
TEST(ImportScanTest, SmokeFuzz) {
  std::mt19937 rng(12345);
  const std::vector<std::string> seeds = {
      "import a.b as c, d\n",
      "from x import (y,\n z)\n",
      "from .. import q\n",
      "s = f'{x!r:>{w}}'\n",
      "'''doc'''\n",
      "__import__('os')\n",
      "r'\\''\n",
      "x = [1, (2, {3})]\n",
      "# c\n",
      "\\\n",
      "b\"\\x00\"\n",
      "importlib.import_module(n)\n",
      "if x:\n\timport y\r\n",
  };
  const std::string alphabet = "iomprtfa._ ()[]{},;:\\'\"#\n\r\t!=*+fbrFBRu0123456789\x80\xff";
  for (int iter = 0; iter < 20000; ++iter) {
    std::string s;
    if (iter % 2 == 0) {
      size_t len = rng() % 200;
      for (size_t i = 0; i < len; ++i) {
        s.push_back(rng() % 4 == 0 ? static_cast<char>(rng() % 256)
                                   : alphabet[rng() % alphabet.size()]);
      }
    } else {
      int parts = 1 + rng() % 6;
      for (int p = 0; p < parts; ++p) s += seeds[rng() % seeds.size()];
      int mutations = rng() % 8;
      for (int m = 0; m < mutations && !s.empty(); ++m) {
        size_t pos = rng() % s.size();
        switch (rng() % 3) {
          case 0:
            s[pos] = alphabet[rng() % alphabet.size()];
            break;
          case 1:
            s.erase(pos, 1 + rng() % 3);
            break;
          default:
            s.insert(pos, 1, static_cast<char>(rng() % 256));
            break;
        }
      }
    }
    ImportScan scan = ExtractImports(s);
    for (const std::string& m : scan.modules) {
      ASSERT_FALSE(m.empty());
      ASSERT_EQ(m.find('.'), std::string::npos) << m;
    }
    for (const std::string& d : scan.dotted) {
      ASSERT_FALSE(d.empty());
      ASSERT_NE(d.front(), '.');
      ASSERT_NE(d.back(), '.');
    }
    for (const RelativeImport& r : scan.relative) ASSERT_GE(r.level, 1);
    ASSERT_LE(scan.warnings.size(), kMaxWarnings);
  }
}

}  // namespace
}  // namespace esb::router

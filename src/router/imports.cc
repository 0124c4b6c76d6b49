// Import extraction: a streaming lexer for Python's lexical structure feeding small token-level
// state machines. Nothing is buffered per token, so time and memory stay linear in the input.
#include "router/imports.h"

#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "common/utf8.h"

namespace esb::router {
namespace {

// f-strings nest (f"{f'{x}'}"); the lexer recurses once per level, so bound it.
constexpr int kMaxFStringDepth = 32;

enum class Kind : unsigned char { kName, kNumber, kString, kOp, kNewline };

struct Token {
  Kind kind;
  // Inside an f-string replacement field (an expression, never a statement).
  bool in_fexpr = false;
  // A terminated string literal without f/t/b prefix or backslash: its body is its value.
  bool simple_str = false;
  // Name or operator text; for strings the body between the quotes. Points into the source.
  std::string_view text;
};

bool IsIdStart(unsigned char c) {
  // Any non-ASCII byte counts as an identifier byte: Python 3 allows Unicode identifiers, and
  // treating stray bytes of invalid UTF-8 the same way keeps the lexer total.
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c >= 0x80;
}
bool IsDigit(unsigned char c) { return c >= '0' && c <= '9'; }
bool IsIdChar(unsigned char c) { return IsIdStart(c) || IsDigit(c); }

// r, u, b, f, t and the two-letter combinations Python accepts, in any case.
bool IsStringPrefix(std::string_view name) {
  if (name.empty() || name.size() > 2) return false;
  char lower[2] = {0, 0};
  for (size_t k = 0; k < name.size(); ++k) lower[k] = static_cast<char>(name[k] | 0x20);
  std::string_view p(lower, name.size());
  for (std::string_view ok : {"r", "u", "b", "f", "t", "br", "rb", "fr", "rf", "tr", "rt"}) {
    if (p == ok) return true;
  }
  return false;
}

// "a.b.c" (identifier segments separated by single dots), optionally with leading dots.
bool IsDottedName(std::string_view s) {
  size_t i = 0;
  while (i < s.size() && s[i] == '.') ++i;
  if (i == s.size()) return i > 0;  // "." / ".." alone: relative package itself
  bool seg_start = true;
  for (; i < s.size(); ++i) {
    unsigned char c = s[i];
    if (c == '.') {
      if (seg_start) return false;
      seg_start = true;
    } else if (seg_start ? IsIdStart(c) : IsIdChar(c)) {
      seg_start = false;
    } else {
      return false;
    }
  }
  return !seg_start;
}

bool IsOsCapability(std::string_view attr) {
  return attr == "system" || attr == "popen" || attr == "fork" || attr == "forkpty" ||
         attr == "posix_spawn" || attr == "posix_spawnp" || attr.starts_with("exec") ||
         attr.starts_with("spawn");
}

// Collects results; owns the uniqueness sets and the warning cap.
class Collector {
 public:
  explicit Collector(ImportScan* scan) : scan_(scan) {}

  void Warn(std::string message) {
    if (scan_->warnings.size() < kMaxWarnings) {
      scan_->warnings.push_back(std::move(message));
    } else if (!warnings_truncated_) {
      warnings_truncated_ = true;
      scan_->warnings.back() = "further warnings omitted";
    }
  }

  void AddAbsolute(std::string_view dotted) {
    if (dotted.empty()) return;
    if (!IsValidUtf8(dotted)) {
      Warn("module name with invalid UTF-8 ignored");
      return;
    }
    if (dotted_seen_.insert(std::string(dotted)).second) scan_->dotted.emplace_back(dotted);
    std::string_view top = dotted.substr(0, dotted.find('.'));
    if (modules_seen_.insert(std::string(top)).second) scan_->modules.emplace_back(top);
  }

  void AddRelative(int level, std::string_view module, std::string_view name) {
    if (!IsValidUtf8(module) || !IsValidUtf8(name)) {
      Warn("module name with invalid UTF-8 ignored");
      return;
    }
    std::string key = std::to_string(level) + ":" + std::string(module);
    auto [it, inserted] = relative_index_.try_emplace(key, scan_->relative.size());
    if (inserted) scan_->relative.push_back({level, std::string(module), {}});
    if (name.empty()) return;
    if (relative_names_seen_.insert(key + ":" + std::string(name)).second) {
      scan_->relative[it->second].names.emplace_back(name);
    }
  }

  void AddCapability(std::string_view cap) {
    if (capabilities_seen_.insert(std::string(cap)).second) scan_->capabilities.emplace_back(cap);
  }

  void SetDynamic() { scan_->has_dynamic_import = true; }

 private:
  ImportScan* scan_;
  bool warnings_truncated_ = false;
  std::unordered_set<std::string> dotted_seen_, modules_seen_, capabilities_seen_;
  std::unordered_set<std::string> relative_names_seen_;
  std::unordered_map<std::string, size_t> relative_index_;
};

// Recognises import statements: `import a.b as c, d` and `from ..x import (y as z, w)`.
// Sees only tokens outside f-string fields (a statement cannot be inside an expression).
class StatementMachine {
 public:
  explicit StatementMachine(Collector* out) : out_(out) {}

  // True while the machine is inside an import statement (the token belonged to it).
  bool Feed(const Token& t) {
    for (;;) {
      Step step = Advance(t);
      if (step == Step::kConsumed) return state_ != State::kIdle || consumed_keyword_;
      state_ = State::kIdle;  // kReprocess: the statement ended before this token
    }
  }

 private:
  enum class State {
    kIdle,
    kImportName,
    kImportDot,
    kImportNameAfterDot,
    kImportAlias,
    kImportAfterAlias,
    kFrom,
    kFromModDot,
    kFromModName,
    kFromNames,
    kFromAfterName,
    kFromAlias,
    kFromAfterAlias,
  };
  enum class Step { kConsumed, kReprocess };

  static bool IsName(const Token& t) { return t.kind == Kind::kName; }
  static bool IsOp(const Token& t, char c) {
    return t.kind == Kind::kOp && t.text.size() == 1 && t.text[0] == c;
  }
  static bool IsKeyword(const Token& t, std::string_view k) { return IsName(t) && t.text == k; }
  // `import`/`from` can never be part of a dotted name: they start a new statement.
  static bool IsPlainName(const Token& t) {
    return IsName(t) && t.text != "import" && t.text != "from";
  }

  Step Advance(const Token& t) {
    consumed_keyword_ = false;
    switch (state_) {
      case State::kIdle:
        if (IsKeyword(t, "import")) {
          state_ = State::kImportName;
          consumed_keyword_ = true;
        } else if (IsKeyword(t, "from")) {
          state_ = State::kFrom;
          level_ = 0;
          module_.clear();
          consumed_keyword_ = true;
        }
        return Step::kConsumed;

      case State::kImportName:
        if (!IsPlainName(t)) return Step::kReprocess;
        name_.assign(t.text);
        state_ = State::kImportDot;
        return Step::kConsumed;
      case State::kImportDot:
        if (IsOp(t, '.')) {
          state_ = State::kImportNameAfterDot;
          return Step::kConsumed;
        }
        out_->AddAbsolute(name_);
        if (IsKeyword(t, "as")) {
          state_ = State::kImportAlias;
          return Step::kConsumed;
        }
        if (IsOp(t, ',')) {
          state_ = State::kImportName;
          return Step::kConsumed;
        }
        return Step::kReprocess;
      case State::kImportNameAfterDot:
        if (!IsPlainName(t)) {
          out_->AddAbsolute(name_);  // `import a.` — keep what we have
          return Step::kReprocess;
        }
        name_.push_back('.');
        name_.append(t.text);
        state_ = State::kImportDot;
        return Step::kConsumed;
      case State::kImportAlias:
        if (!IsPlainName(t)) return Step::kReprocess;
        state_ = State::kImportAfterAlias;
        return Step::kConsumed;
      case State::kImportAfterAlias:
        if (!IsOp(t, ',')) return Step::kReprocess;
        state_ = State::kImportName;
        return Step::kConsumed;

      case State::kFrom:
        if (IsOp(t, '.')) {
          ++level_;
          return Step::kConsumed;
        }
        if (IsKeyword(t, "import") && level_ > 0) return BeginFromNames();
        if (!IsPlainName(t)) return Step::kReprocess;  // `yield from (x)` and friends
        module_.assign(t.text);
        state_ = State::kFromModDot;
        return Step::kConsumed;
      case State::kFromModDot:
        if (IsOp(t, '.')) {
          state_ = State::kFromModName;
          return Step::kConsumed;
        }
        if (IsKeyword(t, "import")) return BeginFromNames();
        return Step::kReprocess;  // `raise E from err`, `yield from gen`
      case State::kFromModName:
        if (!IsPlainName(t)) return Step::kReprocess;
        module_.push_back('.');
        module_.append(t.text);
        state_ = State::kFromModDot;
        return Step::kConsumed;
      case State::kFromNames:
        if (IsOp(t, '(')) return Step::kConsumed;
        if (IsOp(t, '*')) {
          state_ = State::kFromAfterName;
          return Step::kConsumed;
        }
        if (IsOp(t, ')')) {
          state_ = State::kIdle;
          return Step::kConsumed;
        }
        if (!IsPlainName(t)) return Step::kReprocess;
        AddFromName(t.text);
        state_ = State::kFromAfterName;
        return Step::kConsumed;
      case State::kFromAfterName:
      case State::kFromAfterAlias:
        if (state_ == State::kFromAfterName && IsKeyword(t, "as")) {
          state_ = State::kFromAlias;
          return Step::kConsumed;
        }
        if (IsOp(t, ',')) {
          state_ = State::kFromNames;
          return Step::kConsumed;
        }
        if (IsOp(t, ')')) {
          state_ = State::kIdle;
          return Step::kConsumed;
        }
        return Step::kReprocess;
      case State::kFromAlias:
        if (!IsPlainName(t)) return Step::kReprocess;
        state_ = State::kFromAfterAlias;
        return Step::kConsumed;
    }
    return Step::kReprocess;
  }

  Step BeginFromNames() {
    state_ = State::kFromNames;
    future_ = level_ == 0 && module_ == "__future__";
    if (future_) return Step::kConsumed;
    if (level_ > 0) {
      out_->AddRelative(level_, module_, "");
    } else {
      out_->AddAbsolute(module_);
    }
    return Step::kConsumed;
  }

  void AddFromName(std::string_view name) {
    if (future_) return;
    if (level_ > 0) {
      out_->AddRelative(level_, module_, name);
      return;
    }
    if (module_ == "os" && IsOsCapability(name)) out_->AddCapability("os." + std::string(name));
    out_->AddAbsolute(module_ + "." + std::string(name));
  }

  Collector* out_;
  State state_ = State::kIdle;
  bool consumed_keyword_ = false;
  bool future_ = false;
  int level_ = 0;
  std::string name_;
  std::string module_;
};

// Recognises `__import__("x")`, `import_module("x")` (any receiver), bare references to either, and
// exec()/eval() calls; and `os.<capability>` attribute use. Sees every token, including those
// inside f-string fields (they are code that runs).
class CallMachine {
 public:
  explicit CallMachine(Collector* out) : out_(out) {}

  void Feed(const Token& t, bool part_of_import_statement) {
    for (;;) {
      if (Advance(t, part_of_import_statement)) break;
      state_ = State::kIdle;
    }
    prev2_ = prev_;
    prev_ = t;
  }

 private:
  enum class State { kIdle, kAfterName, kArgs };
  enum class Target { kImport, kImportModule, kExec };

  static bool IsOp(const Token& t, char c) {
    return t.kind == Kind::kOp && t.text.size() == 1 && t.text[0] == c;
  }
  static bool IsKeyword(const Token& t, std::string_view k) {
    return t.kind == Kind::kName && t.text == k;
  }

  // Returns true when the token is consumed, false to reprocess it in kIdle.
  bool Advance(const Token& t, bool in_import) {
    switch (state_) {
      case State::kIdle: {
        if (t.kind != Kind::kName || in_import) return true;
        if (IsKeyword(prev_, "def") || IsKeyword(prev_, "class")) return true;
        bool attr = IsOp(prev_, '.');
        if (attr && IsKeyword(prev2_, "os") && IsOsCapability(t.text)) {
          out_->AddCapability("os." + std::string(t.text));
        }
        if (t.text == "__import__") {
          target_ = Target::kImport;
        } else if (t.text == "import_module") {
          target_ = Target::kImportModule;
        } else if ((t.text == "exec" || t.text == "eval") && !attr) {
          target_ = Target::kExec;
        } else {
          return true;
        }
        state_ = State::kAfterName;
        return true;
      }
      case State::kAfterName:
        if (IsOp(t, '(')) {
          state_ = State::kArgs;
          literal_.clear();
          have_literal_ = false;
          return true;
        }
        // A bare reference (`f = importlib.import_module`) can import anything later.
        if (target_ != Target::kExec) out_->SetDynamic();
        return false;
      case State::kArgs:
        if (target_ != Target::kExec && t.kind == Kind::kString && t.simple_str) {
          literal_.append(t.text);  // implicit concatenation: "a" "b"
          have_literal_ = true;
          return true;
        }
        if (have_literal_ && (IsOp(t, ')') || IsOp(t, ','))) {
          AddLiteral();
          state_ = State::kIdle;
          return true;
        }
        out_->SetDynamic();
        return false;  // reprocess: the argument may itself be __import__("x")
    }
    return true;
  }

  void AddLiteral() {
    if (!IsDottedName(literal_)) {
      out_->SetDynamic();
      return;
    }
    size_t level = 0;
    while (level < literal_.size() && literal_[level] == '.') ++level;
    if (level == 0) {
      out_->AddAbsolute(literal_);
    } else {
      out_->AddRelative(static_cast<int>(level), std::string_view(literal_).substr(level), "");
    }
  }

  Collector* out_;
  State state_ = State::kIdle;
  Target target_ = Target::kImport;
  std::string literal_;
  bool have_literal_ = false;
  Token prev_{Kind::kNewline};
  Token prev2_{Kind::kNewline};
};

class Lexer {
 public:
  Lexer(std::string_view src, Collector* out) : s_(src), out_(out), statements_(out), calls_(out) {}

  void Run() {
    LexCode(0, false);
    Emit(Kind::kNewline, {});
  }

 private:
  // What ended a stretch of code inside an f-string field.
  enum End : char { kEof = 0, kNewlineEnd = '\n', kBrace = '}', kBang = '!', kColon = ':' };

  void Emit(Kind kind, std::string_view text, bool in_fexpr = false, bool simple = false) {
    Token t{kind, in_fexpr, simple, text};
    bool in_import = false;
    if (!in_fexpr) in_import = statements_.Feed(t);
    calls_.Feed(t, in_import);
  }

  void Warn(std::string_view what, size_t line) {
    out_->Warn(std::string(what) + " at line " + std::to_string(line));
  }

  bool AtNewline() const { return i_ < s_.size() && (s_[i_] == '\n' || s_[i_] == '\r'); }
  // Consumes \n, \r\n or a lone \r (all are line ends in Python source).
  void ConsumeNewline() {
    if (s_[i_] == '\r' && i_ + 1 < s_.size() && s_[i_ + 1] == '\n') ++i_;
    ++i_;
    ++line_;
  }

  // Lexes code. At top level (fdepth 0) runs to the end of input. Inside an f-string field it
  // stops, without consuming, at the '}', '!' or ':' that ends the expression at bracket depth
  // 0, or at a line end when the enclosing f-string is single-line.
  End LexCode(int fdepth, bool single_line) {
    const bool in_f = fdepth > 0;
    int depth = 0;
    while (i_ < s_.size()) {
      unsigned char c = s_[i_];
      if (c == '\n' || c == '\r') {
        if (in_f && single_line) return kNewlineEnd;
        ConsumeNewline();
        if (!in_f && depth == 0) Emit(Kind::kNewline, {});
        continue;
      }
      if (c == ' ' || c == '\t' || c == '\f' || c == '\v') {
        ++i_;
        continue;
      }
      if (c == 0) {
        if (!warned_nul_) Warn("NUL byte", line_);
        warned_nul_ = true;
        ++i_;
        continue;
      }
      if (c == '#') {
        while (i_ < s_.size() && !AtNewline()) ++i_;
        continue;
      }
      if (c == '\\') {
        ++i_;
        if (AtNewline()) {
          ConsumeNewline();  // explicit line joining
        } else {
          Warn("stray backslash", line_);
        }
        continue;
      }
      if (IsIdStart(c)) {
        size_t start = i_;
        while (i_ < s_.size() && IsIdChar(s_[i_])) ++i_;
        std::string_view name = s_.substr(start, i_ - start);
        if (i_ < s_.size() && (s_[i_] == '"' || s_[i_] == '\'') && IsStringPrefix(name)) {
          LexString(name, fdepth);
        } else {
          Emit(Kind::kName, name, in_f);
        }
        continue;
      }
      if (c == '"' || c == '\'') {
        LexString({}, fdepth);
        continue;
      }
      if (IsDigit(c) || (c == '.' && i_ + 1 < s_.size() && IsDigit(s_[i_ + 1]))) {
        size_t start = i_;
        while (i_ < s_.size() && (IsIdChar(s_[i_]) || s_[i_] == '.')) ++i_;
        Emit(Kind::kNumber, s_.substr(start, i_ - start), in_f);
        continue;
      }
      if (c == '(' || c == '[' || c == '{') {
        ++depth;
      } else if (c == ')' || c == ']' || c == '}') {
        if (depth == 0) {
          if (in_f && c == '}') return kBrace;
          Warn(std::string("unbalanced '") + static_cast<char>(c) + "'", line_);
          ++i_;
          continue;
        }
        --depth;
      } else if (in_f && depth == 0) {
        if (c == '!' && !(i_ + 1 < s_.size() && s_[i_ + 1] == '=')) return kBang;
        if (c == ':') return kColon;
      }
      Emit(Kind::kOp, s_.substr(i_, 1), in_f);
      ++i_;
    }
    if (!in_f && depth > 0) Warn("unclosed bracket at end of input", line_);
    return kEof;
  }

  // At the opening quote; `prefix` is the (already consumed) string prefix, if any.
  void LexString(std::string_view prefix, int fdepth) {
    bool raw = false, fstr = false, bytes = false;
    for (char ch : prefix) {
      raw |= ch == 'r' || ch == 'R';
      fstr |= ch == 'f' || ch == 'F' || ch == 't' || ch == 'T';
      bytes |= ch == 'b' || ch == 'B';
    }
    const char q = s_[i_];
    const bool triple = i_ + 2 < s_.size() && s_[i_ + 1] == q && s_[i_ + 2] == q;
    const size_t open_line = line_;
    i_ += triple ? 3 : 1;
    if (fstr) {
      // Emitted before the field tokens so `import_module(f"...")` sees a non-literal argument.
      Emit(Kind::kString, {}, fdepth > 0, false);
      if (!LexFStringBody(q, triple, raw, fdepth)) Warn("unterminated f-string", open_line);
      return;
    }
    const size_t body_start = i_;
    bool backslash = false;
    while (i_ < s_.size()) {
      char c = s_[i_];
      if (c == '\\') {
        backslash = true;
        ++i_;
        if (AtNewline()) {
          ConsumeNewline();
        } else if (i_ < s_.size()) {
          ++i_;
        }
        continue;
      }
      if (c == q && (!triple || EndsTriple(q))) {
        std::string_view body = s_.substr(body_start, i_ - body_start);
        i_ += triple ? 3 : 1;
        Emit(Kind::kString, body, fdepth > 0, !bytes && !backslash);
        return;
      }
      if (c == '\n' || c == '\r') {
        if (!triple) break;  // unterminated single-line string ends at the line end
        ConsumeNewline();
        continue;
      }
      ++i_;
    }
    Warn("unterminated string", open_line);
    Emit(Kind::kString, s_.substr(body_start, i_ - body_start), fdepth > 0, false);
  }

  bool EndsTriple(char q) const {
    return i_ + 2 < s_.size() && s_[i_] == q && s_[i_ + 1] == q && s_[i_ + 2] == q;
  }

  // Literal text and replacement fields of an f-string, after the opening quote. Returns false
  // if the string is unterminated (input or line ended first).
  bool LexFStringBody(char q, bool triple, bool raw, int fdepth) {
    while (i_ < s_.size()) {
      char c = s_[i_];
      if (c == '\\') {
        ++i_;
        if (i_ >= s_.size()) break;
        if (AtNewline()) {
          ConsumeNewline();
        } else if (!raw && s_[i_] == 'N' && i_ + 1 < s_.size() && s_[i_ + 1] == '{') {
          // \N{NAME} is a character escape, not a field.
          while (i_ < s_.size() && s_[i_] != '}' && s_[i_] != q && !AtNewline()) ++i_;
          if (i_ < s_.size() && s_[i_] == '}') ++i_;
        } else if (s_[i_] != '{' && s_[i_] != '}') {
          ++i_;  // a backslash never escapes a brace: f"\{x}" still has a field
        }
        continue;
      }
      if (c == q) {
        if (!triple) {
          ++i_;
          return true;
        }
        if (EndsTriple(q)) {
          i_ += 3;
          return true;
        }
        ++i_;
        continue;
      }
      if (c == '\n' || c == '\r') {
        if (!triple) return false;
        ConsumeNewline();
        continue;
      }
      if (c == '{') {
        if (i_ + 1 < s_.size() && s_[i_ + 1] == '{') {
          i_ += 2;
          continue;
        }
        ++i_;
        LexField(q, triple, raw, fdepth + 1);
        continue;
      }
      ++i_;  // literal text, including '}' and '}}'
    }
    return false;
  }

  // After the '{' that opens a replacement field whose expression is at `fdepth`.
  void LexField(char q, bool triple, bool raw, int fdepth) {
    if (fdepth > kMaxFStringDepth) {
      if (!warned_depth_) Warn("f-string nesting too deep; inner fields skipped", line_);
      warned_depth_ = true;
      while (i_ < s_.size() && s_[i_] != '}' && s_[i_] != q && !AtNewline()) ++i_;
      if (i_ < s_.size() && s_[i_] == '}') ++i_;
      return;
    }
    End end = LexCode(fdepth, !triple);
    if (end == kBang) {
      ++i_;
      while (i_ < s_.size() && IsIdChar(s_[i_])) ++i_;  // conversion: !r !s !a
      if (i_ < s_.size() && s_[i_] == ':')
        end = kColon;
      else if (i_ < s_.size() && s_[i_] == '}')
        end = kBrace;
    }
    if (end == kColon) {
      ++i_;
      // Format spec: literal text with nested fields, up to the closing '}'.
      while (i_ < s_.size()) {
        char c = s_[i_];
        if (c == '}') break;
        if (c == q || ((c == '\n' || c == '\r') && !triple)) return;  // let the body see it
        if (c == '{') {
          ++i_;
          LexField(q, triple, raw, fdepth + 1);
          continue;
        }
        if (c == '\n' || c == '\r') {
          ConsumeNewline();
          continue;
        }
        ++i_;
      }
      end = kBrace;
    }
    if (end == kBrace && i_ < s_.size() && s_[i_] == '}') ++i_;
  }

  std::string_view s_;
  size_t i_ = 0;
  size_t line_ = 1;
  bool warned_nul_ = false;
  bool warned_depth_ = false;
  Collector* out_;
  StatementMachine statements_;
  CallMachine calls_;
};

}  // namespace

ImportScan ExtractImports(std::string_view python_source) {
  ImportScan scan;
  Collector collector(&scan);
  Lexer lexer(python_source, &collector);
  lexer.Run();
  return scan;
}

}  // namespace esb::router

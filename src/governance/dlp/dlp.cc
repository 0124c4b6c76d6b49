// The DLP engine: two Vectorscan databases (detect-only: case-sensitive patterns and caseless
// words) for the literal-anchored secret rules and registered secret values, then per hit rule
// an RE2 locate pass from near its first detect match; one number scan over byte-class masks
// (classify.h) for cards, SSN, phone and IBAN and one '@' scan for e-mail (FastScan in
// rules.h); one RE2::Set for custom patterns (with EngineOptions{.vectorscan = false}: for
// every rule). Each candidate goes through its rule's validator. Texts are scanned as given and in
// their decoded views (URL, JSON escapes, base64 multipart parts); findings map back to the given
// text so that redaction replaces the escaped bytes too.
#include "governance/dlp/dlp.h"

#include <hs/hs.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cstring>
#include <functional>
#include <mutex>
#include <unordered_set>

#include "governance/dlp/classify.h"
#include "governance/dlp/decoders.h"
#include "governance/dlp/rules.h"
#include "re2/re2.h"
#include "re2/set.h"

namespace esb::governance::dlp {
namespace {

// The span a match reports: the first capture that took part in it, else the whole match.
re2::StringPiece ReportedSpan(const re2::StringPiece* groups, int ngroups) {
  for (int g = 1; g < ngroups; ++g) {
    if (groups[g].data() != nullptr) return groups[g];
  }
  return groups[0];
}

// Vectorscan ids ≥ this are registered secret values (id - base = index).
constexpr unsigned kSecretIdBase = 1u << 20;
// Vectorscan ids in [kPhoneWordIdBase, kSecretIdBase): phone context words (index into
// kPhoneWords), reported at every match.
constexpr unsigned kPhoneWordIdBase = 1u << 19;
constexpr std::string_view kPhoneWords[] = {"phone", "tel",  "mobile",  "cell",
                                            "fax",   "call", "whatsapp"};
// Bounds the work per rule and view (a body full of near-miss candidates).
constexpr size_t kMaxCandidatesPerRule = 10000;
constexpr size_t kMaxFindings = 1000;
// A rejected candidate up to this long is searched again from its second byte.
constexpr size_t kMaxRescanMatch = 64;
constexpr size_t kMaxMultipartParts = 1000;
constexpr int64_t kRe2MaxMem = 64 << 20;

RE2::Options Latin1Options() {
  RE2::Options options;
  options.set_encoding(RE2::Options::EncodingLatin1);
  options.set_log_errors(false);
  options.set_max_mem(kRe2MaxMem);
  return options;
}

std::string HexEscape(std::string_view literal) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(literal.size() * 4);
  for (unsigned char c : literal) {
    out += "\\x";
    out += kHex[c >> 4];
    out += kHex[c & 15];
  }
  return out;
}

std::string Base64(std::string_view in, bool url_safe) {
  static constexpr char kStd[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  static constexpr char kUrl[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
  const char* alphabet = url_safe ? kUrl : kStd;
  std::string out;
  size_t i = 0;
  for (; i + 3 <= in.size(); i += 3) {
    const uint32_t v = (static_cast<unsigned char>(in[i]) << 16) |
                       (static_cast<unsigned char>(in[i + 1]) << 8) |
                       static_cast<unsigned char>(in[i + 2]);
    out += alphabet[v >> 18];
    out += alphabet[(v >> 12) & 63];
    out += alphabet[(v >> 6) & 63];
    out += alphabet[v & 63];
  }
  if (i + 1 == in.size()) {
    const uint32_t v = static_cast<unsigned char>(in[i]) << 16;
    out += alphabet[v >> 18];
    out += alphabet[(v >> 12) & 63];
    out += "==";
  } else if (i + 2 == in.size()) {
    const uint32_t v =
        (static_cast<unsigned char>(in[i]) << 16) | (static_cast<unsigned char>(in[i + 1]) << 8);
    out += alphabet[v >> 18];
    out += alphabet[(v >> 12) & 63];
    out += alphabet[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

// The forms in which a registered value is looked for, besides its decoded views: verbatim, hex
// (both cases), and base64 (standard and URL-safe) at each of the three alignments it can have
// inside a longer encoded text (only the characters that do not depend on the neighbours).
std::vector<std::string> SecretForms(std::string_view value) {
  std::vector<std::string> forms{std::string(value)};
  static constexpr char kHexLower[] = "0123456789abcdef";
  static constexpr char kHexUpper[] = "0123456789ABCDEF";
  std::string lower, upper;
  for (unsigned char c : value) {
    lower += kHexLower[c >> 4];
    lower += kHexLower[c & 15];
    upper += kHexUpper[c >> 4];
    upper += kHexUpper[c & 15];
  }
  forms.push_back(lower);
  if (upper != lower) forms.push_back(upper);
  for (bool url_safe : {false, true}) {
    for (size_t shift = 0; shift < 3; ++shift) {
      const std::string padded = std::string(shift, '\0') + std::string(value);
      std::string encoded = Base64(padded, url_safe);
      const size_t drop_front = shift == 0 ? 0 : shift + 1;
      const size_t rem = padded.size() % 3;
      const size_t drop_back = rem == 0 ? 0 : (rem == 1 ? 3 : 2);
      if (encoded.size() < drop_front + drop_back + 8) continue;
      encoded = encoded.substr(drop_front, encoded.size() - drop_front - drop_back);
      if (std::find(forms.begin(), forms.end(), encoded) == forms.end()) {
        forms.push_back(std::move(encoded));
      }
    }
  }
  return forms;
}

bool HasByte(std::string_view text, char c) {
  return !text.empty() && std::memchr(text.data(), c, text.size()) != nullptr;
}

std::string LowerAscii(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

// A view of the scanned text: the text itself or one decoding of it. The offset map back to
// the scanned text is built only when a finding needs it (a map is 4 bytes per byte).
struct View {
  std::string_view text;
  std::string_view layer;
  size_t base_offset = 0;               // added to mapped offsets (multipart parts)
  std::function<OffsetMap()> make_map;  // empty: identity
  mutable OffsetMap map;

  // Span of text[begin, end) in the scanned text.
  std::pair<size_t, size_t> ToBase(size_t begin, size_t end) const {
    if (!make_map) return {base_offset + begin, base_offset + end};
    if (map.empty()) map = make_map();
    return {base_offset + map[begin], base_offset + map[end]};
  }
};

OffsetMap Compose(const OffsetMap& outer, const OffsetMap& inner) {
  // outer: view2 → view1; inner: view1 → base (both with their end sentinel).
  OffsetMap out(outer.size());
  for (size_t i = 0; i < outer.size(); ++i) out[i] = inner[outer[i]];
  return out;
}

}  // namespace

struct Engine::Impl {
  struct Rule {
    std::string id;
    Kind kind = Kind::kSecret;
    Action action = Action::kBlock;
    std::unique_ptr<RE2> locate;
    int groups = 0;
    Validator validate = nullptr;
    FastScan fast = FastScan::kRegex;  // kRegex unless compiled with Vectorscan
    LocateFrom locate_from = nullptr;  // RuleDef::locate_from with Vectorscan, else nullptr
  };
  struct Secret {
    std::string id;
    std::vector<std::string> forms;
  };

  DlpConfig config;
  std::vector<Rule> rules;  // enabled built-ins, then custom patterns
  std::vector<Secret> secrets;
  int aws_key_rule = -1;
  int aws_secret_rule = -1;
  std::map<std::string, Action, std::less<>> actions;  // every rule id → action
  std::unordered_set<std::string> allow;

  // Two Vectorscan databases, scanned one after the other with one scratch: the case-sensitive
  // patterns, and the caseless words ("(?i)secret", the phone context words). One database
  // with both ran at half the speed of the two on the DLP bench corpus (short caseless
  // literals among the case-sensitive ones slow Vectorscan's literal matcher down).
  hs_database_t* dbs[2] = {nullptr, nullptr};
  hs_scratch_t* scratch_prototype = nullptr;
  mutable std::mutex scratch_mu;
  mutable std::vector<hs_scratch_t*> scratch_pool;

  // Hand-scanned rules (Vectorscan mode; -1: disabled or RE2-only).
  int card_rule = -1, ssn_rule = -1, phone_rule = -1, iban_rule = -1, email_rule = -1;

  std::unique_ptr<RE2::Set> set;
  std::vector<int> set_rule;  // set index → rule index (< 0: secret value -1-index)

  ~Impl() {
    for (hs_scratch_t* s : scratch_pool) hs_free_scratch(s);
    if (scratch_prototype != nullptr) hs_free_scratch(scratch_prototype);
    for (hs_database_t* db : dbs) {
      if (db != nullptr) hs_free_database(db);
    }
  }

  hs_scratch_t* AcquireScratch() const {
    {
      std::lock_guard<std::mutex> lock(scratch_mu);
      if (!scratch_pool.empty()) {
        hs_scratch_t* s = scratch_pool.back();
        scratch_pool.pop_back();
        return s;
      }
    }
    hs_scratch_t* s = nullptr;
    if (hs_clone_scratch(scratch_prototype, &s) != HS_SUCCESS) return nullptr;
    return s;
  }
  void ReleaseScratch(hs_scratch_t* s) const {
    std::lock_guard<std::mutex> lock(scratch_mu);
    scratch_pool.push_back(s);
  }

  // What the number scan saw of a text's bytes (both true, "maybe", when it did not run).
  struct TextBytes {
    bool at = true;      // a '@'
    bool escape = true;  // a '%' or '\\'
  };
  // `bytes`, if given, receives what the number scan saw of the view's bytes.
  void ScanView(const View& view, Where where, std::vector<Finding>* out,
                TextBytes* bytes = nullptr) const;
  using AddFn = std::function<void(int rule, size_t begin, size_t end)>;
  void ScanNumbers(std::string_view text, const AddFn& add, TextBytes* bytes) const;
  void LocateAnchored(int rule, std::string_view text, size_t start, const AddFn& add) const;
  void ScanEmails(std::string_view text, const AddFn& add) const;
  void ScanViews(std::string_view text, Where where, size_t plus_from, std::string_view boundary,
                 std::vector<Finding>* out) const;
  Result Scan(std::string_view text, Where where, size_t plus_from, std::string_view boundary,
              std::vector<Finding> extra) const;
};

void Engine::Impl::ScanView(const View& view, Where where, std::vector<Finding>* out,
                            TextBytes* bytes) const {
  const std::string_view text = view.text;
  if (text.empty()) return;
  std::vector<char> rule_hit(rules.size(), 0);
  std::vector<char> secret_hit(secrets.size(), 0);
  std::vector<size_t> phone_words;  // where a phone context word starts
  // Per rule, the ends of its first and last detect matches (rules with a locate_from, and the
  // secret key's context word; SIZE_MAX and 0: unknown).
  std::vector<size_t> first_end(rules.size(), SIZE_MAX);
  std::vector<size_t> last_end(rules.size(), 0);
  bool any = false;

  if (dbs[0] != nullptr || dbs[1] != nullptr) {
    struct Hits {
      std::vector<char>* rules;
      std::vector<char>* secrets;
      bool* any;
      std::vector<size_t>* phone_words;
      std::vector<size_t>* first_end;
      std::vector<size_t>* last_end;
    } hits{&rule_hit, &secret_hit, &any, &phone_words, &first_end, &last_end};
    auto on_match = [](unsigned int id, unsigned long long, unsigned long long to, unsigned int,
                       void* ctx) -> int {
      auto* h = static_cast<Hits*>(ctx);
      if (id >= kSecretIdBase) {
        (*h->secrets)[id - kSecretIdBase] = 1;
      } else if (id >= kPhoneWordIdBase) {
        if (h->phone_words->size() < kMaxCandidatesPerRule) {
          h->phone_words->push_back(to - kPhoneWords[id - kPhoneWordIdBase].size());
        }
        return 0;  // a word alone is no hit
      } else {
        (*h->rules)[id] = 1;
        size_t& first = (*h->first_end)[id];
        first = std::min(first, static_cast<size_t>(to));
        size_t& last = (*h->last_end)[id];
        last = std::max(last, static_cast<size_t>(to));
      }
      *h->any = true;
      return 0;
    };
    hs_scratch_t* scratch = AcquireScratch();
    bool ok = scratch != nullptr;
    for (hs_database_t* db : dbs) {
      if (ok && db != nullptr) {
        ok = hs_scan(db, text.data(), static_cast<unsigned>(text.size()), 0, scratch, on_match,
                     &hits) == HS_SUCCESS;
      }
    }
    if (!ok) {
      // Cannot happen short of memory exhaustion; fail towards scanning everything.
      std::fill(rule_hit.begin(), rule_hit.end(), 1);
      std::fill(secret_hit.begin(), secret_hit.end(), 1);
      any = true;
    }
    if (scratch != nullptr) ReleaseScratch(scratch);
  }
  if (set != nullptr) {
    std::vector<int> matched;
    RE2::Set::ErrorInfo error;
    if (set->Match(text, &matched, &error)) {
      for (int i : matched) {
        if (set_rule[i] >= 0) {
          rule_hit[set_rule[i]] = 1;
        } else {
          secret_hit[-1 - set_rule[i]] = 1;
        }
      }
      any = any || !matched.empty();
    } else if (error.kind != RE2::Set::kNoError) {
      // DFA out of memory: locate every set rule directly instead.
      std::fill(rule_hit.begin(), rule_hit.end(), 1);
      std::fill(secret_hit.begin(), secret_hit.end(), 1);
      any = true;
    }
  }
  const bool hand_scanned =
      card_rule >= 0 || ssn_rule >= 0 || email_rule >= 0 || phone_rule >= 0 || iban_rule >= 0;
  if (!any && !hand_scanned) return;

  ValidateContext context;
  if (aws_key_rule >= 0 && rule_hit[aws_key_rule] && aws_secret_rule >= 0) {
    rule_hit[aws_secret_rule] = 1;
  }
  auto add = [&](const std::string& id, Action action, Kind kind, size_t begin, size_t end) {
    if (out->size() >= kMaxFindings) return;
    if (!allow.empty() && allow.count(std::string(text.substr(begin, end - begin))) > 0) return;
    auto [b, e] = view.ToBase(begin, end);
    out->push_back(Finding{id, action, kind, where, std::string(view.layer), b, e - b});
  };
  // The access key rule runs first: its result is the secret key rule's context.
  std::vector<size_t> order;
  if (aws_key_rule >= 0) order.push_back(aws_key_rule);
  for (size_t r = 0; r < rules.size(); ++r) {
    if (static_cast<int>(r) != aws_key_rule) order.push_back(r);
  }
  for (size_t r : order) {
    if (!rule_hit[r] || rules[r].fast != FastScan::kRegex) continue;
    const Rule& rule = rules[r];
    re2::StringPiece input(text.data(), text.size());
    re2::StringPiece groups[3];
    const int ngroups = 1 + std::min(rule.groups, 2);
    // No locate match starts before locate_from (the RE2 search from there finds the same
    // matches as from the start of the text), nor at or after the end of the last detect match
    // (it would contain a later one): the search stops there, not at the end of the text.
    size_t pos = 0;
    size_t stop = SIZE_MAX;
    if (rule.locate_from != nullptr && first_end[r] != SIZE_MAX) {
      pos = rule.locate_from(text, first_end[r]);
      stop = last_end[r];
    }
    // The secret key without an access key id in the text: the validator wants "secret" in the
    // 256 bytes before the value, so no finding starts before the first "secret" ends, and a
    // rejected candidate (≤ 42 bytes) resumes one byte on: the search from just before the
    // word sees the same candidates from there on as the search from the start. Nor does a
    // finding start more than 256 bytes after the last "secret" ends.
    if (static_cast<int>(r) == aws_secret_rule && !context.aws_key_id_present &&
        first_end[r] != SIZE_MAX) {
      pos = first_end[r] > 7 ? first_end[r] - 7 : 0;
      stop = last_end[r] + 256;
    }
    for (size_t n = 0; n < kMaxCandidatesPerRule && pos <= text.size() && pos < stop; ++n) {
      if (!rule.locate->Match(input, pos, text.size(), RE2::UNANCHORED, groups, ngroups)) break;
      const re2::StringPiece span = ReportedSpan(groups, ngroups);
      size_t begin = static_cast<size_t>(span.data() - text.data());
      size_t end = begin + span.size();
      const size_t match_end =
          static_cast<size_t>(groups[0].data() - text.data()) + groups[0].size();
      if (rule.validate == nullptr || rule.validate(text, &begin, &end, context)) {
        add(rule.id, rule.action, rule.kind, begin, end);
        if (static_cast<int>(r) == aws_key_rule) context.aws_key_id_present = true;
        // Continue after the match (a capture may end before a consumed delimiter: then at
        // the capture's end, so adjacent candidates sharing a delimiter are found too).
        pos = std::max(end, begin + 1);
        if (ngroups == 1) pos = std::max(pos, match_end);
      } else {
        // A rejected short candidate may hide a valid one starting inside it; a long one is
        // skipped whole (re-searching inside it would be quadratic: "aaaa…a@x" of 64 KiB).
        pos = groups[0].size() <= kMaxRescanMatch ? begin + 1 : match_end;
      }
    }
  }
  if (hand_scanned) {
    const AddFn add_rule = [&](int r, size_t begin, size_t end) {
      add(rules[r].id, rules[r].action, rules[r].kind, begin, end);
    };
    TextBytes seen;
    if (card_rule >= 0 || ssn_rule >= 0 || phone_rule >= 0 || iban_rule >= 0) {
      ScanNumbers(text, add_rule, &seen);
      if (bytes != nullptr) *bytes = seen;
    }
    if (email_rule >= 0 && seen.at) ScanEmails(text, add_rule);
    // Phone numbers after a context word: the phone pattern anchored at each word.
    for (size_t w : phone_words) LocateAnchored(phone_rule, text, w, add_rule);
  }
  for (size_t s = 0; s < secrets.size(); ++s) {
    if (!secret_hit[s]) continue;
    for (const std::string& form : secrets[s].forms) {
      for (size_t at = text.find(form); at != std::string_view::npos;
           at = text.find(form, at + 1)) {
        add(secrets[s].id, Action::kBlock, Kind::kSecretValue, at, at + form.size());
        if (out->size() >= kMaxFindings) break;
      }
    }
  }
}

namespace {

inline bool IsDigitByte(char c) { return c >= '0' && c <= '9'; }
inline bool IsWordByte(char c) {
  return IsDigitByte(c) || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
inline bool IsEmailLocalByte(char c) {
  return IsWordByte(c) || c == '.' || c == '%' || c == '+' || c == '-';
}
inline bool IsDomainByte(char c) {
  return IsDigitByte(c) || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '-' || c == '.';
}
inline bool IsAlphaByte(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

#if defined(__SSE2__)
// Bit i set: t[i] is an ASCII digit (16 bytes from t).
inline uint32_t DigitMask16(const char* t) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t));
  const __m128i d = _mm_sub_epi8(v, _mm_set1_epi8('0'));
  const __m128i is_digit = _mm_cmpeq_epi8(_mm_min_epu8(d, _mm_set1_epi8(9)), d);
  return static_cast<uint32_t>(_mm_movemask_epi8(is_digit));
}
#endif

// Digits in the phone-shaped run at t[i] ([0-9 .()-], at most 24 bytes).
inline size_t PhoneDigits(const char* t, size_t i, size_t n) {
  size_t digits = 0;
  for (size_t p = i; p < n && p < i + 24; ++p) {
    const char c = t[p];
    if (IsDigitByte(c)) {
      ++digits;
    } else if (c != ' ' && c != '.' && c != '-' && c != '(' && c != ')') {
      break;
    }
  }
  return digits;
}

// First i' ≥ i with t[i'] a digit (== want) or n.
inline size_t SkipWhile(const char* t, size_t i, size_t n, bool digits) {
#if defined(__SSE2__)
  while (i + 16 <= n) {
    uint32_t mask = DigitMask16(t + i);
    if (digits) mask = ~mask & 0xffff;
    if (mask != 0) return i + static_cast<size_t>(__builtin_ctz(mask));
    i += 16;
  }
#endif
  while (i < n && IsDigitByte(t[i]) == digits) ++i;
  return i;
}

}  // namespace

// Runs `rule`'s locate pattern anchored at `start`; a validated match is a finding.
void Engine::Impl::LocateAnchored(int r, std::string_view text, size_t start,
                                  const AddFn& add) const {
  const Rule& rule = rules[r];
  re2::StringPiece input(text.data(), text.size());
  re2::StringPiece groups[3];
  const int ngroups = 1 + std::min(rule.groups, 2);
  if (!rule.locate->Match(input, start, text.size(), RE2::ANCHOR_START, groups, ngroups)) return;
  const re2::StringPiece span = ReportedSpan(groups, ngroups);
  size_t begin = static_cast<size_t>(span.data() - text.data());
  size_t end = begin + span.size();
  if (rule.validate == nullptr || rule.validate(text, &begin, &end, ValidateContext{})) {
    add(r, begin, end);
  }
}

// One pass for the number-shaped rules, without a regex pass over the text: the byte-class
// masks of each 64-byte block (classify.h) give where a \b-anchored number can start (a digit
// after a non-word byte; a digit run inside a word, "a1b2" or base64, starts nothing) and where
// an IBAN can (\b[A-Z]{2}\d{2}), and keep only the number starts that can begin a candidate:
// ≥ 13 bytes of [0-9 -] (every card, and every chain with an SSN after its first group), 11
// bytes of [0-9 -] with a ' ' or '-' at 3 and 6 (an SSN's shape), or a phone marker '+' / '('
// before ≥ 10 bytes of [0-9 .()-]. A kept start is parsed as a chain of digit groups:
//  - Cards: digit groups joined by single ' ' or '-' form a chain. \b(?:\d[ -]?){12,18}\d\b
//    matches whole groups only, so its candidates are, per start group, the longest run of
//    groups with 13–19 digits that ends before a non-word byte; a rejected candidate moves
//    the start one group on (as the RE2 search from the next byte would).
//  - SSN: three groups of 3, 2 and 4 digits with one kind of separator.
//  - Phone: a number after '+' or '(' (not after a byte the validator rejects) with ≥ 9
//    digits in the next 24 bytes: the phone pattern runs anchored at the '+' or '('. (After a
//    context word: Vectorscan reports each word and the pattern runs anchored there.)
//  - IBAN: the IBAN pattern runs anchored at each possible start.
// A dropped start yields no candidate, and lies in no kept start's chain (a chain's later
// starts have shorter [0-9 -] runs, and an SSN after the first group makes the chain ≥ 13
// bytes), so the candidates are the same as the RE2 patterns' over the whole text
// (DlpCorpusTest cross-checks). Also reports whether the text has a '@' (e-mail candidates)
// and a '%' or '\\' (decoded views).
void Engine::Impl::ScanNumbers(std::string_view text, const AddFn& add, TextBytes* bytes) const {
  constexpr size_t kMaxGroups = 64;
  const size_t n = text.size();
  const char* t = text.data();
  struct Group {
    size_t begin, end;
  };
  Group groups[kMaxGroups];
  const ValidateContext context;
  // The chain of digit groups from the kept start i; returns where the next start may be.
  auto on_number = [&](size_t i) -> size_t {
    size_t count = 0;
    size_t j = i;
    for (;;) {
      const size_t begin = j;
      j = SkipWhile(t, j, n, true);
      groups[count++] = {begin, j};
      if (count < kMaxGroups && j + 1 < n && (t[j] == ' ' || t[j] == '-') &&
          IsDigitByte(t[j + 1])) {
        ++j;
        continue;
      }
      break;
    }
    // groups[0] is startable by construction; later groups follow a separator.
    auto endable = [&](size_t g) { return groups[g].end == n || !IsWordByte(t[groups[g].end]); };
    if (card_rule >= 0 && groups[count - 1].end - groups[0].begin >= 13) {
      for (size_t k = 0; k < count;) {
        size_t digits = 0;
        int best = -1;
        for (size_t e = k; e < count; ++e) {
          digits += groups[e].end - groups[e].begin;
          if (digits > 19) break;
          if (digits >= 13 && endable(e)) best = static_cast<int>(e);
        }
        if (best < 0) {
          ++k;
          continue;
        }
        size_t begin = groups[k].begin, end = groups[best].end;
        if (rules[card_rule].validate(text, &begin, &end, context)) {
          add(card_rule, begin, end);
          k = static_cast<size_t>(best) + 1;
        } else {
          ++k;
        }
      }
    }
    if (ssn_rule >= 0) {
      for (size_t k = 0; k + 2 < count; ++k) {
        const Group &a = groups[k], &b = groups[k + 1], &c = groups[k + 2];
        if (a.end - a.begin != 3 || b.end - b.begin != 2 || c.end - c.begin != 4) continue;
        if (t[a.end] != t[b.end] || !endable(k + 2)) continue;
        size_t begin = a.begin, end = c.end;
        if (rules[ssn_rule].validate(text, &begin, &end, context)) add(ssn_rule, begin, end);
      }
    }
    if (phone_rule >= 0) {
      const char before = i > 0 ? t[i - 1] : 0;
      const bool marked = (before == '+' || before == '(') &&
                          (i < 2 || !(IsWordByte(t[i - 2]) || t[i - 2] == '.' || t[i - 2] == '/' ||
                                      t[i - 2] == '+' || t[i - 2] == '-'));
      // (Numbers after a context word are found from the words: see ScanView.)
      if (marked && PhoneDigits(t, i, n) >= 9) LocateAnchored(phone_rule, text, i - 1, add);
    }
    return std::max(j, i + 1);
  };
  const bool ibans = iban_rule >= 0;
  const bool phones = phone_rule >= 0;
  constexpr size_t kBatch = 16;  // blocks classified per call (+ 1 of look-ahead)
  BlockMasks masks[kBatch + 1];
  uint64_t iban_starts[kBatch];
  uint64_t number_starts[kBatch];
  ClassifySeen seen;
  uint64_t word_before = 0;    // bit 0: the byte before the block is a word byte
  uint64_t marker_before = 0;  // bit 0: ... is '+' or '('
  size_t resume = 0;           // starts before this are inside a parsed chain
  for (size_t base = 0; base < n; base += 64 * kBatch) {
    const size_t blocks = std::min(kBatch, (n - base + 63) / 64);
    ClassifyBlocks(text, base, blocks + 1, masks, &seen);
    // The starts of every block of the batch first (no branches: the blocks pipeline), then
    // the candidates in text order.
    for (size_t k = 0; k < blocks; ++k) {
      const BlockMasks& cur = masks[k];
      const BlockMasks& next = masks[k + 1];
      // Bits s.. of the block's mask with the next block's as look-ahead (0 < s < 64).
      const auto ahead = [](uint64_t lo, uint64_t hi, int s) { return lo >> s | hi << (64 - s); };
      const uint64_t not_after_word = ~(cur.word << 1 | word_before);
      const uint64_t after_marker = cur.marker << 1 | marker_before;
      word_before = cur.word >> 63;
      marker_before = cur.marker >> 63;
      iban_starts[k] = ibans ? cur.upper & ahead(cur.upper, next.upper, 1) &
                                   ahead(cur.digit, next.digit, 2) &
                                   ahead(cur.digit, next.digit, 3) & not_after_word
                             : 0;
      // Runs: bit i of x<k> is set when bytes i..i+k-1 are all in the class (the look-ahead
      // halves hold the first bits of the next block's runs, enough for these shifts).
      const uint64_t sep = cur.card_sep, sep_hi = next.card_sep;
      const uint64_t c1 = cur.digit | sep, c1_hi = next.digit | sep_hi;  // [0-9 -]
      const uint64_t c2 = c1 & ahead(c1, c1_hi, 1), c2_hi = c1_hi & c1_hi >> 1;
      const uint64_t c4 = c2 & ahead(c2, c2_hi, 2), c4_hi = c2_hi & c2_hi >> 2;
      const uint64_t c8 = c4 & ahead(c4, c4_hi, 4);
      uint64_t keep = c8 & ahead(c4, c4_hi, 8) & ahead(c1, c1_hi, 12);  // 13 bytes
      keep |= c8 & ahead(c2, c2_hi, 8) & ahead(c1, c1_hi, 10) & ahead(sep, sep_hi, 3) &
              ahead(sep, sep_hi, 6);  // ddd-dd-dddd's shape
      if (phones) {
        const uint64_t m1 = c1 | cur.num_sep, m1_hi = c1_hi | next.num_sep;  // [0-9 .()-]
        const uint64_t m2 = m1 & ahead(m1, m1_hi, 1), m2_hi = m1_hi & m1_hi >> 1;
        const uint64_t m4 = m2 & ahead(m2, m2_hi, 2), m4_hi = m2_hi & m2_hi >> 2;
        const uint64_t m8 = m4 & ahead(m4, m4_hi, 4);
        keep |= m8 & ahead(m2, m2_hi, 8) & after_marker;  // 10 bytes after '+' or '('
      }
      number_starts[k] = cur.digit & not_after_word & keep;
    }
    for (size_t k = 0; k < blocks; ++k) {
      const size_t b = base + 64 * k;
      for (uint64_t s = iban_starts[k]; s != 0; s &= s - 1) {
        LocateAnchored(iban_rule, text, b + static_cast<size_t>(__builtin_ctzll(s)), add);
      }
      for (uint64_t s = number_starts[k]; s != 0; s &= s - 1) {
        const size_t pos = b + static_cast<size_t>(__builtin_ctzll(s));
        if (pos < resume) continue;
        resume = on_number(pos);
      }
    }
  }
  bytes->at = seen.at;
  bytes->escape = seen.escape;
}

// The e-mail pattern's candidates around each '@': the local part runs back to the start of
// its byte class (or the end of the previous match), the domain is the longest prefix of the
// following domain bytes of the form label(.label)*.letters{2,}; a rejected candidate of ≤ 64
// bytes is retried one byte later (as the RE2 search would), a longer one is given up.
void Engine::Impl::ScanEmails(std::string_view text, const AddFn& add) const {
  const size_t n = text.size();
  const char* t = text.data();
  const ValidateContext context;
  size_t floor = 0;  // end of the previous match
  for (const char* at = static_cast<const char*>(std::memchr(t, '@', n)); at != nullptr;
       at = static_cast<const char*>(std::memchr(at + 1, '@', t + n - (at + 1)))) {
    const size_t a = static_cast<size_t>(at - t);
    size_t local = a;
    while (local > floor && IsEmailLocalByte(t[local - 1])) --local;
    if (local == a) continue;
    size_t run = a + 1;
    while (run < n && IsDomainByte(t[run])) ++run;
    // Longest valid domain end: a '.' followed by ≥ 2 letters, every label before it non-empty.
    size_t domain_end = 0;
    bool labels_ok = a + 1 < run && t[a + 1] != '.';
    for (size_t p = a + 2; p < run && labels_ok; ++p) {
      if (t[p] != '.') continue;
      if (t[p - 1] == '.') break;  // empty label: nothing longer can match
      size_t letters = p + 1;
      while (letters < run && IsAlphaByte(t[letters])) ++letters;
      if (letters - (p + 1) >= 2) domain_end = letters;
    }
    if (domain_end == 0) continue;
    for (size_t begin = local; begin < a; ++begin) {
      size_t b = begin, e = domain_end;
      if (rules[email_rule].validate(text, &b, &e, context)) {
        add(email_rule, b, e);
        floor = e;
        break;
      }
      if (domain_end - begin > kMaxRescanMatch) break;
    }
  }
}

void Engine::Impl::ScanViews(std::string_view text, Where where, size_t plus_from,
                             std::string_view boundary, std::vector<Finding>* out) const {
  // One view at a time (built, scanned, dropped): at most the text and two decodings live.
  TextBytes seen;
  ScanView(View{text, "", 0, {}}, where, out, &seen);
  const bool has_plus = plus_from != std::string_view::npos && HasByte(text, '+');
  if ((seen.escape && HasByte(text, '%')) || has_plus) {
    std::string url;
    if (UrlDecode(text, plus_from, &url, nullptr)) {
      const auto url_map = [text, plus_from] {
        std::string decoded;
        OffsetMap map;
        UrlDecode(text, plus_from, &decoded, &map);
        return std::make_pair(std::move(decoded), std::move(map));
      };
      ScanView(View{url, "url", 0, [url_map] { return url_map().second; }}, where, out);
      if (HasByte(url, '\\')) {
        std::string both;
        if (JsonUnescape(url, &both, nullptr)) {
          ScanView(View{both, "url+json", 0,
                        [url_map] {
                          auto [decoded, outer] = url_map();
                          std::string unescaped;
                          OffsetMap inner;
                          JsonUnescape(decoded, &unescaped, &inner);
                          return Compose(inner, outer);
                        }},
                   where, out);
        }
      }
    }
  }
  if (seen.escape && HasByte(text, '\\')) {
    std::string json;
    if (JsonUnescape(text, &json, nullptr)) {
      const auto json_map = [text] {
        std::string decoded;
        OffsetMap map;
        JsonUnescape(text, &decoded, &map);
        return std::make_pair(std::move(decoded), std::move(map));
      };
      ScanView(View{json, "json", 0, [json_map] { return json_map().second; }}, where, out);
      if (HasByte(json, '%')) {
        std::string both;
        if (UrlDecode(json, std::string_view::npos, &both, nullptr)) {
          ScanView(View{both, "json+url", 0,
                        [json_map] {
                          auto [decoded, outer] = json_map();
                          std::string unescaped;
                          OffsetMap inner;
                          UrlDecode(decoded, std::string_view::npos, &unescaped, &inner);
                          return Compose(inner, outer);
                        }},
                   where, out);
        }
      }
    }
  }
  if (!boundary.empty()) {
    absl::StatusOr<std::vector<MultipartPart>> parts =
        ParseMultipart(text, boundary, kMaxMultipartParts);
    if (!parts.ok()) return;
    for (const MultipartPart& part : *parts) {
      const std::string_view body = text.substr(part.offset, part.length);
      std::string decoded;
      if (part.content_transfer_encoding == "base64") {
        if (Base64Decode(body, &decoded, nullptr)) {
          ScanView(View{decoded, "multipart+base64", part.offset,
                        [body] {
                          std::string tmp;
                          OffsetMap map;
                          Base64Decode(body, &tmp, &map);
                          return map;
                        }},
                   where, out);
        }
      } else if (part.content_type == "application/x-www-form-urlencoded" && HasByte(body, '+')) {
        if (UrlDecode(body, 0, &decoded, nullptr)) {
          ScanView(View{decoded, "multipart+url", part.offset,
                        [body] {
                          std::string tmp;
                          OffsetMap map;
                          UrlDecode(body, 0, &tmp, &map);
                          return map;
                        }},
                   where, out);
        }
      }
    }
  }
}

Result Engine::Impl::Scan(std::string_view text, Where where, size_t plus_from,
                          std::string_view boundary, std::vector<Finding> extra) const {
  std::vector<Finding> findings = std::move(extra);
  ScanViews(text, where, plus_from, boundary, &findings);
  // One finding per rule and span: the same match seen in several views is kept once.
  std::stable_sort(findings.begin(), findings.end(), [](const Finding& a, const Finding& b) {
    return a.offset != b.offset ? a.offset < b.offset : a.length > b.length;
  });
  Result result;
  for (Finding& f : findings) {
    const auto overlaps = [&f](const Finding& g) {
      if (g.rule_id != f.rule_id) return false;
      if (g.length == 0 || f.length == 0) return g.offset == f.offset && g.length == f.length;
      return f.offset < g.offset + g.length && g.offset < f.offset + f.length;
    };
    if (std::none_of(result.findings.begin(), result.findings.end(), overlaps)) {
      result.findings.push_back(std::move(f));
    }
  }
  bool mask = false;
  for (const Finding& f : result.findings) {
    result.decision = std::max(result.decision, f.action);
    if (f.action == Action::kBlock && result.block_rule.empty()) result.block_rule = f.rule_id;
    if (f.action >= Action::kRedact && f.length > 0) mask = true;
  }
  if (mask) {
    // Every redact and block span replaced (a blocked message's audit copy is redacted too).
    std::string redacted;
    redacted.reserve(text.size());
    size_t pos = 0;
    for (const Finding& f : result.findings) {
      if (f.action < Action::kRedact || f.length == 0) continue;
      const size_t end = std::min(text.size(), f.offset + f.length);
      if (end <= pos) continue;  // inside a span already replaced
      const size_t begin = std::max(pos, f.offset);
      redacted.append(text.substr(pos, begin - pos));
      redacted.append("[REDACTED:").append(f.rule_id).append("]");
      pos = end;
    }
    redacted.append(text.substr(pos));
    result.redacted = std::move(redacted);
  }
  return result;
}

namespace {

class DisabledScanner : public BodyScanner {
 public:
  void Feed(std::string_view) override {}
  bool oversize() const override { return false; }
  Result Finish() override { return {}; }
};

class StreamingBodyScanner : public BodyScanner {
 public:
  StreamingBodyScanner(const Engine::Impl& engine, const BodyInfo& info)
      : engine_(engine), info_(info), cap_(engine.config.max_body_bytes) {
    if (info.chunked) stages_.push_back(NewChunkedDecoder());
    absl::StatusOr<std::vector<std::unique_ptr<StreamStage>>> content =
        NewContentDecoders(info.content_encoding);
    if (!content.ok()) {
      error_ = content.status();
    } else {
      for (auto& stage : *content) stages_.push_back(std::move(stage));
    }
  }

  void Feed(std::string_view bytes) override {
    raw_bytes_ += bytes.size();
    if (raw_bytes_ > cap_) oversize_ = true;
    if (oversize_ || !error_.ok()) return;
    Push(0, bytes);
  }

  bool oversize() const override { return oversize_; }

  Result Finish() override {
    if (!oversize_ && error_.ok()) {
      for (size_t i = 0; i < stages_.size() && error_.ok() && !oversize_; ++i) {
        absl::Status status =
            stages_[i]->Finish([this, i](std::string_view out) { return Push(i + 1, out); });
        if (!status.ok() && error_.ok()) error_ = status;
      }
    }
    if (oversize_) {
      const Action action =
          engine_.config.on_oversize == OversizePolicy::kBlock ? Action::kBlock : Action::kLog;
      Result result;
      result.findings.push_back(
          Finding{std::string(kRuleOversize), action, Kind::kPolicy, info_.where, "", 0, 0});
      result.decision = action;
      if (action == Action::kBlock) result.block_rule = std::string(kRuleOversize);
      return result;
    }
    std::vector<Finding> extra;
    if (!error_.ok()) {
      const auto it = engine_.actions.find(kRuleUndecodable);
      const Action action = it == engine_.actions.end() ? Action::kBlock : it->second;
      if (action != Action::kNone) {
        extra.push_back(
            Finding{std::string(kRuleUndecodable), action, Kind::kPolicy, info_.where, "", 0, 0});
      }
    }
    const std::string lower_type = LowerAscii(info_.content_type);
    const size_t plus_from =
        lower_type.rfind("application/x-www-form-urlencoded", 0) == 0 ? 0 : std::string::npos;
    return engine_.Scan(buffer_, info_.where, plus_from, MultipartBoundary(info_.content_type),
                        std::move(extra));
  }

 private:
  // Passes `bytes` through stages [level, end) into the buffer; false once over the cap.
  bool Push(size_t level, std::string_view bytes) {
    if (oversize_) return false;
    if (level == stages_.size()) {
      if (buffer_.size() + bytes.size() > cap_) {
        oversize_ = true;
        return false;
      }
      buffer_.append(bytes);
      return true;
    }
    absl::Status status = stages_[level]->Feed(
        bytes, [this, level](std::string_view out) { return Push(level + 1, out); });
    if (!status.ok() && error_.ok()) error_ = status;
    return !oversize_ && error_.ok();
  }

  const Engine::Impl& engine_;
  BodyInfo info_;
  uint64_t cap_;
  uint64_t raw_bytes_ = 0;
  bool oversize_ = false;
  absl::Status error_;
  std::vector<std::unique_ptr<StreamStage>> stages_;
  std::string buffer_;
};

}  // namespace

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

absl::StatusOr<std::shared_ptr<const Engine>> Engine::Compile(const DlpConfig& config,
                                                              const EngineOptions& engine_options) {
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  for (const std::string& a : config.allow) impl->allow.insert(a);
  for (const BuiltinRule& rule : BuiltinRules()) {
    const auto it = config.rule_actions.find(std::string(rule.id));
    impl->actions[std::string(rule.id)] =
        it == config.rule_actions.end() ? rule.default_action : it->second;
  }
  impl->actions[std::string(kRuleOversize)] =
      config.on_oversize == OversizePolicy::kBlock ? Action::kBlock : Action::kLog;

  std::vector<std::string> hs_patterns;
  std::vector<unsigned> hs_ids;
  auto set = std::make_unique<RE2::Set>(Latin1Options(), RE2::UNANCHORED);
  const RE2::Options options = Latin1Options();

  for (const RuleDef& def : BuiltinRuleDefs()) {
    const Action action = impl->actions[std::string(def.id)];
    if (action == Action::kNone) continue;
    Impl::Rule rule;
    rule.id = std::string(def.id);
    rule.action = action;
    for (const BuiltinRule& b : BuiltinRules()) {
      if (b.id == def.id) rule.kind = b.kind;
    }
    rule.locate = std::make_unique<RE2>(def.locate, options);
    if (!rule.locate->ok()) {
      return absl::InternalError("dlp: built-in rule " + rule.id + ": " + rule.locate->error());
    }
    rule.groups = rule.locate->NumberOfCapturingGroups();
    rule.validate = def.validate;
    const int index = static_cast<int>(impl->rules.size());
    if (engine_options.vectorscan) rule.locate_from = def.locate_from;
    if (engine_options.vectorscan && def.fast != FastScan::kRegex) {
      rule.fast = def.fast;
      switch (def.fast) {
        case FastScan::kNumbers:
          if (rule.id == "dlp:credit_card") impl->card_rule = index;
          if (rule.id == "dlp:us_ssn") impl->ssn_rule = index;
          if (rule.id == "dlp:phone") {
            impl->phone_rule = index;
            for (size_t w = 0; w < std::size(kPhoneWords); ++w) {
              hs_patterns.push_back("(?i)" + std::string(kPhoneWords[w]));
              hs_ids.push_back(kPhoneWordIdBase + static_cast<unsigned>(w));
            }
          }
          if (rule.id == "dlp:iban") impl->iban_rule = index;
          break;
        case FastScan::kEmail:
          impl->email_rule = index;
          break;
        case FastScan::kRegex:
          break;
      }
    } else if (def.detect.empty()) {
      std::string error;
      if (set->Add(def.locate, &error) < 0) {
        return absl::InternalError("dlp: built-in rule " + rule.id + ": " + error);
      }
      impl->set_rule.push_back(index);
    } else if (!engine_options.vectorscan) {
      for (const std::string& p : def.detect) {
        std::string error;
        if (set->Add(p, &error) < 0) {
          return absl::InternalError("dlp: built-in rule " + rule.id + ": " + error);
        }
        impl->set_rule.push_back(index);
      }
    } else {
      for (const std::string& p : def.detect) {
        hs_patterns.push_back(p);
        hs_ids.push_back(static_cast<unsigned>(index));
      }
    }
    if (rule.id == "dlp:aws_access_key") impl->aws_key_rule = index;
    if (rule.id == "dlp:aws_secret_key") impl->aws_secret_rule = index;
    impl->rules.push_back(std::move(rule));
  }
  for (const CustomPattern& custom : config.custom_patterns) {
    if (custom.action == Action::kNone) continue;
    Impl::Rule rule;
    rule.id = "dlp:custom:" + custom.name;
    rule.kind = Kind::kCustom;
    rule.action = custom.action;
    rule.locate = std::make_unique<RE2>(custom.regex, options);
    if (!rule.locate->ok()) {
      return absl::InvalidArgumentError("dlp.custom " + custom.name + ": " + rule.locate->error());
    }
    std::string error;
    if (set->Add(custom.regex, &error) < 0) {
      return absl::InvalidArgumentError("dlp.custom " + custom.name + ": " + error);
    }
    impl->set_rule.push_back(static_cast<int>(impl->rules.size()));
    impl->actions[rule.id] = rule.action;
    impl->rules.push_back(std::move(rule));
  }
  for (size_t i = 0; i < config.secret_values.size(); ++i) {
    Impl::Secret secret;
    secret.id = "dlp:secret:" + config.secret_values[i].name;
    secret.forms = SecretForms(config.secret_values[i].value);
    for (const std::string& form : secret.forms) {
      if (engine_options.vectorscan) {
        hs_patterns.push_back(HexEscape(form));
        hs_ids.push_back(kSecretIdBase + static_cast<unsigned>(i));
      } else {
        std::string error;
        if (set->Add(RE2::QuoteMeta(form), &error) < 0) {
          return absl::InternalError("dlp: RE2::Set rejected a secret value");
        }
        impl->set_rule.push_back(-1 - static_cast<int>(i));  // < 0: secret value -1-i
      }
    }
    impl->actions[secret.id] = Action::kBlock;
    impl->secrets.push_back(std::move(secret));
  }

  if (!impl->set_rule.empty()) {
    if (!set->Compile()) return absl::InternalError("dlp: RE2::Set compile failed (memory)");
    impl->set = std::move(set);
  }
  for (int caseless = 0; caseless < 2; ++caseless) {
    std::vector<const char*> expressions;
    std::vector<unsigned> flags;
    std::vector<unsigned> ids;
    for (size_t i = 0; i < hs_patterns.size(); ++i) {
      const unsigned id = hs_ids[i];
      // Phone context words report every occurrence (each is a candidate start).
      const bool word = id >= kPhoneWordIdBase && id < kSecretIdBase;
      if ((word || hs_patterns[i].rfind("(?i)", 0) == 0) != (caseless == 1)) continue;
      expressions.push_back(hs_patterns[i].c_str());
      // So do the rules whose locate pass starts near their first detect match: Vectorscan
      // does not promise to report a single match first that ends first.
      const bool all_ends =
          !word && id < kSecretIdBase &&
          (impl->rules[id].locate_from != nullptr || static_cast<int>(id) == impl->aws_secret_rule);
      flags.push_back(word || all_ends ? 0u : HS_FLAG_SINGLEMATCH);
      ids.push_back(id);
    }
    if (expressions.empty()) continue;
    hs_compile_error_t* error = nullptr;
    if (hs_compile_multi(expressions.data(), flags.data(), ids.data(),
                         static_cast<unsigned>(expressions.size()), HS_MODE_BLOCK, nullptr,
                         &impl->dbs[caseless], &error) != HS_SUCCESS) {
      std::string message = error != nullptr && error->message != nullptr ? error->message : "?";
      const int which = error != nullptr ? error->expression : -1;
      hs_free_compile_error(error);
      // A secret value's pattern is never shown (it is the secret, hex-escaped).
      if (which >= 0 && ids[which] >= kSecretIdBase) {
        return absl::InternalError("dlp: Vectorscan rejected a secret value: " + message);
      }
      return absl::InternalError("dlp: Vectorscan compile failed: " + message);
    }
    // One scratch large enough for both databases.
    if (hs_alloc_scratch(impl->dbs[caseless], &impl->scratch_prototype) != HS_SUCCESS) {
      return absl::InternalError("dlp: hs_alloc_scratch failed");
    }
  }
  return std::shared_ptr<const Engine>(new Engine(std::move(impl)));
}

Result Engine::ScanText(std::string_view text, Where where) const {
  if (!impl_->config.enabled) return {};
  if (where == Where::kResponseBody && !impl_->config.scan_responses) return {};
  if (text.size() > impl_->config.max_body_bytes) {
    const Action action = impl_->actions.at(std::string(kRuleOversize));
    Result result;
    result.findings.push_back(
        Finding{std::string(kRuleOversize), action, Kind::kPolicy, where, "", 0, 0});
    result.decision = action;
    if (action == Action::kBlock) result.block_rule = std::string(kRuleOversize);
    return result;
  }
  size_t plus_from = std::string_view::npos;
  if (where == Where::kUrl) plus_from = text.find('?');
  return impl_->Scan(text, where, plus_from, "", {});
}

std::unique_ptr<BodyScanner> Engine::NewBodyScanner(const BodyInfo& info) const {
  if (!impl_->config.enabled ||
      (info.where == Where::kResponseBody && !impl_->config.scan_responses)) {
    return std::make_unique<DisabledScanner>();
  }
  return std::make_unique<StreamingBodyScanner>(*impl_, info);
}

const DlpConfig& Engine::config() const { return impl_->config; }

Action Engine::ActionFor(std::string_view rule_id) const {
  const auto it = impl_->actions.find(rule_id);
  return it == impl_->actions.end() ? Action::kNone : it->second;
}

}  // namespace esb::governance::dlp

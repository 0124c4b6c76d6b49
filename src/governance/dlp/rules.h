// The built-in detectors' definitions (internal to the DLP library): each rule's Vectorscan
// detect patterns (literal-anchored secrets) or how else it is found (FastScan), the RE2
// pattern that locates matches, and the validator that accepts a located candidate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "governance/dlp/dlp.h"

namespace esb::governance::dlp {

// What a validator may look at besides its candidate.
struct ValidateContext {
  bool aws_key_id_present = false;  // a valid AWS access key id was found in the same text
};

// Accepts or rejects the candidate view[*begin, *end); may narrow or widen the span (IBAN to
// its country length, a PEM key to its END line).
using Validator = bool (*)(std::string_view view, size_t* begin, size_t* end,
                           const ValidateContext& context);

// The earliest offset in `text` where a locate match can start, given that the first detect
// match ends at `first_end`.
using LocateFrom = size_t (*)(std::string_view text, size_t first_end);

// How the Vectorscan engine finds a rule's candidates (EngineOptions{.vectorscan = false}
// ignores this: every rule is then found by the RE2::Set and located over the whole text).
enum class FastScan : uint8_t {
  kRegex,    // `detect` in Vectorscan (or, if empty, `locate` in the RE2::Set), then `locate`
             // over the whole text
  kNumbers,  // the engine's number scan (cards, SSN, phone, IBAN): same candidates as `locate`
  kEmail,    // the engine's scan around each '@': same candidates as `locate`
};

struct RuleDef {
  std::string_view id;
  // Vectorscan detect-only patterns; empty: the locate pattern joins the RE2::Set.
  std::vector<std::string> detect;
  // RE2 (Latin-1) pattern; the span is the first of capture groups 1–2 that took part in the
  // match, else the whole match.
  std::string locate;
  Validator validate = nullptr;  // nullptr: every located match is a finding
  FastScan fast = FastScan::kRegex;
  // With Vectorscan: where the locate pass may start, given the end of the first detect match
  // in the text (every locate match contains a detect match, so none starts before this);
  // nullptr: at the start of the text.
  LocateFrom locate_from = nullptr;
};

// In BuiltinRules() order, without the policy rules.
const std::vector<RuleDef>& BuiltinRuleDefs();

}  // namespace esb::governance::dlp

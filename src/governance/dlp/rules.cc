#include "governance/dlp/rules.h"

#include <algorithm>
#include <cctype>

#include "governance/dlp/validators.h"

namespace esb::governance::dlp {
namespace {

bool IsWordChar(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

bool Contains(std::string_view haystack, std::string_view needle) {
  return haystack.find(needle) != std::string_view::npos;
}

std::string_view Span(std::string_view view, size_t* begin, size_t* end) {
  return view.substr(*begin, *end - *begin);
}

bool CreditCard(std::string_view view, size_t* begin, size_t* end, const ValidateContext&) {
  return CardNumberValid(Span(view, begin, end));
}

bool AwsKeyId(std::string_view view, size_t* begin, size_t* end, const ValidateContext&) {
  const std::string_view key = Span(view, begin, end);
  // AWS documentation keys (AKIAIOSFODNN7EXAMPLE) and other placeholders.
  if (key.size() >= 7 && key.substr(key.size() - 7) == "EXAMPLE") return false;
  return ShannonEntropy(key) >= 3.0;
}

bool AwsSecret(std::string_view view, size_t* begin, size_t* end, const ValidateContext& context) {
  const std::string_view key = Span(view, begin, end);
  if (Contains(key, "EXAMPLE")) return false;
  if (ShannonEntropy(key) < 4.25) return false;
  const bool upper =
      std::any_of(key.begin(), key.end(), [](char c) { return c >= 'A' && c <= 'Z'; });
  const bool lower =
      std::any_of(key.begin(), key.end(), [](char c) { return c >= 'a' && c <= 'z'; });
  const bool digit =
      std::any_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
  if (!upper || !lower || !digit) return false;
  if (context.aws_key_id_present) return true;
  // Context words shortly before the value: "aws_secret_access_key = ...",
  // {"aws": {"secret": ...}}, "SecretAccessKey".
  const size_t window = 256;
  const size_t from = *begin > window ? *begin - window : 0;
  const std::string before = Lower(view.substr(from, *begin - from));
  return Contains(before, "secret") && (Contains(before, "aws") || Contains(before, "access"));
}

bool MinEntropy3(std::string_view view, size_t* begin, size_t* end, const ValidateContext&) {
  return ShannonEntropy(Span(view, begin, end)) >= 3.0;
}

bool GoogleApiKey(std::string_view view, size_t* begin, size_t* end, const ValidateContext&) {
  return ShannonEntropy(Span(view, begin, end)) >= 4.0;
}

bool OpenAi(std::string_view view, size_t* begin, size_t* end, const ValidateContext&) {
  const std::string_view key = Span(view, begin, end);
  const size_t marker = key.find("T3BlbkFJ");
  if (marker == std::string_view::npos) return false;
  // "sk-" [+ "proj-" etc.] + 20.. chars, the marker, 20.. chars.
  const size_t body_start = key.find('-') + 1;
  const size_t before = marker - body_start;
  const size_t after = key.size() - marker - 8;
  return before >= 20 && before <= 200 && after >= 20 && after <= 200;
}

bool PrivateKey(std::string_view view, size_t* begin, size_t* end, const ValidateContext&) {
  // ≥ 64 base64 body characters after the BEGIN line (escaped "\n" in JSON counts its 'n':
  // harmless), up to the END line if there is one.
  constexpr size_t kMaxKeyBytes = 64 * 1024;
  const size_t limit = std::min(view.size(), *end + kMaxKeyBytes);
  const size_t end_marker = view.substr(*end, limit - *end).find("-----END");
  const size_t body_end = end_marker == std::string_view::npos ? limit : *end + end_marker;
  size_t body_chars = 0;
  size_t last_body = *end;
  for (size_t i = *end; i < body_end; ++i) {
    const char c = view[i];
    if (std::isalnum(static_cast<unsigned char>(c)) || c == '+' || c == '/' || c == '=') {
      ++body_chars;
      last_body = i + 1;
    }
  }
  if (body_chars < 64) return false;
  if (end_marker == std::string_view::npos) {
    *end = last_body;
  } else {
    const size_t close = view.find("-----", body_end + 8);
    *end = close == std::string_view::npos || close > limit ? body_end + 8 : close + 5;
  }
  return true;
}

bool Jwt(std::string_view view, size_t* begin, size_t* end, const ValidateContext&) {
  const std::string_view token = Span(view, begin, end);
  const size_t dot1 = token.find('.');
  const size_t dot2 = token.find('.', dot1 + 1);
  if (dot1 < 10 || dot2 - dot1 - 1 < 10) return false;
  if (*begin > 0 && IsWordChar(view[*begin - 1])) return false;
  return JwtHeaderValid(token) && ShannonEntropy(token) >= 3.0;
}

bool Iban(std::string_view view, size_t* begin, size_t* end, const ValidateContext&) {
  const std::string_view text = Span(view, begin, end);
  const int length = IbanLength(text.substr(0, 2));
  if (length == 0) return false;
  // The regex may run on into a following group: cut at the country's length.
  int seen = 0;
  size_t cut = text.size();
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == ' ') continue;
    if (++seen == length) {
      cut = i + 1;
      break;
    }
  }
  if (seen < length) return false;
  if (cut < text.size() && text[cut] != ' ') return false;  // a longer token, not an IBAN
  *end = *begin + cut;
  return IbanValid(text.substr(0, cut));
}

bool Ssn(std::string_view view, size_t* begin, size_t* end, const ValidateContext&) {
  return SsnValid(Span(view, begin, end));
}

bool Email(std::string_view view, size_t* begin, size_t* end, const ValidateContext&) {
  const std::string_view text = Span(view, begin, end);
  const size_t at = text.find('@');
  const std::string_view local = text.substr(0, at);
  const std::string_view domain = text.substr(at + 1);
  if (local.empty() || local.size() > 64 || domain.size() > 253) return false;
  if (local.front() == '.' || local.back() == '.') return false;
  const size_t dot = domain.rfind('.');
  const size_t tld = domain.size() - dot - 1;
  return tld >= 2 && tld <= 24;
}

bool Phone(std::string_view view, size_t* begin, size_t* end, const ValidateContext&) {
  if (*begin > 0 &&
      (IsWordChar(view[*begin - 1]) || view[*begin - 1] == '.' || view[*begin - 1] == '-' ||
       view[*begin - 1] == '/' || view[*begin - 1] == '+')) {
    return false;
  }
  // The pattern's digit groups may run on into a following number ("+1 415 555 2671 12"):
  // drop trailing groups until the number ends cleanly.
  for (;;) {
    const std::string_view text = Span(view, begin, end);
    const size_t digits =
        std::count_if(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
    const bool clean_end =
        *end >= view.size() || !(IsWordChar(view[*end]) || view[*end] == '-' ||
                                 (view[*end] == '.' && *end + 1 < view.size() &&
                                  std::isdigit(static_cast<unsigned char>(view[*end + 1]))));
    if (clean_end && digits >= 10 && digits <= 15) return true;
    const size_t cut = text.find_last_of(" .-");
    if (cut == std::string_view::npos || cut < 2 || digits < 10) return false;
    *end = *begin + cut;
    while (*end > *begin && !std::isdigit(static_cast<unsigned char>(view[*end - 1]))) --*end;
  }
}

// Locate passes that start near the first detect match (RuleDef::locate_from).
// Patterns whose locate match starts at most N bytes before the end of the detect match in it.
template <size_t N>
size_t Reach(std::string_view, size_t first_end) {
  return first_end > N ? first_end - N : 0;
}

bool IsTokenByte(char c) { return IsWordChar(c) || c == '-'; }  // [A-Za-z0-9_\-]

// Start of the run of [A-Za-z0-9_\-] bytes that ends at `end`.
size_t TokenRunStart(std::string_view text, size_t end) {
  while (end > 0 && IsTokenByte(text[end - 1])) --end;
  return end;
}

// "sk-…T3BlbkFJ": the match's bytes before the marker are all [A-Za-z0-9_\-] ("sk-" too).
size_t OpenAiFrom(std::string_view text, size_t first_end) {
  return first_end >= 8 ? TokenRunStart(text, first_end - 8) : 0;
}

// "eyJ….eyJ": the detect match is the byte before the match's first '.' and ".eyJ"; the match
// starts in the run of [A-Za-z0-9_\-] before that '.'.
size_t JwtFrom(std::string_view text, size_t first_end) {
  return first_end >= 4 ? TokenRunStart(text, first_end - 4) : 0;
}

}  // namespace

const std::vector<RuleDef>& BuiltinRuleDefs() {
  // Detect patterns avoid bounded repeats before a literal (Vectorscan slows down or fails to
  // compile them, governance notes C1); lengths are checked by the locate pattern and validator.
  static const auto* defs = new std::vector<RuleDef>{
      {"dlp:credit_card", {}, R"(\b(?:\d[ -]?){12,18}\d\b)", CreditCard, FastScan::kNumbers},
      {"dlp:aws_access_key",
       {"(?:AKIA|ASIA|ABIA|ACCA|A3T[A-Z0-9])[A-Z2-7]{16}"},
       R"(\b((?:AKIA|ASIA|ABIA|ACCA|A3T[A-Z0-9])[A-Z2-7]{16})\b)",
       AwsKeyId,
       FastScan::kRegex,
       Reach<20>},
      // Also run when an access key id is present (see the engine).
      {"dlp:aws_secret_key",
       {"(?i)secret"},
       R"((?:^|[^A-Za-z0-9/+])([A-Za-z0-9/+]{40})(?:$|[^A-Za-z0-9/+=]))",
       AwsSecret},
      {"dlp:github_token",
       {"gh[pousr]_[A-Za-z0-9]{36}", "github_pat_[A-Za-z0-9_]{82}"},
       R"((?:gh[pousr]_[A-Za-z0-9]{36}|github_pat_[A-Za-z0-9_]{82})\b)",
       MinEntropy3,
       FastScan::kRegex,
       Reach<93>},
      {"dlp:slack_token",
       {"xox[baprse]-[0-9A-Za-z]{10}"},
       R"(xox[baprse]-[0-9A-Za-z]{10,}(?:-[0-9A-Za-z]+)+)",
       MinEntropy3,
       FastScan::kRegex,
       Reach<15>},
      {"dlp:slack_webhook",
       {R"(hooks\.slack\.com/(?:services|workflows|triggers)/)"},
       R"(hooks\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9+/_]{20,})",
       nullptr,
       FastScan::kRegex,
       Reach<26>},
      {"dlp:google_api_key",
       {"AIza[0-9A-Za-z_\\-]{35}"},
       R"((AIza[0-9A-Za-z_\-]{35})(?:[^0-9A-Za-z_\-]|$))",
       GoogleApiKey,
       FastScan::kRegex,
       Reach<39>},
      {"dlp:openai_api_key",
       {"T3BlbkFJ"},
       R"(sk-(?:(?:proj|svcacct|admin)-)?[A-Za-z0-9_\-]+T3BlbkFJ[A-Za-z0-9_\-]+)",
       OpenAi,
       FastScan::kRegex,
       OpenAiFrom},
      {"dlp:anthropic_api_key",
       {"sk-ant-(?:api03|admin01)-"},
       R"((sk-ant-(?:api03|admin01)-[A-Za-z0-9_\-]{93}AA)(?:[^A-Za-z0-9_\-]|$))",
       nullptr,
       FastScan::kRegex,
       Reach<15>},
      {"dlp:private_key",
       {"PRIVATE KEY(?: BLOCK)?-----"},
       R"(-----BEGIN[ A-Z0-9_-]{0,100}PRIVATE KEY(?: BLOCK)?-----)",
       PrivateKey,
       FastScan::kRegex,
       Reach<132>},
      {"dlp:jwt",
       {"[A-Za-z0-9_\\-]\\.eyJ"},
       R"(eyJ[A-Za-z0-9_\-]+\.eyJ[A-Za-z0-9_\-]+\.[A-Za-z0-9_\-]*)",
       Jwt,
       FastScan::kRegex,
       JwtFrom},
      {"dlp:iban",
       {},
       R"(\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?\b)",
       Iban,
       FastScan::kNumbers},
      {"dlp:us_ssn", {}, R"(\b(?:\d{3}-\d{2}-\d{4}|\d{3} \d{2} \d{4})\b)", Ssn, FastScan::kNumbers},
      {"dlp:email",
       {},
       R"([A-Za-z0-9._%+\-]+@[A-Za-z0-9\-]+(?:\.[A-Za-z0-9\-]+)*\.[A-Za-z]{2,})",
       Email,
       FastScan::kEmail},
      {"dlp:phone",
       {},
       // An international prefix, an area code in parentheses, or a context word shortly
       // before: bare digit groups are everywhere in machine text.
       R"((\+\d{1,3}[ .\-]?(?:\(\d{1,4}\)[ .\-]?)?\d{1,4}(?:[ .\-]?\d{2,4}){1,5})"
       R"(|\(\d{2,4}\)[ .\-]?\d{2,4}(?:[ .\-]?\d{2,4}){1,3}))"
       R"(|(?i:phone|tel|mobile|cell|fax|call|whatsapp)[^0-9+(\n]{0,20}(\d[\d .\-]{8,18}\d))",
       Phone,
       FastScan::kNumbers},
  };
  return *defs;
}

}  // namespace esb::governance::dlp

#include "governance/dlp/validators.h"

#include <array>
#include <cmath>
#include <cstdint>
#include <string>

namespace esb::governance::dlp {
namespace {

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

int Prefix(std::string_view digits, size_t n) {
  int v = 0;
  for (size_t i = 0; i < n && i < digits.size(); ++i) v = v * 10 + (digits[i] - '0');
  return v;
}

struct IbanCountry {
  char code[3];
  int length;
};

// ISO 13616 registry lengths.
constexpr IbanCountry kIbanCountries[] = {
    {"AD", 24}, {"AE", 23}, {"AL", 28}, {"AT", 20}, {"AZ", 28}, {"BA", 20}, {"BE", 16}, {"BG", 22},
    {"BH", 22}, {"BI", 27}, {"BR", 29}, {"BY", 28}, {"CH", 21}, {"CR", 22}, {"CY", 28}, {"CZ", 24},
    {"DE", 22}, {"DJ", 27}, {"DK", 18}, {"DO", 28}, {"EE", 20}, {"EG", 29}, {"ES", 24}, {"FI", 18},
    {"FK", 18}, {"FO", 18}, {"FR", 27}, {"GB", 22}, {"GE", 22}, {"GI", 23}, {"GL", 18}, {"GR", 27},
    {"GT", 28}, {"HR", 21}, {"HU", 28}, {"IE", 22}, {"IL", 23}, {"IQ", 23}, {"IS", 26}, {"IT", 27},
    {"JO", 30}, {"KW", 30}, {"KZ", 20}, {"LB", 28}, {"LC", 32}, {"LI", 21}, {"LT", 20}, {"LU", 20},
    {"LV", 21}, {"LY", 25}, {"MC", 27}, {"MD", 24}, {"ME", 22}, {"MK", 19}, {"MN", 20}, {"MR", 27},
    {"MT", 31}, {"MU", 30}, {"NI", 28}, {"NL", 18}, {"NO", 15}, {"OM", 23}, {"PK", 24}, {"PL", 28},
    {"PS", 29}, {"PT", 25}, {"QA", 29}, {"RO", 24}, {"RS", 22}, {"RU", 33}, {"SA", 24}, {"SC", 31},
    {"SD", 18}, {"SE", 24}, {"SI", 19}, {"SK", 24}, {"SM", 27}, {"SO", 23}, {"ST", 25}, {"SV", 28},
    {"TL", 23}, {"TN", 24}, {"TR", 26}, {"UA", 29}, {"VA", 22}, {"VG", 24}, {"XK", 20},
};

}  // namespace

bool LuhnValid(std::string_view text) {
  int sum = 0;
  int count = 0;
  bool twice = false;
  for (auto it = text.rbegin(); it != text.rend(); ++it) {
    if (!IsDigit(*it)) continue;
    int d = *it - '0';
    if (twice) {
      d *= 2;
      if (d > 9) d -= 9;
    }
    sum += d;
    twice = !twice;
    ++count;
  }
  return count >= 2 && sum % 10 == 0;
}

bool CardNumberValid(std::string_view text) {
  char buffer[20];  // no allocation per candidate: the number scan calls this a lot
  size_t n = 0;
  char separator = 0;
  size_t group = 0;
  size_t groups = 0;
  for (char c : text) {
    if (IsDigit(c)) {
      if (n == sizeof(buffer)) return false;  // > 19 digits
      buffer[n++] = c;
      ++group;
      continue;
    }
    if (c != ' ' && c != '-') return false;
    if (separator != 0 && c != separator) return false;  // "4111 1111-1111 1111"
    if (group == 0) return false;                        // two separators in a row
    separator = c;
    group = 0;
    ++groups;
  }
  if (separator != 0 && groups < 2) return false;  // "411111111111 1111": not a card layout
  if (n < 13 || n > 19) return false;
  const std::string_view digits(buffer, n);
  if (digits.find_first_not_of(digits[0]) == std::string::npos) return false;
  bool network = false;
  const int p1 = Prefix(digits, 1), p2 = Prefix(digits, 2), p3 = Prefix(digits, 3),
            p4 = Prefix(digits, 4);
  if (p1 == 4) network = n == 13 || n == 16 || n == 19;                         // Visa
  if ((p2 >= 51 && p2 <= 55) || (p4 >= 2221 && p4 <= 2720)) network = n == 16;  // Mastercard
  if (p2 == 34 || p2 == 37) network = n == 15;                                  // Amex
  if (p4 == 6011 || p2 == 65 || (p3 >= 644 && p3 <= 649)) network = n >= 16;    // Discover
  if (p4 >= 3528 && p4 <= 3589) network = n >= 16;                              // JCB
  if (p2 == 36 || p2 == 38 || (p3 >= 300 && p3 <= 305)) network = n >= 14;      // Diners
  return network && LuhnValid(digits);
}

int IbanLength(std::string_view country) {
  for (const IbanCountry& c : kIbanCountries) {
    if (country == c.code) return c.length;
  }
  return 0;
}

bool IbanValid(std::string_view text) {
  std::string iban;
  for (char c : text) {
    if (c == ' ') continue;
    if (!IsDigit(c) && !(c >= 'A' && c <= 'Z')) return false;
    iban.push_back(c);
  }
  if (iban.size() < 15 || iban.size() > 34) return false;
  if (IbanLength(std::string_view(iban).substr(0, 2)) != static_cast<int>(iban.size())) {
    return false;
  }
  if (!IsDigit(iban[2]) || !IsDigit(iban[3])) return false;
  // Move the first four characters to the end, letters → 10..35, then mod 97 piecewise.
  const std::string rotated = iban.substr(4) + iban.substr(0, 4);
  uint32_t mod = 0;
  for (char c : rotated) {
    if (IsDigit(c)) {
      mod = (mod * 10 + (c - '0')) % 97;
    } else {
      mod = (mod * 100 + (c - 'A' + 10)) % 97;
    }
  }
  return mod == 1;
}

bool SsnValid(std::string_view text) {
  std::string digits;
  for (char c : text) {
    if (IsDigit(c)) digits.push_back(c);
  }
  if (digits.size() != 9) return false;
  const int area = Prefix(digits, 3);
  const int group = Prefix(std::string_view(digits).substr(3), 2);
  const int serial = Prefix(std::string_view(digits).substr(5), 4);
  if (area == 0 || area == 666 || area >= 900) return false;
  if (group == 0 || serial == 0) return false;
  if (digits == "078051120" || digits == "219099999" || digits == "123456789") return false;
  return true;
}

double ShannonEntropy(std::string_view text) {
  if (text.empty()) return 0;
  std::array<uint32_t, 256> counts{};
  for (unsigned char c : text) ++counts[c];
  double entropy = 0;
  const double n = static_cast<double>(text.size());
  for (uint32_t count : counts) {
    if (count == 0) continue;
    const double p = count / n;
    entropy -= p * std::log2(p);
  }
  return entropy;
}

bool JwtHeaderValid(std::string_view token) {
  const size_t dot = token.find('.');
  const std::string_view header = token.substr(0, dot);
  if (header.size() > 2048) return false;
  std::string decoded;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : header) {
    int v;
    if (c >= 'A' && c <= 'Z') {
      v = c - 'A';
    } else if (c >= 'a' && c <= 'z') {
      v = c - 'a' + 26;
    } else if (IsDigit(c)) {
      v = c - '0' + 52;
    } else if (c == '-' || c == '+') {
      v = 62;
    } else if (c == '_' || c == '/') {
      v = 63;
    } else {
      return false;
    }
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      decoded.push_back(static_cast<char>((acc >> bits) & 0xff));
    }
  }
  if (decoded.empty() || decoded[0] != '{') return false;
  return decoded.find("\"alg\"") != std::string::npos ||
         decoded.find("\"typ\"") != std::string::npos;
}

}  // namespace esb::governance::dlp

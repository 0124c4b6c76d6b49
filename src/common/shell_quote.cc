#include "common/shell_quote.h"

namespace esb {
namespace {

bool Plain(unsigned char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '_' || c == '.' || c == '/' || c == ':' || c == ',' || c == '=' || c == '+' ||
         c == '@' || c == '%';
}

}  // namespace

std::string ShellQuote(std::string_view s) {
  bool plain = !s.empty();
  for (unsigned char c : s) plain = plain && Plain(c);
  if (plain) return std::string(s);
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  out += "'";
  return out;
}

}  // namespace esb

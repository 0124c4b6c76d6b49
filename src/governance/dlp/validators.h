// Checks that turn a regex candidate into a finding (docs/design.md "DLP"): checksums, number
// ranges, entropy. Pure functions over the candidate's text; internal to the DLP library.
#pragma once

#include <string_view>

namespace esb::governance::dlp {

// Luhn (mod 10) over the digits of `text`; other bytes are ignored. False with < 2 digits.
bool LuhnValid(std::string_view text);

// A payment card number as written: 13–19 digits, either unseparated or grouped with one kind
// of separator (' ' or '-'), an issuer prefix of a major network (Visa 4, Mastercard 51–55 and
// 2221–2720, Amex 34/37, Discover 6011/644–649/65, JCB 3528–3589, Diners 36/38/300–305) with
// a length that network issues, not all one digit, and Luhn-valid.
bool CardNumberValid(std::string_view text);

// An IBAN, with or without single spaces between groups: a known country code, that country's
// length, and ISO 7064 mod 97 == 1.
bool IbanValid(std::string_view text);
// The registered length of a country's IBANs (0: unknown country).
int IbanLength(std::string_view country);

// A US SSN written as AAA-GG-SSSS (or with spaces): area not 000, 666 or 900–999, group not 00,
// serial not 0000, and not a well-known sample (078-05-1120, 219-09-9999, 123-45-6789).
bool SsnValid(std::string_view text);

// Shannon entropy in bits per byte.
double ShannonEntropy(std::string_view text);

// A JWT's first segment base64url-decodes to a JSON object naming "alg" or "typ".
bool JwtHeaderValid(std::string_view token);

}  // namespace esb::governance::dlp

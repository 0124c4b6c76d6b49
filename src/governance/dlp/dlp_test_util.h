// Shared helpers of the DLP tests: deterministic token generators and compression helpers.
#pragma once

#include <brotli/encode.h>
#include <zlib.h>

#include <cstdint>
#include <string>
#include <string_view>

namespace esb::governance::dlp::testing {

inline constexpr std::string_view kAlnum =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
inline constexpr std::string_view kBase32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";

// n characters of `alphabet`, deterministic in `seed` (xorshift), so tests never hard-code a
// live-looking credential and every run sees the same samples.
inline std::string Token(std::string_view alphabet, size_t n, uint64_t seed) {
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    out += alphabet[x % alphabet.size()];
  }
  return out;
}

// Valid-shaped samples of each secret type.
inline std::string AwsKeyId() { return "AKIA" + Token(kBase32, 16, 1); }
inline std::string AwsSecret() {
  return Token("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/", 40, 2);
}
inline std::string GithubToken() { return "ghp_" + Token(kAlnum, 36, 3); }
inline std::string SlackToken() {
  return "xoxb-" + Token("0123456789", 11, 4) + "-" + Token("0123456789", 12, 5) + "-" +
         Token(kAlnum, 24, 6);
}
inline std::string SlackWebhook() {
  return "https://hooks.slack.com/services/T" +
         Token("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", 8, 7) + "/B" +
         Token("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", 8, 8) + "/" + Token(kAlnum, 24, 9);
}
inline std::string GoogleApiKey() {
  return "AIza" + Token("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-", 35, 10);
}
inline std::string OpenAiKey() {
  return "sk-proj-" + Token(kAlnum, 40, 11) + "T3BlbkFJ" + Token(kAlnum, 40, 12);
}
inline std::string AnthropicKey() { return "sk-ant-api03-" + Token(kAlnum, 93, 13) + "AA"; }
inline std::string PrivateKeyPem() {
  return "-----BEGIN RSA PRIVATE KEY-----\n" + Token(kAlnum, 64, 14) + "\n" +
         Token(kAlnum, 64, 15) + "\n" + Token(kAlnum, 20, 16) + "==\n-----END RSA PRIVATE KEY-----";
}
inline std::string Jwt() {
  return "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9."
         "eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4gRG9lIiwiaWF0IjoxNTE2MjM5MDIyfQ."
         "SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c";
}

inline std::string Gzip(std::string_view in, int window_bits = 15 + 16) {
  z_stream z{};
  deflateInit2(&z, 6, Z_DEFLATED, window_bits, 8, Z_DEFAULT_STRATEGY);
  std::string out(deflateBound(&z, in.size()) + 64, '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  z.avail_in = static_cast<uInt>(in.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}
inline std::string ZlibDeflate(std::string_view in) { return Gzip(in, 15); }
inline std::string RawDeflate(std::string_view in) { return Gzip(in, -15); }

inline std::string Brotli(std::string_view in) {
  size_t size = BrotliEncoderMaxCompressedSize(in.size()) + 64;
  std::string out(size, '\0');
  BrotliEncoderCompress(5, BROTLI_DEFAULT_WINDOW, BROTLI_MODE_GENERIC, in.size(),
                        reinterpret_cast<const uint8_t*>(in.data()), &size,
                        reinterpret_cast<uint8_t*>(out.data()));
  out.resize(size);
  return out;
}

// Chunked framing with the given chunk size.
inline std::string Chunked(std::string_view in, size_t chunk) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < in.size(); i += chunk) {
    const std::string_view piece = in.substr(i, chunk);
    std::string size;
    for (size_t n = piece.size(); n > 0; n /= 16) size.insert(size.begin(), kHex[n % 16]);
    out += size + ";ext=1\r\n" + std::string(piece) + "\r\n";
  }
  return out + "0\r\nX-Trailer: t\r\n\r\n";
}

}  // namespace esb::governance::dlp::testing

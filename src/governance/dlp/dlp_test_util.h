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

// The rule PlantSample(i) triggers, for i % 15.
inline constexpr const char* kPlantRules[15] = {"dlp:credit_card",
                                                "dlp:aws_access_key",
                                                "dlp:aws_secret_key",
                                                "dlp:github_token",
                                                "dlp:slack_token",
                                                "dlp:slack_webhook",
                                                "dlp:google_api_key",
                                                "dlp:openai_api_key",
                                                "dlp:anthropic_api_key",
                                                "dlp:private_key",
                                                "dlp:jwt",
                                                "dlp:iban",
                                                "dlp:us_ssn",
                                                "dlp:email",
                                                "dlp:phone"};

// One sample per built-in detector (index % count), for planting in corpora.
inline std::string PlantSample(size_t index) {
  switch (index % 15) {
    case 0:
      return "card 4111 1111 1111 1111";
    case 1:
      return "id " + AwsKeyId();
    case 2:
      return "aws_secret_access_key=" + AwsSecret();
    case 3:
      return GithubToken();
    case 4:
      return SlackToken();
    case 5:
      return SlackWebhook();
    case 6:
      return GoogleApiKey();
    case 7:
      return OpenAiKey();
    case 8:
      return AnthropicKey();
    case 9:
      return PrivateKeyPem();
    case 10:
      return Jwt();
    case 11:
      return "iban DE89370400440532013000";
    case 12:
      return "ssn 536-22-8745";
    case 13:
      return "mail alice@example.com";
    default:
      return "call +1 415 555 2671";
  }
}

// Mixed machine/human text of `size` bytes, deterministic in `seed`: words, ~15 % numeric
// tokens (integers, decimals, dates, versions), hex and base64 runs, JSON punctuation;
// digit-heavy on purpose (the PII detectors' worst case). No '%' or '\\' (no decoded views).
// plant >= 0 plants PlantSample(plant) at a pseudo-random token boundary.
inline std::string MixedText(size_t size, uint64_t seed, int plant = -1) {
  static constexpr std::string_view kWords[] = {
      "the",     "request", "returned", "status",  "user",        "account", "value",   "and",
      "for",     "with",    "order",    "shipped", "Customer",    "invoice", "total",   "items",
      "error",   "retry",   "config",   "deploy",  "service",     "region",  "token",   "build",
      "version", "updated", "created",  "name",    "description", "payment", "address", "street",
      "city",    "country", "data",     "result",  "message",     "timeout", "server",  "client",
      "of",      "to",      "in",       "is"};
  static constexpr std::string_view kPunct[] = {"{\"id\": ", "\", \"",   "\": ",     "}, {", "[",
                                                "], ",       ": true, ", ": null, ", "\n",   ". ",
                                                ", ",        " - ",      " (",       ") "};
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 7;
  auto next = [&x] {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return x;
  };
  std::string out;
  out.reserve(size + 256);
  const size_t plant_at = plant >= 0 ? next() % (size > 512 ? size - 512 : 1) : std::string::npos;
  bool planted = false;
  while (out.size() < size) {
    if (!planted && out.size() >= plant_at) {
      out += " " + PlantSample(static_cast<size_t>(plant)) + " ";
      planted = true;
      continue;
    }
    const uint64_t r = next() % 100;
    if (r < 55) {
      out += kWords[next() % std::size(kWords)];
      out += ' ';
    } else if (r < 70) {
      switch (next() % 5) {
        case 0:
          out += std::to_string(next() % 100000);
          break;
        case 1:
          out += std::to_string(next() % 1000000000000ull);
          break;
        case 2:
          out += std::to_string(2000 + next() % 30) + "-0" + std::to_string(1 + next() % 9) + "-1" +
                 std::to_string(next() % 10);
          break;
        case 3:
          out += std::to_string(next() % 1000) + "." + std::to_string(next() % 100);
          break;
        default:
          out += std::to_string(next() % 10) + "." + std::to_string(next() % 20) + "." +
                 std::to_string(next() % 50);
      }
      out += ' ';
    } else if (r < 78) {
      out += Token("0123456789abcdef", 8 + next() % 33, next());
      out += ' ';
    } else if (r < 85) {
      out += Token("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/",
                   16 + next() % 49, next());
      out += ' ';
    } else {
      out += kPunct[next() % std::size(kPunct)];
    }
  }
  out.resize(size);
  return out;
}

// JSON request bodies of a chat-style API (what an agent sends to a model or posts to a web
// API), `size` bytes, deterministic in `seed`: an envelope, then messages whose content is
// English prose and code with the JSON escapes such text has ("\n" ending every line, "\""
// around quoted words, "\t"), ~3 % numeric tokens. Unlike MixedText it has '\\': the JSON
// view is decoded and scanned too. plant >= 0 plants PlantSample(plant), JSON-escaped, inside
// a message.
inline std::string ChatJson(size_t size, uint64_t seed, int plant = -1) {
  static constexpr std::string_view kWords[] = {
      "the",      "a",        "to",      "of",     "and",     "in",     "is",    "it",
      "that",     "for",      "you",     "with",   "this",    "on",     "can",   "file",
      "function", "returns",  "error",   "when",   "we",      "should", "use",   "data",
      "please",   "explain",  "why",     "test",   "fails",   "here",   "code",  "output",
      "install",  "package",  "version", "run",    "command", "change", "value", "list",
      "request",  "response", "server",  "client", "example", "method", "class", "object"};
  static constexpr std::string_view kCode[] = {
      "def handler(event, context):",
      "    result = compute(items, limit=10)",
      "    for i in range(len(rows)):",
      "        print(f\\\"row {i}: {rows[i]}\\\")",
      "import os, sys, json",
      "if __name__ == \\\"__main__\\\":",
      "\\treturn nil, err",
      "const x = await fetch(url, {method: \\\"POST\\\"});",
      "}",
      "    except KeyError as e:"};
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 11;
  auto next = [&x] {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return x;
  };
  std::string out = R"({"model": "chat-large", "temperature": 0.2, "messages": [)";
  out.reserve(size + 4096);
  const size_t plant_at = plant >= 0 ? next() % (size > 1024 ? size - 1024 : 1) : std::string::npos;
  bool planted = false;
  while (out.size() < size) {
    out +=
        next() % 2 ? R"({"role": "user", "content": ")" : R"({"role": "assistant", "content": ")";
    const size_t end = out.size() + 300 + next() % 2500;
    while (out.size() < end) {
      if (!planted && out.size() >= plant_at) {
        std::string sample = PlantSample(static_cast<size_t>(plant));
        std::string escaped;
        for (char c : sample) {
          if (c == '\n') {
            escaped += "\\n";
          } else {
            if (c == '"' || c == '\\') escaped += '\\';
            escaped += c;
          }
        }
        out += " " + escaped + " ";
        planted = true;
      }
      const uint64_t r = next() % 100;
      if (r < 8) {  // a few lines of code
        out += "\\n```\\n";
        for (uint64_t lines = 2 + next() % 6; lines > 0; --lines) {
          out += kCode[next() % std::size(kCode)];
          out += "\\n";
        }
        out += "```\\n";
      } else {  // a sentence
        const uint64_t words = 4 + next() % 16;
        for (uint64_t w = 0; w < words; ++w) {
          const uint64_t t = next() % 100;
          if (t < 3) {
            out += std::to_string(next() % 2000);
          } else if (t < 5) {
            out += "\\\"";
            out += kWords[next() % std::size(kWords)];
            out += "\\\"";
          } else {
            std::string word(kWords[next() % std::size(kWords)]);
            if (w == 0) word[0] = static_cast<char>(word[0] - 'a' + 'A');
            out += word;
          }
          out += w + 1 < words ? " " : (next() % 4 == 0 ? ".\\n" : ". ");
        }
      }
    }
    out += R"("}, )";
  }
  out.resize(size);
  return out;
}

}  // namespace esb::governance::dlp::testing

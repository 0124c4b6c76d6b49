// Engine tests: every detector with valid and near-miss samples, actions and redaction, custom
// patterns, registered secret values, decoded views and the body scanner.
#include "governance/dlp/dlp.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <chrono>
#include <thread>

#include "governance/dlp/dlp_test_util.h"

namespace esb::governance::dlp {
namespace {

using namespace testing;  // NOLINT: the sample generators

std::shared_ptr<const Engine> MakeEngine(std::string_view config_json = "{}") {
  absl::StatusOr<DlpConfig> config = ParseDlpConfig(boost::json::parse(config_json));
  EXPECT_TRUE(config.ok()) << config.status();
  absl::StatusOr<std::shared_ptr<const Engine>> engine = Engine::Compile(*config);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return *engine;
}

const Engine& Default() {
  static const std::shared_ptr<const Engine> engine = MakeEngine();
  return *engine;
}

std::vector<std::string> Rules(const Result& result) {
  std::vector<std::string> rules;
  for (const Finding& f : result.findings) rules.push_back(f.rule_id);
  return rules;
}

bool Has(const Result& result, std::string_view rule) {
  for (const Finding& f : result.findings) {
    if (f.rule_id == rule) return true;
  }
  return false;
}

std::string Describe(const Result& result) {
  std::string out;
  for (const Finding& f : result.findings) {
    out += f.rule_id + "@" + std::to_string(f.offset) + "+" + std::to_string(f.length) + "/" +
           f.layer + " ";
  }
  return out.empty() ? "(no findings)" : out;
}

// Scans "<prefix><sample><suffix>" and expects exactly the sample's span for `rule`.
void ExpectFound(std::string_view rule, const std::string& sample,
                 const std::string& prefix = "payload: ", const std::string& suffix = " end") {
  const std::string text = prefix + sample + suffix;
  const Result result = Default().ScanText(text, Where::kBody);
  bool found = false;
  for (const Finding& f : result.findings) {
    if (f.rule_id != rule) continue;
    found = true;
    EXPECT_EQ(f.offset, prefix.size()) << rule;
    EXPECT_EQ(f.length, sample.size()) << rule;
  }
  EXPECT_TRUE(found) << rule << " not found in: " << text << " → " << Describe(result);
}

void ExpectNotFound(std::string_view rule, const std::string& text) {
  const Result result = Default().ScanText(text, Where::kBody);
  EXPECT_FALSE(Has(result, rule)) << rule << " in: " << text << " → " << Describe(result);
}

TEST(DlpDetectorTest, CreditCardValidNumbers) {
  ExpectFound("dlp:credit_card", "4111 1111 1111 1111");
  ExpectFound("dlp:credit_card", "4111-1111-1111-1111");
  ExpectFound("dlp:credit_card", "5555555555554444");
  ExpectFound("dlp:credit_card", "378282246310005");
  ExpectFound("dlp:credit_card", "6011111111111117");
  ExpectFound("dlp:credit_card", "2223003122003222");
  ExpectFound("dlp:credit_card", "4012888888881881", "{\"card\":\"", "\"}");
}

TEST(DlpDetectorTest, CreditCardNearMisses) {
  ExpectNotFound("dlp:credit_card", "card 4111 1111 1111 1112 luhn fails");
  ExpectNotFound("dlp:credit_card", "id 1234567812345670 has no issuer prefix");  // Luhn-valid
  ExpectNotFound("dlp:credit_card", "mixed 4111 1111-1111 1111 separators");
  ExpectNotFound("dlp:credit_card", "run 41111111111111110000000 inside a longer number");
  ExpectNotFound("dlp:credit_card", "all same 4444444444444444");
  ExpectNotFound("dlp:credit_card", "amex length 3782822463100050");
}

TEST(DlpDetectorTest, AwsAccessKeyId) {
  ExpectFound("dlp:aws_access_key", AwsKeyId(), "aws_access_key_id=", "\n");
  ExpectFound("dlp:aws_access_key", "ASIA" + Token(kBase32, 16, 40));
  ExpectNotFound("dlp:aws_access_key", "key AKIAIOSFODNN7EXAMPLE from the docs");
  ExpectNotFound("dlp:aws_access_key", "low entropy AKIAAAAAAAAAAAAAAAAA here");
  ExpectNotFound("dlp:aws_access_key", "embedded X" + AwsKeyId() + "Y in a word");
}

TEST(DlpDetectorTest, AwsSecretKeyNeedsContextOrKeyId) {
  ExpectFound("dlp:aws_secret_key", AwsSecret(), "aws_secret_access_key = ", "\n");
  ExpectFound("dlp:aws_secret_key", AwsSecret(), "AWS_SECRET_ACCESS_KEY=", "\n");
  ExpectFound("dlp:aws_secret_key", AwsSecret(), "{\"aws\": {\"secret\": \"", "\"}}");
  ExpectFound("dlp:aws_secret_key", AwsSecret(), "id " + AwsKeyId() + " and ", "");
  // Same value with no context and no key id: 40 base64 characters are everywhere.
  ExpectNotFound("dlp:aws_secret_key", "checksum " + AwsSecret() + " of the file");
  // The AWS documentation's example secret.
  ExpectNotFound("dlp:aws_secret_key",
                 "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY");
  // Low entropy with context.
  ExpectNotFound("dlp:aws_secret_key",
                 "aws_secret_access_key = aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa");
}

TEST(DlpDetectorTest, GithubTokens) {
  ExpectFound("dlp:github_token", GithubToken());
  ExpectFound("dlp:github_token", "gho_" + Token(kAlnum, 36, 41));
  ExpectFound("dlp:github_token",
              "github_pat_" + Token(kAlnum, 22, 42) + "_" + Token(kAlnum, 59, 43));
  ExpectNotFound("dlp:github_token", "short ghp_" + Token(kAlnum, 20, 44) + " token");
  ExpectNotFound("dlp:github_token", "placeholder ghp_" + std::string(36, 'x'));
}

TEST(DlpDetectorTest, SlackTokensAndWebhooks) {
  ExpectFound("dlp:slack_token", SlackToken());
  ExpectFound("dlp:slack_webhook", SlackWebhook().substr(8), "url https://", "");
  ExpectNotFound("dlp:slack_token", "xoxb-not-a-token");
  ExpectNotFound("dlp:slack_webhook", "see https://hooks.slack.com/services/ for docs");
}

TEST(DlpDetectorTest, GoogleOpenAiAnthropicKeys) {
  ExpectFound("dlp:google_api_key", GoogleApiKey(), "key=", "&q=1");
  ExpectFound("dlp:openai_api_key", OpenAiKey(), "Authorization: Bearer ", "\r\n");
  ExpectFound("dlp:openai_api_key",
              "sk-" + Token(kAlnum, 20, 45) + "T3BlbkFJ" + Token(kAlnum, 20, 46));
  ExpectFound("dlp:anthropic_api_key", AnthropicKey(), "x-api-key: ", "\r\n");
  ExpectNotFound("dlp:google_api_key", "AIza" + std::string(35, 'a'));
  ExpectNotFound("dlp:openai_api_key", "sk-short" + std::string("T3BlbkFJ") + "tail");
  ExpectNotFound("dlp:anthropic_api_key", "sk-ant-api03-" + Token(kAlnum, 50, 47) + "AA");
}

TEST(DlpDetectorTest, PemPrivateKey) {
  ExpectFound("dlp:private_key", PrivateKeyPem(), "key:\n", "\n");
  ExpectFound("dlp:private_key",
              "-----BEGIN PRIVATE KEY-----\\n" + Token(kAlnum, 64, 48) + "\\n" +
                  Token(kAlnum, 30, 49) + "\\n-----END PRIVATE KEY-----",
              "{\"key\": \"", "\"}");
  ExpectNotFound("dlp:private_key",
                 "-----BEGIN RSA PRIVATE KEY-----\n...\n-----END RSA PRIVATE "
                 "KEY-----");
  ExpectNotFound("dlp:private_key", "-----BEGIN PUBLIC KEY-----\n" + Token(kAlnum, 128, 50) +
                                        "\n-----END PUBLIC "
                                        "KEY-----");
}

TEST(DlpDetectorTest, Jwt) {
  ExpectFound("dlp:jwt", Jwt(), "Authorization: Bearer ", "\r\n");
  ExpectNotFound("dlp:jwt", "eyJfoo.eyJbar.baz");
  // Right shape, but the header is not a JOSE header.
  ExpectNotFound("dlp:jwt", "eyJub3RhIjoiaGVhZGVyIn0.eyJzdWIiOiIxMjM0NTY3ODkwIn0.abcdefabcdef");
}

TEST(DlpDetectorTest, Iban) {
  ExpectFound("dlp:iban", "DE89370400440532013000");
  ExpectFound("dlp:iban", "GB82 WEST 1234 5698 7654 32");
  ExpectFound("dlp:iban", "NL91ABNA0417164300", "iban: ", " thanks");
  ExpectNotFound("dlp:iban", "wrong check DE89370400440532013001");
  ExpectNotFound("dlp:iban", "wrong length DE8937040044053201300");
  ExpectNotFound("dlp:iban", "unknown country ZZ89370400440532013000");
}

TEST(DlpDetectorTest, UsSsn) {
  ExpectFound("dlp:us_ssn", "536-22-8745");
  ExpectFound("dlp:us_ssn", "536 22 8745");
  for (const char* bad : {"000-12-3456", "666-12-3456", "912-34-5678", "123-00-4567", "123-45-0000",
                          "078-05-1120", "123-45-6789", "536228745"}) {
    ExpectNotFound("dlp:us_ssn", std::string("ssn ") + bad + " here");
  }
}

TEST(DlpDetectorTest, EmailAndPhone) {
  ExpectFound("dlp:email", "alice.smith+tag@mail.example.com");
  ExpectNotFound("dlp:email", "user@localhost and a @ sign");
  ExpectFound("dlp:phone", "+1 415 555 2671");
  ExpectFound("dlp:phone", "(415) 555-2671");
  ExpectFound("dlp:phone", "4155552671", "call me at ", ".");
  ExpectFound("dlp:phone", "+44 20 7946 0958", "call ", "");
  ExpectFound("dlp:phone", "(415) 555-2671", "Tel: ", "");
  ExpectFound("dlp:phone", "+1 415 555 2671", "call ", " 12345 times");
  ExpectNotFound("dlp:phone", "order id 4155552671 shipped");
  ExpectNotFound("dlp:phone", "version 10.20.30.40 released 2024-01-15");
}

TEST(DlpActionTest, DefaultActionsAndDecision) {
  EXPECT_EQ(Default().ActionFor("dlp:credit_card"), Action::kBlock);
  EXPECT_EQ(Default().ActionFor("dlp:aws_access_key"), Action::kBlock);
  EXPECT_EQ(Default().ActionFor("dlp:email"), Action::kLog);
  EXPECT_EQ(Default().ActionFor("dlp:phone"), Action::kLog);
  EXPECT_EQ(Default().ActionFor("dlp:iban"), Action::kRedact);
  EXPECT_EQ(Default().ActionFor("dlp:nope"), Action::kNone);

  Result log_only = Default().ScanText("mail bob@example.org please", Where::kBody);
  EXPECT_EQ(log_only.decision, Action::kLog);
  EXPECT_FALSE(log_only.redacted.has_value());

  Result redact = Default().ScanText("pay to DE89370400440532013000 today", Where::kBody);
  EXPECT_EQ(redact.decision, Action::kRedact);
  ASSERT_TRUE(redact.redacted.has_value());
  EXPECT_EQ(*redact.redacted, "pay to [REDACTED:dlp:iban] today");

  const std::string text = "mail bob@example.org card 4111111111111111 iban DE89370400440532013000";
  Result block = Default().ScanText(text, Where::kBody);
  EXPECT_EQ(block.decision, Action::kBlock);
  EXPECT_EQ(block.block_rule, "dlp:credit_card");
  EXPECT_EQ(Rules(block), (std::vector<std::string>{"dlp:email", "dlp:credit_card", "dlp:iban"}));
  // The audit copy of a blocked message masks block and redact spans, keeps log-only ones.
  ASSERT_TRUE(block.redacted.has_value());
  EXPECT_EQ(*block.redacted,
            "mail bob@example.org card [REDACTED:dlp:credit_card] iban [REDACTED:dlp:iban]");
}

TEST(DlpActionTest, RuleOverrides) {
  auto engine = MakeEngine(R"({"rules": {"email": "redact", "credit_card": "off"}})");
  Result result = engine->ScanText("to bob@example.org card 4111111111111111", Where::kBody);
  EXPECT_EQ(Rules(result), std::vector<std::string>{"dlp:email"});
  EXPECT_EQ(result.decision, Action::kRedact);
  EXPECT_EQ(*result.redacted, "to [REDACTED:dlp:email] card 4111111111111111");
}

TEST(DlpActionTest, DisabledEngineScansNothing) {
  auto engine = MakeEngine(R"({"enabled": false})");
  EXPECT_TRUE(engine->ScanText("card 4111111111111111", Where::kBody).findings.empty());
}

TEST(DlpActionTest, AllowListSkipsExactValues) {
  auto engine = MakeEngine(R"({"allow": ["4111111111111111"]})");
  EXPECT_FALSE(Has(engine->ScanText("card 4111111111111111", Where::kBody), "dlp:credit_card"));
  EXPECT_TRUE(Has(engine->ScanText("card 5555555555554444", Where::kBody), "dlp:credit_card"));
}

TEST(DlpActionTest, ResultsNeverContainTheSecretText) {
  const std::vector<std::string> secrets = {AwsKeyId(),     GithubToken(),     SlackToken(),
                                            GoogleApiKey(), OpenAiKey(),       AnthropicKey(),
                                            Jwt(),          "4111111111111111"};
  for (const std::string& secret : secrets) {
    const Result result = Default().ScanText("x " + secret + " y", Where::kBody);
    ASSERT_EQ(result.decision, Action::kBlock) << Describe(result);
    std::string rendered;
    for (const Finding& f : result.findings) {
      rendered += f.rule_id + f.layer + std::string(KindName(f.kind));
    }
    rendered += result.block_rule + result.redacted.value_or("");
    EXPECT_EQ(rendered.find(secret), std::string::npos) << rendered;
  }
}

TEST(DlpCustomTest, CustomPatternWithItsAction) {
  auto engine = MakeEngine(
      R"({"custom": [{"name": "ticket", "regex": "TCK-[0-9]{6}", "action": "redact"}]})");
  Result result = engine->ScanText("see TCK-123456 and TCK-12", Where::kBody);
  EXPECT_EQ(Rules(result), std::vector<std::string>{"dlp:custom:ticket"});
  EXPECT_EQ(*result.redacted, "see [REDACTED:dlp:custom:ticket] and TCK-12");
}

TEST(DlpSecretValueTest, BlockedVerbatimAndInEncodedForms) {
  const std::string value = "pa55-w0rd/with+chars";
  auto engine =
      MakeEngine(R"({"secrets": [{"name": "DB_PASSWORD", "value": ")" + value + R"("}]})");
  auto url_encode = [](std::string_view s) {
    std::string out;
    for (unsigned char c : s) {
      char buf[4];
      snprintf(buf, sizeof(buf), "%%%02X", c);
      out += buf;
    }
    return out;
  };
  std::string hex;
  for (unsigned char c : value) {
    char buf[3];
    snprintf(buf, sizeof(buf), "%02x", c);
    hex += buf;
  }
  const std::vector<std::pair<std::string, std::string>> forms = {
      {"verbatim", "password=" + value},
      {"url", "p=" + url_encode(value)},
      {"json", R"({"p": "pa55-w0rd\/with+chars"})"},
      {"json-unicode", R"({"p": "\u0070a55-w0rd\/with\u002bchars"})"},
      {"hex", "blob " + hex},
      {"base64-0", "b " + std::string("cGE1NS13MHJkL3dpdGgrY2hhcnM=")},
      // base64 of "x" + value and "xy" + value: the value at the other two alignments.
      {"base64-1", "b eHBhNTUtdzByZC93aXRoK2NoYXJz"},
      {"base64-2", "b eHlwYTU1LXcwcmQvd2l0aCtjaGFycw=="},
  };
  for (const auto& [name, text] : forms) {
    Result result = engine->ScanText(text, Where::kBody);
    EXPECT_TRUE(Has(result, "dlp:secret:DB_PASSWORD")) << name << ": " << Describe(result);
    EXPECT_EQ(result.decision, Action::kBlock) << name;
  }
  EXPECT_FALSE(Has(engine->ScanText("pa55-w0rd/with", Where::kBody), "dlp:secret:DB_PASSWORD"));
}

TEST(DlpDecodedViewTest, UrlEncodedQueryAndForm) {
  // The URL's query: percent-encoding and '+'.
  Result url = Default().ScanText("/submit?card=4111%201111%201111%201111&key=" + GithubToken(),
                                  Where::kUrl);
  EXPECT_TRUE(Has(url, "dlp:credit_card")) << Describe(url);
  EXPECT_TRUE(Has(url, "dlp:github_token")) << Describe(url);
  Result plus = Default().ScanText("/s?card=4111+1111+1111+1111", Where::kUrl);
  EXPECT_TRUE(Has(plus, "dlp:credit_card")) << Describe(plus);
}

TEST(DlpDecodedViewTest, JsonEscapedSecretIsFoundAndRedactedInTheSource) {
  // "AKIA..." written with \u escapes: invisible in the raw text.
  const std::string id = AwsKeyId();
  std::string escaped;
  for (char c : id) {
    char buf[8];
    snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned char>(c));
    escaped += buf;
  }
  const std::string text = R"({"id": ")" + escaped + R"("})";
  Result result = Default().ScanText(text, Where::kBody);
  ASSERT_TRUE(Has(result, "dlp:aws_access_key")) << Describe(result);
  const Finding& f = result.findings[0];
  EXPECT_EQ(f.layer, "json");
  EXPECT_EQ(f.offset, 8u);
  EXPECT_EQ(f.length, escaped.size());
  EXPECT_EQ(*result.redacted, R"({"id": "[REDACTED:dlp:aws_access_key]"})");
}

TEST(DlpDecodedViewTest, ShortHeaderValuesDecodedAndRedacted) {
  // Short decoded views (in-object string storage) are scanned and mapped back correctly.
  auto engine = MakeEngine(R"({"secrets": [{"name": "K", "value": "s3cr3t-x"}]})");
  for (const char* value : {"s3cr3t%2Dx", "s3cr3t\\u002dx", "a=s3cr3t%2dx;"}) {
    Result result = engine->ScanText(value, Where::kHeader);
    ASSERT_TRUE(Has(result, "dlp:secret:K")) << value << ": " << Describe(result);
    ASSERT_TRUE(result.redacted.has_value());
    EXPECT_EQ(result.redacted->find("s3cr3t"), std::string::npos) << *result.redacted;
  }
}

TEST(DlpDecodedViewTest, UrlEncodedEmailRedactedInTheSource) {
  auto engine = MakeEngine(R"({"rules": {"email": "redact"}})");
  Result result = engine->ScanText("/u?to=alice%40example.com&x=1", Where::kUrl);
  ASSERT_TRUE(result.redacted.has_value()) << Describe(result);
  EXPECT_EQ(*result.redacted, "/u?to=[REDACTED:dlp:email]&x=1");
}

TEST(DlpDecodedViewTest, JsonInsideUrlEncodingAndBackslashNewlineBoundary) {
  // A key id after an escaped newline: "\nAKIA..." — raw text has no word boundary before it.
  Result newline =
      Default().ScanText("{\"log\": \"line1\\n" + AwsKeyId() + "\\nline3\"}", Where::kBody);
  EXPECT_TRUE(Has(newline, "dlp:aws_access_key")) << Describe(newline);
  // JSON escapes inside a URL-encoded form value.
  Result nested = Default().ScanText(
      "payload=%7B%22k%22%3A%22" + std::string("\\u0034") + "111111111111111%22%7D", Where::kBody);
  EXPECT_TRUE(Has(nested, "dlp:credit_card")) << Describe(nested);
}

TEST(DlpOversizeTest, ScanTextOverTheCap) {
  auto block = MakeEngine(R"({"max_body_bytes": 1024})");
  Result result = block->ScanText(std::string(2000, 'a'), Where::kBody);
  EXPECT_EQ(result.decision, Action::kBlock);
  EXPECT_EQ(result.block_rule, "dlp:oversize");
  auto pass = MakeEngine(R"({"max_body_bytes": 1024, "on_oversize": "pass_unscanned"})");
  Result passed = pass->ScanText(std::string(2000, 'a') + " 4111111111111111", Where::kBody);
  EXPECT_EQ(passed.decision, Action::kLog);
  EXPECT_EQ(Rules(passed), std::vector<std::string>{"dlp:oversize"});
}

TEST(DlpThreadTest, ConcurrentScansAgree) {
  const std::string text = "card 4111111111111111 key " + AwsKeyId() + " mail a@b.example " +
                           GithubToken() + " " + std::string(10000, 'z');
  const std::vector<std::string> expected = Rules(Default().ScanText(text, Where::kBody));
  ASSERT_EQ(expected.size(), 4u) << Describe(Default().ScanText(text, Where::kBody));
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        if (Rules(Default().ScanText(text, Where::kBody)) != expected) ++mismatches;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(mismatches.load(), 0);
}

// --- Body scanner ------------------------------------------------------------------------

Result ScanBody(const Engine& engine, const BodyInfo& info, std::string_view wire,
                size_t piece = 0) {
  auto scanner = engine.NewBodyScanner(info);
  if (piece == 0) {
    scanner->Feed(wire);
  } else {
    for (size_t i = 0; i < wire.size(); i += piece) scanner->Feed(wire.substr(i, piece));
  }
  return scanner->Finish();
}

TEST(DlpBodyTest, EverySplitPointOfAPlantedSecret) {
  const std::string secret = AwsKeyId();
  const std::string body = std::string(100, 'a') + " " + secret + " " + std::string(100, 'b');
  for (size_t split = 0; split <= body.size(); ++split) {
    auto scanner = Default().NewBodyScanner({});
    scanner->Feed(std::string_view(body).substr(0, split));
    scanner->Feed(std::string_view(body).substr(split));
    const Result result = scanner->Finish();
    ASSERT_TRUE(Has(result, "dlp:aws_access_key")) << "split at " << split;
    EXPECT_EQ(result.findings[0].offset, 101u);
  }
}

TEST(DlpBodyTest, EverySplitPointOfAChunkedGzipBody) {
  const std::string body = "{\"token\": \"" + GithubToken() + "\"}";
  const std::string wire = Chunked(Gzip(body), 7);
  BodyInfo info{Where::kBody, "application/json", "gzip", true};
  for (size_t split = 0; split <= wire.size(); ++split) {
    auto scanner = Default().NewBodyScanner(info);
    scanner->Feed(std::string_view(wire).substr(0, split));
    scanner->Feed(std::string_view(wire).substr(split));
    const Result result = scanner->Finish();
    ASSERT_TRUE(Has(result, "dlp:github_token")) << "split at " << split << Describe(result);
    ASSERT_FALSE(Has(result, "dlp:undecodable")) << "split at " << split;
  }
}

TEST(DlpBodyTest, ContentEncodings) {
  const std::string body = "card=4111111111111111&x=" + std::string(5000, 'x');
  struct Case {
    const char* encoding;
    std::string wire;
  } cases[] = {
      {"gzip", Gzip(body)},
      {"x-gzip", Gzip(body)},
      {"deflate", ZlibDeflate(body)},
      {"deflate", RawDeflate(body)},
      {"br", Brotli(body)},
      {"gzip, br", Brotli(Gzip(body))},
      {"identity", body},
  };
  for (const Case& c : cases) {
    for (size_t piece : {size_t{0}, size_t{1}, size_t{13}}) {
      const Result result = ScanBody(
          Default(), {Where::kBody, "application/x-www-form-urlencoded", c.encoding, false}, c.wire,
          piece);
      EXPECT_TRUE(Has(result, "dlp:credit_card")) << c.encoding << " piece " << piece;
      EXPECT_FALSE(Has(result, "dlp:undecodable")) << c.encoding << " piece " << piece;
    }
  }
}

TEST(DlpBodyTest, UndecodableBodiesBlockByDefault) {
  const std::string gz = Gzip("hello " + GithubToken());
  struct Case {
    const char* name;
    BodyInfo info;
    std::string wire;
  } cases[] = {
      {"unsupported coding", {Where::kBody, "", "zstd", false}, "abc"},
      {"corrupt gzip", {Where::kBody, "", "gzip", false}, "\x1f\x8b garbage garbage"},
      {"truncated gzip", {Where::kBody, "", "gzip", false}, gz.substr(0, gz.size() / 2)},
      {"bad chunk size", {Where::kBody, "", "", true}, "zz\r\nabc\r\n0\r\n\r\n"},
      {"chunk without CRLF", {Where::kBody, "", "", true}, "3\r\nabcX0\r\n\r\n"},
      {"missing last chunk", {Where::kBody, "", "", true}, "3\r\nabc\r\n"},
      {"data after last chunk", {Where::kBody, "", "", true}, "0\r\n\r\nsmuggled"},
  };
  for (const Case& c : cases) {
    const Result result = ScanBody(Default(), c.info, c.wire);
    EXPECT_TRUE(Has(result, "dlp:undecodable")) << c.name << ": " << Describe(result);
    EXPECT_EQ(result.decision, Action::kBlock) << c.name;
    EXPECT_EQ(result.block_rule, "dlp:undecodable") << c.name;
  }
  auto lenient = MakeEngine(R"({"rules": {"undecodable": "log"}})");
  EXPECT_EQ(ScanBody(*lenient, cases[0].info, cases[0].wire).decision, Action::kLog);
}

long MaxRssKiB() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;
}

TEST(DlpBodyTest, DecompressionBombEndsInOversizeWithoutMemoryGrowth) {
  // 256 MiB of zeros: ~250 KiB gzip, a few KiB brotli.
  const size_t decoded = 256u << 20;
  std::string gz;
  {
    z_stream z{};
    deflateInit2(&z, 1, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);
    const std::string zeros(1 << 20, '\0');
    std::string out(1 << 20, '\0');
    for (size_t done = 0; done < decoded; done += zeros.size()) {
      z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(zeros.data()));
      z.avail_in = zeros.size();
      const int flush = done + zeros.size() >= decoded ? Z_FINISH : Z_NO_FLUSH;
      do {
        z.next_out = reinterpret_cast<Bytef*>(out.data());
        z.avail_out = out.size();
        deflate(&z, flush);
        gz.append(out.data(), out.size() - z.avail_out);
      } while (z.avail_out == 0);
    }
    deflateEnd(&z);
  }
  std::string br;
  {
    BrotliEncoderState* s = BrotliEncoderCreateInstance(nullptr, nullptr, nullptr);
    BrotliEncoderSetParameter(s, BROTLI_PARAM_QUALITY, 1);
    const std::string zeros(1 << 20, '\0');
    std::string out(1 << 16, '\0');
    for (size_t done = 0; done < decoded; done += zeros.size()) {
      size_t avail_in = zeros.size();
      const uint8_t* next_in = reinterpret_cast<const uint8_t*>(zeros.data());
      const bool last = done + zeros.size() >= decoded;
      do {
        size_t avail_out = out.size();
        uint8_t* next_out = reinterpret_cast<uint8_t*>(out.data());
        BrotliEncoderCompressStream(s, last ? BROTLI_OPERATION_FINISH : BROTLI_OPERATION_PROCESS,
                                    &avail_in, &next_in, &avail_out, &next_out, nullptr);
        br.append(out.data(), out.size() - avail_out);
      } while (avail_in > 0 || BrotliEncoderHasMoreOutput(s) ||
               (last && !BrotliEncoderIsFinished(s)));
    }
    BrotliEncoderDestroyInstance(s);
  }
  ASSERT_LT(gz.size(), 4u << 20);
  ASSERT_LT(br.size(), 1u << 20);
  auto engine = MakeEngine(R"({"max_body_bytes": 1048576})");
  const long before = MaxRssKiB();
  for (const auto& [encoding, wire] :
       {std::pair<std::string, std::string>{"gzip", gz}, {"br", br}, {"gzip, gzip", Gzip(gz)}}) {
    auto scanner = engine->NewBodyScanner({Where::kBody, "", encoding, false});
    for (size_t i = 0; i < wire.size(); i += 65536) {
      scanner->Feed(std::string_view(wire).substr(i, 65536));
    }
    EXPECT_TRUE(scanner->oversize()) << encoding;
    const Result result = scanner->Finish();
    EXPECT_EQ(Rules(result), std::vector<std::string>{"dlp:oversize"}) << encoding;
    EXPECT_EQ(result.decision, Action::kBlock) << encoding;
  }
  // Decoding stopped at the 1 MiB cap: nowhere near 256 MiB of growth (allow slack for the
  // allocator and the test's own buffers).
  EXPECT_LT(MaxRssKiB() - before, 64 * 1024) << "KiB";
}

TEST(DlpBodyTest, OversizePolicies) {
  const std::string body = "4111111111111111 " + std::string(4000, 'a');
  auto block = MakeEngine(R"({"max_body_bytes": 1024})");
  Result blocked = ScanBody(*block, {}, body, 100);
  EXPECT_EQ(blocked.block_rule, "dlp:oversize");
  auto pass = MakeEngine(R"({"max_body_bytes": 1024, "on_oversize": "pass_unscanned"})");
  Result passed = ScanBody(*pass, {}, body, 100);
  EXPECT_EQ(Rules(passed), std::vector<std::string>{"dlp:oversize"});
  EXPECT_EQ(passed.decision, Action::kLog);
  // At the cap exactly: scanned.
  Result at_cap = ScanBody(*block, {}, body.substr(0, 1024), 100);
  EXPECT_TRUE(Has(at_cap, "dlp:credit_card"));
}

TEST(DlpBodyTest, MultipartParts) {
  const std::string boundary = "----esbBoundary7MA4YWxkTrZu0gW";
  std::string b64_secret;
  {
    // base64 of "token " + GithubToken()
    const std::string plain = "token " + GithubToken();
    static constexpr char kB64[] =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (size_t i = 0; i < plain.size(); i += 3) {
      uint32_t v = static_cast<unsigned char>(plain[i]) << 16;
      if (i + 1 < plain.size()) v |= static_cast<unsigned char>(plain[i + 1]) << 8;
      if (i + 2 < plain.size()) v |= static_cast<unsigned char>(plain[i + 2]);
      b64_secret += kB64[v >> 18];
      b64_secret += kB64[(v >> 12) & 63];
      b64_secret += i + 1 < plain.size() ? kB64[(v >> 6) & 63] : '=';
      b64_secret += i + 2 < plain.size() ? kB64[v & 63] : '=';
    }
  }
  const std::string body =
      "--" + boundary + "\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nhello\r\n" + "--" +
      boundary +
      "\r\nContent-Disposition: form-data; name=\"f\"; filename=\"k.txt\"\r\n"
      "Content-Type: text/plain\r\nContent-Transfer-Encoding: base64\r\n\r\n" +
      b64_secret + "\r\n--" + boundary +
      "\r\nContent-Disposition: form-data; name=\"c\"\r\n\r\ncard 5555 5555 5555 4444\r\n--" +
      boundary + "--\r\n";
  const Result result = ScanBody(
      Default(), {Where::kBody, "multipart/form-data; boundary=" + boundary, "", false}, body, 5);
  EXPECT_TRUE(Has(result, "dlp:credit_card")) << Describe(result);
  ASSERT_TRUE(Has(result, "dlp:github_token")) << Describe(result);
  for (const Finding& f : result.findings) {
    if (f.rule_id == "dlp:github_token") {
      EXPECT_EQ(f.layer, "multipart+base64");
      EXPECT_GE(f.offset, body.find(b64_secret));
      EXPECT_LE(f.offset + f.length, body.find(b64_secret) + b64_secret.size());
    }
  }
}

TEST(DlpBodyTest, RedactedBodyIsTheDecodedBody) {
  auto engine = MakeEngine(R"({"rules": {"email": "redact"}})");
  const std::string body = "{\"to\": \"bob@example.org\"}";
  const Result result =
      ScanBody(*engine, {Where::kBody, "application/json", "gzip", true}, Chunked(Gzip(body), 5));
  ASSERT_TRUE(result.redacted.has_value()) << Describe(result);
  EXPECT_EQ(*result.redacted, "{\"to\": \"[REDACTED:dlp:email]\"}");
}

TEST(DlpBodyTest, ResponsesAreScannedOnlyWhenConfigured) {
  const std::string body = "key " + AwsKeyId();
  EXPECT_TRUE(ScanBody(Default(), {Where::kResponseBody, "", "", false}, body).findings.empty());
  EXPECT_TRUE(Default().ScanText(body, Where::kResponseBody).findings.empty());
  auto engine = MakeEngine(R"({"scan_responses": true})");
  const Result result = ScanBody(*engine, {Where::kResponseBody, "", "", false}, body);
  ASSERT_TRUE(Has(result, "dlp:aws_access_key"));
  EXPECT_EQ(result.findings[0].where, Where::kResponseBody);
}

}  // namespace
}  // namespace esb::governance::dlp

namespace esb::governance::dlp {
namespace {

// The Vectorscan detect patterns must find everything the RE2-only engine finds (they are
// prefilters of the same locate patterns), and every planted sample is found.
TEST(DlpCorpusTest, VectorscanAndRe2OnlyEnginesAgreeAndFindEveryPlant) {
  DlpConfig config;
  config.secret_values.push_back({"PLANTED", "correct-horse-battery"});
  auto vs = Engine::Compile(config);
  auto re2_only = Engine::Compile(config, EngineOptions{.vectorscan = false});
  ASSERT_TRUE(vs.ok() && re2_only.ok());
  size_t total = 0;
  for (int i = 0; i < 45; ++i) {
    std::string body = testing::MixedText(16 * 1024, 1000 + i, i);
    if (i % 9 == 0) body += " correct-horse-battery";
    const Result a = (*vs)->ScanText(body, Where::kBody);
    const Result b = (*re2_only)->ScanText(body, Where::kBody);
    EXPECT_EQ(Describe(a), Describe(b)) << "body " << i;
    EXPECT_TRUE(Has(a, testing::kPlantRules[i % 15])) << "body " << i << ": " << Describe(a);
    if (i % 9 == 0) {
      EXPECT_TRUE(Has(a, "dlp:secret:PLANTED")) << "body " << i;
    }
    total += a.findings.size();
  }
  // Near-misses in the corpus (random digits, base64) must not swamp the plants: at most a few
  // extra findings per body.
  EXPECT_LT(total, 45u * 3) << "false positives in the mixed corpus";
}

}  // namespace
}  // namespace esb::governance::dlp

namespace esb::governance::dlp {
namespace {

// Pathological 1 MiB texts (a hostile body crafted to make the scanner quadratic) finish in
// well under a second per engine; the bound is generous for a loaded machine.
TEST(DlpAttackTest, PathologicalBodiesScanInLinearTime) {
  const size_t size = 1 << 20;
  std::string digits_chain;  // "1 1 1 1 …": one endless chain of one-digit groups
  while (digits_chain.size() < size) digits_chain += "1 ";
  std::string phone_words;  // a context word before every number
  while (phone_words.size() < size) phone_words += "call 415 555 2671 4 ";
  const std::vector<std::pair<std::string, std::string>> bodies = {
      {"long local part", std::string(size, 'a') + "@x"},
      {"many @", std::string(size / 2, '@') + std::string(size / 2, 'a')},
      {"digits", std::string(size, '7')},
      {"one-digit groups", digits_chain},
      {"phone words", phone_words},
      {"base64 run",
       testing::Token("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/", size,
                      99) +
           " aws secret"},
      {"escapes", std::string(size / 6, 'x') +
                      [] {
                        std::string e;
                        while (e.size() < (1 << 19)) e += "\\u0041%41";
                        return e;
                      }()},
  };
  DlpConfig config;
  config.max_body_bytes = 4 << 20;
  for (bool vectorscan : {true, false}) {
    auto engine = Engine::Compile(config, EngineOptions{.vectorscan = vectorscan});
    ASSERT_TRUE(engine.ok());
    for (const auto& [name, body] : bodies) {
      const auto start = std::chrono::steady_clock::now();
      const Result result = (*engine)->ScanText(body, Where::kBody);
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      EXPECT_LT(seconds, 5.0) << name << (vectorscan ? " (vectorscan)" : " (re2)");
      EXPECT_LE(result.findings.size(), 1000u) << name;
    }
  }
}

}  // namespace
}  // namespace esb::governance::dlp

namespace esb::governance::dlp {
namespace {

// Hostile bodies: random bytes and corrupted valid encodings, fed in random pieces, never crash
// or hang the scanner (run under ASan/UBSan too) and always end in a decision.
TEST(DlpAttackTest, CorruptedAndRandomBodiesNeverCrash) {
  uint64_t x = 12345;
  auto next = [&x] {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return x;
  };
  const std::string plain = testing::MixedText(4096, 5, 3) + "\\u0041%41\\n";
  const std::string boundary = "BOUNDARY";
  const std::string multipart = "--" + boundary + "\r\nContent-Transfer-Encoding: base64\r\n\r\n" +
                                "aGVsbG8gd29ybGQ=\r\n--" + boundary + "--\r\n";
  const char* encodings[] = {"", "gzip", "deflate", "br", "gzip, br"};
  for (int iteration = 0; iteration < 300; ++iteration) {
    const char* encoding = encodings[next() % std::size(encodings)];
    std::string wire = iteration % 3 == 0 ? multipart : plain;
    if (std::string_view(encoding) == "gzip") wire = testing::Gzip(wire);
    if (std::string_view(encoding) == "deflate") wire = testing::RawDeflate(wire);
    if (std::string_view(encoding) == "br") wire = testing::Brotli(wire);
    if (std::string_view(encoding) == "gzip, br") wire = testing::Brotli(testing::Gzip(wire));
    const bool chunked = next() % 2 == 0;
    if (chunked) wire = testing::Chunked(wire, 1 + next() % 100);
    if (iteration % 4 != 0) {  // corrupt a few bytes (or, every 4th, leave it valid)
      for (int k = 0; k < 1 + static_cast<int>(next() % 4); ++k) {
        wire[next() % wire.size()] = static_cast<char>(next());
      }
    }
    if (iteration % 10 == 9) {
      static constexpr char kBytes[] = "\x00\x01\xff\r\n%\\-@+0123456789ab";
      wire = testing::Token(std::string_view(kBytes, sizeof(kBytes) - 1), 5000, next());
    }
    const std::string content_type =
        iteration % 3 == 0 ? "multipart/form-data; boundary=" + boundary : "text/plain";
    auto scanner = Default().NewBodyScanner({Where::kBody, content_type, encoding, chunked});
    for (size_t i = 0; i < wire.size();) {
      const size_t piece = 1 + next() % 700;
      scanner->Feed(std::string_view(wire).substr(i, piece));
      i += piece;
    }
    const Result result = scanner->Finish();
    if (iteration % 4 == 0 && iteration % 10 != 9) {
      EXPECT_FALSE(Has(result, "dlp:undecodable")) << iteration << " " << encoding;
    }
    for (const Finding& f : result.findings) {
      EXPECT_LE(f.offset + f.length, 64u * 1024 * 1024) << iteration;
    }
  }
}

}  // namespace
}  // namespace esb::governance::dlp

namespace esb::governance::dlp {
namespace {

// The number scan works on 64- and 16-byte blocks: every sample at every offset across block
// boundaries is found, and both engines agree.
TEST(DlpCorpusTest, NumberSamplesAtEveryOffset) {
  auto re2_only = Engine::Compile(DlpConfig{}, EngineOptions{.vectorscan = false});
  ASSERT_TRUE(re2_only.ok());
  const std::pair<const char*, std::string> samples[] = {{"dlp:credit_card", "4111 1111 1111 1111"},
                                                         {"dlp:credit_card", "5555555555554444"},
                                                         {"dlp:us_ssn", "536-22-8745"},
                                                         {"dlp:iban", "DE89370400440532013000"},
                                                         {"dlp:phone", "+1 415 555 2671"},
                                                         {"dlp:phone", "(415) 555-2671"},
                                                         {"dlp:email", "bob@example.org"}};
  for (const auto& [rule, sample] : samples) {
    for (size_t offset = 0; offset < 150; ++offset) {
      // x…x, a space, the sample, a space, y…y (offset 0: the sample starts the text).
      const std::string text =
          std::string(offset, 'x') + (offset > 0 ? " " : "") + sample + " " + std::string(200, 'y');
      const Result a = Default().ScanText(text, Where::kBody);
      const Result b = (*re2_only)->ScanText(text, Where::kBody);
      ASSERT_TRUE(Has(a, rule)) << rule << " at " << offset << ": " << Describe(a);
      ASSERT_EQ(Describe(a), Describe(b)) << rule << " at " << offset;
    }
  }
}

}  // namespace
}  // namespace esb::governance::dlp

namespace esb::governance::dlp {
namespace {

const Engine& Re2Only() {
  static const std::shared_ptr<const Engine> engine = [] {
    auto compiled = Engine::Compile(DlpConfig{}, EngineOptions{.vectorscan = false});
    EXPECT_TRUE(compiled.ok()) << compiled.status();
    return *compiled;
  }();
  return *engine;
}

// The number scan classifies 64-byte blocks, 16 per call with one block of look-ahead: number
// samples straddling a block edge, a batch edge (1024) and the end of the text, after a word
// byte (no \b: nothing) or after a separator, are found exactly as by the RE2-only engine.
TEST(DlpCorpusTest, NumberCandidatesAtBlockAndBatchEdgesAndTheEndOfTheText) {
  const std::pair<const char*, std::string> samples[] = {
      {"dlp:credit_card", "4111 1111 1111 1111"},
      {"dlp:credit_card", "4111-1111-1111-1111"},
      {"dlp:credit_card", "378282246310005"},
      {"dlp:us_ssn", "536-22-8745"},
      {"dlp:us_ssn", "536 22 8745"},
      {"dlp:us_ssn", "12 536-22-8745"},  // an SSN after the chain's first group
      {"dlp:iban", "DE89 3704 0044 0532 0130 00"},
      {"dlp:phone", "+44 20 7946 0958"},
      {"dlp:phone", "(415) 555-2671"},
      {"dlp:phone", "tel: 415 555 2671"},
  };
  for (const auto& [rule, sample] : samples) {
    for (size_t edge : {64, 128, 1024, 2048}) {
      for (size_t back = 0; back <= sample.size() + 1; ++back) {
        if (back > edge) continue;
        const size_t offset = edge - back;  // the sample crosses the edge
        for (char before : {' ', 'x', '+', '\n'}) {
          const std::string filler =
              offset == 0 ? "" : std::string(offset - 1, 'y') + std::string(1, before);
          for (const std::string& after : {std::string(" tail"), std::string()}) {
            const std::string text = filler + sample + after;
            const Result a = Default().ScanText(text, Where::kBody);
            const Result b = Re2Only().ScanText(text, Where::kBody);
            ASSERT_EQ(Describe(a), Describe(b))
                << rule << " at " << offset << " after '" << before << "'";
            if (before == ' ' || offset == 0) {
              ASSERT_TRUE(Has(a, rule)) << rule << " at " << offset << ": " << Describe(a);
            }
          }
        }
      }
    }
  }
}

// Decoded views run only when the text has a '%' or '\\' (seen by the block classifier): one at
// the start, at a block or batch edge, or as the text's last bytes still opens its view.
TEST(DlpDecodedViewTest, EscapesAnywhereOpenTheDecodedViews) {
  const std::string encoded = "alice%40example.com";
  for (size_t offset : {0, 1, 50, 63, 64, 1000, 1017, 1023, 1024, 1030, 2047}) {
    for (const std::string& after : {std::string(" end"), std::string()}) {
      const std::string text =
          (offset == 0 ? "" : std::string(offset - 1, 'x') + " ") + encoded + after;
      const Result a = Default().ScanText(text, Where::kBody);
      ASSERT_TRUE(Has(a, "dlp:email")) << offset << ": " << Describe(a);
      EXPECT_EQ(a.findings[0].layer, "url") << offset;
      EXPECT_EQ(Describe(a), Describe(Re2Only().ScanText(text, Where::kBody))) << offset;
    }
  }
  // A JSON-escaped card whose only backslashes are the text's last bytes' neighbours.
  for (size_t offset : {0, 1009, 1010, 1011}) {
    const std::string text = std::string(offset, ' ') + "4111\\u00201111\\u00201111\\u00201111";
    const Result a = Default().ScanText(text, Where::kBody);
    ASSERT_TRUE(Has(a, "dlp:credit_card")) << offset << ": " << Describe(a);
    EXPECT_EQ(Describe(a), Describe(Re2Only().ScanText(text, Where::kBody))) << offset;
  }
}

// The RE2 locate pass of a Vectorscan rule starts near the rule's first detect match
// (RuleDef::locate_from): near-misses before a valid sample, a sample at the very start of the
// text, long token runs before a JWT or an OpenAI key's marker, a PEM header with a long label,
// an AWS secret before or after its context word with and without a key id: the same findings
// as the RE2-only engine, which searches from the start.
TEST(DlpCorpusTest, LocatePassesStartingNearTheFirstDetectMatchFindTheSame) {
  const std::string run(300, 'a');
  const std::string jwt_bad = "eyJhbGciOiJub25lIn0.eyJ4IjoxfQ.";  // header without "alg"
  const std::vector<std::pair<std::string, std::string>> texts = {
      {"github at the start", GithubToken() + " x"},
      {"github near-miss then valid", "ghp_" + std::string(36, 'a') + " " + GithubToken()},
      {"slack token at the end", "token " + SlackToken()},
      {"two google keys", GoogleApiKey() + " " + GoogleApiKey()},
      {"aws key after a word byte, then a valid one", "x" + AwsKeyId() + " " + AwsKeyId()},
      {"jwt after a long token run", run + Jwt()},
      {"jwt after a long token run and a space", run + " " + Jwt()},
      {"invalid jwt then valid", jwt_bad + " " + Jwt()},
      {"openai with token bytes before", run + OpenAiKey()},
      {"openai at the start", OpenAiKey()},
      {"anthropic at the start", AnthropicKey() + " x"},
      {"private key with a long label",
       "-----BEGIN " + std::string(80, 'X') + " PRIVATE KEY-----\n" + std::string(80, 'Q') +
           "\n-----END " + std::string(80, 'X') + " PRIVATE KEY-----"},
      {"slack webhook twice", SlackWebhook() + " " + SlackWebhook()},
      {"aws secret before its context word", AwsSecret() + " aws secret access key"},
      {"aws secret after its context word", "aws secret access key: " + AwsSecret()},
      {"aws secret far before a key id", AwsSecret() + std::string(2000, ' ') + AwsKeyId()},
      // The search stops after the last detect match (+ 256 bytes for the secret's word).
      {"valid github, then a near-miss far after",
       GithubToken() + std::string(3000, ' ') + "ghp_" + std::string(36, 'a')},
      {"two slack tokens far apart", SlackToken() + std::string(5000, '.') + " " + SlackToken()},
      {"aws secret 200 bytes after its word", "aws secret:" + std::string(200, ' ') + AwsSecret()},
      {"aws secret 250 bytes after its word", "aws secret:" + std::string(244, ' ') + AwsSecret()},
      {"aws secret 300 bytes after its word", "aws secret:" + std::string(300, ' ') + AwsSecret()},
      {"aws secret after a rejected candidate 160 bytes after its word",
       "aws secret" + std::string(160, ' ') + std::string(40, 'A') + " " + AwsSecret()},
      {"two slack tokens adjacent", SlackToken() + " " + SlackToken()},
      {"two aws secret words, value after the second",
       "aws secret" + std::string(3000, ' ') + "aws secret= " + AwsSecret()},
  };
  for (const auto& [name, text] : texts) {
    for (const std::string& prefix : {std::string(), std::string(1500, '.') + " "}) {
      const std::string body = prefix + text;
      const Result a = Default().ScanText(body, Where::kBody);
      const Result b = Re2Only().ScanText(body, Where::kBody);
      EXPECT_EQ(Describe(a), Describe(b)) << name << (prefix.empty() ? "" : " (after 1500 B)");
    }
  }
  // And the positive cases are found at all.
  EXPECT_TRUE(Has(Default().ScanText(jwt_bad + " " + Jwt(), Where::kBody), "dlp:jwt"));
  EXPECT_TRUE(Has(Default().ScanText(run + " " + Jwt(), Where::kBody), "dlp:jwt"));
  EXPECT_TRUE(Has(Default().ScanText(OpenAiKey(), Where::kBody), "dlp:openai_api_key"));
  EXPECT_TRUE(Has(Default().ScanText("aws secret access key: " + AwsSecret(), Where::kBody),
                  "dlp:aws_secret_key"));
  EXPECT_TRUE(
      Has(Default().ScanText(AwsSecret() + std::string(2000, ' ') + AwsKeyId(), Where::kBody),
          "dlp:aws_secret_key"));
}

}  // namespace
}  // namespace esb::governance::dlp

namespace esb::governance::dlp {
namespace {

// The bench's second corpus (chat-style JSON with escapes: the JSON view is scanned too): both
// engines agree and every planted sample is found, in the raw text or the JSON view.
TEST(DlpCorpusTest, ChatJsonCorpusEnginesAgreeAndFindEveryPlant) {
  auto re2_only = Engine::Compile(DlpConfig{}, EngineOptions{.vectorscan = false});
  ASSERT_TRUE(re2_only.ok());
  size_t total = 0;
  for (int i = 0; i < 30; ++i) {
    const std::string body = testing::ChatJson(16 * 1024, 500 + i, i);
    const Result a = Default().ScanText(body, Where::kBody);
    const Result b = (*re2_only)->ScanText(body, Where::kBody);
    EXPECT_EQ(Describe(a), Describe(b)) << "body " << i;
    EXPECT_TRUE(Has(a, testing::kPlantRules[i % 15])) << "body " << i << ": " << Describe(a);
    total += a.findings.size();
  }
  EXPECT_LT(total, 30u * 3) << "false positives in the chat corpus";
}

}  // namespace
}  // namespace esb::governance::dlp

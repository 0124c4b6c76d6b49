#include <gtest/gtest.h>

#include "governance/dlp/dlp.h"

namespace esb::governance::dlp {
namespace {

absl::StatusOr<DlpConfig> ParseText(std::string_view text) {
  return ParseDlpConfig(boost::json::parse(text));
}

TEST(DlpConfigTest, DefaultsFromEmptyObject) {
  absl::StatusOr<DlpConfig> config = ParseText("{}");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->enabled);
  EXPECT_EQ(config->max_body_bytes, 10u * 1024 * 1024);
  EXPECT_EQ(config->on_oversize, OversizePolicy::kBlock);
  EXPECT_FALSE(config->scan_responses);
}

TEST(DlpConfigTest, ParsesEveryKeyAndRoundTrips) {
  absl::StatusOr<DlpConfig> config = ParseText(R"({
    "enabled": true, "rules": {"email": "redact", "dlp:phone": "off"},
    "custom": [{"name": "ticket", "regex": "TCK-[0-9]{6}", "action": "log"}],
    "secrets": [{"name": "DB_PASSWORD", "value": "hunter2hunter2"}],
    "allow": ["4111111111111111"], "max_body_bytes": 4096, "on_oversize": "pass_unscanned",
    "scan_responses": true})");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->rule_actions.at("dlp:email"), Action::kRedact);
  EXPECT_EQ(config->rule_actions.at("dlp:phone"), Action::kNone);
  ASSERT_EQ(config->custom_patterns.size(), 1u);
  EXPECT_EQ(config->custom_patterns[0].action, Action::kLog);
  ASSERT_EQ(config->secret_values.size(), 1u);
  EXPECT_EQ(config->max_body_bytes, 4096u);
  EXPECT_EQ(config->on_oversize, OversizePolicy::kPassUnscanned);

  absl::StatusOr<DlpConfig> again = ParseDlpConfig(ToJson(*config, true));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(ToJson(*again, true), ToJson(*config, true));
}

TEST(DlpConfigTest, ToJsonMasksSecretValuesByDefault) {
  absl::StatusOr<DlpConfig> config =
      ParseText(R"({"secrets": [{"name": "TOKEN", "value": "s3cr3t-value-123"}]})");
  ASSERT_TRUE(config.ok()) << config.status();
  const std::string rendered = boost::json::serialize(ToJson(*config));
  EXPECT_EQ(rendered.find("s3cr3t-value-123"), std::string::npos) << rendered;
  // The masked form cannot be stored back by mistake: it is shorter than the minimum.
  EXPECT_FALSE(ParseDlpConfig(ToJson(*config)).ok());
}

TEST(DlpConfigTest, RejectsBadInputWithTheKeyInTheMessage) {
  struct Case {
    const char* json;
    const char* key;
  } cases[] = {
      {R"([])", "dlp"},
      {R"({"bogus": 1})", "dlp.bogus"},
      {R"({"enabled": "yes"})", "dlp.enabled"},
      {R"({"rules": {"dlp:nope": "block"}})", "dlp.rules.dlp:nope"},
      {R"({"rules": {"email": "shout"}})", "dlp.rules.email"},
      {R"({"rules": {"oversize": "log"}})", "dlp.rules.oversize"},
      {R"({"custom": [{"name": "x", "regex": "a("}]})", "dlp.custom[0].regex"},
      {R"({"custom": [{"name": "x", "regex": "a*"}]})", "dlp.custom[0].regex"},
      {R"({"custom": [{"name": "bad name", "regex": "a"}]})", "dlp.custom[0].name"},
      {R"({"custom": [{"name": "x", "regex": "a", "extra": 1}]})", "dlp.custom[0].extra"},
      {R"({"secrets": [{"name": "s", "value": "short"}]})", "dlp.secrets[0].value"},
      {R"({"max_body_bytes": 10})", "dlp.max_body_bytes"},
      {R"({"max_body_bytes": -1})", "dlp.max_body_bytes"},
      {R"({"on_oversize": "drop"})", "dlp.on_oversize"},
      {R"({"allow": [""]})", "dlp.allow"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<DlpConfig> config = ParseText(c.json);
    ASSERT_FALSE(config.ok()) << c.json;
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(config.status().message().find(c.key), std::string::npos)
        << c.json << " → " << config.status();
  }
}

TEST(DlpConfigTest, SecretValueNeverEchoedInErrors) {
  absl::StatusOr<DlpConfig> config = ParseText(R"({"secrets": [{"name": "s", "value": "tiny"}]})");
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().message().find("tiny"), std::string::npos);
}

}  // namespace
}  // namespace esb::governance::dlp

#include "governance/policy.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace esb::governance {
namespace {

namespace json = boost::json;

EgressPolicy MustParse(std::string_view text) {
  auto policy = ParseEgressPolicy(json::parse(text));
  EXPECT_TRUE(policy.ok()) << policy.status();
  return policy.ok() ? *policy : EgressPolicy{};
}

std::string ParseError(std::string_view text) {
  auto policy = ParseEgressPolicy(json::parse(text));
  EXPECT_FALSE(policy.ok()) << text;
  return policy.ok() ? "" : std::string(policy.status().message());
}

Decision D(const EgressPolicy& p, std::string_view host, uint16_t port,
           const std::vector<ActiveIntent>& intents = {}, int64_t now = 1000) {
  return Decide(p, intents, now, host, port);
}

TEST(HostRuleTest, ParsesExactWildcardPortAndIpForms) {
  auto exact = ParseHostRule("Example.COM.");
  ASSERT_TRUE(exact.ok());
  EXPECT_EQ(exact->kind, HostRule::Kind::kExact);
  EXPECT_EQ(exact->host, "example.com");
  EXPECT_EQ(exact->text, "example.com");
  EXPECT_FALSE(exact->port.has_value());

  auto wild = ParseHostRule("*.example.com:443");
  ASSERT_TRUE(wild.ok());
  EXPECT_EQ(wild->kind, HostRule::Kind::kSuffix);
  EXPECT_EQ(wild->host, "example.com");
  EXPECT_EQ(wild->port, 443);
  EXPECT_EQ(wild->text, "*.example.com:443");

  auto v4 = ParseHostRule("203.0.113.7:80");
  ASSERT_TRUE(v4.ok());
  EXPECT_EQ(v4->kind, HostRule::Kind::kIp);
  EXPECT_EQ(v4->text, "203.0.113.7:80");

  auto v6 = ParseHostRule("2001:DB8:0::1");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->kind, HostRule::Kind::kIp);
  EXPECT_EQ(v6->host, "2001:db8::1");
  EXPECT_FALSE(v6->port.has_value());

  auto v6port = ParseHostRule("[2001:db8::1]:8443");
  ASSERT_TRUE(v6port.ok());
  EXPECT_EQ(v6port->host, "2001:db8::1");
  EXPECT_EQ(v6port->port, 8443);
  EXPECT_EQ(v6port->text, "[2001:db8::1]:8443");
}

TEST(HostRuleTest, RejectsBadRulesWithClearMessages) {
  struct Case {
    const char* rule;
    const char* message_part;
  } cases[] = {
      {"", "empty host rule"},
      {"*", "use \"mode\": \"open\""},
      {"*.", "empty suffix"},
      {"*example.com", "leading '*.'"},
      {"a.*.example.com", "leading '*.'"},
      {"example.com:0", "port must be 1..65535"},
      {"example.com:65536", "port must be 1..65535"},
      {"example.com:http", "port must be 1..65535"},
      {"example.com:", "port must be 1..65535"},
      {"exa mple.com", "may contain only"},
      {"a..b", "empty label"},
      {"-a.com", "may not start or end with '-'"},
      {"127.1", "numeric"},
      {"0x7f000001", "numeric address form"},
      {"2130706433", "numeric"},
      {"[127.0.0.1]:80", "not an IPv6 address"},
      {"[::1", "missing ']'"},
      {"[::1]x", "expected ':port'"},
      {"1:2:3:zz::1", "not a valid IPv6"},
  };
  for (const Case& c : cases) {
    auto r = ParseHostRule(c.rule);
    ASSERT_FALSE(r.ok()) << c.rule;
    EXPECT_NE(r.status().message().find(c.message_part), std::string::npos)
        << c.rule << " -> " << r.status().message();
  }
}

TEST(HostRuleTest, CidrRangesParseCanonicallyAndRefuseHostBits) {
  for (auto [in, text] : std::vector<std::pair<std::string, std::string>>{
           {"203.0.113.0/24", "203.0.113.0/24"},
           {"10.0.0.0/8:443", "10.0.0.0/8:443"},
           {"0.0.0.0/0", "0.0.0.0/0"},
           {"2001:DB8::/32", "2001:db8::/32"},
           {"[2001:db8::/32]:443", "[2001:db8::/32]:443"},
           {"203.0.113.7/32", "203.0.113.7/32"}}) {
    auto r = ParseHostRule(in);
    ASSERT_TRUE(r.ok()) << in << ": " << r.status();
    EXPECT_EQ(r->kind, HostRule::Kind::kIp) << in;
    EXPECT_EQ(r->text, text) << in;
    auto again = ParseHostRule(r->text);
    ASSERT_TRUE(again.ok()) << r->text;
    EXPECT_EQ(*again, *r) << "the canonical text parses to the same rule";
  }
  for (auto [in, part] : std::vector<std::pair<std::string, std::string>>{
           {"10.0.0.1/8", "host bits"},
           {"10.0.0.0/33", "prefix length must be 0..32"},
           {"10.0.0.0/", "prefix length"},
           {"10.0.0.0/x", "prefix length"},
           {"2001:db8::/129", "prefix length must be 0..128"},
           {"example.com/8", "only follows an IP address"}}) {
    auto r = ParseHostRule(in);
    ASSERT_FALSE(r.ok()) << in;
    EXPECT_NE(r.status().message().find(part), std::string::npos)
        << in << " -> " << r.status().message();
  }
}

// An allowed IP literal is explicitly allowed even when private or the host's own: a range in
// allow ("0.0.0.0/0" meant as "the internet") would open the metadata and host addresses.
TEST(PolicyTest, CidrRangesAreRefusedInAllowAndIntents) {
  EXPECT_NE(ParseError(R"({"allow": ["0.0.0.0/0"]})").find("deny and tls_exclude only"),
            std::string::npos);
  EXPECT_NE(ParseError(R"({"allow": ["ok.test", "[2001:db8::/32]:443"]})").find("allow[1]"),
            std::string::npos);
  auto catalogue = ParseIntentCatalogue(json::parse(R"({"x": {"allow": ["10.0.0.0/8"]}})"));
  ASSERT_FALSE(catalogue.ok());
  EXPECT_NE(catalogue.status().message().find("deny and tls_exclude only"), std::string::npos);
  EgressPolicy p = MustParse(R"({"deny": ["10.0.0.0/8"], "tls_exclude": ["192.0.2.0/24"]})");
  EXPECT_EQ(p.deny.size(), 1u);
  EXPECT_TRUE(TlsExcluded(p, "192.0.2.9", 443));
}

TEST(DecideTest, CidrRulesCoverTheirRangeOnly) {
  EgressPolicy p = MustParse(
      R"({"mode": "open", "deny": ["203.0.113.0/24", "2001:db8::/32", "198.51.100.0/24:443"]})");
  EXPECT_EQ(D(p, "203.0.113.99", 80).rule, "deny:203.0.113.0/24");
  EXPECT_EQ(D(p, "203.0.114.1", 80).rule, "mode:open");
  EXPECT_EQ(D(p, "[2001:db8:1::5]", 80).rule, "deny:2001:db8::/32");
  EXPECT_EQ(D(p, "2001:db9::5", 80).rule, "mode:open");
  EXPECT_EQ(D(p, "198.51.100.1", 443).rule, "deny:198.51.100.0/24:443");
  EXPECT_EQ(D(p, "198.51.100.1", 80).rule, "mode:open");
  EXPECT_EQ(D(p, "weather.test", 80).rule, "mode:open") << "a range never matches a name";
  EgressPolicy all4 = MustParse(R"({"mode": "open", "deny": ["0.0.0.0/0"]})");
  EXPECT_FALSE(D(all4, "8.8.8.8", 53).allowed);
  EXPECT_TRUE(D(all4, "2001:4860::8888", 53).allowed) << "an IPv4 range never covers IPv6";
}

TEST(HostRuleTest, LimitsOnNameAndLabelLength) {
  std::string label63(63, 'a');
  EXPECT_TRUE(ParseHostRule(label63 + ".test").ok());
  auto long_label = ParseHostRule(std::string(64, 'a') + ".test");
  ASSERT_FALSE(long_label.ok());
  EXPECT_NE(long_label.status().message().find("label longer than 63"), std::string::npos);

  std::string name;
  while (name.size() < 250) name += "abcdefghi.";
  name += "test";  // > 253
  auto too_long = ParseHostRule(name);
  ASSERT_FALSE(too_long.ok());
  EXPECT_NE(too_long.status().message().find("253"), std::string::npos)
      << too_long.status().message();
  auto huge = ParseHostRule(std::string(5000, 'a'));
  ASSERT_FALSE(huge.ok());
  EXPECT_LT(huge.status().message().size(), 200u);  // the echo of the input is capped
}

TEST(DecideTest, ExactMatchesOnlyThatName) {
  EgressPolicy p = MustParse(R"({"allow": ["weather.test"]})");
  EXPECT_EQ(D(p, "weather.test", 443).rule, "allow:weather.test");
  EXPECT_TRUE(D(p, "WEATHER.test.", 80).allowed);
  EXPECT_EQ(D(p, "api.weather.test", 443).rule, "not_allowed");
  EXPECT_FALSE(D(p, "weather.test.evil", 443).allowed);
  EXPECT_FALSE(D(p, "xweather.test", 443).allowed);
}

TEST(DecideTest, WildcardMatchesSubdomainsButNotTheApex) {
  EgressPolicy p = MustParse(R"({"allow": ["*.weather.test"]})");
  EXPECT_EQ(D(p, "api.weather.test", 443).rule, "allow:*.weather.test");
  EXPECT_TRUE(D(p, "a.b.weather.test", 443).allowed);
  EXPECT_EQ(D(p, "weather.test", 443).rule, "not_allowed");  // the apex is not included
  EXPECT_FALSE(D(p, "evilweather.test", 443).allowed);       // not a label boundary
  EXPECT_FALSE(D(p, "weather.test.evil.com", 443).allowed);
}

TEST(DecideTest, PortsRestrictWhenGiven) {
  EgressPolicy p = MustParse(R"({"allow": ["weather.test:443", "*.pkg.test:8080"]})");
  EXPECT_TRUE(D(p, "weather.test", 443).allowed);
  EXPECT_EQ(D(p, "weather.test", 80).rule, "not_allowed");
  EXPECT_TRUE(D(p, "x.pkg.test", 8080).allowed);
  EXPECT_FALSE(D(p, "x.pkg.test", 443).allowed);
}

TEST(DecideTest, IpLiteralsMatchOnlyIpHostsInCanonicalForm) {
  EgressPolicy p = MustParse(R"({"allow": ["203.0.113.7", "[2001:db8::1]:443"]})");
  EXPECT_EQ(D(p, "203.0.113.7", 80).rule, "allow:203.0.113.7");
  EXPECT_TRUE(D(p, "[2001:DB8:0:0::1]", 443).allowed);
  EXPECT_TRUE(D(p, "2001:db8::1", 443).allowed);
  EXPECT_FALSE(D(p, "[2001:db8::1]", 80).allowed);
  EXPECT_FALSE(D(p, "203.0.113.8", 80).allowed);
  // A name rule never lets an address through, nor an address rule a name.
  EgressPolicy names = MustParse(R"({"allow": ["*.test", "localhost"]})");
  EXPECT_FALSE(D(names, "127.0.0.1", 80).allowed);
  EgressPolicy ips = MustParse(R"({"allow": ["127.0.0.1"]})");
  EXPECT_FALSE(D(ips, "localhost", 80).allowed);
}

TEST(DecideTest, NumericAliasesOfAddressesAreInvalidHosts) {
  EgressPolicy p = MustParse(R"({"mode": "open"})");
  EXPECT_EQ(D(p, "127.1", 80).rule, "invalid_host");
  EXPECT_EQ(D(p, "0x7f000001", 80).rule, "invalid_host");
  EXPECT_EQ(D(p, "2130706433", 80).rule, "invalid_host");
  EXPECT_EQ(D(p, "", 80).rule, "invalid_host");
  EXPECT_EQ(D(p, "a b", 80).rule, "invalid_host");
  EXPECT_EQ(D(p, "[127.0.0.1]", 80).rule, "invalid_host");
}

TEST(DecideTest, DenyWinsOverAllowOpenAndIntents) {
  EgressPolicy p = MustParse(R"({"allow": ["*.weather.test"], "deny": ["evil.weather.test"]})");
  EXPECT_EQ(D(p, "evil.weather.test", 443).rule, "deny:evil.weather.test");
  EXPECT_TRUE(D(p, "api.weather.test", 443).allowed);
  EgressPolicy open = MustParse(R"({"mode": "open", "deny": ["*.evil.test:443"]})");
  EXPECT_EQ(D(open, "x.evil.test", 443).rule, "deny:*.evil.test:443");
  EXPECT_EQ(D(open, "x.evil.test", 80).rule, "mode:open");
  ActiveIntent intent{"leak", {*ParseHostRule("evil.weather.test")}, 5000};
  EXPECT_EQ(D(p, "evil.weather.test", 443, {intent}).rule, "deny:evil.weather.test");
}

TEST(DecideTest, Modes) {
  ActiveIntent intent{"check-weather", {*ParseHostRule("weather.test")}, 5000};
  EgressPolicy blocked = MustParse(R"({"mode": "blocked", "allow": ["weather.test"]})");
  EXPECT_EQ(D(blocked, "weather.test", 443, {intent}).rule, "mode:blocked");
  EXPECT_EQ(D(blocked, "not a host", 443).rule, "mode:blocked");
  EgressPolicy open = MustParse(R"({"mode": "open"})");
  EXPECT_EQ(D(open, "anything.test", 1).rule, "mode:open");
  EXPECT_TRUE(D(open, "198.51.100.1", 22).allowed);
  EgressPolicy allowlist = MustParse(R"({})");
  EXPECT_EQ(allowlist.mode, EgressMode::kAllowlist);
  EXPECT_EQ(D(allowlist, "weather.test", 443).rule, "not_allowed");
}

TEST(DecideTest, IntentAllowsOnlyUntilItsExactExpiry) {
  EgressPolicy p = MustParse(R"({"allow": ["pypi.test"]})");
  ActiveIntent intent{"check-weather", {*ParseHostRule("*.weather.test")}, 10'000};
  EXPECT_EQ(D(p, "api.weather.test", 443, {intent}, 9'999).rule, "intent:check-weather");
  EXPECT_EQ(D(p, "api.weather.test", 443, {intent}, 10'000).rule, "not_allowed");
  EXPECT_EQ(D(p, "api.weather.test", 443, {intent}, 10'001).rule, "not_allowed");
  EXPECT_FALSE(D(p, "weather.test", 443, {intent}, 0).allowed);  // apex not in *.weather.test
  // The environment's own allow list is reported first.
  ActiveIntent pypi{"pip", {*ParseHostRule("pypi.test")}, 10'000};
  EXPECT_EQ(D(p, "pypi.test", 443, {pypi}, 0).rule, "allow:pypi.test");
}

TEST(DecideTest, SeveralIntentsUnion) {
  EgressPolicy p;
  std::vector<ActiveIntent> intents = {
      {"a", {*ParseHostRule("a.test")}, 100},
      {"b", {*ParseHostRule("b.test")}, 200},
  };
  EXPECT_EQ(D(p, "a.test", 1, intents, 50).rule, "intent:a");
  EXPECT_EQ(D(p, "b.test", 1, intents, 150).rule, "intent:b");
  EXPECT_FALSE(D(p, "a.test", 1, intents, 150).allowed);
}

TEST(PolicyTest, RoundTripsThroughJson) {
  EgressPolicy p = MustParse(R"({"mode": "allowlist", "allow": ["*.Weather.test:443", "x.test"],
      "deny": ["10.0.0.1"], "tls_inspect": false, "tls_exclude": ["bank.test"],
      "dlp": {"rules": {"dlp:email": "log"}}, "max_body_bytes": 4096})");
  json::object j = ToJson(p);
  EXPECT_EQ(json::serialize(j["allow"]), R"(["*.weather.test:443","x.test"])");
  EXPECT_EQ(j["mode"], "allowlist");
  EXPECT_EQ(j["max_body_bytes"], 4096);
  auto again = ParseEgressPolicy(j);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(*again == p);
  EXPECT_TRUE(TlsExcluded(p, "anything.test", 443));  // tls_inspect false
}

TEST(PolicyTest, DisplayJsonHidesRegisteredSecretValues) {
  EgressPolicy p = MustParse(
      R"({"dlp": {"secrets": [{"name": "DB_PASSWORD", "value": "hunter2-very-secret"}]}})");
  EXPECT_NE(json::serialize(ToJson(p)).find("hunter2-very-secret"), std::string::npos)
      << "the complete form keeps it (store, proxy)";
  std::string shown = json::serialize(ToDisplayJson(p));
  EXPECT_EQ(shown.find("hunter2"), std::string::npos) << shown;
  EXPECT_NE(shown.find(R"({"name":"DB_PASSWORD","value":"***"})"), std::string::npos) << shown;
  EXPECT_EQ(json::serialize(ToDisplayJson(MustParse("{}"))),
            json::serialize(ToJson(MustParse("{}"))));
}

TEST(PolicyTest, DefaultsAndBase) {
  EgressPolicy p = MustParse("{}");
  EXPECT_EQ(p.mode, EgressMode::kAllowlist);
  EXPECT_TRUE(p.tls_inspect);
  EXPECT_EQ(p.max_body_bytes, kDefaultMaxBodyBytes);
  EgressPolicy base = MustParse(R"({"deny": ["evil.test"], "tls_inspect": false})");
  auto layered = ParseEgressPolicy(json::parse(R"({"allow": ["a.test"]})"), base);
  ASSERT_TRUE(layered.ok());
  EXPECT_EQ(layered->deny.size(), 1u);
  EXPECT_FALSE(layered->tls_inspect);
  EXPECT_EQ(layered->allow.size(), 1u);
}

TEST(PolicyTest, TlsExclusions) {
  EgressPolicy p = MustParse(R"({"tls_exclude": ["*.bank.test", "pin.test:8443"]})");
  EXPECT_TRUE(TlsExcluded(p, "www.bank.test", 443));
  EXPECT_FALSE(TlsExcluded(p, "bank.test", 443));
  EXPECT_TRUE(TlsExcluded(p, "pin.test", 8443));
  EXPECT_FALSE(TlsExcluded(p, "pin.test", 443));
  EXPECT_FALSE(TlsExcluded(p, "other.test", 443));
}

TEST(PolicyTest, BadInputGivesClearErrors) {
  EXPECT_NE(ParseError(R"("open")").find("policy object"), std::string::npos);
  EXPECT_NE(ParseError(R"({"mode": "closed"})").find("network.mode must be one of"),
            std::string::npos);
  EXPECT_NE(ParseError(R"({"allow": "a.test"})").find("network.allow must be an array"),
            std::string::npos);
  EXPECT_NE(ParseError(R"({"allow": ["a.test", 7]})").find("network.allow[1] must be a string"),
            std::string::npos);
  EXPECT_NE(ParseError(R"({"deny": ["ok.test", "*."]})").find("network.deny[1]: '*.'"),
            std::string::npos);
  EXPECT_NE(ParseError(R"({"tls_inspect": "yes"})").find("true or false"), std::string::npos);
  EXPECT_NE(ParseError(R"({"dlp": []})").find("network.dlp must be an object"), std::string::npos);
  EXPECT_NE(ParseError(R"({"max_body_bytes": 0})").find("between 1 and"), std::string::npos);
  EXPECT_NE(ParseError(R"({"max_body_bytes": 1.5})").find("integer"), std::string::npos);
  EXPECT_NE(ParseError(R"({"allowed": []})").find("unknown field 'network.allowed'"),
            std::string::npos);
}

TEST(PolicyTest, RuleCountLimit) {
  json::array many;
  for (size_t i = 0; i <= kMaxRulesPerList; ++i)
    many.emplace_back("h" + std::to_string(i) + ".test");
  json::object o;
  o["allow"] = many;
  auto p = ParseEgressPolicy(o);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("at most 256 rules"), std::string::npos);
  many.pop_back();
  o["allow"] = many;
  EXPECT_TRUE(ParseEgressPolicy(o).ok());
  // Duplicates collapse.
  auto dup = ParseEgressPolicy(json::parse(R"({"allow": ["a.test", "A.TEST", "a.test."]})"));
  ASSERT_TRUE(dup.ok());
  EXPECT_EQ(dup->allow.size(), 1u);
}

TEST(IntentCatalogueTest, ParsesAndValidates) {
  auto cat = ParseIntentCatalogue(json::parse(
      R"({"check-weather": {"allow": ["weather.test", "*.weather.test"], "max_ttl_seconds": 600,
          "description": "weather lookups"}})"));
  ASSERT_TRUE(cat.ok()) << cat.status();
  ASSERT_EQ(cat->count("check-weather"), 1u);
  const IntentDefinition& def = cat->at("check-weather");
  EXPECT_EQ(def.allow.size(), 2u);
  EXPECT_EQ(def.max_ttl_seconds, 600);
  auto again = ParseIntentCatalogue(ToJson(*cat));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->at("check-weather").allow, def.allow);

  auto err = [](std::string_view text) {
    auto c = ParseIntentCatalogue(json::parse(text));
    EXPECT_FALSE(c.ok()) << text;
    return c.ok() ? std::string() : std::string(c.status().message());
  };
  EXPECT_NE(err(R"({"Bad Name": {"allow": ["a.test"]}})").find("must start with [a-z0-9]"),
            std::string::npos);
  EXPECT_NE(err(R"({"x": {"allow": []}})").find("at least one"), std::string::npos);
  EXPECT_NE(err(R"({"x": {}})").find("at least one"), std::string::npos);
  EXPECT_NE(err(R"({"x": {"allow": ["*"]}})").find("intents.x.allow[0]"), std::string::npos);
  EXPECT_NE(err(R"({"x": {"allow": ["a.test"], "ttl": 5}})").find("unknown field 'intents.x.ttl'"),
            std::string::npos);
  EXPECT_NE(err(R"({"x": {"allow": ["a.test"], "max_ttl_seconds": 0}})").find("between 1"),
            std::string::npos);
  EXPECT_NE(err(R"([])").find("intents must be an object"), std::string::npos);
  std::string long_name(kMaxIntentNameLength + 1, 'a');
  EXPECT_FALSE(ValidateIntentName(long_name).ok());
  EXPECT_TRUE(ValidateIntentName(std::string(kMaxIntentNameLength, 'a')).ok());
  EXPECT_FALSE(ValidateIntentName("a/b").ok());
}

TEST(ActiveIntentTest, JsonRoundTrip) {
  ActiveIntent a{"check-weather", {*ParseHostRule("*.weather.test:443")}, 1234567};
  auto b = ParseActiveIntent(ToJson(a));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*b, a);
  EXPECT_FALSE(ParseActiveIntent(json::parse(R"({"intent": "x"})")).ok());
}

}  // namespace
}  // namespace esb::governance

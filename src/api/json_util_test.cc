#include "api/json_util.h"

#include <string>

#include "gtest/gtest.h"

namespace esb::api {
namespace {

boost::json::object Obj(std::string_view text) {
  JsonBody b = ParseJsonObject(text);
  EXPECT_TRUE(b.ok()) << text;
  return b.value();
}

std::string ErrorMessage(const Response& r) {
  boost::json::value v = boost::json::parse(r.body);
  EXPECT_EQ(v.at("error"), true);
  return std::string(v.at("message").as_string());
}

TEST(JsonBodyTest, ParsesObjectAndRejectsOtherJson) {
  EXPECT_TRUE(ParseJsonObject(R"({"a": 1})").ok());
  EXPECT_TRUE(ParseJsonObject("").ok());
  EXPECT_TRUE(ParseJsonObject("  \n").ok());
  EXPECT_FALSE(ParseJsonObject("", /*allow_empty=*/false).ok());

  JsonBody arr = ParseJsonObject("[1,2]");
  ASSERT_FALSE(arr.ok());
  EXPECT_EQ(arr.error().status, 400);
  EXPECT_EQ(ErrorMessage(arr.error()), "request body must be a JSON object");

  JsonBody bad = ParseJsonObject(R"({"a": )");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().status, 400);
  EXPECT_NE(ErrorMessage(bad.error()).find("malformed JSON body"), std::string::npos);

  EXPECT_FALSE(ParseJsonObject(R"({"a": 1} trailing)").ok());
  EXPECT_FALSE(ParseJsonObject("{\"a\": \"\xff\"}").ok());  // invalid UTF-8
  // Nesting bombs are refused instead of recursing without bound.
  EXPECT_FALSE(ParseJsonObject("{\"a\":" + std::string(10000, '[') + "}").ok());
}

TEST(JsonBodyTest, ContentTypeChecked) {
  Request req;
  req.body_ = R"({"a": 1})";
  req.headers_ = {{"Content-Type", "application/json; charset=utf-8"}};
  EXPECT_TRUE(ParseJsonObjectBody(req).ok());
  req.headers_ = {{"content-type", "application/merge-patch+json"}};
  EXPECT_TRUE(ParseJsonObjectBody(req).ok());
  req.headers_ = {};
  EXPECT_EQ(ParseJsonObjectBody(req).error().status, 415) << "a body needs a content type";
  // What `curl -d '{...}'` and a cross-site HTML form send: refused although the body is JSON.
  req.headers_ = {{"Content-Type", "application/x-www-form-urlencoded"}};
  JsonBody form = ParseJsonObjectBody(req);
  ASSERT_FALSE(form.ok());
  EXPECT_EQ(form.error().status, 415);
  EXPECT_NE(form.error().body.find("send Content-Type: application/json"), std::string::npos);
  req.headers_ = {{"Content-Type", "multipart/form-data; boundary=x"}};
  EXPECT_EQ(ParseJsonObjectBody(req).error().status, 415);
  req.headers_ = {{"Content-Type", "text/plain"}};
  JsonBody b = ParseJsonObjectBody(req);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.error().status, 415);
  EXPECT_NE(b.error().body.find("unsupported_media_type"), std::string::npos);
  req.body_ = "";
  EXPECT_TRUE(ParseJsonObjectBody(req).ok());  // empty body: content type irrelevant
  // On the header alone (before the body is read), an announced body counts.
  Request head;
  head.has_body_ = true;
  head.headers_ = {{"Content-Type", "text/plain;charset=utf-8"}};
  EXPECT_TRUE(CheckJsonContentType(head).has_value());
  head.headers_ = {{"Content-Type", "Application/JSON; charset=utf-8"}};
  EXPECT_FALSE(CheckJsonContentType(head).has_value());
}

TEST(JsonFieldsTest, ReadsTypedFields) {
  boost::json::object o = Obj(
      R"({"command": "ls", "timeout_seconds": 30, "cpu": 0.5, "flag": true,
          "env": {"K": "V"}, "encoding": "base64", "nothing": null})");
  JsonFields f(o);
  EXPECT_EQ(f.RequiredString("command"), "ls");
  EXPECT_EQ(f.OptionalInt("timeout_seconds", 60, 1, 3600), 30);
  EXPECT_DOUBLE_EQ(f.OptionalDouble("cpu", 1.0, 0.1, 8), 0.5);
  EXPECT_TRUE(f.OptionalBool("flag", false));
  auto env = f.OptionalStringMap("env");
  ASSERT_EQ(env.size(), 1u);
  EXPECT_EQ(env["K"], "V");
  EXPECT_EQ(f.OptionalEnum("encoding", "utf-8", {"utf-8", "base64"}), "base64");
  EXPECT_EQ(f.OptionalString("nothing", "dflt"), "dflt");  // null counts as absent
  EXPECT_EQ(f.OptionalInt("absent", 60, 1, 3600), 60);
  EXPECT_TRUE(f.ok()) << f.error();
}

TEST(JsonFieldsTest, RejectsUnknownFields) {
  boost::json::object o = Obj(R"({"command": "ls", "x": 1})");
  JsonFields f(o);
  f.RequiredString("command");
  EXPECT_FALSE(f.ok());
  EXPECT_EQ(f.error(), "unknown field 'x'");
  Response r = f.ErrorResponse();
  EXPECT_EQ(r.status, 400);
  boost::json::value v = boost::json::parse(r.body);
  EXPECT_EQ(v.at("code"), "bad_request");
  EXPECT_EQ(v.at("message"), "unknown field 'x'");
}

TEST(JsonFieldsTest, AllowMarksFieldKnown) {
  boost::json::object o = Obj(R"({"x": 1})");
  JsonFields f(o);
  f.Allow("x");
  EXPECT_TRUE(f.ok());
}

TEST(JsonFieldsTest, TypeErrors) {
  {
    boost::json::object o = Obj(R"({"command": 5})");
    JsonFields f(o);
    f.RequiredString("command");
    EXPECT_FALSE(f.ok());
    EXPECT_EQ(f.error(), "field 'command' must be a string");
  }
  {
    boost::json::object o = Obj(R"({"t": "60"})");
    JsonFields f(o);
    f.OptionalInt("t", 60, 1, 3600);
    EXPECT_EQ(f.error(), "field 't' must be an integer");
  }
  {
    boost::json::object o = Obj(R"({"t": 1.5})");
    JsonFields f(o);
    f.OptionalInt("t", 60, 1, 3600);
    EXPECT_EQ(f.error(), "field 't' must be an integer");
  }
  {
    boost::json::object o = Obj(R"({"t": true})");
    JsonFields f(o);
    f.OptionalInt("t", 60, 1, 3600);
    EXPECT_FALSE(f.ok());
  }
  {
    boost::json::object o = Obj(R"({"b": 1})");
    JsonFields f(o);
    f.OptionalBool("b", false);
    EXPECT_EQ(f.error(), "field 'b' must be true or false");
  }
  {
    boost::json::object o = Obj(R"({"env": {"K": 1}})");
    JsonFields f(o);
    f.OptionalStringMap("env");
    EXPECT_FALSE(f.ok());
  }
  {
    boost::json::object o = Obj(R"({"enc": "hex"})");
    JsonFields f(o);
    f.OptionalEnum("enc", "utf-8", {"utf-8", "base64"});
    EXPECT_EQ(f.error(), "field 'enc' must be one of: utf-8, base64");
  }
  {
    boost::json::object o = Obj("{}");
    JsonFields f(o);
    f.RequiredString("command");
    f.RequiredInt("n", 0, 10);
    EXPECT_EQ(f.error(), "missing required field 'command'");  // first error wins
  }
}

TEST(JsonFieldsTest, Ranges) {
  auto check = [](std::string_view body, bool ok) {
    boost::json::object o = Obj(body);
    JsonFields f(o);
    f.OptionalInt("t", 60, 1, 3600);
    EXPECT_EQ(f.ok(), ok) << body << " " << f.error();
    return f.error();
  };
  check(R"({"t": 1})", true);
  check(R"({"t": 3600})", true);
  check(R"({"t": 60.0})", true);
  EXPECT_EQ(check(R"({"t": 0})", false), "field 't' must be between 1 and 3600");
  check(R"({"t": 3601})", false);
  check(R"({"t": -5})", false);
  check(R"({"t": 18446744073709551615})", false);
  check(R"({"t": 1e300})", false);

  boost::json::object o = Obj(R"({"cpu": 0.05})");
  JsonFields f(o);
  f.OptionalDouble("cpu", 1.0, 0.1, 2.0);
  EXPECT_FALSE(f.ok());
}

TEST(Base64Test, RoundTripsAllByteValues) {
  std::string all;
  for (int i = 0; i < 256; ++i) all.push_back(static_cast<char>(i));
  for (size_t len = 0; len <= all.size(); ++len) {
    std::string in = all.substr(0, len);
    std::string enc = Base64Encode(in);
    EXPECT_EQ(enc.size() % 4, 0u);
    absl::StatusOr<std::string> dec = Base64Decode(enc);
    ASSERT_TRUE(dec.ok()) << dec.status();
    EXPECT_EQ(*dec, in) << len;
    // Unpadded input is accepted too.
    std::string unpadded = enc.substr(0, enc.find('='));
    dec = Base64Decode(unpadded);
    ASSERT_TRUE(dec.ok()) << unpadded;
    EXPECT_EQ(*dec, in);
  }
}

TEST(Base64Test, KnownVectors) {
  EXPECT_EQ(Base64Encode(""), "");
  EXPECT_EQ(Base64Encode("f"), "Zg==");
  EXPECT_EQ(Base64Encode("fo"), "Zm8=");
  EXPECT_EQ(Base64Encode("foo"), "Zm9v");
  EXPECT_EQ(Base64Encode("foobar"), "Zm9vYmFy");
  EXPECT_EQ(Base64Encode("\xff\xfe"), "//4=");
}

TEST(Base64Test, RejectsInvalidInput) {
  EXPECT_FALSE(Base64Decode("Zm9v!").ok());
  EXPECT_FALSE(Base64Decode("Zm 9v").ok());
  EXPECT_FALSE(Base64Decode("Z").ok());
  EXPECT_FALSE(Base64Decode("Zg=").ok());  // padding without a full quantum
  EXPECT_FALSE(Base64Decode("Z===").ok());
  EXPECT_FALSE(Base64Decode("Zg==Zg==").ok());  // padding in the middle
  EXPECT_FALSE(Base64Decode("Zh==").ok());      // non-zero trailing bits
  EXPECT_FALSE(Base64Decode("Zm9-").ok());      // URL-safe alphabet is not base64
}

}  // namespace
}  // namespace esb::api

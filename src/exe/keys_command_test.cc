#include "exe/keys_command.h"

#include <gtest/gtest.h>

#include <sstream>

namespace esb {
namespace {

class KeysCommandTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto s = Store::Open(":memory:", StoreOptions{});
    ASSERT_TRUE(s.ok()) << s.status();
    store = std::move(*s);
  }
  int Run(std::vector<std::string> args) {
    out.str("");
    err.str("");
    return RunKeysCommand(store.get(), args, out, err);
  }
  std::unique_ptr<Store> store;
  std::ostringstream out, err;
};

// The value after "label: " on its own line of `text`.
std::string Field(const std::string& text, const std::string& label) {
  size_t at = text.find(label + ": ");
  if (at == std::string::npos) return "";
  size_t start = at + label.size() + 2;
  return text.substr(start, text.find('\n', start) - start);
}

TEST_F(KeysCommandTest, AddPrintsTheSecretOnceAndItAuthenticates) {
  ASSERT_EQ(Run({"keys", "add", "--tenant", "acme", "--name", "ci"}), 0) << err.str();
  std::string secret = Field(out.str(), "api_key");
  std::string id = Field(out.str(), "key_id");
  ASSERT_FALSE(secret.empty());
  auto key = store->KeyForSecret(secret);
  ASSERT_TRUE(key.ok()) << key.status();
  EXPECT_EQ(key->tenant, "acme");
  EXPECT_EQ(key->key_id, id);

  ASSERT_EQ(Run({"keys", "list"}), 0) << err.str();
  EXPECT_NE(out.str().find(id), std::string::npos);
  EXPECT_NE(out.str().find("acme"), std::string::npos);
  EXPECT_NE(out.str().find("active"), std::string::npos);
  EXPECT_EQ(out.str().find(secret), std::string::npos) << "list must never show a secret";

  ASSERT_EQ(Run({"keys", "revoke", id}), 0) << err.str();
  EXPECT_FALSE(store->KeyForSecret(secret).ok());
  ASSERT_EQ(Run({"keys", "list"}), 0);
  EXPECT_NE(out.str().find("revoked"), std::string::npos);
}

TEST_F(KeysCommandTest, MistakesExitTwoWithAMessage) {
  EXPECT_EQ(Run({"keys"}), 2);
  EXPECT_NE(err.str().find("usage"), std::string::npos);
  EXPECT_EQ(Run({"keys", "add"}), 2);
  EXPECT_NE(err.str().find("--tenant is required"), std::string::npos);
  EXPECT_EQ(Run({"keys", "add", "--tenant"}), 2);
  EXPECT_NE(err.str().find("needs a value"), std::string::npos);
  EXPECT_EQ(Run({"keys", "add", "--tenant", "a", "--color", "red"}), 2);
  EXPECT_NE(err.str().find("unknown argument '--color'"), std::string::npos);
  EXPECT_EQ(Run({"keys", "revoke"}), 2);
  EXPECT_EQ(Run({"keys", "rotate", "x"}), 2);
  EXPECT_EQ(Run({"keys", "revoke", "no-such-key"}), 2);
  EXPECT_TRUE(out.str().empty());
}

}  // namespace
}  // namespace esb

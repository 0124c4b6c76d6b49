// The env CA private key sealed at rest (storage/secret_box.h) and the store's use of it.
#include "storage/secret_box.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

#include "gtest/gtest.h"
#include "storage/store.h"
#include "storage/store_test_util.h"

namespace esb {
namespace {

using store_test::TempDir;

constexpr char kPem[] =
    "-----BEGIN PRIVATE KEY-----\n"
    "MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgQ3rZ7sVq1nY0pE2L\n"
    "hX9cU4mJb5tKf8aWd2oR6yNs1vChRANCAAS0d3Fq8Kx2mNcPp7Lr4sVb9TwZy1Ue\n"
    "-----END PRIVATE KEY-----\n";
constexpr char kPemBody[] = "MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgQ3rZ7sVq1nY0pE2L";

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Everything SQLite has on disk for the database.
std::string DiskBytes(const std::string& db) {
  return ReadAll(db) + ReadAll(db + "-wal") + ReadAll(db + "-journal");
}

std::unique_ptr<Store> OpenWithKey(const std::string& db, const std::string& key_file,
                                   absl::Status* status = nullptr) {
  StoreOptions o;
  o.secret_key_file = key_file;
  o.write_behind_ms = 0;
  absl::StatusOr<std::unique_ptr<Store>> s = Store::Open(db, o);
  if (status != nullptr) *status = s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

EgressRecord Rec(const std::string& env) { return {env, "acme", "{}", "[]", "CERT", kPem, 1}; }

TEST(SecretBoxTest, SealOpensOnlyWithTheSameKeyAndRow) {
  std::string key(kSecretKeyBytes, 'k'), other(kSecretKeyBytes, 'o');
  absl::StatusOr<std::string> sealed = SealSecret(key, "env_1", kPem);
  ASSERT_TRUE(sealed.ok());
  EXPECT_TRUE(IsSealed(*sealed));
  EXPECT_EQ(sealed->find("PRIVATE"), std::string::npos);
  EXPECT_NE(*SealSecret(key, "env_1", kPem), *sealed) << "a fresh nonce per value";
  EXPECT_EQ(*OpenSecret(key, "env_1", *sealed), kPem);
  EXPECT_EQ(OpenSecret(other, "env_1", *sealed).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(OpenSecret(key, "env_2", *sealed).status().code(),
            absl::StatusCode::kFailedPrecondition)
      << "moved to another row";
  std::string tampered = *sealed;
  tampered[10] = tampered[10] == 'a' ? 'b' : 'a';
  EXPECT_FALSE(OpenSecret(key, "env_1", tampered).ok());
  EXPECT_EQ(OpenSecret(key, "env_1", "v1:zz").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenSecret(key, "env_1", "v1:").status().code(), absl::StatusCode::kInvalidArgument);
}

// The database files never hold the PEM key; the key file is created owner-only, 32 bytes.
TEST(StoreSecretsTest, CaKeyIsSealedAtRestAndTheDatabaseFilesNeverHoldThePem) {
  TempDir dir;
  const std::string db = dir.File("esbd.db"), key = dir.File("state.key");
  {
    auto store = OpenWithKey(db, key);
    ASSERT_NE(store, nullptr);
    ASSERT_TRUE(store->PutEgress(Rec("env_1")).ok());
    auto got = store->GetEgress("env_1");
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->ca_key_pem, kPem);
    EXPECT_EQ(DiskBytes(db).find(kPemBody), std::string::npos);
  }
  std::string bytes = DiskBytes(db);
  EXPECT_GT(bytes.size(), 0u);
  EXPECT_EQ(bytes.find("PRIVATE KEY"), std::string::npos);
  EXPECT_EQ(bytes.find(kPemBody), std::string::npos);
  EXPECT_NE(bytes.find("CERT"), std::string::npos) << "the row itself is there";
  struct stat st {};
  ASSERT_EQ(stat(key.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(st.st_size, static_cast<off_t>(kSecretKeyBytes));
  auto store = OpenWithKey(db, key);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->GetEgress("env_1")->ca_key_pem, kPem) << "survives a restart";
}

// Rows written in plaintext before (no key) keep working and are sealed on the next open.
TEST(StoreSecretsTest, PlaintextRowsFromBeforeAreSealedOnOpen) {
  TempDir dir;
  const std::string db = dir.File("esbd.db"), key = dir.File("state.key");
  {
    auto store = OpenWithKey(db, "");
    ASSERT_NE(store, nullptr);
    ASSERT_TRUE(store->PutEgress(Rec("env_old")).ok());
  }
  ASSERT_NE(DiskBytes(db).find(kPemBody), std::string::npos) << "the test sees a plaintext key";
  {
    auto store = OpenWithKey(db, key);
    ASSERT_NE(store, nullptr);
    auto got = store->GetEgress("env_old");
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->ca_key_pem, kPem);
  }
  EXPECT_EQ(DiskBytes(db).find(kPemBody), std::string::npos);
  EXPECT_EQ(DiskBytes(db).find("PRIVATE KEY"), std::string::npos);
  // Sealed now: opening without the key no longer yields it.
  auto store = OpenWithKey(db, "");
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->GetEgress("env_old").status().code(), absl::StatusCode::kFailedPrecondition);
}

// A replaced, missing, too-loose or short key file: Open fails with a message naming the file,
// no crash, and a missing file is not silently replaced by a new key.
TEST(StoreSecretsTest, WrongMissingOrBadKeyFileGivesAClearError) {
  TempDir dir;
  const std::string db = dir.File("esbd.db"), key = dir.File("state.key");
  {
    auto store = OpenWithKey(db, key);
    ASSERT_NE(store, nullptr);
    ASSERT_TRUE(store->PutEgress(Rec("env_1")).ok());
  }
  auto write_key = [&](const std::string& bytes, mode_t mode) {
    unlink(key.c_str());
    int fd = open(key.c_str(), O_WRONLY | O_CREAT | O_EXCL, mode);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    fchmod(fd, mode);
    close(fd);
  };
  const std::string original = [&] {
    std::ifstream in(key, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  absl::Status st;
  write_key(std::string(kSecretKeyBytes, 'x'), 0600);
  EXPECT_EQ(OpenWithKey(db, key, &st), nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find(key), std::string::npos) << st;
  EXPECT_NE(st.message().find("does not open"), std::string::npos) << st;

  unlink(key.c_str());
  EXPECT_EQ(OpenWithKey(db, key, &st), nullptr);
  EXPECT_NE(st.message().find("missing"), std::string::npos) << st;
  EXPECT_NE(access(key.c_str(), F_OK), 0) << "no new key generated over sealed rows";

  write_key(original, 0644);
  EXPECT_EQ(OpenWithKey(db, key, &st), nullptr);
  EXPECT_NE(st.message().find("600"), std::string::npos) << st;

  write_key(original.substr(0, 16), 0600);
  EXPECT_EQ(OpenWithKey(db, key, &st), nullptr);
  EXPECT_NE(st.message().find("32 bytes"), std::string::npos) << st;

  write_key(original, 0600);
  auto store = OpenWithKey(db, key, &st);
  ASSERT_NE(store, nullptr) << st;
  EXPECT_EQ(store->GetEgress("env_1")->ca_key_pem, kPem);
}

}  // namespace
}  // namespace esb

// The manifest codec and diff, and the disk blob store (issue 13).
#include "core/snapshots/manifest.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>

#include "common/util.h"
#include "core/snapshots/blob_store.h"
#include "storage/sqlite_store.h"

namespace esb {
namespace {

ManifestEntry File(std::string path, std::string sha, int64_t size = 1) {
  ManifestEntry e;
  e.path = std::move(path);
  e.sha256 = std::move(sha);
  e.size = size;
  e.mode = 0644;
  return e;
}

TEST(ManifestTest, RoundTripKeepsEveryField) {
  WorkspaceManifest m;
  m.entries.push_back(File("a.txt", std::string(64, 'a'), 3));
  ManifestEntry d;
  d.path = "dir";
  d.type = ManifestEntry::Type::kDir;
  d.mode = 0755;
  m.entries.push_back(d);
  m.entries.push_back(File("dir/b", std::string(64, 'b')));
  ManifestEntry l;
  l.path = "link";
  l.type = ManifestEntry::Type::kSymlink;
  l.target = "../outside";  // a link's text is data, never followed
  m.entries.push_back(l);
  m.entries[0].change_key = "12:34";
  m.entries[0].mtime_ns = 99;
  m.total_bytes = 4;
  auto back = DecodeManifest(EncodeManifest(m));
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->entries.size(), 4u);
  EXPECT_EQ(back->total_bytes, 4);
  EXPECT_EQ(back->entries[0].change_key, "12:34");
  EXPECT_EQ(back->entries[0].mtime_ns, 99);
  EXPECT_EQ(back->entries[1].type, ManifestEntry::Type::kDir);
  EXPECT_EQ(back->entries[3].target, "../outside");
  EXPECT_EQ(FindEntry(*back, "dir/b")->sha256, std::string(64, 'b'));
  EXPECT_EQ(FindEntry(*back, "dir/c"), nullptr);
}

TEST(ManifestTest, MalformedStoredManifestsAreRefused) {
  for (const char* text : {"", "[]", "{\"v\":2,\"e\":[]}", "{\"v\":1}", "{\"v\":1,\"e\":[[\"a\"]]}",
                           "{\"v\":1,\"e\":[[\"a\",\"x\",0,0,0,\"\",\"\",\"\"]]}",
                           "{\"v\":1,\"e\":[[\"a/../b\",\"d\",0,0,0,\"\",\"\",\"\"]]}",
                           "{\"v\":1,\"e\":[[\"a\",\"d\",99999,0,0,\"\",\"\",\"\"]]}"}) {
    EXPECT_FALSE(DecodeManifest(text).ok()) << text;
  }
}

TEST(ManifestTest, DiffNamesAddedModifiedDeleted) {
  WorkspaceManifest a, b;
  a.entries = {File("keep", std::string(64, '1')), File("mod", std::string(64, '2')),
               File("old", std::string(64, '3'))};
  b.entries = {File("keep", std::string(64, '1')), File("mod", std::string(64, '4')),
               File("new", std::string(64, '5'))};
  std::sort(b.entries.begin(), b.entries.end(),
            [](const ManifestEntry& x, const ManifestEntry& y) { return x.path < y.path; });
  auto changes = DiffManifests(a, b);
  ASSERT_EQ(changes.size(), 3u);
  EXPECT_EQ(changes[0].path, "mod");
  EXPECT_EQ(changes[0].change, "modified");
  EXPECT_EQ(changes[1].path, "new");
  EXPECT_EQ(changes[1].change, "added");
  EXPECT_EQ(changes[2].path, "old");
  EXPECT_EQ(changes[2].change, "deleted");
  b.entries[0].mode = 0600;  // "keep" changes mode only
  EXPECT_EQ(DiffManifests(a, b)[0].path, "keep");
}

TEST(ManifestTest, UnifiedDiffShowsContextAndIsBounded) {
  bool cut = false;
  std::string d = UnifiedDiff("f.py", "a\nb\nc\n", "a\nB\nc\nd\n", 1 << 20, &cut);
  EXPECT_FALSE(cut);
  EXPECT_EQ(d, "--- a/f.py\n+++ b/f.py\n@@ -1,3 +1,4 @@\n a\n-b\n+B\n c\n+d\n");
  std::string big(100000, 'x');
  std::string d2 = UnifiedDiff("g", "", big + "\n", 1000, &cut);
  EXPECT_TRUE(cut);
  EXPECT_LE(d2.size(), 1000u);
}

class BlobStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = (std::filesystem::temp_directory_path() / ("esb_blobs_" + RandomHex(6))).string();
  }
  void TearDown() override { std::filesystem::remove_all(dir); }
  std::string dir;
};

TEST_F(BlobStoreTest, PutIsContentAddressedIdempotentAndVerifiedOnRead) {
  auto s = DiskBlobStore::Open({.dir = dir});
  ASSERT_TRUE(s.ok()) << s.status();
  std::string key;
  {
    auto acme = (*s)->ForTenant("acme");
    auto put = acme.Put("hello");
    ASSERT_TRUE(put.ok());
    key = *put;
    EXPECT_EQ(key, Sha256Hex("hello"));
    EXPECT_EQ(*acme.Put("hello"), key);
    EXPECT_EQ((*s)->total_bytes(), 5);
    EXPECT_EQ((*s)->tenant_bytes("acme"), 5);
    EXPECT_EQ(*acme.Get(key), "hello");
  }
  struct stat st;
  ASSERT_EQ(::stat(dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  // A blob altered on disk is refused, not served.
  const std::string tag = DiskBlobStore::TenantTag("acme");
  std::ofstream(dir + "/t/" + tag + "/" + key.substr(0, 2) + "/" + key) << "HELLO";
  EXPECT_EQ((*s)->ForTenant("acme").Get(key).status().code(), absl::StatusCode::kDataLoss);
  (*s)->BeginSweep();
  EXPECT_EQ((*s)->RemoveUnused(tag, key), 5);
  (*s)->EndSweep();
  EXPECT_TRUE(absl::IsNotFound((*s)->ForTenant("acme").Get(key).status()));
  EXPECT_EQ((*s)->tenant_bytes("acme"), 0);
}

// Restores and the step files route read large blobs in ranges (review H2/M5): the first
// range verifies the whole blob against its key without holding it.
TEST_F(BlobStoreTest, RangesAreReadVerifiedFromTheStart) {
  auto s = DiskBlobStore::Open({.dir = dir, .max_blob_bytes = 4 << 20});
  ASSERT_TRUE(s.ok()) << s.status();
  auto acme = (*s)->ForTenant("acme");
  EXPECT_EQ(acme.max_blob_bytes(), 4 << 20);
  std::string data(3 << 20, 'a');
  for (size_t i = 0; i < data.size(); i += 1000) data[i] = static_cast<char>('b' + i % 20);
  auto key = acme.Put(data);
  ASSERT_TRUE(key.ok());
  std::string back;
  for (int64_t at = 0;; at += 1 << 20) {
    auto piece = acme.ReadRange(*key, at, 1 << 20);
    ASSERT_TRUE(piece.ok()) << piece.status();
    if (piece->empty()) break;
    back += *piece;
  }
  EXPECT_EQ(back, data);
  EXPECT_EQ(*acme.ReadRange(*key, 5, 3), data.substr(5, 3));
  EXPECT_TRUE(absl::IsNotFound(acme.ReadRange(std::string(64, 'a'), 0, 10).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(acme.ReadRange("../x", 0, 10).status()));
  // One byte altered on disk, past the first range: the first range is refused.
  {
    std::fstream f(dir + "/t/" + acme.tag() + "/" + key->substr(0, 2) + "/" + *key,
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(2 << 20);
    f.put('Z');
  }
  EXPECT_EQ(acme.ReadRange(*key, 0, 10).status().code(), absl::StatusCode::kDataLoss);
}

TEST_F(BlobStoreTest, KeysThatAreNotSha256HexNeverNameAFile) {
  auto s = DiskBlobStore::Open({.dir = dir});
  ASSERT_TRUE(s.ok());
  auto acme = (*s)->ForTenant("acme");
  for (const std::string& k :
       {std::string("../../etc/passwd"), std::string(64, 'A'), std::string(63, 'a'),
        std::string("aa/") + std::string(61, 'a'), std::string()}) {
    EXPECT_TRUE(absl::IsInvalidArgument(acme.Get(k).status())) << k;
    EXPECT_FALSE(acme.Has(k));
    EXPECT_FALSE(acme.Pin(k));
    EXPECT_EQ((*s)->RemoveUnused(acme.tag(), k), 0);
  }
  EXPECT_EQ((*s)->RemoveUnused("../..", std::string(64, 'a')), 0);
  EXPECT_FALSE((*s)->List("../..").ok());
}

TEST_F(BlobStoreTest, CapsAreEnforcedAndCountsSurviveReopen) {
  {
    auto s = DiskBlobStore::Open(
        {.dir = dir, .max_blob_bytes = 10, .max_total_bytes = 15, .max_tenant_bytes = 15});
    ASSERT_TRUE(s.ok());
    auto acme = (*s)->ForTenant("acme");
    EXPECT_EQ(acme.Put(std::string(11, 'x')).status().code(), absl::StatusCode::kResourceExhausted);
    ASSERT_TRUE(acme.Put(std::string(10, 'x')).ok());
    EXPECT_EQ(acme.Put(std::string(10, 'y')).status().code(), absl::StatusCode::kResourceExhausted);
    // A crash's leftover temporary file, and a blob of the layout before tenants.
    std::ofstream(dir + "/tmp/partial") << "junk";
    std::filesystem::create_directories(dir + "/ab");
    std::ofstream(dir + "/ab/" + std::string(64, 'a')) << "old";
  }
  auto s = DiskBlobStore::Open(
      {.dir = dir, .max_blob_bytes = 10, .max_total_bytes = 15, .max_tenant_bytes = 15});
  ASSERT_TRUE(s.ok());
  EXPECT_EQ((*s)->total_bytes(), 10);
  EXPECT_EQ((*s)->tenant_bytes("acme"), 10);
  EXPECT_FALSE(std::filesystem::exists(dir + "/tmp/partial"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/ab"));
  auto all = (*s)->List(DiskBlobStore::TenantTag("acme"));
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), 1u);
}

// H1: one tenant cannot take the whole store: its share (a quarter by default) is checked
// before anything is written, and another tenant still stores.
TEST_F(BlobStoreTest, OneTenantFillingItsShareLeavesRoomForOthers) {
  auto s = DiskBlobStore::Open({.dir = dir, .max_total_bytes = 4000});
  ASSERT_TRUE(s.ok());
  EXPECT_EQ((*s)->tenant_cap(), 1000);
  auto a = (*s)->ForTenant("a");
  int stored = 0;
  absl::Status refused;
  for (int i = 0; i < 100 && refused.ok(); ++i) {
    auto put = a.Put(std::string(100, static_cast<char>('0' + i % 64)) + std::to_string(i));
    if (put.ok())
      ++stored;
    else
      refused = put.status();
  }
  EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  EXPECT_NE(refused.message().find("capture refused: this tenant's share"), std::string_view::npos)
      << refused;
  EXPECT_LE((*s)->tenant_bytes("a"), 1000);
  EXPECT_EQ(
      std::filesystem::directory_iterator(dir + "/tmp") == std::filesystem::directory_iterator(),
      true)
      << "nothing written for the refused Put";
  auto b = (*s)->ForTenant("b");
  EXPECT_TRUE(b.Put(std::string(500, 'b')).ok());
}

// M3: identical content is stored per tenant. When a tenant's share is full, a Put of content
// another tenant stored is refused exactly like new content (no dedup oracle), and when it has
// room, that content is charged to it like any other.
TEST_F(BlobStoreTest, CrossTenantDedupIsNoOracleWhenTheShareIsFull) {
  auto s = DiskBlobStore::Open({.dir = dir, .max_total_bytes = 4000});
  ASSERT_TRUE(s.ok());
  const std::string secret(300, 's');
  auto victim = (*s)->ForTenant("victim");
  ASSERT_TRUE(victim.Put(secret).ok());
  auto attacker = (*s)->ForTenant("attacker");
  EXPECT_FALSE(attacker.Has(Sha256Hex(secret))) << "another tenant's blob is invisible";
  EXPECT_TRUE(absl::IsNotFound(attacker.Get(Sha256Hex(secret)).status()));
  ASSERT_TRUE(attacker.Put(std::string(800, 'a')).ok());  // 200 bytes of its share left
  auto existing = attacker.Put(secret);
  auto fresh = attacker.Put(std::string(300, 'n'));
  EXPECT_TRUE(absl::IsResourceExhausted(existing.status())) << existing.status();
  EXPECT_EQ(existing.status(), fresh.status()) << "same answer whether or not it exists";
  // With room, the same content is stored (and charged) in the attacker's namespace.
  auto other = (*s)->ForTenant("other");
  const int64_t before = (*s)->tenant_bytes("other");
  ASSERT_TRUE(other.Put(secret).ok());
  EXPECT_EQ((*s)->tenant_bytes("other") - before, 300);
  EXPECT_EQ((*s)->total_bytes(), 300 + 800 + 300);
}

// M1: a sweep racing a Put. The capture re-finds a blob no step references yet (the sweep's
// candidate) after the sweep read the steps: the blob is kept, whether the capture still holds
// its view or has already written its step and let go. An untouched orphan goes.
TEST_F(BlobStoreTest, SweepRacingAPutOfTheSameContentKeepsIt) {
  auto s = DiskBlobStore::Open({.dir = dir});
  ASSERT_TRUE(s.ok());
  const std::string tag = DiskBlobStore::TenantTag("acme");
  std::string raced, held, orphan;
  {
    auto first = (*s)->ForTenant("acme");
    raced = *first.Put("raced");
    held = *first.Put("held");
    orphan = *first.Put("orphan");
  }                    // an earlier capture failed: all three are referenced by no step
  (*s)->BeginSweep();  // ... the sweep has read the steps and marked nothing of these
  {
    auto capture = (*s)->ForTenant("acme");
    ASSERT_EQ(*capture.Put("raced"), raced);  // re-found, then its step is written
  }
  auto still = (*s)->ForTenant("acme");
  ASSERT_TRUE(still.Pin(held));  // a capture holding it
  EXPECT_EQ((*s)->RemoveUnused(tag, raced), 0);
  EXPECT_EQ((*s)->RemoveUnused(tag, held), 0);
  EXPECT_EQ((*s)->RemoveUnused(tag, orphan), 6);
  (*s)->EndSweep();
  EXPECT_TRUE(still.Has(raced));
  EXPECT_TRUE(still.Has(held));
  EXPECT_FALSE(still.Has(orphan));
  // The next sweep: still pinned stays; released and untouched goes.
  (*s)->BeginSweep();
  EXPECT_EQ((*s)->RemoveUnused(tag, held), 0);
  EXPECT_EQ((*s)->RemoveUnused(tag, raced), 5);
  (*s)->EndSweep();
}

}  // namespace
}  // namespace esb

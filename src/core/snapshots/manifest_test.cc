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
  auto key = (*s)->Put("hello");
  ASSERT_TRUE(key.ok());
  EXPECT_EQ(*key, Sha256Hex("hello"));
  EXPECT_EQ(*(*s)->Put("hello"), *key);
  EXPECT_EQ((*s)->total_bytes(), 5);
  EXPECT_EQ(*(*s)->Get(*key), "hello");
  struct stat st;
  ASSERT_EQ(::stat(dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  // A blob altered on disk is refused, not served.
  std::ofstream(dir + "/" + key->substr(0, 2) + "/" + *key) << "HELLO";
  EXPECT_EQ((*s)->Get(*key).status().code(), absl::StatusCode::kDataLoss);
  ASSERT_TRUE((*s)->Remove(*key).ok());
  EXPECT_TRUE(absl::IsNotFound((*s)->Get(*key).status()));
}

// Restores and the step files route read large blobs in ranges (review H2/M5): the first
// range verifies the whole blob against its key without holding it.
TEST_F(BlobStoreTest, RangesAreReadVerifiedFromTheStart) {
  auto s = DiskBlobStore::Open({.dir = dir, .max_blob_bytes = 4 << 20});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->max_blob_bytes(), 4 << 20);
  std::string data(3 << 20, 'a');
  for (size_t i = 0; i < data.size(); i += 1000) data[i] = static_cast<char>('b' + i % 20);
  auto key = (*s)->Put(data);
  ASSERT_TRUE(key.ok());
  std::string back;
  for (int64_t at = 0;; at += 1 << 20) {
    auto piece = (*s)->ReadRange(*key, at, 1 << 20);
    ASSERT_TRUE(piece.ok()) << piece.status();
    if (piece->empty()) break;
    back += *piece;
  }
  EXPECT_EQ(back, data);
  EXPECT_EQ(*(*s)->ReadRange(*key, 5, 3), data.substr(5, 3));
  EXPECT_TRUE(absl::IsNotFound((*s)->ReadRange(std::string(64, 'a'), 0, 10).status()));
  EXPECT_TRUE(absl::IsInvalidArgument((*s)->ReadRange("../x", 0, 10).status()));
  // One byte altered on disk, past the first range: the first range is refused.
  {
    std::fstream f(dir + "/" + key->substr(0, 2) + "/" + *key,
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(2 << 20);
    f.put('Z');
  }
  EXPECT_EQ((*s)->ReadRange(*key, 0, 10).status().code(), absl::StatusCode::kDataLoss);
}

TEST_F(BlobStoreTest, KeysThatAreNotSha256HexNeverNameAFile) {
  auto s = DiskBlobStore::Open({.dir = dir});
  ASSERT_TRUE(s.ok());
  for (const std::string& k :
       {std::string("../../etc/passwd"), std::string(64, 'A'), std::string(63, 'a'),
        std::string("aa/") + std::string(61, 'a'), std::string()}) {
    EXPECT_TRUE(absl::IsInvalidArgument((*s)->Get(k).status())) << k;
    EXPECT_FALSE((*s)->Has(k));
    EXPECT_FALSE((*s)->Remove(k).ok());
  }
}

TEST_F(BlobStoreTest, CapsAreEnforcedAndCountsSurviveReopen) {
  {
    auto s = DiskBlobStore::Open({.dir = dir, .max_blob_bytes = 10, .max_total_bytes = 15});
    ASSERT_TRUE(s.ok());
    EXPECT_EQ((*s)->Put(std::string(11, 'x')).status().code(),
              absl::StatusCode::kResourceExhausted);
    ASSERT_TRUE((*s)->Put(std::string(10, 'x')).ok());
    EXPECT_EQ((*s)->Put(std::string(10, 'y')).status().code(),
              absl::StatusCode::kResourceExhausted);
    // A crash's leftover temporary file.
    std::ofstream(dir + "/tmp/partial") << "junk";
  }
  auto s = DiskBlobStore::Open({.dir = dir, .max_blob_bytes = 10, .max_total_bytes = 15});
  ASSERT_TRUE(s.ok());
  EXPECT_EQ((*s)->total_bytes(), 10);
  EXPECT_FALSE(std::filesystem::exists(dir + "/tmp/partial"));
  auto all = (*s)->List();
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), 1u);
}

}  // namespace
}  // namespace esb

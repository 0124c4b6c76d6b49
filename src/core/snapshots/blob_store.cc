#include "core/snapshots/blob_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/util.h"
#include "storage/sqlite_store.h"

namespace esb {

namespace fs = std::filesystem;

bool IsBlobKey(std::string_view key) {
  if (key.size() != 64) return false;
  for (char c : key) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

absl::StatusOr<std::unique_ptr<DiskBlobStore>> DiskBlobStore::Open(DiskBlobStoreOptions options) {
  if (options.dir.empty()) return absl::InvalidArgumentError("blob store: empty directory");
  std::error_code ec;
  fs::create_directories(options.dir + "/tmp", ec);
  if (ec)
    return absl::InternalError(
        absl::StrCat("blob store: cannot create ", options.dir, ": ", ec.message()));
  ::chmod(options.dir.c_str(), 0700);
  std::unique_ptr<DiskBlobStore> store(new DiskBlobStore(std::move(options)));
  // Temporary files of writes a crash interrupted are garbage.
  for (const auto& e : fs::directory_iterator(store->options_.dir + "/tmp", ec)) {
    std::error_code rm;
    fs::remove(e.path(), rm);
  }
  auto all = store->List();
  if (!all.ok()) return all.status();
  for (const Entry& e : *all) store->total_ += e.size;
  return store;
}

std::string DiskBlobStore::PathOf(std::string_view key) const {
  return absl::StrCat(options_.dir, "/", AbslView(key.substr(0, 2)), "/", AbslView(key));
}

absl::StatusOr<std::string> DiskBlobStore::Put(std::string_view data) {
  const int64_t size = static_cast<int64_t>(data.size());
  if (size > options_.max_blob_bytes)
    return absl::ResourceExhaustedError(absl::StrCat("blob of ", size, " bytes is over the cap of ",
                                                     options_.max_blob_bytes, " bytes"));
  std::string key = Sha256Hex(data);
  const std::string path = PathOf(key);
  // Already stored: refresh its mtime (see the header) and share it.
  if (::utimensat(AT_FDCWD, path.c_str(), nullptr, 0) == 0) return key;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (total_ + size > options_.max_total_bytes)
      return absl::ResourceExhaustedError(absl::StrCat("the blob store is full (", total_, " of ",
                                                       options_.max_total_bytes, " bytes)"));
    total_ += size;  // reserved; given back on failure
  }
  auto unreserve = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    total_ -= size;
  };
  std::error_code ec;
  fs::create_directories(absl::StrCat(options_.dir, "/", key.substr(0, 2)), ec);
  const std::string tmp = absl::StrCat(options_.dir, "/tmp/", key, ".", RandomHex(6));
  absl::Status st = WriteStringToFile(tmp, data, 0600);
  if (st.ok() && ::rename(tmp.c_str(), path.c_str()) != 0)
    st = absl::InternalError(absl::StrCat("rename ", tmp, " -> ", path, ": ", strerror(errno)));
  if (!st.ok()) {
    ::unlink(tmp.c_str());
    unreserve();
    return st;
  }
  return key;
}

bool DiskBlobStore::Has(std::string_view sha256) {
  if (!IsBlobKey(sha256)) return false;
  struct stat st;
  return ::stat(PathOf(sha256).c_str(), &st) == 0;
}

absl::StatusOr<std::string> DiskBlobStore::Get(std::string_view sha256) {
  if (!IsBlobKey(sha256))
    return absl::InvalidArgumentError("a blob key is 64 lowercase hex characters");
  std::string data;
  absl::Status st = ReadFileToString(PathOf(sha256), &data);
  if (!st.ok()) {
    if (absl::IsNotFound(st) || !Has(sha256))
      return absl::NotFoundError(
          absl::StrCat("blob ", AbslView(sha256), " is not stored (collected)"));
    return st;
  }
  if (Sha256Hex(data) != sha256)
    return absl::DataLossError(absl::StrCat("blob ", AbslView(sha256), " is corrupt"));
  return data;
}

absl::StatusOr<std::string> DiskBlobStore::ReadRange(std::string_view sha256, int64_t offset,
                                                     int64_t length) {
  if (!IsBlobKey(sha256))
    return absl::InvalidArgumentError("a blob key is 64 lowercase hex characters");
  if (offset < 0 || length < 0) return absl::InvalidArgumentError("negative offset or length");
  UniqueFd fd(::open(PathOf(sha256).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (!fd) {
    if (errno == ENOENT)
      return absl::NotFoundError(
          absl::StrCat("blob ", AbslView(sha256), " is not stored (collected)"));
    return absl::InternalError(absl::StrCat("blob ", AbslView(sha256), ": ", strerror(errno)));
  }
  auto read_at = [&](char* buf, size_t n, int64_t at) -> absl::StatusOr<size_t> {
    size_t done = 0;
    while (done < n) {
      ssize_t r = ::pread(fd.get(), buf + done, n - done, static_cast<off_t>(at + done));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0)
        return absl::InternalError(absl::StrCat("blob ", AbslView(sha256), ": ", strerror(errno)));
      if (r == 0) break;
      done += static_cast<size_t>(r);
    }
    return done;
  };
  if (offset == 0) {
    // The whole blob against its key, a piece at a time (never held whole).
    Sha256Stream hash;
    std::string buf(1 << 20, '\0');
    int64_t at = 0;
    for (;;) {
      absl::StatusOr<size_t> n = read_at(buf.data(), buf.size(), at);
      if (!n.ok()) return n.status();
      if (*n == 0) break;
      hash.Update(std::string_view(buf.data(), *n));
      at += static_cast<int64_t>(*n);
    }
    if (hash.HexDigest() != sha256)
      return absl::DataLossError(absl::StrCat("blob ", AbslView(sha256), " is corrupt"));
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0)
    return absl::InternalError(absl::StrCat("blob ", AbslView(sha256), ": ", strerror(errno)));
  const int64_t size = static_cast<int64_t>(st.st_size);
  if (offset >= size) return std::string();
  std::string out(static_cast<size_t>(std::min(length, size - offset)), '\0');
  absl::StatusOr<size_t> n = read_at(out.data(), out.size(), offset);
  if (!n.ok()) return n.status();
  out.resize(*n);
  return out;
}

absl::StatusOr<std::vector<DiskBlobStore::Entry>> DiskBlobStore::List() {
  std::vector<Entry> out;
  std::error_code ec;
  for (const auto& dir : fs::directory_iterator(options_.dir, ec)) {
    const std::string name = dir.path().filename().string();
    if (name.size() != 2 || !dir.is_directory()) continue;
    std::error_code ec2;
    for (const auto& f : fs::directory_iterator(dir.path(), ec2)) {
      const std::string key = f.path().filename().string();
      if (!IsBlobKey(key)) continue;
      struct stat st;
      if (::lstat(f.path().c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
      out.push_back(
          {key, static_cast<int64_t>(st.st_size),
           static_cast<int64_t>(st.st_mtim.tv_sec) * 1000 + st.st_mtim.tv_nsec / 1000000});
    }
  }
  if (ec)
    return absl::InternalError(
        absl::StrCat("blob store: cannot list ", options_.dir, ": ", ec.message()));
  return out;
}

absl::Status DiskBlobStore::Remove(std::string_view sha256) {
  if (!IsBlobKey(sha256)) return absl::InvalidArgumentError("bad blob key");
  const std::string path = PathOf(sha256);
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return absl::OkStatus();
  if (::unlink(path.c_str()) != 0 && errno != ENOENT)
    return absl::InternalError(absl::StrCat("unlink ", path, ": ", strerror(errno)));
  std::lock_guard<std::mutex> lock(mu_);
  total_ -= static_cast<int64_t>(st.st_size);
  return absl::OkStatus();
}

int64_t DiskBlobStore::total_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  return total_;
}

}  // namespace esb

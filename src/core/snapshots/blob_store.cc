#include "core/snapshots/blob_store.h"

#include <fcntl.h>
#include <stdio.h>
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

namespace {
constexpr size_t kTagHex = 32;  // a tenant's directory: the first 128 bits of SHA-256(tenant)

bool IsTag(std::string_view tag) {
  if (tag.size() != kTagHex) return false;
  for (char c : tag) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}
}  // namespace

bool IsBlobKey(std::string_view key) {
  if (key.size() != 64) return false;
  for (char c : key) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

DiskBlobStore::DiskBlobStore(DiskBlobStoreOptions options) : options_(std::move(options)) {
  tenant_cap_ = options_.max_tenant_bytes > 0
                    ? std::min(options_.max_tenant_bytes, options_.max_total_bytes)
                    : options_.max_total_bytes / 4;
}

DiskBlobStore::~DiskBlobStore() = default;

std::string DiskBlobStore::TenantTag(std::string_view tenant) {
  return Sha256Hex(tenant).substr(0, kTagHex);
}

absl::StatusOr<std::unique_ptr<DiskBlobStore>> DiskBlobStore::Open(DiskBlobStoreOptions options) {
  if (options.dir.empty()) return absl::InvalidArgumentError("blob store: empty directory");
  if (options.max_total_bytes < 1 || options.max_blob_bytes < 1 || options.max_tenant_bytes < 0)
    return absl::InvalidArgumentError("blob store: caps must be positive");
  std::error_code ec;
  fs::create_directories(options.dir + "/tmp", ec);
  if (!ec) fs::create_directories(options.dir + "/t", ec);
  if (ec)
    return absl::InternalError(
        absl::StrCat("blob store: cannot create ", options.dir, ": ", ec.message()));
  ::chmod(options.dir.c_str(), 0700);
  std::unique_ptr<DiskBlobStore> store(new DiskBlobStore(std::move(options)));
  // Temporary files of writes a crash interrupted are garbage; so are blobs of the layout
  // before tenant namespaces (<dir>/<2 hex>/: no step can name them any more).
  for (const auto& e : fs::directory_iterator(store->options_.dir + "/tmp", ec)) {
    std::error_code rm;
    fs::remove(e.path(), rm);
  }
  for (const auto& e : fs::directory_iterator(store->options_.dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() == 2 && e.is_directory()) {
      std::error_code rm;
      fs::remove_all(e.path(), rm);
      LogInfo(absl::StrCat("blob store: removed ", e.path().string(), " (old layout)"));
    }
  }
  for (const std::string& tag : store->TenantTags()) {
    auto all = store->List(tag);
    if (!all.ok()) return all.status();
    for (const Entry& e : *all) {
      store->total_ += e.size;
      store->tenant_total_[tag] += e.size;
    }
  }
  return store;
}

std::string DiskBlobStore::PathOf(const std::string& tag, std::string_view key) const {
  return absl::StrCat(options_.dir, "/t/", tag, "/", AbslView(key.substr(0, 2)), "/",
                      AbslView(key));
}

void DiskBlobStore::PinLocked(const std::string& pin) {
  ++pins_[pin];
  if (sweeping_) touched_.insert(pin);
}

DiskBlobStore::Tenant::~Tenant() {
  if (pinned_.empty()) return;
  std::lock_guard<std::mutex> lock(store_->mu_);
  for (const std::string& key : pinned_) {
    const std::string pin = absl::StrCat(tag_, "/", key);
    auto it = store_->pins_.find(pin);
    if (it != store_->pins_.end() && --it->second <= 0) store_->pins_.erase(it);
    // Released during a sweep: the step that references it may have been written after the
    // sweep read the steps.
    if (store_->sweeping_) store_->touched_.insert(pin);
  }
}

bool DiskBlobStore::Tenant::Pin(std::string_view sha256) {
  if (!IsBlobKey(sha256)) return false;
  if (!pinned_.count(std::string(sha256))) {
    std::lock_guard<std::mutex> lock(store_->mu_);
    store_->PinLocked(absl::StrCat(tag_, "/", AbslView(sha256)));
    pinned_.insert(std::string(sha256));
  }
  return Has(sha256);
}

absl::StatusOr<std::string> DiskBlobStore::Tenant::Put(std::string_view data) {
  const DiskBlobStoreOptions& o = store_->options_;
  const int64_t size = static_cast<int64_t>(data.size());
  if (size > o.max_blob_bytes)
    return absl::ResourceExhaustedError(absl::StrCat(
        "capture refused: a blob of ", size, " bytes is over the cap of ", o.max_blob_bytes));
  std::string key = Sha256Hex(data);
  // Pinned first: from here no sweep removes it, so "already stored" stays true.
  if (!Pin(key)) {
    {
      std::lock_guard<std::mutex> lock(store_->mu_);
      int64_t& mine = store_->tenant_total_[tag_];
      if (mine + size > store_->tenant_cap_)
        return absl::ResourceExhaustedError(
            absl::StrCat("capture refused: this tenant's share of the step store is full (", mine,
                         " of ", store_->tenant_cap_,
                         " bytes used; older steps are collected as retention frees "
                         "them)"));
      if (store_->total_ + size > o.max_total_bytes)
        return absl::ResourceExhaustedError(
            absl::StrCat("capture refused: the step store is full (", store_->total_, " of ",
                         o.max_total_bytes, " bytes)"));
      mine += size;  // reserved; given back when not written
      store_->total_ += size;
    }
    auto unreserve = [&] {
      std::lock_guard<std::mutex> lock(store_->mu_);
      store_->tenant_total_[tag_] -= size;
      store_->total_ -= size;
    };
    const std::string path = store_->PathOf(tag_, key);
    std::error_code ec;
    fs::create_directories(fs::path(path).parent_path(), ec);
    const std::string tmp = absl::StrCat(o.dir, "/tmp/", key, ".", RandomHex(6));
    absl::Status st = WriteStringToFile(tmp, data, 0600);
    if (st.ok() &&
        ::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, path.c_str(), RENAME_NOREPLACE) != 0) {
      if (errno == EEXIST) {
        // A concurrent Put of the same content got there first: it is charged once.
        ::unlink(tmp.c_str());
        unreserve();
        return key;
      }
      st = absl::InternalError(absl::StrCat("rename ", tmp, " -> ", path, ": ", strerror(errno)));
    }
    if (!st.ok()) {
      ::unlink(tmp.c_str());
      unreserve();
      return st;
    }
  }
  return key;
}

bool DiskBlobStore::Tenant::Has(std::string_view sha256) {
  if (!IsBlobKey(sha256)) return false;
  struct stat st;
  return ::stat(store_->PathOf(tag_, sha256).c_str(), &st) == 0;
}

absl::StatusOr<std::string> DiskBlobStore::Tenant::Get(std::string_view sha256) {
  if (!IsBlobKey(sha256))
    return absl::InvalidArgumentError("a blob key is 64 lowercase hex characters");
  std::string data;
  absl::Status st = ReadFileToString(store_->PathOf(tag_, sha256), &data);
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

absl::StatusOr<std::string> DiskBlobStore::Tenant::ReadRange(std::string_view sha256,
                                                             int64_t offset, int64_t length) {
  if (!IsBlobKey(sha256))
    return absl::InvalidArgumentError("a blob key is 64 lowercase hex characters");
  if (offset < 0 || length < 0) return absl::InvalidArgumentError("negative offset or length");
  UniqueFd fd(::open(store_->PathOf(tag_, sha256).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
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

std::vector<std::string> DiskBlobStore::TenantTags() {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& d : fs::directory_iterator(options_.dir + "/t", ec)) {
    std::string name = d.path().filename().string();
    if (IsTag(name) && d.is_directory()) out.push_back(std::move(name));
  }
  return out;
}

absl::StatusOr<std::vector<DiskBlobStore::Entry>> DiskBlobStore::List(const std::string& tag) {
  if (!IsTag(tag)) return absl::InvalidArgumentError("bad tenant tag");
  std::vector<Entry> out;
  std::error_code ec;
  const std::string root = absl::StrCat(options_.dir, "/t/", tag);
  for (const auto& dir : fs::directory_iterator(root, ec)) {
    const std::string name = dir.path().filename().string();
    if (name.size() != 2 || !dir.is_directory()) continue;
    std::error_code ec2;
    for (const auto& f : fs::directory_iterator(dir.path(), ec2)) {
      const std::string key = f.path().filename().string();
      if (!IsBlobKey(key)) continue;
      struct stat st;
      if (::lstat(f.path().c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
      out.push_back({key, static_cast<int64_t>(st.st_size)});
    }
    if (ec2)
      return absl::InternalError(
          absl::StrCat("blob store: cannot list ", dir.path().string(), ": ", ec2.message()));
  }
  if (ec && ec != std::errc::no_such_file_or_directory)
    return absl::InternalError(absl::StrCat("blob store: cannot list ", root, ": ", ec.message()));
  return out;
}

void DiskBlobStore::BeginSweep() {
  std::lock_guard<std::mutex> lock(mu_);
  sweeping_ = true;
  touched_.clear();
}

void DiskBlobStore::EndSweep() {
  std::lock_guard<std::mutex> lock(mu_);
  sweeping_ = false;
  touched_.clear();
}

int64_t DiskBlobStore::RemoveUnused(const std::string& tag, std::string_view sha256) {
  if (!IsTag(tag) || !IsBlobKey(sha256)) return 0;
  const std::string pin = absl::StrCat(tag, "/", AbslView(sha256));
  const std::string path = PathOf(tag, sha256);
  // Checked and unlinked under mu_, which a Put's pin takes: a Put either pinned it before
  // (kept) or pins it after it is gone (and writes it again).
  std::lock_guard<std::mutex> lock(mu_);
  if (pins_.count(pin) || touched_.count(pin)) return 0;
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return 0;
  if (::unlink(path.c_str()) != 0) return 0;
  const int64_t size = static_cast<int64_t>(st.st_size);
  total_ -= size;
  tenant_total_[tag] -= size;
  return size;
}

int64_t DiskBlobStore::total_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  return total_;
}

int64_t DiskBlobStore::tenant_bytes(std::string_view tenant) {
  const std::string tag = TenantTag(tenant);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tenant_total_.find(tag);
  return it == tenant_total_.end() ? 0 : it->second;
}

}  // namespace esb

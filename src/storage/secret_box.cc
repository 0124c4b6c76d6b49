#include "storage/secret_box.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/util.h"

namespace esb {
namespace {

constexpr size_t kNonceBytes = 12;
constexpr size_t kTagBytes = 16;

using CipherCtx = std::unique_ptr<EVP_CIPHER_CTX, decltype(&EVP_CIPHER_CTX_free)>;

std::string Hex(std::string_view bytes) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(kHex[c >> 4]);
    out.push_back(kHex[c & 0xf]);
  }
  return out;
}

bool Unhex(std::string_view hex, std::string* out) {
  if (hex.size() % 2 != 0) return false;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  out->clear();
  out->reserve(hex.size() / 2);
  for (size_t i = 0; i < hex.size(); i += 2) {
    int hi = nibble(hex[i]), lo = nibble(hex[i + 1]);
    if (hi < 0 || lo < 0) return false;
    out->push_back(static_cast<char>(hi << 4 | lo));
  }
  return true;
}

const unsigned char* U(std::string_view s) {
  return reinterpret_cast<const unsigned char*>(s.data());
}

}  // namespace

absl::StatusOr<std::string> LoadOrCreateSecretKey(const std::string& path, bool create) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0 && errno == ENOENT && create) {
    std::string key(kSecretKeyBytes, '\0');
    if (RAND_bytes(reinterpret_cast<unsigned char*>(key.data()), static_cast<int>(key.size())) !=
        1) {
      return absl::InternalError("state key: RAND_bytes failed");
    }
    // O_EXCL: two starts racing do not both write a key.
    int w = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (w < 0) return ErrnoStatus(absl::StrCat("state key: create ", path));
    bool ok =
        ::write(w, key.data(), key.size()) == static_cast<ssize_t>(key.size()) && ::fsync(w) == 0;
    ::close(w);
    if (!ok) {
      ::unlink(path.c_str());
      return absl::InternalError(absl::StrCat("state key: cannot write ", path));
    }
    return key;
  }
  if (fd < 0) return ErrnoStatus(absl::StrCat("state key: open ", path));
  UniqueFd owned(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0) return ErrnoStatus(absl::StrCat("state key: stat ", path));
  if (!S_ISREG(st.st_mode) || (st.st_mode & 077) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "state key ", path, " must be a regular file readable by its owner only (chmod 600)"));
  }
  std::string key(kSecretKeyBytes + 1, '\0');
  ssize_t n = ::read(fd, key.data(), key.size());
  if (n != static_cast<ssize_t>(kSecretKeyBytes)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "state key ", path, " must hold exactly ", kSecretKeyBytes, " bytes (it has ",
        n < 0 ? std::string("an unreadable size") : std::to_string(n) + " or more", ")"));
  }
  key.resize(kSecretKeyBytes);
  return key;
}

bool IsSealed(std::string_view stored) { return stored.starts_with(kSealedPrefix); }

absl::StatusOr<std::string> SealSecret(std::string_view key, std::string_view aad,
                                       std::string_view plaintext) {
  if (key.size() != kSecretKeyBytes) return absl::InvalidArgumentError("seal: bad key size");
  std::string nonce(kNonceBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), kNonceBytes) != 1) {
    return absl::InternalError("seal: RAND_bytes failed");
  }
  CipherCtx ctx(EVP_CIPHER_CTX_new(), &EVP_CIPHER_CTX_free);
  std::string out = nonce;
  out.resize(kNonceBytes + plaintext.size() + kTagBytes);
  auto* dst = reinterpret_cast<unsigned char*>(out.data()) + kNonceBytes;
  int len = 0, total = 0;
  if (!ctx || EVP_EncryptInit_ex(ctx.get(), EVP_aes_256_gcm(), nullptr, U(key), U(nonce)) != 1 ||
      EVP_EncryptUpdate(ctx.get(), nullptr, &len, U(aad), static_cast<int>(aad.size())) != 1 ||
      EVP_EncryptUpdate(ctx.get(), dst, &len, U(plaintext), static_cast<int>(plaintext.size())) !=
          1) {
    return absl::InternalError("seal: AES-256-GCM failed");
  }
  total = len;
  if (EVP_EncryptFinal_ex(ctx.get(), dst + total, &len) != 1 ||
      EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_GET_TAG, kTagBytes, dst + plaintext.size()) !=
          1) {
    return absl::InternalError("seal: AES-256-GCM failed");
  }
  return std::string(kSealedPrefix) + Hex(out);
}

absl::StatusOr<std::string> OpenSecret(std::string_view key, std::string_view aad,
                                       std::string_view stored) {
  if (key.size() != kSecretKeyBytes) return absl::InvalidArgumentError("open: bad key size");
  std::string raw;
  if (!IsSealed(stored) || !Unhex(stored.substr(kSealedPrefix.size()), &raw) ||
      raw.size() < kNonceBytes + kTagBytes) {
    return absl::InvalidArgumentError("sealed value is malformed");
  }
  std::string_view nonce(raw.data(), kNonceBytes);
  std::string_view body(raw.data() + kNonceBytes, raw.size() - kNonceBytes - kTagBytes);
  std::string tag = raw.substr(raw.size() - kTagBytes);
  std::string plain(body.size(), '\0');
  CipherCtx ctx(EVP_CIPHER_CTX_new(), &EVP_CIPHER_CTX_free);
  int len = 0;
  if (!ctx || EVP_DecryptInit_ex(ctx.get(), EVP_aes_256_gcm(), nullptr, U(key), U(nonce)) != 1 ||
      EVP_DecryptUpdate(ctx.get(), nullptr, &len, U(aad), static_cast<int>(aad.size())) != 1 ||
      EVP_DecryptUpdate(ctx.get(), reinterpret_cast<unsigned char*>(plain.data()), &len, U(body),
                        static_cast<int>(body.size())) != 1 ||
      EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_SET_TAG, kTagBytes, tag.data()) != 1) {
    return absl::InternalError("open: AES-256-GCM failed");
  }
  int final_len = 0;
  if (EVP_DecryptFinal_ex(ctx.get(), reinterpret_cast<unsigned char*>(plain.data()) + len,
                          &final_len) != 1) {
    return absl::FailedPreconditionError(
        "the sealed value does not open with this key (the state key file was replaced, or "
        "the value was moved from another row)");
  }
  return plain;
}

}  // namespace esb

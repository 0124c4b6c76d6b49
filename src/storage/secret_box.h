// At-rest encryption of the secrets the state database holds (today: each governed
// environment's CA private key, env_egress.ca_key_pem). AES-256-GCM (OpenSSL EVP) with a random
// 96-bit nonce per value and the row's id as associated data (a sealed value moved to another
// row does not open). Stored form: "v1:" + hex(nonce || ciphertext || tag); a value without the
// prefix is a plaintext row from before encryption (Store::Open re-encrypts those).
//
// The key: 32 random bytes in an owner-only file (StoreOptions::secret_key_file; esbd's default
// is <state_dir>/state.key), created on first start. Losing it loses the sealed values (a
// governed environment's CA would have to be re-created); a backup of the database is useless
// without it, which is the point.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace esb {

inline constexpr size_t kSecretKeyBytes = 32;
inline constexpr std::string_view kSealedPrefix = "v1:";

// Reads the key at `path`; creates it (0600, random) when it does not exist and `create` is
// true. Errors name the file: missing, not exactly 32 bytes, group/other-accessible.
absl::StatusOr<std::string> LoadOrCreateSecretKey(const std::string& path, bool create);

bool IsSealed(std::string_view stored);
// Seals `plaintext` for row `aad` with `key` (32 bytes).
absl::StatusOr<std::string> SealSecret(std::string_view key, std::string_view aad,
                                       std::string_view plaintext);
// Opens a value sealed by SealSecret. FailedPrecondition when the key or the row does not match
// (a replaced key file), InvalidArgument when the value is malformed.
absl::StatusOr<std::string> OpenSecret(std::string_view key, std::string_view aad,
                                       std::string_view stored);

}  // namespace esb

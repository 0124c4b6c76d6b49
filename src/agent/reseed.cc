#include "agent/reseed.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/random.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "agent/util.h"

namespace esb::agent {
namespace {

ReseedStep Step(const char* name, const char* status, int err = 0) {
  ReseedStep s;
  s.name = name;
  s.status = status;
  if (err) {
    s.detail = strerror(err);
    s.errno_name = ErrnoName(err);
  }
  return s;
}

}  // namespace

void Reseeder::AddHook(std::string name, Hook hook) {
  std::lock_guard<std::mutex> lock(mu_);
  hooks_.emplace_back(std::move(name), std::move(hook));
}

ReseedResult Reseeder::Reseed(std::string_view host_bytes) {
  ReseedResult result;
  if (host_bytes.size() < kMinBytes || host_bytes.size() > kMaxBytes) {
    result.error = "reseed needs 16 to 4096 bytes of host randomness";
    result.errno_name = "EINVAL";
    return result;
  }
  std::lock_guard<std::mutex> lock(mu_);
  Fd dev(open(device_.c_str(), O_WRONLY | O_CLOEXEC | O_NOCTTY));
  if (!dev) {
    int err = errno;
    result.error = "open " + device_ + ": " + strerror(err);
    result.errno_name = ErrnoName(err);
    return result;
  }

  // struct rand_pool_info ends in a flexible array of u32.
  const size_t words = (host_bytes.size() + 3) / 4;
  std::vector<uint32_t> storage(2 + words, 0);
  auto* info = reinterpret_cast<rand_pool_info*>(storage.data());
  info->entropy_count = static_cast<int>(host_bytes.size() * 8);  // the host's CSPRNG: full
  info->buf_size = static_cast<int>(host_bytes.size());
  std::memcpy(info->buf, host_bytes.data(), host_bytes.size());
  // SECURITY: RNDADDENTROPY only adds (and credits) bytes to the pool; it cannot read or
  // replace the pool's state. Needs CAP_SYS_ADMIN (the sandbox's user normally lacks it).
  if (ioctl(dev.get(), RNDADDENTROPY, info) == 0) {
    result.ok = true;
    result.kernel.push_back(Step("RNDADDENTROPY", "ok"));
    result.kernel.push_back(Step("write /dev/urandom", "skipped"));
    result.kernel.back().detail = "RNDADDENTROPY worked";
  } else {
    result.kernel.push_back(Step("RNDADDENTROPY", "failed", errno));
    // Mixes the bytes in without crediting entropy; permitted to everyone.
    if (WriteAll(dev.get(), host_bytes)) {
      result.ok = true;
      result.kernel.push_back(Step("write /dev/urandom", "ok"));
    } else {
      int err = errno;
      result.kernel.push_back(Step("write /dev/urandom", "failed", err));
      result.error = "the kernel pool took none of the bytes: " + std::string(strerror(err));
      result.errno_name = ErrnoName(err);
    }
  }
  std::memset(storage.data(), 0, storage.size() * sizeof storage[0]);
  if (result.ok) {
    // SECURITY: RNDRESEEDCRNG makes the CRNG reseed from the pool now; no data is passed.
    if (ioctl(dev.get(), RNDRESEEDCRNG) == 0) {
      result.kernel.push_back(Step("RNDRESEEDCRNG", "ok"));
    } else {
      result.kernel.push_back(Step("RNDRESEEDCRNG", "failed", errno));
    }
  } else {
    result.kernel.push_back(Step("RNDRESEEDCRNG", "skipped"));
    result.kernel.back().detail = "no bytes reached the pool";
  }

  for (const auto& [name, hook] : hooks_) {
    ReseedStep step;
    step.name = name;
    bool ok = hook(&step.detail);
    step.status = ok ? "ok" : "failed";
    result.hooks.push_back(std::move(step));
  }
  return result;
}

}  // namespace esb::agent

#include "governance/proxy/quota.h"

#include <algorithm>

namespace esb::governance::proxy {

// ---- Quota

Quota::Reservation& Quota::Reservation::operator=(Reservation&& o) noexcept {
  if (this != &o) {
    Release();
    budget_ = o.budget_;
    key_ = std::move(o.key_);
    bytes_ = o.bytes_;
    o.budget_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

bool Quota::Reservation::GrowTo(int64_t bytes) {
  if (budget_ == nullptr) return false;
  if (bytes <= bytes_) return true;
  if (!budget_->Take(key_, bytes - bytes_)) return false;
  bytes_ = bytes;
  return true;
}

void Quota::Reservation::Release() {
  if (budget_ != nullptr && bytes_ > 0) budget_->Give(key_, bytes_);
  bytes_ = 0;
}

Quota::Reservation Quota::Open(std::string key) {
  Reservation r;
  r.budget_ = this;
  r.key_ = std::move(key);
  return r;
}

int64_t Quota::used() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_;
}

int64_t Quota::used(std::string_view key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_key_.find(key);
  return it == by_key_.end() ? 0 : it->second;
}

bool Quota::Take(const std::string& key, int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_key_.find(key);
  int64_t mine = it == by_key_.end() ? 0 : it->second;
  if (n > total_ - used_ || n > per_key_ - mine) return false;
  used_ += n;
  if (it == by_key_.end()) {
    by_key_.emplace(key, n);
  } else {
    it->second += n;
  }
  return true;
}

void Quota::Give(const std::string& key, int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  used_ -= n;
  auto it = by_key_.find(key);
  if (it == by_key_.end()) return;
  it->second -= n;
  if (it->second <= 0) by_key_.erase(it);
}

// ---- FairPool

FairPool::FairPool(Options options) : options_(options) {
  int n = std::max(1, options_.threads);
  for (int i = 0; i < n; ++i) threads_.emplace_back([this] { Work(); });
}

FairPool::~FairPool() { Shutdown(); }

bool FairPool::Submit(std::string key, std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return false;
    Key& k = keys_[key];
    if (k.queue.size() >= options_.max_queued_per_key) {
      if (k.queue.empty() && k.running == 0) keys_.erase(key);
      return false;
    }
    if (k.queue.empty()) order_.push_back(key);
    k.queue.push_back(std::move(job));
  }
  cv_.notify_one();
  return true;
}

void FairPool::Shutdown() {
  std::deque<std::function<void()>> dropped;  // destroyed outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && threads_.empty()) return;
    stopping_ = true;
    for (auto& [key, k] : keys_) {
      for (auto& job : k.queue) dropped.push_back(std::move(job));
      k.queue.clear();
    }
    order_.clear();
  }
  cv_.notify_all();
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
  threads_.clear();
}

void FairPool::Work() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    // The first key in round-robin order that is under its running cap.
    auto pick = order_.end();
    cv_.wait(lock, [&] {
      if (stopping_) return true;
      pick = std::find_if(order_.begin(), order_.end(), [&](const std::string& key) {
        return keys_[key].running < options_.max_running_per_key;
      });
      return pick != order_.end();
    });
    if (stopping_) return;
    std::string key = std::move(*pick);
    order_.erase(pick);
    Key& k = keys_[key];
    std::function<void()> job = std::move(k.queue.front());
    k.queue.pop_front();
    if (!k.queue.empty()) order_.push_back(key);  // its next job waits behind the others
    ++k.running;
    lock.unlock();
    job();
    job = nullptr;
    lock.lock();
    auto it = keys_.find(key);
    if (--it->second.running == 0 && it->second.queue.empty()) keys_.erase(it);
    cv_.notify_all();  // a key under its cap again, or a key that is now idle
  }
}

}  // namespace esb::governance::proxy

// Fairness primitives of the one shared esb-proxy (docs/design.md "Egress proxy", "Fair shares
// between tenants"): every tenant's environments share its memory, its DLP CPU and its resolver
// threads, so each of those is split into a global limit and a per-tenant share.
//   Quota       units (bytes of buffered request bodies, connections, lookups in flight) under a
//               global limit and a per-key (tenant, environment) share; a Reservation grows as
//               a body arrives and gives everything back when destroyed.
//   FairPool    worker threads for blocking or CPU-heavy jobs (DLP body scans, getaddrinfo):
//               per-key FIFO queues served round-robin, a cap on one key's running jobs (one
//               tenant never holds every thread) and a bound on its queue (over it: refused).
//   RunInPool   awaits a FairPool job from a coroutine without blocking its I/O thread.
#pragma once

#include <boost/asio/awaitable.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace esb::governance::proxy {

class Quota {
 public:
  Quota(int64_t total, int64_t per_key) : total_(total), per_key_(per_key) {}
  Quota(const Quota&) = delete;
  Quota& operator=(const Quota&) = delete;

  // A held share of the budget. Movable; gives its bytes back on Release or destruction (so a
  // reservation in a coroutine frame is released on every path: completion, error, the client
  // going away, a timeout, Detach, Stop). The budget must outlive it.
  class Reservation {
   public:
    Reservation() = default;
    Reservation(Reservation&& o) noexcept { *this = std::move(o); }
    Reservation& operator=(Reservation&& o) noexcept;
    ~Reservation() { Release(); }
    // Grows the reservation to `bytes` in total (nothing to do when it already holds that
    // much). False: that would exceed the key's share or the global limit; it keeps what it had.
    bool GrowTo(int64_t bytes);
    void Release();
    int64_t bytes() const { return bytes_; }

   private:
    friend class Quota;
    Quota* budget_ = nullptr;
    std::string key_;
    int64_t bytes_ = 0;
  };

  // An empty reservation for `key`.
  Reservation Open(std::string key);
  int64_t used() const;
  int64_t used(std::string_view key) const;
  int64_t total() const { return total_; }
  int64_t per_key() const { return per_key_; }

 private:
  bool Take(const std::string& key, int64_t n);
  void Give(const std::string& key, int64_t n);

  const int64_t total_;
  const int64_t per_key_;
  mutable std::mutex mu_;
  int64_t used_ = 0;                                    // guarded by mu_
  std::map<std::string, int64_t, std::less<>> by_key_;  // guarded by mu_ (no zero entries)
};

class FairPool {
 public:
  struct Options {
    int threads = 2;
    int max_running_per_key = 1;     // one key's jobs on the threads at once
    size_t max_queued_per_key = 64;  // one key's jobs waiting (running ones not counted)
  };
  explicit FairPool(Options options);
  ~FairPool();  // Shutdown()
  FairPool(const FairPool&) = delete;
  FairPool& operator=(const FairPool&) = delete;

  // Queues `job` under `key`. False (not queued) when the key's queue is full or the pool is
  // shut down. Jobs must not throw.
  bool Submit(std::string key, std::function<void()> job);
  // Runs no more queued jobs (they are destroyed unrun) and joins the threads (a running job
  // finishes first). Idempotent.
  void Shutdown();

 private:
  struct Key {
    std::deque<std::function<void()>> queue;
    int running = 0;
  };
  void Work();

  const Options options_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Key, std::less<>> keys_;  // guarded by mu_ (idle keys erased)
  std::list<std::string> order_;  // keys with queued jobs, round-robin order; guarded by mu_
  bool stopping_ = false;         // guarded by mu_
  std::vector<std::thread> threads_;
};

// Runs `job` on `pool` under `key` and resumes the calling coroutine (on its own executor)
// once it ran. False at once when the pool refused it (the key's queue is full). The job may
// reference the caller's frame: the caller stays suspended until it finished.
inline boost::asio::awaitable<bool> RunInPool(FairPool& pool, std::string key,
                                              std::function<void()> job) {
  namespace asio = boost::asio;
  struct Done {
    explicit Done(asio::any_io_executor ex) : timer(ex) {}
    asio::steady_timer timer;
    bool done = false;  // touched only on the caller's executor
  };
  // (co_await results are named locals, never arguments: GCC 12 miscompiles those.)
  asio::any_io_executor ex = co_await asio::this_coro::executor;
  auto state = std::make_shared<Done>(ex);
  state->timer.expires_at(asio::steady_timer::time_point::max());
  bool queued = pool.Submit(std::move(key), [state, job = std::move(job)] {
    job();
    asio::post(state->timer.get_executor(), [state] {
      state->done = true;
      state->timer.cancel();
    });
  });
  if (!queued) co_return false;
  while (!state->done) {
    boost::system::error_code ec;
    co_await state->timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
  }
  co_return true;
}

}  // namespace esb::governance::proxy

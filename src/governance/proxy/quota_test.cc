// The proxy's fair-share primitives (governance/proxy/quota.h).
#include "governance/proxy/quota.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace esb::governance::proxy {
namespace {

TEST(QuotaTest, PerKeyShareAndGlobalLimitAndReleaseOnDestruction) {
  Quota q(/*total=*/100, /*per_key=*/60);
  Quota::Reservation a = q.Open("a");
  EXPECT_TRUE(a.GrowTo(50));
  EXPECT_FALSE(a.GrowTo(61));  // over a's share: keeps what it had
  EXPECT_EQ(a.bytes(), 50);
  EXPECT_TRUE(a.GrowTo(60));
  {
    Quota::Reservation b = q.Open("b");
    EXPECT_FALSE(b.GrowTo(41));  // over the global limit
    EXPECT_TRUE(b.GrowTo(40));
    EXPECT_EQ(q.used(), 100);
    EXPECT_EQ(q.used("b"), 40);
    Quota::Reservation moved = std::move(b);  // moved: released once, by `moved`
    EXPECT_EQ(q.used("b"), 40);
  }
  EXPECT_EQ(q.used("b"), 0);
  EXPECT_EQ(q.used(), 60);
  a.Release();
  EXPECT_EQ(q.used(), 0);
  EXPECT_EQ(q.used("a"), 0);
  Quota::Reservation unbound;  // never opened: nothing to grow
  EXPECT_FALSE(unbound.GrowTo(1));
}

// Blocks jobs until released, recording which keys ran and how many ran at once per key.
class Gate {
 public:
  std::function<void()> Job(std::string key) {
    return [this, key] {
      std::unique_lock<std::mutex> lock(mu_);
      started_.push_back(key);
      int now = ++running_[key];
      max_running_[key] = std::max(max_running_[key], now);
      cv_.notify_all();
      cv_.wait(lock, [&] { return open_; });
      --running_[key];
    };
  }
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  bool WaitStarted(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(5), [&] { return started_.size() >= n; });
  }
  std::vector<std::string> started() {
    std::lock_guard<std::mutex> lock(mu_);
    return started_;
  }
  int max_running(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    return max_running_[key];
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
  std::vector<std::string> started_;
  std::map<std::string, int> running_, max_running_;
};

TEST(FairPoolTest, OneKeyFloodingHoldsAtMostItsCapAndAnotherKeyRunsAtOnce) {
  FairPool pool({/*threads=*/3, /*max_running_per_key=*/1, /*max_queued_per_key=*/4});
  Gate gate;
  // Key "a" floods: one runs, four wait, the rest are refused at once.
  int accepted = 0, refused = 0;
  for (int i = 0; i < 10; ++i) (pool.Submit("a", gate.Job("a")) ? accepted : refused)++;
  ASSERT_TRUE(gate.WaitStarted(1));
  EXPECT_GE(refused, 5);
  EXPECT_LE(accepted, 5);
  // "b" gets a thread although a's queue is full.
  ASSERT_TRUE(pool.Submit("b", gate.Job("b")));
  ASSERT_TRUE(gate.WaitStarted(2));
  EXPECT_EQ(gate.started()[1], "b");
  gate.Open();
  pool.Shutdown();
  EXPECT_EQ(gate.max_running("a"), 1);
}

TEST(FairPoolTest, QueuedKeysAreServedRoundRobin) {
  FairPool pool({/*threads=*/1, /*max_running_per_key=*/1, /*max_queued_per_key=*/16});
  Gate blocker;
  ASSERT_TRUE(pool.Submit("x", blocker.Job("x")));  // holds the one thread
  ASSERT_TRUE(blocker.WaitStarted(1));
  std::mutex mu;
  std::vector<std::string> order;
  auto record = [&](std::string k) {
    return [&, k] {
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(k);
    };
  };
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(pool.Submit("a", record("a")));
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(pool.Submit("b", record("b")));
  blocker.Open();
  for (int i = 0; i < 200; ++i) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (order.size() == 6) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(order, (std::vector<std::string>{"a", "b", "a", "b", "a", "b"}));
}

TEST(FairPoolTest, ShutdownDropsQueuedJobsAndRefusesNewOnes) {
  FairPool pool({1, 1, 8});
  Gate gate;
  std::atomic<int> ran{0};
  ASSERT_TRUE(pool.Submit("a", gate.Job("a")));
  ASSERT_TRUE(gate.WaitStarted(1));
  ASSERT_TRUE(pool.Submit("a", [&] { ++ran; }));
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    gate.Open();
  });
  pool.Shutdown();  // waits for the running job; the queued one never runs
  opener.join();
  EXPECT_EQ(ran.load(), 0);
  EXPECT_FALSE(pool.Submit("a", [] {}));
}

}  // namespace
}  // namespace esb::governance::proxy

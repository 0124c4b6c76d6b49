// WorkerPool (internal.h): handler threads with small stacks, created on demand, bounded.
#include <pthread.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>

#include "api/http/internal.h"

namespace esb::api::http_internal {

struct WorkerPool::State {
  int max_threads;
  size_t stack_bytes;
  std::chrono::milliseconds idle_timeout;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> tasks;
  int threads = 0;
  int idle = 0;
};

namespace {
// Idle threads kept for the whole idle timeout; more than that exit after 250 ms.
constexpr int kSpareThreads = 8;
}  // namespace

WorkerPool::WorkerPool(int max_threads, size_t stack_bytes, std::chrono::milliseconds idle_timeout)
    : state_(std::make_shared<State>()) {
  state_->max_threads = max_threads < 1 ? 1 : max_threads;
  state_->stack_bytes = stack_bytes;
  state_->idle_timeout = idle_timeout;
}

WorkerPool::~WorkerPool() {
  // Idle threads exit at once; busy ones when their task ends (they hold the State).
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->idle_timeout = std::chrono::milliseconds(0);
  state_->cv.notify_all();
}

int WorkerPool::threads() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->threads;
}

bool WorkerPool::Submit(std::function<void()> task) {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mu);
  s.tasks.push_back(std::move(task));
  if (s.idle > static_cast<int>(s.tasks.size()) - 1) {
    s.cv.notify_one();
    return true;
  }
  if (s.threads >= s.max_threads) return true;  // a busy thread takes it when done
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  if (s.stack_bytes > 0) pthread_attr_setstacksize(&attr, s.stack_bytes);
  auto* arg = new std::shared_ptr<State>(state_);
  pthread_t tid;
  int rc = pthread_create(&tid, &attr, &WorkerPool::ThreadMain, arg);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    delete arg;
    s.tasks.pop_back();  // no thread for it now: the caller answers 503
    return false;
  }
  ++s.threads;
  return true;
}

void* WorkerPool::ThreadMain(void* arg) {
  std::shared_ptr<State> state = std::move(*static_cast<std::shared_ptr<State>*>(arg));
  delete static_cast<std::shared_ptr<State>*>(arg);
  State& s = *state;
  std::unique_lock<std::mutex> lock(s.mu);
  for (;;) {
    if (s.tasks.empty()) {
      ++s.idle;
      // A few spare threads wait the whole idle timeout; the rest of a burst's threads exit
      // soon after it (so an attack's burst leaves no threads behind).
      const auto wait = s.idle >= kSpareThreads
                            ? std::min(s.idle_timeout, std::chrono::milliseconds(250))
                            : s.idle_timeout;
      bool woke = s.cv.wait_for(lock, wait, [&] { return !s.tasks.empty(); });
      --s.idle;
      if (!woke) break;
    }
    std::function<void()> task = std::move(s.tasks.front());
    s.tasks.pop_front();
    lock.unlock();
    task();
    task = nullptr;  // whatever the task holds is released outside the lock
    lock.lock();
  }
  --s.threads;
  return nullptr;
}

}  // namespace esb::api::http_internal

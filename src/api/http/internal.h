// Internals shared by the files of the HTTP server (src/api/http/); not part of its API.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>

namespace esb::api::http_internal {

// Best-effort check, without reading, whether the peer closed its side of `fd` (FIN or RST).
bool PeerHasClosed(int fd);

// A bounded pool of worker threads for handlers: threads are created on demand up to
// `max_threads`, with `stack_bytes` stacks; 8 idle ones wait up to `idle_timeout` for work,
// any more exit after 250 ms. Tasks
// beyond the cap wait in a queue (the server admits at most max_threads requests at once, so it
// stays short). Thread-safe. The pool must outlive its threads: keep it in a shared_ptr that
// tasks capture, or call Shutdown() and wait.
class WorkerPool {
 public:
  WorkerPool(int max_threads, size_t stack_bytes, std::chrono::milliseconds idle_timeout);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Queues `task`; false if no thread could be started and none is idle (out of memory or
  // threads): the caller answers 503.
  bool Submit(std::function<void()> task);
  // Threads alive (busy or idle).
  int threads() const;

 private:
  struct State;
  static void* ThreadMain(void* arg);
  std::shared_ptr<State> state_;
};

}  // namespace esb::api::http_internal

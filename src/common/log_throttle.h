// Standard library only: the static agent uses it too.
#pragma once

#include <atomic>
#include <cstdint>

namespace esb {

// Thins out a warning that anyone can trigger repeatedly (one per connection, per request, ...)
// so that it cannot grow the log at the rate of its cause: Hit() counts an occurrence and
// returns the count for the 1st, 2nd, 4th, 8th, ... occurrence (log it, with the count), 0 for
// the others (skip). Thread-safe; typically a function-local or member static per kind.
class LogThrottle {
 public:
  uint64_t Hit() {
    uint64_t n = count_.fetch_add(1, std::memory_order_relaxed) + 1;
    return (n & (n - 1)) == 0 ? n : 0;
  }

 private:
  std::atomic<uint64_t> count_{0};
};

}  // namespace esb

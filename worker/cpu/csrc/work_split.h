// Splitting a kernel's items (panel pairs, attention rows) over ATen's threads.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace raydecode {

// Each thread owns a contiguous run of the items and takes them from its front, in
// order (what a kernel prefetches for: its next item); a thread whose run is done takes
// the others' from their backs. With a static split a thread the OS preempts (inside a
// Ray actor: the raylet's, GCS's and the actor's own service threads wake often on two
// cores) holds back the whole call while the other waits at the barrier; here the other
// takes over what the preempted one had not started. Measured in a Ray actor, the
// larger panel calls got faster and the small ones stayed as they were.
//
// A run is one 64-bit word, front in the low half and back in the high half, so taking
// from either end is one compare-and-swap and no item is taken twice.
class StealingSplit {
 public:
  // Items [0, items), thread t owning [items * t / threads, items * (t + 1) / threads).
  StealingSplit(int64_t items, int64_t threads) : StealingSplit(even_bounds(items, threads)) {}

  // Thread t owning items [bounds[t], bounds[t + 1]) (bounds ascending, from 0).
  explicit StealingSplit(const std::vector<int64_t>& bounds)
      : threads_(std::max<int64_t>(1, static_cast<int64_t>(bounds.size()) - 1)),
        runs_(new std::atomic<uint64_t>[static_cast<size_t>(threads_)]) {
    TORCH_CHECK(bounds.size() >= 2 && bounds.front() == 0 && bounds.back() < (int64_t(1) << 32),
                "StealingSplit: runs must start at 0 and fit a 32-bit index");
    for (int64_t t = 0; t < threads_; ++t) {
      TORCH_CHECK(bounds[t] <= bounds[t + 1], "StealingSplit: runs must not overlap");
      runs_[t].store(static_cast<uint64_t>(bounds[t]) | (static_cast<uint64_t>(bounds[t + 1]) << 32),
                     std::memory_order_relaxed);
    }
  }

  int64_t threads() const { return threads_; }

  // f(item, thread) for every item once, `thread` the run of the thread taking it (its
  // own, or one whose run is done: per-thread buffers stay per thread), on ATen's threads.
  template <typename F>
  void run(F&& f) {
    at::parallel_for(0, threads_, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t item; (item = take(t, /*front=*/true)) >= 0;) f(item, t);
        for (int64_t o = 1; o < threads_; ++o)
          for (int64_t item; (item = take((t + o) % threads_, /*front=*/false)) >= 0;) f(item, t);
      }
    });
  }

 private:
  static std::vector<int64_t> even_bounds(int64_t items, int64_t threads) {
    const int64_t n = std::max<int64_t>(1, std::min<int64_t>(threads, items));
    std::vector<int64_t> bounds(n + 1);
    for (int64_t t = 0; t <= n; ++t) bounds[t] = items * t / n;
    return bounds;
  }

  // The front or back item of thread t's run (-1 when it is empty).
  int64_t take(int64_t t, bool front) {
    std::atomic<uint64_t>& run = runs_[t];
    uint64_t r = run.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t lo = r & 0xffffffffu, hi = r >> 32;
      if (lo >= hi) return -1;
      const uint64_t next = front ? r + 1 : r - (uint64_t(1) << 32);
      if (run.compare_exchange_weak(r, next, std::memory_order_relaxed))
        return static_cast<int64_t>(front ? lo : hi - 1);
    }
  }

  int64_t threads_;
  std::unique_ptr<std::atomic<uint64_t>[]> runs_;
};

}  // namespace raydecode

// RowPool: a fixed set of owned threads that run the parallel part of logits-row verification and
// sampling. Built for short, frequent bursts: idle threads spin briefly before sleeping, so a burst
// that follows another one starts within microseconds.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace bulkhead {

class RowPool {
 public:
  // `threads` is the parallelism of parallelFor, the calling thread included: the pool owns
  // threads - 1 helpers. 0 means std::thread::hardware_concurrency().
  explicit RowPool(unsigned threads = 0);
  ~RowPool();  // wakes and joins every helper
  RowPool(const RowPool&) = delete;
  RowPool& operator=(const RowPool&) = delete;

  unsigned threads() const { return unsigned(helpers_.size()) + 1; }

  // Runs fn(0) .. fn(n - 1), each exactly once, on the helpers and the calling thread; returns
  // when all have finished. One caller at a time: parallelFor is not reentrant and must not be
  // called from inside fn, nor from two threads at once. fn must not throw. n < 2^32.
  void parallelFor(size_t n, const std::function<void(size_t)>& fn);

 private:
  void helperLoop();
  // Claims and runs indices of the current burst until none is left; returns the state in which
  // it found nothing left to claim.
  uint64_t drain();

  // The burst: (generation << 32) | next index. Claiming an index is a compare-exchange that
  // also checks the generation, so a helper that wakes late can never take an index of a burst
  // it did not read `count_` and `fn_` for.
  std::atomic<uint64_t> state_{0};
  std::atomic<uint32_t> count_{0};
  std::atomic<const std::function<void(size_t)>*> fn_{nullptr};
  std::atomic<size_t> unfinished_{0};
  uint64_t generation_ = 0;  // caller only

  std::mutex mu_;
  std::condition_variable wake_;
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::vector<std::thread> helpers_;
};

}  // namespace bulkhead

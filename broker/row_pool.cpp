// RowPool implementation: a generation-tagged index counter, spin-then-sleep helpers.
#include "broker/row_pool.h"

#include <immintrin.h>

#include <algorithm>

namespace bulkhead {
namespace {

// About 50-100 µs of pause instructions: long enough that back-to-back bursts never sleep, short
// enough that an idle pool stops burning cores quickly.
constexpr int kSpinIterations = 1 << 12;

}  // namespace

RowPool::RowPool(unsigned threads) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  helpers_.reserve(threads - 1);
  for (unsigned i = 1; i < threads; ++i) helpers_.emplace_back([this] { helperLoop(); });
}

RowPool::~RowPool() {
  {
    std::lock_guard lock(mu_);
    stop_.store(true);
  }
  wake_.notify_all();
  for (std::thread& t : helpers_) t.join();
}

uint64_t RowPool::drain() {
  uint64_t s = state_.load(std::memory_order_acquire);
  while (true) {
    // count_ read after the acquire load of `s` belongs to the burst of `s` or a later one; the
    // compare-exchange below only succeeds if the burst of `s` is still current, and then it
    // cannot have finished (this index is not done), so count_ and fn_ are that burst's.
    const uint32_t index = uint32_t(s);
    if (index >= count_.load(std::memory_order_relaxed)) return s;
    if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel,
                                      std::memory_order_acquire))
      continue;
    (*fn_.load(std::memory_order_relaxed))(index);
    unfinished_.fetch_sub(1, std::memory_order_release);
    s = state_.load(std::memory_order_acquire);
  }
}

void RowPool::helperLoop() {
  uint64_t seen = state_.load(std::memory_order_acquire);
  while (true) {
    int spins = 0;
    uint64_t now;
    while ((now = state_.load(std::memory_order_acquire)) == seen && spins < kSpinIterations &&
           !stop_.load(std::memory_order_relaxed)) {
      _mm_pause();
      ++spins;
    }
    if (now == seen) {
      std::unique_lock lock(mu_);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      // seq_cst on both sides: either the caller sees this sleeper, or this re-check sees the
      // caller's new state.
      wake_.wait(lock,
                 [&] { return stop_.load() || state_.load(std::memory_order_seq_cst) != seen; });
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
      if (stop_.load()) return;
    }
    if (stop_.load(std::memory_order_relaxed)) return;
    // Wait for the next change after the state in which nothing was left to claim.
    seen = drain();
  }
}

void RowPool::parallelFor(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  if (helpers_.empty() || n == 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  count_.store(uint32_t(n), std::memory_order_relaxed);
  fn_.store(&fn, std::memory_order_relaxed);
  unfinished_.store(n, std::memory_order_relaxed);
  ++generation_;
  state_.store(generation_ << 32, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    { std::lock_guard lock(mu_); }
    wake_.notify_all();
  }
  drain();
  int spins = 0;
  while (unfinished_.load(std::memory_order_acquire) != 0) {
    // A helper holding the last index may have been descheduled; stop competing for its core.
    if (++spins < kSpinIterations)
      _mm_pause();
    else
      std::this_thread::yield();
  }
}

}  // namespace bulkhead

// WorkPool implementation: a generation-tagged index counter, spin-then-sleep helpers.
#include "shared/work_pool.h"

#include <pthread.h>
#include <signal.h>

#include <chrono>
#include <cstring>

#include <immintrin.h>

#include <algorithm>

namespace bulkhead {
namespace {

// Idle helpers of a pool that is not kept warm spin this long before sleeping: long enough to
// bridge the stages of one verify-and-sample call, short enough that they are asleep while the
// worker computes the next step. A CPU worker shares these cores, and every core a helper spins
// on is one its step lacks.
// (A pause instruction takes from ~10 to ~140 cycles depending on the processor, so the bound is
// on time, not on a count.)
constexpr auto kSpinFor = std::chrono::microseconds(20);
constexpr int kPausesPerClockRead = 16;
// The index of a burst that is being set up: no index can be claimed.
constexpr uint64_t kClosed = 0xffffffffu;

}  // namespace

WorkPool::WorkPool(unsigned threads) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  participants_.store(threads);
  helpers_.reserve(threads - 1);
  for (unsigned i = 1; i < threads; ++i) helpers_.emplace_back([this, i] { helperLoop(i); });
}

unsigned WorkPool::defaultSpinners(bool beside_cpu_worker) {
  const unsigned cores = std::thread::hardware_concurrency();
  if (cores < 8) return 0;
  return beside_cpu_worker ? cores / 8 : cores / 4;
}

unsigned WorkPool::coresBesideCpuWorker(unsigned cores) {
  return cores >= 8 ? (3 * cores + 7) / 8 : 0;
}

void WorkPool::setSpinners(unsigned n) {
  spinners_.store(n == 0 ? unsigned(helpers_.size()) + 1 : n);
  { std::lock_guard lock(mu_); }  // a sleeper re-checks which side it sleeps on
  wake_.notify_all();
  cold_wake_.notify_all();
}

void WorkPool::setParticipants(unsigned n) {
  const unsigned all = unsigned(helpers_.size()) + 1, now = n == 0 ? all : std::min(n, all);
  if (participants_.exchange(now) == now) return;  // called every step by the broker
  { std::lock_guard lock(mu_); }  // a helper between its predicate check and its wait sees it
  resized_.notify_all();
}

WorkPool::~WorkPool() {
  {
    std::lock_guard lock(mu_);
    stop_.store(true);
  }
  wake_.notify_all();
  cold_wake_.notify_all();
  resized_.notify_all();
  for (std::thread& t : helpers_) t.join();
}

uint64_t WorkPool::drain() {
  uint64_t s = state_.load(std::memory_order_acquire);
  while (true) {
    // count_ read after the acquire load of `s` belongs to the burst of `s` or a later one. A
    // later burst's count_ is only stored after the state was closed (see parallelFor), and the
    // acquire load of count_ makes that close visible to the compare-exchange below, which then
    // fails. So the compare-exchange succeeds only while the burst of `s` is current and its
    // index `index` unclaimed, and count_ and fn_ are that burst's.
    const uint32_t index = uint32_t(s);
    if (index >= count_.load(std::memory_order_acquire)) return s;
    if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel,
                                      std::memory_order_acquire))
      continue;
    (*fn_.load(std::memory_order_relaxed))(index);
    unfinished_.fetch_sub(1, std::memory_order_release);
    s = state_.load(std::memory_order_acquire);
  }
}

void WorkPool::helperLoop(unsigned index) {
  // Asynchronous signals go to the threads that wait for them (a worker's signalfd, the broker's
  // main thread), never to a helper, whichever thread created the pool and whenever.
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);
  uint64_t seen = state_.load(std::memory_order_acquire);
  while (true) {
    if (index >= participants_.load(std::memory_order_acquire)) {
      std::unique_lock lock(mu_);
      resized_.wait(lock, [&] { return stop_.load() || index < participants_.load(); });
      if (stop_.load()) return;
      seen = state_.load(std::memory_order_acquire);
      continue;
    }
    const auto spin_until = std::chrono::steady_clock::now() + kSpinFor;
    int spins = 0;
    uint64_t now;
    while ((now = state_.load(std::memory_order_acquire)) == seen &&
           !stop_.load(std::memory_order_relaxed)) {
      _mm_pause();
      if (++spins % kPausesPerClockRead == 0 && !warmFor(index) &&
          std::chrono::steady_clock::now() >= spin_until)
        break;
    }
    if (now == seen) {
      std::unique_lock lock(mu_);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      // seq_cst on both sides: either the caller sees this sleeper, or this re-check sees the
      // caller's new state.
      // A helper that may not spin sleeps apart, so warming the pool does not wake it.
      const bool spinner = index < spinners_.load();
      (spinner ? wake_ : cold_wake_).wait(lock, [&] {
        return stop_.load() || warmFor(index) || state_.load(std::memory_order_seq_cst) != seen ||
               spinner != (index < spinners_.load());
      });
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
      if (stop_.load()) return;
    }
    if (stop_.load(std::memory_order_relaxed)) return;
    if (index >= participants_.load(std::memory_order_acquire)) continue;  // left out meanwhile
    // Wait for the next change after the state in which nothing was left to claim.
    seen = drain();
  }
}

void WorkPool::keepWarm(bool warm) {
  if (warm_.exchange(warm) == warm || !warm) return;
  { std::lock_guard lock(mu_); }  // a helper between its predicate check and its wait sees it
  wake_.notify_all();
}

void WorkPool::parallelFor(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  if (threads() == 1 || n == 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::lock_guard turn(callers_);
  // Close the previous burst before its count_ and fn_ change: a helper still holding that
  // burst's final state (every index claimed) must not read the new, larger count_ and claim
  // one more index of the old burst. Index kClosed is never below any count_.
  ++generation_;
  state_.store((generation_ << 32) | kClosed, std::memory_order_seq_cst);
  fn_.store(&fn, std::memory_order_relaxed);
  unfinished_.store(n, std::memory_order_relaxed);
  count_.store(uint32_t(n), std::memory_order_release);
  state_.store(generation_ << 32, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    { std::lock_guard lock(mu_); }
    wake_.notify_all();
    cold_wake_.notify_all();
  }
  drain();
  const auto spin_until = std::chrono::steady_clock::now() + kSpinFor;
  int spins = 0;
  bool yielding = false;
  while (unfinished_.load(std::memory_order_acquire) != 0) {
    // A helper holding the last index may have been descheduled; stop competing for its core.
    if (yielding) {
      std::this_thread::yield();
    } else {
      _mm_pause();
      yielding =
          ++spins % kPausesPerClockRead == 0 && std::chrono::steady_clock::now() >= spin_until;
    }
  }
}

void copyInPieces(WorkPool& pool, std::span<const ByteCopy> copies, size_t piece_bytes) {
  piece_bytes = std::max<size_t>(piece_bytes, 1);
  std::vector<ByteCopy> pieces;
  for (const ByteCopy& c : copies)
    for (size_t at = 0; at < c.from.size(); at += piece_bytes)
      pieces.push_back({c.from.subspan(at, std::min(piece_bytes, c.from.size() - at)), c.to + at});
  pool.parallelFor(pieces.size(), [&](size_t i) {
    std::memcpy(pieces[i].to, pieces[i].from.data(), pieces[i].from.size());
  });
}

}  // namespace bulkhead

// WorkPool: a fixed set of owned threads for short, frequent bursts of parallel work — the broker's
// logits-row verification and sampling, the CPU backend's kernels. Idle threads spin briefly
// before sleeping, so a burst that follows another one starts within microseconds; a pool kept
// warm spins until it is told to rest, so a run of bursts with serial work between them (one
// model step) never waits for a thread to wake.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

namespace bulkhead {

class WorkPool {
 public:
  // `threads` is the parallelism of parallelFor, the calling thread included: the pool owns
  // threads - 1 helpers. 0 means std::thread::hardware_concurrency().
  explicit WorkPool(unsigned threads = 0);
  ~WorkPool();  // wakes and joins every helper
  WorkPool(const WorkPool&) = delete;
  WorkPool& operator=(const WorkPool&) = delete;

  // The parallelism of parallelFor now: setParticipants' limit, at most the pool's threads.
  unsigned threads() const { return participants_.load(std::memory_order_relaxed); }

  // Lets only `n` threads (the caller included) take part in bursts from now on, 0: every
  // thread; the others sleep until the limit rises. For a process that shares the host's cores
  // with one that needs most of them (the broker beside a CPU worker).
  void setParticipants(unsigned n);

  // Runs fn(0) .. fn(n - 1), each exactly once, on the helpers and the calling thread; returns
  // when all have finished. Calls from several threads take turns; parallelFor must not be
  // called from inside fn. fn must not throw. n < 2^32.
  void parallelFor(size_t n, const std::function<void(size_t)>& fn);

  // While warm, idle helpers spin instead of going to sleep (setting it wakes the sleepers). A
  // caller warms the pool just before a run of bursts and cools it as soon as the run ends, so
  // that between runs the cores belong to whatever else the host runs (on a CPU-backend host:
  // the broker sampling the step's rows).
  void keepWarm(bool warm);
  // Only the first `n` threads (the caller counted) spin while warm, 0: all of them. The others
  // sleep between bursts as in a cool pool, so a warm pool keeps no more cores busy than a
  // process beside a CPU worker may use.
  void setSpinners(unsigned n);
  // The spinners a warm pool of a process that shares the host keeps by default: a quarter of a
  // host of 8 or more cores, an eighth beside a worker that computes on the host's cores (which
  // leaves three eighths free); 0 (all) on a smaller host. Every core spinning leaves none to the
  // threads a step's end wakes (the worker's, the streams' writers): one then waits out a
  // scheduler slice of milliseconds.
  static unsigned defaultSpinners(bool beside_cpu_worker);
  // The cores a CPU worker leaves to the broker beside it by default: three eighths of a host of
  // 8 or more cores (6 of 16), none on a smaller one. The worker's kernel team takes the rest
  // (CpuBackend::defaultThreads), the broker's sampling keeps to these while the worker computes.
  static unsigned coresBesideCpuWorker(unsigned cores);
  unsigned spinners() const {
    return std::min(spinners_.load(std::memory_order_relaxed), unsigned(helpers_.size()) + 1);
  }

 private:
  static constexpr size_t kLineBytes = 128;
  void helperLoop(unsigned index);  // index 1 .. threads - 1
  // Claims and runs indices of the current burst until none is left; returns the state in which
  // it found nothing left to claim.
  uint64_t drain();

  // The burst: (generation << 32) | next index. Claiming an index is a compare-exchange that
  // also checks the generation, so a helper that wakes late can never take an index of a burst
  // it did not read `count_` and `fn_` for.
  // Claims (state_, read with count_ and fn_), completions (unfinished_, which the caller
  // watches) and the rest each have lines of their own: a completion must not take the line
  // every idle helper is polling. 128 bytes: the pair of lines x86 processors fetch together.
  alignas(kLineBytes) std::atomic<uint64_t> state_{0};
  std::atomic<uint32_t> count_{0};
  std::atomic<const std::function<void(size_t)>*> fn_{nullptr};
  alignas(kLineBytes) std::atomic<size_t> unfinished_{0};
  alignas(kLineBytes) uint64_t generation_ = 0;  // caller only

  std::mutex callers_;  // one burst at a time
  std::mutex mu_;
  std::condition_variable wake_;
  std::atomic<bool> warm_{false};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::vector<std::thread> helpers_;
  std::atomic<unsigned> participants_{1};
  std::atomic<unsigned> spinners_{~0u};
  bool warmFor(unsigned index) const {
    return warm_.load(std::memory_order_relaxed) &&
           index < spinners_.load(std::memory_order_relaxed);
  }
  std::condition_variable resized_;    // helpers left out of bursts wait here
  std::condition_variable cold_wake_;  // idle helpers that may not spin while warm wait here
};

// Bytes to copy: `from` to `to` (host memory).
struct ByteCopy {
  std::span<const std::byte> from;
  std::byte* to = nullptr;
};
// Every copy, cut into pieces of at most `piece_bytes`, spread over `pool` (loading a model
// copies gigabytes).
void copyInPieces(WorkPool& pool, std::span<const ByteCopy> copies, size_t piece_bytes);

}  // namespace bulkhead

// Background verification of the weights a backend computes from. Expected checksums come from
// the checkpoint's host bytes at load; a thread owned by the scrubber walks rolling passes over
// the resident copy, a bounded share of one core's time, repairs any granule that no longer
// matches from the host copy, and says which steps may have used it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "shared/checkpoint.h"
#include "worker/backend.h"

namespace bulkhead {

// Busy at most this share of one core's wall time, and only between steps: a granule starts
// only while no step computes, so a step meets at most the end of one granule (~30 us of one
// core). A burst that lands inside a step preempts one thread of a kernel's team and the whole
// kernel waits for it: before this gate, the 2-core build host measured step-bench compute on
// tiny-v152k (19.6 MB) at batch 1 / 64: share 0 -> 0.55 / 32 ms, 0.05 -> 0.65 / 34 ms, 0.25 ->
// 2.55 / 41 ms. A pass over B bytes takes at least B / (T * share) at a single-core checksum
// throughput T (3.9 GB/s there), longer when steps leave few gaps; by default (in-step checks
// on) no token waits for a pass. An idle broker's Ping runs a parallel full pass, not paced.
constexpr double kDefaultScrubShare = 0.05;
constexpr uint64_t kScrubGranuleBytes = uint64_t(128) << 10;

struct WeightCorruption {
  std::string tensor;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint64_t suspect_from_step = 0;
};

// What the scrubber vouches for, taken in one piece: every step <= clean_through computed with
// clean weights, except those a listed corruption names (suspect_from_step and later).
struct ScrubReport {
  uint64_t clean_through = 0;
  std::vector<WeightCorruption> corruptions;  // found and repaired since the last report
};

// Correctness rests on one fact: corruption persists until the scrubber repairs it. So a granule
// found clean at time t was clean for every step completed before t, and a pass that started
// after step S completed and found every granule clean proves steps up to S clean.
//
// Threads and locks. The scrub thread (started by start(), joined by stop() or the destructor)
// and the caller of fullPass() take pass_mu_ for their work, so at most one of them scrubs.
// Checksums are read under `weights_mutex` shared (alongside steps), repairs take it exclusive
// (no step in flight). report_mu_ guards what the next report carries. Lock order: pass_mu_,
// then weights_mutex, then report_mu_; wake_mu_ is never held with another.
class WeightScrubber {
 public:
  struct Options {
    double share = kDefaultScrubShare;  // 0: no scrub thread
    uint64_t granule_bytes = kScrubGranuleBytes;
  };

  // `weights_mutex` orders repairs against steps and weight bit flips; the server owns it.
  WeightScrubber(Backend& backend, const Checkpoint& checkpoint, std::shared_mutex& weights_mutex,
                 const Options& options);
  ~WeightScrubber();
  WeightScrubber(const WeightScrubber&) = delete;
  WeightScrubber& operator=(const WeightScrubber&) = delete;

  // Starts the scrub thread (no-op when the share is 0 or it already runs).
  void start();
  // Stops and joins the scrub thread; returns within one granule's work.
  void stop();

  // The server calls these around each step's compute: stepStarted before the backend is given
  // the step, then stepCompleted once waitStep returned or stepAbandoned if the step failed. No
  // granule starts in between.
  void stepStarted() { computing_.store(true, std::memory_order_seq_cst); }
  void stepCompleted(uint64_t step_id);
  void stepAbandoned();

  // A complete pass starting now, all granules at once (Backend::residentChecksums in parallel);
  // returns the report, which vouches for every step completed before the call.
  ScrubReport fullPass();
  // Corruptions found since the last report, with clean_through, taken together.
  ScrubReport takeReport();
  // clean_through as a report would carry it, but never covering a step named by a corruption
  // not yet reported (for replies that carry no corruption list).
  uint64_t cleanThrough() const;

  // A new broker on the socket numbers its steps from 1 again: nothing vouched for under the old
  // numbering carries over. Every granule counts as clean only before step 1, clean_through is
  // 0, the rolling pass starts over, and corruptions found (and repaired) before now are dropped:
  // no step of the new numbering read them. The server calls it for each connection it accepts,
  // no step in flight.
  void restartStepNumbering();

  uint64_t totalBytes() const { return total_bytes_; }
  uint64_t passes() const { return passes_.load(std::memory_order_acquire); }
  // Granules the scrub thread has checked, and whether it now waits for a step to end.
  uint64_t granulesScrubbed() const { return granules_scrubbed_.load(std::memory_order_acquire); }
  bool waitingForStepToEnd() const {
    return awaiting_quiet_.load(std::memory_order_acquire) &&
           computing_.load(std::memory_order_acquire);
  }
  double share() const { return share_; }

 private:
  struct Granule {
    WeightRange range;
    uint64_t checksum;
    uint64_t clean_after_step;  // last completed step when it was last found (or made) clean
  };

  void run();
  // One granule of the rolling pass; pass_mu_ held.
  void scrubNext();
  // Repairs granule g found corrupted, records the corruption; pass_mu_ held.
  void repair(Granule& g);
  // pass_mu_ held.
  void finishPass(bool clean, uint64_t started_after);

  Backend& backend_;
  std::shared_mutex& weights_mutex_;
  const double share_;
  std::vector<std::string> names_;
  uint64_t total_bytes_ = 0;
  std::atomic<uint64_t> last_step_{0};
  std::atomic<uint64_t> passes_{0};
  std::atomic<uint64_t> granules_scrubbed_{0};
  std::atomic<bool> computing_{false};
  std::atomic<bool> awaiting_quiet_{false};  // the scrub thread waits for a step to end

  std::mutex pass_mu_;
  std::vector<Granule> granules_;    // guarded by pass_mu_
  std::vector<WeightRange> ranges_;  // all granules' ranges, for fullPass
  size_t cursor_ = 0;                // guarded by pass_mu_
  uint64_t pass_started_after_ = 0;  // guarded by pass_mu_
  bool pass_clean_ = true;           // guarded by pass_mu_

  mutable std::mutex report_mu_;
  uint64_t clean_through_ = 0;             // guarded by report_mu_
  std::vector<WeightCorruption> pending_;  // guarded by report_mu_

  std::mutex wake_mu_;
  std::condition_variable wake_;
  bool stopping_ = false;  // guarded by wake_mu_; wake_ also signals the end of a step
  std::thread thread_;
};

}  // namespace bulkhead

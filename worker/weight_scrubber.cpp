// WeightScrubber: the paced scrub thread, rolling passes, parallel full passes and the handoff of
// what they found to whoever reports next.
#include "worker/weight_scrubber.h"

#include <algorithm>
#include <cstdlib>

#include <spdlog/spdlog.h>

#include "shared/checksum.h"
#include "shared/work_pool.h"

namespace bulkhead {
namespace {

// Crash-only: a backend that cannot checksum or repair its weights cannot be served from.
[[noreturn]] void fatal(const std::string& what) {
  spdlog::critical("weight scrubber: {}", what);
  std::abort();
}

}  // namespace

WeightScrubber::WeightScrubber(Backend& backend, const Checkpoint& checkpoint,
                               std::shared_mutex& weights_mutex, const Options& options)
    : backend_(backend),
      weights_mutex_(weights_mutex),
      share_(std::clamp(options.share, 0.0, 1.0)) {
  const uint64_t granule = std::max<uint64_t>(options.granule_bytes, 4);
  const auto used = checkpoint.usedTensors();
  // What every granule must read back as, from the checkpoint's own bytes, on every core.
  std::vector<std::span<const std::byte>> tensors;
  for (const TensorView* t : used) tensors.push_back(t->data);
  WorkPool pool;
  const std::vector<uint64_t> sums = granuleChecksums(tensors, granule, pool);
  for (uint32_t t = 0; t < used.size(); ++t) {
    names_.push_back(used[t]->name);
    const auto bytes = used[t]->data;
    for (uint64_t off = 0; off < bytes.size(); off += granule) {
      const uint64_t len = std::min<uint64_t>(granule, bytes.size() - off);
      const WeightRange range{t, off, len};
      granules_.push_back({range, sums[granules_.size()], 0});
      ranges_.push_back(range);
      total_bytes_ += len;
    }
  }
}

WeightScrubber::~WeightScrubber() {
  stop();
}

void WeightScrubber::start() {
  if (share_ <= 0.0 || thread_.joinable() || granules_.empty()) return;
  {
    std::lock_guard lock(wake_mu_);
    stopping_ = false;
  }
  thread_ = std::thread([this] { run(); });
}

void WeightScrubber::stop() {
  {
    std::lock_guard lock(wake_mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void WeightScrubber::run() {
  using Clock = std::chrono::steady_clock;
  // After each granule, idle long enough that busy / (busy + idle) <= share.
  const double idle_per_busy = (1.0 - share_) / share_;
  std::unique_lock wake(wake_mu_);
  while (true) {
    // A quiet moment first: seq_cst on both flags, so either stepCompleted sees this wait and
    // notifies, or this check sees the step done.
    awaiting_quiet_.store(true, std::memory_order_seq_cst);
    wake_.wait(wake, [this] { return stopping_ || !computing_.load(std::memory_order_seq_cst); });
    awaiting_quiet_.store(false, std::memory_order_relaxed);
    if (stopping_) return;
    wake.unlock();
    Clock::duration busy;
    {
      std::lock_guard pass(pass_mu_);
      const auto start = Clock::now();
      scrubNext();
      busy = Clock::now() - start;
    }
    wake.lock();
    const auto idle = std::chrono::duration_cast<Clock::duration>(busy * idle_per_busy);
    wake_.wait_for(wake, idle, [this] { return stopping_; });
  }
}

void WeightScrubber::stepCompleted(uint64_t step_id) {
  last_step_.store(step_id, std::memory_order_release);
  stepAbandoned();
}

void WeightScrubber::stepAbandoned() {
  computing_.store(false, std::memory_order_seq_cst);
  if (awaiting_quiet_.load(std::memory_order_seq_cst)) {
    { std::lock_guard lock(wake_mu_); }
    wake_.notify_all();
  }
}

void WeightScrubber::scrubNext() {
  if (cursor_ == 0) {
    pass_started_after_ = last_step_.load(std::memory_order_acquire);
    pass_clean_ = true;
  }
  Granule& g = granules_[cursor_];
  // Read before the bytes are: a step that completes meanwhile is not claimed.
  const uint64_t seen_after = last_step_.load(std::memory_order_acquire);
  uint64_t sum = 0;
  Status s;
  {
    std::shared_lock weights(weights_mutex_);
    s = backend_.residentChecksums({&g.range, 1}, {&sum, 1});
  }
  if (!s.ok()) fatal("checksum of " + names_[g.range.tensor] + ": " + s.toString());
  if (sum != g.checksum) {
    repair(g);
    pass_clean_ = false;
  } else {
    g.clean_after_step = seen_after;
  }
  granules_scrubbed_.fetch_add(1, std::memory_order_release);
  if (++cursor_ == granules_.size()) {
    cursor_ = 0;
    finishPass(pass_clean_, pass_started_after_);
  }
}

void WeightScrubber::repair(Granule& g) {
  const WeightRange& r = g.range;
  WeightCorruption c{names_[r.tensor], r.offset, r.bytes, g.clean_after_step + 1};
  spdlog::error("weight corruption in {} bytes {}..{}; repairing from the host copy", c.tensor,
                r.offset, r.offset + r.bytes);
  {
    std::unique_lock weights(weights_mutex_);  // no step in flight
    Status repaired = backend_.repairResident(r);
    uint64_t again = 0;
    if (repaired.ok()) repaired = backend_.residentChecksums({&r, 1}, {&again, 1});
    if (!repaired.ok() || again != g.checksum)
      fatal("cannot repair " + c.tensor + ": " + repaired.toString());
    g.clean_after_step = last_step_.load(std::memory_order_acquire);
  }
  std::lock_guard report(report_mu_);
  pending_.push_back(std::move(c));
}

void WeightScrubber::finishPass(bool clean, uint64_t started_after) {
  passes_.fetch_add(1, std::memory_order_acq_rel);
  if (!clean) return;
  std::lock_guard report(report_mu_);
  clean_through_ = std::max(clean_through_, started_after);
}

ScrubReport WeightScrubber::fullPass() {
  std::lock_guard pass(pass_mu_);
  const uint64_t started_after = last_step_.load(std::memory_order_acquire);
  std::vector<uint64_t> sums(granules_.size());
  Status s;
  {
    std::shared_lock weights(weights_mutex_);
    s = backend_.residentChecksums(ranges_, sums);
  }
  if (!s.ok()) fatal("full pass: " + s.toString());
  bool clean = true;
  for (size_t i = 0; i < granules_.size(); ++i) {
    if (sums[i] != granules_[i].checksum) {
      repair(granules_[i]);
      clean = false;
    } else {
      granules_[i].clean_after_step = started_after;
    }
  }
  // The rolling pass starts over: a pass that straddles a repair it did not make proves nothing.
  cursor_ = 0;
  finishPass(clean, started_after);
  return takeReport();
}

void WeightScrubber::restartStepNumbering() {
  std::lock_guard pass(pass_mu_);
  last_step_.store(0, std::memory_order_release);
  for (Granule& g : granules_) g.clean_after_step = 0;
  cursor_ = 0;
  std::lock_guard report(report_mu_);
  clean_through_ = 0;
  pending_.clear();
}

ScrubReport WeightScrubber::takeReport() {
  std::lock_guard report(report_mu_);
  ScrubReport out{clean_through_, std::move(pending_)};
  pending_.clear();
  return out;
}

uint64_t WeightScrubber::cleanThrough() const {
  std::lock_guard report(report_mu_);
  uint64_t through = clean_through_;
  for (const WeightCorruption& c : pending_) through = std::min(through, c.suspect_from_step - 1);
  return through;
}

}  // namespace bulkhead

// FakeWorker: a paged token cache, logits as a function of the cached history, scripted faults.
#include "support/fake_worker.h"

#include <algorithm>
#include <thread>

#include "shared/checksum.h"
#include "shared/mix.h"

namespace bulkhead::test {

std::vector<float> fakeLogits(std::span<const uint32_t> history, uint32_t vocab) {
  uint64_t h = 0x6a09e667f3bcc909ull;
  for (size_t p = 0; p < history.size(); ++p) h = splitmix64(h ^ (uint64_t(history[p]) << 20) ^ p);
  std::vector<float> row(vocab);
  for (uint32_t v = 0; v < vocab; ++v)
    row[v] = float(int64_t(splitmix64(h + v) % 8001) - 4000) / 1000.0f;
  return row;
}

CanaryReference fakeReference() {
  return [](const WorkerHello& hello, std::span<const uint32_t> tokens,
            std::span<const uint32_t> rows) -> Result<std::vector<std::vector<float>>> {
    std::vector<std::vector<float>> out;
    for (uint32_t r : rows) out.push_back(fakeLogits(tokens.first(r + 1), hello.vocab_size));
    return out;
  };
}

void FakeWorkerControl::scheduleFault(uint32_t after_steps, FakeFault fault) {
  std::lock_guard lock(mu_);
  faults_.emplace_back(after_steps, fault);
}

void FakeWorkerControl::failStarts(uint32_t count) {
  std::lock_guard lock(mu_);
  failing_starts_ = count;
}

void FakeWorkerControl::miscomputeFromBirth(uint32_t count) {
  std::lock_guard lock(mu_);
  miscomputing_starts_ = count;
}

std::vector<FakeStepRecord> FakeWorkerControl::steps() const {
  std::lock_guard lock(mu_);
  return steps_;
}

size_t FakeWorkerControl::faultsBesideAStepInFlight() const {
  std::lock_guard lock(mu_);
  return faults_beside_a_step_in_flight_;
}

size_t FakeWorkerControl::maxInFlight() const {
  std::lock_guard lock(mu_);
  return max_in_flight_;
}

uint32_t FakeWorkerControl::starts() const {
  std::lock_guard lock(mu_);
  return starts_;
}

WorkerFactory FakeWorkerControl::factory(std::shared_ptr<FakeWorkerControl> self) {
  return [self](uint64_t incarnation) -> WorkerResult<std::unique_ptr<WorkerConnection>> {
    uint32_t start;
    {
      std::lock_guard lock(self->mu_);
      start = ++self->starts_;
    }
    if (self->on_start) self->on_start(start);
    const bool restart = start > 1;
    {
      std::lock_guard lock(self->mu_);
      if (self->failing_starts_ > 0) {
        --self->failing_starts_;
        return workerFailure(WorkerFailure::Kind::kStartFailed, "scripted start failure");
      }
    }
    // The load time of a real worker, simulated (nothing waits on it but the start itself).
    if (restart && self->restart_delay.count() > 0)
      std::this_thread::sleep_for(self->restart_delay);
    if (restart && self->restart_gate.valid())
      (void)self->restart_gate.wait_for(std::chrono::seconds(30));
    return std::unique_ptr<WorkerConnection>(std::make_unique<FakeWorker>(self, incarnation));
  };
}

FakeWorker::FakeWorker(std::shared_ptr<FakeWorkerControl> control, uint64_t incarnation)
    : control_(std::move(control)) {
  const FakeWorkerControl& c = *control_;
  hello_.pid = 1;
  hello_.incarnation = incarnation;
  hello_.backend = c.backend;
  hello_.vocab_size = c.vocab;
  hello_.max_context = 4096;
  hello_.kv_block_size = c.block_size;
  hello_.kv_block_count = c.blocks;
  hello_.max_step_tokens = c.max_step_tokens;
  hello_.arena_slots = c.arena_slots;
  hello_.weight_bytes = 1 << 20;
  hello_.scrubbing = true;
  hello_.in_step_checks = c.in_step_checks;
  hello_.compute_grows_with_rows = c.compute_grows_with_rows;
  hello_.model_identity = 42;
  kv_.assign(size_t(c.blocks) * c.block_size, UINT32_MAX);
  std::lock_guard lock(control_->mu_);
  if (control_->miscomputing_starts_ > 0) {
    --control_->miscomputing_starts_;
    miscompute_ = true;
  }
}

std::optional<FakeFault> FakeWorker::takeFault() {
  std::lock_guard lock(control_->mu_);
  auto& faults = control_->faults_;
  if (faults.empty()) return std::nullopt;
  if (faults.front().first > 1) {
    --faults.front().first;
    return std::nullopt;
  }
  FakeFault f = faults.front().second;
  faults.pop_front();
  // Computed at send: a step whose reply is still to be taken is in flight beside this one.
  if (!replies_.empty()) ++control_->faults_beside_a_step_in_flight_;
  return f;
}

WorkerFailure FakeWorker::sendStep(uint64_t step_id, std::span<const SequenceStep> batch,
                                   uint32_t first_slot, std::chrono::milliseconds) {
  if (!broken_.ok()) return broken_;
  if (control_->on_step) control_->on_step(batch);
  if (replies_.size() >= kMaxStepsInFlight)
    return workerFailure(WorkerFailure::Kind::kProtocolViolation, "too many steps in flight");
  size_t rows = 0;
  for (const SequenceStep& s : batch) rows += s.logits_rows.size();
  if (first_slot + rows > hello_.arena_slots) {
    replies_.push_back(workerFailure(WorkerFailure::Kind::kRejected, "rows past the arena"));
    ready_.push_back(std::chrono::steady_clock::now());
    return {};
  }
  rows_.emplace_back();
  if (rows_.size() > kMaxStepsInFlight + 1) rows_.pop_front();
  replies_.push_back(compute(step_id, batch, rows_.back()));
  free_at_ = std::max(free_at_, std::chrono::steady_clock::now()) +
             (control_->compute_wall ? control_->compute_wall(rows) : std::chrono::microseconds(0));
  ready_.push_back(free_at_);
  std::lock_guard lock(control_->mu_);
  control_->max_in_flight_ = std::max(control_->max_in_flight_, replies_.size());
  return {};
}

WorkerResult<StepReply> FakeWorker::awaitStep() {
  if (replies_.empty())
    return workerFailure(WorkerFailure::Kind::kProtocolViolation, "no step in flight");
  WorkerResult<StepReply> reply = std::move(replies_.front());
  replies_.pop_front();
  std::this_thread::sleep_until(ready_.front());  // the step's compute (compute_wall)
  ready_.pop_front();
  return reply;
}

WorkerResult<StepReply> FakeWorker::compute(uint64_t step_id, std::span<const SequenceStep> batch,
                                            std::vector<std::vector<float>>& rows) {
  if (!broken_.ok()) return broken_;
  const uint32_t bs = hello_.kv_block_size;
  StepReply reply;
  for (const SequenceStep& s : batch) {
    if (s.kv_blocks.size() * bs < s.start_position + s.tokens.size())
      return workerFailure(WorkerFailure::Kind::kRejected, "block table too short");
    {
      std::lock_guard lock(control_->mu_);
      control_->steps_.push_back({hello_.incarnation, step_id, s.sequence_id, s.start_position,
                                  std::vector<uint32_t>(s.tokens.begin(), s.tokens.end())});
    }
    for (size_t i = 0; i < s.tokens.size(); ++i) {
      const uint32_t p = s.start_position + uint32_t(i);
      kv_[size_t(s.kv_blocks[p / bs]) * bs + p % bs] = s.tokens[i];
    }
    for (uint32_t r : s.logits_rows) {
      std::vector<uint32_t> history;
      for (uint32_t p = 0; p <= s.start_position + r; ++p)
        history.push_back(kv_[size_t(s.kv_blocks[p / bs]) * bs + p % bs]);
      rows.push_back(fakeLogits(history, hello_.vocab_size));
    }
  }
  std::optional<FakeFault> fault = rows.empty() ? std::nullopt : takeFault();
  if (fault && fault->kind == FakeFault::Kind::kMiscompute) miscompute_ = true;
  if (miscompute_) {
    for (auto& row : rows) std::rotate(row.begin(), row.begin() + 1, row.end());
  }
  if (fault && fault->kind == FakeFault::Kind::kFailStep) {
    WorkerFailure f = workerFailure(fault->failure, "scripted failure");
    if (f.kind != WorkerFailure::Kind::kRejected &&
        f.kind != WorkerFailure::Kind::kIntegrityFailure)
      broken_ = f;
    return f;
  }
  for (const auto& row : rows)
    reply.rows.push_back({row, checksumBytes(std::as_bytes(std::span(row)))});
  if (control_->compute_micros) reply.compute_micros = control_->compute_micros(rows.size());
  if (fault && fault->kind == FakeFault::Kind::kCorruptRow) rows[0][1] += 1.0f;
  last_step_ = step_id;
  const uint64_t lag = control_->scrub_lag;
  reply.scrub.clean_through = step_id > lag ? step_id - lag : 0;
  if (fault && fault->kind == FakeFault::Kind::kReportCorruption) {
    reply.scrub.corruptions.push_back(
        {"model.layers.0.mlp.up_proj.weight", 0, 4096, step_id - fault->suspect_steps_back});
    reply.scrub.clean_through =
        std::min(reply.scrub.clean_through, step_id - fault->suspect_steps_back - 1);
  }
  return reply;
}

WorkerResult<ScrubStatus> FakeWorker::ping(std::chrono::milliseconds) {
  if (!broken_.ok()) return broken_;
  return ScrubStatus{.clean_through = last_step_, .corruptions = {}};
}

WorkerFailure FakeWorker::heartbeat(std::chrono::milliseconds) {
  return broken_;
}

WorkerFailure FakeWorker::injectFault(const FaultSpec&, std::chrono::milliseconds) {
  return workerFailure(WorkerFailure::Kind::kRejected, "the fake worker takes scripted faults");
}

WorkerFailure FakeWorker::shutdown(std::chrono::milliseconds) {
  broken_ = workerFailure(WorkerFailure::Kind::kExited, "shut down");
  return {};
}

}  // namespace bulkhead::test

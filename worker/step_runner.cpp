// StepRunner: decode, compute into the arena, publish. Faults enter only through StepFaults.
#include "worker/step_runner.h"

#include <mutex>
#include <string>

#include <spdlog/spdlog.h>

#include "shared/ipc_frame.h"
#include "worker/step_decode.h"

namespace bulkhead {

static_assert(uint16_t(wire::WeightCheck::SLOT_TAG) == uint16_t(WeightCheck::kSlotTag));
static_assert(uint16_t(wire::WeightCheck::ARITHMETIC) == uint16_t(WeightCheck::kArithmetic));

void fillScrubReport(wire::ScrubReport::Builder out, const ScrubReport& report) {
  out.setCleanThrough(report.clean_through);
  auto list = out.initCorruptions(unsigned(report.corruptions.size()));
  for (size_t i = 0; i < report.corruptions.size(); ++i) {
    const WeightCorruption& c = report.corruptions[i];
    list[unsigned(i)].setTensor(c.tensor);
    list[unsigned(i)].setOffset(c.offset);
    list[unsigned(i)].setBytes(c.bytes);
    list[unsigned(i)].setSuspectFromStep(c.suspect_from_step);
  }
}

StepRunner::StepRunner(Backend& backend, LogitsArena& arena, WeightScrubber& scrubber,
                       std::shared_mutex& weights_mutex, StepFaults& faults)
    : backend_(backend),
      arena_(arena),
      scrubber_(scrubber),
      weights_mutex_(weights_mutex),
      faults_(faults) {}

StepOutcome StepRunner::run(wire::Step::Reader step, wire::FromWorker::Builder reply) {
  const uint64_t step_id = step.getStepId();
  if (step_id == 0) return {StepVerdict::kRejected, invalidArgument("step id 0 is reserved")};
  uint32_t total_rows = 0;
  if (Status s = decode(step, total_rows); !s.ok()) return {StepVerdict::kRejected, s};

  Clock::time_point from, to;
  StepOutcome outcome = compute(total_rows, step_id, from, to);
  if (outcome.verdict != StepVerdict::kDone) return outcome;

  auto done = reply.initStepDone();
  done.setStepId(step_id);
  done.setComputeMicros(
      uint64_t(std::chrono::duration_cast<std::chrono::microseconds>(to - from).count()));
  auto timeline = done.initTimeline();  // arrived and replying: WorkerServer's
  timeline.setComputeStart(monotonicNanos(from));
  timeline.setComputeEnd(monotonicNanos(to));
  // What the scrub thread found since the last report; it vouches for earlier steps only.
  if (scrubber_.share() > 0) fillScrubReport(done.initScrub(), scrubber_.takeReport());
  auto reads = done.initWeightReads();
  reads.setChecked(verdict_.checked);
  reads.setFailedTensor(verdict_.failed_tensor);
  reads.setWordsRead(verdict_.words_read);
  reads.setWhy(verdict_.why);
  reads.setFailedCheck(static_cast<wire::WeightCheck>(verdict_.failed_check));
  if (!verdict_.failed_tensor.empty())
    spdlog::error("step {} read {} wrongly ({}): in-step check failed", step_id,
                  verdict_.failed_tensor, verdict_.why);
  publish(step_id, done);
  outcome.form = faults_.replyForm();
  return outcome;
}

Status StepRunner::decode(wire::Step::Reader step, uint32_t& total_rows) {
  first_slot_ = step.getFirstSlot();
  return decodeStep(step, backend_.limits(), arena_.slots(), lists_, batch_, total_rows);
}

StepOutcome StepRunner::compute(uint32_t total_rows, uint64_t step_id, Clock::time_point& from,
                                Clock::time_point& to) {
  faults_.beginStep(total_rows);
  slots_.resize(total_rows);
  rows_.resize(total_rows);
  checks_.assign(total_rows, RowCheck{});
  for (uint32_t r = 0; r < total_rows; ++r) {
    slots_[r] = arena_.beginRow(first_slot_ + r);
    rows_[r] = {faults_.rowDestination(r, slots_[r]), &checks_[r]};
  }

  const auto start = Clock::now();
  scrubber_.stepStarted();
  {
    std::shared_lock weights(weights_mutex_);
    Status s = backend_.enqueueStep(batch_, rows_);
    const auto enqueued = std::chrono::steady_clock::now();
    const bool rejected = s.code() == Code::kInvalidArgument;
    if (s.ok()) s = backend_.waitStep(verdict_);
    auto us = [](auto d) {
      return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
    };
    spdlog::trace("step {} ({} rows): enqueued in {} us, waited {} us", step_id, total_rows,
                  us(enqueued - start), us(std::chrono::steady_clock::now() - enqueued));
    if (!s.ok()) {
      scrubber_.stepAbandoned();
      return {rejected ? StepVerdict::kRejected : StepVerdict::kFatal, s};
    }
  }
  scrubber_.stepCompleted(step_id);
  faults_.afterCompute();
  from = start;
  to = Clock::now();
  return {};
}

void StepRunner::publish(uint64_t step_id, wire::StepDone::Builder done) {
  auto refs = done.initRows(unsigned(rows_.size()));
  uint32_t r = 0;
  for (const SequenceStep& seq : batch_) {
    for (uint32_t token_index : seq.logits_rows) {
      RowCheck& check = checks_[r];
      faults_.beforePublish(r, slots_[r], check);
      arena_.publishRow(first_slot_ + r, step_id, seq.sequence_id, token_index, check.checksum);
      faults_.afterPublish(r, first_slot_ + r,
                           {arena_.incarnation(), step_id, seq.sequence_id, token_index,
                            arena_.rowFloats(), check.checksum});
      // The broker refuses such a row by itself; the worker's log says where it came from.
      if (!check.finite)
        spdlog::warn("step {} sequence {} row {}: logits not finite", step_id, seq.sequence_id,
                     token_index);
      auto ref = refs[r];
      ref.setSlot(first_slot_ + r);
      ref.setSequenceId(seq.sequence_id);
      ref.setTokenIndex(token_index);
      ref.setChecksum(check.checksum);
      ++r;
    }
  }
}

}  // namespace bulkhead

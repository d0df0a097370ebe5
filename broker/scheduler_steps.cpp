// Scheduler: steps — packing, sending, sampling and releasing. Up to two steps are in flight
// (WorkerConnection::sendStep): while the worker computes one half of the running sequences, the
// broker verifies and samples the other half's rows, so sampling hides behind compute. A step's
// sequences are marked in flight until its reply is taken; the planner leaves them alone, and
// nothing but steps is sent to the worker while any step is in flight (drainSteps first).
#include <algorithm>

#include <spdlog/spdlog.h>

#include "broker/batch_planner.h"
#include "broker/scheduler.h"
#include "broker/step_rows.h"

namespace bulkhead {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {
// Half steps taken, on the share heuristic alone, before whole steps are taken to see their cost.
constexpr uint32_t kHalvesBeforeWhole = 8;

double msBetween(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}
}  // namespace

// A worker without in-step checks has its tokens wait for the scrubber, and a corruption it
// reports rolls every sequence back: such a worker gets one step at a time.
bool Scheduler::gated(const WorkerConnection& worker) {
  return worker.hello().scrubbing && !worker.hello().in_step_checks;
}

size_t Scheduler::stepDepth(const WorkerConnection& worker) const {
  // Each of two steps needs room for a client row and the canary's in its half of the arena.
  if (!pipelining_ || gated(worker) || worker.hello().arena_slots < 4 ||
      step_failures_in_a_row_ > 0)
    return 1;
  return kMaxStepsInFlight;
}

bool Scheduler::stepOnce(WorkerConnection& worker) {
  const size_t depth = stepDepth(worker);
  const uint64_t preemptions = queues_.counters().preemptions;
  while (in_flight_.size() < depth && sendStep(worker, depth)) {
  }
  // A failed send replaces the worker, which forgets every step in flight. A plan that only
  // preempted (a sequence alone that no longer fits the cache) leaves work for admission at once.
  if (in_flight_.empty() || slot_.worker() == nullptr)
    return !in_flight_.empty() || queues_.counters().preemptions != preemptions;
  completeStep(*slot_.worker());
  return true;
}

bool Scheduler::sendStep(WorkerConnection& worker, size_t depth) {
  const WorkerHello& hello = worker.hello();
  const std::vector<RunningSequence> view = queues_.runningView();
  uint32_t token_budget = std::min(options_.max_batch_tokens, hello.max_step_tokens);
  // Two steps in flight each write their rows to their own half of the arena.
  const uint32_t slots = depth > 1 ? hello.arena_slots / 2 : hello.arena_slots;
  const uint32_t first_slot =
      depth > 1 && !in_flight_.empty() && in_flight_.front().first_slot == 0 ? slots : 0;
  // The canary rides along when due, one ride in flight at a time, and when the step has room for
  // it beside one client token.
  const bool riding = std::any_of(in_flight_.begin(), in_flight_.end(),
                                  [](const InFlightStep& s) { return s.ride; });
  const SequenceStep* ride = riding ? nullptr : slot_.canaryRide();
  if (ride != nullptr && (token_budget < 2 || slots < 2)) ride = nullptr;
  uint32_t max_rows = ride != nullptr ? slots - 1 : slots;
  if (ride != nullptr) --token_budget;
  if (depth > 1 && in_flight_.empty()) {
    // The first of two takes about half the sequences that are due, so the halves balance.
    const auto due = std::count_if(view.begin(), view.end(), [](const RunningSequence& s) {
      return !s.in_flight && s.history > s.computed;
    });
    max_rows = std::min(max_rows, std::max<uint32_t>(1, uint32_t(due + 1) / 2));
  }
  const StepPlan plan = planStep(view, {.token_budget = token_budget,
                                        .max_rows = max_rows,
                                        .block_size = hello.kv_block_size,
                                        .free_blocks = queues_.blocks().freeCount()});
  for (size_t i = 0; i < plan.preempt; ++i) queues_.preemptLast();
  if (plan.chunks.empty()) return false;

  StepRequest request = queues_.assemble(plan);
  if (ride != nullptr) {
    request.steps.push_back(*ride);
    request.tokens += 1;
  }
  const auto timeout =
      options_.step_timeout_base +
      std::chrono::duration_cast<milliseconds>(options_.step_timeout_per_token * request.tokens);
  InFlightStep step{.step_id = slot_.nextStepId(),
                    .batch = request.batch,
                    .chunks = plan.chunks,
                    .ride = ride != nullptr,
                    .first_slot = first_slot,
                    .sent = Clock::now(),
                    .halves = depth > 1};
  if (last_reply_ && in_flight_.empty()) board_.addBetweenSteps(msBetween(*last_reply_, step.sent));
  last_reply_.reset();
  if (WorkerFailure f = worker.sendStep(step.step_id, request.steps, first_slot, timeout);
      !f.ok()) {
    board_.update([](SchedulerStats& s, WorkerStatus&) { ++s.steps; });
    handleStepFailure(f, step.batch);
    return false;
  }
  for (Sequence* s : step.batch) s->in_flight = true;
  if (!in_flight_.empty())
    board_.update([](SchedulerStats& s, WorkerStatus&) { ++s.steps_overlapped; });
  in_flight_.push_back(std::move(step));
  return true;
}

void Scheduler::completeStep(WorkerConnection& worker) {
  InFlightStep step = std::move(in_flight_.front());
  in_flight_.pop_front();
  // A pace runs from one used reply to the next: a failed or discarded step ends it (a used one
  // starts the next in choosePipelining).
  const std::optional<PaceFrom> pace_from = std::exchange(pace_from_, std::nullopt);
  for (Sequence* s : step.batch) s->in_flight = false;
  auto reply = worker.awaitStep();
  const auto step_done = Clock::now();
  board_.update([](SchedulerStats& s, WorkerStatus&) { ++s.steps; });
  if (!reply.ok()) {
    pool_.keepWarm(false);  // warmed by the reply watch for rows that did not come
    handleStepFailure(reply.error(), step.batch);
    return;
  }
  if (step.step_id < trusted_from_step_) {
    // In flight when an earlier step failed its integrity checks: nothing of it is used, and
    // its sequences run again (KV writes are idempotent), after that step's retry.
    pool_.keepWarm(false);
    board_.update([](SchedulerStats& s, WorkerStatus&) { ++s.steps_discarded; });
    return;
  }

  std::vector<SampledRow> sampled;
  if (beside_cpu_worker_)  // the worker computing the step in flight keeps its cores
    pool_.setParticipants(in_flight_.empty() ? 0 : options_.cpu_worker_sampling_threads);
  WorkerFailure bad = sampleRows(step.batch, step.chunks, *reply, step.ride, step.step_id, sampled);
  pool_.keepWarm(false);  // warmed by the reply watch (WorkerClient::setReplySpin)
  const double sample_ms = msBetween(step_done, Clock::now());
  const double compute_ms = double(reply->compute_micros) / 1000.0;
  board_.addStepTimes(msBetween(step.sent, step_done), compute_ms, sample_ms, step.batch.size());
  if (in_flight_.empty()) last_reply_ = step_done;
  choosePipelining(worker, step, bad.ok() ? pace_from : std::nullopt, step_done, compute_ms,
                   std::max(0.0, msBetween(step.sent, step_done) - compute_ms), sample_ms);
  if (!bad.ok()) {
    pace_from_.reset();
    handleStepFailure(bad, step.batch);
    return;
  }
  step_failures_in_a_row_ = 0;
  slot_.stepCompleted();
  std::vector<std::function<void()>> after;
  {
    std::lock_guard lock(mu_);
    after.swap(after_step_);
  }
  for (auto& done : after) done();
  board_.update([&](SchedulerStats&, WorkerStatus& w) {
    w.last_step = step.step_id;
    w.scrub_clean_through = std::min(reply->scrub.clean_through, step.step_id);
  });
  // A worker that checks every step's weight reads vouches for the step by itself; otherwise
  // tokens wait for the scrubber, and a corruption it reports rolls them back, this step's too.
  const bool wait_for_scrub = gated(worker);
  if (wait_for_scrub && !reply->scrub.corruptions.empty()) {
    applyScrub(reply->scrub, wait_for_scrub);
    return;
  }
  std::vector<const TokenChoice*> chosen;
  for (const SampledRow& row : sampled) chosen.push_back(&row.choice);
  const size_t generated = queues_.accept(step.batch, step.chunks, step.step_id, chosen, step_done);
  board_.update([&](SchedulerStats& s, WorkerStatus&) { s.tokens_generated += generated; });
  applyScrub(reply->scrub, wait_for_scrub);
}

void Scheduler::choosePipelining(const WorkerConnection& worker, const InFlightStep& step,
                                 const std::optional<PaceFrom>& from, Clock::time_point done,
                                 double compute_ms, double trip_ms, double sample_ms) {
  const bool decode_only =
      !step.ride && std::all_of(step.chunks.begin(), step.chunks.end(),
                                [](const PlannedChunk& c) { return c.chunk == 1 && c.wants_row; });
  if (decode_only) step_costs_.record(uint32_t(step.chunks.size()), compute_ms, trip_ms, sample_ms);
  if (options_.pipeline_sample_share <= 0) {  // fixed: one at a time, or two throughout
    pipelining_ = options_.pipeline_sample_share == 0;
    return;
  }
  if (worker.hello().compute_grows_with_rows)
    return choosePipeliningByPace(step, decode_only, from, done);
  // Once steps of both sizes have been seen, what they cost decides.
  const uint32_t running = uint32_t(queues_.running().size());
  if (std::optional<bool> pays = step_costs_.halvesPay(running); pays) {
    pipelining_ = *pays;
    halves_unmeasured_ = 0;
    return;
  }
  // Halves never show what a whole step costs: after a run of them, whole steps until one is seen.
  if (pipelining_ && !step_costs_.knows(running) && ++halves_unmeasured_ >= kHalvesBeforeWhole) {
    pipelining_ = false;
    return;
  }
  if (halves_unmeasured_ >= kHalvesBeforeWhole && !step_costs_.knows(running)) return;
  // Until then: two steps in flight pay when sampling takes a fair share of compute, each half's
  // rows then sampled while the worker computes the other half
  // (SchedulerOptions::pipeline_sample_share).
  const double share = options_.pipeline_sample_share;
  if (sample_ms >= share * compute_ms) pipelining_ = true;
  if (sample_ms < 0.5 * share * compute_ms) pipelining_ = false;
}

// Beside a CPU worker the step costs mislead: a half step computed while the other half is sampled
// shares the host's cores with that sampling. So the realised pace of each mode decides: the mode
// in use until its pace is known, then the other until its pace is, then the faster
// (StepCosts::fasterPace); a pace gone stale is measured again the same way. Only decode steps
// without the canary's row make paces (a prefill chunk is many tokens in one row).
void Scheduler::choosePipeliningByPace(const InFlightStep& step, bool decode_only,
                                       const std::optional<PaceFrom>& from,
                                       Clock::time_point done) {
  const uint32_t running = uint32_t(queues_.running().size());
  pace_from_ = PaceFrom{done, step.halves, running};
  if (running < 2) {  // one sequence cannot be halved
    pipelining_ = false;
    return;
  }
  if (decode_only && from && from->halves == step.halves &&
      std::max(from->running, running) - std::min(from->running, running) <=
          std::max(1u, running / 8))
    step_costs_.recordPace(running, step.halves,
                           msBetween(from->at, done) / double(step.batch.size()));
  if (std::optional<bool> faster = step_costs_.fasterPace(running); faster)
    pipelining_ = *faster;
  else if (step_costs_.knowsPace(running, pipelining_))
    pipelining_ = !pipelining_;  // the other's pace is unknown here: measure it
}

void Scheduler::drainSteps() {
  while (!in_flight_.empty() && slot_.worker() != nullptr) completeStep(*slot_.worker());
  forgetInFlight();  // a replaced worker's steps never come back
}

void Scheduler::forgetInFlight() {
  pace_from_.reset();
  for (const InFlightStep& step : in_flight_)
    for (Sequence* s : step.batch) s->in_flight = false;
  in_flight_.clear();
}

// Verification and sampling in one pass over each row, spread over the pool; the canary's row,
// when it rode along, is verified in the same pass and then checked against its qualified digest.
// A row that fails fails the step: none of its rows is used.
WorkerFailure Scheduler::sampleRows(const std::vector<Sequence*>& batch,
                                    std::span<const PlannedChunk> chunks, const StepReply& reply,
                                    bool ride, uint64_t step_id, std::vector<SampledRow>& sampled) {
  std::vector<RowToSample> jobs;
  size_t r = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    if (!chunks[i].wants_row) continue;
    const Sequence& s = *batch[i];
    jobs.push_back({.logits = reply.rows[r].payload,
                    .expected_checksum = reply.rows[r].checksum,
                    .config = &s.request.sampling,
                    .prompt = s.ledger.prompt(),
                    .generated = s.ledger.generated(),
                    .position = s.ledger.tokens().size()});
    ++r;
  }
  if (ride) {
    RowToSample canary;  // verified only: nothing is chosen from it
    canary.logits = reply.rows[r].payload;
    canary.expected_checksum = reply.rows[r].checksum;
    jobs.push_back(canary);
  }
  sampled.resize(jobs.size());
  sampler_.verifyAndSample(jobs, sampled);
  WorkerFailure bad = firstFailedRow(sampled, " of step " + std::to_string(step_id));
  if (ride) {
    if (bad.ok()) bad = slot_.checkRide(reply.rows[r].checksum, step_id);
    sampled.pop_back();
  }
  return bad;
}

void Scheduler::handleStepFailure(const WorkerFailure& f, const std::vector<Sequence*>& batch) {
  const std::string detected = std::string(workerFailureKindName(f.kind)) +
                               (f.kind == WorkerFailure::Kind::kIntegrityFailure
                                    ? " (" + std::string(integrityCheckName(f.check)) + ")"
                                    : "");
  slot_.failed(detected);
  if (f.kind == WorkerFailure::Kind::kRejected) {
    // The worker refused input the broker validated: a broker bug, not the client's.
    spdlog::error("worker rejected a step: {}", f.toString());
    queues_.failRunning(batch, internalError("worker rejected the step: " + f.message));
    return;
  }
  if (f.kind == WorkerFailure::Kind::kIntegrityFailure) {
    board_.update([&f](SchedulerStats& s, WorkerStatus&) {
      ++s.integrity_failures;
      ++s.integrity_failures_by_check[std::string(integrityCheckName(f.check))];
    });
    // Whatever else is in flight was computed by a worker now in doubt.
    for (const InFlightStep& step : in_flight_)
      trusted_from_step_ = std::max(trusted_from_step_, step.step_id + 1);
    if (++step_failures_in_a_row_ <= options_.integrity_retries) {
      // Rows are never sampled from; the same step runs again (KV writes are idempotent).
      spdlog::warn("step rows failed verification, retrying: {}", f.toString());
      return;
    }
  }
  step_failures_in_a_row_ = 0;
  slot_.replace(detected, f.toString());
}

// `gated`: tokens wait for the scrubber's clean-through (a worker without in-step checks), and a
// corruption it reports rolls back every unsent token from the first suspect step on. A worker
// with in-step checks has already failed any step that read a corrupted weight.
void Scheduler::applyScrub(const ScrubStatus& scrub, bool gated) {
  uint64_t from = UINT64_MAX;
  for (const auto& c : scrub.corruptions) {
    spdlog::error("worker repaired corrupted weights in {} (bytes {}..{}), suspect from step {}",
                  c.tensor, c.offset, c.offset + c.bytes, c.suspect_from_step);
    from = std::min(from, c.suspect_from_step);
  }
  if (!scrub.corruptions.empty()) {
    board_.update([&](SchedulerStats& s, WorkerStatus&) {
      s.weight_corruptions += scrub.corruptions.size();
    });
    slot_.failed("weight corruption in " + scrub.corruptions[0].tensor);
  }
  if (gated && from != UINT64_MAX) {
    queues_.rollBack(from);
    return;
  }
  queues_.release(gated ? scrub.clean_through : UINT64_MAX,
                  [&](const ReleaseTimes& times) { board_.addReleaseTimes(times); });
}

}  // namespace bulkhead

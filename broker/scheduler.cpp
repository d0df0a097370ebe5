// Scheduler: admission, step packing, preemption, sampling, stop conditions, worker replacement.
#include "broker/scheduler.h"

#include <sys/random.h>

#include <algorithm>

#include <spdlog/spdlog.h>

namespace bulkhead {

using Clock = std::chrono::steady_clock;

struct Scheduler::Sequence {
  uint64_t id = 0;
  GenerationRequest request;
  std::shared_ptr<TokenSink> sink;
  std::vector<uint32_t> tokens;  // prompt followed by everything generated
  uint32_t prompt_len = 0;
  uint32_t computed = 0;  // tokens whose KV the current worker holds
  std::vector<uint32_t> blocks;
  // Set when assembling a step.
  uint32_t chunk = 0;
  bool wants_row = false;

  std::span<const uint32_t> generated() const { return std::span(tokens).subspan(prompt_len); }
};

Scheduler::Scheduler(WorkerFactory factory, ModelLimits model, SchedulerOptions options)
    : factory_(std::move(factory)), model_(std::move(model)), options_(options) {}

Scheduler::~Scheduler() {
  stop();
}

void Scheduler::start() {
  thread_ = std::thread([this] { run(); });
}

void Scheduler::stop() {
  {
    std::lock_guard lock(mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Scheduler::setServingCallback(std::function<void(bool)> callback) {
  std::lock_guard lock(mu_);
  serving_callback_ = std::move(callback);
  if (serving_callback_) serving_callback_(serving_);
}

void Scheduler::setServing(bool serving) {
  std::function<void(bool)> callback;
  {
    std::lock_guard lock(mu_);
    if (serving_ == serving) return;
    serving_ = serving;
    callback = serving_callback_;
  }
  if (callback) callback(serving);
}

Status Scheduler::submit(GenerationRequest request, std::shared_ptr<TokenSink> sink) {
  auto seq = std::make_unique<Sequence>();
  seq->tokens = request.prompt;
  seq->prompt_len = uint32_t(request.prompt.size());
  seq->request = std::move(request);
  seq->sink = std::move(sink);
  {
    std::lock_guard lock(mu_);
    ++stats_.requests_received;
    if (draining_ || stopping_) {
      ++stats_.requests_rejected;
      return unavailable("the broker is draining and admits no new requests");
    }
    if (worker_status_.state == "failed") {
      ++stats_.requests_rejected;
      return unavailable("no healthy worker: " + worker_status_.last_failure);
    }
    if (incoming_.size() + stats_.requests_waiting >= options_.max_waiting) {
      ++stats_.requests_rejected;
      return resourceExhausted("the request queue is full (" +
                               std::to_string(options_.max_waiting) + " waiting)");
    }
    seq->id = next_sequence_id_++;
    incoming_.push_back(std::move(seq));
  }
  wake_.notify_all();
  return okStatus();
}

SchedulerStats Scheduler::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

WorkerStatus Scheduler::workerStatus() const {
  std::lock_guard lock(mu_);
  return worker_status_;
}

Result<uint32_t> Scheduler::drain(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  draining_ = true;
  finished_while_draining_ = 0;
  wake_.notify_all();
  const bool done = idle_.wait_for(lock, timeout, [&] {
    return stopping_ ||
           (incoming_.empty() && stats_.requests_running == 0 && stats_.requests_waiting == 0);
  });
  if (!done) return Status(Code::kDeadlineExceeded, "drain did not finish in time");
  const uint32_t finished = finished_while_draining_;
  const bool was_serving = serving_;
  auto callback = serving_callback_;
  serving_ = false;
  lock.unlock();
  if (was_serving && callback) callback(false);
  return finished;
}

Result<std::pair<uint64_t, uint64_t>> Scheduler::restartWorker(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  const uint64_t generation = ++restart_generation_;
  restart_requested_ = true;
  wake_.notify_all();
  const bool done = idle_.wait_for(lock, timeout, [&] { return !restart_requested_ || stopping_; });
  if (!done || restart_requested_) return unavailable("restart did not complete in time");
  (void)generation;
  return last_restart_;
}

uint32_t Scheduler::blocksFor(uint64_t positions) const {
  const uint32_t bs = worker_ ? worker_->hello().kv_block_size : 16;
  return uint32_t((positions + bs - 1) / bs);
}

bool Scheduler::growBlocks(Sequence& seq, uint64_t positions) {
  while (seq.blocks.size() < blocksFor(positions)) {
    auto b = blocks_.allocate();
    if (!b) return false;
    seq.blocks.push_back(*b);
  }
  return true;
}

void Scheduler::finish(Sequence& seq, FinishReason reason, const Status& status) {
  for (uint32_t b : seq.blocks) blocks_.release(b);
  seq.blocks.clear();
  Usage usage{seq.prompt_len, uint32_t(seq.tokens.size() - seq.prompt_len),
              seq.request.sampling.seed};
  seq.sink->onFinish(reason, usage, status);
  std::lock_guard lock(mu_);
  if (status.ok()) {
    ++stats_.requests_completed;
  } else {
    ++stats_.requests_failed;
  }
  if (draining_) ++finished_while_draining_;
}

void Scheduler::failAll(const Status& status) {
  for (auto& s : running_) finish(*s, FinishReason::kNone, status);
  for (auto& s : waiting_) finish(*s, FinishReason::kNone, status);
  running_.clear();
  waiting_.clear();
}

void Scheduler::preemptLast() {
  // Recompute: the newest running sequence gives its blocks back and waits again, keeping its
  // whole history; it will be re-prefilled when blocks free up.
  std::unique_ptr<Sequence> victim = std::move(running_.back());
  running_.pop_back();
  for (uint32_t b : victim->blocks) blocks_.release(b);
  victim->blocks.clear();
  victim->computed = 0;
  waiting_.push_front(std::move(victim));
  std::lock_guard lock(mu_);
  ++stats_.preemptions;
}

bool Scheduler::ensureWorker() {
  if (worker_) return true;
  const uint64_t incarnation = next_incarnation_++;
  {
    std::lock_guard lock(mu_);
    if (worker_status_.state != "failed") worker_status_.state = "starting";
  }
  auto started = factory_(incarnation);
  if (!started.ok()) {
    ++failed_starts_;
    const std::string why = started.error().toString();
    spdlog::error("worker start {} failed ({} in a row): {}", incarnation, failed_starts_, why);
    backoff_ = backoff_.count() == 0 ? options_.restart_backoff_initial
                                     : std::min(options_.restart_backoff_max, backoff_ * 2);
    bool now_failed = false;
    {
      std::lock_guard lock(mu_);
      worker_status_.last_failure = why;
      if (failed_starts_ >= options_.max_failed_starts && worker_status_.state != "failed") {
        worker_status_.state = "failed";
        now_failed = true;
      }
    }
    if (now_failed) {
      spdlog::error("worker marked failed after {} failed starts; failing queued requests",
                    failed_starts_);
      setServing(false);
      failAll(unavailable("no healthy worker: " + why));
    }
    return false;
  }
  worker_ = std::move(*started);
  const WorkerHello& h = worker_->hello();
  if (h.vocab_size != model_.vocab_size) {
    spdlog::error("worker reports vocabulary {}, the model has {}", h.vocab_size,
                  model_.vocab_size);
    worker_.reset();
    ++failed_starts_;
    return false;
  }
  failed_starts_ = 0;
  backoff_ = std::chrono::milliseconds(0);
  blocks_.reset(h.kv_block_count);
  {
    std::lock_guard lock(mu_);
    worker_status_.state = "ready";
    worker_status_.incarnation = h.incarnation;
    worker_status_.pid = h.pid;
    worker_status_.backend = h.backend;
    worker_status_.kv_blocks_total = h.kv_block_count;
  }
  spdlog::info("worker incarnation {} ready (pid {}, {} backend, {} KV blocks)", h.incarnation,
               h.pid, h.backend, h.kv_block_count);
  setServing(true);
  return true;
}

void Scheduler::replaceWorker(const std::string& why) {
  spdlog::warn("replacing worker incarnation {}: {}", worker_ ? worker_->hello().incarnation : 0,
               why);
  worker_.reset();  // SIGKILLs a worker that is still running
  // Every running sequence is replayed: its cache is gone, its history is not.
  uint64_t replayed = 0;
  for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
    (*it)->blocks.clear();
    (*it)->computed = 0;
    waiting_.push_front(std::move(*it));
    ++replayed;
  }
  running_.clear();
  for (auto& s : waiting_) {
    s->blocks.clear();
    s->computed = 0;
  }
  std::lock_guard lock(mu_);
  ++stats_.worker_restarts;
  stats_.replayed_sequences += replayed;
  ++worker_status_.restarts;
  worker_status_.last_failure = why;
  worker_status_.state = "starting";
}

void Scheduler::admit() {
  const uint32_t capacity = blocks_.total();
  while (!waiting_.empty() && running_.size() < options_.max_running) {
    Sequence& next = *waiting_.front();
    // Blocks for its whole history plus the token it will generate next.
    const uint32_t need = blocksFor(next.tokens.size() + 1);
    if (need > capacity) {
      auto seq = std::move(waiting_.front());
      waiting_.pop_front();
      finish(*seq, FinishReason::kNone,
             resourceExhausted("the sequence needs " + std::to_string(need) +
                               " KV blocks, the worker has " + std::to_string(capacity)));
      continue;
    }
    if (blocks_.freeCount() < need) break;  // first come, first served: no overtaking
    auto seq = std::move(waiting_.front());
    waiting_.pop_front();
    growBlocks(*seq, seq->tokens.size() + 1);
    running_.push_back(std::move(seq));
  }
}

bool Scheduler::stepOnce() {
  const WorkerHello& hello = worker_->hello();
  uint32_t budget = std::min(options_.max_batch_tokens, hello.max_step_tokens);
  uint32_t rows = 0;
  std::vector<Sequence*> batch;
  for (size_t i = 0; i < running_.size() && budget > 0 && rows < hello.arena_slots; ++i) {
    Sequence& s = *running_[i];
    const uint32_t remaining = uint32_t(s.tokens.size()) - s.computed;
    const uint32_t chunk = std::min(remaining, budget);
    if (chunk == 0) continue;
    while (!growBlocks(s, uint64_t(s.computed) + chunk)) {
      if (running_.back().get() == &s) break;
      preemptLast();
    }
    if (s.blocks.size() < blocksFor(uint64_t(s.computed) + chunk)) {
      preemptLast();  // this sequence is the newest and still does not fit
      break;
    }
    s.chunk = chunk;
    s.wants_row = s.computed + chunk == s.tokens.size();
    rows += s.wants_row ? 1 : 0;
    budget -= chunk;
    batch.push_back(&s);
  }
  if (batch.empty()) return false;

  std::vector<SequenceStep> steps;
  std::vector<uint32_t> row_index(batch.size());
  uint32_t tokens_in_step = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    Sequence& s = *batch[i];
    row_index[i] = s.chunk - 1;
    steps.push_back(
        {.sequence_id = s.id,
         .start_position = s.computed,
         .tokens = std::span(s.tokens).subspan(s.computed, s.chunk),
         .kv_blocks = s.blocks,
         .logits_rows = s.wants_row ? std::span(&row_index[i], 1) : std::span<const uint32_t>()});
    tokens_in_step += s.chunk;
  }
  const auto timeout =
      options_.step_timeout_base + std::chrono::duration_cast<std::chrono::milliseconds>(
                                       options_.step_timeout_per_token * tokens_in_step);
  auto result = worker_->step(next_step_id_++, steps, timeout);
  {
    std::lock_guard lock(mu_);
    ++stats_.steps;
  }
  if (!result.ok()) {
    const WorkerFailure& f = result.error();
    if (f.kind == WorkerFailure::Kind::kRejected) {
      // The worker refused input the broker validated: a broker bug, not the client's.
      spdlog::error("worker rejected a step: {}", f.toString());
      for (Sequence* s : batch) {
        s->wants_row = false;
        s->chunk = 0;
      }
      std::vector<std::unique_ptr<Sequence>> keep;
      for (auto& s : running_) {
        if (std::find(batch.begin(), batch.end(), s.get()) != batch.end()) {
          finish(*s, FinishReason::kNone, internalError("worker rejected the step: " + f.message));
        } else {
          keep.push_back(std::move(s));
        }
      }
      running_ = std::move(keep);
      return true;
    }
    if (f.kind == WorkerFailure::Kind::kIntegrityFailure) {
      {
        std::lock_guard lock(mu_);
        ++stats_.integrity_failures;
      }
      if (++step_failures_in_a_row_ <= options_.integrity_retries) {
        // Rows are never sampled from; the same step runs again (KV writes are idempotent).
        spdlog::warn("step rows failed verification, retrying: {}", f.toString());
        return true;
      }
    }
    step_failures_in_a_row_ = 0;
    replaceWorker(f.toString());
    return true;
  }
  step_failures_in_a_row_ = 0;

  size_t r = 0;
  uint64_t generated = 0;
  std::vector<Sequence*> finished;
  std::vector<FinishReason> reasons;
  for (Sequence* s : batch) {
    s->computed += s->chunk;
    if (!s->wants_row) continue;
    const std::span<const float> row = result->rows[r++];
    const uint64_t position = s->tokens.size();
    TokenChoice choice =
        sampler_.sample(row, s->request.sampling, std::span(s->tokens).first(s->prompt_len),
                        s->generated(), position);
    s->tokens.push_back(choice.token);
    ++generated;
    s->sink->onTokens({&choice, 1});
    FinishReason reason = FinishReason::kNone;
    const auto& stops = s->request.stop_token_ids;
    if (!s->request.ignore_eos &&
        std::find(model_.eos_token_ids.begin(), model_.eos_token_ids.end(), choice.token) !=
            model_.eos_token_ids.end()) {
      reason = FinishReason::kStop;
    } else if (std::find(stops.begin(), stops.end(), choice.token) != stops.end()) {
      reason = FinishReason::kStop;
    } else if (s->generated().size() >= s->request.max_tokens) {
      reason = FinishReason::kLength;
    } else if (s->tokens.size() >= model_.max_context) {
      reason = FinishReason::kContext;
    }
    if (reason != FinishReason::kNone) {
      finished.push_back(s);
      reasons.push_back(reason);
    }
  }
  for (size_t i = 0; i < finished.size(); ++i) finish(*finished[i], reasons[i], okStatus());
  std::erase_if(running_, [&](const std::unique_ptr<Sequence>& s) {
    return std::find(finished.begin(), finished.end(), s.get()) != finished.end();
  });
  std::lock_guard lock(mu_);
  stats_.tokens_generated += generated;
  return true;
}

void Scheduler::run() {
  while (true) {
    bool restart = false;
    {
      std::unique_lock lock(mu_);
      if (stopping_) break;
      while (!incoming_.empty()) {
        waiting_.push_back(std::move(incoming_.front()));
        incoming_.pop_front();
      }
      restart = restart_requested_;
    }
    if (restart) {
      const uint64_t old = worker_ ? worker_->hello().incarnation : 0;
      if (worker_) replaceWorker("restart requested by an operator");
      const bool ok = ensureWorker();
      std::lock_guard lock(mu_);
      if (ok) {
        last_restart_ = {old, worker_->hello().incarnation};
        restart_requested_ = false;
        idle_.notify_all();
      }
    }

    // Cancelled and expired requests give their blocks back within one step.
    const auto now = Clock::now();
    auto drop = [&](Sequence& s) -> bool {
      if (s.sink->cancelled()) {
        finish(s, FinishReason::kNone, Status(Code::kCancelled, "cancelled by the client"));
        return true;
      }
      if (s.request.deadline && now >= *s.request.deadline) {
        finish(
            s, FinishReason::kNone,
            Status(Code::kDeadlineExceeded,
                   "deadline exceeded after " + std::to_string(s.generated().size()) + " tokens"));
        return true;
      }
      return false;
    };
    std::erase_if(running_, [&](const std::unique_ptr<Sequence>& s) { return drop(*s); });
    std::erase_if(waiting_, [&](const std::unique_ptr<Sequence>& s) { return drop(*s); });

    bool worked = false;
    if (!ensureWorker()) {
      std::unique_lock lock(mu_);
      wake_.wait_for(lock, backoff_, [&] { return stopping_; });
      continue;
    }
    admit();
    if (!running_.empty()) worked = stepOnce();

    std::unique_lock lock(mu_);
    stats_.requests_running = uint32_t(running_.size());
    stats_.requests_waiting = uint32_t(waiting_.size());
    worker_status_.kv_blocks_free = blocks_.freeCount();
    if (running_.empty() && waiting_.empty() && incoming_.empty()) idle_.notify_all();
    if (!worked) {
      // Nothing to run: sleep until a submission, a restart request, or the nearest deadline.
      auto until = Clock::now() + std::chrono::seconds(1);
      for (const auto& s : waiting_) {
        if (s->request.deadline) until = std::min(until, *s->request.deadline);
      }
      wake_.wait_until(lock, until,
                       [&] { return stopping_ || !incoming_.empty() || restart_requested_; });
    }
  }
  // Shutting down: every open request ends.
  failAll(unavailable("the broker is shutting down"));
  {
    std::lock_guard lock(mu_);
    for (auto& s : incoming_)
      s->sink->onFinish(FinishReason::kNone, {}, unavailable("shutting down"));
    incoming_.clear();
    worker_status_.state = "stopped";
  }
  if (worker_) {
    (void)worker_->shutdown(std::chrono::seconds(10));
    worker_.reset();
  }
  setServing(false);
  idle_.notify_all();
}

}  // namespace bulkhead

// Scheduler: admission, step packing, preemption, sampling, token release, stop conditions,
// worker supervision, canary and fault-injection bookkeeping.
#include "broker/scheduler.h"

#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>

#include <spdlog/spdlog.h>

namespace bulkhead {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

double msBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace

struct Scheduler::Sequence {
  uint64_t id = 0;
  GenerationRequest request;
  std::shared_ptr<TokenSink> sink;
  std::vector<uint32_t> tokens;  // prompt followed by everything generated
  uint32_t prompt_len = 0;
  uint32_t computed = 0;  // tokens whose KV the current worker holds
  std::vector<uint32_t> blocks;
  // Generated tokens not yet sent: the step that produced each, and what to send.
  uint32_t released = 0;              // generated tokens already sent to the client
  std::vector<uint64_t> token_steps;  // per generated token
  std::vector<TokenChoice> unreleased;
  FinishReason finish_reason = FinishReason::kNone;
  // Set when assembling a step.
  uint32_t chunk = 0;
  bool wants_row = false;

  std::span<const uint32_t> generated() const { return std::span(tokens).subspan(prompt_len); }
  uint32_t generatedCount() const { return uint32_t(tokens.size()) - prompt_len; }
};

Scheduler::Scheduler(WorkerFactory factory, ModelLimits model, SchedulerOptions options)
    : factory_(std::move(factory)),
      model_(std::move(model)),
      options_(std::move(options)),
      canaries_(options_.state_dir) {
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
}

Scheduler::~Scheduler() {
  stop();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void Scheduler::start() {
  thread_ = std::thread([this] { run(); });
}

void Scheduler::stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  // Admin calls waiting on idle_ return now, even if the scheduling thread never ran.
  idle_.notify_all();
  notify();
  if (thread_.joinable()) thread_.join();
}

void Scheduler::notify() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
}

void Scheduler::waitForWork(Clock::time_point until) {
  // Wakes on a notification, on the worker process exiting, or at `until`.
  const auto left = std::chrono::duration_cast<milliseconds>(until - Clock::now()).count();
  pollfd fds[2] = {{wake_fd_, POLLIN, 0}, {-1, POLLIN, 0}};
  int count = 1;
  if (worker_ && worker_->exitFd() >= 0) {
    fds[1].fd = worker_->exitFd();
    count = 2;
  }
  if (::poll(fds, nfds_t(count), int(std::clamp<int64_t>(left, 0, 60'000))) > 0) {
    uint64_t value;
    [[maybe_unused]] ssize_t n = ::read(wake_fd_, &value, sizeof(value));
  }
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
    if (serving && draining_) return;  // a drained broker stays NOT_SERVING
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
  notify();
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

Result<uint32_t> Scheduler::drain(milliseconds timeout) {
  std::unique_lock lock(mu_);
  draining_ = true;
  finished_while_draining_ = 0;
  lock.unlock();
  notify();
  lock.lock();
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

Result<std::pair<uint64_t, uint64_t>> Scheduler::restartWorker(milliseconds timeout) {
  std::unique_lock lock(mu_);
  restart_requested_ = true;
  lock.unlock();
  notify();
  lock.lock();
  const bool done = idle_.wait_for(lock, timeout, [&] { return !restart_requested_ || stopping_; });
  if (!done || restart_requested_) return unavailable("restart did not complete in time");
  return last_restart_;
}

Result<InjectionOutcome> Scheduler::injectFault(ChaosFault fault, uint64_t random,
                                                milliseconds timeout) {
  auto injection = std::make_shared<Injection>();
  injection->fault = fault;
  injection->random = random;
  std::unique_lock lock(mu_);
  if (injection_) return failedPrecondition("another injection is in progress");
  injection_ = injection;
  lock.unlock();
  notify();
  lock.lock();
  const bool settled = idle_.wait_for(lock, timeout, [&] {
    return stopping_ || injection->recovered_at != Clock::time_point{} ||
           (injection->applied && injection->at == Clock::time_point{});
  });
  injection_.reset();
  if (injection->applied && injection->at == Clock::time_point{})
    return failedPrecondition(injection->detected_as);  // refused by the worker
  InjectionOutcome out;
  out.detected = injection->detected_at != Clock::time_point{};
  out.recovered = injection->recovered_at != Clock::time_point{};
  out.detected_as = injection->detected_as;
  if (out.detected) out.detection_ms = msBetween(injection->at, injection->detected_at);
  if (out.recovered) out.recovery_ms = msBetween(injection->detected_at, injection->recovered_at);
  (void)settled;
  return out;
}

// Runs on the scheduler thread: applies a pending injection to the current worker.
void Scheduler::applyInjection() {
  std::shared_ptr<Injection> inj;
  {
    std::lock_guard lock(mu_);
    if (!injection_ || injection_->applied) return;
    inj = injection_;
  }
  if (!worker_) return;  // wait for a worker
  const uint64_t r = inj->random;
  WorkerFailure armed;
  const milliseconds rpc(5'000);
  switch (inj->fault) {
    case ChaosFault::kWorkerKill:
      worker_->kill(SIGKILL);
      break;
    case ChaosFault::kWorkerHang:
      worker_->kill(SIGSTOP);
      break;
    case ChaosFault::kWeightBitflip:
      armed = worker_->injectFault(
          {.kind = FaultKind::kWeightBitflip,
           .byte_offset = r % std::max<uint64_t>(1, worker_->hello().weight_bytes),
           .bit = uint8_t((r >> 56) % 8)},
          rpc);
      break;
    case ChaosFault::kLogitsCorrupt:
      armed =
          worker_->injectFault({.kind = FaultKind::kCorruptPayload, .row = uint32_t(r % 64)}, rpc);
      break;
    case ChaosFault::kLogitsNan:
      armed = worker_->injectFault({.kind = FaultKind::kNanRow, .row = uint32_t(r % 64)}, rpc);
      break;
    case ChaosFault::kTornWrite:
      armed = worker_->injectFault({.kind = FaultKind::kTornWrite, .row = uint32_t(r % 64)}, rpc);
      break;
    case ChaosFault::kStaleEpoch:
      armed = worker_->injectFault(
          {.kind = (r & 1) ? FaultKind::kStaleIncarnation : FaultKind::kStaleStep,
           .row = uint32_t((r >> 1) % 64)},
          rpc);
      break;
    case ChaosFault::kSlowStep: {
      // Slower than the step deadline: the supervisor must notice and replace the worker.
      const auto delay = options_.step_timeout_base * 3;
      armed = worker_->injectFault(
          {.kind = FaultKind::kSlowStep, .delay_ms = uint32_t(delay.count())}, rpc);
      break;
    }
  }
  std::lock_guard lock(mu_);
  inj->applied = true;
  if (!armed.ok()) {
    inj->detected_as = "injection refused: " + armed.toString();
    idle_.notify_all();
    return;
  }
  inj->at = Clock::now();
}

void Scheduler::recordFailure(const std::string& what) {
  std::lock_guard lock(mu_);
  if (injection_ && injection_->applied && injection_->at != Clock::time_point{} &&
      injection_->detected_at == Clock::time_point{}) {
    injection_->detected_at = Clock::now();
    injection_->detected_as = what;
  }
}

void Scheduler::recordSuccess() {
  std::lock_guard lock(mu_);
  if (injection_ && injection_->detected_at != Clock::time_point{} &&
      injection_->recovered_at == Clock::time_point{}) {
    injection_->recovered_at = Clock::now();
    idle_.notify_all();
  }
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

void Scheduler::freeBlocks(Sequence& seq) {
  for (uint32_t b : seq.blocks) blocks_.release(b);
  seq.blocks.clear();
  seq.computed = 0;
}

bool Scheduler::hasUnreleased() const {
  if (!finishing_.empty()) return true;
  for (const auto& s : running_)
    if (!s->unreleased.empty()) return true;
  return false;
}

void Scheduler::finish(Sequence& seq, FinishReason reason, const Status& status) {
  freeBlocks(seq);
  Usage usage{seq.prompt_len, seq.released, seq.request.sampling.seed};
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
  for (auto* list : {&running_, &finishing_}) {
    for (auto& s : *list) finish(*s, FinishReason::kNone, status);
    list->clear();
  }
  for (auto& s : waiting_) finish(*s, FinishReason::kNone, status);
  waiting_.clear();
}

void Scheduler::preemptLast() {
  // Recompute: the newest running sequence gives its blocks back and waits again, keeping its
  // whole history; it will be re-prefilled when blocks free up.
  std::unique_ptr<Sequence> victim = std::move(running_.back());
  running_.pop_back();
  freeBlocks(*victim);
  waiting_.push_front(std::move(victim));
  std::lock_guard lock(mu_);
  ++stats_.preemptions;
}

FinishReason Scheduler::stopReason(const Sequence& s) const {
  if (s.generatedCount() == 0) return FinishReason::kNone;
  const uint32_t token = s.tokens.back();
  const auto& stops = s.request.stop_token_ids;
  const auto& eos = model_.eos_token_ids;
  if (!s.request.ignore_eos && std::find(eos.begin(), eos.end(), token) != eos.end())
    return FinishReason::kStop;
  if (std::find(stops.begin(), stops.end(), token) != stops.end()) return FinishReason::kStop;
  if (s.generatedCount() >= s.request.max_tokens) return FinishReason::kLength;
  if (s.tokens.size() >= model_.max_context) return FinishReason::kContext;
  return FinishReason::kNone;
}

// Every sequence the worker was computing loses its cache. Those whose history still ends in a
// stop wait only for their tokens to be released; the rest go back to waiting, in order.
void Scheduler::requeueAll() {
  std::vector<std::unique_ptr<Sequence>> all;
  for (auto& s : running_) all.push_back(std::move(s));
  for (auto& s : finishing_) all.push_back(std::move(s));
  running_.clear();
  finishing_.clear();
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a->id < b->id; });
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    freeBlocks(**it);
    (*it)->finish_reason = stopReason(**it);
    if ((*it)->finish_reason != FinishReason::kNone) {
      finishing_.push_back(std::move(*it));
    } else {
      waiting_.push_front(std::move(*it));
    }
  }
  std::reverse(finishing_.begin(), finishing_.end());
  for (auto& s : waiting_) freeBlocks(*s);
}

// Forgets every token produced by step `from_step` or later; none of them was sent.
void Scheduler::rollBack(uint64_t from_step) {
  uint64_t dropped = 0;
  auto cut = [&](Sequence& s) {
    size_t keep = s.released;
    while (keep < s.token_steps.size() && s.token_steps[keep] < from_step) ++keep;
    const size_t drop = s.token_steps.size() - keep;
    if (drop == 0) return;
    s.tokens.resize(s.tokens.size() - drop);
    s.token_steps.resize(keep);
    s.unreleased.resize(s.unreleased.size() - drop);
    dropped += drop;
  };
  for (auto& s : running_) cut(*s);
  for (auto& s : finishing_) cut(*s);
  for (auto& s : waiting_) cut(*s);
  uint64_t replayed = running_.size() + finishing_.size();
  requeueAll();
  spdlog::warn("rolled back {} unsent tokens from step {} on; replaying {} sequences", dropped,
               from_step, replayed);
  std::lock_guard lock(mu_);
  stats_.replayed_sequences += replayed;
}

void Scheduler::release(uint64_t clean_through) {
  auto send = [&](Sequence& s) {
    size_t n = 0;
    while (n < s.unreleased.size() && s.token_steps[s.released + n] <= clean_through) ++n;
    if (n == 0) return;
    s.sink->onTokens(std::span(s.unreleased).first(n));
    s.unreleased.erase(s.unreleased.begin(), s.unreleased.begin() + long(n));
    s.released += uint32_t(n);
  };
  for (auto& s : running_) send(*s);
  for (auto& s : finishing_) send(*s);
  std::erase_if(finishing_, [&](std::unique_ptr<Sequence>& s) {
    if (!s->unreleased.empty()) return false;
    finish(*s, s->finish_reason, okStatus());
    return true;
  });
}

void Scheduler::applyScrub(const ScrubStatus& scrub) {
  if (!scrub.corruptions.empty()) {
    uint64_t from = UINT64_MAX;
    for (const auto& c : scrub.corruptions) {
      spdlog::error(
          "worker repaired corrupted weights in {} (bytes {}..{}); steps from {} replayed",
          c.tensor, c.offset, c.offset + c.bytes, c.suspect_from_step);
      from = std::min(from, c.suspect_from_step);
    }
    {
      std::lock_guard lock(mu_);
      stats_.weight_corruptions += scrub.corruptions.size();
    }
    recordFailure("weight corruption in " + scrub.corruptions[0].tensor);
    rollBack(from);
    return;
  }
  release(worker_->hello().scrubbing ? scrub.clean_through : UINT64_MAX);
}

bool Scheduler::passesCanary() {
  const WorkerHello& h = worker_->hello();
  const std::vector<uint32_t> tokens = canaryTokens(h.vocab_size);
  std::vector<uint32_t> blocks;
  for (uint32_t b = 0; b < blocksFor(tokens.size()); ++b) blocks.push_back(b);
  // The last row only: it depends on every token and layer, and on no broker setting.
  const std::vector<uint32_t> rows = {uint32_t(tokens.size() - 1)};
  if (blocks.size() > h.kv_block_count || h.max_step_tokens < tokens.size()) {
    spdlog::warn("the worker is too small for the canary; serving without it");
    return true;
  }
  SequenceStep step{.sequence_id = 0,
                    .start_position = 0,
                    .tokens = tokens,
                    .kv_blocks = blocks,
                    .logits_rows = rows};
  auto result = worker_->step(next_step_id_++, {&step, 1}, options_.step_timeout_base);
  last_canary_ = Clock::now();
  {
    std::lock_guard lock(mu_);
    ++stats_.canary_runs;
  }
  std::string why;
  if (!result.ok()) {
    why = "canary step failed: " + result.error().toString();
  } else if (!result->scrub.corruptions.empty()) {
    why = "canary: worker found corrupted weights in " + result->scrub.corruptions[0].tensor;
  } else {
    Status s =
        canaries_.check(h.model_identity, h.backend, h.weight_digest, canaryDigest(result->rows));
    if (s.ok()) return true;
    why = s.message();
  }
  spdlog::error("worker incarnation {} quarantined: {}", h.incarnation, why);
  {
    std::lock_guard lock(mu_);
    ++stats_.canary_failures;
  }
  recordFailure(why);
  replaceWorker(why);
  return false;
}

bool Scheduler::ensureWorker() {
  if (worker_) return true;
  if (Clock::now() < next_start_at_) return false;
  const uint64_t incarnation = next_incarnation_++;
  {
    std::lock_guard lock(mu_);
    if (worker_status_.state != "failed") worker_status_.state = "starting";
  }
  auto started = factory_(incarnation);
  if (started.ok()) {
    worker_ = std::move(*started);
    if (worker_->hello().vocab_size != model_.vocab_size) {
      const std::string why = "worker reports vocabulary " +
                              std::to_string(worker_->hello().vocab_size) + ", the model has " +
                              std::to_string(model_.vocab_size);
      replaceWorker(why);
      return false;
    }
    blocks_.reset(worker_->hello().kv_block_count);
    worker_proven_ = false;
    last_contact_ = Clock::now();
    if (!passesCanary()) return false;
    const WorkerHello& h = worker_->hello();
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
  const std::string why = started.error().toString();
  spdlog::error("worker start {} failed: {}", incarnation, why);
  {
    std::lock_guard lock(mu_);
    worker_status_.last_failure = why;
  }
  recordFailure("start failed: " + why);
  // Counted like any other failure of a worker that never completed a step.
  worker_proven_ = false;
  replaceWorker(why);
  return false;
}

void Scheduler::replaceWorker(const std::string& why) {
  const bool had_worker = worker_ != nullptr;
  if (had_worker) {
    spdlog::warn("replacing worker incarnation {}: {}", worker_->hello().incarnation, why);
  }
  worker_.reset();  // SIGKILLs a worker that is still running
  // Nothing the old worker computed after its last verified step can be vouched for now.
  uint64_t replayed = 0;
  for (auto* list : {&running_, &finishing_}) replayed += list->size();
  auto forget = [](Sequence& s) {
    s.tokens.resize(s.tokens.size() - s.unreleased.size());
    s.token_steps.resize(s.released);
    s.unreleased.clear();
  };
  for (auto* list : {&running_, &finishing_})
    for (auto& s : *list) forget(*s);
  for (auto& s : waiting_) forget(*s);
  requeueAll();
  // Crash-loop accounting: failures of workers that never completed a step accumulate.
  consecutive_failures_ = worker_proven_ ? 1 : consecutive_failures_ + 1;
  worker_proven_ = false;
  const auto backoff = std::min<milliseconds>(
      options_.restart_backoff_max,
      options_.restart_backoff_initial * (1u << std::min<uint32_t>(consecutive_failures_ - 1, 16)));
  next_start_at_ = Clock::now() + (consecutive_failures_ > 1 ? backoff : milliseconds(0));
  bool now_failed = false;
  {
    std::lock_guard lock(mu_);
    if (had_worker) {
      ++stats_.worker_restarts;
      ++worker_status_.restarts;
    }
    stats_.replayed_sequences += replayed;
    worker_status_.last_failure = why;
    if (consecutive_failures_ >= options_.max_consecutive_failures) {
      now_failed = worker_status_.state != "failed";
      worker_status_.state = "failed";
    } else if (worker_status_.state != "failed") {
      worker_status_.state = "starting";
    }
  }
  if (now_failed) {
    spdlog::error("worker failed {} times in a row; failing requests until a start succeeds",
                  consecutive_failures_);
    setServing(false);
    failAll(unavailable("no healthy worker: " + why));
  }
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
      options_.step_timeout_base +
      std::chrono::duration_cast<milliseconds>(options_.step_timeout_per_token * tokens_in_step);
  const uint64_t step_id = next_step_id_++;
  auto result = worker_->step(step_id, steps, timeout);
  {
    std::lock_guard lock(mu_);
    ++stats_.steps;
  }
  if (!result.ok()) {
    const WorkerFailure& f = result.error();
    recordFailure(std::string(workerFailureKindName(f.kind)) +
                  (f.kind == WorkerFailure::Kind::kIntegrityFailure
                       ? " (" + std::string(integrityCheckName(f.check)) + ")"
                       : ""));
    if (f.kind == WorkerFailure::Kind::kRejected) {
      // The worker refused input the broker validated: a broker bug, not the client's.
      spdlog::error("worker rejected a step: {}", f.toString());
      std::erase_if(running_, [&](std::unique_ptr<Sequence>& s) {
        if (std::find(batch.begin(), batch.end(), s.get()) == batch.end()) return false;
        finish(*s, FinishReason::kNone, internalError("worker rejected the step: " + f.message));
        return true;
      });
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
  last_contact_ = Clock::now();
  worker_proven_ = true;
  consecutive_failures_ = 0;
  recordSuccess();

  if (!result->scrub.corruptions.empty()) {
    applyScrub(result->scrub);  // rolls back: this step's rows are not sampled
    return true;
  }
  size_t r = 0;
  uint64_t generated = 0;
  for (Sequence* s : batch) {
    s->computed += s->chunk;
    if (!s->wants_row) continue;
    const std::span<const float> row = result->rows[r++];
    const uint64_t position = s->tokens.size();
    TokenChoice choice =
        sampler_.sample(row, s->request.sampling, std::span(s->tokens).first(s->prompt_len),
                        s->generated(), position);
    s->tokens.push_back(choice.token);
    s->token_steps.push_back(step_id);
    s->unreleased.push_back(std::move(choice));
    ++generated;
    s->finish_reason = stopReason(*s);
  }
  // Stopped sequences give their blocks back now and wait for their last tokens to be released.
  std::erase_if(running_, [&](std::unique_ptr<Sequence>& s) {
    if (s->finish_reason == FinishReason::kNone) return false;
    freeBlocks(*s);
    finishing_.push_back(std::move(s));
    return true;
  });
  applyScrub(result->scrub);
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
      if (worker_) {
        replaceWorker("restart requested by an operator");
        consecutive_failures_ = 0;
        next_start_at_ = Clock::now();
      }
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
        finish(s, FinishReason::kNone,
               Status(Code::kDeadlineExceeded,
                      "deadline exceeded after " + std::to_string(s.released) + " tokens"));
        return true;
      }
      return false;
    };
    std::erase_if(running_, [&](const std::unique_ptr<Sequence>& s) { return drop(*s); });
    std::erase_if(finishing_, [&](const std::unique_ptr<Sequence>& s) { return drop(*s); });
    std::erase_if(waiting_, [&](const std::unique_ptr<Sequence>& s) { return drop(*s); });

    bool worked = false;
    if (worker_ && worker_->exitFd() >= 0) {
      // A worker that died while idle is noticed here, not at the next request.
      pollfd p{worker_->exitFd(), POLLIN, 0};
      if (::poll(&p, 1, 0) > 0) {
        recordFailure("worker exited");
        replaceWorker("worker process exited while idle");
      }
    }
    if (ensureWorker()) {
      applyInjection();
      admit();
      if (!running_.empty()) {
        worked = stepOnce();
      } else if (worker_ && hasUnreleased()) {
        // Nothing left to compute: ask the worker to vouch for its last steps.
        auto scrub = worker_->ping(options_.step_timeout_base);
        if (scrub.ok()) {
          last_contact_ = Clock::now();
          applyScrub(*scrub);
        } else {
          recordFailure(std::string(workerFailureKindName(scrub.error().kind)));
          replaceWorker(scrub.error().toString());
        }
        worked = true;
      } else if (worker_ && options_.canary_interval.count() > 0 &&
                 Clock::now() - last_canary_ >= options_.canary_interval) {
        passesCanary();
        last_contact_ = Clock::now();
      } else if (worker_ && Clock::now() - last_contact_ >= options_.heartbeat_interval) {
        WorkerFailure beat = worker_->heartbeat(options_.step_timeout_base);
        if (beat.ok()) {
          last_contact_ = Clock::now();
        } else {
          recordFailure(std::string(workerFailureKindName(beat.kind)));
          replaceWorker("heartbeat: " + beat.toString());
        }
      }
    }

    std::unique_lock lock(mu_);
    stats_.requests_running = uint32_t(running_.size() + finishing_.size());
    stats_.requests_waiting = uint32_t(waiting_.size());
    worker_status_.kv_blocks_free = blocks_.freeCount();
    if (running_.empty() && waiting_.empty() && finishing_.empty() && incoming_.empty())
      idle_.notify_all();
    if (worked || !incoming_.empty() || stopping_) continue;
    // Nothing to run: sleep until a submission, the worker exiting, the next start attempt,
    // the nearest deadline, or the next canary.
    auto until = Clock::now() + std::chrono::seconds(1);
    if (!worker_) until = std::min(until, next_start_at_);
    for (const auto& s : waiting_)
      if (s->request.deadline) until = std::min(until, *s->request.deadline);
    if (worker_ && options_.canary_interval.count() > 0)
      until = std::min(until, last_canary_ + options_.canary_interval);
    if (worker_) until = std::min(until, last_contact_ + options_.heartbeat_interval);
    lock.unlock();
    waitForWork(until);
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
  std::lock_guard lock(mu_);
  idle_.notify_all();
}

}  // namespace bulkhead

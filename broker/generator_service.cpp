// Generator and Admin services.
//
// Threads, what each owns and how they meet:
// - The scheduler thread produces tokens and verdicts. Through GrpcSink it only appends them to
//   the stream's StreamChannel queue (StreamChannel::queue_mu, held for the append) and, when the
//   stream is not already waiting for a writer, posts the channel to the StreamWriters queue. It
//   never builds a protobuf, touches a reactor or waits on the network.
// - The writer threads (StreamWriters, owned by GeneratorService, joined by its stop()) take a
//   posted channel, swap its queue out, build GenerateResponse messages into the reactor and
//   start the write, or Finish, under StreamChannel::mu. One writer at a time per stream (the
//   channel stays "scheduled" until its queue is seen empty), so tokens keep their order.
// - gRPC's callback threads run Generate (validation, submit), OnWriteDone (starts the message
//   the writers batched meanwhile, or Finish), OnCancel and OnDone. OnDone detaches the reactor
//   from the channel under StreamChannel::mu; later hand-offs are dropped, so neither side
//   outlives the other's memory.
// - AdminService's executor runs Drain, RestartWorker and InjectFault, one owned thread each
//   (AdminExecutor), joined by AdminService::stop() once Scheduler::stop() has ended their waits.
// Locks: StreamChannel::queue_mu and StreamChannel::mu are never held together; the writers'
// queue lock is taken with neither held. StreamChannel::mu is recursive because gRPC may run a
// reaction (OnWriteDone) inline from StartWrite.
#include "broker/generator_service.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

#include <spdlog/spdlog.h>

#include "broker/request_validation.h"

namespace bulkhead {

class GenerateReactor;

// How a stream ends: the scheduler's onFinish, kept until a writer delivers it.
struct Verdict {
  FinishReason reason = FinishReason::kNone;
  Usage usage;
  Status status;
};

struct StreamChannel {
  explicit StreamChannel(std::string id) : request_id(std::move(id)) {}

  const std::string request_id;
  // Set by OnCancel or a failed write; the scheduler reads it and frees the sequence.
  std::atomic<bool> cancelled{false};

  // The hand-off from the scheduler thread.
  std::mutex queue_mu;
  std::vector<TokenChoice> queued;  // GUARDED_BY(queue_mu)
  std::optional<Verdict> verdict;   // GUARDED_BY(queue_mu)
  // Posted to the writers or being written by one; cleared by the writer that finds the queue
  // empty. GUARDED_BY(queue_mu)
  bool scheduled = false;

  // The reactor side.
  std::recursive_mutex mu;
  GenerateReactor* reactor = nullptr;  // GUARDED_BY(mu); null once the RPC is done
};

namespace {

v1::FinishReason toProto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case FinishReason::kStop:
      return v1::FINISH_REASON_STOP;
    case FinishReason::kContext:
      return v1::FINISH_REASON_CONTEXT;
    case FinishReason::kNone:
      break;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

}  // namespace

class GenerateReactor final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  explicit GenerateReactor(std::shared_ptr<StreamChannel> channel) : channel_(std::move(channel)) {
    channel_->reactor = this;
  }

  // With channel->mu held, on a writer thread.
  void push(std::span<const TokenChoice> tokens) {
    // While a write is in flight, new tokens join the last queued message.
    if (pending_.size() < 2) pending_.emplace_back();
    v1::GenerateResponse& r = pending_.back();
    for (const TokenChoice& t : tokens) {
      r.add_token_ids(t.token);
      if (!t.has_logprob) continue;
      v1::TokenLogprobs* lp = r.add_logprobs();
      lp->set_logprob(t.logprob);
      for (const auto& [id, logprob] : t.top) {
        v1::TokenLogprob* alt = lp->add_top();
        alt->set_token_id(id);
        alt->set_logprob(logprob);
      }
    }
    startNext();
  }

  // With channel->mu held: on a writer thread, or in Generate for a request never scheduled.
  void finishWith(const Verdict& verdict) {
    if (finish_pending_) return;  // exactly once
    if (verdict.status.ok()) {
      if (pending_.size() < 2) pending_.emplace_back();
      v1::GenerateResponse& r = pending_.back();
      r.set_finish_reason(toProto(verdict.reason));
      r.mutable_usage()->set_prompt_tokens(verdict.usage.prompt_tokens);
      r.mutable_usage()->set_completion_tokens(verdict.usage.completion_tokens);
      r.mutable_usage()->set_seed(verdict.usage.seed);
      r.set_request_id(channel_->request_id);
    }
    final_status_ = toGrpcStatus(verdict.status);
    finish_pending_ = true;
    startNext();
  }

  // With channel->mu held, in Generate: a refusal that is not the scheduler's (authorization).
  void finishWithStatus(const grpc::Status& status) {
    if (finish_pending_) return;
    final_status_ = status;
    finish_pending_ = true;
    startNext();
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard lock(channel_->mu);
    pending_.pop_front();
    writing_ = false;
    if (!ok) {
      // The client is gone: no more writes; the scheduler sees the flag and frees the sequence.
      channel_->cancelled = true;
      pending_.clear();
    }
    startNext();
  }

  void OnCancel() override { channel_->cancelled = true; }

  void OnDone() override {
    {
      std::lock_guard lock(channel_->mu);
      channel_->reactor = nullptr;
    }
    delete this;
  }

 private:
  // Starts writing the front message, or finishes once everything is written. With channel->mu.
  void startNext() {
    if (writing_ || finished_) return;
    if (!pending_.empty() && !channel_->cancelled) {
      writing_ = true;
      StartWrite(&pending_.front());
      return;
    }
    // Cancelled: Finish still waits for the scheduler's verdict, which frees the sequence first.
    if (!finish_pending_) return;
    finished_ = true;
    Finish(final_status_);
  }

  std::shared_ptr<StreamChannel> channel_;
  std::deque<v1::GenerateResponse> pending_;  // front is being written when writing_
  bool writing_ = false;
  bool finish_pending_ = false;
  bool finished_ = false;
  grpc::Status final_status_;
};

class StreamWriters {
 public:
  explicit StreamWriters(size_t threads) {
    for (size_t i = 0; i < std::max<size_t>(threads, 1); ++i)
      threads_.emplace_back([this] { run(); });
  }
  ~StreamWriters() { stop(); }

  // Queues `channel`, whose `scheduled` flag the caller has just set, for a writer.
  void post(std::shared_ptr<StreamChannel> channel) {
    {
      std::lock_guard lock(mu_);
      if (!stopping_) {
        ready_.push_back(std::move(channel));
        ready_cv_.notify_one();
        return;
      }
    }
    // Only after stop(), when the scheduler has stopped too: nothing else would write it.
    std::vector<TokenChoice> buffer;
    pump(*channel, buffer);
  }

  // Writes everything posted so far, then joins the threads.
  void stop() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    ready_cv_.notify_all();
    for (auto& t : threads_)
      if (t.joinable()) t.join();
  }

 private:
  void run() {
    std::vector<TokenChoice> buffer;  // reused, so a steady stream allocates little
    std::unique_lock lock(mu_);
    for (;;) {
      ready_cv_.wait(lock, [&] { return !ready_.empty() || stopping_; });
      if (ready_.empty()) return;  // stopping, and nothing left to write
      std::shared_ptr<StreamChannel> channel = std::move(ready_.front());
      ready_.pop_front();
      lock.unlock();
      pump(*channel, buffer);
      channel.reset();
      lock.lock();
    }
  }

  // Hands everything queued on `channel` to its reactor, until the queue is found empty.
  static void pump(StreamChannel& channel, std::vector<TokenChoice>& buffer) {
    for (;;) {
      std::optional<Verdict> verdict;
      buffer.clear();
      {
        std::lock_guard lock(channel.queue_mu);
        if (channel.queued.empty() && !channel.verdict) {
          channel.scheduled = false;
          return;
        }
        std::swap(buffer, channel.queued);
        verdict.swap(channel.verdict);
      }
      std::lock_guard lock(channel.mu);
      if (!channel.reactor) continue;  // the RPC is over: drop
      if (!buffer.empty()) channel.reactor->push(buffer);
      if (verdict) channel.reactor->finishWith(*verdict);
    }
  }

  std::mutex mu_;
  std::condition_variable ready_cv_;
  std::deque<std::shared_ptr<StreamChannel>> ready_;  // GUARDED_BY(mu_)
  bool stopping_ = false;                             // GUARDED_BY(mu_)
  std::vector<std::thread> threads_;
};

namespace {

class GrpcSink final : public TokenSink {
 public:
  GrpcSink(std::shared_ptr<StreamChannel> channel, StreamWriters& writers)
      : channel_(std::move(channel)), writers_(writers) {}

  // On the scheduler thread: append and signal, nothing more.
  void onTokens(std::span<const TokenChoice> tokens) override {
    if (channel_->cancelled) return;  // nobody will read them
    bool post;
    {
      std::lock_guard lock(channel_->queue_mu);
      channel_->queued.insert(channel_->queued.end(), tokens.begin(), tokens.end());
      post = !std::exchange(channel_->scheduled, true);
    }
    if (post) writers_.post(channel_);
  }
  void onFinish(FinishReason reason, const Usage& usage, const Status& status) override {
    bool post;
    {
      std::lock_guard lock(channel_->queue_mu);
      channel_->verdict = Verdict{reason, usage, status};
      post = !std::exchange(channel_->scheduled, true);
    }
    if (post) writers_.post(channel_);
  }
  bool cancelled() const override { return channel_->cancelled; }

 private:
  std::shared_ptr<StreamChannel> channel_;
  StreamWriters& writers_;
};

}  // namespace

grpc::Status toGrpcStatus(const Status& status) {
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), status.message());
}

GeneratorService::GeneratorService(Router& router, ModelLimits model, const Authorizer& auth,
                                   size_t writer_threads)
    : router_(router),
      model_(std::move(model)),
      auth_(auth),
      writers_(std::make_unique<StreamWriters>(writer_threads)) {}

GeneratorService::~GeneratorService() {
  stop();
}

void GeneratorService::stop() {
  writers_->stop();
}

grpc::ServerWriteReactor<v1::GenerateResponse>* GeneratorService::Generate(
    grpc::CallbackServerContext* context, const v1::GenerateRequest* request) {
  auto channel = std::make_shared<StreamChannel>(request->request_id());
  auto* reactor = new GenerateReactor(channel);
  // Requests that never reach the scheduler are answered here, on gRPC's thread.
  auto reject = [&](const Status& status) {
    std::lock_guard lock(channel->mu);
    reactor->finishWith(Verdict{FinishReason::kNone, {}, status});
  };
  if (const grpc::Status allowed = auth_.check(*context, Authorizer::Api::kGenerate);
      !allowed.ok()) {
    std::lock_guard lock(channel->mu);
    reactor->finishWithStatus(allowed);
    return reactor;
  }
  auto valid = validateRequest(*request, model_);
  if (!valid.ok()) {
    reject(valid.status());
    return reactor;
  }
  const auto deadline = context->deadline();
  if (deadline != std::chrono::system_clock::time_point::max()) {
    valid->deadline = std::chrono::steady_clock::now() +
                      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                          deadline - std::chrono::system_clock::now());
  }
  Status submitted =
      router_.submit(std::move(*valid), std::make_shared<GrpcSink>(channel, *writers_));
  if (!submitted.ok()) reject(submitted);
  return reactor;
}

grpc::ServerUnaryReactor* AdminService::refused(grpc::CallbackServerContext* context) const {
  const grpc::Status allowed = auth_.check(*context, Authorizer::Api::kAdmin);
  if (allowed.ok()) return nullptr;
  auto* reactor = context->DefaultReactor();
  reactor->Finish(allowed);
  return reactor;
}

grpc::ServerUnaryReactor* AdminService::ListWorkers(grpc::CallbackServerContext* context,
                                                    const v1::ListWorkersRequest*,
                                                    v1::ListWorkersResponse* response) {
  if (auto* refusal = refused(context)) return refusal;
  for (const WorkerView& view : router_.workers()) {
    const WorkerStatus& w = view.status;
    v1::WorkerInfo* info = response->add_workers();
    info->set_name(view.name);
    info->set_state(view.draining ? "draining" : w.state);
    info->set_incarnation(w.incarnation);
    info->set_pid(w.pid);
    info->set_backend(w.backend);
    info->set_kv_blocks_total(w.kv_blocks_total);
    info->set_kv_blocks_free(w.kv_blocks_free);
    info->set_restarts(w.restarts);
    info->set_last_failure(w.last_failure);
    info->set_requests_running(view.stats.requests_running);
    info->set_requests_waiting(view.stats.requests_waiting);
    info->set_tokens_generated(view.stats.tokens_generated);
    info->set_steps(view.stats.steps);
    info->set_migrated_sequences(view.stats.migrated_sequences);
    info->set_resident_weight_bytes(w.weight_bytes);
    info->set_streamed_weight_bytes(w.streamed_weight_bytes);
  }
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* AdminService::GetStats(grpc::CallbackServerContext* context,
                                                 const v1::GetStatsRequest*, v1::Stats* out) {
  if (auto* refusal = refused(context)) return refusal;
  const SchedulerStats s = router_.stats();
  out->set_requests_received(s.requests_received);
  out->set_requests_completed(s.requests_completed);
  out->set_requests_failed(s.requests_failed);
  out->set_requests_rejected(s.requests_rejected);
  out->set_requests_running(s.requests_running);
  out->set_requests_waiting(s.requests_waiting);
  out->set_tokens_generated(s.tokens_generated);
  out->set_steps(s.steps);
  out->set_preemptions(s.preemptions);
  out->set_worker_restarts(s.worker_restarts);
  out->set_replayed_sequences(s.replayed_sequences);
  out->set_rolled_back_tokens(s.rolled_back_tokens);
  out->set_integrity_failures(s.integrity_failures);
  out->set_weight_corruptions(s.weight_corruptions);
  out->set_canary_runs(s.canary_runs);
  out->set_canary_failures(s.canary_failures);
  out->set_release_latency_ms_p50(s.release_latency_ms_p50);
  out->set_release_latency_ms_p99(s.release_latency_ms_p99);
  out->set_step_ms_p50(s.step_ms_p50);
  out->set_compute_ms_p50(s.compute_ms_p50);
  out->set_sample_ms_p50(s.sample_ms_p50);
  out->set_between_steps_ms_p50(s.between_steps_ms_p50);
  out->set_steps_overlapped(s.steps_overlapped);
  out->set_migrated_sequences(s.migrated_sequences);
  out->set_migration_ms_p50(s.migration_ms_p50);
  out->set_migration_ms_p99(s.migration_ms_p99);
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* AdminService::RestartWorker(grpc::CallbackServerContext* context,
                                                      const v1::RestartWorkerRequest* request,
                                                      v1::RestartWorkerResponse* response) {
  if (auto* refusal = refused(context)) return refusal;
  auto* reactor = context->DefaultReactor();
  // Restarting waits for a new worker: off the callback thread.
  Status started = executor_.submit([this, reactor, response, name = request->name()] {
    auto r = router_.restartWorker(name, Scheduler::kRestartTimeout);
    if (r.ok()) {
      response->set_old_incarnation(r->first);
      response->set_new_incarnation(r->second);
    }
    reactor->Finish(r.ok() ? grpc::Status::OK : toGrpcStatus(r.status()));
  });
  if (!started.ok()) reactor->Finish(toGrpcStatus(started));
  return reactor;
}

grpc::ServerUnaryReactor* AdminService::Drain(grpc::CallbackServerContext* context,
                                              const v1::DrainRequest* request,
                                              v1::DrainResponse* response) {
  if (auto* refusal = refused(context)) return refusal;
  auto* reactor = context->DefaultReactor();
  // Draining waits for running requests to end (or to move): off the callback thread.
  Status started = executor_.submit([this, reactor, response, worker = request->worker()] {
    if (!worker.empty()) {
      auto moved = router_.drainWorker(worker, std::chrono::minutes(2));
      if (moved.ok()) response->set_moved(*moved);
      reactor->Finish(moved.ok() ? grpc::Status::OK : toGrpcStatus(moved.status()));
      return;
    }
    auto r = router_.drain(std::chrono::minutes(10));
    if (r.ok()) response->set_drained(*r);
    reactor->Finish(r.ok() ? grpc::Status::OK : toGrpcStatus(r.status()));
  });
  if (!started.ok()) reactor->Finish(toGrpcStatus(started));
  return reactor;
}

grpc::ServerUnaryReactor* AdminService::InjectFault(grpc::CallbackServerContext* context,
                                                    const v1::InjectFaultRequest* request,
                                                    v1::InjectFaultResponse* response) {
  if (auto* refusal = refused(context)) return refusal;
  auto* reactor = context->DefaultReactor();
  if (!fault_injection_) {
    spdlog::warn("refused a fault injection request: fault injection is disabled");
    reactor->Finish(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                                 "fault injection is disabled; start the broker with "
                                 "--enable-fault-injection"));
    return reactor;
  }
  const auto fault = faultFromName(request->fault());
  if (!fault) {
    reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                 "fault: unknown class \"" + request->fault() + "\""));
    return reactor;
  }
  const auto timeout =
      std::chrono::milliseconds(request->timeout_ms() != 0 ? request->timeout_ms() : 30'000);
  const uint64_t random = request->random();
  // The injection waits for detection and recovery: off the callback thread.
  const bool keep_armed = request->keep_armed();
  Status started = executor_.submit([this, reactor, response, f = *fault, random, timeout,
                                     keep_armed, worker = request->worker()] {
    auto r = router_.injectFault(worker, f, random, timeout, keep_armed);
    if (r.ok()) {
      response->set_migrated(r->migrated);
      response->set_worker(r->worker);
      response->set_detected(r->detected);
      response->set_recovered(r->recovered);
      response->set_detection_ms(r->detection_ms);
      response->set_recovery_ms(r->recovery_ms);
      response->set_detected_as(r->detected_as);
      response->set_disarmed(r->disarmed);
    }
    reactor->Finish(r.ok() ? grpc::Status::OK : toGrpcStatus(r.status()));
  });
  if (!started.ok()) reactor->Finish(toGrpcStatus(started));
  return reactor;
}

}  // namespace bulkhead

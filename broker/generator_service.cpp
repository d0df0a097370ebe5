// Generator and Admin services. A stream's reactor and the scheduler meet in a StreamChannel:
// the scheduler pushes responses through it; the reactor detaches from it in OnDone, after which
// pushes are dropped, so neither side can outlive the other's memory.
#include "broker/generator_service.h"

#include <deque>
#include <mutex>
#include <thread>

#include <spdlog/spdlog.h>

#include "broker/request_validation.h"

namespace bulkhead {
namespace {

class GenerateReactor;

struct StreamChannel {
  std::recursive_mutex mu;  // gRPC may run a reaction inline from StartWrite
  GenerateReactor* reactor = nullptr;
  std::atomic<bool> cancelled{false};
};

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

class GenerateReactor final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  explicit GenerateReactor(std::shared_ptr<StreamChannel> channel) : channel_(std::move(channel)) {
    channel_->reactor = this;
  }

  // With channel->mu held.
  void push(std::span<const TokenChoice> tokens) {
    // While a write is in flight, new tokens join the last queued message.
    if (pending_.size() < 2) pending_.emplace_back();
    v1::GenerateResponse& r = pending_.back();
    for (const TokenChoice& t : tokens) {
      r.add_token_ids(t.token);
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

  // With channel->mu held.
  void finishWith(FinishReason reason, const Usage& usage, const std::string& request_id,
                  const Status& status) {
    if (status.ok()) {
      if (pending_.size() < 2) pending_.emplace_back();
      v1::GenerateResponse& r = pending_.back();
      r.set_finish_reason(toProto(reason));
      r.mutable_usage()->set_prompt_tokens(usage.prompt_tokens);
      r.mutable_usage()->set_completion_tokens(usage.completion_tokens);
      r.mutable_usage()->set_seed(usage.seed);
      r.set_request_id(request_id);
    }
    final_status_ = toGrpcStatus(status);
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
  void startNext() {
    if (writing_ || finished_) return;
    if (!pending_.empty() && !channel_->cancelled) {
      writing_ = true;
      StartWrite(&pending_.front());
      return;
    }
    if (finish_pending_ || channel_->cancelled) {
      if (!finish_pending_) return;  // cancelled: Finish comes with the scheduler's verdict
      finished_ = true;
      Finish(final_status_);
    }
  }

  std::shared_ptr<StreamChannel> channel_;
  std::deque<v1::GenerateResponse> pending_;  // front is being written when writing_
  bool writing_ = false;
  bool finish_pending_ = false;
  bool finished_ = false;
  grpc::Status final_status_;
};

class GrpcSink final : public TokenSink {
 public:
  GrpcSink(std::shared_ptr<StreamChannel> channel, std::string request_id)
      : channel_(std::move(channel)), request_id_(std::move(request_id)) {}

  void onTokens(std::span<const TokenChoice> tokens) override {
    std::lock_guard lock(channel_->mu);
    if (channel_->reactor) channel_->reactor->push(tokens);
  }
  void onFinish(FinishReason reason, const Usage& usage, const Status& status) override {
    std::lock_guard lock(channel_->mu);
    if (channel_->reactor) channel_->reactor->finishWith(reason, usage, request_id_, status);
  }
  bool cancelled() const override { return channel_->cancelled; }

 private:
  std::shared_ptr<StreamChannel> channel_;
  std::string request_id_;
};

}  // namespace

grpc::Status toGrpcStatus(const Status& status) {
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), status.message());
}

grpc::ServerWriteReactor<v1::GenerateResponse>* GeneratorService::Generate(
    grpc::CallbackServerContext* context, const v1::GenerateRequest* request) {
  auto channel = std::make_shared<StreamChannel>();
  auto* reactor = new GenerateReactor(channel);
  auto valid = validateRequest(*request, model_);
  if (!valid.ok()) {
    std::lock_guard lock(channel->mu);
    reactor->finishWith(FinishReason::kNone, {}, request->request_id(), valid.status());
    return reactor;
  }
  const auto deadline = context->deadline();
  if (deadline != std::chrono::system_clock::time_point::max()) {
    valid->deadline = std::chrono::steady_clock::now() +
                      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                          deadline - std::chrono::system_clock::now());
  }
  Status submitted = scheduler_.submit(std::move(*valid),
                                       std::make_shared<GrpcSink>(channel, request->request_id()));
  if (!submitted.ok()) {
    std::lock_guard lock(channel->mu);
    reactor->finishWith(FinishReason::kNone, {}, request->request_id(), submitted);
  }
  return reactor;
}

grpc::ServerUnaryReactor* AdminService::ListWorkers(grpc::CallbackServerContext* context,
                                                    const v1::ListWorkersRequest*,
                                                    v1::ListWorkersResponse* response) {
  const WorkerStatus w = scheduler_.workerStatus();
  v1::WorkerInfo* info = response->add_workers();
  info->set_name("worker-0");
  info->set_state(w.state);
  info->set_incarnation(w.incarnation);
  info->set_pid(w.pid);
  info->set_backend(w.backend);
  info->set_kv_blocks_total(w.kv_blocks_total);
  info->set_kv_blocks_free(w.kv_blocks_free);
  info->set_restarts(w.restarts);
  info->set_last_failure(w.last_failure);
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* AdminService::GetStats(grpc::CallbackServerContext* context,
                                                 const v1::GetStatsRequest*, v1::Stats* out) {
  const SchedulerStats s = scheduler_.stats();
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
  out->set_integrity_failures(s.integrity_failures);
  out->set_weight_corruptions(s.weight_corruptions);
  out->set_canary_runs(s.canary_runs);
  out->set_canary_failures(s.canary_failures);
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* AdminService::RestartWorker(grpc::CallbackServerContext* context,
                                                      const v1::RestartWorkerRequest* request,
                                                      v1::RestartWorkerResponse* response) {
  auto* reactor = context->DefaultReactor();
  if (!request->name().empty() && request->name() != "worker-0") {
    reactor->Finish(
        grpc::Status(grpc::StatusCode::NOT_FOUND, "no worker named " + request->name()));
    return reactor;
  }
  // Restarting waits for a new worker: off the callback thread.
  std::thread([this, reactor, response] {
    auto r = scheduler_.restartWorker(std::chrono::minutes(2));
    if (r.ok()) {
      response->set_old_incarnation(r->first);
      response->set_new_incarnation(r->second);
    }
    reactor->Finish(r.ok() ? grpc::Status::OK : toGrpcStatus(r.status()));
  }).detach();
  return reactor;
}

grpc::ServerUnaryReactor* AdminService::Drain(grpc::CallbackServerContext* context,
                                              const v1::DrainRequest*,
                                              v1::DrainResponse* response) {
  auto* reactor = context->DefaultReactor();
  std::thread([this, reactor, response] {
    auto r = scheduler_.drain(std::chrono::minutes(10));
    if (r.ok()) response->set_drained(*r);
    reactor->Finish(r.ok() ? grpc::Status::OK : toGrpcStatus(r.status()));
  }).detach();
  return reactor;
}

grpc::ServerUnaryReactor* AdminService::InjectFault(grpc::CallbackServerContext* context,
                                                    const v1::InjectFaultRequest* request,
                                                    v1::InjectFaultResponse* response) {
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
  std::thread([this, reactor, response, f = *fault, random, timeout] {
    auto r = scheduler_.injectFault(f, random, timeout);
    if (r.ok()) {
      response->set_detected(r->detected);
      response->set_recovered(r->recovered);
      response->set_detection_ms(r->detection_ms);
      response->set_recovery_ms(r->recovery_ms);
      response->set_detected_as(r->detected_as);
    }
    reactor->Finish(r.ok() ? grpc::Status::OK : toGrpcStatus(r.status()));
  }).detach();
  return reactor;
}

}  // namespace bulkhead

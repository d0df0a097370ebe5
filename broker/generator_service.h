// The gRPC face of the broker: bulkhead.v1.Generator (streamed generation over the callback API)
// and bulkhead.v1.Admin. Validation happens here; scheduling does not.
#pragma once

#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "broker/admin_executor.h"
#include "broker/auth.h"
#include "broker/router.h"
#include "bulkhead/v1/generator.grpc.pb.h"

namespace bulkhead {

grpc::Status toGrpcStatus(const Status& status);

// The threads that build and start the writes of streamed responses (generator_service.cpp).
class StreamWriters;

class GeneratorService final : public v1::Generator::CallbackService {
 public:
  static constexpr size_t kDefaultWriterThreads = 2;

  GeneratorService(Router& router, ModelLimits model, const Authorizer& auth,
                   size_t writer_threads = kDefaultWriterThreads);
  ~GeneratorService() override;

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context, const v1::GenerateRequest* request) override;

  // Writes out what the scheduler has handed over, then joins the writer threads. Call after
  // Scheduler::stop(), which finishes every stream, and before grpc::Server::Shutdown(), which
  // waits for every stream's Finish. Idempotent; the destructor calls it.
  void stop();

 private:
  Router& router_;
  const ModelLimits model_;
  const Authorizer& auth_;
  std::unique_ptr<StreamWriters> writers_;
};

class AdminService final : public v1::Admin::CallbackService {
 public:
  AdminService(Router& router, bool fault_injection, const Authorizer& auth)
      : router_(router), fault_injection_(fault_injection), auth_(auth) {}
  ~AdminService() override { stop(); }

  // Refuses new Drain, RestartWorker and InjectFault calls (UNAVAILABLE) and joins those in
  // flight. Call after Scheduler::stop(), which ends their waits. Idempotent.
  void stop() noexcept { executor_.stop(); }

  grpc::ServerUnaryReactor* ListWorkers(grpc::CallbackServerContext* context,
                                        const v1::ListWorkersRequest* request,
                                        v1::ListWorkersResponse* response) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context,
                                     const v1::GetStatsRequest* request,
                                     v1::Stats* response) override;
  grpc::ServerUnaryReactor* RestartWorker(grpc::CallbackServerContext* context,
                                          const v1::RestartWorkerRequest* request,
                                          v1::RestartWorkerResponse* response) override;
  grpc::ServerUnaryReactor* Drain(grpc::CallbackServerContext* context,
                                  const v1::DrainRequest* request,
                                  v1::DrainResponse* response) override;
  grpc::ServerUnaryReactor* InjectFault(grpc::CallbackServerContext* context,
                                        const v1::InjectFaultRequest* request,
                                        v1::InjectFaultResponse* response) override;

 private:
  // A reactor finished with the caller's refusal, or null when the caller may go on.
  grpc::ServerUnaryReactor* refused(grpc::CallbackServerContext* context) const;

  Router& router_;
  const bool fault_injection_;
  const Authorizer& auth_;
  // The RPCs that wait on the scheduler run here, off gRPC's callback threads.
  AdminExecutor executor_;
};

}  // namespace bulkhead

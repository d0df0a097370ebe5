// The gRPC face of the broker: bulkhead.v1.Generator (streamed generation over the callback API)
// and bulkhead.v1.Admin. Validation happens here; scheduling does not.
#pragma once

#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "broker/scheduler.h"
#include "bulkhead/v1/generator.grpc.pb.h"

namespace bulkhead {

grpc::Status toGrpcStatus(const Status& status);

class GeneratorService final : public v1::Generator::CallbackService {
 public:
  GeneratorService(Scheduler& scheduler, ModelLimits model)
      : scheduler_(scheduler), model_(std::move(model)) {}

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context, const v1::GenerateRequest* request) override;

 private:
  Scheduler& scheduler_;
  const ModelLimits model_;
};

class AdminService final : public v1::Admin::CallbackService {
 public:
  AdminService(Scheduler& scheduler, bool fault_injection)
      : scheduler_(scheduler), fault_injection_(fault_injection) {}

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
  Scheduler& scheduler_;
  const bool fault_injection_;
};

}  // namespace bulkhead

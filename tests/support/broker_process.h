// A real bulkhead-broker process for end-to-end tests: started on port 0 with a readiness pipe,
// stopped (SIGTERM, then SIGKILL) on destruction. Plus small gRPC client helpers.
#pragma once

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "bulkhead/v1/generator.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "shared/child_process.h"
#include "support/test_support.h"

namespace bulkhead::test {

class BrokerProcess {
 public:
  // Starts the broker on `model` with extra flags; waits until it listens and, unless told not
  // to, until it serves. Canary records go to a private state directory unless one is given.
  explicit BrokerProcess(const std::string& model, std::vector<std::string> extra = {},
                         bool wait_serving = true) {
    std::vector<std::string> args = {test::binDir() + "/bulkhead-broker",
                                     "--model",
                                     model,
                                     "--listen",
                                     "127.0.0.1:0",
                                     "--backend",
                                     "cpu",
                                     "--ready-fd",
                                     "3",
                                     "--log-level",
                                     "warn"};
    if (std::find(extra.begin(), extra.end(), "--state-dir") == extra.end()) {
      args.push_back("--state-dir");
      args.push_back(state_.path());
    }
    args.insert(args.end(), extra.begin(), extra.end());
    auto child = ChildProcess::spawn(args);
    if (!child.ok()) {
      ADD_FAILURE() << child.status().toString();
      return;
    }
    process_ = std::move(*child);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    auto listening = process_.readReadyLine(deadline);
    if (!listening.ok() || listening->rfind("listening ", 0) != 0) {
      ADD_FAILURE() << "broker did not start listening";
      return;
    }
    address_ = listening->substr(10);
    if (std::find(extra.begin(), extra.end(), "--metrics-listen") != extra.end()) {
      auto metrics = process_.readReadyLine(deadline);
      if (!metrics.ok() || metrics->rfind("metrics ", 0) != 0) {
        ADD_FAILURE() << "broker did not report its metrics address";
        return;
      }
      metrics_address_ = metrics->substr(8);
    }
    if (wait_serving) {
      auto serving = process_.readReadyLine(deadline);
      if (!serving.ok() || *serving != "serving") {
        ADD_FAILURE() << "broker did not start serving";
        return;
      }
    }
    channel_ = grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
  }
  ~BrokerProcess() {
    channel_.reset();
    process_.signal(SIGTERM);
    ExitInfo info;
    if (!process_.waitExit(std::chrono::steady_clock::now() + std::chrono::seconds(20), &info)) {
      ADD_FAILURE() << "broker did not exit on SIGTERM";
    }
  }

  bool ok() const { return channel_ != nullptr; }
  const std::string& address() const { return address_; }
  // host:port of the metrics endpoint, when started with --metrics-listen.
  const std::string& metricsAddress() const { return metrics_address_; }
  std::shared_ptr<grpc::Channel> channel() const { return channel_; }
  ChildProcess& process() { return process_; }

 private:
  TempDir state_;
  ChildProcess process_;
  std::string address_, metrics_address_;
  std::shared_ptr<grpc::Channel> channel_;
};

struct Generation {
  grpc::Status status;
  std::vector<uint32_t> tokens;
  std::vector<float> logprobs;
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
  v1::Usage usage;
  size_t messages = 0;
};

inline Generation generate(grpc::Channel& channel, const v1::GenerateRequest& request,
                           std::chrono::milliseconds deadline = std::chrono::seconds(60)) {
  auto stub = v1::Generator::NewStub(std::shared_ptr<grpc::Channel>(&channel, [](auto*) {}));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + deadline);
  auto reader = stub->Generate(&context, request);
  Generation g;
  v1::GenerateResponse r;
  while (reader->Read(&r)) {
    ++g.messages;
    g.tokens.insert(g.tokens.end(), r.token_ids().begin(), r.token_ids().end());
    for (const auto& lp : r.logprobs()) g.logprobs.push_back(lp.logprob());
    if (r.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      g.finish = r.finish_reason();
      g.usage = r.usage();
    }
  }
  g.status = reader->Finish();
  return g;
}

inline v1::WorkerInfo workerInfo(grpc::Channel& channel) {
  auto admin = v1::Admin::NewStub(std::shared_ptr<grpc::Channel>(&channel, [](auto*) {}));
  grpc::ClientContext ctx;
  v1::ListWorkersResponse r;
  EXPECT_TRUE(admin->ListWorkers(&ctx, {}, &r).ok());
  return r.workers_size() > 0 ? r.workers(0) : v1::WorkerInfo{};
}

// Asks Admin.ListWorkers until `done` holds for the worker or `limit` passes; returns the last
// answer. (The broker publishes worker state between steps; there is no event to wait on.)
template <typename Done>
v1::WorkerInfo waitForWorker(grpc::Channel& channel, Done done, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  v1::WorkerInfo info;
  do {
    info = workerInfo(channel);
    if (done(info)) break;
    std::this_thread::yield();
  } while (std::chrono::steady_clock::now() < deadline);
  return info;
}

// Asks for logprobs, so that tests compare them too.
inline v1::GenerateRequest request(std::vector<uint32_t> prompt, uint32_t max_tokens) {
  v1::GenerateRequest r;
  for (uint32_t t : prompt) r.add_prompt_token_ids(t);
  r.set_max_tokens(max_tokens);
  r.set_logprobs(true);
  return r;
}

}  // namespace bulkhead::test

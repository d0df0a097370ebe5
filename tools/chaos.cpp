// chaos: reference pass, loaded fault phase, report.
#include "tools/chaos.h"

#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "broker/generator_service.h"
#include "bulkhead/v1/generator.grpc.pb.h"
#include "shared/child_process.h"
#include "tools/build_info.h"
#include "tools/percentile.h"

namespace bulkhead {
namespace {

using Clock = std::chrono::steady_clock;

struct Outcome {
  grpc::Status status;
  std::vector<uint32_t> tokens;
  bool finished = false;  // a final message with a finish reason arrived
};

Outcome generateOnce(v1::Generator::Stub& stub, const v1::GenerateRequest& request) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  auto reader = stub.Generate(&ctx, request);
  v1::GenerateResponse r;
  Outcome o;
  while (reader->Read(&r)) {
    o.tokens.insert(o.tokens.end(), r.token_ids().begin(), r.token_ids().end());
    if (r.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) o.finished = true;
  }
  o.status = reader->Finish();
  return o;
}

std::vector<v1::GenerateRequest> requestSet(uint32_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<v1::GenerateRequest> set;
  for (uint32_t i = 0; i < count; ++i) {
    v1::GenerateRequest r;
    const uint32_t prompt = 1 + rng() % 48;
    for (uint32_t k = 0; k < prompt; ++k) r.add_prompt_token_ids(3 + rng() % 250);
    r.set_max_tokens(16 + rng() % 96);
    r.set_ignore_eos(true);
    if (i % 2 == 1) {
      r.mutable_sampling()->set_temperature(0.6f + float(rng() % 80) / 100.0f);
      r.mutable_sampling()->set_seed(rng());
      if (i % 3 == 0) r.mutable_sampling()->set_top_k(40);
      if (i % 5 == 0) r.mutable_sampling()->set_top_p(0.9f);
    }
    r.set_request_id("chaos-" + std::to_string(i));
    set.push_back(std::move(r));
  }
  return set;
}

}  // namespace

int runChaos(const ChaosOptions& o) {
  std::printf("bulkhead chaos: seed %llu, %u faults, commit %s, model %s\n",
              static_cast<unsigned long long>(o.seed), o.faults, BULKHEAD_COMMIT,
              o.model_dir.c_str());
  char state_template[] = "/tmp/bulkhead-chaos-XXXXXX";
  if (::mkdtemp(state_template) == nullptr) {
    std::fprintf(stderr, "chaos: cannot create a state directory\n");
    return 2;
  }
  const std::string state_dir = state_template;
  std::vector<std::string> broker_args = {o.broker_path,
                                          "--model",
                                          o.model_dir,
                                          "--listen",
                                          "127.0.0.1:0",
                                          "--backend",
                                          o.backend,
                                          "--ready-fd",
                                          "3",
                                          "--enable-fault-injection",
                                          "--state-dir",
                                          state_dir,
                                          "--step-timeout-ms",
                                          std::to_string(o.step_timeout_ms),
                                          "--step-timeout-per-token-us",
                                          "500",
                                          "--log-level",
                                          "error"};
  if (o.pipeline_sample_share) {
    broker_args.push_back("--pipeline-sample-share");
    broker_args.push_back(std::to_string(*o.pipeline_sample_share));
  }
  auto broker = ChildProcess::spawn(broker_args);
  if (!broker.ok()) {
    std::fprintf(stderr, "chaos: %s\n", broker.status().toString().c_str());
    return 2;
  }
  const auto start_deadline = Clock::now() + std::chrono::seconds(120);
  auto listening = broker->readReadyLine(start_deadline);
  auto serving = broker->readReadyLine(start_deadline);
  if (!listening.ok() || !serving.ok() || *serving != "serving") {
    std::fprintf(stderr, "chaos: the broker did not start serving\n");
    return 2;
  }
  const std::string address = listening->substr(listening->find(' ') + 1);
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  auto admin = v1::Admin::NewStub(channel);

  // Reference pass: no faults.
  const auto requests = requestSet(o.requests, o.seed);
  std::vector<std::vector<uint32_t>> reference(requests.size());
  {
    auto stub = v1::Generator::NewStub(channel);
    for (size_t i = 0; i < requests.size(); ++i) {
      Outcome out = generateOnce(*stub, requests[i]);
      if (!out.status.ok() || !out.finished) {
        std::fprintf(stderr, "chaos: reference request %zu failed: %s\n", i,
                     out.status.error_message().c_str());
        return 2;
      }
      reference[i] = out.tokens;
    }
  }

  // Fault phase: load threads replay the set while the schedule is injected.
  std::atomic<bool> stop{false};
  std::mutex mu;
  uint64_t completed = 0, failed = 0, mismatched = 0, lost = 0;
  std::vector<std::string> problems;
  std::atomic<uint32_t> next{0};
  std::vector<std::thread> load;
  for (uint32_t w = 0; w < o.concurrency; ++w) {
    load.emplace_back([&] {
      auto stub = v1::Generator::NewStub(channel);
      while (!stop) {
        const uint32_t i = next++ % uint32_t(requests.size());
        Outcome out = generateOnce(*stub, requests[i]);
        std::lock_guard lock(mu);
        if (out.status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
            (out.status.ok() && !out.finished)) {
          ++lost;
          problems.push_back("lost request " + std::to_string(i));
        } else if (!out.status.ok()) {
          ++failed;
          problems.push_back("request " + std::to_string(i) +
                             " failed: " + out.status.error_message());
        } else {
          ++completed;
          if (out.tokens != reference[i]) {
            ++mismatched;
            size_t at = 0;
            while (at < out.tokens.size() && at < reference[i].size() &&
                   out.tokens[at] == reference[i][at])
              ++at;
            problems.push_back("request " + std::to_string(i) +
                               " differs from its reference at token " + std::to_string(at) + " (" +
                               std::to_string(out.tokens.size()) + " tokens, reference " +
                               std::to_string(reference[i].size()) + ")");
          }
        }
      }
    });
  }

  struct ClassStats {
    uint32_t injected = 0, detected = 0, recovered = 0;
    uint32_t misattributed = 0;                   // caught by another class's mechanism
    std::map<std::string, uint32_t> detected_as;  // which mechanism caught it, and how often
    std::vector<double> detection_ms, recovery_ms;
  };
  std::map<std::string, ClassStats> classes;
  for (Fault f : allFaults()) classes[std::string(faultName(f))];
  std::mt19937_64 schedule(o.seed ^ 0xc4a05c4a05ull);
  const auto start = Clock::now();
  for (uint32_t k = 0; k < o.faults; ++k) {
    const Fault fault = allFaults()[schedule() % allFaults().size()];
    const uint64_t random = schedule();
    ClassStats& c = classes[std::string(faultName(fault))];
    ++c.injected;
    grpc::ClientContext ctx;
    v1::InjectFaultRequest req;
    req.set_fault(std::string(faultName(fault)));
    req.set_random(random);
    req.set_timeout_ms(30'000);
    v1::InjectFaultResponse resp;
    grpc::Status s = admin->InjectFault(&ctx, req, &resp);
    if (!s.ok()) {
      std::lock_guard lock(mu);
      problems.push_back("injecting " + req.fault() + " failed: " + s.error_message());
      continue;
    }
    if (resp.detected()) {
      ++c.detected;
      c.detection_ms.push_back(resp.detection_ms());
      // The mechanism, without the step-specific details after the first ':'.
      ++c.detected_as[resp.detected_as().substr(0, resp.detected_as().find(':'))];
      if (!detectedByItsOwnMechanism(fault, resp.detected_as())) {
        ++c.misattributed;
        std::lock_guard lock(mu);
        problems.push_back("fault " + std::to_string(k) + " (" + req.fault() +
                           ") detected as another class's: " + resp.detected_as());
      }
    } else {
      std::lock_guard lock(mu);
      problems.push_back("fault " + std::to_string(k) + " (" + req.fault() + ") undetected");
    }
    if (resp.recovered()) {
      ++c.recovered;
      c.recovery_ms.push_back(resp.recovery_ms());
    }
  }
  stop = true;
  for (auto& t : load) t.join();
  const double wall = std::chrono::duration<double>(Clock::now() - start).count();
  v1::Stats stats;
  {
    grpc::ClientContext ctx;
    if (grpc::Status s = admin->GetStats(&ctx, {}, &stats); !s.ok())
      problems.push_back("GetStats failed: " + s.error_message());
  }

  broker->signal(SIGTERM);
  ExitInfo exit_info;
  broker->waitExit(Clock::now() + std::chrono::seconds(30), &exit_info);
  std::error_code ec;
  std::filesystem::remove_all(state_dir, ec);

  nlohmann::json report = {{"seed", o.seed},       {"commit", BULKHEAD_COMMIT},
                           {"model", o.model_dir}, {"faults", o.faults},
                           {"wall_s", wall},       {"classes", nlohmann::json::object()}};
  std::printf("\n%-16s %9s %9s %10s %8s %12s %12s %12s %12s\n", "class", "injected", "detected",
              "recovered", "as_own", "detect_p50", "detect_p99", "recover_p50", "recover_p99");
  bool undetected = false;
  for (const auto& [name, c] : classes) {
    const double d50 = percentile(c.detection_ms, 50), d99 = percentile(c.detection_ms, 99);
    const double r50 = percentile(c.recovery_ms, 50), r99 = percentile(c.recovery_ms, 99);
    std::printf("%-16s %9u %9u %10u %8u %10.1f ms %9.1f ms %9.1f ms %9.1f ms\n", name.c_str(),
                c.injected, c.detected, c.recovered, c.detected - c.misattributed, d50, d99, r50,
                r99);
    undetected |= c.detected != c.injected || c.recovered != c.injected || c.misattributed != 0;
    report["classes"][name] = {{"injected", c.injected},
                               {"detected", c.detected},
                               {"recovered", c.recovered},
                               {"detection_ms_p50", d50},
                               {"detection_ms_p99", d99},
                               {"recovery_ms_p50", r50},
                               {"recovery_ms_p99", r99},
                               {"detected_as", c.detected_as},
                               {"detected_as_own_class", c.detected - c.misattributed}};
  }
  report["requests"] = {
      {"completed", completed}, {"failed", failed}, {"mismatched", mismatched}, {"lost", lost}};
  report["recovery"] = {{"worker_restarts", stats.worker_restarts()},
                        {"replayed_sequences", stats.replayed_sequences()},
                        {"rolled_back_tokens", stats.rolled_back_tokens()},
                        {"integrity_failures", stats.integrity_failures()},
                        {"canary_runs", stats.canary_runs()},
                        {"canary_failures", stats.canary_failures()},
                        {"steps", stats.steps()},
                        {"steps_overlapped", stats.steps_overlapped()}};
  std::printf(
      "\nrecovery: %llu worker restarts, %llu sequences replayed, %llu tokens rolled back, "
      "%llu canary runs; %llu of %llu steps sent while another was in flight\n",
      static_cast<unsigned long long>(stats.worker_restarts()),
      static_cast<unsigned long long>(stats.replayed_sequences()),
      static_cast<unsigned long long>(stats.rolled_back_tokens()),
      static_cast<unsigned long long>(stats.canary_runs()),
      static_cast<unsigned long long>(stats.steps_overlapped()),
      static_cast<unsigned long long>(stats.steps()));
  if (o.pipeline_sample_share == 0.0 && stats.steps_overlapped() == 0)
    problems.push_back("two steps in flight were asked for, and no step was sent beside another");
  // With this many faults some must land in the middle of generations; if none did, the run
  // proved nothing about replay.
  if (o.faults >= 50 && (stats.replayed_sequences() == 0 || stats.rolled_back_tokens() == 0))
    problems.push_back("no fault landed in the middle of a generation (nothing was replayed)");
  std::printf("\nrequests: %llu completed, %llu failed, %llu mismatched, %llu lost; %.1f s\n",
              static_cast<unsigned long long>(completed), static_cast<unsigned long long>(failed),
              static_cast<unsigned long long>(mismatched), static_cast<unsigned long long>(lost),
              wall);
  for (size_t i = 0; i < std::min<size_t>(problems.size(), 20); ++i)
    std::printf("  problem: %s\n", problems[i].c_str());
  if (!o.report_path.empty()) {
    std::ofstream out(o.report_path);
    out << report.dump(2) << "\n";
  }
  const bool ok = failed == 0 && mismatched == 0 && lost == 0 && !undetected && problems.empty();
  std::printf("%s\n", ok ? "chaos: PASS" : "chaos: FAIL");
  return ok ? 0 : 1;
}

}  // namespace bulkhead

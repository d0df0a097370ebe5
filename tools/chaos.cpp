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

struct ClassStats {
  uint32_t injected = 0, detected = 0, recovered = 0;
  uint32_t misattributed = 0;  // caught by another class's mechanism
  uint32_t migrated = 0;       // recovered by moving the worker's sequences to another
  std::map<std::string, uint32_t> detected_as;  // which mechanism caught it, and how often
  std::vector<double> detection_ms, recovery_ms;
};

// One broker under load while faults are injected.
struct Phase {
  uint32_t workers = 1;
  std::map<std::string, ClassStats> classes;
  uint64_t completed = 0, failed = 0, mismatched = 0, lost = 0;
  std::vector<std::string> problems;
  std::vector<double> recovery_ms;  // every class's
  v1::Stats stats;
  double wall_s = 0;
  bool undetected = false;  // some fault not detected, not recovered, or misattributed

  bool ok() const {
    return failed == 0 && mismatched == 0 && lost == 0 && !undetected && problems.empty();
  }
};

struct Broker {
  ChildProcess process;
  std::shared_ptr<grpc::Channel> channel;
};

Result<Broker> startBroker(const ChaosOptions& o, uint32_t workers, const std::string& state_dir) {
  std::vector<std::string> args = {o.broker_path,
                                   "--model",
                                   o.model_dir,
                                   "--listen",
                                   "127.0.0.1:0",
                                   "--backend",
                                   o.backend,
                                   "--workers",
                                   std::to_string(workers),
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
    args.push_back("--pipeline-sample-share");
    args.push_back(std::to_string(*o.pipeline_sample_share));
  }
  for (const std::string& a : o.worker_args) args.push_back("--worker-arg=" + a);
  auto child = ChildProcess::spawn(args);
  if (!child.ok()) return child.status();
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  auto listening = child->readReadyLine(deadline);
  auto serving = child->readReadyLine(deadline);
  if (!listening.ok() || !serving.ok() || *serving != "serving")
    return unavailable("the broker did not start serving");
  const std::string address = listening->substr(listening->find(' ') + 1);
  return Broker{std::move(*child),
                grpc::CreateChannel(address, grpc::InsecureChannelCredentials())};
}

void stopBroker(Broker& broker) {
  broker.channel.reset();
  broker.process.signal(SIGTERM);
  ExitInfo exit_info;
  broker.process.waitExit(Clock::now() + std::chrono::seconds(30), &exit_info);
}

// Polls ListWorkers (every millisecond) until every worker is ready or `limit` passes.
bool waitAllReady(v1::Admin::Stub& admin, std::chrono::seconds limit) {
  const auto deadline = Clock::now() + limit;
  while (Clock::now() < deadline) {
    grpc::ClientContext ctx;
    v1::ListWorkersResponse r;
    if (admin.ListWorkers(&ctx, {}, &r).ok() &&
        std::all_of(r.workers().begin(), r.workers().end(),
                    [](const v1::WorkerInfo& w) { return w.state() == "ready"; }))
      return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

// Load threads replay the request set while `faults` faults from the seeded schedule are
// injected one after another; every completed output is checked against its reference.
Phase runFaults(const ChaosOptions& o, grpc::Channel& channel,
                const std::vector<v1::GenerateRequest>& requests,
                const std::vector<std::vector<uint32_t>>& reference, uint32_t faults,
                uint32_t workers) {
  Phase phase;
  phase.workers = workers;
  auto shared = std::shared_ptr<grpc::Channel>(&channel, [](auto*) {});
  auto admin = v1::Admin::NewStub(shared);
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::atomic<uint32_t> next{0};
  std::vector<std::thread> load;
  for (uint32_t w = 0; w < o.concurrency; ++w) {
    load.emplace_back([&] {
      auto stub = v1::Generator::NewStub(shared);
      while (!stop) {
        const uint32_t i = next++ % uint32_t(requests.size());
        Outcome out = generateOnce(*stub, requests[i]);
        std::lock_guard lock(mu);
        if (out.status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
            (out.status.ok() && !out.finished)) {
          ++phase.lost;
          phase.problems.push_back("lost request " + std::to_string(i));
        } else if (!out.status.ok()) {
          ++phase.failed;
          phase.problems.push_back("request " + std::to_string(i) +
                                   " failed: " + out.status.error_message());
        } else {
          ++phase.completed;
          if (out.tokens != reference[i]) {
            ++phase.mismatched;
            size_t at = 0;
            while (at < out.tokens.size() && at < reference[i].size() &&
                   out.tokens[at] == reference[i][at])
              ++at;
            phase.problems.push_back(
                "request " + std::to_string(i) + " differs from its reference at token " +
                std::to_string(at) + " (" + std::to_string(out.tokens.size()) +
                " tokens, reference " + std::to_string(reference[i].size()) + ")");
          }
        }
      }
    });
  }

  for (Fault f : allFaults()) phase.classes[std::string(faultName(f))];
  std::mt19937_64 schedule(o.seed ^ 0xc4a05c4a05ull);
  const auto start = Clock::now();
  for (uint32_t k = 0; k < faults; ++k) {
    // Each fault finds every worker serving, as one worker does once it recovered: with several,
    // recovery (the sequences moved) comes before the failed worker is back.
    if (workers > 1 && !waitAllReady(*admin, std::chrono::seconds(60))) {
      std::lock_guard lock(mu);
      phase.problems.push_back("before fault " + std::to_string(k) +
                               ": the workers were not all ready within 60 s");
    }
    const Fault fault = allFaults()[schedule() % allFaults().size()];
    const uint64_t random = schedule();
    ClassStats& c = phase.classes[std::string(faultName(fault))];
    ++c.injected;
    grpc::ClientContext ctx;
    v1::InjectFaultRequest req;
    req.set_fault(std::string(faultName(fault)));
    req.set_random(random);  // with several workers, it also picks the worker
    req.set_timeout_ms(30'000);
    v1::InjectFaultResponse resp;
    grpc::Status s = admin->InjectFault(&ctx, req, &resp);
    if (!s.ok()) {
      std::lock_guard lock(mu);
      phase.problems.push_back("injecting " + req.fault() + " failed: " + s.error_message());
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
        phase.problems.push_back("fault " + std::to_string(k) + " (" + req.fault() + " in " +
                                 resp.worker() +
                                 ") detected as another class's: " + resp.detected_as());
      }
    } else {
      std::lock_guard lock(mu);
      phase.problems.push_back("fault " + std::to_string(k) + " (" + req.fault() + " in " +
                               resp.worker() + ") undetected");
    }
    if (resp.recovered()) {
      ++c.recovered;
      c.migrated += resp.migrated() ? 1 : 0;
      c.recovery_ms.push_back(resp.recovery_ms());
      phase.recovery_ms.push_back(resp.recovery_ms());
    }
  }
  stop = true;
  for (auto& t : load) t.join();
  phase.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  grpc::ClientContext ctx;
  if (grpc::Status s = admin->GetStats(&ctx, {}, &phase.stats); !s.ok())
    phase.problems.push_back("GetStats failed: " + s.error_message());
  for (const auto& [name, c] : phase.classes)
    phase.undetected |=
        c.detected != c.injected || c.recovered != c.injected || c.misattributed != 0;
  if (o.pipeline_sample_share == 0.0 && phase.stats.steps_overlapped() == 0)
    phase.problems.push_back(
        "two steps in flight were asked for, and no step was sent beside another");
  // With this many faults some must land in the middle of generations; if none did, the run
  // proved nothing about replay.
  if (faults >= 50 &&
      (phase.stats.replayed_sequences() == 0 || phase.stats.rolled_back_tokens() == 0))
    phase.problems.push_back(
        "no fault landed in the middle of a generation (nothing was replayed)");
  if (workers > 1 && faults >= 50 && phase.stats.migrated_sequences() == 0)
    phase.problems.push_back("no sequence moved to another worker");
  return phase;
}

nlohmann::json phaseReport(const Phase& p) {
  nlohmann::json classes = nlohmann::json::object();
  for (const auto& [name, c] : p.classes) {
    classes[name] = {{"injected", c.injected},
                     {"detected", c.detected},
                     {"recovered", c.recovered},
                     {"recovered_by_migration", c.migrated},
                     {"detection_ms_p50", percentile(c.detection_ms, 50)},
                     {"detection_ms_p99", percentile(c.detection_ms, 99)},
                     {"recovery_ms_p50", percentile(c.recovery_ms, 50)},
                     {"recovery_ms_p99", percentile(c.recovery_ms, 99)},
                     {"detected_as", c.detected_as},
                     {"detected_as_own_class", c.detected - c.misattributed}};
  }
  const v1::Stats& s = p.stats;
  return {{"workers", p.workers},
          {"wall_s", p.wall_s},
          {"classes", classes},
          {"recovery_ms_p50", percentile(p.recovery_ms, 50)},
          {"recovery_ms_p99", percentile(p.recovery_ms, 99)},
          {"requests",
           {{"completed", p.completed},
            {"failed", p.failed},
            {"mismatched", p.mismatched},
            {"lost", p.lost}}},
          {"recovery",
           {{"worker_restarts", s.worker_restarts()},
            {"replayed_sequences", s.replayed_sequences()},
            {"migrated_sequences", s.migrated_sequences()},
            {"migration_ms_p50", s.migration_ms_p50()},
            {"migration_ms_p99", s.migration_ms_p99()},
            {"rolled_back_tokens", s.rolled_back_tokens()},
            {"integrity_failures", s.integrity_failures()},
            {"canary_runs", s.canary_runs()},
            {"canary_failures", s.canary_failures()},
            {"steps", s.steps()},
            {"steps_overlapped", s.steps_overlapped()}}}};
}

void printPhase(const Phase& p) {
  std::printf("\n%-16s %9s %9s %10s %8s %8s %12s %12s %12s %12s\n", "class", "injected", "detected",
              "recovered", "as_own", "moved", "detect_p50", "detect_p99", "recover_p50",
              "recover_p99");
  for (const auto& [name, c] : p.classes) {
    std::printf("%-16s %9u %9u %10u %8u %8u %10.1f ms %9.1f ms %9.1f ms %9.1f ms\n", name.c_str(),
                c.injected, c.detected, c.recovered, c.detected - c.misattributed, c.migrated,
                percentile(c.detection_ms, 50), percentile(c.detection_ms, 99),
                percentile(c.recovery_ms, 50), percentile(c.recovery_ms, 99));
  }
  const v1::Stats& s = p.stats;
  std::printf(
      "\nrecovery: %llu worker restarts, %llu sequences replayed, %llu moved to another worker, "
      "%llu tokens rolled back, %llu canary runs; %llu of %llu steps sent while another was in "
      "flight\n",
      static_cast<unsigned long long>(s.worker_restarts()),
      static_cast<unsigned long long>(s.replayed_sequences()),
      static_cast<unsigned long long>(s.migrated_sequences()),
      static_cast<unsigned long long>(s.rolled_back_tokens()),
      static_cast<unsigned long long>(s.canary_runs()),
      static_cast<unsigned long long>(s.steps_overlapped()),
      static_cast<unsigned long long>(s.steps()));
  std::printf("requests: %llu completed, %llu failed, %llu mismatched, %llu lost; %.1f s\n",
              static_cast<unsigned long long>(p.completed),
              static_cast<unsigned long long>(p.failed),
              static_cast<unsigned long long>(p.mismatched),
              static_cast<unsigned long long>(p.lost), p.wall_s);
  for (size_t i = 0; i < std::min<size_t>(p.problems.size(), 20); ++i)
    std::printf("  problem: %s\n", p.problems[i].c_str());
}

// Recovery with several workers against one, per class and over every fault, and over the
// classes whose detection replaces the worker (where several workers move its sequences instead
// of waiting for its restart).
void printComparison(const Phase& many, const Phase& one) {
  const std::vector<std::string> replacing = {"worker_kill",   "worker_hang",     "slow_step",
                                              "garbage_reply", "truncated_reply", "stale_slot"};
  std::printf("\n%-16s %22s %22s\n", "recovery p99",
              (std::to_string(many.workers) + " workers").c_str(), "1 worker");
  std::vector<double> many_replacing, one_replacing;
  for (const auto& [name, c] : many.classes) {
    const ClassStats& b = one.classes.at(name);
    std::printf("%-16s %19.1f ms %19.1f ms\n", name.c_str(), percentile(c.recovery_ms, 99),
                percentile(b.recovery_ms, 99));
    if (std::find(replacing.begin(), replacing.end(), name) == replacing.end()) continue;
    many_replacing.insert(many_replacing.end(), c.recovery_ms.begin(), c.recovery_ms.end());
    one_replacing.insert(one_replacing.end(), b.recovery_ms.begin(), b.recovery_ms.end());
  }
  auto line = [&](const char* what, const std::vector<double>& a, const std::vector<double>& b) {
    const double pa = percentile(a, 99), pb = percentile(b, 99);
    std::printf("%-16s %19.1f ms %19.1f ms  (%s)\n", what, pa, pb,
                pa < pb ? "faster with several" : "NOT faster with several");
  };
  line("replacing", many_replacing, one_replacing);
  line("every fault", many.recovery_ms, one.recovery_ms);
}

}  // namespace

int runChaos(const ChaosOptions& o) {
  std::printf("bulkhead chaos: seed %llu, %u faults, %u worker%s, commit %s, model %s\n",
              static_cast<unsigned long long>(o.seed), o.faults, o.workers,
              o.workers == 1 ? "" : "s", BULKHEAD_COMMIT, o.model_dir.c_str());
  char state_template[] = "/tmp/bulkhead-chaos-XXXXXX";
  if (::mkdtemp(state_template) == nullptr) {
    std::fprintf(stderr, "chaos: cannot create a state directory\n");
    return 2;
  }
  const std::string state_dir = state_template;
  auto cleanup = [&] {
    std::error_code ec;
    std::filesystem::remove_all(state_dir, ec);
  };
  auto broker = startBroker(o, o.workers, state_dir);
  if (!broker.ok()) {
    std::fprintf(stderr, "chaos: %s\n", broker.status().toString().c_str());
    cleanup();
    return 2;
  }

  // Reference pass: no faults.
  const auto requests = requestSet(o.requests, o.seed);
  std::vector<std::vector<uint32_t>> reference(requests.size());
  {
    auto stub = v1::Generator::NewStub(broker->channel);
    for (size_t i = 0; i < requests.size(); ++i) {
      Outcome out = generateOnce(*stub, requests[i]);
      if (!out.status.ok() || !out.finished) {
        std::fprintf(stderr, "chaos: reference request %zu failed: %s\n", i,
                     out.status.error_message().c_str());
        stopBroker(*broker);
        cleanup();
        return 2;
      }
      reference[i] = out.tokens;
    }
  }
  Phase main = runFaults(o, *broker->channel, requests, reference, o.faults, o.workers);
  stopBroker(*broker);

  // The comparison: one worker, the same schedule, the same references.
  std::optional<Phase> baseline;
  const uint32_t baseline_faults = o.baseline_faults.value_or(o.faults);
  if (o.workers > 1 && baseline_faults > 0) {
    auto single = startBroker(o, 1, state_dir);
    if (!single.ok()) {
      main.problems.push_back("the single-worker broker did not start: " +
                              single.status().toString());
    } else {
      baseline = runFaults(o, *single->channel, requests, reference, baseline_faults, 1);
      stopBroker(*single);
    }
  }
  cleanup();

  nlohmann::json report = phaseReport(main);
  report["seed"] = o.seed;
  report["commit"] = BULKHEAD_COMMIT;
  report["model"] = o.model_dir;
  report["faults"] = o.faults;
  printPhase(main);
  if (baseline) {
    std::printf("\nthe same schedule against one worker (%u faults):", baseline_faults);
    printPhase(*baseline);
    printComparison(main, *baseline);
    report["single_worker"] = phaseReport(*baseline);
  }
  if (!o.report_path.empty()) {
    std::ofstream out(o.report_path);
    out << report.dump(2) << "\n";
  }
  const bool ok = main.ok() && (!baseline || baseline->ok());
  std::printf("%s\n", ok ? "chaos: PASS" : "chaos: FAIL");
  return ok ? 0 : 1;
}

}  // namespace bulkhead

// serve-bench implementation: step-bench for the ceiling, then bench through a spawned broker.
#include "tools/serve_bench.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include <grpcpp/grpcpp.h>

#include "bulkhead/v1/generator.grpc.pb.h"
#include "shared/child_process.h"
#include "tools/json_report.h"
#include "tools/remote.h"
#include "tools/step_bench.h"

namespace bulkhead {

Status runServeBench(const ServeBenchOptions& o) {
  StepBenchOptions step;
  step.model_dir = o.model_dir;
  step.worker_path = o.worker_path;
  step.backend = o.backend;
  step.batches = o.concurrency;
  step.iterations = 100;
  step.worker_args = o.worker_args;
  std::printf("== worker compute per decode step (step-bench) ==\n");
  BULKHEAD_ASSIGN_OR_RETURN(const std::vector<StepBenchRow> ceiling, runStepBench(step));

  char state_template[] = "/tmp/bulkhead-serve-bench-XXXXXX";
  if (::mkdtemp(state_template) == nullptr) return internalError("cannot create a state directory");
  const std::string state_dir = state_template;
  std::vector<std::string> args = {
      o.broker_path, "--model", o.model_dir,   "--listen", "127.0.0.1:0", "--backend", o.backend,
      "--ready-fd",  "3",       "--state-dir", state_dir,  "--log-level", "warn"};
  args.insert(args.end(), o.broker_args.begin(), o.broker_args.end());
  for (const std::string& a : o.worker_args) args.push_back("--worker-arg=" + a);

  struct Mode {
    const char* name;
    float temperature, top_p;
  };
  const Mode modes[] = {{"greedy", 0, 1}, {"t0.8-p0.9", 0.8f, 0.9f}};
  std::printf(
      "\n== end to end through a fresh broker per row (prompt %u, gen %u, after %u untimed "
      "requests a stream); release_p99, "
      "step_p50 (round trip), compute_p50 (the worker's), sample_p50, between_p50 (reply to "
      "next request) and overlap (steps sent while another was in flight) are the broker's own; "
      "decode_step the in-run step-bench round trip at that batch ==\n",
      o.prompt_len, o.gen_len, o.warmup_requests_per_stream);
  if (o.workers.size() > 1 || o.workers[0] != 1)
    std::printf(
        "(ceiling and ratio: one worker's; scaling: tokens/s against the same row with the "
        "first worker count)\n");
  std::printf("%7s %11s %10s %12s %12s %8s %8s %10s %10s %10s %12s %10s %12s %12s %12s %8s %12s\n",
              "workers", "concurrency", "sampling", "tokens/s", "ceiling", "ratio", "scaling",
              "ttft_p50", "itl_p50", "itl_p99", "release_p99", "step_p50", "compute_p50",
              "sample_p50", "between_p50", "overlap", "decode_step");
  nlohmann::json report = {
      {"model", o.model_dir},       {"backend", o.backend},
      {"prompt_len", o.prompt_len}, {"warmup_requests_per_stream", o.warmup_requests_per_stream},
      {"gen_len", o.gen_len},       {"results", nlohmann::json::array()}};
  Status status;
  for (size_t i = 0; i < o.concurrency.size(); ++i) {
    const double ceiling_tok_s = ceiling[i].batch / (ceiling[i].compute_p50_us * 1e-6);
    for (const Mode& m : modes) {
      double first_tokens_per_s = 0;
      for (const uint32_t workers : o.workers) {
        // A broker of its own, so its latency windows hold this row's samples only.
        std::vector<std::string> broker_args = args;
        broker_args.push_back("--workers");
        broker_args.push_back(std::to_string(workers));
        BULKHEAD_ASSIGN_OR_RETURN(ChildProcess broker, ChildProcess::spawn(broker_args));
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(300);
        auto listening = broker.readReadyLine(deadline);
        auto serving = broker.readReadyLine(deadline);
        if (!listening.ok() || !serving.ok() || *serving != "serving")
          return unavailable("the broker did not start serving");
        const std::string address = listening->substr(listening->find(' ') + 1);
        auto admin =
            v1::Admin::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
        BenchCommand c{.server = address,
                       .temperature = m.temperature,
                       .top_p = m.top_p,
                       .concurrency = o.concurrency[i],
                       .prompt_len = o.prompt_len,
                       .gen_len = o.gen_len,
                       .requests = o.concurrency[i] * o.requests_per_stream,
                       .warmup_requests = o.concurrency[i] * o.warmup_requests_per_stream};
        const BenchResult r = measureBench(c);
        const double ratio = r.tokens_per_s / ceiling_tok_s;
        if (workers == o.workers[0]) first_tokens_per_s = r.tokens_per_s;
        const double scaling = first_tokens_per_s > 0 ? r.tokens_per_s / first_tokens_per_s : 0;
        // The broker's own view: release latency and step time over its last 4096 samples.
        v1::Stats stats;
        grpc::ClientContext ctx;
        (void)admin->GetStats(&ctx, {}, &stats);
        broker.signal(SIGTERM);
        ExitInfo exit_info;
        broker.waitExit(std::chrono::steady_clock::now() + std::chrono::seconds(30), &exit_info);
        const double decode_step_ms = ceiling[i].rtt_p50_us / 1000.0;
        const double overlap =
            stats.steps() > 0 ? double(stats.steps_overlapped()) / double(stats.steps()) : 0.0;
        std::printf(
            "%7u %11u %10s %12.1f %12.1f %7.1f%% %7.2fx %7.2f ms %7.3f ms %7.3f ms %9.3f ms %7.3f "
            "ms %9.3f ms %9.3f ms %9.3f ms %7.1f%% %9.3f ms\n",
            workers, o.concurrency[i], m.name, r.tokens_per_s, ceiling_tok_s, 100 * ratio, scaling,
            r.ttft_ms_p50, r.itl_ms_p50, r.itl_ms_p99, stats.release_latency_ms_p99(),
            stats.step_ms_p50(), stats.compute_ms_p50(), stats.sample_ms_p50(),
            stats.between_steps_ms_p50(), 100 * overlap, decode_step_ms);
        report["results"].push_back({{"workers", workers},
                                     {"scaling", scaling},
                                     {"concurrency", o.concurrency[i]},
                                     {"sampling", m.name},
                                     {"tokens_per_s", r.tokens_per_s},
                                     {"compute_p50_us", ceiling[i].compute_p50_us},
                                     {"ceiling_tokens_per_s", ceiling_tok_s},
                                     {"ratio", ratio},
                                     {"ttft_ms_p50", r.ttft_ms_p50},
                                     {"itl_ms_p50", r.itl_ms_p50},
                                     {"itl_ms_p99", r.itl_ms_p99},
                                     {"release_latency_ms_p99", stats.release_latency_ms_p99()},
                                     {"step_ms_p50", stats.step_ms_p50()},
                                     {"compute_ms_p50", stats.compute_ms_p50()},
                                     {"sample_ms_p50", stats.sample_ms_p50()},
                                     {"between_steps_ms_p50", stats.between_steps_ms_p50()},
                                     {"steps_overlapped_share", overlap},
                                     {"decode_step_rtt_ms_p50", decode_step_ms},
                                     {"failed", r.failed}});
        if (r.failed > 0 && status.ok())
          status = unavailable(std::to_string(r.failed) + " requests failed: " + r.first_error);
      }
    }
  }
  std::error_code ec;
  std::filesystem::remove_all(state_dir, ec);
  BULKHEAD_RETURN_IF_ERROR(writeJsonReport(o.json_path, report));
  return status;
}

}  // namespace bulkhead

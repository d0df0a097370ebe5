// step-bench implementation.
#include "tools/step_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "broker/row_sampling.h"
#include "broker/worker_client.h"
#include "shared/work_pool.h"
#include "tools/json_report.h"
#include "tools/percentile.h"

namespace bulkhead {
namespace {

Result<std::unique_ptr<WorkerClient>> spawnBenchWorker(const StepBenchOptions& o,
                                                       bool in_step_checks) {
  WorkerClient::SpawnOptions spawn;
  spawn.worker_path = o.worker_path;
  spawn.model_dir = o.model_dir;
  spawn.backend = o.backend;
  spawn.arena_slots = *std::max_element(o.batches.begin(), o.batches.end());
  spawn.extra_args = {"--log-level", "warn", "--scrub-share", std::to_string(o.scrub_share)};
  if (!in_step_checks) spawn.extra_args.push_back("--no-in-step-checks");
  spawn.extra_args.insert(spawn.extra_args.end(), o.worker_args.begin(), o.worker_args.end());
  auto client = WorkerClient::spawn(spawn);
  if (!client.ok()) return client.error().toStatus();
  return std::move(*client);
}

// `batch` one-token decode steps at position `position`, each sequence over its own blocks.
std::vector<SequenceStep> decodeSteps(uint32_t batch, uint32_t position, uint64_t seq_base,
                                      const std::vector<std::vector<uint32_t>>& blocks,
                                      std::span<const uint32_t> token,
                                      std::span<const uint32_t> rows) {
  std::vector<SequenceStep> steps;
  for (uint32_t s = 0; s < batch; ++s)
    steps.push_back({.sequence_id = seq_base + s,
                     .start_position = position,
                     .tokens = token,
                     .kv_blocks = blocks[s],
                     .logits_rows = rows});
  return steps;
}

// Blocks each sequence needs for a run of `o.iterations` measured steps after 20 warm-up ones,
// or why the worker cannot hold the run.
Result<uint32_t> blocksPerSequence(const StepBenchOptions& o, const WorkerHello& hello) {
  const uint32_t max_batch = *std::max_element(o.batches.begin(), o.batches.end());
  const uint32_t positions = o.iterations + 21;
  const uint32_t blocks_per_seq = (positions + hello.kv_block_size - 1) / hello.kv_block_size;
  if (uint64_t(blocks_per_seq) * max_batch > hello.kv_block_count)
    return resourceExhausted("the worker's KV cache is too small for this run");
  if (positions > hello.max_context)
    return invalidArgument("iterations exceed the model's context");
  return blocks_per_seq;
}

std::vector<std::vector<uint32_t>> blockTables(uint32_t batch, uint32_t blocks_per_seq) {
  std::vector<std::vector<uint32_t>> blocks(batch);
  for (uint32_t s = 0; s < batch; ++s)
    for (uint32_t b = 0; b < blocks_per_seq; ++b) blocks[s].push_back(s * blocks_per_seq + b);
  return blocks;
}

}  // namespace

Result<std::vector<StepBenchRow>> runStepBench(const StepBenchOptions& o) {
  auto client = spawnBenchWorker(o, o.in_step_checks);
  if (!client.ok()) return client.status();
  const WorkerHello& hello = (*client)->hello();
  const uint32_t positions = o.iterations + 21;
  BULKHEAD_ASSIGN_OR_RETURN(const uint32_t blocks_per_seq, blocksPerSequence(o, hello));

  // Rows are verified and sampled (greedy) on the pool, as the broker does after every step.
  WorkPool pool(o.sampling_threads);
  RowSampler sampler(pool);
  // As the broker: only some of a large host's cores spin while the pool is warm
  // (SchedulerOptions::warm_spinners); watch for replies awake around when they are due, warming
  // the pool then.
  if (o.warm_spinners > 0)
    pool.setSpinners(o.warm_spinners);
  else if (o.sampling_threads == 0)
    pool.setSpinners(WorkPool::defaultSpinners(hello.backend == "cpu"));
  (*client)->setReplySpin(std::chrono::microseconds(o.reply_spin_us),
                          [&pool](bool warm) { pool.keepWarm(warm); });
  std::printf(
      "step-bench: %s on %s, vocab %u, %u iterations per batch size, scrub share %.3g, "
      "%u sampling threads (%u spinning while warm), in-step weight checks %s\n",
      o.model_dir.c_str(), hello.backend.c_str(), hello.vocab_size, o.iterations, o.scrub_share,
      pool.threads(), pool.spinners(), hello.in_step_checks ? "on" : "off");
  // overhead = rtt - compute, split into the step's round trip beyond the worker's compute
  // (messages, wake-ups, header checks) and the verification and sampling of its rows.
  std::printf("%6s %12s %12s %12s %14s %14s %12s %12s %12s\n", "batch", "rtt_p50_us", "rtt_p99_us",
              "compute_p50", "overhead_p50", "overhead_p99", "trip_p50", "sample_p50", "MB/step");
  nlohmann::json report = {{"model", o.model_dir},
                           {"backend", hello.backend},
                           {"vocab", hello.vocab_size},
                           {"iterations", o.iterations},
                           {"results", nlohmann::json::array()}};
  // What a default request asks for: greedy, no logprobs.
  const SamplingConfig greedy{.logprobs = false};
  std::vector<RowToSample> jobs;
  std::vector<SampledRow> sampled;
  std::vector<StepBenchRow> rows_out;
  // The round trip beyond compute, piece by piece (StepTimeline), per batch size: building the
  // message, to the worker (the write and the worker's wake-up), in the worker before and after
  // its compute (reading, decoding; publishing, the reply), back to the broker (the write and the
  // broker's wake-up), and the reply's checks until step() returns.
  struct Pieces {
    uint32_t batch = 0;
    std::vector<double> build = {}, to_worker = {}, in_worker = {}, to_broker = {}, checks = {};
    double awake = 0;  // the share of replies read while the broker watched for them awake
  };
  std::vector<Pieces> pieces;
  uint64_t step_id = 1, seq_base = 1;
  for (uint32_t batch : o.batches) {
    const auto blocks = blockTables(batch, blocks_per_seq);
    const std::vector<uint32_t> rows = {0}, token = {1};
    std::vector<double> rtt, compute, overhead, trip, sample;
    Pieces& piece = pieces.emplace_back(Pieces{.batch = batch});
    const uint64_t awake_before = (*client)->repliesSeenAwake();
    for (uint32_t it = 0; it < positions - 1; ++it) {
      const std::vector<SequenceStep> steps = decodeSteps(batch, it, seq_base, blocks, token, rows);
      const auto start = std::chrono::steady_clock::now();
      auto result = (*client)->step(step_id++, steps, std::chrono::seconds(60));
      if (!result.ok()) return result.error().toStatus();
      const auto replied = std::chrono::steady_clock::now();
      jobs.clear();
      for (const PendingRow& row : result->rows)
        jobs.push_back({.logits = row.payload,
                        .expected_checksum = row.checksum,
                        .config = &greedy,
                        .prompt = {},
                        .generated = {},
                        .position = it + 1});
      sampled.resize(jobs.size());
      sampler.verifyAndSample(jobs, sampled);
      pool.keepWarm(false);
      const double us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
              .count();
      for (const SampledRow& row : sampled)
        if (row.failed != IntegrityCheck::kNone)
          return dataLoss(std::string("a row failed the ") +
                          std::string(integrityCheckName(row.failed)) + " check");
      if (it < 20) continue;  // warm-up
      rtt.push_back(us);
      compute.push_back(double(result->compute_micros));
      overhead.push_back(us - double(result->compute_micros));
      const double trip_us = std::chrono::duration<double, std::micro>(replied - start).count() -
                             double(result->compute_micros);
      trip.push_back(trip_us);
      sample.push_back(us - double(result->compute_micros) - trip_us);
      const StepTimeline& t = result->timeline;
      const auto micros = [](int64_t from, int64_t to) { return double(to - from) / 1e3; };
      const int64_t started = monotonicNanos(start), returned = monotonicNanos(replied);
      piece.build.push_back(micros(started, t.sent));
      piece.to_worker.push_back(micros(t.sent, t.arrived));
      piece.in_worker.push_back(micros(t.arrived, t.compute_start) +
                                micros(t.compute_end, t.replying));
      piece.to_broker.push_back(micros(t.replying, t.read));
      piece.checks.push_back(micros(t.read, returned));
    }
    piece.awake = double((*client)->repliesSeenAwake() - awake_before) / (positions - 1);
    seq_base += batch;
    const double mb = double(batch) * hello.vocab_size * 4 / 1e6;
    std::printf("%6u %12.1f %12.1f %12.1f %14.1f %14.1f %12.1f %12.1f %12.2f\n", batch,
                percentile(rtt, 50), percentile(rtt, 99), percentile(compute, 50),
                percentile(overhead, 50), percentile(overhead, 99), percentile(trip, 50),
                percentile(sample, 50), mb);
    rows_out.push_back({batch, percentile(rtt, 50), percentile(rtt, 99), percentile(compute, 50),
                        percentile(overhead, 50), percentile(overhead, 99)});
    report["results"].push_back({{"batch", batch},
                                 {"rtt_p50_us", percentile(rtt, 50)},
                                 {"rtt_p99_us", percentile(rtt, 99)},
                                 {"compute_p50_us", percentile(compute, 50)},
                                 {"overhead_p50_us", percentile(overhead, 50)},
                                 {"overhead_p99_us", percentile(overhead, 99)},
                                 {"trip_p50_us", percentile(trip, 50)},
                                 {"sample_p50_us", percentile(sample, 50)},
                                 {"logits_mb_per_step", mb}});
  }
  std::printf(
      "the round trip beyond compute, p50 us: build the step, to the worker, in the worker "
      "(before and after compute), to the broker, the reply's checks; the share of replies read "
      "while the broker watched for them awake\n");
  std::printf("%6s %10s %10s %10s %10s %10s %8s\n", "batch", "build", "to_worker", "in_worker",
              "to_broker", "checks", "awake");
  for (size_t i = 0; i < pieces.size(); ++i) {
    const Pieces& p = pieces[i];
    std::printf("%6u %10.1f %10.1f %10.1f %10.1f %10.1f %7.1f%%\n", p.batch,
                percentile(p.build, 50), percentile(p.to_worker, 50), percentile(p.in_worker, 50),
                percentile(p.to_broker, 50), percentile(p.checks, 50), 100 * p.awake);
    report["results"][i]["trip_pieces_p50_us"] = {{"build", percentile(p.build, 50)},
                                                  {"to_worker", percentile(p.to_worker, 50)},
                                                  {"in_worker", percentile(p.in_worker, 50)},
                                                  {"to_broker", percentile(p.to_broker, 50)},
                                                  {"checks", percentile(p.checks, 50)}};
    report["results"][i]["replies_seen_awake"] = p.awake;
  }
  (void)(*client)->shutdown(std::chrono::seconds(10));
  BULKHEAD_RETURN_IF_ERROR(writeJsonReport(o.json_path, report));
  return rows_out;
}

Status runCheckCostBench(const StepBenchOptions& o) {
  BULKHEAD_ASSIGN_OR_RETURN(auto with, spawnBenchWorker(o, true));
  BULKHEAD_ASSIGN_OR_RETURN(auto without, spawnBenchWorker(o, false));
  const WorkerHello& hello = with->hello();
  if (!hello.in_step_checks || without->hello().in_step_checks)
    return failedPrecondition("the workers did not start with and without in-step checks");
  const uint32_t positions = o.iterations + 21;
  BULKHEAD_ASSIGN_OR_RETURN(const uint32_t blocks_per_seq, blocksPerSequence(o, hello));
  std::printf(
      "step-bench --compare-checks: %s on %s, vocab %u, %u iterations per batch size, the two "
      "workers stepped in alternation\n",
      o.model_dir.c_str(), hello.backend.c_str(), hello.vocab_size, o.iterations);
  std::printf("%6s %16s %16s %12s %10s\n", "batch", "checks_on_p50_us", "checks_off_p50_us",
              "cost_us", "cost");
  nlohmann::json report = {{"model", o.model_dir},
                           {"backend", hello.backend},
                           {"vocab", hello.vocab_size},
                           {"iterations", o.iterations},
                           {"results", nlohmann::json::array()}};
  uint64_t step_id = 1, seq_base = 1;
  for (uint32_t batch : o.batches) {
    const auto blocks = blockTables(batch, blocks_per_seq);
    const std::vector<uint32_t> rows = {0}, token = {1};
    std::vector<double> on, off;
    for (uint32_t it = 0; it < positions - 1; ++it) {
      const std::vector<SequenceStep> steps = decodeSteps(batch, it, seq_base, blocks, token, rows);
      // Which worker goes first alternates too.
      WorkerClient* order[2] = {with.get(), without.get()};
      if (it % 2 == 1) std::swap(order[0], order[1]);
      for (WorkerClient* w : order) {
        auto result = w->step(step_id, steps, std::chrono::seconds(60));
        if (!result.ok()) return result.error().toStatus();
        if (it >= 20) (w == with.get() ? on : off).push_back(double(result->compute_micros));
      }
      ++step_id;
    }
    seq_base += batch;
    const double p_on = percentile(on, 50), p_off = percentile(off, 50);
    std::printf("%6u %16.1f %16.1f %12.1f %9.1f%%\n", batch, p_on, p_off, p_on - p_off,
                100.0 * (p_on - p_off) / p_off);
    report["results"].push_back({{"batch", batch},
                                 {"checks_on_compute_p50_us", p_on},
                                 {"checks_off_compute_p50_us", p_off},
                                 {"cost_us", p_on - p_off},
                                 {"cost_share", (p_on - p_off) / p_off}});
  }
  (void)with->shutdown(std::chrono::seconds(10));
  (void)without->shutdown(std::chrono::seconds(10));
  BULKHEAD_RETURN_IF_ERROR(writeJsonReport(o.json_path, report));
  return okStatus();
}

}  // namespace bulkhead

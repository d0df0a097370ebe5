// `bulkhead`: the command-line tool. Subcommands: logits, make-model, generate, bench,
// step-bench, bench-engine, sample-bench, chaos.
#include <cstdio>
#include <filesystem>
#include <string>

#include <CLI/CLI.hpp>

#include "shared/dtype.h"
#include "tools/chaos.h"
#include "tools/commands.h"
#include "tools/engine_bench.h"
#include "tools/gemm_bench.h"
#include "tools/make_model.h"
#include "tools/qualify.h"
#include "tools/remote.h"
#include "tools/sample_bench.h"
#include "tools/serve_bench.h"
#include "tools/step_bench.h"

namespace {

// An executable installed next to this one.
std::string besideThis(const std::string& name) {
  std::error_code ec;
  return (std::filesystem::read_symlink("/proc/self/exe", ec).parent_path() / name).string();
}

int fail(const std::string& command, const bulkhead::Status& status) {
  std::fprintf(stderr, "bulkhead %s: %s\n", command.c_str(), status.toString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace bulkhead;
  CLI::App app{"bulkhead: LLM generation from GPUs that cannot always be trusted"};
  app.require_subcommand(1);

  std::string model, tokens, out, backend = "cpu";
  auto* logits = app.add_subcommand("logits", "Teacher-forced forward pass; writes all logits");
  logits->add_option("--model", model, "Hugging Face checkpoint directory")->required();
  logits->add_option("--tokens", tokens, "Comma-separated token ids, e.g. 1,5,9")->required();
  logits->add_option("--out", out, "Output file: float32 little-endian [positions][vocab]")
      ->required();
  logits->add_option("--backend", backend, "cpu | cuda | auto");

  MakeModelOptions make;
  std::string dtype = "bf16";
  auto* make_model = app.add_subcommand("make-model", "Write a random-weight checkpoint");
  make_model
      ->add_option("--shape", make.shape,
                   "tiny | tiny-v152k | tiny-llama | qwen2.5-0.5b | qwen2.5-7b | "
                   "qwen2.5-0.5b-layer | qwen2.5-7b-layer | "
                   "qwen2.5-14b")
      ->required();
  make_model->add_option("--out", make.out_dir, "Output directory")->required();
  make_model->add_option("--seed", make.seed, "Seed (same seed, same bytes)");
  make_model->add_option("--layers", make.layers, "Layers (default: the shape's)");
  make_model->add_option("--dtype", dtype, "bf16 | f16 | f32");
  make_model->add_option("--max-shard-bytes", make.max_shard_bytes,
                         "Split into shards above this size");

  LocalGenerateCommand gen;
  RemoteGenerateCommand remote;
  std::string stop_ids;
  uint64_t seed = 0;
  auto* generate = app.add_subcommand(
      "generate",
      "Stream a generation from a broker (--server), or run greedy in-process (--model)");
  // How generate and bench reach a broker that serves TLS or asks for a token.
  auto addSecurity = [](CLI::App* command, ClientSecurity& security) {
    command->add_option("--tls-ca", security.tls_ca, "PEM CA bundle: connect over TLS");
    command->add_option("--tls-cert", security.tls_cert,
                        "PEM client certificate, for a broker that requires one");
    command->add_option("--tls-key", security.tls_key, "PEM private key of --tls-cert");
    command->add_option("--token-file", security.token_file,
                        "File holding the bearer token to send (mode 600)");
  };
  auto* server_opt = generate->add_option("--server", remote.server, "Broker address host:port");
  addSecurity(generate, remote.security);
  auto* model_opt =
      generate->add_option("--model", gen.model_dir, "Run in-process on this checkpoint instead");
  server_opt->excludes(model_opt);
  generate->add_option("--tokens", tokens, "Prompt token ids, e.g. 1,2,3")->required();
  generate->add_option("--max-tokens", remote.max_tokens, "Tokens to generate");
  generate->add_option("--backend", gen.backend, "In-process backend: cpu | cuda | auto");
  generate->add_option("--temperature", remote.temperature, "0 = greedy");
  generate->add_option("--top-k", remote.top_k, "0 = off");
  generate->add_option("--top-p", remote.top_p, "(0, 1]");
  generate->add_option("--min-p", remote.min_p, "[0, 1]");
  generate->add_option("--repetition-penalty", remote.repetition_penalty, "> 0");
  generate->add_option("--presence-penalty", remote.presence_penalty, "[-2, 2]");
  generate->add_option("--frequency-penalty", remote.frequency_penalty, "[-2, 2]");
  auto* seed_opt = generate->add_option("--seed", seed, "Sampling seed");
  generate->add_option("--stop", stop_ids, "Comma-separated stop token ids");
  generate->add_flag("--ignore-eos", remote.ignore_eos, "Do not stop at the model's EOS");
  generate->add_option("--top-logprobs", remote.top_logprobs, "Alternatives per token");
  generate->add_option("--timeout", remote.timeout_s, "Deadline in seconds");
  generate->add_option("--request-id", remote.request_id,
                       "Names the request in the broker's logs and its last message");

  BenchCommand bench_cmd;
  auto* bench = app.add_subcommand("bench", "Load generator against a broker");
  bench->add_option("--server", bench_cmd.server, "Broker address host:port")->required();
  addSecurity(bench, bench_cmd.security);
  bench->add_option("--concurrency", bench_cmd.concurrency, "Concurrent streams");
  bench->add_option("--prompt-len", bench_cmd.prompt_len, "Prompt tokens per request");
  bench->add_option("--gen-len", bench_cmd.gen_len, "Generated tokens per request");
  bench->add_option("--requests", bench_cmd.requests, "Requests in all (default 4 x concurrency)");
  bench->add_option("--warmup-requests", bench_cmd.warmup_requests,
                    "Requests sent first and not measured (default 0)");
  bench->add_option("--json", bench_cmd.json_path, "Also write the results as JSON");
  bench->add_option("--temperature", bench_cmd.temperature, "0 = greedy");
  bench->add_option("--top-p", bench_cmd.top_p, "Nucleus sampling mass (with --temperature)");

  AdminCommand admin_cmd;
  auto* admin = app.add_subcommand(
      "admin", "An operator's call to a broker: workers | stats | drain | restart");
  admin->add_option("action", admin_cmd.action, "workers | stats | drain | restart")->required();
  admin
      ->add_option("--server", admin_cmd.server,
                   "Broker address host:port, or unix:PATH of its --admin-socket")
      ->required();
  admin->add_option("--worker", admin_cmd.worker,
                    "drain: only this worker (its sequences move to the others); restart: this "
                    "worker (needed with several)");
  addSecurity(admin, admin_cmd.security);

  ServeBenchOptions serve_opts;
  std::string serve_concurrency = "1,32,64";
  auto* serve_bench = app.add_subcommand(
      "serve-bench", "End-to-end tokens/s through a broker against the worker's compute ceiling");
  serve_bench->add_option("--model", serve_opts.model_dir, "Checkpoint directory")->required();
  serve_bench->add_option("--backend", serve_opts.backend, "cpu | cuda | auto");
  serve_bench->add_option("--concurrency", serve_concurrency, "Comma-separated stream counts");
  serve_bench->add_option("--prompt-len", serve_opts.prompt_len, "Prompt tokens per request");
  serve_bench->add_option("--gen-len", serve_opts.gen_len, "Generated tokens per request");
  serve_bench->add_option("--requests-per-stream", serve_opts.requests_per_stream,
                          "Requests each stream sends");
  serve_bench->add_option("--warmup-requests-per-stream", serve_opts.warmup_requests_per_stream,
                          "Untimed requests each stream sends first (the fresh worker's graph "
                          "captures and first launches; the broker's own columns include them)");
  serve_bench
      ->add_option("--broker-arg", serve_opts.broker_args,
                   "Extra broker flag (repeatable; default: the broker's defaults)")
      ->allow_extra_args(false);
  serve_bench
      ->add_option("--worker-arg", serve_opts.worker_args,
                   "Extra flag for every worker, the ceiling's step-bench included (repeatable)")
      ->allow_extra_args(false);
  serve_bench->add_option("--json", serve_opts.json_path, "Also write the results as JSON");
  std::string serve_workers = "1";
  serve_bench->add_option("--workers", serve_workers,
                          "Comma-separated worker counts behind the broker (e.g. 1,2,4): each row "
                          "also gives tokens/s against the same row with one worker");

  StepBenchOptions step_opts;
  std::string batches = "1,32";
  auto* step_bench =
      app.add_subcommand("step-bench", "Round-trip cost of a worker step beyond compute");
  step_bench->add_option("--model", step_opts.model_dir, "Checkpoint directory")->required();
  step_bench->add_option("--worker", step_opts.worker_path,
                         "bulkhead-worker executable (default: next to this one)");
  step_bench->add_option("--backend", step_opts.backend, "cpu | cuda | auto");
  step_bench->add_option("--batches", batches, "Comma-separated batch sizes");
  step_bench->add_option("--iterations", step_opts.iterations, "Measured steps per batch size");
  step_bench->add_option("--json", step_opts.json_path, "Also write the results as JSON");
  step_bench->add_option("--sampling-threads", step_opts.sampling_threads,
                         "Threads verifying and sampling rows (0: one per core)");
  step_bench->add_option("--warm-spinners", step_opts.warm_spinners,
                         "Sampling threads that spin while the pool is warm, as the broker's "
                         "option of that name (0: by host)");
  step_bench
      ->add_option("--reply-spin-us", step_opts.reply_spin_us,
                   "Watch awake for a step's reply this long either side of when it is due, as "
                   "the broker's option of that name")
      ->check(CLI::Range(int64_t(0), int64_t(10'000)));
  step_bench
      ->add_option("--worker-arg", step_opts.worker_args,
                   "An argument passed on to the worker (repeatable; e.g. "
                   "--worker-arg=--cpu-threads=8)")
      ->allow_extra_args(false);
  bool no_in_step_checks = false;
  step_bench->add_flag("--no-in-step-checks", no_in_step_checks,
                       "Run the worker without its in-step weight checks (their cost)");
  bool compare_checks = false;
  step_bench->add_flag("--compare-checks", compare_checks,
                       "Measure what the in-step checks cost: a worker with them and one without, "
                       "stepped in alternation");
  step_bench
      ->add_option("--scrub-share", step_opts.scrub_share,
                   "The worker's background scrubbing, a share of one core (default 0: "
                   "IPC overhead alone)")
      ->check(CLI::Range(0.0, 1.0));

  EngineBenchOptions engine_opts;
  std::string engine_batches = "1,8,32,64", engine_graphs = "on", engine_programmatic = "on";
  auto* engine_bench = app.add_subcommand(
      "bench-engine", "The backend alone, in process: prefill and decode speed per batch size");
  engine_bench->add_option("--model", engine_opts.model_dir, "Checkpoint directory")->required();
  engine_bench->add_option("--backend", engine_opts.backend, "cuda | cpu");
  engine_bench->add_option("--batch", engine_batches, "Comma-separated batch sizes");
  engine_bench->add_option("--graphs", engine_graphs, "on | off: decode steps as CUDA graphs")
      ->check(CLI::IsMember({"on", "off"}));
  engine_bench
      ->add_option("--programmatic-launch", engine_programmatic,
                   "on | off: each of a step's kernels may begin while the one before finishes")
      ->check(CLI::IsMember({"on", "off"}));
  engine_bench->add_option(
      "--gemm-schedules", engine_opts.gemm_schedules,
      "CUDA: the product's schedule, one or one per bucket of rows "
      "(1-8,9-16,17-32,33+): plain, pipelined, two_tiles, interleaved, paired, tiled");
  engine_bench->add_option("--gemm-splits", engine_opts.gemm_splits,
                           "CUDA: split counts for some product shapes, NxK=S[,NxK=S...] (S 1 to "
                           "8; other numbers for those shapes, the same at every row count)");
  engine_bench->add_option("--gemm-shape-schedules", engine_opts.gemm_shape_schedules,
                           "CUDA: schedules for some product shapes in steps of 33-95 rows, "
                           "NxK=NAME[,NxK=NAME...] (the same numbers)");
  engine_bench->add_option("--prompt", engine_opts.prompt, "Tokens prefilled per sequence");
  engine_bench->add_option("--max-step-tokens", engine_opts.max_step_tokens,
                           "Tokens a step may hold (the backend's default: 8192); longer "
                           "prefills go in chunks");
  engine_bench->add_option("--steps", engine_opts.steps, "Timed decode steps per batch size");
  bool engine_alone = false;
  engine_bench->add_flag("--no-compare", engine_alone,
                         "Skip the runs without in-step checks and through cuBLAS");
  engine_bench->add_flag("--residual-in-products", engine_opts.residual_in_products,
                         "CUDA: the attention output's and MLP's products add into the residual "
                         "stream themselves, and the norms only add partials up");
  engine_bench->add_flag("--norm-in-products", engine_opts.norm_in_products,
                         "CUDA, with --residual-in-products: steps of 1-8 rows normalise their "
                         "q/k/v and gate/up inputs in those products, without norm launches");
  engine_bench->add_flag("--silu-in-products", engine_opts.silu_in_products,
                         "CUDA: steps of 1-8 rows compute the MLP's activation in the down "
                         "product, without activation launches");
  engine_bench
      ->add_option("--rope-in-attention", engine_opts.rope_in_attention,
                   "CUDA: in decode steps the attention kernel adds the q/k/v biases, rotates and "
                   "writes the cache itself, without q/k/v kernel launches (auto: for head sizes "
                   "up to 64, without --attention-mma)")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  // CUDA options taking on | off, their default shown.
  auto engineOnOff = [&](const char* name, std::string& value, const char* help) {
    engine_bench->add_option(name, value, help)
        ->check(CLI::IsMember({"on", "off"}))
        ->capture_default_str();
  };
  engineOnOff("--attention-tiles", engine_opts.attention_tiles,
              "CUDA: in prefill steps attention takes 4-8 rows of a sequence a block, loading "
              "each key and value once for them");
  engine_bench
      ->add_option("--attention-paired-rows", engine_opts.attention_paired_rows,
                   "CUDA: steps of at most this many rows take each row's attention chunks two "
                   "at a time (head sizes up to 64; the same numbers)")
      ->capture_default_str();
  engineOnOff("--attention-mma", engine_opts.attention_mma,
              "CUDA: attention on the tensor cores in every step (head sizes 64 and 128); other "
              "numbers than the CUDA-core kernel, each invariant");
  engineOnOff("--logits-in-product", engine_opts.logits_in_product,
              "CUDA: lm_head stores the logits rows to their destinations as it computes them "
              "(off: a copy after it)");
  engineOnOff("--cublas-products", engine_opts.cublas_products,
              "CUDA: every product through workspace-0 cuBLAS, whose weights only the arithmetic "
              "check sees in the step (off: our kernels, which fold every word)");
  engine_bench->add_flag("--kernel-times", engine_opts.kernel_times,
                         "CUDA: then where a decode step's device time goes, launch by launch "
                         "(an event after each, no graphs), with and without the checks, and "
                         "where the prefill's went");
  engine_bench->add_option("--weight-budget", engine_opts.weight_budget,
                           "CUDA: device memory for the weights (such as 8GiB); the products' "
                           "weights beyond it are streamed from host memory every step");
  engine_bench->add_option("--json", engine_opts.json_path, "Also write the results as JSON");

  GemmBenchOptions gemm_opts;
  std::string gemm_rows = "1,8,32,64";
  auto* gemm_bench = app.add_subcommand(
      "bench-gemm", "A model shape's products alone on the GPU: each schedule of ours and cuBLAS");
  gemm_bench->add_option("--shape", gemm_opts.shape, "A make-model shape (e.g. qwen2.5-7b)");
  gemm_bench->add_option("--rows", gemm_rows, "Comma-separated row counts");
  gemm_bench->add_option("--launches", gemm_opts.launches, "Timed launches per cell")
      ->check(CLI::Range(1u, 100000u));
  gemm_bench->add_option("--json", gemm_opts.json_path, "Also write the results as JSON");

  SampleBenchOptions sample_opts;
  std::string sample_rows = "1,8,32,64";
  auto* sample_bench = app.add_subcommand(
      "sample-bench", "Broker cost of verifying and sampling logits rows, without a worker");
  sample_bench->add_option("--vocab", sample_opts.vocab, "Vocabulary size (row length)");
  sample_bench->add_option("--rows", sample_rows, "Comma-separated rows per call");
  std::string sample_threads = "0";
  sample_bench->add_option("--threads", sample_threads,
                           "Comma-separated pool sizes, one table each (0: all cores)");
  sample_bench->add_option("--iterations", sample_opts.iterations, "Measured calls per cell");
  sample_bench->add_flag("--peaked", sample_opts.peaked,
                         "Rows as trained models give them (a few likely tokens) instead of "
                         "near-flat ones");
  sample_bench
      ->add_option("--lanes", sample_opts.lanes,
                   "16: AVX-512 passes where the processor has them; 8: the 8-lane ones (the "
                   "same results)")
      ->check(CLI::IsMember({8u, 16u}));
  sample_bench->add_option("--json", sample_opts.json_path, "Also write the results as JSON");

  ChaosOptions chaos_opts;
  auto* chaos = app.add_subcommand("chaos", "Fault-injection run against its own broker");
  chaos->add_option("--model", chaos_opts.model_dir, "Checkpoint directory")->required();
  chaos->add_option("--faults", chaos_opts.faults, "Faults to inject");
  chaos->add_option("--seed", chaos_opts.seed, "Schedule and request seed (same seed, same run)");
  chaos->add_option("--concurrency", chaos_opts.concurrency, "Concurrent client streams");
  chaos->add_option("--requests", chaos_opts.requests, "Distinct requests in the reference set");
  chaos->add_option("--backend", chaos_opts.backend, "cpu | cuda | auto");
  chaos->add_option("--step-timeout-ms", chaos_opts.step_timeout_ms,
                    "Broker step deadline (how fast hangs are detected)");
  chaos->add_option("--report", chaos_opts.report_path, "Write the JSON report here");
  chaos
      ->add_option("--workers", chaos_opts.workers,
                   "Workers behind the broker; faults land on random ones")
      ->check(CLI::Range(1u, 64u));
  chaos->add_option("--baseline-faults", chaos_opts.baseline_faults,
                    "With several workers: faults for the single-worker run whose recovery times "
                    "the report compares (default: as many as --faults; 0: none)");
  chaos->add_option("--pipeline-sample-share", chaos_opts.pipeline_sample_share,
                    "The broker's --pipeline-sample-share (0: two steps in flight throughout)");
  chaos->add_option("--worker-arg", chaos_opts.worker_args,
                    "Extra worker flag, passed on by the broker (repeatable, e.g. "
                    "--worker-arg=--cuda-weight-budget=600MiB)");
  chaos->add_option("--broker", chaos_opts.broker_path,
                    "bulkhead-broker executable (default: next to this one)");

  QualifyOptions qualify_opts;
  auto* qualify = app.add_subcommand(
      "qualify", "Qualify a backend's canary against the CPU reference engine; write its record");
  qualify->add_option("--model", qualify_opts.model_dir, "Checkpoint directory")->required();
  qualify->add_option("--backend", qualify_opts.backend, "cpu | cuda | auto");
  qualify->add_option("--out", qualify_opts.out_path, "The record (for --canary-record)")
      ->required();
  qualify->add_option("--worker", qualify_opts.worker_path,
                      "bulkhead-worker executable (default: next to this one)");
  qualify->add_option("--worker-arg", qualify_opts.worker_args, "Extra worker flag (repeatable)")
      ->allow_extra_args(false);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  if (*logits) {
    auto parsed = parseTokenList(tokens);
    if (!parsed.ok()) return fail("logits", parsed.status());
    auto summary = runLogits({model, *parsed, out, backend});
    if (!summary.ok()) return fail("logits", summary.status());
    std::printf("%s\n", summary->c_str());
  } else if (*make_model) {
    std::optional<DType> t = dtype == "bf16"  ? std::optional(DType::kBF16)
                             : dtype == "f16" ? std::optional(DType::kF16)
                             : dtype == "f32" ? std::optional(DType::kF32)
                                              : std::nullopt;
    if (!t) return fail("make-model", invalidArgument("--dtype must be bf16, f16 or f32"));
    make.dtype = *t;
    auto report = makeModel(make);
    if (!report.ok()) return fail("make-model", report.status());
    std::printf("wrote %s: shape %s, %.2f M parameters, %.1f MB %s in %d file(s)\n",
                make.out_dir.c_str(), make.shape.c_str(), double(report->parameters) / 1e6,
                double(report->bytes) / 1e6, dtype.c_str(), report->shards);
  } else if (*generate) {
    auto parsed = parseTokenList(tokens);
    if (!parsed.ok()) return fail("generate", parsed.status());
    if (remote.server.empty() && gen.model_dir.empty())
      return fail("generate", invalidArgument("give --server ADDR or --model DIR"));
    if (!remote.server.empty()) {
      remote.tokens = *parsed;
      if (*seed_opt) remote.seed = seed;
      if (!stop_ids.empty()) {
        auto stops = parseTokenList(stop_ids);
        if (!stops.ok()) return fail("generate", invalidArgument("--stop: expected e.g. 2,7"));
        remote.stop_token_ids = *stops;
      }
      Status s = runRemoteGenerate(remote);
      if (!s.ok()) return fail("generate", s);
      return 0;
    }
    gen.tokens = *parsed;
    gen.max_tokens = remote.max_tokens;
    auto result = runLocalGenerate(gen);
    if (!result.ok()) return fail("generate", result.status());
    std::string ids;
    for (uint32_t t : result->tokens) ids += (ids.empty() ? "" : ",") + std::to_string(t);
    std::printf("%s\n", ids.c_str());
    std::fprintf(stderr, "finish %s; prefill %.1f ms, decode %.2f ms/token\n",
                 result->finish_reason.c_str(), result->prefill_ms, result->decode_ms_per_token);
  } else if (*serve_bench) {
    auto parsed = parseTokenList(serve_concurrency);
    if (!parsed.ok())
      return fail("serve-bench", invalidArgument("--concurrency: expected e.g. 1,32,64"));
    serve_opts.concurrency = *parsed;
    auto workers = parseTokenList(serve_workers);
    if (!workers.ok() || workers->empty() ||
        std::find(workers->begin(), workers->end(), 0u) != workers->end())
      return fail("serve-bench", invalidArgument("--workers: expected e.g. 1,2,4"));
    serve_opts.workers = *workers;
    serve_opts.broker_path = besideThis("bulkhead-broker");
    serve_opts.worker_path = besideThis("bulkhead-worker");
    Status s = runServeBench(serve_opts);
    if (!s.ok()) return fail("serve-bench", s);
  } else if (*admin) {
    Status s = runAdmin(admin_cmd);
    if (!s.ok()) return fail("admin", s);
  } else if (*bench) {
    Status s = runBench(bench_cmd);
    if (!s.ok()) return fail("bench", s);
  } else if (*qualify) {
    if (qualify_opts.worker_path.empty()) qualify_opts.worker_path = besideThis("bulkhead-worker");
    auto record = runQualify(qualify_opts);
    if (!record.ok()) return fail("qualify", record.status());
    std::printf("qualified: model %016llx on %s, canary digest %016llx; wrote %s\n",
                static_cast<unsigned long long>(record->model_identity), record->backend.c_str(),
                static_cast<unsigned long long>(record->logits_digest),
                qualify_opts.out_path.c_str());
  } else if (*chaos) {
    if (chaos_opts.broker_path.empty()) chaos_opts.broker_path = besideThis("bulkhead-broker");
    return runChaos(chaos_opts);
  } else if (*step_bench) {
    auto parsed = parseTokenList(batches);
    if (!parsed.ok()) return fail("step-bench", invalidArgument("--batches: expected e.g. 1,32"));
    step_opts.batches = *parsed;
    step_opts.in_step_checks = !no_in_step_checks;
    if (step_opts.worker_path.empty()) step_opts.worker_path = besideThis("bulkhead-worker");
    if (compare_checks) {
      Status s = runCheckCostBench(step_opts);
      if (!s.ok()) return fail("step-bench", s);
      return 0;
    }
    auto s = runStepBench(step_opts);
    if (!s.ok()) return fail("step-bench", s.status());
  } else if (*engine_bench) {
    auto parsed = parseTokenList(engine_batches);
    if (!parsed.ok() || parsed->empty())
      return fail("bench-engine", invalidArgument("--batch: expected e.g. 1,8,32,64"));
    engine_opts.batches = *parsed;
    engine_opts.graphs = engine_graphs == "on";
    engine_opts.programmatic_launch = engine_programmatic == "on";
    engine_opts.compare = !engine_alone;
    Status s = runEngineBench(engine_opts);
    if (!s.ok()) return fail("bench-engine", s);
  } else if (*gemm_bench) {
    auto parsed = parseTokenList(gemm_rows);
    if (!parsed.ok() || parsed->empty())
      return fail("bench-gemm", invalidArgument("--rows: expected e.g. 1,8,32,64"));
    gemm_opts.rows = *parsed;
    Status s = runGemmBench(gemm_opts);
    if (!s.ok()) return fail("bench-gemm", s);
  } else if (*sample_bench) {
    auto parsed = parseTokenList(sample_rows);
    if (!parsed.ok() || parsed->empty())
      return fail("sample-bench", invalidArgument("--rows: expected e.g. 1,8,32,64"));
    sample_opts.rows = *parsed;
    auto threads = parseTokenList(sample_threads);
    if (!threads.ok() || threads->empty())
      return fail("sample-bench", invalidArgument("--threads: expected e.g. 4,8,16"));
    sample_opts.threads.assign(threads->begin(), threads->end());
    Status s = runSampleBench(sample_opts);
    if (!s.ok()) return fail("sample-bench", s);
  }
  return 0;
}

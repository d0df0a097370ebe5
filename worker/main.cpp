// bulkhead-worker: loads a model onto a backend and serves steps to the broker over a Unix socket.
// Crash-only: a broken invariant ends the process; the broker replaces it.
#include <signal.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>

#include <spdlog/spdlog.h>
#include <CLI/CLI.hpp>

#include "shared/checkpoint.h"
#include "shared/config_file.h"
#include "shared/logging.h"
#include "shared/phase_clock.h"
#include "shared/service_notify.h"
#include "worker/backend_factory.h"
#include "worker/canary_check.h"
#include "worker/weight_residency.h"
#include "worker/worker_server.h"

int main(int argc, char** argv) {
  using namespace bulkhead;
  // Read first, and cleared from the environment, so nothing this worker starts reports as it.
  const ServiceNotifier notifier = ServiceNotifier::fromEnvironment();
  CLI::App app{"bulkhead-worker: runs model steps for the bulkhead broker"};
  ConfigFile config_file(app);
  WorkerOptions options;
  std::string backend_name = "auto", log_level = "info";
  BackendOptions backend_options;
  app.add_option("--model", options.model_dir, "Hugging Face checkpoint directory")->required();
  app.add_option("--socket", options.socket_path, "Unix socket path to listen on")->required();
  app.add_option("--backend", backend_name, "cpu | cuda | auto");
  app.add_option("--kv-blocks", backend_options.kv_blocks, "KV cache blocks (0: from budget)");
  app.add_option(
         "--cpu-threads", backend_options.cpu_threads,
         "CPU backend: kernel threads, this one included (0: one a core, five eighths of them "
         "from 8 cores up)")
      ->check(CLI::Range(0u, 4096u));
  app.add_option("--arena-slots", options.arena_slots, "Most logits rows one step may ask for")
      ->check(CLI::Range(1u, 1u << 16));
  app.add_option("--incarnation", options.incarnation, "Incarnation id (0: random)");
  app.add_option("--ready-fd", options.ready_fd, "Descriptor to signal readiness on");
  app.add_flag("--enable-fault-injection", options.enable_fault_injection,
               "Accept FaultInject messages (tests and chaos runs only)");
  app.add_option("--scrub-share", options.scrub_share,
                 "Share of one core's time the background weight scrubber may be busy (0: no "
                 "scrubbing)")
      ->check(CLI::Range(0.0, 1.0));
  int spin_us = -1;
  app.add_option("--spin-us", spin_us,
                 "After a reply, microseconds to watch the socket awake for the next step before "
                 "sleeping (0: sleep at once; -1: by backend, 200 where a device computes and "
                 "the host's threads wait, as on a GPU, else 0)")
      ->check(CLI::Range(-1, 100000));
  app.add_option("--frame-wait-ms", options.frame_wait_ms,
                 "Once a request's first bytes arrive, milliseconds the rest may take before the "
                 "connection is dropped")
      ->check(CLI::Range(1, 3'600'000));
  bool no_in_step_checks = false;
  app.add_flag("--no-in-step-checks", no_in_step_checks,
               "Do not check the weight words each step reads (to measure what the checks cost; "
               "tokens then wait for the scrubber)");
  app.add_option("--device", backend_options.cuda_device,
                 "CUDA backend: the device ordinal to run on (a broker with --workers N gives "
                 "worker i device i)")
      ->check(CLI::Range(0, 1023));
  bool no_cuda_graphs = false;
  app.add_flag("--no-cuda-graphs", no_cuda_graphs,
               "CUDA backend: launch every step's kernels one by one (the logits are the same)");
  bool no_programmatic_launch = false;
  app.add_flag("--no-programmatic-launch", no_programmatic_launch,
               "CUDA backend: launch each of a step's kernels only once the one before it has "
               "finished (by default each may begin, and load its weights, while the one before "
               "it finishes; the logits are the same)");
  app.add_flag("--cuda-attention-mma", backend_options.cuda_attention_mma,
               "CUDA backend: attention on the tensor cores in every step (head sizes 64 and "
               "128): long prompts prefill 1.5-1.8 times as fast, decode at short contexts is "
               "slower. Other numbers than without it, so the worker names its backend cuda-mma "
               "and canary records made without it do not apply");
  app.add_flag("--cuda-cublas-products", backend_options.cuda_cublas_products,
               "CUDA backend: every matrix multiply through cuBLAS (faster on large models, most "
               "in prefill and at 33-64 rows), whose weights only the arithmetic check sees in "
               "the step: a flipped bit inside its tolerance changes tokens until the scrubber "
               "finds it. Other numbers than without it, so the worker names its backend "
               "cuda-cublas and canary records made without it do not apply");
  const auto byteSize = [](const std::string& v) {
    const auto size = parseByteSize(v);
    return size.ok() ? std::string() : std::string(size.status().message());
  };
  app.add_option("--cuda-weight-budget", backend_options.cuda_weight_budget,
                 "CUDA backend: device memory for the weights (such as 40GiB; 0: no limit). The "
                 "products' weights beyond it stay in pinned host memory and are copied in every "
                 "step through staging slots (a step then takes at least the streamed bytes over "
                 "the host-to-device bandwidth); the logits are the same")
      ->check(byteSize);
  config_file.addList(app, "--cuda-streamed", backend_options.cuda_streamed_units,
                      "CUDA backend: a weight unit to stream whatever the budget (layers.N.qkv, "
                      "layers.N.o, layers.N.gate_up, layers.N.down, lm_head; repeatable)");
  app.add_option("--cuda-stream-larger-than", backend_options.cuda_stream_larger_than,
                 "CUDA backend: stream every weight unit larger than this (such as 200MiB; 0: "
                 "none by size), whatever the budget")
      ->check(byteSize);
  app.add_option("--cuda-staging-slots", backend_options.cuda_staging_slots,
                 "CUDA backend: device slots streamed weights are copied into, each the size of "
                 "the largest streamed unit (more let copies run further ahead)")
      ->check(CLI::Range(1u, 64u));
  app.add_option("--gemm-schedules", backend_options.cuda_gemm_schedules,
                 "CUDA backend: the product's schedule, one for all steps or one per bucket of "
                 "rows (1-8,9-16,17-32,33+): plain, pipelined, two_tiles, interleaved, paired or "
                 "tiled (the logits are the same; by default pipelined,plain,plain,tiled)");
  std::string canary_record;
  app.add_option("--canary-record", canary_record,
                 "A canary record `bulkhead qualify` made for this model and backend: the worker "
                 "runs the canary after loading and is ready only if its digest matches");
  std::string perturb;
  app.add_option("--perturb-weight", perturb,
                 "BYTE:BIT to flip in the resident weights at start (needs "
                 "--enable-fault-injection; simulates a worker that computes wrongly from birth)");
  app.add_option("--perturb-attention", backend_options.attention_scale_factor,
                 "Multiply the attention's score scale by this (needs --enable-fault-injection; "
                 "simulates a kernel that computes wrongly from birth while its weight reads and "
                 "products all check out)");
  app.add_option("--log-level", log_level, "trace | debug | info | warn | error");
  config_file.addOptions(app);
  if (auto stop = config_file.parse(app, argc, argv)) return *stop;
  if (config_file.printed(app)) return 0;

  configureLogging("worker %P", log_level);
  while (options.incarnation == 0) {
    if (::getrandom(&options.incarnation, sizeof(options.incarnation), 0) !=
        ssize_t(sizeof(options.incarnation))) {
      spdlog::critical("getrandom failed");
      return 1;
    }
  }
  setProcessLogFields({.worker = std::to_string(::getpid()), .incarnation = options.incarnation});
  // The serving loop reads SIGTERM and SIGINT from a signalfd. Block them before any thread starts
  // (the backend's pools): a thread that left them unblocked would take the default action, and
  // the worker would die instead of shutting down cleanly. During a load they wait for the loop.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  ::pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  backend_options.check_weight_reads = !no_in_step_checks;
  backend_options.cuda_graphs = !no_cuda_graphs;
  backend_options.cuda_programmatic_launch = !no_programmatic_launch;
  if (backend_options.attention_scale_factor != 1.0f && !options.enable_fault_injection) {
    spdlog::critical("--perturb-attention needs --enable-fault-injection");
    return 2;
  }
  PhaseClock clock;
  auto checkpoint = Checkpoint::open(options.model_dir);
  if (!checkpoint.ok()) {
    spdlog::critical("{}", checkpoint.status().toString());
    return 1;
  }
  auto shared = std::make_shared<const Checkpoint>(std::move(*checkpoint));
  clock.phase("checkpoint");
  auto backend = createBackend(backend_name, shared, backend_options);
  if (!backend.ok()) {
    spdlog::critical("{}", backend.status().toString());
    return 1;
  }
  clock.phase("backend load");
  const auto bytesGiven = [](const std::string& v) {
    const auto size = parseByteSize(v);
    return size.ok() && *size > 0;
  };
  if (!(*backend)->name().starts_with("cuda") &&
      (bytesGiven(backend_options.cuda_weight_budget) ||
       !backend_options.cuda_streamed_units.empty() ||
       bytesGiven(backend_options.cuda_stream_larger_than)))
    spdlog::warn(
        "the {} backend keeps every weight in its own memory: the CUDA options for "
        "streamed weights do nothing here",
        (*backend)->name());
  // A GPU worker's threads wait while the device computes, so watching the socket costs no
  // compute; a step's request then needs no wake-up, and the next launch runs on a core kept
  // busy (0.5B on an H100: b1 compute 1.19 -> 0.88 ms in step-bench, c1 911.7 -> 999.2 tokens/s).
  // A CPU worker's compute threads would lose the core.
  options.spin_us =
      spin_us >= 0 ? spin_us : ((*backend)->limits().compute_grows_with_rows ? 0 : 200);
  // The digest of the loaded weights (every byte once), which the canary and the broker check.
  const uint64_t weight_digest = shared->weightDigest();
  clock.phase("weight digest");
  spdlog::info("loaded {} ({}) on {}: {} KV blocks of {}", options.model_dir,
               shared->config().architecture_name, (*backend)->name(),
               (*backend)->limits().kv_block_count, (*backend)->limits().kv_block_size);
  if (!perturb.empty()) {
    unsigned long long byte = 0;
    unsigned bit = 0;
    if (!options.enable_fault_injection ||
        std::sscanf(perturb.c_str(), "%llu:%u", &byte, &bit) != 2) {
      spdlog::critical("--perturb-weight needs --enable-fault-injection and BYTE:BIT");
      return 2;
    }
    Status flipped = (*backend)->flipWeightBit(byte, uint8_t(bit));
    if (!flipped.ok()) {
      spdlog::critical("{}", flipped.toString());
      return 2;
    }
    spdlog::warn("fault injection: resident weight byte {} bit {} flipped at start", byte, bit);
  }
  if (!canary_record.empty()) {
    auto record = readCanaryRecord(canary_record);
    if (!record.ok()) {
      spdlog::critical("{}", record.status().toString());
      return 2;
    }
    if (Status passed = checkCanaryRecord(**backend, *shared, *record); !passed.ok()) {
      spdlog::critical("canary failed at start: {}", passed.toString());
      return 1;
    }
    spdlog::info("canary passed: digest {:016x} as {} records", record->logits_digest,
                 canary_record);
    clock.phase("canary");
  }
  options.notifier = notifier;
  auto server = WorkerServer::create(std::move(*backend), shared, options);
  if (!server.ok()) {
    spdlog::critical("{}", server.status().toString());
    return 1;
  }
  clock.phase("arena and scrub references");
  spdlog::info("started in {} (weights {:016x})", clock.summary(), weight_digest);
  // A backend failure ends serve() with an error: crash-only, the broker replaces this worker.
  Status served = (*server)->serve();
  notifier.notify("STOPPING=1");
  if (!served.ok()) {
    spdlog::critical("{}", served.toString());
    return 1;
  }
  spdlog::info("clean shutdown");
  return 0;
}

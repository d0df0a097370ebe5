// bulkhead-broker: the long-lived process users talk to. Serves bulkhead.v1 over gRPC, spawns
// and supervises its worker, and writes the bound address to --ready-file once it serves.
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <spdlog/spdlog.h>
#include <CLI/CLI.hpp>

#include "broker/generator_service.h"
#include "broker/metrics.h"
#include "broker/router.h"
#include "broker/worker_client.h"
#include "shared/config_file.h"
#include "shared/logging.h"
#include "shared/model_config.h"
#include "shared/service_notify.h"
#include "shared/socket_path.h"
#include "worker/reference_engine.h"
#include "worker/weight_scrubber.h"

namespace {

// Writes atomically, so a reader never sees a half-written address.
bool writeReadyFile(const std::string& path, const std::string& address) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << address << "\n";
    if (!out) return false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace bulkhead;
  // Read first, and cleared from the environment, so the workers this broker spawns never report
  // as its service.
  const ServiceNotifier notifier = ServiceNotifier::fromEnvironment();
  CLI::App app{"bulkhead-broker: serves LLM generations from supervised workers"};
  ConfigFile config_file(app);
  std::string model_dir, listen = "127.0.0.1:50051", backend = "auto", ready_file, worker_path;
  std::string log_level = "info";
  uint32_t kv_blocks = 0, arena_slots = 0;
  bool fault_injection = false;
  uint32_t step_timeout_ms = 10'000;
  SchedulerOptions options;
  app.add_option("--model", model_dir, "Hugging Face checkpoint directory")->required();
  app.add_option("--listen", listen, "Address to serve on (port 0 picks a free one)");
  app.add_option("--backend", backend, "Worker backend: cpu | cuda | auto");
  app.add_option("--ready-file", ready_file, "Written with the bound host:port once serving");
  int ready_fd = -1;
  app.add_option("--ready-fd", ready_fd,
                 "Descriptor that gets \"listening HOST:PORT\" once bound, then \"serving\" "
                 "once a worker is ready, then is closed");
  app.add_option("--worker", worker_path, "bulkhead-worker executable (default: next to this one)");
  app.add_option("--kv-blocks", kv_blocks, "Worker KV cache blocks (0: the backend's default)");
  app.add_option("--max-batch-tokens", options.max_batch_tokens, "Tokens per step");
  app.add_option("--max-running", options.max_running, "Sequences decoding at once");
  app.add_option("--max-waiting", options.max_waiting, "Queued requests before RESOURCE_EXHAUSTED");
  app.add_option("--pipeline-sample-share", options.pipeline_sample_share,
                 "Two steps in flight once sampling takes this share of compute (beside a CPU "
                 "worker: whichever mode runs faster; negative: never; 0: always)");
  uint32_t max_message_bytes = 16 << 20;
  app.add_option("--max-message-bytes", max_message_bytes,
                 "Largest gRPC message received or sent (larger: RESOURCE_EXHAUSTED)")
      ->check(CLI::Range(1024u, 1u << 30));
  std::string admin_socket;
  app.add_option("--admin-socket", admin_socket,
                 "Serve Admin only on this Unix socket (owner-only), not on the gRPC port");
  uint32_t max_streams = 256;
  app.add_option("--max-streams-per-connection", max_streams,
                 "Streams one client connection may have open at once (more wait their turn)")
      ->check(CLI::Range(1u, 1u << 20));
  app.add_option("--step-timeout-ms", step_timeout_ms, "Base deadline of a worker step");
  app.add_option("--arena-slots", arena_slots, "Logits rows per step (default: --max-running)");
  uint32_t step_timeout_per_token_us = 10'000;
  app.add_option("--step-timeout-per-token-us", step_timeout_per_token_us,
                 "Added to a step's deadline per token in the step");
  std::string state_dir;
  app.add_option("--state-dir", state_dir,
                 "Canary records (default: $STATE_DIRECTORY, else ~/.local/state/bulkhead)");
  uint32_t canary_interval_s = 60;
  app.add_option("--canary-interval-s", canary_interval_s,
                 "Run the canary between generations this often (0: only at worker start)");
  uint32_t heartbeat_ms = 2'000;
  app.add_option("--canary-every-steps", options.canary_every_steps,
                 "The canary rides along with every N-th step under load (0: never)");
  std::string canary_record;
  app.add_option("--canary-record", canary_record,
                 "A canary record pinned by `bulkhead qualify`: the only reference, nothing is "
                 "recorded (default: qualify against the CPU reference engine and record in the "
                 "state directory)");
  app.add_option("--heartbeat-ms", heartbeat_ms, "Heartbeat an idle worker this often");
  double scrub_share = kDefaultScrubShare;
  app.add_option("--scrub-share", scrub_share,
                 "Workers re-verify their weights in the background, busy at most this share of "
                 "one core (0: no scrubbing)")
      ->check(CLI::Range(0.0, 1.0));
  int64_t reply_spin_us = -1;
  app.add_option(
         "--reply-spin-us", reply_spin_us,
         "Watch awake for a step's reply from this long before the shortest of the last "
         "steps' times until this long after the longest (at most a quarter past the "
         "shortest), so it is read without a scheduler wake-up (0: sleep; -1: by host, 50 on "
         "hosts of 8 cores or more, else 0)")
      ->check(CLI::Range(int64_t(-1), int64_t(10'000)));
  app.add_flag("--enable-fault-injection", fault_injection,
               "Start workers that accept fault injection (tests and chaos runs only)");
  unsigned sampling_threads = 0;
  app.add_option("--sampling-threads", sampling_threads,
                 "Threads that verify and sample logits rows (0: one per core, or the quarter of "
                 "the cores a CPU worker leaves free beside it on a host of 8 or more)");
  unsigned warm_spinners = 0;
  app.add_option(
      "--warm-spinners", warm_spinners,
      "Sampling threads that spin while the pool waits warm for a step's rows, the "
      "caller counted (0: by host: an eighth of the cores beside a CPU worker, a quarter "
      "beside a GPU one, every thread below 8 cores)");
  std::vector<std::string> worker_args;
  config_file.addList(app, "--worker-arg", worker_args,
                      "A flag passed on to every worker the broker starts (repeatable; e.g. "
                      "--worker-arg=--cpu-threads=8)");
  std::string tls_cert, tls_key, tls_client_ca, token_file, admin_token_file;
  app.add_option("--tls-cert", tls_cert, "PEM certificate chain: serve gRPC over TLS");
  app.add_option("--tls-key", tls_key, "PEM private key of --tls-cert");
  app.add_option("--tls-client-ca", tls_client_ca,
                 "PEM CA bundle: require client certificates signed by it (mutual TLS)");
  app.add_option("--token-file", token_file,
                 "File holding the bearer token Generate requires (mode 600)");
  app.add_option("--admin-token-file", admin_token_file,
                 "File holding the bearer token Admin requires (mode 600; with --token-file and "
                 "without this, Admin is closed)");
  uint32_t workers = 1;
  app.add_option("--workers", workers,
                 "Workers to spawn, one per GPU (worker i gets CUDA device i); a failed worker's "
                 "sequences move to the others at once")
      ->check(CLI::Range(1u, 64u));
  std::vector<std::string> workers_from;
  config_file.addList(app, "--workers-from", workers_from,
                      "Attach to the worker systemd runs on this socket instead of spawning one "
                      "(repeatable: one worker per socket)");
  uint32_t attach_timeout_s = 600;
  app.add_option("--attach-timeout-s", attach_timeout_s,
                 "How long to wait for an attached worker to listen (it loads its model first)");
  std::string metrics_listen;
  app.add_option("--metrics-listen", metrics_listen,
                 "Serve Prometheus metrics at http://HOST:PORT/metrics (port 0 picks a free one; "
                 "empty: none)");
  app.add_option("--log-level", log_level, "trace | debug | info | warn | error");
  config_file.addOptions(app);
  if (auto stop = config_file.parse(app, argc, argv)) return *stop;
  if (config_file.printed(app)) return 0;
  configureLogging("broker", log_level);
  if (reply_spin_us < 0) reply_spin_us = defaultReplySpin().count();
  options.step_timeout_base = std::chrono::milliseconds(step_timeout_ms);
  options.step_timeout_per_token = std::chrono::microseconds(step_timeout_per_token_us);
  options.canary_interval = std::chrono::seconds(canary_interval_s);
  options.heartbeat_interval = std::chrono::milliseconds(std::max<uint32_t>(heartbeat_ms, 10));
  if (state_dir.empty()) {
    if (const char* s = std::getenv("STATE_DIRECTORY"); s && *s) {
      state_dir = s;  // systemd's StateDirectory=
    } else if (const char* home = std::getenv("HOME"); home && *home) {
      state_dir = std::string(home) + "/.local/state/bulkhead";
    }
  }
  options.state_dir = state_dir;
  if (!canary_record.empty()) {
    auto pinned = readCanaryRecord(canary_record);
    if (!pinned.ok()) {
      spdlog::critical("--canary-record: {}", pinned.status().message());
      return 2;
    }
    options.pinned_canary = *pinned;
  }
  // The reference a new canary is qualified against: the CPU engine on the same checkpoint, in
  // this process.
  options.canary_reference = [model_dir](const WorkerHello& hello, std::span<const uint32_t> tokens,
                                         std::span<const uint32_t> rows) {
    return referenceLogits(model_dir, hello.weight_digest, tokens, rows);
  };

  auto config = ModelConfig::load(model_dir);
  if (!config.ok()) {
    spdlog::critical("{}", config.status().toString());
    return 1;
  }
  if (worker_path.empty()) {
    std::error_code ec;
    worker_path =
        (std::filesystem::read_symlink("/proc/self/exe", ec).parent_path() / "bulkhead-worker")
            .string();
  }
  ModelLimits model{uint32_t(config->vocab_size), uint32_t(config->max_context),
                    config->eos_token_ids};

  // SIGTERM/SIGINT end the process gracefully; block them before any thread starts.
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGINT);
  pthread_sigmask(SIG_BLOCK, &mask, nullptr);

  WorkerClient::SpawnOptions spawn;
  spawn.worker_path = worker_path;
  spawn.model_dir = model_dir;
  spawn.backend = backend;
  spawn.kv_blocks = kv_blocks;
  spawn.arena_slots = arena_slots != 0 ? arena_slots : options.max_running;
  spawn.enable_fault_injection = fault_injection;
  spawn.extra_args = {"--log-level", log_level};
  spawn.extra_args.push_back("--scrub-share");
  spawn.extra_args.push_back(std::to_string(scrub_share));
  spawn.extra_args.insert(spawn.extra_args.end(), worker_args.begin(), worker_args.end());
  // WATCHDOG=1 from the scheduling thread: on every pass of its loop, and while it waits for a
  // worker to load or to listen (at most every half watchdog interval).
  // (The router calls it once every worker's scheduling loop has gone round.)
  auto last_ping = std::chrono::steady_clock::now();
  std::mutex ping_mu;
  auto alive = [&notifier, &last_ping, &ping_mu] {
    const auto period = notifier.watchdogPeriod();
    std::lock_guard lock(ping_mu);
    if (period.count() == 0 || std::chrono::steady_clock::now() - last_ping < period) return;
    notifier.notify("WATCHDOG=1");
    last_ping = std::chrono::steady_clock::now();
  };
  options.alive = alive;
  spawn.waiting = alive;
  // Verification and sampling of logits rows, spread over the host's cores.
  WorkPool pool(sampling_threads);
  // The cores a CPU worker leaves free by default (CpuBackend::defaultThreads).
  if (sampling_threads == 0)
    options.cpu_worker_sampling_threads =
        WorkPool::coresBesideCpuWorker(std::thread::hardware_concurrency());
  // Not every core spins while the pool is warm: with all 16 of a host spinning beside a GPU
  // worker, one step's end in about a hundred waited 3-6 ms for a core.
  if (warm_spinners > 0) {
    options.cpu_worker_warm_spinners = options.warm_spinners = warm_spinners;
  } else if (sampling_threads == 0) {
    options.cpu_worker_warm_spinners = WorkPool::defaultSpinners(/*beside_cpu_worker=*/true);
    options.warm_spinners = WorkPool::defaultSpinners(/*beside_cpu_worker=*/false);
  }
  // Set on SIGTERM before the scheduler stops: an attach still waiting for a worker gives up.
  auto stopping = std::make_unique<std::atomic<bool>>(false);
  // Several CPU workers on one host share its cores.
  const bool has_cpu_threads =
      std::any_of(worker_args.begin(), worker_args.end(),
                  [](const std::string& a) { return a.rfind("--cpu-threads", 0) == 0; });
  if (workers > 1 && backend != "cuda" && !has_cpu_threads) {  // auto picks the CPU
    spawn.extra_args.push_back("--cpu-threads");
    spawn.extra_args.push_back(
        std::to_string(std::max(1u, std::thread::hardware_concurrency() / workers)));
  }
  std::vector<WorkerFactory> factories;
  for (uint32_t i = 0; i < workers && workers_from.empty(); ++i) {
    WorkerClient::SpawnOptions mine = spawn;
    if (workers > 1) {
      mine.extra_args.push_back("--device");
      mine.extra_args.push_back(std::to_string(i));
    }
    factories.push_back(
        [mine, i, reply_spin_us,
         pool = &pool](uint64_t incarnation) -> WorkerResult<std::unique_ptr<WorkerConnection>> {
          WorkerClient::SpawnOptions o = mine;
          // Unique across this broker's workers and across brokers on the host.
          o.incarnation = incarnation ^ (uint64_t(::getpid()) << 32) ^ (uint64_t(i) << 24);
          auto client = WorkerClient::spawn(o);
          if (!client.ok()) return client.error();
          (*client)->setReplySpin(std::chrono::microseconds(reply_spin_us),
                                  [pool](bool warm) { pool->keepWarm(warm); });
          return std::unique_ptr<WorkerConnection>(std::move(*client));
        });
  }
  for (const std::string& path : workers_from) {
    // Attach mode: systemd runs the worker; the broker connects, and after replacing it (which
    // kills it) waits for systemd's next one. Never the incarnation just replaced.
    auto replaced = std::make_shared<uint64_t>(0);
    factories.push_back([path, replaced, timeout = std::chrono::seconds(attach_timeout_s),
                         stopping = stopping.get(), alive, reply_spin_us, pool = &pool](
                            uint64_t) -> WorkerResult<std::unique_ptr<WorkerConnection>> {
      auto client = WorkerClient::attach(path, *replaced, timeout, stopping, alive);
      if (!client.ok()) return client.error();
      (*client)->setReplySpin(std::chrono::microseconds(reply_spin_us),
                              [pool](bool warm) { pool->keepWarm(warm); });
      *replaced = (*client)->hello().incarnation;
      return std::unique_ptr<WorkerConnection>(std::move(*client));
    });
  }
  Router router(std::move(factories), model, options, pool);

  auto auth = Authorizer::load(token_file, admin_token_file);
  auto credentials = serverCredentials(tls_cert, tls_key, tls_client_ca);
  for (const Status& s : {auth.status(), credentials.status()}) {
    if (!s.ok()) {
      spdlog::critical("{}", s.message());
      return 2;
    }
  }
  GeneratorService generator(router, model, *auth);
  AdminService admin(router, fault_injection, *auth);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, *credentials, &port);
  builder.RegisterService(&generator);
  if (admin_socket.empty()) builder.RegisterService(&admin);
  builder.SetMaxReceiveMessageSize(int(max_message_bytes));
  builder.SetMaxSendMessageSize(int(max_message_bytes));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, int(max_streams));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    spdlog::critical("cannot listen on {}", listen);
    return 1;
  }
  // Admin on its own Unix socket: only whoever may open the path (its owner) reaches it.
  std::unique_ptr<grpc::Server> admin_server;
  if (!admin_socket.empty()) {
    if (Status claimed = claimSocketPath(admin_socket); !claimed.ok()) {
      spdlog::critical("--admin-socket: {}", claimed.message());
      return 1;
    }
    grpc::ServerBuilder admin_builder;
    admin_builder.AddListeningPort("unix:" + admin_socket, *credentials);
    admin_builder.RegisterService(&admin);
    admin_server = admin_builder.BuildAndStart();
    if (!admin_server || ::chmod(admin_socket.c_str(), 0600) != 0) {
      spdlog::critical("cannot serve Admin on {}", admin_socket);
      return 1;
    }
    spdlog::info("Admin on unix:{}", admin_socket);
  }
  auto* health = server->GetHealthCheckService();
  health->SetServingStatus(false);
  const std::string host = listen.substr(0, listen.rfind(':'));
  const std::string bound = host + ":" + std::to_string(port);
  spdlog::info("listening on {} (model {}, worker {})", bound, model_dir, worker_path);
  if (ready_fd >= 0) {
    const std::string line = "listening " + bound + "\n";
    if (::write(ready_fd, line.data(), line.size()) < 0) spdlog::error("ready fd: write failed");
  }
  std::unique_ptr<MetricsServer> metrics;
  if (!metrics_listen.empty()) {
    auto started = MetricsServer::start(metrics_listen, router);
    if (!started.ok()) {
      spdlog::critical("{}", started.status().message());
      return 1;
    }
    metrics = std::move(*started);
    spdlog::info("metrics at http://{}/metrics", metrics->address());
    if (ready_fd >= 0) {
      const std::string line = "metrics " + metrics->address() + "\n";
      if (::write(ready_fd, line.data(), line.size()) < 0) spdlog::error("ready fd: write failed");
    }
  }

  std::once_flag ready_once;
  router.setServingCallback([&](bool serving) {
    health->SetServingStatus(serving);
    health->SetServingStatus("bulkhead.v1.Generator", serving);
    notifier.notify(serving ? "STATUS=serving on " + bound
                            : "STATUS=not serving: no healthy worker");
    if (serving) {
      std::call_once(ready_once, [&] {
        notifier.notify("READY=1");
        if (!ready_file.empty() && !writeReadyFile(ready_file, bound))
          spdlog::error("cannot write {}", ready_file);
        if (ready_fd >= 0) {
          const std::string line = "serving\n";
          if (::write(ready_fd, line.data(), line.size()) < 0)
            spdlog::error("ready fd: write failed");
          ::close(ready_fd);
        }
      });
    }
  });
  router.start();

  int sfd = signalfd(-1, &mask, SFD_CLOEXEC);
  signalfd_siginfo info{};
  while (::read(sfd, &info, sizeof(info)) < 0 && errno == EINTR) {
  }
  spdlog::info("signal {} received; shutting down", info.ssi_signo);
  notifier.notify("STOPPING=1");
  stopping->store(true);
  health->SetServingStatus(false);
  // Order matters. Stopping the scheduler finishes every stream and ends the waits of admin
  // calls; their threads are then joined while the scheduler they call still exists; the stream
  // writers then deliver every Finish, which the server's shutdown waits for. Destruction (in
  // reverse order of declaration) finds all of them stopped.
  router.stop();
  admin.stop();
  generator.stop();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  if (admin_server) {
    admin_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    ::unlink(admin_socket.c_str());
  }
  if (!ready_file.empty()) std::remove(ready_file.c_str());
  return 0;
}

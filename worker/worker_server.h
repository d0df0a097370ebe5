// The worker's serving loop: listens on a Unix socket, greets each connection with Hello,
// dispatches every message it reads (steps go to the StepRunner), and validates each one. Bad
// input gets an Error reply and the worker keeps serving; a backend failure or a broken invariant
// ends it (crash-only).
//
// Threads: the serving thread owns the socket, the arena and every step; the WeightScrubber owns
// one scrub thread (started by serve(), joined on shutdown). weights_mutex_ orders them: steps
// take it shared, weight repairs and bit flips exclusive.
#pragma once

#include <chrono>
#include <memory>
#include <shared_mutex>
#include <string>

#include <capnp/message.h>

#include "shared/checkpoint.h"
#include "shared/logits_arena.h"
#include "shared/service_notify.h"
#include "worker/backend.h"
#include "worker/fault_hooks.h"
#include "worker/step_runner.h"
#include "worker/weight_scrubber.h"

namespace bulkhead {

struct WorkerOptions {
  std::string socket_path;
  uint64_t incarnation = 0;
  uint32_t arena_slots = 64;  // most logits rows one step may ask for
  bool enable_fault_injection = false;
  std::string model_dir;
  int ready_fd = -1;  // written to (one byte) and closed once the socket listens
  // Share of one core's time the scrub thread may be busy (0: no scrubbing).
  double scrub_share = kDefaultScrubShare;
  // After a reply, how long the worker polls its socket for the next step before it sleeps in
  // poll(2): a sleeping thread woken on another core costs tens of microseconds a step, a
  // spinning one a core the broker's sampling or the CPU backend may need (0: sleep at once).
  int spin_us = 0;
  // Once a request's first bytes have arrived, how long the rest of its frame may take: a peer
  // that stops in the middle of a frame is dropped (the worker waits for the next connection, its
  // watchdog kept) rather than waited for without end.
  int frame_wait_ms = 30'000;
  // systemd's readiness protocol: READY=1 once the model is loaded and the socket listens,
  // WATCHDOG=1 from the serving loop itself (between steps and while idle), STOPPING=1.
  ServiceNotifier notifier;
};

class WorkerServer {
 public:
  static Result<std::unique_ptr<WorkerServer>> create(std::unique_ptr<Backend> backend,
                                                      std::shared_ptr<const Checkpoint> checkpoint,
                                                      const WorkerOptions& options);
  ~WorkerServer();

  // Serves connections one at a time until Shutdown, SIGTERM or SIGINT: returns OK then. Returns
  // an error when the worker must exit non-zero (a backend failure).
  Status serve();

 private:
  WorkerServer() = default;
  // Waits until `fd` (or the signal descriptor) is readable, first awake for spin_us when `spin`,
  // then in poll(2) sending WATCHDOG=1 when one is due meanwhile; false when a signal arrived.
  bool awaitInput(int fd, bool spin = false);
  void watchdogIfDue();
  // Serves one connection; true when the worker should stop, an error when it must die.
  Result<bool> serveConnection(int fd);
  Status sendHello(int fd);
  // Handles one request; `form` says how to send the reply. True when the worker should stop.
  Result<bool> dispatch(const std::vector<capnp::word>& words, wire::FromWorker::Builder reply,
                        ReplyForm& form);
  Status sendReply(int fd, capnp::MessageBuilder& message, ReplyForm form);

  std::shared_ptr<const Checkpoint> checkpoint_;
  // Declared before the backend, so the backend (which may have registered its memory) is
  // destroyed first.
  std::unique_ptr<LogitsArena> arena_;
  std::unique_ptr<Backend> backend_;
  std::shared_mutex weights_mutex_;
  std::unique_ptr<StepFaults> faults_;
  std::unique_ptr<WeightScrubber> scrubber_;
  std::unique_ptr<StepRunner> runner_;
  uint64_t model_identity_ = 0;
  WorkerOptions options_;
  uint64_t weight_digest_ = 0;
  int listen_fd_ = -1;
  std::chrono::steady_clock::time_point last_watchdog_{};
  int signal_fd_ = -1;
};

}  // namespace bulkhead

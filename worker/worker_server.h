// The worker's serving loop: listens on a Unix socket, greets each connection with Hello, runs
// steps on its Backend, writes logits rows into the arena, and validates every message it reads.
// Bad input gets an Error reply and the worker keeps serving; only a broken invariant ends it.
#pragma once

#include <memory>
#include <string>

#include "shared/checkpoint.h"
#include "shared/logits_arena.h"
#include "worker/backend.h"
#include "worker/weight_scrubber.h"

namespace bulkhead {

struct WorkerOptions {
  std::string socket_path;
  uint64_t incarnation = 0;
  uint32_t arena_slots = 64;  // most logits rows one step may ask for
  bool enable_fault_injection = false;
  std::string model_dir;
  int ready_fd = -1;  // written to (one byte) and closed once the socket listens
  // Resident weight bytes verified after each step (0: no scrubbing).
  uint64_t scrub_bytes_per_step = 256ull << 20;
};

class WorkerServer {
 public:
  static Result<std::unique_ptr<WorkerServer>> create(std::unique_ptr<Backend> backend,
                                                      std::shared_ptr<const Checkpoint> checkpoint,
                                                      const WorkerOptions& options);
  ~WorkerServer();

  // Serves connections one at a time until Shutdown, SIGTERM or SIGINT. Returns OK then.
  Status serve();

 private:
  WorkerServer() = default;
  struct Connection;
  struct PendingFault;
  // Serves one connection; returns true when the worker should stop.
  bool serveConnection(int fd);

  std::shared_ptr<const Checkpoint> checkpoint_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<WeightScrubber> scrubber_;
  uint64_t last_step_ = 0;
  uint64_t model_identity_ = 0;
  std::unique_ptr<LogitsArena> arena_;
  std::unique_ptr<PendingFault> fault_;
  WorkerOptions options_;
  uint64_t weight_digest_ = 0;
  int listen_fd_ = -1;
  int signal_fd_ = -1;
};

}  // namespace bulkhead

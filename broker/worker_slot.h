// One worker slot: the current worker connection and everything about its life — starting it with
// backoff, qualifying it with the canary, heartbeats and idle canaries, arming injected faults,
// and replacing it when it fails. The scheduler owns the sequences; the slot tells it, through
// callbacks, when a worker is lost (its sequences must be replayed) or the slot enters a crash
// loop (requests fail until a start succeeds). Runs on the scheduler thread only.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "broker/broker_stats.h"
#include "broker/canary.h"
#include "broker/canary_run.h"
#include "broker/fault_injection.h"
#include "broker/row_sampling.h"
#include "broker/supervision.h"
#include "broker/worker_connection.h"

namespace bulkhead {

// Starts a worker incarnation.
using WorkerFactory =
    std::function<WorkerResult<std::unique_ptr<WorkerConnection>>(uint64_t incarnation)>;

struct WorkerSlotOptions {
  SupervisionOptions supervision;
  std::chrono::milliseconds request_timeout{10'000};  // canary, ping and heartbeat deadlines
  std::chrono::milliseconds canary_interval{60'000};  // idle canary; 0: only at start
  uint32_t canary_every_steps = 16;  // the canary rides along every N client steps; 0: never
  CanaryReference reference;         // qualifies a canary no record vouches for; empty: none can be
  std::chrono::milliseconds heartbeat_interval{2'000};
  uint32_t vocab_size = 0;  // the model's; a worker reporting another is refused
};

class WorkerSlot {
 public:
  using Clock = std::chrono::steady_clock;
  struct Callbacks {
    std::function<void(const std::string& why)> lost;          // the worker's sequences must replay
    std::function<void(const std::string& why)> crash_loop;    // refuse new requests
    std::function<void(const std::string& why)> fail_waiting;  // then fail what waits
    std::function<void(bool serving)> serving;
    std::function<void()> recovered;  // a start succeeded: the crash loop, if any, is over
  };

  WorkerSlot(WorkerFactory factory, WorkerSlotOptions options, CanaryStore& canaries,
             RowSampler& sampler, FaultInjector& injector, StatsBoard& board, Callbacks callbacks);
  ~WorkerSlot();

  // The ready worker, starting one (and qualifying it with the canary) when there is none and the
  // backoff allows. Null while none is ready.
  WorkerConnection* ensure();
  WorkerConnection* worker() const { return ready_ ? worker_.get() : nullptr; }
  WorkerState state() const { return supervision_.state(); }
  uint64_t nextStepId() { return next_step_id_++; }

  // The canary's KV blocks (0 .. n-1 of every worker), never handed to a sequence; 0 when the
  // worker is too small for the canary.
  uint32_t reservedBlocks() const { return canary_ ? canary_->blocks() : 0; }
  // The canary continuation when it is due to ride along with the next client step (one token,
  // one row, appended after the client sequences); null otherwise.
  const SequenceStep* canaryRide() const;
  // The verdict on a ride-along row that passed row verification: its checksum against the
  // worker's qualified one. kIntegrityFailure (check kCanary) on a mismatch.
  WorkerFailure checkRide(uint64_t row_checksum, uint64_t step_id);

  // Notices a worker process that exited while idle.
  void checkExited();
  // Idle duties: a canary when one is due, else a heartbeat when one is due.
  void idle();
  // The earliest time idle() or ensure() has something to do.
  Clock::time_point nextDuty() const;
  int exitFd() const { return worker_ ? worker_->exitFd() : -1; }

  // Step outcomes, as the scheduler saw them.
  void stepCompleted();
  void failed(const std::string& what);  // detection only (injection timing)
  // Replaces the worker: kills it, tells the scheduler its sequences are lost, counts the
  // failure towards a crash loop unless an operator asked for it. `cause` is a short name from a
  // fixed set ("canary", "timed out", ...): the metrics count replacements by it.
  void replace(std::string_view cause, const std::string& why, bool operator_request = false);
  // Arms a fault an operator asked for on the current worker.
  void armPendingFault(std::chrono::milliseconds step_timeout);
  // A fault waits to be armed on the ready worker.
  bool faultPending() const;
  // Asks the worker for a full scrub pass; replaces it when that fails.
  std::optional<ScrubStatus> vouch();
  // Stops the worker (an orderly exit) and the slot: nothing starts until resume().
  void shutdown();
  void resume();

 private:
  bool start();
  // The full canary of a new worker: the prefix, then the continuation; qualified against the
  // reference engine when no record vouches for it.
  bool passesCanary();
  // The continuation alone (idle canaries).
  bool passesRide();
  // Quarantines the worker: logs, counts, replaces.
  void quarantine(const std::string& why);

  const WorkerFactory factory_;
  const WorkerSlotOptions options_;
  CanaryStore& canaries_;
  RowSampler& sampler_;
  FaultInjector& injector_;
  StatsBoard& board_;
  const Callbacks callbacks_;
  Supervision supervision_;
  std::unique_ptr<WorkerConnection> worker_;
  bool ready_ = false;
  uint64_t next_incarnation_ = 1;
  uint64_t next_step_id_ = 1;
  Clock::time_point last_canary_{}, last_contact_{};
  // The current worker's canary, its continuation step (spans into the plan), the qualified
  // checksum of the continuation's row, and client steps since it last rode along.
  std::optional<CanaryPlan> canary_;
  SequenceStep ride_{};
  uint64_t ride_checksum_ = 0;
  uint32_t steps_since_ride_ = 0;
  bool rode_ = false;  // the step being completed carried the canary
};

}  // namespace bulkhead

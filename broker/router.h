// The broker's workers: one Scheduler (one thread, one worker slot) per worker, and the router in
// front of them. A new request goes to the ready worker holding the fewest sequences (then the one
// with the most free KV blocks) among those whose KV cache can hold it, and stays there, with its
// KV cache, while that worker serves.
// When a worker is lost (any failure), starting, in a crash loop or drained by an operator, the
// sequences it holds move at once to the ready workers and are replayed there from the broker's
// copy of their history; batch-invariant numerics make their tokens the same. The failed worker
// restarts in the background and takes new requests once its canary passes. With no ready worker
// elsewhere, they wait in the router for the first worker that becomes ready (its own restart
// or another's), and fail only once every worker is in a crash loop or drained. A sequence moves
// only to a worker whose cache can hold it (workers may differ), else it waits for one that can.
//
// Every scheduler reports into its own StatsBoard; the router adds them up. One worker behaves
// exactly as a Scheduler alone.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "broker/scheduler.h"

namespace bulkhead {

struct WorkerView {
  std::string name;
  WorkerStatus status;
  SchedulerStats stats;   // counters of the sequences this worker computed
  bool draining = false;  // an operator's drain (Admin Drain with a name) is under way
  bool drained = false;   // stopped by that drain
};

class Router {
 public:
  // One worker per factory (at least one), named worker-0, worker-1, ... The queue limit
  // (options.max_waiting) is the broker's: each worker gets its share.
  Router(std::vector<WorkerFactory> factories, ModelLimits model, SchedulerOptions options,
         WorkPool& pool);
  ~Router();

  void start();
  void stop();

  // Places a validated request on a worker (see the file comment).
  Status submit(GenerationRequest request, std::shared_ptr<TokenSink> sink);
  // Called with true while at least one worker serves, false when none does.
  void setServingCallback(std::function<void(bool)> callback);

  // The whole broker: stops admitting and waits until nothing runs.
  Result<uint32_t> drain(std::chrono::milliseconds timeout);
  // One worker, for an operator replacing its GPU: its sequences move to the others, then it
  // stops until restartWorker(name). FAILED_PRECONDITION when no other worker is ready.
  Result<uint32_t> drainWorker(const std::string& name, std::chrono::milliseconds timeout);
  // Replaces the named worker (empty: the only one), or starts a drained one again.
  Result<std::pair<uint64_t, uint64_t>> restartWorker(const std::string& name,
                                                      std::chrono::milliseconds timeout);
  // Into the named worker; empty: the only one, or with several a ready one picked by `random`.
  Result<InjectionOutcome> injectFault(const std::string& name, Fault fault, uint64_t random,
                                       std::chrono::milliseconds timeout, bool keep_armed = false);

  size_t size() const { return schedulers_.size(); }
  // Sequences waiting in the router for a worker (see the file comment).
  size_t parked() const { return parked_count_.load(); }
  // The broker's counters: every worker's added up, percentiles over all of their windows.
  SchedulerStats stats() const;
  StatsHistograms histograms() const;
  std::vector<WorkerView> workers() const;

 private:
  // The scheduler named `name`; empty names the only one. NOT_FOUND / INVALID_ARGUMENT.
  Result<Scheduler*> find(const std::string& name) const;
  bool ready(size_t i) const;
  // Where a new request of at most `positions` goes: the ready worker with the least load whose KV
  // cache can hold it, else any not drained that can (it waits for that worker), else as if none
  // could.
  size_t place(uint64_t positions) const;
  // Moves `sequences` from worker `from` to the ready others, or parks them (SchedulerLinks).
  size_t handOff(size_t from, std::vector<SequencePtr>& sequences, bool may_park);
  // What worker `claimer` takes of the parked sequences (see claimParked in router.cpp).
  void claimParked(size_t claimer, std::vector<SequencePtr>& into);
  // Keeps `sequences` in the router until a worker is ready (while any may still serve), and
  // wakes those already ready.
  void park(size_t from, std::vector<SequencePtr>& sequences);
  // Worker i is ready or may become ready (not in a crash loop, not drained); anyAlive: some is.
  bool alive(size_t i) const;
  bool anyAlive() const;
  // Ends the parked sequences with `status` (none alive, or the broker stopping).
  void failParked(const Status& status);
  void servingChanged(size_t i, bool serving);
  std::vector<const StatsBoard*> boards() const;

  std::unique_ptr<std::atomic<bool>[]> beats_;  // each loop went round since the last ping
  std::vector<std::unique_ptr<Scheduler>> schedulers_;
  mutable std::mutex mu_;  // serving state only; never held while calling a scheduler
  std::vector<bool> serving_;
  bool any_serving_ = false;
  std::function<void(bool)> serving_callback_;
  // Sequences whose worker went while no other was ready, for the first that is.
  std::mutex parked_mu_;
  std::mutex drains_mu_;  // one operator's drain of a worker at a time
  std::vector<SequencePtr> parked_;
  std::atomic<size_t> parked_count_{0};
};

}  // namespace bulkhead

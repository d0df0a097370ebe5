// The broker's handle on one worker process: spawns (or connects to) bulkhead-worker, sends steps
// over its socket, and returns the logits rows whose arena headers match what was asked for, as
// zero-copy views into the arena (payloads are verified where they are sampled).
#pragma once

#include <sys/types.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <capnp/message.h>

#include "broker/worker_connection.h"
#include "shared/child_process.h"
#include "shared/ipc_frame.h"
#include "shared/logits_arena.h"
#include "shared/status.h"
#include "shared/step_types.h"

namespace bulkhead {

// The broker's default for WorkerClient::setReplySpin: 50 us on a host of 8 cores or more, none on
// a smaller one (a spinning thread there takes a core from a CPU worker's compute; measured on 2
// cores: 40 -> 76 us of round trip at batch 1).
std::chrono::microseconds defaultReplySpin();

// When to watch awake for a step's reply, the step's wait running from `start`: from `spin`
// before the shortest of `recent_waits` (the last steps', start to reply) until `spin` after the
// longest, though no later than a quarter past the shortest. No waits yet: `spin` either side of
// `start`.
struct ReplyWatch {
  SteadyTime wake, until;
};
ReplyWatch replyWatch(SteadyTime start, std::span<const SteadyTime::duration> recent_waits,
                      std::chrono::microseconds spin);

class WorkerClient final : public WorkerConnection {
 public:
  struct SpawnOptions {
    std::string worker_path;  // the bulkhead-worker executable
    std::string model_dir;
    std::string backend = "auto";
    std::string socket_dir;  // a private directory for the socket; created if absent
    uint64_t incarnation = 0;
    uint32_t kv_blocks = 0;
    uint32_t arena_slots = 64;
    bool enable_fault_injection = false;
    std::vector<std::string> extra_args;
    std::chrono::milliseconds start_timeout{120'000};
    // Called every 100 ms while the worker loads (the broker's watchdog ping).
    std::function<void()> waiting;
  };

  static WorkerResult<std::unique_ptr<WorkerClient>> spawn(const SpawnOptions& options);
  // Connects to a worker someone else runs (systemd). Its exit cannot be observed directly.
  static WorkerResult<std::unique_ptr<WorkerClient>> connect(const std::string& socket_path,
                                                             std::chrono::milliseconds timeout);
  // Attach mode: connects to the worker systemd runs on `socket_path`, waiting up to `timeout`
  // for one to listen (a restarted worker loads its model first) whose incarnation is not
  // `replaced` (never re-attach to the worker just replaced). Holds a pidfd of the worker's
  // process: its exit is noticed as a spawned worker's is, and destroying the client (the broker
  // replacing the worker) kills it, so systemd starts a fresh one. shutdown() only disconnects.
  // Gives up early once `*stopping` is set (the broker shutting down).
  // `waiting` is called about every 200 ms while no worker listens.
  static WorkerResult<std::unique_ptr<WorkerClient>> attach(
      const std::string& socket_path, uint64_t replaced, std::chrono::milliseconds timeout,
      const std::atomic<bool>* stopping, const std::function<void()>& waiting = {});
  ~WorkerClient();
  WorkerClient(const WorkerClient&) = delete;
  WorkerClient& operator=(const WorkerClient&) = delete;

  const WorkerHello& hello() const override { return hello_; }
  pid_t pid() const { return attached_pidfd_ >= 0 ? pid_t(hello_.pid) : child_.pid(); }
  // Readable once the worker has exited (-1 when connected to one we neither spawned nor
  // attached to).
  int exitFd() const override { return attached_pidfd_ >= 0 ? attached_pidfd_ : child_.exitFd(); }
  // After any failure other than kRejected or kIntegrityFailure the connection is unusable;
  // further calls fail fast.
  bool broken() const { return !broken_by_.ok(); }

  WorkerFailure sendStep(uint64_t step_id, std::span<const SequenceStep> batch, uint32_t first_slot,
                         std::chrono::milliseconds timeout) override;
  WorkerResult<StepReply> awaitStep() override;
  WorkerResult<ScrubStatus> ping(std::chrono::milliseconds timeout) override;
  WorkerFailure release(std::span<const uint64_t> sequence_ids, std::chrono::milliseconds timeout);
  WorkerFailure heartbeat(std::chrono::milliseconds timeout) override;
  WorkerFailure injectFault(const FaultSpec& fault, std::chrono::milliseconds timeout) override;
  WorkerFailure shutdown(std::chrono::milliseconds timeout) override;
  // How long to watch awake for a step's reply around the time it is due: the thread sleeps
  // until `spin` before the shortest of the last kWaitHistory steps' waits and polls the socket
  // without sleeping until `spin` after the longest (a watch of at most 2 * `spin` and a quarter
  // of the shortest wait), so the reply is read without a scheduler wake-up. 0: sleep in poll
  // throughout.
  // `waking(true)` runs as the thread turns from sleeping to watching: the caller warms what the
  // reply will need next (the broker: its sampling pool, cooled again once the rows are sampled);
  // `waking(false)` when the watch ends without the reply (a step longer than the last), as the
  // thread goes back to sleep.
  void setReplySpin(std::chrono::microseconds spin, std::function<void(bool)> waking = {}) {
    reply_spin_ = spin;
    reply_waking_ = std::move(waking);
  }
  // Step replies that arrived while the thread watched awake for them.
  uint64_t repliesSeenAwake() const { return replies_seen_awake_; }
  // Sends a signal to a spawned worker (supervision and fault tests).
  void kill(int signal);
  // Raw bytes onto the socket, bypassing framing (protocol fault tests).
  Status sendRaw(const void* bytes, size_t size);

 private:
  WorkerClient() = default;
  // Sends `request` and reads one reply frame into reply_words_; the caller parses it. Only with
  // no step awaiting its reply.
  WorkerFailure roundTrip(capnp::MessageBuilder& request, SteadyTime deadline);
  WorkerFailure send(capnp::MessageBuilder& request, SteadyTime deadline);
  WorkerFailure receive(SteadyTime deadline);
  // The reply watch of setReplySpin for a step whose wait runs from `start`.
  void watchForReply(SteadyTime start);
  WorkerFailure unusable() const;
  // Marks the connection broken by `failure` and returns it.
  WorkerFailure fail(WorkerFailure failure);
  // Why the connection ended: the exit status if the process is gone by `wait_until`.
  WorkerFailure connectionLost(const std::string& what, SteadyTime wait_until);
  WorkerFailure handshake(SteadyTime deadline);
  void takeCarried(ScrubStatus& status);
  // A request carrying no payload (ping, shutdown, release, fault) answered by `expected`.
  WorkerFailure simpleCall(capnp::MessageBuilder& request, int expected_which,
                           std::chrono::milliseconds timeout);

  int fd_ = -1;
  ChildProcess child_;       // empty when connected to a worker someone else runs
  int attached_pidfd_ = -1;  // attach mode: the worker's process
  bool let_go_ = false;      // attach mode: shut down by the broker, left running
  std::string owned_socket_dir_;
  WorkerHello hello_;
  std::unique_ptr<LogitsArena> arena_;
  uint64_t next_request_id_ = 1;
  WorkerFailure broken_by_;
  std::vector<capnp::word> reply_words_;
  // Steps sent whose replies have not been read, oldest first: what each reply must match.
  struct SentStep {
    uint64_t request_id = 0, step_id = 0;
    uint32_t first_slot = 0;
    std::vector<std::pair<uint64_t, uint32_t>> rows;  // (sequence, token index) per row
    SteadyTime sent_at;
    std::chrono::milliseconds timeout{0};
    bool behind_another = false;  // sent while another step awaited its reply
  };
  std::deque<SentStep> in_flight_;
  SteadyTime last_step_reply_;  // when the last step's reply was read
  std::chrono::microseconds reply_spin_{0};
  std::function<void(bool)> reply_waking_;
  // The last steps' waits, from their start to their reply (a ring; `waits_seen_` in all).
  static constexpr size_t kWaitHistory = 8;
  std::array<SteadyTime::duration, kWaitHistory> recent_waits_{};
  size_t waits_seen_ = 0;
  uint64_t replies_seen_awake_ = 0;
  // Corruption reports that arrived with a reply whose rows failed verification.
  std::vector<WeightCorruptionReport> carried_corruptions_;
};

}  // namespace bulkhead

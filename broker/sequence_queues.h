// The scheduler's sequences and their KV blocks: waiting (in arrival order, preempted ones at the
// front), running (holding blocks, being computed) and finishing (stopped, waiting for their last
// tokens to be released). Every move between the queues — admission, preemption, release, rollback
// and requeueing after a worker is lost — happens here. Scheduler thread only.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "broker/batch_planner.h"
#include "broker/kv_allocator.h"
#include "broker/release_ledger.h"
#include "broker/sequence.h"
#include "shared/step_types.h"

namespace bulkhead {

struct Sequence {
  uint64_t id = 0;
  GenerationRequest request;
  std::shared_ptr<TokenSink> sink;
  ReleaseLedger ledger;
  uint32_t computed = 0;  // tokens whose KV the current worker holds
  std::vector<uint32_t> blocks;
  FinishReason finish_reason = FinishReason::kNone;
  // In a step sent to the worker whose reply has not been taken: neither planned, preempted nor
  // dropped until it has.
  bool in_flight = false;
  // When the broker took the request, and when it last handed tokens to the client.
  std::chrono::steady_clock::time_point submitted = std::chrono::steady_clock::now();
  std::optional<std::chrono::steady_clock::time_point> last_release;
  // Set when the sequence moved here from a worker that was lost or drained: when that happened,
  // and who to tell once its first token here is released (the fault injector timing recovery).
  struct Migration {
    std::chrono::steady_clock::time_point lost_at;
    std::function<void()> resumed;
  };
  std::optional<Migration> migration;

  Sequence(GenerationRequest r, std::shared_ptr<TokenSink> s)
      : request(std::move(r)), sink(std::move(s)), ledger(request.prompt) {}

  // The most KV positions it can come to need: its whole request, and at least its history and
  // the token it generates next.
  uint64_t mostPositions() const {
    return std::max(uint64_t(request.prompt.size()) + request.max_tokens,
                    uint64_t(ledger.tokens().size()) + 1);
  }
};

using SequencePtr = std::unique_ptr<Sequence>;

// CANCELLED when its client cancelled, DEADLINE_EXCEEDED when its deadline has passed by `now`.
std::optional<Status> endedByClient(const Sequence& s, std::chrono::steady_clock::time_point now);

// A planned step as the worker is asked for it: the sequences, and each one's part of the step
// (views into the sequences' histories and block tables, valid until the queues change).
struct StepRequest {
  std::vector<Sequence*> batch;
  std::vector<SequenceStep> steps;
  std::vector<uint32_t> row_index;  // each sequence's last token, where a row is wanted
  uint32_t tokens = 0;
};

struct QueueCounters {
  uint64_t preemptions = 0, replayed = 0;
  // Computed positions discarded (a lost cache, a rollback) plus sampled tokens dropped unsent.
  uint64_t rolled_back = 0;
};

class SequenceQueues {
 public:
  // `finished` is told about every request that ends, just before its sink is.
  SequenceQueues(uint32_t max_context, std::vector<uint32_t> eos_token_ids,
                 std::function<void(const Status&)> finished);

  std::deque<SequencePtr>& waiting() { return waiting_; }
  std::vector<SequencePtr>& running() { return running_; }
  size_t open() const { return running_.size() + finishing_.size(); }
  bool empty() const { return waiting_.empty() && running_.empty() && finishing_.empty(); }
  bool hasUnreleased() const;
  // Some sequence stopped and waits only for its last tokens to be released.
  bool hasFinishing() const { return !finishing_.empty(); }
  const QueueCounters& counters() const { return counters_; }
  KvBlockAllocator& blocks() { return blocks_; }

  // A new worker with `blocks` KV blocks of `block_size` positions; all sequences must be waiting.
  // A new worker's cache: `blocks` in all, of which the first `reserved` are never handed out.
  void resetBlocks(uint32_t blocks, uint32_t block_size, uint32_t reserved = 0);
  uint32_t blockSize() const { return block_size_; }

  // Starts what the batch planner admits, first come first served.
  void admit(size_t max_running);
  // Ends cancelled requests and those past their deadline.
  void dropCancelled(std::chrono::steady_clock::time_point now);
  void preemptLast();
  bool growBlocks(Sequence& seq, uint32_t blocks);
  // The running sequences as the batch planner sees them.
  std::vector<RunningSequence> runningView() const;
  // Gives each planned sequence the blocks the plan reserved and lays out the step.
  StepRequest assemble(const StepPlan& plan);
  // After a step: each sequence of `batch` advances by its chunk and, when the chunk asked for a
  // row, takes the next token of `chosen` (in order); sequences that stopped give their blocks back
  // and wait for their last tokens. Returns the tokens appended.
  size_t accept(std::span<Sequence* const> batch, std::span<const PlannedChunk> chunks,
                uint64_t step_id, std::span<const TokenChoice* const> chosen,
                std::chrono::steady_clock::time_point step_done);
  // Ends these running sequences with `status`.
  void failRunning(std::span<Sequence* const> batch, const Status& status);
  FinishReason stopReason(const Sequence& seq) const;

  // Sends the tokens of steps up to `clean_through`; ends requests with nothing left to send.
  // Hands the sent tokens' latencies (ReleaseTimes) to `record` when given, before it ends any
  // request: whoever sees a request end (a client, then a metrics scrape) finds its tokens
  // counted.
  void release(uint64_t clean_through, const std::function<void(const ReleaseTimes&)>& record = {});
  // Drops unsent tokens from `from_step` on and replays everything. Returns tokens dropped.
  size_t rollBack(uint64_t from_step);
  // The worker is gone: unsent tokens are dropped and every sequence is replayed.
  void workerLost();
  void failAll(const Status& status);
  void finish(Sequence& seq, FinishReason reason, const Status& status);
  // Every waiting sequence, in order (they hold no blocks): to move to another worker.
  std::vector<SequencePtr> takeWaiting();
  // Sequences from another worker (or given back by takeWaiting's taker) join the waiting ones in
  // the order of their ids, that is of their arrival.
  void adopt(std::vector<SequencePtr> sequences);

 private:
  void requeueAll();
  void freeBlocks(Sequence& seq);

  const uint32_t max_context_;
  const std::vector<uint32_t> eos_;
  const std::function<void(const Status&)> finished_;
  std::deque<SequencePtr> waiting_;
  std::vector<SequencePtr> running_;
  std::vector<SequencePtr> finishing_;
  KvBlockAllocator blocks_;
  uint32_t block_size_ = 16;
  QueueCounters counters_;
};

}  // namespace bulkhead

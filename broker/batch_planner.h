// Batch planning as pure functions of plain state, so each decision is unit-tested alone:
// admission (which waiting sequences start, first come first served, by free KV blocks) and step
// packing (how many tokens each running sequence gets this step, under a token budget and a row
// cap, and which of the newest sequences must be preempted by recompute to make blocks).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace bulkhead {

inline uint32_t blocksFor(uint64_t positions, uint32_t block_size) {
  return uint32_t((positions + block_size - 1) / block_size);
}

enum class Admit { kStart, kRejectTooLarge };

struct WaitingSequence {
  uint32_t history = 0;  // tokens in its history
  uint64_t most = 0;     // the most tokens it can come to hold: prompt + max_tokens
  bool begun = false;    // its client has tokens from it (a replay, or a recompute)
};

// The blocks a sequence may come to need: for its whole request, and at least for its history
// plus the token it will generate next.
inline uint32_t mostBlocks(const WaitingSequence& s, uint32_t block_size) {
  return blocksFor(s.most > uint64_t(s.history) + 1 ? s.most : uint64_t(s.history) + 1, block_size);
}

// The blocks a sequence needs to be admitted at all: a new one's whole request (mostBlocks), so
// that a request the worker could never finish is refused before its first token; one that has
// begun (replayed on a worker that came back with a smaller cache, say) only its history and the
// token it will generate next: it goes on as far as the cache holds it, and may finish first.
inline uint32_t admissionBlocks(const WaitingSequence& s, uint32_t block_size) {
  return s.begun ? blocksFor(uint64_t(s.history) + 1, block_size) : mostBlocks(s, block_size);
}

// Decisions for the longest prefix of `waiting` that can be decided now: a sequence starts when
// the blocks for its history plus the token it will generate next are free; one that could never
// fit the worker (admissionBlocks over its total) is rejected; the first that must wait stops the
// walk (no overtaking).
std::vector<Admit> planAdmission(std::span<const WaitingSequence> waiting, uint32_t free_blocks,
                                 uint32_t total_blocks, uint32_t block_size, size_t running,
                                 size_t max_running);

struct RunningSequence {
  uint32_t history = 0;      // tokens in its history
  uint32_t computed = 0;     // of which the worker's KV cache holds this many
  uint32_t blocks_held = 0;  // KV blocks it holds now
  bool in_flight = false;    // in a step whose reply has not come back: not planned again yet
};

struct StepLimits {
  uint32_t token_budget = 0;
  uint32_t max_rows = 0;  // logits rows one step may ask for
  uint32_t block_size = 0;
  uint32_t free_blocks = 0;
};

struct PlannedChunk {
  size_t index = 0;            // into the running list
  uint32_t chunk = 0;          // tokens to feed, from `computed` on
  bool wants_row = false;      // the chunk ends the history: sample the next token from its row
  uint32_t blocks_needed = 0;  // blocks the sequence must hold for this step
};

struct StepPlan {
  std::vector<PlannedChunk> chunks;  // in running order
  // This many sequences at the back of the running list give their blocks back and wait again
  // (recompute); none of them is in `chunks`.
  size_t preempt = 0;
};

// Running sequences are visited oldest first; each gets as many of its missing tokens as the
// budget allows. When blocks run out, the newest running sequences are preempted until the current
// one fits; if it is itself the newest, it is preempted and planning stops. Sequences in flight
// are skipped, and while any is in flight nothing is preempted: planning stops at the first
// sequence that does not fit (the step in flight gives blocks back or can be waited for).
StepPlan planStep(std::span<const RunningSequence> running, const StepLimits& limits);

}  // namespace bulkhead

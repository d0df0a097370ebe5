// SequenceQueues: moves between waiting, running and finishing, and the KV blocks that go with
// them.
#include "broker/sequence_queues.h"

#include <algorithm>
#include <string>

#include <spdlog/spdlog.h>

#include "broker/batch_planner.h"
#include "shared/logging.h"

namespace bulkhead {

SequenceQueues::SequenceQueues(uint32_t max_context, std::vector<uint32_t> eos_token_ids,
                               std::function<void(const Status&)> finished)
    : max_context_(max_context), eos_(std::move(eos_token_ids)), finished_(std::move(finished)) {}

void SequenceQueues::resetBlocks(uint32_t blocks, uint32_t block_size, uint32_t reserved) {
  blocks_.reset(blocks, reserved);
  block_size_ = block_size;
}

bool SequenceQueues::hasUnreleased() const {
  if (!finishing_.empty()) return true;
  return std::any_of(running_.begin(), running_.end(),
                     [](const SequencePtr& s) { return s->ledger.unreleasedCount() != 0; });
}

void SequenceQueues::admit(size_t max_running) {
  std::vector<WaitingSequence> waiting;
  for (const auto& s : waiting_)
    waiting.push_back({uint32_t(s->ledger.tokens().size()),
                       uint64_t(s->request.prompt.size()) + s->request.max_tokens,
                       s->ledger.released() > 0});
  const auto decisions = planAdmission(waiting, blocks_.freeCount(), blocks_.total(), block_size_,
                                       running_.size(), max_running);
  for (size_t i = 0; i < decisions.size(); ++i) {
    SequencePtr seq = std::move(waiting_.front());
    waiting_.pop_front();
    if (decisions[i] == Admit::kRejectTooLarge) {
      const std::string need = waiting[i].begun
                                   ? "after " + std::to_string(seq->ledger.released()) +
                                         " tokens the sequence's next token needs "
                                   : "prompt (" + std::to_string(seq->request.prompt.size()) +
                                         ") + max_tokens (" +
                                         std::to_string(seq->request.max_tokens) + ") needs ";
      finish(*seq, FinishReason::kNone,
             resourceExhausted(need + std::to_string(admissionBlocks(waiting[i], block_size_)) +
                               " KV blocks of " + std::to_string(block_size_) +
                               " positions; the worker's cache has " +
                               std::to_string(blocks_.total())));
      continue;
    }
    growBlocks(*seq, blocksFor(seq->ledger.tokens().size() + 1, block_size_));
    running_.push_back(std::move(seq));
  }
}

std::optional<Status> endedByClient(const Sequence& s, std::chrono::steady_clock::time_point now) {
  if (s.sink->cancelled()) return Status(Code::kCancelled, "cancelled by the client");
  if (s.request.deadline && now >= *s.request.deadline)
    return Status(Code::kDeadlineExceeded,
                  "deadline exceeded after " + std::to_string(s.ledger.released()) + " tokens");
  return std::nullopt;
}

void SequenceQueues::dropCancelled(std::chrono::steady_clock::time_point now) {
  auto drop = [&](const SequencePtr& s) -> bool {
    if (s->in_flight) return false;  // once its step is back
    const auto ended = endedByClient(*s, now);
    if (ended) finish(*s, FinishReason::kNone, *ended);
    return ended.has_value();
  };
  std::erase_if(running_, drop);
  std::erase_if(finishing_, drop);
  std::erase_if(waiting_, drop);
}

// Recompute: the newest running sequence gives its blocks back and waits again, keeping its whole
// history; it is re-prefilled when blocks free up.
void SequenceQueues::preemptLast() {
  SequencePtr victim = std::move(running_.back());
  running_.pop_back();
  freeBlocks(*victim);
  waiting_.push_front(std::move(victim));
  ++counters_.preemptions;
}

bool SequenceQueues::growBlocks(Sequence& seq, uint32_t blocks) {
  while (seq.blocks.size() < blocks) {
    auto b = blocks_.allocate();
    if (!b) return false;
    seq.blocks.push_back(*b);
  }
  return true;
}

std::vector<RunningSequence> SequenceQueues::runningView() const {
  std::vector<RunningSequence> view;
  for (const auto& s : running_)
    view.push_back({uint32_t(s->ledger.tokens().size()), s->computed, uint32_t(s->blocks.size()),
                    s->in_flight});
  return view;
}

StepRequest SequenceQueues::assemble(const StepPlan& plan) {
  StepRequest r;
  r.row_index.resize(plan.chunks.size());  // sized first: steps hold spans into it
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const PlannedChunk& c = plan.chunks[i];
    Sequence& s = *running_[c.index];
    growBlocks(s, c.blocks_needed);  // the plan reserved them
    r.row_index[i] = c.chunk - 1;
    r.batch.push_back(&s);
    r.steps.push_back(
        {.sequence_id = s.id,
         .start_position = s.computed,
         .tokens = s.ledger.tokens().subspan(s.computed, c.chunk),
         .kv_blocks = s.blocks,
         .logits_rows = c.wants_row ? std::span(&r.row_index[i], 1) : std::span<const uint32_t>()});
    r.tokens += c.chunk;
  }
  return r;
}

void SequenceQueues::freeBlocks(Sequence& seq) {
  seq.in_flight = false;  // whatever was in flight for it is forgotten with its cache
  for (uint32_t b : seq.blocks) blocks_.release(b);
  seq.blocks.clear();
  seq.computed = 0;
}

size_t SequenceQueues::accept(std::span<Sequence* const> batch,
                              std::span<const PlannedChunk> chunks, uint64_t step_id,
                              std::span<const TokenChoice* const> chosen,
                              std::chrono::steady_clock::time_point step_done) {
  size_t r = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    Sequence& s = *batch[i];
    s.computed += chunks[i].chunk;
    if (!chunks[i].wants_row) continue;
    s.ledger.append(step_id, *chosen[r++], step_done);
    s.finish_reason = stopReason(s);
  }
  std::erase_if(running_, [&](SequencePtr& s) {
    if (s->finish_reason == FinishReason::kNone) return false;
    freeBlocks(*s);
    finishing_.push_back(std::move(s));
    return true;
  });
  return r;
}

void SequenceQueues::failRunning(std::span<Sequence* const> batch, const Status& status) {
  std::erase_if(running_, [&](const SequencePtr& s) {
    if (std::find(batch.begin(), batch.end(), s.get()) == batch.end()) return false;
    finish(*s, FinishReason::kNone, status);
    return true;
  });
}

FinishReason SequenceQueues::stopReason(const Sequence& s) const {
  const ReleaseLedger& l = s.ledger;
  if (l.generatedCount() == 0) return FinishReason::kNone;
  const uint32_t token = l.tokens().back();
  const auto& stops = s.request.stop_token_ids;
  if (!s.request.ignore_eos && std::find(eos_.begin(), eos_.end(), token) != eos_.end())
    return FinishReason::kStop;
  if (std::find(stops.begin(), stops.end(), token) != stops.end()) return FinishReason::kStop;
  if (l.generatedCount() >= s.request.max_tokens) return FinishReason::kLength;
  if (l.tokens().size() >= max_context_) return FinishReason::kContext;
  return FinishReason::kNone;
}

void SequenceQueues::release(uint64_t clean_through,
                             const std::function<void(const ReleaseTimes&)>& record) {
  ReleaseTimes recorded;
  ReleaseTimes* times = record ? &recorded : nullptr;
  std::vector<std::chrono::steady_clock::time_point> produced;
  const auto now = std::chrono::steady_clock::now();
  auto ms = [](auto d) { return std::chrono::duration<double, std::milli>(d).count(); };
  for (auto* list : {&running_, &finishing_}) {
    for (auto& s : *list) {
      produced.clear();
      const std::vector<TokenChoice> out = s->ledger.takeReleasable(clean_through, &produced);
      if (out.empty()) continue;
      s->sink->onTokens(out);
      if (s->migration) {
        if (times != nullptr) times->migration.push_back(ms(now - s->migration->lost_at));
        if (s->migration->resumed) s->migration->resumed();
        s->migration.reset();
      }
      if (times != nullptr) {
        for (const auto& at : produced) times->after_step.push_back(ms(now - at));
        if (s->last_release) {
          times->inter_token.push_back(ms(now - *s->last_release));
        } else {
          times->first_token.push_back(ms(now - s->submitted));
        }
        times->inter_token.insert(times->inter_token.end(), out.size() - 1, 0.0);
      }
      s->last_release = now;
    }
  }
  if (record) record(recorded);
  std::erase_if(finishing_, [&](const SequencePtr& s) {
    if (s->ledger.unreleasedCount() != 0) return false;
    finish(*s, s->finish_reason, okStatus());
    return true;
  });
}

size_t SequenceQueues::rollBack(uint64_t from_step) {
  size_t dropped = 0;
  for (auto* list : {&running_, &finishing_})
    for (auto& s : *list) dropped += s->ledger.rollBack(from_step);
  for (auto& s : waiting_) dropped += s->ledger.rollBack(from_step);
  counters_.rolled_back += dropped;
  const size_t replayed = open();
  requeueAll();
  spdlog::warn("rolled back {} unsent tokens from step {} on; replaying {} sequences", dropped,
               from_step, replayed);
  return dropped;
}

void SequenceQueues::workerLost() {
  for (auto* list : {&running_, &finishing_})
    for (auto& s : *list) counters_.rolled_back += s->ledger.forgetUnreleased();
  for (auto& s : waiting_) counters_.rolled_back += s->ledger.forgetUnreleased();
  requeueAll();
}

// Every sequence the worker was computing loses its cache. Those whose history still ends in a
// stop wait only for their tokens to be released; the rest go back to waiting, in order.
void SequenceQueues::requeueAll() {
  counters_.replayed += open();
  for (auto* list : {&running_, &finishing_})
    for (const auto& s : *list) counters_.rolled_back += s->computed;
  std::vector<SequencePtr> all;
  for (auto* list : {&running_, &finishing_}) {
    for (auto& s : *list) all.push_back(std::move(s));
    list->clear();
  }
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a->id < b->id; });
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    freeBlocks(**it);
    (*it)->finish_reason = stopReason(**it);
    if ((*it)->finish_reason != FinishReason::kNone) {
      finishing_.push_back(std::move(*it));
    } else {
      waiting_.push_front(std::move(*it));
    }
  }
  std::reverse(finishing_.begin(), finishing_.end());
  for (auto& s : waiting_) freeBlocks(*s);
}

void SequenceQueues::failAll(const Status& status) {
  for (auto* list : {&running_, &finishing_}) {
    for (auto& s : *list) finish(*s, FinishReason::kNone, status);
    list->clear();
  }
  for (auto& s : waiting_) finish(*s, FinishReason::kNone, status);
  waiting_.clear();
}

std::vector<SequencePtr> SequenceQueues::takeWaiting() {
  std::vector<SequencePtr> out;
  for (auto& s : waiting_) {
    freeBlocks(*s);
    out.push_back(std::move(s));
  }
  waiting_.clear();
  return out;
}

void SequenceQueues::adopt(std::vector<SequencePtr> sequences) {
  std::sort(sequences.begin(), sequences.end(),
            [](const SequencePtr& a, const SequencePtr& b) { return a->id < b->id; });
  auto at = waiting_.begin();
  for (auto& s : sequences) {
    at = std::find_if(at, waiting_.end(), [&](const SequencePtr& w) { return w->id > s->id; });
    at = std::next(waiting_.insert(at, std::move(s)));
  }
}

void SequenceQueues::finish(Sequence& seq, FinishReason reason, const Status& status) {
  freeBlocks(seq);
  {
    // The request's id (its own, or the broker's sequence id) on the line and as a journal field.
    const std::string id =
        seq.request.request_id.empty() ? "#" + std::to_string(seq.id) : seq.request.request_id;
    ScopedLogFields fields({.request_id = id});
    if (status.ok()) {
      spdlog::debug("request {} finished after {} tokens", id, seq.ledger.released());
    } else {
      const auto level =
          status.code() == Code::kCancelled ? spdlog::level::info : spdlog::level::warn;
      spdlog::log(level, "request {} ended: {}", id, status.toString());
    }
  }
  const Usage usage{seq.ledger.promptLength(), seq.ledger.released(), seq.request.sampling.seed};
  if (finished_) finished_(status);  // counted before the client can see the end
  seq.sink->onFinish(reason, usage, status);
}

}  // namespace bulkhead

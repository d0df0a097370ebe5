// Drives a Backend in tests: hands out KV blocks, runs steps of several sequences, and returns
// every logits row so tests can compare them bit for bit.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <span>
#include <vector>

#include "worker/backend.h"

namespace bulkhead::test {

using Rows = std::vector<std::vector<float>>;

struct TestSequence {
  uint64_t id = 0;
  std::vector<uint32_t> blocks;
  uint32_t position = 0;
};

class BackendDriver {
 public:
  explicit BackendDriver(Backend& backend, bool tolerate_failed_reads = false)
      : backend_(backend), tolerate_failed_reads_(tolerate_failed_reads) {}
  // Rows are written into `buffer` first (memory the backend registered as its output), as
  // a worker's arena; null: straight into the returned rows.
  void setOutputBuffer(std::vector<float>* buffer) { output_ = buffer; }
  // Steps whose in-step weight check failed (counted only when tolerated).
  int failedReads() const { return failed_reads_; }

  TestSequence newSequence(uint64_t id, uint32_t max_positions) {
    TestSequence s{id, {}, 0};
    const uint32_t bs = backend_.limits().kv_block_size;
    for (uint32_t i = 0; i < (max_positions + bs - 1) / bs; ++i) s.blocks.push_back(next_block_++);
    return s;
  }

  struct Chunk {
    TestSequence* seq;
    std::vector<uint32_t> tokens;
  };

  // One step; every token's logits are requested. Returns rows per chunk.
  std::vector<Rows> step(const std::vector<Chunk>& chunks) {
    const uint32_t vocab = backend_.limits().vocab_size;
    std::vector<SequenceStep> batch;
    std::vector<std::vector<uint32_t>> row_ids(chunks.size());
    std::vector<Rows> out(chunks.size());
    std::vector<float*> dst;
    for (size_t i = 0; i < chunks.size(); ++i) {
      const Chunk& c = chunks[i];
      for (uint32_t r = 0; r < c.tokens.size(); ++r) row_ids[i].push_back(r);
      out[i].assign(c.tokens.size(), std::vector<float>(vocab));
      for (auto& row : out[i]) dst.push_back(row.data());
      batch.push_back({.sequence_id = c.seq->id,
                       .start_position = c.seq->position,
                       .tokens = c.tokens,
                       .kv_blocks = c.seq->blocks,
                       .logits_rows = row_ids[i]});
    }
    // With an output buffer, rows land there (as in the arena) and are copied out after.
    std::vector<float*> final_dst;
    if (output_ != nullptr) {
      const size_t stride = (vocab + 15) & ~size_t(15);
      EXPECT_LE(dst.size() * stride, output_->size()) << "output buffer too small";
      final_dst.swap(dst);
      for (size_t k = 0; k < final_dst.size(); ++k) dst.push_back(output_->data() + k * stride);
    }
    Status s = runStep(backend_, batch, dst);
    for (size_t k = 0; k < final_dst.size(); ++k)
      std::memcpy(final_dst[k], dst[k], vocab * sizeof(float));
    if (tolerate_failed_reads_ && s.code() == Code::kDataLoss) {
      ++failed_reads_;  // the step computed, but its own weight check failed
    } else {
      EXPECT_TRUE(s.ok()) << s.toString();
    }
    for (const Chunk& c : chunks) c.seq->position += uint32_t(c.tokens.size());
    return out;
  }

  // `target` in chunks of 5 tokens through a fresh sequence, each step shared with the other
  // sequences (`others`, prefilling and decoding at their own positions), the target at a
  // different place in the batch each step. Returns the target's rows.
  Rows runAmongOthers(const std::vector<uint32_t>& target,
                      const std::vector<std::vector<uint32_t>>& others) {
    TestSequence t = newSequence(100, uint32_t(target.size()));
    std::vector<TestSequence> o;
    for (size_t i = 0; i < others.size(); ++i)
      o.push_back(newSequence(200 + i, uint32_t(others[i].size())));
    Rows batched;
    for (size_t begin = 0, step = 0; begin < target.size(); begin += 5, ++step) {
      std::vector<Chunk> chunks;
      for (size_t i = 0; i < others.size(); ++i) {
        const size_t pos = o[i].position;
        const size_t len = std::min<size_t>(3 + i * 4, others[i].size() - pos);
        if (len > 0)
          chunks.push_back(
              {&o[i], {others[i].begin() + long(pos), others[i].begin() + long(pos + len)}});
      }
      const size_t where = step % (chunks.size() + 1);
      const size_t end = std::min(target.size(), begin + 5);
      chunks.insert(chunks.begin() + long(where),
                    {&t, {target.begin() + long(begin), target.begin() + long(end)}});
      auto out = this->step(chunks);
      batched.insert(batched.end(), out[where].begin(), out[where].end());
    }
    return batched;
  }

  // Runs `tokens` alone through a fresh sequence in chunks of `chunk` tokens.
  Rows runAlone(uint64_t id, const std::vector<uint32_t>& tokens, size_t chunk) {
    TestSequence seq = newSequence(id, uint32_t(tokens.size()));
    Rows rows;
    for (size_t begin = 0; begin < tokens.size(); begin += chunk) {
      const size_t end = std::min(tokens.size(), begin + chunk);
      auto part = step({{&seq, {tokens.begin() + long(begin), tokens.begin() + long(end)}}});
      rows.insert(rows.end(), part[0].begin(), part[0].end());
    }
    return rows;
  }

 private:
  Backend& backend_;
  bool tolerate_failed_reads_ = false;
  int failed_reads_ = 0;
  uint32_t next_block_ = 0;
  std::vector<float>* output_ = nullptr;
};

inline bool bitIdentical(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace bulkhead::test

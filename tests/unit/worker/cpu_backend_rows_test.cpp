// The CPU backend's producer checks: each row's checksum, folded in while lm_head writes the row,
// equals checksumBytes() of the row's bytes, and its finite flag is right, whatever the batch and
// thread count.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "shared/checkpoint.h"
#include "support/test_support.h"
#include "worker/cpu_backend.h"

namespace bulkhead {
namespace {

class CpuBackendRowsTest : public ::testing::TestWithParam<int64_t> {
 protected:
  void SetUp() override {
    auto ckpt = Checkpoint::open(test::fixtureDir("tiny-qwen2"));
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().toString();
    checkpoint_ = std::make_shared<const Checkpoint>(std::move(*ckpt));
    CpuBackend::Options options;
    options.kv_blocks = 64;
    options.parallel_macs = GetParam();
    auto backend = CpuBackend::create(checkpoint_, options);
    ASSERT_TRUE(backend.ok()) << backend.status().toString();
    backend_ = std::move(*backend);
  }

  // Three sequences, every token's row requested: 9 rows of vocab floats.
  void runStep(uint64_t first_id, std::vector<std::vector<float>>& payloads,
               std::vector<RowCheck>& checks, bool weights_intact = true) {
    const uint32_t vocab = backend_->limits().vocab_size;
    static const std::vector<uint32_t> tokens[3] = {{1, 2, 3}, {7}, {9, 8, 7, 6, 5}};
    static const std::vector<uint32_t> rows[3] = {{0, 1, 2}, {0}, {0, 1, 2, 3, 4}};
    std::vector<std::vector<uint32_t>> blocks(3);
    std::vector<SequenceStep> batch;
    for (uint32_t s = 0; s < 3; ++s) {
      blocks[s] = {uint32_t(next_block_++)};
      batch.push_back({.sequence_id = first_id + s,
                       .start_position = 0,
                       .tokens = tokens[s],
                       .kv_blocks = blocks[s],
                       .logits_rows = rows[s]});
    }
    payloads.assign(9, std::vector<float>(vocab));
    checks.assign(9, RowCheck{.checksum = 12345, .finite = false});  // must be overwritten
    std::vector<RowOutput> out;
    for (size_t r = 0; r < 9; ++r) out.push_back({payloads[r].data(), &checks[r]});
    ASSERT_TRUE(backend_->enqueueStep(batch, out).ok());
    batch.clear();  // enqueueStep copied what it needs
    blocks.clear();
    WeightReadVerdict verdict;
    ASSERT_TRUE(backend_->waitStep(verdict).ok());
    EXPECT_TRUE(verdict.checked);
    if (weights_intact) {
      EXPECT_EQ(verdict.failed_tensor, "") << "a clean step failed its in-step weight check";
    } else {
      EXPECT_NE(verdict.failed_tensor, "") << "the step read flipped weights unseen";
    }
  }

  void expectChecksMatch(const std::vector<std::vector<float>>& payloads,
                         const std::vector<RowCheck>& checks, bool want_finite) {
    for (size_t r = 0; r < payloads.size(); ++r) {
      const auto& p = payloads[r];
      const uint64_t want = checksumBytes(std::as_bytes(std::span(p)));
      EXPECT_EQ(checks[r].checksum, want) << "row " << r;
      bool finite = true;
      for (float v : p) finite = finite && std::isfinite(v);
      EXPECT_EQ(finite, want_finite) << "row " << r;
      EXPECT_EQ(checks[r].finite, finite) << "row " << r;
    }
  }

  std::shared_ptr<const Checkpoint> checkpoint_;
  std::unique_ptr<CpuBackend> backend_;
  int next_block_ = 0;
};

TEST_P(CpuBackendRowsTest, ProducerChecksumsMatchTheRowsAtAnyThreadCount) {
  std::vector<std::vector<float>> payloads;
  std::vector<RowCheck> checks;
  uint64_t id = 1;
  for (unsigned t : {0u, 1u, 3u}) {
    backend_->setThreads(t);
    runStep(id, payloads, checks);
    id += 3;
    expectChecksMatch(payloads, checks, true);
  }
}

TEST_P(CpuBackendRowsTest, NonFiniteRowsAreFlaggedAndStillChecksummed) {
  // Make the first lm_head weight NaN (all exponent bits set): every row's logit 0 is NaN.
  const auto used = checkpoint_->usedTensors();
  const TensorView* lm_head = checkpoint_->tensors().lm_head;
  uint64_t offset = 0;
  for (const TensorView* t : used) {
    if (t == lm_head) break;
    offset += t->data.size();
  }
  ASSERT_EQ(lm_head->dtype, DType::kBF16);
  uint16_t w;
  std::memcpy(&w, lm_head->data.data(), 2);
  for (int bit = 7; bit < 15; ++bit) {
    if ((w >> bit & 1) == 0) {
      ASSERT_TRUE(backend_->flipWeightBit(offset + uint64_t(bit / 8), uint8_t(bit % 8)).ok());
    }
  }
  if ((w & 0x7f) == 0) {
    ASSERT_TRUE(backend_->flipWeightBit(offset, 0).ok());  // NaN, not Inf
  }
  std::vector<std::vector<float>> payloads;
  std::vector<RowCheck> checks;
  runStep(1, payloads, checks, /*weights_intact=*/false);
  expectChecksMatch(payloads, checks, false);
}

INSTANTIATE_TEST_SUITE_P(Parallelism, CpuBackendRowsTest, ::testing::Values(0, int64_t(1) << 18),
                         [](const ::testing::TestParamInfo<int64_t>& info) {
                           return info.param == 0 ? std::string("AllParallel")
                                                  : std::string("Default");
                         });

}  // namespace
}  // namespace bulkhead

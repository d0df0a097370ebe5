// Every malformed step is refused with a message naming the problem, and refusal leaves the
// backend's state untouched; a KV cache larger than the host is refused when the backend is made.
#include <gtest/gtest.h>

#include "shared/checkpoint.h"
#include "support/backend_driver.h"
#include "support/test_support.h"
#include "worker/cpu_backend.h"

namespace bulkhead {
namespace {

class StepValidationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto ckpt = Checkpoint::open(test::fixtureDir("tiny-qwen2"));
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().toString();
    CpuBackend::Options options;
    options.kv_blocks = 8;
    options.max_step_tokens = 64;
    auto backend =
        CpuBackend::create(std::make_shared<const Checkpoint>(std::move(*ckpt)), options);
    ASSERT_TRUE(backend.ok()) << backend.status().toString();
    backend_ = std::move(*backend);
    row_.resize(backend_->limits().vocab_size);
  }

  void expectRejected(std::vector<SequenceStep> batch, std::vector<float*> dst,
                      const std::string& needle) {
    Status s = runStep(*backend_, batch, dst);
    ASSERT_FALSE(s.ok()) << "accepted; expected \"" << needle << "\"";
    EXPECT_EQ(s.code(), Code::kInvalidArgument);
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  }

  std::unique_ptr<CpuBackend> backend_;
  std::vector<float> row_;
};

TEST_F(StepValidationTest, RejectsBadSteps) {
  const std::vector<uint32_t> tokens = {1, 2, 3}, bad_token = {1, 512}, blocks = {0}, blocks2 = {1},
                              none = {}, last = {2}, unsorted = {2, 1}, outside = {3},
                              far_block = {8};
  std::vector<uint32_t> long_tokens(300, 1), many_blocks(19);
  for (uint32_t i = 0; i < 19; ++i) many_blocks[i] = i;
  float* dst = row_.data();
  auto seq = [&](uint64_t id, const std::vector<uint32_t>& t, const std::vector<uint32_t>& b,
                 const std::vector<uint32_t>& rows, uint32_t start = 0) {
    return SequenceStep{.sequence_id = id,
                        .start_position = start,
                        .tokens = t,
                        .kv_blocks = b,
                        .logits_rows = rows};
  };
  expectRejected({}, {}, "no sequences");
  expectRejected({seq(1, none, blocks, none)}, {}, "sequence 1: no tokens");
  expectRejected({seq(1, bad_token, blocks, none)}, {}, "token id 512 >= vocab size 512");
  expectRejected({seq(1, tokens, blocks, none, 255)}, {}, "exceed the context limit 256");
  expectRejected({seq(1, long_tokens, many_blocks, none)}, {}, "exceed the context limit");
  expectRejected({seq(1, tokens, blocks, none, 14)}, {}, "block table has 1 blocks");
  expectRejected({seq(1, tokens, far_block, none)}, {}, "KV block 8 out of range (8 blocks)");
  expectRejected({seq(1, tokens, blocks, none), seq(2, tokens, blocks, none)}, {},
                 "KV block 0 is also used by sequence 1");
  expectRejected({seq(1, tokens, blocks, none), seq(1, tokens, blocks2, none)}, {},
                 "sequence 1 appears twice");
  expectRejected({seq(1, tokens, blocks, outside)}, {dst}, "logits row 3 outside its 3 tokens");
  expectRejected({seq(1, tokens, blocks, unsorted)}, {dst, dst}, "strictly ascending");
  expectRejected({seq(1, tokens, blocks, last)}, {}, "asks for 1 logits rows but 0");
  expectRejected({seq(1, tokens, blocks, last)}, {nullptr}, "null logits destination");
  std::vector<uint32_t> big(65, 1), big_blocks = {0, 1, 2, 3, 4};
  expectRejected({seq(1, big, big_blocks, none)}, {}, "step carries 65 tokens, the limit is 64");
}

TEST_F(StepValidationTest, RejectedStepLeavesStateUntouched) {
  // A sequence's logits are the same whether or not a bad step touching its blocks came between.
  test::BackendDriver driver(*backend_);
  const std::vector<uint32_t> tokens = {5, 6, 7, 8};
  const test::Rows clean = driver.runAlone(1, tokens, 4);
  test::TestSequence seq = driver.newSequence(2, 4);
  driver.step({{&seq, {5, 6}}});
  const std::vector<uint32_t> bad = {9, 600};
  const std::vector<uint32_t> rows = {};
  SequenceStep s{.sequence_id = 2,
                 .start_position = 2,
                 .tokens = bad,
                 .kv_blocks = seq.blocks,
                 .logits_rows = rows};
  ASSERT_FALSE(runStep(*backend_, {&s, 1}, {}).ok());
  const auto rest = driver.step({{&seq, {7, 8}}})[0];
  EXPECT_TRUE(test::bitIdentical(rest[1], clean[3]));
}

// --kv-blocks at its largest: before, the allocation threw std::bad_alloc out of create() and the
// worker ended in std::terminate.
TEST(CpuBackendCreate, AKvCacheLargerThanTheHostIsRefused) {
  auto ckpt = Checkpoint::open(test::fixtureDir("tiny-qwen2"));
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().toString();
  CpuBackend::Options options;
  options.kv_blocks = UINT32_MAX;
  auto backend = CpuBackend::create(std::make_shared<const Checkpoint>(std::move(*ckpt)), options);
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), Code::kResourceExhausted) << backend.status().toString();
  EXPECT_NE(backend.status().message().find("larger than this host's memory"), std::string::npos)
      << backend.status().message();
}

}  // namespace
}  // namespace bulkhead

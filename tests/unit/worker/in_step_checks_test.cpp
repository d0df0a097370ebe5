// In-step weight checks on the CPU backend: a clean step reads every weight it uses in full and
// passes; a flipped bit in any tensor fails the very step that read it (the folded reads), and
// any weight served from another slot or a stale copy, every resident byte intact, fails the step
// before it computes (the slot tags); a faulty multiply-add with every weight intact fails the
// arithmetic check (column sums); each names the weight.
#include <gtest/gtest.h>

#include <cstring>

#include "shared/checkpoint.h"
#include "support/test_support.h"
#include "worker/cpu_backend.h"

namespace bulkhead {
namespace {

class InStepChecksTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto ckpt = Checkpoint::open(test::fixtureDir("tiny-qwen2"));
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().toString();
    checkpoint_ = std::make_shared<const Checkpoint>(std::move(*ckpt));
    fresh();
  }
  void fresh() {
    CpuBackend::Options options;
    options.kv_blocks = 64;
    options.parallel_macs = 0;  // every kernel on the thread team
    auto backend = CpuBackend::create(checkpoint_, options);
    ASSERT_TRUE(backend.ok()) << backend.status().toString();
    backend_ = std::move(*backend);
    next_block_ = 0;
  }

  // A prefill of `tokens` with the last row requested, on fresh blocks.
  WeightReadVerdict step(const std::vector<uint32_t>& tokens) {
    std::vector<uint32_t> blocks;
    const uint32_t bs = backend_->limits().kv_block_size;
    for (uint32_t b = 0; b < (tokens.size() + bs - 1) / bs; ++b) blocks.push_back(next_block_++);
    const std::vector<uint32_t> rows = {uint32_t(tokens.size() - 1)};
    const SequenceStep s{.sequence_id = 1,
                         .start_position = 0,
                         .tokens = tokens,
                         .kv_blocks = blocks,
                         .logits_rows = rows};
    std::vector<float> payload(backend_->limits().vocab_size);
    RowCheck check;
    const RowOutput out{payload.data(), &check};
    EXPECT_TRUE(backend_->enqueueStep({&s, 1}, {&out, 1}).ok());
    WeightReadVerdict verdict;
    EXPECT_TRUE(backend_->waitStep(verdict).ok());
    return verdict;
  }

  std::shared_ptr<const Checkpoint> checkpoint_;
  std::unique_ptr<CpuBackend> backend_;
  uint32_t next_block_ = 0;
  std::string first_;
  size_t roles_ = 0;
};

TEST_F(InStepChecksTest, ACleanStepReadsEveryWeightInFullAndPasses) {
  const std::vector<uint32_t> tokens = {5, 9, 13};
  const WeightReadVerdict v = step(tokens);
  EXPECT_TRUE(v.checked);
  EXPECT_EQ(v.failed_tensor, "");
  // Coverage, counted: every weight once (lm_head once more, for the tied embedding's second
  // role), minus the embedding, plus the three embedding rows gathered.
  const ModelTensors& t = checkpoint_->tensors();
  uint64_t words = 0;
  for (const TensorView* tensor : checkpoint_->usedTensors())
    words += (tensor->data.size() + 3) / 4;
  const uint64_t embed_words = (t.embed->data.size() + 3) / 4;
  const uint64_t row_words = (t.embed->data.size() / t.embed->shape[0] + 3) / 4;
  if (t.lm_head == t.embed) words += embed_words;  // read again as lm_head
  words = words - embed_words + tokens.size() * row_words;
  EXPECT_EQ(v.words_read, words);
}

TEST_F(InStepChecksTest, AFlippedBitInAnyTensorFailsTheStepThatReadsIt) {
  const auto used = checkpoint_->usedTensors();
  uint64_t offset = 0;
  for (const TensorView* tensor : used) {
    SCOPED_TRACE(tensor->name);
    fresh();
    // A byte in the first row: the embedding's row of token 0 is gathered by the step below.
    ASSERT_TRUE(backend_->flipWeightBit(offset + 1, 3).ok());
    const WeightReadVerdict v = step({0, 4, 8});
    EXPECT_NE(v.failed_tensor, "") << "a flipped bit in " << tensor->name << " went unseen";
    EXPECT_NE(v.failed_tensor.find(tensor->name), std::string::npos) << v.failed_tensor;
    EXPECT_EQ(v.why, "its bytes differ from the checkpoint");
    offset += tensor->data.size();
  }
}

TEST_F(InStepChecksTest, AStaleSlotForEveryWeightIsCaughtInTheStep) {
  // Each weight role in turn is served from another slot of its size or a stale copy; the
  // scrubber's table still points at intact bytes, so only the step's own reads can tell.
  fresh();
  ASSERT_EQ(step({1, 2, 3}).failed_tensor, "");
  for (uint64_t role = 0;; ++role) {
    fresh();
    auto tensor = backend_->staleSlot(role);
    ASSERT_TRUE(tensor.ok()) << tensor.status().toString();
    if (role > 0 && *tensor == first_) break;  // every role visited
    if (role == 0) first_ = *tensor;
    SCOPED_TRACE(*tensor);
    const WeightReadVerdict v = step({3, 1, 4, 1, 5});
    EXPECT_EQ(v.failed_tensor, *tensor) << "stale " << *tensor << " went unseen";
    // Caught before anything is computed: the binding is not its tensor's tagged slot.
    EXPECT_TRUE(v.why == "bound to a slot tagged for another tensor" ||
                v.why == "bound to memory that is no resident slot")
        << v.why;
    ++roles_;
  }
  EXPECT_GT(roles_, 20u);
}

TEST_F(InStepChecksTest, AFaultyMultiplyInAnyLinearLayerFailsTheArithmeticCheck) {
  // Every weight byte intact, so only the column-sum check can see it. The selector walks the
  // roles and, through its upper part, different tokens and outputs of the prefill.
  fresh();
  for (uint64_t selector = 0;; ++selector) {
    auto role = backend_->computeFault(selector * 1000003);
    ASSERT_TRUE(role.ok()) << role.status().toString();
    if (selector > 0 && *role == first_) break;  // every linear role visited
    if (selector == 0) first_ = *role;
    SCOPED_TRACE(*role);
    const WeightReadVerdict v = step({3, 1, 4, 1, 5});
    EXPECT_EQ(v.failed_tensor, *role) << "a faulty multiply in " << *role << " went unseen";
    EXPECT_NE(v.why.find("arithmetic check"), std::string::npos) << v.why;
    // The fault lasts one step: the next one passes.
    EXPECT_EQ(step({2, 7}).failed_tensor, "");
    ++roles_;
  }
  // q, k, v, o, gate, up, down per layer, and lm_head.
  EXPECT_EQ(roles_, 7 * checkpoint_->tensors().layers.size() + 1);
}

TEST_F(InStepChecksTest, TheArithmeticCheckPassesLongPrefillsAndDecodes) {
  // No false alarm from accumulation error: long rows of real activations, many positions.
  std::vector<uint32_t> tokens;
  for (uint32_t i = 0; i < 120; ++i) tokens.push_back((i * 7919u) % 500u);
  const WeightReadVerdict v = step(tokens);
  EXPECT_EQ(v.failed_tensor, "") << v.why;
}

}  // namespace
}  // namespace bulkhead

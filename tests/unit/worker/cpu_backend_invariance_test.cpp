// Batch- and chunk-invariance of the CPU engine: a sequence's logits are bit-identical whether
// it runs alone or batched, prefilled at once, in chunks, or token by token, and whatever the
// thread count. Lossless replay after a worker restart depends on this.
#include <gtest/gtest.h>

#include <random>

#include "shared/checkpoint.h"
#include "support/backend_driver.h"
#include "support/test_support.h"
#include "tools/make_model.h"
#include "worker/cpu_backend.h"

namespace bulkhead {
namespace {

struct ModelCase {
  std::string name;
  std::string shape;  // empty: the golden fixture
  DType dtype = DType::kBF16;
};
void PrintTo(const ModelCase& c, std::ostream* os) {
  *os << c.name;
}

class InvarianceTest : public ::testing::TestWithParam<ModelCase> {
 protected:
  void SetUp() override {
    std::string dir = test::fixtureDir("tiny-qwen2");
    if (!GetParam().shape.empty()) {
      dir = tmp_.path();
      auto made = makeModel(
          {.shape = GetParam().shape, .out_dir = dir, .seed = 3, .dtype = GetParam().dtype});
      ASSERT_TRUE(made.ok()) << made.status().toString();
    }
    auto ckpt = Checkpoint::open(dir);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().toString();
    // Every kernel parallel, however small, so thread splits are exercised on tiny models.
    CpuBackend::Options options;
    options.parallel_macs = 0;
    auto backend =
        CpuBackend::create(std::make_shared<const Checkpoint>(std::move(*ckpt)), options);
    ASSERT_TRUE(backend.ok()) << backend.status().toString();
    backend_ = std::move(*backend);
  }

  std::vector<uint32_t> randomTokens(size_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<uint32_t> t(n);
    for (auto& x : t) x = rng() % backend_->limits().vocab_size;
    return t;
  }

  void expectIdentical(const test::Rows& a, const test::Rows& b, const std::string& how) {
    ASSERT_EQ(a.size(), b.size()) << how;
    for (size_t p = 0; p < a.size(); ++p) {
      ASSERT_TRUE(test::bitIdentical(a[p], b[p])) << how << ": row " << p << " differs";
    }
  }

  test::TempDir tmp_;
  std::unique_ptr<CpuBackend> backend_;
};

TEST_P(InvarianceTest, ChunkingDoesNotChangeLogits) {
  test::BackendDriver driver(*backend_);
  const auto tokens = randomTokens(45, 1);
  const test::Rows whole = driver.runAlone(1, tokens, tokens.size());
  for (size_t chunk : {1, 2, 3, 7, 16, 17}) {
    expectIdentical(whole, driver.runAlone(10 + chunk, tokens, chunk),
                    "chunk " + std::to_string(chunk));
  }
}

TEST_P(InvarianceTest, BatchCompositionDoesNotChangeLogits) {
  test::BackendDriver driver(*backend_);
  const auto target = randomTokens(30, 2);
  const test::Rows alone = driver.runAlone(1, target, 5);

  // The same chunks of the target, each step shared with other sequences at other positions,
  // prefilling and decoding; the target sits at a different place in the batch each step.
  std::vector<std::vector<uint32_t>> others = {randomTokens(50, 3), randomTokens(9, 4),
                                               randomTokens(33, 5)};
  const test::Rows batched = driver.runAmongOthers(target, others);
  expectIdentical(alone, batched, "batched");
}

TEST_P(InvarianceTest, ThreadCountDoesNotChangeLogits) {
  test::BackendDriver driver(*backend_);
  const auto tokens = randomTokens(20, 6);
  const test::Rows parallel = driver.runAlone(1, tokens, 8);
  backend_->setThreads(1);
  const test::Rows serial = driver.runAlone(2, tokens, 8);
  backend_->setThreads(3);
  const test::Rows three = driver.runAlone(3, tokens, 8);
  backend_->setThreads(0);
  expectIdentical(parallel, serial, "1 thread");
  expectIdentical(parallel, three, "3 threads");
}

TEST_P(InvarianceTest, RequestingFewerRowsDoesNotChangeThem) {
  test::BackendDriver driver(*backend_);
  const auto tokens = randomTokens(12, 7);
  const test::Rows all = driver.runAlone(1, tokens, tokens.size());
  test::TestSequence seq = driver.newSequence(2, uint32_t(tokens.size()));
  const uint32_t rows[2] = {3, 11};
  std::vector<float> r3(backend_->limits().vocab_size), r11(backend_->limits().vocab_size);
  float* dst[2] = {r3.data(), r11.data()};
  SequenceStep s{.sequence_id = 2,
                 .start_position = 0,
                 .tokens = tokens,
                 .kv_blocks = seq.blocks,
                 .logits_rows = rows};
  ASSERT_TRUE(runStep(*backend_, {&s, 1}, dst).ok());
  EXPECT_TRUE(test::bitIdentical(all[3], r3));
  EXPECT_TRUE(test::bitIdentical(all[11], r11));
}

INSTANTIATE_TEST_SUITE_P(
    Models, InvarianceTest,
    ::testing::Values(ModelCase{"fixture_qwen2_bf16", "", DType::kBF16},
                      ModelCase{"llama_mqa_untied_bf16", "tiny-llama", DType::kBF16},
                      ModelCase{"qwen2_f16", "tiny", DType::kF16},
                      ModelCase{"qwen2_f32", "tiny", DType::kF32}),
    [](const ::testing::TestParamInfo<ModelCase>& info) { return info.param.name; });

}  // namespace
}  // namespace bulkhead

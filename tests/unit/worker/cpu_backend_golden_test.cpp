// The CPU engine against the golden fixture computed by Hugging Face transformers: every logit
// within 1e-4, greedy tokens equal, through full prefill, through the KV cache token by token,
// and inside mixed batches.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "shared/checkpoint.h"
#include "support/backend_driver.h"
#include "support/test_support.h"
#include "worker/cpu_backend.h"

namespace bulkhead {
namespace {

constexpr float kTolerance = 1e-4f;

class CpuGoldenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string dir = test::fixtureDir("tiny-qwen2");
    golden_ = test::loadGolden(dir);
    auto ckpt = Checkpoint::open(dir);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().toString();
    auto backend = CpuBackend::create(std::make_shared<const Checkpoint>(std::move(*ckpt)), {});
    ASSERT_TRUE(backend.ok()) << backend.status().toString();
    backend_ = std::move(*backend);
    ASSERT_EQ(golden_.vocab, backend_->limits().vocab_size);
    ASSERT_EQ(golden_.cases.size(), 3u);
  }

  // Compares rows [0, rows.size()) of a case with the golden file.
  void expectMatchesGolden(const test::GoldenCase& c, const test::Rows& rows,
                           const std::string& how) {
    ASSERT_EQ(rows.size(), c.positions) << how;
    float worst = 0;
    for (size_t p = 0; p < rows.size(); ++p) {
      const float* want = golden_.row(c, p);
      for (uint32_t v = 0; v < golden_.vocab; ++v) {
        const float err = std::fabs(rows[p][v] - want[v]);
        worst = std::max(worst, err);
        ASSERT_LE(err, kTolerance) << how << ": position " << p << " token " << v << " got "
                                   << rows[p][v] << " want " << want[v];
      }
    }
    // The greedy path: row len(prompt)-1+i predicts greedy[i].
    for (size_t p = c.prompt.size() - 1; p < rows.size(); ++p) {
      const uint32_t argmax =
          uint32_t(std::max_element(rows[p].begin(), rows[p].end()) - rows[p].begin());
      EXPECT_EQ(argmax, c.greedy[p - (c.prompt.size() - 1)]) << how << ": position " << p;
    }
    RecordProperty(how + "_max_abs_error", std::to_string(worst));
  }

  std::vector<uint32_t> teacherTokens(const test::GoldenCase& c) {
    auto t = c.tokens();
    t.resize(c.positions);
    return t;
  }

  test::Golden golden_;
  std::unique_ptr<CpuBackend> backend_;
};

TEST_F(CpuGoldenTest, FullPrefillMatchesGolden) {
  test::BackendDriver driver(*backend_);
  for (size_t i = 0; i < golden_.cases.size(); ++i) {
    const auto& c = golden_.cases[i];
    expectMatchesGolden(c, driver.runAlone(i, teacherTokens(c), c.positions), "prefill");
  }
}

TEST_F(CpuGoldenTest, PrefillThenTokenByTokenDecodeMatchesGolden) {
  test::BackendDriver driver(*backend_);
  for (size_t i = 0; i < golden_.cases.size(); ++i) {
    const auto& c = golden_.cases[i];
    const auto tokens = teacherTokens(c);
    test::TestSequence seq = driver.newSequence(i, uint32_t(tokens.size()));
    test::Rows rows = driver.step({{&seq, c.prompt}})[0];
    for (size_t p = c.prompt.size(); p < tokens.size(); ++p) {
      rows.push_back(driver.step({{&seq, {tokens[p]}}})[0][0]);
    }
    expectMatchesGolden(c, rows, "kv_decode");
  }
}

TEST_F(CpuGoldenTest, GreedyGenerationThroughKvCacheReproducesGoldenTokens) {
  test::BackendDriver driver(*backend_);
  for (size_t i = 0; i < golden_.cases.size(); ++i) {
    const auto& c = golden_.cases[i];
    test::TestSequence seq = driver.newSequence(i, uint32_t(c.prompt.size() + c.greedy.size()));
    std::vector<uint32_t> generated;
    std::vector<uint32_t> input = c.prompt;
    while (generated.size() < c.greedy.size()) {
      const auto rows = driver.step({{&seq, input}})[0];
      const auto& last = rows.back();
      const uint32_t next = uint32_t(std::max_element(last.begin(), last.end()) - last.begin());
      generated.push_back(next);
      input = {next};
    }
    EXPECT_EQ(generated, c.greedy) << "case " << i;
  }
}

TEST_F(CpuGoldenTest, MixedBatchesMatchGolden) {
  // All three cases share every step: their prompts prefill together, then each decodes one
  // token per step while the others are still prefilling or decoding at other positions.
  test::BackendDriver driver(*backend_);
  std::vector<test::TestSequence> seqs;
  std::vector<std::vector<uint32_t>> tokens;
  std::vector<test::Rows> rows(golden_.cases.size());
  for (size_t i = 0; i < golden_.cases.size(); ++i) {
    tokens.push_back(teacherTokens(golden_.cases[i]));
    seqs.push_back(driver.newSequence(100 + i, uint32_t(tokens.back().size())));
  }
  // Case i prefills its prompt in chunks of (i + 2) tokens, then decodes.
  bool work = true;
  while (work) {
    work = false;
    std::vector<test::BackendDriver::Chunk> chunks;
    std::vector<size_t> owners;
    for (size_t i = 0; i < seqs.size(); ++i) {
      const size_t pos = seqs[i].position;
      if (pos >= tokens[i].size()) continue;
      const size_t prompt = golden_.cases[i].prompt.size();
      const size_t len = pos < prompt ? std::min(prompt - pos, i + 2) : 1;
      chunks.push_back(
          {&seqs[i], {tokens[i].begin() + long(pos), tokens[i].begin() + long(pos + len)}});
      owners.push_back(i);
    }
    if (chunks.empty()) break;
    work = true;
    auto out = driver.step(chunks);
    for (size_t k = 0; k < out.size(); ++k) {
      rows[owners[k]].insert(rows[owners[k]].end(), out[k].begin(), out[k].end());
    }
  }
  for (size_t i = 0; i < golden_.cases.size(); ++i) {
    expectMatchesGolden(golden_.cases[i], rows[i], "mixed_batch");
  }
}

}  // namespace
}  // namespace bulkhead

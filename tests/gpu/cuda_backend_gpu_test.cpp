// The CUDA backend end to end: against the golden fixture and the CPU reference engine, batch-
// and chunk-invariant bit for bit (and across devices, given two), its rows' checksums those of
// the bytes it wrote, and each in-step check failing the step that a real injected fault spoils
// (and no other).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "cuda/attention.cuh"
#include "shared/checkpoint.h"
#include "shared/checksum.h"
#include "support/backend_driver.h"
#include "support/test_support.h"
#include "tests/gpu/gpu_test_util.h"
#include "tools/make_model.h"
#include "worker/cpu_backend.h"
#include "worker/cuda_backend.h"

namespace bulkhead {
namespace {

// A make-model checkpoint of `shape` (seed 3), written once a process: every test of a model
// case reads the same files. Empty if it failed.
std::string madeModel(const std::string& shape) {
  static std::map<std::string, std::unique_ptr<test::TempDir>> made;
  std::unique_ptr<test::TempDir>& dir = made[shape];
  if (dir == nullptr) {
    auto fresh = std::make_unique<test::TempDir>();
    auto report = makeModel({.shape = shape, .out_dir = fresh->path(), .seed = 3});
    if (!report.ok()) {
      ADD_FAILURE() << "make-model " << shape << ": " << report.status().toString();
      return "";
    }
    dir = std::move(fresh);
  }
  return dir->path();
}

std::shared_ptr<const Checkpoint> openModel(const std::string& dir) {
  auto ckpt = Checkpoint::open(dir);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status().toString();
  return ckpt.ok() ? std::make_shared<const Checkpoint>(std::move(*ckpt)) : nullptr;
}

// CudaBackend::Options::residual_in_products for the backends a test makes: the model case's
// (CudaBackendModels sets it for each test).
bool residual_in_products = false;
bool norm_in_products = false;            // and CudaBackend::Options::norm_in_products
bool silu_in_products = false;            // and CudaBackend::Options::silu_in_products
bool rope_in_attention = false;           // and CudaBackend::Options::rope_in_attention
bool attention_tiles = false;             // and CudaBackend::Options::attention_tiles
bool logits_in_product = true;            // CudaBackend::Options::logits_in_product
bool attention_mma = false;               // CudaBackend::Options::attention_mma
bool cublas_products = false;             // CudaBackend::Options::cublas_products
std::vector<std::string> streamed_units;  // CudaBackend::Options::streamed_units
uint32_t staging_slots = 2;               // CudaBackend::Options::staging_slots
uint64_t weight_budget = 0;               // CudaBackend::Options::weight_budget

// Every weight unit a backend can stream (CudaBackend::Options::streamed_units).
std::vector<std::string> everyUnit(const Checkpoint& ckpt) {
  std::vector<std::string> units;
  for (size_t l = 0; l < ckpt.tensors().layers.size(); ++l)
    for (const char* u : {"qkv", "o", "gate_up", "down"})
      units.push_back("layers." + std::to_string(l) + "." + u);
  if (ckpt.tensors().lm_head != ckpt.tensors().embed) units.push_back("lm_head");
  return units;
}

std::unique_ptr<CudaBackend> cudaBackend(std::shared_ptr<const Checkpoint> ckpt, bool graphs = true,
                                         int device = 0, bool programmatic = false,
                                         cuda::GemmScheduleBuckets schedules = {}) {
  CudaBackend::Options options;
  options.residual_in_products = residual_in_products;
  options.norm_in_products = norm_in_products;
  options.silu_in_products = silu_in_products;
  options.rope_in_attention = rope_in_attention;
  options.attention_tiles = attention_tiles;
  options.logits_in_product = logits_in_product;
  options.attention_mma = attention_mma;
  options.cublas_products = cublas_products;
  options.streamed_units = streamed_units;
  options.staging_slots = staging_slots;
  options.weight_budget = weight_budget;
  options.gemm_schedules = schedules;
  options.cuda_graphs = graphs;
  options.device = device;
  options.programmatic_launch = programmatic;
  options.kv_blocks = 256;
  options.max_step_tokens = 1024;
  auto backend = CudaBackend::create(std::move(ckpt), options);
  EXPECT_TRUE(backend.ok()) << backend.status().toString();
  return backend.ok() ? std::move(*backend) : nullptr;
}

std::vector<uint32_t> randomTokens(size_t n, uint32_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint32_t> t(n);
  for (auto& x : t) x = rng() % vocab;
  return t;
}

void expectIdentical(const test::Rows& a, const test::Rows& b, const std::string& how) {
  ASSERT_EQ(a.size(), b.size()) << how;
  for (size_t p = 0; p < a.size(); ++p)
    ASSERT_TRUE(test::bitIdentical(a[p], b[p])) << how << ": row " << p << " differs";
}

// The largest |a - b| over rows, and the largest |b|.
std::pair<double, double> maxError(const test::Rows& a, const test::Rows& b) {
  double err = 0, scale = 0;
  for (size_t p = 0; p < a.size(); ++p)
    for (size_t v = 0; v < a[p].size(); ++v) {
      err = std::max(err, double(std::fabs(a[p][v] - b[p][v])));
      scale = std::max(scale, double(std::fabs(b[p][v])));
    }
  return {err, scale};
}

TEST(CudaBackendGpu, FixtureLogitsMatchTransformers) {
  if (!test::haveDevice()) GTEST_SKIP() << "no CUDA device";
  const std::string dir = test::fixtureDir("tiny-qwen2");
  const test::Golden golden = test::loadGolden(dir);
  auto backend = cudaBackend(openModel(dir));
  ASSERT_NE(backend, nullptr);
  test::BackendDriver driver(*backend);
  for (size_t i = 0; i < golden.cases.size(); ++i) {
    const test::GoldenCase& c = golden.cases[i];
    std::vector<uint32_t> tokens = c.tokens();
    tokens.resize(c.positions);
    const test::Rows rows = driver.runAlone(1 + i, tokens, tokens.size());
    test::Rows want(c.positions);
    for (size_t p = 0; p < c.positions; ++p)
      want[p].assign(golden.row(c, p), golden.row(c, p) + golden.vocab);
    const auto [err, scale] = maxError(rows, want);
    RecordProperty("case" + std::to_string(i) + "_max_abs_error", std::to_string(err));
    // bf16 activations into every product: a few hundredths of the logits' range.
    EXPECT_LE(err, 0.03 * std::max(1.0, scale)) << "case " << i;
    // The greedy path, where the golden margin exceeds twice the error.
    for (size_t p = c.prompt.size() - 1; p < rows.size(); ++p) {
      std::vector<float> sorted(want[p]);
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
      if (sorted[0] - sorted[1] <= 2 * err) continue;
      const auto argmax = std::max_element(rows[p].begin(), rows[p].end()) - rows[p].begin();
      EXPECT_EQ(uint32_t(argmax), c.greedy[p - (c.prompt.size() - 1)]) << "case " << i << " " << p;
    }
  }
}

// DESIGN.md's residency lesson: every residency policy gives the same tokens, so streaming each
// unit alone is a regression test. On the fixture (tied lm_head) and an untied llama: each
// product's weights streamed alone give the resident weights' rows bit for bit, run in chunks of
// five tokens and token by token (StreamedWeightsGiveTheResidentLogits covers graphs).
TEST(CudaBackendGpu, EachUnitStreamedAloneGivesTheResidentRows) {
  if (!test::haveDevice()) GTEST_SKIP() << "no CUDA device";
  for (const std::string& dir : {test::fixtureDir("tiny-qwen2"), madeModel("tiny-llama")}) {
    ASSERT_FALSE(dir.empty());
    const auto ckpt = openModel(dir);
    ASSERT_NE(ckpt, nullptr);
    auto resident = cudaBackend(ckpt);
    ASSERT_NE(resident, nullptr);
    const uint32_t vocab = resident->limits().vocab_size;
    const auto tokens = randomTokens(24, vocab, 31);
    test::BackendDriver resident_driver(*resident);
    const test::Rows want = resident_driver.runAlone(1, tokens, 5);
    const test::Rows want_one = resident_driver.runAlone(2, tokens, 1);
    for (const std::string& unit : everyUnit(*ckpt)) {
      streamed_units = {unit};
      auto streamed = cudaBackend(ckpt);
      streamed_units.clear();
      ASSERT_NE(streamed, nullptr) << unit;
      EXPECT_GT(streamed->limits().streamed_weight_bytes, 0u) << unit;
      test::BackendDriver driver(*streamed);
      expectIdentical(want, driver.runAlone(1, tokens, 5), dir + ": " + unit + " streamed alone");
      expectIdentical(want_one, driver.runAlone(2, tokens, 1),
                      dir + ": " + unit + " streamed alone, token by token");
      EXPECT_GT(streamed->streamedSteps(), 0u) << unit;
    }
  }
}

struct ModelCase {
  std::string name;
  std::string shape;      // empty: the golden fixture
  bool residual = false;  // CudaBackend::Options::residual_in_products
  bool normed = false;    // CudaBackend::Options::norm_in_products
  bool silu = false;      // CudaBackend::Options::silu_in_products
  bool rope = false;      // CudaBackend::Options::rope_in_attention
  bool tiles = false;     // CudaBackend::Options::attention_tiles
  bool mma = false;       // CudaBackend::Options::attention_mma
  bool cublas = false;    // CudaBackend::Options::cublas_products
  bool streamed = false;  // every weight unit streamed (CudaBackend::Options::streamed_units)
};
void PrintTo(const ModelCase& c, std::ostream* os) {
  *os << c.name;
}

class CudaBackendModels : public testing::TestWithParam<ModelCase> {
 protected:
  void SetUp() override {
    if (!test::haveDevice()) GTEST_SKIP() << "no CUDA device";
    residual_in_products = GetParam().residual;
    norm_in_products = GetParam().normed;
    silu_in_products = GetParam().silu;
    rope_in_attention = GetParam().rope;
    attention_tiles = GetParam().tiles;
    attention_mma = GetParam().mma;
    cublas_products = GetParam().cublas;
    const std::string dir =
        GetParam().shape.empty() ? test::fixtureDir("tiny-qwen2") : madeModel(GetParam().shape);
    ASSERT_FALSE(dir.empty());
    checkpoint_ = openModel(dir);
    ASSERT_NE(checkpoint_, nullptr);
    if (GetParam().streamed) streamed_units = everyUnit(*checkpoint_);
    backend_ = cudaBackend(checkpoint_);
    ASSERT_NE(backend_, nullptr);
    vocab_ = backend_->limits().vocab_size;
  }

  void TearDown() override {
    residual_in_products = norm_in_products = silu_in_products = rope_in_attention =
        attention_tiles = attention_mma = cublas_products = false;
    streamed_units.clear();
  }

  std::shared_ptr<const Checkpoint> checkpoint_;
  std::unique_ptr<CudaBackend> backend_;
  uint32_t vocab_ = 0;
};

TEST_P(CudaBackendModels, ChunkingDoesNotChangeLogits) {
  test::BackendDriver driver(*backend_);
  const auto tokens = randomTokens(45, vocab_, 1);
  const test::Rows whole = driver.runAlone(1, tokens, tokens.size());
  for (size_t chunk : {1, 3, 16, 17})
    expectIdentical(whole, driver.runAlone(10 + chunk, tokens, chunk),
                    "chunk " + std::to_string(chunk));
}

// With attention_mma, attention runs on the tensor cores in every step, prefill and decode.
TEST_P(CudaBackendModels, AttentionRunsOnTheTensorCoresWhenAskedTo) {
  test::BackendDriver driver(*backend_);
  const auto tokens = randomTokens(20, vocab_, 6);
  const uint64_t before = backend_->mmaAttentionSteps();
  driver.runAlone(1, tokens, 7);  // steps of 7, 7 and 6 rows
  EXPECT_EQ(backend_->mmaAttentionSteps() - before, GetParam().mma ? 3u : 0u);
  // Its numbers are its own, so its canary records are too: they are keyed by the name, as
  // cuBLAS products' are.
  EXPECT_EQ(backend_->name(), std::string(GetParam().cublas ? "cuda-cublas" : "cuda") +
                                  (GetParam().mma ? "-mma" : ""));
}

TEST_P(CudaBackendModels, BatchCompositionDoesNotChangeLogits) {
  test::BackendDriver driver(*backend_);
  const auto target = randomTokens(30, vocab_, 2);
  const test::Rows alone = driver.runAlone(1, target, 5);
  std::vector<std::vector<uint32_t>> others = {
      randomTokens(50, vocab_, 3), randomTokens(9, vocab_, 4), randomTokens(33, vocab_, 5)};
  const test::Rows batched = driver.runAmongOthers(target, others);
  expectIdentical(alone, batched, "batched");
}

// Three sequences prefilled, then decoded together and apart (batch sizes 3 and 1), rows written
// into registered memory as in a worker. Memory is registered with one backend at a time, as each
// worker registers its own arena.
test::Rows decodeThree(CudaBackend& b, uint32_t vocab) {
  std::vector<float> output(size_t(64) * ((vocab + 15) & ~15u));
  EXPECT_TRUE(b.registerOutputs(
                   {reinterpret_cast<std::byte*>(output.data()), output.size() * sizeof(float)})
                  .ok());
  test::BackendDriver driver(b);
  driver.setOutputBuffer(&output);
  std::vector<test::TestSequence> seqs;
  std::vector<std::vector<uint32_t>> tokens;
  for (uint32_t i = 0; i < 3; ++i) {
    seqs.push_back(driver.newSequence(i + 1, 40));
    tokens.push_back(randomTokens(40, vocab, 20 + i));
    driver.step({{&seqs[i], {tokens[i].begin(), tokens[i].begin() + 8}}});
  }
  test::Rows rows;
  for (uint32_t p = 8; p < 40; ++p) {
    std::vector<test::BackendDriver::Chunk> chunks;
    for (uint32_t i = 0; i < 3; ++i)
      if (p % 3 != 0 || i == 0) chunks.push_back({&seqs[i], {tokens[i][p]}});
    for (const test::Rows& r : driver.step(chunks)) rows.insert(rows.end(), r.begin(), r.end());
  }
  EXPECT_TRUE(b.registerOutputs({}).ok());
  return rows;
}

// Weights streamed from host memory through staging slots give the resident weights' logits, bit
// for bit: every unit streamed through one slot (each copy waits for the product before it) and
// through three, and a budget just under the model's weights (part of it streamed); prompts
// prefilled in chunks (uncaptured steps) and decoded as graphs.
TEST_P(CudaBackendModels, StreamedWeightsGiveTheResidentLogits) {
  const std::vector<std::string> as_cased = streamed_units;
  streamed_units.clear();
  auto resident = cudaBackend(checkpoint_);
  ASSERT_NE(resident, nullptr);
  const uint64_t all = resident->limits().resident_weight_bytes;
  ASSERT_EQ(resident->limits().streamed_weight_bytes, 0u);
  const auto tokens = randomTokens(30, vocab_, 7);
  const test::Rows decoded = decodeThree(*resident, vocab_);
  test::BackendDriver resident_driver(*resident);
  const test::Rows prefilled = resident_driver.runAlone(1, tokens, 7);
  EXPECT_EQ(resident->streamedSteps(), 0u);
  struct Way {
    std::vector<std::string> units;
    uint32_t slots;
    uint64_t budget;
    std::string name;
  };
  const Way ways[] = {{everyUnit(*checkpoint_), 1, 0, "every unit through one slot"},
                      {everyUnit(*checkpoint_), 3, 0, "every unit through three slots"},
                      {{}, 1, all - 1, "a budget just under the weights"}};
  for (const Way& way : ways) {
    streamed_units = way.units;
    staging_slots = way.slots;
    weight_budget = way.budget;
    auto streamed = cudaBackend(checkpoint_);
    streamed_units = as_cased;
    staging_slots = 2;
    weight_budget = 0;
    ASSERT_NE(streamed, nullptr) << way.name;
    EXPECT_GT(streamed->limits().streamed_weight_bytes, 0u) << way.name;
    EXPECT_EQ(streamed->limits().resident_weight_bytes + streamed->limits().streamed_weight_bytes,
              all)
        << way.name;
    expectIdentical(decoded, decodeThree(*streamed, vocab_), way.name + ", decoded");
    EXPECT_GT(streamed->graphLaunches(), 0u) << way.name;
    test::BackendDriver driver(*streamed);
    expectIdentical(prefilled, driver.runAlone(1, tokens, 7), way.name + ", prefilled");
    EXPECT_GT(streamed->streamedSteps(), 0u) << way.name;
  }
}

TEST_P(CudaBackendModels, GraphsDoNotChangeLogits) {
  auto plain = cudaBackend(checkpoint_, /*graphs=*/false);
  ASSERT_NE(plain, nullptr);
  const test::Rows with = decodeThree(*backend_, vocab_), without = decodeThree(*plain, vocab_);
  EXPECT_GT(backend_->graphLaunches(), 0u) << "no step ran as a graph";
  EXPECT_EQ(plain->graphLaunches(), 0u);
  expectIdentical(with, without, "graphs");
}

// lm_head storing its rows to their destinations itself gives the rows the copy after it gives,
// bit for bit, with graphs and without (its row checksums: RowChecksAreThoseOfTheBytesWritten).
TEST_P(CudaBackendModels, LogitsStoredByTheProductAreTheCopiedOnes) {
  logits_in_product = false;
  auto copied = cudaBackend(checkpoint_), copied_plain = cudaBackend(checkpoint_, false);
  logits_in_product = true;
  ASSERT_NE(copied, nullptr);
  ASSERT_NE(copied_plain, nullptr);
  auto plain = cudaBackend(checkpoint_, /*graphs=*/false);
  ASSERT_NE(plain, nullptr);
  const test::Rows stored = decodeThree(*backend_, vocab_);
  expectIdentical(stored, decodeThree(*copied, vocab_), "copied, graphs");
  expectIdentical(stored, decodeThree(*copied_plain, vocab_), "copied, no graphs");
  expectIdentical(stored, decodeThree(*plain, vocab_), "stored, no graphs");
  EXPECT_GT(backend_->graphLaunches(), 0u) << "no step ran as a graph";
  // decodeThree: 3 prefill steps and 32 decode steps, every one stored by lm_head or none (a
  // cuBLAS lm_head stores none: the copy after it does).
  const uint64_t stored_steps = GetParam().cublas ? 0 : 35;
  EXPECT_EQ(backend_->productStoredRowSteps(), stored_steps);
  EXPECT_EQ(plain->productStoredRowSteps(), stored_steps);
  EXPECT_EQ(copied->productStoredRowSteps(), 0u);
  EXPECT_EQ(copied_plain->productStoredRowSteps(), 0u);
}

// Steps of 33 to 64 rows run each product in the schedule its shape gives
// (cuda::gemmScheduleAt33To64), and lm_head stores 33 to 64 logits rows a launch itself: the rows
// of 40 sequences prefilled in one step (lm_head launches of 64 and 56 rows) and decoded together
// (steps of 40 rows) are each sequence's rows alone, token by token.
TEST_P(CudaBackendModels, StepsOf33To64RowsGiveEverySequenceItsRowsAlone) {
  constexpr uint32_t kSequences = 40, kPrompt = 3, kPositions = kPrompt + 2;
  std::vector<std::vector<uint32_t>> tokens;
  for (uint32_t i = 0; i < kSequences; ++i)
    tokens.push_back(randomTokens(kPositions, vocab_, 60 + i));
  std::vector<float> output(size_t(kSequences * kPrompt) * ((vocab_ + 15) & ~15u));
  ASSERT_TRUE(backend_
                  ->registerOutputs(
                      {reinterpret_cast<std::byte*>(output.data()), output.size() * sizeof(float)})
                  .ok());
  test::BackendDriver driver(*backend_);
  driver.setOutputBuffer(&output);
  std::vector<test::TestSequence> seqs;
  for (uint32_t i = 0; i < kSequences; ++i) seqs.push_back(driver.newSequence(i + 1, kPositions));
  std::vector<test::Rows> together(kSequences);
  for (uint32_t begin = 0, len = kPrompt; begin < kPositions; begin += len, len = 1) {
    std::vector<test::BackendDriver::Chunk> chunks;
    for (uint32_t i = 0; i < kSequences; ++i)
      chunks.push_back({&seqs[i], {tokens[i].begin() + begin, tokens[i].begin() + begin + len}});
    const std::vector<test::Rows> rows = driver.step(chunks);
    for (uint32_t i = 0; i < kSequences; ++i)
      together[i].insert(together[i].end(), rows[i].begin(), rows[i].end());
  }
  const uint64_t stored = backend_->productStoredRowSteps();
  ASSERT_TRUE(backend_->registerOutputs({}).ok());
  test::BackendDriver alone(*backend_);  // rows straight into its own (the KV blocks reused)
  for (uint32_t i = 0; i < kSequences; ++i)
    expectIdentical(alone.runAlone(100 + i, tokens[i], 1), together[i],
                    "sequence " + std::to_string(i) + " of " + std::to_string(kSequences));
  // The prompts' step and both decode steps stored their rows from lm_head (ours, not cuBLAS).
  EXPECT_EQ(stored, GetParam().cublas ? 0u : 3u);
}

// The product checks start every step at zero: the kernel that counts them at a step's end clears
// them (no memset a step), with graphs and without.
TEST_P(CudaBackendModels, EveryStepLeavesTheProductChecksCleared) {
  auto plain = cudaBackend(checkpoint_, /*graphs=*/false);
  ASSERT_NE(plain, nullptr);
  for (CudaBackend* b : {backend_.get(), plain.get()}) {
    decodeThree(*b, vocab_);
    const Result<bool> cleared = b->productChecksCleared();
    ASSERT_TRUE(cleared.ok()) << cleared.status().message();
    EXPECT_TRUE(*cleared) << (b == plain.get() ? "without graphs" : "with graphs");
  }
  EXPECT_GT(backend_->graphLaunches(), 0u) << "no step ran as a graph";
}

// Every step's checks pass (the driver asserts it) and every row is the same bit for bit when
// each kernel may begin while the one before it finishes: with graphs, without, and over
// chunked prefills beside other sequences.
TEST_P(CudaBackendModels, ProgrammaticLaunchDoesNotChangeLogits) {
  const test::Rows reference = decodeThree(*backend_, vocab_);
  for (bool graphs : {true, false}) {
    auto early = cudaBackend(checkpoint_, graphs, 0, /*programmatic=*/true);
    ASSERT_NE(early, nullptr);
    expectIdentical(reference, decodeThree(*early, vocab_),
                    graphs ? "programmatic, graphs" : "programmatic, no graphs");
    if (graphs) {
      EXPECT_GT(early->graphLaunches(), 0u) << "no step ran as a graph";
    }
  }
  auto early = cudaBackend(checkpoint_, true, 0, /*programmatic=*/true);
  ASSERT_NE(early, nullptr);
  test::BackendDriver plain_driver(*backend_), early_driver(*early);
  const auto target = randomTokens(30, vocab_, 2);
  const std::vector<std::vector<uint32_t>> others = {randomTokens(50, vocab_, 3),
                                                     randomTokens(9, vocab_, 4)};
  expectIdentical(plain_driver.runAmongOthers(target, others),
                  early_driver.runAmongOthers(target, others), "programmatic, batched");
  expectIdentical(plain_driver.runAlone(1, target, 7), early_driver.runAlone(1, target, 7),
                  "programmatic, chunks of 7");
}

// Every product schedule gives the same rows, bit for bit, whichever bucket of rows a step's
// products fall in: prefill chunks of 3, 13, 20 and 40 tokens (one per bucket) and of 70, one
// step of three 100-token prompts (300 rows: from cuda::kTiledFromRows on, tiled runs its own
// kernel), and decode steps as graphs; against plain everywhere.
TEST_P(CudaBackendModels, ProductSchedulesDoNotChangeLogits) {
  test::BackendDriver plain(*backend_);
  const auto tokens = randomTokens(80, vocab_, 9);
  const size_t chunks[] = {3, 13, 20, 40, 70};
  std::vector<test::Rows> want;
  for (size_t i = 0; i < std::size(chunks); ++i)
    want.push_back(plain.runAlone(1 + i, tokens, chunks[i]));
  const test::Rows decoded = decodeThree(*backend_, vocab_);
  std::vector<std::vector<uint32_t>> prompts;
  for (uint32_t i = 0; i < 3; ++i) prompts.push_back(randomTokens(100, vocab_, 30 + i));
  auto wide = [&](CudaBackend& backend) {
    test::BackendDriver driver(backend);
    std::vector<test::TestSequence> sequences;
    for (size_t i = 0; i < prompts.size(); ++i)
      sequences.push_back(driver.newSequence(300 + i, 100));
    std::vector<test::BackendDriver::Chunk> prefill;
    for (size_t i = 0; i < prompts.size(); ++i) prefill.push_back({&sequences[i], prompts[i]});
    test::Rows rows;
    for (const test::Rows& part : driver.step(prefill))
      rows.insert(rows.end(), part.begin(), part.end());
    return rows;
  };
  const test::Rows wide_rows = wide(*backend_);
  ASSERT_GE(wide_rows.size(), size_t(cuda::kTiledFromRows));
  std::string defaults;
  for (const cuda::GemmSchedule s : cuda::kDefaultGemmSchedules)
    defaults += std::string(defaults.empty() ? "" : ",") + cuda::gemmScheduleName(s);
  for (const std::string& names :
       {std::string("pipelined"), std::string("two_tiles"),
        std::string("two_tiles,pipelined,two_tiles,pipelined"), std::string("tiled"), defaults}) {
    auto schedules = cuda::parseGemmSchedules(names);
    ASSERT_TRUE(schedules.ok()) << schedules.status().toString();
    auto other = cudaBackend(checkpoint_, true, 0, false, *schedules);
    ASSERT_NE(other, nullptr);
    test::BackendDriver driver(*other);
    for (size_t i = 0; i < std::size(chunks); ++i)
      expectIdentical(want[i], driver.runAlone(1 + i, tokens, chunks[i]),
                      names + ", chunks of " + std::to_string(chunks[i]));
    expectIdentical(decoded, decodeThree(*other, vocab_), names + ", decoding");
    expectIdentical(wide_rows, wide(*other), names + ", one step of 300 rows");
  }
}

// bench-engine --kernel-times: timing every launch changes no row; each step's launches are
// all accounted for, once a step each where a step has one (decode steps of three sequences:
// one lm_head chunk, one embedding), once a layer for the layers' kernels.
TEST_P(CudaBackendModels, KernelTimesAccountForEveryLaunchAndChangeNothing) {
  CudaBackend::Options options;
  options.kernel_times = true;
  options.residual_in_products = GetParam().residual;
  options.norm_in_products = GetParam().normed;
  options.silu_in_products = GetParam().silu;
  options.rope_in_attention = GetParam().rope;
  options.attention_tiles = GetParam().tiles;
  options.attention_mma = GetParam().mma;
  options.cublas_products = GetParam().cublas;
  options.kv_blocks = 256;
  options.max_step_tokens = 1024;
  auto created = CudaBackend::create(checkpoint_, options);
  ASSERT_TRUE(created.ok()) << created.status().toString();
  CudaBackend& timed = **created;
  const test::Rows reference = decodeThree(*backend_, vocab_);
  EXPECT_TRUE(backend_->takeLaunchTimes().empty()) << "times taken without kernel_times";
  timed.takeLaunchTimes();
  EXPECT_TRUE(timed.takeLaunchTimes().empty());
  expectIdentical(reference, decodeThree(timed, vocab_), "kernel times");
  EXPECT_EQ(timed.graphLaunches(), 0u) << "a timed step ran as a graph";
  const std::vector<LaunchTime> times = timed.takeLaunchTimes();
  // decodeThree: 3 prefill steps, then 32 decode steps.
  const uint64_t prefills = 3, steps = 35, layers = checkpoint_->config().num_layers;
  std::map<std::string, uint64_t> launches;
  for (const LaunchTime& t : times) {
    EXPECT_GT(t.total_us, 0.0) << t.what;
    launches[t.what] = t.launches;
  }
  EXPECT_EQ(launches["step inputs copy"], steps);
  EXPECT_EQ(launches["embedding"], steps);
  EXPECT_EQ(launches["product lm_head"], steps);
  EXPECT_EQ(launches["logits rows out"], steps);
  EXPECT_EQ(launches["count product checks"], steps);
  for (const char* kind :
       {"product q/k/v", "attention", "product o", "product gate/up", "product down"})
    EXPECT_EQ(launches[kind], steps * layers) << kind;
  // With the rope in the attention, only the prefill steps launch the q/k/v kernel; with tiles,
  // the prefill steps' attention runs in them.
  EXPECT_EQ(launches["q/k/v bias, rope, cache"], (GetParam().rope ? prefills : steps) * layers);
  // On the tensor cores, every step's attention runs in tiles of its own (mmaAttentionSteps).
  EXPECT_EQ(timed.tiledAttentionSteps(), GetParam().tiles && !GetParam().mma ? prefills : 0u);
  EXPECT_EQ(timed.mmaAttentionSteps(), GetParam().mma ? steps : 0u);
  EXPECT_EQ(launches["silu"], GetParam().silu ? 0 : steps * layers);
  // Every step has at most 8 rows: with the norms in the products, none launches on its own.
  for (const char* kind : {"norm (input)", "norm (post-attention)"})
    EXPECT_EQ(launches[kind], GetParam().normed ? 0 : steps * layers) << kind;
  EXPECT_TRUE(timed.takeLaunchTimes().empty()) << "taken twice";
}

TEST_P(CudaBackendModels, AgreesWithTheCpuReferenceEngine) {
  auto cpu = CpuBackend::create(checkpoint_, {});
  ASSERT_TRUE(cpu.ok()) << cpu.status().toString();
  test::BackendDriver on_gpu(*backend_), on_cpu(**cpu);
  const auto tokens = randomTokens(40, vocab_, 7);
  const test::Rows gpu_rows = on_gpu.runAlone(1, tokens, 16);
  const test::Rows cpu_rows = on_cpu.runAlone(1, tokens, 16);
  const auto [err, scale] = maxError(gpu_rows, cpu_rows);
  RecordProperty("max_abs_error", std::to_string(err));
  RecordProperty("max_abs_logit", std::to_string(scale));
  EXPECT_LE(err, 0.03 * std::max(1.0, scale));
}

// Past one attention split (cuda::kAttentionSplit positions): a row is the same bit for bit
// whether its splits ran one after another (steps of many rows: prefill chunks of 100) or side by
// side (steps of 8 rows and of one, decoding as graphs, with and without programmatic launch:
// from one split to five, so grids of 1, 2, 4 and 8 blocks a row and head, and past
// cuda::kAttentionSplitBlocks splits, so that a block takes several), and close to the CPU
// reference engine, whose attention is one pass. The parameter is a shape, its context raised to
// 16,384, and whether attention runs on the tensor cores (attention_mma): tiny (head size 16) on
// the CUDA cores, the 0.5B's layer (64) on either. On the CUDA cores the prefill tiles and chunks
// taken two at a time (attention_paired_rows) give the same rows too.
class CudaBackendLongContext : public testing::TestWithParam<std::pair<std::string, bool>> {};

TEST_P(CudaBackendLongContext, SplitsGiveTheSameRowsWhereverTheyRun) {
  if (!test::haveDevice()) GTEST_SKIP() << "no CUDA device";
  test::TempDir tmp;
  const auto [shape, mma] = GetParam();
  auto made = makeModel({.shape = shape, .out_dir = tmp.path(), .seed = 5});
  ASSERT_TRUE(made.ok()) << made.status().toString();
  {
    const std::string path = tmp.path() + "/config.json";
    std::ifstream in(path);
    nlohmann::json config = nlohmann::json::parse(in);
    config["max_position_embeddings"] = 16384;
    if (config.contains("sliding_window")) config["sliding_window"] = 16384;
    std::ofstream(path) << config.dump(2);
  }
  auto checkpoint = openModel(tmp.path());
  ASSERT_NE(checkpoint, nullptr);
  ASSERT_GE(checkpoint->config().max_context, 16384);
  auto backend = [&](bool programmatic, bool tiles = false, uint32_t paired_rows = 0) {
    CudaBackend::Options options;
    options.programmatic_launch = programmatic;
    options.attention_tiles = tiles;
    options.attention_paired_rows = paired_rows;
    options.attention_mma = mma;
    options.kv_blocks = 1024;  // 16,384 positions of 16
    options.max_step_tokens = 1024;
    auto created = CudaBackend::create(checkpoint, options);
    EXPECT_TRUE(created.ok()) << created.status().toString();
    return created.ok() ? std::move(*created) : nullptr;
  };
  auto gpu = backend(false);
  ASSERT_NE(gpu, nullptr);
  if (mma) {
    // Chunks two at a time are the CUDA-core kernel's: asked for beside the tensor cores, the
    // backend is refused with the reason.
    CudaBackend::Options options;
    options.attention_mma = true;
    options.attention_paired_rows = 8;
    auto refused = CudaBackend::create(checkpoint, options);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find("two at a time"), std::string::npos)
        << refused.status().toString();
  }
  const uint32_t vocab = gpu->limits().vocab_size;
  const size_t length = (cuda::kAttentionSplitBlocks + 1) * cuda::kAttentionSplit + 300;
  // Decoded a position a step: [early, early + 900) and the last 300; the rest in steps of 100.
  const size_t early = cuda::kAttentionSplit - 56, late = length - 300;
  auto decoded = [&](size_t at) { return (at >= early && at < early + 900) || at >= late; };
  size_t decode_steps = 0, parallel_steps = 0;  // decoding side by side: more than one split
  std::set<int> grids;  // attention's blocks a (row, head) in the decode steps: one graph each
  for (size_t at = 0; at < length; ++at) {
    if (!decoded(at)) continue;
    const size_t splits = (at + cuda::kAttentionSplit) / cuda::kAttentionSplit;
    int blocks = 1;
    while (splits > 1 && blocks < cuda::kAttentionSplitBlocks && size_t(blocks) < splits)
      blocks *= 2;
    ++decode_steps;
    parallel_steps += splits > 1;
    grids.insert(blocks);
  }
  ASSERT_EQ(grids.size(), 5u) << "grids of 1, 2, 4, 8 and 16 blocks";
  const auto tokens = randomTokens(length, vocab, 13);
  // Rows land in registered memory, as in the arena, so that decode steps run as graphs.
  std::vector<float> output(size_t(100) * ((vocab + 15) & ~15u));
  // The decoded positions one at a time beside rows - 1 other sequences, the others in steps of
  // up to 100 rows (rows 100: in steps of 100 throughout). The first sequence's rows.
  size_t steps_run = 0;  // by the last run
  auto run = [&](Backend& b, size_t rows) {
    steps_run = 0;
    EXPECT_TRUE(b.registerOutputs(
                     {reinterpret_cast<std::byte*>(output.data()), output.size() * sizeof(float)})
                    .ok());
    test::BackendDriver driver(b);  // from block 0: each run rewrites the cache it reads
    driver.setOutputBuffer(&output);
    test::TestSequence seq = driver.newSequence(1, uint32_t(length));
    // The other rows of the decode end: sequences of their own, decoding beside the first.
    std::vector<test::TestSequence> others;
    for (size_t o = 1; o < rows && rows < 100; ++o)
      others.push_back(driver.newSequence(100 + o, uint32_t(decode_steps)));
    test::Rows got;
    for (size_t at = 0; at < length;) {
      const bool one = decoded(at) && rows < 100;
      const size_t end = at < early         ? early
                         : at < early + 900 ? early + 900
                         : at < late        ? late
                                            : length;
      const size_t take = one ? 1 : std::min<size_t>(100, end - at);
      std::vector<test::BackendDriver::Chunk> chunks = {
          {&seq, {tokens.begin() + long(at), tokens.begin() + long(at + take)}}};
      for (size_t o = 0; one && o < others.size(); ++o)
        chunks.push_back({&others[o], {tokens[(at + o) % length]}});
      const auto out = driver.step(chunks);
      ++steps_run;
      got.insert(got.end(), out[0].begin(), out[0].end());
      at += take;
    }
    // Memory is registered once in a process: the next backend registers the same buffer.
    EXPECT_TRUE(b.registerOutputs({}).ok());
    return got;
  };
  const test::Rows serial = run(*gpu, 100);  // steps of 100 rows throughout: one block a row
  EXPECT_EQ(gpu->parallelAttentionSteps(), 0u);
  EXPECT_EQ(gpu->mmaAttentionSteps() > 0, mma) << "attention on the tensor cores";
  if (!mma) {
    // Prefill tiles (rows of a sequence sharing their loads): the same rows, tiles across split
    // boundaries included (steps of up to 100 rows cross multiples of the split).
    auto tiled = backend(false, true);
    ASSERT_NE(tiled, nullptr);
    expectIdentical(serial, run(*tiled, 100), "prefill tiles");
    // Every step there has rows of one sequence only: all of them in tiles.
    EXPECT_EQ(tiled->tiledAttentionSteps(), steps_run);
    // Chunks taken two at a time, in steps of up to 100 rows (no tiles: the splits one after
    // another) and of one row (side by side): the same rows.
    auto paired = backend(true, false, 100);
    ASSERT_NE(paired, nullptr);
    expectIdentical(serial, run(*paired, 100), "paired chunks, 100 rows a step");
    EXPECT_EQ(paired->pairedAttentionSteps(), steps_run) << "every step of up to 100 rows";
    const uint64_t paired_before = paired->pairedAttentionSteps();
    expectIdentical(serial, run(*paired, 1), "paired chunks, 1 row a step");
    EXPECT_EQ(paired->pairedAttentionSteps() - paired_before, steps_run);
    EXPECT_GT(paired->parallelGraphLaunches(), 0u) << "paired and side by side";
  }
  for (const bool programmatic : {false, true}) {
    auto other = backend(programmatic);
    ASSERT_NE(other, nullptr);
    for (const size_t rows : {size_t(1), size_t(8)}) {
      const uint64_t parallel = other->parallelAttentionSteps(), graphs = other->graphLaunches(),
                     parallel_graphs = other->parallelGraphLaunches();
      const size_t captured = other->capturedGraphs();
      expectIdentical(
          serial, run(*other, rows),
          std::to_string(rows) + " rows a step" + (programmatic ? ", programmatic" : ""));
      EXPECT_EQ(other->parallelAttentionSteps() - parallel, parallel_steps)
          << rows << " rows a step";
      EXPECT_GE(other->graphLaunches() - graphs, decode_steps) << rows << " rows a step";
      // The graphs replayed ran the splits side by side (their keys, as captured), and each
      // grid has its graph: the 8-row run captures exactly those (the 1-row run also captures
      // its prefill steps of up to 64 rows, which run as graphs too, and the 8-row run has the
      // same prefill steps).
      EXPECT_EQ(other->parallelGraphLaunches() - parallel_graphs, parallel_steps)
          << rows << " rows a step";
      if (rows == 8)
        EXPECT_EQ(other->capturedGraphs() - captured, grids.size());
      else
        EXPECT_GT(other->capturedGraphs() - captured, grids.size());
    }
  }
  auto cpu = CpuBackend::create(checkpoint, {});
  ASSERT_TRUE(cpu.ok()) << cpu.status().toString();
  test::BackendDriver on_cpu(**cpu);
  const auto [err, scale] = maxError(serial, on_cpu.runAlone(1, tokens, 100));
  RecordProperty("max_abs_error", std::to_string(err));
  EXPECT_LE(err, 0.03 * std::max(1.0, scale));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaBackendLongContext,
                         testing::Values(std::pair<std::string, bool>{"tiny", false},
                                         std::pair<std::string, bool>{"qwen2.5-0.5b-layer", false},
                                         std::pair<std::string, bool>{"qwen2.5-0.5b-layer", true}),
                         [](const testing::TestParamInfo<std::pair<std::string, bool>>& info) {
                           return info.param.first == "tiny" ? std::string("tiny")
                                  : info.param.second        ? std::string("qwen05_layer_mma")
                                                             : std::string("qwen05_layer");
                         });

TEST_P(CudaBackendModels, RowChecksAreThoseOfTheBytesWritten) {
  // Rows in registered memory (as the arena is) and rows outside it both carry checkRow() of
  // exactly what landed.
  std::vector<float> arena(size_t(3) * vocab_ + 7, -1.0f);
  ASSERT_TRUE(backend_
                  ->registerOutputs(
                      {reinterpret_cast<std::byte*>(arena.data()), arena.size() * sizeof(float)})
                  .ok());
  std::vector<float> outside(vocab_, -1.0f);
  const auto tokens = randomTokens(6, vocab_, 8);
  std::vector<uint32_t> blocks(16);
  for (uint32_t i = 0; i < blocks.size(); ++i) blocks[i] = i;
  const uint32_t wanted[4] = {0, 2, 4, 5};
  SequenceStep s{.sequence_id = 1,
                 .start_position = 0,
                 .tokens = tokens,
                 .kv_blocks = blocks,
                 .logits_rows = wanted};
  // Row 1 at an odd offset: not 16-byte aligned.
  float* payloads[4] = {arena.data(), arena.data() + vocab_ + 1, outside.data(),
                        arena.data() + 2 * vocab_ + 7};
  RowCheck checks[4];
  RowOutput rows[4];
  for (int i = 0; i < 4; ++i) rows[i] = {payloads[i], &checks[i]};
  ASSERT_TRUE(backend_->enqueueStep({&s, 1}, rows).ok());
  WeightReadVerdict verdict;
  ASSERT_TRUE(backend_->waitStep(verdict).ok());
  EXPECT_TRUE(verdict.failed_tensor.empty()) << verdict.failed_tensor << ": " << verdict.why;
  for (int i = 0; i < 4; ++i) {
    const RowCheck want = checkRow(payloads[i], vocab_);
    EXPECT_EQ(checks[i].checksum, want.checksum) << "row " << i;
    EXPECT_TRUE(checks[i].finite) << "row " << i;
    EXPECT_NE(payloads[i][vocab_ / 2], -1.0f) << "row " << i << " not written";
  }
  ASSERT_TRUE(backend_->registerOutputs({}).ok());  // before `arena` goes
}

// One step of `tokens` fresh from position 0, its last row asked for; returns its verdict.
WeightReadVerdict verdictOf(Backend& backend, const std::vector<uint32_t>& tokens,
                            uint64_t sequence) {
  std::vector<float> row(backend.limits().vocab_size);
  std::vector<uint32_t> blocks(64);
  for (uint32_t i = 0; i < blocks.size(); ++i) blocks[i] = i;
  const uint32_t last = uint32_t(tokens.size() - 1);
  SequenceStep s{.sequence_id = sequence,
                 .start_position = 0,
                 .tokens = tokens,
                 .kv_blocks = blocks,
                 .logits_rows = {&last, 1}};
  RowCheck check;
  RowOutput out{row.data(), &check};
  WeightReadVerdict verdict;
  EXPECT_TRUE(backend.enqueueStep({&s, 1}, {&out, 1}).ok());
  EXPECT_TRUE(backend.waitStep(verdict).ok());
  EXPECT_TRUE(verdict.checked);
  return verdict;
}

TEST_P(CudaBackendModels, NoCheckFailsOnHealthySteps) {
  test::BackendDriver driver(*backend_);
  // Prefill chunks and decode steps of several sequences: runStep fails on any check.
  for (uint64_t seq = 1; seq <= 3; ++seq) driver.runAlone(seq, randomTokens(120, vocab_, 9), 40);
  const auto verdict = verdictOf(*backend_, randomTokens(200, vocab_, 10), 9);
  EXPECT_TRUE(verdict.failed_tensor.empty()) << verdict.failed_tensor << ": " << verdict.why;
  EXPECT_GT(verdict.words_read, 0u);
  // No healthy product strayed beyond the usual rounding, so no step was computed twice.
  EXPECT_EQ(backend_->recomputedSteps(), 0u);
}

TEST_P(CudaBackendModels, AFaultyMultiplyFailsTheArithmeticCheckOfThatStepOnly) {
  // The flipped exponent bit makes an output below 2 in magnitude enormous, and one above 2
  // almost zero: a change of ordinary size, far inside the worst-case bound of a wide product
  // (qwen2.5-7b-layer), that the usual-rounding check and the second computation must catch.
  // Steps of 12 rows and of 6 (where the model case computes norms and the activation in the
  // products, those paths' checks must catch it).
  const auto twelve = randomTokens(12, vocab_, 11), six = randomTokens(6, vocab_, 12);
  for (uint64_t i = 0; i < 40; ++i) {
    const auto& tokens = i % 2 == 0 ? twelve : six;
    const uint64_t selector = i * 7919 + i * i * 104729;
    auto role = backend_->computeFault(selector);
    ASSERT_TRUE(role.ok());
    const auto faulty = verdictOf(*backend_, tokens, 1000 + 2 * i);
    EXPECT_EQ(faulty.failed_tensor, *role) << "selector " << selector;
    EXPECT_EQ(faulty.failed_check, WeightCheck::kArithmetic) << faulty.why;
    const auto next = verdictOf(*backend_, tokens, 1001 + 2 * i);
    EXPECT_TRUE(next.failed_tensor.empty()) << next.failed_tensor << ": " << next.why;
  }
  EXPECT_EQ(backend_->straysRepeated(), 0u);
  if (GetParam().shape == "qwen2.5-7b-layer") {
    EXPECT_GT(backend_->recomputedSteps(), 0u) << "every fault was beyond the worst-case bound";
  }
}

// One step of `count` sequences of `tokens_each` tokens fresh from position 0 (sequences
// `first` on), each one's last row asked for; returns its verdict.
WeightReadVerdict verdictOfSequences(Backend& backend, uint32_t count, size_t tokens_each,
                                     uint64_t first) {
  const uint32_t vocab = backend.limits().vocab_size;
  std::vector<std::vector<uint32_t>> tokens, blocks;
  std::vector<uint32_t> last(count, uint32_t(tokens_each - 1));
  std::vector<SequenceStep> steps;
  for (uint32_t i = 0; i < count; ++i) {
    tokens.push_back(randomTokens(tokens_each, vocab, uint32_t(first + i)));
    blocks.push_back({i});
  }
  for (uint32_t i = 0; i < count; ++i)
    steps.push_back({.sequence_id = first + i,
                     .start_position = 0,
                     .tokens = tokens[i],
                     .kv_blocks = blocks[i],
                     .logits_rows = {&last[i], 1}});
  std::vector<float> rows(size_t(count) * vocab);
  std::vector<RowCheck> checks(count);
  std::vector<RowOutput> out;
  for (uint32_t i = 0; i < count; ++i) out.push_back({rows.data() + size_t(i) * vocab, &checks[i]});
  WeightReadVerdict verdict;
  EXPECT_TRUE(backend.enqueueStep(steps, out).ok());
  EXPECT_TRUE(backend.waitStep(verdict).ok());
  EXPECT_TRUE(verdict.checked);
  return verdict;
}

// Steps whose rows are all asked for (decode steps) and steps of which half are (two-token
// prefills): a faulty multiply on any row fails that step's check, and the next step passes.
TEST_P(CudaBackendModels, AFaultyMultiplyFailsTheCheckOfAStepOfAskedRows) {
  for (uint64_t i = 0; i < 24; ++i) {
    const size_t tokens_each = 1 + i % 2;
    const uint64_t selector = i * 7919 + i * i * 104729 + 3;
    auto role = backend_->computeFault(selector);
    ASSERT_TRUE(role.ok());
    const auto faulty = verdictOfSequences(*backend_, 5, tokens_each, 100 * i + 1);
    EXPECT_EQ(faulty.failed_tensor, *role)
        << "selector " << selector << ", " << tokens_each << " tokens a sequence";
    EXPECT_EQ(faulty.failed_check, WeightCheck::kArithmetic) << faulty.why;
    const auto next = verdictOfSequences(*backend_, 5, tokens_each, 100 * i + 50);
    EXPECT_TRUE(next.failed_tensor.empty()) << next.failed_tensor << ": " << next.why;
  }
}

TEST_P(CudaBackendModels, AStaleSlotFailsItsSlotTagBeforeComputing) {
  auto role = backend_->staleSlot(5);
  ASSERT_TRUE(role.ok());
  const auto verdict = verdictOf(*backend_, randomTokens(4, vocab_, 12), 1);
  EXPECT_EQ(verdict.failed_tensor, *role);
  EXPECT_EQ(verdict.failed_check, WeightCheck::kSlotTag) << verdict.why;
}

// A matrix multiply's weight (not a bias, norm or embedding), by the checkpoint's names.
bool isProductWeight(const std::string& name) {
  return name == "lm_head.weight" ||
         (name.size() > 12 && name.compare(name.size() - 12, 12, "_proj.weight") == 0);
}

TEST_P(CudaBackendModels, AFlippedWeightBitFailsTheStepThatReadsIt) {
  const auto tokens = randomTokens(8, vocab_, 13);
  // The high exponent bit, then the lowest mantissa bit, of the first bf16 of every used tensor:
  // every one is read by a step of all its rows except the embedding (one row per token), whose
  // first row token 0 reads.
  std::vector<uint32_t> with_zero = tokens;
  with_zero[3] = 0;
  uint64_t offset = 0;
  uint32_t tensor = 0;
  for (const TensorView* t : checkpoint_->usedTensors()) {
    ASSERT_TRUE(backend_->flipWeightBit(offset + 1, 6).ok());
    const auto verdict = verdictOf(*backend_, with_zero, 1);
    EXPECT_FALSE(verdict.failed_tensor.empty()) << t->name << " flipped, step passed";
    ASSERT_TRUE(backend_->flipWeightBit(offset + 1, 6).ok());  // flip back
    // The lowest mantissa bit: far inside the arithmetic check's tolerance, so only the folded
    // words of the reads can see it; cuBLAS folds none, so in its products' weights only the
    // scrubber's checksums can.
    ASSERT_TRUE(backend_->flipWeightBit(offset, 0).ok());
    const auto low = verdictOf(*backend_, with_zero, 1);
    if (GetParam().cublas && isProductWeight(t->name)) {
      const std::vector<WeightRange> ranges = {{tensor, 0, t->data.size()}};
      std::vector<uint64_t> got(1);
      ASSERT_TRUE(backend_->residentChecksums(ranges, got).ok());
      EXPECT_NE(got[0], checksumBytes(t->data)) << t->name << " low bit flipped, scrub passed";
    } else {
      EXPECT_FALSE(low.failed_tensor.empty()) << t->name << " low bit flipped, step passed";
      EXPECT_EQ(low.failed_check, WeightCheck::kReads) << t->name << ": " << low.why;
    }
    ASSERT_TRUE(backend_->flipWeightBit(offset, 0).ok());
    offset += t->data.size();
    ++tensor;
  }
  const auto clean = verdictOf(*backend_, with_zero, 2);
  EXPECT_TRUE(clean.failed_tensor.empty()) << clean.failed_tensor << ": " << clean.why;
}

TEST_P(CudaBackendModels, ResidentChecksumsSeeACorruptionAndRepairMendsIt) {
  const auto used = checkpoint_->usedTensors();
  std::vector<WeightRange> ranges;
  std::vector<uint64_t> want;
  for (uint32_t t = 0; t < used.size(); ++t) {
    const uint64_t bytes = used[t]->data.size();
    ranges.push_back({t, 0, bytes / 2});
    ranges.push_back({t, bytes / 2, bytes - bytes / 2});
    want.push_back(checksumBytes(used[t]->data.subspan(0, bytes / 2)));
    want.push_back(checksumBytes(used[t]->data.subspan(bytes / 2)));
  }
  std::vector<uint64_t> got(ranges.size());
  ASSERT_TRUE(backend_->residentChecksums(ranges, got).ok());
  EXPECT_EQ(got, want);
  ASSERT_TRUE(backend_->flipWeightBit(used[0]->data.size() - 1, 0).ok());  // tensor 0's end
  ASSERT_TRUE(backend_->residentChecksums(ranges, got).ok());
  EXPECT_EQ(got[0], want[0]);
  EXPECT_NE(got[1], want[1]);
  ASSERT_TRUE(backend_->repairResident(ranges[1]).ok());
  ASSERT_TRUE(backend_->residentChecksums(ranges, got).ok());
  EXPECT_EQ(got, want);
}

// Two GPUs (a broker's --workers 2): a sequence gives the same logits bit for bit on either
// device, so one that moves from GPU 0 to GPU 1 mid-generation continues exactly; and the second
// device's backend serves calls from a thread other than the one that loaded it (the worker's
// scrubber), which must use that device, not the thread's default one.
TEST_P(CudaBackendModels, TheSecondDeviceGivesTheSameLogitsAndScrubsFromAnotherThread) {
  if (test::deviceCount() < 2) GTEST_SKIP() << "needs two CUDA devices";
  std::unique_ptr<CudaBackend> second = cudaBackend(checkpoint_, true, 1);
  ASSERT_NE(second, nullptr);
  const auto tokens = randomTokens(40, vocab_, 9);
  test::BackendDriver on_first(*backend_), on_second(*second);
  // Prefilled in chunks of 7 (and decoded) on each: the rows of a sequence that moved.
  expectIdentical(on_first.runAlone(1, tokens, 7), on_second.runAlone(1, tokens, 7),
                  "device 1 against device 0");
  const auto used = checkpoint_->usedTensors();
  std::vector<WeightRange> ranges;
  std::vector<uint64_t> want;
  for (uint32_t t = 0; t < used.size(); ++t) {
    ranges.push_back({t, 0, used[t]->data.size()});
    want.push_back(checksumBytes(used[t]->data));
  }
  std::vector<uint64_t> got(ranges.size());
  Status scrubbed;
  std::thread scrubber([&] { scrubbed = second->residentChecksums(ranges, got); });
  scrubber.join();
  ASSERT_TRUE(scrubbed.ok()) << scrubbed.toString();
  EXPECT_EQ(got, want);
}

INSTANTIATE_TEST_SUITE_P(
    Models, CudaBackendModels,
    testing::Values(
        ModelCase{"fixture_qwen2", ""}, ModelCase{"llama_untied", "tiny-llama"},
        ModelCase{"qwen2_v152k", "tiny-v152k"}, ModelCase{"qwen7b_layer", "qwen2.5-7b-layer"},
        ModelCase{"fixture_qwen2_residual", "", true},
        ModelCase{"qwen7b_layer_residual", "qwen2.5-7b-layer", true},
        ModelCase{"fixture_qwen2_normed", "", true, true},
        ModelCase{"qwen7b_layer_normed", "qwen2.5-7b-layer", true, true},
        ModelCase{"llama_untied_silu", "tiny-llama", false, false, true},
        ModelCase{"fixture_qwen2_fused", "", true, true, true},
        ModelCase{"qwen7b_layer_fused", "qwen2.5-7b-layer", true, true, true},
        ModelCase{"fixture_qwen2_rope", "", false, false, false, true},
        ModelCase{"llama_untied_rope", "tiny-llama", false, false, false, true},
        ModelCase{"qwen7b_layer_rope", "qwen2.5-7b-layer", false, false, false, true},
        ModelCase{"fixture_qwen2_tiles", "", false, false, false, false, true},
        ModelCase{"llama_untied_tiles", "tiny-llama", false, false, false, false, true},
        ModelCase{"qwen7b_layer_rope_tiles", "qwen2.5-7b-layer", false, false, false, true, true},
        ModelCase{"qwen05_layer", "qwen2.5-0.5b-layer"},
        // Every fusion with rope in attention (the default at head size 64): no other case
        // combines them.
        ModelCase{"qwen05_layer_fused_rope", "qwen2.5-0.5b-layer", true, true, true, true},
        ModelCase{"qwen05_layer_mma", "qwen2.5-0.5b-layer", false, false, false, false, false,
                  true},
        ModelCase{"qwen7b_layer_mma", "qwen2.5-7b-layer", false, false, false, false, false, true},
        ModelCase{"qwen7b_layer_residual_mma", "qwen2.5-7b-layer", true, false, false, false, false,
                  true},
        // cuBLAS products, checked by the arithmetic check alone.
        ModelCase{"fixture_qwen2_cublas", "", false, false, false, false, false, false, true},
        ModelCase{"qwen7b_layer_cublas", "qwen2.5-7b-layer", false, false, false, false, true,
                  false, true},
        // Every product's weights streamed from host memory through staging slots.
        ModelCase{"fixture_qwen2_streamed", "", false, false, false, false, false, false, false,
                  true},
        ModelCase{"llama_untied_streamed", "tiny-llama", false, false, false, false, false, false,
                  false, true},
        ModelCase{"qwen7b_layer_streamed", "qwen2.5-7b-layer", false, false, false, false, false,
                  false, false, true},
        ModelCase{"qwen05_layer_fused_rope_streamed", "qwen2.5-0.5b-layer", true, true, true, true,
                  false, false, false, true},
        ModelCase{"qwen7b_layer_cublas_streamed", "qwen2.5-7b-layer", false, false, false, false,
                  true, false, true, true}),
    [](const testing::TestParamInfo<ModelCase>& info) { return info.param.name; });

}  // namespace
}  // namespace bulkhead

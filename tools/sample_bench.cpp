// sample-bench implementation.
#include "tools/sample_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>

#include "broker/row_sampling.h"
#include "shared/checksum.h"
#include "shared/mix.h"
#include "shared/work_pool.h"
#include "tools/json_report.h"
#include "tools/percentile.h"

namespace bulkhead {
namespace {

struct Mode {
  const char* name;
  bool verify_only;
  float temperature;
  float top_p;
  bool logprobs;  // as a request that asks for them (the default request does not)
};

constexpr Mode kModes[] = {
    {"verify", true, 0.0f, 1.0f, false},           {"greedy", false, 0.0f, 1.0f, false},
    {"greedy+logprobs", false, 0.0f, 1.0f, true},  {"T=0.8", false, 0.8f, 1.0f, false},
    {"T=0.8,top_p=0.9", false, 0.8f, 0.9f, false}, {"top_p+logprobs", false, 0.8f, 0.9f, true}};

// Whether the passes run 16 lanes wide: asked for, and the processor has them.
bool wideLanes(const SampleBenchOptions& o) {
  return o.lanes == 16 && RowSampler::sixteenLanes();
}

// One table: every row count and mode on a pool of `threads` threads (0: every core).
Status benchPool(const SampleBenchOptions& o, unsigned threads, const std::vector<float>& block,
                 const std::vector<uint64_t>& checksums, nlohmann::json& results) {
  WorkPool pool(threads);
  const bool wide = wideLanes(o);
  RowSampler sampler(pool, wide);
  std::printf(
      "sample-bench: vocab %u, %s rows, %u threads, %u iterations, %d-lane passes; "
      "microseconds per call\n",
      o.vocab, o.peaked ? "peaked" : "near-flat", pool.threads(), o.iterations, wide ? 16 : 8);
  std::printf("%6s", "rows");
  for (const Mode& m : kModes) std::printf(" %18s", (std::string(m.name) + " p50/p99").c_str());
  std::printf("\n");
  const std::vector<uint32_t> history = {1, 2, 3};
  for (uint32_t n : o.rows) {
    std::printf("%6u", n);
    for (const Mode& m : kModes) {
      SamplingConfig cfg;
      cfg.temperature = m.temperature;
      cfg.top_p = m.top_p;
      cfg.logprobs = m.logprobs;
      cfg.seed = 1;
      std::vector<RowToSample> rows(n);
      std::vector<SampledRow> out(n);
      std::vector<double> us;
      for (uint32_t it = 0; it < o.iterations + 10; ++it) {
        for (uint32_t r = 0; r < n; ++r)
          rows[r] = {.logits = std::span(block).subspan(size_t(r) * o.vocab, o.vocab),
                     .expected_checksum = checksums[r],
                     .config = m.verify_only ? nullptr : &cfg,
                     .prompt = history,
                     .generated = {},
                     .position = it};
        const auto start = std::chrono::steady_clock::now();
        sampler.verifyAndSample(rows, out);
        const double t =
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
                .count();
        for (const SampledRow& s : out)
          if (s.failed != IntegrityCheck::kNone)
            return internalError("sample-bench: a clean row failed verification");
        if (it >= 10) us.push_back(t);  // the first calls size the scratch space
      }
      const double p50 = percentile(us, 50), p99 = percentile(us, 99);
      char cell[32];
      std::snprintf(cell, sizeof cell, "%.1f/%.1f", p50, p99);
      std::printf(" %18s", cell);
      std::fflush(stdout);
      results.push_back({{"threads", pool.threads()},
                         {"rows", n},
                         {"mode", m.name},
                         {"p50_us", p50},
                         {"p99_us", p99}});
    }
    std::printf("\n");
  }
  return okStatus();
}

}  // namespace

Status runSampleBench(const SampleBenchOptions& o) {
  if (o.vocab == 0 || o.rows.empty() || o.iterations == 0)
    return invalidArgument("sample-bench: --vocab, --rows and --iterations must be positive");
  const uint32_t max_rows = *std::max_element(o.rows.begin(), o.rows.end());
  // One block like the arena's payloads: rows back to back. Logits spread over [-1, 1]: the
  // near-flat rows of random weights, where top-p keeps most of the vocabulary. Peaked: spread
  // over [-4, 4], and 16 tokens a row at 10 to 13.75, which hold about 98% of the mass at
  // temperature 0.8, so top-p keeps a few of them.
  std::vector<float> block(size_t(max_rows) * o.vocab);
  for (size_t i = 0; i < block.size(); ++i)
    block[i] = float((double(splitmix64(i) >> 11) * 0x1p-52 - 1.0) * (o.peaked ? 4.0 : 1.0));
  if (o.peaked) {
    for (uint32_t r = 0; r < max_rows; ++r)
      for (uint32_t j = 0; j < 16; ++j)
        block[size_t(r) * o.vocab + splitmix64(uint64_t(r) * 16 + j) % o.vocab] =
            10.0f + 0.25f * float(j);
  }
  std::vector<uint64_t> checksums(max_rows);
  for (uint32_t r = 0; r < max_rows; ++r)
    checksums[r] =
        checksumBytes(std::as_bytes(std::span(block).subspan(size_t(r) * o.vocab, o.vocab)));

  nlohmann::json report = {{"vocab", o.vocab},
                           {"iterations", o.iterations},
                           {"rows_kind", o.peaked ? "peaked" : "flat"},
                           {"lanes", wideLanes(o) ? 16 : 8},
                           {"results", nlohmann::json::array()}};
  for (const unsigned threads : o.threads)
    BULKHEAD_RETURN_IF_ERROR(benchPool(o, threads, block, checksums, report["results"]));
  BULKHEAD_RETURN_IF_ERROR(writeJsonReport(o.json_path, report));
  return okStatus();
}

}  // namespace bulkhead

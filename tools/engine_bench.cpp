// bench-engine: see engine_bench.h.
#include "tools/engine_bench.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "shared/checkpoint.h"
#include "tools/json_report.h"
#include "tools/percentile.h"
#include "worker/backend_factory.h"
#ifdef BULKHEAD_HAVE_CUDA
#include "cuda/bandwidth.cuh"
#endif

namespace bulkhead {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kWarmupSteps = 8;

double usSince(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

// Page-aligned host memory for the logits rows, registered with the backend as the worker's
// arena is, so rows reach the host the way they do in service.
class RowMemory {
 public:
  static Result<RowMemory> map(size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return resourceExhausted("mmap of " + std::to_string(bytes) + " bytes");
    RowMemory m;
    m.data_ = static_cast<std::byte*>(p);
    m.bytes_ = bytes;
    return m;
  }
  RowMemory() = default;
  RowMemory(RowMemory&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  RowMemory& operator=(RowMemory&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~RowMemory() {
    if (data_ != nullptr) munmap(data_, bytes_);
  }
  std::span<std::byte> span() const { return {data_, bytes_}; }
  float* row(size_t i, size_t vocab) const { return reinterpret_cast<float*>(data_) + i * vocab; }

 private:
  std::byte* data_ = nullptr;
  size_t bytes_ = 0;
};

struct Variant {
  std::string name;
  bool checks = true;
  bool cublas = false;
  bool kernel_times = false;
};

struct Measured {
  double prefill_tokens_per_s = 0;
  double step_p50_us = 0;
  double step_p99_us = 0;
  std::vector<LaunchTime> launches;          // the timed steps', with kernel times
  std::vector<LaunchTime> prefill_launches;  // the whole prefill's, with kernel times
  std::string backend_name;                  // Backend::name(): whose products it ran
  uint64_t streamed_bytes = 0;               // weight bytes a step copies in (weight_budget)
};

// Weight bytes a decode step of `batch` sequences reads: every used tensor but the embedding
// table, of which only the batch's rows, unless the lm_head is the same table.
uint64_t stepWeightBytes(const Checkpoint& ckpt, uint32_t batch) {
  const ModelTensors& t = ckpt.tensors();
  uint64_t bytes = ckpt.weightBytes();
  if (t.embed != nullptr && t.lm_head != t.embed)
    bytes -= t.embed->data.size() -
             std::min<uint64_t>(t.embed->data.size(),
                                uint64_t(batch) * t.embed->data.size() / t.embed->shape[0]);
  return bytes;
}

// The prompts of `steps` (each from position 0, its logits row the prompt's last), in steps of at
// most `max_tokens` tokens: each prompt in chunks of up to that many, as many sequences' chunks
// a step as fit. `dst` gets the last chunks' logits rows, one a sequence.
Status prefill(Backend& backend, std::span<const SequenceStep> steps, std::span<float* const> dst,
               uint32_t max_tokens) {
  const uint32_t prompt = uint32_t(steps.front().tokens.size());
  const uint32_t chunk = std::min(prompt, max_tokens);
  std::vector<SequenceStep> part;
  std::vector<float*> part_dst;
  for (uint32_t begin = 0; begin < prompt; begin += chunk) {
    const uint32_t len = std::min(chunk, prompt - begin);
    const bool last = begin + len == prompt;
    const uint32_t last_row[] = {len - 1};
    for (size_t s0 = 0; s0 < steps.size();) {
      const size_t n = std::min<size_t>(steps.size() - s0, max_tokens / len);
      part.clear();
      part_dst.clear();
      for (size_t s = s0; s < s0 + n; ++s) {
        SequenceStep step = steps[s];
        step.start_position = begin;
        step.tokens = steps[s].tokens.subspan(begin, len);
        step.logits_rows = last ? std::span<const uint32_t>(last_row) : std::span<const uint32_t>();
        if (last) part_dst.push_back(dst[s]);
        part.push_back(step);
      }
      BULKHEAD_RETURN_IF_ERROR(runStep(backend, part, part_dst));
      s0 += n;
    }
  }
  return okStatus();
}

// One backend, every batch size: prefill, warm-up, timed decode steps.
Result<std::vector<Measured>> measure(const EngineBenchOptions& o,
                                      std::shared_ptr<const Checkpoint> ckpt, const Variant& v) {
  BackendOptions options;
  options.check_weight_reads = v.checks;
  options.cuda_graphs = o.graphs;
  options.cuda_programmatic_launch = o.programmatic_launch;
  options.cuda_gemm_schedules = o.gemm_schedules;
  options.cuda_gemm_splits = o.gemm_splits;
  options.cuda_gemm_shape_schedules = o.gemm_shape_schedules;
  options.max_step_tokens = o.max_step_tokens;
  options.cuda_cublas_products = v.cublas || o.cublas_products == "on";
  options.cuda_kernel_times = v.kernel_times;
  options.cuda_residual_in_products = o.residual_in_products && !v.cublas;  // ours only
  options.cuda_norm_in_products = o.norm_in_products && !v.cublas;
  options.cuda_silu_in_products = o.silu_in_products && !v.cublas;
  if (o.rope_in_attention != "auto") options.cuda_rope_in_attention = o.rope_in_attention == "on";
  options.cuda_attention_tiles = o.attention_tiles == "on";
  options.cuda_attention_paired_rows = o.attention_paired_rows;
  options.cuda_attention_mma = o.attention_mma == "on";
  options.cuda_logits_in_product = o.logits_in_product == "on";
  options.cuda_weight_budget = o.weight_budget;
  BULKHEAD_ASSIGN_OR_RETURN(auto backend, createBackend(o.backend, ckpt, options));
  const BackendLimits& limits = backend->limits();
  const uint32_t max_batch = *std::max_element(o.batches.begin(), o.batches.end());
  const size_t vocab = limits.vocab_size;
  BULKHEAD_ASSIGN_OR_RETURN(RowMemory rows, RowMemory::map(size_t(max_batch) * vocab * 4));
  BULKHEAD_RETURN_IF_ERROR(backend->registerOutputs(rows.span()));
  const uint32_t positions = o.prompt + kWarmupSteps + o.steps;
  const uint32_t blocks_each = (positions + limits.kv_block_size - 1) / limits.kv_block_size;
  if (positions > limits.max_context)
    return invalidArgument(std::to_string(positions) + " positions exceed the model's context");

  std::vector<Measured> out;
  for (const uint32_t batch : o.batches) {
    if (uint64_t(batch) * blocks_each > limits.kv_block_count)
      return resourceExhausted("batch " + std::to_string(batch) + " needs " +
                               std::to_string(uint64_t(batch) * blocks_each) +
                               " KV blocks, the backend has " +
                               std::to_string(limits.kv_block_count));
    std::vector<std::vector<uint32_t>> tables(batch), prompts(batch);
    std::vector<uint32_t> last_row = {o.prompt - 1}, first_row = {0};
    std::vector<std::array<uint32_t, 1>> next(batch);
    std::vector<SequenceStep> steps(batch);
    std::vector<float*> dst(batch);
    for (uint32_t s = 0; s < batch; ++s) {
      for (uint32_t b = 0; b < blocks_each; ++b) tables[s].push_back(s * blocks_each + b);
      for (uint32_t i = 0; i < o.prompt; ++i)
        prompts[s].push_back(uint32_t((uint64_t(s) * 7919 + i * 104729 + 13) % vocab));
      steps[s] = {.sequence_id = s,
                  .start_position = 0,
                  .tokens = prompts[s],
                  .kv_blocks = tables[s],
                  .logits_rows = last_row};
      dst[s] = rows.row(s, vocab);
    }
    Measured m;
    m.backend_name = std::string(backend->name());
    m.streamed_bytes = limits.streamed_weight_bytes;
    auto start = Clock::now();
    BULKHEAD_RETURN_IF_ERROR(prefill(*backend, steps, dst, limits.max_step_tokens));
    m.prefill_tokens_per_s = double(batch) * o.prompt / (usSince(start) * 1e-6);
    m.prefill_launches = backend->takeLaunchTimes();
    std::vector<double> us;
    for (uint32_t step = 0; step < kWarmupSteps + o.steps; ++step) {
      for (uint32_t s = 0; s < batch; ++s) {
        // Greedy: each sequence's next token is its last row's argmax.
        const float* row = dst[s];
        next[s][0] = uint32_t(std::max_element(row, row + vocab) - row);
        steps[s].start_position = o.prompt + step;
        steps[s].tokens = next[s];
        steps[s].logits_rows = first_row;
      }
      if (step == kWarmupSteps) backend->takeLaunchTimes();  // the warm-up's
      start = Clock::now();
      BULKHEAD_RETURN_IF_ERROR(runStep(*backend, steps, dst));
      if (step >= kWarmupSteps) us.push_back(usSince(start));
    }
    m.step_p50_us = percentile(us, 50);
    m.step_p99_us = percentile(us, 99);
    m.launches = backend->takeLaunchTimes();
    out.push_back(m);
  }
  return out;
}

// The kernel-times tables: per batch size, each kind of launch's device time a step, checked
// and (where measured) unchecked.
nlohmann::json printLaunchTimes(const EngineBenchOptions& o, const std::vector<Measured>& checked,
                                const std::vector<Measured>* unchecked) {
  nlohmann::json out = nlohmann::json::array();
  const double steps = o.steps;
  for (size_t i = 0; i < o.batches.size(); ++i) {
    std::printf(
        "\nbatch %u, device time a decode step by launch (uncaptured steps, a timed event after "
        "each launch; us):\n%-26s %9s %10s %10s %12s %10s\n",
        o.batches[i], "launch", "per_step", "us_each", "us_a_step", "unchecked", "checks");
    double total = 0, total_off = 0;
    nlohmann::json rows = nlohmann::json::array();
    for (const LaunchTime& t : checked[i].launches) {
      const double per_step = t.total_us / steps;
      total += per_step;
      std::printf("%-26s %9.1f %10.2f %10.1f", t.what.c_str(), double(t.launches) / steps,
                  t.total_us / double(t.launches), per_step);
      nlohmann::json row = {{"launch", t.what},
                            {"launches_per_step", double(t.launches) / steps},
                            {"us_per_step", per_step}};
      const LaunchTime* off = nullptr;
      if (unchecked != nullptr)
        for (const LaunchTime& u : (*unchecked)[i].launches)
          if (u.what == t.what) off = &u;
      if (off != nullptr) {
        std::printf(" %12.1f %10.1f", off->total_us / steps, per_step - off->total_us / steps);
        row["unchecked_us_per_step"] = off->total_us / steps;
      }
      std::printf("\n");
      rows.push_back(row);
    }
    if (unchecked != nullptr)
      for (const LaunchTime& u : (*unchecked)[i].launches) total_off += u.total_us / steps;
    std::printf("%-26s %9s %10s %10.1f", "total", "", "", total);
    if (unchecked != nullptr) std::printf(" %12.1f %10.1f", total_off, total - total_off);
    std::printf("\n");
    // The prefill before the decode steps: where a prefill step's device time goes (its products
    // against its attention and the rest), checked only.
    std::printf(
        "batch %u, device time of the whole prefill (%u prompts of %u tokens) by launch:\n"
        "%-26s %9s %10s %7s\n",
        o.batches[i], o.batches[i], o.prompt, "launch", "launches", "us", "share");
    double prefill_total = 0;
    for (const LaunchTime& t : checked[i].prefill_launches) prefill_total += t.total_us;
    nlohmann::json prefill = nlohmann::json::array();
    for (const LaunchTime& t : checked[i].prefill_launches) {
      std::printf("%-26s %9llu %10.1f %6.1f%%\n", t.what.c_str(), (unsigned long long)t.launches,
                  t.total_us, prefill_total > 0 ? 100 * t.total_us / prefill_total : 0.0);
      prefill.push_back({{"launch", t.what}, {"launches", t.launches}, {"us", t.total_us}});
    }
    std::printf("%-26s %9s %10.1f\n", "total", "", prefill_total);
    out.push_back({{"batch", o.batches[i]}, {"launches", rows}, {"prefill_launches", prefill}});
  }
  return out;
}

}  // namespace

Status runEngineBench(const EngineBenchOptions& o) {
  if (o.batches.empty() || o.prompt == 0 || o.steps == 0)
    return invalidArgument("bench-engine needs batch sizes, a prompt and steps");
  if (o.kernel_times && o.backend != "cuda")
    return invalidArgument("--kernel-times times the CUDA backend's launches (--backend cuda)");
  if (!o.weight_budget.empty() && o.backend != "cuda")
    return invalidArgument("--weight-budget streams the CUDA backend's weights (--backend cuda)");
  BULKHEAD_ASSIGN_OR_RETURN(Checkpoint opened, Checkpoint::open(o.model_dir));
  auto ckpt = std::make_shared<const Checkpoint>(std::move(opened));

  double read_bytes_per_s = 0;
#ifdef BULKHEAD_HAVE_CUDA
  if (o.backend == "cuda") {
    BULKHEAD_ASSIGN_OR_RETURN(const cuda::ReadBandwidth bw,
                              cuda::measureReadBandwidth(size_t(4) << 30, 10));
    read_bytes_per_s = bw.bytes_per_s;
  }
#endif
  std::vector<Variant> variants = {{"checked", true, false}};
  if (o.compare && o.backend == "cuda") {
    variants.push_back({"unchecked", false, false});
    variants.push_back({"cublas", false, true});
  }
  std::vector<std::vector<Measured>> results;
  for (const Variant& v : variants) {
    BULKHEAD_ASSIGN_OR_RETURN(auto measured, measure(o, ckpt, v));
    results.push_back(std::move(measured));
  }

  std::printf(
      "bench-engine: %s on %s, graphs %s, programmatic launch %s, product schedules %s, "
      "product splits %s, shape schedules %s, "
      "residual in products %s, norms in products %s, silu in products %s, rope in attention %s, "
      "attention tiles %s, attention chunks paired up to %u rows, attention on tensor cores %s, "
      "logits in product %s, cuBLAS products %s (%s), prompt %u, %u decode steps per batch size\n",
      o.model_dir.c_str(), o.backend.c_str(), o.graphs ? "on" : "off",
      o.programmatic_launch ? "on" : "off",
      o.gemm_schedules.empty() ? "default" : o.gemm_schedules.c_str(),
      o.gemm_splits.empty() ? "default" : o.gemm_splits.c_str(),
      o.gemm_shape_schedules.empty() ? "default" : o.gemm_shape_schedules.c_str(),
      o.residual_in_products ? "on" : "off", o.norm_in_products ? "on" : "off",
      o.silu_in_products ? "on" : "off", o.rope_in_attention.c_str(), o.attention_tiles.c_str(),
      o.attention_paired_rows, o.attention_mma.c_str(), o.logits_in_product.c_str(),
      o.cublas_products.c_str(), results[0].empty() ? "" : results[0][0].backend_name.c_str(),
      o.prompt, o.steps);
  if (read_bytes_per_s > 0)
    std::printf("device read bandwidth (copy kernel, median of 10 passes over 4 GiB): %.0f GB/s\n",
                read_bytes_per_s / 1e9);
  const uint64_t streamed = results[0].empty() ? 0 : results[0][0].streamed_bytes;
  if (!o.weight_budget.empty())
    std::printf("weight budget %s: %.1f MiB of weights streamed from host memory every step\n",
                o.weight_budget.c_str(), double(streamed) / (1 << 20));
  std::printf("%6s %12s %10s %10s %10s %11s %7s", "batch", "prefill_t/s", "step_ms", "step_p99",
              "tokens/s", "weight_GB/s", "of_HBM");
  if (variants.size() > 1)
    std::printf(" %12s %8s %12s %13s %10s", "unchecked_ms", "checks", "cublas_ms", "cublas_tok/s",
                "vs_cublas");
  std::printf("\n");
  nlohmann::json report = {
      {"model", o.model_dir},
      {"backend", o.backend},
      {"graphs", o.graphs},
      {"programmatic_launch", o.programmatic_launch},
      {"gemm_schedules", o.gemm_schedules.empty() ? "default" : o.gemm_schedules},
      {"gemm_splits", o.gemm_splits.empty() ? "default" : o.gemm_splits},
      {"gemm_shape_schedules", o.gemm_shape_schedules.empty() ? "default" : o.gemm_shape_schedules},
      {"residual_in_products", o.residual_in_products},
      {"norm_in_products", o.norm_in_products},
      {"silu_in_products", o.silu_in_products},
      {"rope_in_attention", o.rope_in_attention},
      {"attention_tiles", o.attention_tiles},
      {"attention_paired_rows", o.attention_paired_rows},
      {"attention_mma", o.attention_mma},
      {"logits_in_product", o.logits_in_product},
      {"cublas_products", o.cublas_products},
      {"backend_name", results[0].empty() ? "" : results[0][0].backend_name},
      {"prompt", o.prompt},
      {"steps", o.steps},
      {"read_bandwidth_gb_s", read_bytes_per_s / 1e9},
      {"weight_budget", o.weight_budget},
      {"streamed_weight_bytes", streamed},
      {"results", nlohmann::json::array()}};
  for (size_t i = 0; i < o.batches.size(); ++i) {
    const uint32_t batch = o.batches[i];
    const Measured& m = results[0][i];
    const double tokens_per_s = batch / (m.step_p50_us * 1e-6);
    const double weight_gb_s = double(stepWeightBytes(*ckpt, batch)) / (m.step_p50_us * 1e-6) / 1e9;
    const double of_hbm = read_bytes_per_s > 0 ? weight_gb_s * 1e9 / read_bytes_per_s : 0;
    std::printf("%6u %12.0f %10.3f %10.3f %10.1f %11.0f", batch, m.prefill_tokens_per_s,
                m.step_p50_us / 1e3, m.step_p99_us / 1e3, tokens_per_s, weight_gb_s);
    if (of_hbm > 0)
      std::printf(" %6.1f%%", 100 * of_hbm);
    else
      std::printf(" %7s", "-");
    nlohmann::json row = {{"batch", batch},
                          {"prefill_tokens_per_s", m.prefill_tokens_per_s},
                          {"step_p50_ms", m.step_p50_us / 1e3},
                          {"step_p99_ms", m.step_p99_us / 1e3},
                          {"tokens_per_s", tokens_per_s},
                          {"weight_gb_per_s", weight_gb_s},
                          {"fraction_of_read_bandwidth", of_hbm}};
    if (variants.size() > 1) {
      const Measured& off = results[1][i];
      const Measured& cublas = results[2][i];
      const double checks = m.step_p50_us / off.step_p50_us - 1;
      const double cublas_tokens = batch / (cublas.step_p50_us * 1e-6);
      std::printf(" %12.3f %7.1f%% %12.3f %13.1f %9.1f%%", off.step_p50_us / 1e3, 100 * checks,
                  cublas.step_p50_us / 1e3, cublas_tokens, 100 * tokens_per_s / cublas_tokens);
      row["unchecked_step_p50_ms"] = off.step_p50_us / 1e3;
      row["checks_cost"] = checks;
      row["cublas_step_p50_ms"] = cublas.step_p50_us / 1e3;
      row["cublas_tokens_per_s"] = cublas_tokens;
      row["tokens_per_s_vs_cublas"] = tokens_per_s / cublas_tokens;
    }
    if (streamed > 0) {
      // What the copies from host memory reached: a step copies every streamed byte once.
      const double streamed_gb_s = double(streamed) / (m.step_p50_us * 1e-6) / 1e9;
      std::printf("  streamed %.1f GB/s", streamed_gb_s);
      row["streamed_gb_per_s"] = streamed_gb_s;
    }
    std::printf("\n");
    report["results"].push_back(row);
  }
  if (o.kernel_times) {
    BULKHEAD_ASSIGN_OR_RETURN(const auto timed,
                              measure(o, ckpt, {"checked, timed", true, false, true}));
    std::vector<Measured> timed_off;
    if (o.compare) {
      BULKHEAD_ASSIGN_OR_RETURN(timed_off,
                                measure(o, ckpt, {"unchecked, timed", false, false, true}));
    }
    report["kernel_times"] = printLaunchTimes(o, timed, o.compare ? &timed_off : nullptr);
  }
  BULKHEAD_RETURN_IF_ERROR(writeJsonReport(o.json_path, report));
  return okStatus();
}

}  // namespace bulkhead

// bench-gemm: see gemm_bench.h.
#include "tools/gemm_bench.h"

#include <algorithm>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "tools/json_report.h"
#include "tools/make_model.h"
#ifdef BULKHEAD_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/cuda_check.cuh"
#include "cuda/gemm.cuh"
#include "cuda/launch.cuh"
#include "cuda/matmul.cuh"
#endif

namespace bulkhead {

#ifndef BULKHEAD_HAVE_CUDA
Status runGemmBench(const GemmBenchOptions&) {
  return failedPrecondition("bench-gemm needs a build with the CUDA backend");
}
#else
namespace {

struct Product {
  const char* name;
  int n, k;
};

constexpr int kCopiedMiB = 256;
constexpr size_t kMaxCopies = 4096;

std::vector<Product> productsOf(const ModelShape& s) {
  const int head_dim = s.hidden / s.heads;
  return {{"qkv", s.hidden + 2 * s.kv_heads * head_dim, s.hidden},
          {"o", s.hidden, s.hidden},
          {"gate_up", 2 * s.intermediate, s.hidden},
          {"down", s.hidden, s.intermediate},
          {"lm_head", s.vocab, s.hidden}};
}

// A failed release cannot change what was measured, but it is reported, never ignored.
void reportIfFailed(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    std::fprintf(stderr, "bench-gemm: %s failed: %s\n", what, cudaGetErrorString(err));
}

// Device memory freed on scope exit.
struct DeviceBuffer {
  void* p = nullptr;
  ~DeviceBuffer() {
    if (p != nullptr) reportIfFailed(cudaFree(p), "cudaFree");
  }
};

// The stream, destroyed (and no longer programmatic) on scope exit.
struct BenchStream {
  cudaStream_t s = nullptr;
  ~BenchStream() {
    if (s == nullptr) return;
    cuda::setProgrammaticLaunch(s, false);
    reportIfFailed(cudaStreamDestroy(s), "cudaStreamDestroy");
  }
};

// A timed graph's executable and events, released on scope exit.
struct TimedGraph {
  cudaGraphExec_t exec = nullptr;
  cudaEvent_t begin = nullptr, end = nullptr;
  ~TimedGraph() {
    if (begin != nullptr) reportIfFailed(cudaEventDestroy(begin), "cudaEventDestroy");
    if (end != nullptr) reportIfFailed(cudaEventDestroy(end), "cudaEventDestroy");
    if (exec != nullptr) reportIfFailed(cudaGraphExecDestroy(exec), "cudaGraphExecDestroy");
  }
};

// What a column times: one of our schedules, with the fold of the weight words a step's checks
// add or without, or cuBLAS.
struct Path {
  const char* label;  // the table's column
  const char* json;   // the JSON field, before "_us"
  bool cublas = false;
  cuda::GemmSchedule schedule = cuda::GemmSchedule::kPlain;
  bool folding = false;
  int splits = 0;  // 0: gemmSplits, as a step
};
const Path kPaths[] = {
    {"plain", "plain"},
    {"+fold", "plain_folding", false, cuda::GemmSchedule::kPlain, true},
    {"pipelined", "pipelined", false, cuda::GemmSchedule::kPipelined},
    {"+fold", "pipelined_folding", false, cuda::GemmSchedule::kPipelined, true},
    {"two_tiles", "two_tiles", false, cuda::GemmSchedule::kTwoTiles},
    {"+fold", "two_tiles_folding", false, cuda::GemmSchedule::kTwoTiles, true},
    {"interleaved", "interleaved", false, cuda::GemmSchedule::kInterleaved},
    {"+fold", "interleaved_folding", false, cuda::GemmSchedule::kInterleaved, true},
    {"paired", "paired", false, cuda::GemmSchedule::kPaired},
    {"+fold", "paired_folding", false, cuda::GemmSchedule::kPaired, true},
    {"tiled", "tiled", false, cuda::GemmSchedule::kTiled},
    {"+fold", "tiled_folding", false, cuda::GemmSchedule::kTiled, true},
    {"cublas", "cublas", true},
};

// Microseconds a launch, `launches` launches over `copies` copies of the weight in one graph.
Result<double> timeLaunches(const Path& path, const Product& p, int m, const __nv_bfloat16* x,
                            const __nv_bfloat16* w, int copies, float* y, cudaStream_t stream,
                            const cuda::Matmul& cublas, cuda::FoldAccount* account,
                            uint32_t launches) {
  const size_t weight_elems = size_t(p.n) * size_t(p.k);
  cuda::GemmFold fold;
  if (path.folding) {
    fold.weights = 1;
    fold.account[0] = account;
    fold.salt[0] = 0x2545f491u;
    fold.row_end[0] = p.n;
  }
  auto enqueue = [&](uint32_t count) -> Status {
    for (uint32_t i = 0; i < count; ++i) {
      const __nv_bfloat16* wi = w + weight_elems * (i % uint32_t(copies));
      if (path.cublas) {
        BULKHEAD_RETURN_IF_ERROR(cublas.run(x, m, wi, p.n, p.k, y, false));
      } else {
        BULKHEAD_RETURN_IF_ERROR(
            cuda::launchGemm(x, m, wi, p.n, p.k, y, p.n, stream, fold, path.schedule, path.splits));
      }
    }
    return okStatus();
  };
  cudaGraph_t graph = nullptr;
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  Status captured = enqueue(launches);
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  if (!captured.ok() && graph != nullptr)
    reportIfFailed(cudaGraphDestroy(graph), "cudaGraphDestroy");
  BULKHEAD_RETURN_IF_ERROR(captured);
  BULKHEAD_CUDA_RETURN_IF_ERROR(ended);
  TimedGraph timed;
  const cudaError_t instantiated = cudaGraphInstantiate(&timed.exec, graph, 0);
  reportIfFailed(cudaGraphDestroy(graph), "cudaGraphDestroy");
  BULKHEAD_CUDA_RETURN_IF_ERROR(instantiated);
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaEventCreate(&timed.begin));
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaEventCreate(&timed.end));
  float best_ms = 0;
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(timed.exec, stream));  // untimed
  for (int rep = 0; rep < 3; ++rep) {
    BULKHEAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(timed.begin, stream));
    BULKHEAD_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(timed.exec, stream));
    BULKHEAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(timed.end, stream));
    BULKHEAD_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(timed.end));
    float ms = 0;
    BULKHEAD_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, timed.begin, timed.end));
    best_ms = rep == 0 ? ms : std::min(best_ms, ms);
  }
  return 1000.0 * best_ms / launches;
}

}  // namespace

Status runGemmBench(const GemmBenchOptions& o) {
  const auto& shapes = modelShapes();
  auto shape = std::find_if(shapes.begin(), shapes.end(),
                            [&](const ModelShape& s) { return s.name == o.shape; });
  if (shape == shapes.end()) return invalidArgument("unknown shape " + o.shape);
  if (o.rows.empty() || o.launches == 0) return invalidArgument("no rows or no launches");
  const int max_m = int(*std::max_element(o.rows.begin(), o.rows.end()));
  // Declared before the cuBLAS handle bound to it, so released after it.
  BenchStream owned;
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&owned.s, cudaStreamNonBlocking));
  cudaStream_t stream = owned.s;
  const bool programmatic = cuda::programmaticLaunchSupported();
  cuda::setProgrammaticLaunch(stream, programmatic);
  auto cublas = cuda::Matmul::create(stream);
  if (!cublas.ok()) return cublas.status();
  std::printf(
      "bench-gemm: %s products, at least %u launches a cell in one graph (one per weight copy, "
      "%d MiB of copies), programmatic launch %s; us a launch and weight GB/s\n",
      o.shape.c_str(), o.launches, kCopiedMiB, programmatic ? "on" : "off");
  std::printf("%-8s %7s %6s %4s", "product", "n", "k", "m");
  for (const Path& p : kPaths) std::printf(" %12s %8s", p.label, "GB/s");
  std::printf(" %10s\n", "best/cublas");
  nlohmann::json report = {
      {"shape", o.shape}, {"launches", o.launches}, {"results", nlohmann::json::array()}};
  for (const Product& p : productsOf(*shape)) {
    const size_t weight_bytes = size_t(p.n) * size_t(p.k) * 2;
    // Enough copies that the L2 cache (50 MB on an H200) holds none of them between uses, and a
    // launch for each at least. Weights so small that this many copies would make a graph of
    // more than kMaxCopies launches are timed from the cache, and marked so.
    const int copies = int(std::min<size_t>(
        kMaxCopies, std::max<size_t>(2, (size_t(kCopiedMiB) << 20) / weight_bytes + 1)));
    const bool from_cache = size_t(copies) * weight_bytes < (size_t(kCopiedMiB) << 20);
    const uint32_t launches = std::max(o.launches, uint32_t(copies));
    DeviceBuffer w, x, y, account;
    BULKHEAD_CUDA_RETURN_IF_ERROR(cudaMalloc(&account.p, sizeof(cuda::FoldAccount)));
    BULKHEAD_CUDA_RETURN_IF_ERROR(cudaMalloc(&w.p, weight_bytes * size_t(copies)));
    BULKHEAD_CUDA_RETURN_IF_ERROR(cudaMalloc(&x.p, size_t(max_m) * size_t(p.k) * 2));
    BULKHEAD_CUDA_RETURN_IF_ERROR(cudaMalloc(&y.p, size_t(max_m) * size_t(p.n) * 4));
    // Small finite values: 0x3c3c is about 0.0115 in bf16.
    BULKHEAD_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(w.p, 0x3c, weight_bytes * size_t(copies), stream));
    BULKHEAD_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(x.p, 0x3c, size_t(max_m) * size_t(p.k) * 2, stream));
    for (uint32_t m : o.rows) {
      std::printf("%-8s %7d %6d %4u", p.name, p.n, p.k, m);
      nlohmann::json row = {{"product", p.name}, {"n", p.n}, {"k", p.k}, {"m", m}};
      double best_ours = 0, cublas_us = 0;
      auto time = [&](const Path& path) {
        return timeLaunches(path, p, int(m), static_cast<const __nv_bfloat16*>(x.p),
                            static_cast<const __nv_bfloat16*>(w.p), copies,
                            static_cast<float*>(y.p), stream, **cublas,
                            static_cast<cuda::FoldAccount*>(account.p), launches);
      };
      for (const Path& path : kPaths) {
        BULKHEAD_ASSIGN_OR_RETURN(const double us, time(path));
        const double gbs = double(weight_bytes) / us / 1e3;
        std::printf(" %12.2f %8.0f", us, gbs);
        row[std::string(path.json) + "_us"] = us;
        if (path.cublas)
          cublas_us = us;
        else
          best_ours = best_ours == 0 ? us : std::min(best_ours, us);
      }
      std::printf(" %9.1f%%%s\n", 100.0 * cublas_us / best_ours,
                  from_cache ? " (weights in the L2 cache)" : "");
      // The other split counts a shape could be given (each its own fixed sum order): whether
      // gemmSplits chose well.
      std::printf(
          "%28s splits (plain/pipelined/two_tiles/interleaved/paired/tiled us), a step uses %d:",
          "", cuda::gemmSplits(p.n, p.k));
      row["splits"] = nlohmann::json::array();
      for (const int splits : {1, 2, 4, 8}) {
        std::printf(" %d: ", splits);
        for (const auto schedule : cuda::kGemmSchedules) {
          const Path path{"", "", false, schedule, false, splits};
          BULKHEAD_ASSIGN_OR_RETURN(const double us, time(path));
          std::printf(schedule == cuda::GemmSchedule::kPlain ? "%.2f" : "/%.2f", us);
          row["splits"].push_back(
              {{"splits", splits}, {"schedule", cuda::gemmScheduleName(schedule)}, {"us", us}});
        }
      }
      std::printf("\n");
      row["launches"] = launches;
      row["from_cache"] = from_cache;
      report["results"].push_back(row);
    }
  }
  return writeJsonReport(o.json_path, report);
}
#endif

}  // namespace bulkhead

// Whether workspace-0 cuBLAS keeps a row's bits whatever the row count, past the 64 rows of a
// decode step: up to the 2,048 rows of a prefill chunk, on the fused weight shapes the backend
// multiplies (Qwen2.5 0.5B and 7B: q/k/v, o, gate/up, down, lm_head). Every row of every product
// is compared bit for bit with the same row computed alone (one row, the same configuration).
// Three configurations: cublasGemmEx with its own choice per call; cuBLASLt with its
// heuristic's first algorithm per call; cuBLASLt pinned to the algorithm its heuristic gives at
// 64 rows, for every row count. For the heuristic, the algorithm it picks at each row count
// (id, tile, stages, split-k, cluster) is printed, so a change of kernel shows beside a change
// of bits. Then each configuration's time a launch at 1 to 2,048 rows.
//
// Build: nvcc -std=c++17 -gencode arch=compute_90,code=sm_90 -O3 -o cublas_probe \
//          tools/gpu/cublas_probe.cu -lcublasLt -lcublas
// Run on an sm_90 GPU: ./cublas_probe (exit 0: every configuration invariant; 1: some not).
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe.cuh"  // CHECK

#define CHECK_BLAS(call)                                                \
  do {                                                                  \
    cublasStatus_t s_ = (call);                                         \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, \
                   cublasGetStatusString(s_));                          \
      std::exit(2);                                                     \
    }                                                                   \
  } while (0)

namespace {

constexpr int kMaxRows = 2048;
const int kRowCounts[] = {1,  2,  3,  4,   7,   8,   9,   16,  17,  31,  32,  33,   48,  63,
                          64, 65, 96, 127, 128, 129, 200, 256, 384, 512, 777, 1024, 2048};

__global__ void fill(__nv_bfloat16* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint32_t x = uint32_t(i) * 2654435761u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    x ^= x >> 15;
    p[i] = __float2bfloat16((float(x & 0xffff) / 65536.0f - 0.5f) * 0.1f);
  }
}

// bad[r] = 1 where row r of y differs in any bit from row r of ref (rows of n floats).
__global__ void compareRows(const float* y, const float* ref, int n, int* bad) {
  const int r = blockIdx.y;
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x)
    if (__float_as_uint(y[size_t(r) * n + j]) != __float_as_uint(ref[size_t(r) * n + j])) {
      bad[r] = 1;
      return;
    }
}

struct Shape {
  const char* name;
  int n, k;
};

enum Config { kGemmEx, kLtHeuristic, kLtPinned, kConfigs };
const char* const kConfigNames[] = {"cublasGemmEx", "cublasLt heuristic", "cublasLt pinned@64"};

struct Probe {
  cublasHandle_t blas;
  cublasLtHandle_t lt;
  cudaStream_t stream;
  cublasLtMatmulDesc_t desc;
  Shape shape;
  const __nv_bfloat16* w;
  cublasLtMatmulAlgo_t pinned;

  void layouts(int m, cublasLtMatrixLayout_t* a, cublasLtMatrixLayout_t* b,
               cublasLtMatrixLayout_t* c) const {
    CHECK_BLAS(cublasLtMatrixLayoutCreate(a, CUDA_R_16BF, shape.k, shape.n, shape.k));
    CHECK_BLAS(cublasLtMatrixLayoutCreate(b, CUDA_R_16BF, shape.k, m, shape.k));
    CHECK_BLAS(cublasLtMatrixLayoutCreate(c, CUDA_R_32F, shape.n, m, shape.n));
  }

  bool heuristic(int m, cublasLtMatmulAlgo_t* algo) const {
    cublasLtMatrixLayout_t a, b, c;
    layouts(m, &a, &b, &c);
    cublasLtMatmulPreference_t pref;
    CHECK_BLAS(cublasLtMatmulPreferenceCreate(&pref));
    const size_t zero = 0;
    CHECK_BLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &zero, sizeof zero));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    CHECK_BLAS(cublasLtMatmulAlgoGetHeuristic(lt, desc, a, b, c, c, pref, 1, &result, &found));
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(c);
    if (found < 1) return false;
    *algo = result.algo;
    return true;
  }

  // y (m rows) = x (m rows) times w transposed, in configuration `config`.
  bool run(Config config, const __nv_bfloat16* x, int m, float* y) const {
    const float one = 1.0f, zero = 0.0f;
    if (config == kGemmEx) {
      CHECK_BLAS(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, shape.n, m, shape.k, &one, w,
                              CUDA_R_16BF, shape.k, x, CUDA_R_16BF, shape.k, &zero, y, CUDA_R_32F,
                              shape.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      return true;
    }
    cublasLtMatmulAlgo_t algo = pinned;
    if (config == kLtHeuristic && !heuristic(m, &algo)) return false;
    cublasLtMatrixLayout_t a, b, c;
    layouts(m, &a, &b, &c);
    const cublasStatus_t s =
        cublasLtMatmul(lt, desc, &one, w, a, x, b, &zero, y, c, y, c, &algo, nullptr, 0, stream);
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(c);
    if (s == CUBLAS_STATUS_NOT_SUPPORTED) return false;
    CHECK_BLAS(s);
    return true;
  }
};

void describe(const cublasLtMatmulAlgo_t& algo, char* out, size_t size) {
  auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attr) {
    // The attributes are integers of 2, 4 or 8 bytes, and a read must name the exact size.
    for (size_t bytes : {4, 2, 8}) {
      uint64_t v = 0;
      size_t written = 0;
      if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, bytes, &written) ==
          CUBLAS_STATUS_SUCCESS)
        return static_cast<long long>(v);
    }
    return -1LL;
  };

  std::snprintf(out, size, "id %lld tile %lld stages %lld splitk %lld reduction %lld cluster %lld",
                get(CUBLASLT_ALGO_CONFIG_ID), get(CUBLASLT_ALGO_CONFIG_TILE_ID),
                get(CUBLASLT_ALGO_CONFIG_STAGES_ID), get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID));
}

}  // namespace

int main() {
  const Shape shapes[] = {
      {"0.5B q/k/v 1152x896", 1152, 896},       {"0.5B o 896x896", 896, 896},
      {"0.5B gate/up 9728x896", 9728, 896},     {"0.5B down 896x4864", 896, 4864},
      {"0.5B lm_head 151936x896", 151936, 896}, {"7B q/k/v 4608x3584", 4608, 3584},
      {"7B o 3584x3584", 3584, 3584},           {"7B gate/up 37888x3584", 37888, 3584},
      {"7B down 3584x18944", 3584, 18944},      {"7B lm_head 152064x3584", 152064, 3584}};
  Probe p{};
  CHECK(cudaStreamCreate(&p.stream));
  CHECK_BLAS(cublasCreate(&p.blas));
  CHECK_BLAS(cublasSetStream(p.blas, p.stream));
  CHECK_BLAS(cublasSetWorkspace(p.blas, nullptr, 0));
  CHECK_BLAS(cublasLtCreate(&p.lt));
  CHECK_BLAS(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transpose = CUBLAS_OP_T;
  CHECK_BLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose,
                                            sizeof transpose));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  int* bad = nullptr;
  CHECK(cudaMalloc(&bad, kMaxRows * sizeof(int)));
  std::vector<int> host_bad(kMaxRows);
  bool all_invariant = true;

  for (const Shape& s : shapes) {
    p.shape = s;
    __nv_bfloat16 *w, *x;
    float *y, *ref;
    CHECK(cudaMalloc(&w, size_t(s.n) * s.k * 2));
    CHECK(cudaMalloc(&x, size_t(kMaxRows) * s.k * 2));
    CHECK(cudaMalloc(&y, size_t(s.n) * kMaxRows * 4));
    CHECK(cudaMalloc(&ref, size_t(s.n) * kMaxRows * 4));
    fill<<<1024, 256, 0, p.stream>>>(w, size_t(s.n) * s.k, 1);
    fill<<<1024, 256, 0, p.stream>>>(x, size_t(kMaxRows) * s.k, 2);
    CHECK(cudaGetLastError());
    p.w = w;
    if (!p.heuristic(64, &p.pinned)) {
      std::printf("%s: no cuBLASLt algorithm at 64 rows\n", s.name);
      return 2;
    }
    std::printf("== %s\n", s.name);
    for (int config = 0; config < kConfigs; ++config) {
      const Config c = Config(config);
      // The reference: every row alone, in this configuration.
      for (int r = 0; r < kMaxRows; ++r)
        if (!p.run(c, x + size_t(r) * s.k, 1, ref + size_t(r) * s.n)) {
          std::printf("  %-20s cannot run one row\n", kConfigNames[c]);
          goto next_config;
        }
      for (int m : kRowCounts) {
        char algo_text[160] = "";
        if (c == kLtHeuristic) {
          cublasLtMatmulAlgo_t algo;
          if (p.heuristic(m, &algo)) describe(algo, algo_text, sizeof algo_text);
        }
        if (!p.run(c, x, m, y)) {
          std::printf("  %-20s m=%-5d not supported\n", kConfigNames[c], m);
          continue;
        }
        CHECK(cudaMemsetAsync(bad, 0, m * sizeof(int), p.stream));
        compareRows<<<dim3(8, m), 256, 0, p.stream>>>(y, ref, s.n, bad);
        CHECK(cudaGetLastError());
        CHECK(cudaMemcpyAsync(host_bad.data(), bad, m * sizeof(int), cudaMemcpyDeviceToHost,
                              p.stream));
        CHECK(cudaStreamSynchronize(p.stream));
        int differ = 0;
        for (int r = 0; r < m; ++r) differ += host_bad[r];
        if (differ != 0) all_invariant = false;
        if (differ != 0 || c == kLtHeuristic)
          std::printf("  %-20s m=%-5d rows differing from alone: %d  %s\n", kConfigNames[c], m,
                      differ, algo_text);
      }
      std::printf("  %-20s us a launch (TB/s of weight | TFLOPS):", kConfigNames[c]);
      for (int m : {1, 8, 32, 64, 128, 512, 2048}) {
        // The heuristic's algorithm is asked for once a row count, outside the timed launches.
        const cublasLtMatmulAlgo_t pinned = p.pinned;
        Config timed = c;
        if (c == kLtHeuristic) {
          if (!p.heuristic(m, &p.pinned)) continue;
          timed = kLtPinned;
        }
        if (!p.run(timed, x, m, y)) {
          p.pinned = pinned;
          continue;
        }
        const int launches = m >= 512 ? 5 : 20;
        CHECK(cudaEventRecord(start, p.stream));
        for (int i = 0; i < launches; ++i) p.run(timed, x, m, y);
        CHECK(cudaEventRecord(stop, p.stream));
        CHECK(cudaEventSynchronize(stop));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, start, stop));
        p.pinned = pinned;
        const double us = 1e3 * ms / launches;
        std::printf("  %d: %.1f (%.2f | %.0f)", m, us, 2.0 * s.n * s.k / us / 1e6,
                    2.0 * m * s.n * s.k / us / 1e6);
      }
      std::printf("\n");
    next_config:;
    }
    CHECK(cudaFree(w));
    CHECK(cudaFree(x));
    CHECK(cudaFree(y));
    CHECK(cudaFree(ref));
  }
  std::printf(all_invariant ? "every configuration invariant\n" : "some rows differ\n");
  return all_invariant ? 0 : 1;
}

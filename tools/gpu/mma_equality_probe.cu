// Whether Hopper's warpgroup product (wgmma) rounds a bf16 product's k16 steps exactly as the
// warp product the CUDA backend's kernels use (mma.sync m16n8k16, fp32 accumulation), so that a
// wgmma kernel can take some row buckets without changing a single output bit. For 64 x 8 outputs
// over K, each path accumulates the same k16 steps in the same order from the same start; the
// probe compares the results bit for bit, and against a double-precision reference to show that
// each shared-memory layout was read as meant.
//
// Build: nvcc -std=c++20 -gencode arch=compute_90a,code=sm_90a -O2 -o mma_equality_probe \
//          tools/gpu/mma_equality_probe.cu
// Run on an sm_90 GPU: ./mma_equality_probe (exit 0: every path read right equals mma.sync bit
// for bit; 1: some differs; 2: none was read right).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "probe.cuh"

constexpr int kM = 64, kN = 8;

// a: kM x k row-major, b: kN x k row-major (each output row n's k values contiguous), d: kM x kN.
// Warp w takes rows 16w..16w+15 with mma.sync, k16 step after k16 step from d's start values.
__global__ void warpProduct(const __nv_bfloat16* a, const __nv_bfloat16* b, int k, float* d) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int r0 = 16 * warp + g, r1 = r0 + 8;
  float acc[4] = {d[r0 * kN + 2 * c], d[r0 * kN + 2 * c + 1], d[r1 * kN + 2 * c],
                  d[r1 * kN + 2 * c + 1]};
  for (int k0 = 0; k0 < k; k0 += 16) {
    const uint32_t a0 = pairOf(a + r0 * k + k0 + 2 * c), a1 = pairOf(a + r1 * k + k0 + 2 * c),
                   a2 = pairOf(a + r0 * k + k0 + 2 * c + 8),
                   a3 = pairOf(a + r1 * k + k0 + 2 * c + 8);
    const uint32_t b0 = pairOf(b + g * k + k0 + 2 * c), b1 = pairOf(b + g * k + k0 + 2 * c + 8);
    mmaBf16(acc, a0, a1, a2, a3, b0, b1);
  }
  d[r0 * kN + 2 * c] = acc[0];
  d[r0 * kN + 2 * c + 1] = acc[1];
  d[r1 * kN + 2 * c] = acc[2];
  d[r1 * kN + 2 * c + 1] = acc[3];
}

__device__ uint64_t descriptor(const void* smem, uint32_t lbo, uint32_t sbo) {
  const uint32_t addr = uint32_t(__cvta_generic_to_shared(smem));
  return uint64_t((addr >> 4) & 0x3fff) | uint64_t((lbo >> 4) & 0x3fff) << 16 |
         uint64_t((sbo >> 4) & 0x3fff) << 32;  // swizzle bits 62-63: 0, none
}

// Stores rows x 16 k values (from column k0 of a row-major matrix of width k) as core matrices of
// 8 rows x 8 values (128 bytes each): core (row block rb, k half kh) at byte (rb * 2 + kh) * 128.
__device__ void storeCores(const __nv_bfloat16* src, int rows, int k, int k0, __nv_bfloat16* dst) {
  for (int i = threadIdx.x; i < rows * 16; i += blockDim.x) {
    const int r = i / 16, kk = i % 16;
    dst[((r / 8) * 2 + kk / 8) * 64 + (r % 8) * 8 + kk % 8] = src[r * k + k0 + kk];
  }
}

// The same outputs with one warpgroup's wgmma m64n8k16 a k16 step: A from registers (the
// mma.sync fragments) when a_in_smem is false, else from shared memory; B from shared memory.
// lbo/sbo: the descriptors' offsets between core matrices along k and along rows.
__global__ void groupProduct(const __nv_bfloat16* a, const __nv_bfloat16* b, int k, float* d,
                             bool a_in_smem, uint32_t lbo, uint32_t sbo) {
  // Twice what the layouts hold: a misread assignment of the offsets (B's second k half at 256
  // bytes) reads past them, never past the arrays.
  __shared__ alignas(128) __nv_bfloat16 sa[kM * 32];
  __shared__ alignas(128) __nv_bfloat16 sb[kN * 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int r0 = 16 * warp + g, r1 = r0 + 8;
  float acc[4] = {d[r0 * kN + 2 * c], d[r0 * kN + 2 * c + 1], d[r1 * kN + 2 * c],
                  d[r1 * kN + 2 * c + 1]};
  for (int k0 = 0; k0 < k; k0 += 16) {
    __syncthreads();
    storeCores(b, kN, k, k0, sb);
    if (a_in_smem) storeCores(a, kM, k, k0, sa);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    const uint64_t db = descriptor(sb, lbo, sbo);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    if (a_in_smem) {
      const uint64_t da = descriptor(sa, lbo, sbo);
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, %4, %5, p, 1, 1, "
          "0, 0;\n}\n"
          : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
          : "l"(da), "l"(db)
          : "memory");
    } else {
      const uint32_t a0 = pairOf(a + r0 * k + k0 + 2 * c), a1 = pairOf(a + r1 * k + k0 + 2 * c),
                     a2 = pairOf(a + r0 * k + k0 + 2 * c + 8),
                     a3 = pairOf(a + r1 * k + k0 + 2 * c + 8);
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
          "%8, p, 1, 1, 0;\n}\n"
          : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db)
          : "memory");
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  }
  d[r0 * kN + 2 * c] = acc[0];
  d[r0 * kN + 2 * c + 1] = acc[1];
  d[r1 * kN + 2 * c] = acc[2];
  d[r1 * kN + 2 * c + 1] = acc[3];
}

int main() {
  int failures = 0, read_right = 0;
  std::mt19937 rng(7);
  for (int k : {16, 64, 256, 3584}) {
    // Values over a wide range of magnitudes, so that the rounding inside a k16 step matters.
    std::uniform_real_distribution<float> mant(1.0f, 2.0f);
    std::uniform_int_distribution<int> expo(-12, 12), sign(0, 1);
    auto draw = [&] {
      return __float2bfloat16((sign(rng) ? -1.0f : 1.0f) * std::ldexp(mant(rng), expo(rng)));
    };
    std::vector<__nv_bfloat16> a(kM * k), b(kN * k);
    for (auto& v : a) v = draw();
    for (auto& v : b) v = draw();
    std::vector<float> start(kM * kN);
    for (auto& v : start) v = __bfloat162float(draw());
    std::vector<double> ref(kM * kN);
    double scale = 0;
    for (int m = 0; m < kM; ++m)
      for (int n = 0; n < kN; ++n) {
        double s = start[m * kN + n], mag = std::fabs(s);
        for (int i = 0; i < k; ++i) {
          const double p =
              double(__bfloat162float(a[m * k + i])) * double(__bfloat162float(b[n * k + i]));
          s += p;
          mag += std::fabs(p);
        }
        ref[m * kN + n] = s;
        scale = std::max(scale, mag);
      }
    __nv_bfloat16 *da, *db;
    float* dd;
    CHECK(cudaMalloc(&da, a.size() * 2));
    CHECK(cudaMalloc(&db, b.size() * 2));
    CHECK(cudaMalloc(&dd, start.size() * 4));
    CHECK(cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
    auto run = [&](auto launch) {
      CHECK(cudaMemcpy(dd, start.data(), start.size() * 4, cudaMemcpyHostToDevice));
      launch();
      CHECK(cudaGetLastError());
      CHECK(cudaDeviceSynchronize());
      std::vector<float> out(start.size());
      CHECK(cudaMemcpy(out.data(), dd, out.size() * 4, cudaMemcpyDeviceToHost));
      return out;
    };
    const std::vector<float> warp = run([&] { warpProduct<<<1, 128>>>(da, db, k, dd); });
    auto worst = [&](const std::vector<float>& out) {
      double e = 0;
      for (size_t i = 0; i < out.size(); ++i) e = std::max(e, std::fabs(out[i] - ref[i]) / scale);
      return e;
    };
    std::printf("k %5d: mma.sync, error against double %.3g (of the sum of magnitudes)\n", k,
                worst(warp));
    struct Variant {
      const char* name;
      bool a_in_smem;
      uint32_t lbo, sbo;
    };
    for (Variant v : {Variant{"wgmma, A in registers, lbo 128", false, 128, 256},
                      Variant{"wgmma, A in registers, lbo 256", false, 256, 128},
                      Variant{"wgmma, A in shared memory, lbo 128 sbo 256", true, 128, 256},
                      Variant{"wgmma, A in shared memory, lbo 256 sbo 128", true, 256, 128}}) {
      const std::vector<float> group =
          run([&] { groupProduct<<<1, 128>>>(da, db, k, dd, v.a_in_smem, v.lbo, v.sbo); });
      int differ = 0;
      for (size_t i = 0; i < group.size(); ++i) differ += std::memcmp(&group[i], &warp[i], 4) != 0;
      const double e = worst(group);
      // A misread layout is off by the order of the sums themselves; rounding by far less.
      const bool layout_ok = e < 1e-3;
      std::printf("  %-44s error %.3g%s, outputs differing from mma.sync: %d of %zu\n", v.name, e,
                  layout_ok ? "" : " (layout misread)", differ, group.size());
      read_right += layout_ok;
      if (layout_ok && differ > 0) ++failures;
    }
    CHECK(cudaFree(da));
    CHECK(cudaFree(db));
    CHECK(cudaFree(dd));
  }
  if (read_right == 0) {
    std::printf("no wgmma path read its operands as laid out: nothing compared\n");
    return 2;
  }
  std::printf(failures == 0 ? "every correctly read wgmma path equals mma.sync bit for bit\n"
                            : "some wgmma path rounds differently from mma.sync\n");
  return failures == 0 ? 0 : 1;
}

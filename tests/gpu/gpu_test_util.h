// What the GPU tests share: whether a device is present, and a device buffer that checks its
// allocation and copies.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <initializer_list>
#include <vector>

namespace bulkhead::test {

inline int deviceCount() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}
inline bool haveDevice() {
  return deviceCount() > 0;
}

// n elements of T in device memory, freed at scope exit.
template <typename T>
struct DeviceBuffer {
  T* p = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t count) : n(count) {
    EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
  }
  // The copy has landed when it returns: cudaMemcpy from pageable memory may return before its
  // DMA ends, and a non-blocking stream that reads the buffer next does not wait for it.
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) {
    EXPECT_EQ(cudaMemcpy(p, host.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  // Waits for the device, then copies elements [first, first + count) back.
  std::vector<T> read(size_t first, size_t count) const {
    std::vector<T> out(count);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(out.data(), p + first, count * sizeof(T), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return out;
  }
  std::vector<T> read() const { return read(0, n); }
};

// y = x · wᵀ (m x n, from bf16 x: m x k and w: n x k) against the product in double, for `rows`
// and three outputs of each: bf16 products are exact in fp32, and fp32 sums stay well within
// this bound.
inline void expectMatchesProduct(const std::vector<float>& y, const std::vector<__nv_bfloat16>& x,
                                 const std::vector<__nv_bfloat16>& w, int n, int k,
                                 std::initializer_list<int> rows) {
  for (int r : rows) {
    for (int j : {0, n / 3, n - 1}) {
      double expect = 0, scale = 0;
      for (int i = 0; i < k; ++i) {
        const double p = double(__bfloat162float(x[size_t(r) * k + i])) *
                         double(__bfloat162float(w[size_t(j) * k + i]));
        expect += p;
        scale += std::fabs(p);
      }
      EXPECT_NEAR(y[size_t(r) * n + j], expect, 1e-5 * scale + 1e-6)
          << "row " << r << ", output " << j;
    }
  }
}

}  // namespace bulkhead::test

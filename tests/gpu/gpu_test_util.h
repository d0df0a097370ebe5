// What the GPU tests share: whether a device is present, and a device buffer that checks its
// allocation and copies.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <vector>

namespace bulkhead::test {

inline bool haveDevice() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// n elements of T in device memory, freed at scope exit.
template <typename T>
struct DeviceBuffer {
  T* p = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t count) : n(count) {
    EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) {
    EXPECT_EQ(cudaMemcpy(p, host.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
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

}  // namespace bulkhead::test

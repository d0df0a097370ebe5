// RAII owners for the CUDA runtime's resources (device and pinned buffers, streams, events, a
// host-memory registration, a graph). Destructors ignore errors: they run on paths that are
// already leaving, and a worker whose device failed exits anyway. (The factories move into their
// Result explicitly: nvcc does not move a returned local implicitly.)
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "cuda/cuda_check.cuh"

namespace bulkhead::cuda {

// Where a Buffer's bytes live: device memory (cudaMalloc: never managed memory), or page-locked
// host memory mapped into the device's address space.
struct DeviceAllocator {
  static cudaError_t allocate(void** p, size_t bytes) { return cudaMalloc(p, bytes); }
  static void release(void* p) { cudaFree(p); }
};
struct PinnedAllocator {
  static cudaError_t allocate(void** p, size_t bytes) {
    return cudaHostAlloc(p, bytes, cudaHostAllocMapped);
  }
  static void release(void* p) { cudaFreeHost(p); }
};

// `bytes` bytes from `Allocator`, released at destruction.
template <typename Allocator>
class Buffer {
 public:
  Buffer() = default;
  static Result<Buffer> allocate(size_t bytes) {
    Buffer m;
    if (bytes == 0) return Result<Buffer>(std::move(m));
    BULKHEAD_CUDA_RETURN_IF_ERROR(Allocator::allocate(&m.ptr_, bytes));
    m.bytes_ = bytes;
    return Result<Buffer>(std::move(m));
  }
  Buffer(Buffer&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  Buffer& operator=(Buffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~Buffer() {
    if (ptr_ != nullptr) Allocator::release(ptr_);
  }
  template <typename T = void>
  T* get() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};
using DeviceMemory = Buffer<DeviceAllocator>;
using PinnedMemory = Buffer<PinnedAllocator>;

class Stream {
 public:
  Stream() = default;
  // `urgent`: the device's greatest priority, so that its kernels take multiprocessors as they
  // free up ahead of those of default-priority streams (the scrubber's).
  static Result<Stream> create(bool urgent = false) {
    Stream s;
    int least = 0, greatest = 0;
    if (urgent) BULKHEAD_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    BULKHEAD_CUDA_RETURN_IF_ERROR(
        cudaStreamCreateWithPriority(&s.stream_, cudaStreamNonBlocking, urgent ? greatest : least));
    return Result<Stream>(std::move(s));
  }
  Stream(Stream&& o) noexcept : stream_(std::exchange(o.stream_, nullptr)) {}
  Stream& operator=(Stream&& o) noexcept {
    std::swap(stream_, o.stream_);
    return *this;
  }
  ~Stream() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

class Event {
 public:
  Event() = default;
  // Events order work and are not timed unless `timed`.
  static Result<Event> create(bool timed = false) {
    Event e;
    BULKHEAD_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&e.event_, timed ? cudaEventDefault : cudaEventDisableTiming));
    return Result<Event>(std::move(e));
  }
  Event(Event&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
  Event& operator=(Event&& o) noexcept {
    std::swap(event_, o.event_);
    return *this;
  }
  ~Event() {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// Host memory (another owner's mapping) registered with the device, so kernels write it directly.
class HostRegistration {
 public:
  HostRegistration() = default;
  static Result<HostRegistration> create(void* base, size_t bytes) {
    HostRegistration r;
    BULKHEAD_CUDA_RETURN_IF_ERROR(cudaHostRegister(base, bytes, cudaHostRegisterMapped));
    r.base_ = base;
    void* device = nullptr;
    BULKHEAD_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&device, base, 0));
    r.device_ = device;
    r.bytes_ = bytes;
    return Result<HostRegistration>(std::move(r));
  }
  HostRegistration(HostRegistration&& o) noexcept
      : base_(std::exchange(o.base_, nullptr)),
        device_(std::exchange(o.device_, nullptr)),
        bytes_(std::exchange(o.bytes_, 0)) {}
  HostRegistration& operator=(HostRegistration&& o) noexcept {
    std::swap(base_, o.base_);
    std::swap(device_, o.device_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~HostRegistration() {
    if (base_ != nullptr) cudaHostUnregister(base_);
  }
  // The device address of host address `p`, or null when p is not inside the registration.
  void* deviceAddress(const void* p) const {
    const auto* b = static_cast<const std::byte*>(base_);
    const auto* q = static_cast<const std::byte*>(p);
    if (base_ == nullptr || q < b || q >= b + bytes_) return nullptr;
    return static_cast<std::byte*>(device_) + (q - b);
  }

 private:
  void* base_ = nullptr;
  void* device_ = nullptr;
  size_t bytes_ = 0;
};

// An instantiated CUDA graph.
class GraphExec {
 public:
  GraphExec() = default;
  // Instantiates `graph` and destroys it.
  static Result<GraphExec> instantiate(cudaGraph_t graph) {
    GraphExec e;
    const cudaError_t err = cudaGraphInstantiate(&e.exec_, graph, 0);
    cudaGraphDestroy(graph);
    BULKHEAD_CUDA_RETURN_IF_ERROR(err);
    return Result<GraphExec>(std::move(e));
  }
  GraphExec(GraphExec&& o) noexcept : exec_(std::exchange(o.exec_, nullptr)) {}
  GraphExec& operator=(GraphExec&& o) noexcept {
    std::swap(exec_, o.exec_);
    return *this;
  }
  ~GraphExec() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
  }
  cudaGraphExec_t get() const { return exec_; }

 private:
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace bulkhead::cuda

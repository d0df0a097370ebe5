// Every kernel a process runs, with its start and end on the device: an LD_PRELOAD library that
// turns on CUPTI's kernel activity records (kernels launched from CUDA graphs and
// programmatically included, so overlaps between neighbours show) and writes them as CSV when the
// process exits. ncu times kernels one at a time, so it cannot show what a kernel does to its
// neighbours; this can. tools/gpu/timeline.py summarises the file.
//
// Build (one line): g++ -std=c++17 -O2 -shared -fPIC -I/usr/local/cuda/include
//   -o libkernel_timeline.so tools/gpu/kernel_timeline.cpp -L/usr/local/cuda/lib -lcupti
// Run:   BULKHEAD_TIMELINE=out.csv LD_PRELOAD=./libkernel_timeline.so bulkhead bench-engine ...
#include <cupti.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace {

constexpr size_t kBufferBytes = size_t(8) << 20;

std::mutex out_mutex;
FILE* out = nullptr;

void check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* text = nullptr;
  cuptiGetResultString(r, &text);
  std::fprintf(stderr, "kernel_timeline: %s failed: %s\n", what, text != nullptr ? text : "?");
}

void CUPTIAPI bufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI bufferCompleted(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::lock_guard<std::mutex> lock(out_mutex);
  CUpti_Activity* record = nullptr;
  while (out != nullptr && cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
    std::fprintf(out, "%llu,%llu,%u,%u,%u,%llu,%d,%d,%d,%d,%d,%d,%u,%u,%s\n",
                 static_cast<unsigned long long>(k->start), static_cast<unsigned long long>(k->end),
                 k->streamId, k->correlationId, k->graphId,
                 static_cast<unsigned long long>(k->graphNodeId), k->gridX, k->gridY, k->gridZ,
                 k->blockX, k->dynamicSharedMemory, k->staticSharedMemory,
                 unsigned(k->registersPerThread), k->sharedMemoryExecuted,
                 k->name != nullptr ? k->name : "?");
  }
  size_t dropped = 0;
  if (cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped) == CUPTI_SUCCESS && dropped > 0)
    std::fprintf(stderr, "kernel_timeline: %zu records dropped\n", dropped);
  std::free(buffer);
}

// At exit (registered when the library loads): CUPTI's last buffers, then the file closed.
void stop() {
  if (out == nullptr) return;
  check(cuptiActivityFlushAll(1), "cuptiActivityFlushAll");
  std::lock_guard<std::mutex> lock(out_mutex);
  std::fclose(out);
  out = nullptr;
}

__attribute__((constructor)) void start() {
  const char* path = std::getenv("BULKHEAD_TIMELINE");
  if (path == nullptr) return;
  out = std::fopen(path, "w");
  if (out == nullptr) {
    std::fprintf(stderr, "kernel_timeline: cannot write %s\n", path);
    return;
  }
  std::fprintf(out,
               "start_ns,end_ns,stream,correlation,graph,graph_node,grid_x,grid_y,grid_z,block_x,"
               "dynamic_shared,static_shared,registers,shared_executed,name\n");
  check(cuptiActivityRegisterCallbacks(bufferRequested, bufferCompleted),
        "cuptiActivityRegisterCallbacks");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable");
  std::atexit(stop);
}

}  // namespace

// What a persistent decoder could gain over one kernel a phase, before the backend is reshaped
// for it: a one-row decode step of a Qwen2.5 shape (0.5B or 7B) as synthetic work of the real
// sizes (each product reads its weight's bytes, in tiles of 16 rows by a k split, multiplies them
// by its input on the CUDA cores and stores one partial sum a row and split; attention reads a
// 128-position cache a head and reduces; norms and the activation read and write their vectors),
// run two ways and timed:
//   kernels     one kernel a phase, 128 threads a task, each block's weights requested before its
//               wait for the kernel before (programmatic launch), the step one CUDA graph: the
//               backend's design today
//   persistent  one cooperative launch a step, four groups of 128 threads a multiprocessor each
//               running its tasks of every phase in turn, a phase's inputs awaited by a counter
//               (acquire loads) that its producers' groups add to (release, with and without a
//               fence before it), a task's first weights requested before that wait and its
//               next task's asked of the L2 cache
// Each with every phase's work, with the products' only, and with none (the dependencies alone);
// and the step again with the norms folded into the products after them and the activation into
// the down product (each task recomputes them from its input: `fused`). The outputs are not
// checked against anything: this measures time only. Builds alone with nvcc:
//   nvcc -std=c++17 -gencode arch=compute_90,code=sm_90 -O3 -o persistent_probe persistent_probe.cu
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "probe.cuh"

namespace {

constexpr int kGroupThreads = 128;
constexpr int kGroups = 4;       // groups of kGroupThreads a persistent block
constexpr int kRound = 16;       // 16-byte weight words a thread loads a round
constexpr int kPositions = 128;  // cached positions attention reads a head
constexpr int kMaxStage = 4864;  // floats of input a group stages (the largest k a split)

enum Kind : int { kProduct, kNorm, kAttention, kSilu };

struct Phase {
  int kind = kProduct;
  const uint4* w = nullptr;  // product: n x k bf16; attention: per head K then V, bf16
  int n = 0, k = 0, splits = 1;
  int tasks = 0;
  const float* in = nullptr;  // in_splits x in_len floats, summed
  int in_len = 0, in_splits = 1;
  float* out = nullptr;  // product: splits x n; others: out_len
  int out_len = 0;
  bool norm_in = false;  // product: normalise the input first (fused)
  bool silu_in = false;  // product: input is silu(gate) * up of a 2k-long gate/up output
  int heads = 0, head_dim = 0, kv_heads = 0;
  unsigned* counter = nullptr;  // this phase's, in persistent runs
  bool skip = false;            // no work: only the phase's dependencies (timing them alone)
};

__device__ inline void groupSync(int group) {
  asm volatile("bar.sync %0, %1;" ::"r"(group + 1), "r"(kGroupThreads) : "memory");
}
__device__ inline unsigned loadAcquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ inline void addRelease(unsigned* p) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p) : "memory");
}
__device__ inline float bf16Lo(uint32_t v) {
  return __uint_as_float(v << 16);
}
__device__ inline float bf16Hi(uint32_t v) {
  return __uint_as_float(v & 0xffff0000u);
}
__device__ inline float dot8(uint4 w, const float* x) {
  return bf16Lo(w.x) * x[0] + bf16Hi(w.x) * x[1] + bf16Lo(w.y) * x[2] + bf16Hi(w.y) * x[3] +
         bf16Lo(w.z) * x[4] + bf16Hi(w.z) * x[5] + bf16Lo(w.w) * x[6] + bf16Hi(w.w) * x[7];
}

// The input element i: the sum of its splits.
__device__ inline float inputAt(const Phase& p, int i) {
  float v = 0;
  for (int s = 0; s < p.in_splits; ++s) v += __ldcg(p.in + s * p.in_len + i);
  return v;
}

// Sum over the group of v, every thread getting it (scratch: kGroupThreads / 32 floats).
__device__ float groupSum(float v, float* scratch, int group) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int t = threadIdx.x % kGroupThreads;
  if (t % 32 == 0) scratch[t / 32] = v;
  groupSync(group);
  float s = 0;
  for (int w = 0; w < kGroupThreads / 32; ++w) s += scratch[w];
  groupSync(group);
  return s;
}
__device__ float groupMax(float v, float* scratch, int group) {
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int t = threadIdx.x % kGroupThreads;
  if (t % 32 == 0) scratch[t / 32] = v;
  groupSync(group);
  float s = scratch[0];
  for (int w = 1; w < kGroupThreads / 32; ++w) s = fmaxf(s, scratch[w]);
  groupSync(group);
  return s;
}

struct Smem {
  float stage[kMaxStage];
  float scratch[8];
};

// Product tasks: thread t takes row t / 8 of the tile and its words t % 8, t % 8 + 8, ... (eight
// threads read 128 consecutive bytes), kRound words a round.
__device__ inline const uint4* productRow(const Phase& p, int task, int t) {
  const int kk = p.k / p.splits, tile = task / p.splits, s = task % p.splits;
  return p.w + (size_t(tile * 16 + t / 8) * p.k + s * kk) / 8;
}

// Requests the words of round `round` of the task (product or attention).
__device__ void loadRound(const Phase& p, int task, int round, uint4 (&w)[kRound]) {
  const int t = threadIdx.x % kGroupThreads;
  if (p.skip) return;
  if (p.kind == kProduct) {
    const int per_row = p.k / p.splits / 8;
    const uint4* row = productRow(p, task, t);
#pragma unroll
    for (int i = 0; i < kRound; ++i) {
      const int c = t % 8 + 8 * (round * kRound + i);
      if (c < per_row) w[i] = __ldg(row + c);
    }
  } else if (p.kind == kAttention) {
    // Head `task`'s keys and values: kPositions x head_dim each (written by earlier steps).
    const int words = 2 * kPositions * p.head_dim / 8;
    const uint4* base = p.w + size_t(task) * words;
#pragma unroll
    for (int i = 0; i < kRound; ++i) {
      const int c = t + i * kGroupThreads;
      if (c < words) w[i] = __ldg(base + c);
    }
  }
}

// Asks the L2 cache for the task's first round (no registers held).
__device__ void prefetchTask(const Phase& p, int task) {
  if (p.kind != kProduct || p.skip) return;
  const int t = threadIdx.x % kGroupThreads, per_row = p.k / p.splits / 8;
  const uint4* row = productRow(p, task, t);
  for (int i = 0; i < kRound; ++i) {
    const int c = t % 8 + 8 * i;
    if (c < per_row) asm volatile("prefetch.global.L2 [%0];" ::"l"(row + c));
  }
}

// The rest of the task, its inputs ready.
__device__ void runTask(const Phase& p, int task, uint4 (&w)[kRound], Smem& sm, int group) {
  const int t = threadIdx.x % kGroupThreads;
  if (p.skip) return;
  if (p.kind == kProduct) {
    const int kk = p.k / p.splits, tile = task / p.splits, s = task % p.splits;
    const int per_row = kk / 8, rounds = (per_row + 8 * kRound - 1) / (8 * kRound);
    float inv = 1.0f;
    if (p.norm_in) {
      float sq = 0;
      for (int i = t; i < p.in_len; i += kGroupThreads) {
        const float v = inputAt(p, i);
        sq += v * v;
      }
      inv = rsqrtf(groupSum(sq, sm.scratch, group) / p.in_len + 1e-6f);
    }
    for (int i = t; i < kk; i += kGroupThreads) {
      float v;
      if (p.silu_in) {
        const float g = inputAt(p, s * kk + i), u = inputAt(p, p.k + s * kk + i);
        v = g / (1.0f + __expf(-g)) * u;
      } else {
        v = inputAt(p, s * kk + i) * inv;
      }
      sm.stage[i] = v;
    }
    groupSync(group);
    float acc = 0;
    for (int round = 0; round < rounds; ++round) {
      if (round > 0) loadRound(p, task, round, w);
#pragma unroll
      for (int i = 0; i < kRound; ++i) {
        const int c = t % 8 + 8 * (round * kRound + i);
        if (c < per_row) acc += dot8(w[i], sm.stage + c * 8);
      }
    }
    for (int o = 4; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (t % 8 == 0) p.out[s * p.n + tile * 16 + t / 8] = acc;
  } else if (p.kind == kNorm) {
    float sq = 0;
    for (int i = t; i < p.in_len; i += kGroupThreads) {
      const float v = inputAt(p, i);
      sq += v * v;
    }
    const float inv = rsqrtf(groupSum(sq, sm.scratch, group) / p.in_len + 1e-6f);
    for (int i = t; i < p.out_len; i += kGroupThreads) p.out[i] = inputAt(p, i) * inv;
  } else if (p.kind == kSilu) {
    const int half = p.out_len;
    for (int i = task * 1024 + t; i < min(half, (task + 1) * 1024); i += kGroupThreads) {
      const float g = inputAt(p, i), u = inputAt(p, half + i);
      p.out[i] = g / (1.0f + __expf(-g)) * u;
    }
  } else {  // attention: head `task`, query at in[task * head_dim]
    const int d = p.head_dim;
    for (int i = t; i < d; i += kGroupThreads) sm.stage[i] = inputAt(p, task * d + i);
    groupSync(group);
    // Thread t: position t's score from the keys in its words (d / 8 words a position).
    const int per_pos = d / 8;
    float score = 0;
#pragma unroll
    for (int i = 0; i < kRound; ++i) {
      const int c = t + i * kGroupThreads;
      if (c < kPositions * per_pos) score += dot8(w[i], sm.stage + (c % per_pos) * 8);
    }
    score *= rsqrtf(float(d));
    const float m = groupMax(score, sm.scratch, group);
    const float e = __expf(score - m);
    const float total = groupSum(e, sm.scratch, group);
    for (int i = t; i < d; i += kGroupThreads) sm.stage[d + i] = 0;
    groupSync(group);
    const float* v0 = reinterpret_cast<const float*>(p.w);  // values: a stand-in read
    atomicAdd(&sm.stage[d + t % d], e / total * __ldg(v0 + t));
    groupSync(group);
    for (int i = t; i < d; i += kGroupThreads) p.out[task * d + i] = sm.stage[d + i];
  }
}

__device__ inline void waitGridBefore() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ inline void letNextLaunch() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// One phase, one block a task.
__global__ void __launch_bounds__(kGroupThreads) phaseKernel(Phase p) {
  __shared__ Smem sm;
  letNextLaunch();
  uint4 w[kRound];
  loadRound(p, blockIdx.x, 0, w);
  waitGridBefore();
  runTask(p, blockIdx.x, w, sm, 0);
}

// Every phase of a step; group g = block * kGroups + j takes the tasks b + blocks * (j + kGroups
// * i) of each phase (a phase's tasks spread over the multiprocessors first).
__global__ void __launch_bounds__(kGroupThreads* kGroups, 1)
    persistentKernel(const Phase* phases, int count, unsigned step, bool fenced) {
  extern __shared__ unsigned char raw[];
  const int j = threadIdx.x / kGroupThreads, t = threadIdx.x % kGroupThreads;
  Smem& sm = reinterpret_cast<Smem*>(raw)[j];
  const int blocks = gridDim.x;
  for (int ph = 0; ph < count; ++ph) {
    const Phase p = phases[ph];
    int task = blockIdx.x + blocks * j;
    if (task >= p.tasks) continue;
    uint4 w[kRound];
    loadRound(p, task, 0, w);
    if (ph > 0) {
      if (t == 0) {
        const unsigned target = (step + 1) * unsigned(phases[ph - 1].tasks);
        while (loadAcquire(phases[ph - 1].counter) < target) {
        }
      }
      groupSync(j);
    }
    for (;;) {
      if (task + blocks * kGroups < p.tasks) prefetchTask(p, task + blocks * kGroups);
      runTask(p, task, w, sm, j);
      groupSync(j);
      if (t == 0) {
        if (fenced) __threadfence();
        addRelease(p.counter);
      }
      task += blocks * kGroups;
      if (task >= p.tasks) break;
      loadRound(p, task, 0, w);
    }
  }
}

struct Shape {
  const char* name;
  int layers, hidden, inter, heads, kv_heads, head_dim, vocab;
};
constexpr Shape kShapes[] = {{"qwen2.5-0.5b", 24, 896, 4864, 14, 2, 64, 151936},
                             {"qwen2.5-7b", 28, 3584, 18944, 28, 4, 128, 152064}};

int splitsFor(int n, int k, int groups) {
  int s = 1;
  while (s < 8 && (n / 16) * s < groups && (k / (2 * s)) % 8 == 0 && k / (2 * s) >= 256) s *= 2;
  while (k / s > kMaxStage) s *= 2;
  return s;
}

struct Step {
  std::vector<Phase> phases;
  size_t weight_bytes = 0;
  std::vector<void*> allocations;
};

void* deviceAlloc(Step& step, size_t bytes) {
  void* p = nullptr;
  CHECK(cudaMalloc(&p, bytes));
  CHECK(cudaMemset(p, 0x3c, bytes));
  step.allocations.push_back(p);
  return p;
}

// The phases of one step at one row.
Step buildStep(const Shape& s, bool fused, int groups) {
  Step step;
  const float* prev = nullptr;
  int prev_len = s.hidden, prev_splits = 1;
  float* x0 = static_cast<float*>(deviceAlloc(step, s.hidden * sizeof(float)));
  CHECK(cudaMemset(x0, 0, s.hidden * sizeof(float)));
  prev = x0;
  auto product = [&](int n, int k, bool norm_in, bool silu_in) {
    Phase p;
    p.kind = kProduct;
    p.n = n, p.k = k, p.splits = splitsFor(n, k, groups);
    p.tasks = n / 16 * p.splits;
    p.w = static_cast<const uint4*>(deviceAlloc(step, size_t(n) * k * 2));
    step.weight_bytes += size_t(n) * k * 2;
    p.in = prev, p.in_len = prev_len, p.in_splits = prev_splits;
    p.norm_in = norm_in, p.silu_in = silu_in;
    p.out = static_cast<float*>(deviceAlloc(step, size_t(p.splits) * n * sizeof(float)));
    p.out_len = n;
    step.phases.push_back(p);
    prev = p.out, prev_len = n, prev_splits = p.splits;
  };
  auto simple = [&](int kind, int out_len, int tasks) {
    Phase p;
    p.kind = kind;
    p.tasks = tasks;
    p.in = prev, p.in_len = prev_len, p.in_splits = prev_splits;
    p.out = static_cast<float*>(deviceAlloc(step, size_t(out_len) * sizeof(float)));
    p.out_len = out_len;
    step.phases.push_back(p);
    prev = p.out, prev_len = out_len, prev_splits = 1;
  };
  const int q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
  for (int l = 0; l < s.layers; ++l) {
    if (!fused) simple(kNorm, s.hidden, 1);
    product(q + 2 * kv, s.hidden, fused, false);
    Phase a;
    a.kind = kAttention;
    a.tasks = s.heads, a.heads = s.heads, a.head_dim = s.head_dim, a.kv_heads = s.kv_heads;
    const size_t cache = size_t(s.heads) * 2 * kPositions * s.head_dim * 2;
    a.w = static_cast<const uint4*>(deviceAlloc(step, cache));
    step.weight_bytes += size_t(s.kv_heads) * 2 * kPositions * s.head_dim * 2;
    a.in = prev, a.in_len = prev_len, a.in_splits = prev_splits;
    a.out = static_cast<float*>(deviceAlloc(step, size_t(q) * sizeof(float)));
    a.out_len = q;
    step.phases.push_back(a);
    prev = a.out, prev_len = q, prev_splits = 1;
    product(s.hidden, q, false, false);
    if (!fused) simple(kNorm, s.hidden, 1);
    product(2 * s.inter, s.hidden, fused, false);
    if (!fused) simple(kSilu, s.inter, (s.inter + 1023) / 1024);
    product(s.hidden, s.inter, false, fused);
  }
  simple(kNorm, s.hidden, 1);
  product(s.vocab, s.hidden, false, false);
  for (Phase& p : step.phases) {
    p.counter = static_cast<unsigned*>(deviceAlloc(step, sizeof(unsigned)));
    CHECK(cudaMemset(p.counter, 0, sizeof(unsigned)));
  }
  return step;
}

__global__ void copyKernel(const uint4* in, uint4* out, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    out[i] = in[i];
}

double copyBandwidth() {  // GB/s read + written
  const size_t bytes = size_t(2) << 30;
  uint4 *a, *b;
  CHECK(cudaMalloc(&a, bytes));
  CHECK(cudaMalloc(&b, bytes));
  CHECK(cudaMemset(a, 1, bytes));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  copyKernel<<<132 * 8, 512>>>(a, b, bytes / 16);
  CHECK(cudaEventRecord(e0));
  for (int i = 0; i < 10; ++i) copyKernel<<<132 * 8, 512>>>(a, b, bytes / 16);
  CHECK(cudaEventRecord(e1));
  CHECK(cudaEventSynchronize(e1));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  CHECK(cudaFree(a));
  CHECK(cudaFree(b));
  return 2.0 * bytes * 10 / (ms * 1e-3) / 1e9;
}

// Median ms a step over `steps` runs of `run`, which launches on `stream`.
template <typename F>
double timeSteps(int steps, cudaStream_t stream, F&& run) {
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < 5; ++i) run(i);
  CHECK(cudaDeviceSynchronize());
  std::vector<float> ms(steps);
  for (int i = 0; i < steps; ++i) {
    CHECK(cudaEventRecord(e0, stream));
    run(5 + i);
    CHECK(cudaEventRecord(e1, stream));
    CHECK(cudaEventSynchronize(e1));
    CHECK(cudaEventElapsedTime(&ms[i], e0, e1));
  }
  std::sort(ms.begin(), ms.end());
  return ms[steps / 2];
}

double runKernels(const Step& step, int steps) {
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (const Phase& p : step.phases) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(p.tasks);
    config.blockDim = dim3(kGroupThreads);
    config.stream = stream;
    cudaLaunchAttribute attribute = {};
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
    CHECK(cudaLaunchKernelEx(&config, phaseKernel, p));
  }
  CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const double ms = timeSteps(steps, stream, [&](int) { CHECK(cudaGraphLaunch(exec, stream)); });
  CHECK(cudaStreamSynchronize(stream));
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaStreamDestroy(stream));
  return ms;
}

double runPersistent(const Step& step, int steps, int blocks, bool fenced) {
  Phase* phases;
  CHECK(cudaMalloc(&phases, step.phases.size() * sizeof(Phase)));
  CHECK(cudaMemcpy(phases, step.phases.data(), step.phases.size() * sizeof(Phase),
                   cudaMemcpyHostToDevice));
  const size_t smem = kGroups * sizeof(Smem);
  CHECK(cudaFuncSetAttribute(persistentKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(smem)));
  int count = int(step.phases.size());
  // Counters only grow: step i waits for (i + 1) x tasks. Reset them for this run.
  for (const Phase& p : step.phases) CHECK(cudaMemset(p.counter, 0, sizeof(unsigned)));
  const double ms = timeSteps(steps, nullptr, [&](int i) {
    unsigned s = unsigned(i);
    void* args[] = {&phases, &count, &s, &fenced};
    CHECK(cudaLaunchCooperativeKernel(persistentKernel, dim3(blocks), dim3(kGroupThreads * kGroups),
                                      args, smem, nullptr));
  });
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaFree(phases));
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  int steps = argc > 1 ? std::atoi(argv[1]) : 50;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  int per_sm = 0;
  const size_t smem = kGroups * sizeof(Smem);
  CHECK(cudaFuncSetAttribute(persistentKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(smem)));
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, persistentKernel,
                                                      kGroupThreads * kGroups, smem));
  const int blocks = prop.multiProcessorCount;
  std::printf("%s, %d multiprocessors, %d persistent block(s) fit on each\n", prop.name, blocks,
              per_sm);
  if (per_sm < 1) return 1;
  const double copy = copyBandwidth();
  std::printf("copy kernel %.0f GB/s (read + written)\n\n", copy);
  std::printf(
      "Work: all (every phase), products (the others' tasks empty), none (every task "
      "empty: the phases' dependencies alone).\n\n");
  std::printf(
      "| shape | phases | work | MB read | kernels ms | persistent ms | without the fence "
      "before the release, ms | persistent / kernels | MB read at the copy kernel's rate, "
      "ms |\n|---|---|---|---|---|---|---|---|---|\n");
  for (const Shape& s : kShapes) {
    for (bool fused : {false, true}) {
      Step step = buildStep(s, fused, blocks * kGroups);
      for (const char* work : {"all", "products", "none"}) {
        for (Phase& p : step.phases)
          p.skip = std::strcmp(work, "none") == 0 ||
                   (std::strcmp(work, "products") == 0 && p.kind != kProduct);
        const double k = runKernels(step, steps);
        const double p = runPersistent(step, steps, blocks, true);
        const double u = runPersistent(step, steps, blocks, false);
        std::printf("| %s%s | %zu | %s | %.0f | %.3f | %.3f | %.3f | %.3f | %.3f |\n", s.name,
                    fused ? " fused" : "", step.phases.size(), work, step.weight_bytes / 1e6, k, p,
                    u, p / k, step.weight_bytes / (copy / 2 * 1e9) * 1e3);
        std::fflush(stdout);
      }
      for (void* a : step.allocations) CHECK(cudaFree(a));
    }
  }
  return 0;
}

// createBackend: the one place that knows which backends this build has.
#include "worker/backend_factory.h"

#include "worker/cpu_backend.h"
#ifdef BULKHEAD_HAVE_CUDA
#include "cuda/gemm.cuh"
#include "worker/cuda_backend.h"
#include "worker/weight_residency.h"
#endif

namespace bulkhead {

Result<std::unique_ptr<Backend>> createBackend(const std::string& name,
                                               std::shared_ptr<const Checkpoint> checkpoint,
                                               const BackendOptions& options) {
  if (name == "cpu" || name == "auto") {
    CpuBackend::Options cpu;
    cpu.kv_blocks = options.kv_blocks;
    if (options.max_step_tokens > 0) cpu.max_step_tokens = options.max_step_tokens;
    cpu.threads = options.cpu_threads;
    cpu.check_weight_reads = options.check_weight_reads;
    cpu.attention_scale_factor = options.attention_scale_factor;
    BULKHEAD_ASSIGN_OR_RETURN(auto backend, CpuBackend::create(std::move(checkpoint), cpu));
    return std::unique_ptr<Backend>(std::move(backend));
  }
  if (name == "cuda") {
#ifdef BULKHEAD_HAVE_CUDA
    CudaBackend::Options cuda;
    cuda.kv_blocks = options.kv_blocks;
    if (options.max_step_tokens > 0) cuda.max_step_tokens = options.max_step_tokens;
    cuda.check_weight_reads = options.check_weight_reads;
    cuda.attention_scale_factor = options.attention_scale_factor;
    cuda.cuda_graphs = options.cuda_graphs;
    cuda.programmatic_launch = options.cuda_programmatic_launch;
    cuda.cublas_products = options.cuda_cublas_products;
    cuda.device = options.cuda_device;
    cuda.kernel_times = options.cuda_kernel_times;
    cuda.residual_in_products = options.cuda_residual_in_products;
    cuda.norm_in_products = options.cuda_norm_in_products;
    cuda.silu_in_products = options.cuda_silu_in_products;
    cuda.rope_in_attention = options.cuda_rope_in_attention;
    cuda.attention_paired_rows = options.cuda_attention_paired_rows;
    cuda.attention_tiles = options.cuda_attention_tiles;
    cuda.attention_mma = options.cuda_attention_mma;
    cuda.logits_in_product = options.cuda_logits_in_product;
    if (!options.cuda_weight_budget.empty()) {
      BULKHEAD_ASSIGN_OR_RETURN(cuda.weight_budget, parseByteSize(options.cuda_weight_budget));
    }
    cuda.streamed_units = options.cuda_streamed_units;
    BULKHEAD_ASSIGN_OR_RETURN(cuda.stream_larger_than,
                              parseByteSize(options.cuda_stream_larger_than));
    cuda.staging_slots = options.cuda_staging_slots;
    if (!options.cuda_gemm_shape_schedules.empty()) {
      BULKHEAD_ASSIGN_OR_RETURN(cuda.gemm_shape_schedules,
                                cuda::parseGemmShapeSchedules(options.cuda_gemm_shape_schedules));
    }
    if (!options.cuda_gemm_splits.empty()) {
      BULKHEAD_ASSIGN_OR_RETURN(cuda.gemm_splits, cuda::parseGemmSplits(options.cuda_gemm_splits));
    }
    if (!options.cuda_gemm_schedules.empty()) {
      BULKHEAD_ASSIGN_OR_RETURN(cuda.gemm_schedules,
                                cuda::parseGemmSchedules(options.cuda_gemm_schedules));
    }
    BULKHEAD_ASSIGN_OR_RETURN(auto backend, CudaBackend::create(std::move(checkpoint), cuda));
    return std::unique_ptr<Backend>(std::move(backend));
#else
    return unimplemented("the CUDA backend is not available in this build");
#endif
  }
  return invalidArgument("unknown backend \"" + name + "\" (known: cpu, cuda, auto)");
}

}  // namespace bulkhead

// Picks and builds a Backend by name: "cpu", "cuda" (when built with CUDA) or "auto".
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shared/checkpoint.h"
#include "worker/backend.h"

namespace bulkhead {

struct BackendOptions {
  uint32_t kv_blocks = 0;        // 0: the backend's default for its memory budget
  uint32_t max_step_tokens = 0;  // 0: the backend's default
  unsigned cpu_threads = 0;  // the CPU backend's kernel threads (0: CpuBackend::defaultThreads())
  // Check every step's weight reads (off only to measure what the checks cost).
  bool check_weight_reads = true;
  float attention_scale_factor = 1.0f;   // fault injection (CpuBackend::Options)
  bool cuda_graphs = true;               // the CUDA backend runs decode steps as graphs
  bool cuda_programmatic_launch = true;  // CudaBackend::Options::programmatic_launch
  bool cuda_cublas_products = false;     // CudaBackend::Options::cublas_products
  int cuda_device = 0;                   // the CUDA device ordinal the worker uses
  // The CUDA product's schedule per bucket of rows (cuda::parseGemmSchedules); empty: the default.
  std::string cuda_gemm_schedules;
  // Split counts for some product shapes (cuda::parseGemmSplits); empty: cuda::gemmSplits'.
  std::string cuda_gemm_splits;
  // Schedules for some product shapes at 33-95 rows (cuda::parseGemmShapeSchedules).
  std::string cuda_gemm_shape_schedules;
  bool cuda_kernel_times = false;              // CudaBackend::Options::kernel_times
  bool cuda_residual_in_products = false;      // CudaBackend::Options::residual_in_products
  bool cuda_norm_in_products = false;          // CudaBackend::Options::norm_in_products
  bool cuda_silu_in_products = false;          // CudaBackend::Options::silu_in_products
  std::optional<bool> cuda_rope_in_attention;  // CudaBackend::Options::rope_in_attention
  bool cuda_attention_tiles = true;            // CudaBackend::Options::attention_tiles
  uint32_t cuda_attention_paired_rows = 0;     // CudaBackend::Options::attention_paired_rows
  bool cuda_attention_mma = false;             // CudaBackend::Options::attention_mma
  bool cuda_logits_in_product = true;          // CudaBackend::Options::logits_in_product
  // CudaBackend::Options::weight_budget, as parseByteSize reads it ("0": no limit).
  std::string cuda_weight_budget = "0";
  std::vector<std::string> cuda_streamed_units;  // CudaBackend::Options::streamed_units
  std::string cuda_stream_larger_than = "0";     // CudaBackend::Options::stream_larger_than
  uint32_t cuda_staging_slots = 2;               // CudaBackend::Options::staging_slots
};

Result<std::unique_ptr<Backend>> createBackend(const std::string& name,
                                               std::shared_ptr<const Checkpoint> checkpoint,
                                               const BackendOptions& options);

}  // namespace bulkhead

// bench-engine: the backend alone, in process (no worker, no gRPC). For each batch size: the
// prefill of every sequence's prompt (in as few steps as the step's tokens allow), then timed
// decode steps of one token each, with the weight bandwidth they reach as a share of the device's
// read bandwidth measured in the same run. On CUDA it runs the same steps again without the in-step
// checks, and through cuBLAS products, so the price of the checks and of invariance are each one
// column.
#pragma once

#include <string>
#include <vector>

#include "shared/status.h"

namespace bulkhead {

struct EngineBenchOptions {
  std::string model_dir;
  std::string backend = "cuda";
  std::vector<uint32_t> batches = {1, 8, 32, 64};
  bool graphs = true;
  bool programmatic_launch = false;  // CudaBackend::Options::programmatic_launch
  std::string gemm_schedules;        // BackendOptions::cuda_gemm_schedules (empty: the default)
  std::string gemm_splits;           // BackendOptions::cuda_gemm_splits (empty: the default)
  std::string gemm_shape_schedules;  // BackendOptions::cuda_gemm_shape_schedules
  uint32_t prompt = 128;             // tokens prefilled per sequence
  uint32_t max_step_tokens = 0;      // BackendOptions::max_step_tokens (0: the backend's)
  uint32_t steps = 64;               // timed decode steps per batch size (after 8 untimed)
  bool compare = true;               // CUDA: also without checks, and through cuBLAS
  // Then the same decode steps with each launch timed (Backend::takeLaunchTimes), checked and,
  // with compare, unchecked: a table per batch size of where a step's device time goes, and one
  // of where the prefill's went (checked).
  bool kernel_times = false;
  bool residual_in_products = false;       // CudaBackend::Options::residual_in_products (ours only)
  bool norm_in_products = false;           // CudaBackend::Options::norm_in_products (ours only)
  bool silu_in_products = false;           // CudaBackend::Options::silu_in_products (ours only)
  std::string rope_in_attention = "auto";  // CudaBackend::Options::rope_in_attention: on, off
  std::string attention_tiles = "on";      // CudaBackend::Options::attention_tiles: on, off
  uint32_t attention_paired_rows = 0;      // CudaBackend::Options::attention_paired_rows
  std::string attention_mma = "off";       // CudaBackend::Options::attention_mma: on, off
  std::string logits_in_product = "on";    // CudaBackend::Options::logits_in_product: on, off
  std::string cublas_products = "off";     // CudaBackend::Options::cublas_products: on, off
  // BackendOptions::cuda_weight_budget: device memory for the weights; the products' weights
  // beyond it are streamed from host memory every step ("": no limit).
  std::string weight_budget;
  std::string json_path;
};

// Prints the table to stdout; writes JSON when asked.
Status runEngineBench(const EngineBenchOptions& options);

}  // namespace bulkhead

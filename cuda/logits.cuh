// Logits rows out of the device: lm_head's fp32 output copied to each row's destination (a slot
// of the host-registered logits arena, so the row reaches the broker with no host copy), unless
// the product stored them there itself, and for each value the row's checksum (shared/checksum.h
// checkRow: the order-independent sum of each word's term keyed by its index) and finite flag, and
// lm_head's produced sum for its arithmetic check.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/step_checks.cuh"
#include "shared/status.h"

namespace bulkhead::cuda {

struct LogitsArgs {
  const float* logits = nullptr;  // rows x vocab fp32
  int rows = 0, vocab = 0;
  float* const* dst = nullptr;             // rows device-visible destinations (vocab floats each)
  bool aligned = false;                    // every destination is 16-byte aligned (vector stores)
  unsigned long long* row_sums = nullptr;  // rows, zeroed before
  unsigned int* row_nonfinite = nullptr;   // rows, zeroed before
  int role = -1;                           // lm_head's product role
  int check_row = 0;                       // the first row's index in the product checks
  CheckView checks;
  // The product already stored the rows to dst (GemmResidual::rows_to): only their checksums,
  // finite flags and produced sums, from `logits` (the same values).
  bool rows_written = false;
};

// Device memory (dst may be mapped host memory), asynchronous on `stream`.
Status launchLogits(const LogitsArgs& args, cudaStream_t stream);

}  // namespace bulkhead::cuda

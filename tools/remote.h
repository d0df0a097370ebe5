// The `bulkhead` subcommands that talk to a running broker: generate (streams tokens to stdout),
// bench (a load generator) and admin (the operator's calls).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "shared/status.h"

namespace bulkhead {

// How a client reaches a secured broker: TLS (the server's CA; a client certificate for mutual
// TLS) and a bearer token from a file. All empty: plain text, no token.
struct ClientSecurity {
  std::string tls_ca, tls_cert, tls_key, token_file;
};

struct RemoteGenerateCommand {
  std::string server;
  ClientSecurity security = {};
  std::vector<uint32_t> tokens;
  uint32_t max_tokens = 16;
  float temperature = 0, top_p = 0, min_p = 0, repetition_penalty = 0;
  float presence_penalty = 0, frequency_penalty = 0;
  uint32_t top_k = 0, top_logprobs = 0;
  std::optional<uint64_t> seed;
  std::vector<uint32_t> stop_token_ids;
  bool ignore_eos = false;
  double timeout_s = 0;    // 0: none
  std::string request_id;  // echoed in the broker's logs and the last message
};

// Prints tokens to stdout as they arrive (comma-separated) and a summary line to stderr.
Status runRemoteGenerate(const RemoteGenerateCommand& command);

struct BenchCommand {
  std::string server;
  ClientSecurity security = {};
  float temperature = 0;  // 0: greedy
  float top_p = 1;
  uint32_t concurrency = 1;
  uint32_t prompt_len = 32;
  uint32_t gen_len = 64;
  uint32_t requests = 0;  // 0: 4 x concurrency
  // Sent first and not measured (a fresh worker's first steps of each size capture their CUDA
  // graphs and load their kernels).
  uint32_t warmup_requests = 0;
  uint64_t seed = 1;
  std::string json_path = {};
};

struct BenchResult {
  uint64_t tokens = 0;
  uint32_t requests = 0, failed = 0;
  double tokens_per_s = 0, wall_s = 0;
  double ttft_ms_p50 = 0, ttft_ms_p99 = 0, itl_ms_p50 = 0, itl_ms_p99 = 0;
  std::string first_error;
};

// Runs the load and measures it; prints nothing.
BenchResult measureBench(const BenchCommand& command);
// Prints throughput, time to first token and inter-token latency (p50/p99).
Status runBench(const BenchCommand& command);

struct AdminCommand {
  std::string server;  // host:port, or unix:PATH for a broker's --admin-socket
  ClientSecurity security = {};
  // workers (a table), stats (JSON), drain (the whole broker, or --worker), restart (--worker;
  // none: the only worker)
  std::string action;
  std::string worker;
};

// Prints what the call returned; the broker's error otherwise.
Status runAdmin(const AdminCommand& command);

}  // namespace bulkhead

// generate and bench over gRPC.
#include "tools/remote.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <random>
#include <thread>

#include <google/protobuf/util/json_util.h>
#include <nlohmann/json.hpp>

#include "bulkhead/v1/generator.grpc.pb.h"
#include "shared/secret_file.h"
#include "tools/percentile.h"

namespace bulkhead {
namespace {

using Clock = std::chrono::steady_clock;

Status fromGrpc(const grpc::Status& s) {
  return Status(static_cast<Code>(s.error_code()), s.error_message());
}

// A channel to the broker, over TLS when the security options ask for it, and the metadata every
// call carries (the bearer token).
struct Connection {
  std::shared_ptr<grpc::Channel> channel;
  std::string authorization;  // empty: none
  void prepare(grpc::ClientContext& context) const {
    if (!authorization.empty()) context.AddMetadata("authorization", authorization);
  }
};

Result<Connection> connectTo(const std::string& server, const ClientSecurity& security) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(16 << 20);
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (!security.tls_ca.empty() || !security.tls_cert.empty()) {
    grpc::SslCredentialsOptions tls;
    if (!security.tls_ca.empty()) {
      BULKHEAD_ASSIGN_OR_RETURN(tls.pem_root_certs, readOptionFile(security.tls_ca, "--tls-ca"));
    }
    if (!security.tls_cert.empty()) {
      BULKHEAD_ASSIGN_OR_RETURN(tls.pem_cert_chain,
                                readOptionFile(security.tls_cert, "--tls-cert"));
      BULKHEAD_ASSIGN_OR_RETURN(tls.pem_private_key, readOptionFile(security.tls_key, "--tls-key"));
    }
    credentials = grpc::SslCredentials(tls);
  }
  Connection c{grpc::CreateCustomChannel(server, credentials, args), ""};
  if (!security.token_file.empty()) {
    BULKHEAD_ASSIGN_OR_RETURN(std::string token,
                              readSecretFile(security.token_file, "--token-file"));
    c.authorization = "Bearer " + token;
  }
  return c;
}

const char* finishName(v1::FinishReason r) {
  switch (r) {
    case v1::FINISH_REASON_LENGTH:
      return "length";
    case v1::FINISH_REASON_STOP:
      return "stop";
    case v1::FINISH_REASON_CONTEXT:
      return "context";
    default:
      return "unspecified";
  }
}

}  // namespace

Status runRemoteGenerate(const RemoteGenerateCommand& c) {
  BULKHEAD_ASSIGN_OR_RETURN(const Connection connection, connectTo(c.server, c.security));
  auto stub = v1::Generator::NewStub(connection.channel);
  v1::GenerateRequest request;
  for (uint32_t t : c.tokens) request.add_prompt_token_ids(t);
  request.set_max_tokens(c.max_tokens);
  auto* s = request.mutable_sampling();
  s->set_temperature(c.temperature);
  s->set_top_k(c.top_k);
  s->set_top_p(c.top_p);
  s->set_min_p(c.min_p);
  s->set_repetition_penalty(c.repetition_penalty);
  s->set_presence_penalty(c.presence_penalty);
  s->set_frequency_penalty(c.frequency_penalty);
  if (c.seed) s->set_seed(*c.seed);
  for (uint32_t t : c.stop_token_ids) request.add_stop_token_ids(t);
  request.set_ignore_eos(c.ignore_eos);
  request.set_top_logprobs(c.top_logprobs);
  request.set_request_id(c.request_id);

  grpc::ClientContext context;
  connection.prepare(context);
  if (c.timeout_s > 0) {
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(int64_t(c.timeout_s * 1000)));
  }
  const auto start = Clock::now();
  auto reader = stub->Generate(&context, request);
  v1::GenerateResponse response;
  bool first = true;
  v1::GenerateResponse last;
  double ttft_ms = 0;
  while (reader->Read(&response)) {
    for (uint32_t t : response.token_ids()) {
      if (first) ttft_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
      std::printf(first ? "%u" : ",%u", t);
      first = false;
    }
    std::fflush(stdout);
    if (response.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) last = response;
  }
  std::printf("\n");
  std::fflush(stdout);
  grpc::Status status = reader->Finish();
  if (!status.ok()) return fromGrpc(status);
  const double total_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  std::fprintf(stderr,
               "finish %s; %u prompt + %u generated tokens, seed %llu; first token %.1f ms, "
               "total %.1f ms\n",
               finishName(last.finish_reason()), last.usage().prompt_tokens(),
               last.usage().completion_tokens(),
               static_cast<unsigned long long>(last.usage().seed()), ttft_ms, total_ms);
  return okStatus();
}

BenchResult measureBench(const BenchCommand& c) {
  BenchResult result;
  if (c.warmup_requests > 0) {
    BenchCommand warmup = c;
    warmup.requests = c.warmup_requests;
    warmup.warmup_requests = 0;
    warmup.seed = c.seed + 0x9e3779b9u;  // other prompts than the measured ones
    const BenchResult w = measureBench(warmup);
    if (w.failed > 0 || w.tokens == 0) {
      result.failed = std::max<uint32_t>(w.failed, 1);
      result.first_error = "warm-up: " + w.first_error;
      return result;
    }
  }
  auto connection = connectTo(c.server, c.security);
  if (!connection.ok()) {
    result.first_error = connection.status().message();
    return result;
  }
  const auto& channel = connection->channel;
  result.requests = c.requests != 0 ? c.requests : 4 * c.concurrency;
  std::atomic<uint32_t> next{0};
  std::mutex mu;
  std::vector<double> ttft, itl;
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  for (uint32_t w = 0; w < c.concurrency; ++w) {
    threads.emplace_back([&, w] {
      auto stub = v1::Generator::NewStub(channel);
      std::mt19937 rng(uint32_t(c.seed * 7919 + w));
      while (true) {
        const uint32_t i = next++;
        if (i >= result.requests) break;
        v1::GenerateRequest request;
        // Token ids in 3..258 are valid for every model bulkhead serves, the tiny ones included.
        for (uint32_t k = 0; k < c.prompt_len; ++k) request.add_prompt_token_ids(3 + rng() % 256);
        request.set_max_tokens(c.gen_len);
        request.set_ignore_eos(true);
        if (c.temperature > 0) {
          request.mutable_sampling()->set_temperature(c.temperature);
          request.mutable_sampling()->set_top_p(c.top_p);
          request.mutable_sampling()->set_seed(c.seed + i);
        }
        grpc::ClientContext context;
        connection->prepare(context);
        const auto sent = Clock::now();
        auto reader = stub->Generate(&context, request);
        v1::GenerateResponse response;
        std::vector<double> arrivals;
        while (reader->Read(&response)) {
          const double at = std::chrono::duration<double, std::milli>(Clock::now() - sent).count();
          for (int k = 0; k < response.token_ids_size(); ++k) arrivals.push_back(at);
        }
        grpc::Status status = reader->Finish();
        std::lock_guard lock(mu);
        if (!status.ok()) {
          if (result.failed++ == 0) result.first_error = status.error_message();
          continue;
        }
        result.tokens += arrivals.size();
        if (!arrivals.empty()) ttft.push_back(arrivals[0]);
        for (size_t k = 1; k < arrivals.size(); ++k) itl.push_back(arrivals[k] - arrivals[k - 1]);
      }
    });
  }
  for (auto& t : threads) t.join();
  result.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  result.tokens_per_s = double(result.tokens) / result.wall_s;
  result.ttft_ms_p50 = percentile(ttft, 50);
  result.ttft_ms_p99 = percentile(ttft, 99);
  result.itl_ms_p50 = percentile(itl, 50);
  result.itl_ms_p99 = percentile(itl, 99);
  return result;
}

Status runBench(const BenchCommand& c) {
  if (c.concurrency == 0 || c.prompt_len == 0 || c.gen_len == 0)
    return invalidArgument("--concurrency, --prompt-len and --gen-len must be positive");
  const BenchResult r = measureBench(c);
  if (r.requests == 0 && !r.first_error.empty()) return invalidArgument(r.first_error);
  std::printf("bench: %s, concurrency %u, prompt %u, gen %u, %u requests (%u failed)\n",
              c.server.c_str(), c.concurrency, c.prompt_len, c.gen_len, r.requests, r.failed);
  std::printf("%12s %10s %10s %10s %10s %10s\n", "tokens/s", "ttft_p50", "ttft_p99", "itl_p50",
              "itl_p99", "wall_s");
  std::printf("%12.1f %10.2f %10.2f %10.3f %10.3f %10.2f   (latencies in ms)\n", r.tokens_per_s,
              r.ttft_ms_p50, r.ttft_ms_p99, r.itl_ms_p50, r.itl_ms_p99, r.wall_s);
  if (!c.json_path.empty()) {
    nlohmann::json j = {{"server", c.server},
                        {"concurrency", c.concurrency},
                        {"prompt_len", c.prompt_len},
                        {"gen_len", c.gen_len},
                        {"temperature", c.temperature},
                        {"top_p", c.top_p},
                        {"requests", r.requests},
                        {"failed", r.failed},
                        {"warmup_requests", c.warmup_requests},
                        {"tokens", r.tokens},
                        {"tokens_per_s", r.tokens_per_s},
                        {"ttft_ms_p50", r.ttft_ms_p50},
                        {"ttft_ms_p99", r.ttft_ms_p99},
                        {"itl_ms_p50", r.itl_ms_p50},
                        {"itl_ms_p99", r.itl_ms_p99},
                        {"wall_s", r.wall_s}};
    std::ofstream out(c.json_path);
    out << j.dump(2) << "\n";
  }
  if (r.failed > 0)
    return unavailable(std::to_string(r.failed) + " requests failed: " + r.first_error);
  return okStatus();
}

Status runAdmin(const AdminCommand& command) {
  BULKHEAD_ASSIGN_OR_RETURN(const Connection c, connectTo(command.server, command.security));
  auto admin = v1::Admin::NewStub(c.channel);
  grpc::ClientContext context;
  c.prepare(context);
  if (command.action == "workers") {
    v1::ListWorkersResponse r;
    if (grpc::Status s = admin->ListWorkers(&context, {}, &r); !s.ok()) return fromGrpc(s);
    std::printf("%-10s %-9s %18s %8s %-8s %13s %15s %8s %8s %12s %10s %9s %6s  %s\n", "worker",
                "state", "incarnation", "pid", "backend", "kv_free/total", "weights_MiB/str",
                "running", "waiting", "tokens", "steps", "restarts", "moved", "last_failure");
    for (const v1::WorkerInfo& w : r.workers()) {
      const std::string kv =
          std::to_string(w.kv_blocks_free()) + "/" + std::to_string(w.kv_blocks_total());
      // Resident MiB, then the MiB streamed from host memory every step.
      const std::string weights = std::to_string(w.resident_weight_bytes() >> 20) + "/" +
                                  std::to_string(w.streamed_weight_bytes() >> 20);
      std::printf(
          "%-10s %-9s %18llx %8d %-8s %13s %15s %8u %8u %12llu %10llu %9u %6llu  %s\n",
          w.name().c_str(), w.state().c_str(), static_cast<unsigned long long>(w.incarnation()),
          w.pid(), w.backend().c_str(), kv.c_str(), weights.c_str(), w.requests_running(),
          w.requests_waiting(), static_cast<unsigned long long>(w.tokens_generated()),
          static_cast<unsigned long long>(w.steps()), w.restarts(),
          static_cast<unsigned long long>(w.migrated_sequences()), w.last_failure().c_str());
    }
    return okStatus();
  }
  if (command.action == "stats") {
    v1::Stats r;
    if (grpc::Status s = admin->GetStats(&context, {}, &r); !s.ok()) return fromGrpc(s);
    std::string json;
    google::protobuf::util::JsonPrintOptions options;
    options.add_whitespace = true;
    options.always_print_primitive_fields = true;
    options.preserve_proto_field_names = true;
    if (!google::protobuf::util::MessageToJsonString(r, &json, options).ok())
      return internalError("cannot print the stats as JSON");
    std::printf("%s", json.c_str());
    return okStatus();
  }
  if (command.action == "drain") {
    v1::DrainRequest request;
    request.set_worker(command.worker);
    v1::DrainResponse r;
    if (grpc::Status s = admin->Drain(&context, request, &r); !s.ok()) return fromGrpc(s);
    if (command.worker.empty()) {
      std::printf("drained: %u requests finished; the broker no longer serves\n", r.drained());
    } else {
      std::printf(
          "%s drained: %u sequences moved to the other workers; it stays stopped until "
          "`bulkhead admin restart --worker %s`\n",
          command.worker.c_str(), r.moved(), command.worker.c_str());
    }
    return okStatus();
  }
  if (command.action == "restart") {
    v1::RestartWorkerRequest request;
    request.set_name(command.worker);
    v1::RestartWorkerResponse r;
    if (grpc::Status s = admin->RestartWorker(&context, request, &r); !s.ok()) return fromGrpc(s);
    std::printf("%s restarted: incarnation %llx -> %llx\n",
                command.worker.empty() ? "the worker" : command.worker.c_str(),
                static_cast<unsigned long long>(r.old_incarnation()),
                static_cast<unsigned long long>(r.new_incarnation()));
    return okStatus();
  }
  return invalidArgument("unknown admin action \"" + command.action +
                         "\" (workers, stats, drain, restart)");
}

}  // namespace bulkhead

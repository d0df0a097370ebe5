// renderMetrics and the HTTP server around it.
#include "broker/metrics.h"

#include <httplib.h>

#include <cstdio>
#include <thread>

namespace bulkhead {
namespace {

// A label value with the characters the format escapes escaped.
std::string escaped(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// Values with every digit; bucket bounds as written (0.0005, not 0.00050000000000000001).
std::string number(double v, int digits = 17) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*g", digits, v);
  return buf;
}

class Writer {
 public:
  void family(const std::string& name, const char* type, const char* help) {
    out_ += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  }
  void sample(const std::string& name, double v, const std::string& labels = "") {
    out_ += name + (labels.empty() ? "" : "{" + labels + "}") + " " + number(v) + "\n";
  }
  void counter(const std::string& name, const char* help, double v) {
    family(name, "counter", help);
    sample(name, v);
  }
  void gauge(const std::string& name, const char* help, double v) {
    family(name, "gauge", help);
    sample(name, v);
  }
  // A labelled counter family.
  void counters(const std::string& name, const char* help, const char* label,
                const std::map<std::string, uint64_t>& values) {
    family(name, "counter", help);
    for (const auto& [key, v] : values)
      sample(name, double(v), std::string(label) + "=\"" + escaped(key) + "\"");
  }
  // scale turns the histogram's unit into the exposed one (ms -> s: 1e-3).
  void histogram(const std::string& name, const char* help, const Histogram& h, double scale) {
    family(name, "histogram", help);
    uint64_t cumulative = 0;
    for (size_t i = 0; i < h.bounds().size(); ++i) {
      cumulative += h.counts()[i];
      sample(name + "_bucket", double(cumulative),
             "le=\"" + number(h.bounds()[i] * scale, 12) + "\"");
    }
    sample(name + "_bucket", double(h.count()), "le=\"+Inf\"");
    sample(name + "_sum", h.sum() * scale);
    sample(name + "_count", double(h.count()));
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

}  // namespace

std::string renderMetrics(const SchedulerStats& s, const std::vector<WorkerView>& workers,
                          const StatsHistograms& h) {
  Writer m;
  m.family("bulkhead_requests_total", "counter", "Generate requests by outcome.");
  m.sample("bulkhead_requests_total", double(s.requests_completed), "outcome=\"completed\"");
  m.sample("bulkhead_requests_total", double(s.requests_failed), "outcome=\"failed\"");
  m.sample("bulkhead_requests_total", double(s.requests_rejected), "outcome=\"rejected\"");
  m.counter("bulkhead_requests_received_total", "Generate requests accepted for scheduling.",
            double(s.requests_received));
  m.counter("bulkhead_prompt_tokens_total", "Prompt tokens of accepted requests.",
            double(s.prompt_tokens));
  m.counter("bulkhead_generated_tokens_total", "Tokens generated and sampled.",
            double(s.tokens_generated));
  m.gauge("bulkhead_requests_running", "Requests being computed.", double(s.requests_running));
  m.gauge("bulkhead_requests_waiting", "Requests queued for admission.",
          double(s.requests_waiting));
  m.counter("bulkhead_steps_total", "Worker steps run.", double(s.steps));
  m.counter("bulkhead_steps_overlapped_total",
            "Steps sent while another awaited its reply (sampling hidden behind compute).",
            double(s.steps_overlapped));
  m.counter("bulkhead_steps_discarded_total",
            "Steps whose rows were not used: in flight when an earlier step failed its integrity "
            "checks.",
            double(s.steps_discarded));
  m.counter("bulkhead_preemptions_total", "Sequences preempted to free KV blocks.",
            double(s.preemptions));
  m.counter("bulkhead_replayed_sequences_total",
            "Sequences re-prefilled after their KV cache or unsent tokens were lost.",
            double(s.replayed_sequences));
  m.counter("bulkhead_rolled_back_tokens_total",
            "KV positions and unsent tokens discarded and recomputed.",
            double(s.rolled_back_tokens));
  m.counters("bulkhead_worker_restarts_total", "Worker replacements by cause.", "cause",
             s.restarts_by_cause);
  m.counters("bulkhead_integrity_failures_total", "Steps that failed an integrity check, by check.",
             "check", s.integrity_failures_by_check);
  m.counter("bulkhead_weight_corruptions_total", "Corrupted weight granules the scrubber found.",
            double(s.weight_corruptions));
  m.counter("bulkhead_canary_runs_total", "Canary runs.", double(s.canary_runs));
  m.counter("bulkhead_canary_failures_total", "Canary runs that failed.",
            double(s.canary_failures));
  m.counter("bulkhead_migrated_sequences_total",
            "Sequences moved from a lost, starting or drained worker to the others.",
            double(s.migrated_sequences));
  // One sample per worker, labelled with its name.
  auto perWorker = [&](const std::string& name, const char* help, auto value) {
    m.family(name, "gauge", help);
    for (const WorkerView& v : workers)
      m.sample(name, double(value(v)), "worker=\"" + escaped(v.name) + "\"");
  };
  perWorker("bulkhead_worker_ready", "1 while the worker serves.",
            [](const WorkerView& v) { return v.status.state == "ready" ? 1 : 0; });
  perWorker("bulkhead_worker_incarnation", "The worker's incarnation id (low 52 bits).",
            [](const WorkerView& v) { return v.status.incarnation & ((uint64_t(1) << 52) - 1); });
  perWorker("bulkhead_kv_blocks", "KV cache blocks sequences can use.",
            [](const WorkerView& v) { return v.status.kv_blocks_total; });
  perWorker("bulkhead_kv_blocks_free", "KV cache blocks free.",
            [](const WorkerView& v) { return v.status.kv_blocks_free; });
  perWorker("bulkhead_weight_resident_bytes", "Weight bytes resident in the worker's memory.",
            [](const WorkerView& v) { return v.status.weight_bytes; });
  perWorker("bulkhead_weight_streamed_bytes",
            "Weight bytes the worker keeps in host memory and copies to its device every step.",
            [](const WorkerView& v) { return v.status.streamed_weight_bytes; });
  perWorker("bulkhead_last_step_id", "The newest step the worker completed.",
            [](const WorkerView& v) { return v.status.last_step; });
  perWorker("bulkhead_scrub_clean_through_step_id",
            "The newest step after which the worker's scrubber verified every resident weight.",
            [](const WorkerView& v) { return v.status.scrub_clean_through; });
  perWorker("bulkhead_worker_requests_running", "Requests the worker computes.",
            [](const WorkerView& v) { return v.stats.requests_running; });
  m.histogram("bulkhead_step_duration_seconds", "A worker step's round trip.", h.step_ms, 1e-3);
  m.histogram("bulkhead_time_to_first_token_seconds",
              "From a request's arrival to the release of its first token.", h.first_token_ms,
              1e-3);
  m.histogram("bulkhead_inter_token_seconds",
              "Between the releases of a sequence's consecutive tokens.", h.inter_token_ms, 1e-3);
  m.histogram("bulkhead_release_delay_seconds",
              "From the end of a token's step to its release to the client.", h.release_ms, 1e-3);
  m.histogram("bulkhead_step_batch_size", "Sequences in a worker step.", h.batch_size, 1.0);
  m.histogram("bulkhead_migration_seconds",
              "From the loss of a sequence's worker to its first token on another.", h.migration_ms,
              1e-3);
  return m.take();
}

struct MetricsServer::Impl {
  httplib::Server server;
  std::thread thread;
};

Result<std::unique_ptr<MetricsServer>> MetricsServer::start(const std::string& listen,
                                                            const Router& router) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos)
    return invalidArgument("--metrics-listen " + listen + ": expected HOST:PORT");
  const std::string host = listen.substr(0, colon);
  int port = 0;
  try {
    port = std::stoi(listen.substr(colon + 1));
  } catch (const std::exception&) {
    return invalidArgument("--metrics-listen " + listen + ": the port is not a number");
  }
  std::unique_ptr<MetricsServer> m(new MetricsServer());
  m->impl_ = std::make_unique<Impl>();
  m->impl_->server.Get("/metrics", [&router](const httplib::Request&, httplib::Response& res) {
    res.set_content(renderMetrics(router.stats(), router.workers(), router.histograms()),
                    "text/plain; version=0.0.4");
  });
  const int bound = port == 0 ? m->impl_->server.bind_to_any_port(host)
                              : (m->impl_->server.bind_to_port(host, port) ? port : -1);
  if (bound <= 0) return unavailable("--metrics-listen " + listen + ": cannot listen there");
  m->address_ = host + ":" + std::to_string(bound);
  Impl* impl = m->impl_.get();
  m->impl_->thread = std::thread([impl] { impl->server.listen_after_bind(); });
  return m;
}

MetricsServer::~MetricsServer() {
  if (impl_ == nullptr) return;
  impl_->server.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

}  // namespace bulkhead

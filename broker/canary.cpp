// CanaryStore: JSON records under the state directory, written atomically. Reading a record never
// throws: it runs on the scheduler thread, and a damaged state directory must not end the broker.
#include "broker/canary.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <string_view>

#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include "shared/checksum.h"

namespace bulkhead {
namespace {

// A record is four short fields; anything much larger is not one of ours.
constexpr std::uintmax_t kMaxRecordBytes = 64 << 10;

std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// 1 to 16 hex digits and nothing else (no sign, prefix or space): what hex() writes, give or take
// leading zeros.
std::optional<uint64_t> parseHex64(std::string_view text) noexcept {
  if (text.empty() || text.size() > 16) return std::nullopt;
  uint64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value, 16);
  if (ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

// A field's value as it goes into an error message: quoted and cut short.
std::string shown(const nlohmann::json& value) {
  std::string s = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (s.size() > 40) s = s.substr(0, 40) + "...";
  return s;
}

// The hex field `name` of `record`, or what is wrong with it in `why`.
std::optional<uint64_t> hexField(const nlohmann::json& record, const char* name,
                                 std::string& why) noexcept {
  const auto it = record.find(name);
  if (it == record.end()) {
    why = std::string(name) + ": missing";
    return std::nullopt;
  }
  if (!it->is_string()) {
    why = std::string(name) + ": " + shown(*it) + " is a " + it->type_name() + ", not a string";
    return std::nullopt;
  }
  auto value = parseHex64(it->get_ref<const std::string&>());
  if (!value) why = std::string(name) + ": " + shown(*it) + " is not 1 to 16 hex digits";
  return value;
}

// The record's text, or what is wrong with the file in `why`. nullopt with an empty `why`: there
// is no record.
std::optional<std::string> readRecordFile(const std::filesystem::path& path,
                                          std::string& why) noexcept {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (status.type() == std::filesystem::file_type::not_found) return std::nullopt;
  if (ec) {
    why = "cannot inspect it: " + ec.message();
    return std::nullopt;
  }
  if (status.type() != std::filesystem::file_type::regular) {
    why = status.type() == std::filesystem::file_type::directory ? "is a directory, not a file"
                                                                 : "is not a regular file";
    return std::nullopt;
  }
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec) {
    why = "cannot read its size: " + ec.message();
    return std::nullopt;
  }
  if (size > kMaxRecordBytes) {
    why = std::to_string(size) + " bytes, more than a record's " + std::to_string(kMaxRecordBytes);
    return std::nullopt;
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    why = std::string("cannot be opened: ") + std::strerror(errno);
    return std::nullopt;
  }
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) {
    why = "read failed";
    return std::nullopt;
  }
  return text;
}

// Renames a corrupt record out of the way, never over anything: "<name>.corrupt-<unix seconds>",
// with a counter when that is taken. Returns the new path, or nullopt if it stayed where it was.
std::optional<std::filesystem::path> moveAside(const std::filesystem::path& path) noexcept {
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count();
  const std::string base = path.string() + ".corrupt-" + std::to_string(seconds);
  for (int n = 0; n < 100; ++n) {
    const std::filesystem::path target = n == 0 ? base : base + "-" + std::to_string(n);
    std::error_code ec;
    if (std::filesystem::symlink_status(target, ec).type() != std::filesystem::file_type::not_found)
      continue;
    std::filesystem::rename(path, target, ec);
    if (!ec) return target;
    spdlog::error("cannot move corrupt canary record {} aside to {}: {}", path.string(),
                  target.string(), ec.message());
    return std::nullopt;
  }
  spdlog::error("cannot move corrupt canary record {} aside: {}.* are all taken", path.string(),
                base);
  return std::nullopt;
}

// A record's fields from its text, or what is wrong with it in `why`.
std::optional<CanaryRecord> parseRecord(const std::string& text, std::string& why) noexcept {
  const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    why = "not valid JSON (" + std::to_string(text.size()) + " bytes)";
    return std::nullopt;
  }
  if (!j.is_object()) {
    why = std::string("a JSON ") + j.type_name() + ", not an object";
    return std::nullopt;
  }
  const auto model = hexField(j, "model_identity", why);
  const auto weights = model ? hexField(j, "weight_digest", why) : std::nullopt;
  const auto logits = weights ? hexField(j, "logits_digest", why) : std::nullopt;
  if (!logits) return std::nullopt;  // `why` says which field
  const auto b = j.find("backend");
  if (b == j.end() || !b->is_string()) {
    why = b == j.end() ? "backend: missing" : "backend: " + shown(*b) + " is not a string";
    return std::nullopt;
  }
  return CanaryRecord{*model, b->get_ref<const std::string&>(), *weights, *logits};
}

}  // namespace

std::vector<uint32_t> canaryTokens(uint32_t vocab_size) {
  std::vector<uint32_t> tokens(kCanaryPrefix + 1);
  for (uint32_t i = 0; i < tokens.size(); ++i)
    tokens[i] = uint32_t((uint64_t(i) * 2654435761ull + 12345) % vocab_size);
  return tokens;
}

uint64_t canaryDigest(std::span<const uint64_t> row_checksums) {
  return checksumBytes(std::as_bytes(row_checksums));
}

float canaryTolerance(const std::string& backend) {
  // The CPU engine is the reference: the same code on the same checkpoint must agree bit for bit.
  // Other engines round differently: the CUDA backend rounds every product's input to bf16 and
  // keeps its KV cache in bf16, an error that grows with depth (measured on random-weight
  // checkpoints: within 2% of the largest logit on the 24-layer 0.5B shape, 2.9% on the
  // 28-layer 7B shape). 5% of the largest logit allows that and still refuses an engine that
  // computes wrongly; once qualified, the riding canary holds a worker to its digest exactly.
  return backend == "cpu" ? 0.0f : 0.05f;
}

Status qualifyRows(std::span<const std::span<const float>> worker,
                   std::span<const std::vector<float>> reference, float tolerance) {
  if (worker.size() != reference.size())
    return failedPrecondition("canary: the worker gave " + std::to_string(worker.size()) +
                              " rows, the reference engine " + std::to_string(reference.size()));
  auto argmax = [](std::span<const float> row) {
    size_t best = 0;
    for (size_t i = 1; i < row.size(); ++i)
      if (row[i] > row[best]) best = i;
    return best;
  };
  for (size_t r = 0; r < worker.size(); ++r) {
    const std::span<const float> w = worker[r];
    const std::vector<float>& ref = reference[r];
    const std::string which = "canary row " + std::to_string(r);
    if (w.size() != ref.size())
      return failedPrecondition(which + " has " + std::to_string(w.size()) +
                                " logits, the reference engine's " + std::to_string(ref.size()));
    float scale = 1.0f;
    for (float v : ref) scale = std::max(scale, std::fabs(v));
    const float bound = tolerance * scale;
    size_t worst = 0;
    float worst_error = 0.0f;
    for (size_t i = 0; i < w.size(); ++i) {
      const float e = std::fabs(w[i] - ref[i]);
      if (!(e <= worst_error)) {  // NaN counts as the worst
        worst = i;
        worst_error = std::isnan(e) ? std::numeric_limits<float>::infinity() : e;
      }
    }
    const size_t wa = argmax(w), ra = argmax(ref);
    if (wa != ra || worst_error > bound) {
      char buf[200];
      std::snprintf(buf, sizeof(buf),
                    ": argmax %zu, the reference engine's %zu; largest error %.6g at token %zu "
                    "(%.9g against %.9g), tolerance %.6g",
                    wa, ra, double(worst_error), worst, double(w[worst]), double(ref[worst]),
                    double(bound));
      return failedPrecondition(which + " disagrees with the reference engine" + buf);
    }
  }
  return okStatus();
}

Result<CanaryRecord> readCanaryRecord(const std::filesystem::path& path) {
  std::string why;
  auto text = readRecordFile(path, why);
  if (!text)
    return failedPrecondition("canary record " + path.string() + ": " +
                              (why.empty() ? "no such file" : why));
  auto record = parseRecord(*text, why);
  if (!record) return failedPrecondition("canary record " + path.string() + ": " + why);
  return *record;
}

Status writeCanaryRecord(const std::filesystem::path& path, const CanaryRecord& record) {
  const nlohmann::json j = {{"model_identity", hex(record.model_identity)},
                            {"backend", record.backend},
                            {"weight_digest", hex(record.weight_digest)},
                            {"logits_digest", hex(record.logits_digest)}};
  const std::filesystem::path tmp = path.string() + ".tmp";
  std::error_code ec;
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    out.close();
    if (!out) {
      std::filesystem::remove(tmp, ec);
      return internalError("cannot write " + tmp.string());
    }
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    const std::string why = ec.message();
    std::filesystem::remove(tmp, ec);
    return internalError("cannot rename " + tmp.string() + " to " + path.string() + ": " + why);
  }
  return okStatus();
}

std::filesystem::path CanaryStore::pathFor(uint64_t identity, const std::string& backend) const {
  // The version names the canary's definition (prompt, rows, digest): records made under another
  // definition are not compared against.
  return dir_ / ("canary-v" + std::to_string(kCanaryVersion) + "-" + hex(identity) + "-" + backend +
                 ".json");
}

std::optional<CanaryStore::Record> CanaryStore::load(const std::filesystem::path& path,
                                                     uint64_t identity, const std::string& backend,
                                                     bool& keep_out) noexcept {
  keep_out = false;
  std::string why;
  std::optional<Record> record;
  if (auto text = readRecordFile(path, why)) {
    if (auto r = parseRecord(*text, why)) {
      if (r->model_identity != identity) {
        why = "model_identity: " + hex(r->model_identity) + " is not the " + hex(identity) +
              " it is filed as";
      } else if (r->backend != backend) {
        why = "backend: \"" + r->backend + "\" is not the \"" + backend + "\" it is filed as";
      } else {
        record = Record{r->weight_digest, r->logits_digest};
      }
    }
  }
  if (record || why.empty()) return record;
  // Corrupt. Keep the bytes for whoever investigates, and qualify this worker's canary afresh.
  if (auto aside = moveAside(path)) {
    spdlog::error(
        "canary record {} is corrupt ({}); moved it aside to {} and treating the record as "
        "absent: this worker's canary will be qualified and recorded in its place",
        path.string(), why, aside->string());
  } else {
    keep_out = true;
    spdlog::error(
        "canary record {} is corrupt ({}) and could not be moved aside; treating the record as "
        "absent and keeping a qualified canary in memory only",
        path.string(), why);
  }
  return std::nullopt;
}

void CanaryStore::record(uint64_t identity, const std::string& backend, uint64_t weight_digest,
                         uint64_t logits_digest) noexcept {
  if (pinned_) return;
  std::lock_guard lock(mu_);
  const auto key = std::make_pair(identity, backend);
  memory_[key] = Record{weight_digest, logits_digest};
  spdlog::info("canary qualified and recorded for model {} on {}: {}", hex(identity), backend,
               hex(logits_digest));
  if (dir_.empty() || keep_out_[key]) return;
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  const std::filesystem::path path = pathFor(identity, backend);
  Status written = ec ? internalError("cannot create " + dir_.string() + ": " + ec.message())
                      : writeCanaryRecord(path, {identity, backend, weight_digest, logits_digest});
  if (!written.ok())
    spdlog::error("cannot record canary at {}: {}", path.string(), written.message());
}

Status CanaryStore::check(uint64_t identity, const std::string& backend, uint64_t weight_digest,
                          uint64_t logits_digest) noexcept {
  std::lock_guard lock(mu_);
  const auto key = std::make_pair(identity, backend);
  std::optional<Record> record;
  if (pinned_) {
    if (pinned_->model_identity != identity || pinned_->backend != backend)
      return failedPrecondition("the pinned canary record is for model " +
                                hex(pinned_->model_identity) + " on " + pinned_->backend +
                                "; this worker serves model " + hex(identity) + " on " + backend);
    record = Record{pinned_->weight_digest, pinned_->logits_digest};
  }
  if (auto it = memory_.find(key); !record && it != memory_.end()) record = it->second;
  if (!record && !dir_.empty()) {
    bool keep_out = false;
    record = load(pathFor(identity, backend), identity, backend, keep_out);
    keep_out_[key] = keep_out;
  }
  if (!record) return Status(Code::kNotFound, "no canary record: the canary must be qualified");
  memory_[key] = *record;
  if (record->weight_digest != weight_digest)
    return dataLoss("canary: the weights (digest " + hex(weight_digest) +
                    ") differ from those the canary was recorded with (" +
                    hex(record->weight_digest) + ")");
  if (record->logits_digest != logits_digest)
    return dataLoss("canary mismatch: logits digest " + hex(logits_digest) + ", recorded " +
                    hex(record->logits_digest));
  return okStatus();
}

}  // namespace bulkhead

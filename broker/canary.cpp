// CanaryStore: JSON records under the state directory, written atomically.
#include "broker/canary.h"

#include <cstdio>
#include <fstream>
#include <sstream>

#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include "shared/checksum.h"

namespace bulkhead {
namespace {

std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

std::vector<uint32_t> canaryTokens(uint32_t vocab_size) {
  std::vector<uint32_t> tokens(16);
  for (uint32_t i = 0; i < tokens.size(); ++i)
    tokens[i] = uint32_t((uint64_t(i) * 2654435761ull + 12345) % vocab_size);
  return tokens;
}

uint64_t canaryDigest(std::span<const std::span<const float>> rows) {
  std::vector<uint64_t> sums;
  for (const auto& row : rows) sums.push_back(checksumBytes(std::as_bytes(row)));
  return checksumBytes(std::as_bytes(std::span(sums)));
}

std::filesystem::path CanaryStore::pathFor(uint64_t identity, const std::string& backend) const {
  // The version names the canary's definition (prompt, rows, digest): records made under another
  // definition are not compared against.
  return dir_ / ("canary-v" + std::to_string(kCanaryVersion) + "-" + hex(identity) + "-" + backend +
                 ".json");
}

Status CanaryStore::check(uint64_t identity, const std::string& backend, uint64_t weight_digest,
                          uint64_t logits_digest) {
  const auto key = std::make_pair(identity, backend);
  std::optional<Record> record;
  if (auto it = memory_.find(key); it != memory_.end()) record = it->second;
  if (!record && !dir_.empty()) {
    std::ifstream in(pathFor(identity, backend));
    if (in) {
      std::stringstream text;
      text << in.rdbuf();
      auto j = nlohmann::json::parse(text.str(), nullptr, false);
      if (j.is_object() && j.contains("weight_digest") && j.contains("logits_digest")) {
        record = Record{std::stoull(j["weight_digest"].get<std::string>(), nullptr, 16),
                        std::stoull(j["logits_digest"].get<std::string>(), nullptr, 16)};
      } else {
        spdlog::error("ignoring unreadable canary record {}", pathFor(identity, backend).string());
      }
    }
  }
  if (!record) {
    memory_[key] = {weight_digest, logits_digest};
    if (!dir_.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(dir_, ec);
      const auto path = pathFor(identity, backend);
      const auto tmp = path.string() + ".tmp";
      nlohmann::json j = {{"model_identity", hex(identity)},
                          {"backend", backend},
                          {"weight_digest", hex(weight_digest)},
                          {"logits_digest", hex(logits_digest)}};
      std::ofstream(tmp) << j.dump(2) << "\n";
      std::filesystem::rename(tmp, path, ec);
      if (ec) spdlog::error("cannot record canary at {}: {}", path.string(), ec.message());
    }
    spdlog::info("canary recorded for model {} on {}: {}", hex(identity), backend,
                 hex(logits_digest));
    return okStatus();
  }
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

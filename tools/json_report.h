// The benchmarks' --json output: the report, indented, to `path`; nothing when no path was given.
#pragma once

#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "shared/status.h"

namespace bulkhead {

inline Status writeJsonReport(const std::string& path, const nlohmann::json& report) {
  if (path.empty()) return okStatus();
  std::ofstream out(path);
  out << report.dump(2) << "\n";
  if (!out) return internalError(path + ": write failed");
  return okStatus();
}

}  // namespace bulkhead

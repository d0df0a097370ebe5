// Scrapes a broker's Prometheus endpoint in tests: GET /metrics, parsed to name{labels} -> value.
#pragma once

#include <gtest/gtest.h>
#include <httplib.h>

#include <map>
#include <sstream>
#include <string>

namespace bulkhead::test {

// Prometheus text: name{labels} -> value.
inline std::map<std::string, double> scrapeMetrics(const std::string& address) {
  const size_t colon = address.rfind(':');
  httplib::Client client(address.substr(0, colon), std::stoi(address.substr(colon + 1)));
  client.set_read_timeout(10, 0);
  auto res = client.Get("/metrics");
  std::map<std::string, double> samples;
  if (!res || res->status != 200) {
    ADD_FAILURE() << "GET /metrics failed";
    return samples;
  }
  std::istringstream in(res->body);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    samples[line.substr(0, space)] = std::stod(line.substr(space + 1));
  }
  return samples;
}

}  // namespace bulkhead::test

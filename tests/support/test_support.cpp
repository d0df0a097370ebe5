// Test helpers.
#include "support/test_support.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

namespace bulkhead::test {

namespace {

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) {
    if (c == '\'') {
      q.append("'\\''");
    } else {
      q.push_back(c);
    }
  }
  return q + "'";
}

}  // namespace

CommandResult runBulkhead(const TempDir& dir, const std::vector<std::string>& args) {
  return runBinary(dir, "bulkhead", args);
}

CommandResult runBinary(const TempDir& dir, const std::string& name,
                        const std::vector<std::string>& args) {
  std::string cmd = quote(binDir() + "/" + name);
  for (const auto& a : args) cmd += " " + quote(a);
  cmd += " > " + quote(dir.file("stdout")) + " 2> " + quote(dir.file("stderr"));
  const int status = std::system(cmd.c_str());
  CommandResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = readFile(dir.file("stdout"));
  r.err = readFile(dir.file("stderr"));
  return r;
}

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string templ = std::string(base && *base ? base : "/tmp") + "/bulkhead-test-XXXXXX";
  if (::mkdtemp(templ.data()) == nullptr) {
    ADD_FAILURE() << "mkdtemp failed for " << templ;
  }
  path_ = templ;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

void writeFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  if (!out) ADD_FAILURE() << "cannot write " << path;
}

std::string readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) ADD_FAILURE() << "cannot read " << path;
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

void copyDir(const std::string& from, const std::string& to) {
  std::filesystem::create_directories(to);
  for (const auto& entry : std::filesystem::directory_iterator(from)) {
    std::filesystem::copy_file(entry.path(), to + "/" + entry.path().filename().string(),
                               std::filesystem::copy_options::overwrite_existing);
    std::filesystem::permissions(
        to + "/" + entry.path().filename().string(),
        std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  }
}

std::string binDir() {
  const char* env = std::getenv("BULKHEAD_BIN_DIR");
  return env != nullptr && *env ? env : BULKHEAD_BIN_DIR;
}

std::string fixtureDir(const std::string& name) {
  // The environment can point elsewhere (a bundle run on another machine).
  const char* env = std::getenv("BULKHEAD_FIXTURES_DIR");
  const std::string base = env != nullptr && *env ? env : BULKHEAD_FIXTURES_DIR;
  const std::string dir = base + "/" + name;
  if (!std::filesystem::exists(dir + "/config.json")) {
    ADD_FAILURE() << "fixture " << dir << " not found; configure with "
                  << "-DBULKHEAD_FIXTURES_DIR=<path to shared/fixtures> or set it in the "
                  << "environment";
  }
  return dir;
}

std::vector<uint32_t> GoldenCase::tokens() const {
  std::vector<uint32_t> t = prompt;
  t.insert(t.end(), greedy.begin(), greedy.end());
  return t;
}

Golden loadGolden(const std::string& fixture_dir) {
  Golden g;
  auto j = nlohmann::json::parse(readFile(fixture_dir + "/golden.json"));
  g.vocab = j.at("vocab_size").get<uint32_t>();
  for (const auto& c : j.at("cases")) {
    GoldenCase gc;
    gc.prompt = c.at("prompt").get<std::vector<uint32_t>>();
    gc.greedy = c.at("greedy").get<std::vector<uint32_t>>();
    gc.logits_offset = c.at("logits_offset").get<size_t>();
    gc.positions = c.at("positions").get<size_t>();
    g.cases.push_back(gc);
  }
  const std::string bytes = readFile(fixture_dir + "/" + j.at("logits_file").get<std::string>());
  g.logits.resize(bytes.size() / 4);
  std::memcpy(g.logits.data(), bytes.data(), g.logits.size() * 4);
  return g;
}

}  // namespace bulkhead::test

// Helpers shared by the tests: temporary directories, file I/O, the golden fixtures.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace bulkhead::test {

// A fresh directory under $TMPDIR, removed with everything in it on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

void writeFile(const std::string& path, const std::string& bytes);
std::string readFile(const std::string& path);
// Copies every file of `from` into `to` (flat directories only).
void copyDir(const std::string& from, const std::string& to);

// Where the executables under test are: $BULKHEAD_BIN_DIR, else the build's bin directory.
std::string binDir();

// The `bulkhead` executable run with `args` to its end; its output lands in `dir`.
struct CommandResult {
  int exit_code = -1;
  std::string out, err;
};
CommandResult runBulkhead(const TempDir& dir, const std::vector<std::string>& args);
// Any of the built executables (bulkhead-broker, bulkhead-worker), the same way.
CommandResult runBinary(const TempDir& dir, const std::string& name,
                        const std::vector<std::string>& args);

// ../shared/fixtures/<name>; aborts the test with a clear message when absent.
std::string fixtureDir(const std::string& name);

struct GoldenCase {
  std::vector<uint32_t> prompt;
  std::vector<uint32_t> greedy;
  size_t logits_offset = 0;  // in floats
  size_t positions = 0;
  // prompt followed by greedy: row p of the logits follows tokens[0..p].
  std::vector<uint32_t> tokens() const;
};

struct Golden {
  uint32_t vocab = 0;
  std::vector<GoldenCase> cases;
  std::vector<float> logits;
  const float* row(const GoldenCase& c, size_t position) const {
    return logits.data() + c.logits_offset + position * vocab;
  }
};

Golden loadGolden(const std::string& fixture_dir);

}  // namespace bulkhead::test

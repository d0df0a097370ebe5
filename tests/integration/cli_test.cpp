// The `bulkhead` executable end to end: logits against the golden fixture, make-model followed by
// generate, and a one-line reason with a non-zero exit for bad input.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "support/test_support.h"

namespace bulkhead {
namespace {

using test::CommandResult;
using test::runBulkhead;

size_t lineCount(const std::string& s) {
  return size_t(std::count(s.begin(), s.end(), '\n'));
}

TEST(Cli, LogitsMatchGolden) {
  test::TempDir dir;
  const std::string fixture = test::fixtureDir("tiny-qwen2");
  const test::Golden golden = test::loadGolden(fixture);
  const test::GoldenCase& c = golden.cases[1];
  auto tokens = c.tokens();
  tokens.resize(c.positions);
  std::string list;
  for (uint32_t t : tokens) list += (list.empty() ? "" : ",") + std::to_string(t);

  auto r = runBulkhead(dir, {"logits", "--model", fixture, "--tokens", list, "--out",
                             dir.file("logits.f32"), "--backend", "cpu"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(lineCount(r.out), 1u) << r.out;
  EXPECT_NE(r.out.find("wrote 30 positions x 512 vocab"), std::string::npos) << r.out;
  const std::string bytes = test::readFile(dir.file("logits.f32"));
  ASSERT_EQ(bytes.size(), c.positions * golden.vocab * 4);
  std::vector<float> got(bytes.size() / 4);
  std::memcpy(got.data(), bytes.data(), bytes.size());
  for (size_t p = 0; p < c.positions; ++p) {
    for (uint32_t v = 0; v < golden.vocab; ++v) {
      ASSERT_NEAR(got[p * golden.vocab + v], golden.row(c, p)[v], 1e-4)
          << "position " << p << " token " << v;
    }
  }
}

TEST(Cli, BadInputGivesOneLineReason) {
  test::TempDir dir;
  const std::string fixture = test::fixtureDir("tiny-qwen2");
  const std::string out = dir.file("x.f32");
  struct Case {
    std::vector<std::string> args;
    std::string reason;
  };
  const std::vector<Case> cases = {
      {{"logits", "--model", fixture, "--tokens", "1,x,3", "--out", out}, "\"x\" is not a token"},
      {{"logits", "--model", fixture, "--tokens", "1,512", "--out", out},
       "token id 512 >= vocab size 512"},
      {{"logits", "--model", dir.file("nope"), "--tokens", "1", "--out", out}, "config.json"},
      {{"logits", "--model", fixture, "--tokens", "1", "--out", out, "--backend", "tpu"},
       "unknown backend \"tpu\""},
      {{"logits", "--model", fixture, "--tokens", "1", "--out", dir.file("no/such/dir/x")},
       "cannot open for writing"},
      {{"make-model", "--shape", "huge", "--out", dir.file("m")}, "unknown shape \"huge\""},
  };
  for (const Case& c : cases) {
    auto r = runBulkhead(dir, c.args);
    EXPECT_NE(r.exit_code, 0) << c.reason;
    EXPECT_EQ(lineCount(r.err), 1u) << r.err;
    EXPECT_NE(r.err.find(c.reason), std::string::npos) << r.err;
  }
}

TEST(Cli, MakeModelThenGenerate) {
  test::TempDir dir;
  auto made =
      runBulkhead(dir, {"make-model", "--shape", "tiny", "--out", dir.file("tiny"), "--seed", "5"});
  ASSERT_EQ(made.exit_code, 0) << made.err;
  EXPECT_TRUE(std::filesystem::exists(dir.file("tiny/model.safetensors")));
  auto first = runBulkhead(
      dir, {"generate", "--model", dir.file("tiny"), "--tokens", "1,2,3", "--max-tokens", "8"});
  ASSERT_EQ(first.exit_code, 0) << first.err;
  auto second = runBulkhead(
      dir, {"generate", "--model", dir.file("tiny"), "--tokens", "1,2,3", "--max-tokens", "8"});
  ASSERT_EQ(second.exit_code, 0) << second.err;
  EXPECT_EQ(first.out, second.out);  // greedy is deterministic
  EXPECT_GE(std::count(first.out.begin(), first.out.end(), ','), 0);
  EXPECT_FALSE(first.out.empty());
}

// bench-engine drives the backend in process: a row per batch size, in the table and the JSON,
// with the decode steps it timed turned into tokens per second.
TEST(Cli, BenchEngineReportsEveryBatchSize) {
  test::TempDir dir;
  auto r = runBulkhead(
      dir, {"bench-engine", "--model", test::fixtureDir("tiny-qwen2"), "--backend", "cpu",
            "--batch", "1,3", "--prompt", "8", "--steps", "4", "--json", dir.file("engine.json")});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(lineCount(r.out), 4u) << r.out;  // title, header, two batch sizes
  const auto report = nlohmann::json::parse(test::readFile(dir.file("engine.json")));
  ASSERT_EQ(report["results"].size(), 2u) << report.dump();
  EXPECT_EQ(report["results"][1]["batch"], 3);
  for (const auto& row : report["results"]) {
    EXPECT_GT(row["tokens_per_s"].get<double>(), 0) << row.dump();
    EXPECT_GT(row["prefill_tokens_per_s"].get<double>(), 0) << row.dump();
    EXPECT_NEAR(row["tokens_per_s"].get<double>(),
                row["batch"].get<double>() / (row["step_p50_ms"].get<double>() * 1e-3),
                1e-6 * row["tokens_per_s"].get<double>());
  }
  // Prompts longer than a step holds are prefilled in chunks: 3 x 40 tokens in steps of 32.
  auto chunked =
      runBulkhead(dir, {"bench-engine", "--model", test::fixtureDir("tiny-qwen2"), "--backend",
                        "cpu", "--batch", "3", "--prompt", "40", "--max-step-tokens", "32",
                        "--steps", "2", "--json", dir.file("chunked.json")});
  ASSERT_EQ(chunked.exit_code, 0) << chunked.err;
  const auto chunked_report = nlohmann::json::parse(test::readFile(dir.file("chunked.json")));
  ASSERT_EQ(chunked_report["results"].size(), 1u) << chunked_report.dump();
  EXPECT_GT(chunked_report["results"][0]["prefill_tokens_per_s"].get<double>(), 0);
  auto bad = runBulkhead(dir, {"bench-engine", "--model", test::fixtureDir("tiny-qwen2"),
                               "--backend", "cpu", "--batch", "1", "--prompt", "100000"});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("positions exceed"), std::string::npos) << bad.err;
  auto untimed = runBulkhead(dir, {"bench-engine", "--model", test::fixtureDir("tiny-qwen2"),
                                   "--backend", "cpu", "--kernel-times"});
  EXPECT_NE(untimed.exit_code, 0);
  EXPECT_NE(untimed.err.find("--kernel-times times the CUDA backend"), std::string::npos)
      << untimed.err;
}

// The broker and the worker read every option from a TOML file too; flags win over the file, and
// --print-config writes the effective options back as a file that reads the same.
TEST(Cli, ConfigFilesGiveEveryOptionAndFlagsWin) {
  test::TempDir dir;
  test::writeFile(dir.file("broker.toml"),
                  "model = \"/srv/models/q05\"\nmax-running = 7\nscrub-share = 0.25\n");
  auto r = test::runBinary(
      dir, "bulkhead-broker",
      {"--config", dir.file("broker.toml"), "--max-running", "9", "--print-config"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("model=\"/srv/models/q05\""), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("max-running=9"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("scrub-share=0.25"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("listen=\"127.0.0.1:50051\""), std::string::npos) << "defaults shown";
  EXPECT_EQ(r.out.find("print-config"), std::string::npos) << "--print-config is no option";
  test::writeFile(dir.file("effective.toml"), r.out);
  auto again = test::runBinary(dir, "bulkhead-broker",
                               {"--config", dir.file("effective.toml"), "--print-config"});
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(again.out, r.out);

  // The defaults alone read back too.
  auto defaults = test::runBinary(dir, "bulkhead-broker", {"--model", "m", "--print-config"});
  ASSERT_EQ(defaults.exit_code, 0) << defaults.err;
  test::writeFile(dir.file("defaults.toml"), defaults.out);
  auto defaults_again = test::runBinary(dir, "bulkhead-broker",
                                        {"--config", dir.file("defaults.toml"), "--print-config"});
  ASSERT_EQ(defaults_again.exit_code, 0) << defaults_again.err;
  EXPECT_EQ(defaults_again.out, defaults.out);
  // An empty list prints as "" (read back as no item; CLI11's own "[]" read back as that string),
  // and a list's items read back as given.
  EXPECT_NE(defaults.out.find("worker-arg=\"\"\n"), std::string::npos) << defaults.out;
  test::writeFile(dir.file("list.toml"),
                  "model = \"m\"\nworker-arg = [\"--cpu-threads=2\", \"--spin-us=0\"]\n");
  auto list = test::runBinary(dir, "bulkhead-broker",
                              {"--config", dir.file("list.toml"), "--print-config"});
  ASSERT_EQ(list.exit_code, 0) << list.err;
  EXPECT_NE(list.out.find("worker-arg=[\"--cpu-threads=2\", \"--spin-us=0\"]"), std::string::npos)
      << list.out;

  test::writeFile(dir.file("worker.toml"),
                  "model = \"m\"\nsocket = \"/run/w.sock\"\nbackend = \"cuda\"\n");
  auto w = test::runBinary(dir, "bulkhead-worker",
                           {"--config", dir.file("worker.toml"), "--print-config"});
  ASSERT_EQ(w.exit_code, 0) << w.err;
  EXPECT_NE(w.out.find("backend=\"cuda\""), std::string::npos) << w.out;
  EXPECT_NE(w.out.find("socket=\"/run/w.sock\""), std::string::npos) << w.out;

  test::writeFile(dir.file("bad.toml"), "max-running = \"many\"\n");
  auto bad =
      test::runBinary(dir, "bulkhead-broker", {"--config", dir.file("bad.toml"), "--print-config"});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("max-running"), std::string::npos) << bad.err;

  // A key that is no option (a typo) stops the program and is named, for both.
  for (const char* binary : {"bulkhead-broker", "bulkhead-worker"}) {
    test::writeFile(dir.file("typo.toml"), "model = \"m\"\nscrub-shar = 0.5\n");
    auto typo = test::runBinary(dir, binary, {"--config", dir.file("typo.toml"), "--print-config"});
    EXPECT_NE(typo.exit_code, 0) << binary;
    EXPECT_NE(typo.err.find("\"scrub-shar\" is no option of " + std::string(binary)),
              std::string::npos)
        << binary << ": " << typo.err;
  }
}

// Under systemd (JOURNAL_STREAM names stdout, where the logs go) a log line carries the syslog
// priority journald reads its level from, and no timestamp of its own; anywhere else, a timestamp.
TEST(Cli, LogLinesCarryTheirPriorityForTheJournal) {
  test::TempDir dir;
  const std::vector<std::string> args = {"--model", dir.file("missing")};
  auto plain = test::runBinary(dir, "bulkhead-broker", args);
  EXPECT_NE(plain.exit_code, 0);
  EXPECT_EQ(plain.out.find("<2>[broker] critical: "), std::string::npos) << plain.out;
  EXPECT_NE(plain.out.find("[broker] critical: "), std::string::npos) << plain.out;

  test::writeFile(dir.file("stdout"), "");  // the file runBinary sends stdout to, kept
  struct stat st {};
  ASSERT_EQ(::stat(dir.file("stdout").c_str(), &st), 0);
  const std::string stream = std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
  ::setenv("JOURNAL_STREAM", stream.c_str(), 1);
  auto journal = test::runBinary(dir, "bulkhead-broker", args);
  ::unsetenv("JOURNAL_STREAM");
  EXPECT_NE(journal.exit_code, 0);
  EXPECT_EQ(journal.out.rfind("<2>[broker] critical: ", 0), 0u) << journal.out;
}

}  // namespace
}  // namespace bulkhead

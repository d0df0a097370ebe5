// A real bulkhead-worker process behind WorkerClient: logits bit-identical to the in-process
// engine, batched steps, the golden fixture, and every fault injected for real and reported
// promptly as the right typed error.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <thread>

#include <capnp/message.h>

#include "broker/step_rows.h"
#include "broker/worker_client.h"
#include "proto/worker.capnp.h"
#include "shared/checkpoint.h"
#include "shared/child_process.h"
#include "shared/ipc_frame.h"
#include "shared/logits_arena.h"
#include "support/backend_driver.h"
#include "support/test_support.h"
#include "worker/cpu_backend.h"

namespace bulkhead {
namespace {

using namespace std::chrono_literals;
using Kind = WorkerFailure::Kind;

constexpr auto kStepTimeout = 10s;

class WorkerProcessTest : public ::testing::Test {
 protected:
  // A peer listening on `socket` in place of a worker: it sends one Hello (its protocol version
  // set, the rest by `fill`) and holds the connection until the client lets go; `connect` runs a
  // client against it. Returns why the client refused the peer (ok: it took it, and let go since).
  WorkerFailure meetAPeer(
      const std::string& socket, const std::function<void(wire::Hello::Builder)>& fill,
      const std::function<WorkerResult<std::unique_ptr<WorkerClient>>()>& connect) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, socket.c_str(), sizeof(addr.sun_path) - 1);
    const int listener = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    EXPECT_GE(listener, 0);
    EXPECT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(::listen(listener, 1), 0);
    std::thread peer([&] {
      const int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) return;
      capnp::MallocMessageBuilder message;
      auto hello = message.initRoot<wire::FromWorker>().initHello();
      hello.setProtocolVersion(wire::PROTOCOL_VERSION);
      fill(hello);
      EXPECT_TRUE(writeMessage(fd, message, std::chrono::steady_clock::now() + 10s).ok());
      char byte;
      while (::read(fd, &byte, 1) > 0) {  // until the client lets go
      }
      ::close(fd);
    });
    WorkerFailure why;
    {
      auto client = connect();
      if (!client.ok()) why = client.error();
    }  // a client that was accepted lets go here (an attached one SIGKILLs what it watched), so
       // the peer's read ends
    ::shutdown(listener, SHUT_RDWR);  // and an accept that never got a connection returns
    peer.join();
    ::close(listener);
    return why;
  }

  std::unique_ptr<WorkerClient> spawn(bool fault_injection = true, uint32_t arena_slots = 64,
                                      std::vector<std::string> more_args = {}) {
    WorkerClient::SpawnOptions o;
    o.worker_path = test::binDir() + "/bulkhead-worker";
    o.model_dir = test::fixtureDir("tiny-qwen2");
    o.backend = "cpu";
    o.socket_dir = dir_.file("sock");
    o.incarnation = next_incarnation_++;
    o.kv_blocks = 256;
    o.arena_slots = arena_slots;
    o.enable_fault_injection = fault_injection;
    o.start_timeout = 30s;
    o.extra_args = {"--log-level", "warn"};
    o.extra_args.insert(o.extra_args.end(), more_args.begin(), more_args.end());
    auto client = WorkerClient::spawn(o);
    EXPECT_TRUE(client.ok()) << client.error().toString();
    return client.ok() ? std::move(*client) : nullptr;
  }

  // A step whose rows are then verified on the pool, header and payload, as the broker does.
  WorkerResult<StepReply> verifiedStep(WorkerClient& client, std::span<const SequenceStep> batch,
                                       std::chrono::milliseconds timeout = kStepTimeout) {
    auto reply = client.step(next_step_++, batch, timeout);
    if (!reply.ok()) return reply;
    if (WorkerFailure bad = verifyRows(sampler_, reply->rows); !bad.ok()) return bad;
    return reply;
  }

  // `steps` one-sequence steps through both clients: each gives the same row.
  void expectSameRows(WorkerClient& want_from, WorkerClient& got_from, uint32_t steps) {
    OneStep s;
    for (uint32_t i = 0; i < steps; ++i) {
      s.tokens = {1 + i, 2 + i, 3 + i, 4 + i};
      SequenceStep seq = s.step(i + 1);
      auto want = verifiedStep(want_from, {&seq, 1});
      auto got = verifiedStep(got_from, {&seq, 1});
      ASSERT_TRUE(want.ok() && got.ok());
      ASSERT_EQ(got->rows.size(), 1u);
      EXPECT_TRUE(std::equal(want->rows[0].payload.begin(), want->rows[0].payload.end(),
                             got->rows[0].payload.begin(), got->rows[0].payload.end()))
          << "step " << i;
    }
  }

  std::unique_ptr<CpuBackend> inProcess() {
    auto ckpt = Checkpoint::open(test::fixtureDir("tiny-qwen2"));
    EXPECT_TRUE(ckpt.ok());
    CpuBackend::Options o;
    o.kv_blocks = 256;
    auto b = CpuBackend::create(std::make_shared<const Checkpoint>(std::move(*ckpt)), o);
    EXPECT_TRUE(b.ok());
    return std::move(*b);
  }

  // A one-sequence decode-style step asking for the logits of its last token.
  struct OneStep {
    std::vector<uint32_t> tokens = {1, 2, 3, 4};
    std::vector<uint32_t> blocks = {0};
    std::vector<uint32_t> rows = {3};
    SequenceStep step(uint64_t id = 1) {
      return {.sequence_id = id,
              .start_position = 0,
              .tokens = tokens,
              .kv_blocks = blocks,
              .logits_rows = rows};
    }
  };

  // Arms `fault`, runs a step, and checks the failure kind and how fast it came.
  WorkerFailure faultedStep(WorkerClient& client, const FaultSpec& fault,
                            std::chrono::milliseconds timeout = kStepTimeout) {
    WorkerFailure armed = client.injectFault(fault, 5s);
    EXPECT_TRUE(armed.ok()) << armed.toString();
    OneStep s;
    SequenceStep seq = s.step();
    const auto start = std::chrono::steady_clock::now();
    auto result = verifiedStep(client, {&seq, 1}, timeout);
    last_detection_ = std::chrono::steady_clock::now() - start;
    EXPECT_FALSE(result.ok()) << "the fault went unnoticed";
    return result.ok() ? WorkerFailure{} : result.error();
  }

  test::TempDir dir_;
  uint64_t next_incarnation_ = 0x1000 + uint64_t(::getpid()) * 1000;
  uint64_t next_step_ = 1;
  WorkPool pool_{2};
  RowSampler sampler_{pool_};
  std::chrono::steady_clock::duration last_detection_{};
};

TEST_F(WorkerProcessTest, HelloDescribesTheModel) {
  auto client = spawn();
  ASSERT_TRUE(client);
  const WorkerHello& h = client->hello();
  EXPECT_EQ(h.vocab_size, 512u);
  EXPECT_EQ(h.max_context, 256u);
  EXPECT_EQ(h.kv_block_count, 256u);
  EXPECT_EQ(h.backend, "cpu");
  EXPECT_EQ(h.architecture, "Qwen2ForCausalLM");
  EXPECT_EQ(h.eos_token_ids, std::vector<uint32_t>{2});
  auto ckpt = Checkpoint::open(test::fixtureDir("tiny-qwen2"));
  EXPECT_EQ(h.weight_digest, ckpt->weightDigest());
  EXPECT_TRUE(client->ping(5s).ok());
}

TEST_F(WorkerProcessTest, LogitsBitIdenticalToInProcessEngineAcrossBatchedSteps) {
  auto client = spawn();
  ASSERT_TRUE(client);
  auto local = inProcess();
  test::BackendDriver driver(*local);
  // Three sequences: prefill chunks of different sizes, then decode, all in shared steps.
  std::vector<std::vector<uint32_t>> tokens = {{5, 9, 17, 33, 65, 129, 257, 3, 4},
                                               {100, 200, 300, 400, 500},
                                               {7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7}};
  std::vector<test::TestSequence> remote_seqs, local_seqs;
  for (size_t i = 0; i < tokens.size(); ++i) {
    local_seqs.push_back(driver.newSequence(i + 1, 32));
    remote_seqs.push_back(local_seqs.back());
  }
  size_t steps = 0;
  for (bool work = true; work;) {
    work = false;
    std::vector<test::BackendDriver::Chunk> chunks;
    std::vector<SequenceStep> batch;
    std::vector<std::vector<uint32_t>> chunk_tokens, chunk_rows;
    chunk_tokens.reserve(3);
    chunk_rows.reserve(3);
    for (size_t i = 0; i < tokens.size(); ++i) {
      const uint32_t pos = local_seqs[i].position;
      if (pos >= tokens[i].size()) continue;
      const size_t len = pos == 0 ? i + 2 : 1;
      const size_t end = std::min(tokens[i].size(), pos + len);
      chunk_tokens.emplace_back(tokens[i].begin() + pos, tokens[i].begin() + long(end));
      chunk_rows.emplace_back();
      for (uint32_t r = 0; r < chunk_tokens.back().size(); ++r) chunk_rows.back().push_back(r);
      chunks.push_back({&local_seqs[i], chunk_tokens.back()});
      batch.push_back({.sequence_id = i + 1,
                       .start_position = pos,
                       .tokens = chunk_tokens.back(),
                       .kv_blocks = remote_seqs[i].blocks,
                       .logits_rows = chunk_rows.back()});
      work = true;
    }
    if (!work) break;
    auto want = driver.step(chunks);
    auto got = verifiedStep(*client, batch);
    ASSERT_TRUE(got.ok()) << got.error().toString();
    size_t r = 0;
    for (const auto& rows : want) {
      for (const auto& row : rows) {
        ASSERT_EQ(got->rows[r].payload.size(), row.size());
        ASSERT_EQ(std::memcmp(got->rows[r].payload.data(), row.data(), row.size() * 4), 0)
            << "step " << steps << " row " << r << " differs from the in-process engine";
        ++r;
      }
    }
    ++steps;
  }
  EXPECT_GT(steps, 5u);
}

// A step's reply says when the worker received, computed and answered it (step-bench splits the
// round trip with these times).
TEST_F(WorkerProcessTest, AStepsTimelineRunsInOrderOnTheHostsClock) {
  auto client = spawn();
  ASSERT_TRUE(client);
  OneStep s;
  SequenceStep seq = s.step();
  auto reply = verifiedStep(*client, {&seq, 1});
  ASSERT_TRUE(reply.ok()) << reply.error().toString();
  const StepTimeline& t = reply->timeline;
  // The broker's times and the worker's come from one clock, so they interleave in order.
  EXPECT_GT(t.sent, 0);
  EXPECT_LE(t.sent, t.arrived);
  EXPECT_LE(t.arrived, t.compute_start);
  EXPECT_LT(t.compute_start, t.compute_end);
  EXPECT_LE(t.compute_end, t.replying);
  EXPECT_LE(t.replying, t.read);
  EXPECT_EQ(uint64_t((t.compute_end - t.compute_start) / 1000), reply->compute_micros);
}

// Two steps in flight: the worker computes them in order, each into its own arena slots, so the
// first step's rows are intact after the second was computed, and equal to the same sequences
// computed one step at a time. A step whose rows would pass the arena's end is refused, and the
// connection stays usable.
TEST_F(WorkerProcessTest, TwoStepsInFlightKeepTheirRowsApart) {
  auto client = spawn(/*fault_injection=*/false, /*arena_slots=*/8);
  ASSERT_TRUE(client);
  const std::vector<uint32_t> a_tokens = {1, 2, 3, 4}, b_tokens = {9, 8, 7, 6}, rows = {0, 1, 2, 3};
  const std::vector<uint32_t> blocks[4] = {{0}, {1}, {2}, {3}};
  auto seq = [&](uint64_t id, const std::vector<uint32_t>& tokens, int block) {
    return SequenceStep{.sequence_id = id,
                        .start_position = 0,
                        .tokens = tokens,
                        .kv_blocks = blocks[block],
                        .logits_rows = rows};
  };
  auto copyRows = [](const StepReply& reply) {
    std::vector<std::vector<float>> out;
    for (const PendingRow& r : reply.rows) out.emplace_back(r.payload.begin(), r.payload.end());
    return out;
  };
  // One at a time, for reference.
  const SequenceStep a_alone = seq(11, a_tokens, 2), b_alone = seq(12, b_tokens, 3);
  auto a_ref = verifiedStep(*client, {&a_alone, 1});
  ASSERT_TRUE(a_ref.ok()) << a_ref.error().toString();
  const auto want_a = copyRows(*a_ref);
  auto b_ref = verifiedStep(*client, {&b_alone, 1});
  ASSERT_TRUE(b_ref.ok()) << b_ref.error().toString();
  const auto want_b = copyRows(*b_ref);

  const SequenceStep a = seq(1, a_tokens, 0), b = seq(2, b_tokens, 1);
  ASSERT_TRUE(client->sendStep(next_step_++, {&a, 1}, 0, kStepTimeout).ok());
  ASSERT_TRUE(client->sendStep(next_step_++, {&b, 1}, 4, kStepTimeout).ok());
  auto got_a = client->awaitStep();
  ASSERT_TRUE(got_a.ok()) << got_a.error().toString();
  auto got_b = client->awaitStep();
  ASSERT_TRUE(got_b.ok()) << got_b.error().toString();
  // Read the first step's rows only now, after the second step wrote its own.
  ASSERT_TRUE(verifyRows(sampler_, got_a->rows).ok());
  ASSERT_TRUE(verifyRows(sampler_, got_b->rows).ok());
  EXPECT_EQ(copyRows(*got_a), want_a);
  EXPECT_EQ(copyRows(*got_b), want_b);

  ASSERT_TRUE(client->sendStep(next_step_++, {&a, 1}, 6, kStepTimeout).ok());
  auto past_end = client->awaitStep();
  ASSERT_FALSE(past_end.ok());
  EXPECT_EQ(past_end.error().kind, Kind::kRejected) << past_end.error().toString();
  EXPECT_NE(past_end.error().message.find("from slot 6"), std::string::npos)
      << past_end.error().message;
  EXPECT_TRUE(verifiedStep(*client, {&a_alone, 1}).ok());
}

TEST_F(WorkerProcessTest, GoldenFixtureThroughTheWorker) {
  auto client = spawn();
  ASSERT_TRUE(client);
  const test::Golden golden = test::loadGolden(test::fixtureDir("tiny-qwen2"));
  uint64_t seq_id = 1;
  uint32_t next_block = 0;
  for (const auto& c : golden.cases) {
    auto tokens = c.tokens();
    tokens.resize(c.positions);
    std::vector<uint32_t> blocks, rows;
    for (uint32_t b = 0; b < (tokens.size() + 15) / 16; ++b) blocks.push_back(next_block++);
    for (uint32_t r = 0; r < tokens.size(); ++r) rows.push_back(r);
    SequenceStep s{.sequence_id = seq_id++,
                   .start_position = 0,
                   .tokens = tokens,
                   .kv_blocks = blocks,
                   .logits_rows = rows};
    auto got = verifiedStep(*client, {&s, 1});
    ASSERT_TRUE(got.ok()) << got.error().toString();
    for (size_t p = 0; p < c.positions; ++p) {
      for (uint32_t v = 0; v < golden.vocab; ++v) {
        ASSERT_NEAR(got->rows[p].payload[v], golden.row(c, p)[v], 1e-4) << "position " << p;
      }
    }
  }
}

TEST_F(WorkerProcessTest, InvalidStepsAreRejectedAndTheWorkerKeepsServing) {
  auto client = spawn(true, 4);
  ASSERT_TRUE(client);
  const std::vector<uint32_t> bad_token = {1, 9999}, ok_tokens = {1, 2}, blocks = {0},
                              far_blocks = {100000}, rows = {1}, many_rows = {0, 1, 2, 3, 4},
                              five = {1, 2, 3, 4, 5};
  struct Case {
    SequenceStep step;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {{1, 0, bad_token, blocks, rows}, "token id 9999 >= vocab size 512"},
      {{1, 255, ok_tokens, blocks, rows}, "exceed the context limit 256"},
      {{1, 0, ok_tokens, far_blocks, rows}, "KV block 100000 out of range"},
      {{1, 0, five, blocks, many_rows}, "the arena holds 4"},
  };
  for (const Case& c : cases) {
    auto r = client->step(next_step_++, {&c.step, 1}, kStepTimeout);
    ASSERT_FALSE(r.ok()) << c.needle;
    EXPECT_EQ(r.error().kind, Kind::kRejected) << r.error().toString();
    EXPECT_NE(r.error().message.find(c.needle), std::string::npos) << r.error().message;
    EXPECT_FALSE(client->broken());
  }
  SequenceStep good{1, 0, ok_tokens, blocks, rows};
  auto r = client->step(next_step_++, {&good, 1}, kStepTimeout);
  EXPECT_TRUE(r.ok()) << r.error().toString();
}

TEST_F(WorkerProcessTest, FaultInjectionIsRefusedWithoutTheFlag) {
  auto client = spawn(/*fault_injection=*/false);
  ASSERT_TRUE(client);
  WorkerFailure f = client->injectFault({.fault = Fault::kWorkerKill}, 5s);
  EXPECT_EQ(f.kind, Kind::kRejected);
  EXPECT_EQ(f.code, Code::kPermissionDenied);
  EXPECT_NE(f.message.find("--enable-fault-injection"), std::string::npos);
  OneStep s;
  SequenceStep seq = s.step();
  EXPECT_TRUE(client->step(next_step_++, {&seq, 1}, kStepTimeout).ok());
}

TEST_F(WorkerProcessTest, CrashMidStepIsReportedAsExitBySignal) {
  auto client = spawn();
  ASSERT_TRUE(client);
  WorkerFailure f = faultedStep(*client, {.fault = Fault::kWorkerKill});
  EXPECT_EQ(f.kind, Kind::kExited) << f.toString();
  EXPECT_EQ(f.signal, SIGKILL);
  EXPECT_LT(last_detection_, 3s);
  EXPECT_TRUE(client->broken());
  EXPECT_EQ(client->ping(1s).error().kind, Kind::kExited);  // fails fast afterwards
}

TEST_F(WorkerProcessTest, ExternalSigkillIsReportedPromptly) {
  auto client = spawn();
  ASSERT_TRUE(client);
  // Slow step so the kill lands while the worker is mid-step.
  ASSERT_TRUE(client->injectFault({.fault = Fault::kSlowStep, .delay_ms = 5000}, 5s).ok());
  OneStep s;
  SequenceStep seq = s.step();
  std::thread killer([&] {
    std::this_thread::sleep_for(200ms);  // the fault under test, not synchronisation
    client->kill(SIGKILL);
  });
  const auto start = std::chrono::steady_clock::now();
  auto r = client->step(next_step_++, {&seq, 1}, kStepTimeout);
  const auto took = std::chrono::steady_clock::now() - start;
  killer.join();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().kind, Kind::kExited) << r.error().toString();
  EXPECT_EQ(r.error().signal, SIGKILL);
  EXPECT_LT(took, 3s);
}

TEST_F(WorkerProcessTest, HangIsReportedAsTimeoutAtTheDeadline) {
  auto client = spawn();
  ASSERT_TRUE(client);
  WorkerFailure f = faultedStep(*client, {.fault = Fault::kWorkerHang}, 500ms);
  EXPECT_EQ(f.kind, Kind::kTimedOut) << f.toString();
  EXPECT_GE(last_detection_, 500ms);
  EXPECT_LT(last_detection_, 2s);
}

struct RowFaultCase {
  const char* name;
  Fault fault;
  Kind expected_kind;
  IntegrityCheck expected_check;
};
void PrintTo(const RowFaultCase& c, std::ostream* os) {
  *os << c.name;
}

class RowFaultTest : public WorkerProcessTest,
                     public ::testing::WithParamInterface<RowFaultCase> {};

TEST_P(RowFaultTest, IsDetected) {
  auto client = spawn();
  ASSERT_TRUE(client);
  // A clean step first, so stale payloads exist in the slot.
  OneStep s;
  SequenceStep seq = s.step();
  ASSERT_TRUE(client->step(next_step_++, {&seq, 1}, kStepTimeout).ok());
  const RowFaultCase& c = GetParam();
  // Different tokens, so the faulted row's true payload differs from what the slot held.
  OneStep other;
  other.tokens = {5, 6, 7, 8};
  other.blocks = {1};
  SequenceStep seq2 = other.step(2);
  ASSERT_TRUE(client->injectFault({.fault = c.fault}, 5s).ok());
  const auto start = std::chrono::steady_clock::now();
  auto r = verifiedStep(*client, {&seq2, 1});
  ASSERT_FALSE(r.ok()) << c.name << " went unnoticed";
  EXPECT_EQ(r.error().kind, c.expected_kind) << r.error().toString();
  EXPECT_EQ(r.error().check, c.expected_check) << r.error().toString();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
  if (c.expected_kind == Kind::kIntegrityFailure) {
    EXPECT_EQ(r.error().toStatus().code(), Code::kDataLoss);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Faults, RowFaultTest,
    ::testing::Values(RowFaultCase{"flipped_payload_byte", Fault::kLogitsCorrupt,
                                   Kind::kIntegrityFailure, IntegrityCheck::kPayloadChecksum},
                      RowFaultCase{"half_written_slot", Fault::kTornWrite, Kind::kIntegrityFailure,
                                   IntegrityCheck::kPayloadChecksum},
                      RowFaultCase{"old_incarnation", Fault::kStaleIncarnation,
                                   Kind::kIntegrityFailure, IntegrityCheck::kIncarnation},
                      RowFaultCase{"old_step", Fault::kStaleStep, Kind::kIntegrityFailure,
                                   IntegrityCheck::kStepId},
                      RowFaultCase{"nan_in_row", Fault::kLogitsNan, Kind::kIntegrityFailure,
                                   IntegrityCheck::kNonFinite},
                      RowFaultCase{"garbage_reply", Fault::kGarbageReply, Kind::kProtocolViolation,
                                   IntegrityCheck::kNone},
                      RowFaultCase{"truncated_reply", Fault::kTruncatedReply,
                                   Kind::kProtocolViolation, IntegrityCheck::kNone}),
    [](const ::testing::TestParamInfo<RowFaultCase>& info) { return info.param.name; });

// A peer on the worker's socket whose Hello claims no arena slots (or any other zero limit): the
// client refuses it as a protocol violation instead of serving a worker no step can use.
TEST_F(WorkerProcessTest, AHelloWithZeroLimitsIsAProtocolViolation) {
  for (const std::string zero : {"arena_slots", "kv_block_count", "max_step_tokens"}) {
    const std::string socket = dir_.file(zero + ".sock");
    const WorkerFailure why = meetAPeer(
        socket,
        [&](wire::Hello::Builder hello) {
          hello.setPid(uint32_t(::getpid()));
          hello.setVocabSize(64);
          hello.setKvBlockSize(4);
          hello.setKvBlockCount(zero == "kv_block_count" ? 0 : 64);
          hello.setMaxStepTokens(zero == "max_step_tokens" ? 0 : 64);
          hello.setArenaSlots(zero == "arena_slots" ? 0 : 8);
          hello.setArenaName("/bulkhead-test-none");
        },
        [&] { return WorkerClient::connect(socket, 10s); });
    ASSERT_FALSE(why.ok()) << zero;
    EXPECT_EQ(why.kind, Kind::kProtocolViolation) << why.toString();
    EXPECT_NE(why.toString().find("zero limits"), std::string::npos) << why.toString();
  }
}

// Attach mode SIGKILLs a worker it replaces, so the process it watches is the one the kernel says
// serves the socket, never the pid a Hello claims. A peer (this test process) whose Hello names
// another process (a sleeping child) is refused, and the child is left alone; before, the client
// watched the child and killed it when it let go.
TEST_F(WorkerProcessTest, AttachWatchesTheSocketsPeerNotThePidItsHelloClaims) {
  auto bystander = ChildProcess::spawn({"/bin/sleep", "60"});
  ASSERT_TRUE(bystander.ok()) << bystander.status().toString();
  const uint64_t incarnation = 0x5eed;
  auto arena =
      LogitsArena::create(LogitsArena::arenaName(::getpid(), incarnation), incarnation, 8, 64);
  ASSERT_TRUE(arena.ok()) << arena.status().toString();
  const std::string socket = dir_.file("claims.sock");
  const WorkerFailure why = meetAPeer(
      socket,
      [&](wire::Hello::Builder hello) {
        hello.setPid(uint32_t(bystander->pid()));
        hello.setIncarnation(incarnation);
        hello.setVocabSize(64);
        hello.setKvBlockSize(4);
        hello.setKvBlockCount(64);
        hello.setMaxStepTokens(64);
        hello.setArenaSlots(8);
        hello.setArenaName((*arena)->name());
      },
      [&] { return WorkerClient::attach(socket, /*replaced=*/0, 10s, nullptr, {}); });
  EXPECT_FALSE(why.ok()) << "attached to a peer that named another process";
  EXPECT_NE(why.toString().find("the socket's peer is pid"), std::string::npos) << why.toString();
  // A negative check, bounded: the bystander (sleeping a minute) must not exit now.
  ExitInfo exit;
  EXPECT_FALSE(bystander->waitExit(std::chrono::steady_clock::now() + 1s, &exit))
      << "the process the Hello named was killed: " << exit.describe();
}

TEST_F(WorkerProcessTest, ConnectsToAWorkerItDidNotSpawn) {
  // As under systemd: the worker runs on its own; the client only connects.
  const std::string socket = dir_.file("standalone.sock");
  auto child = ChildProcess::spawn({test::binDir() + "/bulkhead-worker", "--model",
                                    test::fixtureDir("tiny-qwen2"), "--socket", socket, "--backend",
                                    "cpu", "--ready-fd", "3", "--log-level", "warn"});
  ASSERT_TRUE(child.ok());
  ASSERT_TRUE(child->waitReady(std::chrono::steady_clock::now() + 30s).ok());
  auto client = WorkerClient::connect(socket, 10s);
  ASSERT_TRUE(client.ok()) << client.error().toString();
  EXPECT_EQ((*client)->hello().pid, child->pid());
  OneStep s;
  SequenceStep seq = s.step();
  EXPECT_TRUE((*client)->step(next_step_++, {&seq, 1}, kStepTimeout).ok());
  // The worker's exit is seen as a lost connection.
  child->signal(SIGKILL);
  auto r = (*client)->step(next_step_++, {&seq, 1}, kStepTimeout);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().kind, Kind::kExited) << r.error().toString();
  ExitInfo info;
  ASSERT_TRUE(child->waitExit(std::chrono::steady_clock::now() + 10s, &info));
  EXPECT_GE(LogitsArena::collectStale(), 1);  // the killed worker's arena
}

TEST_F(WorkerProcessTest, CleanShutdownRemovesSocketAndArena) {
  auto client = spawn();
  ASSERT_TRUE(client);
  const std::string arena =
      "/dev/shm/" + LogitsArena::arenaName(client->hello().pid, client->hello().incarnation);
  ASSERT_TRUE(std::filesystem::exists(arena));
  WorkerFailure f = client->shutdown(10s);
  EXPECT_TRUE(f.ok()) << f.toString();
  EXPECT_FALSE(std::filesystem::exists(arena));
  EXPECT_TRUE(std::filesystem::is_empty(dir_.file("sock")));
}

// A worker told to watch its socket awake after each reply (--spin-us, here long enough that
// every next step arrives while it does) computes the same rows, and still stops when asked.
TEST_F(WorkerProcessTest, AWorkerGivenSpinUsGivesTheSameRowsAndStops) {
  auto plain = spawn();
  auto spinning = spawn(true, 64, {"--spin-us", "50000"});
  ASSERT_TRUE(plain && spinning);
  expectSameRows(*plain, *spinning, 20);
  WorkerFailure f = spinning->shutdown(10s);
  EXPECT_TRUE(f.ok()) << f.toString();
}

TEST_F(WorkerProcessTest, AClientWatchingForRepliesAwakeReadsThemWhileAwakeWithTheSameRows) {
  auto plain = spawn();
  auto watching = spawn();
  ASSERT_TRUE(plain && watching);
  // Far longer than a step of the tiny model: every reply comes while the client watches.
  int wakings = 0, cooled = 0;
  watching->setReplySpin(std::chrono::microseconds(2'000'000),
                         [&](bool warm) { ++(warm ? wakings : cooled); });
  expectSameRows(*plain, *watching, 10);
  EXPECT_EQ(watching->repliesSeenAwake(), 10u);
  EXPECT_EQ(wakings, 10) << "what the reply needs is warmed once a step";
  EXPECT_EQ(cooled, 0) << "every reply came while the client watched";
  // A watch that ends without the reply (here a hung worker's) cools what it warmed before the
  // client sleeps until the deadline.
  auto hung = spawn();
  ASSERT_TRUE(hung);
  int hung_wakings = 0, hung_cooled = 0;
  hung->setReplySpin(std::chrono::microseconds(1),
                     [&](bool warm) { ++(warm ? hung_wakings : hung_cooled); });
  WorkerFailure timed_out = faultedStep(*hung, {.fault = Fault::kWorkerHang}, 300ms);
  EXPECT_EQ(timed_out.kind, Kind::kTimedOut) << timed_out.toString();
  EXPECT_EQ(hung_wakings, 1);
  EXPECT_EQ(hung_cooled, 1) << "a watch that ended without the reply left the pool warm";
  EXPECT_EQ(plain->repliesSeenAwake(), 0u);
  // A worker that dies while the client watches is reported as such, not waited out.
  watching->kill(SIGKILL);
  OneStep last;
  SequenceStep seq = last.step(100);
  auto lost = watching->step(100, {&seq, 1}, 30s);
  ASSERT_FALSE(lost.ok());
  EXPECT_EQ(lost.error().kind, WorkerFailure::Kind::kExited) << lost.error().toString();
}

TEST_F(WorkerProcessTest, KilledWorkersArenaIsRemovedByItsClient) {
  std::string arena;
  {
    auto client = spawn();
    ASSERT_TRUE(client);
    arena = "/dev/shm/" + LogitsArena::arenaName(client->hello().pid, client->hello().incarnation);
    ASSERT_TRUE(std::filesystem::exists(arena));
  }  // destruction SIGKILLs the worker
  EXPECT_FALSE(std::filesystem::exists(arena));
}

}  // namespace
}  // namespace bulkhead

namespace bulkhead {
namespace {

// The worker's socket path: never through a symlink, never another user's socket.
TEST(WorkerSocketPathTest, RefusesASymlinkAndAnotherUsersSocket) {
  test::TempDir dir;
  auto start = [&](const std::string& socket) {
    auto child = ChildProcess::spawn({test::binDir() + "/bulkhead-worker", "--model",
                                      test::fixtureDir("tiny-qwen2"), "--socket", socket,
                                      "--backend", "cpu", "--log-level", "warn"});
    EXPECT_TRUE(child.ok()) << child.status().toString();
    ExitInfo exit;
    EXPECT_TRUE(child->waitExit(std::chrono::steady_clock::now() + std::chrono::seconds(30), &exit))
        << "the worker took over " << socket;
    return exit;
  };
  // A symlink at the path, to a file the worker must not touch.
  test::writeFile(dir.file("target"), "keep");
  ASSERT_EQ(::symlink(dir.file("target").c_str(), dir.file("link.sock").c_str()), 0);
  EXPECT_NE(start(dir.file("link.sock")).exit_code, 0);
  EXPECT_EQ(test::readFile(dir.file("target")), "keep");
  EXPECT_TRUE(std::filesystem::is_symlink(dir.file("link.sock")));

  if (::geteuid() != 0) GTEST_SKIP() << "making another user's socket needs root";
  const std::string theirs = dir.file("theirs.sock");
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  theirs.copy(addr.sun_path, sizeof(addr.sun_path) - 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ::close(fd);  // a stale socket: nobody listens
  ASSERT_EQ(::chown(theirs.c_str(), 65534, 65534), 0);
  EXPECT_NE(start(theirs).exit_code, 0);
  struct stat st {};
  ASSERT_EQ(::lstat(theirs.c_str(), &st), 0) << "another user's socket was removed";
  EXPECT_EQ(st.st_uid, 65534u);
}

}  // namespace
}  // namespace bulkhead

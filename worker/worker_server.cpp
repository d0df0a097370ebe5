// WorkerServer: socket setup, message dispatch, step execution into the arena, fault injection.
#include "worker/worker_server.h"

#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <spdlog/spdlog.h>

#include "proto/worker.capnp.h"
#include "shared/checksum.h"
#include "shared/ipc_frame.h"

namespace bulkhead {
namespace {

constexpr auto kReplyTimeout = std::chrono::seconds(30);
// Caps on what one Step message may carry, checked before anything is copied.
constexpr uint32_t kMaxSequencesPerStep = 4096;

SteadyTime replyDeadline() {
  return std::chrono::steady_clock::now() + kReplyTimeout;
}

Status bindListener(const std::string& path, int& out_fd) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path))
    return invalidArgument("socket path " + path + " is longer than " +
                           std::to_string(sizeof(addr.sun_path) - 1) + " bytes");
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);

  // A socket file left by a dead worker is collected; a live one is never taken over.
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) return failedPrecondition(path + " exists and is not a socket");
    int probe = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const bool alive =
        probe >= 0 && ::connect(probe, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    if (probe >= 0) ::close(probe);
    if (alive) return Status(Code::kAlreadyExists, path + " is served by a running worker");
    ::unlink(path.c_str());
    spdlog::info("removed stale socket {}", path);
  }
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return internalError(std::string("socket: ") + std::strerror(errno));
  const mode_t old_mask = ::umask(0077);  // owner-only socket file
  const int rc = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  ::umask(old_mask);
  if (rc != 0 || ::listen(fd, 4) != 0) {
    const int err = errno;
    ::close(fd);
    return Status(err == EADDRINUSE ? Code::kAlreadyExists : Code::kInternal,
                  path + ": cannot listen: " + std::strerror(err));
  }
  out_fd = fd;
  return okStatus();
}

void fillScrubReport(wire::ScrubReport::Builder report,
                     const std::vector<WeightCorruption>& corruptions, uint64_t clean_through) {
  report.setCleanThrough(clean_through);
  auto list = report.initCorruptions(unsigned(corruptions.size()));
  for (size_t i = 0; i < corruptions.size(); ++i) {
    list[unsigned(i)].setTensor(corruptions[i].tensor);
    list[unsigned(i)].setOffset(corruptions[i].offset);
    list[unsigned(i)].setBytes(corruptions[i].bytes);
    list[unsigned(i)].setSuspectFromStep(corruptions[i].suspect_from_step);
  }
}

void setError(wire::FromWorker::Builder reply, const Status& status) {
  auto e = reply.initError();
  e.setCode(uint32_t(status.code()));
  e.setMessage(status.message());
}

}  // namespace

struct WorkerServer::PendingFault {
  wire::FaultKind kind = wire::FaultKind::NONE;
  uint32_t row = 0;
  uint32_t delay_ms = 0;
};

Result<std::unique_ptr<WorkerServer>> WorkerServer::create(
    std::unique_ptr<Backend> backend, std::shared_ptr<const Checkpoint> checkpoint,
    const WorkerOptions& options) {
  std::unique_ptr<WorkerServer> server(new WorkerServer());
  server->options_ = options;
  server->weight_digest_ = checkpoint->weightDigest();
  server->model_identity_ = checkpoint->identity();
  server->checkpoint_ = checkpoint;
  server->fault_ = std::make_unique<PendingFault>();
  if (const int removed = LogitsArena::collectStale(); removed > 0)
    spdlog::info("removed {} stale logits arena(s)", removed);
  BULKHEAD_ASSIGN_OR_RETURN(
      server->arena_,
      LogitsArena::create(LogitsArena::arenaName(int(::getpid()), options.incarnation),
                          options.incarnation, options.arena_slots, backend->limits().vocab_size));
  server->backend_ = std::move(backend);
  server->scrubber_ = std::make_unique<WeightScrubber>(*server->backend_, *checkpoint);

  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGINT);
  if (::pthread_sigmask(SIG_BLOCK, &mask, nullptr) != 0)
    return internalError("cannot block SIGTERM/SIGINT");
  server->signal_fd_ = ::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
  if (server->signal_fd_ < 0)
    return internalError(std::string("signalfd: ") + std::strerror(errno));
  BULKHEAD_RETURN_IF_ERROR(bindListener(options.socket_path, server->listen_fd_));
  return server;
}

WorkerServer::~WorkerServer() {
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    ::unlink(options_.socket_path.c_str());
  }
  if (signal_fd_ >= 0) ::close(signal_fd_);
}

Status WorkerServer::serve() {
  spdlog::info("worker incarnation {:016x} serving on {} (arena {}, {} slots)",
               options_.incarnation, options_.socket_path, arena_->name(), arena_->slots());
  if (options_.ready_fd >= 0) {
    const char byte = 'R';
    [[maybe_unused]] ssize_t n = ::write(options_.ready_fd, &byte, 1);
    ::close(options_.ready_fd);
    options_.ready_fd = -1;
  }
  while (true) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {signal_fd_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return internalError(std::string("poll: ") + std::strerror(errno));
    }
    if (fds[1].revents & POLLIN) {
      spdlog::info("signal received; shutting down");
      return okStatus();
    }
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    BULKHEAD_RETURN_IF_ERROR(makeNonBlocking(fd));
    const bool stop = serveConnection(fd);
    ::close(fd);
    if (stop) return okStatus();
  }
}

bool WorkerServer::serveConnection(int fd) {
  const BackendLimits limits = backend_->limits();
  {
    capnp::MallocMessageBuilder message;
    auto reply = message.initRoot<wire::FromWorker>();
    auto hello = reply.initHello();
    hello.setProtocolVersion(wire::PROTOCOL_VERSION);
    hello.setPid(::getpid());
    hello.setIncarnation(options_.incarnation);
    hello.setBackend(std::string(backend_->name()));
    hello.setArchitecture(backend_->config().architecture_name);
    hello.setModelDir(options_.model_dir);
    hello.setVocabSize(limits.vocab_size);
    hello.setMaxContext(limits.max_context);
    hello.setKvBlockSize(limits.kv_block_size);
    hello.setKvBlockCount(limits.kv_block_count);
    hello.setMaxStepTokens(limits.max_step_tokens);
    hello.setWeightBytes(backend_->residentWeightBytes());
    hello.setWeightDigest(weight_digest_);
    hello.setArenaName(arena_->name());
    hello.setArenaSlots(arena_->slots());
    hello.setFaultInjection(options_.enable_fault_injection);
    hello.setModelIdentity(model_identity_);
    hello.setScrubbing(options_.scrub_bytes_per_step > 0);
    const auto& eos = backend_->config().eos_token_ids;
    auto eos_list = hello.initEosTokenIds(unsigned(eos.size()));
    for (size_t i = 0; i < eos.size(); ++i) eos_list.set(unsigned(i), eos[i]);
    if (!writeMessage(fd, message, replyDeadline()).ok()) return false;
  }

  std::vector<capnp::word> words;
  std::vector<std::vector<uint32_t>> lists;
  std::vector<SequenceStep> batch;
  std::vector<float*> rows;
  std::vector<float> scratch;
  while (true) {
    FrameReadResult frame = readFrame(fd, words, SteadyTime::max(), /*extra_fd=*/signal_fd_);
    if (frame.status.code() == Code::kAborted) return true;  // SIGTERM/SIGINT
    if (!frame.status.ok()) {
      if (frame.status.code() == Code::kInvalidArgument) {
        // The stream cannot be resynchronised: say why, then drop the connection.
        spdlog::warn("dropping connection: {}", frame.status.message());
        capnp::MallocMessageBuilder message;
        setError(message.initRoot<wire::FromWorker>(), frame.status);
        (void)writeMessage(fd, message, replyDeadline());
      } else if (!frame.clean_close) {
        spdlog::warn("connection ended: {}", frame.status.message());
      }
      return false;
    }

    capnp::MallocMessageBuilder message;
    auto reply = message.initRoot<wire::FromWorker>();
    bool stop = false;
    enum class RawReply { kNone, kGarbage, kTruncated } raw = RawReply::kNone;
    try {
      capnp::ReaderOptions reader_options;
      reader_options.traversalLimitInWords = words.size() * 4 + 1024;
      reader_options.nestingLimit = 16;
      capnp::FlatArrayMessageReader reader(kj::arrayPtr(words.data(), words.size()),
                                           reader_options);
      auto request = reader.getRoot<wire::ToWorker>();
      reply.setRequestId(request.getRequestId());
      switch (request.which()) {
        case wire::ToWorker::PING: {
          auto report = reply.initPong();
          if (options_.scrub_bytes_per_step > 0) {
            fillScrubReport(report, scrubber_->fullPass(last_step_), scrubber_->cleanThrough());
          }
          break;
        }
        case wire::ToWorker::HEARTBEAT:
          reply.initPong().setCleanThrough(scrubber_->cleanThrough());
          break;
        case wire::ToWorker::RELEASE:
          reply.setReleased();
          break;
        case wire::ToWorker::SHUTDOWN:
          reply.setShuttingDown();
          stop = true;
          break;
        case wire::ToWorker::FAULT_INJECT: {
          auto f = request.getFaultInject();
          if (!options_.enable_fault_injection) {
            spdlog::warn("refused a fault injection request: fault injection is disabled");
            setError(reply, Status(Code::kPermissionDenied,
                                   "fault injection is disabled; start the worker with "
                                   "--enable-fault-injection"));
            break;
          }
          spdlog::warn("fault armed: kind {} row {}", int(f.getKind()), f.getRow());
          if (f.getKind() == wire::FaultKind::WEIGHT_BITFLIP) {
            Status s = backend_->flipWeightBit(f.getByteOffset(), f.getBit());
            if (!s.ok()) {
              setError(reply, s);
              break;
            }
          } else {
            *fault_ = {f.getKind(), f.getRow(), f.getDelayMillis()};
          }
          reply.setFaultArmed();
          break;
        }
        case wire::ToWorker::STEP: {
          auto step = request.getStep();
          const uint64_t step_id = step.getStepId();
          auto seqs = step.getSequences();
          if (step_id == 0) {
            setError(reply, invalidArgument("step id 0 is reserved"));
            break;
          }
          if (seqs.size() > kMaxSequencesPerStep) {
            setError(reply, invalidArgument("step has " + std::to_string(seqs.size()) +
                                            " sequences, the limit is " +
                                            std::to_string(kMaxSequencesPerStep)));
            break;
          }
          // Copy lists out of the message; reject sizes past the limits before copying.
          lists.assign(size_t(seqs.size()) * 3, {});
          batch.clear();
          uint64_t total_rows = 0;
          Status invalid;
          for (unsigned i = 0; i < seqs.size() && invalid.ok(); ++i) {
            auto s = seqs[i];
            auto tokens = s.getTokens();
            auto blocks = s.getKvBlocks();
            auto logits_rows = s.getLogitsRows();
            if (tokens.size() > limits.max_step_tokens || blocks.size() > limits.kv_block_count ||
                logits_rows.size() > tokens.size()) {
              invalid = invalidArgument("sequence " + std::to_string(s.getSequenceId()) +
                                        ": list lengths exceed the worker's limits");
              break;
            }
            auto copy = [](auto list, std::vector<uint32_t>& out) {
              out.resize(list.size());
              for (unsigned k = 0; k < list.size(); ++k) out[k] = list[k];
            };
            copy(tokens, lists[i * 3]);
            copy(blocks, lists[i * 3 + 1]);
            copy(logits_rows, lists[i * 3 + 2]);
            total_rows += logits_rows.size();
            batch.push_back({.sequence_id = s.getSequenceId(),
                             .start_position = s.getStartPosition(),
                             .tokens = lists[i * 3],
                             .kv_blocks = lists[i * 3 + 1],
                             .logits_rows = lists[i * 3 + 2]});
          }
          if (invalid.ok() && total_rows > arena_->slots()) {
            invalid = resourceExhausted("step asks for " + std::to_string(total_rows) +
                                        " logits rows, the arena holds " +
                                        std::to_string(arena_->slots()));
          }
          if (!invalid.ok()) {
            setError(reply, invalid);
            break;
          }
          // Row faults wait for a step that has rows; they hit the last row if there are fewer.
          PendingFault fault = *fault_;
          const bool row_fault = fault.kind == wire::FaultKind::LOGITS_CORRUPT ||
                                 fault.kind == wire::FaultKind::TORN_WRITE ||
                                 fault.kind == wire::FaultKind::STALE_INCARNATION ||
                                 fault.kind == wire::FaultKind::STALE_STEP ||
                                 fault.kind == wire::FaultKind::LOGITS_NAN;
          if (row_fault && total_rows == 0) {
            fault = PendingFault{};
          } else {
            *fault_ = PendingFault{};
            if (row_fault) fault.row = std::min<uint32_t>(fault.row, uint32_t(total_rows - 1));
          }
          const bool torn = fault.kind == wire::FaultKind::TORN_WRITE;
          rows.resize(total_rows);
          for (uint32_t r = 0; r < total_rows; ++r) rows[r] = arena_->beginRow(r);
          if (torn) {
            scratch.resize(limits.vocab_size);
            rows[fault.row] = scratch.data();  // the payload never reaches the slot
          }
          const auto start = std::chrono::steady_clock::now();
          Status s = backend_->step(batch, rows);
          if (!s.ok()) {
            setError(reply, s);
            break;
          }
          if (fault.kind == wire::FaultKind::WORKER_KILL) ::raise(SIGKILL);
          if (fault.kind == wire::FaultKind::WORKER_HANG) ::raise(SIGSTOP);
          if (fault.kind == wire::FaultKind::SLOW_STEP)
            std::this_thread::sleep_for(std::chrono::milliseconds(fault.delay_ms));
          const uint64_t micros = uint64_t(std::chrono::duration_cast<std::chrono::microseconds>(
                                               std::chrono::steady_clock::now() - start)
                                               .count());
          last_step_ = step_id;
          auto done = reply.initStepDone();
          done.setStepId(step_id);
          done.setComputeMicros(micros);
          if (options_.scrub_bytes_per_step > 0) {
            fillScrubReport(done.initScrub(),
                            scrubber_->scrub(options_.scrub_bytes_per_step, step_id),
                            scrubber_->cleanThrough());
          }
          auto refs = done.initRows(unsigned(total_rows));
          uint32_t r = 0;
          for (const SequenceStep& seq : batch) {
            for (uint32_t token_index : seq.logits_rows) {
              const bool hit = fault.row == r;
              if (hit && fault.kind == wire::FaultKind::LOGITS_NAN) rows[r][7] = std::nanf("");
              uint64_t checksum;
              if (hit && torn) {
                // Half the payload lands, the header claims all of it.
                std::memcpy(arena_->beginRow(r), scratch.data(),
                            sizeof(float) * limits.vocab_size / 2);
                checksum = checkRow(scratch.data(), limits.vocab_size).checksum;
                arena_->publishHeader(r, {options_.incarnation, step_id, seq.sequence_id,
                                          token_index, limits.vocab_size, checksum});
              } else {
                checksum = arena_->publishRow(r, step_id, seq.sequence_id, token_index);
              }
              if (hit && fault.kind == wire::FaultKind::STALE_INCARNATION) {
                arena_->publishHeader(r, {options_.incarnation - 1, step_id, seq.sequence_id,
                                          token_index, limits.vocab_size, checksum});
              } else if (hit && fault.kind == wire::FaultKind::STALE_STEP) {
                arena_->publishHeader(r, {options_.incarnation, step_id - 1, seq.sequence_id,
                                          token_index, limits.vocab_size, checksum});
              } else if (hit && fault.kind == wire::FaultKind::LOGITS_CORRUPT) {
                reinterpret_cast<unsigned char*>(rows[r])[13] ^= 0x40;
              }
              auto ref = refs[r];
              ref.setSlot(r);
              ref.setSequenceId(seq.sequence_id);
              ref.setTokenIndex(token_index);
              ref.setChecksum(checksum);
              ++r;
            }
          }
          if (fault.kind == wire::FaultKind::GARBAGE_REPLY) raw = RawReply::kGarbage;
          if (fault.kind == wire::FaultKind::TRUNCATED_REPLY) raw = RawReply::kTruncated;
          break;
        }
        default:
          setError(reply,
                   invalidArgument("unknown request kind " + std::to_string(int(request.which()))));
          break;
      }
    } catch (const kj::Exception& e) {
      spdlog::warn("malformed message: {}", e.getDescription().cStr());
      reply.setRequestId(0);
      setError(reply,
               invalidArgument(std::string("malformed message: ") + e.getDescription().cStr()));
    }

    Status sent;
    if (raw == RawReply::kGarbage) {
      static const char garbage[16] = {'\x13', '\x37', 'n', 'o', 't', ' ', 'a',    ' ',
                                       'f',    'r',    'a', 'm', 'e', '!', '\xff', '\xfe'};
      if (::send(fd, garbage, sizeof(garbage), MSG_NOSIGNAL) < 0) sent = unavailable("send failed");
    } else if (raw == RawReply::kTruncated) {
      kj::Array<capnp::word> flat = capnp::messageToFlatArray(message);
      const auto bytes = flat.asBytes();
      sent = writeFrame(fd, bytes.begin(), (bytes.size() / 2) & ~size_t(7), replyDeadline());
    } else {
      sent = writeMessage(fd, message, replyDeadline());
    }
    if (!sent.ok()) {
      spdlog::warn("reply not delivered: {}", sent.message());
      return false;
    }
    if (stop) return true;
  }
}

}  // namespace bulkhead

// WorkerServer: socket setup, Hello, message dispatch and reply framing. Steps run in StepRunner;
// faults enter through StepFaults.
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
#include <cstring>
#include <vector>

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <spdlog/spdlog.h>

#include "proto/fault_wire.h"
#include "proto/worker.capnp.h"
#include "shared/ipc_frame.h"
#include "shared/socket_path.h"

namespace bulkhead {
namespace {

constexpr auto kReplyTimeout = std::chrono::seconds(30);

SteadyTime replyDeadline() {
  return std::chrono::steady_clock::now() + kReplyTimeout;
}

Status bindListener(const std::string& path, int& out_fd) {
  BULKHEAD_ASSIGN_OR_RETURN(sockaddr_un addr, unixSocketAddress(path));

  // A socket file left by a dead worker is collected; a live one is never taken over.
  if (Status claimed = claimSocketPath(path); !claimed.ok()) {
    if (claimed.code() == Code::kAlreadyExists)
      return Status(Code::kAlreadyExists, path + " is served by a running worker");
    return claimed;
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

void setError(wire::FromWorker::Builder reply, const Status& status) {
  auto e = reply.initError();
  e.setCode(uint32_t(status.code()));
  e.setMessage(status.message());
}

}  // namespace

Result<std::unique_ptr<WorkerServer>> WorkerServer::create(
    std::unique_ptr<Backend> backend, std::shared_ptr<const Checkpoint> checkpoint,
    const WorkerOptions& options) {
  std::unique_ptr<WorkerServer> server(new WorkerServer());
  server->options_ = options;
  server->weight_digest_ = checkpoint->weightDigest();
  server->model_identity_ = checkpoint->identity();
  server->checkpoint_ = checkpoint;
  if (const int removed = LogitsArena::collectStale(); removed > 0)
    spdlog::info("removed {} stale logits arena(s)", removed);
  BULKHEAD_ASSIGN_OR_RETURN(
      server->arena_,
      LogitsArena::create(LogitsArena::arenaName(int(::getpid()), options.incarnation),
                          options.incarnation, options.arena_slots, backend->limits().vocab_size));
  server->backend_ = std::move(backend);
  Backend& b = *server->backend_;
  BULKHEAD_RETURN_IF_ERROR(b.registerOutputs(server->arena_->memory()));
  server->faults_ = options.enable_fault_injection
                        ? makeInjectedFaults(b, server->weights_mutex_, *server->arena_)
                        : std::make_unique<StepFaults>();
  server->scrubber_ =
      std::make_unique<WeightScrubber>(b, *checkpoint, server->weights_mutex_,
                                       WeightScrubber::Options{.share = options.scrub_share});
  server->runner_ = std::make_unique<StepRunner>(b, *server->arena_, *server->scrubber_,
                                                 server->weights_mutex_, *server->faults_);

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
  if (scrubber_) scrubber_->stop();
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
  options_.notifier.notify("READY=1\nSTATUS=serving on " + options_.socket_path);
  // Started here, after create() blocked SIGTERM/SIGINT, so the thread inherits the mask.
  scrubber_->start();
  while (true) {
    if (!awaitInput(listen_fd_)) {
      spdlog::info("signal received; shutting down");
      return okStatus();
    }
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    BULKHEAD_RETURN_IF_ERROR(makeNonBlocking(fd));
    // Its broker numbers steps from 1 (a broker restarted in attach mode reconnects here).
    scrubber_->restartStepNumbering();
    Result<bool> stop = serveConnection(fd);
    ::close(fd);
    if (!stop.ok()) return stop.status();
    if (*stop) return okStatus();
  }
}

void WorkerServer::watchdogIfDue() {
  const auto period = options_.notifier.watchdogPeriod();
  if (period.count() == 0) return;
  const auto now = std::chrono::steady_clock::now();
  if (now - last_watchdog_ < period) return;
  options_.notifier.notify("WATCHDOG=1");
  last_watchdog_ = now;
}

bool WorkerServer::awaitInput(int fd, bool spin) {
  // A ping that is due goes first: under steady load the next request is already waiting, and
  // neither the spin nor the poll below would reach one.
  watchdogIfDue();
  const auto period = options_.notifier.watchdogPeriod();
  if (spin && options_.spin_us > 0) {
    // The next step usually follows a reply within the broker's sampling time: watch for it
    // awake, but not past the next ping. A stop signal is seen in poll below once the spin ends.
    auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(options_.spin_us);
    if (period.count() > 0) until = std::min(until, last_watchdog_ + period);
    if (watchAwake(fd, until) != SocketWatch::kTimedOut) return true;
  }
  while (true) {
    watchdogIfDue();
    pollfd fds[2] = {{fd, POLLIN, 0}, {signal_fd_, POLLIN, 0}};
    const int ready = ::poll(fds, 2, period.count() == 0 ? -1 : int(period.count()));
    if (ready < 0 && errno != EINTR) return true;  // the read that follows reports the error
    if (ready <= 0) continue;
    if (fds[1].revents & POLLIN) return false;
    return true;
  }
}

Status WorkerServer::sendHello(int fd) {
  const BackendLimits& limits = backend_->limits();
  capnp::MallocMessageBuilder message;
  auto hello = message.initRoot<wire::FromWorker>().initHello();
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
  hello.setWeightBytes(limits.resident_weight_bytes + limits.streamed_weight_bytes);
  hello.setStreamedWeightBytes(limits.streamed_weight_bytes);
  hello.setWeightDigest(weight_digest_);
  hello.setArenaName(arena_->name());
  hello.setArenaSlots(arena_->slots());
  hello.setFaultInjection(options_.enable_fault_injection);
  hello.setModelIdentity(model_identity_);
  hello.setScrubbing(scrubber_->share() > 0);
  hello.setInStepChecks(backend_->limits().checks_weight_reads);
  hello.setComputeGrowsWithRows(backend_->limits().compute_grows_with_rows);
  const auto& eos = backend_->config().eos_token_ids;
  auto eos_list = hello.initEosTokenIds(unsigned(eos.size()));
  for (size_t i = 0; i < eos.size(); ++i) eos_list.set(unsigned(i), eos[i]);
  return writeMessage(fd, message, replyDeadline());
}

Result<bool> WorkerServer::serveConnection(int fd) {
  if (!sendHello(fd).ok()) return false;
  std::vector<capnp::word> words;
  while (true) {
    if (!awaitInput(fd, /*spin=*/true)) return true;  // SIGTERM/SIGINT
    const SteadyTime arrived = SteadyTime::clock::now();
    FrameReadResult frame =
        readFrame(fd, words, arrived + std::chrono::milliseconds(options_.frame_wait_ms),
                  /*extra_fd=*/signal_fd_);
    if (frame.status.code() == Code::kAborted) return true;  // SIGTERM/SIGINT
    if (!frame.status.ok()) {
      if (frame.status.code() == Code::kInvalidArgument) {
        // The stream cannot be resynchronised: say why, then drop the connection.
        spdlog::warn("dropping connection: {}", frame.status.message());
        capnp::MallocMessageBuilder message;
        setError(message.initRoot<wire::FromWorker>(), frame.status);
        (void)writeMessage(fd, message, replyDeadline());
      } else if (frame.status.code() == Code::kDeadlineExceeded) {
        spdlog::warn("dropping connection: a request's frame did not arrive in full within {} ms",
                     options_.frame_wait_ms);
      } else if (!frame.clean_close) {
        spdlog::warn("connection ended: {}", frame.status.message());
      }
      return false;
    }
    capnp::MallocMessageBuilder message;
    auto reply = message.initRoot<wire::FromWorker>();
    ReplyForm form = ReplyForm::kMessage;
    Result<bool> stop = dispatch(words, reply, form);
    if (!stop.ok()) return stop.status();  // nothing is sent: the worker is about to exit
    if (reply.isStepDone()) {
      auto timeline = reply.getStepDone().getTimeline();
      timeline.setArrived(monotonicNanos(arrived));
      timeline.setReplying(monotonicNanos(SteadyTime::clock::now()));
    }
    if (Status sent = sendReply(fd, message, form); !sent.ok()) {
      spdlog::warn("reply not delivered: {}", sent.message());
      return false;
    }
    faults_->afterReply();
    if (*stop) return true;
  }
}

Result<bool> WorkerServer::dispatch(const std::vector<capnp::word>& words,
                                    wire::FromWorker::Builder reply, ReplyForm& form) {
  try {
    capnp::ReaderOptions reader_options;
    reader_options.traversalLimitInWords = words.size() * 4 + 1024;
    reader_options.nestingLimit = 16;
    capnp::FlatArrayMessageReader reader(kj::arrayPtr(words.data(), words.size()), reader_options);
    auto request = reader.getRoot<wire::ToWorker>();
    reply.setRequestId(request.getRequestId());
    switch (request.which()) {
      case wire::ToWorker::STEP: {
        StepOutcome outcome = runner_->run(request.getStep(), reply);
        if (outcome.verdict == StepVerdict::kFatal) {
          spdlog::critical("backend failed; exiting: {}", outcome.status.toString());
          return outcome.status;
        }
        if (outcome.verdict == StepVerdict::kRejected) setError(reply, outcome.status);
        form = outcome.form;
        return false;
      }
      case wire::ToWorker::PING: {
        // A full pass first, so the Pong vouches for every step completed so far.
        auto pong = reply.initPong();
        if (scrubber_->share() > 0) fillScrubReport(pong, scrubber_->fullPass());
        return false;
      }
      case wire::ToWorker::HEARTBEAT:
        reply.initPong().setCleanThrough(scrubber_->cleanThrough());
        return false;
      case wire::ToWorker::RELEASE:
        reply.setReleased();
        return false;
      case wire::ToWorker::SHUTDOWN:
        reply.setShuttingDown();
        return true;
      case wire::ToWorker::FAULT_INJECT: {
        auto f = request.getFaultInject();
        const std::optional<Fault> fault = fromWire(f.getKind());
        Status armed =
            !fault ? invalidArgument("unknown fault kind " + std::to_string(unsigned(f.getKind())))
                   : faults_->arm({.fault = *fault,
                                   .row = f.getRow(),
                                   .delay_ms = f.getDelayMillis(),
                                   .byte_offset = f.getByteOffset(),
                                   .bit = f.getBit(),
                                   .between_steps = f.getBetweenSteps()});
        if (armed.ok()) {
          reply.setFaultArmed();
        } else {
          setError(reply, armed);
        }
        return false;
      }
      default:
        setError(reply,
                 invalidArgument("unknown request kind " + std::to_string(int(request.which()))));
        return false;
    }
  } catch (const kj::Exception& e) {
    spdlog::warn("malformed message: {}", e.getDescription().cStr());
    reply.setRequestId(0);
    setError(reply,
             invalidArgument(std::string("malformed message: ") + e.getDescription().cStr()));
    return false;
  }
}

Status WorkerServer::sendReply(int fd, capnp::MessageBuilder& message, ReplyForm form) {
  switch (form) {
    case ReplyForm::kGarbage: {
      static const char garbage[16] = {'\x13', '\x37', 'n', 'o', 't', ' ', 'a',    ' ',
                                       'f',    'r',    'a', 'm', 'e', '!', '\xff', '\xfe'};
      if (::send(fd, garbage, sizeof(garbage), MSG_NOSIGNAL) < 0) return unavailable("send failed");
      return okStatus();
    }
    case ReplyForm::kTruncated: {
      kj::Array<capnp::word> flat = capnp::messageToFlatArray(message);
      const auto bytes = flat.asBytes();
      return writeFrame(fd, bytes.begin(), (bytes.size() / 2) & ~size_t(7), replyDeadline());
    }
    case ReplyForm::kMessage:
      break;
  }
  return writeMessage(fd, message, replyDeadline());
}

}  // namespace bulkhead

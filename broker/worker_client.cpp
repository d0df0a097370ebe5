// WorkerClient: process spawning with a readiness pipe and a pidfd, framed Cap'n Proto calls with
// deadlines, and verification of every logits row before it is handed out.
#include "broker/worker_client.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <thread>

#include <capnp/serialize.h>
#include <spdlog/spdlog.h>

#include "proto/fault_wire.h"
#include "proto/worker.capnp.h"

namespace bulkhead {
namespace {

using std::chrono::milliseconds;
using Kind = WorkerFailure::Kind;

SteadyTime after(milliseconds timeout) {
  return std::chrono::steady_clock::now() + timeout;
}

WorkerFailure failure(Kind kind, std::string message) {
  return workerFailure(kind, std::move(message));
}

int connectUnix(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) return -1;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// The process serving a connected Unix socket, as the kernel names it in this process's pid
// namespace (SO_PEERCRED: the peer that listened); -1 if it cannot be read.
pid_t peerPid(int fd) {
  ucred peer{};
  socklen_t len = sizeof(peer);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &len) != 0) return -1;
  return peer.pid;
}

// Parses reply_words as a FromWorker and runs `use` on it; malformed content is a protocol
// violation (Cap'n Proto validates lazily, so every access happens inside the try).
template <typename F>
WorkerFailure withReply(const std::vector<capnp::word>& words, uint64_t request_id, F&& use) {
  try {
    capnp::ReaderOptions options;
    options.traversalLimitInWords = words.size() * 4 + 1024;
    options.nestingLimit = 16;
    capnp::FlatArrayMessageReader reader(kj::arrayPtr(words.data(), words.size()), options);
    auto reply = reader.getRoot<wire::FromWorker>();
    if (reply.getRequestId() != request_id) {
      return failure(Kind::kProtocolViolation, "reply to request " +
                                                   std::to_string(reply.getRequestId()) +
                                                   ", expected " + std::to_string(request_id));
    }
    if (reply.isError()) {
      auto e = reply.getError();
      WorkerFailure f = failure(Kind::kRejected, e.getMessage());
      f.code = e.getCode() <= 16 ? Code(e.getCode()) : Code::kUnknown;
      return f;
    }
    return use(reply);
  } catch (const kj::Exception& e) {
    return failure(Kind::kProtocolViolation,
                   std::string("malformed reply: ") + e.getDescription().cStr());
  }
}

// The step's own check of the weight words its kernels read, as StepDone reports it: none, or the
// integrity failure naming the tensor and which check failed.
WorkerFailure weightReadsFailure(wire::WeightReads::Reader reads, uint64_t step_id) {
  if (reads.getFailedTensor().size() == 0) return WorkerFailure{};
  WorkerFailure bad =
      failure(Kind::kIntegrityFailure,
              "step " + std::to_string(step_id) + " read " + std::string(reads.getFailedTensor()) +
                  " wrongly: " + std::string(reads.getWhy()) + " (in-step check)");
  switch (reads.getFailedCheck()) {
    case wire::WeightCheck::SLOT_TAG:
      bad.check = IntegrityCheck::kSlotTag;
      break;
    case wire::WeightCheck::ARITHMETIC:
      bad.check = IntegrityCheck::kArithmetic;
      break;
    default:  // READS, and any value this build does not know: the strictest reading
      bad.check = IntegrityCheck::kWeightReads;
      break;
  }
  return bad;
}

// StepDone's row references against the rows a step asked for, (sequence, token index) each in
// slots from `first_slot`, every row's header checked in the arena; the rows into `rows`, in
// request order.
WorkerFailure checkRows(const LogitsArena& arena, uint64_t incarnation, uint64_t step_id,
                        uint32_t first_slot, std::span<const std::pair<uint64_t, uint32_t>> asked,
                        capnp::List<wire::RowRef>::Reader refs, std::vector<PendingRow>& rows) {
  rows.reserve(asked.size());
  for (size_t r = 0; r < asked.size(); ++r) {
    const auto [sequence_id, token_index] = asked[r];
    auto ref = refs[unsigned(r)];
    RowExpectation expect{.incarnation = incarnation,
                          .step_id = step_id,
                          .sequence_id = sequence_id,
                          .token_index = token_index,
                          .slot = ref.getSlot(),
                          .reported_checksum = ref.getChecksum()};
    if (ref.getSequenceId() != sequence_id || ref.getTokenIndex() != token_index)
      return failure(Kind::kProtocolViolation, "StepDone rows out of order");
    if (ref.getSlot() != first_slot + r) {
      WorkerFailure bad =
          failure(Kind::kIntegrityFailure, "row " + std::to_string(r) + " in slot " +
                                               std::to_string(ref.getSlot()) + ", asked for slot " +
                                               std::to_string(first_slot + r));
      bad.check = IntegrityCheck::kSlotRange;
      return bad;
    }
    IntegrityCheck check = IntegrityCheck::kNone;
    auto row = arena.checkHeader(expect, &check);
    if (!row.ok()) {
      WorkerFailure bad = failure(Kind::kIntegrityFailure, row.status().message());
      bad.check = check;
      return bad;
    }
    rows.push_back({*row, expect.reported_checksum});
  }
  return WorkerFailure{};
}

ScrubStatus readScrub(wire::ScrubReport::Reader report) {
  ScrubStatus s;
  s.clean_through = report.getCleanThrough();
  for (auto c : report.getCorruptions()) {
    s.corruptions.push_back({c.getTensor(), c.getOffset(), c.getBytes(), c.getSuspectFromStep()});
  }
  return s;
}

}  // namespace

WorkerResult<std::unique_ptr<WorkerClient>> WorkerClient::spawn(const SpawnOptions& o) {
  std::unique_ptr<WorkerClient> client(new WorkerClient());
  std::error_code ec;
  std::string dir = o.socket_dir;
  if (dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/bulkhead-XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr)
      return failure(Kind::kStartFailed,
                     "cannot create a socket directory: " + std::string(std::strerror(errno)));
    dir = templ;
    client->owned_socket_dir_ = dir;
  } else {
    std::filesystem::create_directories(dir, ec);
    std::filesystem::permissions(dir, std::filesystem::perms::owner_all, ec);
  }
  uint64_t incarnation = o.incarnation;
  while (incarnation == 0) {
    if (::getrandom(&incarnation, sizeof(incarnation), 0) != ssize_t(sizeof(incarnation)))
      return failure(Kind::kStartFailed, "getrandom failed");
  }
  char name[64];
  std::snprintf(name, sizeof(name), "/worker-%016llx.sock",
                static_cast<unsigned long long>(incarnation));
  const std::string socket_path = dir + name;

  std::vector<std::string> args = {o.worker_path,
                                   "--model",
                                   o.model_dir,
                                   "--socket",
                                   socket_path,
                                   "--backend",
                                   o.backend,
                                   "--incarnation",
                                   std::to_string(incarnation),
                                   "--arena-slots",
                                   std::to_string(o.arena_slots),
                                   "--ready-fd",
                                   "3"};
  if (o.kv_blocks != 0) {
    args.push_back("--kv-blocks");
    args.push_back(std::to_string(o.kv_blocks));
  }
  if (o.enable_fault_injection) args.push_back("--enable-fault-injection");
  args.insert(args.end(), o.extra_args.begin(), o.extra_args.end());
  auto child = ChildProcess::spawn(args);
  if (!child.ok()) return failure(Kind::kStartFailed, child.status().message());
  client->child_ = std::move(*child);

  const SteadyTime deadline = after(o.start_timeout);
  while (true) {
    // In slices of 100 ms, so the caller hears from us while a large model loads.
    const SteadyTime slice = std::min(deadline, after(milliseconds(100)));
    auto ready = client->child_.waitReady(slice);
    if (ready.ok()) break;
    if (ready.status().code() != Code::kDeadlineExceeded)
      return client->connectionLost("worker exited during start", deadline);
    if (slice >= deadline)
      return failure(Kind::kTimedOut,
                     "worker not ready within " + std::to_string(o.start_timeout.count()) + " ms");
    if (o.waiting) o.waiting();
  }
  client->fd_ = connectUnix(socket_path);
  if (client->fd_ < 0)
    return failure(Kind::kStartFailed,
                   "cannot connect to " + socket_path + ": " + std::strerror(errno));
  if (Status s = makeNonBlocking(client->fd_); !s.ok())
    return failure(Kind::kStartFailed, s.message());
  WorkerFailure f = client->handshake(deadline);
  if (!f.ok()) return f;
  return client;
}

WorkerResult<std::unique_ptr<WorkerClient>> WorkerClient::connect(const std::string& socket_path,
                                                                  milliseconds timeout) {
  std::unique_ptr<WorkerClient> client(new WorkerClient());
  client->fd_ = connectUnix(socket_path);
  if (client->fd_ < 0)
    return failure(Kind::kStartFailed,
                   "cannot connect to " + socket_path + ": " + std::strerror(errno));
  if (Status s = makeNonBlocking(client->fd_); !s.ok())
    return failure(Kind::kStartFailed, s.message());
  WorkerFailure f = client->handshake(after(timeout));
  if (!f.ok()) return f;
  return client;
}

WorkerResult<std::unique_ptr<WorkerClient>> WorkerClient::attach(
    const std::string& socket_path, uint64_t replaced, milliseconds timeout,
    const std::atomic<bool>* stopping, const std::function<void()>& waiting) {
  const SteadyTime deadline = after(timeout);
  // Systemd gives no event for "the restarted worker listens": ask again, backing off to 200 ms.
  milliseconds wait{5};
  WorkerFailure last = failure(Kind::kStartFailed, "no worker listens on " + socket_path);
  while (true) {
    const auto left =
        std::chrono::duration_cast<milliseconds>(deadline - std::chrono::steady_clock::now());
    auto client = connect(socket_path, std::max(milliseconds(1), left));
    if (client.ok() && (*client)->hello().incarnation != replaced) {
      // The process to watch, and to SIGKILL if it is replaced, is the one the kernel says
      // listens on the socket, never the pid the Hello claims: a confused or hostile peer could
      // name any process (and a worker in another pid namespace names its own numbering).
      const pid_t pid = peerPid((*client)->fd_);
      if (pid <= 1 || pid == ::getpid())
        return failure(Kind::kStartFailed, "worker on " + socket_path +
                                               ": the socket's peer is pid " + std::to_string(pid) +
                                               ", not a worker process the broker may watch");
      if (pid != pid_t((*client)->hello().pid))
        spdlog::warn(
            "worker on {}: its Hello says pid {}, the socket's peer is pid {} (another "
            "pid namespace?); watching {}",
            socket_path, (*client)->hello().pid, pid, pid);
      const int pidfd = int(::syscall(SYS_pidfd_open, pid, 0));
      if (pidfd < 0)
        return failure(Kind::kStartFailed,
                       "worker on " + socket_path + " (pid " + std::to_string(pid) +
                           "): cannot watch its process: " + std::strerror(errno));
      (*client)->attached_pidfd_ = pidfd;
      return client;
    }
    if (!client.ok()) last = client.error();
    if (stopping != nullptr && stopping->load()) return last;
    if (std::chrono::steady_clock::now() + wait >= deadline) return last;
    if (waiting) waiting();
    std::this_thread::sleep_for(wait);
    wait = std::min(wait * 2, milliseconds(200));
  }
}

WorkerFailure WorkerClient::handshake(SteadyTime deadline) {
  FrameReadResult frame = readFrame(fd_, reply_words_, deadline, child_.exitFd());
  if (!frame.status.ok()) {
    if (frame.status.code() == Code::kDeadlineExceeded)
      return fail(failure(Kind::kTimedOut, "no Hello from the worker"));
    if (frame.status.code() == Code::kInvalidArgument)
      return fail(failure(Kind::kProtocolViolation, "Hello: " + frame.status.message()));
    return fail(connectionLost("connection lost before Hello", deadline));
  }
  WorkerFailure f = withReply(reply_words_, 0, [&](wire::FromWorker::Reader reply) {
    if (!reply.isHello()) return failure(Kind::kProtocolViolation, "first message is not Hello");
    auto h = reply.getHello();
    if (h.getProtocolVersion() != wire::PROTOCOL_VERSION)
      return failure(Kind::kProtocolViolation,
                     "worker speaks protocol " + std::to_string(h.getProtocolVersion()) +
                         ", the broker " + std::to_string(wire::PROTOCOL_VERSION));
    hello_.pid = h.getPid();
    hello_.incarnation = h.getIncarnation();
    hello_.backend = h.getBackend();
    hello_.architecture = h.getArchitecture();
    hello_.model_dir = h.getModelDir();
    hello_.vocab_size = h.getVocabSize();
    hello_.max_context = h.getMaxContext();
    hello_.kv_block_size = h.getKvBlockSize();
    hello_.kv_block_count = h.getKvBlockCount();
    hello_.max_step_tokens = h.getMaxStepTokens();
    hello_.arena_slots = h.getArenaSlots();
    hello_.weight_bytes = h.getWeightBytes();
    hello_.streamed_weight_bytes = h.getStreamedWeightBytes();
    hello_.weight_digest = h.getWeightDigest();
    hello_.fault_injection = h.getFaultInjection();
    for (uint32_t id : h.getEosTokenIds()) hello_.eos_token_ids.push_back(id);
    hello_.model_identity = h.getModelIdentity();
    hello_.scrubbing = h.getScrubbing();
    hello_.in_step_checks = h.getInStepChecks();
    hello_.compute_grows_with_rows = h.getComputeGrowsWithRows();
    // Each would leave every step empty: requests admitted and never answered.
    if (hello_.vocab_size == 0 || hello_.kv_block_size == 0 || hello_.kv_block_count == 0 ||
        hello_.max_step_tokens == 0 || hello_.arena_slots == 0)
      return failure(Kind::kProtocolViolation, "Hello has zero limits");
    auto arena = LogitsArena::open(h.getArenaName(), hello_.incarnation, hello_.vocab_size);
    if (!arena.ok()) return failure(Kind::kProtocolViolation, arena.status().message());
    arena_ = std::move(*arena);
    if (arena_->slots() < hello_.arena_slots)
      return failure(Kind::kProtocolViolation, "arena smaller than Hello claims");
    return WorkerFailure{};
  });
  return f.ok() ? f : fail(f);
}

WorkerClient::~WorkerClient() {
  if (fd_ >= 0) ::close(fd_);
  if (attached_pidfd_ >= 0) {
    // Replaced: a worker the broker stopped trusting must not serve again; systemd starts a
    // fresh one. After shutdown() the worker stays up for the next broker.
    if (!let_go_) {
      (void)::syscall(SYS_pidfd_send_signal, attached_pidfd_, SIGKILL, nullptr, 0);
      if (arena_) arena_->unlink();
    }
    ::close(attached_pidfd_);
  }
  if (child_.running()) {
    child_.kill();
    // A killed worker cannot remove its own arena.
    if (arena_) arena_->unlink();
  }
  if (!owned_socket_dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(owned_socket_dir_, ec);
  }
}

void WorkerClient::kill(int signal) {
  child_.signal(signal);
}

Status WorkerClient::sendRaw(const void* bytes, size_t size) {
  if (::send(fd_, bytes, size, MSG_NOSIGNAL) != ssize_t(size))
    return unavailable(std::string("send: ") + std::strerror(errno));
  return okStatus();
}

WorkerFailure WorkerClient::fail(WorkerFailure f) {
  if (f.kind != Kind::kRejected && broken_by_.ok()) broken_by_ = f;
  return f;
}

WorkerFailure WorkerClient::connectionLost(const std::string& what, SteadyTime wait_until) {
  if (!child_.running() && child_.pid() <= 0) return failure(Kind::kExited, what);
  // The socket closing usually means the process is exiting: give it until the deadline.
  ExitInfo info;
  if (child_.waitExit(std::min(wait_until, after(milliseconds(2000))), &info)) {
    if (arena_) arena_->unlink();
    WorkerFailure f = failure(Kind::kExited, what + " (" + info.describe() + ")");
    f.signal = info.signal;
    f.exit_code = info.exit_code;
    return f;
  }
  return failure(Kind::kProtocolViolation, what + " while the process is still running");
}

WorkerFailure WorkerClient::unusable() const {
  WorkerFailure f = broken_by_;
  f.message = "connection unusable after an earlier failure: " + f.message;
  return f;
}

WorkerFailure WorkerClient::send(capnp::MessageBuilder& request, SteadyTime deadline) {
  if (!broken_by_.ok()) return unusable();
  Status sent = writeMessage(fd_, request, deadline);
  if (sent.ok()) return {};
  if (sent.code() == Code::kDeadlineExceeded)
    return fail(failure(Kind::kTimedOut, "request not accepted: " + sent.message()));
  return fail(connectionLost("connection lost while sending: " + sent.message(), deadline));
}

WorkerFailure WorkerClient::receive(SteadyTime deadline) {
  if (!broken_by_.ok()) return unusable();
  FrameReadResult frame = readFrame(fd_, reply_words_, deadline, child_.exitFd());
  if (frame.status.ok()) return {};
  switch (frame.status.code()) {
    case Code::kDeadlineExceeded:
      return fail(failure(Kind::kTimedOut, "no reply by the deadline"));
    case Code::kInvalidArgument:
      return fail(failure(Kind::kProtocolViolation, "unframed reply: " + frame.status.message()));
    case Code::kAborted:
      return fail(connectionLost("worker process ended", deadline));
    default:
      return fail(connectionLost(frame.status.message(), deadline));
  }
}

WorkerFailure WorkerClient::roundTrip(capnp::MessageBuilder& request, SteadyTime deadline) {
  if (!in_flight_.empty())
    return fail(failure(Kind::kProtocolViolation, "a request sent with " +
                                                      std::to_string(in_flight_.size()) +
                                                      " step(s) awaiting their replies"));
  if (WorkerFailure f = send(request, deadline); !f.ok()) return f;
  return receive(deadline);
}

WorkerFailure WorkerClient::sendStep(uint64_t step_id, std::span<const SequenceStep> batch,
                                     uint32_t first_slot, milliseconds timeout) {
  if (in_flight_.size() >= kMaxStepsInFlight)
    return fail(failure(Kind::kProtocolViolation,
                        "more than " + std::to_string(kMaxStepsInFlight) + " steps in flight"));
  capnp::MallocMessageBuilder message;
  auto request = message.initRoot<wire::ToWorker>();
  SentStep sent;
  sent.request_id = next_request_id_++;
  sent.step_id = step_id;
  sent.first_slot = first_slot;
  request.setRequestId(sent.request_id);
  auto step = request.initStep();
  step.setStepId(step_id);
  step.setFirstSlot(first_slot);
  auto seqs = step.initSequences(unsigned(batch.size()));
  for (size_t i = 0; i < batch.size(); ++i) {
    const SequenceStep& s = batch[i];
    auto out = seqs[unsigned(i)];
    out.setSequenceId(s.sequence_id);
    out.setStartPosition(s.start_position);
    auto put = [](auto list, std::span<const uint32_t> values) {
      for (size_t k = 0; k < values.size(); ++k) list.set(unsigned(k), values[k]);
    };
    put(out.initTokens(unsigned(s.tokens.size())), s.tokens);
    put(out.initKvBlocks(unsigned(s.kv_blocks.size())), s.kv_blocks);
    put(out.initLogitsRows(unsigned(s.logits_rows.size())), s.logits_rows);
    for (uint32_t token_index : s.logits_rows) sent.rows.emplace_back(s.sequence_id, token_index);
  }
  sent.sent_at = SteadyTime::clock::now();
  sent.timeout = timeout;
  sent.behind_another = !in_flight_.empty();
  if (WorkerFailure f = send(message, sent.sent_at + timeout); !f.ok()) return f;
  in_flight_.push_back(std::move(sent));
  return {};
}

std::chrono::microseconds defaultReplySpin() {
  return std::chrono::microseconds(std::thread::hardware_concurrency() >= 8 ? 50 : 0);
}

ReplyWatch replyWatch(SteadyTime start, std::span<const SteadyTime::duration> recent_waits,
                      std::chrono::microseconds spin) {
  if (recent_waits.empty()) return {start - spin, start + spin};
  const auto [shortest, longest] = std::minmax_element(recent_waits.begin(), recent_waits.end());
  return {start + *shortest - spin, start + std::min(*longest, *shortest + *shortest / 4) + spin};
}

void WorkerClient::watchForReply(SteadyTime start) {
  // A step usually takes about as long as one of the last few did; a window around the last
  // one alone misses a reply a little earlier or later than it (a CPU worker's steps vary by
  // more than the spin).
  const auto [wake, until] = replyWatch(
      start, std::span(recent_waits_).first(std::min(waits_seen_, kWaitHistory)), reply_spin_);
  SteadyTime now = SteadyTime::clock::now();
  if (now < wake) {
    // A sleeping thread's timers may fire up to its timer slack late (50 us by default): as
    // long as the watch before the reply is due. This thread's sleeps end on time.
    thread_local const bool on_time = ::prctl(PR_SET_TIMERSLACK, 1000UL) == 0;
    (void)on_time;
    const auto nanos = std::chrono::duration_cast<std::chrono::nanoseconds>(wake - now).count();
    const timespec sleep = {time_t(nanos / 1'000'000'000), long(nanos % 1'000'000'000)};
    pollfd fd = {fd_, POLLIN, 0};
    // Ready early (a reply, the connection closing) or an error: the read that follows handles it.
    const int ready = ::ppoll(&fd, 1, &sleep, nullptr);
    if (reply_waking_) reply_waking_(true);
    if (ready != 0) return;
    now = SteadyTime::clock::now();
  } else if (reply_waking_) {
    reply_waking_(true);
  }
  switch (watchAwake(fd_, std::max(until, now + reply_spin_))) {
    case SocketWatch::kReadable:
      ++replies_seen_awake_;
      return;
    case SocketWatch::kClosed:  // the read that follows says why
      return;
    case SocketWatch::kTimedOut:
      if (reply_waking_) reply_waking_(false);  // back to sleep until the reply comes
      return;
  }
}

WorkerResult<StepReply> WorkerClient::awaitStep() {
  if (in_flight_.empty())
    return fail(failure(Kind::kProtocolViolation, "awaiting a step that was not sent"));
  const SentStep sent = std::move(in_flight_.front());
  in_flight_.pop_front();
  // The worker computes steps in order: one sent behind another starts when that one's reply
  // came (or later), and its time runs from there.
  const SteadyTime start =
      sent.behind_another ? std::max(sent.sent_at, last_step_reply_) : sent.sent_at;
  if (reply_spin_.count() > 0) watchForReply(start);
  WorkerFailure received = receive(start + sent.timeout);
  last_step_reply_ = SteadyTime::clock::now();
  recent_waits_[waits_seen_++ % kWaitHistory] = last_step_reply_ - start;
  if (!received.ok()) return received;

  StepReply result;
  WorkerFailure f = withReply(reply_words_, sent.request_id, [&](wire::FromWorker::Reader reply) {
    if (!reply.isStepDone()) return failure(Kind::kProtocolViolation, "reply is not StepDone");
    auto done = reply.getStepDone();
    if (done.getStepId() != sent.step_id)
      return failure(Kind::kProtocolViolation, "StepDone for step " +
                                                   std::to_string(done.getStepId()) +
                                                   ", expected " + std::to_string(sent.step_id));
    auto refs = done.getRows();
    if (refs.size() != sent.rows.size())
      return failure(Kind::kProtocolViolation, "StepDone carries " + std::to_string(refs.size()) +
                                                   " rows, expected " +
                                                   std::to_string(sent.rows.size()));
    result.compute_micros = done.getComputeMicros();
    auto timeline = done.getTimeline();
    result.timeline = {.sent = monotonicNanos(sent.sent_at),
                       .arrived = timeline.getArrived(),
                       .compute_start = timeline.getComputeStart(),
                       .compute_end = timeline.getComputeEnd(),
                       .replying = timeline.getReplying(),
                       .read = monotonicNanos(last_step_reply_)};
    result.scrub = readScrub(done.getScrub());
    auto reads = done.getWeightReads();
    if (hello_.in_step_checks && !reads.getChecked())
      return failure(Kind::kProtocolViolation, "StepDone lacks the in-step weight check");
    if (WorkerFailure bad = weightReadsFailure(reads, sent.step_id); !bad.ok()) return bad;
    return checkRows(*arena_, hello_.incarnation, sent.step_id, sent.first_slot, sent.rows, refs,
                     result.rows);
  });
  // A rejected step, or rows that failed verification, leave the stream in step: the connection
  // stays usable (the caller decides whether to retry or replace the worker). Anything else
  // breaks it.
  if (!f.ok()) {
    // A corruption report must not be lost with the rows it came with: it rides on the next one.
    carried_corruptions_.insert(carried_corruptions_.end(), result.scrub.corruptions.begin(),
                                result.scrub.corruptions.end());
    return f.kind == Kind::kRejected || f.kind == Kind::kIntegrityFailure ? f : fail(f);
  }
  takeCarried(result.scrub);
  return result;
}
WorkerFailure WorkerClient::simpleCall(capnp::MessageBuilder& message, int expected_which,
                                       milliseconds timeout) {
  const uint64_t request_id = message.getRoot<wire::ToWorker>().getRequestId();
  if (WorkerFailure f = roundTrip(message, after(timeout)); !f.ok()) return f;
  WorkerFailure f = withReply(reply_words_, request_id, [&](wire::FromWorker::Reader reply) {
    if (int(reply.which()) != expected_which)
      return failure(Kind::kProtocolViolation, "unexpected reply kind");
    return WorkerFailure{};
  });
  return f.ok() || f.kind == Kind::kRejected ? f : fail(f);
}

WorkerResult<ScrubStatus> WorkerClient::ping(milliseconds timeout) {
  capnp::MallocMessageBuilder message;
  auto request = message.initRoot<wire::ToWorker>();
  const uint64_t request_id = next_request_id_++;
  request.setRequestId(request_id);
  request.setPing();
  if (WorkerFailure f = roundTrip(message, after(timeout)); !f.ok()) return f;
  ScrubStatus status;
  WorkerFailure f = withReply(reply_words_, request_id, [&](wire::FromWorker::Reader reply) {
    if (!reply.isPong()) return failure(Kind::kProtocolViolation, "reply is not Pong");
    status = readScrub(reply.getPong());
    return WorkerFailure{};
  });
  if (!f.ok()) return f.kind == Kind::kRejected ? f : fail(f);
  takeCarried(status);
  return status;
}

void WorkerClient::takeCarried(ScrubStatus& status) {
  status.corruptions.insert(status.corruptions.begin(), carried_corruptions_.begin(),
                            carried_corruptions_.end());
  carried_corruptions_.clear();
}

WorkerFailure WorkerClient::heartbeat(milliseconds timeout) {
  capnp::MallocMessageBuilder message;
  auto request = message.initRoot<wire::ToWorker>();
  request.setRequestId(next_request_id_++);
  request.setHeartbeat();
  return simpleCall(message, int(wire::FromWorker::PONG), timeout);
}

WorkerFailure WorkerClient::release(std::span<const uint64_t> ids, milliseconds timeout) {
  capnp::MallocMessageBuilder message;
  auto request = message.initRoot<wire::ToWorker>();
  request.setRequestId(next_request_id_++);
  auto list = request.initRelease(unsigned(ids.size()));
  for (size_t i = 0; i < ids.size(); ++i) list.set(unsigned(i), ids[i]);
  return simpleCall(message, int(wire::FromWorker::RELEASED), timeout);
}

WorkerFailure WorkerClient::injectFault(const FaultSpec& fault, milliseconds timeout) {
  capnp::MallocMessageBuilder message;
  auto request = message.initRoot<wire::ToWorker>();
  request.setRequestId(next_request_id_++);
  auto f = request.initFaultInject();
  f.setKind(toWire(fault.fault));
  f.setRow(fault.row);
  f.setDelayMillis(fault.delay_ms);
  f.setByteOffset(fault.byte_offset);
  f.setBit(fault.bit);
  f.setBetweenSteps(fault.between_steps);
  return simpleCall(message, int(wire::FromWorker::FAULT_ARMED), timeout);
}

WorkerFailure WorkerClient::shutdown(milliseconds timeout) {
  if (attached_pidfd_ >= 0) {
    // Attach mode: the worker is systemd's to stop; the broker only lets go of it.
    let_go_ = true;
    broken_by_ = failure(Kind::kExited, "worker was let go");
    return {};
  }
  capnp::MallocMessageBuilder message;
  auto request = message.initRoot<wire::ToWorker>();
  request.setRequestId(next_request_id_++);
  request.setShutdown();
  const SteadyTime deadline = after(timeout);
  WorkerFailure f = simpleCall(message, int(wire::FromWorker::SHUTTING_DOWN), timeout);
  if (!f.ok()) return f;
  if (child_.running()) {
    ExitInfo info;
    if (!child_.waitExit(deadline, &info))
      return fail(failure(Kind::kTimedOut, "worker did not exit after Shutdown"));
    if (info.signal != 0 || info.exit_code != 0) {
      WorkerFailure bad =
          failure(Kind::kExited, "worker exited uncleanly after Shutdown: " + info.describe());
      bad.signal = info.signal;
      bad.exit_code = info.exit_code;
      return fail(bad);
    }
  }
  broken_by_ = failure(Kind::kExited, "worker was shut down");
  return {};
}

}  // namespace bulkhead

#include "server/streams/socket_streams.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpc/slice.h"
#include "server/streams/stream_reactor.h"

namespace attention::server {
namespace {

constexpr uint64_t kEndBit = uint64_t{1} << 63;
constexpr int kLengthBytes = 8;
constexpr int kMagicBytes = sizeof(SocketStreams::kHelloMagic) - 1;
constexpr int kHelloBytes = kMagicBytes + SocketStreams::kNonceBytes;
// A request's bytes are read into slices of at most this, allocated as the bytes arrive: a client
// that announces a large request and sends little holds little.
constexpr size_t kReadSliceBytes = size_t{16} << 20;
// A thread with nothing to do still wakes this often (a cancelled call, the stall timeout).
constexpr int kTickMs = 100;
// How long the end frame may wait for room in the socket's send buffer.
constexpr int kEndFrameWaitMs = 200;
// Gathered writes: a response's slices at most this many per sendmsg.
constexpr int kMaxIov = 64;

void PutU64(char* to, uint64_t value) {
  for (int i = 0; i < 8; ++i) to[i] = static_cast<char>(value >> (8 * i));
}

uint64_t GetU64(const unsigned char* from) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | from[i];
  return value;
}

void Ring(int event_fd) {
  const uint64_t one = 1;
  (void)!write(event_fd, &one, sizeof(one));
}

void Drain(int event_fd) {
  uint64_t count;
  (void)!read(event_fd, &count, sizeof(count));
}

bool WouldBlock(int error) { return error == EAGAIN || error == EWOULDBLOCK; }

absl::Status Broken(absl::string_view what) {
  return absl::CancelledError(absl::StrCat("socket ", what, ": ", std::strerror(errno)));
}

}  // namespace

struct SocketStreams::Pending {
  Call* call;
  grpc::CallbackServerContext* context;
  const StreamMethod* method;
  v1::SocketClosed* response;
  absl::Time deadline;  // the hello timeout
};

// The Open call: answered when its socket ends (or when its connection never comes). A cancel is
// a flag its waiter (the acceptor, then the socket's thread) reads and a ring of that waiter's
// eventfd; the lock guards only that fd, so no other lock is ever taken under it.
class SocketStreams::Call final : public grpc::ServerUnaryReactor {
 public:
  void OnCancel() override {
    cancelled_.store(true);
    std::lock_guard<std::mutex> lock(mu_);
    if (wake_fd_ >= 0) Ring(wake_fd_);
  }
  void OnDone() override { delete this; }
  // Whom a cancel wakes (-1: nobody), set before the waiter changes or goes.
  void SetWake(int fd) {
    std::lock_guard<std::mutex> lock(mu_);
    wake_fd_ = fd;
  }
  bool cancelled() const { return cancelled_.load(); }

 private:
  std::atomic<bool> cancelled_{false};
  std::mutex mu_;
  int wake_fd_ = -1;  // guarded by mu_
};

// One socket's StreamFlow: StreamFlow's operations (StartRead, StartWrite, Finish) are requests to
// the socket's thread, which does every read and write on the non-blocking connection and
// reports their completions; it sleeps in poll() on the connection and its eventfd.
class SocketStreams::Flow final : public StreamFlow<Flow> {
  using Base = StreamFlow<Flow>;

 public:
  // `closing` runs as the socket closes, before its end frame goes. `broken` is what the
  // requests' CallContext reads as cancelled, beside the call's own cancellation.
  Flow(int fd, const StreamMethod& method, StreamProcess process, Call* call,
       v1::SocketClosed* response, const SocketStreamOptions& options,
       std::shared_ptr<std::atomic<bool>> broken, absl::AnyInvocable<void() &&> closing)
      : Base(method, std::move(process)),
        fd_(fd),
        wake_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)),
        options_(options),
        call_(call),
        response_(response),
        broken_flag_(std::move(broken)),
        closing_(std::move(closing)) {}
  ~Flow() {
    if (fd_ >= 0) close(fd_);
    if (wake_fd_ >= 0) close(wake_fd_);
  }

  bool usable() const { return wake_fd_ >= 0; }
  int wake_fd() const { return wake_fd_; }
  // Starts the flow; it holds itself until its call is answered.
  void Begin(const std::shared_ptr<Flow>& self) { Base::Begin(self); }

  // StreamFlow's operations, with its lock held, on the socket's thread or a worker's.
  void StartRead(grpc::ByteBuffer* request) {
    {
      std::lock_guard<std::mutex> lock(ops_mu_);
      read_into_ = request;
    }
    Ring(wake_fd_);
  }
  void StartWrite(const grpc::ByteBuffer* response) {
    {
      std::lock_guard<std::mutex> lock(ops_mu_);
      write_from_ = response;
    }
    Ring(wake_fd_);
  }
  void Finish(const grpc::Status& status) {
    {
      std::lock_guard<std::mutex> lock(ops_mu_);
      finish_ = status;
    }
    Ring(wake_fd_);
  }
  // On the socket's thread: its next read waits for it, as on the other transports.
  template <typename Work>
  void RunProcess(size_t /*bytes*/, Work work) {
    std::move(work)();
  }

  // The socket's thread, until the socket ends and its call is answered.
  void Serve();

 private:
  // A request being read: its length word, then its bytes into slices.
  struct In {
    unsigned char length_word[kLengthBytes];
    int length_got = 0;
    uint64_t length = 0;
    uint64_t got = 0;
    std::vector<grpc::Slice> slices;
    size_t last_fill = 0;  // bytes in slices.back()
  };
  // A response being written: its length word, then its slices.
  struct Out {
    char length_word[kLengthBytes];
    std::vector<grpc::Slice> slices;
    size_t total = 0;
    size_t sent = 0;
    absl::Time since;  // when the client last took some of its bytes (or it was handed over)
  };
  enum class Read { kMore, kRequest, kEnd };

  // Reads what the connection holds of the current request.
  absl::StatusOr<Read> ReadSome();
  // Writes what the connection takes of out_; true once all of it is written.
  absl::StatusOr<bool> SendSome();
  // The socket is found broken (`status`): no more reads or writes; it ends with `status` once its
  // requests in flight are done.
  void Break(absl::Status status);
  // The write outstanding will not be written: reported as failed, so the flow can end.
  void FailWrite();
  // The last step: the end frame, the connection shut, the call answered.
  void Close(const grpc::Status& flow_status);

  const int fd_;
  const int wake_fd_;
  const SocketStreamOptions options_;
  Call* const call_;
  v1::SocketClosed* const response_;
  const std::shared_ptr<std::atomic<bool>> broken_flag_;
  absl::AnyInvocable<void() &&> closing_;
  // The socket's thread's own.
  In in_;
  std::optional<Out> out_;
  absl::Status broken_;       // why the socket ends, when it is the connection's fault
  bool frames_whole_ = true;  // no response was cut off mid-frame (the end frame can follow)
  int64_t requests_read_ = 0;
  int64_t answered_ = 0;
  std::mutex ops_mu_;  // guards the three below
  grpc::ByteBuffer* read_into_ = nullptr;
  const grpc::ByteBuffer* write_from_ = nullptr;
  std::optional<grpc::Status> finish_;
};

absl::StatusOr<SocketStreams::Flow::Read> SocketStreams::Flow::ReadSome() {
  while (in_.length_got < kLengthBytes) {
    const ssize_t n = recv(fd_, in_.length_word + in_.length_got, kLengthBytes - in_.length_got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (WouldBlock(errno)) return Read::kMore;
      return Broken("read");
    }
    if (n == 0) {
      if (in_.length_got == 0) return Read::kEnd;  // the client's side shut at a frame boundary
      return absl::CancelledError(absl::StrCat("socket request ", requests_read_,
                                               ": the connection closed inside its "
                                               "length word"));
    }
    in_.length_got += static_cast<int>(n);
    if (in_.length_got < kLengthBytes) continue;
    in_.length = GetU64(in_.length_word);
    if ((in_.length & kEndBit) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("socket request ", requests_read_, ": length word ", in_.length,
                       " has bit 63 set (the server's end frame); expected a request's length"));
    }
    if (in_.length > static_cast<uint64_t>(options_.max_message_bytes)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("socket request ", requests_read_, ": length ", in_.length,
                       " exceeds the server's largest message, ", options_.max_message_bytes,
                       " bytes (--max_message_mb)"));
    }
  }
  while (in_.got < in_.length) {
    if (in_.slices.empty() || in_.last_fill == in_.slices.back().size()) {
      const size_t size = std::min<uint64_t>(kReadSliceBytes, in_.length - in_.got);
      in_.slices.emplace_back(grpc_slice_malloc(size), grpc::Slice::STEAL_REF);
      in_.last_fill = 0;
    }
    grpc::Slice& slice = in_.slices.back();
    // A slice this thread just allocated and nobody else holds: its bytes are ours to write.
    auto* to = const_cast<uint8_t*>(slice.begin()) + in_.last_fill;
    const ssize_t n = recv(fd_, to, slice.size() - in_.last_fill, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (WouldBlock(errno)) return Read::kMore;
      return Broken("read");
    }
    if (n == 0) {
      return absl::CancelledError(absl::StrCat("socket request ", requests_read_,
                                               ": the connection closed after ", in_.got,
                                               " of its ", in_.length, " bytes"));
    }
    in_.last_fill += static_cast<size_t>(n);
    in_.got += static_cast<uint64_t>(n);
  }
  return Read::kRequest;
}

absl::StatusOr<bool> SocketStreams::Flow::SendSome() {
  while (out_->sent < out_->total) {
    iovec iov[kMaxIov];
    int count = 0;
    size_t skip = out_->sent;
    auto add = [&](const void* data, size_t size) {
      if (count == kMaxIov) return;
      if (skip >= size) {
        skip -= size;
        return;
      }
      iov[count++] = {const_cast<char*>(static_cast<const char*>(data)) + skip, size - skip};
      skip = 0;
    };
    add(out_->length_word, kLengthBytes);
    for (const grpc::Slice& slice : out_->slices) add(slice.begin(), slice.size());
    msghdr message{};
    message.msg_iov = iov;
    message.msg_iovlen = static_cast<size_t>(count);
    const ssize_t n = sendmsg(fd_, &message, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (WouldBlock(errno)) return false;
      return Broken("write");
    }
    out_->sent += static_cast<size_t>(n);
    out_->since = absl::Now();  // the client reads: no stall
  }
  return true;
}

void SocketStreams::Flow::Break(absl::Status status) {
  if (broken_.ok()) broken_ = std::move(status);
  broken_flag_->store(true);
  Base::Cancelled();
}

void SocketStreams::Flow::FailWrite() {
  if (out_.has_value() && out_->sent > 0) frames_whole_ = false;
  out_.reset();
  {
    std::lock_guard<std::mutex> lock(ops_mu_);
    write_from_ = nullptr;
  }
  Base::WriteDone(false);
}

void SocketStreams::Flow::Serve() {
  while (true) {
    grpc::ByteBuffer* read_into;
    const grpc::ByteBuffer* write_from;
    std::optional<grpc::Status> finish;
    {
      std::lock_guard<std::mutex> lock(ops_mu_);
      read_into = read_into_;
      write_from = write_from_;
      finish = finish_;
    }
    if (finish.has_value()) {
      if (read_into != nullptr) {  // the read left outstanding completes, not ok
        {
          std::lock_guard<std::mutex> lock(ops_mu_);
          read_into_ = nullptr;
        }
        Base::ReadDone(false);
      }
      return Close(*finish);
    }
    bool progressed = false;
    if (write_from != nullptr) {
      if (!broken_.ok()) {
        FailWrite();
        continue;
      }
      if (!out_.has_value()) {
        out_.emplace();
        if (!write_from->Dump(&out_->slices).ok()) {
          out_->slices.clear();  // an empty response: the length word alone
        }
        out_->total = kLengthBytes + write_from->Length();
        PutU64(out_->length_word, write_from->Length());
        out_->since = absl::Now();
      }
      absl::StatusOr<bool> sent = SendSome();
      if (!sent.ok()) {
        Break(sent.status());
        FailWrite();
        continue;
      }
      if (*sent) {
        out_.reset();
        ++answered_;
        {
          std::lock_guard<std::mutex> lock(ops_mu_);
          write_from_ = nullptr;
        }
        Base::WriteDone(true);
        continue;
      }
      if (absl::Now() - out_->since >= options_.stall_timeout) {
        // The client read nothing of the answer for that long: it is not reading. The socket ends
        // (its thread and its place among --max_sockets freed) instead of waiting.
        Break(absl::DeadlineExceededError(
            absl::StrCat("socket responses: the client read none of an answer's bytes for ",
                         absl::FormatDuration(options_.stall_timeout),
                         " (--socket_stall_timeout_s); the socket is closed")));
        FailWrite();
        continue;
      }
    }
    if (read_into != nullptr && broken_.ok()) {
      absl::StatusOr<Read> read = ReadSome();
      if (!read.ok()) {
        Break(read.status());
        progressed = true;
      } else if (*read != Read::kMore) {
        if (*read == Read::kRequest) {
          if (in_.slices.empty()) in_.slices.emplace_back();  // an empty request
          *read_into = grpc::ByteBuffer(in_.slices.data(), in_.slices.size());
          ++requests_read_;
        }
        in_ = In();
        {
          std::lock_guard<std::mutex> lock(ops_mu_);
          read_into_ = nullptr;
        }
        Base::ReadDone(*read == Read::kRequest);
        progressed = true;
      }
    }
    if (call_->cancelled() && broken_.ok()) {
      // The client went (or the server shuts down): nothing more is read or written.
      Break(absl::CancelledError("socket: its Sockets.Open call was cancelled"));
      progressed = true;
    }
    if (progressed) continue;
    pollfd fds[2] = {{fd_, 0, 0}, {wake_fd_, POLLIN, 0}};
    if (broken_.ok()) {
      if (read_into != nullptr) fds[0].events |= POLLIN;
      if (write_from != nullptr) fds[0].events |= POLLOUT;
    } else {
      fds[0].fd = -1;  // nothing more is read or written
    }
    if (poll(fds, 2, kTickMs) < 0 && errno != EINTR) {
      Break(Broken("poll"));
      continue;
    }
    if ((fds[1].revents & POLLIN) != 0) Drain(wake_fd_);
    // Hung up or failed with nothing asked of it (a full window, a request being computed): the
    // connection is gone; asked, the read or write says why.
    if ((fds[0].revents & (POLLHUP | POLLERR)) != 0 && (fds[0].events & (POLLIN | POLLOUT)) == 0) {
      Break(absl::CancelledError("socket: the connection closed"));
    }
  }
}

void SocketStreams::Flow::Close(const grpc::Status& flow_status) {
  // A broken socket says why; otherwise StreamFlow's status (OK once the client shut its side
  // and every answer was written, a failed request's status naming it, or CANCELLED).
  const grpc::Status status = broken_.ok() ? flow_status : ToGrpcStatus(broken_);
  // Counted closed before the end frame goes: a client that read it sees the socket gone.
  std::move(closing_)();
  if (frames_whole_) {
    // The end frame, best effort (a client gone or not reading does not get it).
    const std::string& text = status.error_message();
    std::string frame(kLengthBytes + 4, '\0');
    PutU64(frame.data(), kEndBit | (4 + text.size()));
    const auto code = static_cast<uint32_t>(status.error_code());
    for (int i = 0; i < 4; ++i) frame[kLengthBytes + i] = static_cast<char>(code >> (8 * i));
    frame += text;
    size_t sent = 0;
    const absl::Time until = absl::Now() + absl::Milliseconds(kEndFrameWaitMs);
    while (sent < frame.size() && absl::Now() < until) {
      const ssize_t n = send(fd_, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
      if (n > 0) {
        sent += static_cast<size_t>(n);
      } else if (n < 0 && (WouldBlock(errno) || errno == EINTR)) {
        pollfd fd = {fd_, POLLOUT, 0};
        poll(&fd, 1, 10);
      } else {
        break;
      }
    }
  }
  shutdown(fd_, SHUT_RDWR);
  response_->set_requests(answered_);
  call_->SetWake(-1);
  call_->Finish(status);
  std::shared_ptr<Flow> self = Base::Release();
}

SocketStreams::SocketStreams(const StreamMethods* methods, const CallGate* gate,
                             SocketStreamOptions options)
    : methods_(methods), gate_(gate), options_(options), metrics_(gate->metrics()) {}

SocketStreams::~SocketStreams() { Stop(); }

absl::StatusOr<int> SocketStreams::Listen(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int error =
          getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found);
      error != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--socket_port: cannot resolve ", host, ": ", gai_strerror(error)));
  }
  std::string why = "no address";
  for (addrinfo* a = found; a != nullptr && listen_fd_ < 0; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 128) == 0) {
      listen_fd_ = fd;
    } else {
      why = std::strerror(errno);
      close(fd);
    }
  }
  freeaddrinfo(found);
  if (listen_fd_ < 0) {
    return absl::UnavailableError(
        absl::StrCat("--socket_port: cannot listen on ", host, ":", port, ": ", why));
  }
  sockaddr_storage bound{};
  socklen_t length = sizeof(bound);
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &length);
  const int chosen =
      ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                        : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  acceptor_ = std::thread([this] { Accept(); });
  return chosen;
}

grpc::ServerUnaryReactor* SocketStreams::Open(grpc::CallbackServerContext* context,
                                              const v1::OpenSocketRequest* request,
                                              v1::SocketClosed* response) {
  const absl::Time arrival = absl::Now();
  auto* call = new Call;
  // A refused socket is counted as a call (rpc="OpenSocket"); a served one is not: its requests
  // are counted as the stream method's.
  auto refuse = [&](const absl::Status& status) {
    gate_->Refuse("OpenSocket", *context, arrival, status,
                  [call](absl::Status status) { call->Finish(ToGrpcStatus(status)); });
    return call;
  };
  if (absl::Status token = gate_->Authenticate(*context); !token.ok()) return refuse(token);
  if (request->method() != v1::RING_METHOD_ATTEND && request->method() != v1::RING_METHOD_STEP) {
    return refuse(absl::InvalidArgumentError(
        absl::StrCat("method: expected RING_METHOD_ATTEND or RING_METHOD_STEP, got ",
                     v1::RingMethod_Name(request->method()))));
  }
  const bool attend = request->method() == v1::RING_METHOD_ATTEND;
  const StreamMethod* method = methods_->Find(attend ? kAttendStreamPath : kStepStreamPath);
  if (method == nullptr) {
    return refuse(absl::UnimplementedError(
        absl::StrCat("method: ", v1::RingMethod_Name(request->method()), " is not served here (no ",
                     attend ? "Attention" : "Sessions", " service)")));
  }
  if (request->nonce().size() != kNonceBytes) {
    return refuse(absl::InvalidArgumentError(
        absl::StrCat("nonce: expected ", kNonceBytes, " bytes, got ", request->nonce().size())));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (stopped_ || listen_fd_ < 0) return refuse(absl::UnavailableError("server is shutting down"));
  if (const int served = serving_.load(); served >= options_.max_sockets) {
    return refuse(absl::ResourceExhaustedError(
        absl::StrCat("sockets: ", served, " served or waiting for their connection, at most ",
                     options_.max_sockets, " at once (--max_sockets)")));
  }
  if (pending_.count(request->nonce()) != 0) {
    return refuse(absl::AlreadyExistsError("nonce: another Sockets.Open waits with it"));
  }
  pending_.emplace(request->nonce(), Pending{.call = call,
                                             .context = context,
                                             .method = method,
                                             .response = response,
                                             .deadline = arrival + options_.hello_timeout});
  call->SetWake(wake_fd_);  // a cancel wakes the acceptor, which answers it
  metrics_->SetSocketStreams(serving_.fetch_add(1) + 1);
  WakeAcceptor();  // its connection may be parked there already
  return call;
}

bool SocketStreams::Bind(int fd, const std::string& nonce) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopped_) {
    close(fd);
    return true;
  }
  auto it = pending_.find(nonce);
  if (it == pending_.end()) return false;
  const Pending pending = it->second;
  pending_.erase(it);
  auto broken = std::make_shared<std::atomic<bool>>(false);
  CallContext context{.grpc = pending.context, .cancelled = [context = pending.context, broken] {
                        return context->IsCancelled() || broken->load();
                      }};
  auto flow =
      std::make_shared<Flow>(fd, *pending.method, pending.method->open(std::move(context)),
                             pending.call, pending.response, options_, std::move(broken),
                             [this] { metrics_->SetSocketStreams(serving_.fetch_sub(1) - 1); });
  if (!flow->usable()) {
    pending.call->SetWake(-1);
    metrics_->SetSocketStreams(serving_.fetch_sub(1) - 1);
    pending.call->Finish(ToGrpcStatus(
        absl::ResourceExhaustedError(absl::StrCat("eventfd: ", std::strerror(errno)))));
    return true;  // the flow closes fd
  }
  pending.call->SetWake(flow->wake_fd());
  flow->Begin(flow);
  servers_.Reap();
  servers_.Start([flow]() mutable { flow->Serve(); });
  return true;
}

void SocketStreams::ExpirePendingLocked(absl::Time now, bool all) {
  for (auto it = pending_.begin(); it != pending_.end();) {
    const Pending& pending = it->second;
    absl::Status status;
    if (all) {
      status = absl::UnavailableError("server is shutting down");
    } else if (pending.call->cancelled()) {
      status = absl::CancelledError("the call was cancelled before its connection came");
    } else if (now >= pending.deadline) {
      status = absl::DeadlineExceededError(
          absl::StrCat("no connection brought this call's nonce to the socket port within ",
                       absl::FormatDuration(options_.hello_timeout)));
    } else {
      ++it;
      continue;
    }
    pending.call->SetWake(-1);
    metrics_->SetSocketStreams(serving_.fetch_sub(1) - 1);
    pending.call->Finish(ToGrpcStatus(status));
    it = pending_.erase(it);
  }
}

void SocketStreams::WakeAcceptor() {
  if (wake_fd_ >= 0) Ring(wake_fd_);
}

void SocketStreams::Accept() {
  struct Hello {
    int fd;
    absl::Time deadline;
    char bytes[kHelloBytes];
    int got = 0;
  };
  // Connections whose hello is not complete, then those whose nonce no call has brought yet: a
  // client sends its Open and connects at once, and the call may reach the server second.
  std::vector<Hello> hellos;
  std::vector<Hello> parked;
  std::vector<pollfd> fds;
  while (!stopping_.load()) {
    fds.assign({{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}});
    for (const Hello& hello : hellos) fds.push_back({hello.fd, POLLIN, 0});
    poll(fds.data(), fds.size(), kTickMs);
    if ((fds[1].revents & POLLIN) != 0) Drain(wake_fd_);
    const absl::Time now = absl::Now();
    std::vector<Hello> waiting;
    for (size_t i = 0; i < hellos.size(); ++i) {
      Hello& hello = hellos[i];
      bool drop = now >= hello.deadline;
      if (!drop && fds[i + 2].revents != 0) {
        const ssize_t n = recv(hello.fd, hello.bytes + hello.got, kHelloBytes - hello.got, 0);
        if (n > 0) {
          hello.got += static_cast<int>(n);
        } else if (n == 0 || !(WouldBlock(errno) || errno == EINTR)) {
          drop = true;
        }
      }
      if (!drop && hello.got == kHelloBytes) {
        if (std::memcmp(hello.bytes, kHelloMagic, kMagicBytes) == 0) {
          parked.push_back(hello);
        } else {
          close(hello.fd);
        }
      } else if (drop) {
        close(hello.fd);
      } else {
        waiting.push_back(hello);
      }
    }
    hellos.swap(waiting);
    waiting.clear();
    for (const Hello& hello : parked) {
      if (Bind(hello.fd, std::string(hello.bytes + kMagicBytes, kNonceBytes))) continue;
      if (now >= hello.deadline) {
        close(hello.fd);  // no call brought its nonce in time
      } else {
        waiting.push_back(hello);
      }
    }
    parked.swap(waiting);
    if ((fds[0].revents & POLLIN) != 0) {
      while (true) {
        const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;  // none left, or an error the next poll sees again
        if (static_cast<int>(hellos.size() + parked.size()) >= kMaxHellos) {
          close(fd);
          continue;
        }
        const int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        hellos.push_back({.fd = fd, .deadline = now + options_.hello_timeout, .bytes = {}});
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    ExpirePendingLocked(now, /*all=*/false);
  }
  for (const Hello& hello : hellos) close(hello.fd);
  for (const Hello& hello : parked) close(hello.fd);
}

void SocketStreams::Stop() {
  ServiceThreads servers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
    stopped_ = true;
    ExpirePendingLocked(absl::Now(), /*all=*/true);
    servers = std::move(servers_);
  }
  stopping_.store(true);
  WakeAcceptor();
  if (acceptor_.joinable()) acceptor_.join();
  servers.JoinAll();
  if (listen_fd_ >= 0) close(listen_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

}  // namespace attention::server

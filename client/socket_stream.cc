#include "client/socket_stream.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/session.h"

namespace attention::client {
namespace {

constexpr char kMagic[] = "ATTNSOCK";
constexpr int kNonceBytes = 32;
constexpr uint64_t kEndBit = uint64_t{1} << 63;
constexpr int kLengthBytes = 8;

void PutU64(char* to, uint64_t value) {
  for (int i = 0; i < 8; ++i) to[i] = static_cast<char>(value >> (8 * i));
}

uint64_t GetU64(const char* from) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | static_cast<unsigned char>(from[i]);
  return value;
}

// The host of a gRPC target of one address: "host:port", "[v6]:port", "dns:///host:port",
// "ipv4:host:port"; empty for a Unix socket or several addresses.
std::string TargetHost(std::string target) {
  if (target.rfind("unix:", 0) == 0 || target.find(',') != std::string::npos) return "";
  for (const char* scheme : {"dns:///", "dns:", "ipv4:", "ipv6:"}) {
    if (target.rfind(scheme, 0) == 0) {
      target = target.substr(std::strlen(scheme));
      break;
    }
  }
  const size_t colon = target.rfind(':');
  std::string host = colon == std::string::npos ? target : target.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host.empty() ? "localhost" : host;
}

// A blocking TCP connection to host:port with TCP_NODELAY, or why not.
absl::StatusOr<int> Connect(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int error = getaddrinfo(host.c_str(), service.c_str(), &hints, &found); error != 0) {
    return absl::UnavailableError(
        absl::StrCat("socket stream: cannot resolve ", host, ": ", gai_strerror(error)));
  }
  std::string why = "no address";
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      why = std::strerror(errno);
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("socket stream: cannot connect to ", host, ":", port, ": ", why));
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

bool SendAll(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = send(fd, data, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SocketStream>> SocketStream::Open(
    Client& client, v1::RingMethod method, const SocketStreamOptions& options) {
  SocketStreamOptions resolved = options;
  if (resolved.host.empty()) {
    resolved.host = TargetHost(client.options().target);
    if (resolved.host.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("socket stream: the Client's target \"", client.options().target,
                       "\" is not one host; set SocketStreamOptions::host"));
    }
  }
  if (resolved.port == 0) {
    absl::StatusOr<v1::ServerInfo> info = client.GetServerInfo();
    if (!info.ok()) return info.status();
    if (info->socket_port() == 0) {
      return absl::UnimplementedError(
          "socket stream: the server serves none (ServerInfo.socket_port is 0; it needs "
          "--socket_port)");
    }
    resolved.port = info->socket_port();
  }
  std::string nonce(kNonceBytes, '\0');
  std::random_device random;
  for (char& c : nonce) c = static_cast<char>(random());
  auto stream = std::unique_ptr<SocketStream>(new SocketStream(client, method, resolved, nonce));
  absl::StatusOr<int> fd = Connect(resolved.host, resolved.port);
  if (!fd.ok()) return fd.status();  // the destructor cancels the call
  stream->fd_ = *fd;
  const std::string hello = absl::StrCat(absl::string_view(kMagic, 8), nonce);
  if (!SendAll(stream->fd_, hello.data(), hello.size())) {
    return absl::UnavailableError(absl::StrCat("socket stream: the hello to ", resolved.host, ":",
                                               resolved.port, " failed: ", std::strerror(errno)));
  }
  return stream;
}

SocketStream::SocketStream(Client& client, v1::RingMethod method,
                           const SocketStreamOptions& options, std::string nonce)
    : stub_(v1::Sockets::NewStub(client.channel())),
      // No deadline: the call lasts as long as the socket.
      context_(client.NewContext({.deadline = absl::InfiniteDuration()})) {
  if (!options.owner.empty()) context_->AddMetadata(kSessionOwnerHeader, options.owner);
  request_.set_method(method);
  request_.set_nonce(std::move(nonce));
  stub_->async()->Open(context_.get(), &request_, &response_, [this](grpc::Status /*status*/) {
    std::lock_guard<std::mutex> lock(mu_);
    call_done_ = true;
    call_ended_.notify_all();
  });
}

SocketStream::~SocketStream() {
  if (fd_ >= 0) {
    Finish();
    close(fd_);
  }
  // The call ends once the server closed the socket; cancelled if it has not.
  context_->TryCancel();
  std::unique_lock<std::mutex> lock(mu_);
  call_ended_.wait(lock, [this] { return call_done_; });
}

bool SocketStream::Write(const google::protobuf::MessageLite& request) {
  if (over_ || writes_done_) return false;
  const size_t size = request.ByteSizeLong();
  buffer_.resize(kLengthBytes + size);
  PutU64(buffer_.data(), size);
  request.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(buffer_.data()) +
                                          kLengthBytes);
  if (!SendAll(fd_, buffer_.data(), buffer_.size())) {
    Break(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                       absl::StrCat("socket stream: write: ", std::strerror(errno))));
    return false;
  }
  return true;
}

bool SocketStream::ReadFrame(std::string* body) {
  if (over_) return false;
  char word[kLengthBytes];
  if (!ReadExactly(word, kLengthBytes)) return false;
  const uint64_t length = GetU64(word);
  body->resize(length & ~kEndBit);
  if (!ReadExactly(body->data(), body->size())) return false;
  if ((length & kEndBit) == 0) return true;
  // The end frame: the stream's status (u32 code, then the message).
  if (body->size() < 4) {
    Break(grpc::Status(grpc::StatusCode::DATA_LOSS,
                       absl::StrCat("socket stream: an end frame of ", body->size(),
                                    " bytes; expected at least 4 (the status code)")));
    return false;
  }
  uint32_t code = 0;
  for (int i = 3; i >= 0; --i) code = (code << 8) | static_cast<unsigned char>((*body)[i]);
  Break(grpc::Status(static_cast<grpc::StatusCode>(code), body->substr(4)));
  return false;
}

bool SocketStream::Read(google::protobuf::MessageLite* response) {
  std::string body;
  if (!ReadFrame(&body)) return false;
  if (!response->ParseFromString(body)) {
    Break(
        grpc::Status(grpc::StatusCode::DATA_LOSS,
                     absl::StrCat("socket stream: expected a serialized ", response->GetTypeName(),
                                  ", got ", body.size(), " bytes that do not parse as one")));
    return false;
  }
  return true;
}

void SocketStream::WritesDone() {
  if (writes_done_ || fd_ < 0) return;
  writes_done_ = true;
  shutdown(fd_, SHUT_WR);
}

grpc::Status SocketStream::Finish() {
  WritesDone();
  std::string discarded;
  while (ReadFrame(&discarded)) {
  }
  return status_;
}

bool SocketStream::ReadExactly(char* to, size_t size) {
  while (size > 0) {
    const ssize_t n = recv(fd_, to, size, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      Break(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                         n == 0 ? std::string("socket stream: the server closed the connection")
                                : absl::StrCat("socket stream: read: ", std::strerror(errno))));
      return false;
    }
    to += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

void SocketStream::Break(grpc::Status error) {
  if (!over_) status_ = std::move(error);
  over_ = true;
}

}  // namespace attention::client

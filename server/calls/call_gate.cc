#include "server/calls/call_gate.h"

#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/calls/security.h"

namespace attention::server {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

std::string RegionOwner(const grpc::ServerContextBase& context, const std::string& auth_token) {
  // Keys of the two kinds never collide: a peer starts with its scheme ("ipv4:", "unix:").
  return auth_token.empty() ? absl::StrCat("peer ", context.peer())
                            : absl::StrCat("token ", auth_token);
}

CallLog::CallLog(CallLogOptions options) : options_(std::move(options)) {}

void CallLog::Ended(absl::string_view rpc, const absl::Status& status, absl::Duration elapsed,
                    absl::string_view peer) {
  const absl::Time now = absl::Now();
  std::string line;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (now - window_start_ >= absl::Seconds(1)) {
      window_start_ = now;
      written_in_window_ = 0;
    }
    if (written_in_window_ >= options_.max_lines_per_s) {
      ++left_out_;
      return;
    }
    ++written_in_window_;
    line = absl::StrCat("attention_server: ", rpc, " from ", peer, " ",
                        absl::StatusCodeToString(status.code()), " after ",
                        absl::FormatDuration(elapsed));
    if (!status.ok()) absl::StrAppend(&line, ": ", status.message());
    if (left_out_ > 0) {
      absl::StrAppend(&line, " (", left_out_, " calls before it not logged: over ",
                      options_.max_lines_per_s, " lines a second)");
      left_out_ = 0;
    }
  }
  Write(line);
}

void CallLog::Flush() {
  int64_t left_out = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    left_out = std::exchange(left_out_, 0);
  }
  if (left_out > 0) {
    Write(absl::StrCat("attention_server: ", left_out, " calls not logged: over ",
                       options_.max_lines_per_s, " lines a second"));
  }
}

void CallLog::Write(const std::string& line) {
  if (options_.sink) return options_.sink(line);
  std::fprintf(stderr, "%s\n", line.c_str());
}

void CallTicket::Record(const absl::Status& status, int64_t response_bytes) const {
  const absl::Duration elapsed = absl::Now() - arrival_;
  gate_->metrics_->RequestFinished(rpc_, status.code(), elapsed, request_bytes_, response_bytes);
  if (gate_->log_->Logs(status)) gate_->log_->Ended(rpc_, status, elapsed, context_->peer());
}

CallGate::CallGate(Metrics* metrics, DrainGate* drain, std::string auth_token, CallLog* log)
    : metrics_(metrics), drain_(drain), auth_token_(std::move(auth_token)), log_(log) {}

absl::Status CallGate::Authenticate(const grpc::ServerContextBase& context) const {
  return CheckBearerToken(context.client_metadata(), auth_token_);
}

CallTicket CallGate::Admit(absl::string_view rpc, const grpc::ServerContextBase& context,
                           absl::Time arrival, int64_t request_bytes, Drain drain) const {
  metrics_->RequestStarted();
  CallTicket ticket(this, rpc, &context, arrival, request_bytes);
  ticket.admission_ = Authenticate(context);
  if (ticket.admission_.ok() && drain == Drain::kEnter) {
    ticket.entered_ = drain_->Enter();
    if (!ticket.entered_) {
      ticket.refused_ = true;
      ticket.admission_ = absl::UnavailableError("server is shutting down");
    }
  }
  return ticket;
}

void CallGate::Refuse(absl::string_view rpc, const grpc::ServerContextBase& context,
                      absl::Time arrival, const absl::Status& status,
                      absl::AnyInvocable<void(absl::Status) &&> answer) const {
  metrics_->RequestStarted();
  CallTicket(this, rpc, &context, arrival, 0).End(status, 0, std::move(answer));
}

}  // namespace attention::server

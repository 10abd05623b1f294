// What every call of the gRPC edge passes through, in one place: the bearer token, the drain (new
// calls UNAVAILABLE once the server drains, accepted ones counted until answered), the request
// metrics under the call's rpc name, the request log, and the one conversion of absl::Status
// into grpc::Status. The Attention, Sessions and SharedMemory services and the request rings
// (a ring's requests are its stream method's calls) take every call through a CallGate.
//
// A call: Admit when it arrives (counted started; token; drain), then exactly one End with its
// status once answered (its metrics, its log line, its answer, then the drain left). Nothing is
// allocated per call but a drain refusal's held answer; a CallTicket is a few words, moved into
// the call's own answer.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <utility>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "server/calls/drain_gate.h"
#include "server/metrics/metrics.h"

namespace attention::server {

// absl's canonical codes share gRPC's numbering.
grpc::Status ToGrpcStatus(const absl::Status& status);

// The owner key of the caller of `context`: its bearer token when the server checks tokens, else
// its connection (peer address and port). Regions and sessions belong to it.
std::string RegionOwner(const grpc::ServerContextBase& context, const std::string& auth_token);

// The request log: one line per call that ended with an error (level 1, the default), or per call
// (level 2), on stderr; level 0 logs nothing. At most `max_lines_per_s` lines a second: beyond
// it lines are counted, not written, and the next line written (or Flush) says how many were
// left out, so a burst of refusals (a drain's thousands of UNAVAILABLE) leaves a few lines and a
// count instead of nothing or a flood.
struct CallLogOptions {
  int level = 1;
  int max_lines_per_s = 20;
  // Where lines go (tests capture them); empty: stderr.
  std::function<void(const std::string& line)> sink;
};

class CallLog {
 public:
  explicit CallLog(CallLogOptions options = {});
  // Whether a call ending with `status` is logged at this level (before its peer is asked for).
  bool Logs(const absl::Status& status) const {
    return options_.level >= 2 || (options_.level == 1 && !status.ok());
  }
  // One call's end (CallTicket::End), when Logs.
  void Ended(absl::string_view rpc, const absl::Status& status, absl::Duration elapsed,
             absl::string_view peer);
  // Writes the count of lines left out since the last line, if any (at shutdown).
  void Flush();

 private:
  void Write(const std::string& line);

  const CallLogOptions options_;
  std::mutex mu_;  // guards the three below
  absl::Time window_start_ = absl::InfinitePast();
  int written_in_window_ = 0;
  int64_t left_out_ = 0;
};

class CallGate;

// One admitted (or refused) call until its End. Movable; End exactly once.
class CallTicket {
 public:
  CallTicket(CallTicket&&) = default;
  CallTicket& operator=(CallTicket&&) = default;

  // OK when the call may go on; else the call is to End with this status at once.
  const absl::Status& admission() const { return admission_; }
  absl::Time arrival() const { return arrival_; }

  // Ends the call with `status` (`response_bytes` sent): records its metrics and its log line,
  // runs `answer(status)` (which gives the caller its answer), then leaves the drain gate if the
  // call entered it. A call the drain turned away is ended later, when the drain releases its
  // refusals (DrainGate::Refuse). `answer`: void(absl::Status), movable.
  template <typename Answer>
  void End(absl::Status status, int64_t response_bytes, Answer answer) &&;

 private:
  friend class CallGate;
  CallTicket(const CallGate* gate, absl::string_view rpc, const grpc::ServerContextBase* context,
             absl::Time arrival, int64_t request_bytes)
      : gate_(gate),
        rpc_(rpc),
        context_(context),
        arrival_(arrival),
        request_bytes_(request_bytes) {}
  void Record(const absl::Status& status, int64_t response_bytes) const;

  const CallGate* gate_;
  absl::string_view rpc_;
  const grpc::ServerContextBase* context_;
  absl::Time arrival_;
  int64_t request_bytes_;
  absl::Status admission_;
  bool entered_ = false;  // passed the drain gate: leaves it at End
  bool refused_ = false;  // turned away by the drain gate: ended through DrainGate::Refuse
};

class CallGate {
 public:
  // Whether a call passes the drain gate: every call that computes or touches sessions does;
  // GetServerInfo and the SharedMemory calls do not.
  enum class Drain { kEnter, kSkip };

  // `metrics`, `drain` and `log` must outlive the gate. An empty `auth_token` admits every call.
  CallGate(Metrics* metrics, DrainGate* drain, std::string auth_token, CallLog* log);

  const std::string& auth_token() const { return auth_token_; }
  Metrics* metrics() const { return metrics_; }

  // Admits a call of `rpc` (a string literal: the ticket keeps the view) on `context` (which
  // outlives the ticket), arrived at `arrival` with `request_bytes`: counts it started, checks
  // the bearer token (UNAUTHENTICATED) and, with kEnter, enters the drain gate ("server is
  // shutting down", UNAVAILABLE). The ticket's admission says whether it may go on.
  CallTicket Admit(absl::string_view rpc, const grpc::ServerContextBase& context,
                   absl::Time arrival, int64_t request_bytes, Drain drain = Drain::kEnter) const;
  // The bearer token alone.
  absl::Status Authenticate(const grpc::ServerContextBase& context) const;
  // A call answered without being admitted (it is counted only when refused: OpenRing, whose
  // served rings are counted as their requests): counted started and ended with `status` at once.
  void Refuse(absl::string_view rpc, const grpc::ServerContextBase& context, absl::Time arrival,
              const absl::Status& status, absl::AnyInvocable<void(absl::Status) &&> answer) const;

 private:
  friend class CallTicket;

  Metrics* const metrics_;
  DrainGate* const drain_;
  const std::string auth_token_;
  CallLog* const log_;
};

template <typename Answer>
void CallTicket::End(absl::Status status, int64_t response_bytes, Answer answer) && {
  if (refused_) {
    // Held while the drain holds refusals: recorded and answered when they are released.
    gate_->drain_->Refuse([ticket = std::move(*this), status = std::move(status),
                           answer = std::move(answer)]() mutable {
      ticket.Record(status, 0);
      std::move(answer)(std::move(status));
    });
    return;
  }
  Record(status, response_bytes);
  const bool entered = entered_;
  DrainGate* const drain = gate_->drain_;
  std::move(answer)(std::move(status));  // may end the call's owner: nothing of this after it
  if (entered) drain->Leave();
}

}  // namespace attention::server

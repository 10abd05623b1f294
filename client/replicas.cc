#include "client/replicas.h"

#include <future>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attention::client {

absl::StatusOr<size_t> Emptiest(absl::Span<const Client* const> clients, const CallOptions& call) {
  // Every call sent before any answer is awaited: the slowest server bounds the wait, not the sum.
  std::vector<std::future<absl::StatusOr<v1::ServerInfo>>> answers;
  answers.reserve(clients.size());
  for (const Client* client : clients) answers.push_back(client->GetServerInfoAsync(call));
  std::optional<size_t> best;
  int64_t most = -1;
  std::vector<std::string> failures;
  for (size_t i = 0; i < clients.size(); ++i) {
    const std::string& target = clients[i]->options().target;
    absl::StatusOr<v1::ServerInfo> info = answers[i].get();
    if (!info.ok()) {
      failures.push_back(absl::StrCat(target, ": ", absl::StatusCodeToString(info.status().code()),
                                      ": ", info.status().message()));
      continue;
    }
    if (info->kv_pages_total() == 0) {
      failures.push_back(absl::StrCat(target, ": serves no sessions (no KV pages)"));
      continue;
    }
    const int64_t room = info->kv_pages_free() + info->kv_pages_cached();
    if (room > most) {
      best = i;
      most = room;
    }
  }
  if (!best) {
    return absl::UnavailableError(
        absl::StrCat("no replica to place a session on: ",
                     clients.empty() ? "no replica given" : absl::StrJoin(failures, "; ")));
  }
  return *best;
}

absl::StatusOr<Session> PlaceSession(absl::Span<SessionClient* const> sessions,
                                     const SessionSpec& spec, const v1::Tensor* k,
                                     const v1::Tensor* v, const CallOptions& call) {
  std::vector<const Client*> clients;
  clients.reserve(sessions.size());
  for (const SessionClient* s : sessions) clients.push_back(&s->client());
  absl::StatusOr<size_t> emptiest = Emptiest(clients, call);
  if (!emptiest.ok()) return emptiest.status();
  return sessions[*emptiest]->Create(spec, k, v, call);
}

namespace {

// `status` with the session it is about in front of its message.
absl::Status AboutSession(const std::string& id, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat("session ", id, ": ", status.message()));
}

}  // namespace

absl::StatusOr<std::vector<std::string>> Drain(SessionClient& source, SessionClient& target,
                                               const std::function<absl::Status()>& switch_fn,
                                               int64_t chunk_rows, const CallOptions& call) {
  absl::StatusOr<v1::ListSessionsResponse> listed = source.List(call);
  if (!listed.ok()) return listed.status();
  std::vector<std::string> ids;
  for (const v1::SessionInfo& info : listed->sessions()) ids.push_back(info.session_id());
  for (const std::string& id : ids) {
    absl::StatusOr<Session> copy = source.CopyTo(id, target, {}, chunk_rows, call, /*seal=*/true);
    if (!copy.ok()) return AboutSession(id, copy.status());
    copy->Release();  // it stays on `target` (a Session drops its session when destroyed)
  }
  if (switch_fn) {
    if (absl::Status status = switch_fn(); !status.ok()) return status;
  }
  for (const std::string& id : ids) {
    if (absl::Status status = source.Drop(id, call); !status.ok()) return AboutSession(id, status);
  }
  return ids;
}

}  // namespace attention::client

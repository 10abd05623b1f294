// Several replicas of attention_server from C++ (the Python client's attention_client.replicas):
// placing a new session on the replica with the most free KV pages, and draining a replica (every
// session moved to a peer under its id, as an operator's tool does before the replica stops;
// deploy/README.md, "Draining a replica").
//
//   std::vector<SessionClient*> pool = {&r1, &r2, &r3};   // one per replica, called directly
//   absl::StatusOr<Session> s = PlaceSession(pool, spec, &k, &v);   // on the one with most room
//   absl::StatusOr<std::vector<std::string>> moved =
//       Drain(r3, r2, [&] { return PointOwnerAt("r3", "r2"); });    // the router's update
//
// The clients call their replicas directly, not through the router. A moved session keeps its
// id, so its id still names the drained replica (its attention-session-owner header): the switch
// is where the router learns that the drained replica's sessions now live on the peer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/attention_client.h"
#include "client/session.h"

namespace attention::client {

// The index in `clients` of the server with the most room for a new session: its free KV pages
// and those of cached prefixes no session holds, taken back when needed (ServerInfo's
// kv_pages_free + kv_pages_cached; pages of its own size), the first of equals. Every server is
// asked at once (GetServerInfoAsync). A server that does not answer, or serves no sessions
// (kv_pages_total 0), is passed over; UNAVAILABLE naming each server (ClientOptions::target) and
// its failure when none is left.
absl::StatusOr<size_t> Emptiest(absl::Span<const Client* const> clients,
                                const CallOptions& call = {});

// A new session (SessionClient::Create(spec, k, v)) on the server of `sessions` with the most
// room (Emptiest over their clients). Behind a router every later call about it carries its
// owner's name, so the SessionClient it landed on need not be the one used later. For a session
// from tokens or a prefix: Create or CreateFromPrefix on sessions[*Emptiest(...)].
absl::StatusOr<Session> PlaceSession(absl::Span<SessionClient* const> sessions,
                                     const SessionSpec& spec, const v1::Tensor* k = nullptr,
                                     const v1::Tensor* v = nullptr, const CallOptions& call = {});

// Moves every session `source` lists to `target` under the same ids and returns the ids.
//
// First each session is exported from `source` sealed (v1::ExportRequest::seal: from its export
// on, `source` refuses the session's AppendKv, Step, Truncate and Fork UNAVAILABLE with
// kSealedMarker, which the clients retry) and imported into `target` (the rows bit for bit);
// then `switch_fn` (when given) sends the sessions' calls to `target`, where the retries land;
// then each is dropped on `source`. So no row is appended on `source` that `target` lacks; a
// session's calls wait (retrying) from its export until the switch. With the server checking
// tokens, only the caller's sessions (those of source's bearer token) are listed and moved.
// Returns the first failure, naming the session: nothing was switched (or the switch failed) and
// the sessions exported so far stay sealed on `source` (their changes refused there: drain again,
// to this or another peer) and imported on `target`.
absl::StatusOr<std::vector<std::string>> Drain(SessionClient& source, SessionClient& target,
                                               const std::function<absl::Status()>& switch_fn = {},
                                               int64_t chunk_rows = 0,
                                               const CallOptions& call = {});

}  // namespace attention::client

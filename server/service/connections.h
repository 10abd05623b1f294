// The server's open connections as gRPC's channelz sees them (on by default:
// GRPC_ARG_ENABLE_CHANNELZ). Each connection has an id never reused in the process, so a
// connection that closed and a later one from the same address and port differ, which their peer
// strings do not. gRPC 1.51 tells the application nothing when a connection closes; the regions
// of a caller without a bearer token, which belong to its connection, are tied to its id here.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/container/flat_hash_set.h"

namespace attention::server {

// The id of the open connection whose peer is `peer` (ServerContext::peer(), e.g.
// "ipv4:127.0.0.1:49030"); -1 when channelz knows none.
int64_t ConnectionOf(const std::string& peer);

// The ids of every open connection of every server in the process; nullopt when channelz cannot
// say (then nothing may be taken for closed).
std::optional<absl::flat_hash_set<int64_t>> OpenConnections();

}  // namespace attention::server

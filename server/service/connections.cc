#include "server/service/connections.h"

#include <algorithm>
#include <vector>

#include "absl/strings/numbers.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "grpc/grpc.h"
#include "grpc/support/alloc.h"

namespace attention::server {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

// One answer of channelz's C API (JSON, owned by the caller), parsed; nullopt when there is none.
std::optional<Struct> Parse(char* json) {
  if (json == nullptr) return std::nullopt;
  Struct parsed;
  const bool ok = google::protobuf::util::JsonStringToMessage(json, &parsed).ok();
  gpr_free(json);
  if (!ok) return std::nullopt;
  return parsed;
}

// The field `name` of `object`, or an empty value when absent.
const Value& FieldOf(const Struct& object, const std::string& name) {
  static const Value* const kAbsent = new Value;
  auto it = object.fields().find(name);
  return it == object.fields().end() ? *kAbsent : it->second;
}

// An id field: channelz writes int64 ids as JSON strings; -1 when absent.
int64_t IdOf(const Struct& object, const std::string& name) {
  int64_t id = -1;
  return absl::SimpleAtoi(FieldOf(object, name).string_value(), &id) ? id : -1;
}

struct Socket {
  int64_t id;
  std::string name;  // "chttp2 " + the peer
};

// Every server socket (connection) of every server: nullopt when channelz does not answer.
std::optional<std::vector<Socket>> ServerSockets() {
  std::optional<Struct> servers = Parse(grpc_channelz_get_servers(0));
  if (!servers.has_value()) return std::nullopt;
  std::vector<Socket> sockets;
  for (const Value& server : FieldOf(*servers, "server").list_value().values()) {
    const int64_t server_id =
        IdOf(FieldOf(server.struct_value(), "ref").struct_value(), "serverId");
    if (server_id < 0) return std::nullopt;
    // Pages of sockets, by ascending id, until channelz says the end.
    int64_t start = 0;
    while (true) {
      std::optional<Struct> page = Parse(grpc_channelz_get_server_sockets(server_id, start, 0));
      if (!page.has_value()) return std::nullopt;
      const auto& refs = FieldOf(*page, "socketRef").list_value().values();
      for (const Value& ref : refs) {
        const Struct& socket = ref.struct_value();
        sockets.push_back({IdOf(socket, "socketId"), FieldOf(socket, "name").string_value()});
        start = std::max(start, sockets.back().id + 1);
      }
      if (FieldOf(*page, "end").bool_value() || refs.empty()) break;
    }
  }
  return sockets;
}

}  // namespace

int64_t ConnectionOf(const std::string& peer) {
  std::optional<std::vector<Socket>> sockets = ServerSockets();
  if (!sockets.has_value()) return -1;
  const std::string name = "chttp2 " + peer;
  for (const Socket& socket : *sockets) {
    if (socket.name == name) return socket.id;
  }
  return -1;
}

std::optional<absl::flat_hash_set<int64_t>> OpenConnections() {
  std::optional<std::vector<Socket>> sockets = ServerSockets();
  if (!sockets.has_value()) return std::nullopt;
  absl::flat_hash_set<int64_t> ids;
  for (const Socket& socket : *sockets) ids.insert(socket.id);
  return ids;
}

}  // namespace attention::server

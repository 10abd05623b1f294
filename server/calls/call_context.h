// What a request needs of the gRPC call that carries it, whichever API the call is on: the
// context (metadata for the token, the peer that owns regions, the deadline) and whether the call
// was cancelled. On the callback API the context may be asked that at any time; on the async API
// only once its done tag has come back, so the transport answers it (generic_streams.h).
#pragma once

#include <functional>

#include "grpcpp/grpcpp.h"

namespace attention::server {

struct CallContext {
  const grpc::ServerContextBase* grpc;
  std::function<bool()> cancelled;
};

// A callback-API call as its requests see it.
inline CallContext CallbackCall(const grpc::CallbackServerContext* context) {
  return {.grpc = context, .cancelled = [context] { return context->IsCancelled(); }};
}

}  // namespace attention::server

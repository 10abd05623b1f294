// Request rings (attention.v1.SharedMemory.OpenRing): AttendStream's or StepStream's messages
// passed through a ring in one of the client's system regions (proto/attention/v1/request_ring.h)
// instead of gRPC messages. Why: a co-located decode loop with one Step in flight pays loopback
// gRPC's message exchange on every Step, ~100 us on the GPU host with no service code at all
// (bench/README.md, co-located clients), more than the rest of the server's own part; through a
// ring a request costs a copy into shared memory and, only when the server sleeps, one futex wake.
//
// Each ring has a thread of its own that polls the ring's counters and takes each request (copied
// out of its slot, then processed on that thread as a message of the stream method: the same
// checks, queue, metrics and drain as on the gRPC transports). The scheduler's worker that
// answers a request writes its response straight into the next response slot (the ring's thread
// does when none is free yet), so no thread hop lies between the answer and the client. The
// bookkeeping is StreamFlow's (stream_reactor.h), as on the two gRPC transports: the stream
// window, the order requests are queued in, the first failure ending the ring with its status.
// While requests come the thread spins; after 20 ms without one it sleeps on the ring's bell,
// waking at least every ring::kServerTickMs to see a cancelled call or a shrunk region.
//
// A client that stops taking answers: the answer that finds no free response slot waits (the
// thread sleeps meanwhile; the client's bell wakes it when it takes one) at most the stall
// timeout, after which the ring ends DEADLINE_EXCEEDED; once the call is cancelled (the client
// went, or the server shuts down) or the ring broke, it is dropped, so the ring ends at once and
// never holds the server's shutdown.
//
// The ring's region is held (a RegionRegistry::Use) while the ring is served, so Unregister waits
// for the ring to end. The ring's words are the client's to write at any time: the thread keeps
// its own counters, checks every word it reads, and copies a request before parsing it.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "absl/time/time.h"
#include "attention/v1/attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/calls/call_gate.h"
#include "server/calls/service_threads.h"
#include "server/regions/region_registry.h"
#include "server/service/attention_service.h"
#include "server/service/session_service.h"

namespace attention::server {

class RequestRings {
 public:
  // `methods` (a ring method whose stream method is not there is UNIMPLEMENTED), `registry` and
  // `gate` must outlive this. At most `max_rings` rings are served at once, over every
  // caller: each holds a thread, which spins while its requests come. A refused OpenRing passes
  // `gate` (metrics, log); a ring's requests pass it as their method's calls. A ring whose
  // answer waits `stall_timeout` for a free response slot (its client stopped reading) ends
  // DEADLINE_EXCEEDED.
  RequestRings(const StreamMethods* methods, RegionRegistry* registry, const CallGate* gate,
               int max_rings, absl::Duration stall_timeout);
  // Stops, if Stop has not.
  ~RequestRings();
  RequestRings(const RequestRings&) = delete;
  RequestRings& operator=(const RequestRings&) = delete;

  // Serves the ring `request` describes for the OpenRing call `context` (whose token and the
  // shared-memory flag are already checked), answering the call when the ring ends; a ring that
  // cannot be served is answered at once (INVALID_ARGUMENT naming the field, NOT_FOUND for another
  // caller's region, RESOURCE_EXHAUSTED beyond max_rings).
  grpc::ServerUnaryReactor* Open(grpc::CallbackServerContext* context,
                                 const v1::OpenRingRequest& request, v1::RingClosed* response);

  // Once the server has shut down (so every ring's call is cancelled) and the scheduler with it
  // (so nothing is in flight): joins the rings' threads.
  void Stop();

 private:
  class Ring;
  class Flow;
  struct Memory;

  const StreamMethods* const methods_;
  RegionRegistry* const registry_;
  const CallGate* const gate_;
  const int max_rings_;
  const absl::Duration stall_timeout_;
  Metrics* const metrics_;  // the gate's
  std::mutex mu_;
  ServiceThreads servers_;       // guarded by mu_: a thread for each ring
  std::atomic<int> serving_{0};  // rings not yet closed (attention_request_rings, --max_rings)
  bool stopped_ = false;         // guarded by mu_
};

}  // namespace attention::server

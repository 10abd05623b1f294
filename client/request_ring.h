// A request ring (attention.v1.SharedMemory.OpenRing) for a client on the server's host: requests
// and responses travel through slots in a POSIX shared-memory object that client and server both
// map, with no gRPC message per request. One OpenRing call lasts as long as the ring; the layout
// and the doorbells are proto/attention/v1/request_ring.h.
//
//   attention::client::Client client({.target = "localhost:50051"});
//   auto ring = RequestRing::Open(client, v1::RING_METHOD_STEP, {.slot_bytes = 1 << 20});
//   (*ring)->Write(step_request) && (*ring)->Read(&step_response);    // as on a StepStream
//   grpc::Status status = (*ring)->Finish();
//
// Why: a decode loop with one Step in flight pays gRPC's loopback round trip on every Step, about
// 100 us per message on the GPU host (bench/results/2026-12-02-step-latency-polled-streams.md),
// whichever client API it uses. On a ring a request costs a copy into shared memory and, at most, a
// futex wake of a sleeping server; the response comes back the same way, and this client spins for
// it (one busy core) before it sleeps. The server must run with --allow_shared_memory.
//
// The ring is a region of the Client's credentials, like any other (client/shared_memory.h): the
// requests it carries may refer to that Client's regions only, so register them over the same
// Client. Its interface is PolledStream's (client/polled_stream.h), so a tool can swap one for
// the other. After an error (the server's, or one this client finds) Write and Read return false
// and Finish says why. One thread drives it; the Client must outlive it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "attention/v1/attention.grpc.pb.h"
#include "client/attention_client.h"
#include "client/shared_memory.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/grpcpp.h"
#include "proto/attention/v1/request_ring.h"

namespace attention::client {

struct RingOptions {
  // Request slots, and as many response slots: requests in flight at most (1 to 64).
  int slots = 4;
  // Each slot's bytes, its 8-byte length word included: the largest serialized request or
  // response it carries plus 8, a multiple of 64 from 4 KiB to 64 MiB.
  int64_t slot_bytes = 1 << 20;
  // The name the ring's shared-memory object is registered under; one ring per name and Client.
  std::string region = "ring";
};

class RequestRing {
 public:
  // Creates the ring's shared-memory object (RingBytes(slots, slot_bytes)), registers it over
  // `client` as options.region and starts the OpenRing call for `method` (RING_METHOD_ATTEND:
  // AttendRequest in, AttendResponse out; RING_METHOD_STEP: StepRequest in, StepResponse out).
  // INVALID_ARGUMENT for options out of the ring's limits; a failed registration's code, its
  // message prefixed with the region's name (FAILED_PRECONDITION from a server without
  // --allow_shared_memory).
  // Returns once the server serves the ring; an OpenRing the server refuses (too many rings, a
  // region it cannot use) is its status, the message prefixed "OpenRing: ".
  static absl::StatusOr<std::unique_ptr<RequestRing>> Open(const Client& client,
                                                           v1::RingMethod method,
                                                           const RingOptions& options = {});
  // Closes the ring and waits for the server to end the call (after 5 s it cancels the call);
  // then unregisters the region, unmaps and unlinks the object.
  ~RequestRing();
  RequestRing(const RequestRing&) = delete;
  RequestRing& operator=(const RequestRing&) = delete;

  // Serializes `request` straight into the next request slot, waiting while all slots are taken,
  // and posts it. false when the ring is over, closed by WritesDone, or when the request does not
  // fit a slot (Finish then returns INVALID_ARGUMENT; the ring is closed).
  bool Write(const google::protobuf::MessageLite& request);
  // Waits for the next response (in the order the server answers: match them by request_id),
  // parses it into `response` and frees its slot. false when the ring is over with no response
  // left, or when a response slot holds no valid message (Finish then returns DATA_LOSS).
  bool Read(google::protobuf::MessageLite* response);
  // Posts no more requests: the server answers those posted, then ends the call OK.
  void WritesDone();
  // WritesDone, then waits for the call to end, discarding responses not read by then (so a
  // server waiting for a free response slot can finish); the call's status, or the error this
  // client found first (a request too large, a malformed response).
  grpc::Status Finish();

 private:
  RequestRing(const Client& client, std::unique_ptr<SharedMemoryObject> object,
              std::unique_ptr<SharedMemoryClient> regions, v1::RingMethod method,
              const RingOptions& options);

  // Spins while `ready` is false and the ring is not over, up to kSpin, then sleeps on the
  // client bell; true once `ready`, false once the ring is over and still not `ready`.
  template <class Ready>
  bool Wait(Ready ready);
  // Waits until the server serves the ring (true) or ended the call (false).
  bool AwaitOpen();
  // The server serves the ring no more: it said so in the header, or the call ended.
  bool Over() const;
  // Records a client-side error (Finish returns it) and closes the ring.
  void Break(grpc::Status error);
  // Frees every response slot the server posted, unread.
  void DiscardResponses();
  // Waits, discarding responses, until the call ended and its callback left, or until `until`;
  // whether it ended.
  bool AwaitEnd(std::chrono::steady_clock::time_point until);

  const std::unique_ptr<SharedMemoryObject> object_;
  ring::RingHeader* const header_;  // at the start of object_
  const std::unique_ptr<SharedMemoryClient> regions_;
  const RingOptions options_;
  const std::unique_ptr<v1::SharedMemory::Stub> stub_;
  // The OpenRing call's state: gRPC uses them until the call's callback has run.
  const std::unique_ptr<grpc::ClientContext> context_;
  v1::OpenRingRequest request_;
  v1::RingClosed response_;
  // Set by the callback, under mu_, with call_status_: seeing it true and then taking mu_ means
  // the callback is done with this object.
  std::atomic<bool> call_done_{false};
  std::mutex mu_;
  grpc::Status call_status_;
  // This side's copies of the counters only it stores.
  uint64_t posted_ = 0;  // requests_posted
  uint64_t taken_ = 0;   // responses_taken
  bool writes_done_ = false;
  grpc::Status error_;  // the first client-side error
};

}  // namespace attention::client

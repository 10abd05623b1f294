// Tensors in shared memory (attention.v1.SharedMemory) for clients on the server's host: their
// bytes never cross the socket. The server must run with --allow_shared_memory.
//
//   auto shm = SharedMemoryObject::Create("/attn-client-1", 256 << 20);   // POSIX shm object
//   SharedMemoryClient regions(client);
//   regions.Register("inputs", *shm);                  // the whole object, mapped by the server
//   PlaceTensor(q, "inputs", 0, shm->data(), &request.mutable_q());       // q's bytes by reference
//   *request.mutable_o_ref() = MakeRef("inputs", o_offset, o_bytes);     // O written there
//
// A region belongs to this client's credentials: its bearer token, or, without one, its
// connection (so register and use a region over one Client). Regions must be unregistered
// before the object is unmapped; SharedMemoryObject unlinks its name when destroyed.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention/v1/attention.grpc.pb.h"
#include "client/attention_client.h"

namespace attention::client {

// A POSIX shared-memory object this process created and maps (shm_open, ftruncate, mmap).
class SharedMemoryObject {
 public:
  // Creates `key` ("/name") of `bytes`, failing if it exists.
  static absl::StatusOr<std::unique_ptr<SharedMemoryObject>> Create(const std::string& key,
                                                                    int64_t bytes);
  // Unmaps and unlinks it.
  ~SharedMemoryObject();
  SharedMemoryObject(const SharedMemoryObject&) = delete;
  SharedMemoryObject& operator=(const SharedMemoryObject&) = delete;

  const std::string& key() const { return key_; }
  char* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  SharedMemoryObject(std::string key, char* data, int64_t size)
      : key_(std::move(key)), data_(data), size_(size) {}
  std::string key_;
  char* data_;
  int64_t size_;
};

// A reference to bytes [offset, offset + byte_size) of region `region`.
v1::TensorRef MakeRef(const std::string& region, int64_t offset, int64_t byte_size);

// Copies `tensor`'s data to `base + offset` (the region's mapping in this process) and sets `out`
// to the same dtype and shape referring to it instead of carrying the bytes.
void PlaceTensor(const v1::Tensor& tensor, const std::string& region, int64_t offset, char* base,
                 v1::Tensor* out);

// SharedMemory calls over a Client's channel, deadline and token. The Client must outlive it.
class SharedMemoryClient {
 public:
  explicit SharedMemoryClient(const Client& client);

  // Registers bytes [offset, offset + byte_size) of the POSIX shm object `key` as `name`.
  absl::StatusOr<v1::RegionInfo> RegisterSystem(const std::string& name, const std::string& key,
                                                int64_t offset, int64_t byte_size,
                                                const CallOptions& call = {});
  // The whole object.
  absl::StatusOr<v1::RegionInfo> Register(const std::string& name, const SharedMemoryObject& object,
                                          const CallOptions& call = {});
  // Bytes [data, data + byte_size) of the object's mapping in this process (a pointer and a size
  // inside it); INVALID_ARGUMENT when they are not inside it.
  absl::StatusOr<v1::RegionInfo> Register(const std::string& name, const SharedMemoryObject& object,
                                          const char* data, int64_t byte_size,
                                          const CallOptions& call = {});
  // Registers device memory by its IPC handle (the bytes of a cudaIpcMemHandle_t) on GPU
  // `device`; see client/cuda_region.h to get one from a CUDA allocation.
  absl::StatusOr<v1::RegionInfo> RegisterCuda(const std::string& name, const std::string& handle,
                                              int device, int64_t offset, int64_t byte_size,
                                              const CallOptions& call = {});
  // Waits (bounded by the call's deadline) while a request of this caller uses it.
  absl::Status Unregister(const std::string& name, const CallOptions& call = {});
  absl::StatusOr<v1::ListRegionsResponse> List(const CallOptions& call = {});

 private:
  absl::StatusOr<v1::RegionInfo> Send(const v1::RegisterRegionRequest& request,
                                      const CallOptions& call);

  const Client& client_;
  std::unique_ptr<v1::SharedMemory::Stub> stub_;
};

}  // namespace attention::client

#include "client/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace attention::client {

absl::StatusOr<std::unique_ptr<SharedMemoryObject>> SharedMemoryObject::Create(
    const std::string& key, int64_t bytes) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("bytes: expected > 0, got ", bytes));
  }
  const int fd = shm_open(key.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("shm_open(", key, "): ", strerror(errno)));
  }
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    close(fd);
    shm_unlink(key.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("ftruncate(", key, "): ", strerror(err)));
  }
  void* data = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (data == MAP_FAILED) {
    shm_unlink(key.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("mmap(", key, "): ", strerror(err)));
  }
  return std::unique_ptr<SharedMemoryObject>(
      new SharedMemoryObject(key, static_cast<char*>(data), bytes));
}

SharedMemoryObject::~SharedMemoryObject() {
  munmap(data_, static_cast<size_t>(size_));
  shm_unlink(key_.c_str());
}

v1::TensorRef MakeRef(const std::string& region, int64_t offset, int64_t byte_size) {
  v1::TensorRef ref;
  ref.set_region(region);
  ref.set_offset(offset);
  ref.set_byte_size(byte_size);
  return ref;
}

void PlaceTensor(const v1::Tensor& tensor, const std::string& region, int64_t offset, char* base,
                 v1::Tensor* out) {
  std::memcpy(base + offset, tensor.data().data(), tensor.data().size());
  v1::Tensor placed;
  placed.set_dtype(tensor.dtype());
  *placed.mutable_shape() = tensor.shape();
  *placed.mutable_ref() = MakeRef(region, offset, static_cast<int64_t>(tensor.data().size()));
  *out = std::move(placed);
}

SharedMemoryClient::SharedMemoryClient(const Client& client)
    : client_(client), stub_(v1::SharedMemory::NewStub(client.channel())) {}

absl::StatusOr<v1::RegionInfo> SharedMemoryClient::Send(const v1::RegisterRegionRequest& request,
                                                        const CallOptions& call) {
  v1::RegionInfo info;
  std::unique_ptr<grpc::ClientContext> context = client_.NewContext(call);
  if (grpc::Status s = stub_->Register(context.get(), request, &info); !s.ok()) {
    return ToAbslStatus(s);
  }
  return info;
}

absl::StatusOr<v1::RegionInfo> SharedMemoryClient::RegisterSystem(const std::string& name,
                                                                  const std::string& key,
                                                                  int64_t offset, int64_t byte_size,
                                                                  const CallOptions& call) {
  v1::RegisterRegionRequest request;
  request.set_name(name);
  request.set_system_key(key);
  request.set_offset(offset);
  request.set_byte_size(byte_size);
  return Send(request, call);
}

absl::StatusOr<v1::RegionInfo> SharedMemoryClient::Register(const std::string& name,
                                                            const SharedMemoryObject& object,
                                                            const CallOptions& call) {
  return RegisterSystem(name, object.key(), 0, object.size(), call);
}

absl::StatusOr<v1::RegionInfo> SharedMemoryClient::Register(const std::string& name,
                                                            const SharedMemoryObject& object,
                                                            const char* data, int64_t byte_size,
                                                            const CallOptions& call) {
  const int64_t offset = data - object.data();
  if (offset < 0 || byte_size <= 0 || byte_size > object.size() - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("data, byte_size: expected bytes inside the object's ", object.size(),
                     " mapped bytes, got offset ", offset, " and ", byte_size, " bytes"));
  }
  return RegisterSystem(name, object.key(), offset, byte_size, call);
}

absl::StatusOr<v1::RegionInfo> SharedMemoryClient::RegisterCuda(const std::string& name,
                                                                const std::string& handle,
                                                                int device, int64_t offset,
                                                                int64_t byte_size,
                                                                const CallOptions& call) {
  v1::RegisterRegionRequest request;
  request.set_name(name);
  request.set_cuda_ipc_handle(handle);
  request.set_device(device);
  request.set_offset(offset);
  request.set_byte_size(byte_size);
  return Send(request, call);
}

absl::Status SharedMemoryClient::Unregister(const std::string& name, const CallOptions& call) {
  v1::UnregisterRegionRequest request;
  request.set_name(name);
  v1::UnregisterRegionResponse response;
  std::unique_ptr<grpc::ClientContext> context = client_.NewContext(call);
  return ToAbslStatus(stub_->Unregister(context.get(), request, &response));
}

absl::StatusOr<v1::ListRegionsResponse> SharedMemoryClient::List(const CallOptions& call) {
  v1::ListRegionsResponse response;
  std::unique_ptr<grpc::ClientContext> context = client_.NewContext(call);
  if (grpc::Status s = stub_->List(context.get(), v1::ListRegionsRequest(), &response); !s.ok()) {
    return ToAbslStatus(s);
  }
  return response;
}

}  // namespace attention::client

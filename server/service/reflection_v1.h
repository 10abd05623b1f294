// grpc.reflection.v1.ServerReflection, which gRPC 1.51's reflection library lacks (it serves only
// v1alpha): clients such as grpcurl and Postman try v1 first. Answers from the process's generated
// descriptor pool, which holds every service the server links (attention.v1, grpc.health.v1, the
// reflection services themselves), as the v1alpha service does.
#pragma once

#include <string>
#include <vector>

#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace attention::server {

class ReflectionV1Service final : public grpc::reflection::v1::ServerReflection::Service {
 public:
  // `services`: the full names ListServices answers.
  explicit ReflectionV1Service(std::vector<std::string> services);

  grpc::Status ServerReflectionInfo(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<grpc::reflection::v1::ServerReflectionResponse,
                               grpc::reflection::v1::ServerReflectionRequest>* stream) override;

 private:
  const std::vector<std::string> services_;
};

}  // namespace attention::server

#include "server/service/reflection_v1.h"

#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"

namespace attention::server {
namespace {

using google::protobuf::DescriptorPool;
using google::protobuf::FileDescriptor;
using grpc::reflection::v1::ServerReflectionRequest;
using grpc::reflection::v1::ServerReflectionResponse;

void SetError(grpc::StatusCode code, const std::string& message,
              ServerReflectionResponse* response) {
  response->mutable_error_response()->set_error_code(static_cast<int32_t>(code));
  response->mutable_error_response()->set_error_message(message);
}

// `file` and the files it depends on, transitively, that this stream has not sent yet (`sent`),
// the asked-for file first.
void AddFile(const FileDescriptor* file, std::set<std::string>* sent,
             ServerReflectionResponse* response) {
  if (!sent->insert(file->name()).second) return;
  google::protobuf::FileDescriptorProto proto;
  file->CopyTo(&proto);
  proto.SerializeToString(
      response->mutable_file_descriptor_response()->add_file_descriptor_proto());
  for (int i = 0; i < file->dependency_count(); ++i) AddFile(file->dependency(i), sent, response);
}

}  // namespace

ReflectionV1Service::ReflectionV1Service(std::vector<std::string> services)
    : services_(std::move(services)) {}

grpc::Status ReflectionV1Service::ServerReflectionInfo(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<ServerReflectionResponse, ServerReflectionRequest>* stream) {
  const DescriptorPool* pool = DescriptorPool::generated_pool();
  std::set<std::string> sent;  // files this stream has sent
  ServerReflectionRequest request;
  while (stream->Read(&request)) {
    ServerReflectionResponse response;
    response.set_valid_host(request.host());
    *response.mutable_original_request() = request;
    switch (request.message_request_case()) {
      case ServerReflectionRequest::kListServices:
        for (const std::string& name : services_) {
          response.mutable_list_services_response()->add_service()->set_name(name);
        }
        break;
      case ServerReflectionRequest::kFileByFilename: {
        const FileDescriptor* file = pool->FindFileByName(request.file_by_filename());
        if (file == nullptr) {
          SetError(grpc::StatusCode::NOT_FOUND,
                   absl::StrCat("file not found: ", request.file_by_filename()), &response);
        } else {
          AddFile(file, &sent, &response);
        }
        break;
      }
      case ServerReflectionRequest::kFileContainingSymbol: {
        const FileDescriptor* file =
            pool->FindFileContainingSymbol(request.file_containing_symbol());
        if (file == nullptr) {
          SetError(grpc::StatusCode::NOT_FOUND,
                   absl::StrCat("symbol not found: ", request.file_containing_symbol()), &response);
        } else {
          AddFile(file, &sent, &response);
        }
        break;
      }
      case ServerReflectionRequest::kFileContainingExtension: {
        const auto& asked = request.file_containing_extension();
        const google::protobuf::Descriptor* type =
            pool->FindMessageTypeByName(asked.containing_type());
        const google::protobuf::FieldDescriptor* extension =
            type == nullptr ? nullptr : pool->FindExtensionByNumber(type, asked.extension_number());
        if (extension == nullptr) {
          SetError(grpc::StatusCode::NOT_FOUND,
                   absl::StrCat("extension ", asked.extension_number(), " of ",
                                asked.containing_type(), " not found"),
                   &response);
        } else {
          AddFile(extension->file(), &sent, &response);
        }
        break;
      }
      case ServerReflectionRequest::kAllExtensionNumbersOfType: {
        const google::protobuf::Descriptor* type =
            pool->FindMessageTypeByName(request.all_extension_numbers_of_type());
        if (type == nullptr) {
          SetError(grpc::StatusCode::NOT_FOUND,
                   absl::StrCat("type not found: ", request.all_extension_numbers_of_type()),
                   &response);
          break;
        }
        std::vector<const google::protobuf::FieldDescriptor*> extensions;
        pool->FindAllExtensions(type, &extensions);
        auto* numbers = response.mutable_all_extension_numbers_response();
        numbers->set_base_type_name(type->full_name());
        for (const auto* extension : extensions) numbers->add_extension_number(extension->number());
        break;
      }
      case ServerReflectionRequest::MESSAGE_REQUEST_NOT_SET:
        SetError(
            grpc::StatusCode::INVALID_ARGUMENT,
            "message_request: expected one of file_by_filename, file_containing_symbol, "
            "file_containing_extension, all_extension_numbers_of_type, list_services; got none",
            &response);
        break;
    }
    if (!stream->Write(response)) break;
  }
  return context->IsCancelled() ? grpc::Status::CANCELLED : grpc::Status::OK;
}

}  // namespace attention::server

// grpc.reflection.v1.ServerReflection from the generated descriptor pool
// (frontend/grpc_reflection.h).
#include "frontend/grpc_reflection.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/descriptor.pb.h>
#include <grpcpp/grpcpp.h>

#include <set>
#include <utility>

#include "grpc/reflection/v1/reflection.grpc.pb.h"

namespace burst::server {

namespace {

namespace gp = google::protobuf;
namespace rv1 = grpc::reflection::v1;

class ReflectionV1 final : public rv1::ServerReflection::Service {
 public:
  explicit ReflectionV1(std::vector<std::string> services) : services_(std::move(services)) {}

  // One response per request, in order, until the client half-closes. A file's answer holds it
  // and every file it imports (each once), whatever earlier answers held, as v1alpha's does.
  grpc::Status ServerReflectionInfo(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<rv1::ServerReflectionResponse, rv1::ServerReflectionRequest>*
          stream) override {
    rv1::ServerReflectionRequest req;
    while (stream->Read(&req)) {
      std::set<std::string> sent;
      if (ctx->IsCancelled()) return grpc::Status::CANCELLED;
      rv1::ServerReflectionResponse resp;
      resp.set_valid_host(req.host());
      *resp.mutable_original_request() = req;
      answer(req, resp, sent);
      if (!stream->Write(resp)) return grpc::Status::CANCELLED;
    }
    return grpc::Status::OK;
  }

 private:
  static const gp::DescriptorPool* pool() { return gp::DescriptorPool::generated_pool(); }

  static void not_found(rv1::ServerReflectionResponse& resp, const std::string& what) {
    auto* e = resp.mutable_error_response();
    e->set_error_code(static_cast<int32_t>(grpc::StatusCode::NOT_FOUND));
    e->set_error_message(what + " not found");
  }

  // `file`, then each file it imports (transitively) that `sent` does not hold yet.
  static void add_file(const gp::FileDescriptor* file, std::set<std::string>& sent,
                       rv1::FileDescriptorResponse* out) {
    if (!sent.insert(file->name()).second) return;
    gp::FileDescriptorProto proto;
    file->CopyTo(&proto);
    proto.SerializeToString(out->add_file_descriptor_proto());
    for (int i = 0; i < file->dependency_count(); ++i) {
      add_file(file->dependency(i), sent, out);
    }
  }

  void answer(const rv1::ServerReflectionRequest& req, rv1::ServerReflectionResponse& resp,
              std::set<std::string>& sent) const {
    using R = rv1::ServerReflectionRequest;
    const gp::FileDescriptor* file = nullptr;
    switch (req.message_request_case()) {
      case R::kListServices:
        for (const std::string& name : services_) {
          resp.mutable_list_services_response()->add_service()->set_name(name);
        }
        return;
      case R::kFileByFilename:
        file = pool()->FindFileByName(req.file_by_filename());
        if (!file) return not_found(resp, "file '" + req.file_by_filename() + "'");
        break;
      case R::kFileContainingSymbol:
        file = pool()->FindFileContainingSymbol(req.file_containing_symbol());
        if (!file) return not_found(resp, "symbol '" + req.file_containing_symbol() + "'");
        break;
      case R::kFileContainingExtension: {
        const rv1::ExtensionRequest& x = req.file_containing_extension();
        const gp::Descriptor* type = pool()->FindMessageTypeByName(x.containing_type());
        const gp::FieldDescriptor* ext =
            type ? pool()->FindExtensionByNumber(type, x.extension_number()) : nullptr;
        if (!ext) {
          return not_found(resp, "extension " + std::to_string(x.extension_number()) + " of '" +
                                     x.containing_type() + "'");
        }
        file = ext->file();
        break;
      }
      case R::kAllExtensionNumbersOfType: {
        const gp::Descriptor* type =
            pool()->FindMessageTypeByName(req.all_extension_numbers_of_type());
        if (!type) return not_found(resp, "type '" + req.all_extension_numbers_of_type() + "'");
        std::vector<const gp::FieldDescriptor*> exts;
        pool()->FindAllExtensions(type, &exts);
        auto* out = resp.mutable_all_extension_numbers_response();
        out->set_base_type_name(type->full_name());
        for (const gp::FieldDescriptor* e : exts) out->add_extension_number(e->number());
        return;
      }
      case R::MESSAGE_REQUEST_NOT_SET: {
        auto* e = resp.mutable_error_response();
        e->set_error_code(static_cast<int32_t>(grpc::StatusCode::INVALID_ARGUMENT));
        e->set_error_message("the request names no message_request");
        return;
      }
    }
    add_file(file, sent, resp.mutable_file_descriptor_response());
  }

  std::vector<std::string> services_;
};

}  // namespace

std::unique_ptr<grpc::Service> make_reflection_v1_service(std::vector<std::string> services) {
  return std::make_unique<ReflectionV1>(std::move(services));
}

}  // namespace burst::server

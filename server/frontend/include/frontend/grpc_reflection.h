// gRPC server reflection v1 (grpc.reflection.v1.ServerReflection), beside the v1alpha service
// that gRPC's C++ library registers (its reflection plugin offers v1alpha only on this
// platform; clients such as recent grpcurl ask v1 first). Answers from the process's generated
// descriptor pool, as v1alpha does: list_services, file_by_filename, file_containing_symbol,
// file_containing_extension, all_extension_numbers_of_type; an unknown name is an in-band
// NOT_FOUND error response and the stream goes on. The message shapes come from
// proto/grpc/reflection/v1/reflection.proto.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace grpc {
class Service;
}  // namespace grpc

namespace burst::server {

// The v1 reflection service, listing `services` (fully qualified names) for list_services.
// Register it with the server's builder; it must outlive the server.
std::unique_ptr<grpc::Service> make_reflection_v1_service(std::vector<std::string> services);

}  // namespace burst::server

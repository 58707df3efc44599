"""End-to-end test of burst-server's gRPC server reflection (what grpcurl and grpc_cli use), with
a client built only from upstream gRPC's own reflection proto (Debian grpc-proto,
/usr/share/grpc-proto/grpc/reflection/v1alpha/reflection.proto), compiled at test time by protoc
and Debian's grpc_python_plugin. Over one ServerReflectionInfo stream: list_services names the
public API, the health service and reflection itself (and no internal worker service);
file_containing_symbol for burst.v1.Burst and for its Generate method returns the
FileDescriptorProto that protoc builds from proto/burst/v1/burst.proto, with the right
streaming flags; grpc.health.v1.Health can be described too (grpcurl needs that to call
Health/Check); an unknown symbol gets an in-band NOT_FOUND error and the stream goes on.
Every test runs twice: over grpc.reflection.v1alpha (gRPC's own service) and over
grpc.reflection.v1 (burst's, server/frontend/grpc_reflection.cpp), each client built from
Debian grpc-proto's proto of that version.
Run: /usr/bin/python3 test_reflection.py --build BUILD_DIR."""
import os
import subprocess
import sys
import tempfile

import grpc
from google.protobuf import descriptor_pb2

from harness import ROOT, Server, check, compile_protos, run

REFLECTION_DIR = "/usr/share/grpc-proto/grpc/reflection/v1alpha"
REFLECTION_V1 = "/usr/share/grpc-proto/grpc/reflection/v1/reflection.proto"
BURST_PROTO = "burst/v1/burst.proto"
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]

if not os.path.exists(os.path.join(REFLECTION_DIR, "reflection.proto")):
    sys.exit(f"{REFLECTION_DIR}/reflection.proto missing: Debian grpc-proto, see scripts/setup.sh")

out = tempfile.mkdtemp(prefix="burst-refl-pb-")
# The proto is compiled from its own directory, so the module is reflection_pb2 at the top level:
# under its upstream path it would be grpc.reflection.v1alpha, shadowed by the grpc package
# itself. The proto package (and so the method path on the wire) stays grpc.reflection.v1alpha.
compile_protos("reflection.proto", proto_path=REFLECTION_DIR, out=out)
# The reference for what the server must serve: protoc's own descriptor of our proto.
reference_set = os.path.join(out, "burst.pb")
subprocess.run(["protoc", f"--proto_path={os.path.join(ROOT, 'proto')}",
                f"--descriptor_set_out={reference_set}", BURST_PROTO], check=True)
sys.path.insert(0, out)
import reflection_pb2, reflection_pb2_grpc  # noqa: E402
# v1 under another file name, so that its modules do not shadow v1alpha's (same file name); its
# package, and so its method path, stays grpc.reflection.v1.
v1_dir = tempfile.mkdtemp(prefix="burst-refl-v1-")
with open(REFLECTION_V1) as src, open(os.path.join(v1_dir, "reflection_v1.proto"), "w") as dst:
    dst.write(src.read())
compile_protos("reflection_v1.proto", proto_path=v1_dir, out=v1_dir)
import reflection_v1_pb2, reflection_v1_pb2_grpc  # noqa: E402

srv = None
stub = None
# The version under test: (package, pb2 module, stub class).
VERSIONS = [("v1alpha", reflection_pb2, reflection_pb2_grpc.ServerReflectionStub),
            ("v1", reflection_v1_pb2, reflection_v1_pb2_grpc.ServerReflectionStub)]


def ask(*requests):
    """Sends the requests on one ServerReflectionInfo stream; returns one response per request."""
    responses = list(stub.ServerReflectionInfo(iter(requests), timeout=20))
    check(len(responses) == len(requests), f"{len(requests)} requests, {len(responses)} answers")
    return responses


def served_file(response, name):
    check(response.WhichOneof("message_response") == "file_descriptor_response",
          f"expected a file descriptor, got {response}")
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in response.file_descriptor_response.file_descriptor_proto]
    names = [f.name for f in files]
    check(names and names[0] == name, f"first file {names}, want {name}")
    return files[0]


def reference_file():
    ref = descriptor_pb2.FileDescriptorSet.FromString(open(reference_set, "rb").read()).file[0]
    # protoc's descriptor set carries json_name on every field; the descriptors compiled into a
    # C++ binary (and so served by reflection) do not. Everything else must be equal.
    def clear(messages):
        for m in messages:
            for f in m.field:
                f.ClearField("json_name")
            clear(m.nested_type)
    clear(ref.message_type)
    return ref


def test_list_services():
    (r,) = ask(pb.ServerReflectionRequest(list_services=""))
    check(r.WhichOneof("message_response") == "list_services_response", f"{r}")
    names = {s.name for s in r.list_services_response.service}
    for want in ["burst.v1.Burst", "grpc.health.v1.Health",
                 "grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection"]:
        check(want in names, f"{want} not in {sorted(names)}")
    internal = [n for n in names if n.startswith("burst.v1.internal")]
    check(not internal, f"internal services on the public port: {internal}")


def test_file_containing_symbol():
    by_service, by_method, by_name = ask(
        pb.ServerReflectionRequest(file_containing_symbol="burst.v1.Burst"),
        pb.ServerReflectionRequest(file_containing_symbol="burst.v1.Burst.Generate"),
        pb.ServerReflectionRequest(file_by_filename=BURST_PROTO))
    check(by_service.original_request.file_containing_symbol == "burst.v1.Burst",
          f"original_request {by_service.original_request}")
    fd = served_file(by_service, BURST_PROTO)
    check(fd.package == "burst.v1", f"package {fd.package}")
    (svc,) = [s for s in fd.service if s.name == "Burst"]
    methods = {m.name: m for m in svc.method}
    check(set(methods) == {"Generate", "Chat", "Tokenize", "ModelInfo"},
          f"methods {sorted(methods)}")
    for name, server_streaming in [("Generate", True), ("Chat", True), ("Tokenize", False),
                                   ("ModelInfo", False)]:
        m = methods[name]
        check(m.server_streaming == server_streaming and not m.client_streaming,
              f"{name}: client_streaming={m.client_streaming} "
              f"server_streaming={m.server_streaming}")
        reply = "Generate" if name == "Chat" else name  # Chat streams Generate's events
        check(m.input_type == f".burst.v1.{name}Request" and
              m.output_type == f".burst.v1.{reply}Response", f"{name}: {m}")
    check(fd == reference_file(), "served descriptor differs from protoc's for " + BURST_PROTO)
    check(served_file(by_method, BURST_PROTO) == fd, "by method != by service")
    check(served_file(by_name, BURST_PROTO) == fd, "by file name != by service")


def test_health_described():
    # grpcurl resolves grpc.health.v1.Health this way before it can call Health/Check.
    (r,) = ask(pb.ServerReflectionRequest(
        file_containing_symbol="grpc.health.v1.Health"))
    fd = served_file(r, "grpc/health/v1/health.proto")
    (svc,) = [s for s in fd.service if s.name == "Health"]
    methods = {m.name: m.server_streaming for m in svc.method}
    check(methods == {"Check": False, "Watch": True}, f"Health methods {methods}")


def test_unknown_symbol():
    missing, after = ask(
        pb.ServerReflectionRequest(file_containing_symbol="burst.v1.NoSuchService"),
        pb.ServerReflectionRequest(list_services=""))
    check(missing.WhichOneof("message_response") == "error_response", f"{missing}")
    check(missing.error_response.error_code == NOT_FOUND,
          f"error_code {missing.error_response.error_code}, want NOT_FOUND ({NOT_FOUND})")
    check(missing.original_request.file_containing_symbol == "burst.v1.NoSuchService",
          f"original_request {missing.original_request}")
    # The error is an answer, not the end of the stream.
    check(after.WhichOneof("message_response") == "list_services_response", f"{after}")


def test_v1_described_and_extensions():
    # The v1 service describes itself (both versions find it in the server's descriptor pool):
    # one bidirectional streaming method, Debian's v1 message names.
    (r,) = ask(pb.ServerReflectionRequest(
        file_containing_symbol="grpc.reflection.v1.ServerReflection"))
    fd = served_file(r, "grpc/reflection/v1/reflection.proto")
    (svc,) = fd.service
    (m,) = svc.method
    check(m.name == "ServerReflectionInfo" and m.client_streaming and m.server_streaming
          and m.input_type == ".grpc.reflection.v1.ServerReflectionRequest", f"{m}")
    want = {d.name for d in reflection_v1_pb2.DESCRIPTOR.message_types_by_name.values()}
    check({d.name for d in fd.message_type} == want, f"{[d.name for d in fd.message_type]}")
    # An unknown file is NOT_FOUND; a type with no extensions lists none.
    (r,) = ask(pb.ServerReflectionRequest(file_by_filename="no/such.proto"))
    check(r.WhichOneof("message_response") == "error_response"
          and r.error_response.error_code == NOT_FOUND, f"{r}")
    (r,) = ask(pb.ServerReflectionRequest(all_extension_numbers_of_type="burst.v1.Token"))
    check(r.WhichOneof("message_response") == "all_extension_numbers_response"
          and r.all_extension_numbers_response.base_type_name == "burst.v1.Token"
          and list(r.all_extension_numbers_response.extension_number) == [], f"{r}")


def for_version(test, name, module, stub_class):
    def one():
        global pb, stub
        pb = module
        stub = stub_class(grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}"))
        test()
    one.__name__ = f"{test.__name__}_{name}"
    return one


pb = reflection_pb2

if __name__ == "__main__":
    srv = Server(workers=1)
    try:
        run([for_version(t, *v) for v in VERSIONS
             for t in [test_list_services, test_file_containing_symbol, test_health_described,
                       test_unknown_symbol, test_v1_described_and_extensions]])
    finally:
        srv.stop()

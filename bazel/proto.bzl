"""cc_grpc_proto: protoc + grpc_cpp_plugin from Debian, wrapped in a cc_library."""

def cc_grpc_proto(name, src, proto_deps = [], deps = [], grpc = True, **kwargs):
    """Generates C++ message (and gRPC service) code for one .proto file.

    Args:
      name: cc_library name; include "<package>/<stem>.pb.h" / ".grpc.pb.h".
      src: the .proto file, in this package.
      proto_deps: other .proto files it imports (labels), for the sandbox.
      deps: cc_grpc_proto libraries generated from those imports.
      grpc: also generate service stubs.
      **kwargs: forwarded to the cc_library.
    """
    stem = src.rsplit(".", 1)[0]
    outs = [stem + ".pb.h", stem + ".pb.cc"]
    plugin = ""
    if grpc:
        outs += [stem + ".grpc.pb.h", stem + ".grpc.pb.cc"]
        plugin = "--grpc_out=$(GENDIR) --plugin=protoc-gen-grpc=/usr/bin/grpc_cpp_plugin"
    native.genrule(
        name = name + "_protoc",
        srcs = [src] + proto_deps,
        outs = outs,
        # -I. : import paths are workspace-relative ("proto/worker.proto");
        # well-known types come from /usr/include (libprotobuf-dev).
        cmd = "/usr/bin/protoc -I. -I/usr/include --cpp_out=$(GENDIR) %s $(location %s)" % (plugin, src),
    )
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        deps = deps + ["//third_party:protobuf"] + (["//third_party:grpc"] if grpc else []),
        **kwargs
    )

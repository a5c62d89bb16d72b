"""Sends request bodies that are not their method's message to every RPC of
pdworker's own services, as raw bytes through grpcio's generic calls (no
stubs: no serializer stands between the bytes and the wire).

  unparsable_request_client.py --target=127.0.0.1:PORT --out=FILE

Bodies per method: bytes that are no protobuf message at all (field number 0,
wire type 7), a truncated message (a length-delimited field that claims 100
bytes and has 3), and, where the request has a string field (at the top or
one message deep), that field holding invalid UTF-8. Writes one record per
call ({service, method, request_type, case, code, details}) to --out as JSON;
the C++ test (unparsable_request_test.cc) judges them and the worker's state.
"""
import argparse
import json

import grpc
from google.protobuf import descriptor
from google.protobuf import descriptor_pb2
from proto import smg_common_pb2  # noqa: F401 (VllmEngine's imports)
from proto import vllm_engine_pb2
from proto import worker_pb2

SERVICES = [
    worker_pb2.DESCRIPTOR.services_by_name["Worker"],
    worker_pb2.DESCRIPTOR.services_by_name["KvTransfer"],
    vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"],
]


def varint(n):
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def length_delimited(number, payload):
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def invalid_utf8_body(message_type):
    """A body whose only field is a string (maybe one message deep) holding
    invalid UTF-8; None when the message has no such field."""
    bad = b"\xc3\x28"  # a 2-byte lead followed by a non-continuation byte
    fields = message_type.fields
    for f in fields:
        if f.type == descriptor.FieldDescriptor.TYPE_STRING:
            return length_delimited(f.number, bad), f.name
    for f in fields:
        if f.type == descriptor.FieldDescriptor.TYPE_MESSAGE:
            for inner in f.message_type.fields:
                if inner.type == descriptor.FieldDescriptor.TYPE_STRING:
                    body = length_delimited(
                        f.number, length_delimited(inner.number, bad))
                    return body, f"{f.name}.{inner.name}"
    return None, None


def call(channel, service, method, body):
    proto = descriptor_pb2.MethodDescriptorProto()
    method.CopyToProto(proto)
    path = f"/{service.full_name}/{method.name}"
    try:
        if proto.server_streaming:
            for _ in channel.unary_stream(path)(body, timeout=30):
                pass
        else:
            channel.unary_unary(path)(body, timeout=30)
        return "OK", ""
    except grpc.RpcError as e:
        return e.code().name, e.details() or ""


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    records = []
    with grpc.insecure_channel(args.target) as channel:
        for service in SERVICES:
            for method in service.methods:
                cases = [
                    ("not protobuf", b"\x07\xff\x00not a protobuf message"),
                    # Field 1, length-delimited, 100 bytes long; 3 follow.
                    ("truncated", varint(1 << 3 | 2) + varint(100) + b"abc"),
                ]
                body, field = invalid_utf8_body(method.input_type)
                if body is not None:
                    cases.append((f"invalid UTF-8 in {field}", body))
                for name, body in cases:
                    code, details = call(channel, service, method, body)
                    records.append({
                        "service": service.full_name,
                        "method": method.name,
                        "request_type": method.input_type.full_name,
                        "case": name,
                        "code": code,
                        "details": details,
                    })
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()

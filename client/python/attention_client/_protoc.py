"""Generating the attention.v1 stubs (attention_pb2.py, attention_pb2_grpc.py) from the .proto.

The package ships its stubs in attention_client/_gen, written by
`/usr/bin/python3 client/python/attention_client/_protoc.py client/python/attention_client/_gen`
on Debian 12 (protoc 3.21 and grpc_python_plugin 1.51: code that runs on protobuf >= 3.20 and
any grpcio >= 1.51); run it again after changing the .proto (tests/python/test_package.py compares).
The tests' build also generates them into the build tree.
"""
import importlib.util
import os
import shutil
import subprocess
import sys

# The repository's proto root, relative to this file (client/python/attention_client/).
PROTO_ROOT = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "proto"))
PROTO_FILE = "attention/v1/attention.proto"


def generate(out_dir, proto_root=PROTO_ROOT):
    """Writes attention/v1/attention_pb2{,_grpc}.py (and __init__.py files) under out_dir."""
    os.makedirs(os.path.join(out_dir, "attention", "v1"), exist_ok=True)
    for d in (out_dir, os.path.join(out_dir, "attention"), os.path.join(out_dir, "attention", "v1")):
        open(os.path.join(d, "__init__.py"), "a").close()
    args = ["--proto_path=" + proto_root, "--python_out=" + out_dir, "--grpc_python_out=" + out_dir,
            os.path.join(proto_root, PROTO_FILE)]
    if importlib.util.find_spec("grpc_tools") is not None:
        cmd = [sys.executable, "-m", "grpc_tools.protoc"] + args
    else:
        protoc, plugin = shutil.which("protoc"), shutil.which("grpc_python_plugin")
        if protoc is None or plugin is None:
            raise RuntimeError("generating the attention.v1 stubs needs grpcio-tools, or protoc "
                               "and grpc_python_plugin (Debian: protobuf-compiler-grpc)")
        cmd = [protoc, "--plugin=protoc-gen-grpc_python=" + plugin] + args
    subprocess.run(cmd, check=True)


if __name__ == "__main__":
    generate(sys.argv[1], *(sys.argv[2:3]))

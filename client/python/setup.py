# Generates the attention.v1 Python stubs into attention_client/_gen while the package is built
# (pip install client/python), from the repository's proto/attention/v1/attention.proto. Uses
# grpcio-tools when installed, else the system protoc with grpc_python_plugin (Debian:
# protobuf-compiler, protobuf-compiler-grpc).
import importlib.util
import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
# Loaded by path: importing the package would need grpc and numpy at build time.
_spec = importlib.util.spec_from_file_location(
    "_protoc", os.path.join(HERE, "attention_client", "_protoc.py"))
_protoc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_protoc)


class BuildWithStubs(build_py):
    def run(self):
        _protoc.generate(os.path.join(HERE, "attention_client", "_gen"))
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})

# The package ships its attention.v1 stubs (attention_client/_gen, generated from the repository's
# proto/attention/v1/attention.proto by attention_client/_protoc.py), so building it needs neither
# protoc nor grpcio-tools: `pip install client/python` and `python -m build` work anywhere
# setuptools does. tests/python/test_package.py fails when the shipped stubs differ from the proto.
from setuptools import setup

setup()

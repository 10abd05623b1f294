"""The generated attention.v1 modules: from the import path when present there (a build that
generated them elsewhere), else from attention_client/_gen (written when the package is built)."""
import os
import sys

try:
    from attention.v1 import attention_pb2, attention_pb2_grpc  # noqa: F401
except ImportError:
    # The generated grpc module imports "attention.v1.attention_pb2" absolutely, so its root
    # must be on the path.
    sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_gen"))
    from attention.v1 import attention_pb2, attention_pb2_grpc  # noqa: F401

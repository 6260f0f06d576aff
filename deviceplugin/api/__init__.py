"""Generated gRPC stubs for the kubelet device plugin API v1beta1 (source: proto/api.proto).

Import `deviceplugin.api.api_pb2` / `api_pb2_grpc`. Regenerate with
`python -m deviceplugin.api.generate`; a test fails when the committed stubs are stale.
"""

API_VERSION = "v1beta1"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
KUBELET_SOCKET_NAME = "kubelet.sock"
DEFAULT_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"

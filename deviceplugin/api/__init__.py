"""Generated gRPC stubs for the kubelet device plugin API v1beta1 (source: proto/api.proto) and the
kubelet PodResources API v1 (source: proto/podresources.proto, module podresources_pb2*).

Import `deviceplugin.api.api_pb2` / `api_pb2_grpc`. Regenerate with
`python -m deviceplugin.api.generate`; a test fails when the committed stubs are stale.
"""

API_VERSION = "v1beta1"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
KUBELET_SOCKET_NAME = "kubelet.sock"
DEFAULT_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
# the kubelet's PodResources API (proto/podresources.proto), asked by PreStartContainer
DEFAULT_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"

"""Generated gRPC stubs for the kubelet's DRA plugin APIs, from the Kubernetes v1.36.2 protos copied
unchanged into proto/: `dra_v1` (k8s.io/kubelet/pkg/apis/dra/v1: NodePrepareResources /
NodeUnprepareResources), `dra_v1beta1` (the same service, older name), `pluginregistration_v1`
(k8s.io/kubelet/pkg/apis/pluginregistration/v1: GetInfo, NotifyRegistrationStatus) and
`dra_health_v1alpha1` (k8s.io/kubelet/pkg/apis/dra-health/v1alpha1: the devices' health stream).

Regenerate with `python -m draplugin.api.generate`; a test fails when the committed stubs are stale.
"""

PLUGIN_TYPE = "DRAPlugin"
SERVICE_V1 = "v1.DRAPlugin"
SERVICE_V1BETA1 = "v1beta1.DRAPlugin"
DEFAULT_REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
DEFAULT_PLUGINS_DIR = "/var/lib/kubelet/plugins"

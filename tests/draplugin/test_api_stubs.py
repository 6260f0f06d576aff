"""The committed DRA stubs (draplugin/api/) are what grpcio-tools generates from proto/ now, and the
protos are the kubelet's: the services and fields the DRA manager harness calls."""

from __future__ import annotations

from draplugin.api import dra_v1_pb2, generate, pluginregistration_v1_pb2


def test_committed_stubs_are_not_stale() -> None:
    assert generate.stale_files() == [], "draplugin/api stubs are stale: run python -m draplugin.api.generate"


def test_services_are_the_kubelets() -> None:
    assert dra_v1_pb2.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1"
    assert set(dra_v1_pb2.DESCRIPTOR.services_by_name["DRAPlugin"].methods_by_name) == {
        "NodePrepareResources",
        "NodeUnprepareResources",
    }
    assert pluginregistration_v1_pb2.DESCRIPTOR.package == "pluginregistration"
    assert dra_v1_pb2.Device.DESCRIPTOR.fields_by_name["share_id"].number == 5

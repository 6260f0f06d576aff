"""The shared Kubernetes client layer (gpupack/kubeclient.py): one loader, one error type per failure."""

from __future__ import annotations

import json

import pytest
from kubernetes import config

from gpupack import kubeclient


def test_a_missing_kubeconfig_is_one_config_error_naming_it(tmp_path):
    with pytest.raises(kubeclient.KubeConfigError) as e:
        kubeclient.api_client(str(tmp_path / "absent"))
    assert isinstance(e.value, config.ConfigException)  # callers of the library's loader catch it unchanged
    assert str(tmp_path / "absent") in str(e.value)
    (tmp_path / "bad").write_text("just: text\n")
    with pytest.raises(kubeclient.KubeConfigError):
        kubeclient.api_client(str(tmp_path / "bad"))


def test_clients_keep_their_own_configuration(k8s, tmp_path):
    other = k8s.write_kubeconfig(tmp_path / "kc", server="http://127.0.0.1:1")
    a, b = kubeclient.api_client(str(k8s.kubeconfig)), kubeclient.api_client(str(other), connections=7)
    assert a.configuration.host != b.configuration.host
    assert (a.configuration.retries, b.configuration.connection_pool_maxsize) == (0, 7)
    kc = kubeclient.KubeClient(a, timeout_s=10, page=1)
    names = [n["metadata"]["name"] for n in kc.list_all(kc.core.list_namespace)]
    assert {"default", "kube-system"} <= set(names) and len(names) == len(set(names))
    # nothing listens on port 1: a failed connection is an ApiException like any other API failure
    down = kubeclient.KubeClient(b, timeout_s=2)
    with pytest.raises(kubeclient.ApiException) as e:
        down.json(down.core.list_namespace)
    assert e.value.status == 504


def test_api_reason_prefers_the_servers_message():
    e = kubeclient.ApiException(status=409, reason="Conflict")
    e.body = json.dumps({"kind": "Status", "message": "the object has been modified"})
    assert kubeclient.api_reason(e) == "409 the object has been modified"
    e.body = "not json"
    assert kubeclient.api_reason(e) == "409 Conflict"

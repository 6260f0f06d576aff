"""A real Kubernetes control plane for tests: etcd, kube-apiserver, kube-controller-manager and
kube-scheduler plus the kubelet's device manager harness (v1.28.7 in ``../shared/k8s``, v1.36.2 in
``../shared/k8s-1.36``; the suite runs on both).

The binaries come from ``$GPUPACK_K8S_ASSETS`` or ``../shared/k8s`` (a folder with ``bin/*.xz`` and
``SHA256SUMS``) and are unpacked once into ``$GPUPACK_K8S_CACHE`` (default
``~/.cache/gpupack/k8s/<checksum>``), checked against ``SHA256SUMS``. One control plane serves a
whole test run (the session fixture in ``tests/conftest.py``); tests stay apart by using their own
namespaces and node names, and ``ControlPlane.reset()`` clears what a test left behind.

What differs between versions is read from the server, never assumed from a version number: the
ValidatingAdmissionPolicy API a server serves (`ControlPlane.policy_api`), whether its pod-bound
tokens name their node (`ControlPlane.token_node_claim`). Only the apiserver's start flags, needed
before there is a server to ask, follow the binary's own ``--version``.

Nothing here is product code: it lives in ``tests/`` and is never installed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import lzma
import os
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import requests
import urllib3
import yaml
from kubernetes import client
from kubernetes.client import rest

REPO = Path(__file__).resolve().parents[1]
NODE_CLAIM = "authentication.kubernetes.io/node-name"  # in pod-bound tokens of servers that add it
POLICY_KINDS = frozenset({"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"})
HOW_TO_GET = (
    "real Kubernetes binaries not found: set GPUPACK_K8S_ASSETS to a folder with bin/*.xz and "
    "SHA256SUMS (as ../shared/k8s has), or check out ../shared beside the repository"
)
SYSTEM_NAMESPACES = frozenset({"default", "kube-system", "kube-public", "kube-node-lease"})


# --- finding and unpacking the binaries ------------------------------------------------------------
def assets_dir() -> Path | None:
    """The folder holding ``bin/*.xz`` and ``SHA256SUMS``, or None when it cannot be found."""
    if os.environ.get("GPUPACK_K8S_ASSETS"):
        # asked for by name (.ci/run: one version per run): that folder or none, never another version
        explicit = Path(os.environ["GPUPACK_K8S_ASSETS"])
        return explicit if (explicit / "SHA256SUMS").is_file() and (explicit / "bin").is_dir() else None
    for c in default_assets_dirs():
        if (c / "SHA256SUMS").is_file() and (c / "bin").is_dir():
            return c
    return None


def default_assets_dirs() -> list[Path]:
    """Where the binaries are looked for when GPUPACK_K8S_ASSETS names no folder, in order."""
    candidates = []
    if os.environ.get("GPUPACK_SHARED"):
        candidates.append(Path(os.environ["GPUPACK_SHARED"]) / "k8s")
    candidates.append(REPO.parent / "shared" / "k8s")
    return candidates


def _checksums(assets: Path) -> dict[str, str]:
    out = {}
    for line in (assets / "SHA256SUMS").read_text().splitlines():
        if line.strip():
            digest, name = line.split(None, 1)
            out[name.strip().lstrip("*")] = digest
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def binary(name: str, assets: Path | None = None) -> Path:
    """Path of an unpacked, checksum-verified binary; unpacked on first use into the cache."""
    assets = assets or assets_dir()
    if assets is None:
        raise FileNotFoundError(HOW_TO_GET)
    return unpack(
        name, assets, Path(os.environ.get("GPUPACK_K8S_CACHE") or Path.home() / ".cache" / "gpupack" / "k8s")
    )


def unpack(name: str, assets: Path, cache_root: Path) -> Path:
    """`assets`/bin/`name`.xz unpacked under `cache_root` (a folder per SHA256SUMS, so another
    version never reuses it) and checked against SHA256SUMS; shared with tests/realhelm.py."""
    sums = _checksums(assets)
    if name not in sums:
        raise FileNotFoundError(f"{name} is not listed in {assets / 'SHA256SUMS'}")
    key = hashlib.sha256((assets / "SHA256SUMS").read_bytes()).hexdigest()[:16]
    cache = cache_root / key
    target = cache / name
    if target.is_file() and os.access(target, os.X_OK):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=f".{name}.")
    try:
        with os.fdopen(fd, "wb") as out, lzma.open(assets / "bin" / f"{name}.xz") as src:
            shutil.copyfileobj(src, out, 1 << 20)
        if _sha256(Path(tmp)) != sums[name]:
            raise RuntimeError(f"checksum mismatch unpacking {name} from {assets}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic: a concurrent run sees the whole file or none
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return target


def binary_version(name: str, assets: Path | None = None) -> tuple[int, int]:
    """(major, minor) that binary reports with ``--version`` ("Kubernetes v1.36.2")."""
    out = subprocess.run([str(binary(name, assets)), "--version"], capture_output=True, text=True, timeout=60)
    m = re.search(r"v(\d+)\.(\d+)", out.stdout + out.stderr)
    if m is None:
        raise RuntimeError(f"{name} --version said {out.stdout + out.stderr!r}")
    return int(m.group(1)), int(m.group(2))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def until(
    pred: Callable[[], Any], timeout: float = 20.0, what: str = "condition", interval: float = 0.05
) -> Any:
    """Poll `pred` until it returns something truthy; AssertionError naming `what` otherwise."""
    end = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < end:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what} (last: {last!r})")


# --- processes ---------------------------------------------------------------------------------------
class Proc:
    """A child process logging to a file, stopped with SIGTERM then SIGKILL."""

    def __init__(self, name: str, cmd: list[str], log: Path, env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.log = log
        self.cmd = cmd
        self.proc = subprocess.Popen(
            cmd,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def kubeconfig_dict(server: str, token: str, ca_file: Path | None) -> dict[str, Any]:
    cluster: dict[str, Any] = {"server": server}
    if ca_file is not None:
        cluster["certificate-authority"] = str(ca_file)
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": cluster}],
        "users": [{"name": "user", "user": {"token": token}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "user"}}],
        "current-context": "local",
    }


def gpupack_scheduler_config(extender_url: str) -> dict[str, Any]:
    """The KubeSchedulerConfiguration gpupack ships (deploy/scheduler/config.yaml, a ConfigMap) with
    only the extender's urlPrefix changed; `ControlPlane.start_scheduler` sets kubeconfig and
    leader election."""
    cm = yaml.safe_load((REPO / "deploy" / "scheduler" / "config.yaml").read_text())
    cfg = yaml.safe_load(cm["data"]["config.yaml"])
    (ext,) = cfg["extenders"]
    ext["urlPrefix"] = extender_url
    return cfg


class ControlPlane:
    """etcd + kube-apiserver (+ controller-manager, + kube-scheduler on demand) on 127.0.0.1."""

    def __init__(self, workdir: Path, assets: Path | None = None) -> None:
        self.assets = assets or assets_dir()
        if self.assets is None:
            raise FileNotFoundError(HOW_TO_GET)
        self.dir = workdir
        self.logs = workdir / "logs"
        self.pki = workdir / "pki"
        self.token = secrets.token_hex(16)
        self.api_port = 0
        self.url = ""
        self.ca_file = self.pki / "serving" / "apiserver.crt"
        self.kubeconfig = workdir / "admin.kubeconfig"
        self.procs: dict[str, Proc] = {}
        self._schedulers: list[Proc] = []
        self._api_client: client.ApiClient | None = None
        self._policy_api = ""

    # -- lifecycle --
    def start(self, controller_manager: bool = True) -> ControlPlane:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.pki.mkdir(parents=True, exist_ok=True)
        bins = {n: binary(n, self.assets) for n in ("etcd", "kube-apiserver")}
        # ValidatingAdmissionPolicy is beta and off before v1.30 (tests of admission use it); from
        # v1.30 v1 is on by default, and v1.34 no longer knows the gate nor serves v1beta1
        vap = (["--feature-gates", "ValidatingAdmissionPolicy=true",
                "--runtime-config", "admissionregistration.k8s.io/v1beta1=true"]
               if binary_version("kube-apiserver", self.assets) < (1, 30) else [])  # fmt: skip
        self._keys()
        etcd_port, peer_port, self.api_port = free_port(), free_port(), free_port()
        self.url = f"https://127.0.0.1:{self.api_port}"
        (self.pki / "tokens.csv").write_text(f'{self.token},admin,admin,"system:masters"\n')
        self.procs["etcd"] = Proc("etcd", [
            str(bins["etcd"]), "--data-dir", str(self.dir / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"default=http://127.0.0.1:{peer_port}", "--log-level", "warn",
            "--unsafe-no-fsync",  # a test store: durability across power loss is not under test
        ], self.logs / "etcd.log")  # fmt: skip
        self._wait_http("etcd", f"http://127.0.0.1:{etcd_port}/health", expect=None)
        self.procs["kube-apiserver"] = Proc("kube-apiserver", [
            str(bins["kube-apiserver"]), "--etcd-servers", f"http://127.0.0.1:{etcd_port}",
            "--bind-address", "127.0.0.1", "--secure-port", str(self.api_port),
            "--cert-dir", str(self.pki / "serving"), "--token-auth-file", str(self.pki / "tokens.csv"),
            "--authorization-mode", "Node,RBAC",
            "--service-account-issuer", "https://kubernetes.default.svc",
            "--service-account-key-file", str(self.pki / "sa.pub"),
            "--service-account-signing-key-file", str(self.pki / "sa.key"),
            "--service-cluster-ip-range", "10.0.0.0/24", "--endpoint-reconciler-type", "none",
            "--max-requests-inflight", "3000", "--max-mutating-requests-inflight", "1000",
            *vap, "-v", os.environ.get("GPUPACK_K8S_V", "1"),
        ], self.logs / "kube-apiserver.log")  # fmt: skip
        self._wait_http("kube-apiserver", f"{self.url}/readyz", expect="ok", token=self.token)
        self.kubeconfig.write_text(json.dumps(kubeconfig_dict(self.url, self.token, self.ca_file)))
        if controller_manager:
            self.start_controller_manager()
        return self

    def _keys(self) -> None:
        """The service-account signing key pair (what TokenRequest signs tokens with)."""
        if (self.pki / "sa.key").exists():
            return
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        (self.pki / "sa.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        ))  # fmt: skip
        (self.pki / "sa.pub").write_bytes(key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ))  # fmt: skip

    def _wait_http(
        self, name: str, url: str, expect: str | None, token: str = "", timeout: float = 90.0
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            p = self.procs[name]
            if not p.alive():
                raise RuntimeError(f"{name} exited at start: {p.tail()}")
            try:
                # the serving certificate appears only once the API server runs: poll unverified
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", urllib3.exceptions.InsecureRequestWarning)
                    r = requests.get(url, headers=headers, verify=False, timeout=2)
                if r.status_code == 200 and (expect is None or r.text == expect):
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{name} not ready after {timeout:g}s: {self.procs[name].tail()}")

    def start_controller_manager(self) -> None:
        if "kube-controller-manager" in self.procs:
            return
        self.procs["kube-controller-manager"] = Proc("kube-controller-manager", [
            str(binary("kube-controller-manager", self.assets)), "--kubeconfig", str(self.kubeconfig),
            "--bind-address", "127.0.0.1", "--secure-port", "0",
            # no kubelets: node lifecycle would mark every fake node NotReady and evict its pods
            "--controllers", "*,-nodelifecycle",
            "--service-account-private-key-file", str(self.pki / "sa.key"),
            "--root-ca-file", str(self.ca_file), "--leader-elect=false",
            "--kube-api-qps", "1000", "--kube-api-burst", "2000",
            "--concurrent-deployment-syncs", "10", "--concurrent-replicaset-syncs", "10",
        ], self.logs / "kube-controller-manager.log")  # fmt: skip

    def stop(self) -> None:
        for s in self._schedulers:
            s.stop()
        for name in ("kube-controller-manager", "kube-apiserver", "etcd"):
            if name in self.procs:
                self.procs[name].stop()
        if self._api_client is not None:
            self._api_client.close()

    # -- clients --
    def api_client(self) -> client.ApiClient:
        """A shared admin client (system:masters)."""
        if self._api_client is None:
            self._api_client = self.new_api_client()
        return self._api_client

    def new_api_client(self, token: str | None = None) -> client.ApiClient:
        cfg = client.Configuration()
        cfg.host = self.url
        cfg.ssl_ca_cert = str(self.ca_file)
        cfg.api_key = {"authorization": f"Bearer {token or self.token}"}
        return client.ApiClient(cfg)

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api_client())

    def write_kubeconfig(self, path: Path, token: str | None = None, server: str | None = None) -> Path:
        """A kubeconfig for the admin (or for `token`), optionally through another `server` URL."""
        ca = self.ca_file if (server or self.url).startswith("https") else None
        path.write_text(json.dumps(kubeconfig_dict(server or self.url, token or self.token, ca)))
        return path

    def service_account_token(self, namespace: str, name: str, seconds: int = 3600) -> str:
        """A real, signed token for that ServiceAccount (TokenRequest API); creates the account."""
        self.ensure_namespace(namespace)
        with contextlib.suppress(client.ApiException):
            self.core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})
        tr = self.core.create_namespaced_service_account_token(
            name,
            namespace,
            {"spec": {"expirationSeconds": seconds, "audiences": ["https://kubernetes.default.svc"]}},
        )
        return tr.status.token

    def service_account_kubeconfig(self, path: Path, namespace: str, name: str) -> Path:
        return self.write_kubeconfig(path, token=self.service_account_token(namespace, name))

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120) -> str:
        r = subprocess.run(
            [str(binary("kubectl", self.assets)), "--kubeconfig", str(self.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and r.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({r.returncode}): {r.stderr or r.stdout}")
        return r.stdout if check else r.stdout + r.stderr

    # -- what this server does, asked of it --
    def _get(self, path: str) -> Any:
        r = requests.get(f"{self.url}{path}", headers={"Authorization": f"Bearer {self.token}"},
                         verify=str(self.ca_file), timeout=10)  # fmt: skip
        r.raise_for_status()
        return r.json()

    def server_version(self) -> tuple[int, int]:
        """(major, minor) of the running API server (its /version)."""
        v = self._get("/version")
        return int(v["major"]), int(v["minor"].rstrip("+"))

    def policy_api(self) -> str:
        """The group/version this server serves ValidatingAdmissionPolicy in, from discovery:
        admissionregistration.k8s.io/v1 (GA, on by default from v1.30), else v1beta1 (v1.28-1.29
        with the gate and the API turned on; no longer served from v1.34)."""
        if not self._policy_api:
            group = "admissionregistration.k8s.io"
            for v in self._get(f"/apis/{group}")["versions"]:  # the preferred version first
                gv = v["groupVersion"]
                if any(
                    r["name"] == "validatingadmissionpolicies" for r in self._get(f"/apis/{gv}")["resources"]
                ):
                    self._policy_api = gv
                    break
            else:
                raise RuntimeError(f"this API server serves no ValidatingAdmissionPolicy in {group}")
        return self._policy_api

    def for_this_server(self, objs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """deploy/'s objects as this server takes them: the admission policies (shipped as v1) in the
        version it serves; the fields are the same in v1beta1. Other objects are passed on as they are."""
        api = self.policy_api()
        return [{**o, "apiVersion": api} if o.get("kind") in POLICY_KINDS else o for o in objs]

    def token_node_claim(self, token: str) -> str:
        """The node this server reads from `token` (a TokenReview's `authentication.kubernetes.io/
        node-name`), or "" where it puts none in: before v1.30 a pod-bound token names only its pod."""
        review = client.AuthenticationV1Api(self.api_client()).create_token_review({"spec": {"token": token}})
        assert review.status.authenticated, review.status.error
        return ((review.status.user.extra or {}).get(NODE_CLAIM) or [""])[0]

    # -- objects tests need --
    def ensure_namespace(self, name: str, labels: Mapping[str, str] | None = None) -> None:
        """Create `name` (if absent) and wait for its `default` ServiceAccount (pods need it)."""
        try:
            self.core.create_namespace({"metadata": {"name": name, "labels": dict(labels or {})}})
        except client.ApiException as e:
            if e.status != 409:
                raise
        if "kube-controller-manager" in self.procs:
            until(lambda: self._has_default_sa(name), 30, f"ServiceAccount default in {name}")
        elif not self._has_default_sa(name):
            with contextlib.suppress(client.ApiException):
                self.core.create_namespaced_service_account(name, {"metadata": {"name": "default"}})

    def _has_default_sa(self, ns: str) -> bool:
        try:
            self.core.read_namespaced_service_account("default", ns)
            return True
        except client.ApiException:
            return False

    def make_node(self, name: str, **kw: Any) -> None:
        """A Ready fake node (see the module-level `make_node` for the keywords)."""
        make_node(self.core, name, **kw)

    # -- kube-scheduler --
    def start_scheduler(
        self,
        config: Mapping[str, Any] | str | Path,
        name: str = "kube-scheduler",
        kubeconfig: Path | None = None,
        leader_election: Mapping[str, Any] | None = None,
        extra_args: Iterable[str] = (),
    ) -> Proc:
        """The real kube-scheduler with that KubeSchedulerConfiguration (a dict, YAML text or file).

        Only `clientConnection.kubeconfig` and leader election are overridden (no kubelets, one
        replica); everything else, extenders included, is the caller's. `kubeconfig` (default the
        admin's) lets an RBAC test run it as a ServiceAccount; `leader_election` replaces the
        default (off); `extra_args` go after the defaults (e.g. a real `--secure-port`).
        """
        if isinstance(config, Path):
            config = config.read_text()
        cfg = yaml.safe_load(config) if isinstance(config, str) else json.loads(json.dumps(config))
        cfg.setdefault("clientConnection", {})["kubeconfig"] = str(kubeconfig or self.kubeconfig)
        cfg["leaderElection"] = (
            dict(leader_election) if leader_election is not None else {"leaderElect": False}
        )
        n = len(self._schedulers)
        path = self.dir / f"{name}-{n}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        p = Proc(name, [str(binary("kube-scheduler", self.assets)), "--config", str(path), "--secure-port", "0",
                        "-v", os.environ.get("GPUPACK_K8S_SCHED_V", "2"), *extra_args],
                 self.logs / f"{name}-{n}.log")  # fmt: skip
        self._schedulers.append(p)
        return p

    # -- between tests --
    def reset(self, keep_namespaces: Iterable[str] = ()) -> None:
        """Remove what tests create: pods (at once), nodes, non-system namespaces, webhook and
        admission-policy configurations, and cluster RBAC objects not made by the apiserver."""
        keep = SYSTEM_NAMESPACES | set(keep_namespaces)
        core = self.core
        for ns in core.list_namespace().items:
            n = ns.metadata.name
            if n not in SYSTEM_NAMESPACES - {"default"}:
                # controllers first: a namespace being deleted keeps its ReplicaSets a while, and they
                # would recreate pods that the next test's scheduler then places on its nodes
                for path in _WORKLOAD_COLLECTIONS:
                    with contextlib.suppress(requests.RequestException):
                        requests.delete(f"{self.url}{path.format(ns=n)}", params={"propagationPolicy": "Background"},
                                        headers={"Authorization": f"Bearer {self.token}"},
                                        verify=str(self.ca_file), timeout=10)  # fmt: skip
            with contextlib.suppress(client.ApiException):
                core.delete_collection_namespaced_pod(n, grace_period_seconds=0)
            if n not in keep and ns.status.phase != "Terminating":
                with contextlib.suppress(client.ApiException):
                    core.delete_namespace(n)
        with contextlib.suppress(client.ApiException):
            core.delete_collection_node()
        adm = client.AdmissionregistrationV1Api(self.api_client())
        with contextlib.suppress(client.ApiException):
            adm.delete_collection_mutating_webhook_configuration()
        with contextlib.suppress(client.ApiException):
            adm.delete_collection_validating_webhook_configuration()
        for kind in ("validatingadmissionpolicybindings", "validatingadmissionpolicies"):
            with contextlib.suppress(requests.RequestException):
                requests.delete(f"{self.url}/apis/{self.policy_api()}/{kind}",
                                headers={"Authorization": f"Bearer {self.token}"}, verify=str(self.ca_file), timeout=10)  # fmt: skip
        rbac = client.RbacAuthorizationV1Api(self.api_client())
        for b in rbac.list_cluster_role_binding().items:
            if not b.metadata.name.startswith("system:") and b.metadata.name != "cluster-admin":
                with contextlib.suppress(client.ApiException):
                    rbac.delete_cluster_role_binding(b.metadata.name)
        for r in rbac.list_cluster_role().items:
            if not r.metadata.name.startswith("system:") and r.metadata.name not in _BUILTIN_ROLES:
                with contextlib.suppress(client.ApiException):
                    rbac.delete_cluster_role(r.metadata.name)


_WORKLOAD_COLLECTIONS = tuple(
    f"/apis/{gv}/namespaces/{{ns}}/{res}"
    for gv, res in (("apps/v1", "deployments"), ("apps/v1", "statefulsets"), ("apps/v1", "daemonsets"),
                    ("apps/v1", "replicasets"), ("batch/v1", "cronjobs"), ("batch/v1", "jobs"))
)  # fmt: skip
_BUILTIN_ROLES = frozenset({"admin", "edit", "view", "cluster-admin"})


def make_node(
    core: client.CoreV1Api,
    name: str,
    *,
    cpu: str = "64",
    memory: str = "512Gi",
    pods: str = "250",
    extended: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> None:
    capacity = {"cpu": cpu, "memory": memory, "pods": pods, **dict(extended or {})}
    core.create_node({"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **dict(labels or {})},
                                   "annotations": dict(annotations or {})}})  # fmt: skip
    set_node_status(core, name, capacity)
    # TaintNodesByCondition admission taints every new node not-ready; a kubelet would clear it
    node = core.read_node(name)
    taints = [t for t in (node.spec.taints or []) if t.key != "node.kubernetes.io/not-ready"]
    core.patch_node(name, {"spec": {"taints": [t.to_dict() for t in taints] or None}})


def set_node_status(
    core: client.CoreV1Api, name: str, capacity: Mapping[str, str], ready: bool = True
) -> None:
    """What a kubelet reports: capacity = allocatable, and the Ready condition."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    core.patch_node_status(name, {"status": {
        "capacity": dict(capacity), "allocatable": dict(capacity),
        "conditions": [{"type": "Ready", "status": "True" if ready else "False", "reason": "KubeletReady",
                        "message": "fake node", "lastHeartbeatTime": now, "lastTransitionTime": now}],
    }})  # fmt: skip


def running_ready_status(pod: Any, pod_ip: str = "10.0.0.1") -> dict[str, Any]:
    """The status a kubelet writes once a pod's containers run and pass readiness."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    spec = pod.spec if not isinstance(pod, Mapping) else None
    names = (
        [c.name for c in spec.containers]
        if spec is not None
        else [c["name"] for c in pod["spec"]["containers"]]
    )
    return {"status": {
        "phase": "Running", "podIP": pod_ip, "hostIP": "10.0.0.2", "startTime": now,
        "conditions": [{"type": t, "status": "True", "lastTransitionTime": now}
                       for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")],
        "containerStatuses": [{"name": n, "ready": True, "restartCount": 0, "image": "x", "imageID": "",
                               "started": True, "state": {"running": {"startedAt": now}}} for n in names],
    }}  # fmt: skip


# A test's finalizer that stands for containers still stopping: the pod keeps its phase (and so its
# GPU) until the test removes it, where without it the emulated kubelet ends the pod at once.
STILL_STOPPING = "gpupack.io/test-terminating"


def confirm_deletion(core: client.CoreV1Api, pod: Any) -> None:
    """The kubelet's confirmation that a pod being deleted is gone: its terminal phase first (the
    kubelet writes Failed or Succeeded before it lets a pod go; from v1.29 the Job controller removes
    its tracking finalizer only from a terminal pod, so an evicted Job pod would otherwise stay
    Terminating), then a grace-period-0 delete with the pod's UID as precondition, as the kubelet's
    status manager sends it. Without the precondition a late event of an old pod deletes its
    successor of the same name (a StatefulSet's replacement)."""
    stopping = STILL_STOPPING in (pod.metadata.finalizers or [])
    if not stopping and (pod.status.phase if pod.status else None) not in ("Succeeded", "Failed"):
        with contextlib.suppress(client.ApiException):  # gone already
            core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace,
                                             {"status": {"phase": "Failed"}})  # fmt: skip
    opts = client.V1DeleteOptions(
        grace_period_seconds=0, preconditions=client.V1Preconditions(uid=pod.metadata.uid)
    )
    with contextlib.suppress(client.ApiException):  # already gone (404) or replaced (409)
        core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, body=opts)


# Admissions in flight at once, each on a kept-alive connection of its own (with_pool): enough
# that a burst's admissions never queue behind each other. With 8 (below an API client's default
# pool of 10 on 2 CPUs) they waited seconds for a slot at a burst's 40-60 binds/s whatever the
# admission delay asked: an admission is two writes (the device plugin's, the kubelet's), each
# 0.05-0.7 s on an API server sharing 2 busy CPUs, so 8 at a time served 6-40 a second (issue 29,
# benchmarks/bench_kubelet.py).
ADMIT_CONCURRENCY = 128
RELIST_S = 10.0  # how often a KubeletEmulator lists every pod again


def with_pool(api: client.ApiClient, size: int) -> client.ApiClient:
    """`api` keeping up to `size` connections: every call beyond an API client's pool (10 on
    2 CPUs) opens and throws away a TLS connection, whose handshake costs CPU on both sides."""
    api.configuration.connection_pool_maxsize = size
    api.rest_client = rest.RESTClientObject(api.configuration)
    return api


class KubeletEmulator:
    """What the kubelets of fake nodes would do to pods: a bound pod is set Running and Ready after
    `admit_delay` seconds, and a pod being deleted is removed at once (the kubelet confirms its
    termination with a grace-period-0 delete). `on_admit(pod)` runs before the status write (a test
    device manager hooks in there). Runs a real watch on the API server. `nodes(name)`, if given,
    says which nodes' pods this one serves (the others are another's); `concurrency`: admissions
    in flight at once (ADMIT_CONCURRENCY if 0); `watching` is set once the first list is handled and
    the watch opens."""

    def __init__(
        self, cp: Any, namespace: str | None = None, admit_delay: float = 0.0,
        on_admit: Callable[[Any], None] | None = None, ready: bool = True,
        nodes: Callable[[str], bool] | None = None, concurrency: int = 0,
    ) -> None:  # fmt: skip
        concurrency = concurrency or ADMIT_CONCURRENCY
        self.core = client.CoreV1Api(with_pool(cp.new_api_client(), concurrency + 2))
        self.namespace = namespace
        self.serves = nodes  # not `nodes`: subclasses (dm_nodes) keep their nodes there
        self.watching = threading.Event()
        self.admit_delay = admit_delay
        self.on_admit = on_admit
        self.ready = ready
        self._stop = threading.Event()
        self._seen: set[str] = set()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kubelet-emulator")
        self._calls = threading.BoundedSemaphore(concurrency)
        self.errors: list[str] = []

    def start(self) -> KubeletEmulator:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def __enter__(self) -> KubeletEmulator:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _list(self, **kw: Any) -> Any:
        if self.namespace:
            return self.core.list_namespaced_pod(self.namespace, **kw)
        return self.core.list_pod_for_all_namespaces(**kw)

    def _run(self) -> None:
        # Listed once, then watched on from the last resourceVersion seen (bookmarks keep it fresh);
        # listed again after an error or an expired version, and every RELIST_S, which retries a
        # deletion whose confirmation failed. (Listing every pod of the cluster at each 2 s watch
        # renewal cost this process and the API server more CPU than the admissions themselves
        # once a benchmark had a thousand pods.)
        rv: str | None = None
        listed = 0.0
        while not self._stop.is_set():
            try:
                if rv is None or time.monotonic() - listed > RELIST_S:
                    lst = json.loads(self._list(_preload_content=False).data)
                    for obj in lst.get("items") or ():
                        self._handle_event(obj)
                    rv, listed = lst["metadata"]["resourceVersion"], time.monotonic()
                    self.watching.set()
                resp = self._list(watch=True, resource_version=rv, timeout_seconds=2, _preload_content=False,
                                  allow_watch_bookmarks=True)  # fmt: skip
                try:
                    for line in resp:
                        if self._stop.is_set():
                            break
                        ev = json.loads(line)
                        if ev.get("type") == "ERROR":  # 410 Gone: the version is too old to watch from
                            rv = None
                            break
                        rv = (ev["object"].get("metadata") or {}).get("resourceVersion") or rv
                        if ev.get("type") in ("ADDED", "MODIFIED"):
                            self._handle_event(ev["object"])
                finally:
                    resp.release_conn()
            except Exception as e:  # keep emulating; a test asserts on its own outcomes
                self.errors.append(repr(e))
                rv = None
                time.sleep(0.2)

    def _handle_event(self, obj: dict[str, Any]) -> None:
        """_handle for a listed or watched pod, made a V1Pod only when there is something to do: a
        V1Pod costs ~1 ms of CPU to build, every pod is listed again every RELIST_S and has several
        events (bound, handoff, status), on the cores this harness shares with the control plane
        it measures."""
        meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
        if not spec.get("nodeName") or (self.serves is not None and not self.serves(spec["nodeName"])):
            return
        deleting = bool(meta.get("deletionTimestamp"))
        if not deleting and (
            meta.get("uid") in self._seen or (obj.get("status") or {}).get("phase") not in (None, "Pending")
        ):
            return
        self._handle(_to_v1pod(self.core.api_client, obj))

    def _handle(self, pod: Any) -> None:
        meta = pod.metadata
        if meta.deletion_timestamp is not None and pod.spec.node_name:
            confirm_deletion(self.core, pod)
            return
        if not pod.spec.node_name or meta.uid in self._seen:
            return
        if pod.status and pod.status.phase not in (None, "Pending"):
            return
        self._seen.add(meta.uid)
        threading.Thread(target=self._admit, args=(pod,), daemon=True).start()

    def _admit(self, pod: Any) -> None:
        if self.admit_delay:
            time.sleep(self.admit_delay)
        with self._calls:
            self._admit_now(pod)

    def _admit_now(self, pod: Any) -> None:
        try:
            if self.on_admit is not None:
                self.on_admit(pod)
            if self.ready:
                # the answer read raw (a V1Pod of it is ~1 ms of CPU for nothing), to its end so that
                # its connection goes back to the pool
                _ = self.core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace,
                                                          running_ready_status(pod), _preload_content=False).data  # fmt: skip
        except client.ApiException as e:
            if e.status != 404:
                self.errors.append(f"{pod.metadata.name}: {e.status} {e.reason}")
        except Exception as e:
            self.errors.append(f"{pod.metadata.name}: {e!r}")


class _Raw:
    """Adapter so ApiClient.deserialize accepts an already-decoded JSON object."""

    def __init__(self, obj: Any) -> None:
        self.data = json.dumps(obj)


def _to_v1pod(api: client.ApiClient, obj: Any) -> Any:
    """A watch event's pod as a V1Pod, with either ApiClient.deserialize signature: (response,
    type) before kubernetes-client 32, (text, type, content_type) since."""
    try:
        return api.deserialize(json.dumps(obj), "V1Pod", "application/json")
    except TypeError:
        return api.deserialize(_Raw(obj), "V1Pod")

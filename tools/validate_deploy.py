"""Render gpupack's kustomizations and validate every object offline.

    python -m tools.validate_deploy [--renderer auto|kubectl|python] [--kubectl PATH]
                                    [--k8s 1.30,1.32,1.35] [DIR ...]

Run from the repository root. DIR defaults to deploy/ and deploy/examples/. Exit 0 when everything
validates, 1 with one line per problem otherwise, 2 on bad usage.

1. Render (tools/kustomize.py): the real `kubectl kustomize DIR` when a kubectl is found
   (--kubectl, $GPUPACK_KUBECTL, or PATH; renderer "auto"), else a minimal kustomize for the
   features these manifests use. Unsupported kustomization fields are an error, never ignored.
2. Schemas: each object against the Kubernetes OpenAPI-derived JSON schemas of every listed
   version, strict (unknown fields are errors), from the kubernetes-validate package.
3. What a schema cannot see, checked against this repository's code:
   - every `gpupack ...` / `python -m gpupack.certs` container's args parse with that command's
     real argparse parser; `--*port` values are declared container ports; absolute paths in
     args lie under a volumeMount;
   - the KubeSchedulerConfiguration in the ConfigMap: known fields only, the scheduler name,
     managed resources and extender port/verbs that gpupack's code uses, httpTimeout > worst bind;
   - webhook paths are routes the extender serves; Services, probes, selectors, ServiceAccounts,
     RBAC role references, volumes, HPA/PDB targets all point at something that exists;
   - gpupack resources are spelled as in gpupack.contract, requests == limits, gpu-sm 1..100;
   - every image is pinned to a tag (not `latest`) or digest.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from gpupack import contract
from tools.kustomize import (
    CLUSTER_SCOPED,
    RENDERERS,
    Obj,
    RenderError,
    pod_spec,
    render,
    split_image,
)

REPO = Path(__file__).resolve().parents[1]
PROG = "python -m tools.validate_deploy"
DEFAULT_DIRS = ("deploy", "deploy/examples")
# Oldest supported (webhook matchConditions are GA from 1.30), the
# kube-scheduler image's minor, and the newest the installed schemas cover well.
DEFAULT_VERSIONS = ("1.30", "1.32", "1.35")


# --- object helpers ---------------------------------------------------------------------------------
def pod_labels(o: Obj) -> dict[str, str]:
    spec = o.get("spec") or {}
    if o.get("kind") == "CronJob":
        spec = (spec.get("jobTemplate") or {}).get("spec") or {}
    return ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}


def ident(o: Obj) -> str:
    md = o.get("metadata") or {}
    ns = md.get("namespace")
    return f"{o.get('kind')}/{ns + '/' if ns else ''}{md.get('name')}"


# --- schema validation ---------------------------------------------------------------------------
# The JSON schemas (generated from each release's OpenAPI spec) ship in the kubernetes-validate
# package. Its validate() re-reads the 1.4 MB definitions file on every call; the schemas are
# loaded once per version here and checked with the same Draft 2020-12 validator it uses.
_SCHEMA_CACHE: dict[tuple[str, str], Any] = {}


def _schema_dir(version: str) -> Path:
    import kubernetes_validate

    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    d = root / f"v{version}.0-local-strict"
    if not d.is_dir():
        have = sorted(p.name for p in root.iterdir() if p.name.endswith("-local-strict"))
        raise RenderError(f"no strict schemas for Kubernetes {version} in kubernetes-validate (have {have})")
    return d


def _validator(version: str, kind: str, api_version: str) -> Any:
    import json

    import jsonschema
    from referencing import Registry, Resource

    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    key = (version, f"{kind.lower()}-{group_version}")
    if key not in _SCHEMA_CACHE:
        d = _schema_dir(version)
        if (version, "_definitions") not in _SCHEMA_CACHE:
            _SCHEMA_CACHE[(version, "_definitions")] = Resource.from_contents(
                json.loads((d / "_definitions.json").read_text())
            )
        f = d / f"{key[1]}.json"
        if not f.is_file():
            _SCHEMA_CACHE[key] = None
        else:
            schema = json.loads(f.read_text())
            registry = Resource.from_contents(schema) @ (
                _SCHEMA_CACHE[(version, "_definitions")] @ Registry()
            )
            _SCHEMA_CACHE[key] = jsonschema.Draft202012Validator(schema, registry=registry)
    return _SCHEMA_CACHE[key]


def schema_errors(o: Obj, versions: tuple[str, ...]) -> list[str]:
    out = []
    for v in versions:
        validator = _validator(v, str(o.get("kind", "")), str(o.get("apiVersion", "")))
        if validator is None:
            out.append(f"{ident(o)}: Kubernetes {v} has no {o.get('apiVersion')} {o.get('kind')}")
            continue
        err = next(
            iter(sorted(validator.iter_errors(o), key=lambda e: list(map(str, e.absolute_path)))), None
        )
        if err is not None:
            where = "/".join(str(p) for p in err.absolute_path) or "(top)"
            out.append(f"{ident(o)}: Kubernetes {v} schema: {where}: {err.message}")
    return out


# --- the KubeSchedulerConfiguration (no JSON schema ships for it) -------------------------------
_KSC_TOP = {
    "apiVersion",
    "kind",
    "parallelism",
    "leaderElection",
    "clientConnection",
    "percentageOfNodesToScore",
    "podInitialBackoffSeconds",
    "podMaxBackoffSeconds",
    "profiles",
    "extenders",
    "delayCacheUntilActive",
    "enableProfiling",
    "enableContentionProfiling",
}
_KSC_PROFILE = {"schedulerName", "percentageOfNodesToScore", "plugins", "pluginConfig"}
_KSC_LEADER = {
    "leaderElect",
    "leaseDuration",
    "renewDeadline",
    "retryPeriod",
    "resourceLock",
    "resourceName",
    "resourceNamespace",
}
_KSC_EXTENDER = {
    "urlPrefix",
    "filterVerb",
    "preemptVerb",
    "prioritizeVerb",
    "weight",
    "bindVerb",
    "enableHTTPS",
    "tlsConfig",
    "httpTimeout",
    "nodeCacheCapable",
    "managedResources",
    "ignorable",
}
_DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|ms|s|m|h))+$")


def _duration_s(v: Any) -> float:
    if not isinstance(v, str) or not _DURATION.match(v):
        raise ValueError(f"{v!r} is not a Go duration")
    unit = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * unit[u] for n, _, u in re.findall(r"(\d+(\.\d+)?)(ns|us|ms|s|m|h)", v))


def scheduler_config_errors(cfg: Any, where: str) -> list[str]:
    errs: list[str] = []
    if not isinstance(cfg, dict):
        return [f"{where}: not a YAML mapping"]
    if (
        cfg.get("apiVersion") != "kubescheduler.config.k8s.io/v1"
        or cfg.get("kind") != "KubeSchedulerConfiguration"
    ):
        errs.append(
            f"{where}: expected apiVersion kubescheduler.config.k8s.io/v1, kind KubeSchedulerConfiguration"
        )
    errs += [f"{where}: unknown field {k!r}" for k in sorted(set(cfg) - _KSC_TOP)]
    le = cfg.get("leaderElection") or {}
    errs += [f"{where}: leaderElection: unknown field {k!r}" for k in sorted(set(le) - _KSC_LEADER)]
    profiles = cfg.get("profiles") or []
    names = [p.get("schedulerName") for p in profiles if isinstance(p, dict)]
    for p in profiles:
        errs += [f"{where}: profiles: unknown field {k!r}" for k in sorted(set(p) - _KSC_PROFILE)]
    if contract.SCHEDULER_NAME not in names:
        errs.append(
            f"{where}: no profile named {contract.SCHEDULER_NAME!r} (gpupack.contract.SCHEDULER_NAME)"
        )
    exts = cfg.get("extenders") or []
    if len(exts) != 1:
        errs.append(f"{where}: expected exactly one extender, found {len(exts)}")
    for e in exts:
        errs += [f"{where}: extenders: unknown field {k!r}" for k in sorted(set(e) - _KSC_EXTENDER)]
        w = e.get("weight")
        if "prioritizeVerb" in e and not (isinstance(w, int) and w > 0):
            errs.append(f"{where}: extenders: weight must be a positive integer with prioritizeVerb")
        try:
            _duration_s(e.get("httpTimeout", "30s"))
        except ValueError as x:
            errs.append(f"{where}: extenders: httpTimeout {x}")
        if e.get("managedResources"):
            # With managedResources kube-scheduler asks the extender only about pods requesting one:
            # CPU-only pods would be spread over GPU nodes by its own scores, stranding their GPUs.
            errs.append(
                f"{where}: extenders: managedResources must not be set (the extender must be asked about "
                "every pod, CPU-only ones too); make NodeResourcesFit ignore gpupack's resources instead "
                "(pluginConfig ignoredResourceGroups: [gpupack.io])"
            )
        if e.get("ignorable") is True:
            errs.append(f"{where}: extenders: ignorable must not be true (GPU pods would be placed blind)")
    for p in profiles:
        if isinstance(p, dict) and p.get("schedulerName") == contract.SCHEDULER_NAME:
            errs += _fit_args_errors(p, f"{where}: profile {contract.SCHEDULER_NAME}")
    return errs


_FIT_ARGS = {"ignoredResources", "ignoredResourceGroups", "scoringStrategy"}


def _fit_args_errors(profile: dict[str, Any], where: str) -> list[str]:
    """NodeResourcesFit must leave every gpupack resource to the extender: the kubelet advertises
    `gpupack.io/gpu` slots only, never gpu-mem or gpu-sm, so kube-scheduler's own check would find
    no node for a GPU pod."""
    errs: list[str] = []
    args: dict[str, Any] = {}
    for pc in profile.get("pluginConfig") or []:
        if not isinstance(pc, dict) or pc.get("name") != "NodeResourcesFit":
            continue
        a = pc.get("args") or {}
        if not isinstance(a, dict):
            return [f"{where}: pluginConfig NodeResourcesFit: args must be a mapping"]
        unknown = sorted(set(a) - _FIT_ARGS)
        errs += [f"{where}: pluginConfig NodeResourcesFit: unknown field {k!r}" for k in unknown]
        args = a
    groups = set(args.get("ignoredResourceGroups") or [])
    names = set(args.get("ignoredResources") or [])
    missing = [r for r in contract.MANAGED_RESOURCES if r not in names and r.split("/", 1)[0] not in groups]
    if missing:
        errs.append(
            f"{where}: pluginConfig NodeResourcesFit does not ignore {', '.join(missing)} (gpupack.contract."
            "MANAGED_RESOURCES): set ignoredResourceGroups: [gpupack.io]"
        )
    disabled = _disabled_filters(profile)
    if "*" in disabled:
        errs.append(
            f"{where}: plugins.filter.disabled '*' turns off every kube-scheduler filter (taints, affinity, "
            "ports, volumes, topology spread), which the extender does not check; disable NodeResourcesFit only"
        )
    if "NodeResourcesFit" in disabled or "*" in disabled:
        ours = {r.split("/", 1)[0] for r in contract.MANAGED_RESOURCES}
        extra = sorted((groups - ours) | {n for n in names if n.split("/", 1)[0] not in ours})
        if extra:
            # the extender, which does the filter's work then, checks every resource outside gpupack.io
            errs.append(
                f"{where}: pluginConfig NodeResourcesFit ignores {', '.join(extra)}, which has no effect while "
                "its filter is disabled: the extender checks every node resource outside gpupack.io "
                "(enable the filter again to have kube-scheduler ignore them)"
            )
    return errs


def _disabled_filters(profile: dict[str, Any]) -> set[str]:
    plugins = profile.get("plugins") or {}
    flt = plugins.get("filter") or {} if isinstance(plugins, dict) else {}
    disabled = flt.get("disabled") or [] if isinstance(flt, dict) else []
    return {str(d.get("name")) for d in disabled if isinstance(d, dict)}


def extender_routes() -> set[str]:
    """Routes the extender serves: its Flask apps' (read from the source, no app needs building)
    and the verbs its WSGI verb path answers in front of them (app.VERB_PATHS)."""
    from extender.serve.app import VERB_PATHS

    src = (REPO / "extender" / "serve" / "app.py").read_text()
    return set(re.findall(r"@app\.(?:post|get)\(\"(/[^\"]*)\"\)", src)) | set(VERB_PATHS)


# --- container args against the real CLI parsers -----------------------------------------------
def _component_parser(cmd: list[str]) -> tuple[str, argparse.ArgumentParser | None, list[str]] | None:
    """(what, parser, args-prefix) for a gpupack container command; None if not gpupack's."""
    import importlib

    from gpupack.cli import COMMANDS

    if cmd[:1] == ["gpupack"] and len(cmd) >= 2:
        sub = cmd[1]
        if sub not in COMMANDS:
            return (f"gpupack {sub}", None, [])
        module = importlib.import_module(COMMANDS[sub][0])
        return (f"gpupack {sub}", getattr(module, "build_parser", lambda: None)(), cmd[2:])
    if cmd[:3] in (["python", "-m", "gpupack.certs"], ["python3", "-m", "gpupack.certs"]):
        from gpupack import certs

        return ("gpupack.certs", certs.build_parser(), cmd[3:])
    return None


def _expand(arg: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), "x"), arg)


def _command(c: Obj) -> list[str]:
    return [str(x) for x in (c.get("command") or []) + (c.get("args") or [])]


def _container_where(o: Obj, c: Obj) -> str:
    return f"{ident(o)} container {c.get('name')!r}"


def _declared_ports(c: Obj) -> set[Any]:
    return {p.get("containerPort") for p in c.get("ports") or []}


def container_errors(o: Obj, c: Obj, ps: Obj) -> list[str]:
    where = _container_where(o, c)
    errs = _volume_mount_errors(where, c, ps)
    errs += _args_errors(where, c)
    errs += _probe_errors(where, c)
    errs += _gpupack_resource_errors(where, c)
    errs += _image_errors(where, c)
    return errs


def _volume_mount_errors(where: str, c: Obj, ps: Obj) -> list[str]:
    volumes = {v.get("name"): v for v in ps.get("volumes") or []}
    return [
        f"{where}: volumeMount {m.get('name')!r} has no volume"
        for m in c.get("volumeMounts") or []
        if m.get("name") not in volumes
    ]


def _args_errors(where: str, c: Obj) -> list[str]:
    """A gpupack command's args: parsed by its real parser, ports declared, paths mounted."""
    cmd = _command(c)
    found = _component_parser(cmd) if cmd else None
    if found is None:
        return []
    what, parser, args = found
    if parser is None:
        errs = [f"{where}: {what}: unknown command or it has no build_parser() to check flags against"]
    else:
        errs = _parse_errors(where, what, parser, args, c)
    return errs + _arg_value_errors(where, args, c)


def _parse_errors(
    where: str, what: str, parser: argparse.ArgumentParser, args: list[str], c: Obj
) -> list[str]:
    env = {e["name"]: "x" for e in c.get("env") or [] if "name" in e}
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args([_expand(a, env) for a in args])
        except SystemExit:
            msg = buf.getvalue().strip().splitlines()
            return [f"{where}: {what} rejects its args: {msg[-1] if msg else 'exit'}"]
    return []


def _arg_value_errors(where: str, args: list[str], c: Obj) -> list[str]:
    errs: list[str] = []
    ports = _declared_ports(c)
    mounts = [m.get("mountPath", "") for m in c.get("volumeMounts") or []]
    for a in args:
        flag, _, val = a.partition("=")
        if flag.endswith("port") and val.isdigit() and int(val) != 0 and int(val) not in ports:
            errs.append(
                f"{where}: {flag}={val} is not a declared containerPort {sorted(p for p in ports if p)}"
            )
        if val.startswith("/") and not any(val == m or val.startswith(m.rstrip("/") + "/") for m in mounts):
            errs.append(f"{where}: {flag}={val} is not under any volumeMount {mounts}")
    return errs


def _probe_errors(where: str, c: Obj) -> list[str]:
    errs: list[str] = []
    ports = _declared_ports(c)
    names = {p.get("name"): p.get("containerPort") for p in c.get("ports") or [] if p.get("name")}
    for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = c.get(probe_name)
        if not probe:
            continue
        action = probe.get("httpGet") or probe.get("tcpSocket") or probe.get("grpc") or {}
        port = action.get("port")
        if isinstance(port, str) and port not in names:
            errs.append(f"{where}: {probe_name} port {port!r} is not a named container port {sorted(names)}")
        if isinstance(port, int) and port not in ports:
            errs.append(f"{where}: {probe_name} port {port} is not a declared containerPort")
    return errs


def _gpupack_resource_errors(where: str, c: Obj) -> list[str]:
    errs: list[str] = []
    res = c.get("resources") or {}
    limits, requests = res.get("limits") or {}, res.get("requests") or {}
    for key in set(limits) | set(requests):
        if key.startswith(contract.DOMAIN + "/") and key not in contract.MANAGED_RESOURCES:
            errs.append(
                f"{where}: unknown gpupack resource {key!r} (known: {', '.join(contract.MANAGED_RESOURCES)})"
            )
    for key in contract.MANAGED_RESOURCES:
        if key in requests and (
            key not in limits
            or contract.parse_quantity(requests[key]) != contract.parse_quantity(limits[key])
        ):
            errs.append(f"{where}: {key}: requests must equal limits")
    if contract.RES_GPU_SM in limits and not 1 <= contract.parse_quantity(limits[contract.RES_GPU_SM]) <= 100:
        errs.append(f"{where}: {contract.RES_GPU_SM} must be 1..100")
    return errs


def _image_errors(where: str, c: Obj) -> list[str]:
    image = c.get("image", "")
    _, tag, digest = split_image(image)
    if not digest and (not tag or tag == "latest"):
        return [f"{where}: image {image!r} is not pinned to a tag or digest"]
    return []


# --- cross-object checks ------------------------------------------------------------------------
BIND_API_CALLS = 5  # lease read, pod read, PATCH, lease read, Binding
BUILTIN_ROLES = {
    "system:kube-scheduler",
    "system:volume-scheduler",
    "system:auth-delegator",
    "extension-apiserver-authentication-reader",
    "view",
    "edit",
    "admin",
    "cluster-admin",
}
_SELECTING_KINDS = ("Deployment", "DaemonSet", "StatefulSet", "ReplicaSet")


def _ns(o: Obj) -> str:
    return (o.get("metadata") or {}).get("namespace", "")


def _name(o: Obj) -> str:
    return (o.get("metadata") or {}).get("name", "")


class Objects:
    """The rendered objects, indexed once for the cross-object checks."""

    def __init__(self, objs: list[Obj]) -> None:
        self.all = objs
        self.by_kind: dict[str, list[Obj]] = {}
        for o in objs:
            self.by_kind.setdefault(o.get("kind", ""), []).append(o)
        self.workloads = [o for o in objs if pod_spec(o) is not None]

    def of(self, kind: str) -> list[Obj]:
        return self.by_kind.get(kind, [])

    def exists(self, kind: Any, name: Any, namespace: str = "") -> bool:
        return any(_name(x) == name and _ns(x) == namespace for x in self.by_kind.get(kind, []))

    def selected(self, namespace: str, selector: Any) -> list[Obj]:
        """The pod templates in `namespace` that a label selector matches."""
        return [
            w
            for w in self.workloads
            if _ns(w) == namespace and contract.selector_matches(selector, pod_labels(w))
        ]


def semantic_errors(objs: list[Obj]) -> list[str]:
    """What a schema cannot see, one check after another, in a fixed order."""
    idx = Objects(objs)
    routes = extender_routes()
    errs = _duplicate_errors(objs)
    errs += _namespace_errors(idx)
    errs += _workload_errors(idx)
    errs += _scheduler_configmap_errors(idx, _extender_args(idx), routes)
    errs += _service_errors(idx)
    errs += _webhook_errors(idx, routes)
    errs += _role_binding_errors(idx)
    errs += _network_policy_errors(idx)
    errs += _hpa_errors(idx)
    errs += _pdb_errors(idx)
    return errs


def _duplicate_errors(objs: list[Obj]) -> list[str]:
    seen: dict[str, int] = {}
    for o in objs:
        seen[ident(o)] = seen.get(ident(o), 0) + 1
    return [f"{i}: defined {n} times" for i, n in seen.items() if n > 1]


def _namespace_errors(idx: Objects) -> list[str]:
    errs: list[str] = []
    namespaces = {_name(x) for x in idx.of("Namespace")}
    for o in idx.all:
        if o.get("kind") in CLUSTER_SCOPED:
            continue
        if not _ns(o):
            errs.append(f"{ident(o)}: namespaced object without metadata.namespace")
        elif namespaces and _ns(o) not in namespaces and _ns(o) != "kube-system":
            errs.append(f"{ident(o)}: namespace {_ns(o)!r} is not created by this kustomization")
    return errs


def _workload_errors(idx: Objects) -> list[str]:
    errs: list[str] = []
    for o in idx.workloads:
        ps = pod_spec(o) or {}
        errs += _selector_errors(o)
        errs += _service_account_errors(o, ps, idx)
        errs += _configmap_volume_errors(o, ps, idx)
        for c in _pod_containers(ps):
            errs += container_errors(o, c, ps)
            if _command(c)[:1] == ["kube-scheduler"]:
                errs += _kube_scheduler_errors(o, c, ps, idx.by_kind)
    return errs


def _pod_containers(ps: Obj) -> list[Obj]:
    return list(ps.get("initContainers") or []) + list(ps.get("containers") or [])


def _selector_errors(o: Obj) -> list[str]:
    sel = (o.get("spec") or {}).get("selector")
    if sel and o.get("kind") in _SELECTING_KINDS and not contract.selector_matches(sel, pod_labels(o)):
        return [f"{ident(o)}: spec.selector does not match the pod template's labels"]
    return []


def _service_account_errors(o: Obj, ps: Obj, idx: Objects) -> list[str]:
    sa = ps.get("serviceAccountName")
    if sa and sa != "default" and not idx.exists("ServiceAccount", sa, _ns(o)):
        return [f"{ident(o)}: serviceAccountName {sa!r} has no ServiceAccount"]
    return []


def _configmap_volume_errors(o: Obj, ps: Obj, idx: Objects) -> list[str]:
    errs: list[str] = []
    for v in ps.get("volumes") or []:
        cm = (v.get("configMap") or {}).get("name")
        if cm and not idx.exists("ConfigMap", cm, _ns(o)) and not (v["configMap"].get("optional")):
            errs.append(f"{ident(o)}: volume {v.get('name')!r}: ConfigMap {cm!r} not found")
    return errs


def _extender_args(idx: Objects) -> dict[str, str]:
    """The `--flag=value` args of the (last) `gpupack extender` container; {} without one."""
    ext_args: dict[str, str] = {}
    for o in idx.workloads:
        for c in _pod_containers(pod_spec(o) or {}):
            cmd = _command(c)
            if cmd[:2] == ["gpupack", "extender"]:
                ext_args = dict(a.partition("=")[::2] for a in cmd[2:])
    return ext_args


def _scheduler_configmap_errors(idx: Objects, ext_args: dict[str, str], routes: set[str]) -> list[str]:
    """Every KubeSchedulerConfiguration in a ConfigMap, alone and against the extender it calls."""
    errs: list[str] = []
    for cm in idx.of("ConfigMap"):
        for key, text in (cm.get("data") or {}).items():
            if "KubeSchedulerConfiguration" not in text:
                continue
            where = f"{ident(cm)} data[{key}]"
            try:
                cfg = yaml.safe_load(text)
            except yaml.YAMLError as e:
                errs.append(f"{where}: invalid YAML: {e}")
                continue
            errs += scheduler_config_errors(cfg, where)
            errs += _keep_best_errors(cfg, where, ext_args)
            for ext in (cfg or {}).get("extenders") or []:
                errs += _extender_url_errors(ext, where, ext_args)
                errs += _extender_verb_errors(ext, where, routes)
                errs += _bind_timeout_errors(ext, where, ext_args)
    return errs


def _keep_best_errors(cfg: Any, where: str, ext_args: dict[str, str]) -> list[str]:
    keep = ext_args.get("--filter-keep-best", "0") if ext_args else "0"
    if not (keep.isdigit() and int(keep) > 0):
        return []
    # the extender passes the best of the nodes it is shown: all of them, or its choice
    # is the best of a subset kube-scheduler's adaptive search happened to find
    shares = [(cfg or {}).get("percentageOfNodesToScore")]
    shares += [
        p.get("percentageOfNodesToScore")
        for p in (cfg or {}).get("profiles") or []
        if isinstance(p, dict) and p.get("schedulerName") == contract.SCHEDULER_NAME
    ]
    share = next((x for x in reversed(shares) if x is not None), None)
    if share == 100:
        return []
    return [
        f"{where}: percentageOfNodesToScore is {share}, must be 100 with the extender's "
        f"--filter-keep-best={keep} (it picks the best of the nodes it is shown)"
    ]


def _extender_url_errors(e: Obj, where: str, ext_args: dict[str, str]) -> list[str]:
    url = str(e.get("urlPrefix", ""))
    m = re.match(r"^https?://(127\.0\.0\.1|localhost|\[::1\]):(\d+)/?$", url)
    if not m:
        return [f"{where}: urlPrefix {url!r}: expected the sidecar on loopback, http://127.0.0.1:PORT"]
    if ext_args and ext_args.get("--port", "8888") != m.group(2):
        return [f"{where}: urlPrefix port {m.group(2)} != extender --port {ext_args.get('--port')}"]
    return []


def _extender_verb_errors(e: Obj, where: str, routes: set[str]) -> list[str]:
    return [
        f"{where}: {verb} {e[verb]!r}: the extender serves no /{e[verb]} (routes: {sorted(routes)})"
        for verb in ("filterVerb", "prioritizeVerb", "bindVerb", "preemptVerb")
        if verb in e and "/" + str(e[verb]) not in routes
    ]


def _bind_timeout_errors(e: Obj, where: str, ext_args: dict[str, str]) -> list[str]:
    try:
        # a bind waits for the node's pending handoff, then makes up to BIND_API_CALLS
        # API calls, each bounded by --api-timeout-s (extender/main.py's help says so)
        from extender.main import build_parser

        dflt = build_parser().parse_args([])
        wait = float(ext_args.get("--bind-wait-s", dflt.bind_wait_s))
        api = float(ext_args.get("--api-timeout-s", getattr(dflt, "api_timeout_s", 0.0)))
        worst = wait + BIND_API_CALLS * api
        if _duration_s(e.get("httpTimeout", "30s")) <= worst:
            return [
                f"{where}: httpTimeout {e.get('httpTimeout')} must exceed the extender's "
                f"worst bind: --bind-wait-s {wait:g} + {BIND_API_CALLS} x --api-timeout-s "
                f"{api:g} = {worst:g} s"
            ]
    except ValueError:
        pass
    return []


def _container_ports(workloads: list[Obj]) -> tuple[set[Any], set[Any]]:
    """(names, numbers) of the ports the app containers of `workloads` declare."""
    ports = [
        q
        for w in workloads
        for c in (pod_spec(w) or {}).get("containers") or []
        for q in c.get("ports") or []
    ]
    return {q.get("name") for q in ports}, {q.get("containerPort") for q in ports}


def _service_errors(idx: Objects) -> list[str]:
    errs: list[str] = []
    for svc in idx.of("Service"):
        sel = (svc.get("spec") or {}).get("selector") or {}
        pods = idx.selected(_ns(svc), {"matchLabels": sel})
        if sel and not pods:
            errs.append(f"{ident(svc)}: selector {sel} matches no pod template")
        for p in (svc.get("spec") or {}).get("ports") or []:
            tp = p.get("targetPort", p.get("port"))
            for w in pods:
                named, nums = _container_ports([w])
                if (isinstance(tp, str) and tp not in named) or (isinstance(tp, int) and tp not in nums):
                    errs.append(f"{ident(svc)}: targetPort {tp!r} is not a port of {ident(w)}")
    return errs


def _webhook_errors(idx: Objects, routes: set[str]) -> list[str]:
    errs: list[str] = []
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        for wc in idx.of(kind):
            for hook in wc.get("webhooks") or []:
                s = (hook.get("clientConfig") or {}).get("service")
                if s:
                    errs += _webhook_service_errors(f"{ident(wc)} {hook.get('name')}", s, idx, routes)
    return errs


def _webhook_service_errors(where: str, s: Obj, idx: Objects, routes: set[str]) -> list[str]:
    errs: list[str] = []
    svc = [x for x in idx.of("Service") if _name(x) == s.get("name") and _ns(x) == s.get("namespace")]
    if not svc:
        errs.append(f"{where}: Service {s.get('namespace')}/{s.get('name')} not found")
    elif s.get("port", 443) not in {p.get("port") for p in svc[0]["spec"].get("ports") or []}:
        errs.append(f"{where}: Service has no port {s.get('port', 443)}")
    if s.get("path") not in routes:
        errs.append(
            f"{where}: path {s.get('path')!r} is not served by the extender (routes: {sorted(routes)})"
        )
    return errs


def _role_binding_errors(idx: Objects) -> list[str]:
    errs: list[str] = []
    for kind in ("RoleBinding", "ClusterRoleBinding"):
        for b in idx.of(kind):
            ref = b.get("roleRef") or {}
            rk, rn = ref.get("kind"), ref.get("name")
            if rn not in BUILTIN_ROLES and not idx.exists(rk, rn, _ns(b) if rk == "Role" else ""):
                errs.append(f"{ident(b)}: roleRef {rk}/{rn} not found")
            for s in b.get("subjects") or []:
                if s.get("kind") == "ServiceAccount" and not idx.exists(
                    "ServiceAccount", s.get("name"), s.get("namespace", _ns(b))
                ):
                    errs.append(
                        f"{ident(b)}: subject ServiceAccount {s.get('namespace')}/{s.get('name')} not found"
                    )
    return errs


def _network_policy_errors(idx: Objects) -> list[str]:
    errs: list[str] = []
    for np_ in idx.of("NetworkPolicy"):
        pods = idx.selected(_ns(np_), (np_.get("spec") or {}).get("podSelector") or {})
        if not pods:
            errs.append(f"{ident(np_)}: podSelector matches no pod template")
        named, _ = _container_ports(pods)
        for rule in (np_.get("spec") or {}).get("ingress") or []:
            for p in rule.get("ports") or []:
                if isinstance(p.get("port"), str) and p["port"] not in named:
                    errs.append(f"{ident(np_)}: port {p['port']!r} is not a named port of the selected pods")
    return errs


def _hpa_errors(idx: Objects) -> list[str]:
    errs: list[str] = []
    for hpa in idx.of("HorizontalPodAutoscaler"):
        ref = (hpa.get("spec") or {}).get("scaleTargetRef") or {}
        if not idx.exists(ref.get("kind"), ref.get("name"), _ns(hpa)):
            errs.append(f"{ident(hpa)}: scaleTargetRef {ref.get('kind')}/{ref.get('name')} not found")
    return errs


def _pdb_errors(idx: Objects) -> list[str]:
    return [
        f"{ident(pdb)}: selector matches no pod template"
        for pdb in idx.of("PodDisruptionBudget")
        if not idx.selected(_ns(pdb), (pdb.get("spec") or {}).get("selector") or {})
    ]


def _kube_scheduler_errors(o: Obj, c: Obj, ps: Obj, by_kind: dict[str, list[Obj]]) -> list[str]:
    """--config must name a key of the ConfigMap mounted at its directory."""
    where = _container_where(o, c)
    cfg = next(
        (a.split("=", 1)[1] for a in c.get("command", []) + c.get("args", []) if a.startswith("--config=")),
        None,
    )
    if not cfg:
        return [f"{where}: kube-scheduler without --config"]
    mount = next(
        (m for m in c.get("volumeMounts") or [] if cfg.startswith(m["mountPath"].rstrip("/") + "/")), None
    )
    if not mount:
        return [f"{where}: --config={cfg} is not under any volumeMount"]
    vol: Obj = next((v for v in ps.get("volumes") or [] if v.get("name") == mount["name"]), {})
    cm_name = (vol.get("configMap") or {}).get("name")
    key = cfg[len(mount["mountPath"].rstrip("/")) + 1 :]
    cms = [x for x in by_kind.get("ConfigMap", []) if x["metadata"]["name"] == cm_name]
    if not cms or key not in (cms[0].get("data") or {}):
        return [f"{where}: --config={cfg}: ConfigMap {cm_name!r} has no key {key!r}"]
    return []


# --- driver --------------------------------------------------------------------------------------
def validate_dir(
    path: Path, renderer: str, versions: tuple[str, ...], kubectl: str | None = None
) -> tuple[int, list[str]]:
    """(objects rendered, problems) for one kustomization directory."""
    try:
        objs = render(path, renderer, kubectl)
    except RenderError as e:
        return 0, [str(e)]
    errs: list[str] = []
    for o in objs:
        errs += schema_errors(copy.deepcopy(o), versions)
    errs += semantic_errors(objs)
    return len(objs), errs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("dirs", nargs="*", help="kustomization directories (default: deploy, deploy/examples)")
    p.add_argument("--renderer", choices=RENDERERS, default="auto")
    p.add_argument("--kubectl", help="the kubectl to render with (default: $GPUPACK_KUBECTL, then PATH)")
    p.add_argument(
        "--k8s", default=",".join(DEFAULT_VERSIONS), help="Kubernetes versions to validate against"
    )
    args = p.parse_args(argv)
    versions = tuple(v.strip() for v in args.k8s.split(",") if v.strip())
    dirs = [Path(d) for d in args.dirs] or [REPO / d for d in DEFAULT_DIRS]
    try:
        for v in versions:
            _schema_dir(v)
    except ModuleNotFoundError:
        print(f"{PROG}: needs the kubernetes-validate package (pip install -e '.[test]')", file=sys.stderr)
        return 2
    except RenderError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    failed = False
    for d in dirs:
        n, errs = validate_dir(d, args.renderer, versions, args.kubectl)
        for err in errs:
            print(f"{d}: {err}")
        failed |= bool(errs)
        print(
            f"{d}: {n} objects, {len(errs)} problems (Kubernetes {', '.join(versions)}, renderer {args.renderer})"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

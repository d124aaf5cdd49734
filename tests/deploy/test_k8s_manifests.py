"""The Kubernetes manifests: every overlay rendered, every object validated, a lint, the daemon's settings.

Each overlay under ``deploy/k8s/overlays`` is rendered with ``kubectl
kustomize``; every object is validated against the Kubernetes schemas of one
pinned version (kubernetes-validate ships them: no network), strictly, so an
unknown field fails; prometheus-operator objects, whose schemas it does not
ship, get their required fields checked here. The lint: every pod runs
non-root with a RuntimeDefault seccomp profile, no service-account token,
no host namespaces, hostPath only for the directories Strata owns; every
container drops all capabilities, cannot escalate, has a read-only root
filesystem and memory requests and limits; the one exception is named with
what it may add. Every ``strata serve`` container is loaded through the real
settings loader (its args, its ConfigMap, its environment) and its pod is
checked against those settings: memory requests and limits equal to what
``kvstore.doctor.host.pod_memory_bytes`` computes from them, the arena
volume against ``ram_bytes`` and its table, the disk volume against
``disk_bytes``, the termination grace against ``grace_seconds``, the secret
files mounted, gRPC health probes on the gRPC port; its ``strata doctor``
init container checks the same settings. Placement: pods that use GPUs
tolerate the ``nvidia.com/gpu`` taint and need a GPU node, node-local pods
run at the ``strata-node`` priority, monitoring only where an overlay opts in.
The router overlay's engines, KV events, router and index are wired to one
another, and its index daemon starts on its ConfigMap. The Secrets' keys the
manifests read are those ``strata auth init`` writes. Placeholders for commands and modules not on this branch
(``strata weights``, the vLLM tier) are checked to be still missing, so this
test says when to check them for real.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from benchmarks.harness import free_port
from tests.support.manifests import (K8S, OVERLAYS, REPO, WORKLOADS, containers, kustomize_unavailable, objects,
                                     pod_spec, render)
from tests.support.wait import wait_until
from kvstore import Client
from kvstore.cli.common import serve_overrides
from kvstore.cli.main import build_parser
from kvstore.config import load_settings
from kvstore.cli.auth import secret_commands
from kvstore.doctor.host import arena_bytes, pod_memory_bytes, table_bytes

K8S_VERSION = "1.30.0"  # kubernetes-validate's schemas; native sidecars (initContainers restartPolicy) need 1.29+
# The one container allowed to run as root: it hands the node's hostPath directories to the daemon's user.
ROOT_CONTAINERS = {"prepare-dirs": {"CHOWN", "FOWNER"}}
HOST_PATHS = {"/dev/shm/strata", "/mnt/nvme/strata", "/mnt/nvme/models"}
# strata commands and modules that manifests use before they exist on this branch, and why.
# Commands (their first two arguments) the manifests use before they exist.
PENDING_COMMANDS: dict[tuple[str, str], str] = {}  # commands (first two arguments) used before they exist
PENDING_MODULES: dict[str, str] = {}  # modules the manifests name before they exist
SECRETISH = re.compile(r"PASSWORD|TOKEN|SECRET|ACCESS_KEY|PRIVATE", re.I)


_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity(text) -> int:
    """A Kubernetes memory quantity (34Gi, 8704Mi, 512M, 1024) in bytes."""
    m = re.fullmatch(r"(\d+)([KMGT]i|[kMGT])?", str(text))
    assert m, f"{text!r} is not a memory quantity this test reads"
    return int(m.group(1)) * _UNITS.get(m.group(2) or "", 1)




pytestmark = [pytest.mark.system, pytest.mark.skipif(kustomize_unavailable() is not None, reason=str(kustomize_unavailable()))]


def where(overlay: str, obj: dict, container: dict | None = None) -> str:
    return f"overlays/{overlay}: {obj['kind']}/{obj['metadata']['name']}" + (f" container {container['name']}" if container else "")


# ---- schemas ---------------------------------------------------------------------------------


def test_every_overlay_renders():
    assert {"node", "sidecar", "node-redis", "node-redis-cluster", "node-minio", "gpu", "gpu-router",
            "gpu-router-monitoring", "weights-prefetch"} <= set(OVERLAYS)
    for overlay in OVERLAYS:
        assert render(overlay), overlay


def _check_operator_object(obj: dict) -> None:
    """prometheus-operator's PodMonitor and PrometheusRule: the fields the operator requires."""
    spec = obj["spec"]
    if obj["kind"] == "PodMonitor":
        assert spec["selector"]["matchLabels"] and spec["podMetricsEndpoints"]
        for endpoint in spec["podMetricsEndpoints"]:
            assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "relabelings", "metricRelabelings",
                                     "scheme", "honorLabels"}, endpoint
    elif obj["kind"] == "PrometheusRule":
        for group in spec["groups"]:
            assert group["name"] and group["rules"]
            for rule in group["rules"]:
                assert set(rule) <= {"alert", "record", "expr", "for", "labels", "annotations"}, rule
                assert "expr" in rule and ("alert" in rule) != ("record" in rule)
    else:
        raise AssertionError(f"no check for {obj['apiVersion']} {obj['kind']}: add one")


def test_every_object_validates_against_the_pinned_kubernetes_schemas():
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    checked = 0
    for overlay, obj in objects():
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            _check_operator_object(obj)
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{where(overlay, obj)}: {err.message} at {'/'.join(map(str, err.path))}")
        checked += 1
    assert checked > 20


def test_kubernetes_validate_needs_no_network():
    pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare to take the network away")
    code = ("import kubernetes_validate as k; "
            f"k.validate({{'apiVersion': 'v1', 'kind': 'ConfigMap', 'metadata': {{'name': 'x'}}}}, '{K8S_VERSION}', strict=True)")
    done = subprocess.run(["unshare", "--net", sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# ---- lint: security context, resources, secrets -----------------------------------------------


def test_every_pod_runs_non_root_with_least_privilege():
    for overlay, obj in objects(WORKLOADS):
        spec = pod_spec(obj)
        ctx = spec.get("securityContext", {})
        assert ctx.get("runAsNonRoot") is True and ctx.get("seccompProfile") == {"type": "RuntimeDefault"}, where(overlay, obj)
        assert spec.get("automountServiceAccountToken") is False, f"{where(overlay, obj)}: it calls no Kubernetes API"
        assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), where(overlay, obj)
        for volume in spec.get("volumes", []):
            if "hostPath" in volume:
                assert volume["hostPath"]["path"] in HOST_PATHS, f"{where(overlay, obj)}: hostPath {volume['hostPath']}"
        for c in containers(spec):
            sc = c.get("securityContext", {})
            at = where(overlay, obj, c)
            assert sc.get("allowPrivilegeEscalation") is False and sc.get("readOnlyRootFilesystem") is True, at
            assert not sc.get("privileged") and sc.get("capabilities", {}).get("drop") == ["ALL"], at
            added = set(sc.get("capabilities", {}).get("add", []))
            if c["name"] in ROOT_CONTAINERS:
                assert added <= ROOT_CONTAINERS[c["name"]], at
            else:
                assert not added and sc.get("runAsUser", 1) != 0 and sc.get("runAsNonRoot") is not False, at


def test_every_strata_listener_is_served_with_authentication():
    """Safe by default: no manifest turns protected mode off, and every strata server in them (the
    daemon, a weight node, the router) is given a policy to authenticate its callers by."""
    servers = 0
    for overlay, obj in objects(WORKLOADS):
        for c in containers(pod_spec(obj)):
            args = [str(a) for a in c.get("command", []) + c.get("args", [])]
            at = where(overlay, obj, c)
            assert "--insecure" not in args and not any(a.startswith("--insecure=") for a in args), at
            assert not any(e.get("name") == "STRATA_INSECURE" for e in c.get("env", [])), at
            if "strata" in args[:1] and "serve" in args[1:3]:
                servers += 1
                configured = "--config" in args  # the node's TOML, whose [auth] file the config tests check
                assert configured or "--auth-file" in args, f"{at}: serves without --auth-file"
    assert servers >= 2


def test_every_container_has_requests_and_a_memory_limit():
    for overlay, obj in objects(WORKLOADS):
        spec = pod_spec(obj)
        for c in containers(spec):
            r, at = c.get("resources", {}), where(overlay, obj, c)
            assert {"cpu", "memory"} <= set(r.get("requests", {})) and "memory" in r.get("limits", {}), at
            assert quantity(r["limits"]["memory"]) >= quantity(r["requests"]["memory"]), at
        for volume in spec.get("volumes", []):
            if "emptyDir" in volume:
                assert "sizeLimit" in volume["emptyDir"], f"{where(overlay, obj)}: emptyDir {volume['name']} unbounded"


def test_no_secret_is_written_in_a_manifest():
    for overlay, obj in objects():
        assert obj["kind"] != "Secret", f"{where(overlay, obj)}: create Secrets out of band"
        if obj["kind"] not in WORKLOADS:
            continue
        for c in containers(pod_spec(obj)):
            for env in c.get("env", []):
                if "value" not in env:
                    continue
                literal = re.sub(r"\$\([A-Z0-9_]+\)", "", env["value"])
                assert not SECRETISH.search(env["name"]) or not literal, f"{where(overlay, obj, c)}: {env['name']}"
                assert not re.search(r"://[^/@\s]*:[^$/@\s][^/@\s]*@", env["value"]), (
                    f"{where(overlay, obj, c)}: {env['name']} has a password in a URL: take it from a Secret as $(VAR)")


# ---- the daemon's settings against its pod ------------------------------------------------------


ENV_STAND_INS = {"spec.nodeName": "node-1", "status.podIP": "10.0.0.7", "metadata.name": "pod-0"}


def environment(c: dict) -> dict[str, str]:
    """The container's environment as the kubelet makes it: $(VAR) expanded; stand-ins for the
    downward API and for Secrets (a placeholder password)."""
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\(([A-Z0-9_]+)\)", lambda m: env.get(m.group(1), m.group(0)), e["value"])
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = ENV_STAND_INS[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[e["name"]] = "0123456789abcdef"
    return env


def config_file(rendered: tuple[dict, ...], spec: dict, c: dict, path: str, tmp_path: Path) -> Path:
    """The file at ``path`` in the container: a ConfigMap key mounted by subPath, written out."""
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == path)
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    cm = next(o for o in rendered if o["kind"] == "ConfigMap" and o["metadata"]["name"] == volume["configMap"]["name"])
    out = tmp_path / f"{cm['metadata']['name']}.toml"
    out.write_text(cm["data"][mount["subPath"]])
    return out


def strata_containers():
    for overlay, obj in objects(WORKLOADS):
        spec = pod_spec(obj)
        for c in containers(spec):
            if c.get("command") == ["strata"]:
                yield overlay, obj, spec, c


def settings_of(overlay: str, spec: dict, c: dict, tmp_path: Path):
    args = list(c["args"])
    if "--config" in args:
        i = args.index("--config")
        args[i + 1] = str(config_file(render(overlay), spec, c, args[i + 1], tmp_path))
    parsed = build_parser().parse_args(args)
    return load_settings(parsed.config, environ=environment(c), **serve_overrides(parsed))


def volume_at(spec: dict, c: dict, path: Path) -> tuple[dict, str]:
    """The volume mounted at ``path`` or above it, and its mount path."""
    best = max((m for m in c.get("volumeMounts", []) if str(path).startswith(m["mountPath"].rstrip("/") + "/")
                or str(path) == m["mountPath"]), key=lambda m: len(m["mountPath"]), default=None)
    assert best is not None, f"nothing is mounted at {path}"
    return next(v for v in spec["volumes"] if v["name"] == best["name"]), best["mountPath"]


def test_every_strata_serve_container_loads_and_its_pod_matches_its_tiers(tmp_path):
    served = 0
    for overlay, obj, spec, c in strata_containers():
        if c["args"][0] != "serve":
            continue
        served += 1
        at = where(overlay, obj, c)
        s = settings_of(overlay, spec, c, tmp_path)
        disk = int(s.tiers.disk.bytes) if "disk" in s.tiers.chain else 0
        memory = c["resources"]["requests"]["memory"], c["resources"]["limits"]["memory"]
        wanted = pod_memory_bytes(s)
        assert tuple(map(quantity, memory)) == (wanted, wanted), (
            f"{at}: memory {memory}: the arena, its block table and the daemon's headroom make {wanted >> 20}Mi "
            "(requests = limits; docs/deploy/kubernetes.md#sizing)")
        arena, _ = volume_at(spec, c, s.tiers.ram.shm_dir)
        if "emptyDir" in arena:
            assert arena["emptyDir"].get("medium") == "Memory", f"{at}: the arena needs a memory-backed volume"
            assert quantity(arena["emptyDir"]["sizeLimit"]) >= arena_bytes(s) + table_bytes(s), (
                f"{at}: arena volume < the arena + its table")
        else:
            assert arena["hostPath"]["path"].startswith("/dev/shm/"), f"{at}: the arena belongs on the node's tmpfs"
        if disk:
            volume, _ = volume_at(spec, c, s.tiers.disk.dir)
            assert "hostPath" in volume or quantity(volume["emptyDir"]["sizeLimit"]) >= disk, f"{at}: disk volume"
        if s.server.unix_socket:
            volume_at(spec, c, Path(s.server.unix_socket))
        grace = spec.get("terminationGracePeriodSeconds", 30)
        assert grace >= 2 * s.server.grace_seconds + 10, f"{at}: {grace}s cannot drain ({s.server.grace_seconds}s) and persist"
        for flag, path in (("--auth-file", s.auth.file), ("--peer-token-file", s.tiers.peer.token_file)):
            if path:
                volume, _ = volume_at(spec, c, Path(path))
                assert "secret" in volume, f"{at}: {flag} {path} is not on a Secret volume"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probe in c, f"{at}: no {probe}"
        listen_port = int(s.server.listen.rpartition(":")[2])
        if not s.server.listen.startswith("127."):
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[probe].get("grpc", {}).get("port") == listen_port, f"{at}: {probe} is not gRPC health"
            assert c["readinessProbe"]["grpc"].get("service") == "strata.kv.v1.KVService"
        metrics_port = int(s.server.metrics_listen.rpartition(":")[2])
        assert {"name": "metrics", "containerPort": metrics_port} in c["ports"], f"{at}: no metrics port"
        assert obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "strata"
    assert served >= 2


def test_every_other_strata_command_parses_or_is_pending(tmp_path):
    for overlay, obj, spec, c in strata_containers():
        command = c["args"][0]
        if command == "serve":
            continue
        if tuple(c["args"][:2]) in PENDING_COMMANDS:
            continue
        if command == "weights":  # the weight pipeline's own command line (strata weights runs weightcache's)
            from weightcache.cli import build_parser

            args = build_parser().parse_args(c["args"][1:])  # argparse exits (a failed test) on a bad flag
            assert args.command == c["args"][1]
            continue
        if command == "route":
            router_settings(c, tmp_path)
            continue
        settings_of(overlay, spec, c, tmp_path)  # parses (strata doctor takes serve's settings)


def router_settings(c: dict, tmp_path: Path):
    """``strata route``'s settings; its --model-dir (filled by the pod's init container) is a folder here."""
    from kvstore.config.router import ROUTER_SETTINGS, load_router_settings

    args = list(c["args"])
    if "--model-dir" in args:
        args[args.index("--model-dir") + 1] = str(tmp_path)
    parsed = build_parser().parse_args(args)
    overrides = {r.flag: getattr(parsed, r.flag) for r in ROUTER_SETTINGS if getattr(parsed, r.flag) is not None}
    return load_router_settings(parsed.config, environ={}, **overrides)


def test_every_doctor_init_container_checks_the_settings_its_daemon_serves(tmp_path):
    checked = 0
    for overlay, obj, spec, c in strata_containers():
        if c["args"][0] != "doctor":
            continue
        [serve] = [d for d in containers(spec) if d.get("command") == ["strata"] and d["args"][0] == "serve"]
        doctor, daemon = settings_of(overlay, spec, c, tmp_path), settings_of(overlay, spec, serve, tmp_path)
        for part in ("ram", "disk"):
            assert getattr(doctor.tiers, part) == getattr(daemon.tiers, part), (
                f"{where(overlay, obj, c)}: checks [tiers.{part}] {getattr(doctor.tiers, part)}, the daemon serves "
                f"{getattr(daemon.tiers, part)}: give it the same settings (the same env)")
        assert doctor.auth == daemon.auth
        checked += 1
    assert checked >= 2


def test_pending_commands_and_modules_do_not_exist_yet():
    used = {tuple(c["args"][:2]) for _, _, _, c in strata_containers()}
    assert set(PENDING_COMMANDS) <= used, "a pending command no manifest uses: drop it from PENDING_COMMANDS"
    for command, why in PENDING_COMMANDS.items():
        done = subprocess.run([sys.executable, "-m", "kvstore.cli.main", *command, "--help"], capture_output=True,
                              text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode != 0, (
            f"`strata {' '.join(command)}` exists now ({why}): check the manifests' use of it against the real command "
            "and remove it from PENDING_COMMANDS")
    rendered = "\n".join(yaml.safe_dump(o) for _, o in objects())
    for module, why in PENDING_MODULES.items():
        assert module in rendered, f"no manifest names {module}: drop it from PENDING_MODULES"
        assert importlib.util.find_spec(module) is None, (
            f"{module} exists now ({why}): check the manifests against it and remove it from PENDING_MODULES")


def test_every_module_path_a_manifest_names_exists():
    rendered = "\n".join(yaml.safe_dump(o) for _, o in objects())
    named = set(re.findall(r'module_path\W+(kvstore[\w.]+)', rendered))
    assert "kvstore.integrations.vllm" in named
    for module in named - set(PENDING_MODULES):
        assert importlib.util.find_spec(module) is not None, f"a manifest names {module}, which does not exist"


def test_engines_on_the_node_map_the_daemon_s_arena_at_its_path_as_its_uid(tmp_path):
    [(_, daemon, dspec, dc)] = [x for x in strata_containers() if x[0] == "node" and x[3]["args"][0] == "serve"]
    s = settings_of("node", dspec, dc, tmp_path)
    arena, mounted_at = volume_at(dspec, dc, s.tiers.ram.shm_dir)
    assert mounted_at == str(s.tiers.ram.shm_dir)
    uid = dspec["securityContext"]["runAsUser"]
    [engine] = [o for o in render("node-engine") if o["kind"] == "Deployment"]
    espec = pod_spec(engine)
    [shared] = [v for v in espec["volumes"] if v.get("hostPath", {}).get("path") == arena["hostPath"]["path"]]
    for c in espec["containers"]:
        mount = next(m for m in c["volumeMounts"] if m["name"] == shared["name"])
        assert mount["mountPath"] == mounted_at, "the arena's path is the daemon's: mount it at the same path"
    assert espec["securityContext"]["runAsUser"] == uid, "the arena file is 0600: run engines as the daemon's uid"
    lmcache = next(o for o in render("node-engine") if o["kind"] == "ConfigMap")["data"]["lmcache.yaml"]
    target = yaml.safe_load(lmcache)["extra_config"]["remote_storage_plugin.strata.target"]
    assert target == f"unix:{s.server.unix_socket}"


def test_the_sidecar_shares_its_arena_with_vllm_through_a_memory_volume(tmp_path):
    [(_, _, spec, c)] = [x for x in strata_containers() if x[0] == "sidecar"]
    s = settings_of("sidecar", spec, c, tmp_path)
    arena, path = volume_at(spec, c, s.tiers.ram.shm_dir)
    assert arena["emptyDir"]["medium"] == "Memory" and c.get("restartPolicy") == "Always"
    [vllm] = spec["containers"]
    assert {"name": arena["name"], "mountPath": path} in vllm["volumeMounts"]
    assert s.server.listen.startswith("127.0.0.1:"), "the sidecar serves loopback only (no token needed)"


def test_the_disruption_budget_covers_the_daemonset():
    for overlay in OVERLAYS:
        rendered = render(overlay)
        for ds in (o for o in rendered if o["kind"] == "DaemonSet"):
            labels = ds["spec"]["template"]["metadata"]["labels"]
            pdbs = [o for o in rendered if o["kind"] == "PodDisruptionBudget"
                    and o["spec"]["selector"]["matchLabels"].items() <= labels.items()]
            assert pdbs and pdbs[0]["spec"]["maxUnavailable"] == 1, overlay


def test_the_podmonitor_scrapes_every_pod_with_a_metrics_port():
    """The daemons' and the weight nodes' (overlays/weights-prefetch) ``metrics`` ports: the one
    PodMonitor selects them by labels, in its own namespace, so a pod without them goes unscraped."""
    monitors = [o for _, o in objects({"PodMonitor"})]
    assert monitors, "no overlay renders the PodMonitor (components/monitoring)"
    monitor = monitors[0]  # every overlay with components/monitoring renders the same one
    wanted = monitor["spec"]["selector"]["matchLabels"].items()
    ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    scraped = set()
    for overlay, obj in objects(WORKLOADS):
        template = obj["spec"]["template"]
        named = {p.get("name") for c in containers(template["spec"]) for p in c.get("ports", [])}
        if "metrics" not in named:
            continue
        assert named & ports, f"{where(overlay, obj)}: its metrics port is not one the PodMonitor scrapes ({ports})"
        assert wanted <= template["metadata"].get("labels", {}).items(), (
            f"{where(overlay, obj)}: its pods lack the PodMonitor's labels {dict(wanted)}")
        assert obj["metadata"].get("namespace") == monitor["metadata"].get("namespace"), where(overlay, obj)
        scraped.add(template["metadata"]["labels"].get("app.kubernetes.io/component"))
    assert "weight-node" in scraped, "the weight node's metrics port is not scraped"


# ---- placement: GPU nodes, priority ------------------------------------------------------------


GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
GPU_OVERLAYS = {"gpu", "gpu-router", "gpu-router-monitoring", "weights-prefetch"}


def gpu_terms(spec: dict) -> list:
    required = spec.get("affinity", {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", {})
    return required.get("nodeSelectorTerms", [])


def test_pods_on_gpus_tolerate_the_gpu_taint_and_need_a_gpu_node():
    """Every pod that asks for a GPU, and every workload of the GPU overlays, tolerates the
    nvidia.com/gpu taint and requires a node labelled nvidia.com/gpu.present (components/gpu-nodes)."""
    placed = set()
    for overlay, obj in objects(WORKLOADS):
        spec = pod_spec(obj)
        uses_gpu = any("nvidia.com/gpu" in c.get("resources", {}).get("limits", {}) for c in containers(spec))
        on_gpu_nodes = overlay in GPU_OVERLAYS and obj["metadata"].get("labels", {}).get("strata/node-pool") == "gpu"
        if not (uses_gpu or on_gpu_nodes):
            continue
        at = where(overlay, obj)
        assert GPU_TAINT in spec.get("tolerations", []), f"{at}: does not tolerate the nvidia.com/gpu taint"
        assert gpu_terms(spec) == [{"matchExpressions": [
            {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}]}], f"{at}: {gpu_terms(spec)}"
        placed.add((overlay, obj["kind"], obj["metadata"]["name"]))
    assert {("gpu", "DaemonSet", "strata-node"), ("gpu-router", "StatefulSet", "vllm"),
            ("gpu-router", "DaemonSet", "strata-weights"), ("weights-prefetch", "Job", "strata-weights-prefetch"),
            ("node-engine", "Deployment", "vllm-node-strata"), ("sidecar", "Deployment", "vllm-strata")} <= placed
    for overlay in ("node", "node-redis"):  # the plain overlays run anywhere
        assert all(not gpu_terms(pod_spec(o)) for o in render(overlay) if o["kind"] in WORKLOADS), overlay


def test_the_gpu_placement_is_overridden_by_the_patch_the_docs_show(tmp_path):
    """docs/deploy/kubernetes.md's overlay for another GPU label, rendered: every GPU workload
    takes its node affinity, and keeps the toleration."""
    doc = (REPO / "docs" / "deploy" / "kubernetes.md").read_text()
    [block] = re.findall(r"```yaml\n(# overlays/my-gpu-pool/kustomization\.yaml\n.*?)```", doc, re.S)
    kustomization = yaml.safe_load(block)
    target = tmp_path / "my-gpu-pool"
    target.mkdir()
    kustomization["resources"] = [os.path.relpath(K8S / "overlays" / "gpu", target)]
    (target / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    done = subprocess.run(["kubectl", "kustomize", str(target)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    [daemon] = [o for o in yaml.safe_load_all(done.stdout) if o and o["kind"] == "DaemonSet"]
    spec = pod_spec(daemon)
    assert GPU_TAINT in spec["tolerations"]
    assert gpu_terms(spec) != gpu_terms(pod_spec(next(o for o in render("gpu") if o["kind"] == "DaemonSet")))
    assert "nvidia.com/gpu.present" not in yaml.safe_dump(gpu_terms(spec))


def test_node_local_pods_run_at_the_strata_node_priority():
    for overlay in OVERLAYS:
        rendered = render(overlay)
        classes = {o["metadata"]["name"]: o for o in rendered if o["kind"] == "PriorityClass"}
        assert set(classes) <= {"strata-node"}, overlay
        for strata_node in classes.values():
            assert 0 < strata_node["value"] < 1_000_000_000 and strata_node["globalDefault"] is False, (
                "a cache ranks above workloads and below every system class (system-* are 2e9 and up)")
        for obj in (o for o in rendered if o["kind"] in WORKLOADS):
            name = pod_spec(obj).get("priorityClassName")
            assert name is None or name in classes, f"{where(overlay, obj)}: priority class {name}"
            if obj["kind"] == "DaemonSet":
                assert name == "strata-node", f"{where(overlay, obj)}: a node-local cache runs at strata-node"


# ---- monitoring is opt-in ---------------------------------------------------------------------


def test_monitoring_comes_only_with_an_overlay_that_opts_in():
    """prometheus-operator's kinds fail to apply without its CRDs: no overlay renders them but
    those named *-monitoring, and each of those is its base overlay plus the monitoring objects."""
    for overlay in OVERLAYS:
        operator_kinds = [o for o in render(overlay) if o["apiVersion"].startswith("monitoring.coreos.com/")]
        if not overlay.endswith("-monitoring"):
            assert not operator_kinds, f"overlays/{overlay} pulls in monitoring: make it opt-in"
            continue
        base = overlay.removesuffix("-monitoring")
        assert {o["kind"] for o in operator_kinds} == {"PodMonitor", "PrometheusRule"}
        rest = [o for o in render(overlay) if o not in operator_kinds]
        assert sorted(map(yaml.safe_dump, rest)) == sorted(map(yaml.safe_dump, render(base))), overlay


# ---- the router overlay: engines, KV events, router, index -------------------------------------


def _container(obj: dict, name: str) -> dict:
    return next(c for c in containers(pod_spec(obj)) if c["name"] == name)


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_the_router_its_index_and_the_engines_kv_events_are_wired(tmp_path):
    rendered = render("gpu-router")
    [engines] = [o for o in rendered if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "vllm"]
    [service] = [o for o in rendered if o["kind"] == "Service" and o["metadata"]["name"] == engines["spec"]["serviceName"]]
    [router_pod] = [o for o in rendered if o["kind"] == "Deployment" and o["metadata"]["name"] == "strata-router"]
    assert service["spec"]["clusterIP"] == "None", "the engines need one DNS name each"
    namespace = engines["metadata"]["namespace"]
    vllm = _container(engines, "vllm")
    args, env = vllm["args"], environment(vllm)
    ports = {p["name"]: p["containerPort"] for p in vllm["ports"]}
    events = json.loads(_arg(args, "--kv-events-config"))
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    assert events["endpoint"] == f"tcp://*:{ports['kv-events']}" and events["replay_endpoint"] == f"tcp://*:{ports['kv-replay']}"
    if importlib.util.find_spec("vllm") is not None:  # vLLM's own config class takes it as given
        from vllm.config.kv_events import KVEventsConfig

        KVEventsConfig(**events)
    assert _arg(args, "--prefix-caching-hash-algo") == "sha256_cbor"

    index = _container(router_pod, "index")
    s = settings_of("gpu-router", pod_spec(router_pod), index, tmp_path)
    sources = s.index.event_sources()
    router = router_settings(_container(router_pod, "router"), tmp_path)
    host = "{pod}." + f"{service['metadata']['name']}.{namespace}.svc"
    pods = [f"{engines['metadata']['name']}-{i}" for i in range(len(sources))]
    assert len(pods) >= engines["spec"]["replicas"], "the index follows every replica"
    assert [(x["endpoint"], x["replay_endpoint"], x["engine_id"]) for x in sources] == [
        (f"tcp://{host.format(pod=p)}:{ports['kv-events']}", f"tcp://{host.format(pod=p)}:{ports['kv-replay']}", p)
        for p in pods]
    assert {x["namespace"] for x in sources} == {router.namespace}
    assert router.endpoints == [f"http://{host.format(pod=p)}:{ports['http']}={p}" for p in pods]
    assert router.index == s.server.listen and s.server.listen.startswith("127.0.0.1:"), "the index is in the pod"
    assert router.block_size == int(_arg(args, "--block-size")) and router.hash_seed == env["PYTHONHASHSEED"]
    assert _arg(_container(router_pod, "router")["args"], "--model-dir") == "/models/tokenizer"
    assert router.listen.startswith("0.0.0.0:")


def test_the_router_s_index_daemon_starts_on_its_config_and_follows_engines_not_yet_running(tmp_path):
    """The rendered ConfigMap, served by a real daemon (its paths moved under tmp_path): it starts
    with four engines whose names do not resolve here, and answers."""
    rendered = render("gpu-router")
    [router_pod] = [o for o in rendered if o["kind"] == "Deployment" and o["metadata"]["name"] == "strata-router"]
    spec = pod_spec(router_pod)
    config = config_file(rendered, spec, _container(router_pod, "index"), "/etc/strata/strata.toml", tmp_path)
    port = free_port()
    log = tmp_path / "index.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli.main", "serve", "--config", str(config),
                                 "--listen", f"127.0.0.1:{port}", "--metrics-listen", "", "--shm-dir", str(tmp_path),
                                 "--disk-dir", str(tmp_path / "state"), "--log-format", "text"],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        wait_until(lambda: proc.poll() is not None or "ready on" in log.read_text(), timeout=60,
                   what=f"the router's index daemon to start (log: {log})")
        assert proc.poll() is None, log.read_text()
        with Client(f"127.0.0.1:{port}", use_shm=False, retries=0) as kv:
            assert kv.stats() is not None
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ---- secrets ------------------------------------------------------------------------------------


def test_the_secret_keys_the_manifests_read_are_those_strata_auth_init_writes(tmp_path):
    written: dict[str, set[str]] = {}
    for command in secret_commands(tmp_path, "strata"):
        name = command.split("create secret generic ")[1].split()[0]
        written[name] = set(re.findall(r"--from-file=([^=]+)=", command))
    used: set[tuple[str, str]] = set()
    for overlay, obj in objects(WORKLOADS):
        spec = pod_spec(obj)
        rendered = render(overlay)
        text_of_pod = yaml.safe_dump(obj) + "".join(
            yaml.safe_dump(o["data"]) for o in rendered if o["kind"] == "ConfigMap"
            and any(v.get("configMap", {}).get("name") == o["metadata"]["name"] for v in spec.get("volumes", [])))
        for volume in spec.get("volumes", []):
            secret = volume.get("secret", {}).get("secretName")
            if secret not in written:
                continue
            for item in volume["secret"].get("items", []):
                used.add((secret, item["key"]))
            for c in containers(spec):
                for mount in (m for m in c.get("volumeMounts", []) if m["name"] == volume["name"]):
                    for key in re.findall(re.escape(mount["mountPath"].rstrip("/")) + r"/([\w.-]+)", text_of_pod):
                        used.add((secret, key))
    assert {"strata-auth", "strata-engine-token"} == {s for s, _ in used}
    for secret, key in sorted(used):
        assert key in written[secret], f"the manifests read key {key} of Secret {secret}; strata auth init writes {written[secret]}"


def test_every_call_to_a_weight_node_authenticates_with_a_token_the_pod_mounts():
    """The weight node serves with --auth-file: a ``strata weights`` command that names it (--node)
    needs --token-file, a file of a Secret mounted in its container."""
    calls = 0
    for overlay, obj, spec, c in strata_containers():
        args, at = c["args"], where(overlay, obj, c)
        if args[0] != "weights" or "--node" not in args:
            continue
        calls += 1
        assert "--token-file" in args, f"{at}: calls the weight node {_arg(args, '--node')} without --token-file"
        path = Path(_arg(args, "--token-file"))
        secrets = {v["name"]: v["secret"] for v in spec.get("volumes", []) if "secret" in v}
        mounts = [m for m in c.get("volumeMounts", []) if m["name"] in secrets and path.parent == Path(m["mountPath"])]
        assert mounts, f"{at}: no Secret is mounted at {path.parent} for --token-file {path}"
        items = secrets[mounts[0]["name"]].get("items")
        assert items is None or path.name in {i["path"] for i in items}, f"{at}: the Secret mounted has no {path.name}"
    assert calls >= 3  # the prefetch Job, the router overlay's engines, the weights-wait component


def test_a_hugging_face_token_is_optional_and_only_from_its_secret():
    found = set()
    for overlay, obj in objects(WORKLOADS):
        for c in containers(pod_spec(obj)):
            for e in c.get("env", []):
                if e["name"] != "HF_TOKEN":
                    continue
                assert e.get("valueFrom", {}).get("secretKeyRef") == {"name": "strata-hf-token", "key": "token",
                                                                      "optional": True}, where(overlay, obj, c)
                found.add((overlay, c["name"]))
    assert {("gpu-router", "vllm"), ("gpu-router", "tokenizer")} <= found

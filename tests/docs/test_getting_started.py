"""docs/getting-started.md's one-machine recipe, run as written: the doc cannot rot.

Every ``sh`` block of the section *Two daemons, Redis, the router and an engine, on one machine*
runs in order in one bash (``set -e``: a command that fails fails the test), from the
repository's root, inside a network namespace of its own (``unshare --net``), so the recipe's
fixed ports (Redis's 6379, the daemons', the engines', the router's) cannot meet another
process's. The recipe's last block stops everything and removes the arenas; the test then
checks the router counted the cache hit the doc shows. It needs root (for the namespace),
redis-server and curl, and the reference engine's torch; it skips, saying which, without them.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "getting-started.md"
SECTION = "## Two daemons, Redis, the router and an engine, on one machine"


def recipe() -> tuple[list[str], str]:
    """The section's sh blocks, and the text block the doc says the hit looks like."""
    text = DOC.read_text()
    section = text[text.index(SECTION):]
    section = section[: section.index("\n## ", len(SECTION))]
    return re.findall(r"```sh\n(.*?)```", section, re.S), re.findall(r"```text\n(.*?)```", section, re.S)[0].strip()


def missing() -> str | None:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs root, unshare and ip for a network namespace of its own"
    for tool in ("redis-server", "curl"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if importlib.util.find_spec("torch") is None:
        return "the reference engine needs torch (pip install torch==2.13.0, the CPU build)"
    return None


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(missing() is not None, reason=str(missing()))
def test_the_one_machine_recipe_runs_as_written_and_shows_a_cache_hit(tmp_path):
    blocks, shown = recipe()
    assert len(blocks) >= 4
    script = tmp_path / "recipe.sh"
    # The blocks as they are; the last one (the clean-up) runs even when another failed.
    body = "\n".join(blocks[:-1])
    script.write_text("set -e\nip link set lo up\ntrap 'set +e; " + blocks[-1].strip().replace("'", "'\\''").replace(
        "\n", "; ") + "' EXIT\n" + body)
    bindir = str(Path(sys.executable).parent)  # strata and python of this environment
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ["PATH"], "PYTHONPATH": str(REPO),
           "TMPDIR": str(tmp_path)}
    done = subprocess.run(["unshare", "--net", "bash", str(script)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=540)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in tmp_path.rglob("*.log"))
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{logs}"
    assert "a block of bytes" in done.stdout, "the block put into node-a is read from node-b"
    metric = shown.rpartition(" ")[0]
    [count] = [float(line.rpartition(" ")[2]) for line in done.stdout.splitlines() if line.startswith(metric + " ")]
    assert f"{metric} {count}" == shown, f"the doc shows {shown!r}; the recipe printed:\n{done.stdout}"

"""The package as a user installs it: a wheel built from a copy of the checkout's tracked files, installed (not
editable) into a fresh virtual environment, started outside the checkout. From there it runs a 2-peer swarm with its
own launcher (``swarm.launch``) and a greedy generation equal to local Hugging Face's.

The fresh environment gets the wheel alone (``--no-deps --no-index``); its dependencies (torch, transformers,
hivemind, ...: gigabytes, and no network here) are the project environment's, put on its path by a ``.pth`` line.
Such a line adds a folder without running the ``.pth`` files inside it, so the project's editable install of
``swarm`` stays invisible: what imports is the wheel's copy, which the driver checks, with every requirement the
wheel declares met by what is on that path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from tests.helpers.models import local_reference, make_tiny_model

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

# Runs inside the fresh environment, from a folder outside the checkout: prints one JSON line.
DRIVER = r"""
import importlib.metadata, importlib.resources, importlib.util, json, sys

from packaging.requirements import Requirement

import torch

import peers.node, swarm.client.model, swarm.families.spec  # the wheel once missed swarm/families
from swarm import DistributedModelForCausalLM
from swarm.config import Timing
from swarm.launch import LocalSwarm

folder = sys.argv[1]
files = {name: m.__file__ for name, m in (("swarm", swarm.client.model), ("peers", peers.node))}
data = [
    importlib.resources.files("swarm.dashboard") / "static" / "dashboard.html",
    importlib.resources.files("swarm_configs") / "models" / "smollm2-135m.toml",
    importlib.resources.files("swarm_configs") / "runs" / "tiny-llama.toml",
    importlib.resources.files("swarm_configs") / "hardware" / "h100.toml",
]
dist = importlib.metadata.distribution("fusion-swarm")
wanted = [Requirement(r) for r in dist.requires or []]
unmet = [str(r) for r in wanted if (r.marker is None or r.marker.evaluate({"extra": ""}))
         and importlib.metadata.version(r.name) not in r.specifier]
shipped = {name: importlib.util.find_spec(name) is not None for name in ("harness", "tests")}
with LocalSwarm(folder, ["0:2", "2:4"], extra_args=("--throughput", "100"), test_timings=True) as local:
    with DistributedModelForCausalLM.from_pretrained(
        folder, initial_peers=local.initial_peers, timing=Timing.for_tests(), codec="none"
    ) as model:
        ids = torch.tensor([[5, 17, 101, 3, 250, 42, 7]])
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
        route = [hop.peer_id for hop in model.route]
result = {"files": files, "dist": str(dist.locate_file("")), "unmet": unmet, "wanted": len(wanted)}
result |= {"data": [p.is_file() for p in data], "shipped": shipped, "tokens": out.tolist(), "route": route}
print(json.dumps(result))
"""


def _run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> str:
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


def test_the_wheel_installs_and_runs_a_swarm(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    # 1. the wheel, built from a copy of the files git has or would add (not build outputs, caches or .venv)
    source = tmp_path / "source"
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for rel in tracked.splitlines():
        if (ROOT / rel).is_file():
            (source / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, source / rel)
    pip = [sys.executable, "-m", "pip"]
    _run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(source)],
        env,
        tmp_path,
        300,
    )
    (wheel,) = (tmp_path / "dist").glob("fusion_swarm-*.whl")

    # 2. a fresh environment holding the wheel; the dependencies come from the project environment's folder
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env, tmp_path, 120)
    python = str(venv / "bin" / "python")
    purelib = Path(
        _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env, tmp_path, 60).strip()
    )
    (purelib / "project-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([*pip, "--python", python, "install", "--no-deps", "--no-index", "-q", str(wheel)], env, tmp_path, 300)

    # 3. from outside the checkout: a tiny perturbed Llama served by two peers, and a greedy generation
    folder = make_tiny_model(tmp_path / "tiny-llama", "llama", perturb=0.02)
    (tmp_path / "driver.py").write_text(DRIVER)
    out = _run([python, str(tmp_path / "driver.py"), str(folder)], env, tmp_path, 600)
    result = json.loads(out.strip().splitlines()[-1])

    assert all(Path(f).resolve().is_relative_to(venv.resolve()) for f in result["files"].values()), result["files"]
    assert Path(result["dist"]).resolve().is_relative_to(venv.resolve()) and result["wanted"] > 10
    assert result["unmet"] == []
    assert all(result["data"]), "package data missing from the wheel"
    assert result["shipped"] == {"harness": False, "tests": False}
    assert len(set(result["route"])) == 2  # both peers served
    ids = torch.tensor([[5, 17, 101, 3, 250, 42, 7]])
    reference = local_reference(folder).generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert result["tokens"] == reference.tolist()

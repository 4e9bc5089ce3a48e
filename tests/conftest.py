"""Shared fixtures: tiny random models of each family (saved once per session) and the converted SmolLM2 folder.
Every session starts with empty caches of its own (``pytest_configure``). The plain helpers the tests share (saving
tiny models, the local Hugging Face run to compare a swarm with, ...) are in ``tests.helpers``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

# A failed assert inside a helper says what it compared, as one in a test does (before any helper is imported).
pytest.register_assert_rewrite("tests.helpers")

from tests.helpers.examples import FAST_SUBSET  # noqa: E402
from tests.helpers.models import TinyModels  # noqa: E402

# Every hypothesis test draws the same cases on every run and machine (derandomized: seeded from the test itself) and
# reads no example database a previous run left behind. A test's own ``@settings`` add to this profile.
settings.register_profile("swarm", derandomize=True, database=None, deadline=None)
settings.load_profile("swarm")


SMOLLM = "smollm2-135m"
_SESSION_CACHE: list[Path] = []
_CONVERSION: list[tuple[subprocess.Popen[str], Path]] = []
# what a peer does on its first start with --log-format json: convert the card into the cache, printing the folder
_CONVERT = (
    "from swarm.config import default_cache_dir, load_model_card\n"
    "from swarm.logs import configure_logging\n"
    "from swarm.model_files import model_folder\n"
    "configure_logging('INFO', 'json')\n"
    f"print(model_folder(load_model_card({SMOLLM!r}), default_cache_dir()))\n"
)


def pytest_configure(config: pytest.Config) -> None:
    """Point every cache at an empty folder of this session, before any test, fork server or peer starts (they all
    inherit the environment): converted models, weight fingerprints, throughput probes, ONNX exports, calibrations
    and default checkpoints (``SWARM_CACHE_DIR``), and Hugging Face's (``HF_HOME``). So the suite runs as on a fresh
    machine every time, and nothing passes only because an earlier run left something behind."""
    root = Path(tempfile.mkdtemp(prefix="swarm-test-caches-"))
    _SESSION_CACHE.append(root)
    os.environ["SWARM_CACHE_DIR"] = str(root / "swarm")
    os.environ["HF_HOME"] = str(root / "huggingface")
    FAST_SUBSET.append("not slow" in (config.getoption("markexpr") or ""))
    # One torch thread in the test processes, as the peers run (``--threads`` 1): two workers of two threads each,
    # beside the peers, on the suite's two cores, spun in each other's way (the coverage walk took 3x its time alone)
    import torch

    torch.set_num_threads(1)


# The files that take longest (seconds in a fresh-clone run on the 2-core VM, two workers, stop 71), longest first:
# the two workers take files in the order collected (scripts/test.sh: ``--no-loadscope-reorder``), so these start
# first and the many short files fill in around them, instead of one long file starting last while the other worker
# idles. Order only: which tests run, and how, does not depend on it.
LONGEST_FIRST = (
    "tests/integration/test_families.py",  # 348
    "tests/integration/test_pretrain.py",  # 335
    "tests/integration/test_api_features.py",  # 151
    "tests/integration/test_nat_swarm.py",  # 133
    "tests/integration/test_readme_tour.py",  # 118
    "tests/unit/test_family_infer.py",  # 109: the coverage walk
    "tests/integration/test_busy.py",  # 106
    "tests/integration/test_smollm.py",  # 98
    "tests/integration/test_attacks.py",  # 96
    "tests/integration/test_reachability_matrix.py",  # 86
    "tests/integration/test_api.py",  # 85
    "tests/integration/test_lifecycle.py",  # 80
    "tests/integration/test_failover.py",  # 70
    "tests/integration/test_replica_heal.py",  # 70
    "tests/integration/test_chaining.py",  # 62
    "tests/integration/test_dashboard_browser.py",  # 62
    "tests/integration/test_speculative_live.py",  # 61
    "tests/integration/test_verification.py",  # 59
    "tests/integration/test_gpu_check.py",  # 58
    "tests/integration/test_keepalive.py",  # 50
    "tests/integration/test_runtimes.py",  # 48
    "tests/integration/test_quantized.py",  # 48
    "tests/integration/test_wan_swarm.py",  # 44
)


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _file_order(item: pytest.Item) -> tuple[int, int]:
    if _file(item) in LONGEST_FIRST:
        return 0, LONGEST_FIRST.index(_file(item))
    return (1 if item.get_closest_marker("slow") is not None else 2), 0  # then files with a slow test, then the rest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``SWARM_TEST_PHASE=shared`` leaves out the tests marked ``alone``, ``=alone`` keeps only them: scripts/test.sh
    runs the rest on two workers, then these by themselves (unset: every test, as pytest alone runs them). Files are
    ordered longest first (``LONGEST_FIRST``), each file's tests kept together in their own order."""
    files: dict[str, tuple[int, int]] = {}
    for item in items:  # a file goes where its heaviest test puts it
        files[_file(item)] = min(files.get(_file(item), (3, 0)), _file_order(item))
    position = {path: i for i, path in enumerate(files)}
    items.sort(key=lambda it: (*files[_file(it)], position[_file(it)]))
    phase = os.environ.get("SWARM_TEST_PHASE", "")
    if phase not in ("shared", "alone"):
        return
    alone = phase == "alone"
    keep, drop = [], []
    for item in items:
        (keep if (item.get_closest_marker("alone") is not None) == alone else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collection_finish(session: pytest.Session) -> None:
    """SmolLM2 is converted once per session (about 30 s): start it now, beside the tests that run before the first
    one needing it, if any selected test does (and none when the session only collects)."""
    if session.config.option.collectonly:
        return
    if any("smollm_folder" in getattr(item, "fixturenames", ()) for item in session.items):
        _start_conversion()


def pytest_unconfigure(config: pytest.Config) -> None:
    for proc, _ in _CONVERSION:  # a session that ended before it was needed
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    while _SESSION_CACHE:
        shutil.rmtree(_SESSION_CACHE.pop(), ignore_errors=True)


def _start_conversion() -> tuple[subprocess.Popen[str], Path]:
    if not _CONVERSION:
        log = _SESSION_CACHE[0] / "smollm-conversion.log"
        with open(log, "w") as stderr:
            proc = subprocess.Popen([sys.executable, "-c", _CONVERT], stdout=subprocess.PIPE, stderr=stderr, text=True)
        _CONVERSION.append((proc, log))
    return _CONVERSION[0]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def smollm_conversion() -> tuple[Path, Path]:
    """SmolLM2's folder, converted from its GGUF into the session's empty cache by a child process that logs JSON as
    a peer with ``--log-format json`` does, and that process's stderr (``test_smollm.py`` reads it)."""
    proc, log = _start_conversion()
    out, _ = proc.communicate(timeout=1200)
    assert proc.returncode == 0, f"converting {SMOLLM} failed ({proc.returncode}):\n{log.read_text()[-3000:]}"
    return Path(out.strip().splitlines()[-1]), log


@pytest.fixture(scope="session")
def smollm_folder(smollm_conversion: tuple[Path, Path]) -> Path:
    return smollm_conversion[0]

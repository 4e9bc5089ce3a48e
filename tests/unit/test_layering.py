"""The layering, held as data: every module of ``swarm/``, ``peers/`` and ``harness/`` belongs to a group by where it
lives (``GROUPS``), and imports only its own group and the groups ``MAY_IMPORT`` lists for it. Imports are read from
the source (``ast``), wherever they stand: at the top, inside a function (lazy) or under ``TYPE_CHECKING``
(type-only); all count the same. On top of the groups: the files' import graph has no circle, no product module
imports an entry point or the harness, only the web groups import a web framework, and ``import swarm`` does no
heavy work."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from fnmatch import fnmatch
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("swarm", "peers", "harness")

# Where a module belongs: the first group with a pattern matching its path. A pattern ending in "/" takes a folder
# and everything under it; "swarm/*.py" takes that folder's own modules only. An entry point (a module Python runs:
# a ``__main__.py``, or one with an ``if __name__ == "__main__":`` guard) of the product is in ENTRY whatever its
# folder; the harness's are the harness's.
GROUPS: dict[str, tuple[str, ...]] = {
    "harness": ("harness/",),  # local-swarm drills, fork server, WAN emulator, calibration probes and validation
    "facade": ("swarm/__init__.py",),  # the public API, re-exporting the client lazily
    "core": ("swarm/*.py",),  # config, ids, records, protocol, wire, codecs, dht, errors, identity, lease, ...
    "families": ("swarm/families/",),  # what differs between model families: local math
    "transport": ("swarm/rpc/",),
    "plan": ("swarm/plan/",),
    "cost model": ("swarm/perf/",),
    "training run": ("swarm/training/",),
    "client": ("swarm/client/",),
    "dashboard": ("swarm/dashboard/",),
    "api": ("swarm/api/",),
    "serving": ("peers/serving/",),  # the serving domain and the ports stages plug into it
    "runtimes": ("peers/blocks/",),  # span runtimes (torch, ONNX) and the serving stage that loads them
    "broker": ("peers/broker/",),
    "handlers": ("peers/rpc/",),
    "trainable stage": ("peers/training/",),
    "node": ("peers/*.py",),  # wiring: node, config, follower, hardware, metrics, observers
}
ENTRY = "entry point"
PRODUCT = frozenset(GROUPS) - {"harness"}
MAY_IMPORT: dict[str, frozenset[str]] = {
    "harness": frozenset(GROUPS) | {ENTRY},
    ENTRY: PRODUCT,
    "facade": frozenset({"core", "client"}),
    "core": frozenset(),
    "families": frozenset({"core"}),
    "transport": frozenset({"core"}),
    "plan": frozenset({"core"}),
    "cost model": frozenset({"core", "plan"}),
    "training run": frozenset({"core", "families", "transport"}),
    "client": frozenset({"core", "families", "transport", "plan", "cost model", "training run"}),
    "dashboard": frozenset({"core", "transport"}),
    "api": frozenset({"core", "client", "dashboard"}),
    "broker": frozenset({"core", "cost model"}),
    "serving": frozenset({"core", "families", "transport", "broker"}),
    "runtimes": frozenset({"core", "families", "serving", "broker"}),
    "handlers": frozenset({"core", "transport", "serving"}),
    "trainable stage": frozenset({"core", "families", "transport", "training run", "serving", "runtimes", "broker"}),
    "node": frozenset({"core", "transport", "serving", "handlers", "broker"}),
}
WEB = ("fastapi", "starlette", "uvicorn")  # web frameworks: only the web groups (and entry points) serve HTTP apps
WEB_GROUPS = frozenset({"api", "dashboard", ENTRY})


@cache
def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the three packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def matches(rel: str, pattern: str) -> bool:
    if pattern.endswith("/"):
        return rel.startswith(pattern)
    folder, _, glob = pattern.rpartition("/")
    here, _, file = rel.rpartition("/")
    return here == folder and fnmatch(file, glob)


@cache
def group_of(name: str) -> str:
    path = modules()[name]
    rel = path.relative_to(ROOT).as_posix()
    entry = path.name == "__main__.py" or re.search(r'^if __name__ == "__main__":', path.read_text(), re.M)
    for group, patterns in GROUPS.items():
        if any(matches(rel, p) for p in patterns):
            return ENTRY if entry and group != "harness" else group
    raise AssertionError(f"{rel} is in no group: add it to GROUPS")


def imported(name: str) -> list[tuple[int, str]]:
    """(line, module name as written) of every import in ``name``'s file, relative ones resolved."""
    path = modules()[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name`` imports mod
            out += [(node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in modules() else base) for a in node.names]
    return out


def resolve(name: str) -> str | None:
    """The module of ours an import names (the longest known prefix), or None for a third-party one."""
    while name:
        if name in modules():
            return name
        name = name.rpartition(".")[0]
    return None


def edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in modules()}
    for m in modules():
        graph[m] |= {t for _, n in imported(m) if (t := resolve(n)) is not None and t != m}
    return graph


def test_every_import_follows_the_groups():
    bad = []
    for m in modules():
        mine = group_of(m)
        for line, name in imported(m):
            target = resolve(name)
            if target is None or target == m:
                continue
            theirs = group_of(target)
            if theirs != mine and theirs not in MAY_IMPORT[mine]:
                bad.append(f"{modules()[m].relative_to(ROOT)}:{line} ({mine}) imports {target} ({theirs})")
    assert bad == []


def test_no_import_circles():
    graph = edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in graph:
        if v not in index:
            visit(v)
    assert circles == []


def test_only_web_groups_import_web_frameworks():
    bad = [
        f"{modules()[m].relative_to(ROOT)}:{line} imports {name}"
        for m in modules()
        if group_of(m) not in WEB_GROUPS | {"harness"}
        for line, name in imported(m)
        if name.split(".")[0] in WEB
    ]
    assert bad == []


def test_the_rules_are_not_vacuous():
    """Every group has modules and the rules name only groups that exist (a typo would silently allow nothing)."""
    found = {group_of(m) for m in modules()}
    assert found == set(GROUPS) | {ENTRY}
    assert set(MAY_IMPORT) == set(GROUPS) | {ENTRY}
    assert all(allowed <= set(GROUPS) | {ENTRY} for allowed in MAY_IMPORT.values())
    for allowed in MAY_IMPORT.values():  # nothing but the harness reaches into the harness or an entry point
        assert allowed is MAY_IMPORT["harness"] or not allowed & {"harness", ENTRY}


def test_import_swarm_is_cheap():
    code = "import sys, swarm; print('torch' in sys.modules, 'hivemind' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_tests_share_helpers_not_test_modules():
    """What tests share lives in ``tests/helpers/``: no module under ``tests/`` imports a test module (``test_*``) or
    a ``conftest`` (pytest loads those itself; importing one runs it twice under two names)."""
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                last = name.split(".")[-1]
                if name.startswith("tests.") and (last.startswith("test_") or last == "conftest"):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert bad == []

"""The documentation: the site under docs/ builds with MkDocs in strict mode (a broken link or anchor, a page left out
of the nav or a nav entry without its page fails), without the network; the README stays short and its relative
links point at files that exist."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250
# [text](target) and ![alt](target); a target ends at whitespace or the closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _without_network() -> list[str]:
    """A prefix that runs a command in a network namespace of its own (no interface but loopback), where this
    machine allows it (root with util-linux's unshare), so the build cannot reach anything; none elsewhere."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        return []
    probe = subprocess.run([unshare, "--net", "true"], capture_output=True)
    return [unshare, "--net"] if probe.returncode == 0 else []


def test_site_builds_in_strict_mode(tmp_path):
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # Material's banner about MkDocs 2.0 (not a build warning)
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml")]
    done = subprocess.run(
        [*_without_network(), *command, "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (site / "index.html").is_file()
    # every page of the nav was rendered, pictures came along
    for page in ("serving", "api", "families", "links", "trust", "cost-model", "how-it-works", "layout", "tests"):
        assert (site / page / "index.html").is_file(), page
    assert (site / "perf" / "serving-crossover.png").is_file()


@pytest.mark.slow  # a second MkDocs build (the fast subset keeps the site's)
def test_strict_build_fails_on_a_broken_link(tmp_path):
    """The check above can fail: the same configuration refuses a page whose link points nowhere."""
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    (docs / "index.md").write_text((docs / "index.md").read_text() + "\n[gone](no-such-page.md)\n")
    config = (ROOT / "mkdocs.yml").read_text()
    (tmp_path / "mkdocs.yml").write_text(config)
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=tmp_path,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert "no-such-page.md" in done.stdout + done.stderr


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_readme_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    block = text[text.index("```bash") : text.index("```", text.index("```bash") + 3)]
    assert "bash scripts/setup.sh && .venv/bin/python -m swarm.demo" in block
    assert "bash scripts/test.sh" in block
    assert text.index("```bash") < text.index("\n## ")  # before any section


def _anchors(page: Path) -> set[str]:
    """The ids MkDocs gives a page's headings (Python-Markdown's ``toc``), outside code fences."""
    from markdown.extensions.toc import slugify

    found, fence = set(), False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence and (heading := re.match(r"#{1,6} (.+)", line)):
            found.add(slugify(re.sub(r"[`*]", "", heading.group(1)), "-"))
    return found


def test_readme_relative_links_point_at_files():
    text = (ROOT / "README.md").read_text()
    targets = [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]
    assert targets, "the README links to its documentation"
    missing = [t for t in targets if not (ROOT / t.split("#", 1)[0]).exists()]
    assert missing == []
    # a link to a heading of a page names one the page has
    wrong = [t for t in targets if "#" in t and t.split("#", 1)[1] not in _anchors(ROOT / t.split("#", 1)[0])]
    assert wrong == []


def test_paths_the_docs_name_exist():
    """Every repository path the docs and the README name in code spans (`swarm/client/session/chain.py`) exists: a
    file moved or renamed takes its mentions along."""
    path = re.compile(r"`((?:swarm|peers|harness|scripts|tests|configs|docs)/[\w/.\-]*)`")
    pages = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    missing = [
        f"{page.relative_to(ROOT)}: {m.group(1)}"
        for page in pages
        for m in path.finditer(page.read_text())
        if "*" not in m.group(1) and not (ROOT / m.group(1)).exists()
    ]
    assert missing == []

"""A plan as a picture and as a table: every node drawn, parties as clusters, wire sizes on the edges, phases told
apart, hostile strings escaped (checked by Graphviz's own parser, through the SVG it draws), and real PNG and SVG
files from Debian's ``dot`` (``scripts/setup.sh`` installs it: no skip here)."""

from __future__ import annotations

import json
import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from swarm.hop import Hop
from swarm.plan.compile import Call, ModelShape, finetune_plan, generate_plan, pretrain_plan
from swarm.plan.dot import RenderError, human_bytes, quote, render, short_peer, to_dot
from swarm.plan.ir import Plan
from swarm.plan.table import table

SVG = "{http://www.w3.org/2000/svg}"
XLINK = "{http://www.w3.org/1999/xlink}"
MODEL = ModelShape("smollm2-135m", num_blocks=30, hidden_size=576, vocab_size=49152)
PEERS = [f"12D3KooW{c * 44}000{i}" for i, c in enumerate("ABC", start=1)]
ROUTE = [Hop(PEERS[0], 0, 10), Hop(PEERS[1], 10, 20, dtype="float16"), Hop(PEERS[2], 20, 30)]
CALL = Call(batch=1, tokens=128)
# what a hostile server could announce as its peer id, to break out of a DOT string or a terminal line
HOSTILE = 'evil"];\n  x -> y [label="pwned"]; subgraph { } \\N \\\x1b[2J\x00\u202e\\'


def finetune() -> Plan:
    return finetune_plan(MODEL, ROUTE, CALL)


def hostile() -> Plan:
    """A plan read from the network whose second server calls itself ``HOSTILE`` (a valid plan: peer ids are
    free text up to 128 characters)."""
    d = json.loads(finetune().to_json())
    for node in d["nodes"]:
        for key in ("peer", "src", "dst"):
            if node.get(key) == PEERS[1]:
                node[key] = HOSTILE
    d["model_id"] = 'model"\n}'
    return Plan.parse(json.dumps(d))


def svg_of(dot_text: str, tmp_path: Path) -> ET.Element:
    return ET.parse(render(dot_text, tmp_path / "plan.svg")).getroot()


def groups(root: ET.Element, kind: str) -> list[ET.Element]:
    return [g for g in root.iter(f"{SVG}g") if g.get("class") == kind]


def titles(root: ET.Element) -> list[str]:
    return [a.get(f"{XLINK}title", "") for a in root.iter(f"{SVG}a")]


def test_every_node_is_drawn_once_in_its_party():
    plan = finetune()
    text = to_dot(plan)
    for node in plan.nodes:
        assert f'label="{node.id}\\n' in text
    assert len(re.findall(r"^\s+n\d+ \[label=", text, re.M)) == len(plan.nodes)
    assert text.count("subgraph cluster_") == 4  # the client and three servers
    for peer in PEERS:
        assert f'label="server {short_peer(peer)}\\nblocks ' in text and f'tooltip="{peer}"' in text
    assert 'blocks 10:20 · torch · float16"' in text


def test_edges_carry_types_and_wire_sizes():
    text = to_dot(finetune())
    assert 'label="float16[1, 128, 576] · 144 KiB"' in text  # into the float16 server
    assert 'label="float32[1, 128, 576] · 288 KiB"' in text
    assert 'label="int64[1, 128]"' in text
    assert "28 nodes, 3.1 MiB on the wire" in text  # 10 x 288 KiB + 2 x 144 KiB


def node_line(plan: Plan, node_id: str) -> str:
    """The DOT statement that draws ``node_id``."""
    ident = next(f"n{i}" for i, n in enumerate(plan.nodes) if n.id == node_id)
    return next(x for x in to_dot(plan).splitlines() if x.strip().startswith(f"{ident} [label="))


def test_backward_and_update_look_different():
    plan = finetune()
    assert "dashed" not in node_line(plan, "f1") and "bold" not in node_line(plan, "f1")
    assert "dashed" in node_line(plan, "b1") and "#b03a2e" in node_line(plan, "b1")
    assert "dashed" in node_line(plan, "b1.in")  # it carries a gradient, whatever phase the compiler gave it
    assert "bold" in node_line(plan, "optimizer") and "#1e7b34" in node_line(plan, "optimizer")
    averaging = pretrain_plan(MODEL, ROUTE, CALL, target_batch=8, average_every=4)
    assert "#1e7b34" in node_line(averaging, "average")


def test_a_hostile_peer_id_is_escaped(tmp_path):
    plan = hostile()
    text = to_dot(plan)
    assert "\n  x -> y" not in text and "\x00" not in text and "\x1b" not in text and "\u202e" not in text
    for line in text.splitlines():  # every quote inside a string is escaped: quotes pair up on every line
        assert len(re.findall(r'(?<!\\)(?:\\\\)*"', line)) % 2 == 0, line
    root = svg_of(text, tmp_path)  # Graphviz's own parser: the same graph, the id shown as it was, no injection
    assert len(groups(root, "node")) == len(plan.nodes) and len(groups(root, "cluster")) == 4
    assert len(groups(root, "edge")) == sum(len(n.inputs) for n in plan.nodes)
    shown = 'evil"];\ufffd  x -> y [label="pwned"]; subgraph { } \\N \\\ufffd[2J\ufffd\ufffd\\'
    assert shown in [t.replace("\xa0", " ") for t in titles(root)]  # SVG keeps a run of spaces with a nbsp
    assert not any("pwned" in t for t in root.itertext() if "evil" not in t)


def test_a_hostile_title_and_strings_cannot_end_a_string():
    assert quote("a\\") == '"a\\\\"'  # a final backslash cannot swallow the closing quote
    assert quote('say "hi"', "two") == '"say \\"hi\\"\\ntwo"'
    assert quote("\\N") == '"\\\\N"'  # not Graphviz's node-name escape
    assert quote("line\nbreak\r\x00") == '"line\ufffdbreak\ufffd\ufffd"'
    text = to_dot(finetune(), title='"}; digraph { owned')
    assert 'label="\\"}; digraph { owned\\n' in text


def test_render_writes_real_png_and_svg(tmp_path):
    text = to_dot(finetune())
    png = render(text, tmp_path / "plan.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    root = svg_of(text, tmp_path)
    assert root.tag == f"{SVG}svg"
    assert {"f0", "b2", "optimizer"} <= {t.text for t in root.iter(f"{SVG}text")}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.png", "plan.svg"]  # no temporary file left


def test_render_errors_are_clear(tmp_path, monkeypatch):
    text = to_dot(generate_plan(MODEL, ROUTE, CALL, max_length=256))
    with pytest.raises(RenderError, match=r"name a .png, .svg or .pdf file"):
        render(text, tmp_path / "plan.gif")
    with pytest.raises(RenderError, match="dot could not draw plan.png .exit code 1.: .*syntax error"):
        render("digraph { a -> }", tmp_path / "plan.png")
    hung = tmp_path / "hung"  # a dot that never finishes, however fast the machine: its timeout must end it
    hung.mkdir()
    (hung / "dot").write_text("#!/bin/sh\nexec sleep 600\n")
    (hung / "dot").chmod(0o755)
    with monkeypatch.context() as m:
        m.setenv("PATH", f"{hung}:{os.environ['PATH']}")
        with pytest.raises(RenderError, match="dot took more than 1 s"):
            render(text, tmp_path / "plan.png", timeout=1.0)
    assert [p.name for p in tmp_path.iterdir()] == ["hung"]  # nothing half-written
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without Graphviz
    with pytest.raises(RenderError, match="install Debian's graphviz: apt-get install graphviz"):
        render(text, tmp_path / "plan.svg")


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 1023, 1024, 147456, 3 << 20, 5 << 30)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "144 KiB",
        "3.0 MiB",
        "5.0 GiB",
    ]
    assert human_bytes(1536) == "1.5 KiB" and human_bytes(1 << 60) == "1048576 TiB"


def test_the_table_lists_every_node_in_order_with_the_servers():
    plan = finetune()
    text = table(plan)
    lines = text.splitlines()
    first = lines.index(next(x for x in lines if x.startswith("id "))) + 2  # after the header and its rule
    rows = lines[first : first + len(plan.nodes)]
    assert [r.split()[0] for r in rows] == [n.id for n in plan.order()] and lines[first + len(plan.nodes)] == ""
    for peer in PEERS:
        assert peer in text
    row = "f1.in        forward   transfer        client -> ..BBBB0002          float16[1, 128, 576]       144 KiB"
    assert row in text
    assert text.rstrip().endswith("on the wire: 1.4 MiB client -> servers, 1.7 MiB servers -> client")
    assert "b1           backward  span_backward   ..BBBB0002            10:20" in text


def test_the_table_prints_no_control_characters():
    text = table(hostile())
    assert not any(c in text for c in "\x00\x1b\u202e\r")
    assert all(line.isprintable() for line in text.splitlines())

"""A plan as a picture: Graphviz DOT text (pure), and its rendering to PNG, SVG or PDF by Graphviz's ``dot``.

One cluster per party: the client, and each server by a short peer id with its blocks, runtime and dtype. Transfers
stand between the clusters, and the edges leaving them carry the wire type and its size. Backward nodes are dashed
and red, update nodes green; a dotted edge is a reference rather than data (the kept graph a ``span_backward``
runs on, the hidden states a local backward reaches).

Every string a plan carries (peer ids, the model id) may come from the network: each is cleaned of non-printable
characters and escaped, and DOT identifiers are generated (``n0``, ``cluster_1``), never taken from the plan."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from swarm.errors import SwarmError
from swarm.plan.ir import (
    CLIENT,
    AnyNode,
    LocalBackward,
    Phase,
    Plan,
    SpanBackward,
    SpanForward,
    SpanStep,
    TensorType,
    Transfer,
)

FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
RENDER_TIMEOUT = 60.0
FONT = "Helvetica"
PHASE_STYLE: dict[Phase, str] = {
    "forward": 'color="#333333"',
    "backward": 'color="#b03a2e", fontcolor="#b03a2e", style="rounded,dashed,filled", fillcolor="#fdf2f0"',
    "update": 'color="#1e7b34", fontcolor="#1e7b34", style="rounded,bold,filled", fillcolor="#eaf6ec"',
}
EDGE_STYLE: dict[Phase, str] = {
    "forward": 'color="#333333"',
    "backward": 'color="#b03a2e", fontcolor="#b03a2e", style=dashed',
    "update": 'color="#1e7b34", fontcolor="#1e7b34", style=bold',
}
_PHASES: tuple[Phase, ...] = ("forward", "backward", "update")
MAX_SHOWN = 80  # characters of one plan string shown in a label (peer ids are at most 128, model ids 256)


class RenderError(SwarmError):
    """Graphviz is missing, or could not draw the picture."""


def human_bytes(n: int) -> str:
    """``147456`` -> ``144 KiB``: binary units, one decimal below ten."""
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{n} B"
    return f"{value:.0f} {unit}" if value >= 10 else f"{value:.1f} {unit}"


def short_peer(peer: str) -> str:
    """A peer id as people read it: its last 8 characters (libp2p ids share their first ones)."""
    return peer if len(peer) <= 10 else ".." + peer[-8:]


def clean(text: str) -> str:
    """Printable characters only: no newline, NUL, lone surrogate (unwritable as UTF-8) or bidi control of a
    hostile plan reaches Graphviz."""
    return "".join(c if c.isprintable() else "\ufffd" for c in text)


def _shown(text: str) -> str:
    """A plan's string cut to ``MAX_SHOWN`` characters for a label."""
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 1] + "\u2026"


def quote(*lines: str) -> str:
    """A DOT double-quoted string of ``lines``. Backslashes are doubled so none can start an escape (``\\N`` would
    expand to the node's name, a final backslash would swallow the closing quote), quotes are escaped, and the lines
    are joined with DOT's own ``\\n``."""
    escaped = (clean(line).replace("\\", "\\\\").replace('"', '\\"') for line in lines)
    return '"' + "\\n".join(escaped) + '"'


def _effective_phases(plan: Plan) -> dict[str, Phase]:
    """Each node's phase, or a later one when it reads a later phase's result: a node that reads a gradient
    cannot run before the backward, whatever phase it was given, and the picture shows when it can run."""
    rank = {p: i for i, p in enumerate(_PHASES)}
    out: dict[str, Phase] = {}
    for node in plan.order():
        phase = node.phase
        for name in _data_inputs(node):
            if rank[out[name]] > rank[phase]:
                phase = out[name]
        out[node.id] = phase
    return out


def _data_inputs(node: AnyNode) -> tuple[str, ...]:
    """The inputs whose values flow into the node (not the references drawn dotted)."""
    if isinstance(node, SpanBackward | LocalBackward) and len(node.inputs) == 2:
        return node.inputs[:1]
    return node.inputs


def _type_text(t: TensorType | None, transfer: Transfer | None = None) -> str:
    text = str(t) if t is not None else ""
    if transfer is not None and transfer.nbytes is not None:
        text += f" \u00b7 {human_bytes(transfer.nbytes)}"
    return text


def _node_lines(node: AnyNode, out: TensorType | None) -> list[str]:
    """A node's label: its id, its op (with the blocks of a remote op), its output type. A transfer's type and
    size are on the edge leaving it."""
    if isinstance(node, Transfer):
        return [node.id, f"{short_peer(node.src)} \u2192 {short_peer(node.dst)}"]
    if isinstance(node, SpanForward | SpanStep | SpanBackward):
        keep = " (keeps graph)" if isinstance(node, SpanForward) and node.keep else ""
        lines = [node.id, f"{node.op} {node.start}:{node.end}{keep}"]
    elif isinstance(node, LocalBackward):
        lines = [node.id, f"{node.op} \u2192 {node.to}"]
    else:
        lines = [node.id] if node.op == node.id else [node.id, node.op]
    return lines + ([str(out)] if out is not None else [])


def _parties(plan: Plan) -> dict[str, list[str]]:
    """Party -> the spans it runs (``0:10 float16 torch``), client first, servers in order of first use."""
    parties: dict[str, list[str]] = {CLIENT: []}
    for node in plan.nodes:
        if isinstance(node, SpanForward | SpanStep | SpanBackward):
            span = f"{node.start}:{node.end} \u00b7 {node.runtime} \u00b7 {node.dtype}"
            spans = parties.setdefault(node.peer, [])
            if span not in spans:
                spans.append(span)
    return parties


def _levels(plan: Plan) -> list[tuple[str, ...]]:
    """Nodes drawn level with each other: each span_backward with its kept forward, and the transfers around them
    crosswise (the gradient arrives level with the output that left, and leaves level with the input that came)."""
    out_of: dict[str, str] = {}
    for node in plan.nodes:
        if isinstance(node, Transfer):
            out_of.setdefault(node.inputs[0], node.id)
    levels: list[tuple[str, ...]] = []
    for node in plan.nodes:
        if isinstance(node, SpanBackward):
            fwd = plan.node(node.inputs[1])
            levels.append((fwd.id, node.id))
            if fwd.id in out_of:
                levels.append((out_of[fwd.id], node.inputs[0]))
            if node.id in out_of:
                levels.append((fwd.inputs[0], out_of[node.id]))
    return levels


def to_dot(plan: Plan, title: str | None = None) -> str:
    """The plan as a Graphviz digraph (``dot -Tpng``)."""
    types = plan.types()
    phases = _effective_phases(plan)
    ident = {node.id: f"n{i}" for i, node in enumerate(plan.nodes)}
    wire = sum(n.nbytes or 0 for n in plan.nodes if isinstance(n, Transfer))
    heading = title if title is not None else f"{plan.task} plan of {_shown(plan.model_id)}"
    summary = f"{len(plan.nodes)} nodes, {human_bytes(wire)} on the wire" if wire else f"{len(plan.nodes)} nodes"
    legend = "solid: forward \u00b7 dashed red: backward \u00b7 green: update \u00b7 dotted: a reference, not data"
    out = [
        "digraph plan {",
        f"  graph [fontname={FONT}, fontsize=12, labelloc=t, newrank=true, nodesep=0.25, ranksep=0.3,",
        f"         label={quote(heading, summary, legend)}];",
        f'  node [fontname={FONT}, fontsize=9, shape=box, style="rounded,filled", fillcolor=white,',
        '        margin="0.08,0.03"];',
        f"  edge [fontname={FONT}, fontsize=8, arrowsize=0.6];",
    ]

    def node_line(node: AnyNode, indent: str) -> str:
        shape = ', shape=cds, margin="0.18,0.03"' if isinstance(node, Transfer) else ""
        if isinstance(node, Transfer):
            tooltip = f"{node.id}: {node.src} -> {node.dst}"
        else:
            tooltip = f"{node.id} on {node.party}"
        return (
            f"{indent}{ident[node.id]} [label={quote(*_node_lines(node, types[node.id]))}, "
            f"tooltip={quote(tooltip)}, {PHASE_STYLE[phases[node.id]]}{shape}];"
        )

    for k, (party, spans) in enumerate(_parties(plan).items()):
        members = [n for n in plan.nodes if n.party == party and not isinstance(n, Transfer)]
        if party == CLIENT:
            label = quote(f"client \u00b7 {_shown(plan.model_id)} \u00b7 {plan.dtype}")
            color = '"#2c5aa0"'
        else:
            label = quote(f"server {short_peer(party)}", "blocks " + ", ".join(spans))
            color = '"#7a5c00"'
        out += [
            f"  subgraph cluster_{k} {{",
            f"    label={label}; tooltip={quote(party)}; style=rounded;",
            f"    color={color}; fontcolor={color};",
        ]
        out += [node_line(n, "    ") for n in members]
        out.append("  }")
    # transfers belong to no party: they are the network between two
    out += [node_line(n, "  ") for n in plan.nodes if isinstance(n, Transfer)]

    # The backward runs the forward's chain in reverse: drawn upwards beside it, each backward node level with its
    # forward, so a training step reads as a U (down through the servers, back up, the update at the top).
    for node in plan.nodes:
        data = _data_inputs(node)
        for name in node.inputs:
            src, dst = ident[name], ident[node.id]
            if name not in data:  # a reference: drawn without pulling the layout, so the chains stay straight
                out.append(f'  {src} -> {dst} [style=dotted, color="#999999", constraint=false, arrowhead=empty];')
                continue
            source = plan.node(name)
            text = _type_text(types[name], source if isinstance(source, Transfer) else None)
            if not text and isinstance(source, LocalBackward):  # to the parameters: their gradients, no tensor
                text = "gradients"
            style = EDGE_STYLE[phases[node.id]]
            if phases[name] == "forward":
                out.append(f"  {src} -> {dst} [label={quote(text)}, {style}];")
            else:  # ranked upwards, the arrow still at the reader
                out.append(f"  {dst} -> {src} [label={quote(text)}, dir=back, {style}];")
    out += [f"  {{rank=same; {' '.join(ident[i] for i in level)}}}" for level in _levels(plan)]
    out.append("}")
    return "\n".join(out) + "\n"


def render(dot_text: str, path: Path, timeout: float = RENDER_TIMEOUT) -> Path:
    """Draw ``dot_text`` into ``path`` with Graphviz's ``dot``, in the format its suffix names (.png, .svg, .pdf).
    The file appears whole or not at all."""
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise RenderError(f"cannot draw {path.name}: name a .png, .svg or .pdf file")
    exe = shutil.which("dot")
    if exe is None:
        raise RenderError("Graphviz's dot is not installed: install Debian's graphviz: apt-get install graphviz")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        done = subprocess.run(
            [exe, f"-T{fmt}", "-o", str(tmp)],
            input=dot_text.encode(),
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            problem = done.stderr.decode(errors="replace").strip()[-2000:]
            raise RenderError(f"dot could not draw {path.name} (exit code {done.returncode}): {problem}")
        os.replace(tmp, path)
    except subprocess.TimeoutExpired:  # run() has killed and reaped dot
        raise RenderError(f"dot took more than {timeout:.0f} s to draw {path.name}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return path

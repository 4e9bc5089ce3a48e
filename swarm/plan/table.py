"""A plan as text for a terminal: who takes part, then one row per node in the order the executor may run them
(id, phase, op, party, blocks, output type, bytes on the wire), then the traffic.

Peer ids and the model id may come from the network: they are cleaned of non-printable characters (a terminal's
escape sequences included) before they are printed."""

from __future__ import annotations

from swarm.plan.dot import clean, human_bytes, short_peer
from swarm.plan.ir import CLIENT, Plan, SpanBackward, SpanForward, SpanStep, Transfer

COLUMNS = ("id", "phase", "op", "party", "blocks", "output", "wire bytes")


def table(plan: Plan) -> str:
    types = plan.types()
    rows: list[tuple[str, ...]] = []
    servers: dict[str, list[str]] = {}
    sent = received = 0
    for node in plan.order():
        blocks, wire = "", ""
        party = short_peer(clean(node.party))
        if isinstance(node, Transfer):
            party = f"{short_peer(clean(node.src))} -> {short_peer(clean(node.dst))}"
            if node.nbytes is not None:
                wire = human_bytes(node.nbytes)
                if node.src == CLIENT:
                    sent += node.nbytes
                elif node.dst == CLIENT:
                    received += node.nbytes
        elif isinstance(node, SpanForward | SpanStep | SpanBackward):
            blocks = f"{node.start}:{node.end}"
            span = f"{blocks} ({node.runtime}, {node.dtype})"
            if span not in servers.setdefault(node.peer, []):
                servers[node.peer].append(span)
        out = types[node.id]
        rows.append((node.id, node.phase, node.op, party, blocks, str(out) if out is not None else "-", wire))
    lines = [
        f"{plan.task} plan of {clean(plan.model_id)}: {plan.num_blocks} blocks, hidden {plan.hidden_size}, "
        f"vocab {plan.vocab_size}, client {plan.dtype}; {len(plan.nodes)} nodes",
        "",
        "servers:" if servers else "servers: none",
    ]
    lines += [f"  {short_peer(clean(p)):<12} {clean(p)}  blocks {', '.join(s)}" for p, s in servers.items()]
    widths = [max(len(r[i]) for r in (COLUMNS, *rows)) for i in range(len(COLUMNS))]
    lines += ["", _row(COLUMNS, widths), _row(tuple("-" * w for w in widths), widths)]
    lines += [_row(r, widths) for r in rows]
    lines += ["", f"on the wire: {human_bytes(sent)} client -> servers, {human_bytes(received)} servers -> client"]
    return "\n".join(lines)


def _row(cells: tuple[str, ...], widths: list[int]) -> str:
    last = len(cells) - 1  # the bytes column is right-aligned
    pairs = enumerate(zip(cells, widths, strict=True))
    return "  ".join(c.rjust(w) if i == last else c.ljust(w) for i, (c, w) in pairs).rstrip()

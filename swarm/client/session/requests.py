"""What an inference session sends a hop: the opening that binds the session (and its adapter) on the server, and each
client-mediated step's request. The chain (``session.chain``) and the verifier (``swarm.client.verify.verifier``) open
hops through the same function."""

from __future__ import annotations

from collections.abc import Callable

import torch

from swarm.client.session.hop import HopState
from swarm.client.tuning.adapters import AdapterDelivery
from swarm.protocol import InferenceRequest, InferenceStep, OpenSession, PrefixUse
from swarm.rpc.remote import Tensors


def opening(
    state: HopState, delivery: AdapterDelivery | None, max_length: int, batch_size: int, prefix: PrefixUse | None = None
) -> tuple[OpenSession, Tensors]:
    """Hop ``state``'s opening: the adapter is bound to the server's session at open, named by version, its
    tensors sent only when that server lacks this version (or when a reference came back adapter_missing);
    ``prefix``: the session asks for prefix caching."""
    hop = state.hop
    tensors: Tensors = {}
    ref = None
    if delivery is not None:
        send = state.link.send_adapter or delivery.needs_sending(hop)
        ref, tensors = delivery.part(hop, send)
        delivery.delivered(hop)  # optimistic: an adapter_missing reply sends the tensors next time
    request = OpenSession(
        session_id=state.session_id,
        start=hop.start,
        end=hop.end,
        max_length=max_length,
        batch_size=batch_size,
        adapter=ref,
        prefix=prefix,
    )
    return request, dict(tensors)


def step_request(
    state: HopState,
    hidden: torch.Tensor,
    mask: torch.Tensor | None,
    positions: torch.Tensor | None,
    position: int,
    open_hop: Callable[[HopState], tuple[OpenSession, Tensors]],
) -> tuple[InferenceRequest, Tensors]:
    """One client-mediated step to ``state``'s hop (its opening first if its stream is not open yet)."""
    step = InferenceStep(position=position)
    tensors: Tensors = {"hidden": hidden.to(getattr(torch, state.hop.dtype))}
    request = InferenceRequest(step=step)
    if state.link.stream is None:
        request_open, part = open_hop(state)
        tensors.update(part)
        request = InferenceRequest(open=request_open, step=step)
    if mask is not None:
        tensors["attention_mask"] = mask
    if positions is not None:
        tensors["position_ids"] = positions
    return request, tensors

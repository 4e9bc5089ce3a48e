"""One compiled plan of each compile function and option (``PLANS``), with symbolic and with concrete shapes, over a
tiny model and a three-hop route: what the plan IR's tests and its fuzz tests mutate."""

from __future__ import annotations

import json
from typing import Any

from swarm.hop import Hop
from swarm.plan.compile import (
    Call,
    ModelShape,
    finetune_plan,
    forward_plan,
    generate_plan,
    hidden_plan,
    pretrain_plan,
    score_plan,
)
from swarm.plan.ir import Plan

MODEL = ModelShape("tiny-llama", num_blocks=4, hidden_size=8, vocab_size=32)
PEER_A = "12D3KooWAaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaA"
PEER_B = "12D3KooWBbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbB"
PEER_C = "12D3KooWCccccccccccccccccccccccccccccccccccccccccccccC"
# three servers of three dtypes: the transfers cast on the way in and out
ROUTE = [Hop(PEER_A, 0, 2), Hop(PEER_B, 2, 3, dtype="float16"), Hop(PEER_C, 3, 4, dtype="bfloat16")]
CONCRETE = Call(batch=2, tokens=5)


def compiled() -> dict[str, Plan]:
    """One plan of each compile function and option, with symbolic and with concrete shapes."""
    out: dict[str, Plan] = {}
    for shapes, call in (("symbolic", Call()), ("concrete", CONCRETE)):
        out |= {
            f"forward/{shapes}": forward_plan(MODEL, ROUTE, call),
            f"forward-loss-backward/{shapes}": forward_plan(MODEL, ROUTE, call, labels=True, keep=True),
            f"forward-prompts/{shapes}": forward_plan(MODEL, ROUTE, call, prompts=3),
            f"finetune/{shapes}": finetune_plan(MODEL, ROUTE, call),
            f"finetune-prompts/{shapes}": finetune_plan(MODEL, ROUTE, call, prompts=4),
            f"pretrain/{shapes}": pretrain_plan(MODEL, ROUTE, call, target_batch=8),
            f"pretrain-averaging/{shapes}": pretrain_plan(MODEL, ROUTE, call, target_batch=8, average_every=5),
            f"generate/{shapes}": generate_plan(MODEL, ROUTE, call, max_length=64),
            f"generate-prompts/{shapes}": generate_plan(MODEL, ROUTE, call, max_length=64, prompts=2),
            f"score/{shapes}": score_plan(MODEL, ROUTE, call),
            f"hidden/{shapes}": hidden_plan(MODEL, [Hop(PEER_A, 0, 2), Hop(PEER_B, 2, 3)], call),
        }
    return out


PLANS = compiled()


def as_dict(plan: Plan) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(plan.to_json())
    return value

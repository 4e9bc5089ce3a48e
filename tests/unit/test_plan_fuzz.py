"""Plans mutated at random (derandomized hypothesis: the same cases every run), structure by structure and byte by
byte: each parses into a plan that validates again, or is refused with a ``PlanError``, quickly (in less CPU time
than the largest plan the parser accepts, measured in the same run); never anything else."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import json
import random
import time
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.plan.ir import MAX_NODES, Plan, PlanError
from tests.helpers.examples import fuzz_examples
from tests.helpers.plans import PLANS, as_dict

# ---- fuzzing -------------------------------------------------------------------------------------------------------
EXAMPLES = fuzz_examples(300)
FUZZ = settings(
    derandomize=True, max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
SEEDS = st.integers(min_value=0, max_value=2**64 - 1)
BASES = [PLANS[k] for k in ("finetune/concrete", "generate-prompts/symbolic", "pretrain-averaging/concrete")]
JUNK: list[object] = [
    None,
    True,
    0,
    -1,
    1,
    2**31,
    2**63,
    -(2**63),
    1.5,
    "",
    "client",
    "f1",
    "head",
    "tokens+1",
    "float16",
    "span_backward",
    "backward",
    "update",
    "hidden",
    "labels",
    "\x00",
    "\ud800",
    [],
    [1, "batch"],
    {},
    {"shape": [], "dtype": "int64"},
]


def _junk(rng: random.Random) -> Any:
    return copy.deepcopy(rng.choice(JUNK))  # a fresh copy: a later change must not reach another place


def _mutate_value(rng: random.Random, value: Any) -> Any:
    """One structural change somewhere in a decoded plan: a value replaced, a key dropped or added, a list item
    dropped, duplicated or swapped."""
    if isinstance(value, dict) and value:
        key = rng.choice(sorted(value))
        what = rng.randrange(5)
        if what == 0:
            del value[key]
        elif what == 1:
            value[rng.choice(["extra", "phase", "inputs", "out", "keep", "peer"])] = _junk(rng)
        elif what == 2:
            value[key] = _junk(rng)
        else:
            value[key] = _mutate_value(rng, value[key])
        return value
    if isinstance(value, list) and value:
        i, what = rng.randrange(len(value)), rng.randrange(5)
        if what == 0:
            del value[i]
        elif what == 1:
            value.insert(rng.randrange(len(value) + 1), copy.deepcopy(value[i]))
        elif what == 2:
            j = rng.randrange(len(value))
            value[i], value[j] = value[j], value[i]
        else:
            value[i] = _mutate_value(rng, value[i])
        return value
    if isinstance(value, int) and not isinstance(value, bool) and rng.random() < 0.5:
        return value + rng.choice([-1, 1, -(2**40), 2**40])
    return _junk(rng)


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    raw = bytearray(data)
    for _ in range(rng.randrange(1, 6)):
        what, i = rng.randrange(4), rng.randrange(len(raw) + 1)
        if what == 0 and i < len(raw):
            raw[i] = rng.randrange(256)
        elif what == 1:
            raw[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8)))
        elif what == 2:
            del raw[i : i + rng.randrange(1, 16)]
        else:
            raw = raw[:i]
    return bytes(raw)


def _cpu_to_parse(data: bytes | str) -> tuple[Plan | None, float]:
    """The plan (None: refused) and the CPU seconds this thread spent on it: other processes' load does not count,
    nor a garbage collection of what earlier cases left."""
    gc.disable()
    start = time.thread_time()
    try:
        plan: Plan | None = Plan.parse(data)
    except PlanError:
        plan = None
    finally:
        spent = time.thread_time() - start
        gc.enable()
    return plan, spent


@functools.cache
def _largest() -> float:
    """CPU seconds to parse the largest plan the parser accepts (``MAX_NODES`` nodes): the best of three."""
    d = as_dict(PLANS["forward/concrete"])
    d["nodes"] = [{"id": f"x{i}", "op": "input", "out": {"shape": [1], "dtype": "int64"}} for i in range(MAX_NODES)]
    data = json.dumps(d)
    return min(_cpu_to_parse(data)[1] for _ in range(3))


def _parse_or_refuse(data: bytes | str) -> Plan | None:
    plan, spent = _cpu_to_parse(data)
    # a mutated plan is no larger than the largest legal one, nor should anything in it cost more to refuse
    assert spent <= 2 * _largest(), (spent, _largest())
    if plan is not None:  # what is accepted is a whole plan: it validates again, the same, on its own
        assert Plan.parse(plan.to_msgpack()) == plan
        assert len(plan.order()) == len(plan.nodes)
    return plan


@FUZZ
@given(seed=SEEDS, base=st.sampled_from(range(len(BASES))), changes=st.integers(1, 4), as_json=st.booleans())
def test_structurally_mutated_plans_parse_or_are_refused(seed, base, changes, as_json):
    rng = random.Random(seed)
    value = as_dict(BASES[base])
    for _ in range(changes):
        if rng.random() < 0.8:  # mostly inside one node, where the graph's rules are
            nodes = value.get("nodes")
            if isinstance(nodes, list) and nodes:
                i = rng.randrange(len(nodes))
                nodes[i] = _mutate_value(rng, nodes[i])
                continue
        value = _mutate_value(rng, value)
    data = json.dumps(value)
    if not as_json:
        with contextlib.suppress(OverflowError):  # an integer grown past 64 bits stays JSON
            data = msgpack.packb(value, use_bin_type=True, unicode_errors="surrogatepass")
    _parse_or_refuse(data)


@FUZZ
@given(seed=SEEDS, base=st.sampled_from(range(len(BASES))), as_json=st.booleans())
def test_byte_mutated_plans_parse_or_are_refused(seed, base, as_json):
    plan = BASES[base]
    data = plan.to_json().encode() if as_json else plan.to_msgpack()
    _parse_or_refuse(_mutate_bytes(random.Random(seed), data))

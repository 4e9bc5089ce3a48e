"""The plan IR as a reader of hostile input: every compiled plan validates and survives JSON and msgpack unchanged,
and a plan with a cycle, an unknown op, a dangling or duplicate id, a shape or dtype that does not follow from its
inputs, a transfer that lies about its bytes, too many nodes or bytes, an unknown field, or no plan at all, is refused
with a ``PlanError`` that names the problem. Mutated plans are fuzzed in ``test_plan_fuzz.py`` (hypothesis,
derandomized)."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest

from swarm.errors import BadInputError
from swarm.hop import Hop
from swarm.plan.compile import repair
from swarm.plan.ir import MAX_NODES, MAX_PLAN_BYTES, Plan, PlanError, SpanBackward, SpanForward, SpanStep, Transfer
from tests.helpers.plans import PEER_A, PEER_B, PEER_C, PLANS, as_dict


def node_of(d: dict[str, Any], node_id: str) -> dict[str, Any]:
    node: dict[str, Any] = next(n for n in d["nodes"] if n["id"] == node_id)
    return node


def refused(value: dict[str, Any] | bytes, match: str) -> PlanError:
    """Parse ``value`` (a plan's dict, as JSON and as msgpack, or raw bytes): both must be refused alike."""
    data = [value] if isinstance(value, bytes) else [json.dumps(value).encode(), msgpack.packb(value)]
    errors = []
    for raw in data:
        with pytest.raises(PlanError, match=match) as caught:
            Plan.parse(raw)
        errors.append(caught.value)
    return errors[0]


# ---- valid plans ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PLANS))
def test_compiled_plans_validate_and_round_trip(name):
    plan = PLANS[name]
    assert Plan.parse(plan.to_json()) == plan
    assert Plan.parse(plan.to_msgpack()) == plan
    assert Plan.parse(plan.to_json().encode()) == plan
    assert Plan.parse(Plan.parse(plan.to_msgpack()).to_json()).to_msgpack() == plan.to_msgpack()
    order = [n.id for n in plan.order()]
    assert sorted(order) == sorted(n.id for n in plan.nodes)
    seen: set[str] = set()
    for node_id in order:  # each node after what it reads
        assert set(plan.node(node_id).inputs) <= seen
        seen.add(node_id)


def test_compiled_plans_say_what_they_compute():
    plan = PLANS["finetune/concrete"]
    types = plan.types()
    assert str(types["logits"]) == "float32[2, 5, 32]" and str(types["loss"]) == "float32[]"
    assert str(types["f1.in"]) == "float16[2, 5, 8]" and str(types["f2.in"]) == "bfloat16[2, 5, 8]"
    transfer = plan.node("f1.in")
    assert isinstance(transfer, Transfer) and transfer.nbytes == 2 * 5 * 8 * 2 and transfer.dst == PEER_B
    assert [(n.peer, n.start, n.end) for n in plan.remote() if isinstance(n, SpanForward)] == [
        (PEER_A, 0, 2),
        (PEER_B, 2, 3),
        (PEER_C, 3, 4),
    ]
    assert {n.op for n in plan.phase("update")} == {"optimizer_step"}
    prompts = PLANS["finetune-prompts/symbolic"].types()
    assert str(prompts["f0.in"]) == "float32[batch, tokens+4, 8]"
    assert str(prompts["logits"]) == "float32[batch, tokens, 32]"  # the prompts' positions are dropped
    assert str(PLANS["score/concrete"].types()["out"]) == "float32[2, 4]"
    assert isinstance(PLANS["generate/concrete"].node("s1"), SpanStep)


def test_a_plan_error_is_bad_input():
    assert issubclass(PlanError, BadInputError)


# ---- refusals ------------------------------------------------------------------------------------------------------
def test_a_cycle_is_refused():
    d = as_dict(PLANS["forward/concrete"])
    node_of(d, "embed")["inputs"] = ["hidden"]  # embed -> f0.in -> ... -> hidden -> embed
    assert "embed" in str(refused(d, "cycle"))


def test_a_node_reading_itself_is_a_cycle():
    d = as_dict(PLANS["forward/concrete"])
    node_of(d, "head")["inputs"] = ["head"]
    refused(d, "cycle through head")


def test_an_unknown_op_is_refused():
    d = as_dict(PLANS["forward/concrete"])
    node_of(d, "head")["op"] = "exec_shell"
    assert "exec_shell" in str(refused(d, "does not match any of the expected tags"))


def test_a_dangling_input_is_refused():
    d = as_dict(PLANS["forward/concrete"])
    node_of(d, "head")["inputs"] = ["nowhere"]
    refused(d, "node head reads nowhere, which is not in the plan")


def test_a_duplicate_id_is_refused():
    d = as_dict(PLANS["forward/concrete"])
    node_of(d, "logits")["id"] = "head"
    refused(d, "two nodes named head")


def test_a_wrong_number_of_inputs_is_refused():
    d = as_dict(PLANS["forward/concrete"])
    node_of(d, "embed")["inputs"] = []
    refused(d, r"node embed \(embed\) takes 1 to 1 inputs, got 0")


def test_a_shape_mismatch_is_refused():
    d = as_dict(PLANS["forward-loss-backward/concrete"])
    node_of(d, "labels")["out"] = {"shape": [3, 5], "dtype": "int64"}  # a batch of 3 labels for a batch of 2
    refused(d, "node loss: logits float32.2, 5, 32. and labels int64.3, 5. differ in batch or length")
    d = as_dict(PLANS["forward/concrete"])
    node_of(d, "head")["out"] = {"shape": [2, 5, 33], "dtype": "float32"}  # a declared type the inputs do not make
    refused(d, r"node head \(head\) declares float32\[2, 5, 33\], its inputs make float32\[2, 5, 32\]")
    d = as_dict(PLANS["forward/concrete"])
    node_of(d, "input_ids")["out"] = {"shape": [2, 5, 8], "dtype": "int64"}
    refused(d, "node embed: token ids int64.2, 5, 8. should have 2 dimensions")


def test_a_dtype_mismatch_is_refused():
    # f1 runs on a float16 server; its transfer claims to deliver the client's float32 (a cast left out)
    d = as_dict(PLANS["forward/concrete"])
    transfer = node_of(d, "f1.in")
    transfer["codec"], transfer["nbytes"] = "float32", 2 * 5 * 8 * 4
    refused(d, "node f1: input float32.2, 5, 8. reaches a float16 server without a transfer to cast it")
    d = as_dict(PLANS["forward/concrete"])
    node_of(d, "input_ids")["out"] = {"shape": [2, 5], "dtype": "float32"}  # token ids that are not integers
    refused(d, "node embed: token ids float32.2, 5. should be int64")
    d = as_dict(PLANS["forward/concrete"])
    node_of(d, "f0.in")["codec"] = "int64"  # hidden states cannot travel as integers
    refused(d, "node f0.in: codec int64 cannot carry float32")


def test_a_transfer_that_lies_about_its_bytes_is_refused():
    d = as_dict(PLANS["forward/concrete"])
    node_of(d, "f1.in")["nbytes"] = 1  # it carries 160 bytes
    refused(d, r"node f1.in: 1 bytes declared for float16\[2, 5, 8\] \(160 bytes\)")
    d = as_dict(PLANS["forward/symbolic"])
    node_of(d, "f1.in")["nbytes"] = 160  # a size no symbolic shape can promise
    refused(d, "node f1.in: 160 bytes declared")


def test_spans_and_backwards_must_fit():
    d = as_dict(PLANS["forward/concrete"])
    node_of(d, "f2")["end"] = 9
    refused(d, "node f2: blocks 3:9 of a 4-block model")
    d = as_dict(PLANS["forward/concrete"])
    node_of(d, "f2")["start"] = 4
    refused(d, "empty span 4:4")
    d = as_dict(PLANS["finetune/concrete"])
    node_of(d, "b1")["inputs"] = ["b1.in", "f2"]  # the backward of another hop's forward, on another server
    refused(d, "node b1 runs on 12D3KooWB.* but reads f2 on 12D3KooWC.* without a transfer")
    d = as_dict(PLANS["finetune/concrete"])
    node_of(d, "b1")["inputs"] = ["b1.in", "f2"]
    for node_id in ("b1", "b1.in", "b1.out"):  # all of b1 moved to f2's server: a backward of the wrong span there
        node = node_of(d, node_id)
        for field in ("peer", "dst", "src"):
            if node.get(field) == PEER_B:
                node[field] = PEER_C
    refused(d, "node b1: bound elsewhere than its forward f2")
    d = as_dict(PLANS["finetune/concrete"])
    node_of(d, "f0")["keep"] = False
    refused(d, "node b0: f0 is not a span_forward that keeps its graph")


def test_more_nodes_than_the_bound_are_refused():
    d = as_dict(PLANS["forward/concrete"])
    d["nodes"] = [{"id": f"x{i}", "op": "input", "out": {"shape": [1], "dtype": "int64"}} for i in range(MAX_NODES)]
    assert len(Plan.parse(json.dumps(d)).nodes) == MAX_NODES  # the bound itself is allowed
    d["nodes"].append({"id": "one_more", "op": "input", "out": {"shape": [1], "dtype": "int64"}})
    refused(d, f"invalid plan at nodes: .* at most {MAX_NODES} items")


def test_an_oversized_byte_string_is_refused_before_parsing(monkeypatch):
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("an oversized plan reached a parser")

    monkeypatch.setattr("swarm.plan.ir.json.loads", never)
    monkeypatch.setattr("swarm.plan.ir.msgpack.unpackb", never)
    refused(b"{" + b" " * MAX_PLAN_BYTES, f"a plan of {MAX_PLAN_BYTES + 1} bytes is over the {MAX_PLAN_BYTES}-byte")
    refused(b"\x91" * (MAX_PLAN_BYTES + 1), "over the")


def test_unknown_fields_are_refused():
    d = as_dict(PLANS["forward/concrete"])
    d["run_this"] = "rm -rf /"
    refused(d, "invalid plan at run_this: Extra inputs are not permitted")
    d = as_dict(PLANS["forward/concrete"])
    node_of(d, "f0")["command"] = "x"
    refused(d, "invalid plan at nodes.3.span_forward.command: Extra inputs are not permitted")
    d = as_dict(PLANS["forward/concrete"])
    node_of(d, "input_ids")["out"]["strides"] = [1, 1]
    refused(d, "Extra inputs are not permitted")


def test_other_versions_and_bad_values_are_refused():
    d = as_dict(PLANS["forward/concrete"])
    d["plan_version"] = 2
    refused(d, "plan version 2, this side reads 1")
    d = as_dict(PLANS["forward/concrete"])
    d["dtype"] = "int64"
    refused(d, "the client's dtype must be floating point")
    d = as_dict(PLANS["forward/concrete"])
    node_of(d, "f0")["id"] = "f0; drop"
    refused(d, r"invalid plan at nodes.3.span_forward.id: String should match pattern")
    d = as_dict(PLANS["forward/concrete"])
    node_of(d, "input_ids")["out"] = {"shape": [2, -5], "dtype": "int64"}
    refused(d, "invalid plan at nodes.0.input.out.shape")


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00",
        b"\xff\xfe\xfd",
        b"not a plan",
        b"{not json",
        b'{"task": ',
        b"\xc1",
        b"[1, 2]",
        msgpack.packb([1, 2, 3]),
        msgpack.packb(7),
        msgpack.packb({"nodes": b"\x00" * 8}),
        msgpack.packb("plan"),
        json.dumps({"nodes": None}).encode(),
        b"{}",
        '{"task": "\ud800"}'.encode("utf-8", "surrogatepass"),
    ],
)
def test_garbage_is_refused(data):
    with pytest.raises(PlanError, match="not a plan|invalid plan"):
        Plan.parse(data)


def test_deeply_nested_json_is_refused():
    refused(b'{"nodes": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "not a plan")


def test_a_text_plan_that_is_not_unicode_is_refused():
    with pytest.raises(PlanError, match="not a plan"):
        Plan.parse('{"task": "\ud800"}')


# ---- repair --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["forward/concrete", "finetune/concrete", "finetune-prompts/symbolic"])
def test_repair_rebinds_a_hop_to_a_new_route(name):
    plan = PLANS[name]
    route = [Hop("12D3KooWDdddd", 2, 3, dtype="bfloat16")]
    fixed, new = repair(plan, "f1", route, generation=1)
    assert new == ["f1.r1.0"]
    assert Plan.parse(fixed.to_json()) == fixed and Plan.parse(fixed.to_msgpack()) == fixed
    assert "f1" not in {n.id for n in fixed.nodes} and PEER_B not in {n.party for n in fixed.nodes}
    node = fixed.node("f1.r1.0")
    assert isinstance(node, SpanForward) and (node.peer, node.start, node.end, node.dtype) == (
        "12D3KooWDdddd",
        2,
        3,
        "bfloat16",
    )
    # whatever read the old hop reads the new one: the outputs keep their types
    before, after = plan.types(), fixed.types()
    assert {k: after[k] for k in before if k in after and k not in ("f1.in",)} == {
        k: before[k] for k in before if k in after and k not in ("f1.in",)
    }
    assert set(after) >= {"logits", "f2.in"}
    if plan.task == "finetune":  # the backward follows the forward to its new server
        backward = [n for n in fixed.remote() if isinstance(n, SpanBackward)]
        assert [(n.peer, n.inputs[1]) for n in backward] == [
            (PEER_C, "f2"),
            ("12D3KooWDdddd", "f1.r1.0"),
            (PEER_A, "f0"),
        ]
        assert fixed.types()["grad_input"] == plan.types()["grad_input"]


def test_repair_over_several_servers_and_of_an_inference_step():
    fixed, new = repair(PLANS["finetune/concrete"], "f0", [Hop("D", 0, 1), Hop("E", 1, 2, dtype="float16")], 3)
    assert new == ["f0.r3.0", "f0.r3.1"]
    assert [n.peer for n in fixed.remote() if isinstance(n, SpanBackward)][-2:] == ["E", "D"]
    assert Plan.parse(fixed.to_msgpack()) == fixed
    fixed, new = repair(PLANS["generate/concrete"], "s2", [Hop("F", 3, 4)], 1)
    step = fixed.node(new[0])
    assert isinstance(step, SpanStep) and step.peer == "F" and step.max_length == 64
    assert Plan.parse(fixed.to_json()) == fixed


def test_repair_refuses_what_it_cannot_rebind():
    with pytest.raises(PlanError, match="must cover blocks 2:3"):
        repair(PLANS["forward/concrete"], "f1", [Hop("D", 2, 4)], 1)
    with pytest.raises(PlanError, match="must cover blocks 2:3"):
        repair(PLANS["forward/concrete"], "f1", [], 1)
    with pytest.raises(PlanError, match="not a forward or inference node"):
        repair(PLANS["finetune/concrete"], "b1", [Hop("D", 2, 3)], 1)


def test_a_hop_can_be_repaired_again_and_again():
    plan, node = PLANS["generate/concrete"], "s1"
    for generation in range(1, 31):  # a long session whose hop keeps failing over
        plan, new = repair(plan, node, [Hop(f"peer{generation}", 2, 3, dtype="float16")], generation)
        node = new[0]
    assert Plan.parse(plan.to_json()) == plan


# ---- phases and parties ---------------------------------------------------------------------------------------------
def test_compiled_gradient_transfers_are_in_the_backward_phase():
    plan = PLANS["finetune/concrete"]
    forward = {n.id for n in plan.phase("forward")}
    assert not forward & {"b0.in", "b1.out", "grad_input"}


def test_a_forward_node_reading_a_gradient_is_refused():
    d = as_dict(PLANS["finetune/concrete"])
    node_of(d, "b2.in")["phase"] = "forward"  # runs in the forward, on grad_hidden which exists only after it
    refused(d, "phase")


def test_a_transfer_to_the_wrong_party_is_refused():
    d = as_dict(PLANS["forward/concrete"])
    node_of(d, "f1.in")["dst"] = "12D3KooWEvilevilevilevil"  # f1 runs on PEER_B
    refused(d, "f1")


def test_a_remote_node_reading_the_client_without_a_transfer_is_refused():
    d = as_dict(PLANS["forward/concrete"])
    node_of(d, "f0")["inputs"] = ["embed"]  # f0's server is float32, as the client: no cast hides the gap
    refused(d, "transfer")

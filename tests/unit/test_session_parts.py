"""The inference session's parts that decide without a network (``swarm/client/session/``): a hop's replay history
cut back by a speculative take-back, the route repaired as a value, the one rule of the adapter re-send, and a step
cut into chunks."""

from __future__ import annotations

import torch

from swarm.client.executor import schedule
from swarm.client.session.hop import HopState
from swarm.client.session.paths import resend_adapter
from swarm.client.session.route import BoundRoute
from swarm.client.session.steps import Step, chunks
from swarm.client.tuning.adapters import AdapterDelivery, ClientAdapters
from swarm.hop import Hop
from swarm.plan.compile import ModelShape, generate_plan, repair
from swarm.tuning import TuningSpec


def _hop(peer: str, start: int, end: int) -> Hop:
    return Hop(peer_id=peer, start=start, end=end)


def _steps(*lengths: int) -> HopState:
    state = HopState(_hop("a", 0, 4))
    at = 0
    for n in lengths:
        x = torch.arange(at, at + n, dtype=torch.float32).view(1, n, 1)
        state.replay.record(x, torch.arange(at, at + n)[None], -x)
        at += n
    return state


def test_a_take_back_cuts_the_last_steps_and_keeps_what_evidence_needs():
    state = _steps(3, 1, 4)  # a prompt, one token, a speculative step of 4 (1 kept + 3 drafts)
    state.replay.take_back(3)
    assert [x.shape[1] for x in state.replay.inputs] == [3, 1, 1]
    assert state.replay.positions[-1].tolist() == [[4]]
    assert state.replay.outputs[-1] is not None and state.replay.outputs[-1].flatten().tolist() == [-4.0]
    tail_in, tail_out = state.replay.tails[2]  # the rejected drafts: the server's commitment covers them
    assert tail_in.flatten().tolist() == [5.0, 6.0, 7.0]
    assert tail_out is not None and tail_out.flatten().tolist() == [-5.0, -6.0, -7.0]
    hidden, positions = state.replay.history()
    assert hidden.flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] and positions.tolist() == [[0, 1, 2, 3, 4]]


def test_a_take_back_across_steps_drops_whole_steps():
    state = _steps(2, 1, 1)
    state.replay.take_back(2)
    assert [x.shape[1] for x in state.replay.inputs] == [2]
    assert len(state.replay.outputs) == 1 and not state.replay.tails


def test_a_take_back_after_verification_let_outputs_go_cuts_inputs_only():
    state = _steps(2, 3)
    state.replay.outputs.clear()  # no verifier: outputs are not kept
    state.replay.take_back(2)
    assert [x.shape[1] for x in state.replay.inputs] == [2, 1] and state.replay.outputs == []
    assert state.replay.tails[1][1] is None


def test_a_repaired_route_is_a_new_value_and_the_old_one_stands():
    shape = ModelShape(model_id="m", num_blocks=8, hidden_size=16, vocab_size=32)
    route = [_hop("a", 0, 4), _hop("b", 4, 8)]
    plan = generate_plan(shape, route, max_length=16)
    bound = BoundRoute.bind(plan, schedule(plan), route)
    fresh_hops = [_hop("c", 0, 2), _hop("d", 2, 4)]
    new_plan, ids = repair(plan, bound.ids[0], fresh_hops, 1)
    fresh = [HopState(h) for h in fresh_hops]
    repaired = bound.replaced(0, new_plan, ids, fresh, 1)
    assert [h.peer_id for h in repaired.route] == ["c", "d", "b"]
    assert repaired.states[2] is bound.states[1]  # the hop after keeps its state (its KV cache, its history)
    assert repaired.schedule is None and repaired.generation == 1
    assert [h.peer_id for h in bound.route] == ["a", "b"] and bound.plan is plan  # nothing to roll back


def test_the_adapter_is_sent_again_once_and_only_at_an_opening():
    adapters = ClientAdapters(TuningSpec("lora", lora_rank=2), {"q_proj": (4, 4)}, num_blocks=4, hidden_size=4)
    delivery = AdapterDelivery(adapters)
    state = HopState(_hop("a", 0, 4))
    delivery.delivered(state.hop)
    assert not delivery.needs_sending(state.hop)
    assert not resend_adapter(None, state, True)  # no adapter: nothing to send
    assert not resend_adapter(delivery, state, False)  # a later step cannot carry it: the error stands
    assert resend_adapter(delivery, state, True)
    assert state.link.send_adapter and state.link.stream is None and state.link.generation == -1
    assert delivery.needs_sending(state.hop)  # its copy there is forgotten
    assert not resend_adapter(delivery, state, True)  # it went along already: a server that drops it is not fed twice


def test_a_step_enters_later_hops_with_their_input_and_is_cut_in_chunks():
    step = Step(torch.zeros(1, 5, 2), None, None, torch.arange(5)[None], 7)
    later = step.entering(torch.ones(1, 5, 2))
    assert later.position == 7 and later.tokens == 5 and bool((later.hidden == 1).all())
    assert [(c.start, c.end) for c in chunks(5, 2)] == [(0, 2), (2, 4), (4, 5)]
    assert [(c.start, c.end) for c in chunks(5, 0)] == [(0, 5)]

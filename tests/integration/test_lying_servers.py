"""Servers that lie in their replies (``tests/helpers/liar.py``: real peers whose answers are rewritten in their
own process) cost the client a failover each, never a wrong output or an error: a reply without ``hidden``, one far
larger than the request implies, ``bad_input`` to a valid request, an internal "out of memory" failure. With one
honest server beside them, the client's forward and generate equal a local Hugging Face run, and every liar ends
banned."""

from __future__ import annotations

import pytest
import torch

from swarm.errors import BadInputError, MessageTooLargeError, PeerUnavailableError, SwarmError, WrongReplyError
from tests.helpers.liar import MODES, start_liar
from tests.helpers.models import local_reference
from tests.helpers.swarms import check_forward, connect, counter, running_swarm, wait_for

pytestmark = pytest.mark.slow


def _server_fault(e: object) -> bool:
    """A failure the server named as its own internal error (answered ``swarm_error``)."""
    cause = getattr(e, "cause", None)
    return isinstance(e, PeerUnavailableError) and type(cause) is SwarmError and cause.declared


def caught_as_lies(client, liar_ids: dict[str, str], steps: bool) -> dict[str, str]:
    """Each liar's mode -> what is wrong with how the client recorded its failure ("" where it is the lie's own
    kind), from the retry helper's typed record: a failure counted against every liar, for the very lie it told.
    ``steps``: inference steps, where the ``no_hidden`` liar's rename breaks its own session loop (which reads the
    step's ``hidden``) before anything is sent: a server error, not a reply the client could check."""
    last = client.connection.retrier.last_failure
    wrong = {}
    for mode, peer in liar_ids.items():
        e = last.get(peer)
        if mode == "no_hidden" and not steps:  # its reply failed the client's check of names, shapes and dtypes
            ok = isinstance(e, WrongReplyError)
        elif mode == "oversized":  # cut off at the request's bound as its frames arrived
            ok = isinstance(e, PeerUnavailableError) and isinstance(e.cause, MessageTooLargeError)
        elif mode == "bad_input":  # its claim was checked on the honest server, which computed the request
            ok = type(e) is BadInputError and e.declared
        else:  # oom (and no_hidden's broken step): the server's internal error, named as such
            ok = _server_fault(e)
        wrong[mode] = "" if ok else f"{type(e).__name__}: {e} (cause {getattr(e, 'cause', None)!r})"
    return wrong


def test_lying_servers_are_banned_and_outputs_stay_exact(tiny_models):
    folder = str(tiny_models["llama"])
    ref = local_reference(tiny_models["llama"])
    ids = torch.randint(0, 320, (1, 7), generator=torch.Generator().manual_seed(5))
    expected = ref.generate(ids, max_new_tokens=8, do_sample=False)
    # one honest server, and four liars on the same blocks, each announced ten times faster: routes try them first
    with running_swarm(folder, ["0:4"], "--metrics-port", "0") as swarm:  # every peer's metrics, liars' too
        liars = [start_liar(swarm, mode, "0:4", wait=False) for mode in MODES]
        for liar in liars:
            liar.wait_ready(swarm.startup_timeout)
        liar_ids = {mode: liar.peer_id for mode, liar in zip(MODES, liars, strict=True)}
        honest = swarm.peers[0].peer_id
        no_lie = dict.fromkeys(MODES, "")  # nothing wrong with how any liar was caught

        # forward: each liar in turn gets the call (fresh clients have measured nobody yet) and is banned: at least
        # one failover each (a loaded machine may add a timeout of its own, and a ban that ran out may let a liar
        # lie twice; neither changes what each liar was caught for)
        with connect(folder, swarm) as client:
            wait_for(lambda: len(client.connection.view.servers()) == 5, 60, "every server in the client's view")
            check_forward(client, ref, 320)
            assert caught_as_lies(client, liar_ids, steps=False) == no_lie
            assert client.failovers >= len(MODES)
            assert [h.peer_id for h in client.route] == [honest]

        # generate: the inference sessions' steps, the same way
        with connect(folder, swarm) as client:
            wait_for(lambda: len(client.connection.view.servers()) == 5, 60, "every server in the client's view")
            assert torch.equal(client.generate(ids, max_new_tokens=8, do_sample=False), expected)
            assert caught_as_lies(client, liar_ids, steps=True) == no_lie
            assert client.failovers >= len(MODES)
        assert all(liar.proc.poll() is None for liar in liars)  # they lied; they did not crash
        # the out-of-memory lie is an error of the liar's own, and counted as such by it; the honest server had none
        errors = counter(swarm, "swarm_peer_internal_errors")
        assert errors[liar_ids["oom"]] >= 1 and errors[honest] == 0, errors

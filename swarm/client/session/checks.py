"""What an inference session checks about its servers around each step, in one object the step calls before and after:
verification of each hop's work on another server (``swarm.client.verify.verifier``), the signatures over each hop's
commitments (``audit``, and ``seal`` at the end), and which step is final.

A speculative step is provisional (``InferenceSession.provisional``): its drafts may still be taken back, so its hops'
records go to verification only once ``take_back`` has cut them to what was accepted, or the next step begins."""

from __future__ import annotations

import logging

import torch

from swarm.client.connection import SwarmConnection
from swarm.client.session.hop import HopState, seal_chains
from swarm.client.verify.verdicts import act
from swarm.client.verify.verifier import Verifier
from swarm.rpc.remote import unavailable

log = logging.getLogger(__name__)


class SessionChecks:
    def __init__(self, conn: SwarmConnection, verifier: Verifier | None, chunk: int, session_id: str) -> None:
        self.conn, self.verifier, self.chunk, self.session_id = conn, verifier, chunk, session_id
        self.caught: list[str] = []  # servers this session caught computing wrong answers
        self.pending = False  # the last step is not final yet (a provisional step not yet cut)

    def before_step(self, states: list[HopState]) -> None:
        """The last step is final now; the checks that finished are acted on (a cheating hop is marked broken, so
        it is replaced before this step)."""
        self.confirm(states)
        if self.verifier is not None:
            self.caught += act(self.verifier.settle(), self.conn, self.chunk)

    def after_step(self, states: list[HopState], mask: torch.Tensor | None, final: bool) -> None:
        """A step went through ``states`` with ``mask`` over every position so far (padding: the steps are no plain
        prefixes, not verified yet); ``final``: no draft of it can be taken back."""
        if self.verifier is not None and mask is not None and not bool((mask == 1).all()):
            self.verifier.stop()
        self.pending = True
        if final:
            self.confirm(states)

    def confirm(self, states: list[HopState]) -> None:
        """The last step is final: its hops' records go to verification (or their outputs are let go)."""
        if not self.pending:
            return
        self.pending = False
        if self.verifier is not None:
            self.verifier.after_step(states)
        else:  # outputs are kept only for verification
            for state in states:
                state.replay.outputs.clear()

    def audit(self, states: list[HopState]) -> None:
        """Check the latest signature over each hop's commitments, if not yet checked; a hop whose signature does not
        hold is banned and replaced at the next step. Off the decode path (an Ed25519 check costs about 150 µs, one
        per hop covers all its steps): what a step needs at once is checked as replies arrive (``session.chain``)."""
        for state in states:
            if not state.commitments.audit():
                state.link.broken = True
                error = unavailable(state.hop.peer_id, "signed its commitments with a key it did not certify")
                self.conn.retrier.note_failure(error, "commitment audit")

    def seal(self, states: list[HopState], end: bool = False) -> None:
        """Have every live hop sign the head of its chain of commitments, so the session's last steps are signed too;
        a hop that signs another chain than the one it sent is banned. Best effort: a hop that does not answer in
        time keeps its last steps unsigned (and is not blamed: it may just be gone)."""
        timeout = self.conn.timing.notice_timeout
        try:
            bad = self.conn.loop.run(seal_chains(states, timeout, end), timeout + 1.0)
        except Exception as e:  # noqa: BLE001 - best effort at the session's end: its tokens are already out
            log.info("sealing the session's commitments failed: %s", e, extra={"session": self.session_id})
            return
        for state in bad:
            error = unavailable(state.hop.peer_id, "signed a chain of commitments other than the one it sent")
            self.conn.retrier.note_failure(error, "commitment seal")

    def finish(self, states: list[HopState], chained: bool) -> None:
        """The session ends: the steps since each hop's last check are checked, the chains of chained hops sealed,
        and every signature audited."""
        try:
            self.confirm(states)
            if self.verifier is not None:
                self.caught += act(self.verifier.finish(self.conn.timing.request_timeout), self.conn, self.chunk)
        finally:
            if self.verifier is not None:
                self.verifier.close()
            if chained:
                self.seal(states, end=True)
            self.audit(states)

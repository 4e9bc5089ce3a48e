"""The server's step scheduler: which waiting steps run together (pure ``pick`` with an injected clock), fair shares
per caller on a saturated server, the oldest step always first, overdue steps before fair shares, inference ahead
of other compute, and a failed batch that hurts only the row at fault."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch

from peers.serving.rhythm import Rhythm, hold
from peers.serving.runtime import Row
from peers.serving.scheduler import Shares, StepScheduler, Waiting, batching, pick, pieces
from swarm.ids import Span

SUB = Span(0, 4)


def _waiting(caller: str, since: float, rows: int = 1, n: int = 1, key: object = "decode", past: int = 0) -> Waiting:
    row = Row(torch.zeros(rows, n, 4), None, past)
    return Waiting(caller, SUB, row, key, since, lambda: torch.zeros(0), None, None)  # type: ignore[arg-type]


def test_the_first_step_sets_what_joins_it():
    steps = [_waiting("a", 2.0), _waiting("b", 1.0, n=7, key="prefill"), _waiting("c", 3.0)]
    batch = pick(steps, Shares(), max_rows=8, max_tokens=64)
    assert batch == [steps[1]]  # equal shares: the oldest leads; a prefill chunk runs alone (nothing shares its key)
    steps.remove(steps[1])
    batch = pick(steps, Shares(), max_rows=8, max_tokens=64)
    assert batch == [steps[0], steps[1]]


def test_a_caller_with_thirty_sessions_and_one_with_one_share_a_saturated_server():
    """Rows of four per forward, caller ``many`` always has 30 steps waiting and ``few`` one of four rows (its
    session's batch), which comes back fresh after each of its forwards while ``many``'s have waited long: over many
    rounds each gets within 20% of half the rows. (Steps that had waited long went first, oldest first, before: on a
    saturated server that is first come first served, and ``few`` got 4 rows in 34.)"""
    shares, served = Shares(), Counter[str]()
    clock = 0.0
    waiting = [_waiting("many", clock) for _ in range(30)] + [_waiting("few", clock, rows=4)]
    for _ in range(400):
        clock += 1.0
        batch = pick(waiting, shares, max_rows=4, max_tokens=64)
        for w in batch:
            served[w.caller] += w.row.rows
            waiting.remove(w)
            waiting.append(_waiting(w.caller, clock, rows=w.row.rows))  # the session's next step
    total = served["many"] + served["few"]
    for caller in ("many", "few"):
        assert abs(served[caller] / total - 0.5) <= 0.1, served


def test_the_least_served_caller_leads_and_its_oldest_step_first():
    """However long a greedy caller's steps have waited, the least served caller leads the batch (with its oldest
    step, whatever its kind: a prompt chunk shares no batch, and still runs); the greedy caller's oldest fill the rest,
    and it leads as soon as it is the least served."""
    shares = Shares()
    shares.vtime.update({"greedy": 1000.0, "fresh": 0.0})
    shares.waiting = frozenset({"greedy", "fresh"})
    old, late = _waiting("greedy", 0.0), _waiting("greedy", 1.0)
    chunk = _waiting("fresh", 5.0, n=7, key="prefill")
    fresh = [_waiting("fresh", 6.0) for _ in range(3)]
    assert pick([*fresh, chunk, late, old], shares, max_rows=2, max_tokens=64) == [chunk]
    assert pick([*fresh, late, old], shares, max_rows=4, max_tokens=64) == [*fresh, old]  # then greedy's oldest
    shares.vtime["fresh"] = 2000.0
    assert pick([*fresh, late, old], shares, max_rows=2, max_tokens=64) == [old, late]  # greedy is behind now


def test_a_batch_room_is_bounded_by_rows_times_the_longest_past():
    steps = [_waiting("a", 0.0, past=10), _waiting("b", 1.0, past=900), _waiting("c", 2.0, past=20)]
    batch = pick(steps, Shares(), max_rows=8, max_tokens=64, max_room=100)
    assert batch == [steps[0], steps[2]]  # 2 x (900 + 1) would not fit; 2 x (20 + 1) does


def test_a_caller_that_was_idle_banks_no_credit():
    shares = Shares()
    for _ in range(50):  # only "a" waits for a while
        pick([_waiting("a", 0.0)], shares, 8, 64)
    a_then = shares.vtime["a"]
    pick([_waiting("a", 1.0), _waiting("b", 1.0)], shares, 8, 64)
    assert shares.vtime["b"] >= a_then  # b starts where the least served waiting caller was, not at 0


class _Runtime:
    def __init__(self, fail_row: int | None = None) -> None:
        self.batches: list[int] = []
        self.fail_row = fail_row

    def joins(self, cache: object) -> bool:
        return True

    def run_batch(self, rows: list[Row], sub: Span) -> list[torch.Tensor]:
        self.batches.append(len(rows))
        if self.fail_row is not None and any(int(r.hidden[0, 0, 0]) == self.fail_row for r in rows):
            raise RuntimeError("a bad row")
        return [r.hidden * 2 for r in rows]


def _thread_runner():
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(1)

    async def on_thread(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    return pool, on_thread


@pytest.mark.parametrize("fail_row", [None, 3])
def test_steps_waiting_together_run_as_one_batch(fail_row):
    runtime, sizes = _Runtime(fail_row), []
    pool, on_thread = _thread_runner()

    async def main():
        scheduler = StepScheduler(on_thread, 32, 1024, 1.0, 0, sizes.append)

        async def one(i: int):
            x = torch.full((1, 1, 4), float(i))

            def alone():
                if i == fail_row:
                    raise RuntimeError("a bad row")
                return x * 2

            return await scheduler.step(f"c{i % 3}", SUB, Row(x, None, 0), alone, runtime, "decode")

        steps = [asyncio.ensure_future(one(i)) for i in range(8)]  # all wait before the scheduler's loop runs
        results = await asyncio.gather(*steps, return_exceptions=True)
        scheduler.close()
        return results

    try:
        results = asyncio.run(main())
    finally:
        pool.shutdown()
    assert runtime.batches[0] == 8  # the eight steps waiting together ran as one forward
    assert 8 in sizes  # ...and the batch-size metric saw it
    for i, r in enumerate(results):
        if i == fail_row:
            assert isinstance(r, RuntimeError)  # only the row at fault hears the error
        else:
            assert torch.equal(r, torch.full((1, 1, 4), 2.0 * i))


def test_waiting_inference_goes_before_other_work():
    order: list[str] = []
    runtime = _Runtime()
    pool, on_thread = _thread_runner()

    async def main():
        scheduler = StepScheduler(on_thread, 32, 1024, 60.0, 0, lambda rows: None)
        first = asyncio.ensure_future(scheduler.other(lambda: order.append("first")))
        await asyncio.sleep(0)
        training = asyncio.ensure_future(scheduler.other(lambda: order.append("training")))
        x = torch.ones(1, 1, 4)
        step = asyncio.ensure_future(
            scheduler.step("c", SUB, Row(x, None, 0), lambda: order.append("step") or x, runtime, "decode")
        )
        await asyncio.gather(first, training, step)
        scheduler.close()

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()
    assert order.index("step") < order.index("training")


def _at(session: str, since: float, rows: int = 1) -> Waiting:
    w = _waiting("c", since, rows=rows)
    w.session = session
    return w


def _rhythm(price: float, share: float = 1.0) -> Rhythm:
    rhythm = Rhythm(share=share)
    rhythm.forwards = [price, 2 * price]  # the price is the quickest recent forward
    return rhythm


def test_a_lone_session_or_a_full_batch_never_waits():
    rhythm = _rhythm(0.05)
    rhythm.arrived("a", 0.0)
    rhythm.arrived("a", 1.0)
    assert hold([_at("a", 1.0)], rhythm, 1.0, max_rows=8, max_wait=1.0) == 0.0  # nobody else keeps a rhythm here
    rhythm.ran(0.05, ["a", "b"])  # b ran with a last time and is not back
    assert hold([_at("a", 1.0)], rhythm, 1.0, max_rows=8, max_wait=1.0) > 0
    assert hold([_at("a", 1.0, rows=8)], rhythm, 1.0, max_rows=8, max_wait=1.0) == 0.0  # full: nothing can join
    assert hold([_at("a", 1.0)], rhythm, 1.0, max_rows=1, max_wait=1.0) == 0.0  # unbatched


def test_steps_wait_for_their_last_companions_at_most_one_forward():
    rhythm = _rhythm(0.04)
    rhythm.ran(0.04, ["a", "b", "c"])
    waiting = [_at("a", 10.0)]
    assert hold(waiting, rhythm, 10.0, 8, 1.0) == pytest.approx(0.04)  # b and c are on their way: one price at most
    assert hold(waiting, rhythm, 10.03, 8, 1.0) == pytest.approx(0.01)  # counted from the oldest step's arrival
    assert hold(waiting, rhythm, 10.05, 8, 1.0) == 0.0  # the price is spent: run without them
    waiting += [_at("b", 10.01), _at("c", 10.02)]
    assert hold(waiting, rhythm, 10.02, 8, 1.0) == 0.0  # all back: run at once
    rhythm.forgot("b")
    rhythm.forgot("c")
    assert hold(waiting[:1], rhythm, 10.0, 8, 1.0) == 0.0  # ended sessions are no one's companions


def test_a_session_due_by_its_rhythm_is_waited_for_only_if_due_within_the_price():
    rhythm = _rhythm(0.04)
    for t in (0.0, 0.5, 1.0):  # b steps every 0.5 s, last at 1.0: due at 1.5
        rhythm.arrived("b", t)
    assert hold([_at("a", 1.48)], rhythm, 1.48, 8, 1.0) == pytest.approx(0.02)  # due before the price is spent
    assert hold([_at("a", 1.40)], rhythm, 1.40, 8, 1.0) == 0.0  # due after it: not worth a forward's wait
    assert hold([_at("a", 3.40)], rhythm, 3.40, 8, 1.0) == 0.0  # b stopped stepping (silent for 2 gaps)


def test_on_a_shared_device_rounds_wait_longer_so_they_merge():
    rhythm = _rhythm(0.04, share=0.5)  # the compute thread got half a core during its forwards
    for t in (0.0, 0.5, 1.0):
        rhythm.arrived("b", t)
    assert hold([_at("a", 1.40)], rhythm, 1.40, 8, 1.0) == pytest.approx(0.10)  # due within 8 prices
    assert hold([_at("a", 1.40)], rhythm, 1.40, 8, 0.1) == 0.0  # ...but never past half of max_wait
    rhythm.ran(0.04, ["a", "c"], cpu=0.04)
    assert rhythm.share > 0.5  # measured again with every forward


def test_a_held_round_runs_as_one_forward():
    """Session b ran with a last time and comes back 20 ms after it: they run together, not as two forwards."""
    runtime, sizes = _Runtime(), []
    pool, on_thread = _thread_runner()

    async def main():
        scheduler = StepScheduler(on_thread, 32, 1024, 20.0, 0, sizes.append)
        # a forward costs far more than b's lateness (b's arrival ends the wait, not the price)
        scheduler.rhythm.ran(5.0, [("c", "a"), ("c", "b")])

        async def one(name: str, delay: float):
            await asyncio.sleep(delay)
            x = torch.ones(1, 1, 4)
            return await scheduler.step("c", SUB, Row(x, None, 0), lambda: x, runtime, "decode", session=("c", name))

        await asyncio.gather(one("a", 0.0), one("b", 0.02))
        scheduler.close()

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()
    assert sizes == [2] and runtime.batches == [2]


def _stepping(rhythm: Rhythm, sessions: list[str], every: float, upto: float, rows: int = 1) -> None:
    """``sessions`` stepping every ``every`` seconds until ``upto``."""
    t = 0.0
    while t <= upto:
        for name in sessions:
            rhythm.arrived(name, t, rows)
        t += every


def test_a_server_idle_most_of_a_round_takes_half_its_stepping_rows_per_forward():
    """Pipeline micro-batches: 16 sessions stepping every 0.25 s through a server whose forwards fill a fifth of its
    time go in two forwards of 8 (the next hop computes one while this one computes the other); a busy server, a
    server whose forwards are not known yet, a lone session and sessions that stopped stepping keep the whole batch."""
    rhythm = Rhythm()
    names = [f"s{i}" for i in range(16)]
    _stepping(rhythm, names, 0.25, 1.0)
    assert rhythm.cohort(1.0, 32) == 32  # no forward measured yet: busy counts as 1
    for end in (0.30, 0.55, 0.80, 1.05):
        rhythm.ran(0.05, names, end=end)
    assert rhythm.busy(1.05) == pytest.approx(0.2 / 0.80)
    assert rhythm.cohort(1.05, 32) == 8
    assert rhythm.cohort(1.05, 6) == 6  # never over --max-batch
    _stepping(rhythm, names[:3], 0.25, 1.0, rows=4)  # three of them now step with 4 rows each: 13 + 12 rows
    assert rhythm.cohort(1.05, 32) == 13
    assert rhythm.cohort(5.0, 32) == 32  # all silent for two of their gaps: no one steps here any more
    busy = Rhythm()
    _stepping(busy, names, 0.25, 1.0)
    for end in (0.25, 0.5, 0.75, 1.0):
        busy.ran(0.2, names, end=end)  # forwards fill 80% of the time: this is the slow hop, batch all
    assert busy.cohort(1.0, 32) == 32
    lone = Rhythm()
    _stepping(lone, ["a"], 0.25, 1.0)
    for end in (0.3, 0.55, 0.8, 1.05):
        lone.ran(0.01, ["a"], end=end)
    assert lone.cohort(1.05, 32) == 32
    few = Rhythm()  # idle most of the round, but two rows step through it: halves of one row cost two fixed costs
    _stepping(few, names[:2], 0.25, 1.0)
    for end in (0.30, 0.55, 0.80, 1.05):
        few.ran(0.05, names[:2], end=end)
    assert few.busy(1.05) < 0.5 and few.cohort(1.05, 32) == 32
    _stepping(few, names[:4], 0.25, 1.0)  # four rows: two halves of two
    assert few.cohort(1.05, 32) == 2


def test_an_idle_server_runs_a_round_as_two_forwards_and_sends_the_first_half_on_before_the_second():
    """The scheduler's loop with a pipelining rhythm: 16 steps waiting together run as 8 + 8, and the first eight
    steps' outputs are out (their callers resumed) before the second forward starts; a half that comes back alone
    runs at once, without waiting for the other half."""
    import threading

    runtime, sizes, outs, released = _Runtime(), [], [], []
    first_half_out = threading.Event()
    pool, on_thread = _thread_runner()
    names = [f"s{i}" for i in range(16)]

    async def main():
        clock = [100.0]
        scheduler = StepScheduler(on_thread, 32, 1024, 20.0, 0, sizes.append, clock=lambda: clock[0])
        _stepping(scheduler.rhythm, [("c", n) for n in names], 0.25, 99.9)
        for end in (99.3, 99.55, 99.8, 100.0):
            scheduler.rhythm.ran(0.05, [], end=end)  # forwards fill a fifth of the time
        real = runtime.run_batch

        def run_batch(rows, sub):
            if runtime.batches:  # a later forward: are the first half's callers on their way (pushing on)?
                released.append(first_half_out.wait(5.0))
            return real(rows, sub)

        runtime.run_batch = run_batch

        async def one(name: str):
            x = torch.ones(1, 1, 4)
            out = await scheduler.step("c", SUB, Row(x, None, 0), lambda: x, runtime, "decode", session=("c", name))
            outs.append(name)
            if len(outs) == 8:
                first_half_out.set()
            return out

        await asyncio.gather(*(one(n) for n in names))
        assert sizes == [8, 8] and released == [True]  # the first half went on while the second computed
        first = outs[:8]
        clock[0] += 0.25  # the first half is back on its own: it does not wait for the other half
        await asyncio.wait_for(asyncio.gather(*(one(n) for n in first)), 5.0)
        assert sizes == [8, 8, 8]
        scheduler.close()

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()


class _Batching:
    """A runtime that batches sessions whose cache it is told joins."""

    def __init__(self, joins: bool) -> None:
        self._joins = joins

    def joins(self, cache: object) -> bool:
        return self._joins

    def run_batch(self, rows: list[Row], sub: Span) -> list[torch.Tensor]:
        raise AssertionError("not run here")


def test_a_step_batches_only_through_a_batching_runtime_with_a_plain_cache_past_its_prompts():
    row = Row(torch.zeros(1, 3, 4), object(), past=5)
    runtime = _Batching(joins=True)
    assert batching(runtime, SUB, row, prompts=0) == (runtime, (SUB, 3))
    assert batching(runtime, SUB, row, prompts=8) == (None, None)  # a deep prompt still to add: alone
    assert batching(_Batching(joins=False), SUB, row, prompts=0) == (None, None)
    assert batching(object(), SUB, row, prompts=0) == (None, None)  # a runtime that does not batch (ONNX)


def test_a_long_step_is_cut_into_prefill_chunks_but_a_deep_prompt_stays_whole():
    runtime = _Batching(joins=True)
    assert pieces(runtime, 600, 0, 256, 0) == [(0, 256), (256, 512), (512, 600)]
    assert pieces(runtime, 200, 0, 256, 0) == [(0, 200)]
    assert pieces(runtime, 600, 0, 256, 600) == [(0, 600)]  # the prompt's tokens go in one piece
    assert pieces(object(), 600, 0, 256, 0) == [(0, 600)]  # only a batching runtime splits a step

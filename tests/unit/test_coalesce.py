"""The client's head coalescer: concurrent inference-mode calls from several threads go as one call over all their
positions, each gets exactly its own rows back, a lone call and calls under autograd go alone, and an error in a
joined call reaches only the call at fault."""

from __future__ import annotations

import threading
import time

import torch

from swarm.client.coalesce import Coalescer

W = torch.randn(8, 5, generator=torch.Generator().manual_seed(0))


def _run_together(fn, inputs: list[torch.Tensor]) -> tuple[Coalescer, list[object], list[int]]:
    """The first call holds the function until every other call waits behind it; then all go on."""
    sizes: list[int] = []
    release = threading.Event()

    def held(x: torch.Tensor) -> torch.Tensor:
        sizes.append(x.shape[0])
        if len(sizes) == 1:
            assert release.wait(30)
        return fn(x)

    c = Coalescer(held)
    results: list[object] = [None] * len(inputs)

    def call(i: int) -> None:
        with torch.inference_mode():
            try:
                results[i] = c(inputs[i])
            except Exception as e:
                results[i] = e

    threads = [threading.Thread(target=call, args=(0,))]
    threads[0].start()
    deadline = time.monotonic() + 30
    while not sizes and time.monotonic() < deadline:
        time.sleep(0.001)
    threads += [threading.Thread(target=call, args=(i,)) for i in range(1, len(inputs))]
    for t in threads[1:]:
        t.start()
    while len(c._pending) < len(inputs) - 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    release.set()
    for t in threads:
        t.join(30)
    return c, results, sizes


def test_concurrent_calls_share_one_call_and_get_their_own_rows():
    inputs = [torch.randn(1, 1, 8), torch.randn(2, 3, 8), torch.randn(1, 1, 8), torch.randn(3, 1, 8)]
    c, results, sizes = _run_together(lambda x: x @ W, inputs)
    assert sizes == [1, 6 + 1 + 3]  # the first alone (nobody waited), then the three waiting ones in one call
    assert c.joined == 3
    for x, got in zip(inputs, results, strict=True):
        assert isinstance(got, torch.Tensor) and got.shape == (*x.shape[:-1], 5)
        assert torch.allclose(got, x @ W, atol=1e-6)


def test_an_error_in_a_joined_call_reaches_only_its_caller():
    def fn(x: torch.Tensor) -> torch.Tensor:
        if torch.isnan(x).any():
            raise ValueError("nan")
        return x @ W

    bad = torch.full((1, 1, 8), float("nan"))
    inputs = [torch.randn(1, 1, 8), torch.randn(1, 1, 8), bad, torch.randn(1, 1, 8)]
    _, results, _ = _run_together(fn, inputs)
    assert isinstance(results[2], ValueError)
    for i in (0, 1, 3):
        assert isinstance(results[i], torch.Tensor)
        assert torch.allclose(results[i], inputs[i] @ W, atol=1e-6)


def test_calls_that_record_gradients_are_never_joined():
    x = torch.randn(1, 2, 8, requires_grad=True)
    c = Coalescer(lambda h: h @ W)
    out = c(x)
    out.sum().backward()
    assert x.grad is not None and c.joined == 0


def test_a_lone_call_goes_straight_through():
    c = Coalescer(lambda h: h @ W)
    with torch.inference_mode():
        x = torch.randn(1, 1, 8)
        assert torch.equal(c(x), x @ W)
    assert c.joined == 0


class _Stream(threading.Thread):
    """A decoding stream: a thread of its own that calls the coalescer when told to, one call at a time."""

    def __init__(self, c: Coalescer) -> None:
        super().__init__(daemon=True)
        self.c, self.todo, self.done = c, threading.Semaphore(0), threading.Semaphore(0)
        self.start()

    def run(self) -> None:
        while True:
            self.todo.acquire()
            with torch.inference_mode():
                self.c(torch.ones(1, 5))
            self.done.release()

    def call(self) -> None:
        self.todo.release()

    def finished(self, timeout: float) -> bool:
        return self.done.acquire(timeout=timeout)


def _paced(sizes: list[int], clock: list[float]) -> Coalescer:
    """A coalescer on a clock that moves only when the function runs (10 s a call: its price), with a long gap."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        sizes.append(x.shape[0])
        clock[0] += 10.0
        return x @ W.T

    return Coalescer(fn, clock=lambda: clock[0], gap=60.0, recent=1000.0)


def test_the_first_call_of_a_burst_waits_for_a_stream_still_to_come():
    """Two streams decode; the first to come back holds (at most a call's price) and the second joins it: one call
    for both. Without the hold, the first would run alone and the second after it."""
    sizes: list[int] = []
    clock = [0.0]
    c = _paced(sizes, clock)
    a, b = _Stream(c), _Stream(c)
    a.call()  # a lone stream so far: runs at once, and a call's price is known
    assert a.finished(30)
    b.call()  # a decodes too: b holds for it (the clock stands still: only a's call ends the hold)
    deadline = time.monotonic() + 30
    while not (c._leading and len(c._pending) == 1):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    a.call()
    assert a.finished(30) and b.finished(30)
    assert sizes == [1, 2] and c.calls == 2


def test_a_lone_stream_never_waits():
    """With no other stream calling, the call runs at once (a hold on this still clock would never end)."""
    sizes: list[int] = []
    clock = [0.0]
    c = _paced(sizes, clock)
    a = _Stream(c)
    for _ in range(3):
        a.call()
        assert a.finished(10), "a lone call waited for companions"
    assert sizes == [1, 1, 1]

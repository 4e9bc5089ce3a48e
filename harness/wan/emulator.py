"""``Wan``: the emulator's Python API. Each node is a network namespace with loopback and one TUN device; a router
process of its own joins the TUNs with the configured delays and bandwidths.

    with Wan(WanConfig(nodes=("server", "client"), delay_ms=20, mbit=50)) as wan:
        server = wan.popen("server", ["python", "-m", "http.server", "--bind", wan.address("server")])
        subprocess.run(wan.argv("client", ["curl", f"http://{wan.address('server')}:8000/"]))

Any TCP program works unchanged, since it runs in the namespace and sees an ordinary interface.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

from harness.env import child_env
from harness.wan import netns
from harness.wan.config import WanConfig
from harness.wan.netns import State, WanError
from harness.wan.router import RouterSpec
from harness.wan.tun import open_tun

READY_TIMEOUT_S = 15.0
MTU = 1500  # what a real path has; TSO lets the router still see ~64 KiB packets (see tun.py)
TXQUEUELEN = 4096  # the TUN's queue towards the router: it must never be the bottleneck


class Wan:
    """A running emulated WAN; ``close()`` (or leaving the ``with``) removes every namespace and device it made.

    ``state_file``, when given, records the names and the router's PID so ``python -m harness.wan down --state FILE``
    can clean up after a process that died without closing.
    """

    def __init__(self, config: WanConfig, state_file: str | Path | None = None, python: str = sys.executable):
        self.config = config
        self.python = python
        self.state_file = Path(state_file) if state_file is not None else None
        self.router: subprocess.Popen[str] | None = None
        self.counters: dict[str, Any] | None = None  # the router's per-node counters, once closed
        self._state = State(config.prefix, [config.namespace(n) for n in config.nodes], owner_pid=os.getpid())
        self._children: list[subprocess.Popen[Any]] = []
        self._started = False
        self._closed = False

    def __enter__(self) -> Wan:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- life cycle ------------------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._started or self._closed:
            raise WanError("this Wan was already started or closed; make a new one")
        reason = netns.unavailable_reason()
        if reason is not None:
            raise WanError(reason)
        cfg = self.config
        clash = netns.namespaces() & set(self._state.namespaces)
        if clash:  # someone else's: raised before this Wan owns anything, so close() will not touch them
            raise WanError(f"namespaces already exist: {sorted(clash)} (prefix {cfg.prefix!r} in use?)")
        self._started = True
        fds: list[int] = []
        try:
            self._save_state()  # before anything exists, so a crash at any point leaves a usable record
            netns.ip(batch=[f"netns add {ns}" for ns in self._state.namespaces])
            for node in cfg.nodes:
                fds.append(open_tun(cfg.device(node)))
            netns.ip(batch=[f"link set {cfg.device(n)} netns {cfg.namespace(n)}" for n in cfg.nodes])
            for node in cfg.nodes:
                dev = cfg.device(node)
                netns.ip(
                    "-n",
                    cfg.namespace(node),
                    batch=[
                        "link set lo up",  # p2pd and hivemind also bind 127.0.0.1 inside the node
                        f"addr add {cfg.address(node)}/{cfg.prefixlen()} dev {dev}",
                        f"link set {dev} addrgenmode none",  # no IPv6 link-local, so no IPv6 chatter
                        f"link set {dev} mtu {MTU} txqueuelen {TXQUEUELEN} up",
                    ],
                )
            self._start_router(fds)
            self._save_state()
        except BaseException:
            self.close()
            raise
        finally:
            for fd in fds:  # the router holds its own copies; when it exits the TUNs vanish with them
                os.close(fd)

    def _start_router(self, fds: list[int]) -> None:
        cfg = self.config
        spec = RouterSpec(
            fds=fds,
            addresses=[cfg.address(n) for n in cfg.nodes],
            delay_ms=[[cfg.delay_between(a, b) if a != b else 0.0 for b in cfg.nodes] for a in cfg.nodes],
            mbit=[cfg.mbit_of(n) for n in cfg.nodes],
            queue_ms=[cfg.queue_ms_of(n) for n in cfg.nodes],
            jitter_ms=cfg.jitter_ms,
            loss=cfg.loss,
            seed=cfg.seed,
            nat_boxes=cfg.nat_tables()[0],
            nat_behind=cfg.nat_tables()[1],
        )
        self.router = subprocess.Popen(
            [self.python, "-m", "harness.wan.router", spec.to_json()],
            pass_fds=fds,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        self._state.router_pid = self.router.pid
        self._state.router_start = netns.start_time(self.router.pid)
        assert self.router.stdout is not None
        ready, _, _ = select.select([self.router.stdout], [], [], READY_TIMEOUT_S)
        line = self.router.stdout.readline() if ready else ""
        if line.strip() != "ready":
            raise WanError(f"the WAN router did not start: {line!r}")

    def close(self) -> None:
        """Stop the router and every process started with ``popen``, delete every namespace. Idempotent."""
        if self._closed or not self._started:
            self._closed = True
            return
        self._closed = True
        errors: list[str] = []
        for child in self._children:
            if child.poll() is None:
                child.terminate()
        for child in self._children:
            try:
                child.wait(3)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if self.router is not None:
            self._stop_router(self.router)
        try:
            netns.tear_down(State(self._state.prefix, self._state.namespaces))
        except WanError as e:
            errors.append(str(e))
        if self.state_file is not None and not errors:
            self.state_file.unlink(missing_ok=True)
        if errors:
            raise WanError("; ".join(errors))

    def _stop_router(self, router: subprocess.Popen[str]) -> None:
        if router.poll() is None:
            router.send_signal(signal.SIGTERM)
        try:
            _, err = router.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            router.kill()
            _, err = router.communicate()
        lines = [line for line in (err or "").splitlines() if line.startswith("{")]
        if lines:
            import json

            self.counters = json.loads(lines[-1])

    def _save_state(self) -> None:
        if self.state_file is not None:
            self._state.save(self.state_file)

    # -- using the nodes -------------------------------------------------------------------------------------------

    def _check_running(self) -> None:
        if not self._started or self._closed:
            raise WanError("the WAN is not running")

    def address(self, node: str) -> str:
        """``node``'s IPv4 address: other nodes reach it there; listen on it (or 0.0.0.0) inside ``node``."""
        return self.config.address(node)

    def public_address(self, node: str) -> str:
        """Where other nodes see ``node``'s packets come from (its outermost NAT's address, if it is behind one).
        Nodes behind a NAT are reached only through the mappings their own traffic opened."""
        return self.config.public_address(node)

    def namespace(self, node: str) -> str:
        self.config.index(node)
        return self.config.namespace(node)

    def argv(self, node: str, argv: list[str]) -> list[str]:
        """``argv`` prefixed to run inside ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(node), *argv]

    def popen(self, node: str, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``node``; it is terminated on ``close()`` if still running. ``swarm`` is importable
        in it (from this checkout) unless ``env`` is given."""
        self._check_running()
        kwargs.setdefault("env", child_env())
        child = subprocess.Popen(self.argv(node, argv), **kwargs)
        self._children = [c for c in self._children if c.poll() is None]  # a long benchmark starts many
        self._children.append(child)
        return child

    def run(self, node: str, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """``subprocess.run`` inside ``node``."""
        self._check_running()
        kwargs.setdefault("env", child_env())
        return subprocess.run(self.argv(node, argv), **kwargs)

    @property
    def router_pid(self) -> int | None:
        return self.router.pid if self.router is not None else None

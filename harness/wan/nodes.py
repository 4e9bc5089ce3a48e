"""A real swarm behind emulated links: every server a ``python -m swarm.serve`` process in its own WAN node (or, given
a fork server, ``fork=``, forked from it into the node's namespace: the imports paid once), listening on that
node's address, and clients (``harness.wan.client_job``) in nodes of their own. Used by ``scripts/bench_wan.py``
and ``tests/integration/test_wan_swarm.py``. Every process is stopped by the PID this object started, never by name.

    with Wan(WanConfig(nodes=("c", "s1", "s2"), delay_ms=20, mbit=100)) as wan:
        with WanSwarm(wan, "tiny-llama", {"s1": "0:4", "s2": "4:8"}) as swarm:
            job = ClientJob(wan, "c", {"model": "tiny-llama", "initial_peers": swarm.initial_peers, ...})
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from harness.env import child_env
from harness.fork_server import ForkServer
from harness.wan.emulator import Wan
from swarm.launch import LocalSwarm, PeerHandle, PeerProcess


class WanSwarm(LocalSwarm):
    """``LocalSwarm`` whose peers each run in a WAN node: ``spans`` maps node name -> span (or None: broker's choice);
    the first one starts the swarm. ``extra_args`` go to every server (``--threads 1`` is always added), and
    ``node_args`` to the server of one node (``--relay`` for a public one, ``--reachability private`` behind a NAT)."""

    def __init__(
        self,
        wan: Wan,
        model: str,
        spans: dict[str, str | None],
        node_args: dict[str, tuple[str, ...]] | None = None,
        fork: ForkServer | None = None,
        **kwargs: Any,
    ) -> None:
        """``fork``: fork the servers from this fork server into their nodes (the tests') instead of ``ip netns
        exec``."""
        super().__init__(model, list(spans.values()), **kwargs)
        self.fork = fork
        self.node_args = dict(node_args or {})
        self.wan = wan
        self.nodes = list(spans)
        self.node_of: dict[int, str] = {}  # pid -> node

    def _spawn(self, span: str | None, args: tuple[str, ...], main: str = "swarm.serve") -> PeerProcess:
        if main != "swarm.serve":
            raise ValueError(f"a WAN node runs swarm.serve, not {main}")
        node = self.nodes[len(self.peers)] if len(self.peers) < len(self.nodes) else None
        if node is None:
            raise ValueError("every WAN node of this swarm already runs a peer; give add_peer a node")
        return self._spawn_in(node, span, args)

    def add_peer(
        self, span: str | None, *extra: str, wait: bool = True, main: str = "swarm.serve", node: str | None = None
    ) -> PeerProcess:
        if node is None:
            return super().add_peer(span, *extra, wait=wait, main=main)
        peer = self._spawn_in(node, span, ("--initial-peers", *self.initial_peers, *extra))
        if wait:
            peer.wait_ready(self.startup_timeout)
        return peer

    def _spawn_in(self, node: str, span: str | None, args: tuple[str, ...]) -> PeerProcess:
        import threading

        cmd = [
            sys.executable,
            "-m",
            "swarm.serve",
            "--model",
            self.model,
            "--threads",
            "1",
            "--host",
            self.wan.address(node),
            *self.extra_args,
            *self.node_args.get(node, ()),
            *args,
        ]
        if span:
            cmd += ["--blocks", span]
        if self.test_timings:
            cmd.append("--test-timings")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"peer-{len(self.peers)}-{node}-{(span or 'auto').replace(':', '_')}.log"
        proc: PeerHandle
        # forked into the node (``--threads 1`` keeps it to one thread as OMP_NUM_THREADS would: the fork server
        # read its environment at import)
        if self.fork is not None and not self.env_overrides:
            log_path.write_text("")
            argv = cmd[3:]  # what follows ``python -m swarm.serve``
            proc = self.fork.spawn(argv, log_path, netns=self.wan.namespace(node))
        else:
            env = child_env({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
            with open(log_path, "w") as stderr:
                # ``ip netns exec`` execs the command, so this PID is the server's own
                proc = self.wan.popen(node, cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        peer = PeerProcess(proc, span, tuple(args), log_path)
        threading.Thread(target=peer._watch_stdout, daemon=True).start()
        self.peers.append(peer)
        self.node_of[proc.pid] = node
        return peer


class ClientJob:
    """A client process (``python -m harness.wan.client_job SPEC``) in a WAN node. It prints one JSON object a line;
    ``lines()`` yields them. When the spec asks for a pause (a failover drill) it prints ``{"pause": ...}`` and waits
    for a line on its stdin: ``resume()`` sends it."""

    def __init__(
        self,
        wan: Wan | None,
        node: str | None,
        spec: dict[str, Any],
        log_path: Any = None,
        command: Sequence[str] = (sys.executable, "-m", "harness.wan.client_job"),
    ) -> None:
        """``wan`` None: a plain child process on this machine's own network (the loopback reference). ``command``:
        another program speaking the same protocol (SPEC as its last argument, JSON lines out, stdin for cues)."""
        env = child_env({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
        self._log = open(log_path, "w") if log_path is not None else None  # noqa: SIM115
        argv = [*command, json.dumps(spec)]
        stderr: Any = self._log if self._log is not None else subprocess.DEVNULL
        kwargs: dict[str, Any] = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        if wan is None:
            self.proc = subprocess.Popen(argv, **kwargs)
        else:
            assert node is not None
            self.proc = wan.popen(node, argv, **kwargs)
        self.log_path = log_path

    def next(self, timeout: float) -> dict[str, Any] | None:
        """The next JSON line, None at the end of output; raises TimeoutError after ``timeout`` seconds."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise TimeoutError(f"the client job printed nothing for {timeout:.0f} s{self._tail()}")
            line = self.proc.stdout.readline()
            if not line:
                return None
            if line.startswith("{"):
                item: dict[str, Any] = json.loads(line)
                return item

    def lines(self, timeout: float) -> list[dict[str, Any]]:
        out = []
        while (item := self.next(timeout)) is not None:
            out.append(item)
        return out

    def resume(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def _tail(self) -> str:
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path) as f:
                return "; its log ends:\n" + f.read()[-3000:]
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        if self._log is not None:
            self._log.close()

    def __enter__(self) -> ClientJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

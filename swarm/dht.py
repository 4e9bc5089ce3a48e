"""hivemind's DHT, made safe to kill, and the typed record operations over it.

hivemind runs the DHT in a forked child that starts its own ``p2pd``. If the parent is SIGKILLed both would live on
as a ghost peer, so the child asks the kernel for SIGTERM when its parent dies, and on SIGTERM it kills its own
children (the ``p2pd`` it started) by PID before exiting. The DHT must be created from a thread that lives as long
as the process (the main thread): the kernel's parent-death signal follows the creating thread.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from functools import partial
from pathlib import Path

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from swarm.ids import block_key
from swarm.records import ServerRecord, parse_record

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _own_children(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                children.append(int(entry))
    return children


def _terminate_children_and_exit(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    children = _own_children(os.getpid())
    for child in children:
        try:
            os.kill(child, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 2.0
    for child in children:  # reap them, or they linger as zombies where PID 1 does not reap
        while time.monotonic() < deadline:
            try:
                if os.waitpid(child, os.WNOHANG)[0]:
                    break
            except ChildProcessError:
                break
            time.sleep(0.02)
    os._exit(0)


def die_with_parent(parent_pid: int) -> None:
    """In a forked child: ask the kernel for SIGTERM when the parent dies, which then kills and reaps this child's
    own children (exit at once if the parent is already gone)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: fall back to hivemind's own behaviour
        log.warning("cannot ask for a parent-death signal; a killed parent may leave its children behind")
    signal.signal(signal.SIGTERM, _terminate_children_and_exit)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(0)


class OwnedDHT(hivemind.DHT):
    """A hivemind DHT whose child process (and its p2pd) never outlives the process that created it."""

    def run(self) -> None:
        die_with_parent(self._parent_pid)
        super().run()


def load_identity(path: Path | None) -> tuple[str | None, RSAPrivateKey]:
    """The libp2p identity file (created if missing) and the same RSA key, which also signs this peer's records,
    so a restarted peer keeps its peer id and can overwrite its own records."""
    if path is None:
        return None, RSAPrivateKey()
    path = Path(path).expanduser()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
    proto = crypto_pb2.PrivateKey.FromString(path.read_bytes())
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": proto.data})
    return str(path), key


def start_dht(
    *,
    initial_peers: tuple[str, ...] = (),
    host: str = "127.0.0.1",
    port: int = 0,
    announce_maddrs: tuple[str, ...] = (),
    identity: Path | None = None,
    client_mode: bool = False,
    timeout: float = 30.0,
) -> tuple[OwnedDHT, RSASignatureValidator]:
    identity_path, key = load_identity(identity)
    validator = RSASignatureValidator(key)
    proto = "ip6" if ":" in host else "ip4"
    kwargs = dict(
        initial_peers=list(initial_peers),
        start=True,
        client_mode=client_mode,
        record_validators=[validator],
        host_maddrs=[f"/{proto}/{host}/tcp/{port}"],
        await_ready=False,
    )
    if announce_maddrs:
        kwargs["announce_maddrs"] = list(announce_maddrs)
    if identity_path:
        kwargs["identity_path"] = identity_path
    dht = OwnedDHT(**kwargs)
    try:
        dht.wait_until_ready(timeout)
    except BaseException:
        dht.shutdown()
        raise
    return dht, validator


async def _store_records(_dht, node, keys, values, expiration, subkey) -> dict:
    return await node.store_many(keys, values, [expiration] * len(keys), subkeys=[subkey] * len(keys))


async def _get_many(_dht, node, keys) -> dict:
    found = await node.get_many(keys, sufficient_expiration_time=float("inf"))
    # unwrap to plain picklable data: {key: {subkey: value}}
    out = {}
    for key, item in found.items():
        if item is not None and isinstance(item.value, dict):
            out[key] = {sub: v.value for sub, v in item.value.items()}
    return out


DHT_CALL_TIMEOUT = 30.0  # a DHT child that died or hangs must not hang its caller (or its exit) forever


def _call(dht: hivemind.DHT, fn, timeout: float = DHT_CALL_TIMEOUT):
    if not dht.is_alive():
        raise RuntimeError("the DHT process is not running")
    return dht.run_coroutine(fn, return_future=True).result(timeout)


def announce(dht: hivemind.DHT, validator: RSASignatureValidator, record: ServerRecord, expiration: float) -> bool:
    """Store ``record`` under every block key of its span, signed, under this peer's own subkey."""
    keys = [block_key(record.model_id, b) for b in range(record.start, record.end)]
    values = [record.to_wire()] * len(keys)
    fn = partial(_store_records, keys=keys, values=values, expiration=expiration, subkey=validator.local_public_key)
    return all(_call(dht, fn).values())


def read_view(dht: hivemind.DHT, model_id: str, num_blocks: int) -> dict[int, list[ServerRecord]]:
    """Every valid record for each block; records of other schema versions or malformed ones are skipped."""
    keys = [block_key(model_id, b) for b in range(num_blocks)]
    found = _call(dht, partial(_get_many, keys=keys))
    view: dict[int, list[ServerRecord]] = {b: [] for b in range(num_blocks)}
    for b, key in enumerate(keys):
        for value in found.get(key, {}).values():
            record = parse_record(value)
            if record is not None and record.model_id == model_id and b in record.span:
                view[b].append(record)
    return view


async def _get_subkeys(_dht, node, key) -> dict:
    found = await node.get(key, latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    return {sub: v.value for sub, v in found.value.items()}


def store_own(dht: hivemind.DHT, validator: RSASignatureValidator, key: str, value: dict, expiration: float) -> bool:
    """Store ``value`` under ``key`` in this peer's own signed subkey."""
    fn = partial(_store_records, keys=[key], values=[value], expiration=expiration, subkey=validator.local_public_key)
    return all(_call(dht, fn).values())


def read_all(dht: hivemind.DHT, key: str) -> list:
    """Every subkey's value under ``key`` (each peer's own entry)."""
    return list(_call(dht, partial(_get_subkeys, key=key)).values())

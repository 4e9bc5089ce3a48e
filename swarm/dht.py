"""The typed, authenticated record operations over hivemind's DHT (``RecordStore``), and joining it (``start_dht``).
The DHT process itself, made safe to kill, is ``swarm.owned_dht``'s."""

from __future__ import annotations

import logging
import shutil
from collections import Counter
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Protocol, TypeVar

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P
from hivemind.proto import crypto_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarm.circuit import take_hop
from swarm.config import Timing
from swarm.errors import DhtLostError, NotMemberError, SwarmError
from swarm.identity import Credentials, Signed, new_identity_file, owner_of, sign_record
from swarm.ids import block_key, broker_key
from swarm.lease import LeaseRules, LeaseView
from swarm.membership import SwarmKey, SwarmKeyAuthorizer
from swarm.owned_dht import OwnedDHT
from swarm.records import Lease, Record, ServerRecord, View, parse_as
from swarm.relay import RelayPolicy

R = TypeVar("R", bound=Record)
T = TypeVar("T")

log = logging.getLogger(__name__)


class _Found(Protocol):
    value: object  # hivemind's ValueWithExpiration: the value (a dict of subkeys, for a record key)


class _DHTNode(Protocol):
    """What the coroutines below use of hivemind's DHTNode, which ships without types."""

    p2p: P2P

    async def store_many(
        self, keys: list[str], values: list[dict[str, object]], expiration_time: list[float], *, subkeys: list[bytes]
    ) -> dict[str, bool]: ...

    async def get_many(self, keys: list[str], *, sufficient_expiration_time: float) -> dict[str, _Found | None]: ...

    async def get(self, key: str, *, latest: bool) -> _Found | None: ...


async def _no_daemon_relay(_dht: object, node: _DHTNode) -> None:
    await take_hop(node.p2p)


def dht_time() -> float:
    """hivemind's DHT clock (wall time; records expire by it)."""
    return float(get_dht_time())


def load_identity(path: Path) -> RSAPrivateKey:
    """The libp2p identity file (created if missing) and the same RSA key, which also signs this peer's records:
    readers believe a record only when its key is the one its author's peer id comes from."""
    path = Path(path).expanduser()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
    proto = crypto_pb2.PrivateKey.FromString(path.read_bytes())
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": proto.data})
    return key


# The coroutines below run inside hivemind's DHT process: ``node`` is its DHTNode (``_DHTNode``).


async def _store_records(
    _dht: object, node: _DHTNode, keys: list[str], values: list[dict[str, object]], expiration: float, subkey: bytes
) -> dict[str, bool]:
    result = await node.store_many(keys, values, [expiration] * len(keys), subkeys=[subkey] * len(keys))
    return result


async def _get_many(_dht: object, node: _DHTNode, keys: list[str]) -> dict[str, dict[object, object]]:
    found = await node.get_many(keys, sufficient_expiration_time=float("inf"))
    # unwrap to plain picklable data: {key: {subkey: value}}
    out: dict[str, dict[object, object]] = {}
    for key, item in found.items():
        if item is not None and isinstance(item.value, dict):
            out[key] = {sub: v.value for sub, v in item.value.items()}
    return out


async def _get_subkeys(_dht: object, node: _DHTNode, key: str) -> dict[object, object]:
    found = await node.get(key, latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    return {sub: v.value for sub, v in found.value.items()}


class RecordStore:
    """Typed access to the DHT: every write goes to this peer's own signed subkey, every read is parsed into a
    record model (values of another schema version, malformed ones and the rest are skipped). Every call has a
    timeout, so a DHT process that died or hangs never hangs its caller."""

    def __init__(
        self,
        dht: OwnedDHT,
        key: RSAPrivateKey,
        validator: RSASignatureValidator,
        call_timeout: float,
        swarm_key: SwarmKey | None = None,
    ) -> None:
        self.dht = dht  # hivemind's, for what needs it directly (the averager, the P2P replica)
        self.key = key  # this peer's identity: signs its DHT values (through ``validator``) and its messages
        self.swarm_key = swarm_key  # a private swarm's key (its DHT already requires it; RPC tokens come from it)
        self.validator = validator
        self.call_timeout = call_timeout
        self.dropped: Counter[str] = Counter()  # values refused at read, by reason (unsigned, foreign, malformed)

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id.to_base58())

    def alive(self) -> bool:
        return bool(self.dht.is_alive())

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def credentials(self) -> Credentials:
        """Who this process is on RPC calls: its identity key (and, in a private swarm, its membership token)."""
        key = self.swarm_key
        return Credentials.of(self.key, key.token(self.peer_id) if key is not None else None)

    async def replicate_p2p(self) -> P2P:
        """A P2P instance in this process that shares the DHT child's p2pd (what RPC calls and handlers use)."""
        return await self.dht.replicate_p2p()

    def _call(self, fn: Callable[..., Awaitable[T]]) -> T:
        if not self.dht.is_alive():
            raise DhtLostError("the DHT process is not running")
        result: T = self.dht.run_coroutine(fn, return_future=True).result(self.call_timeout)
        return result

    def _store(self, keys: list[str], record: Record, expiration: float) -> bool:
        subkey = self.validator.local_public_key
        fn = partial(
            _store_records, keys=keys, values=[record.to_wire()] * len(keys), expiration=expiration, subkey=subkey
        )
        return all(self._call(fn).values())

    def sign(self, record: Record) -> Signed:
        """``record`` signed with this peer's identity key, to carry in a message."""
        return sign_record(self.key, record)

    def publish(self, key: str, record: Record, expiration: float) -> bool:
        """Store ``record`` under ``key`` in this peer's own signed subkey."""
        return self._store([key], record, expiration)

    def _authentic(self, subkey: object, value: object, cls: type[R]) -> R | None:
        """``value`` as ``cls`` if the key that signed it is its author's; else None, counted in ``dropped``."""
        author = owner_of(subkey)
        if author is None:
            self.dropped["unsigned"] += 1
            return None
        record = parse_as(cls, value)
        if record is None:
            self.dropped["malformed"] += 1
            return None
        if record.author != author:
            self.dropped["foreign"] += 1
            log.debug("dropping a %s that %s wrote as %s", cls.__name__, author, record.author)
            return None
        return record

    def read(self, key: str, cls: type[R]) -> list[R]:
        """Every authentic value under ``key`` (each author's own subkey) that parses as ``cls``."""
        found = self._call(partial(_get_subkeys, key=key))
        return [r for r in (self._authentic(s, v, cls) for s, v in found.items()) if r is not None]

    def announce(self, record: ServerRecord, expiration: float) -> bool:
        """Store ``record`` under every block key of its span, signed, under this peer's own subkey."""
        return self._store([block_key(record.model_id, b) for b in range(record.start, record.end)], record, expiration)

    def view(self, model_id: str, num_blocks: int) -> View:
        """Every valid record for each block of ``model_id``."""
        keys = [block_key(model_id, b) for b in range(num_blocks)]
        found = self._call(partial(_get_many, keys=keys))
        view: dict[int, list[ServerRecord]] = {b: [] for b in range(num_blocks)}
        for b, key in enumerate(keys):
            for subkey, value in found.get(key, {}).items():
                record = self._authentic(subkey, value, ServerRecord)
                if record is not None and record.model_id == model_id and b in record.span:
                    view[b].append(record)
        return view

    def shutdown(self) -> None:
        self.dht.shutdown()


def start_dht(
    *,
    initial_peers: tuple[str, ...] = (),
    host: str = "127.0.0.1",
    port: int = 0,
    announce_maddrs: tuple[str, ...] = (),
    identity: Path | None = None,
    client_mode: bool = False,
    timeout: float = 30.0,
    call_timeout: float = 30.0,
    swarm_key: SwarmKey | None = None,
    relay: RelayPolicy | None = None,
) -> RecordStore:
    """Start this process's DHT peer (a forked child with its own p2pd) and wait until it has joined. Without an
    ``identity`` file a fresh one is made (and removed once p2pd has read it): p2pd's peer id and the key that signs
    this peer's records are always the same key.

    With a ``swarm_key`` the DHT speaks only with holders of the same key (``swarm.membership``). Joining fails at
    once with a ``NotMemberError`` when the initial peers refuse this peer (wrong key, or none for a private swarm)
    or answer as an open swarm (a key given for a swarm that has none)."""
    path = identity if identity is not None else new_identity_file()
    key = load_identity(path)
    validator = RSASignatureValidator(key)
    proto = "ip6" if ":" in host else "ip4"
    kwargs: dict[str, object] = dict(
        initial_peers=list(initial_peers),
        start=True,
        client_mode=client_mode,
        record_validators=[validator],
        host_maddrs=[f"/{proto}/{host}/tcp/{port}"],
        await_ready=False,
    )
    if announce_maddrs:
        kwargs["announce_maddrs"] = list(announce_maddrs)
    relay = relay or RelayPolicy()
    kwargs.update(relay.hivemind_kwargs())
    kwargs["identity_path"] = str(Path(path).expanduser())
    if identity is None:  # a key made a moment ago is nobody else's: skip hivemind's check (a second p2pd start)
        kwargs["check_if_identity_free"] = False
    authorizer: SwarmKeyAuthorizer | None = None
    if swarm_key is not None:
        authorizer = kwargs["authorizer"] = SwarmKeyAuthorizer(swarm_key)
        log.info("private swarm: DHT requests are signed with swarm key %s", swarm_key.fingerprint)
    dht = OwnedDHT(p2pd_flags=relay.p2pd_flags(), **kwargs)
    try:
        dht.wait_until_ready(timeout)
        # the daemon's built-in relay would serve strangers with limits nobody chose: off (a --relay peer answers
        # the protocol itself, ``peers.relay_service``)
        dht.run_coroutine(_no_daemon_relay, return_future=True).result(timeout)
    except BaseException as e:
        dht.shutdown()
        if isinstance(e, Exception) and initial_peers:
            _explain_failed_join(e, initial_peers, swarm_key, authorizer)
        raise
    finally:
        if identity is None:
            shutil.rmtree(path.parent, ignore_errors=True)
    return RecordStore(dht, key, validator, call_timeout, swarm_key)


def _explain_failed_join(
    error: Exception, initial_peers: tuple[str, ...], swarm_key: SwarmKey | None, authorizer: SwarmKeyAuthorizer | None
) -> None:
    """Raise what a user can act on in place of hivemind's errors for a failed join (else return). p2pd fails to
    start when it reaches none of the initial peers; once it has, hivemind says only "DHTNode bootstrap failed: none
    of the initial_peers responded to a ping", also when they refused every request (a member refuses one without
    its key; a keyed peer counts an unsigned answer as none): the authorizer's counts tell an open swarm apart."""
    text = str(error)
    if "failed to connect to bootstrap peers" in text:
        raise SwarmError(
            f"none of the --initial-peers could be reached ({', '.join(initial_peers)}): are the "
            "addresses right and the peers running?"
        ) from None
    if "bootstrap failed" not in text:
        return
    if authorizer is not None and authorizer.unsigned_answers:
        raise NotMemberError(
            "the --initial-peers answered as an open swarm (no swarm key): start without "
            "--swarm-key to join it, or give the addresses of the private swarm's peers"
        ) from None
    if swarm_key is None:
        raise NotMemberError(
            "the --initial-peers refused this peer (a private swarm refuses peers without its key): "
            "give the swarm's key file with --swarm-key FILE"
        ) from None
    raise NotMemberError(
        f"the --initial-peers refused this peer's key: --swarm-key {swarm_key.path or ''} (key "
        f"{swarm_key.fingerprint}) is not this swarm's key"
    ) from None


def current_broker(store: RecordStore, model_id: str, timing: Timing) -> Lease | None:
    """The lease a newcomer would obey now (it has obeyed no term before)."""
    rules = LeaseRules(timing.lease_seconds, timing.max_tenure, skew=timing.clock_skew)
    return LeaseView(rules).resolve(store.read(broker_key(model_id), Lease), dht_time())

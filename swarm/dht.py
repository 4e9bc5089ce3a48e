"""The typed, authenticated record operations over hivemind's DHT (``RecordStore``), and joining it (``start_dht``).
The DHT process itself, made safe to kill, is ``swarm.owned_dht``'s."""

from __future__ import annotations

import logging
import random
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
from swarm.dht_io import Entries, read_copies, store_signed
from swarm.errors import DhtLostError, NotMemberError, SwarmError
from swarm.identity import Credentials, Signed, new_identity_file, owner_of, sign_record
from swarm.ids import SHARDS, broker_key, peers_key, servers_key, shard_of
from swarm.lease import LeaseRules, LeaseView
from swarm.membership import SwarmKey, SwarmKeyAuthorizer
from swarm.owned_dht import OwnedDHT
from swarm.records import Lease, PeerRecord, PeerState, Record, ServerRecord, View, parse_as
from swarm.relay import RelayPolicy

R = TypeVar("R", bound=Record)
T = TypeVar("T")

log = logging.getLogger(__name__)


class _DHTNode(Protocol):
    """What the coroutines below use of hivemind's DHTNode, which ships without types."""

    p2p: P2P

    async def get(self, key: str, *, latest: bool) -> _Found | None: ...


class _Found(Protocol):
    value: object  # hivemind's ValueWithExpiration: the value (a dict of subkeys, for a record key)


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


def announce_keys(record: ServerRecord) -> list[str]:
    """The DHT keys a server's record is stored under: one, its peer's shard's (readers rebuild the per-block view,
    ``RecordStore.view``)."""
    return [servers_key(record.model_id, shard_of(record.peer_id))]


# The coroutines below run inside hivemind's DHT process: ``node`` is its DHTNode (``_DHTNode``).


async def _store_records(
    _dht: object, node: _DHTNode, keys: list[str], values: list[object], expiration: float, subkey: bytes
) -> dict[str, bool]:
    return await store_signed(node, keys, values, expiration, subkey)


async def _get_many(_dht: object, node: _DHTNode, keys: list[str]) -> dict[str, Entries]:
    """{key: {subkey: (value, expiration)}}: plain picklable data, merged from two copies (``swarm.dht_io``)."""
    return await read_copies(node, keys)


async def _get_thorough(_dht: object, node: _DHTNode, key: str) -> Entries:
    """{subkey: (value, expiration)} of one key, every replica's copy merged (hivemind's own read: it costs the
    key's whole value from each node its search asks, so it is kept for the reads that must miss nothing)."""
    found = await node.get(key, latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    return {sub: (v.value, float(v.expiration_time)) for sub, v in found.value.items()}  # hivemind's, untyped


async def _get_subkeys(_dht: object, node: _DHTNode, key: str) -> dict[object, object]:
    """{subkey: value} of one key."""
    found = await read_copies(node, [key])
    return {sub: value for sub, (value, _) in found.get(key, {}).items()}


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
        self._announced: dict[str, ServerRecord] = {}  # model -> the last server record this peer announced

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
        found = self._call(partial(_get_many, keys=[key])).get(key, {})
        return [r for r in (self._authentic(s, v, cls) for s, (v, _) in found.items()) if r is not None]

    def announce(self, record: ServerRecord, expiration: float) -> bool:
        """Store ``record`` once (``announce_keys``), signed, in this peer's own subkey, where it replaces the peer's
        last record. A ``leaving`` record of blocks a peer no longer holds (another span than its last record's) is
        not stored: nothing of its old span lingers to be marked, and it would replace the record of what it holds."""
        last = self._announced.get(record.model_id)
        if record.state == PeerState.LEAVING and last is not None and last.state != PeerState.LEAVING:
            if last.span != record.span:
                return True
        self._announced[record.model_id] = record
        return self._store(announce_keys(record), record, expiration)

    def view(self, model_id: str, num_blocks: int, enough: int | None = None) -> View:
        """Every valid record for each block of ``model_id``. With ``enough``, shards are read (one, three more, then
        the rest, from a random one on) only until every block has that many online servers: a client routes over a
        sample of a large swarm, and reads all of a small one."""
        first = random.randrange(SHARDS)
        order = [(first + i) % SHARDS for i in range(SHARDS)]
        batches = [order] if enough is None else [order[:1], order[1:4], order[4:]]
        view: dict[int, list[ServerRecord]] = {b: [] for b in range(num_blocks)}
        for batch in batches:
            keys = {servers_key(model_id, shard): shard for shard in batch}
            found = {keys[k]: entries for k, entries in self._call(partial(_get_many, keys=list(keys))).items()}
            for record in self._servers(model_id, found):
                for b in range(record.start, min(record.end, num_blocks)):
                    view[b].append(record)  # the per-block view: each record under every block of its span
            if enough is not None and all(sum(r.state == PeerState.ONLINE for r in v) >= enough for v in view.values()):
                break
        return view

    def heartbeat(self, model_id: str, record: PeerRecord, expiration: float) -> bool:
        """Store this peer's heartbeat under its shard's peers key (``swarm.ids.peers_key``), in its own subkey."""
        return self._store([peers_key(model_id, shard_of(record.peer_id))], record, expiration)

    def heartbeats(self, model_id: str) -> list[PeerRecord]:
        """Every peer's authentic heartbeat (all shards); one under another shard's key than its author's was not
        stored by ``heartbeat`` and is dropped (``misplaced``)."""
        keys = {peers_key(model_id, shard): shard for shard in range(SHARDS)}
        found = self._call(partial(_get_many, keys=list(keys)))
        out = []
        for key, entries in sorted(found.items()):
            for subkey, (value, _expiration) in entries.items():
                record = self._authentic(subkey, value, PeerRecord)
                if record is None:
                    continue
                if shard_of(record.peer_id) != keys[key]:
                    self.dropped["misplaced"] += 1
                    continue
                out.append(record)
        return out

    def heartbeat_of(self, model_id: str, peer_id: str) -> PeerRecord | None:
        """``peer_id``'s own authentic heartbeat, read from its shard's key alone (one key, however big the swarm)."""
        found = self.read(peers_key(model_id, shard_of(peer_id)), PeerRecord)
        return next((r for r in found if r.peer_id == peer_id), None)

    def shard(self, model_id: str, shard: int) -> list[ServerRecord]:
        """The authentic server records of one shard, read thoroughly (``_get_thorough``): what a chained server
        checks its neighbours against, where a record stored on any replica must count."""
        return self._servers(model_id, {shard: self._call(partial(_get_thorough, key=servers_key(model_id, shard)))})

    def _servers(self, model_id: str, found: dict[int, Entries]) -> list[ServerRecord]:
        """The authentic server records of ``model_id`` in shards' values. A peer signs one subkey, so it has one
        record (its newest) in its shard's key; one found under another shard's key was not stored by ``announce``
        and is dropped."""
        out = []
        for shard, entries in sorted(found.items()):
            for subkey, (value, _expiration) in entries.items():
                record = self._authentic(subkey, value, ServerRecord)
                if record is None or record.model_id != model_id:
                    continue
                if shard_of(record.peer_id) != shard:
                    self.dropped["misplaced"] += 1
                    continue
                out.append(record)
        return out

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

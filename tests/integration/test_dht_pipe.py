"""Large records through the DHT process's request pipe (``swarm.dht._LockedPipe``, ``_WholeRecv``): an accusation
with its evidence is a message of tens to hundreds of KiB, which hivemind's pipe read in pieces (its DHT process
died of ``BlockingIOError`` then ``EOFError``). Four threads publish and read such records at once, many times: the
DHT process stays up and every record reads back whole."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from swarm.accusations import Accusation, Accusations, Commitment, Evidence, Piece, TensorBlob
from swarm.dht import dht_time, start_dht


def _record(accuser: str, seed: int) -> Accusations:
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randn(1, 300, 64, generator=g)  # 77 KiB of tensors: several times the pipe's 16 KiB message split
    evidence = Evidence(
        session_id="s" * 32,
        commit_key="k",
        public_key="p",
        commit_cert="c",
        commitments=(Commitment(position=0, tag=0, input_digest="0" * 64, digest="1" * 64),),
        signature="x",
        pieces=(Piece(index=0, start=0, length=300),),
        inputs=TensorBlob.of(inputs),
        output=TensorBlob.of(inputs[:, -1:]),
    )
    item = Accusation(
        accused="someone", model_id="m", fingerprint="f", start=0, end=4, reason="r", made=dht_time(), evidence=evidence
    )
    return Accusations(accuser=accuser, items=(item,))


def test_large_records_from_many_threads_keep_the_dht_process_alive():
    store = start_dht()
    try:
        key = "pipe-test.accusations"

        def one(i: int) -> int:
            # (whether a store wins is the DHT's business: of two at once, the one of an older expiration loses)
            store.publish(key, _record(store.peer_id, i), dht_time() + 60)
            return len(store.read(key, Accusations))

        with ThreadPoolExecutor(4) as pool:
            seen = list(pool.map(one, range(40)))
        assert store.alive() and all(n == 1 for n in seen)
        got = store.read(key, Accusations)[0].items[0].evidence.inputs.tensor()
        assert got.shape == (1, 300, 64)
    finally:
        store.shutdown()

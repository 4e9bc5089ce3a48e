"""The client model's parts that need no swarm: ``from_pretrained``'s keywords grouped into their config objects
(``swarm.client.load_options``), the tuning asked for resolved against a family, and the open inference sessions, one
a thread (``swarm.client.generation.OpenSessions``)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from swarm.client.generation import OpenSessions
from swarm.client.load_options import Loading, LoadOptions, Weights
from swarm.client.tuning.setup import TuningRequest
from swarm.config import ClientConfig, Timing
from swarm.errors import BadInputError
from swarm.families.spec import family_of
from swarm.tuning import TuningSpec

PEERS = ["/ip4/127.0.0.1/tcp/1/p2p/QmPeer"]


def test_defaults_are_the_config_objects_own():
    load = Loading.of({"initial_peers": PEERS})
    defaults = ClientConfig()
    for name in ("direct", "chain", "prefill_chunk", "codec", "local_blocks", "verify_every", "accuse", "swarm_key"):
        assert getattr(load.client, name) == getattr(defaults, name), name
    assert load.client.initial_peers == tuple(PEERS)
    assert load.weights == Weights()
    assert load.tuning == TuningRequest() and not load.tuning.asked


def test_every_keyword_lands_in_its_config_object(tmp_path):
    """Each keyword, given a value other than its default, is found where ``Loading`` groups it: none is dropped."""
    timing = Timing(dht_timeout=1.5)
    given: LoadOptions = {
        "initial_peers": PEERS,
        "timing": timing,
        "cache_dir": tmp_path,
        "direct": "never",
        "swarm_key": tmp_path / "key",
        "chain": False,
        "prefill_chunk": 7,
        "codec": "float16",
        "local_blocks": 0,  # with tuning it is refused (below); its own value is checked apart
        "trusted_peers": ["QmA"],
        "verify_every": 0,
        "verify_seed": 3,
        "accuse": False,
        "prefix_cache": True,
        "share_prefixes": True,
        "dtype": torch.bfloat16,
        "fingerprint": "f" * 8,
        "allow_quantized": ["int8"],
        "tuning": "prompt",
        "adapter": str(tmp_path),
        "lora_rank": 4,
        "lora_alpha": 2.0,
        "lora_targets": ["c_attn"],
        "num_prompt_tokens": 3,
    }
    assert set(given) == LoadOptions.__optional_keys__  # the table above lists every keyword
    load = Loading.of(given)
    c = load.client
    assert (c.timing, c.cache_dir, c.direct, c.swarm_key) == (timing, tmp_path, "never", tmp_path / "key")
    assert (c.chain, c.prefill_chunk, c.codec, c.trusted_peers) == (False, 7, "float16", ("QmA",))
    assert (c.verify_every, c.verify_seed, c.accuse) == (0, 3, False)
    assert (c.prefix_cache, c.share_prefixes) == (True, True)
    assert load.weights == Weights(torch.bfloat16, "f" * 8, ("int8",))
    assert load.tuning == TuningRequest("prompt", Path(tmp_path), 4, 2.0, ("c_attn",), 3)
    assert Loading.of({"initial_peers": PEERS, "local_blocks": 2}).client.local_blocks == 2


@pytest.mark.parametrize(
    "options, message",
    [
        ({"initial_peers": PEERS, "bogus": 1, "other": 2}, "unsupported arguments: bogus, other"),
        ({}, "give initial_peers"),
        ({"initial_peers": PEERS, "direct": "sometimes"}, "direct must be"),
        ({"initial_peers": PEERS, "local_blocks": 2, "tuning": "lora"}, "local_blocks cannot be combined"),
        ({"initial_peers": PEERS, "local_blocks": 2, "adapter": "folder"}, "local_blocks cannot be combined"),
    ],
)
def test_bad_keywords_are_refused(options, message):
    with pytest.raises(BadInputError, match=message):
        Loading.of(options)


def test_tuning_request_resolves_against_the_family():
    family = family_of(LlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, vocab_size=32))
    assert TuningRequest().spec(family) is None
    lora = TuningRequest("lora").spec(family)
    assert lora == TuningSpec("lora", lora_targets=family.spec.lora_defaults)
    assert TuningRequest("lora", lora_targets=("k_proj",)).spec(family).lora_targets == ("k_proj",)
    assert TuningRequest("deep_prompt", num_prompt_tokens=5).spec(family).prompt_tokens == 5
    with pytest.raises(BadInputError):
        TuningRequest("lora", lora_rank=0).spec(family)


class _Session:
    def __init__(self, max_length: int, batch_size: int) -> None:
        self.shape, self.closed = (max_length, batch_size), 0

    def close(self) -> None:
        self.closed += 1


def test_open_sessions_one_a_thread_and_all_ended_by_close():
    made: list[_Session] = []
    sessions = OpenSessions(lambda n, b: made.append(_Session(n, b)) or made[-1])
    assert sessions.current is None
    with sessions.open(10, 2) as mine:
        assert sessions.current is mine and mine.shape == (10, 2)
        with pytest.raises(BadInputError, match="already open"), sessions.open(5):
            pass
        inside, opened, release = [], threading.Event(), threading.Event()

        def other() -> None:
            inside.append(sessions.current)  # another thread sees none of this thread's
            with sessions.open(3):
                opened.set()
                release.wait(5)

        thread = threading.Thread(target=other)
        thread.start()
        assert opened.wait(5) and inside == [None]
        sessions.close()  # the model closes: every thread's open session ends
        assert [s.closed for s in made] == [1, 1]
        release.set()
        thread.join(5)
    assert sessions.current is None and made[0].closed == 2  # and its own ``with`` closes it once more (idempotent)

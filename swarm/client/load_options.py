"""``DistributedModelForCausalLM.from_pretrained``'s keywords (``LoadOptions``, each explained here) and the config
objects they group into (``Loading``): the swarm's ``ClientConfig`` (``swarm.config``), the weights' ``Weights``, and
the tuning asked for (``TuningRequest``, resolved against the family into a ``TuningSpec``). Pure: nothing connects."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import torch

from swarm.client.tuning.setup import TuningRequest
from swarm.config import ClientConfig, DirectPolicy, Timing, client_config
from swarm.errors import BadInputError
from swarm.tuning import TuningSpec


class LoadOptions(TypedDict, total=False):
    """``from_pretrained``'s keywords, all optional but ``initial_peers``."""

    # ---- the swarm (``ClientConfig``) ----
    initial_peers: Sequence[str]  # multiaddrs of running swarm peers
    timing: Timing | None  # every timeout and period (None: the defaults)
    cache_dir: Path | None  # model folders and fingerprints (None: ``swarm.config.default_cache_dir``)
    # servers' plain-TCP data plane: "auto" (only on loopback/private networks), "always" or "never" (libp2p only)
    direct: DirectPolicy
    swarm_key: Path | None  # a private swarm's key file (``--swarm-key`` of its peers)
    chain: bool  # inference steps pass from server to server (False: through this client at every hop)
    prefill_chunk: int  # tokens per pipelined piece of a long chained step
    codec: str  # activations' codec: "auto" (per link) or one to force
    # privacy (docs/serving.md): run the first N blocks on this client (their weights read from the model folder) and
    # route only the rest, so no server sees the embeddings of the tokens (not with ``tuning`` or ``adapter``: the
    # adapter would have to run here too)
    local_blocks: int
    # route only through these peer ids (your own servers): blocks none of them serves are missing, never routed
    # elsewhere
    trusted_peers: Sequence[str]
    # verification (docs/trust.md): each hop's work is run again on another server, in windows of about this many
    # steps (0: off), and forwards and backwards with probability 1 / ``verify_every``
    verify_every: int
    verify_seed: int | None  # which steps and verifiers, reproducibly (tests only: servers must not predict it)
    accuse: bool  # publish accusations of cheaters caught, and act on others' once their evidence re-runs wrong
    # prefix caching (docs/serving.md): servers keep this client's finished sessions' KV for its later sessions that
    # start alike (False, the default: not asked); ``share_prefixes``: also with every caller that shares, if allowed
    prefix_cache: bool
    share_prefixes: bool
    # ---- the weights (``Weights``) ----
    dtype: torch.dtype  # of the client's own tensors (embeddings, final norm, head) and its local blocks
    fingerprint: str | None  # pins the exact weights (None: the best-covered ones); overrides ``allow_quantized``
    # route through servers holding quantized blocks too (``swarm.quantization``): True for every format, or the
    # formats to take ("int8", "nf4"); by default only servers of the exact weights, so results are those of the
    # dtype they are served in
    allow_quantized: bool | str | Sequence[str]
    # ---- the tuning (``TuningRequest``): the model's own weights are then frozen; only the adapter trains ----
    tuning: str | None  # "lora", "prompt" or "deep_prompt"
    adapter: str | Path | None  # a PEFT adapter folder to start from (its config sets the tuning)
    # LoRA's, as in PEFT, whose defaults these are; targets by default the family's (e.g. ``q_proj, v_proj``; GPT-2
    # ``c_attn``; NeoX, Falcon, BLOOM ``query_key_value``)
    lora_rank: int
    lora_alpha: float
    lora_targets: Sequence[str] | None
    num_prompt_tokens: int  # the prompts' length, for "prompt" and "deep_prompt"


@dataclass(frozen=True)
class Weights:
    """Which weights a client loads and which servers' weights it routes through."""

    dtype: torch.dtype = torch.float32
    fingerprint: str | None = None
    allow_quantized: bool | str | tuple[str, ...] = False


@dataclass(frozen=True)
class Loading:
    """``from_pretrained``'s keywords, grouped and checked."""

    client: ClientConfig
    weights: Weights
    tuning: TuningRequest

    @classmethod
    def of(cls, options: LoadOptions) -> Loading:
        unknown = sorted(set(options) - LoadOptions.__optional_keys__)
        if unknown:
            raise BadInputError(f"unsupported arguments: {', '.join(unknown)}")
        o, c = options, ClientConfig  # ``ClientConfig``'s class attributes are its fields' defaults
        client = client_config(
            o.get("initial_peers", ()),
            o.get("timing"),
            o.get("cache_dir"),
            o.get("direct", c.direct),
            swarm_key=o.get("swarm_key"),
            chain=o.get("chain", c.chain),
            prefill_chunk=o.get("prefill_chunk", c.prefill_chunk),
            codec=o.get("codec", c.codec),
            local_blocks=o.get("local_blocks", c.local_blocks),
            trusted_peers=tuple(o.get("trusted_peers", ())),
            verify_every=o.get("verify_every", c.verify_every),
            verify_seed=o.get("verify_seed"),
            accuse=o.get("accuse", c.accuse),
            prefix_cache=o.get("prefix_cache", c.prefix_cache),
            share_prefixes=o.get("share_prefixes", c.share_prefixes),
        )
        quantized = o.get("allow_quantized", False)
        weights = Weights(
            o.get("dtype", Weights.dtype),
            o.get("fingerprint"),
            quantized if isinstance(quantized, bool | str) else tuple(quantized),
        )
        adapter, targets = o.get("adapter"), o.get("lora_targets")
        tuning = TuningRequest(
            o.get("tuning"),
            Path(adapter) if adapter is not None else None,
            o.get("lora_rank", TuningSpec.lora_rank),
            o.get("lora_alpha", TuningSpec.lora_alpha),
            tuple(targets) if targets is not None else None,
            o.get("num_prompt_tokens", TuningSpec.num_prompt_tokens),
        )
        if client.local_blocks and tuning.asked:
            raise BadInputError(
                "local_blocks cannot be combined with tuning or an adapter yet: the adapter's parts for the local "
                "blocks would have to run on this client"
            )
        return cls(client, weights, tuning)

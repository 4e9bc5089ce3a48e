"""What the performance model needs of a decoder-only transformer: parameter counts, FLOPs and bytes per block and
per token, from the model's Hugging Face config (a mapping, so that no config class or torch is needed)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "int4": 0.5}


@dataclass(frozen=True)
class Arch:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int
    tied: bool = False

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any) -> Arch:  # Any: JSON values, or a PretrainedConfig
        """From a config dict (``config.json``, a card's ``[source.config]``) or a ``PretrainedConfig``."""

        def get(key: str, default: Any = None) -> Any:  # Any: a config value, whatever its key holds
            return config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)

        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        return cls(
            hidden=hidden,
            # GPT-2's n_inner, Falcon's ffn_hidden_size; BLOOM's MLP is 4 x hidden
            intermediate=int(get("intermediate_size") or get("n_inner") or get("ffn_hidden_size") or 4 * hidden),
            layers=int(get("num_hidden_layers")),
            heads=heads,
            kv_heads=int(get("num_key_value_heads") or heads),
            vocab=int(get("vocab_size")),
            head_dim=int(get("head_dim") or hidden // heads),
            tied=bool(get("tie_word_embeddings", False)),
        )

    # ---- parameters ------------------------------------------------------------------------------------------------
    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def block_matrices(self) -> tuple[int, ...]:
        """Weights of each matrix multiplication of a block: q, k, v, o and the gated MLP's gate, up and down."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_dim, self.intermediate
        return (h * q, h * kv, h * kv, q * h, h * i, h * i, i * h)

    @property
    def block_linear_params(self) -> int:
        """Weights of a block's matrix multiplications: q, k, v, o and the gated MLP's three."""
        h, q = self.hidden, self.heads * self.head_dim
        return h * q + 2 * h * self.kv_dim + q * h + 3 * h * self.intermediate

    @property
    def block_params(self) -> int:
        return self.block_linear_params + 2 * self.hidden  # the two RMS norms

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden
        return self.layers * self.block_params + embed * (1 if self.tied else 2) + self.hidden

    def block_bytes(self, dtype_bytes: float) -> float:
        return self.block_params * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        """One block's keys and values for one position."""
        return 2 * self.kv_dim * dtype_bytes

    # ---- work ------------------------------------------------------------------------------------------------------
    def attention_flops(self, tokens: int, context: float) -> float:
        """Scores and the weighted sum of values: 2 x 2 FLOPs per attended position per query dimension, for
        ``tokens`` new positions attending to ``context`` positions each on average."""
        return 4.0 * tokens * context * self.heads * self.head_dim

    def block_flops(self, tokens: int, context: float) -> float:
        """Forward FLOPs of one block: 2 per weight per token, and attention's."""
        return 2.0 * tokens * self.block_linear_params + self.attention_flops(tokens, context)

    def activation_traffic(self, tokens: int, dtype_bytes: float) -> float:
        """Bytes of a block's element-wise work, counted as tensor passes (each read or write of a whole tensor) per
        token: two RMS norms (7 hidden-sized passes each), rotary embeddings on queries and keys (11 each: two
        products, the half rotation's negation and concatenation, the sum), two residual sums (3 each), heads
        transposed back (2); the MLP's activation (2 intermediate-sized) and gate product (3)."""
        return (
            tokens * (2 * 7 + 2 * 11 + 2 * 3 + 2) * self.hidden * dtype_bytes
            + tokens * 5 * self.intermediate * dtype_bytes
        )

    def head_flops(self, tokens: int) -> float:
        return 2.0 * tokens * self.hidden * self.vocab

    def head_traffic(self, tokens: int, dtype_bytes: float) -> float:
        return (self.hidden * self.vocab + tokens * (self.vocab + self.hidden)) * dtype_bytes


def context_of(past: int, tokens: int) -> float:
    """Average positions attended by ``tokens`` new positions after ``past`` cached ones (causal)."""
    return past + (tokens + 1) / 2

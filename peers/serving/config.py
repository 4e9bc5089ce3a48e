"""What runs a peer's blocks and what one request or session may take of it: the serving domain's part of the
peer's configuration (``peers.config.PeerConfig.compute``); every field is a flag of ``python -m swarm.serve``."""

from __future__ import annotations

from dataclasses import dataclass, replace

from swarm.cli import option
from swarm.errors import BadInputError
from swarm.quantization import parse_quantization

MIB = 1024 * 1024


def _auto_or_float(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise BadInputError(f"--throughput takes 'auto' or a number, got {text!r}") from None


def _runtime(text: str) -> str:
    if text not in ("torch", "onnx"):  # peers.serving.runtime.RUNTIMES (not imported here: that pulls in torch)
        raise BadInputError(f"--runtime takes 'torch' or 'onnx', got {text!r}")
    return text


def mib(text: str) -> int:
    """A flag's value in MiB, as bytes."""
    return int(float(text) * MIB)


@dataclass(frozen=True)
class ComputeConfig:
    """What runs the blocks and what one request or session may take of it."""

    device: str = option("cpu", help="where to serve: cpu, cuda, cuda:1, ...")
    runtime: str = option(
        "torch",
        parse=_runtime,
        metavar="torch|onnx",
        help="what runs the blocks: torch (inference, forward, backward, adapters) or onnx (ONNX Runtime on the "
        "CPU, Llama-family models in float32: inference and forward only; routes that train or carry adapters skip it)",
    )
    dtype: str | None = option(None, help="serving dtype (default: the model card's)")
    quantize: str = option(
        "none",
        parse=parse_quantization,
        metavar="none|int8|nf4",
        help="hold the blocks' linear weights quantized: int8 (torchao, weight-only) or nf4 (bitsandbytes, QLoRA's "
        "4-bit); announced, and only clients that allow quantized blocks route here",
    )
    threads: int = option(1, help="compute threads, torch's or ONNX Runtime's (peers often share a machine's cores)")
    throughput: float | None = option(
        None,
        parse=_auto_or_float,
        show="auto",
        help="'auto' measures the span once and caches it; a number (forward tokens/s of ONE block) skips the probe",
    )
    cache_tokens: int = option(
        8192,
        help="KV-cache budget as tokens of context through this peer's largest span (batch x max_length, all "
        "sessions together), turned into bytes by the model family's cache layout",
    )
    cache_bytes: int | None = option(
        None,
        name="--cache-mb",
        parse=mib,
        show="from --cache-tokens",
        metavar="MB",
        help="KV-cache budget in MiB instead (a session reserves what its family's caches take for its span)",
    )
    max_batch_tokens: int = option(8192, help="largest batch x sequence one request may carry")
    max_adapter_bytes: int = option(
        512 * MIB,
        name="--max-adapter-mb",
        parse=mib,
        show="512",
        metavar="MB",
        help="room for clients' adapters and deep prompts, all clients together",
    )
    max_message_bytes: int = option(
        256 * MIB, name="--max-message-mb", parse=mib, show="256", metavar="MB", help="a larger request is refused"
    )
    max_held_bytes: int = option(
        1024 * MIB,
        name="--max-held-mb",
        parse=mib,
        show="1024",
        metavar="MB",
        help="bytes held for callers at once (requests arriving, queued or computing, replies being written, "
        "pushes waiting), all callers together; more is 'busy'",
    )
    max_caller_held_bytes: int = option(
        384 * MIB,
        name="--max-caller-held-mb",
        parse=mib,
        show="384",
        metavar="MB",
        help="...and of one caller (at least --max-message-mb: one largest request must fit)",
    )
    max_memory_bytes: int | None = option(
        None,
        name="--max-memory-mb",
        parse=mib,
        show="off",
        metavar="MB",
        help="one ceiling for everything held for others (requests, replies, pushes, kept graphs, adapters, KV "
        "cache): sets those budgets to shares of it (docs/trust.md#the-memory-ceiling)",
    )
    max_kept_bytes: int = option(
        2048 * MIB,
        name="--max-kept-mb",
        parse=mib,
        show="2048",
        metavar="MB",
        help="forward passes kept for a pending backward (what autograd saved), all callers together",
    )
    max_caller_kept_bytes: int = option(
        512 * MIB,
        name="--max-caller-kept-mb",
        parse=mib,
        show="512",
        metavar="MB",
        help="...and for one caller (its oldest go first; beyond either, the client recomputes)",
    )
    max_caller_adapter_bytes: int = option(
        128 * MIB,
        name="--max-caller-adapter-mb",
        parse=mib,
        show="128",
        metavar="MB",
        help="room for one caller's adapters (a larger upload is refused)",
    )
    max_sessions: int = option(128, help="open inference sessions, all callers together")
    max_caller_sessions: int = option(16, help="open inference sessions of one caller")
    caller_cache_share: float = option(0.5, help="share of the KV-cache budget one caller's sessions may reserve")
    prefix_cache: bool = option(
        True, help="keep no finished session's KV for the same caller's next session that starts alike (prefix caching)"
    )
    share_prefixes: bool = option(
        False, help="let sessions that ask share kept prefixes with every other caller that asks (public prompts)"
    )
    max_queued: int = option(256, help="compute requests waiting for or running on the compute thread, all callers")
    max_caller_queued: int = option(32, help="...and of one caller (beyond either, a request is refused at once)")
    inline_tokens: int = option(8, help="inference steps of at most this many tokens run on the RPC loop")
    max_batch: int = option(
        32, help="rows of one batched forward: steps of different sessions that wait together run as one (1: alone)"
    )
    batch_window_ms: float = option(
        2.0, help="with several sessions open, a step that finds the compute thread idle waits this long for others"
    )
    prefill_chunk: int = option(
        256, help="a longer prompt step runs in chunks of this many tokens, other sessions' steps in between"
    )
    perturb_weights: float = option(0.0, hidden=True, help="tests: noise added to the weights after fingerprinting")


def within_memory(c: ComputeConfig) -> ComputeConfig:
    """``c`` with every budget of what the server holds for others set to a share of ``--max-memory-mb`` (itself
    when that is not set): a quarter each for bytes in flight and kept graphs, an eighth for adapters, the rest for
    the KV cache. Per-caller shares keep their proportion to the totals they had."""
    total = c.max_memory_bytes
    if total is None:
        return c
    held, kept, adapters = total // 4, total // 4, total // 8

    def share(per_caller: int, old_total: int, new_total: int) -> int:
        return max(1, min(new_total, per_caller * new_total // max(old_total, 1)))

    return replace(
        c,
        max_held_bytes=held,
        max_caller_held_bytes=share(c.max_caller_held_bytes, c.max_held_bytes, held),
        max_message_bytes=min(c.max_message_bytes, share(c.max_caller_held_bytes, c.max_held_bytes, held)),
        max_kept_bytes=kept,
        max_caller_kept_bytes=share(c.max_caller_kept_bytes, c.max_kept_bytes, kept),
        max_adapter_bytes=adapters,
        max_caller_adapter_bytes=share(c.max_caller_adapter_bytes, c.max_adapter_bytes, adapters),
        cache_bytes=total - held - kept - adapters,
    )

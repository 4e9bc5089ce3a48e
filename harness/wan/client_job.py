"""``python -m harness.wan.client_job SPEC_JSON``: a swarm client that measures, run inside a WAN node so the client
itself sits behind an emulated link (``harness.wan.nodes.ClientJob`` starts it). One torch thread. It prints one JSON
object a line, then ``{"done": true}``.

SPEC: ``model`` (card name or folder), ``initial_peers``, ``test_timings`` (bool), ``timing`` (a dict of ``Timing``
fields to override, e.g. a test's patient step timeout), ``tasks`` (any of "local", "decode", "ttft", "finetune",
"pretrain", "forward", "generate"), ``modes`` (a list of {"name", "chain", "direct", "codec"}: ClientConfig fields
each client of a task is built with; ``codec`` is passed only where ClientConfig has that field), and the tasks'
sizes: ``new_tokens``, ``prompt_len``, ``repeats``, ``ft_batch``, ``ft_seq``, ``ft_steps``, ``pretrain_run``,
``pretrain_steps``; for "forward": ``ids`` (a batch of token ids: its logits come back); for "generate": ``prompt``
(token ids), ``max_new_tokens``, ``pause_after`` (print ``{"pause": token, "route": [peer ids]}`` after that many new
tokens and wait for a line on stdin). "forward" and "generate" report ``codecs``: how many of their calls'
activations went in each codec (the client's own counts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch


def emit(**record: Any) -> None:
    print(json.dumps(record), flush=True)


def client_fields() -> set[str]:
    from swarm.config import ClientConfig

    return {f.name for f in dataclasses.fields(ClientConfig)}


@contextlib.contextmanager
def overrides(mode: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """ClientConfig fields (``chain``, ``codec``, ``prefill_chunk``) applied to every client built inside, the
    pre-training ``Trainer``'s too (it takes none of them as arguments): the config factory is wrapped, for the
    duration, in each module that builds a client's config (``from_pretrained``'s options, and the trainer)."""
    import swarm.client.load_options as load_options
    import swarm.client.training.trainer as trainer

    known = client_fields()
    applied: dict[str, Any] = {
        k: mode[k] for k in ("chain", "codec", "prefill_chunk") if mode.get(k) is not None and k in known
    }
    modules = (load_options, trainer)
    originals = [vars(m)["client_config"] for m in modules]

    def wrapped(original: Any) -> Any:
        def patched(*args: Any, **kwargs: Any) -> Any:
            return dataclasses.replace(original(*args, **kwargs), **applied)

        return patched

    for module, original in zip(modules, originals, strict=True):
        vars(module)["client_config"] = wrapped(original)
    try:
        yield applied
    finally:
        for module, original in zip(modules, originals, strict=True):
            vars(module)["client_config"] = original


class Stamps:
    """A Hugging Face streamer that timestamps every token (the first ``put`` is the prompt); optionally pauses."""

    def __init__(self, pause_after: int | None = None, on_pause: Any = None) -> None:
        self.times: list[float] = []
        self.count = -1
        self.pause_after, self.on_pause = pause_after, on_pause

    def put(self, value: object) -> None:
        self.count += 1
        self.times.append(time.perf_counter())
        if self.pause_after is not None and self.count == self.pause_after and self.on_pause is not None:
            self.on_pause()

    def end(self) -> None:
        pass

    def first_token(self) -> float | None:
        """Seconds from the prompt to the first new token: the sessions' opening (every hop's) and the prefill."""
        return self.times[1] - self.times[0] if len(self.times) > 1 else None

    def steps(self) -> list[float]:
        """Seconds between consecutive new tokens (the first new token is the prefill's, excluded)."""
        return [b - a for a, b in zip(self.times[1:], self.times[2:], strict=False)]


def timing(spec: dict[str, Any]) -> Any:
    from swarm.config import Timing

    base = Timing.for_tests() if spec.get("test_timings") else Timing()
    return dataclasses.replace(base, **spec.get("timing", {}))


def folder_of(model: str) -> Any:
    from swarm.config import default_cache_dir, load_model_card
    from swarm.model_files import model_folder

    return model_folder(load_model_card(model), default_cache_dir())


def connect(spec: dict[str, Any], mode: dict[str, Any], **kwargs: Any) -> Any:
    from swarm import DistributedModelForCausalLM

    return DistributedModelForCausalLM.from_pretrained(
        spec["model"],
        initial_peers=spec["initial_peers"],
        timing=timing(spec),
        direct=mode.get("direct", "auto"),
        **kwargs,
    )


def decode_run(model: Any, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, Stamps, float]:
    stamps = Stamps()
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    t0 = time.perf_counter()
    out = model.generate(prompt, streamer=stamps, **gen)
    return out, stamps, t0


def measure_decode(model: Any, prompt: torch.Tensor, new_tokens: int, repeats: int) -> dict[str, Any]:
    """Median step time over ``repeats`` generations (after one warm-up), tokens/s from it, and the tokens."""
    decode_run(model, prompt, min(new_tokens, 4))  # warm-up: connections, sessions, allocator
    steps: list[float] = []
    out = None
    for _ in range(repeats):
        out, stamps, _ = decode_run(model, prompt, new_tokens)
        steps += stamps.steps()
    step, ordered = statistics.median(steps), sorted(steps)
    tokens = out[0].tolist() if out is not None else []
    return {
        "step_s": step,
        "tokens_per_s": 1.0 / step,
        "steps_p10": ordered[len(steps) // 10],
        "steps_p90": ordered[9 * len(steps) // 10],
        "tokens": tokens,
    }


def measure_ttft(model: Any, long: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        stamps = Stamps()
        t0 = time.perf_counter()
        model.generate(long, max_new_tokens=1, do_sample=False, pad_token_id=0, streamer=stamps)
        times.append(stamps.times[1] - t0 if len(stamps.times) > 1 else time.perf_counter() - t0)
    return statistics.median(times)


def prompts(spec: dict[str, Any], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    short = torch.randint(0, vocab, (1, 16), generator=gen)
    long = torch.randint(0, vocab, (1, int(spec.get("prompt_len", 512))), generator=gen)
    return short, long


def task_local(spec: dict[str, Any]) -> None:
    """The whole model in this process (same machine, one thread): its compute per token is the floor's."""
    from transformers import AutoModelForCausalLM

    folder = folder_of(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train(False)
    short, long = prompts(spec, model.config.vocab_size)
    with torch.no_grad():
        dec = measure_decode(model, short, int(spec.get("new_tokens", 32)), int(spec.get("repeats", 2)))
        ttft = measure_ttft(model, long, int(spec.get("ttft_repeats", 1)))
    emit(
        task="local",
        step_s=dec["step_s"],
        tokens_per_s=dec["tokens_per_s"],
        ttft_s=ttft,
        hidden=model.config.hidden_size,
        blocks=model.config.num_hidden_layers,
        tokens=dec["tokens"],
    )


def task_decode_ttft(spec: dict[str, Any], mode: dict[str, Any], do_decode: bool, do_ttft: bool) -> None:
    from swarm.model_files import load_config

    vocab = load_config(folder_of(spec["model"])).vocab_size
    short, long = prompts(spec, vocab)
    with overrides(mode) as applied, connect(spec, mode) as client:
        traffic = client.connection.remote.traffic
        if do_decode:
            new_tokens = int(spec.get("new_tokens", 32))
            before = dict(traffic)
            dec = measure_decode(client, short, new_tokens, int(spec.get("repeats", 2)))
            tokens = (int(spec.get("repeats", 2)) * new_tokens) + min(new_tokens, 4)
            moved = sum(traffic[k] - before.get(k, 0) for k in ("sent_bytes", "received_bytes"))
            emit(
                task="decode",
                mode=mode["name"],
                applied=applied,
                hops=len(client.route),
                client_bytes_per_token=moved / tokens,
                failovers=client.failovers,
                **dec,
            )
        if do_ttft:
            before = dict(traffic)
            repeats = int(spec.get("ttft_repeats", 1))
            ttft = measure_ttft(client, long, repeats)
            sent = (traffic.get("sent_bytes", 0) - before.get("sent_bytes", 0)) / repeats  # the prompt, to hop 1
            emit(task="ttft", mode=mode["name"], applied=applied, ttft_s=ttft, sent_bytes=sent)
            if spec.get("ttft_again"):  # the same prompt and a next turn, in a new session: what the servers kept
                more = torch.randint(0, vocab, (1, 64), generator=torch.Generator().manual_seed(1))
                prompt = torch.cat([long, more], dim=1)
                before = dict(traffic)
                with client.inference_session(max_length=prompt.shape[1] + 1) as session:
                    again = measure_ttft(client, prompt, 1)
                    reused, claimed = session.reused, session.claimed
                sent = traffic.get("sent_bytes", 0) - before.get("sent_bytes", 0)
                emit(
                    task="ttft_again",
                    mode=mode["name"],
                    applied=applied,
                    ttft_s=again,
                    sent_bytes=sent,
                    reused=reused,
                    claimed=claimed,
                )


def task_finetune(spec: dict[str, Any], mode: dict[str, Any]) -> None:
    from swarm.model_files import load_config

    vocab = load_config(folder_of(spec["model"])).vocab_size
    batch, seq, steps = int(spec.get("ft_batch", 2)), int(spec.get("ft_seq", 64)), int(spec.get("ft_steps", 3))
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(steps + 1)]
    lora = dict(tuning="lora", lora_rank=8, lora_alpha=16, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    with overrides(mode) as applied, connect(spec, mode, **lora) as client:
        params = [p for p in client.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-3)
        times, losses = [], []
        for i, ids in enumerate(data):
            t0 = time.perf_counter()
            loss = client(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            if i > 0:  # the first step is a warm-up (connections, adapters' upload)
                times.append(time.perf_counter() - t0)
            losses.append(loss.item())
    step = statistics.median(times)
    emit(
        task="finetune",
        mode=mode["name"],
        applied=applied,
        step_s=step,
        steps_per_s=1 / step,
        batch=batch,
        seq=seq,
        losses=losses,
    )


def task_pretrain(spec: dict[str, Any], mode: dict[str, Any]) -> None:
    from swarm.client.training.trainer import Trainer
    from swarm.training.data import Samples, corpus_files, tokenize
    from swarm.training.run import load_run

    run = load_run(spec["pretrain_run"])
    data = Samples(tokenize(corpus_files(None), run.tokenizer, run.hf_config().vocab_size), run.seq_len, run.seed)
    steps, warmup = int(spec.get("pretrain_steps", 4)), 1
    with overrides(mode) as applied:
        with Trainer(
            run,
            data,
            tuple(spec["initial_peers"]),
            timing=timing(spec),
            direct=mode.get("direct", "auto"),
            average_trainers=False,
        ) as trainer:
            times, losses = [], []
            for i in range(steps + warmup):
                t0 = time.perf_counter()
                losses.append(trainer.train_step())
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    tokens = run.target_batch_size * run.seq_len
    emit(
        task="pretrain",
        mode=mode["name"],
        applied=applied,
        step_s=step,
        tokens_per_s=tokens / step,
        tokens_per_step=tokens,
        losses=losses,
    )


def codecs_since(client: Any, before: dict[str, int]) -> dict[str, int]:
    """Calls per activation codec since ``before`` (the client's ``traffic`` then): what ``auto`` chose."""
    now = client.traffic
    counts = {k.removeprefix("codec."): v - before.get(k, 0) for k, v in now.items() if k.startswith("codec.")}
    return {k: v for k, v in counts.items() if v}


def task_forward(spec: dict[str, Any], mode: dict[str, Any]) -> None:
    """One forward pass of ``ids``: its logits, and the codecs its calls used."""
    ids = torch.tensor(spec["ids"])
    with overrides(mode) as applied, connect(spec, mode) as client, torch.no_grad():
        before = client.traffic
        logits = client(ids).logits
        emit(
            task="forward",
            mode=mode["name"],
            applied=applied,
            logits=logits.tolist(),
            codecs=codecs_since(client, before),
            route=[h.peer_id for h in client.route],
        )


def links(client: Any) -> dict[str, list[str]]:
    """Peer id -> the addresses of this client's libp2p connections to it (a relayed one names its relay)."""
    conn = client.connection
    peers = conn.loop.run(conn.remote.p2p.list_peers())
    return {str(p.peer_id): [str(a) for a in p.addrs] for p in peers}


def task_generate(spec: dict[str, Any], mode: dict[str, Any]) -> None:
    """Greedy generation of ``prompt``; with ``pause_after``, stop after that many new tokens until told to go on
    (the caller kills a server meanwhile)."""
    prompt = torch.tensor([spec["prompt"]])
    n = int(spec["max_new_tokens"])
    with overrides(mode) as applied, connect(spec, mode) as client:

        def pause() -> None:
            emit(pause=spec["pause_after"], route=[h.peer_id for h in client.route], links=links(client))
            sys.stdin.readline()

        stamps = Stamps(spec.get("pause_after"), pause)
        if spec.get("warmup", True):
            client.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
        before = client.traffic
        out = client.generate(
            prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, streamer=stamps
        )
        steps = stamps.steps()
        if spec.get("pause_after") is not None:  # the paused interval and the failover are not a decode step
            steps = steps[: int(spec["pause_after"]) - 1]
        emit(
            task="generate",
            mode=mode["name"],
            applied=applied,
            tokens=out[0].tolist(),
            step_s=statistics.median(steps) if steps else None,
            steps=steps,
            first_token_s=stamps.first_token(),
            failovers=client.failovers,
            route=[h.peer_id for h in client.route],
            codecs=codecs_since(client, before),
            punched={k: v for k, v in client.traffic.items() if k.startswith("punch")},
            bytes=sum(client.traffic.get(k, 0) - before.get(k, 0) for k in ("sent_bytes", "received_bytes")),
        )


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    torch.set_num_threads(1)
    tasks = spec.get("tasks", [])
    modes = spec.get("modes", [{"name": "default"}])
    if "local" in tasks:
        task_local(spec)
    if "decode" in tasks or "ttft" in tasks:
        for mode in modes:
            task_decode_ttft(spec, mode, "decode" in tasks, "ttft" in tasks)
    if "finetune" in tasks:
        for mode in modes:
            task_finetune(spec, mode)
    if "pretrain" in tasks:
        for mode in modes:
            task_pretrain(spec, mode)
    if "forward" in tasks:
        for mode in modes:
            task_forward(spec, mode)
    if "generate" in tasks:
        for mode in modes:
            task_generate(spec, mode)
    emit(done=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

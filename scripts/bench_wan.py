"""The swarm behind real-looking links: every server and the client in its own emulated WAN node (``harness.wan``),
vs the floors the links allow, in one run. Needs root, /dev/net/tun and ``ip``.

    python scripts/bench_wan.py --quick                    # tiny Llama, loopback + link a, direct plane (~3 min)
    python scripts/bench_wan.py                            # everything below (about 35-45 min on 2 busy cores)
    python scripts/bench_wan.py --models tiny-llama --links a c --planes direct --chain on --tasks decode
    python scripts/bench_wan.py --codec float16            # adds codec=float16 rows where ClientConfig has ``codec``

Models: SmolLM2-135M over 3 peers (0:10, 10:20, 20:30) and the tiny Llama card over 4 peers (2 blocks each); not
in the default run, ``mid-llama`` over 5 peers (the cost model's held-out workload; no pre-training run of it).
Links (one-way delay d between any two nodes, each node's bandwidth both ways): ``loopback`` (no WAN: 127.0.0.1,
the reference), ``a`` 100 Mbit/s d=20 ms, ``b`` 100 Mbit/s d=50 ms, ``c`` 20 Mbit/s d=50 ms; and, not in the
default run, ``z``: the WAN with d=0 and no bandwidth limit (the emulator's own cost: router, MTU 1500, namespaces).
Planes: ``direct`` (the servers' encrypted TLS data plane, the client's default ``direct="auto"``) and ``libp2p``
(servers started with ``--direct-port off``, client ``direct="never"``: every byte through the p2pd daemons). The code
base has no unencrypted direct TCP option (``swarm/rpc/direct.py`` is TLS-only), so there is no plain-TCP plane.
Chaining: ``chain=False`` (client-mediated: client -> s1 -> client -> s2 ...) and ``chain=True`` (client -> s1 ->
s2 ... -> client). It changes inference steps only; fine-tuning and pre-training rows use the default.

Per model, one local process (same machine, one torch thread, measured in this run) gives the compute per decode
step c and the local time to first token. Next to each decode step time t:
    floor = (n+1) d + c + (n+1) * hidden * 4 bytes / bandwidth        (n peers; float32 activations)
    x(n+1)d = t / ((n+1) d + c)      what a chained step should take
    x2nd    = t / (2 n d + c)        what a client-mediated step should take
Every process uses one torch thread; servers run with ``--threads 1 --throughput 100`` (no probe).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LINKS: dict[str, tuple[float, float | None]] = {  # name -> (one-way delay ms, Mbit/s)
    "loopback": (0.0, None),
    "a": (20.0, 100.0),
    "b": (50.0, 100.0),
    "c": (50.0, 20.0),
    "z": (0.0, None),  # not in the default run: the emulator's own cost (router, MTU 1500, namespaces), no delay
}
SPANS = {
    "smollm2-135m": ["0:10", "10:20", "20:30"],
    "tiny-llama": ["0:2", "2:4", "4:6", "6:8"],
    "mid-llama": ["0:2", "2:4", "4:6", "6:8", "8:10"],  # the cost model's held-out workload (validate_model.py)
}
SERVER_ARGS = ("--throughput", "100")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # this checkout's ``swarm`` (the WAN's children import it from here too)
    sys.path.insert(0, str(ROOT))


def has_codec() -> bool:
    from swarm.config import ClientConfig

    return "codec" in {f.name for f in dataclasses.fields(ClientConfig)}


def pretrain_run_toml(model: str, spans: list[str], folder: Path) -> Path:
    """A pre-training run over the same spans: the tiny Llama's shape from scratch (byte tokens), or SmolLM2
    continued from its weights (its tokenizer); small batches, no averaging or checkpoints."""
    if model == "smollm2-135m":
        model_section = 'from = "smollm2-135m"'
        tokenizer, batch, micro = "smollm2-135m", 4, 2
    else:
        model_section = "\n".join(
            [
                'model_type = "llama"',
                "hidden_size = 256",
                "intermediate_size = 688",
                "num_hidden_layers = 8",
                "num_attention_heads = 8",
                "num_key_value_heads = 8",
                "vocab_size = 256",
                "max_position_embeddings = 2048",
                "tie_word_embeddings = false",
                "initializer_range = 0.02",
            ]
        )
        tokenizer, batch, micro = "bytes", 8, 4
    path = folder / f"pretrain-{model}.toml"
    path.write_text(f"""name = "wanbench-{model}"
seed = 0
[model]
{model_section}
[data]
tokenizer = "{tokenizer}"
seq_len = 64
[optimizer]
lr = 1e-4
[schedule]
kind = "constant"
[batch]
target_batch_size = {batch}
micro_batch_size = {micro}
pipeline_depth = 2
[averaging]
every_steps = 0
[checkpoint]
every_steps = 0
dir = "{folder / "ckpt"}"
[stages]
spans = {json.dumps(spans)}
""")
    return path


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-wan-"))
        self.results: list[dict[str, Any]] = []
        self.local: dict[str, dict[str, Any]] = {}
        codecs: list[str | None] = ["none"] if has_codec() else [None]  # exact by default: tokens compared with local
        if args.codec:
            if has_codec():
                codecs = ["none", args.codec]
            else:
                print(f"note: ClientConfig has no 'codec' field yet; --codec {args.codec} ignored", flush=True)
        self.codecs = codecs

    def log(self, text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

    def modes(self, plane: str, chains: list[bool]) -> list[dict[str, Any]]:
        direct = "never" if plane == "libp2p" else "auto"
        out = []
        for chain in chains:
            for codec in self.codecs:
                name = f"chain={'on' if chain else 'off'}" + (f" codec={codec}" if codec not in (None, "none") else "")
                out.append({"name": name, "chain": chain, "direct": direct, "codec": codec})
        return out

    # -- one swarm, one client job ---------------------------------------------------------------------------------

    def run_job(self, wan: Any, spec: dict[str, Any], label: str) -> list[dict[str, Any]]:
        from harness.wan.nodes import ClientJob

        log_path = self.tmp / f"client-{label}.log"
        with ClientJob(wan, "c" if wan is not None else None, spec, log_path=log_path) as job:
            out = []
            while (item := job.next(self.args.job_timeout)) is not None:
                if item.get("done"):
                    break
                item.pop("losses", None)
                out.append(item)
                brief = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in item.items() if k != "tokens"}
                self.log(f"  {label}: {brief}")
            if job.proc.wait(60) != 0:
                raise RuntimeError(f"client job {label} failed (exit {job.proc.returncode}); log: {log_path}")
        return out

    def with_swarm(self, model: str, link: str, plane: str, train_run: Path | None, fn: Any) -> None:
        """Start the servers (in WAN nodes, or on loopback) and call ``fn(wan_or_None, initial_peers)``."""
        from harness.wan import Wan, WanConfig
        from harness.wan.nodes import WanSwarm
        from swarm.launch import LocalSwarm

        spans = SPANS[model]
        extra: tuple[str, ...] = SERVER_ARGS + (("--direct-port", "off") if plane == "libp2p" else ())
        if train_run is not None:
            extra += ("--train", str(train_run))
        logs = self.tmp / f"{model}-{link}-{plane}-{'train' if train_run else 'serve'}"
        t0 = time.perf_counter()
        if link == "loopback":
            with LocalSwarm(model, spans, extra_args=(*extra, "--threads", "1"), log_dir=logs) as swarm:
                self.log(f"{model} @ {link} / {plane}: {len(spans)} servers up in {time.perf_counter() - t0:.0f} s")
                fn(None, swarm.initial_peers)
            return
        delay, mbit = LINKS[link]
        nodes = ("c", *(f"s{i + 1}" for i in range(len(spans))))
        with Wan(WanConfig(nodes=nodes, delay_ms=delay, mbit=mbit)) as wan:
            with WanSwarm(wan, model, dict(zip(nodes[1:], spans, strict=True)), extra_args=extra, log_dir=logs) as sw:
                self.log(f"{model} @ {link} / {plane}: {len(spans)} servers up in {time.perf_counter() - t0:.0f} s")
                fn(wan, sw.initial_peers)

    def base_spec(self, model: str, peers: list[str]) -> dict[str, Any]:
        a = self.args
        return dict(
            model=model,
            initial_peers=peers,
            new_tokens=a.new_tokens,
            repeats=a.repeats,
            prompt_len=a.prompt_len,
            ttft_repeats=1,
            ttft_again=a.ttft_again,
            ft_batch=a.ft_batch,
            ft_seq=a.ft_seq,
            ft_steps=a.ft_steps,
            pretrain_steps=a.pretrain_steps,
        )

    def measure_local(self, model: str) -> None:
        spec = dict(self.base_spec(model, []), tasks=["local"])
        (self.local[model],) = self.run_job(None, spec, f"{model}-local")

    def measure(self, model: str, link: str, plane: str) -> None:
        a = self.args
        infer = [t for t in a.tasks if t in ("decode", "ttft", "finetune")]
        if infer:

            def go(wan: Any, peers: list[str]) -> None:
                spec = self.base_spec(model, peers)
                chains = [c == "on" for c in a.chain]
                items = []
                if "decode" in infer or "ttft" in infer:
                    # the local compute is measured again here, in the same process and under the same load as
                    # the swarm's rows it is the floor of (the servers idle meanwhile)
                    tasks = ["local", *(t for t in infer if t != "finetune")]
                    s = dict(spec, tasks=tasks, modes=self.modes(plane, chains))
                    items += self.run_job(wan, s, f"{model}-{link}-{plane}-infer")
                if "finetune" in infer:
                    s = dict(spec, tasks=["finetune"], modes=self.modes(plane, [True]))
                    items += self.run_job(wan, s, f"{model}-{link}-{plane}-ft")
                for item in items:
                    self.results.append(dict(item, model=model, link=link, plane=plane))

            self.with_swarm(model, link, plane, None, go)
        if "pretrain" in a.tasks and plane in a.pretrain_planes and model in ("tiny-llama", "smollm2-135m"):
            run = pretrain_run_toml(model, SPANS[model], self.tmp)

            def train(wan: Any, peers: list[str]) -> None:
                s = dict(
                    self.base_spec(model, peers),
                    tasks=["pretrain"],
                    modes=self.modes(plane, [True]),
                    pretrain_run=str(run),
                )
                for item in self.run_job(wan, s, f"{model}-{link}-{plane}-pretrain"):
                    self.results.append(dict(item, model=model, link=link, plane=plane, pretrain_run=str(run)))

            self.with_swarm(model, link, plane, run, train)

    # -- the tables ------------------------------------------------------------------------------------------------

    def local_of(self, r: dict[str, Any]) -> dict[str, Any]:
        """The local run measured by the same client job as row ``r`` (else the model's first one)."""
        same = [
            x for x in self.results if x["task"] == "local" and all(x[k] == r[k] for k in ("model", "link", "plane"))
        ]
        return same[0] if same else self.local[r["model"]]

    def floors(self, r: dict[str, Any]) -> dict[str, float]:
        delay, mbit = LINKS[r["link"]]
        d, n = delay / 1000, r["hops"]
        local = self.local_of(r)
        c = local["step_s"]
        hidden = local["hidden"]
        wire = (n + 1) * hidden * 4 * 8 / (mbit * 1e6) if mbit else 0.0
        return {"floor": (n + 1) * d + c + wire, "chained": (n + 1) * d + c, "mediated": 2 * n * d + c, "c": c}

    def report(self) -> None:
        print(
            "\n## Inference (median decode step over the generated tokens; TTFT of a "
            f"{self.args.prompt_len}-token prompt)"
        )
        for model, local in self.local.items():
            print(
                f"{model}: local one process, 1 thread: {local['tokens_per_s']:.1f} tokens/s "
                f"(compute per token c = {local['step_s'] * 1000:.1f} ms), TTFT {local['ttft_s']:.2f} s"
            )
        head = (
            f"| {'model':<12} | {'link':<19} | {'plane':<6} | {'mode':<14} | {'tok/s':>6} | {'step ms':>7} | "
            f"{'floor ms':>8} | {'c ms':>5} | {'xfloor':>6} | {'x(n+1)d':>7} | {'x2nd':>5} | {'TTFT s':>6} | "
            f"{'xlocal':>6} |"
        )
        print(head)
        print(rule(head))
        for r in self.results:
            if r["task"] != "decode":
                continue
            f = self.floors(r)
            local = self.local_of(r)
            ttft = next(
                (
                    x["ttft_s"]
                    for x in self.results
                    if x["task"] == "ttft" and all(x[k] == r[k] for k in ("model", "link", "plane", "mode"))
                ),
                None,
            )
            t = r["step_s"]
            tt = f"{ttft:>6.2f}" if ttft is not None else f"{'':>6}"
            tl = f"{ttft / local['ttft_s']:>5.2f}x" if ttft is not None else f"{'':>6}"
            print(
                f"| {r['model']:<12} | {link_name(r['link']):<19} | {r['plane']:<6} | {r['mode']:<14} | "
                f"{r['tokens_per_s']:>6.1f} | {t * 1000:>7.1f} | {f['floor'] * 1000:>8.1f} | "
                f"{f['c'] * 1000:>5.1f} | {t / f['floor']:>5.2f}x | {t / f['chained']:>6.2f}x | "
                f"{t / f['mediated']:>4.2f}x | {tt} | {tl} |"
            )
        train = [r for r in self.results if r["task"] in ("finetune", "pretrain")]
        if train:
            print("\n## Training (median step after one warm-up step)")
            head = f"| {'model':<12} | {'link':<19} | {'plane':<6} | {'mode':<14} | {'what':<40} | {'value':>8} |"
            print(head)
            print(rule(head))
            for r in train:
                if r["task"] == "finetune":
                    what, value = f"LoRA r=8 steps/s (batch {r['batch']}x{r['seq']})", r["steps_per_s"]
                else:
                    what, value = f"pre-training tokens/s ({r['tokens_per_step']} tok/step)", r["tokens_per_s"]
                mode = r["mode"].replace("chain=on", "").strip() or "-"
                print(
                    f"| {r['model']:<12} | {link_name(r['link']):<19} | {r['plane']:<6} | {mode:<14} | "
                    f"{what:<40} | {value:>8.2f} |"
                )
        mism = [r for r in self.results if r["task"] == "decode" and r["tokens"] != self.local[r["model"]]["tokens"]]
        if mism:
            print(
                "\nWARNING: greedy tokens differ from the local run in:",
                ", ".join(f"{r['model']}/{r['link']}/{r['plane']}/{r['mode']}" for r in mism),
            )
        else:
            print("\nEvery decode row's greedy tokens equal the local run's.")


def rule(head: str) -> str:
    return "|" + "|".join("-" * len(p) for p in head.split("|")[1:-1]) + "|"


def link_name(link: str) -> str:
    if link == "loopback":
        return "loopback (no WAN)"
    if link == "z":
        return "z: WAN d=0, no limit"
    delay, mbit = LINKS[link]
    return f"{link}: {mbit:.0f}Mb/s d={delay:.0f}ms"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny Llama; loopback and link a; direct plane; decode, TTFT and fine-tuning; fewer tokens",
    )
    p.add_argument("--models", nargs="+", choices=list(SPANS), default=["tiny-llama", "smollm2-135m"])
    p.add_argument("--links", nargs="+", choices=list(LINKS), default=["loopback", "a", "b", "c"])
    p.add_argument("--planes", nargs="+", choices=["direct", "libp2p"], default=["direct", "libp2p"])
    p.add_argument(
        "--pretrain-planes",
        nargs="+",
        choices=["direct", "libp2p"],
        default=["direct"],
        help="pre-training needs servers of its own per plane, so by default only the direct plane",
    )
    p.add_argument("--chain", nargs="+", choices=["off", "on"], default=["off", "on"])
    p.add_argument("--codec", default=None, help="add rows with this ClientConfig.codec (where the field exists)")
    p.add_argument(
        "--tasks",
        nargs="+",
        choices=["decode", "ttft", "finetune", "pretrain"],
        default=["decode", "ttft", "finetune", "pretrain"],
    )
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="timed generations per decode row")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--ttft-again", action="store_true", help="ttft: then the same prompt +64 tokens, new session")
    p.add_argument("--ft-batch", type=int, default=2)
    p.add_argument("--ft-seq", type=int, default=64)
    p.add_argument("--ft-steps", type=int, default=2)
    p.add_argument("--pretrain-steps", type=int, default=2)
    p.add_argument("--json", type=Path, default=None, help="also write every result here (after each swarm)")
    p.add_argument("--job-timeout", type=float, default=600.0, help="seconds a client may go without a result")
    args = p.parse_args()
    if args.quick:
        args.models, args.links, args.planes = ["tiny-llama"], ["loopback", "a"], ["direct"]
        args.tasks = [t for t in args.tasks if t != "pretrain"]
        args.new_tokens, args.repeats = 16, 1

    from harness.wan import unavailable_reason

    reason = unavailable_reason()
    if reason is not None and any(link != "loopback" for link in args.links):
        print(f"cannot emulate links: {reason}", file=sys.stderr)
        return 2
    bench = Bench(args)
    t0 = time.perf_counter()
    try:
        for model in args.models:
            bench.measure_local(model)
            for link in args.links:
                for plane in args.planes:
                    bench.measure(model, link, plane)
                    if args.json:
                        args.json.write_text(
                            json.dumps({"local": bench.local, "results": bench.results, "spans": SPANS})
                        )
    finally:
        bench.report()
        print(f"\nwall time {time.perf_counter() - t0:.0f} s; logs in {bench.tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

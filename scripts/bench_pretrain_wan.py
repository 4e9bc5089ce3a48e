"""Pre-training with two replicas per stage, on loopback and behind emulated WAN links (``harness.wan``), for each
way replicas keep together: today's averaging of weights and Adam's moments, DiLoCo at several H, DiLoCo with its
pseudo-gradients compressed. Needs root, /dev/net/tun and ``ip`` for the WAN links.

    python scripts/bench_pretrain_wan.py --quick          # tiny Llama, loopback, 60 steps a method (~6 min)
    python scripts/bench_pretrain_wan.py                  # the table of docs/benchmarks.md (about 40 min on 2 cores)
    python scripts/bench_pretrain_wan.py --models tiny --links loopback c --methods average diloco-10-topk
    python scripts/bench_pretrain_wan.py --passes --links loopback c      # chained passes against client-mediated

Models: ``tiny`` (configs/runs/tiny-llama.toml: 6 layers, hidden 64, bytes; 3 stages of 2 blocks) and ``smol`` (a
SmolLM2-135M-shaped Llama from scratch, SmolLM2's tokenizer; 3 stages of 10 blocks; batch 8 x 32 tokens). Each
stage has two replicas, each replica and the trainer a process of its own (one torch thread); on WAN links each in
a node of its own. Links (one-way delay between any two nodes, each node's bandwidth): ``loopback``, ``a`` 20 ms
100 Mbit/s, ``c`` 50 ms 20 Mbit/s.

Per row: training tokens/s (median step), the mean loss of the last 10 steps (every method sees the same samples in
the same order; the stochastic wiring decides which replica trains on which), and the bytes the replicas sent each
other in averaging rounds per inner step: read from the servers' ``swarm_peer_bytes_total{role="averaging"}``
metric on loopback (the same tensors and codec go over any link), summed over the six replicas, divided by the
steps run. Rounds of a method whose H exceeds the steps run are not taken: those rows say so.

``--passes``: one replica per stage (3 stages of the tiny Llama), one trainer training first with its micro-batches
passed through itself between stages (client-mediated), then chained from stage to stage, in the same swarm; both
exact (no activation codec). Per link: micro-batches per second of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # this checkout's ``swarm`` (the WAN's children import it from here too)
    sys.path.insert(0, str(ROOT))

LINKS: dict[str, tuple[float, float | None]] = {"loopback": (0.0, None), "a": (20.0, 100.0), "c": (50.0, 20.0)}
METHODS: dict[str, dict[str, Any]] = {
    "average": {"method": "parameters", "every_steps": 10},
    "diloco-10": {"method": "diloco", "every_steps": 10},
    "diloco-50": {"method": "diloco", "every_steps": 50},
    "diloco-100": {"method": "diloco", "every_steps": 100},
    "diloco-10-int8": {"method": "diloco", "every_steps": 10, "compression": "int8"},
    "diloco-10-topk": {"method": "diloco", "every_steps": 10, "compression": "topk", "density": 0.01},
}
SMOL = {  # SmolLM2-135M's shape (its config.json), from scratch
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "initializer_range": 0.041666666666666664,
}


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def run_file(model: str, method: str, folder: Path, every: int | None = None) -> Path:
    """The model's run with the method's ``[averaging]`` (``every``: its period instead); no checkpoints."""
    data = tomllib.loads((ROOT / "configs" / "runs" / "tiny-llama.toml").read_text())
    data["name"] = f"wan-{model}-{method}"
    if model == "smol":
        data["model"] = dict(SMOL)
        data["data"] = {"tokenizer": "smollm2-135m", "seq_len": 32}
        data["optimizer"]["lr"] = 1e-3
        data["batch"] = {"target_batch_size": 8, "micro_batch_size": 4, "pipeline_depth": 2}
        data["stages"] = {"spans": ["0:10", "10:20", "20:30"]}
    data["batch"]["target_batch_size"] = max(data["batch"]["target_batch_size"], 16 if model == "tiny" else 8)
    data["averaging"] = {"matchmaking_seconds": 1.0, **METHODS[method]}
    if every is not None:
        data["averaging"]["every_steps"] = every
    data["checkpoint"] = {"every_steps": 0, "dir": str(folder / f"ckpt-{model}-{method}")}
    lines = [f"{k} = {_toml(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for section, fields in data.items():
        if isinstance(fields, dict):
            lines += [f"[{section}]"] + [f"{k} = {_toml(v)}" for k, v in fields.items()]
    path = folder / f"{model}-{method}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def averaging_bytes(urls: list[str]) -> int:
    """``swarm_peer_bytes_total{role="averaging"}`` summed over the peers' metrics pages."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0
    for url in urls:
        with urllib.request.urlopen(url, timeout=10) as reply:  # noqa: S310 - our own peers on 127.0.0.1
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            total += sum(
                int(s.value)
                for s in family.samples
                if s.name == "swarm_peer_bytes_total" and s.labels.get("role") == "averaging"
            )
    return total


def settled_bytes(urls: list[str], every: float = 6.0, limit: float = 120.0) -> int:
    """The replicas' averaging bytes once the last round has ended (two reads ``every`` seconds apart agree)."""
    last, deadline = averaging_bytes(urls), time.monotonic() + limit
    while time.monotonic() < deadline:
        time.sleep(every)
        now = averaging_bytes(urls)
        if now == last:
            return now
        last = now
    return last


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-pretrain-wan-"))
        self.rows: list[dict[str, Any]] = []
        self.passes: list[dict[str, Any]] = []

    def log(self, text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

    def steps(self, model: str, link: str) -> int:
        a = self.args
        return (a.steps if link == "loopback" else a.wan_steps) if model == "tiny" else a.smol_steps

    def measure(self, model: str, link: str, method: str) -> None:
        from harness.wan.nodes import ClientJob

        run = run_file(model, method, self.tmp)
        spans = [str(s) for s in tomllib.loads(run.read_text())["stages"]["spans"] for _ in range(2)]
        steps = self.steps(model, link)
        spec = {"tasks": ["pretrain"], "pretrain_run": str(run), "pretrain_steps": steps, "modes": [{"name": method}]}
        label = f"{model}-{link}-{method}"
        extra = ("--throughput", "100", "--threads", "1", "--train", str(run))
        t0 = time.perf_counter()

        def job(wan: Any, peers: list[str]) -> dict[str, Any]:
            self.log(f"{label}: {len(spans)} replicas up in {time.perf_counter() - t0:.0f} s")
            with ClientJob(wan, "t" if wan else None, dict(spec, initial_peers=peers), self.tmp / f"{label}.log") as j:
                items = [i for i in j.lines(self.args.job_timeout) if i.get("task") == "pretrain"]
            if not items:
                raise RuntimeError(f"{label}: the trainer reported nothing; log: {self.tmp / f'{label}.log'}")
            return items[0]

        if link == "loopback":
            from swarm.launch import LocalSwarm

            metrics = ("--metrics-port", "0")
            with LocalSwarm("tiny-llama", spans, extra_args=(*extra, *metrics), log_dir=self.tmp / label) as swarm:
                item = job(None, swarm.initial_peers)
                sent: int | None = settled_bytes([p.urls["metrics"] for p in swarm.peers])
        else:
            from harness.wan import Wan, WanConfig
            from harness.wan.nodes import WanSwarm

            delay, mbit = LINKS[link]
            nodes = ("t", *(f"s{i}" for i in range(len(spans))))
            with Wan(WanConfig(nodes=nodes, delay_ms=delay, mbit=mbit)) as wan:
                placed = dict(zip(nodes[1:], spans, strict=True))
                with WanSwarm(wan, "tiny-llama", placed, extra_args=extra, log_dir=self.tmp / label) as wan_swarm:
                    item = job(wan, wan_swarm.initial_peers)
            sent = None
        every = METHODS[method]["every_steps"]
        row = dict(
            model=model,
            link=link,
            method=method,
            steps=steps,
            rounds=steps // every,
            tokens_per_s=item["tokens_per_s"],
            loss=statistics.fmean(item["losses"][-10:]),
            bytes_per_step=None if sent is None else sent / (steps + 1),
        )
        self.rows.append(row)
        self.log(f"{label}: {json.dumps(row)}")

    def measure_passes(self, link: str) -> None:
        """Client-mediated against chained passes, in one swarm of one replica per stage."""
        from harness.wan.nodes import ClientJob

        run = run_file("tiny", "average", self.tmp, every=0)
        spans = [str(s) for s in tomllib.loads(run.read_text())["stages"]["spans"]]
        modes = [{"name": f"chain={c}", "chain": c == "on", "codec": "none"} for c in ("off", "on")]
        spec = {"tasks": ["pretrain"], "pretrain_run": str(run), "pretrain_steps": self.args.pass_steps, "modes": modes}
        extra = ("--throughput", "100", "--threads", "1", "--train", str(run))
        label = f"passes-{link}"

        def job(wan: Any, peers: list[str]) -> list[dict[str, Any]]:
            with ClientJob(wan, "t" if wan else None, dict(spec, initial_peers=peers), self.tmp / f"{label}.log") as j:
                return [i for i in j.lines(self.args.job_timeout) if i.get("task") == "pretrain"]

        if link == "loopback":
            from swarm.launch import LocalSwarm

            with LocalSwarm("tiny-llama", spans, extra_args=extra) as swarm:
                items = job(None, swarm.initial_peers)
        else:
            from harness.wan import Wan, WanConfig
            from harness.wan.nodes import WanSwarm

            delay, mbit = LINKS[link]
            nodes = ("t", *(f"s{i}" for i in range(len(spans))))
            with Wan(WanConfig(nodes=nodes, delay_ms=delay, mbit=mbit)) as wan:
                placed = dict(zip(nodes[1:], spans, strict=True))
                with WanSwarm(wan, "tiny-llama", placed, extra_args=extra) as wan_swarm:
                    items = job(wan, wan_swarm.initial_peers)
        rates = {i["mode"]: i["tokens_per_s"] / tomllib.loads(run.read_text())["data"]["seq_len"] for i in items}
        mb = tomllib.loads(run.read_text())["batch"]["micro_batch_size"]
        row = {"link": link, **{k: v / mb for k, v in rates.items()}}
        self.passes.append(row)
        self.log(f"{label}: {json.dumps(row)}")

    def table(self) -> None:
        if self.passes:
            print("\n| link | micro-batches/s, client-mediated | chained | chained / client-mediated |")
            print("| --- | --- | --- | --- |")
            for r in self.passes:
                off, on = r.get("chain=off", 0.0), r.get("chain=on", 0.0)
                print(f"| {r['link']} | {off:.2f} | {on:.2f} | {on / off if off else 0:.2f}x |")
        if not self.rows:
            return
        print(
            "\n| model | link | method | steps (rounds) | tokens/s | loss, last 10 steps | bytes between replicas "
            "per inner step | vs average |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in self.rows:
            base = next(
                (b for b in self.rows if (b["model"], b["link"], b["method"]) == (r["model"], "loopback", "average")),
                None,
            )
            per = r["bytes_per_step"]
            if per is None:  # behind a WAN: the loopback row's bytes (the same tensors and codec)
                same = next((b for b in self.rows if (b["model"], b["method"]) == (r["model"], r["method"])), None)
                per = same["bytes_per_step"] if same else None
            ratio = f"{base['bytes_per_step'] / per:.0f}x fewer" if base and per and base["bytes_per_step"] else ""
            shown = "no round" if not r["rounds"] else (f"{per:,.0f}" if per is not None else "")
            print(
                f"| {r['model']} | {r['link']} | {r['method']} | {r['steps']} ({r['rounds']}) | "
                f"{r['tokens_per_s']:,.0f} | {r['loss']:.4f} | {shown} | {ratio} |"
            )
        if self.args.json:
            self.args.json.write_text(json.dumps(self.rows, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny Llama on loopback, 60 steps a method")
    p.add_argument("--models", nargs="+", choices=["tiny", "smol"], default=["tiny", "smol"])
    p.add_argument("--links", nargs="+", choices=list(LINKS), default=list(LINKS))
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    p.add_argument("--steps", type=int, default=300, help="tiny Llama on loopback (loss and bytes)")
    p.add_argument("--wan-steps", type=int, default=60, help="tiny Llama behind a WAN link (tokens/s)")
    p.add_argument("--smol-steps", type=int, default=20)
    p.add_argument("--passes", action="store_true", help="chained passes against client-mediated, per link, only")
    p.add_argument("--pass-steps", type=int, default=20)
    p.add_argument("--job-timeout", type=float, default=1800.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.quick:
        args.models, args.links, args.steps = ["tiny"], ["loopback"], 60
    bench = Bench(args)
    if args.passes:
        for link in args.links:
            bench.measure_passes(link)
        bench.table()
        return
    for model in args.models:
        for link in args.links:
            for method in args.methods:
                if model == "smol" and method not in ("average", "diloco-10-topk"):
                    continue  # H beyond the steps a SmolLM2-shaped run takes here: no round to measure
                bench.measure(model, link, method)
    bench.table()


if __name__ == "__main__":
    main()

"""50 x RTX 3080 over internet links against 4 x H100 over NVLink: serving Llama-2-70B and pre-training Llama-2-7B,
priced by swarm.perf.fleet. Prints each side's throughput, cost and time breakdown, every assumption, the crossover
over link bandwidth x delay and a verdict; writes plots to --plots.

    python scripts/cost_model.py [--link-mbps 1000] [--delay-ms 20] [--plots docs/perf]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402

from swarm.perf.catalogue import load_catalogue  # noqa: E402
from swarm.perf.crossover import Crossover, crossover, needed  # noqa: E402
from swarm.perf.fleet import (  # noqa: E402
    Pretraining,
    Result,
    Serving,
    device_of,
    serve_datacenter,
    serve_swarm,
    train_datacenter,
    train_swarm,
)
from swarm.perf.model import Link  # noqa: E402

SHARES = ("compute", "memory", "overhead", "comm", "bubble")


def mbps(bw: float | None) -> str:
    if bw is None:
        return "never (<= 10 Gbit/s)"
    return f"{bw * 8 / 1e6:,.0f} Mbit/s"


def table(title: str, rows: list[Result], args: argparse.Namespace, latency_label: str) -> None:
    print(f"\n## {title}\n")
    cols = [
        "side",
        "devices",
        "used",
        "tokens/s",
        latency_label,
        "power kW",
        "cloud $/h",
        "purchase $",
        "$/Mtok cloud",
        "$/Mtok owned",
        "kWh/Mtok",
        *SHARES,
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        owned = r.usd_per_mtok_owned(args.electricity, args.hours_per_year, args.amortize_years)
        shares = [f"{getattr(r.cost, k) / r.cost.total:.0%}" for k in SHARES]
        cells = [
            r.side,
            f"{r.count} x {r.device}",
            str(r.used),
            f"{r.throughput:,.0f}",
            f"{r.latency:.3g}",
            f"{r.power_w / 1000:.1f}",
            f"{r.cloud_usd_per_hour:.2f}",
            f"{r.purchase_usd:,.0f}",
            f"{r.usd_per_mtok_cloud:.3f}",
            f"{owned:.3f}",
            f"{r.kwh_per_mtok:.2f}",
            *shares,
        ]
        print("| " + " | ".join(cells) + " |")
    for r in rows:
        print(f"\n{r.side} detail: " + ", ".join(f"{k}={v:.3g}" for k, v in r.detail.items()))


def heatmap(cx: Crossover, title: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [b * 8 / 1e6 for b in cx.bandwidths]
    y = [d * 1e3 for d in cx.delays]
    mesh = ax.pcolormesh(x, y, cx.ratio, shading="nearest", cmap="RdYlGn", norm=LogNorm(vmin=0.01, vmax=10))
    fig.colorbar(mesh, ax=ax, label="swarm / datacenter throughput")
    if min(min(r) for r in cx.ratio) < 1 < max(max(r) for r in cx.ratio):
        ax.contour(x, y, cx.ratio, levels=[1.0], colors="black", linewidths=2)
        ax.plot([], [], color="black", lw=2, label="equal throughput (ratio 1.0)")
    else:
        ax.plot([], [], " ", label=f"ratio 1.0 not reached (max {max(max(r) for r in cx.ratio):.2f})")
    if min(min(r) for r in cx.cost_ratio) < 1 < max(max(r) for r in cx.cost_ratio):
        ax.contour(x, y, cx.cost_ratio, levels=[1.0], colors="blue", linestyles="dashed")
        ax.plot([], [], color="blue", ls="--", label="equal cloud $ per token")
    else:
        ax.plot([], [], " ", label="never cheaper per token (cloud)")
    ax.set(
        xscale="log", yscale="log", xlabel="link bandwidth per GPU (Mbit/s)", ylabel="one-way delay (ms)", title=title
    )
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plots", type=Path, default=Path("docs/perf"), help="folder for the PNGs")
    p.add_argument("--link-mbps", type=float, default=1000.0, help="swarm link bandwidth per GPU, Mbit/s")
    p.add_argument("--delay-ms", type=float, default=20.0, help="swarm link one-way delay, ms")
    p.add_argument("--nvlink-gbps", type=float, default=450.0, help="H100 NVLink GB/s each way")
    p.add_argument("--electricity", type=float, default=0.15, help="$/kWh")
    p.add_argument("--hours-per-year", type=float, default=8760.0, help="running hours per year (owned)")
    p.add_argument("--amortize-years", type=float, default=3.0, help="years to spread the purchase over")
    p.add_argument("--swarm-count", type=int, default=50)
    p.add_argument("--dc-count", type=int, default=4)
    args = p.parse_args()
    cat = load_catalogue()
    g, h = cat["rtx3080"], cat["h100"]
    link = Link(delay=args.delay_ms / 1e3, bandwidth=args.link_mbps * 1e6 / 8)
    serving, training = Serving(), Pretraining()
    n, k, nv = args.swarm_count, args.dc_count, args.nvlink_gbps
    print(f"# Cost model: {n} x {g.name} vs {k} x {h.name}")
    print(
        f"\nSwarm link: {args.link_mbps:g} Mbit/s per GPU, {args.delay_ms:g} ms one-way; NVLink {nv:g} GB/s each way;"
        f" electricity ${args.electricity}/kWh; owned: {args.amortize_years:g} years x {args.hours_per_year:g} h"
    )
    s_sw, s_dc = serve_swarm(g, n, link, serving), serve_datacenter(h, k, serving, nv)
    t_sw, t_dc = train_swarm(g, n, link, training), train_datacenter(h, k, training, nv)
    table("Serving Llama-2-70B (16-bit), decode", [s_sw, s_dc], args, "s/token/seq")
    table("Pre-training Llama-2-7B (bf16 + AdamW)", [t_sw, t_dc], args, "s/step")
    print(f"\nH100 pre-training MFU (emerges from the model): {t_dc.detail['mfu']:.2f}")

    print("\n## Assumptions\n")
    print("| name | value | source or reason |\n|---|---|---|")
    seen: set[str] = set()
    for r in (s_sw, s_dc, t_sw, t_dc):
        for name, value, why in r.assumptions:
            key = f"{name}={value}"
            if key not in seen:
                seen.add(key)
                print(f"| {name} | {value} | {why} |")

    print("\n## Crossover (swarm / datacenter over link bandwidth x one-way delay)\n")
    cs, ct = crossover(g, n, h, k, serving, nv), crossover(g, n, h, k, training, nv)
    for label, cx in (("serving", cs), ("pre-training", ct)):
        best = max(max(r) for r in cx.ratio)
        print(f"{label}: throughput ratio {min(min(r) for r in cx.ratio):.2f} .. {best:.2f} over the grid")
        for d, m, c in zip(cx.delays, cx.match, cx.cheaper, strict=True):
            print(
                f"  delay {d * 1e3:6.1f} ms: matches 4xH100 throughput from {mbps(m)}; cheaper per token "
                f"(cloud) from {mbps(c)}"
            )
    for label, wl, ref in (("serving", serving, s_dc), ("pre-training", training, t_dc)):
        count = needed(g, ref, link, wl)
        print(
            f"{label}: RTX 3080s needed to match {k} x H100 at {args.link_mbps:g} Mbit/s, {args.delay_ms:g} ms: "
            f"{count if count is not None else 'more than 4096'}"
        )
    tr, sr = t_sw.throughput / t_dc.throughput, s_sw.throughput / s_dc.throughput
    own = {
        r.side + label: r.usd_per_mtok_owned(args.electricity, args.hours_per_year, args.amortize_years)
        for label, rs in (("s", (s_sw, s_dc)), ("t", (t_sw, t_dc)))
        for r in rs
    }
    reach = lambda cx: "reach" if any(m is not None for m in cx.match) else "never reach"  # noqa: E731
    print("\n## Verdict\n")
    print(
        f"Serving 70B: {n} x 3080 give {s_sw.throughput:,.0f} tokens/s against {s_dc.throughput:,.0f} ({sr:.2f}x), "
        f"and {reach(cs)} {k} x H100 on the grid (best {max(max(r) for r in cs.ratio):.2f}x): a 10 GB card holds "
        f"{s_sw.detail['blocks_per_gpu']:.0f} blocks and little KV cache, so only "
        f"{s_sw.detail['inflight_per_pipeline']:.0f} sequences fit in flight and each waits a whole "
        f"{s_sw.detail['stages']:.0f}-stage trip per token; the delay multiplies into every trip. Cost per million "
        f"tokens: ${s_sw.usd_per_mtok_cloud:.2f} vs ${s_dc.usd_per_mtok_cloud:.2f} rented, ${own['swarms']:.2f} vs "
        f"${own['datacenters']:.2f} owned."
    )
    print(
        f"Pre-training 7B: {n} x 3080 give {t_sw.throughput:,.0f} tokens/s against {t_dc.throughput:,.0f} "
        f"({tr:.2f}x), and {reach(ct)} {k} x H100 on the grid (best {max(max(r) for r in ct.ratio):.2f}x). "
        f"Compute is there ({n} x {device_of(g).flops / 1e12:.1f} vs {k} x {device_of(h).flops / 1e12:.0f} "
        f"TFLOPS attainable) but checkpointing adds a forward, only {t_sw.used} of {n} cards fit whole pipelines, "
        f"and on slow links the activations and the gradient averaging take over. Rented, the swarm is cheaper per "
        f"token from {mbps(ct.cheaper[0])} (${t_sw.usd_per_mtok_cloud:.3f} vs ${t_dc.usd_per_mtok_cloud:.3f} per "
        f"million tokens here); owned, ${own['swarmt']:.3f} vs ${own['datacentert']:.3f} (the swarm draws "
        f"{t_sw.power_w / 1000:.0f} kW against {t_dc.power_w / 1000:.1f} kW)."
    )

    args.plots.mkdir(parents=True, exist_ok=True)
    heatmap(cs, f"Serving Llama-2-70B: {n}x3080 / {k}xH100 tokens/s", args.plots / "serving-crossover.png")
    heatmap(ct, f"Pre-training Llama-2-7B: {n}x3080 / {k}xH100 tokens/s", args.plots / "training-crossover.png")
    fig, axes = plt.subplots(1, 2, figsize=(7, 4.5))
    x = [b * 8 / 1e6 for b in cs.bandwidths]
    for ax, cx, ref, name in ((axes[0], cs, s_dc, "serving 70B"), (axes[1], ct, t_dc, "pre-training 7B")):
        for i in range(0, len(cx.delays), max(1, len(cx.delays) // 4)):
            ax.plot(x, [v * ref.throughput for v in cx.ratio[i]], label=f"{n}x3080, {cx.delays[i] * 1e3:.0f} ms")
        ax.axhline(ref.throughput, color="black", ls="--", label=f"{k}xH100 (NVLink)")
        ax.set(xscale="log", yscale="log", xlabel="link bandwidth (Mbit/s)", ylabel="tokens/s", title=name)
        ax.legend(fontsize=7)
    fig.suptitle("Throughput vs swarm link bandwidth")
    fig.tight_layout()
    fig.savefig(args.plots / "throughput-vs-bandwidth.png", dpi=100)
    plt.close(fig)
    print(
        f"\nPlots written to {args.plots}/ (serving-crossover.png, training-crossover.png, throughput-vs-bandwidth.png)"
    )
    assert math.isfinite(s_sw.throughput)


if __name__ == "__main__":
    main()

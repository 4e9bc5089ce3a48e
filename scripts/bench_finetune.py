"""LoRA fine-tuning steps/s through a local swarm vs the same steps locally with PEFT, in one run.

    python scripts/bench_finetune.py                  # SmolLM2-135M, 3 peers, batch 4 x 128, 5 measured steps each
    python scripts/bench_finetune.py --steps 8 --rank 16

A step is forward, backward and an AdamW step of the adapter. Both sides start from the same adapter (saved by the
swarm client, loaded by PEFT), train on the same batches and use one torch thread per process; steps alternate
(local, swarm, local, ...) so slow drifts of this machine weigh on both alike. The loss of every step is printed for
both: they must agree. Bytes are counted over every message the client sent and received, all transports.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from swarm import DistributedModelForCausalLM
from swarm.config import default_cache_dir, load_model_card
from swarm.launch import LocalSwarm
from swarm.model_files import load_config, model_folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--spans", nargs="+", default=["0:10", "10:20", "20:30"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", nargs="+", default=["q_proj", "k_proj", "v_proj", "o_proj"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--distinct", type=int, default=0, help="cycle over this many batches (a loss that can fall)")
    p.add_argument("--codec", default="none", help="the swarm side's activation codec: auto, none, float16, block8...")
    p.add_argument("--json", type=Path, default=None, help="also write the results here (read by validate_model.py)")
    args = p.parse_args()
    torch.set_num_threads(1)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = model_folder(load_model_card(args.model), default_cache_dir())
    vocab = load_config(folder).vocab_size
    gen = torch.Generator().manual_seed(0)
    distinct = args.distinct or args.steps + 1
    pool = [torch.randint(0, vocab, (args.batch, args.seq), generator=gen) for _ in range(distinct)]
    data = [pool[i % distinct] for i in range(args.steps + 1)]

    with LocalSwarm(args.model, args.spans, extra_args=("--throughput", "100")) as swarm:
        remote = DistributedModelForCausalLM.from_pretrained(
            args.model,
            initial_peers=swarm.initial_peers,
            tuning="lora",
            lora_rank=args.rank,
            lora_alpha=2 * args.rank,
            lora_targets=tuple(args.targets),
            codec=args.codec,
        )
        with remote, tempfile.TemporaryDirectory() as adapter_dir:
            remote.save_adapter(adapter_dir)
            base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            local = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
            sides = {}
            for name, model in (("local", local), ("swarm", remote)):
                params = [q for q in model.parameters() if q.requires_grad]
                sides[name] = (model, torch.optim.AdamW(params, lr=1e-3), [], [])
            n_params = sum(q.numel() for q in remote.adapters.parameters())
            traffic = remote.connection.remote.traffic

            def step(name: str, batch: torch.Tensor) -> None:
                model, opt, times, losses = sides[name]
                t0 = time.perf_counter()
                loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                times.append(time.perf_counter() - t0)
                losses.append(loss.item())

            for name in sides:  # warm-up (not measured): first calls pay for connections and allocator growth
                step(name, data[0])
                sides[name][2].clear()
            before = dict(traffic)
            for batch in data[1:]:
                step("local", batch)
                step("swarm", batch)
            per_step = {k: (traffic[k] - before.get(k, 0)) / args.steps for k in traffic}

    t_local, t_swarm = (statistics.median(sides[n][2]) for n in ("local", "swarm"))
    print(
        f"\n{args.model}: LoRA r={args.rank} on {', '.join(args.targets)} ({n_params:,} parameters), batch "
        f"{args.batch} x {args.seq}, {len(args.spans)} peers on 127.0.0.1, 1 torch thread per process"
    )
    print(f"| {'metric':<34} | {'local PEFT':>10} | {'swarm':>10} | {'ratio':>6} |")
    print(f"|{'-' * 36}|{'-' * 12}|{'-' * 12}|{'-' * 8}|")
    print(
        f"| {'training steps/s (median)':<34} | {1 / t_local:>10.3f} | {1 / t_swarm:>10.3f} | "
        f"{t_local / t_swarm:>5.2f}x |"
    )
    print(f"| {'seconds per step (median)':<34} | {t_local:>10.2f} | {t_swarm:>10.2f} | {'':>6} |")
    print("\nper swarm step, counted over every message:")
    print(f"  adapter bytes sent:        {per_step.get('adapter_bytes_sent', 0) / 1e6:8.2f} MB")
    activations = per_step.get("sent_bytes", 0) - per_step.get("adapter_bytes_sent", 0)
    print(f"  activations etc. sent:     {activations / 1e6:8.2f} MB")
    print(f"  received (outputs, grads): {per_step.get('received_bytes', 0) / 1e6:8.2f} MB")
    last_local, last_swarm = sides["local"][3][-1], sides["swarm"][3][-1]
    print(
        f"\nswarm codec {args.codec}: final loss {last_swarm:.5f} vs local {last_local:.5f}, relative difference "
        f"{abs(last_swarm - last_local) / last_local:.3%}"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"json": str(args.json)},
                    "adapter_params": n_params,
                    "local_step_s": t_local,
                    "swarm_step_s": t_swarm,
                },
                indent=1,
            )
        )
    print("\nloss per step (local PEFT vs swarm):")
    for i, (a, b) in enumerate(zip(sides["local"][3], sides["swarm"][3], strict=True)):
        print(f"  step {i + 1}: {a:.5f}  {b:.5f}  (diff {abs(a - b):.1e})")


if __name__ == "__main__":
    main()

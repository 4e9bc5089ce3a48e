"""``python -m swarm.demo``: the main job. Starts a local 3-peer swarm on 127.0.0.1 serving SmolLM2-135M-Instruct in
three spans, streams the model's answer to a chat prompt through it, prints per-token latency and the route, and
shuts everything down."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import TYPE_CHECKING

from swarm.config import default_cache_dir, load_model_card
from swarm.launch import LocalSwarm
from swarm.logs import configure_logging
from swarm.model_files import load_config, model_folder
from swarm.quantization import FORMATS, describe

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase


class _TimedStreamer:
    """A Hugging Face streamer that prints text as it comes and records when each token arrived."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.times: list[float] = []
        self.tokens: list[int] = []
        self._printed = 0
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate first passes the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.tokens.extend(value.reshape(-1).tolist())
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        print(text[self._printed :], end="", flush=True)
        self._printed = len(text)

    def end(self) -> None:
        print(flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m swarm.demo", description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument(
        "--prompt",
        default="What is the capital of France? Answer in one sentence, then name two famous places to visit there.",
    )
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--local-blocks", type=int, default=0, help="run the first N blocks on the client (privacy)")
    p.add_argument(
        "--quantize", default="none", choices=FORMATS, help="serve the blocks quantized (swarm.serve --quantize)"
    )
    args = p.parse_args(argv)
    configure_logging("WARNING")

    import torch
    from transformers import BatchEncoding

    from swarm import DistributedModelForCausalLM, load_tokenizer

    torch.set_num_threads(1)
    folder = model_folder(load_model_card(args.model), default_cache_dir())  # converts once, with a progress bar
    n = load_config(folder).num_hidden_layers
    cuts = [round(i * n / args.peers) for i in range(args.peers + 1)]
    spans: list[str | None] = [f"{a}:{b}" for a, b in zip(cuts, cuts[1:], strict=False)]
    shown = ", ".join(str(s) for s in spans)
    print(f"starting {args.peers} peers on 127.0.0.1 serving {args.model} blocks {shown} ...", flush=True)
    t0 = time.perf_counter()
    with LocalSwarm(args.model, spans, extra_args=("--quantize", args.quantize)) as swarm:
        print(f"swarm up in {time.perf_counter() - t0:.1f} s; initial peer: {swarm.initial_peers[0]}", flush=True)
        tokenizer = load_tokenizer(args.model)
        with DistributedModelForCausalLM.from_pretrained(
            args.model,
            initial_peers=swarm.initial_peers,
            local_blocks=args.local_blocks,
            allow_quantized=args.quantize != "none",
        ) as model:
            chat = [{"role": "user", "content": args.prompt}]
            inputs = tokenizer.apply_chat_template(
                chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
            assert isinstance(inputs, BatchEncoding)
            print(f"\nuser: {args.prompt}\nassistant: ", end="", flush=True)
            streamer = _TimedStreamer(tokenizer)
            start = time.perf_counter()
            model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, streamer=streamer)
            gaps = [b - a for a, b in zip([start, *streamer.times], streamer.times, strict=False)]
            decode = gaps[1:] or gaps
            print(
                f"\n{len(gaps)} tokens; first token (prefill of {inputs['input_ids'].shape[1]} tokens) "
                f"{gaps[0] * 1000:.0f} ms; per token after that: median {statistics.median(decode) * 1000:.1f} ms, "
                f"max {max(decode) * 1000:.1f} ms ({1 / statistics.mean(decode):.1f} tokens/s)"
            )
            print("route:")
            for hop in model.route:
                print(f"  blocks {hop.start}:{hop.end} -> peer {hop.peer_id} ({describe(hop.dtype, hop.quantization)})")
    print("swarm shut down.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

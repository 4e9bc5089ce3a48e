"""How many bytes a volunteer downloads to serve a span of a Hub model, and a client to use it, computed from the
checkpoint's index and the Hub's file list (nothing but config, tokenizer and index is downloaded):

    python scripts/hub_span_bytes.py Qwen/Qwen3-8B --blocks 0:9 18:27
    python scripts/hub_span_bytes.py meta-llama/Llama-3.1-70B-Instruct --blocks 0:8 --token hf_...

Prints one row per span (blocks, shards, bytes, share of the whole checkpoint), then the client's row (embeddings,
final norm and head). ``HF_ENDPOINT``, ``HF_HUB_CACHE`` and ``HF_TOKEN`` are honoured."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.families.local import client_names  # noqa: E402
from swarm.families.spec import family_of  # noqa: E402
from swarm.families.weights import layer_prefix  # noqa: E402
from swarm.hub import HubSettings, add_token_flag, hub_model, shards_for, use_token  # noqa: E402
from swarm.hub_snapshot import snapshot_of  # noqa: E402
from swarm.ids import parse_span  # noqa: E402
from swarm.model_files import load_config, weight_map  # noqa: E402


def rows(name: str, spans: list[str]) -> list[tuple[str, int, int, float]]:
    """(what, shards, bytes, share of all weight bytes) per span, then the client's."""
    folder = hub_model(name, HubSettings.from_env())
    snap = snapshot_of(folder)
    assert snap is not None
    mapping = weight_map(folder)
    family = family_of(load_config(folder))
    sizes = {f: snap.resolved.files[f].size for f in set(mapping.values())}
    total = sum(sizes.values())
    out = []
    for text in spans:
        span = parse_span(text)
        files = shards_for(mapping, [layer_prefix(family, i, mapping) for i in span])
        nbytes = sum(sizes[f] for f in files)
        out.append((f"blocks {span}", len(files), nbytes, nbytes / total))
    files = shards_for(mapping, [], client_names(family, mapping))  # what ``from_pretrained`` reads
    nbytes = sum(sizes[f] for f in files)
    out.append(("client (embeddings, norm, head)", len(files), nbytes, nbytes / total))
    out.append(("the whole checkpoint", len(sizes), total, 1.0))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="ORG/NAME[@REVISION]")
    p.add_argument("--blocks", nargs="+", default=["0:1"], metavar="A:B")
    add_token_flag(p)
    args = p.parse_args(argv)
    use_token(args.token)
    print(f"| {args.model} | shards | GB | share |\n|---|---:|---:|---:|")
    for what, shards, nbytes, share in rows(args.model, args.blocks):
        print(f"| {what} | {shards} | {nbytes / 1e9:.2f} | {share:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

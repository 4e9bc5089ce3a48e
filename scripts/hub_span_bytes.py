"""How many bytes a volunteer downloads to serve a span of a Hub model, and a client to use it, computed from the
checkpoint's index and the Hub's file list (nothing but config, tokenizer and index is downloaded):

    python scripts/hub_span_bytes.py Qwen/Qwen3-8B --blocks 0:9 18:27
    python scripts/hub_span_bytes.py meta-llama/Llama-3.1-70B-Instruct --blocks 0:8 --token hf_...
    GIT_LFS_SKIP_SMUDGE=1 git clone https://huggingface.co/Qwen/Qwen3-8B /tmp/q
    python scripts/hub_span_bytes.py --clone /tmp/q --blocks 0:9

``--clone`` reads a Git clone of the model's Hub repository made without its large files: each weight file is then
Git LFS's pointer, which holds the file's size and sha256 as the Hub lists them, and nothing is downloaded.

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

LFS_POINTER = "version https://git-lfs.github.com/spec/v1"


def hub_sizes(name: str) -> tuple[Path, dict[str, int]]:
    """The folder holding config and index of Hub model ``name``, and each weight file's size by the Hub's list."""
    folder = hub_model(name, HubSettings.from_env())
    snap = snapshot_of(folder)
    assert snap is not None
    return folder, {f: snap.resolved.files[f].size for f in set(weight_map(folder).values())}


def clone_sizes(folder: Path) -> tuple[Path, dict[str, int]]:
    """Each weight file's size from its Git LFS pointer in a clone made with ``GIT_LFS_SKIP_SMUDGE=1``."""
    sizes = {}
    for file in set(weight_map(folder).values()):
        lines = (folder / file).read_text(errors="replace").splitlines()
        fields = dict(line.split(" ", 1) for line in lines[1:] if " " in line)
        if not lines or lines[0] != LFS_POINTER or not fields.get("size", "").isdigit():
            raise SystemExit(f"{folder / file} is not a Git LFS pointer: clone with GIT_LFS_SKIP_SMUDGE=1")
        sizes[file] = int(fields["size"])
    return folder, sizes


def rows(folder: Path, sizes: dict[str, int], spans: list[str]) -> list[tuple[str, int, int, float]]:
    """(what, shards, bytes, share of all weight bytes) per span, then the client's."""
    mapping = weight_map(folder)
    family = family_of(load_config(folder))
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
    p.add_argument("model", nargs="?", help="ORG/NAME[@REVISION]")
    p.add_argument("--clone", type=Path, help="a Git clone of the Hub repository without its LFS files, instead")
    p.add_argument("--blocks", nargs="+", default=["0:1"], metavar="A:B")
    add_token_flag(p)
    args = p.parse_args(argv)
    if (args.model is None) == (args.clone is None):
        p.error("name a model or a --clone, one of them")
    use_token(args.token)
    folder, sizes = clone_sizes(args.clone) if args.clone else hub_sizes(args.model)
    print(f"| {args.model or args.clone.name} | shards | GB | share |\n|---|---:|---:|---:|")
    for what, shards, nbytes, share in rows(folder, sizes, args.blocks):
        print(f"| {what} | {shards} | {nbytes / 1e9:.2f} | {share:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

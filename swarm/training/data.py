"""Training text as fixed-length samples in a reproducible order, addressed by position (samples consumed so far),
so a checkpoint only needs that number to resume exactly where it stopped."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from swarm.errors import BadInputError

TEXT_SUFFIXES = (".py", ".txt", ".rst", ".md")


def default_corpus(max_bytes: int = 2_000_000) -> list[Path]:
    """Text every machine has: the Python standard library's own top-level modules (sorted, up to ``max_bytes``)."""
    files, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        files.append(path)
        total += path.stat().st_size
        if total >= max_bytes:
            break
    return files


def corpus_files(path: Path | None) -> list[Path]:
    if path is None:
        return default_corpus()
    path = Path(path).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if files:
            return files
    raise BadInputError(f"no training text at {path} (a file, or a folder of {', '.join(TEXT_SUFFIXES)} files)")


def tokenize(files: list[Path], tokenizer: str, vocab_size: int) -> torch.Tensor:
    """One stream of token ids: UTF-8 bytes for ``tokenizer = "bytes"``, else the named model's tokenizer."""
    text = "\n".join(p.read_text(errors="replace") for p in files)
    if tokenizer == "bytes":
        ids = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int64)
    else:
        from swarm.tokenizer import load_tokenizer

        ids = torch.tensor(load_tokenizer(tokenizer)(text)["input_ids"], dtype=torch.int64)
    if int(ids.max()) >= vocab_size:
        raise BadInputError(f"token id {int(ids.max())} does not fit the model's vocabulary of {vocab_size}")
    return ids


class Samples:
    """Non-overlapping windows of ``seq_len`` tokens, shuffled per epoch by the run's seed."""

    def __init__(self, ids: torch.Tensor, seq_len: int, seed: int, shard: tuple[int, int] = (0, 1)) -> None:
        """``shard=(k, n)``: this reader takes every n-th sample starting at the k-th, so n trainers fed the same
        text and seed never process the same sample."""
        self.count = ids.numel() // seq_len
        if self.count < 1:
            raise BadInputError(f"the text has {ids.numel()} tokens, fewer than one sample of {seq_len}")
        self.windows = ids[: self.count * seq_len].view(self.count, seq_len)
        self.seed = seed
        self.shard = shard
        if not 0 <= shard[0] < shard[1]:
            raise BadInputError(f"shard {shard[0]}/{shard[1]} does not exist")
        self._orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(self.count, generator=gen)}
        return self._orders[epoch]

    def batch(self, position: int, size: int) -> torch.Tensor:
        """Samples ``position`` .. ``position + size - 1`` of the endless shuffled sequence."""
        k, n = self.shard
        indices = (i * n + k for i in range(position, position + size))
        rows = [self._order(i // self.count)[i % self.count] for i in indices]
        return self.windows[torch.stack(rows)]

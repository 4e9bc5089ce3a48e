"""Tokenizer and chat template, loaded by the same model name as the model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from swarm.config import default_cache_dir, load_model_card
from swarm.model_files import load_tokenizer as _load_from_folder
from swarm.model_files import model_folder

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(name_or_path: str, cache_dir: Path | None = None) -> PreTrainedTokenizerBase:
    return _load_from_folder(model_folder(load_model_card(name_or_path), cache_dir or default_cache_dir()))

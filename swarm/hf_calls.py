"""Typed adapters for the few transformers functions the product calls that transformers leaves unannotated: each
states the signature once, so its callers stay checked (``mypy --strict`` refuses a call to an untyped function).
Assigning the untyped function to a typed ``Callable`` is where the signature is stated; transformers is imported
lazily, as its callers did, so importing this module costs nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel


def model_from_config(config: PretrainedConfig, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_config``: a causal LM of ``config``'s family, freshly initialised."""
    from transformers import AutoModelForCausalLM

    build: Callable[..., PreTrainedModel] = AutoModelForCausalLM.from_config
    return build(config) if dtype is None else build(config, dtype=dtype)


def output_embeddings(model: PreTrainedModel) -> torch.nn.Module | None:
    """``PreTrainedModel.get_output_embeddings``: the LM head, or None for a model without one."""
    get: Callable[[], torch.nn.Module | None] = model.get_output_embeddings
    return get()


def init_weights(model: PreTrainedModel, module: torch.nn.Module) -> None:
    """``PreTrainedModel._init_weights``: the family's initialiser, applied to one module."""
    init: Callable[[torch.nn.Module], None] = model._init_weights
    init(module)


def disable_progress_bar() -> None:
    """transformers' process-wide switch for its progress bars."""
    from transformers.utils import logging as transformers_logging

    switch: Callable[[], None] = transformers_logging.disable_progress_bar
    switch()

"""swarm: run and fine-tune large language models on GPUs joined over the internet.

The client entry point is ``DistributedModelForCausalLM``; it is imported lazily so ``import swarm`` stays cheap.
"""

from typing import TYPE_CHECKING

from swarm.version import __version__

__all__ = ["DistributedModelForCausalLM", "load_tokenizer", "__version__"]

if TYPE_CHECKING:
    from swarm.client.model import DistributedModelForCausalLM
    from swarm.tokenizer import load_tokenizer


def __getattr__(name: str) -> object:
    if name == "DistributedModelForCausalLM":
        from swarm.client.model import DistributedModelForCausalLM

        return DistributedModelForCausalLM
    if name == "load_tokenizer":
        from swarm.tokenizer import load_tokenizer

        return load_tokenizer
    raise AttributeError(name)

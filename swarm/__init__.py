"""swarm: run and fine-tune large language models on GPUs joined over the internet.

The client entry point is ``DistributedModelForCausalLM``; it is imported lazily so ``import swarm`` stays cheap.
"""

import logging
from typing import TYPE_CHECKING

from swarm.version import __version__

# transformers imports torchao whenever it is installed (it is: quantized blocks, ``peers.blocks.quantize``), and
# torchao's import warns that it cannot load its CUDA-only extensions and makes torch warn about a deprecated call:
# three lines of noise on every process's stderr, outside any log format (JSON logs must stay JSON). Only those two
# loggers are quietened, before anything can import transformers; their errors still show.
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)

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

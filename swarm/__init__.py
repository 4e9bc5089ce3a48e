"""swarm: run and fine-tune large language models on GPUs joined over the internet.

The client entry point is ``DistributedModelForCausalLM``; it is imported lazily so ``import swarm`` stays cheap.
"""

__version__ = "0.1.0"

__all__ = ["DistributedModelForCausalLM", "load_tokenizer", "__version__"]


def __getattr__(name: str):
    if name == "DistributedModelForCausalLM":
        from swarm.client.model import DistributedModelForCausalLM

        return DistributedModelForCausalLM
    if name == "load_tokenizer":
        from swarm.tokenizer import load_tokenizer

        return load_tokenizer
    raise AttributeError(name)

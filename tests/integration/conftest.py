"""One fork server for the session's swarms: every peer ``running_swarm`` starts is forked from a process that has
already imported torch, transformers and hivemind (``harness.fork_server``), instead of paying those imports again."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.fork_server import ForkServer
from swarm.training.data import corpus_files, tokenize
from tests.helpers import swarms
from tests.helpers.models import local_reference


@pytest.fixture(scope="session", autouse=True)
def fork_server() -> Iterator[ForkServer]:
    server = ForkServer()
    swarms.SPAWNERS.append(server)
    try:
        yield server
    finally:
        swarms.SPAWNERS.remove(server)
        server.close()


@pytest.fixture(scope="module")
def folder(tiny_models) -> str:
    """The tiny Llama's folder: what most loopback swarms serve."""
    return str(tiny_models["llama"])


@pytest.fixture(scope="module")
def corpus_ids():
    """The shipped corpus as byte tokens: what the pre-training tests train on."""
    return tokenize(corpus_files(None), "bytes", 256)


@pytest.fixture(scope="module")
def ref(tiny_models):
    """A local Hugging Face run of the same weights, to compare the swarm's outputs with."""
    return local_reference(tiny_models["llama"])

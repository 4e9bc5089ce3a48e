"""``/v1/embeddings``: each input's last hidden states (the last block's output through the swarm, then the final
norm on this client: Hugging Face's ``hidden_states[-1]``), pooled as the model's card says, L2-normalised.

The card is sentence-transformers' ``1_Pooling/config.json`` in the model's folder when it has one (mean or last
token); a plain causal LM has none and is mean-pooled (every token counts; a causal model's last token alone sees
the whole input, but mean pooling is the steadier default for models not trained as embedders). ``dimensions`` keeps
the first N values and normalises again, as OpenAI's shortened embeddings are."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Literal

import torch

from swarm.api import errors
from swarm.api.engine import ServedModel
from swarm.api.replies import Embedding, EmbeddingList, EmbeddingUsage
from swarm.api.schema import EmbeddingRequest

Pooling = Literal["mean", "last"]


def pooling_of(folder: Path | None) -> Pooling:
    """What the model's card says: sentence-transformers' pooling config, else mean."""
    card = folder / "1_Pooling" / "config.json" if folder is not None else None
    if card is not None and card.is_file():
        modes = json.loads(card.read_text())
        if modes.get("pooling_mode_lasttoken"):
            return "last"
        other = [k for k, v in modes.items() if k.startswith("pooling_mode_") and v and k != "pooling_mode_mean_tokens"]
        if other:  # CLS, max, weighted: what the card asks for is not done here, and not replaced silently
            raise errors.bad_request(f"the model card asks for {', '.join(sorted(other))}: not offered here", "model")
    return "mean"


def pool(hidden: torch.Tensor, how: Pooling) -> torch.Tensor:
    """[n, hidden] -> [hidden], unit length."""
    vector = hidden[-1] if how == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector.float(), dim=-1)


MAX_TOKENS = 32_768  # tokens of one request's inputs together


def embed(served: ServedModel, req: EmbeddingRequest, deadline: float = float("inf")) -> EmbeddingList:
    """The request's embeddings, one input at a time through the swarm (runs on a worker thread), given up once
    ``deadline`` (monotonic) passes."""
    model = served.model
    width = int(model.config.hidden_size)
    if req.dimensions is not None and req.dimensions > width:
        raise errors.bad_request(f"dimensions is {req.dimensions}; {served.name} has {width}", param="dimensions")
    how = pooling_of(model.folder)
    norm = getattr(model.model, model.family.spec.norm) if model.family.spec.norm else None
    data, tokens = [], 0
    inputs = [served.text_ids(item) if isinstance(item, str) else item for item in req.inputs()]
    if sum(len(ids) for ids in inputs) > MAX_TOKENS:
        raise errors.bad_request(f"the inputs hold more than {MAX_TOKENS} tokens together", param="input")
    for i, ids in enumerate(inputs):
        if time.monotonic() > deadline:
            raise errors.ApiError(
                408, "the request ran out of time", type="server_error", code="timeout", outcome="timeout"
            )
        if any(not 0 <= t < served.n_vocab for t in ids):
            raise errors.bad_request(f"input {i} holds a token id past the vocabulary ({served.n_vocab})", "input")
        if len(ids) > served.context:
            raise errors.context_too_long(len(ids), 0, served.context)
        with torch.inference_mode():
            hidden = model.hidden_states(torch.tensor([ids]), block=served.num_blocks - 1)[0]
            if norm is not None:
                hidden = norm(hidden)
        vector = pool(hidden, how)
        if req.dimensions is not None:
            vector = torch.nn.functional.normalize(vector[: req.dimensions], dim=-1)
        tokens += len(ids)
        data.append(Embedding(index=i, embedding=encode(vector, req.encoding_format)))
    return EmbeddingList(data=data, model=served.name, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


def encode(vector: torch.Tensor, fmt: Literal["float", "base64"]) -> list[float] | str:
    if fmt == "float":
        return [float(v) for v in vector.tolist()]
    return base64.b64encode(vector.float().numpy().astype("<f4").tobytes()).decode()

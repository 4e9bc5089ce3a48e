"""``DistributedModelForCausalLM``: a Hugging Face causal LM whose decoder blocks run in the swarm.

Only the embeddings, the final norm and the LM head live here (token ids and logits never leave this machine);
hidden states go to the servers. Forward, backward and ``generate`` follow the Hugging Face API."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from swarm.client.inference_session import InferenceSession
from swarm.client.loop import LoopThread
from swarm.client.remote import Remote
from swarm.client.retry import Retrier
from swarm.client.sequential import RemoteBlocks
from swarm.client.swarm_view import SwarmView
from swarm.config import ClientConfig, Timing, default_cache_dir, load_model_card
from swarm.dht import start_dht
from swarm.errors import BadInputError
from swarm.model_files import load_config, model_folder, read_tensors, weight_map

log = logging.getLogger(__name__)

LOCAL_PREFIXES = ("model.embed_tokens.", "model.norm.", "lm_head.")


class _Swarm:
    """The client's connection: DHT (client mode), event loop, view, retry helper; closed with the model."""

    def __init__(self, cfg: ClientConfig, model_id: str, num_blocks: int, fingerprint: str | None) -> None:
        self.dht, _ = start_dht(initial_peers=cfg.initial_peers, client_mode=True, timeout=cfg.timing.open_timeout * 6)
        try:
            self.loop = LoopThread()
            self.remote = Remote(self.loop.run(self.dht.replicate_p2p()), cfg.direct)
            self.view = SwarmView(self.dht, model_id, num_blocks, cfg.timing, fingerprint, cfg.hop_latency_s)
            self.retrier = Retrier(self.view, cfg.timing)
            self.blocks = RemoteBlocks(self.view, self.remote, self.loop, self.retrier, cfg.timing)
        except BaseException:
            self.dht.shutdown()
            raise

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.loop.run(self.remote.p2p.shutdown(), 5)
        self.loop.close()
        self.dht.shutdown()


class DistributedModelForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = PretrainedConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _supports_sdpa = True

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        # Build the family's full model on the meta device (no memory) and keep only its local parts.
        with torch.device("meta"):
            full = AutoModelForCausalLM.from_config(config)
        self.model = torch.nn.Module()
        self.model.embed_tokens = full.model.embed_tokens
        self.model.norm = full.model.norm
        self.lm_head = full.lm_head
        self._swarm: _Swarm | None = None
        self._session: InferenceSession | None = None

    # ---- loading ------------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        initial_peers=(),
        dtype: torch.dtype = torch.float32,
        timing: Timing | None = None,
        cache_dir: Path | None = None,
        fingerprint: str | None = None,
        direct: str = "auto",
        **unused,
    ) -> DistributedModelForCausalLM:
        """Connect to a swarm serving ``name_or_path`` (a model card name or a Hugging Face folder).

        ``direct``: use servers' plain-TCP data plane "auto" (only on loopback/private networks), "always" or
        "never" (libp2p only). ``fingerprint`` pins the exact weights; by default the best-covered ones are used.
        """
        if unused:
            raise BadInputError(f"unsupported arguments: {', '.join(unused)}")
        if not initial_peers:
            raise BadInputError("give initial_peers: multiaddrs of running swarm peers")
        if direct not in ("auto", "always", "never"):
            raise BadInputError("direct must be 'auto', 'always' or 'never'")
        cfg = ClientConfig(
            direct=direct,
            initial_peers=tuple(initial_peers),
            timing=timing or Timing(),
            cache_dir=cache_dir or default_cache_dir(),
        )
        card = load_model_card(name_or_path)
        folder = model_folder(card, cfg.cache_dir)
        config = load_config(folder)
        config._attn_implementation = "sdpa"
        model = cls(config)
        names = [k for k in weight_map(folder) if k.startswith(LOCAL_PREFIXES)]  # never the blocks' tensors
        state = read_tensors(folder, names)
        if "lm_head.weight" not in state:  # tied embeddings
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
        if getattr(config, "tie_word_embeddings", False):
            model.lm_head.weight = model.model.embed_tokens.weight
        model.name_or_path = card.name
        model.loaded_tensor_names = tuple(sorted(state))
        model.eval()
        model._swarm = _Swarm(cfg, card.name, config.num_hidden_layers, fingerprint)
        return model

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
        if self._swarm is not None:
            self._swarm.close()
            self._swarm = None

    def __enter__(self) -> DistributedModelForCausalLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def swarm(self) -> _Swarm:
        if self._swarm is None:
            raise BadInputError("this model is closed")
        return self._swarm

    @property
    def route(self):
        """The servers the last call went through."""
        return self._session.route if self._session is not None else self.swarm.blocks.last_route

    @property
    def failovers(self) -> int:
        return self.swarm.retrier.failovers

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    # ---- inference sessions -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def inference_session(self, max_length: int, batch_size: int = 1):
        """Server-side KV caches for up to ``max_length`` tokens; ``generate`` calls inside continue the session."""
        if self._session is not None:
            raise BadInputError("an inference session is already open on this model")
        session = InferenceSession(self.swarm.blocks, max_length, batch_size)
        self._session = session
        try:
            yield session
        finally:
            self._session = None
            session.close()

    def generate(self, inputs=None, *args, **kwargs):
        if kwargs.get("num_beams", 1) > 1 or getattr(kwargs.get("generation_config"), "num_beams", 1) > 1:
            raise BadInputError("beam search is not supported through the swarm yet; use greedy or sampling")
        kwargs["use_cache"] = False  # the cache lives on the servers, in the inference session
        ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
        if ids is None:
            raise BadInputError("generate needs input_ids")
        if self._session is not None:
            ids, kwargs = self._with_history(ids, kwargs)
            out = super().generate(ids, *args, **kwargs)
            self._session.conversation = out if isinstance(out, torch.Tensor) else out.sequences
            return out
        gen = kwargs.get("generation_config") or self.generation_config
        max_new = kwargs.get("max_new_tokens") or gen.max_new_tokens
        max_length = ids.shape[1] + max_new if max_new else (kwargs.get("max_length") or gen.max_length)
        batch = ids.shape[0] * kwargs.get("num_return_sequences", getattr(gen, "num_return_sequences", 1) or 1)
        with self.inference_session(max_length=max_length, batch_size=batch):
            return super().generate(ids, *args, **kwargs)

    def _with_history(self, ids: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, dict]:
        """Inside a session, ``generate`` takes the whole conversation or only its continuation; either way it
        returns the whole conversation, and only unseen tokens go to the servers."""
        session = self._session
        # the last generate's output ends with a token the servers have not seen yet
        history = session.conversation if session.conversation is not None else session.tokens
        if history is None:
            return ids, kwargs
        seen = history.shape[1]
        if ids.shape[1] > seen and torch.equal(ids[:, :seen], history):
            return ids, kwargs
        mask = kwargs.get("attention_mask")
        if mask is not None:
            prev = torch.ones_like(history)
            if session._mask is not None:
                prev[:, : session._mask.shape[1]] = session._mask[:, :seen]
            kwargs = dict(kwargs, attention_mask=torch.cat([prev, mask.to(prev.dtype)], dim=1))
        return torch.cat([history, ids], dim=1), kwargs

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        # Whole sequences each step: ``forward`` sends the session only the tokens its servers have not seen.
        return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}

    # ---- forward ------------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        return_dict=True,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise BadInputError("give exactly one of input_ids or inputs_embeds")
        if self._session is not None:
            if input_ids is None:
                raise BadInputError("inside an inference session, pass input_ids")
            hidden = self._session_step(input_ids, attention_mask, position_ids)
        else:
            embeds = inputs_embeds if inputs_embeds is not None else self.model.embed_tokens(input_ids)
            padded = attention_mask is not None and not bool(attention_mask.all())
            hidden = self.swarm.blocks(embeds, attention_mask if padded else None, position_ids)
        logits = self.lm_head(self.model.norm(hidden))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def _session_step(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        session = self._session
        seen, (batch, length) = session.position, input_ids.shape
        if seen and session.tokens is not None and length > seen and torch.equal(input_ids[:, :seen], session.tokens):
            new = input_ids[:, seen:]  # the Hugging Face way: the whole sequence so far
            full_mask = attention_mask
        else:
            new = input_ids  # only the continuation
            prev = session._mask if session._mask is not None else torch.ones(batch, seen, dtype=torch.int64)
            now = attention_mask if attention_mask is not None else torch.ones(batch, length, dtype=torch.int64)
            full_mask = torch.cat([prev[:, :seen], now.to(torch.int64)], dim=1) if seen else attention_mask
        n = new.shape[1]
        if position_ids is not None and position_ids.shape[1] != n:
            position_ids = position_ids[:, -n:]
        padded = full_mask is not None and not bool(full_mask.all())
        hidden = session.step(self.model.embed_tokens(new), full_mask if padded else None, position_ids)
        session.tokens = new if session.tokens is None else torch.cat([session.tokens, new], dim=1)
        return hidden

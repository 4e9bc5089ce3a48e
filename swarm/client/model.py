"""``DistributedModelForCausalLM``: a Hugging Face causal LM whose decoder blocks run in the swarm.

Only the embeddings, the final norm and the LM head live here (token ids and logits never leave this machine);
hidden states go to the servers. Forward, backward and ``generate`` follow the Hugging Face API. With ``tuning``,
the model also owns trainable extras (LoRA for the remote blocks, input or deep prompts) and nothing else trains."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from swarm.client import peft_format
from swarm.client.adapters import ClientAdapters
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
from swarm.tuning import TuningSpec, linear_modules, resolve_targets

log = logging.getLogger(__name__)

LOCAL_PREFIXES = ("model.embed_tokens.", "model.norm.", "lm_head.")


class _Swarm:
    """The client's connection: DHT (client mode), event loop, view, retry helper; closed with the model."""

    def __init__(self, cfg: ClientConfig, model_id: str, num_blocks: int, fingerprint: str | None) -> None:
        self.dht, self.validator = start_dht(
            initial_peers=cfg.initial_peers, client_mode=True, timeout=cfg.timing.open_timeout * 6
        )
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
            self.loop.loop.call_soon_threadsafe(self.remote.close)
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
        self._block_linears = linear_modules(full.model.layers[0])  # LoRA's possible targets, with their shapes
        self.adapters: ClientAdapters | None = None
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
        tuning: str | None = None,
        adapter: str | Path | None = None,
        lora_rank: int = 8,
        lora_alpha: float = 8.0,
        lora_targets=("q_proj", "v_proj"),
        num_prompt_tokens: int = 16,
        **unused,
    ) -> DistributedModelForCausalLM:
        """Connect to a swarm serving ``name_or_path`` (a model card name or a Hugging Face folder).

        ``direct``: use servers' plain-TCP data plane "auto" (only on loopback/private networks), "always" or
        "never" (libp2p only). ``fingerprint`` pins the exact weights; by default the best-covered ones are used.

        ``tuning``: "lora" (``lora_rank``, ``lora_alpha``, ``lora_targets`` as in PEFT, whose defaults these are),
        "prompt" or "deep_prompt" (``num_prompt_tokens``); ``adapter``: a PEFT adapter folder to start from (its
        config sets the tuning). The model's own weights are then frozen; only the adapter's parameters train.
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
        if tuning is not None or adapter is not None:
            spec = peft_format.read_spec(adapter) if adapter is not None else None
            if spec is not None and tuning not in (None, spec.mode):
                raise BadInputError(f"tuning={tuning!r}, but the adapter in {adapter} is {spec.mode!r}")
            if spec is None:
                spec = TuningSpec(tuning, lora_rank, lora_alpha, tuple(lora_targets), num_prompt_tokens)
            model._attach_adapters(spec, adapter)
        model._swarm = _Swarm(cfg, card.name, config.num_hidden_layers, fingerprint)
        model._swarm.blocks.adapters = model.adapters
        return model

    def _attach_adapters(self, spec: TuningSpec, folder) -> None:
        """Build (and fill from ``folder``) the adapter; shapes and targets are checked here, before any training."""
        paths = resolve_targets(spec.lora_targets, self._block_linears) if spec.mode == "lora" else ()
        adapters = ClientAdapters(
            spec, {p: self._block_linears[p] for p in paths}, self.config.num_hidden_layers, self.config.hidden_size
        )
        if folder is not None:
            peft_format.load_into(adapters, folder)
        for p in self.parameters():
            p.requires_grad_(False)
        self.adapters = adapters

    def save_adapter(self, folder: str | Path) -> None:
        """Write the adapter in the PEFT format (``adapter_config.json`` + ``adapter_model.safetensors``)."""
        if self.adapters is None:
            raise BadInputError("this model has no adapter: load it with tuning=... to train one")
        peft_format.save(self.adapters, Path(folder), self.name_or_path, self.config.num_attention_heads)

    @property
    def prompt_tokens(self) -> int:
        return self.adapters.spec.prompt_tokens if self.adapters is not None else 0

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
        if self._swarm is not None:
            self._swarm.blocks.release_adapters()
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
        session = InferenceSession(self.swarm.blocks, max_length + self.prompt_tokens, batch_size)
        session.prefix = self.prompt_tokens
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
                known = session._mask[:, session.prefix : session.prefix + seen]
                prev[:, : known.shape[1]] = known
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
            if self.prompt_tokens:
                embeds, attention_mask, position_ids, labels = self._with_prompts(
                    embeds, attention_mask, position_ids, labels
                )
            padded = attention_mask is not None and not bool(attention_mask.all())
            hidden = self.swarm.blocks(embeds, attention_mask if padded else None, position_ids)
        logits = self.lm_head(self.model.norm(hidden))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        if self.prompt_tokens and self._session is None:
            logits = logits[:, self.prompt_tokens :]  # one logit row per input token, as without prompts
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def _with_prompts(self, embeds, attention_mask, position_ids, labels):
        """Prepend the trainable prompts as PEFT's prompt tuning does: attended by every token, no labels."""
        n, batch = self.prompt_tokens, embeds.shape[0]
        prompts = self.adapters.prompts.to(embeds.dtype).unsqueeze(0).expand(batch, -1, -1)
        embeds = torch.cat([prompts, embeds], dim=1)
        if attention_mask is not None:
            ones = torch.ones(batch, n, dtype=attention_mask.dtype, device=attention_mask.device)
            attention_mask = torch.cat([ones, attention_mask], dim=1)
        if position_ids is not None:
            position_ids = torch.cat([torch.arange(n).expand(batch, -1), position_ids + n], dim=1)
        if labels is not None:
            labels = torch.cat([torch.full((batch, n), -100, dtype=labels.dtype), labels], dim=1)
        return embeds, attention_mask, position_ids, labels

    def _session_step(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        session = self._session
        seen, (batch, length) = session.position - session.prefix if session.position else 0, input_ids.shape
        if seen and session.tokens is not None and length > seen and torch.equal(input_ids[:, :seen], session.tokens):
            new = input_ids[:, seen:]  # the Hugging Face way: the whole sequence so far
            full_mask = attention_mask
        else:
            new = input_ids  # only the continuation
            prev = session._mask[:, session.prefix :] if session._mask is not None else torch.ones(batch, seen).long()
            now = attention_mask if attention_mask is not None else torch.ones(batch, length, dtype=torch.int64)
            full_mask = torch.cat([prev[:, :seen], now.to(torch.int64)], dim=1) if seen else attention_mask
        n = new.shape[1]
        if position_ids is not None and position_ids.shape[1] != n:
            position_ids = position_ids[:, -n:]
        embeds = self.model.embed_tokens(new)
        first = session.position == 0
        if session.prefix:  # the prompts go in front of the first step; later positions shift past them
            if first:
                embeds, full_mask, position_ids, _ = self._with_prompts(embeds, full_mask, position_ids, None)
            else:
                ones = torch.ones(batch, session.prefix, dtype=torch.int64)
                full_mask = None if full_mask is None else torch.cat([ones, full_mask.to(torch.int64)], dim=1)
                position_ids = None if position_ids is None else position_ids + session.prefix
        padded = full_mask is not None and not bool(full_mask.all())
        hidden = session.step(embeds, full_mask if padded else None, position_ids)
        session.tokens = new if session.tokens is None else torch.cat([session.tokens, new], dim=1)
        return hidden[:, session.prefix :] if first else hidden

"""``DistributedModelForCausalLM``: a Hugging Face causal LM whose decoder blocks run in the swarm.

Only the embeddings, the final norm and the LM head live here (token ids and logits never leave this machine);
hidden states go to the servers (after the first ``local_blocks`` blocks, run here where the user asks). Forward,
backward and ``generate`` follow the Hugging Face API. With ``tuning``, the model also owns trainable extras (LoRA for
the remote blocks, input or deep prompts) and nothing else trains."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Literal, Unpack

import torch
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from swarm.client import generation
from swarm.client.connected import Connected, Own, connect
from swarm.client.connection import SwarmConnection
from swarm.client.executor import Context, Handler
from swarm.client.generation import OpenSessions, Passed
from swarm.client.load_options import Loading, LoadOptions
from swarm.client.local_blocks import LocalBlocks
from swarm.client.passes.sequential import RemoteChain
from swarm.client.runner import PlanRunner
from swarm.client.session.inference_session import InferenceSession
from swarm.client.speculative.loop import Trace
from swarm.client.speculative.speculator import Speculator
from swarm.client.tuning.adapters import ClientAdapters
from swarm.client.tuning.setup import build_adapters, save_adapters
from swarm.config import ClientConfig, load_model_card
from swarm.errors import BadInputError
from swarm.families import local
from swarm.families.selfcheck import require_exact
from swarm.families.spec import Family, family_of
from swarm.hop import Hop
from swarm.identity import Signed
from swarm.model_files import fingerprint_groups, load_config, model_folder, read_tensors, weight_map
from swarm.plan.ir import Plan
from swarm.protocol import TrainTag
from swarm.quantization import accepted_formats
from swarm.tuning import TuningSpec, linear_modules


class DistributedModelForCausalLM(  # type: ignore[no-untyped-call]  # transformers' __init_subclass__: unannotated
    PreTrainedModel, GenerationMixin
):
    """The model's own modules (what Hugging Face's API asks of it), and, while connected, its parts
    (``swarm.client.connected``): the open sessions, the procedures and speculative decoding, each its own object."""

    config_class = PretrainedConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _supports_sdpa = True

    def __init__(self, config: PretrainedConfig) -> None:
        family = family_of(config)  # before transformers sets its own attention choice on ``config``
        super().__init__(config)
        # The family's causal LM without layers, on the meta device (no memory): its base model (embeddings, learned
        # positions, final norm: ``self.model``, whatever the family calls it) and its head are the local parts.
        self.family: Family = family
        lm = local.local_model(self.family, device="meta")
        self.model: PreTrainedModel = local.base_of(self.family, lm)
        self.lm_head: torch.nn.Module = local.head_of(lm)
        self.beside = torch.nn.ModuleDict(local.beside_of(self.model))  # the LM's other modules (ModernBERT-decoder)
        with torch.device("meta"):  # LoRA's possible targets, with their shapes
            self._block_linears = linear_modules(self.family.build_layer(0))
        self.adapters: ClientAdapters | None = None
        self.loaded_tensor_names: tuple[str, ...] = ()
        self.local_blocks: LocalBlocks | None = None  # the first blocks, run on this client (``local_blocks=N``)
        self.folder: Path | None = None  # the model folder it was loaded from (None: built from parts)
        self._parts: Connected | None = None  # while connected

    # ---- loading ------------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(  # type: ignore[override]  # a swarm client takes other arguments than a local model
        cls, name_or_path: str, **options: Unpack[LoadOptions]
    ) -> DistributedModelForCausalLM:
        """Connect to a swarm serving ``name_or_path`` (a model card name or a Hugging Face folder). The options
        (``swarm.client.load_options.LoadOptions``, each explained there) group into the swarm's ``ClientConfig``,
        the weights (``dtype``, ``fingerprint``, ``allow_quantized``) and the tuning (``tuning``, ``adapter``,
        ``lora_*``, ``num_prompt_tokens``)."""
        load = Loading.of(options)
        card = load_model_card(name_or_path)
        folder = model_folder(card, load.client.cache_dir)
        config = load_config(folder)
        dtype = load.weights.dtype
        require_exact(config, dtype)  # the family's local parts and spans reproduce Hugging Face, or this is refused
        model = cls(config)
        names = local.client_names(model.family, weight_map(folder))  # never the blocks' tensors
        model._load_local({names[k]: v.to(dtype) for k, v in read_tensors(folder, list(names)).items()})
        if load.client.local_blocks:
            model.local_blocks = LocalBlocks.load(model.family, folder, load.client.local_blocks, dtype)
        model.name_or_path = card.name
        model.folder = folder
        model.train(False)
        spec = load.tuning.spec(model.family)
        if spec is not None:
            model._attach_adapters(spec, load.tuning.adapter)
        # only servers of these very weights are chained (a stranger's other weights never are, however fast)
        formats = accepted_formats(load.weights.allow_quantized)
        groups = fingerprint_groups(folder, load.client.cache_dir, formats)
        pinned = load.weights.fingerprint
        model._connect(load.client, card.name, frozenset({pinned}) if pinned else frozenset(groups), groups)
        return model

    @classmethod
    def local_tensor_names(cls, config: PretrainedConfig) -> list[str]:
        """The tensors a client holds (embeddings, final norm, LM head), by their Hugging Face names."""
        with torch.device("meta"):
            return list(cls(config).state_dict())

    @classmethod
    def from_parts(
        cls,
        config: PretrainedConfig,
        state: dict[str, torch.Tensor],
        *,
        model_id: str,
        client: ClientConfig,
        fingerprint: str | None = None,
    ) -> DistributedModelForCausalLM:
        """A client whose own tensors are ``state`` (all trainable) and whose blocks are served in the swarm under
        ``model_id``: what a pre-training trainer drives (``swarm.client.training``). ``client``: its configuration
        (``swarm.config.client_config``: its ``identity`` is the key file a closed run lists among its trainers;
        ``chain``: micro-batches pass from stage to stage, ``swarm/client/passes/chained.py``)."""
        model = cls(config)
        model.to_empty(device="cpu")
        model._load_local(state)
        model._connect(client, model_id, frozenset({fingerprint}) if fingerprint else None)
        return model

    def _load_local(self, state: dict[str, torch.Tensor]) -> None:
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        missing, unexpected = self.load_state_dict(state, strict=False, assign=True)
        missing = [n for n in missing if not (tied and n == "lm_head.weight")]  # tied: the embeddings, below
        if missing or unexpected:
            raise BadInputError(f"local tensors missing: {missing}; unexpected: {unexpected}")
        if tied:
            self.lm_head.weight = self.model.get_input_embeddings().weight
        local.restore_buffers(self.family, self.model)  # Gemma's embedding scale: in no checkpoint
        self.loaded_tensor_names = tuple(sorted(state))

    def _connect(
        self,
        cfg: ClientConfig,
        model_id: str,
        fingerprints: frozenset[str] | None,
        groups: Mapping[str, str] | None = None,
    ) -> None:
        weight = self.get_input_embeddings().weight  # hidden states travel in the embeddings' dtype
        assert isinstance(weight, torch.Tensor)
        own = Own(self, self.config, weight.dtype, self.family, self.adapters, self.local_blocks, self.folder)
        self._parts = connect(own, cfg, model_id, fingerprints, groups)

    def _attach_adapters(self, spec: TuningSpec, folder: str | Path | None) -> None:
        """Build (and fill from ``folder``) the adapter; shapes and targets are checked here, before any training.
        The model's own weights are frozen: only the adapter trains."""
        layers, hidden = int(self.config.num_hidden_layers), int(self.config.hidden_size)
        adapters = build_adapters(self.family, spec, self._block_linears, layers, hidden, folder)
        for p in self.parameters():
            p.requires_grad_(False)
        self.adapters = adapters

    def save_adapter(self, folder: str | Path) -> None:
        """Write the adapter in the PEFT format (``adapter_config.json`` + ``adapter_model.safetensors``)."""
        if self.adapters is None:
            raise BadInputError("this model has no adapter: load it with tuning=... to train one")
        heads = int(self.config.num_attention_heads)
        save_adapters(self.adapters, self.family, Path(folder), self.name_or_path or "", heads)

    @property
    def prompt_tokens(self) -> int:
        return self.adapters.spec.prompt_tokens if self.adapters is not None else 0

    def close(self) -> None:
        parts, self._parts = self._parts, None
        if parts is not None:
            parts.close()

    def __enter__(self) -> DistributedModelForCausalLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the parts, as users and tools see them -------------------------------------------------------------------
    @property
    def parts(self) -> Connected:
        """The model's parts while connected (``swarm.client.connected``)."""
        if self._parts is None:
            raise BadInputError("this model is closed")
        return self._parts

    @property
    def connection(self) -> SwarmConnection:
        """The connection to the swarm: its DHT store (``.store``), transport (``.remote``), view and retry helper."""
        return self.parts.conn

    @property
    def blocks(self) -> RemoteChain:
        return self.parts.blocks

    @property
    def runner(self) -> PlanRunner:
        """Compiles this model's procedures into plans and runs them (``swarm.client.runner``)."""
        return self.parts.runner

    @property
    def sessions(self) -> OpenSessions:
        """The inference sessions open on this model, one a thread (``swarm.client.generation``)."""
        return self.parts.sessions

    @property
    def speculator(self) -> Speculator:
        """Speculative decoding's drafters and hooks (``swarm.client.speculative.speculator``; the API's decode shares
        them)."""
        return self.parts.speculator

    @property
    def last_speculation(self) -> Trace | None:
        """The last speculative ``generate``'s trips, drafts and tokens."""
        return self.parts.speculator.last

    @property
    def route(self) -> list[Hop]:
        """The servers the last call went through."""
        session = self.sessions.current
        return session.route if session is not None else self.blocks.last_route

    @property
    def last_plan(self) -> Plan | None:
        """The plan the last call ran, as repaired when servers failed (``swarm.plan``)."""
        return self.blocks.last_plan

    @property
    def failovers(self) -> int:
        """How many times a call moved on after a failure (a peer banned and routed around)."""
        return self.connection.retrier.failovers

    @property
    def traffic(self) -> dict[str, int]:
        """Bytes sent and received over every message, all transports (``sent_bytes``, ``received_bytes``,
        ``adapter_bytes_sent``), and per compute call or inference step the codec its activations travelled in
        (``codec.none``, ``codec.block8``, ...: what ``auto`` chose)."""
        return dict(self.connection.remote.traffic)

    def get_input_embeddings(self) -> torch.nn.Module:
        embeddings: torch.nn.Module = self.model.get_input_embeddings()
        return embeddings

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    # ---- forward and generate (Hugging Face's API) ----------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool = True,
        train: TrainTag | None = None,
        **kwargs: object,
    ) -> CausalLMOutputWithPast:
        """Hugging Face's causal LM forward: a step of the thread's open inference session, or a plan run by the
        executor. ``train`` tags every remote call with a pre-training run's global step and the micro-batch's sample
        count (``swarm.client.training``)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise BadInputError("give exactly one of input_ids or inputs_embeds")
        parts = self.parts
        session = parts.sessions.current
        if session is not None:
            if input_ids is None:
                raise BadInputError("inside an inference session, pass input_ids")
            logits = parts.procedures.session_step(session, input_ids, attention_mask, position_ids)
            loss = self.causal_loss(logits, labels) if labels is not None else None
            return CausalLMOutputWithPast(loss=loss, logits=logits)
        padded = attention_mask is not None and not bool(attention_mask.all())
        inputs = {"input_ids": input_ids} if input_ids is not None else {}
        if inputs_embeds is not None:  # what the model adds to them (GPT-2's positions, BLOOM's norm), as HF's does
            inputs["inputs_embeds"] = local.finish_embedding(
                self.family, self.model, inputs_embeds, position_ids, mask=attention_mask if padded else None
            )
        if labels is not None:
            inputs["labels"] = labels
        keep = torch.is_grad_enabled() and (
            any(p.requires_grad for p in self.parameters())
            or (inputs_embeds is not None and inputs_embeds.requires_grad)
        )
        ctx = Context(attention_mask if padded else None, position_ids, train)
        params: Literal["adapter", "client"] = "adapter" if self.adapters else "client"
        out = parts.procedures.forward(inputs, ctx, keep=keep, prompts=self.prompt_tokens, params=params)
        return CausalLMOutputWithPast(loss=out.get("loss"), logits=out["logits"])

    def generate(self, inputs: torch.Tensor | None = None, *args: Passed, **kwargs: Passed) -> Passed:
        """Hugging Face's ``generate`` through the swarm. ``speculative``: decode with drafts verified several per
        trip (``swarm.client.speculative.loop``): "ngram", "first:N", a draft model's name or folder, a ``Drafter`` or a
        ``Speculation``; greedy gives plain greedy's tokens, sampling plain sampling's distribution."""
        speculative = kwargs.pop("speculative", None)
        if speculative is not None and speculative is not False:
            if args:
                raise BadInputError("speculative generate takes its options by keyword")
            return self.parts.speculator.generate(inputs, speculative, kwargs, self.generation_config)
        hf_generate = super().generate
        return generation.generate(hf_generate, self.sessions, self.generation_config, inputs, args, kwargs)

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs: object,
    ) -> dict[str, torch.Tensor | None]:
        # Whole sequences each step: ``forward`` sends the session only the tokens its servers have not seen.
        return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}

    def inference_session(self, max_length: int, batch_size: int = 1) -> AbstractContextManager[InferenceSession]:
        """Server-side KV caches for up to ``max_length`` tokens; ``generate`` calls inside continue the session.
        One session a thread: other threads open their own at the same time."""
        return self.sessions.open(max_length, batch_size)

    # ---- the other procedures (``swarm.client.procedures``) -----------------------------------------------------
    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Each token's log-probability given the tokens before it (evaluation, reward models): [batch, n - 1],
        float32; 0 where the token is padding (``attention_mask`` 0)."""
        return self.parts.procedures.score(input_ids, attention_mask)

    def hidden_states(
        self, input_ids: torch.Tensor, block: int, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The output of block ``block`` (0-based: Hugging Face's ``hidden_states[block + 1]``) for every token,
        [batch, n, hidden]: only blocks ``0..block`` are computed."""
        return self.parts.procedures.hidden_states(input_ids, block, attention_mask)

    def train_step(
        self,
        input_ids: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> float:
        """One fine-tuning step as its plan: forward keeping graphs, loss, backward through every server, then the
        plan's update phase (``optimizer`` steps and clears the gradients). Returns the loss."""
        labels = input_ids if labels is None else labels

        def loss() -> torch.Tensor:
            out: CausalLMOutputWithPast = self(input_ids=input_ids, labels=labels, attention_mask=attention_mask)
            assert out.loss is not None
            return out.loss

        return self.parts.procedures.train_step(loss, optimizer)

    def run_update(self, handlers: dict[str, Handler]) -> None:
        """The update phase of the last training plan (``optimizer_step``, ``average``), through ``handlers``."""
        self.parts.procedures.update(handlers)

    def pretraining(self, target_batch: int, average_every: int) -> None:
        """Mark this model as a pre-training trainer's: its training plans carry the global step's update."""
        self.parts.procedures.pretraining = (target_batch, average_every)

    def notify_step(self, step: int, proof: Signed | None = None, wait: bool = True) -> None:
        """Pre-training: tell every server that global step ``step`` has begun, with this client's signed progress
        (``proof``, or signed here; best effort). ``wait=False``: sent while the caller goes on."""
        self.parts.procedures.notify_step(step, proof, wait)

    # ---- the client's own modules, as the executor calls them (``swarm.client.runner.ModelParts``) ------------------
    def embed(
        self,
        ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        past: int = 0,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Embeddings, plus learned positions (GPT-2: ``position_ids``, by default ``past`` onwards); ``mask`` over
        every position of the session (None: no padding), for a family whose model counts positions along it."""
        return local.embed(self.family, self.model, ids, position_ids, past, mask)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return local.head(self.family, self.model, self.lm_head, hidden)  # final norm, head, logit soft-cap

    def prompt_vectors(self) -> torch.Tensor | None:
        return self.adapters.prompts if self.adapters is not None and self.prompt_tokens else None

    def causal_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        return loss

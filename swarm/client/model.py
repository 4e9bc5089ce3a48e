"""``DistributedModelForCausalLM``: a Hugging Face causal LM whose decoder blocks run in the swarm.

Only the embeddings, the final norm and the LM head live here (token ids and logits never leave this machine);
hidden states go to the servers (after the first ``local_blocks`` blocks, run here where the user asks). Forward,
backward and ``generate`` follow the Hugging Face API. With ``tuning``, the model also owns trainable extras (LoRA for
the remote blocks, input or deep prompts) and nothing else trains."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from swarm.client.adapters import AdapterDelivery, ClientAdapters
from swarm.client.connection import SwarmConnection
from swarm.client.executor import Context
from swarm.client.generation import Sessions
from swarm.client.local_blocks import LocalBlocks
from swarm.client.procedures import Procedures
from swarm.client.runner import PlanRunner
from swarm.client.sequential import RemoteChain
from swarm.client.trust import Trust
from swarm.client.tuning_setup import build_adapters, save_adapters, tuning_spec
from swarm.config import ClientConfig, DirectPolicy, Timing, client_config, load_model_card
from swarm.errors import BadInputError
from swarm.families import local
from swarm.families.selfcheck import require_exact
from swarm.families.spec import Family, family_of
from swarm.hop import Hop
from swarm.model_files import fingerprint_groups, load_config, model_folder, read_tensors, weight_map
from swarm.plan.compile import ModelShape, float_dtype
from swarm.plan.ir import Plan, Task
from swarm.protocol import ReleaseRequest, TrainTag
from swarm.quantization import accepted_formats
from swarm.tuning import TuningSpec, linear_modules

log = logging.getLogger(__name__)


# transformers leaves PreTrainedModel.__init_subclass__ unannotated
class DistributedModelForCausalLM(Procedures, Sessions, PreTrainedModel, GenerationMixin):  # type: ignore[no-untyped-call]
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
        self._conn: SwarmConnection | None = None
        self._blocks: RemoteChain | None = None
        self.local_blocks: LocalBlocks | None = None  # the first blocks, run on this client (``local_blocks=N``)
        self._runner: PlanRunner | None = None
        self.folder: Path | None = None  # the model folder it was loaded from (None: built from parts)
        self._init_sessions()
        self._pretraining: tuple[int, int] | None = None  # a trainer's (target batch, average every)

    # ---- loading ------------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(  # type: ignore[override]  # a swarm client takes other arguments than a local model
        cls,
        name_or_path: str,
        *,
        initial_peers: Sequence[str] = (),
        dtype: torch.dtype = torch.float32,
        timing: Timing | None = None,
        cache_dir: Path | None = None,
        fingerprint: str | None = None,
        direct: DirectPolicy = "auto",
        tuning: str | None = None,
        adapter: str | Path | None = None,
        lora_rank: int = 8,
        lora_alpha: float = 8.0,
        lora_targets: Sequence[str] | None = None,
        num_prompt_tokens: int = 16,
        swarm_key: Path | None = None,
        chain: bool = True,
        prefill_chunk: int = 128,
        codec: str = "auto",
        local_blocks: int = 0,
        trusted_peers: Sequence[str] = (),
        verify_every: int = 16,
        verify_seed: int | None = None,
        accuse: bool = True,
        allow_quantized: bool | str | Sequence[str] = False,
        **unused: object,
    ) -> DistributedModelForCausalLM:
        """Connect to a swarm serving ``name_or_path`` (a model card name or a Hugging Face folder).

        ``direct``: use servers' plain-TCP data plane "auto" (only on loopback/private networks), "always" or
        "never" (libp2p only). ``fingerprint`` pins the exact weights; by default the best-covered ones are used.

        ``tuning``: "lora" (``lora_rank``, ``lora_alpha``, ``lora_targets`` as in PEFT, whose defaults these are:
        by default the family's, e.g. ``q_proj, v_proj``; GPT-2 ``c_attn``; NeoX, Falcon, BLOOM ``query_key_value``),
        "prompt" or "deep_prompt" (``num_prompt_tokens``); ``adapter``: a PEFT adapter folder to start from (its
        config sets the tuning). The model's own weights are then frozen; only the adapter's parameters train.
        ``swarm_key``: a private swarm's key file (``--swarm-key`` of its peers). ``chain``: inference steps pass
        from server to server (``False``: through this client at every hop); ``prefill_chunk``: tokens per pipelined
        piece of a long chained step. ``codec``: activations' codec, "auto" (per link) or one to force.

        Privacy (docs/serving.md): ``local_blocks``: run the first N blocks on this client (their weights read from
        the model folder) and route only the rest, so no server sees the embeddings of the tokens (not with
        ``tuning`` or ``adapter``: the adapter would have to run here too); ``trusted_peers``: route only through
        these peer ids (your own servers): blocks none of them serves are missing, never routed elsewhere.

        Verification (docs/trust.md): ``verify_every``: each hop's work is run again on another server, in windows
        of about this many steps (0: off), and forwards and backwards with probability 1 / ``verify_every``;
        ``verify_seed``: makes which steps and verifiers reproducible (tests only: servers must not predict it);
        ``accuse``: publish accusations of cheaters caught, and act on others' once their evidence re-runs wrong.

        ``allow_quantized``: route through servers holding quantized blocks too (``swarm.quantization``): True for
        every format, or the formats to take ("int8", "nf4"); by default only servers of the exact weights, so
        results are those of the dtype they are served in. ``fingerprint`` overrides it."""
        if unused:
            raise BadInputError(f"unsupported arguments: {', '.join(unused)}")
        cfg = client_config(
            initial_peers,
            timing,
            cache_dir,
            direct,
            swarm_key=swarm_key,
            chain=chain,
            prefill_chunk=prefill_chunk,
            codec=codec,
            local_blocks=local_blocks,
            trusted_peers=tuple(trusted_peers),
            verify_every=verify_every,
            verify_seed=verify_seed,
            accuse=accuse,
        )
        if local_blocks and (tuning is not None or adapter is not None):
            raise BadInputError(
                "local_blocks cannot be combined with tuning or an adapter yet: the adapter's parts for the local "
                "blocks would have to run on this client"
            )
        card = load_model_card(name_or_path)
        folder = model_folder(card, cfg.cache_dir)
        config = load_config(folder)
        require_exact(config, dtype)  # the family's local parts and spans reproduce Hugging Face, or this is refused
        model = cls(config)
        names = local.client_names(model.family, weight_map(folder))  # never the blocks' tensors
        state = {names[k]: v.to(dtype) for k, v in read_tensors(folder, list(names)).items()}
        model._load_local(state)
        if local_blocks:
            model.local_blocks = LocalBlocks.load(model.family, folder, local_blocks, dtype)
        model.name_or_path = card.name
        model.folder = folder  # drafters of speculative decoding may read it (``swarm.client.drafting``)
        model.train(False)
        spec = tuning_spec(tuning, adapter, lora_rank, lora_alpha, lora_targets, num_prompt_tokens, model.family)
        if spec is not None:
            model._attach_adapters(spec, adapter)
        # only servers of these very weights are chained (a stranger's other weights never are, however fast)
        groups = fingerprint_groups(folder, cfg.cache_dir, accepted_formats(allow_quantized))
        model._connect(cfg, card.name, frozenset({fingerprint}) if fingerprint else frozenset(groups), groups)
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
        initial_peers: Sequence[str],
        fingerprint: str | None = None,
        timing: Timing | None = None,
        cache_dir: Path | None = None,
        direct: DirectPolicy = "auto",
        wiring_seed: int | None = None,
        identity: Path | None = None,
        swarm_key: Path | None = None,
        codec: str = "auto",
        chain: bool = True,
    ) -> DistributedModelForCausalLM:
        """A client whose own tensors are ``state`` (all trainable) and whose blocks are served in the swarm under
        ``model_id``: what a pre-training trainer drives (``swarm.client.training``). ``identity``: its key file (a
        closed run lists its trainers' peer ids). ``swarm_key``: a private swarm's key file. ``chain``: micro-batches
        pass from stage to stage (``swarm/client/chained_passes.py``), not through the client."""
        cfg = client_config(
            initial_peers,
            timing,
            cache_dir,
            direct,
            wiring_seed=wiring_seed,
            identity=identity,
            swarm_key=swarm_key,
            codec=codec,
            chain=chain,
        )
        model = cls(config)
        model.to_empty(device="cpu")
        model._load_local(state)
        model._connect(cfg, model_id, frozenset({fingerprint}) if fingerprint else None)
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
        dtype_name = str(self.model.get_input_embeddings().weight.dtype).removeprefix("torch.")
        self._conn = SwarmConnection(
            cfg,
            model_id,
            int(self.config.num_hidden_layers),
            fingerprints,
            groups=groups,
            hidden=int(self.config.hidden_size),
            value_bytes=getattr(torch, dtype_name).itemsize,  # hidden states travel in the embeddings' dtype
        )
        self._conn.trust = Trust.of(self._conn)
        remote = self.adapters is not None and self.adapters.applies_remotely
        self._blocks = RemoteChain(self._conn, AdapterDelivery(self.adapters) if remote and self.adapters else None)
        dtype = float_dtype(dtype_name)
        shape = ModelShape(
            model_id,
            int(self.config.num_hidden_layers),
            int(self.config.hidden_size),
            int(self.config.vocab_size),
            dtype,
        )
        self._runner = PlanRunner(self, self._conn, self._blocks, shape, self.local_blocks)

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
        self._close_sessions()
        if self._conn is not None:
            delivery = self.blocks.delivery
            if delivery is not None:  # servers would drop it after Timing.adapter_ttl anyway
                with contextlib.suppress(Exception):
                    self._conn.notify(delivery.holders(), ReleaseRequest(client=delivery.adapters.client_id))
                delivery.forget()
            self._conn.close()
            self._conn = self._blocks = self._runner = None

    def __enter__(self) -> DistributedModelForCausalLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the swarm, as users and tools see it ---------------------------------------------------------------------
    @property
    def connection(self) -> SwarmConnection:
        """The connection to the swarm: its DHT store (``.store``), transport (``.remote``), view and retry helper."""
        if self._conn is None:
            raise BadInputError("this model is closed")
        return self._conn

    @property
    def blocks(self) -> RemoteChain:
        if self._blocks is None:
            raise BadInputError("this model is closed")
        return self._blocks

    @property
    def runner(self) -> PlanRunner:
        """Compiles this model's procedures into plans and runs them (``swarm.client.runner``)."""
        if self._runner is None:
            raise BadInputError("this model is closed")
        return self._runner

    @property
    def route(self) -> list[Hop]:
        """The servers the last call went through."""
        return self._session.route if self._session is not None else self.blocks.last_route

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

    # ---- forward ------------------------------------------------------------------------------------------------
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
        """Hugging Face's causal LM forward, as a plan run by the executor. ``train`` tags every remote call with a
        pre-training run's global step and the micro-batch's sample count (``swarm.client.training``)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise BadInputError("give exactly one of input_ids or inputs_embeds")
        if self._session is not None:
            if input_ids is None:
                raise BadInputError("inside an inference session, pass input_ids")
            logits = self._session_step(self._session, input_ids, attention_mask, position_ids)
            loss = None
            if labels is not None:
                loss = self.causal_loss(logits, labels)
            return CausalLMOutputWithPast(loss=loss, logits=logits)
        padded = attention_mask is not None and not bool(attention_mask.all())
        ctx = Context(attention_mask if padded else None, position_ids, train)
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
        task: Task = "forward"
        target, every = self._pretraining or (1, 0)
        if keep and train is not None:
            task = "pretrain"
        elif keep and labels is not None:
            task = "finetune"
        out = self.runner.forward(
            inputs,
            ctx,
            keep=keep,
            prompts=self.prompt_tokens,
            task=task,
            target_batch=target,
            average_every=every,
            params="adapter" if self.adapters else "client",
        )
        return CausalLMOutputWithPast(loss=out.get("loss"), logits=out["logits"])

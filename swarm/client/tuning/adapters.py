"""The client's trainable extras: LoRA pairs for the remote blocks' linear modules, input prompts, deep prompts.

They live here, with the optimizer; servers get copies per call (see ``AdapterRef`` in ``swarm.protocol``). The
content version changes whenever a parameter is modified in place (an optimizer step) or replaced, which is how
the client knows a server's cached copy is stale without hashing the tensors."""

from __future__ import annotations

import math
import secrets

import torch
from torch import nn

from swarm.hop import Hop
from swarm.protocol import AdapterRef
from swarm.tuning import GRAD_PREFIX, TuningSpec, deep_name, lora_name


class LoraPair(nn.Module):
    def __init__(self, fan_in: int, fan_out: int, rank: int) -> None:
        super().__init__()
        # PEFT's default initialisation: A Kaiming-uniform, B zero, so the adapted model starts as the base model
        self.A = nn.Parameter(torch.empty(rank, fan_in))
        self.B = nn.Parameter(torch.zeros(fan_out, rank))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))


def _key(path: str) -> str:
    return path.replace(".", "__")  # module names may not contain dots


class ClientAdapters(nn.Module):
    def __init__(
        self, spec: TuningSpec, targets: dict[str, tuple[int, int]], num_blocks: int, hidden_size: int
    ) -> None:
        """``targets``: module path -> (in_features, out_features) of the LoRA targets (LoRA only)."""
        super().__init__()
        self.spec = spec
        self.num_blocks = num_blocks
        self.targets = dict(targets) if spec.mode == "lora" else {}
        self.client_id = secrets.token_hex(32)  # the only key to this client's cached adapters on servers
        self._token: tuple[tuple[int, int], ...] | None = None
        self._version = 0
        if spec.mode == "lora":
            self.lora = nn.ModuleList(
                nn.ModuleDict({_key(p): LoraPair(i, o, spec.lora_rank) for p, (i, o) in self.targets.items()})
                for _ in range(num_blocks)
            )
        else:
            # PEFT's prompt tuning initialises its prompt embedding as nn.Embedding does: N(0, 1)
            self.prompts = nn.Parameter(torch.randn(spec.num_prompt_tokens, hidden_size))
        if spec.mode == "deep_prompt":
            # as Petals does: zero at first, so training starts from plain prompt tuning
            self.deep = nn.Parameter(torch.zeros(num_blocks, spec.num_prompt_tokens, hidden_size))

    def pair(self, block: int, path: str) -> LoraPair:
        """The LoRA pair of the linear module at ``path`` in block ``block``."""
        layer = self.lora[block]
        assert isinstance(layer, nn.ModuleDict)
        pair = layer[_key(path)]
        assert isinstance(pair, LoraPair)
        return pair

    # ---- what remote blocks need --------------------------------------------------------------------------------
    def remote_tensors(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """Wire name -> tensor (still attached to its parameter) for blocks ``start:end``."""
        out: dict[str, torch.Tensor] = {}
        for block in range(start, end):
            if self.spec.mode == "lora":
                for path in self.targets:
                    pair = self.pair(block, path)
                    out[lora_name(block, path, "A")], out[lora_name(block, path, "B")] = pair.A, pair.B
            elif self.spec.mode == "deep_prompt":
                out[deep_name(block)] = self.deep[block]
        return out

    def remote_parameters(self) -> list[nn.Parameter]:
        """The parameters servers apply (and send gradients for), in a fixed order."""
        if self.spec.mode == "lora":
            pairs = (self.pair(block, path) for block in range(self.num_blocks) for path in self.targets)
            return [p for pair in pairs for p in (pair.A, pair.B)]
        return [self.deep] if self.spec.mode == "deep_prompt" else []

    @property
    def applies_remotely(self) -> bool:
        return self.spec.mode != "prompt"

    def version(self) -> int:
        """Bumped whenever a remote parameter changed since the last call: torch counts in-place writes per tensor
        (``_version``), and a replaced tensor has a new storage address."""
        token = tuple((p._version, p.data_ptr()) for p in self.remote_parameters())
        if token != self._token:
            self._token = token
            self._version += 1
        return self._version

    def ref(self, has_tensors: bool) -> AdapterRef:
        return AdapterRef(
            client=self.client_id,
            version=self.version(),
            has_tensors=has_tensors,
            scaling=self.spec.scaling if self.spec.mode == "lora" else 1.0,
        )

    def payload(self, start: int, end: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Detached copies in the server's dtype, ready for the wire."""
        return {n: t.detach().to(dtype) for n, t in self.remote_tensors(start, end).items()}

    def gradients(self, replies: list[dict[str, torch.Tensor]]) -> list[torch.Tensor | None]:
        """Sum the ``grad.*`` tensors of backward replies into one gradient per remote parameter (None if none
        arrived), in ``remote_parameters`` order."""
        sums: dict[str, torch.Tensor] = {}
        for reply in replies:
            for name, g in reply.items():
                if name.startswith(GRAD_PREFIX):
                    key = name[len(GRAD_PREFIX) :]
                    sums[key] = sums[key] + g if key in sums else g
        if self.spec.mode == "deep_prompt":
            if not sums:
                return [None]
            grad = torch.zeros_like(self.deep)
            for block in range(self.num_blocks):
                if deep_name(block) in sums:
                    grad[block] = sums[deep_name(block)].to(grad.dtype)
            return [grad]
        out: list[torch.Tensor | None] = []
        for block in range(self.num_blocks):
            for path in self.targets:
                for which in ("A", "B"):
                    out.append(sums.get(lora_name(block, path, which)))
        return [g if g is None else g.to(p.dtype) for g, p in zip(out, self.remote_parameters(), strict=True)]


class AdapterDelivery:
    """Which servers hold which version of this client's adapter, as far as this client knows, and the adapter part
    of each request: the reference always, the tensors for the hop's blocks only where the server lacks them."""

    def __init__(self, adapters: ClientAdapters) -> None:
        self.adapters = adapters
        self._known: dict[tuple[str, int, int], tuple[int, Hop]] = {}  # (peer, start, end) -> version it holds

    def needs_sending(self, hop: Hop) -> bool:
        held = self._known.get((hop.peer_id, hop.start, hop.end))
        return held is None or held[0] != self.adapters.version()

    def delivered(self, hop: Hop, held: bool = True) -> None:
        """Record that ``hop``'s server holds the current version (or, with False, that it lost it)."""
        key = (hop.peer_id, hop.start, hop.end)
        if held:
            self._known[key] = (self.adapters.version(), hop)
        else:
            self._known.pop(key, None)

    def resend(self, hop: Hop, sent: bool) -> bool:
        """``hop``'s server said it holds no copy of this version: whether to send the tensors again (not when they
        went along already: a server that drops them on arrival is not fed twice); its copy there is forgotten."""
        if sent:
            return False
        self.delivered(hop, False)
        return True

    def part(self, hop: Hop, send: bool) -> tuple[AdapterRef, dict[str, torch.Tensor]]:
        """The reference, and (with ``send``) the tensors of the hop's blocks in the server's dtype."""
        tensors = self.adapters.payload(hop.start, hop.end, getattr(torch, hop.dtype)) if send else {}
        return self.adapters.ref(send), tensors

    def holders(self) -> list[Hop]:
        """One hop per server that got this client's adapter."""
        return list({hop.peer_id: hop for _, hop in self._known.values()}.values())

    def forget(self) -> None:
        self._known.clear()

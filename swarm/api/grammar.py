"""Constrained decoding on the client: a grammar (a JSON schema, or the tool-call format around one) decides which
tokens may come next, and the sampler never sees the others. llguidance (Microsoft's, in Rust) computes each step's
token mask in about 20 µs for SmolLM2's 49,152 tokens on one CPU core and needs nothing but the tokenizer; xgrammar
pulls triton and a GPU toolchain, outlines-core builds an index per schema up front. The servers take no part: they
compute the same blocks whatever the client samples.

A schema from a request is bounded before it is compiled (``swarm.api.schema``) and compiled under llguidance's
parser limits; one it cannot compile is a 400 naming the field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import llguidance.hf
import numpy as np
import torch
from transformers import PreTrainedTokenizerFast

from swarm.api import errors
from swarm.api.schema import JsonObject
from swarm.errors import BadInputError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions
    from transformers import PreTrainedTokenizerBase

ANY_OBJECT: JsonObject = {"type": "object"}
NO_ARGUMENTS: JsonObject = {"type": "object", "properties": {}, "additionalProperties": False}
# JSON as json.dumps writes it, with no freedom in its whitespace: a model may not pad an answer without end
LAYOUT: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar, ready for a matcher per choice."""

    text: str
    kind: str  # "json" or "tools": how the answer is read back


class Vocabulary:
    """A model's tokens as llguidance sees them: built once per served model (about 0.3 s for SmolLM2)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, n_vocab: int, eos: frozenset[int]) -> None:
        self.n_vocab = n_vocab
        if not isinstance(tokenizer, PreTrainedTokenizerFast):  # as llguidance itself refuses a slow one
            raise ValueError("Only fast tokenizers are supported")
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=sorted(eos))

    def token_bytes(self, token: int) -> bytes:
        return bytes(self.tokenizer.decode_bytes([token]))

    def json(self, schema: JsonObject, param: str) -> Grammar:
        """Answers that are one JSON value of ``schema`` (laid out as ``LAYOUT`` says)."""
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=LAYOUT)
        except ValueError as e:
            raise errors.bad_request(f"the JSON schema does not compile: {e}", param=param) from None
        return self._checked(Grammar(text, "json"), param)

    def tool_calls(self, functions: dict[str, JsonObject | None], parallel: bool) -> Grammar:
        """Answers that are tool calls: ``<tool_call>`` blocks (the Hermes format most open chat templates use), each
        a JSON object naming one of ``functions`` with arguments that match its parameters' schema."""
        options = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": params or NO_ARGUMENTS},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, params in functions.items()
        ]
        call = {**(options[0] if len(options) == 1 else {"anyOf": options}), "x-guidance": LAYOUT}
        more = ' ("\\n" call)*' if parallel else ""
        lark = f'start: call{more}\ncall: "<tool_call>\\n" %json {json.dumps(call)} "\\n</tool_call>"\n'
        return self._checked(Grammar(llguidance.LLMatcher.grammar_from_lark(lark), "tools"), "tools")

    def _checked(self, grammar: Grammar, param: str) -> Grammar:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar.text, self.tokenizer)
        if is_error:
            raise errors.bad_request(f"the schema cannot be used: {messages[0][:500]}", param=param)
        return grammar

    def matcher(self, grammar: Grammar) -> Matcher:
        return Matcher(self, grammar)


class Matcher:
    """One choice's place in its grammar: the tokens allowed next, and the tokens taken."""

    def __init__(self, vocab: Vocabulary, grammar: Grammar) -> None:
        self.vocab, self.grammar = vocab, grammar
        self.m = llguidance.LLMatcher(vocab.tokenizer, grammar.text, log_level=0)
        self.bits = np.full((1, (vocab.n_vocab + 31) // 32), -1, dtype=np.int32)

    def allowed(self) -> torch.Tensor:
        """[n_vocab] booleans: the tokens the grammar allows now (end-of-text once the answer is complete)."""
        self.m.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        unpacked = np.unpackbits(self.bits.view(np.uint8), bitorder="little")[: self.vocab.n_vocab]
        return torch.from_numpy(unpacked.astype(np.bool_))

    def mask(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` [vocab] with every token the grammar forbids at -inf (columns past the vocabulary too)."""
        allowed = self.allowed()
        if self.m.is_error() or not bool(allowed.any()):  # the parser's limits, say: nothing may follow
            raise BadInputError(f"the grammar cannot go on: {self.m.get_error() or 'no token is allowed'}")
        out = torch.full_like(scores, float("-inf"))
        n = min(scores.shape[-1], allowed.shape[0])
        out[:n] = torch.where(allowed[:n], scores[:n], out[:n])
        return out

    def take(self, token: int) -> None:
        if not self.m.consume_token(token) or self.m.is_error():
            raise BadInputError(f"the grammar refused token {token}: {self.m.get_error()}")

    @property
    def done(self) -> bool:
        """The answer is complete and nothing may follow (an end-of-text token is implied)."""
        return bool(self.m.is_stopped())

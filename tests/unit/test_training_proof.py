"""Pre-training is proven per family, not listed (``swarm.training.proof``): a training step of the run's twin as the
swarm takes it (a trainer's own tensors and stages initialised apart, each under its name in the family's causal LM)
equals one process's, or the run is refused with what differed. Families other than Llama's naming are proven and
trained; a seed drawn under another name, a gradient that does not reach a weight, and dropout are each caught."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

import swarm.families.span as span_module
import swarm.training.seeds as seeds_module
from swarm.training import proof
from swarm.training.seeds import block_prefix, hf_names, init_full_model, seeded_client_state

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, vocab_size=128)


def _config(model_type: str, **extra: object) -> object:
    if model_type == "gpt2":
        fields = dict(n_embd=32, n_layer=4, n_head=4, vocab_size=128, n_positions=64)
        fields.update(attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, summary_first_dropout=0.0)
    else:
        fields = dict(SMALL)
    fields.update(extra)
    return AutoConfig.for_model(model_type, **fields)


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gpt_neox", "phi3"])
def test_a_training_step_through_the_split_equals_one_process(model_type):
    assert proof.check_training(_config(model_type)) is None


def test_a_trainer_and_a_stage_draw_what_one_process_draws_under_the_family_names():
    config = _config("gpt2")
    full = init_full_model(config, 5)
    assert block_prefix(config, 3) == "transformer.h.3."
    theirs = hf_names(config)
    assert theirs["model.wte.weight"] == "transformer.wte.weight" and theirs["lm_head.weight"] == "lm_head.weight"
    drawn = seeded_client_state(config, 5, ["model.wte.weight", "model.ln_f.weight", "model.ln_f.bias"])
    assert torch.equal(drawn["model.wte.weight"], full.transformer.wte.weight)
    assert torch.equal(drawn["model.ln_f.weight"], torch.ones(32))  # a LayerNorm named ln_f: one, its bias zero
    assert torch.equal(drawn["model.ln_f.bias"], torch.zeros(32))
    assert torch.equal(full.transformer.h[1].ln_2.weight, torch.ones(32))


def test_a_stage_that_draws_its_blocks_under_other_names_is_caught(monkeypatch):
    def shifted(config, index):
        return f"model.layers.{index + 1}."

    monkeypatch.setattr(seeds_module, "block_prefix", shifted)
    problem = proof.check_training(_config("llama"))
    assert problem is not None and "model.layers.0.self_attn.q_proj.weight is held by no stage" in problem


def test_a_trainer_that_draws_its_tensors_under_other_names_is_caught(monkeypatch):
    real = seeds_module.hf_names

    def renamed(config):  # the embeddings drawn under the head's name and the other way round (same shapes)
        swap = {"model.embed_tokens.weight": "lm_head.weight", "lm_head.weight": "model.embed_tokens.weight"}
        return {k: swap.get(v, v) for k, v in real(config).items()}

    monkeypatch.setattr(seeds_module, "hf_names", renamed)
    problem = proof.check_training(_config("llama"))
    assert problem is not None and "model.embed_tokens.weight starts from other values" in problem


def test_a_gradient_that_does_not_reach_the_embeddings_is_caught(monkeypatch):
    real = span_module.call_layer

    def cut(family, layer, index, hidden, *args, **kwargs):
        return real(family, layer, index, hidden.detach() if index == 0 else hidden, *args, **kwargs)

    monkeypatch.setattr(span_module, "call_layer", cut)
    problem = proof.check_training(_config("llama"))
    assert problem is not None and "no gradient through the swarm" in problem


def test_dropout_is_refused_with_the_fields_to_turn_off():
    problem = proof.check_training(AutoConfig.for_model("gpt2", n_embd=32, n_layer=4, n_head=4, vocab_size=128))
    assert problem is not None and "dropout is on" in problem and "resid_pdrop" in problem
    with pytest.raises(Exception, match="would not equal one process"):
        proof.require_trainable(_config("llama", attention_dropout=0.1))

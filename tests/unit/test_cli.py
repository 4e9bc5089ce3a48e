"""The serve command's flags come from the config dataclasses: every default is the field's, every flag parses into
its field, and a flag not given keeps the field's default."""

from __future__ import annotations

import dataclasses

import pytest

from peers.config import NetworkConfig, PeerConfig, PlacementConfig
from peers.serving.config import ComputeConfig
from swarm.config import Timing
from swarm.errors import BadInputError
from swarm.ids import Span
from swarm.serve import build_parser, config_from_args


def parse(*argv: str) -> PeerConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def test_no_flags_give_the_dataclass_defaults():
    cfg = parse()
    assert cfg.network == NetworkConfig() and cfg.compute == ComputeConfig() and cfg.placement == PlacementConfig()
    assert cfg.model == PeerConfig().model and cfg.timing == Timing()


def test_every_flag_reaches_its_field():
    cfg = parse(
        "--model",
        "tiny-llama",
        "--blocks",
        "2:6",
        "--no-broker",
        "--initial-peers",
        "a",
        "b",
        "--max-adapter-mb",
        "1.5",
        "--direct-port",
        "off",
        "--throughput",
        "250",
        "--cache-tokens",
        "64",
        "--announce-maddr",
        "/ip4/1.2.3.4/tcp/5",
        "--standby-fraction",
        "0.25",
        "--test-timings",
    )
    assert cfg.model == "tiny-llama" and cfg.placement.blocks == Span(2, 6) and cfg.placement.broker is False
    assert cfg.network.initial_peers == ("a", "b") and cfg.network.direct_port is None
    assert cfg.network.announce_maddrs == ("/ip4/1.2.3.4/tcp/5",)
    assert cfg.compute.max_adapter_bytes == int(1.5 * 2**20) and cfg.compute.throughput == 250.0
    assert cfg.compute.cache_tokens == 64 and cfg.placement.standby_fraction == 0.25
    assert cfg.timing == Timing.for_tests()
    assert parse("--throughput", "auto").compute.throughput is None
    assert parse("--runtime", "onnx").compute.runtime == "onnx" and parse().compute.runtime == "torch"


def test_help_shows_the_fields_defaults():
    text = build_parser().format_help()
    for flag in ("--cache-tokens", "--max-batch-tokens", "--replication", "--network-mbps", "--no-broker"):
        assert flag in text
    assert f"(default: {ComputeConfig().cache_tokens})" in text.replace("\n", " ").replace("  ", " ")


def test_bad_values_and_combinations_are_clear_errors(capsys):
    for argv, message in (
        (("--direct-port", "sometimes"), "a port flag takes a port number or 'off'"),
        (("--blocks", "3"), "a span looks like START:END"),
        (("--runtime", "tensorrt"), "--runtime takes 'torch' or 'onnx'"),
        (("--cache-tokens", "many"), "invalid literal for int()"),
    ):
        with pytest.raises(SystemExit) as info:
            parse(*argv)
        assert info.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(BadInputError, match="not both"):
        dataclasses.replace(PeerConfig(), network=NetworkConfig(new_swarm=True, initial_peers=("x",))).check()
    with pytest.raises(BadInputError, match="--initial-peers"):
        PeerConfig().check()

"""The hardware catalogue: every shipped file loads, carries every number with a source, and orders sensibly."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.perf.catalogue import CATALOGUE_DIR, DTYPES, DeviceSpec, Numbers, load_catalogue, lookup

SHIPPED = {"rtx3080", "rtx3090", "rtx4090", "a100", "h100", "h200", "cpu"}


@pytest.fixture(scope="module")
def cat() -> dict[str, DeviceSpec]:
    return load_catalogue()


def test_every_shipped_file_loads(cat: dict[str, DeviceSpec]) -> None:
    assert {p.stem for p in CATALOGUE_DIR.glob("*.toml")} == set(cat)
    assert SHIPPED <= set(cat)


def test_every_field_has_a_source_and_date(cat: dict[str, DeviceSpec]) -> None:
    for stem, spec in cat.items():
        assert spec.match, stem
        assert set(spec.peak_tflops) == set(DTYPES), stem
        entries = list(spec.peak_tflops.values()) + [getattr(spec.numbers, f) for f in Numbers.model_fields]
        assert len(entries) == len(DTYPES) + 9
        for entry in entries:
            assert entry.value > 0 and entry.source.strip() and len(entry.date) == 7, stem
        for dtype in DTYPES:
            assert spec.flops(dtype) == spec.peak_tflops[dtype].value * 1e12
        assert 0 < spec.matmul_efficiency <= 1 and 0 < spec.memory_efficiency <= 1, stem
        assert 1e-7 < spec.launch_overhead < 1e-4, stem
        assert spec.memory_bytes > 1e9 and spec.memory_bandwidth > 1e10 and spec.host_link > 1e9, stem
        assert spec.power_w > 0 and spec.price_usd > 0 and spec.cloud_usd_per_hour > 0, stem
    assert cat["cpu"].kind == "cpu" and all(s.kind == "gpu" for k, s in cat.items() if k != "cpu")


def test_numbers_are_ordered_sensibly(cat: dict[str, DeviceSpec]) -> None:
    order = ["h100", "a100", "rtx4090", "rtx3090", "rtx3080", "cpu"]
    bf16 = [cat[k].flops("bfloat16") for k in order]
    assert bf16 == sorted(bf16, reverse=True) and len(set(bf16)) == len(bf16)
    assert cat["h200"].flops("bfloat16") == cat["h100"].flops("torch.bfloat16")
    assert cat["h200"].numbers.memory_gb.value == 141
    assert cat["h200"].memory_bytes == 141e9
    bandwidth = [cat[k].memory_bandwidth for k in ["h200", "h100", "a100", "rtx4090", "rtx3090", "rtx3080", "cpu"]]
    assert bandwidth == sorted(bandwidth, reverse=True) and len(set(bandwidth)) == len(bandwidth)
    assert cat["cpu"].flops("bfloat16") <= cat["cpu"].flops("float32")
    with pytest.raises(ValueError, match="unknown dtype"):
        cat["h100"].flops("float64")


def test_lookup(cat: dict[str, DeviceSpec]) -> None:
    assert lookup("NVIDIA GeForce RTX 3080", cat) is cat["rtx3080"]
    assert lookup("NVIDIA GeForce RTX 3090", cat) is cat["rtx3090"]
    assert lookup("nvidia geforce rtx 4090", cat) is cat["rtx4090"]
    assert lookup("NVIDIA A100-SXM4-80GB", cat) is cat["a100"]
    assert lookup("NVIDIA H100 80GB HBM3", cat) is cat["h100"]
    assert lookup("NVIDIA H200", cat) is cat["h200"]
    assert lookup("cpu: AMD EPYC", cat) is cat["cpu"]
    assert lookup("cpu", cat) is cat["cpu"]
    assert lookup("Some unknown", cat) is None


def test_lookup_prefers_the_longest_match(cat: dict[str, DeviceSpec]) -> None:
    ti = cat["rtx3080"].model_copy(update={"name": "RTX 3080 Ti", "match": ("RTX 3080 Ti",)})
    both = {"ti": ti, **cat}  # the shorter "RTX 3080" comes later and must not shadow it
    assert lookup("NVIDIA GeForce RTX 3080 Ti", both) is ti
    assert lookup("NVIDIA GeForce RTX 3080", both) is cat["rtx3080"]


def test_malformed_toml_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "broken.toml").write_text('name = "x\n')
    with pytest.raises(ValueError, match="broken.toml"):
        load_catalogue(tmp_path)


def _copy(tmp_path: Path, text: str) -> Path:
    (tmp_path / "dev.toml").write_text(text)
    return tmp_path


def test_extra_field_is_refused(tmp_path: Path) -> None:
    text = (CATALOGUE_DIR / "rtx3080.toml").read_text()
    with pytest.raises(ValueError, match="dev.toml"):
        load_catalogue(_copy(tmp_path, text.replace("[numbers]", "[numbers]\nsurprise = 1", 1)))
    with pytest.raises(ValueError, match="dev.toml"):
        load_catalogue(_copy(tmp_path, text.replace('kind = "gpu"', 'kind = "gpu"\nvendor = "NVIDIA"', 1)))


def test_bad_values_are_refused(tmp_path: Path) -> None:
    text = (CATALOGUE_DIR / "rtx3080.toml").read_text()
    for bad in [
        text.replace("value = 29.8", "value = -1", 1),
        text.replace('date = "2020-09"', 'date = "Sept 2020"', 1),
        text.replace('match = ["RTX 3080"]', "match = []", 1),
        "\n".join(line for line in text.splitlines() if not line.startswith("int8")),
        "\n".join(line for line in text.splitlines() if not line.startswith("power_w")),
    ]:
        with pytest.raises(ValueError, match="dev.toml"):
            load_catalogue(_copy(tmp_path, bad))
    assert set(load_catalogue(_copy(tmp_path, text))) == {"dev"}

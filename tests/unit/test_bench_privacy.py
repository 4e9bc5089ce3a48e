"""``scripts/bench_privacy.py --quick``: the inversion attack runs end to end on a tiny model (its text as bytes, no
swarm started) and prints its table; the training and test texts come from different sources."""

from __future__ import annotations

from tests.helpers.scripts import load_script


def test_quick_attack_runs_and_prints_the_table(tiny_models, capsys):
    bench = load_script("bench_privacy")
    folder = tiny_models["llama"]
    assert bench.main(["--quick", "--no-speed", "--model", str(folder), "--depths", "1", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["0", "1", "2"]  # depth 0, the embeddings, always
    for row in rows:
        top1, top10 = (float(cell.strip().rstrip("%")) for cell in row.split("|")[3:5])
        assert 0.0 <= top1 <= top10 <= 100.0


def test_train_and_test_text_are_disjoint():
    bench = load_script("bench_privacy")
    train, files = bench.docstrings(("json",), 20_000)  # a small package of the standard library: fast
    test = set(bench.test_text())
    assert train and files and test
    assert not test & set(train)

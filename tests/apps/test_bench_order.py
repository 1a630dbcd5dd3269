"""The decode benchmark's order of work, with the GPU work faked (no GPU needed)."""

from __future__ import annotations

from types import SimpleNamespace

from ferrox_driver.apps.bench import decode as bench_decode
from ferrox_driver.apps.bench import torch_baseline
from ferrox_driver.apps.bench.report import DecodePoint


def test_ours_are_all_measured_before_pytorch_runs_anything(monkeypatch, capsys):
    # PyTorch's first SDPA turns on a slower mode for every kernel of the process
    #: every measurement of ours, the growing
    # graph included, comes first, then PyTorch's on the same points in the same order.
    calls = []

    def ours(shape, seq, dtype, iters, device):
        calls.append(("ours", shape, seq, dtype))
        return DecodePoint("/".join(map(str, shape)), dtype, seq, 10**6, 1.0, 2.0, 3.0, None, None)

    def grown(iters):
        calls.append(("grown",))
        return {4096: (1.5, 2.5)}

    def torch_sdpa(shape, seq, dtype, iters):
        calls.append(("torch", shape, seq, dtype))
        return 5.0, 6.0

    monkeypatch.setattr(bench_decode, "default_device", lambda: SimpleNamespace(name="fake"))
    monkeypatch.setattr(bench_decode, "measure_read_ceiling", lambda *a, **k: 4.4)
    monkeypatch.setattr(bench_decode, "measure_point", ours)
    monkeypatch.setattr(bench_decode, "measure_growing_graph", grown)
    monkeypatch.setattr(bench_decode, "import_torch", lambda: object())
    monkeypatch.setattr(torch_baseline, "torch_sdpa_us", torch_sdpa)
    result = bench_decode.run_decode_bench(
        None, shapes=[(8, 1, 64), (16, 2, 64)], seq_lens=[512, 4096], dtypes=["bf16", "f32"]
    )
    assert [c[0] for c in calls] == ["ours"] * 8 + ["grown"] + ["torch"] * 8
    assert [c[1:] for c in calls if c[0] == "ours"] == [c[1:] for c in calls if c[0] == "torch"]
    points = result["points"]
    assert [(p["shape"], p["seq_len"], p["dtype"]) for p in points] == [
        ("/".join(map(str, c[1])), c[2], c[3]) for c in calls if c[0] == "ours"
    ]
    assert all(
        p["graph_us"] == 1.0 and (p["torch_us"], p["torch_single_us"]) == (5.0, 6.0) for p in points
    )
    assert result["growing_graph"] == {"4096": {"graph_us": 1.5, "single_us": 2.5}}
    assert "5.00x" in capsys.readouterr().out  # the table's speed-up: torch 5.0 / ours 1.0

"""``bench --only torch`` without a GPU: its arguments, one process per table (hidden
self-test tables stand in for the GPU ones), the JSON it writes, the step clock over a CPU
generate(), the tables' refusal without CUDA; and on a GPU, the decode layer it traces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ferrox_driver as fd
from ferrox_driver.apps import cli
from ferrox_driver.apps.bench import torch_bench as tb

TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "vocab_size": 97,
        "max_position_embeddings": 256}  # fmt: skip


@pytest.fixture
def torch():
    pytest.importorskip("transformers")
    return pytest.importorskip("torch")


def quiet(line: str) -> None:
    pass


# --- arguments -----------------------------------------------------------------------------------


def test_tables_parse_as_a_comma_separated_list():
    args = cli.build_parser().parse_args(
        ["bench", "--only", "torch", "--tables", "fp8, explain", "--quick", "--out", "d"]
    )
    assert (args.only, args.tables, args.quick, args.out) == (
        "torch",
        ["fp8", "explain"],
        True,
        "d",
    )
    assert cli.build_parser().parse_args(["bench", "--only", "torch"]).tables is None


@pytest.mark.parametrize(
    "argv,says",
    [
        (["bench", "--only", "torch", "--tables", "compiled,warp"], "compiled,eager,fp8,growing"),
        (["bench", "--only", "torch", "--tables", ","], "got ','"),
        (["bench", "--only", "torch", "--tables", "selftest"], "got 'selftest'"),
        (["bench", "--only", "decode", "--tables", "eager"], "applies to --only torch"),
    ],
)
def test_a_bad_tables_argument_is_refused_naming_it(capsys, argv, says):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv, prog="ferrox-driver")
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ferrox-driver bench: error: argument --tables") and says in err, err


def test_bench_only_torch_hands_its_arguments_to_the_table_runner(monkeypatch, tmp_path):
    seen = []

    def fake_run(tables, out_dir, quick):
        seen.append((list(tables), out_dir, quick))
        return {"tables": {t: {"table": t} for t in tables}}

    monkeypatch.setattr(fd, "cuda_available", lambda: True)
    monkeypatch.setattr(tb, "run_torch_bench", fake_run)
    argv = [
        "bench",
        "--only",
        "torch",
        "--tables",
        "eager,growing",
        "--quick",
        "--out",
        str(tmp_path),
    ]
    assert cli.main(argv) == 0
    assert cli.main(["bench", "--only", "torch"]) == 0
    assert seen == [(["eager", "growing"], tmp_path, True), (list(tb.TABLES), None, False)]


def test_bench_only_torch_exits_1_when_a_table_failed(monkeypatch):
    monkeypatch.setattr(fd, "cuda_available", lambda: True)
    failed = {"tables": {"compiled": {"table": "compiled"}, "fp8": {"table": "fp8", "error": "x"}}}
    monkeypatch.setattr(tb, "run_torch_bench", lambda tables, out_dir, quick: failed)
    assert cli.main(["bench", "--only", "torch"]) == 1


def test_the_runner_refuses_a_name_that_is_not_a_table():
    with pytest.raises(ValueError, match=r"tables: expected some of compiled, eager.*'warp'"):
        tb.run_torch_bench(["compiled", "warp"], echo=quiet)
    with pytest.raises(ValueError, match="tables: expected"):
        tb.run_torch_bench([], echo=quiet)


# --- one process per table -----------------------------------------------------------------------


def test_each_table_runs_in_a_process_of_its_own(tmp_path):
    a = tb.run_table_process("selftest", tmp_path / "a.json", False, 60, echo=quiet)
    b = tb.run_table_process("selftest", tmp_path / "b.json", False, 60, echo=quiet)
    pids = [next(r["value"] for r in res["rows"] if r["what"] == "pid") for res in (a, b)]
    assert len({*pids, os.getpid()}) == 3
    assert a["returncode"] == b["returncode"] == 0


def test_the_run_writes_every_tables_json_and_prints_it(tmp_path):
    lines: list[str] = []
    result = tb.run_torch_bench(["selftest"], tmp_path / "out", quick=True, echo=lines.append)
    written = json.loads((tmp_path / "out" / "torch_bench.json").read_text())
    assert written == result
    assert set(written) == {"quick", "inductor_cache", "tables", "must_show"}
    assert written["quick"] is True and written["must_show"] == []
    table = written["tables"]["selftest"]
    assert set(table) == {"table", "rows", "notes", "elapsed_s", "returncode"}
    assert table["table"] == "selftest" and table["returncode"] == 0
    assert table["rows"][0] == {"what": "fixed", "value": 2.5}
    assert table["notes"] == ["quick=True"]  # --quick reached the table's process
    printed = "\n".join(lines)
    assert "fixed" in printed and "2.50" in printed and "note: quick=True" in printed


def test_the_tables_of_a_run_share_a_fresh_inductor_cache_removed_after(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    result = tb.run_torch_bench(["selftest"], None, echo=quiet)
    rows = result["tables"]["selftest"]["rows"]
    used = next(r["value"] for r in rows if r["what"] == "TORCHINDUCTOR_CACHE_DIR")
    assert used and "ferrox-torch-bench-inductor-" in used and not Path(used).exists()
    assert result["inductor_cache"] == "fresh for this run"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the user's choice is kept
    result = tb.run_torch_bench(["selftest"], None, echo=quiet)
    rows = result["tables"]["selftest"]["rows"]
    assert next(r["value"] for r in rows if r["what"] == "TORCHINDUCTOR_CACHE_DIR") == str(tmp_path)
    assert result["inductor_cache"] == str(tmp_path) and tmp_path.exists()


def test_a_failing_table_is_reported_and_the_next_still_runs():
    lines: list[str] = []
    result = tb.run_torch_bench(["selftest-error", "selftest"], None, echo=lines.append)
    bad, good = result["tables"]["selftest-error"], result["tables"]["selftest"]
    assert bad["error"] == "RuntimeError: the selftest-error table fails on purpose"
    assert bad["returncode"] == 1 and any("fails on purpose" in x for x in bad["output_tail"])
    assert "error" not in good and good["rows"][0]["value"] == 2.5
    assert any("selftest-error" in x and "FAILED" in x for x in lines)


def test_a_table_process_that_leaves_no_json_is_an_error(tmp_path):
    res = tb.run_table_process("selftest-crash", tmp_path / "c.json", False, 60, echo=quiet)
    assert res["returncode"] == 3 and res["error"].startswith("exit status 3 and no JSON")
    assert "selftest-crash: leaving without a JSON" in res["output_tail"]


def test_a_table_past_its_time_limit_is_killed(tmp_path):
    t0 = time.perf_counter()
    res = tb.run_table_process("selftest-hang", tmp_path / "h.json", False, 2, echo=quiet)
    assert time.perf_counter() - t0 < 30
    assert res["error"] == "killed after 2 s (the table's time limit)"
    assert res["returncode"] == -9


# --- without CUDA --------------------------------------------------------------------------------


@pytest.mark.parametrize("table", tb.TABLES)
def test_every_table_refuses_clearly_without_cuda(torch, table):
    if torch.cuda.is_available():
        pytest.skip("the no-CUDA behaviour")
    with pytest.raises(tb.NoCudaError, match=f"table {table} needs a CUDA device"):
        tb.TABLE_FUNCS[table](True)


def test_a_table_process_without_cuda_exits_1_with_the_reason_in_its_json(torch, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the no-CUDA behaviour")
    out = tmp_path / "e.json"
    done = subprocess.run(
        [sys.executable, "-m", "ferrox_driver.apps.bench.torch_bench", "--table", "explain",
         "--json", str(out), "--quick"], capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 1
    assert "table explain needs a CUDA device" in done.stderr
    res = json.loads(out.read_text())
    assert res["table"] == "explain" and res["error"].startswith("NoCudaError: table explain")


# --- the step clock ------------------------------------------------------------------------------


def test_step_intervals_and_their_median_from_given_stamps():
    stamps = [100.0, 100.010, 100.030, 100.031, 100.051]
    assert tb.step_intervals_ms(stamps) == pytest.approx([10.0, 20.0, 1.0, 20.0])
    assert tb.median_step_ms(stamps) == pytest.approx(15.0)
    assert tb.median_step_ms([0.0, 0.004]) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="stamps: expected at least two"):
        tb.median_step_ms([1.0])


def test_the_stamps_bracket_the_decode_steps_and_not_the_prefill(torch):
    # the prefill forward sleeps 0.4 s, each decode step 0.05 s: every interval is one step
    model = tb.build_model(torch, TINY, "cpu")

    def slow(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        time.sleep(0.4 if ids.shape[1] > 1 else 0.05)

    model.register_forward_pre_hook(slow, with_kwargs=True)
    syncs = []
    stamper = tb.step_stamper(lambda: syncs.append(1))
    prompt = tb.prompt_ids(torch, 12, TINY["vocab_size"], "cpu")
    model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                   min_new_tokens=6, do_sample=False, pad_token_id=0,
                   logits_processor=[stamper], cache_implementation="static")  # fmt: skip
    assert len(stamper.stamps) == len(syncs) == 6  # once per token, each after a sync
    steps = tb.step_intervals_ms(stamper.stamps)
    assert len(steps) == 5 and min(steps) >= 50.0 and max(steps) < 400.0


def test_time_generate_over_a_cpu_generate(torch):
    model = tb.build_model(torch, TINY, "cpu")
    prompt = tb.prompt_ids(torch, 16, TINY["vocab_size"], "cpu")
    run = tb.time_generate(torch, model, prompt, 5, 1, lambda: None,
                           cache_implementation="static", disable_compile=True)  # fmt: skip
    assert run["steps"] == 4 and len(run["tokens"]) == 5
    assert 0 < run["step_ms_min"] <= run["ms_per_step"] <= run["step_ms_max"]
    assert run["compile_config"] is None and run["graphs"] == 0 and run["graph_breaks"] == 0
    # the same static cache length: a bf16 model's attention over another length sums in
    # another order, and a random tiny model's near-tied logits may then pick another token
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5,
                              min_new_tokens=5, do_sample=False, pad_token_id=0,
                              cache_implementation="static", disable_compile=True)  # fmt: skip
    assert run["tokens"] == expected[0, 16:].tolist()


def test_a_given_cache_is_reset_before_each_call_and_its_bytes_counted(torch):
    from transformers import StaticCache

    model = tb.build_model(torch, TINY, "cpu")
    prompt = tb.prompt_ids(torch, 16, TINY["vocab_size"], "cpu")
    cache = StaticCache(config=model.config, max_cache_len=40)
    run = tb.time_generate(torch, model, prompt, 5, 2, lambda: None, cache=cache,
                           disable_compile=True)  # fmt: skip
    fresh = StaticCache(config=model.config, max_cache_len=40)  # the same length: same sums
    plain = tb.time_generate(torch, model, prompt, 5, 0, lambda: None, cache=fresh,
                             disable_compile=True)  # fmt: skip
    assert run["tokens"] == plain["tokens"]  # three calls over one cache, each from empty
    # 2 layers x (K and V) x 40 positions x 2 KV heads x 16 x 2 bytes (bf16)
    assert tb.static_cache_nbytes(cache) == 2 * 2 * 40 * 2 * 16 * 2


def test_time_generate_says_which_compile_config_generate_used(torch):
    from transformers import CompileConfig

    model = tb.build_model(torch, TINY, "cpu")
    prompt = tb.prompt_ids(torch, 16, TINY["vocab_size"], "cpu")
    config = CompileConfig(backend="eager", mode=None)
    config._compile_all_devices = True  # generate compiles on the CPU only when told to
    try:
        run = tb.time_generate(torch, model, prompt, 4, 1, lambda: None,
                               cache_implementation="static", compile_config=config)  # fmt: skip
        assert run["compile_config"]["backend"] == "eager" and run["graphs"] >= 1
        tb.forget_compiles(torch, model)
        for attr in ("_compiled_call", "_last_compile_config", "_previous_max_cache_length"):
            assert attr not in vars(model)
        run = tb.time_generate(torch, model, prompt, 4, 0, lambda: None,
                               cache_implementation="static", disable_compile=True)  # fmt: skip
        assert run["compile_config"] is None and run["graphs"] == 0
    finally:
        torch._dynamo.reset()


def test_switching_attention_on_one_model(torch):
    model = tb.build_model(torch, TINY, "cpu")
    tb.use_attention(model, "ferrox")
    assert model.config._attn_implementation == "ferrox"
    assert model.model.layers[1].self_attn.config._attn_implementation == "ferrox"
    tb.use_attention(model, "sdpa")
    assert model.config._attn_implementation == "sdpa"


def test_explain_summary_counts_graphs_breaks_and_names_the_reason(torch):
    def with_a_break(x):
        y = x.sin()
        print("a graph break")
        return y.cos()

    torch._dynamo.reset()
    summary = tb.explain_summary(torch._dynamo.explain(with_a_break)(torch.ones(3)))
    assert (summary["graphs"], summary["graph_breaks"]) == (2, 1)
    (reason,) = summary["break_reasons"]
    assert "`print`" in reason and "\n" not in reason
    assert reason.endswith(f"at {__file__}:{with_a_break.__code__.co_firstlineno + 2}")


# --- the printed tables --------------------------------------------------------------------------


def run_of(ms, compile_s=60.0, graphs=1, breaks=0, tokens=(1, 2, 3, 4)):
    return {"ms_per_step": ms, "compile_s": compile_s, "graphs": graphs, "graph_breaks": breaks,
            "tokens": list(tokens)}  # fmt: skip


def test_the_compiled_table_prints_the_ratio_against_its_target():
    res = {"device": "H200", "elapsed_s": 300.0, "new_tokens": 32, "warmups": 2, "notes": ["n"],
           "rows": [{"context": 4096, "sdpa": run_of(17.2), "ferrox": run_of(15.48, 70.5, 3, 2),
                     "ratio": 0.9, "must_reach": 1.0, "tokens_equal_prefix": 3}]}  # fmt: skip
    text = tb.format_table("compiled", res)
    row = next(line for line in text.splitlines() if line.strip().startswith("4096"))
    assert row.split()[:6] == ["4096", "17.20", "15.48", "0.90", "<=1.00", "60.0"]
    assert "70.5" in row and "1/3" in row and "0/2" in row and "3/4" in row
    assert text.splitlines()[0] == "compiled (H200, 300.0 s in its own process)"


def test_the_fp8_table_prints_the_memory_ratio():
    res = {"device": "H200", "rows": [{
        "context": 131072, "sdpa_bf16": run_of(40.0), "ferrox_fp8": run_of(30.0),
        "ratio": 0.75, "must_reach": 0.95, "sdpa_cache_bytes": 16 * 2**30,
        "fp8_cache_bytes": 8 * 2**30, "memory_ratio": 0.5, "memory_must_reach": 0.52}]}  # fmt: skip
    row = next(x for x in tb.format_table("fp8", res).splitlines() if x.startswith(" 131072"))
    assert row.split()[:9] == ["131072", "40.00", "30.00", "0.75", "<=0.95", "16.00", "8.00",
                               "0.500", "<=0.52"]  # fmt: skip


def test_must_show_sets_each_measured_target_against_its_bound():
    tables = {
        "compiled": {"rows": [{"context": 4096, "ratio": 0.9, "must_reach": 1.0},
                              {"context": 32768, "ratio": 1.2, "must_reach": 1.0}]},
        "eager": {"table": "eager", "error": "x"},
        "fp8": {"rows": [{"context": 131072, "ratio": 0.96, "must_reach": 0.95,
                          "memory_ratio": 0.5, "memory_must_reach": 0.52}]},
        "growing": {"rows": [{"what": "fixed_us", "value": 15.0},
                             {"what": "growing_nhd_us", "value": 19.5},
                             {"what": "random_memory_growth_bytes", "value": 2097152.0}]},
        "explain": {"explain": {"graph_breaks": 0}},
    }  # fmt: skip
    got = [(m["what"], m["value"], m["ok"]) for m in tb.must_show(tables)]
    assert got == [
        ("compiled, 4096 tokens: ferrox/sdpa ms/step", 0.9, True),
        ("compiled, 32768 tokens: ferrox/sdpa ms/step", 1.2, False),
        ("fp8 cache, 131072 tokens: ferrox/sdpa ms/step", 0.96, False),
        ("fp8 cache, 131072 tokens: cache bytes ratio", 0.5, True),
        ("growing: growing_nhd_us", 19.5, True),
        ("growing: random_memory_growth_bytes", 2097152.0, False),
        ("explain: graph breaks of the decode layer", 0, True),
    ]
    assert tb.must_show({"explain": {"explain": {"graph_breaks": 2}}})[0]["ok"] is False


def test_a_failed_table_prints_its_error_and_where():
    res = {"table": "fp8", "error": "ImportError: no FP8Cache", "elapsed_s": 3.0,
           "traceback": ['  File "a.py", line 1, in f', "    x()", '  File "b.py", line 9, in g',
                         "    import y", "ImportError: no FP8Cache"]}  # fmt: skip
    lines = tb.format_table("fp8", res).splitlines()
    assert lines == ["fp8 (3.0 s in its own process): FAILED: ImportError: no FP8Cache",
                     '  File "a.py", line 1, in f', '  File "b.py", line 9, in g']  # fmt: skip


def test_the_explain_table_prints_breaks_and_modes():
    res = {"explain": {"graphs": 2, "graph_breaks": 1, "break_reasons": ["print at x.py:3"]},
           "rows": [{"mode": "eager", "us_per_call": 80.0, "max_abs_diff": 0.0, "rel_diff": 0.0,
                     "first_call_s": None, "cudagraph_skips": None},
                    {"mode": "reduce-overhead", "error": "RuntimeError: no"}]}  # fmt: skip
    text = tb.format_table("explain", res)
    assert "2 graph(s), 1 graph break(s) (must be 0)" in text
    assert "  break: print at x.py:3" in text
    assert "reduce-overhead  error: RuntimeError: no" in text
    eager = next(x for x in text.splitlines() if x.startswith("eager"))
    assert eager.split() == ["eager", "80.0", "0", "0", "-", "-"]


# --- on a GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_decode_layer_matches_a_float64_reference(torch):
    # the layer the explain table traces: after its append the decode reads length + 1 rows,
    # the new token's included (one of six: leaving it out moves the output far past the
    # tolerance); rows past it are NaN and must not be read
    fxt = pytest.importorskip("ferrox_driver.integrations.torch")
    n_heads, n_kv, hd, prefill = 8, 2, 64, 5
    layer = tb.decode_layer(torch, fxt, n_heads, n_kv, hd, prefill + 8, "cuda")
    with torch.no_grad():
        for lin in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj):
            lin.weight.normal_(0.0, 0.05)
        layer.k_cache.fill_(float("nan"))
        layer.v_cache.fill_(float("nan"))
        layer.k_cache[:prefill].normal_()
        layer.v_cache[:prefill].normal_()
        layer.state.copy_(torch.tensor([prefill, 0], dtype=torch.int32))
        x = torch.randn(1, n_heads * hd, device="cuda", dtype=torch.bfloat16)
        k_old, v_old = layer.k_cache[:prefill].double(), layer.v_cache[:prefill].double()
        out = layer(x).double()
        w = {n: getattr(layer, n).weight.double() for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        xd = x.double()
        q = (xd @ w["q_proj"].T).view(n_heads, hd)
        k = torch.cat([k_old, (xd @ w["k_proj"].T).view(1, n_kv, hd)])
        v = torch.cat([v_old, (xd @ w["v_proj"].T).view(1, n_kv, hd)])
        group = n_heads // n_kv
        kh = k.repeat_interleave(group, dim=1)  # (t, heads, hd)
        vh = v.repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q, kh) / hd**0.5, dim=1)
        ref = torch.einsum("ht,thd->hd", p, vh).reshape(1, -1) @ w["o_proj"].T
    assert int(layer.state[0]) == prefill + 1
    with torch.no_grad():  # the token's own row went in where the state said, unchanged
        assert torch.equal(layer.k_cache[prefill], layer.k_proj(x).view(n_kv, hd))
        assert torch.equal(layer.v_cache[prefill], layer.v_proj(x).view(n_kv, hd))
    assert not out.isnan().any()
    # bf16 q/k/v projections and output: a few bf16 ulps of the output's scale
    assert float((out - ref).abs().max()) <= 0.03 * float(ref.abs().max())


@pytest.mark.gpu
def test_gpu_explain_table_traces_the_layer_without_breaks_and_compiles_it(torch, tmp_path):
    res = tb.run_table_process("explain", tmp_path / "x.json", True, 600, echo=print)
    assert "error" not in res, res.get("output_tail")
    assert res["explain"]["graph_breaks"] == 0, res["explain"]["break_reasons"]
    rows = {r["mode"]: r for r in res["rows"]}
    assert set(rows) == {"eager", "fullgraph=True", "reduce-overhead"}
    for mode in ("fullgraph=True", "reduce-overhead"):
        assert "error" not in rows[mode], rows[mode]
        # the same bf16 layer with other matmul kernels: a few bf16 roundings apart
        assert rows[mode]["rel_diff"] < 0.03, rows[mode]
    assert rows["reduce-overhead"]["cudagraph_skips"] == 0  # captured in a CUDA graph


def test_split_steps_gives_each_interval_to_the_implementation_that_ran_it():
    # stamps: prefill (order[0]) | step 1 (order[1]) | step 2 (order[0]) | ...
    own = tb.split_steps([1.0, 2.0, 3.0, 4.0, 5.0], ("sdpa", "ferrox"))
    assert own == {"ferrox": [1.0, 3.0, 5.0], "sdpa": [2.0, 4.0]}
    own = tb.split_steps([1.0, 2.0], ("ferrox", "sdpa"))
    assert own == {"sdpa": [1.0], "ferrox": [2.0]}


def test_alternating_steps_run_the_implementations_in_turn(torch):
    # what each forward ran, read from the config as the forward starts
    model = tb.build_model(torch, TINY, "cpu")
    ran = []
    model.register_forward_pre_hook(lambda m, a: ran.append(m.config._attn_implementation))
    prompt = tb.prompt_ids(torch, 12, TINY["vocab_size"], "cpu")
    order = ("eager", "sdpa")
    run = tb.time_generate(torch, model, prompt, 6, 1, lambda: None,
                           on_step=tb.alternate_steps(model, order),
                           cache_implementation="static", disable_compile=True)  # fmt: skip
    assert ran == ["eager", "sdpa", "eager", "sdpa", "eager", "sdpa"] * 2  # warm-up, timed
    own = tb.split_steps(run["step_intervals_ms"], order)
    assert len(own["sdpa"]) == 3 and len(own["eager"]) == 2

"""``python -m ferrox_driver bench --only torch``: ferrox inside PyTorch and transformers.

The tables of issue 47's "Must show", medians, bf16:

- ``compiled``: a Llama-3-8B-shaped model (random weights built on the GPU) generating with a
  static cache and transformers' own ``torch.compile`` of the decode step, greedy, after
  CONTEXT prompt tokens, ``attn_implementation="sdpa"`` against ``"ferrox"``.
- ``eager``: the same with ``disable_compile=True``; the two take turns step by step within
  one generate call (an eager step is host-bound and the host's pace drifts over seconds:
  neighbouring steps share it), four such calls, a row the median over its own steps.
- ``fp8``: at 131072 tokens, ferrox over ``FP8Cache`` against SDPA over a bf16 ``StaticCache``,
  both compiled: time per step and the caches' device bytes.
- ``growing``: host time per ``gqa_decode`` over a growing ``k[:n]`` (``growing.growing_rows``).
- ``explain``: ``torch._dynamo.explain`` of a decode layer on the ``torch.ops.ferrox`` ops, and
  that layer under ``torch.compile(fullgraph=True)`` and ``mode="reduce-overhead"``.

A step's time is the median interval between decode steps, stamped by a logits processor that
synchronizes the device and reads ``time.perf_counter()`` (transformers calls the processors
once per generated token, after that token's forward: the prefill's stamp and then one per
decode step); two warm-up ``generate`` calls of the same length come first (they compile).

Each table runs in its own process (``python -m ferrox_driver.apps.bench.torch_bench --table
NAME --json FILE``): a fresh CUDA context, fresh ``torch.compile`` state, no memory held over
from another table. The parent collects the JSON, prints the tables and writes
``torch_bench.json``. Unless ``TORCHINDUCTOR_CACHE_DIR`` is set, the tables of one run share
a fresh inductor cache directory, so the compile columns are cold compiles and the user's
cache is left alone. Between the rows of a table, dynamo is reset (its code caches and CUDA
graph trees) and transformers' compiled call and remembered static-cache length dropped, so
every row compiles for itself and no row is compiled with dynamic shapes learned from another.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import gc
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["TABLES", "run_torch_bench", "step_intervals_ms", "median_step_ms", "main"]

TABLES = ("compiled", "eager", "fp8", "growing", "explain")
# hidden tables that test the process-per-table plumbing without a GPU
SELFTESTS = ("selftest", "selftest-error", "selftest-crash", "selftest-hang")
TABLE_TIMEOUT_S = 560  # a table stays well under 8 minutes; a device command gets 10

# Llama-3-8B's widths (random weights)
LLAMA_8B: dict[str, Any] = {
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2**18,
    "tie_word_embeddings": False,
}
CONTEXTS = (4096, 32768)
FP8_CONTEXT = 131072
NEW_TOKENS, WARMUPS = 32, 2
EAGER_ROUNDS = 4  # eager rows: timed generate calls whose steps alternate the two
QUICK_CONTEXT, QUICK_NEW_TOKENS, QUICK_WARMUPS = 4096, 8, 1
MUST = {"compiled": 1.00, "eager": 1.00, "fp8": 0.95, "fp8_memory": 0.52}
# growing.growing_rows()'s keys that issue 47 sets a bound on (host us per call; bytes)
GROWING_MUST = {"growing_nhd_us": 20.0, "growing_hnd_us": 20.0, "random_us": 25.0,
                "random_memory_growth_bytes": 0}  # fmt: skip


class NoCudaError(RuntimeError):
    """A table needs PyTorch with a CUDA device and this process has none."""


# --- the step clock --------------------------------------------------------------------------


def step_intervals_ms(stamps: Sequence[float]) -> list[float]:
    """Milliseconds between consecutive ``time.perf_counter()`` stamps (one per generated
    token: the first after the prefill, so the intervals are the decode steps)."""
    if len(stamps) < 2:
        raise ValueError(
            f"stamps: expected at least two (a prefill and a decode step), got {len(stamps)}"
        )
    return [1e3 * (b - a) for a, b in itertools.pairwise(stamps)]


def median_step_ms(stamps: Sequence[float]) -> float:
    """The median of ``step_intervals_ms(stamps)``."""
    return float(statistics.median(step_intervals_ms(stamps)))


def step_stamper(sync: Callable[[], None], on_step: Callable[[int], None] | None = None) -> Any:
    """A transformers ``LogitsProcessor`` that calls ``sync()`` and appends
    ``time.perf_counter()`` to its ``stamps`` each time it is called, then ``on_step(number
    of stamps)`` if given; scores pass unchanged."""
    from transformers import LogitsProcessor

    class StepStamps(LogitsProcessor):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            sync()
            self.stamps.append(time.perf_counter())
            if on_step is not None:
                on_step(len(self.stamps))
            return scores

    return StepStamps()


# --- the parent: one process per table -------------------------------------------------------


def run_torch_bench(
    tables: Sequence[str] = TABLES,
    out_dir: Path | None = None,
    quick: bool = False,
    timeout_s: float = TABLE_TIMEOUT_S,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run each table in its own process, print the tables, write ``out_dir/torch_bench.json``.

    Returns:
        ``{"quick", "inductor_cache", "tables": {name: result}, "must_show"}``: a table that
        failed has ``"error"`` (and ``"output_tail"``, its process's last lines) in its
        result; ``must_show`` lists issue 47's targets against what the tables measured.
    Raises:
        ValueError: a name in ``tables`` is not a table.
    """
    unknown = [t for t in tables if t not in TABLES + SELFTESTS]
    if unknown or not tables:
        raise ValueError(f"tables: expected some of {', '.join(TABLES)}, got {list(tables)}")
    env = dict(os.environ)
    fresh = "TORCHINDUCTOR_CACHE_DIR" not in env
    cache_dir = tempfile.mkdtemp(prefix="ferrox-torch-bench-inductor-") if fresh else None
    if cache_dir is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    result: dict[str, Any] = {
        "quick": quick,
        "inductor_cache": "fresh for this run" if fresh else env["TORCHINDUCTOR_CACHE_DIR"],
        "tables": {},
    }
    try:
        with tempfile.TemporaryDirectory(prefix="ferrox-torch-bench-") as tmp:
            for name in tables:
                echo(f"--- table {name}: its own process ---")
                res = run_table_process(
                    name, Path(tmp) / f"{name}.json", quick, timeout_s, env, echo
                )
                result["tables"][name] = res
                echo(format_table(name, res))
    finally:
        if cache_dir is not None:
            shutil.rmtree(cache_dir, ignore_errors=True)
    result["must_show"] = must_show(result["tables"])
    echo("must show (issue 47):")
    for m in result["must_show"]:
        verdict = "ok" if m["ok"] else "NOT MET"
        echo(f"  {m['what']:<48} {m['value']:>8.3g}  must be <= {m['must']:<5} {verdict}")
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "torch_bench.json").write_text(json.dumps(result, indent=1))
        echo(f"written: {out_dir / 'torch_bench.json'}")
    return result


def must_show(tables: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 47's targets that the tables measured: ``{"what", "value", "must", "ok"}``
    each (value <= must); a table that failed or did not run adds none."""
    found = []

    def add(what: str, value: float, must: float) -> None:
        found.append({"what": what, "value": value, "must": must, "ok": value <= must})

    for name in ("compiled", "eager"):
        for r in tables.get(name, {}).get("rows", []):
            add(f"{name}, {r['context']} tokens: ferrox/sdpa ms/step", r["ratio"], r["must_reach"])
    for r in tables.get("fp8", {}).get("rows", []):
        add(f"fp8 cache, {r['context']} tokens: ferrox/sdpa ms/step", r["ratio"], r["must_reach"])
        add(f"fp8 cache, {r['context']} tokens: cache bytes ratio", r["memory_ratio"],
            r["memory_must_reach"])  # fmt: skip
    for r in tables.get("growing", {}).get("rows", []):
        if r["what"] in GROWING_MUST:
            add(f"growing: {r['what']}", r["value"], GROWING_MUST[r["what"]])
    explained = tables.get("explain", {}).get("explain")
    if explained is not None:
        add("explain: graph breaks of the decode layer", explained["graph_breaks"], 0)
    return found


def run_table_process(
    name: str,
    json_path: Path,
    quick: bool,
    timeout_s: float,
    env: dict[str, str] | None = None,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """``python -m ferrox_driver.apps.bench.torch_bench --table name --json json_path``, its
    output echoed as it comes; its JSON, with ``elapsed_s`` and ``returncode`` added (a
    process that wrote none, or ran past ``timeout_s`` and was killed: an ``error``)."""
    cmd = [
        sys.executable,
        "-m",
        "ferrox_driver.apps.bench.torch_bench",
        "--table",
        name,
        "--json",
        str(json_path),
        *(["--quick"] if quick else []),
    ]
    tail: collections.deque[str] = collections.deque(maxlen=40)
    t0 = time.perf_counter()
    # its own session, so a timeout ends it and the compile workers it started, and no more
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    killed = threading.Event()

    def kill() -> None:
        killed.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout_s, kill)
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            echo(f"  | {tail[-1]}")
        returncode = proc.wait()
    finally:
        timer.cancel()
    elapsed = time.perf_counter() - t0
    res: dict[str, Any] = {"table": name}
    if killed.is_set():
        res["error"] = f"killed after {timeout_s:.0f} s (the table's time limit)"
    else:
        try:
            res = json.loads(json_path.read_text())
        except (OSError, ValueError) as exc:
            res["error"] = f"exit status {returncode} and no JSON ({type(exc).__name__})"
    res["elapsed_s"] = round(elapsed, 1)
    res["returncode"] = returncode
    if "error" in res:
        res["output_tail"] = list(tail)
    return res


# --- the child: one table --------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``--table NAME --json FILE [--quick]``: run one table, write its JSON (a failed table:
    ``{"table", "error", "traceback"}``, exit status 1)."""
    parser = argparse.ArgumentParser(prog="python -m ferrox_driver.apps.bench.torch_bench")
    parser.add_argument("--table", required=True, choices=TABLES + SELFTESTS)
    parser.add_argument("--json", required=True, type=Path, help="where the result goes")
    parser.add_argument("--quick", action="store_true", help="4096 tokens, 8 steps, 1 warm-up")
    args = parser.parse_args(argv)
    try:
        result = {"table": args.table, **TABLE_FUNCS[args.table](args.quick)}
        status = 0
    except Exception as exc:
        print(f"table {args.table}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        result = {
            "table": args.table,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc().splitlines()[-12:],
        }
        status = 1
    tmp = args.json.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(args.json)
    return status


def require_cuda(table: str) -> Any:
    """PyTorch, when it sees a CUDA device. Raises NoCudaError naming the table otherwise."""
    try:
        import torch
    except ImportError:
        raise NoCudaError(f"table {table} needs PyTorch (with CUDA); it is not installed") from None
    if not torch.cuda.is_available():
        raise NoCudaError(
            f"table {table} needs a CUDA device: torch.cuda.is_available() is False "
            f"(torch {torch.__version__})"
        )
    return torch


def versions(torch: Any) -> dict[str, Any]:
    import transformers

    from ..._version import __version__

    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ferrox_driver": __version__,
    }


# --- generate(), timed -----------------------------------------------------------------------


def cache_kwarg() -> str:
    """The name generate() takes a cache by: ``cache`` from transformers 5.24 on
    (``past_key_values`` is deprecated there), ``past_key_values`` before."""
    from transformers.generation import utils

    names = getattr(utils, "ALL_CACHE_NAMES", ["past_key_values"])
    return "cache" if "cache" in names else "past_key_values"


def build_model(torch: Any, config: dict[str, Any], device: str, impl: str = "sdpa") -> Any:
    """A LlamaForCausalLM of ``config``'s widths, random bf16 weights made on ``device``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            LlamaConfig(**config), dtype=torch.bfloat16, attn_implementation=impl
        )
    return model.eval()


def use_attention(model: Any, impl: str) -> None:
    """Switch the model's attention (``ferrox``: registered with transformers first)."""
    if impl == "ferrox":
        from ...integrations import transformers as fx_transformers

        fx_transformers.register()
    model.set_attn_implementation(impl)
    if model.config._attn_implementation != impl:
        raise RuntimeError(
            f"set_attn_implementation({impl!r}) left the model on "
            f"{model.config._attn_implementation!r}"
        )


def forget_compiles(torch: Any, model: Any) -> None:
    """Dynamo's caches and CUDA graph trees reset, transformers' compiled call and remembered
    static-cache length dropped, memory given back: the next row starts as a fresh process's
    first would (the disk caches aside)."""
    torch._dynamo.reset()
    for attr in ("_compiled_call", "_last_compile_config", "_previous_max_cache_length"):
        if attr in vars(model):
            delattr(model, attr)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compile_config_used(model: Any) -> dict[str, Any] | None:
    """The CompileConfig generate() compiled with (None: it did not compile), as a dict."""
    cfg = vars(model).get("_last_compile_config")
    if cfg is None or "_compiled_call" not in vars(model):
        return None
    return {
        k: v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)
        for k, v in cfg.to_dict().items()
    }


def time_generate(
    torch: Any,
    model: Any,
    prompt: Any,
    new_tokens: int,
    warmups: int,
    sync: Callable[[], None],
    cache: Any = None,
    on_step: Callable[[int], None] | None = None,
    **generate_kwargs: Any,
) -> dict[str, Any]:
    """``warmups`` generate calls then one timed, each of ``new_tokens`` greedy tokens after
    ``prompt`` (a (1, n) id tensor; an all-ones attention mask). ``cache``: a transformers
    Cache passed to every call, ``reset()`` before each; else ``generate_kwargs`` say
    (``cache_implementation="static"``). ``on_step``: called with 0 before each call and
    with the number of stamps after each stamp (`step_stamper`).

    Returns:
        ``ms_per_step`` (median decode-step interval of the timed call), ``steps``,
        ``step_ms_min``/``max``, ``first_call_s``, ``timed_call_s``, ``compile_s`` (the first
        call's wall time less the timed call's), ``compile_config`` (what generate compiled
        with, None when it did not), dynamo's ``graphs``, ``graph_breaks``,
        ``cudagraph_skips`` over all calls, and the timed call's ``tokens``.
    """
    from torch._dynamo.utils import counters
    from transformers import LogitsProcessorList

    counters.clear()
    mask = torch.ones_like(prompt)
    walls, stamper, out = [], None, None
    for _ in range(warmups + 1):
        stamper = step_stamper(sync, on_step)
        if on_step is not None:
            on_step(0)
        kwargs = dict(generate_kwargs)
        if cache is not None:
            cache.reset()
            kwargs[cache_kwarg()] = cache
        sync()
        t0 = time.perf_counter()
        out = model.generate(
            prompt,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([stamper]),
            pad_token_id=model.config.eos_token_id,
            **kwargs,
        )
        sync()
        walls.append(time.perf_counter() - t0)
    assert stamper is not None and out is not None
    steps = step_intervals_ms(stamper.stamps)
    return {
        "ms_per_step": float(statistics.median(steps)),
        "steps": len(steps),
        "step_intervals_ms": steps,
        "step_ms_min": min(steps),
        "step_ms_max": max(steps),
        "first_call_s": round(walls[0], 2),
        "timed_call_s": round(walls[-1], 2),
        "compile_s": round(walls[0] - walls[-1], 1),
        "compile_config": compile_config_used(model),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]),
        "tokens": out[0, prompt.shape[1] :].tolist(),
    }


def sizes(quick: bool, contexts: tuple[int, ...]) -> tuple[tuple[int, ...], int, int]:
    """(contexts, new tokens, warm-up calls) of a generate table; ``quick``: a smoke run."""
    if quick:
        return (QUICK_CONTEXT,), QUICK_NEW_TOKENS, QUICK_WARMUPS
    return contexts, NEW_TOKENS, WARMUPS


def same_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def prompt_ids(torch: Any, context: int, vocab: int, device: str) -> Any:
    """A fixed pseudo-random prompt of ``context`` token ids (the same for every row)."""
    gen = torch.Generator().manual_seed(47)
    return torch.randint(0, vocab, (1, context), generator=gen).to(device)


def _generate_table(table: str, quick: bool, compiled: bool) -> dict[str, Any]:
    torch = require_cuda(table)
    contexts, new_tokens, warmups = sizes(quick, CONTEXTS)
    model = build_model(torch, LLAMA_8B, "cuda")
    gen_kwargs: dict[str, Any] = {"cache_implementation": "static"}
    if not compiled:
        gen_kwargs["disable_compile"] = True
    rows = []
    for context in contexts:
        prompt = prompt_ids(torch, context, LLAMA_8B["vocab_size"], "cuda")
        runs: dict[str, Any] = {}
        if compiled or quick:
            for impl in ("sdpa", "ferrox"):
                if compiled:
                    forget_compiles(torch, model)
                use_attention(model, impl)
                print(f"{table}: {impl} at {context} tokens ...", flush=True)
                runs[impl] = time_generate(
                    torch, model, prompt, new_tokens, warmups, torch.cuda.synchronize,
                    **gen_kwargs,
                )  # fmt: skip
        else:
            runs = alternating_runs(torch, model, prompt, new_tokens, warmups, **gen_kwargs)
        for impl in ("sdpa", "ferrox"):
            print(f"{table}: {impl} at {context}: {runs[impl]['ms_per_step']:.2f} ms/step",
                  flush=True)  # fmt: skip
        rows.append(
            {
                "context": context,
                "sdpa": runs["sdpa"],
                "ferrox": runs["ferrox"],
                "ratio": runs["ferrox"]["ms_per_step"] / runs["sdpa"]["ms_per_step"],
                "must_reach": MUST[table],
                "tokens_equal_prefix": same_prefix(
                    runs["ferrox"]["tokens"], runs["sdpa"]["tokens"]
                ),
            }
        )
    cfg = model.generation_config.compile_config
    notes = (
        [
            f"generation_config.compile_config: {cfg!r}"
            + (
                " (None: generate compiles with model._default_compile_config())"
                if cfg is None
                else ""
            ),
            "compiled with (per row, from model._last_compile_config): "
            + "; ".join(
                f"{r['context']} {i}: {r[i]['compile_config']}"
                for r in rows
                for i in ("sdpa", "ferrox")
            ),
        ]
        if compiled
        else ["generate(disable_compile=True): the model's forward runs eagerly"]
    )
    return {
        **versions(torch),
        "new_tokens": new_tokens,
        "warmups": warmups,
        "rows": rows,
        "notes": notes,
    }


def alternating_runs(
    torch: Any, model: Any, prompt: Any, new_tokens: int, warmups: int, **gen_kwargs: Any
) -> dict[str, Any]:
    """Eager SDPA and ferrox on the same steps' pace: ``warmups`` + 1 plain generate calls
    per implementation (warm-up, and the timed one's tokens), then EAGER_ROUNDS generate
    calls in which the two take turns step by step (`alternate_steps`), each round starting
    with the other. An eager step is host-bound and the host's pace drifts over seconds;
    neighbouring steps share it, so each implementation's row is the median over its own
    steps of every round (`split_steps`)."""
    sync = torch.cuda.synchronize
    use_attention(model, "ferrox")  # (registered, and checked to take)
    runs: dict[str, Any] = {}
    for impl in ("sdpa", "ferrox"):
        use_attention(model, impl)
        print(f"eager: {impl} alone, warm-up and tokens ...", flush=True)
        runs[impl] = time_generate(torch, model, prompt, new_tokens, warmups, sync,
                                   **gen_kwargs)  # fmt: skip
    steps: dict[str, list[float]] = {"sdpa": [], "ferrox": []}
    for r in range(EAGER_ROUNDS):
        order = ("sdpa", "ferrox") if r % 2 == 0 else ("ferrox", "sdpa")
        print(f"eager: round {r + 1}, steps taking turns, {order[0]} first ...", flush=True)
        run = time_generate(torch, model, prompt, new_tokens, 0, sync,
                            on_step=alternate_steps(model, order), **gen_kwargs)  # fmt: skip
        for impl, own in split_steps(run["step_intervals_ms"], order).items():
            steps[impl] += own
    for impl in ("sdpa", "ferrox"):
        own = steps[impl]
        runs[impl] = {
            **runs[impl],
            "alone_ms_per_step": runs[impl]["ms_per_step"],
            "ms_per_step": float(statistics.median(own)),
            "steps": len(own),
            "step_intervals_ms": own,
            "step_ms_min": min(own),
            "step_ms_max": max(own),
            "rounds": EAGER_ROUNDS,
        }
    return runs


def alternate_steps(model: Any, order: tuple[str, str]) -> Callable[[int], None]:
    """`time_generate`'s ``on_step`` that runs the prefill with ``order[0]`` and then the
    decode steps with ``order[1]``, ``order[0]``, ... (the attention implementation is read
    per forward: set on the config, no re-registration)."""

    def on_step(stamps: int) -> None:
        model.config._attn_implementation = order[stamps % 2]

    return on_step


def split_steps(intervals: Sequence[float], order: tuple[str, str]) -> dict[str, list[float]]:
    """The step intervals of an `alternate_steps` call by implementation: interval k (after
    stamp k, before stamp k + 1) ran ``order[(k + 1) % 2]``."""
    own: dict[str, list[float]] = {order[0]: [], order[1]: []}
    for k, ms in enumerate(intervals):
        own[order[(k + 1) % 2]].append(ms)
    return own


def compiled_table(quick: bool) -> dict[str, Any]:
    """8B-shaped generate, transformers' default torch.compile: ferrox against SDPA."""
    return _generate_table("compiled", quick, compiled=True)


def eager_table(quick: bool) -> dict[str, Any]:
    """The same with ``disable_compile=True``."""
    return _generate_table("eager", quick, compiled=False)


def static_cache_nbytes(cache: Any) -> int:
    """A transformers StaticCache's device bytes: its layers' keys and values."""
    return int(sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers))


def fp8_table(quick: bool) -> dict[str, Any]:
    """131072 tokens: ferrox over FP8Cache against SDPA over a bf16 StaticCache, compiled."""
    torch = require_cuda("fp8")
    from transformers import StaticCache

    from ...integrations.transformers import FP8Cache

    (context,), new_tokens, warmups = sizes(quick, (FP8_CONTEXT,))
    max_cache_len = context + new_tokens
    model = build_model(torch, LLAMA_8B, "cuda")
    prompt = prompt_ids(torch, context, LLAMA_8B["vocab_size"], "cuda")
    runs: dict[str, Any] = {}
    nbytes: dict[str, int] = {}
    peaks: dict[str, int] = {}
    cache: Any
    for impl in ("sdpa", "ferrox"):
        forget_compiles(torch, model)
        use_attention(model, impl)
        torch.cuda.reset_peak_memory_stats()
        if impl == "sdpa":
            cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        else:
            cache = FP8Cache(model, max_cache_len=max_cache_len)
        print(f"fp8: {impl} at {context} tokens ...", flush=True)
        runs[impl] = time_generate(
            torch, model, prompt, new_tokens, warmups, torch.cuda.synchronize, cache=cache
        )
        nbytes[impl] = static_cache_nbytes(cache) if impl == "sdpa" else int(cache.nbytes)
        peaks[impl] = int(torch.cuda.max_memory_allocated())
        print(
            f"fp8: {impl}: {runs[impl]['ms_per_step']:.2f} ms/step, cache "
            f"{nbytes[impl] / 2**30:.2f} GiB",
            flush=True,
        )
        del cache
    row = {
        "context": context,
        "max_cache_len": max_cache_len,
        "sdpa_bf16": runs["sdpa"],
        "ferrox_fp8": runs["ferrox"],
        "ratio": runs["ferrox"]["ms_per_step"] / runs["sdpa"]["ms_per_step"],
        "must_reach": MUST["fp8"],
        "sdpa_cache_bytes": nbytes["sdpa"],
        "fp8_cache_bytes": nbytes["ferrox"],
        "memory_ratio": nbytes["ferrox"] / nbytes["sdpa"],
        "memory_must_reach": MUST["fp8_memory"],
        "peak_allocated_bytes": peaks,
    }
    notes = [
        "SDPA: a transformers StaticCache (bf16) passed to generate; ferrox: "
        "FP8Cache(model, max_cache_len) (e4m3); both reset() before each call; cache bytes: "
        "the StaticCache layers' keys + values, FP8Cache.nbytes"
    ]
    return {
        **versions(torch),
        "new_tokens": new_tokens,
        "warmups": warmups,
        "rows": [row],
        "notes": notes,
    }


def growing_table(quick: bool) -> dict[str, Any]:
    """Host us per call of gqa_decode over a growing ``k[:n]`` (growing.growing_rows)."""
    torch = require_cuda("growing")
    try:
        from .growing import growing_rows  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        return {
            **versions(torch),
            "rows": [],
            "notes": [f"ferrox_driver.apps.bench.growing is not there ({exc}): no rows"],
        }
    measured = growing_rows()
    rows = [{"what": k, "value": v} for k, v in measured.items()]
    return {**versions(torch), "rows": rows, "notes": ["growing.growing_rows(), 32/8/128 bf16"]}


# --- the decode layer, traced ----------------------------------------------------------------


def decode_layer(
    torch: Any, fxt: Any, n_heads: int, n_kv: int, head_dim: int, capacity: int, device: str
) -> Any:
    """A bf16 decode layer on ferrox's torch ops: q/k/v/o projections, ``fxt.kv_append`` of the
    token's K and V into an NHD cache (its length in ``state``), ``fxt.gqa_decode`` with the
    length read from the state on the device."""
    hidden = n_heads * head_dim

    class DecodeLayer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            kw = {"bias": False, "device": device, "dtype": torch.bfloat16}
            self.q_proj = torch.nn.Linear(hidden, n_heads * head_dim, **kw)
            self.k_proj = torch.nn.Linear(hidden, n_kv * head_dim, **kw)
            self.v_proj = torch.nn.Linear(hidden, n_kv * head_dim, **kw)
            self.o_proj = torch.nn.Linear(n_heads * head_dim, hidden, **kw)
            shape = (capacity, n_kv, head_dim)
            self.register_buffer("k_cache", torch.zeros(shape, device=device, dtype=torch.bfloat16))
            self.register_buffer("v_cache", torch.zeros(shape, device=device, dtype=torch.bfloat16))
            self.register_buffer("state", fxt.new_state(torch.device(device)))

        def forward(self, x: Any) -> Any:
            q = self.q_proj(x).view(n_heads, head_dim)
            k = self.k_proj(x).view(n_kv, head_dim)
            v = self.v_proj(x).view(n_kv, head_dim)
            fxt.kv_append(self.k_cache, self.v_cache, k, v, self.state)
            o = fxt.gqa_decode(q, self.k_cache, self.v_cache, self.state[:1])
            return self.o_proj(o.reshape(1, n_heads * head_dim))

    return DecodeLayer()


def explain_summary(explained: Any) -> dict[str, Any]:
    """``torch._dynamo.explain``'s output as JSON: graphs, breaks, each break's reason (its
    first line and dynamo's explanation line) and where (the last user frame)."""
    reasons = []
    for r in explained.break_reasons:
        where = ""
        if getattr(r, "user_stack", None):
            frame = r.user_stack[-1]
            where = f" at {frame.filename}:{frame.lineno}"
        lines = [x.strip() for x in str(r.reason).strip().splitlines()]
        why = [x for x in lines[1:] if x.startswith("Explanation:")][:1]
        reasons.append(" ".join(lines[:1] + why) + where)
    return {
        "graphs": int(explained.graph_count),
        "graph_breaks": int(explained.graph_break_count),
        "break_reasons": reasons,
    }


def run_layer(
    torch: Any, fn: Callable[[Any], Any], xs: Any, warmups: int, step_begin: bool
) -> tuple[list[float], list[Any], float]:
    """``fn`` over every x of ``xs`` in order (each call appends a token); the last
    ``len(xs) - warmups`` calls timed with CUDA events, each alone. Returns (us per timed
    call, every output as float32, the first call's wall seconds)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times, outs, first_s = [], [], 0.0
    for i, x in enumerate(xs):
        if step_begin:
            torch.compiler.cudagraph_mark_step_begin()
        t0 = time.perf_counter()
        start.record()
        y = fn(x)
        end.record()
        end.synchronize()
        if i == 0:
            first_s = time.perf_counter() - t0
        if i >= warmups:
            times.append(1e3 * start.elapsed_time(end))
        outs.append(y.float().clone())
    return times, outs, first_s


def explain_table(quick: bool) -> dict[str, Any]:
    """``torch._dynamo.explain`` of a 32/8/128 bf16 decode layer on the ferrox ops (graphs,
    breaks: must be 0), then the layer eager, under ``torch.compile(fullgraph=True)`` and
    ``mode="reduce-overhead"``: us per call (CUDA events, median) and the largest difference
    from the eager layer's outputs over the same calls."""
    torch = require_cuda("explain")
    from ...integrations import torch as fxt

    n_heads, n_kv, hd, prefill = 32, 8, 128, 4096
    warmups, timed = (3, 50) if quick else (5, 200)
    torch.manual_seed(47)
    base = decode_layer(torch, fxt, n_heads, n_kv, hd, prefill + 4 * (warmups + timed), "cuda")
    with torch.no_grad():
        for lin in (base.q_proj, base.k_proj, base.v_proj, base.o_proj):
            lin.weight.normal_(0.0, lin.in_features**-0.5)  # q, k, v and out of unit scale
        base.k_cache[:prefill].normal_()
        base.v_cache[:prefill].normal_()
        base.state.copy_(torch.tensor([prefill, 0], dtype=torch.int32))
    xs = torch.randn(warmups + timed, 1, n_heads * hd, device="cuda", dtype=torch.bfloat16)

    def fresh() -> Any:
        layer = copy.deepcopy(base)
        for buf in (layer.k_cache, layer.v_cache, layer.state):
            torch._dynamo.mark_static_address(buf)
        return layer

    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        torch._dynamo.reset()
        explained = explain_summary(torch._dynamo.explain(fresh())(xs[0]))
        ref_times, ref_outs, _ = run_layer(torch, fresh(), xs, warmups, False)
        scale = max(float(o.abs().max()) for o in ref_outs)
        rows.append(
            {
                "mode": "eager",
                "us_per_call": statistics.median(ref_times),
                "max_abs_diff": 0.0,
                "rel_diff": 0.0,
                "first_call_s": None,
                "cudagraph_skips": None,
            }
        )
        for mode, options in (
            ("fullgraph=True", {"fullgraph": True}),
            ("reduce-overhead", {"mode": "reduce-overhead"}),
        ):
            from torch._dynamo.utils import counters

            torch._dynamo.reset()
            counters.clear()
            fn = torch.compile(fresh(), **options)
            try:
                times, outs, first_s = run_layer(torch, fn, xs, warmups, mode == "reduce-overhead")
            except Exception as exc:  # a mode that cannot run says why; the others still do
                rows.append({"mode": mode, "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            diff = max(float((a - b).abs().max()) for a, b in zip(outs, ref_outs, strict=True))
            rows.append(
                {
                    "mode": mode,
                    "us_per_call": statistics.median(times),
                    "max_abs_diff": diff,
                    "rel_diff": diff / scale,
                    "first_call_s": round(first_s, 1),
                    "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]),
                }
            )
    notes = [
        f"32/8/128 bf16 layer, {prefill} tokens in an NHD cache, {warmups} warm-up and "
        f"{timed} timed calls, each appending a token; diffs against the eager layer's "
        f"outputs (rel: over their largest magnitude, {scale:.3g})"
    ]
    return {**versions(torch), "explain": explained, "rows": rows, "notes": notes}


# --- the hidden self-tests of the plumbing (no GPU) ------------------------------------------


def _selftest(quick: bool) -> dict[str, Any]:
    rows = [
        {"what": "fixed", "value": 2.5},
        {"what": "pid", "value": os.getpid()},
        {"what": "TORCHINDUCTOR_CACHE_DIR", "value": os.environ.get("TORCHINDUCTOR_CACHE_DIR")},
    ]
    return {"rows": rows, "notes": [f"quick={quick}"]}


def _selftest_error(quick: bool) -> dict[str, Any]:
    raise RuntimeError("the selftest-error table fails on purpose")


def _selftest_crash(quick: bool) -> dict[str, Any]:
    print("selftest-crash: leaving without a JSON", flush=True)
    os._exit(3)


def _selftest_hang(quick: bool) -> dict[str, Any]:
    print("selftest-hang: sleeping", flush=True)
    time.sleep(600)
    return {}


TABLE_FUNCS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "compiled": compiled_table,
    "eager": eager_table,
    "fp8": fp8_table,
    "growing": growing_table,
    "explain": explain_table,
    "selftest": _selftest,
    "selftest-error": _selftest_error,
    "selftest-crash": _selftest_crash,
    "selftest-hang": _selftest_hang,
}


# --- the tables, printed ---------------------------------------------------------------------


def _f(value: Any, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def format_table(name: str, res: dict[str, Any]) -> str:
    """One table's result as console lines (a failed one: its error and last output)."""
    where = [res["device"]] if "device" in res else []
    where += [f"{res['elapsed_s']} s in its own process"] if "elapsed_s" in res else []
    head = f"{name} ({', '.join(where)})" if where else name
    if "error" in res:
        frames = [
            line.strip() for line in res.get("traceback", []) if line.strip().startswith("File")
        ]
        return "\n".join([f"{head}: FAILED: {res['error']}", *(f"  {f}" for f in frames[-2:])])
    lines = [head]
    if name in ("compiled", "eager"):
        compiled = name == "compiled"
        lines.append(
            f"8B-shaped generate, {'transformers default torch.compile' if compiled else 'eager'}, "
            f"static cache, greedy, {res['new_tokens']} new tokens, {res['warmups']} warm-up "
            "call(s); median ms between decode steps"
        )
        lines.append(
            f"{'context':>7} {'sdpa ms':>8} {'ferrox ms':>9} {'ratio':>6} {'must':>6} "
            f"{'sdpa compile s':>14} {'ferrox compile s':>16} {'graphs s/f':>10} "
            f"{'breaks s/f':>10} {'same tokens':>11}"
        )
        for r in res["rows"]:
            s, f = r["sdpa"], r["ferrox"]
            lines.append(
                f"{r['context']:>7} {s['ms_per_step']:8.2f} {f['ms_per_step']:9.2f} "
                f"{r['ratio']:6.2f} {'<=' + _f(r['must_reach']):>6} {s['compile_s']:14.1f} "
                f"{f['compile_s']:16.1f} {s['graphs']:>4}/{f['graphs']:<5} "
                f"{s['graph_breaks']:>4}/{f['graph_breaks']:<5} "
                f"{r['tokens_equal_prefix']:>4}/{len(s['tokens'])}"
            )
    elif name == "fp8":
        lines.append(
            f"{'context':>7} {'sdpa bf16 ms':>12} {'ferrox fp8 ms':>13} {'ratio':>6} "
            f"{'must':>6} {'sdpa cache GiB':>14} {'fp8 cache GiB':>13} {'mem ratio':>9} "
            f"{'must':>6} {'compile s s/f':>13}"
        )
        for r in res["rows"]:
            s, f = r["sdpa_bf16"], r["ferrox_fp8"]
            lines.append(
                f"{r['context']:>7} {s['ms_per_step']:12.2f} {f['ms_per_step']:13.2f} "
                f"{r['ratio']:6.2f} {'<=' + _f(r['must_reach']):>6} "
                f"{r['sdpa_cache_bytes'] / 2**30:14.2f} {r['fp8_cache_bytes'] / 2**30:13.2f} "
                f"{r['memory_ratio']:9.3f} {'<=' + _f(r['memory_must_reach']):>6} "
                f"{s['compile_s']:>6.1f}/{f['compile_s']:<6.1f}"
            )
    elif name == "explain":
        ex = res["explain"]
        lines.append(
            f"torch._dynamo.explain of the decode layer: {ex['graphs']} graph(s), "
            f"{ex['graph_breaks']} graph break(s) (must be 0)"
        )
        lines += [f"  break: {reason}" for reason in ex["break_reasons"]]
        lines.append(
            f"{'mode':<16} {'us/call':>8} {'max |diff| vs eager':>19} {'rel':>8} "
            f"{'first call s':>12} {'cudagraph skips':>15}"
        )
        for r in res["rows"]:
            if "error" in r:
                lines.append(f"{r['mode']:<16} error: {r['error']}")
                continue
            lines.append(
                f"{r['mode']:<16} {r['us_per_call']:8.1f} {_f(r['max_abs_diff'], '.3g'):>19} "
                f"{_f(r.get('rel_diff'), '.2g'):>8} {_f(r['first_call_s'], '.1f'):>12} "
                f"{_f(r['cudagraph_skips'], 'd'):>15}"
            )
    else:  # growing, selftest: what / value
        for r in res.get("rows", []):
            value = r["value"]
            shown = f"{value:10.2f}" if isinstance(value, float) else f"{value!s:>10}"
            lines.append(f"  {r['what']:<60} {shown}")
    lines += [f"note: {n}" for n in res.get("notes", [])]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

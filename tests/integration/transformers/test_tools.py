"""The main job's model section and the benchmark, on CPU with the tiny model."""
from sparse_mla.integration.transformers import main_job
from sparse_mla.tools import bench_hf, harness


def test_model_section_generates_the_same_tokens_and_prints_times(capsys):
    assert main_job.run("cpu") is True
    out = capsys.readouterr().out
    # identical tokens, or (torch builds round differently) a first difference the section
    # itself explains as a near-tie; run() returning True already excludes any other
    differs = [line for line in out.splitlines() if "first differs" in line]
    assert "same greedy tokens: True" in out or (
        "same greedy tokens: False" in out and differs
        and all("a near-tie bf16 rounding can flip" in line for line in differs))
    assert out.count("ms/token") == 2 and "eager" in out and "sparse_mla" in out


def test_benchmark_runs_both_implementations_side_by_side(capsys):
    assert bench_hf.main(["--tiny", "--device", "cpu", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    prefill = [line.split() for line in out.splitlines() if line.split()[:1] in (["24"], ["40"])]
    assert len(prefill) == 2 and all(row[2] == "ms" and row[5] == "ms" for row in prefill)
    assert "same greedy tokens: True" in out
    # decode rows: impl, total "ms", tokens/s with the prefill, tokens/s of the steps alone
    decode = [line.split() for line in out.splitlines()
              if line.split()[:1] in (["eager"], ["sparse_mla"])]
    assert len(decode) == 2 and all(float(row[3]) > 0 and float(row[4]) > 0 for row in decode)
    # the step spread: p10 <= p50 <= p90 ms
    assert all(float(row[5]) <= float(row[7]) <= float(row[9]) for row in decode)


def test_token_clock_times_each_decode_step():
    """The benchmark's decode rate: generate hands out the prompt, then a token per step;
    the clock's median is over the gaps between tokens, the prefill excluded."""
    clock = harness.TokenClock()
    for t in (0.0, 5.0, 5.5, 6.25, 6.75):       # prompt, first token after a 5 s prefill
        clock.stamps.append(t)
    assert clock.gaps() == [0.5, 0.75, 0.5]
    assert clock.step_median() == 0.5
    short = harness.TokenClock()
    short.stamps = [0.0, 5.0]
    assert short.step_median() is None

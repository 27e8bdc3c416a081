"""The launch plan for DeepSeek-V4.1's records (docs/semantics.md §12): the sm_90 kernel decodes
528 B main rows alone or with 528 B, 288 B or 584 B extra rows; launches reading 288 B main
rows, or 584 B main rows beside V4.1 ones, take the portable kernel on every GPU and the plan
says why; the launcher accepts two sources of different tail-scaled records and nothing else
mixed."""
import pytest
import torch

from sparse_mla.ops.attention import KeySource, launch, plan


@pytest.fixture
def sm90_allowed(monkeypatch):
    """A process where the Gluon kernel would be allowed (no interpreter, not turned off)."""
    for var in ("TRITON_INTERPRET", "SPARSE_MLA_SM90", "SPARSE_MLA_SOFT_FP8"):
        monkeypatch.delenv(var, raising=False)
    if plan.sm90_disabled_reason() is not None:
        pytest.skip(plan.sm90_disabled_reason())


@pytest.mark.parametrize("fmt,extra,names", [("v4", "v41_fp4", "v4 + v41_fp4"),
                                              ("v41_fp4", None, "v41_fp4"),
                                              ("v41_fp4", "v41", "v41_fp4 + v41"),
                                              ("v4", "v41", "v4 + v41")])
def test_other_v41_pairs_route_to_the_portable_kernel(sm90_allowed, fmt, extra, names):
    q = torch.zeros(1, 1, 512, dtype=torch.bfloat16)
    g, why = plan.sm90_route(q, fmt, [], extra)
    assert g is None
    assert why.startswith(f"{names} rows (V4.1 records)") and "portable kernel" in why


@pytest.mark.parametrize("extra", [None, "v41", "v41_fp4", "v4"])
def test_528_main_rows_pass_the_record_check(sm90_allowed, extra):
    """528 B main rows alone or with 528 B / 288 B / 584 B extra rows get past the record
    checks: on CPU tensors the next check (the device) is the one that refuses."""
    q = torch.zeros(1, 1, 512, dtype=torch.bfloat16)
    g, why = plan.sm90_route(q, "v41", [], extra)
    assert g is None
    assert why == "tensors on cpu, the sm_90 kernel needs CUDA"


def test_mixed_v4_records_route_to_the_portable_kernel(sm90_allowed):
    q = torch.zeros(1, 1, 512, dtype=torch.bfloat16)
    assert plan.sm90_route(q, "v4", [], "v4")[1] != plan.sm90_route(q, "v4", [], "v32")[1]
    assert "one format" in plan.sm90_route(q, "v4", [], "v32")[1]


def test_launcher_rejects_mixing_other_formats():
    q = torch.zeros(1, 1, 576, dtype=torch.bfloat16)
    idx = torch.zeros(1, 4, dtype=torch.int32)
    v32 = KeySource(torch.zeros(2, 4, 656, dtype=torch.uint8), "v32", 4, idx)
    v41 = KeySource(torch.zeros(2, 4, 528, dtype=torch.uint8), "v41", 4, idx)
    out = torch.empty(1, 1, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="sources must share one cache format"):
        launch.run(q, [v32, v41], None, 1.0, out)


def test_sm90_launches_may_skip_the_tiny_shape():
    """A launch of one head block and two tiles takes the portable kernel's tiny shape where
    the sm_90 kernel could run it, unless ``sm90_tiny`` is off (V4.1 records: plan_launch passes
    ``V41_SM90_TINY``); the portable kernel's own choice does not change."""
    assert plan.launch_config(1, 1, 2, sm90=True)["tiny"]
    cfg = plan.launch_config(1, 1, 2, sm90=True, sm90_tiny=False)
    assert not cfg["tiny"] and cfg["dv"] == 1
    assert plan.launch_config(1, 1, 2, sm90_tiny=False)["tiny"]

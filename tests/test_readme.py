"""The README's examples run as written (CPU here; CUDA where there is a GPU), and the README
stays a README (<= 10 KB; the manual lives in docs/)."""
import pathlib
import re

import sparse_mla  # the package root: where README.md lies

OP_MARK = "<!-- README example: tests/test_readme.py runs this block -->"
BACKEND_MARK = "<!-- README backend example: tests/test_readme.py runs this block -->"
MAX_BYTES = 10_000


def _readme() -> str:
    return (pathlib.Path(sparse_mla.__file__).parent / "README.md").read_text(encoding="utf-8")


def _example(mark: str) -> str:
    readme = _readme()
    assert mark in readme, f"the README lost its example marker {mark!r}"
    block = re.search(r"```python\n(.*?)```", readme[readme.index(mark):], re.S)
    return block.group(1)


def _run(mark: str, name: str) -> dict:
    ns = {"__name__": name}
    exec(compile(_example(mark), f"README.md {name}", "exec"), ns)
    return ns


def test_readme_is_at_most_10_kb():
    size = len(_readme().encode("utf-8"))
    assert size <= MAX_BYTES, f"README.md is {size} B; move detail into docs/ (limit {MAX_BYTES})"


def test_readme_example_runs_as_written(capsys):
    import torch
    ns = _run(OP_MARK, "readme_example")
    printed = capsys.readouterr().out
    # the plan says before the run what will run, and for Triton the kernel's file
    assert "flashmla_sparse_decode: will run " in printed
    assert "flashmla_sparse_decode: ran " in printed
    if "will run triton" in printed:
        assert "kernel in ops/attention/" in printed
    out, lse, q_out = ns["out"], ns["lse"], ns["q_out"]
    assert out.shape == (4, 1, 16, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (4, 16, 1) and torch.isfinite(lse).all()
    assert torch.isfinite(out.float()).all() and out.float().abs().sum() > 0
    assert q_out.shape == (4, 64, 512) and not q_out[:, 16:].any()


def test_readme_backend_example_runs_as_written(capsys):
    import torch
    ns = _run(BACKEND_MARK, "readme_backend_example")
    printed = capsys.readouterr().out
    assert "'flashmla_sparse_prefill':" in printed and "'fused_qnorm_rope_insert_v4':" in printed
    out, batch = ns["out"], ns["batch"]
    assert batch.num_tokens == 8
    assert out.shape == (8, 16, 512) and out.dtype == torch.bfloat16
    assert torch.isfinite(out.float()).all() and out.float().abs().sum(dim=(1, 2)).gt(0).all()

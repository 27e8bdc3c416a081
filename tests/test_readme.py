"""The README's usage example runs as written (CPU here; CUDA where there is a GPU)."""
import pathlib
import re

import sparse_mla  # the package root: where README.md lies

MARK = "<!-- README example: tests/test_readme.py runs this block -->"


def _example() -> str:
    readme = (pathlib.Path(sparse_mla.__file__).parent / "README.md").read_text()
    assert MARK in readme, "the README lost its example marker"
    block = re.search(r"```python\n(.*?)```", readme[readme.index(MARK):], re.S)
    return block.group(1)


def test_readme_example_runs_as_written(capsys):
    import torch
    ns = {"__name__": "readme_example"}
    exec(compile(_example(), "README.md example", "exec"), ns)
    assert "flashmla_sparse_decode: ran " in capsys.readouterr().out
    out, lse, q_out = ns["out"], ns["lse"], ns["q_out"]
    assert out.shape == (4, 1, 16, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (4, 16, 1) and torch.isfinite(lse).all()
    assert torch.isfinite(out.float()).all() and out.float().abs().sum() > 0
    assert q_out.shape == (4, 64, 512) and not q_out[:, 16:].any()

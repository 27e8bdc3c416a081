"""The Gluon kernel's process-wide compile hook: importing the kernel module must leave every
other Triton compile in the process working and unchanged, on every tested release (3.7+
call the hook with no arguments for a cache key; 3.6 never does)."""
import re

import pytest
import triton
import triton.language as tl

from sparse_mla.ops.attention import plan

pytestmark = pytest.mark.skipif(
    not plan.sm90_triton_supported() or plan.triton_interpreting(),
    reason="the Gluon module is imported only on the tested Triton releases")


@triton.jit
def _copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)


def _compile_plain():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    src = ASTSource(_copy, {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32",
                            "BLOCK": "constexpr"}, constexprs={(3,): 128})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def _ptx_body(kernel):
    # without comments and file names: a build taken from Triton's cache may name the test file
    # under an earlier name (the cache key is the source, not its path)
    lines = (re.sub(r"\s*//.*", "", line) for line in kernel.asm["ptx"].splitlines())
    return "\n".join(line for line in lines if line and not line.lstrip().startswith(".file"))


def test_the_hook_answers_the_cache_key_call():
    from triton import knobs

    from sparse_mla.ops.attention.sm90 import hooks, kernel  # noqa: F401
    hook = knobs.runtime.add_stages_inspection_hook
    assert isinstance(hook, hooks._Hook)
    key, digest = hook()
    assert isinstance(key, str) and isinstance(digest, str) and key.endswith(hooks._KEY)


def test_install_chains_a_hook_found_before_and_only_once(monkeypatch):
    from triton import knobs

    from sparse_mla.ops.attention.sm90 import hooks
    calls = []

    def previous(*args):
        calls.append(len(args))
        return ("prev", "p0") if not args else None
    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", previous)
    hooks.install()
    hooks.install()
    hook = knobs.runtime.add_stages_inspection_hook
    assert isinstance(hook, hooks._Hook) and hook.previous is previous
    assert hook()[0] == "prev" + hooks._KEY and calls == [0]
    stages = {}
    hook(None, stages, None, None, 90)      # no ptx / llir stages: nothing to wrap
    assert calls == [0, 5] and stages == {}


def test_other_kernels_compile_unchanged_after_the_import(monkeypatch):
    """A plain Triton kernel compiled for sm_90a with the hook installed has the same PTX as
    without any hook (the hook edits ``sm90_kernel`` builds only)."""
    from triton import knobs

    from sparse_mla.ops.attention.sm90 import kernel  # noqa: F401
    with_hook = _compile_plain()
    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", None)
    without = _compile_plain()
    assert _ptx_body(with_hook) == _ptx_body(without)

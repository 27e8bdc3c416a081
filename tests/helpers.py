"""Shared test utilities: devices to test on, poisoned caches, byte-level comparisons."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

from sparse_mla.ops.attention import policy as policies

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (run on the device)")
INTERPRETING = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def triton_devices():
    """Devices on which the Triton implementation is exercised in this process: CUDA when
    present; the second GPU too where there are two ("cuda:1" while the current device
    stays 0: the ops must launch on their tensors' GPU); CPU when the Triton interpreter is
    on (a dedicated Bazel target)."""
    devs = []
    if CUDA:
        devs.append("cuda")
        if torch.cuda.device_count() > 1:
            devs.append("cuda:1")
    if INTERPRETING:
        devs.append("cpu")
    return devs


def triton_params():
    """``triton_devices`` as pytest parameters (the second GPU's id is "cuda1", so that
    ``-k cuda1`` selects its runs)."""
    devs = [pytest.param(d, id=d.replace(":", "")) for d in triton_devices()]
    if devs:
        return devs
    return [pytest.param("cuda", marks=pytest.mark.skip(
        reason="Triton needs CUDA here, or TRITON_INTERPRET=1 (the *_interpret_test targets)"))]


def cuda_params():
    """The CUDA devices of ``triton_params`` (for GPU-only behaviour), or one skipped
    parameter where this process has no GPU."""
    devs = [pytest.param(d, id=d.replace(":", "")) for d in triton_devices() if d != "cpu"]
    return devs or [pytest.param("cuda", marks=pytest.mark.skip(reason="needs CUDA"))]


@contextlib.contextmanager
def naming(label: str):
    """Adds ``label`` to any failure raised inside the block, so a test that loops over
    cases (one argument after another) reports which case failed."""
    try:
        yield
    except Exception as exc:
        exc.add_note(f"case: {label}")
        raise


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of every byte of ``t``'s whole allocation (padding between blocks included), so a
    test can prove an op wrote nothing outside the bytes it was asked to write."""
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    flat.set_(t.untyped_storage())
    return flat.clone()


def seeded(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def hopper_with_sm90():
    """Whether this machine runs the sm_90 warp-specialized attention kernel (Gluon) now: not
    where the process turned it off (``SPARSE_MLA_SM90=0``, the forced software e4m3 route
    ``SPARSE_MLA_SOFT_FP8=1``, a Triton outside its range: ``plan.sm90_disabled_reason``)."""
    import torch
    from sparse_mla.ops.attention.plan import sm90_disabled_reason
    if INTERPRETING or not torch.cuda.is_available() or \
            torch.cuda.get_device_capability() != (9, 0) or sm90_disabled_reason() is not None:
        return False
    try:
        import sparse_mla.ops.attention.sm90.kernel  # noqa: F401
    except ImportError:
        return False
    return True


def last_plan():
    """The attention core's launch plan of the last op call on this thread (route, splits,
    whether a combine ran, the compiled split kernels): ``dispatch.last_plan``."""
    from sparse_mla.ops.common import dispatch
    return dispatch.last_plan()


def split_kernel_name():
    """Name of the attention core's last split kernel (``sm90_kernel`` or ``_split_kernel``)."""
    return last_plan().kernel.name


def use_policy(request, **changes):
    """Run the rest of the test (``request``: its pytest request) under the attention core's
    policy in force with ``changes`` (``policy.using``), restored at its teardown."""
    block = policies.using(**changes)
    block.__enter__()
    request.addfinalizer(lambda: block.__exit__(None, None, None))


def force_tiny_launches(request, tiny: bool):
    """Every launch of the attention core takes (``tiny``) or never takes the tiny-launch
    shape (the portable kernel's output-dim split), whatever its size and GPU; where the
    sm_90 kernel runs, one head block is still needed."""
    use_policy(request, small_units=10 ** 9 if tiny else -1, sm90_tiny_units=10 ** 9,
               sm90_tiny_tiles=10 ** 9)


def record_results(monkeypatch, owner, name: str) -> list:
    """Wrap ``owner.name`` so each call's result is appended to the returned list (and
    still returned): which head block, which partial buffers a launch picked."""
    results = []
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        results.append(fn(*args, **kwargs))
        return results[-1]
    monkeypatch.setattr(owner, name, wrapper)
    return results


def gapped(t: torch.Tensor, fill) -> torch.Tensor:
    """A view with ``t``'s values on ``t``'s device whose every stride is doubled: the
    elements between them hold ``fill``, so a kernel that reads the view as if it were
    contiguous picks those up (and a wrong answer) instead of the real ones."""
    wide = torch.full([2 * n for n in t.shape], fill, dtype=t.dtype, device=t.device)
    view = wide[tuple(slice(None, None, 2) for _ in t.shape)]
    view.copy_(t)
    if t.dim() and t.shape[-1] > 1:
        # what a kernel taking the view by base pointer (and its row strides) would read
        misread = view.as_strided(view.shape, view.stride()[:-1] + (1,))
        assert not torch.equal(misread, t), "fill equals the values: the view tests nothing"
    return view


def fake_device(monkeypatch, **changes):
    """Plan every launch as if its device's facts (``plan.DeviceFacts``: capability, SM count,
    shared memory per block) had ``changes``: a GPU this machine is not."""
    from sparse_mla.ops.attention import plan
    import dataclasses
    real = plan.device_facts
    monkeypatch.setattr(plan, "device_facts",
                        lambda device: dataclasses.replace(real(device), **changes))

"""The q fold's arguments (DeepSeek-V4 decode rows: q's RMS-norm and RoPE applied by the
attention kernels as they load q, ops/attention/qrot_kernels.py): ``QRot``, its validation and
the unfused reference the reference and vendor routes apply first. Pure Python (importing the
attention package imports no Triton)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from sparse_mla.ops.common import checks, formats

CS_WIDTH = formats.ROPE_DIM               # cos_sin_cache rows: cos[0:32] || sin[0:32]
# QROT codes (a kernel constexpr): no fold, RoPE only (V4.1: no q norm), norm then RoPE (V4)
NONE, ROPE, NORM_ROPE = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class QRot:
    """What the kernels need to norm and rotate q rows as they load them: ``positions``
    (int32 / int64, one per q row, contiguous), ``cos_sin_cache`` (fp32 [max_pos, 64],
    contiguous) and ``eps`` (None: RoPE only)."""
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    eps: Optional[float]

    @property
    def code(self) -> int:
        return ROPE if self.eps is None else NORM_ROPE

    @property
    def eps32(self) -> float:
        """eps rounded to fp32 (the kernels' and the reference's eps), as a Python float: a
        constexpr the kernels add in fp64 exactly as the reference adds it."""
        return 0.0 if self.eps is None else float(torch.tensor(self.eps, dtype=torch.float32))

    def pointer_args(self) -> dict:
        """The kernels' run-time keyword arguments (both kernels take these names)."""
        return dict(qpos_ptr=self.positions, qcs_ptr=self.cos_sin_cache,
                    q_max_pos=self.cos_sin_cache.shape[0])

    def kernel_args(self) -> dict:
        """All the kernels' keyword arguments: ``pointer_args`` and the constexprs."""
        return dict(self.pointer_args(), QROT=self.code, QEPS=self.eps32)


def check_qrot(q: torch.Tensor, n_rows: int, positions, cos_sin_cache, eps) -> Optional[QRot]:
    """The fold's arguments validated (ValueError naming the argument), as a ``QRot``; None
    where neither ``positions`` nor ``cos_sin_cache`` is given (q arrives rotated)."""
    if positions is None and cos_sin_cache is None:
        if eps is not None:
            raise ValueError("q_norm_eps needs q_positions and cos_sin_cache (the fold)")
        return None
    if positions is None or cos_sin_cache is None:
        raise ValueError("q_positions and cos_sin_cache go together: q is normed / rotated "
                         "by the kernel only with both")
    checks.expect_dtype("q", q, torch.bfloat16)
    checks.expect_dtype("q_positions", positions, checks.INDEX_DTYPES)
    if positions.numel() != n_rows or not positions.is_contiguous():
        raise ValueError(f"q_positions must be a contiguous tensor of {n_rows} positions (one "
                         f"per q row), got shape {list(positions.shape)}")
    checks.expect_dtype("cos_sin_cache", cos_sin_cache, torch.float32)
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != CS_WIDTH \
            or cos_sin_cache.shape[0] == 0 or not cos_sin_cache.is_contiguous():
        raise ValueError(f"cos_sin_cache must be a contiguous [max_position >= 1, {CS_WIDTH}] "
                         f"fp32 table (cos[0:32] || sin[0:32]), got "
                         f"{list(cos_sin_cache.shape)}")
    if eps is not None and not (isinstance(eps, float) and eps >= 0.0):
        raise ValueError(f"q_norm_eps must be a float >= 0 or None (no norm), got {eps!r}")
    if checks.value_checks_enabled(positions, q):
        checks.expect_indices("q_positions", positions.reshape(-1), cos_sin_cache.shape[0],
                              " (rows of cos_sin_cache)", "q row")
    return QRot(positions, cos_sin_cache, eps)


def rotate_reference(q: torch.Tensor, qrot: QRot) -> torch.Tensor:
    """The unfused path's q (docs/semantics.md §3.1's q_out, bf16) for the reference and
    vendor routes: ``q`` [..., H, 512] with one position per leading index."""
    from sparse_mla.ops.common import quant
    lead = q.shape[:-2]
    flat = q.reshape(-1, q.shape[-2], q.shape[-1])
    qf = quant.rms_norm_no_weight(flat, qrot.eps) if qrot.eps is not None else flat.float()
    pos = qrot.positions.reshape(-1).long()
    rot = quant.rope_gptj(qf, qrot.cos_sin_cache[pos].unsqueeze(1))
    return rot.to(torch.bfloat16).reshape(*lead, q.shape[-2], q.shape[-1])


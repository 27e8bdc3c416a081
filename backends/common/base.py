"""What the two DeepSeek-V4 backends share: construction, caches, validation, the step order.

A backend runs one attention step of one layer for a whole batch: ``write`` (q-norm + RoPE of
q, RoPE + insert of this step's kv rows, insert of the compressor's rows), then ``attend``
(index lists, attention, ``out[T, H, 512]`` in place). ``forward`` does both after validating
every input, so a bad batch raises before any cache byte is written.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Optional

import torch
from torch import Tensor

from sparse_mla.backends.common.batch import BatchDescription
from sparse_mla.backends.common.config import LayerConfig
from sparse_mla.backends.common.planner import IndexPlanner
from sparse_mla.backends.common.spec import CacheSpec
from sparse_mla.backends.common.validate import validate_shapes, validate_values
from sparse_mla.ops.common import checks, dispatch


class Backend:
    """Subclasses set ``OPS`` (the ops they call, for :meth:`explain`) and implement
    ``cache_specs``, ``_write`` and ``_attend``."""

    name = "base"
    OPS: tuple = ()
    PLANNER = IndexPlanner      # the step planner this family of layers shares

    def __init__(self, config: LayerConfig, device="cpu", impl: str = "auto",
                 attention_impl: Optional[str] = None,
                 planner: Optional[IndexPlanner] = None):
        """``impl`` forces every op's implementation ("reference", "triton", ...; "auto"
        lets each op choose), ``attention_impl`` the attention op's alone. ``planner``: another
        backend's, to share one step plan among the layers of a kind (see :meth:`plan`)."""
        self.config = config
        self.device = torch.device(device)
        self.impl = impl
        self.attention_impl = attention_impl or impl
        if planner is not None and not planner.compatible(config):
            raise ValueError("planner belongs to a layer of another kind, window, block size "
                             "or capacity; it cannot be shared with this one")
        self.planner = planner or self.PLANNER(config, self.device, impl)
        self._choices: Dict[str, Optional[dispatch.Choice]] = {}

    # -- caches ---------------------------------------------------------------------------
    def cache_specs(self) -> Dict[str, CacheSpec]:
        raise NotImplementedError

    def allocate_caches(self, num_blocks: Dict[str, int], fill: Optional[int] = None):
        """One cache per spec name (``{"swa": n, "compressed": m}``), on this backend's device."""
        specs = self.cache_specs()
        missing = set(specs) - set(num_blocks)
        if missing:
            raise ValueError(f"num_blocks needs an entry for each cache: missing {sorted(missing)}")
        return {name: spec.allocate(num_blocks[name], self.device, fill)
                for name, spec in specs.items()}

    def _check_caches(self, caches) -> None:
        specs = self.cache_specs()
        for name, spec in specs.items():
            if name not in caches:
                raise ValueError(f"caches must hold {sorted(specs)}, missing {name!r}")
            c = caches[name]
            if c.dim() != 3 or tuple(c.shape[1:]) != spec.shape_per_block:
                raise ValueError(f"caches[{name!r}] must have shape [num_blocks, "
                                 f"{', '.join(map(str, spec.shape_per_block))}] ({spec}), got "
                                 f"{list(c.shape)}")
            checks.expect_dtype(f"caches[{name!r}]", c, spec.dtype)

    # -- the step ---------------------------------------------------------------------------
    def validate(self, q: Tensor, caches, batch: BatchDescription, kv: Optional[Tensor] = None,
                 cos_sin_cache: Optional[Tensor] = None,
                 compressed_kv: Optional[Tensor] = None, attention: bool = True) -> None:
        """Raises on any bad input; ``attention=False`` checks only what ``write`` reads."""
        self._check_caches(caches)
        validate_shapes(self.config, batch, q, kv, compressed_kv, attention)
        comp = caches.get("compressed")
        validate_values(self.config, batch, q, cos_sin_cache, caches["swa"].shape[0],
                        None if comp is None else comp.shape[0], attention)
        self._validate_batch(batch)

    def _validate_batch(self, batch: BatchDescription) -> None:
        """A backend's own limits (e.g. its prefill workspace), checked before any write."""

    def plan(self, batch: BatchDescription, num_tokens: int) -> None:
        """The step's shared index lists (token → request, decode windows, C128A lists). Call
        once per step for all layers sharing this planner, then ``forward(..., planned=True)``
        per layer; ``forward`` without ``planned`` plans by itself."""
        with _ops_run(self.OPS) as ran:
            self.planner.plan(batch, num_tokens)
        self.planner.choices = ran

    def forward(self, q: Tensor, kv: Tensor, caches, batch: BatchDescription,
                cos_sin_cache: Tensor, attn_sink: Tensor, out: Tensor,
                compressed_kv: Optional[Tensor] = None, apply_q_norm: bool = True,
                planned: bool = False) -> Tensor:
        """The whole step: validate, write the caches, attend. Returns ``out``."""
        self.validate(q, caches, batch, kv, cos_sin_cache, compressed_kv)
        self._check_out(out, attn_sink, q.shape[0])
        with _ops_run(self.OPS) as ran:
            q_rot = self._write(q, kv, caches, batch, cos_sin_cache, compressed_kv,
                                apply_q_norm)
        self._choices = ran
        if not planned:
            self.plan(batch, q.shape[0])
        self._run_attention(q_rot, caches, batch, attn_sink, out)
        return out

    def _run_attention(self, q_rot, caches, batch, attn_sink, out):
        with _ops_run(self.OPS) as ran:
            self._attend(q_rot, caches, batch, attn_sink, out)
        self._zero_padding(batch, out)
        self._choices.update(ran)

    def write(self, q: Tensor, kv: Tensor, caches, batch: BatchDescription,
              cos_sin_cache: Tensor, compressed_kv: Optional[Tensor] = None,
              apply_q_norm: bool = True) -> Tensor:
        """Caches written; returns q normed and rotated as :meth:`attend` takes it (a view of
        a persistent buffer, valid until the next step). The indexer's top-k is not read here
        (an engine may fill it after the write)."""
        self.validate(q, caches, batch, kv, cos_sin_cache, compressed_kv, attention=False)
        with _ops_run(self.OPS) as ran:
            q_rot = self._write(q, kv, caches, batch, cos_sin_cache, compressed_kv,
                                apply_q_norm)
        self._choices = ran
        return q_rot

    def attend(self, q_rot: Tensor, caches, batch: BatchDescription, attn_sink: Tensor,
               out: Tensor, planned: bool = False) -> Tensor:
        """Attention of already-rotated queries over the caches as they stand."""
        self.validate(q_rot, caches, batch)
        self._check_out(out, attn_sink, q_rot.shape[0])
        self._choices = {}
        if not planned:
            self.plan(batch, q_rot.shape[0])
        self._run_attention(q_rot, caches, batch, attn_sink, out)
        return out

    def _check_out(self, out: Tensor, attn_sink: Tensor, T: int) -> None:
        H = self.config.num_heads
        checks.expect_dtype("out", out, torch.bfloat16)
        checks.expect_shape("out", out, (T, H, 512))
        checks.expect_last_dim_contiguous("out", out)
        checks.expect_dtype("attn_sink", attn_sink, torch.float32)
        checks.expect_shape("attn_sink", attn_sink, (H,))

    def _zero_padding(self, batch: BatchDescription, out: Tensor) -> None:
        """Rows past the real tokens (graph padding) come out as zeros, never stale data."""
        if out.shape[0] > batch.num_tokens:
            out[batch.num_tokens:].zero_()

    def explain(self) -> Dict[str, dispatch.Choice]:
        """The implementation each op of this backend's last step ran (the shared plan's ops
        included), and why the others were not chosen (``dispatch.Choice``)."""
        return {**getattr(self.planner, "choices", {}), **self._choices}

    def _write(self, q, kv, caches, batch, cos_sin_cache, compressed_kv, apply_q_norm):
        raise NotImplementedError

    def _attend(self, q_rot, caches, batch, attn_sink, out):
        raise NotImplementedError


@contextlib.contextmanager
def _ops_run(ops):
    """Collects the ``dispatch.Choice`` of every op in ``ops`` that ran inside the block (a
    call records a new Choice object, so one that is not the object seen before ran)."""
    before = {op: dispatch.last_choice(op) for op in ops}
    ran: Dict[str, dispatch.Choice] = {}
    try:
        yield ran
    finally:
        for op in ops:
            c = dispatch.last_choice(op)
            if c is not None and c is not before[op]:
                ran[op] = c

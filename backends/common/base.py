"""The backend contract every model's backends share, and the step runner behind it.

A backend runs one attention step of one layer for a whole batch: ``write`` (this step's rows
into the caches; returns q as ``attend`` takes it), then ``attend`` (index lists, attention,
``out[T, H, 512]`` in place, padding rows zero). ``forward`` does both after validating every
input, so a bad batch raises before any cache byte is written. ``plan`` builds the step's
shared index lists once for every layer that shares the planner; ``explain`` says what each
op ran. The signatures are the same for every model:

    validate(q, caches, batch, kv=None, cos_sin_cache=None, compressed_kv=None, attention=True)
    write(q, kv, caches, batch, cos_sin_cache=None, compressed_kv=None) -> q for attend
    attend(q, caches, batch, attn_sink=None, out=..., planned=False) -> out
    forward(q, kv, caches, batch, cos_sin_cache=None, attn_sink=None, out=...,
            compressed_kv=None, planned=False) -> out

What a model has or lacks (DeepSeek-V4: a RoPE table the write applies, per-head sinks, a
compressed cache; DeepSeek-V3.2: none of them) is its model class's hooks —
``_validate_inputs``, ``_check_sink``, ``_write``, ``_attend`` — over its config class and
planner class (``CONFIG``, ``PLANNER``): ``backends/v4/base.py``, ``backends/v32/base.py``.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor

from sparse_mla.backends.common.batch import BatchDescription
from sparse_mla.backends.common.planner import StepPlanner
from sparse_mla.backends.common.spec import CacheSpec
from sparse_mla.ops.common import checks, dispatch

D_OUT = 512     # every model's attention output: the 512-wide latent


class Backend:
    """Model classes set ``CONFIG`` and ``PLANNER`` and implement the hooks; backends set
    ``OPS`` (the ops they call, for :meth:`explain`) and implement ``cache_specs``."""

    name = "base"
    OPS: tuple = ()
    CONFIG: type = object
    PLANNER: type = StepPlanner     # the step planner this family of layers shares

    def __init__(self, config, device="cpu", impl: str = "auto",
                 attention_impl: Optional[str] = None,
                 planner: Optional[StepPlanner] = None):
        """``impl`` forces every op's implementation ("reference", "triton", ...; "auto"
        lets each op choose), ``attention_impl`` the attention op's alone. ``planner``: another
        backend's, to share one step plan among the layers of a kind (see :meth:`plan`)."""
        if not isinstance(config, self.CONFIG):
            raise TypeError(f"config must be a {self.CONFIG.__name__}, got "
                            f"{type(config).__name__}")
        self.config = config
        self.device = torch.device(device)
        self.impl = impl
        self.attention_impl = attention_impl or impl
        if planner is not None and not (isinstance(planner, self.PLANNER)
                                        and planner.compatible(config)):
            raise ValueError("planner belongs to a layer of another model, kind, window, block "
                             "size or capacity; it cannot be shared with this one")
        self.planner = planner or self.PLANNER(config, self.device, impl)
        self._choices: Dict[str, Optional[dispatch.Choice]] = {}

    # -- caches ---------------------------------------------------------------------------
    def cache_specs(self) -> Dict[str, CacheSpec]:
        """The caches this layer owns (what an engine allocates for it)."""
        raise NotImplementedError

    def read_specs(self) -> Dict[str, CacheSpec]:
        """Every cache a step takes: the owned ones, and any it reads from another layer
        (DeepSeek-V4.1's shared compressed caches)."""
        return self.cache_specs()

    def allocate_caches(self, num_blocks: Dict[str, int], fill: Optional[int] = None):
        """One cache per spec name (``{"swa": n, "compressed": m}``), on this backend's device."""
        specs = self.cache_specs()
        missing = set(specs) - set(num_blocks)
        if missing:
            raise ValueError(f"num_blocks needs an entry for each cache: missing {sorted(missing)}")
        return {name: spec.allocate(num_blocks[name], self.device, fill)
                for name, spec in specs.items()}

    def _check_caches(self, caches) -> None:
        specs = self.read_specs()
        for name, spec in specs.items():
            if name not in caches:
                raise ValueError(f"caches must hold {sorted(specs)}, missing {name!r}")
            c = caches[name]
            if c.dim() != 3 or tuple(c.shape[1:]) != spec.shape_per_block:
                raise ValueError(f"caches[{name!r}] must have shape [num_blocks, "
                                 f"{', '.join(map(str, spec.shape_per_block))}] ({spec}), got "
                                 f"{list(c.shape)}")
            checks.expect_dtype(f"caches[{name!r}]", c, spec.dtype)

    # -- the contract -----------------------------------------------------------------------
    def validate(self, q: Tensor, caches, batch: BatchDescription, kv: Optional[Tensor] = None,
                 cos_sin_cache: Optional[Tensor] = None,
                 compressed_kv: Optional[Tensor] = None, attention: bool = True) -> None:
        """Raises on any bad input; ``attention=False`` checks only what ``write`` reads (an
        engine may fill the indexer's top-k after the write, as vLLM does). Shapes always;
        values (positions, slots, block tables, top-k ids) on CPU tensors or with
        ``SPARSE_MLA_CHECK_VALUES=1``."""
        self._check_caches(caches)
        self._validate_inputs(q, caches, batch, kv, cos_sin_cache, compressed_kv, attention)
        self._validate_batch(batch)

    def plan(self, batch: BatchDescription, num_tokens: int) -> None:
        """The step's shared index lists (token → request, and the model's own). Call once per
        step for all layers sharing this planner, then ``forward(..., planned=True)`` per
        layer; ``forward`` / ``attend`` without ``planned`` plan by themselves."""
        with dispatch.recording(self.OPS) as ran:
            self.planner.plan(batch, num_tokens)
        self.planner.choices = ran

    def forward(self, q: Tensor, kv: Tensor, caches, batch: BatchDescription,
                cos_sin_cache: Optional[Tensor] = None, attn_sink: Optional[Tensor] = None,
                out: Optional[Tensor] = None, compressed_kv: Optional[Tensor] = None,
                planned: bool = False) -> Tensor:
        """The whole step: validate, write the caches, attend. Returns ``out``."""
        self.validate(q, caches, batch, kv, cos_sin_cache, compressed_kv)
        self._check_out(out, attn_sink, q.shape[0])
        q_att = self._run_write(q, kv, caches, batch, cos_sin_cache, compressed_kv)
        self._run_attention(q_att, caches, batch, attn_sink, out, planned)
        return out

    def write(self, q: Tensor, kv: Tensor, caches, batch: BatchDescription,
              cos_sin_cache: Optional[Tensor] = None,
              compressed_kv: Optional[Tensor] = None) -> Tensor:
        """Caches written; returns q as :meth:`attend` takes it (DeepSeek-V4: normed and
        rotated, a view of a persistent buffer valid until the next step). The indexer's top-k
        is not read here."""
        self.validate(q, caches, batch, kv, cos_sin_cache, compressed_kv, attention=False)
        return self._run_write(q, kv, caches, batch, cos_sin_cache, compressed_kv)

    def attend(self, q: Tensor, caches, batch: BatchDescription,
               attn_sink: Optional[Tensor] = None, out: Optional[Tensor] = None,
               planned: bool = False) -> Tensor:
        """Attention of ``q`` as :meth:`write` returns it, over the caches as they stand."""
        self.validate(q, caches, batch)
        self._check_out(out, attn_sink, q.shape[0])
        self._choices = {}
        self._run_attention(q, caches, batch, attn_sink, out, planned)
        return out

    def explain(self) -> Dict[str, dispatch.Choice]:
        """The implementation each op of this backend's last step ran (the shared plan's ops
        included), and why the others were not chosen (``dispatch.Choice``)."""
        return {**getattr(self.planner, "choices", {}), **self._choices}

    # -- the step runner --------------------------------------------------------------------
    def _run_write(self, q, kv, caches, batch, cos_sin_cache, compressed_kv) -> Tensor:
        with dispatch.recording(self.OPS) as ran:
            q_att = self._write(q, kv, caches, batch, cos_sin_cache, compressed_kv)
        self._choices = ran
        return q_att

    def _run_attention(self, q, caches, batch, attn_sink, out, planned) -> None:
        if not planned:
            self.plan(batch, q.shape[0])
        with dispatch.recording(self.OPS) as ran:
            self._attend(q, caches, batch, attn_sink, out)
        # Rows past the real tokens (graph padding) come out as zeros, never stale data.
        if out.shape[0] > batch.num_tokens:
            out[batch.num_tokens:].zero_()
        self._choices.update(ran)

    def _check_out(self, out: Optional[Tensor], attn_sink: Optional[Tensor], T: int) -> None:
        if out is None:
            raise TypeError(f"out is required: the bfloat16 [num_tokens, num_heads, {D_OUT}] "
                            f"buffer the step writes")
        checks.expect_dtype("out", out, torch.bfloat16)
        checks.expect_shape("out", out, (T, self.config.num_heads, D_OUT))
        checks.expect_last_dim_contiguous("out", out)
        self._check_sink(attn_sink)

    # -- hooks: the model class's ---------------------------------------------------------
    def _validate_inputs(self, q, caches, batch, kv, cos_sin_cache, compressed_kv,
                         attention) -> None:
        """The model's inputs: shapes, and values where ``checks.value_checks_enabled``."""
        raise NotImplementedError

    def _check_sink(self, attn_sink: Optional[Tensor]) -> None:
        raise NotImplementedError

    def _validate_batch(self, batch: BatchDescription) -> None:
        """A backend's own limits (e.g. its prefill workspace), checked before any write."""

    def _write(self, q, kv, caches, batch, cos_sin_cache, compressed_kv) -> Tensor:
        raise NotImplementedError

    def _attend(self, q, caches, batch, attn_sink, out) -> None:
        raise NotImplementedError

"""Every registered op, every tensor argument, non-contiguous: the contiguous call's bytes, or a
named error before anything is written (docs/semantics.md §1, "Strides").

One valid call of each op is recorded (its family's small bench case, or a driver below for an
op no bench case reaches); then each tensor argument in turn is replaced by a view holding the
same values in another layout, every written argument starting from the same bytes:

* ``every_other``: last-dimension stride 2 (a 1-D list taken from every second entry);
* ``padded_rows``: rows ``stride(0)`` apart with poisoned gaps and a storage offset (a cache's
  padded block stride, a q row inside a wider buffer): the kernels must read it as it is;
* ``transposed``: the first two dimensions stored the other way round.

The gaps and the rest of each buffer hold poison (NaN, 0xFF, a wrong but valid index), so a
kernel that reads a view as packed gives other bytes, and one that writes outside the view
changes poison. An argument the op writes may instead be refused: ValueError or TypeError
naming it, every written buffer unchanged. An op added without a case fails
``test_every_op_has_a_case``.

Routes: the reference (CPU; and CUDA on a GPU), Triton on CUDA and, in the
``stride_fuzz_interpret_test`` target, under Triton's interpreter on CPU, and the vendor route
on a GPU where it can run.
"""
from __future__ import annotations

import functools
import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparse_mla.ops.common import dispatch, formats, opdef
from sparse_mla.ops.common.errors import ImplementationUnavailable
from sparse_mla.tests.helpers import CUDA, INTERPRETING, naming

VARIANTS = ("every_other", "padded_rows", "transposed")
SEED = 20261128


# ---------------------------------------------------------------------------------------------
# a valid call of each op

def _rope_table(device, rows=256):
    inv_freq = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    angles = torch.arange(rows, dtype=torch.float32)[:, None] * inv_freq
    return torch.cat([angles.cos(), angles.sin()], 1).to(device)


def _tokens(device, n=6):
    """n tokens: rows, positions and slots (one skipped, the rest scattered over 2 pages)."""
    g = torch.Generator().manual_seed(SEED)
    positions = torch.randperm(200, generator=g)[:n].to(device)
    slots = torch.tensor([3, 70, -1, 17, 127, 64][:n], device=device)
    return positions, slots


def _drive_fused_rope_insert_v41(device):
    positions, slots = _tokens(device)
    n = len(slots)
    q = torch.randn(n, 3, 512, dtype=torch.bfloat16, device=device)
    kv = torch.randn(n, 512, dtype=torch.bfloat16, device=device)
    cache = formats.alloc_paged_cache("v41", 2, 64, device=device, fill=0xFF)
    q_out = torch.full((n, 4, 512), float("nan"), dtype=torch.bfloat16, device=device)
    torch.ops.sparse_mla.fused_rope_insert_v41(q, kv, cache, slots, positions,
                                               _rope_table(device), q_out)


def _drive_compressed_insert_v41(device):
    positions, slots = _tokens(device)
    k = torch.randn(len(slots), 512, dtype=torch.float32, device=device)
    for fmt in ("v41", "v41_fp4"):
        cache = formats.alloc_paged_cache(fmt, 2, 64, device=device, fill=0xFF)
        torch.ops.sparse_mla.compressed_insert_v41(k, cache, slots, positions,
                                                   _rope_table(device), 2, cache_format=fmt)


def _drive_insert_plain(device):
    _, slots = _tokens(device)
    k = torch.randn(len(slots), 512, dtype=torch.bfloat16, device=device)
    cache = torch.full((2, 64, 512), float("nan"), dtype=torch.bfloat16, device=device)
    torch.ops.sparse_mla.insert_plain(k, cache, slots)


def _drive_quantize_insert_v32_nope(device):
    _, slots = _tokens(device)
    kv_c = torch.randn(len(slots), 512, dtype=torch.bfloat16, device=device)
    cache = formats.alloc_paged_cache("v32", 2, 64, device=device, fill=0xFF)
    torch.ops.sparse_mla.quantize_insert_v32_nope(kv_c, cache, slots, 64)


def _drive_convert_req_index_to_global(device):
    g = torch.Generator().manual_seed(SEED)
    T, K, bs = 4, 24, 16
    req_id = torch.tensor([0, 2, 1, 0], dtype=torch.int32, device=device)
    block_table = torch.randint(0, 9, (3, 5), generator=g, dtype=torch.int32).to(device)
    tok = torch.randint(-1, 5 * bs + 8, (T, K), generator=g, dtype=torch.int32).to(device)
    out = torch.full((T, K), 7, dtype=torch.int32, device=device)
    counts = torch.full((T,), 7, dtype=torch.int32, device=device)
    torch.ops.sparse_mla.convert_req_index_to_global(req_id, block_table, tok, out, counts,
                                                     None, None, bs)


def _drive_trtllm_decode_v32(device):
    g = torch.Generator().manual_seed(SEED)
    T, H, K, pages, page = 3, 4, 40, 3, 32
    query = torch.randn(T, H, 576, generator=g).to(torch.bfloat16).to(device)
    cache = torch.randn(pages, page, 576, generator=g).to(torch.bfloat16).to(device)
    rows = torch.randint(-1, pages * page, (T, K), generator=g, dtype=torch.int32).to(device)
    seq_lens = torch.tensor([K, 17, 1], dtype=torch.int32, device=device)
    out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device=device)
    sinks = torch.randn(H, generator=g).to(device)
    # impl given: torch 2.11 drops trailing default arguments before its in-place bookkeeping,
    # which then indexes the dropped optional workspace_buffer (IndexError)
    torch.ops.sparse_mla.trtllm_decode_v32(query, cache, rows, seq_lens, out,
                                           bmm1_scale=576 ** -0.5, sinks=sinks,
                                           impl="reference")


def _drive_indexer_topk_prefill(device):
    # the bench case's 24 tokens x 40 keys x top-512 take minutes under the interpreter
    g = torch.Generator().manual_seed(SEED)
    T, H, C, K = 5, 2, 12, 8
    q = torch.randn(T, H, 128, generator=g).to(torch.bfloat16).to(device)
    weights = torch.randn(T, H, generator=g).to(device)
    k = torch.randn(C, 128, generator=g).to(torch.bfloat16).to(device)
    cu_q = torch.tensor([0, 2, 5], device=device)
    cu_k = torch.tensor([0, 5, 12], device=device)
    positions = torch.tensor([9, 21, 3, 14, 27], device=device)
    out = torch.full((T, K), 7, dtype=torch.int32, device=device)
    torch.ops.sparse_mla.indexer_topk_prefill(q, weights, k, None, cu_q, cu_k, positions, out,
                                              ratio=4)


# ops that no family's small bench case calls, or calls at sizes too slow to interpret
DRIVERS = {
    "indexer_topk_prefill": _drive_indexer_topk_prefill,
    "fused_rope_insert_v41": _drive_fused_rope_insert_v41,
    "compressed_insert_v41": _drive_compressed_insert_v41,
    "insert_plain": _drive_insert_plain,
    "quantize_insert_v32_nope": _drive_quantize_insert_v32_nope,
    "convert_req_index_to_global": _drive_convert_req_index_to_global,
    "trtllm_decode_v32": _drive_trtllm_decode_v32,
}


class _Recorder(TorchDispatchMode):
    """Keeps the first call of each ``sparse_mla::`` op (its overload, arguments)."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "sparse_mla":
            self.calls.setdefault(func._opname, (func, _clone_args(args), dict(kwargs)))
        return func(*args, **kwargs)


def _clone_args(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


@functools.lru_cache(maxsize=None)
def recorded_calls(device: str) -> dict:
    """``{op: (overload, args, kwargs)}``: one valid call of every op reached, on ``device``,
    its arguments as they were before the call (written ones included)."""
    torch.manual_seed(SEED)
    rec = _Recorder()
    for family in dispatch.OPS_BY_FAMILY:
        bench = importlib.import_module(f"sparse_mla.ops.{family}.bench")
        for case in bench.cases(device, True):
            if case.op in rec.calls or case.op in DRIVERS:
                continue
            inputs = case.make()
            with rec:
                case.run(inputs, "reference")
    for drive in DRIVERS.values():
        with rec:
            drive(device)
    return rec.calls


# ---------------------------------------------------------------------------------------------
# layouts

def _poison(t: torch.Tensor):
    if t.dtype.is_floating_point:
        return float("nan")
    if t.dtype == torch.bool:
        return True
    if t.dtype == torch.uint8:
        return 0xFF
    return 1        # a valid-looking wrong index: a misread moves a row without faulting


def _buffer(t, numel):
    buf = torch.empty(numel, dtype=t.dtype, device=t.device)
    if t.dtype == torch.float8_e4m3fn:
        buf.view(torch.uint8).fill_(0xFF)
    else:
        buf.fill_(_poison(t))
    return buf


def relaid(t: torch.Tensor, variant: str):
    """``(view, buffer)``: ``t``'s values in ``variant``'s layout, the buffer around it poisoned;
    None where the variant does not apply (0-D, one element, 1-D for the 2-D variants)."""
    if t.dim() == 0 or t.numel() <= 1:
        return None
    shape = tuple(t.shape)
    if variant == "every_other":
        buf = _buffer(t, t.numel() * 2)
        view = buf.view(*shape[:-1], 2 * shape[-1])[..., ::2]
    elif variant == "padded_rows":
        if t.dim() < 2:
            return None
        # rows 16 elements apart and based 16 elements in, as vLLM's pages and padded rows
        # are: the kernels may load 16 bytes at a time, and a route may depend on Triton's
        # divisibility-by-16 specialization (other strides: test_plain_rows_off_16_elements)
        inner = t[0].numel()
        row = -(-(inner + 1) // 16) * 16
        offset = 16
        buf = _buffer(t, offset + shape[0] * row)
        inner_strides = torch.empty(shape[1:], device="meta").stride()
        view = buf.as_strided(shape, (row, *inner_strides), offset)
    elif variant == "transposed":
        if t.dim() < 2 or shape[0] < 2 or shape[1] < 2:
            return None
        buf = _buffer(t, t.numel())
        view = buf.view(shape[1], shape[0], *shape[2:]).transpose(0, 1)
    else:
        raise ValueError(variant)
    view.copy_(t)
    return view, buf


def _bytes(t):
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same_bytes(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bytes(a), _bytes(b))


def _results(out):
    if out is None:
        return []
    return list(out) if isinstance(out, (tuple, list)) else [out]


# ---------------------------------------------------------------------------------------------
# the check

def _schema_names(overload):
    return [a.name for a in overload._schema.arguments]


def _written(overload):
    return {a.name for a in overload._schema.arguments
            if a.alias_info is not None and a.alias_info.is_write}


def _call(overload, args, kwargs, impl):
    names = _schema_names(overload)
    args = list(args)
    if "impl" in kwargs or len(args) <= names.index("impl"):
        kwargs = {**kwargs, "impl": impl}
    else:
        args[names.index("impl")] = impl
    return overload(*args, **kwargs)


def _fresh(args):
    """A copy of the recorded arguments: every tensor cloned, so written ones start equal."""
    return list(_clone_args(args))


def fuzz_op(op: str, device: str, impl: str, only=None) -> int:
    """Runs every (argument, variant) of ``op`` (of the arguments named in ``only`` where
    given); returns how many ran; fails on a mismatch."""
    overload, args, kwargs = recorded_calls(device)[op]
    names = _schema_names(overload)
    written = _written(overload)
    as_given = opdef.AS_GIVEN[op]          # written arguments and caches: never copied
    assert written <= as_given, f"{op}: written arguments {written - as_given} undeclared"
    base_args = _fresh(args)
    try:
        base_out = _results(_call(overload, base_args, kwargs, impl))
    except ImplementationUnavailable as exc:
        pytest.skip(f"{op}: {impl} cannot run here: {exc}")
    checked = 0
    for i, name in enumerate(names[:len(args)]):
        if not isinstance(args[i], torch.Tensor) or (only is not None and name not in only):
            continue
        for variant in VARIANTS:
            with naming(f"{op} ({impl} on {device}): {name} {variant}"):
                trial = _fresh(args)
                made = relaid(trial[i], variant)
                if made is None:
                    continue
                view, buf = made
                trial[i] = view
                before = {n: (trial[j].clone(), _bytes(buf).clone() if j == i else None)
                          for j, n in enumerate(names[:len(args)]) if n in written
                          and isinstance(trial[j], torch.Tensor)}
                try:
                    out = _results(_call(overload, trial, kwargs, impl))
                except (ValueError, TypeError) as exc:
                    assert name in as_given or variant == "padded_rows", (
                        f"{op} refused a {variant} view of {name}, which it only reads and "
                        f"so must copy: {exc}")
                    assert name in str(exc), f"the error does not name {name}: {exc}"
                    for n, (was, whole) in before.items():
                        j = names.index(n)
                        assert _same_bytes(trial[j], was), f"{n} written before the error"
                        if whole is not None:
                            assert torch.equal(_bytes(buf), whole), f"{n}'s buffer written"
                    checked += 1
                    continue
                for k, (want, got) in enumerate(zip(base_out, out)):
                    assert _same_bytes(want, got), f"returned tensor {k} differs"
                for j, n in enumerate(names[:len(args)]):
                    if n not in written or not isinstance(trial[j], torch.Tensor):
                        continue
                    assert _same_bytes(base_args[j], trial[j]), f"{n} differs from the " \
                        f"contiguous call"
                if name in written:
                    # around the view: the poison exactly as it was
                    expect = before[name][1].clone()
                    expect_view = expect.view(view.dtype).as_strided(
                        view.shape, view.stride(), view.storage_offset())
                    expect_view.copy_(base_args[i])
                    assert torch.equal(_bytes(buf), expect), (
                        f"bytes of {name}'s buffer outside the view changed")
                checked += 1
    return checked


# ---------------------------------------------------------------------------------------------
# tests

def _routes():
    routes = [pytest.param("cpu", "reference", id="cpu-reference")]
    if INTERPRETING:
        routes.append(pytest.param("cpu", "triton", id="cpu-triton"))
    if CUDA:
        routes += [pytest.param("cuda", impl, id=f"cuda-{impl}")
                   for impl in ("triton", "vendor", "reference")]
    return routes


def test_every_op_has_a_case():
    dispatch.load_all()
    ops = set(opdef.AS_GIVEN)               # every op made by opdef.custom_op
    assert ops >= set(dispatch.FAMILY_OF), "ops.common.opdef does not know every op"
    have = set(recorded_calls("cpu"))
    assert ops <= have, f"ops with no stride-fuzz case (add a driver): {sorted(ops - have)}"


@pytest.mark.parametrize("device,impl", _routes())
@pytest.mark.parametrize("op", sorted(dispatch.FAMILY_OF))   # == opdef.AS_GIVEN, checked above
def test_stride_fuzz(op, device, impl):
    if op not in recorded_calls(device):
        pytest.fail(f"{op} has no stride-fuzz case")
    assert fuzz_op(op, device, impl) > 0


def test_fuzz_catches_a_kernel_that_reads_a_view_as_packed(monkeypatch):
    """The check itself can fail: with the op boundary's normalization off, an implementation
    that reads ``positions`` as packed memory from its base pointer (what the Triton inserts
    did) gives other cache bytes for a strided view, and the fuzz says so."""
    monkeypatch.setattr(opdef, "in_row_form", lambda t: True)
    d = dispatch.dispatcher("fused_rope_insert_v41")
    real = d._impls["reference"]

    def packed(q, kv, k_cache, slot_mapping, positions, *rest):
        as_packed = positions.as_strided(positions.shape, (1,))
        return real[0](q, kv, k_cache, slot_mapping, as_packed, *rest)
    monkeypatch.setitem(d._impls, "reference", (packed, *real[1:]))
    with pytest.raises(AssertionError, match="differs"):
        fuzz_op("fused_rope_insert_v41", "cpu", "reference", only=("positions",))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the sm_90 route's gate)")
def test_plain_rows_off_16_elements_run_the_portable_kernel():
    """A prefill kv whose rows are 520 elements apart (16-byte aligned, but not 16-element
    strided) failed to compile in the sm_90 kernel's cp.async copy; it runs the portable
    kernel, says so, and agrees with the contiguous call within the op's tolerance."""
    from sparse_mla.tests.helpers import hopper_with_sm90
    overload, args, kwargs = recorded_calls("cuda")["flashmla_sparse_prefill"]
    names = _schema_names(overload)
    base = _fresh(args)
    _call(overload, base, kwargs, "triton")
    trial = _fresh(args)
    kv = trial[names.index("kv")]
    row = 520
    buf = torch.full((8 + kv.shape[0] * row,), float("nan"), dtype=kv.dtype, device=kv.device)
    view = buf.as_strided(kv.shape, (row, kv.shape[-1], 1), 8)
    view.copy_(kv)
    trial[names.index("kv")] = view
    _call(overload, trial, kwargs, "triton")
    plan = dispatch.last_choice("flashmla_sparse_prefill").plan
    if hopper_with_sm90():
        assert plan.route in ("portable", "tiny") and "16-element strided" in plan.reason
    out = names.index("out")
    torch.testing.assert_close(trial[out].float(), base[out].float(), atol=1e-2, rtol=2 / 128)

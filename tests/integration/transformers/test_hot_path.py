"""The attention function's per-call work: the op runs (validates, dispatches) on the first
call of a kind only, later calls run the kept plan with the same result, state kept across
calls follows what it was made from, and no call reads a device value on the host."""
import dataclasses

import pytest
import torch
from torch.overrides import TorchFunctionMode

import sparse_mla.integration.transformers  # noqa: F401  (registers "sparse_mla")
from sparse_mla.integration.transformers import attention, models, op_route
from sparse_mla.ops.flashmla_decode import vendor
from sparse_mla.integration.transformers.attention import sparse_mla_attention_forward
from sparse_mla.ops.common import checks
from sparse_mla.ops.common.dispatch import ENV_VAR, last_choice
from sparse_mla.ops.common.triton_utils import SOFT_FP8_ENV
from sparse_mla.tests.helpers import CUDA
from sparse_mla.tests.integration.transformers.recording import record

DEVICES = ["cpu"] + ([pytest.param("cuda", id="cuda")] if CUDA else [])


def _calls(device, heads=4, new_tokens=3):
    model = models.random_model(models.tiny_config(num_attention_heads=heads), torch.bfloat16,
                                device=device, seed=5)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, model.config.vocab_size, (1, 20), generator=g).to(device)
    return record(model, lambda: models.greedy(model, ids, new_tokens=new_tokens))


def _run(c):
    with torch.no_grad():
        return sparse_mla_attention_forward(c.module, c.query, c.key, c.value, c.mask,
                                            **c.kwargs)[0]


class _Plans:
    """Counts the plans the attention function makes (``flashmla_decode.plan_prefill``)."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = op_route.fd.plan_prefill

        def counting(*a, **k):
            self.n += 1
            return real(*a, **k)
        monkeypatch.setattr(op_route.fd, "plan_prefill", counting)


@pytest.mark.parametrize("device", DEVICES)
def test_the_op_is_planned_once_per_kind_of_call(device, monkeypatch):
    """A call plans the op (validation, choice, launch plan) once per kind and list width;
    every later call of both runs that plan, bit for bit the same."""
    calls = _calls(device)
    decode = [c for c in calls if c.query.shape[2] == 1]
    prefill = [c for c in calls if c.query.shape[2] > 1]
    op_route.forget()
    plans = _Plans(monkeypatch)
    first = _run(decode[0])
    assert plans.n == 1
    want_impl = last_choice("flashmla_sparse_prefill").impl
    again = _run(decode[0])
    assert plans.n == 1                                  # the kept plan
    assert last_choice("flashmla_sparse_prefill").impl == want_impl
    assert torch.equal(first, again)
    for c in decode[1:] + decode:
        _run(c)
    # one plan per kind and width (decode calls differ in width only), none made twice
    assert plans.n == len(op_route._PLANS) < len(decode)
    n = plans.n
    _run(prefill[0])                                   # a new kind: a new plan
    assert plans.n == n + 1
    monkeypatch.setenv(ENV_VAR, "reference")           # the environment is part of the kind
    forced = _run(decode[0])
    assert plans.n == n + 2 and last_choice("flashmla_sparse_prefill").impl == "reference"
    if device == "cpu":
        assert torch.equal(forced, first)
    monkeypatch.setenv(SOFT_FP8_ENV, "1")               # read by the automatic choice too
    _run(decode[0])
    assert plans.n == n + 3


# 64 heads: FlashMLA's own head count, where a GPU with its wheel calls it directly
HEADS = [("cpu", 4)] + ([pytest.param("cuda", 4, id="cuda"),
                         pytest.param("cuda", 64, id="cuda-h64")] if CUDA else [])


@pytest.mark.parametrize("device,heads", HEADS)
def test_kept_plan_matches_the_op_on_every_call(device, heads):
    """Each recorded call (prefill and decode, every layer type) through a kept plan gives
    the op's answer bit for bit: same implementation, same lists (FlashMLA's at its width:
    the padding is -1, which it skips, as the op's FlashMLA route pads them)."""
    calls = _calls(device, heads)
    for c in calls:
        op_route.forget()
        via_op = _run(c)
        kept = _run(c)
        assert torch.equal(via_op.isnan(), kept.isnan())
        assert torch.equal(via_op.nan_to_num(), kept.nan_to_num())


def test_sinks_kept_follow_in_place_updates():
    c = next(c for c in _calls("cpu") if c.kwargs.get("s_aux") is not None)
    sink = c.kwargs["s_aux"]
    before = _run(c)
    with torch.no_grad():
        sink.add_(2.0)
    after = _run(c)
    fresh = _run(type(c)(c.module, c.query, c.key, c.value, c.mask,
                         dict(c.kwargs, s_aux=sink.detach().clone())))
    assert not torch.equal(before, after)
    assert torch.equal(after, fresh)


class _NoHostReads(TorchFunctionMode):
    """Fails on every way torch code reads a tensor's value on the host (each a device sync
    for a CUDA tensor)."""
    READS = {"__bool__", "item", "tolist", "__int__", "__float__", "__index__", "nonzero",
             "numpy", "cpu"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS:
            raise AssertionError(f"host read of a tensor value: {name}")
        return func(*args, **(kwargs or {}))


def test_calls_read_no_tensor_value_on_the_host(monkeypatch):
    """CPU stand-in for the GPU's sync count: with value checks off (as on a GPU without
    SPARSE_MLA_CHECK_VALUES), neither a first call of a kind nor a later one reads a tensor
    value on the host. The op's CPU implementation is stubbed: it is not what runs on a GPU."""
    calls = _calls("cpu")
    monkeypatch.setattr(checks, "value_checks_enabled", lambda *t: False)

    def stub(q, kv, indices, out, max_logits, lse, topk_length, attn_sink, scale):
        out.zero_()
    d = op_route.dispatch.dispatcher(op_route.OP)
    monkeypatch.setitem(d._impls, "reference", (stub, None, None))
    op_route.forget()
    for c in calls + calls:
        with _NoHostReads():
            _run(c)
    # and the check itself catches a read
    with pytest.raises(AssertionError, match="host read"), _NoHostReads():
        bool(calls[0].query.any())


def test_sinks_cache_drops_dead_tensors():
    sink = torch.randn(4)
    attention._sinks(sink, 4, sink.device)
    key = id(sink)
    assert key in attention._SINKS
    del sink
    assert key not in attention._SINKS


class _FakeFlashMLA:
    """FlashMLA's prefill signature, computed by the op's reference; records what it got."""

    def __init__(self):
        self.widths = []

    def flash_mla_sparse_fwd(self, q, kv, indices, scale, d_v, sink, lengths, use_legacy):
        assert d_v == 512 and use_legacy
        assert indices.is_contiguous() and lengths.is_contiguous()
        assert (lengths <= indices.shape[-1]).all()
        cols = torch.arange(indices.shape[-1])
        assert (indices[:, 0][cols >= lengths[:, None]] == -1).all()   # -1 past each length
        self.widths.append(indices.shape[-1])
        return op_route.fd.flash_mla_sparse_fwd(q, kv, indices, scale, attn_sink=sink,
                                                topk_length=lengths, impl="reference")


@pytest.fixture
def routes_dropped_after():
    """For a test that keeps plans no real call would make: later tests must not get them."""
    yield
    op_route.forget()


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "compiled graph's op"])
def test_direct_flash_mla_route_gets_lists_at_its_width(monkeypatch, routes_dropped_after,
                                                        traced):
    """A kind whose plan calls FlashMLA directly, as on a GPU with its wheel (faked here by
    the reference): lists built 128 wide (also by the custom op a compiled graph calls), -1
    past each row's length, and the op's answer."""
    fake = _FakeFlashMLA()
    monkeypatch.setattr(vendor, "_flash_mla", lambda: (fake, None))
    real_plan = op_route.fd.plan_prefill
    for c in _calls("cpu"):
        op_route.forget()
        monkeypatch.setattr(op_route.fd, "plan_prefill", real_plan)
        want = _run(c)                                 # the kind's first call: the op's plan
        (kind, _), = op_route._PLANS
        op_route._DIRECT.add(kind)                     # as if that plan had chosen FlashMLA
        monkeypatch.setattr(op_route.fd, "plan_prefill", lambda *a, **k: dataclasses.replace(
            real_plan(*a, **k), direct=True))
        calls_before = len(fake.widths)
        if traced:
            b, h, s, d = c.query.shape
            q = c.query[0].transpose(0, 1)
            kv = c.key[:, 0].reshape(-1, 1, d)
            got = attention.attend_traced(
                q, kv, c.mask[:, 0], attention.list_width(c.module, c.key.shape[2], s),
                attention._sinks(c.kwargs.get("s_aux"), h, q.device),
                c.kwargs["scaling"]).view(b, s, h, d)
        else:
            got = _run(c)
        assert len(fake.widths) == calls_before + 1     # the plan ran FlashMLA
        assert fake.widths[-1] % vendor.PREFILL_WIDTH == 0
        torch.testing.assert_close(got.nan_to_num(), want.nan_to_num())

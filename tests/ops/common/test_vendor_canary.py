"""No unverified vendor route runs silently: the one-time canary of dispatch's automatic choice
on an architecture the route was not verified on (fake routes on throwaway dispatchers, fake
architectures through ``dispatch.device_capability``)."""
import pytest
import torch

from sparse_mla.ops.common import dispatch
from sparse_mla.ops.common.dispatch import Canary, Dispatcher, allclose_reason, explain, last_choice


@pytest.fixture(autouse=True)
def _fresh_dispatch_state(monkeypatch):
    """Throwaway dispatchers and canary outcomes vanish after each test; no forcing."""
    monkeypatch.setattr(dispatch, "_REGISTRY", dict(dispatch._REGISTRY))
    monkeypatch.setattr(dispatch, "_CANARIES", {})
    monkeypatch.delenv("SPARSE_MLA_IMPL", raising=False)
    monkeypatch.delenv("SPARSE_MLA_SOFT_FP8", raising=False)


def _fake_arch(monkeypatch, caps):
    """``caps``: device type -> (major, minor); returns the devices looked up, in order."""
    looked_up = []

    def capability(device):
        looked_up.append(torch.device(device))
        return caps[torch.device(device).type]
    monkeypatch.setattr(dispatch, "device_capability", capability)
    return looked_up


def _write(out, value, name):
    out.copy_(value)
    return name


class FakeVendor:
    """A vendor route writing ``x * factor`` into ``out`` (Triton and the reference write
    ``x * 2``), with a canary over ``arange(4)``; counts its calls and canary builds."""

    def __init__(self, name, factor=2.0, verified_ccs=(), raises=False):
        self.calls, self.built_on = 0, []
        self.factor, self.raises = factor, raises
        self.d = Dispatcher(name)
        self.d.register("vendor", self.vendor, verified_ccs=verified_ccs,
                        canary=Canary(self.build, self.compare))
        self.d.register("triton", lambda x, out: _write(out, x * 2, "triton"))
        self.d.register("reference", lambda x, out: _write(out, x * 2, "reference"))

    def vendor(self, x, out):
        self.calls += 1
        if self.raises:
            raise RuntimeError("illegal memory access")
        out.copy_(x * self.factor)
        return "vendor"

    def build(self, device):
        self.built_on.append(torch.device(device))
        x = torch.arange(4, dtype=torch.float32, device=device)
        return (x, torch.zeros_like(x)), {}

    @staticmethod
    def compare(vendor_call, triton_call):
        return allclose_reason("out", vendor_call[0][1], triton_call[0][1], 1e-2, 2 / 128)


def _args(device="cpu"):
    x = torch.ones(3, device=device)
    return x, torch.zeros_like(x)


def test_a_lying_vendor_is_rejected_once_with_the_reason_and_triton_runs(monkeypatch):
    _fake_arch(monkeypatch, {"cpu": (10, 0)})
    fake = FakeVendor("toy_canary_lies", factor=3.0)
    x, out = _args()
    assert fake.d(x, out) == "triton"
    assert torch.equal(out, x * 2)
    choice = last_choice("toy_canary_lies")
    assert choice.impl == "triton"
    assert "disagreed with Triton" in choice.rejected["vendor"]
    assert "out differs by 3" in choice.rejected["vendor"]   # arange(4)*3 vs *2: worst at 3
    assert "SM100" in choice.rejected["vendor"]
    assert str(choice).count("disagreed") == 1              # the reason, printed once
    assert fake.calls == 1 and len(fake.built_on) == 2      # one vendor call, one Triton call
    assert fake.d(*_args()) == "triton"
    assert "disagreed" in str(explain("toy_canary_lies", *_args()))
    assert fake.calls == 1 and len(fake.built_on) == 2      # never retried in this process


def test_a_raising_vendor_is_rejected_naming_the_exception(monkeypatch):
    _fake_arch(monkeypatch, {"cpu": (10, 3)})
    fake = FakeVendor("toy_canary_raises", raises=True)
    assert fake.d(*_args()) == "triton"
    reason = last_choice("toy_canary_raises").rejected["vendor"]
    assert "RuntimeError: illegal memory access" in reason and "impl='vendor'" in reason
    fake.d(*_args())
    assert fake.calls == 1


def test_a_truthful_vendor_is_accepted_once_and_used_after(monkeypatch):
    _fake_arch(monkeypatch, {"cpu": (10, 0)})
    fake = FakeVendor("toy_canary_truth")
    assert fake.d(*_args()) == "vendor"
    choice = last_choice("toy_canary_truth")
    assert choice.impl == "vendor" and choice.rejected == {}
    assert "matched Triton" in choice.canary and "matched Triton" in str(choice)
    assert fake.calls == 2 and len(fake.built_on) == 2      # the canary's call and the op's
    assert fake.d(*_args()) == "vendor"
    assert explain("toy_canary_truth", *_args()).impl == "vendor"
    assert fake.calls == 3 and len(fake.built_on) == 2


def test_a_verified_arch_runs_no_canary(monkeypatch):
    _fake_arch(monkeypatch, {"cpu": (9, 0)})
    fake = FakeVendor("toy_canary_verified", factor=3.0, verified_ccs=((9, 0),))
    assert fake.d(*_args()) == "vendor"                     # lies, but was verified here
    assert fake.built_on == [] and last_choice("toy_canary_verified").canary is None


def test_the_arch_looked_up_is_the_tensors_device_not_the_current_gpu(monkeypatch):
    looked_up = _fake_arch(monkeypatch, {"cpu": (9, 0), "meta": (10, 0)})

    def no_current_device(*args, **kwargs):
        raise AssertionError("the current GPU was asked")
    monkeypatch.setattr(torch.cuda, "current_device", no_current_device)
    monkeypatch.setattr(torch.cuda, "get_device_capability", no_current_device)
    fake = FakeVendor("toy_canary_device", verified_ccs=((9, 0),))
    assert fake.d(*_args("cpu")) == "vendor" and fake.built_on == []
    choice = explain("toy_canary_device", *_args("meta"))
    assert looked_up == [torch.device("cpu"), torch.device("meta")]
    assert fake.built_on == [torch.device("meta")] * 2      # the canary runs on that device
    assert choice.impl == "triton" and "meta (SM100)" in choice.rejected["vendor"]
    assert fake.d(*_args("cpu")) == "vendor"                # the meta verdict is not the CPU's


def test_forcing_the_vendor_runs_it_without_a_canary(monkeypatch):
    _fake_arch(monkeypatch, {"cpu": (10, 0)})
    fake = FakeVendor("toy_canary_forced", factor=3.0)
    assert fake.d(*_args(), impl="vendor") == "vendor"
    monkeypatch.setenv("SPARSE_MLA_IMPL", "toy_canary_forced=vendor")
    assert fake.d(*_args()) == "vendor"
    assert fake.built_on == [] and last_choice("toy_canary_forced").canary is None


def test_no_canary_runs_during_graph_capture_but_an_earlier_pass_counts(monkeypatch):
    _fake_arch(monkeypatch, {"cpu": (10, 0)})
    capturing = [True]
    monkeypatch.setattr(dispatch, "graph_capturing", lambda device: capturing[0])
    fake = FakeVendor("toy_canary_capture")
    assert fake.d(*_args()) == "triton" and fake.built_on == []
    assert "CUDA graph is being captured" in last_choice("toy_canary_capture").rejected["vendor"]
    capturing[0] = False
    assert fake.d(*_args()) == "vendor" and len(fake.built_on) == 2
    capturing[0] = True
    assert fake.d(*_args()) == "vendor" and len(fake.built_on) == 2


def test_a_canary_triton_cannot_run_rejects_the_vendor_with_tritons_reason(monkeypatch):
    _fake_arch(monkeypatch, {"cpu": (10, 0)})
    fake = FakeVendor("toy_canary_no_triton")
    fake.d.register("triton", lambda x, out: _write(out, x * 2, "triton"),
                    lambda x, out: None if x.numel() < 4 else "too long for triton")
    assert fake.d(*_args()) == "triton"                     # 3 elements: Triton runs the op
    reason = last_choice("toy_canary_no_triton").rejected["vendor"]
    assert "no Triton answer to compare with: too long for triton" in reason   # canary: 4
    assert fake.calls == 0


def test_a_route_without_a_canary_is_not_chosen_on_an_unverified_arch(monkeypatch):
    _fake_arch(monkeypatch, {"cpu": (12, 0)})
    d = Dispatcher("toy_canary_none")
    d.register("vendor", lambda x, out: "vendor", verified_ccs=((9, 0),))
    d.register("triton", lambda x, out: "triton")
    assert d(*_args()) == "triton"
    assert "declares none" in last_choice("toy_canary_none").rejected["vendor"]
    assert d(*_args(), impl="vendor") == "vendor"


def test_canary_and_verified_ccs_belong_to_the_vendor_route():
    d = Dispatcher("toy_canary_misplaced")
    with pytest.raises(ValueError, match="vendor route, not 'triton'"):
        d.register("triton", lambda x: x, verified_ccs=((9, 0),))


def test_every_shipped_vendor_route_declares_where_it_was_verified():
    from sparse_mla.ops.flashmla_decode import vendor as flashmla
    from sparse_mla.ops.trtllm_decode import vendor as flashinfer
    assert flashmla.DECODE.verified_ccs == flashmla.PREFILL.verified_ccs == ((9, 0),)
    assert flashinfer.DSV4.verified_ccs == flashinfer.V32.verified_ccs == ()
    assert flashinfer.DSV4.canary is not None and flashinfer.V32.canary is not None


def test_flashinfer_checks_the_querys_gpu(monkeypatch):
    from sparse_mla.ops.trtllm_decode import vendor as flashinfer
    looked_up = _fake_arch(monkeypatch, {"meta": (10, 0)})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda *a: pytest.fail("the current GPU was asked"))
    reason = flashinfer.dsv4_check(torch.zeros(1, device="meta"))
    assert looked_up == [torch.device("meta")]
    assert reason is None or "this GPU is" not in reason    # SM100 passes the arch check


@pytest.mark.parametrize("op", ["dsv4", "v32"])
def test_the_flashinfer_canaries_are_valid_calls_judged_at_the_op_tolerance(op):
    from sparse_mla.ops.trtllm_decode import canary, ops, reference
    route = {"dsv4": canary.DSV4, "v32": canary.V32}[op]
    validate = {"dsv4": ops._validate_dsv4, "v32": ops._validate_v32}[op]
    run = {"dsv4": reference.dsv4, "v32": reference.v32}[op]
    first, second = route.build("cpu"), route.build("cpu")
    validate(*first[0])                       # value checks run on CPU: a call the op accepts
    run(*first[0])
    run(*second[0])
    assert route.compare(first, second) is None
    out = {"dsv4": 6, "v32": 4}[op]
    assert first[0][out].abs().max() > 0.01                # an answer that can be wrong
    second[0][out].add_(0.05)
    assert "out differs" in route.compare(first, second)

"""Choosing an implementation for one op call: vendor, then Triton, then the reference.

Every op family registers its implementations on a :class:`Dispatcher`, all of them the same
way: :func:`implementations` (the family's vendor route from its vendor.py, its Triton and
reference implementations). Each implementation comes with a ``check`` that returns ``None``
when it can run on the given arguments or a short reason when it cannot, and optionally an
``automatic`` check: a reason for the automatic choice to pass over an implementation that can
run (one measured slower than the next one there); forcing it still runs it. The choice can
be forced per call (``impl=``) or for the whole process with the environment variable
``SPARSE_MLA_IMPL``:

* ``SPARSE_MLA_IMPL=triton`` forces Triton for every op;
* ``SPARSE_MLA_IMPL=quantize_insert_v4=reference,gather_dequant=triton`` forces per op
  (op names without the ``sparse_mla::`` prefix); other ops stay automatic.

The variable is checked as a whole at the first op call that reads it (and again whenever it
changes): an unknown implementation or op name, or a malformed item, raises ``ValueError``
naming the valid ones, so a typo cannot silently leave the choice automatic.

A forced implementation that cannot run raises :class:`ImplementationUnavailable` naming what
is missing; there is no silent fallback. ``last_choice(op)`` / ``explain(op, ...)`` report which
implementation ran (or would run) and why the others were rejected.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import threading
from typing import Callable, Optional

import torch

from sparse_mla.ops.common.errors import ImplementationUnavailable

IMPLS = ("vendor", "triton", "reference")
ENV_VAR = "SPARSE_MLA_IMPL"

# Every op of the project, by family (the package that registers it when imported). Written
# out so that SPARSE_MLA_IMPL and explain() can name the valid ops before a family is
# imported; tests/ops/common/test_dispatch.py checks it against the registered dispatchers.
OPS_BY_FAMILY = {
    "cache_insert": ("quantize_insert_v4", "quantize_insert_v32", "fused_qnorm_rope_insert_v4",
                     "fused_qnorm_rope_insert_plain", "insert_plain", "gather_dequant",
                     "fused_rope_insert_v41", "compressed_insert_v41", "rope_insert_v4"),
    "index_combine": ("global_topk_indices_and_lens", "convert_req_index_to_global",
                      "swa_indices_and_lens", "c128a_indices_and_lens",
                      "combine_topk_swa_indices", "flashinfer_mixed_sparse_indices"),
    "flashmla_decode": ("flashmla_sparse_decode", "flashmla_sparse_prefill"),
    "trtllm_decode": ("trtllm_decode_dsv4", "trtllm_decode_v32"),
    "indexer": ("indexer_k_insert", "indexer_topk_prefill", "indexer_topk_decode"),
}
FAMILY_OF = {op: fam for fam, ops in OPS_BY_FAMILY.items() for op in ops}

Check = Callable[..., Optional[str]]


@dataclasses.dataclass(frozen=True)
class Choice:
    op: str
    impl: str
    forced_by: Optional[str]            # "impl=" | ENV_VAR | None (automatic)
    rejected: dict                      # impl name -> reason it was not used
    # what the Triton implementation launched (``LaunchPlan`` of ops/attention/plan.py: the
    # kernel route and why); set on ``last_choice`` after a call of an attention op, else None
    plan: Optional[object] = None

    @property
    def route(self) -> Optional[str]:
        """The kernel route that ran: "vendor", "reference", or for Triton the attention
        core's route ("portable", "tiny", "sm90", "sm90_cluster"; None for other ops), with
        ", software e4m3 (why)" where it decoded e4m3 in software (``LaunchPlan.label``)."""
        if self.impl != "triton":
            return self.impl
        return getattr(self.plan, "label", None)

    def __str__(self):
        why = "; ".join(f"{k}: {v}" for k, v in self.rejected.items())
        how = f"forced by {self.forced_by}" if self.forced_by else "automatic"
        ran = f"{self.impl}, route {self.plan}" if self.plan is not None else self.impl
        return f"{self.op}: ran {ran} ({how})" + (f"; rejected {why}" if why else "")


_REGISTRY: dict = {}
_LAST = threading.local()


def _valid_ops() -> list:
    return sorted(set(FAMILY_OF) | set(_REGISTRY))


@functools.lru_cache(maxsize=16)      # a ValueError is not cached: it is raised every call
def parse_env(raw: str) -> dict:
    """``SPARSE_MLA_IMPL``'s value as ``{op or "*": impl}`` (cached: do not mutate it).
    Raises ValueError on an unknown implementation or op name, or a malformed item, naming
    the valid ones."""
    raw = raw.strip()
    if not raw:
        return {}
    valid_impls = ("auto",) + IMPLS
    if "=" not in raw:
        if raw not in valid_impls:
            raise ValueError(f"{ENV_VAR} asks for implementation {raw!r}; expected one of "
                             f"{valid_impls}, or op=impl pairs separated by commas")
        return {"*": raw}
    out = {}
    for item in raw.split(","):
        name, eq, value = (x.strip() for x in item.partition("="))
        name = name.removeprefix("sparse_mla::")
        if not eq or not name:
            raise ValueError(f"{ENV_VAR}: item {item.strip()!r} is not op=impl (the whole "
                             f"value is one implementation, or op=impl pairs separated by "
                             f"commas)")
        if name not in _valid_ops():
            raise ValueError(f"{ENV_VAR}: unknown op {name!r}; valid ops: "
                             f"{', '.join(_valid_ops())}")
        if value not in valid_impls:
            raise ValueError(f"{ENV_VAR} asks for implementation {value!r} for {name}; "
                             f"expected one of {valid_impls}")
        out[name] = value
    return out


def _env_request(op: str) -> Optional[str]:
    request = parse_env(os.environ.get(ENV_VAR, ""))
    return request.get("*", request.get(op))


def _validate_request(op: str, requested: str, source: str) -> None:
    if requested not in IMPLS + ("auto",):
        raise ValueError(f"{op}: {source} asks for implementation {requested!r}; "
                         f"expected one of {('auto',) + IMPLS}")


class Dispatcher:
    """The implementations of one op, in preference order vendor → triton → reference."""

    def __init__(self, op: str):
        if op in _REGISTRY:
            raise ValueError(f"dispatcher for {op!r} already exists")
        self.op = op
        self._impls: dict = {}
        _REGISTRY[op] = self

    def register(self, name: str, fn: Callable, check: Optional[Check] = None,
                 automatic: Optional[Check] = None) -> None:
        if name not in IMPLS:
            raise ValueError(f"unknown implementation kind {name!r}")
        self._impls[name] = (fn, check, automatic)

    def _reason(self, name: str, args, kwargs, automatic: bool = False) -> Optional[str]:
        if name not in self._impls:
            return f"{self.op} has no {name} implementation"
        _, check, auto_check = self._impls[name]
        reason = None if check is None else check(*args, **kwargs)
        if reason is None and automatic and auto_check is not None:
            reason = auto_check(*args, **kwargs)
        if reason is None and automatic and name == "vendor" and soft_fp8_forced():
            # the switch stands in for a GPU below sm_89, where no vendor kernel runs (FlashMLA:
            # sm_90; FlashInfer's DSv4: sm_100): the automatic choice must run what runs there
            reason = (f"{SOFT_FP8_ENV}=1 runs what a GPU below sm_89 runs, and no vendor "
                      "kernel runs there (impl='vendor' still runs it)")
        return reason

    def choose(self, impl: Optional[str], *args, **kwargs) -> Choice:
        forced_by = None
        requested = impl if impl not in (None, "", "auto") else None
        if requested is not None:
            forced_by = "impl="
            _validate_request(self.op, requested, "impl=")
        else:
            env = _env_request(self.op)
            if env not in (None, "", "auto"):
                _validate_request(self.op, env, ENV_VAR)
                requested, forced_by = env, ENV_VAR
        if requested is not None:
            reason = self._reason(requested, args, kwargs)
            if reason is not None:
                raise ImplementationUnavailable(
                    f"{self.op}: implementation {requested!r} was forced by {forced_by} "
                    f"but cannot run: {reason}", reason)
            return Choice(self.op, requested, forced_by, {})
        rejected = {}
        for name in IMPLS:
            reason = self._reason(name, args, kwargs, automatic=True)
            if reason is None:
                return Choice(self.op, name, None, rejected)
            rejected[name] = reason
        raise ImplementationUnavailable(f"{self.op}: no implementation can run: {rejected}")

    def __call__(self, *args, impl: Optional[str] = None, **kwargs):
        return self.run(self.choose(impl, *args, **kwargs), *args, **kwargs)

    def run(self, choice: Choice, *args, **kwargs):
        """Run the implementation ``choice`` names (from :meth:`choose` on arguments of the
        same kind: a caller that chose once per shape skips choosing on every call) and
        record it for ``last_choice``."""
        record_choice(choice)
        fn = self._impls[choice.impl][0]
        _LAST.plan = None
        dev = cuda_device_of(args, kwargs)
        if dev is None or dev == torch.cuda.current_device():
            result = fn(*args, **kwargs)
        else:
            # Triton launches on the current GPU, whatever its arguments' device: on an H200
            # pair the op tests on cuda:1 failed ("Pointer argument cannot be accessed from
            # Triton") while the current device was 0, as in one process that spreads a
            # model over GPUs
            with torch.cuda.device(dev):
                result = fn(*args, **kwargs)
        if _LAST.plan is not None:
            _LAST.choices[self.op] = dataclasses.replace(choice, plan=_LAST.plan)
        return result


def canonical_device(device) -> torch.device:
    """One name per device: "cuda" is the current GPU, "cuda:N" (so "cuda" and "cuda:0" compare
    equal where GPU 0 is current)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def cuda_device_of(args, kwargs) -> Optional[int]:
    """The index of the first CUDA tensor among the arguments (the ops check that all share
    one device), or None where there is none."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.device.type == "cuda":
            return canonical_device(a.device).index
    return None


def load_family(op: str) -> None:
    """Import the family that registers ``op`` (a no-op once imported)."""
    fam = FAMILY_OF.get(op)
    if fam is not None and op not in _REGISTRY:
        importlib.import_module(f"sparse_mla.ops.{fam}")


def load_all() -> list:
    """Import every op family (registering all ops); returns the op names."""
    for fam in OPS_BY_FAMILY:
        importlib.import_module(f"sparse_mla.ops.{fam}")
    return sorted(_REGISTRY)


def _op_name(op: str) -> str:
    name = op.removeprefix("sparse_mla::")
    if name not in _REGISTRY:
        load_family(name)
    if name not in _REGISTRY:
        raise ValueError(f"unknown op {op!r}; valid ops: {', '.join(_valid_ops())}")
    return name


def last_choice(op: str) -> Optional[Choice]:
    """What the most recent call of ``op`` on this thread ran, and why the others were not;
    for the attention ops' Triton implementation also the kernel route and launch plan
    (``Choice.route`` / ``Choice.plan``)."""
    return getattr(_LAST, "choices", {}).get(_op_name(op))


def record_choice(choice: Choice) -> None:
    """Record ``choice`` as its op's ``last_choice`` on this thread: for a caller that ran
    the chosen implementation's kernel itself (the HF integration's FlashMLA route)."""
    if not hasattr(_LAST, "choices"):
        _LAST.choices = {}
    _LAST.choices[choice.op] = choice


def record_plan(plan) -> None:
    """Called by the attention core with the launch plan it ran; the dispatcher call in
    progress on this thread attaches it to its ``Choice``."""
    _LAST.plan = plan


def last_plan():
    """The launch plan of the attention core's most recent launch on this thread, through
    any op (None before the first)."""
    return getattr(_LAST, "plan", None)


def explain(op: str, *args, impl: Optional[str] = None, **kwargs) -> Choice:
    """Which implementation a call with these arguments would run, without running it. The
    kernel route of the Triton attention ops is decided at launch: after a call,
    ``last_choice(op)`` reports it (``route``, ``plan``: which kernel ran and why)."""
    return _REGISTRY[_op_name(op)].choose(impl, *args, **kwargs)


def dispatcher(op: str) -> Dispatcher:
    return _REGISTRY[_op_name(op)]


# ---------------------------------------------------------------------------------------------
# Checks shared by every op family.

def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


# Forces the software e4m3 route on any GPU ("1"): what an Ampere card runs, testable on a Hopper
SOFT_FP8_ENV = "SPARSE_MLA_SOFT_FP8"


def soft_fp8_forced() -> bool:
    return os.environ.get(SOFT_FP8_ENV, "0") not in ("", "0")


def triton_check(*tensors) -> Optional[str]:
    """Triton runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - triton is a hard dependency on Linux
        return f"triton is not importable ({exc})"
    devices = {t.device.type for t in tensors if t is not None}
    if devices == {"cuda"}:
        return None
    if devices == {"cpu"} and triton_interpreting():
        return None
    if devices == {"cpu"}:
        return "tensors are on CPU (Triton needs CUDA, or TRITON_INTERPRET=1 for its interpreter)"
    return f"tensors are on {sorted(devices)}; Triton needs them all on one CUDA device"


def triton_check_args(*args, **kwargs) -> Optional[str]:
    """:func:`triton_check` over every tensor among an op's arguments (the ops check before
    dispatch that they all share one device)."""
    return triton_check(*(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)))


def no_vendor(reason: str) -> Check:
    def check(*args, **kwargs):
        return reason
    return check


@dataclasses.dataclass(frozen=True)
class VendorRoute:
    """A family's vendor implementation of one op, as its ``vendor.py`` states it: ``run``
    (None where no vendor kernel exists), ``check`` (None where it can run on the arguments,
    else why not) and optionally ``automatic`` (see :meth:`Dispatcher.register`)."""
    run: Optional[Callable]
    check: Check
    automatic: Optional[Check] = None


def no_vendor_route(reason: str) -> VendorRoute:
    """The vendor route of an op no vendor package ships: ``explain`` gives ``reason``."""
    return VendorRoute(None, no_vendor(reason))


def implementations(op: str, *, vendor: VendorRoute, triton: Callable,
                    reference: Callable) -> Dispatcher:
    """The dispatcher of ``op`` (its name without ``sparse_mla::``), registered the same way by
    every family's ops.py: the family's ``vendor`` route with its own checks; its ``triton``
    implementation wherever the arguments' tensors allow Triton (:func:`triton_check_args`);
    its ``reference`` everywhere. All three take the arguments the op passes its dispatcher."""
    d = Dispatcher(op)
    d.register("vendor", vendor.run, vendor.check, vendor.automatic)
    d.register("triton", triton, triton_check_args)
    d.register("reference", reference)
    return d

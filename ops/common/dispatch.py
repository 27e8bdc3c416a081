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

No unverified vendor route runs silently: each declares the compute capabilities on which this
project's tests ran it (``VendorRoute.verified_ccs``). On any other device the automatic choice
first runs the route's :class:`Canary` once per (process, op, device): a small call of the op
compared against the Triton implementation within the op's test tolerance. A pass lets the
automatic choice use the vendor route on that device from then on; a failure or an exception
rejects it there for the rest of the process (never retried), with the reason in
``Choice.rejected``; ``Choice.canary`` reports the outcome either way. No canary runs while a
CUDA graph is being captured (the vendor route is rejected then, unless a canary on that device
already passed). Forcing the vendor (``impl="vendor"`` or ``SPARSE_MLA_IMPL``) runs it without a
canary.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import os
import threading
from typing import Callable, Optional

import torch

from sparse_mla.ops.common import env as env_vars
from sparse_mla.ops.common.errors import ImplementationUnavailable

IMPLS = ("vendor", "triton", "reference")
ENV_VAR = "SPARSE_MLA_IMPL"

# Every op of the project, by family (the package that registers it when imported). Written
# out so that SPARSE_MLA_IMPL and explain() can name the valid ops before a family is
# imported; tests/ops/common/test_dispatch.py checks it against the registered dispatchers.
OPS_BY_FAMILY = {
    "cache_insert": ("quantize_insert_v4", "quantize_insert_v32", "fused_qnorm_rope_insert_v4",
                     "fused_qnorm_rope_insert_plain", "insert_plain", "gather_dequant",
                     "fused_rope_insert_v41", "compressed_insert_v41", "quantize_insert_v32_nope"),
    "index_combine": ("global_topk_indices_and_lens", "convert_req_index_to_global",
                      "swa_indices_and_lens", "c128a_indices_and_lens",
                      "combine_topk_swa_indices", "flashinfer_mixed_sparse_indices"),
    "flashmla_decode": ("flashmla_sparse_decode", "flashmla_sparse_prefill"),
    "trtllm_decode": ("trtllm_decode_dsv4", "trtllm_decode_v32"),
    "indexer": ("indexer_k_insert", "indexer_topk_prefill", "indexer_topk_decode"),
    "indexer_kpool": ("kpool_k_insert", "kpool_topk_prefill", "kpool_topk_decode"),
    "indexer_v41": ("indexer_v41_candidates_decode", "indexer_v41_topk_in_candidates_decode",
                    "indexer_v41_candidates_prefill", "indexer_v41_topk_in_candidates_prefill"),
}
FAMILY_OF = {op: fam for fam, ops in OPS_BY_FAMILY.items() for op in ops}

Check = Callable[..., Optional[str]]


@dataclasses.dataclass(frozen=True)
class Choice:
    op: str
    impl: str
    forced_by: Optional[str]            # "impl=" | ENV_VAR | None (automatic)
    rejected: dict                      # impl name -> reason it was not used
    # what the Triton implementation launches (``LaunchPlan`` of ops/attention/plan.py: the
    # kernel route, its file and why): made by ``explain`` before a call of an attention op,
    # and on ``last_choice`` after one (with its compiled kernels); else None
    plan: Optional[object] = None
    # the vendor route's one-time canary on this device (see the module docstring), where the
    # automatic choice needed one: "... passed" or why it failed; None where none was needed
    canary: Optional[str] = None
    # made by ``explain`` / a ``plan_*`` function before the call (its ``plan`` the launch plan
    # the call will carry out), not recorded after one
    ahead: bool = False

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
        verb = "will run" if self.ahead else "ran"
        # a failed canary is already the vendor's rejection reason
        shown = self.canary and self.canary not in self.rejected.get("vendor", "")
        canary = f"; vendor canary: {self.canary}" if shown else ""
        return (f"{self.op}: {verb} {ran} ({how})" + (f"; rejected {why}" if why else "")
                + canary)


_REGISTRY: dict = {}
_LAST = threading.local()
# (op, device) -> (passed, note): each vendor canary's outcome, for the life of the process
_CANARIES: dict = {}
_CANARY_LOCK = threading.Lock()


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
    request = parse_env(env_vars.getenv(ENV_VAR))
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
        self._verified_ccs: tuple = ()
        self._canary: Optional[Canary] = None
        self._planners: dict = {}
        _REGISTRY[op] = self

    def register(self, name: str, fn: Callable, check: Optional[Check] = None,
                 automatic: Optional[Check] = None, verified_ccs: tuple = (),
                 canary: Optional["Canary"] = None, planner: Optional[Callable] = None) -> None:
        """``verified_ccs`` and ``canary`` only for the vendor route: the compute capabilities
        (``(major, minor)``) on which this project's tests ran it, and the call that checks it
        once per device elsewhere (module docstring). ``planner``: for the Triton route of an
        attention op, what it would launch on these arguments (``plan.LaunchPlan``), made
        without launching: ``explain`` reports it."""
        if name not in IMPLS:
            raise ValueError(f"unknown implementation kind {name!r}")
        if name != "vendor" and (verified_ccs or canary is not None):
            raise ValueError(f"{self.op}: verified_ccs / canary describe the vendor route, "
                             f"not {name!r}")
        self._impls[name] = (fn, check, automatic)
        if planner is not None:
            self._planners[name] = planner
        if name == "vendor":
            self._verified_ccs = tuple(tuple(cc) for cc in verified_ccs)
            self._canary = canary

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
        rejected, canary = {}, None
        for name in IMPLS:
            reason = self._reason(name, args, kwargs, automatic=True)
            if reason is None and name == "vendor":
                reason, canary = self._verify_vendor(args, kwargs)
            if reason is None:
                return Choice(self.op, name, None, rejected, canary=canary)
            rejected[name] = reason
        raise ImplementationUnavailable(f"{self.op}: no implementation can run: {rejected}")

    def _verify_vendor(self, args, kwargs) -> tuple:
        """``(why the automatic choice may not run the vendor route or None, the canary's
        note or None)`` for a call on these arguments' device. A call without tensors has no
        device to verify (the toy dispatchers of tests)."""
        device = tensor_device_of(args, kwargs)
        if device is None:
            return None, None
        cc = device_capability(device)
        if cc is not None and tuple(cc) in self._verified_ccs:
            return None, None
        key = (self.op, str(device))
        with _CANARY_LOCK:
            outcome = _CANARIES.get(key)
        if outcome is None:
            where = _arch_name(device, cc)
            if graph_capturing(device):
                # a canary launches and reads values back: neither may happen in a capture
                return (f"not verified on {where} by this project's tests, and its one-time "
                        f"canary cannot run while a CUDA graph is being captured (a call "
                        f"before capture runs it; impl='vendor' runs the route)"), None
            outcome = self._run_canary(device, where)
            with _CANARY_LOCK:
                outcome = _CANARIES.setdefault(key, outcome)
        passed, note = outcome
        return (None if passed else note + " (impl='vendor' still runs it)"), note

    def _run_canary(self, device: torch.device, where: str) -> tuple:
        """``(passed, note)``: the vendor route's canary call on ``device`` against Triton's."""
        head = f"not verified on {where} by this project's tests; its one-time canary"
        if self._canary is None:
            return False, f"{head} does not exist (the route declares none)"
        saved_plan = getattr(_LAST, "plan", None)
        try:
            vendor_call = self._canary.build(device)
            triton_call = self._canary.build(device)
            why_not = self._reason("triton", *triton_call)
            if why_not is not None:
                return False, f"{head} has no Triton answer to compare with: {why_not}"
            _call_on(cuda_device_of(*vendor_call), self._impls["vendor"][0], *vendor_call)
            _call_on(cuda_device_of(*triton_call), self._impls["triton"][0], *triton_call)
            diff = self._canary.compare(vendor_call, triton_call)
        except Exception as exc:   # any failure of the vendor's call rejects it
            return False, f"{head} raised {type(exc).__name__}: {exc}"
        finally:
            _LAST.plan = saved_plan   # the canary's launch is not the op's
        if diff is not None:
            return False, f"{head} disagreed with Triton: {diff}"
        return True, f"{head} on {device} matched Triton"

    def explain(self, impl: Optional[str], *args, **kwargs) -> Choice:
        """:meth:`choose`, with the launch plan of the chosen route where it has a planner
        (the attention ops' Triton route: the kernel, its file, why, the splits)."""
        choice = dataclasses.replace(self.choose(impl, *args, **kwargs), ahead=True)
        planner = self._planners.get(choice.impl)
        if planner is None:
            return choice
        return dataclasses.replace(choice, plan=planner(*args, **kwargs))

    def __call__(self, *args, impl: Optional[str] = None, **kwargs):
        return self.run(self.choose(impl, *args, **kwargs), *args, **kwargs)

    def run(self, choice: Choice, *args, **kwargs):
        """Run the implementation ``choice`` names (from :meth:`choose` on arguments of the
        same kind: a caller that chose once per shape skips choosing on every call) and
        record it for ``last_choice``."""
        choice = dataclasses.replace(choice, ahead=False) if choice.ahead else choice
        record_choice(choice)
        fn = self._impls[choice.impl][0]
        _LAST.plan = None
        result = _call_on(cuda_device_of(args, kwargs), fn, args, kwargs)
        if _LAST.plan is not None:
            record_choice(dataclasses.replace(choice, plan=_LAST.plan))
        return result


def _call_on(dev: Optional[int], fn: Callable, args, kwargs):
    """``fn(*args, **kwargs)`` with CUDA device ``dev`` current (None: as it is)."""
    if dev is None or dev == torch.cuda.current_device():
        return fn(*args, **kwargs)
    # Triton launches on the current GPU, whatever its arguments' device: on an H200 pair the
    # op tests on cuda:1 failed ("Pointer argument cannot be accessed from Triton") while the
    # current device was 0, as in one process that spreads a model over GPUs
    with torch.cuda.device(dev):
        return fn(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class Canary:
    """A small call of one op that checks its vendor route on a device it was not verified on.
    ``build(device)`` returns fresh ``(args, kwargs)`` for the dispatcher's implementations,
    the same values on every call (it is called once for the vendor, once for Triton);
    ``compare(vendor_call, triton_call)`` reads the outputs both wrote into their own
    ``(args, kwargs)`` and returns None where they agree within the op's test tolerance, else
    how they differ."""
    build: Callable[[torch.device], tuple]
    compare: Callable[[tuple, tuple], Optional[str]]


def allclose_reason(name: str, got: torch.Tensor, want: torch.Tensor, atol: float,
                    rtol: float) -> Optional[str]:
    """None where ``got`` is within ``atol + rtol * |want|`` of ``want`` everywhere (NaN
    nowhere), else the worst element: for a :class:`Canary`'s ``compare``."""
    got, want = got.float(), want.float()
    err = (got - want).abs()
    bad = ~(err <= atol + rtol * want.abs())
    if not bool(bad.any()):
        return None
    worst = int(torch.where(bad, err.nan_to_num(float("inf")), -1).argmax())
    return (f"{name} differs by {float(err.reshape(-1)[worst]):.3g} at flat index {worst} "
            f"({float(got.reshape(-1)[worst]):.4g} vs {float(want.reshape(-1)[worst]):.4g}; "
            f"{int(bad.sum())} of {bad.numel()} elements past atol {atol:g}, rtol {rtol:g})")


def tensor_device_of(args, kwargs) -> Optional[torch.device]:
    """The device of the first tensor among an op's arguments (its query: the ops check that
    all share one device), or None where there is none. The vendor checks and the canary
    look up this device's architecture, never the current GPU's."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return canonical_device(a.device)
    return None


def device_capability(device) -> Optional[tuple]:
    """``(major, minor)`` of a CUDA device, None for any other: the one architecture lookup
    the dispatcher and the vendor checks use."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))


def _arch_name(device: torch.device, cc: Optional[tuple]) -> str:
    return f"{device} (SM{cc[0]}{cc[1]})" if cc is not None else str(device)


def graph_capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream."""
    if device.type != "cuda":
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


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
    for ops, ran in getattr(_LAST, "recorders", ()):
        if choice.op in ops:
            ran[choice.op] = choice


@contextlib.contextmanager
def recording(ops):
    """Collects, into the dict it yields, the ``Choice`` of every op in ``ops`` called on this
    thread inside the block (the last call's where an op runs several times): what a backend
    step ran, layer by layer, even where every layer runs the same planned choice."""
    ran: dict = {}
    if not hasattr(_LAST, "recorders"):
        _LAST.recorders = []
    _LAST.recorders.append((frozenset(_op_name(op) for op in ops), ran))
    try:
        yield ran
    finally:
        _LAST.recorders.pop()     # blocks nest: this block's is the last


def record_plan(plan) -> None:
    """Called by the attention core with the launch plan it ran; the dispatcher call in
    progress on this thread attaches it to its ``Choice``."""
    _LAST.plan = plan


def last_plan():
    """The launch plan of the attention core's most recent launch on this thread, through
    any op (None before the first)."""
    return getattr(_LAST, "plan", None)


def explain(op: str, *args, impl: Optional[str] = None, **kwargs) -> Choice:
    """Which implementation a call with these arguments (the op's dispatcher arguments) would
    run, and for the attention ops' Triton route its launch plan (``Choice.plan``: kernel
    route, its file, why, the splits), without running it (but running the vendor route's
    one-time canary where the automatic choice needs it, so that the answer is the call's).
    The ops' own ``plan_*`` functions (e.g. ``flashmla_decode.plan_decode``) take the op's
    public arguments instead."""
    return _REGISTRY[_op_name(op)].explain(impl, *args, **kwargs)


def dispatcher(op: str) -> Dispatcher:
    return _REGISTRY[_op_name(op)]


# ---------------------------------------------------------------------------------------------
# Checks shared by every op family.

def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


# Forces the software e4m3 route on any GPU ("1"): what an Ampere card runs, testable on a Hopper
SOFT_FP8_ENV = "SPARSE_MLA_SOFT_FP8"


def soft_fp8_forced() -> bool:
    return env_vars.getenv(SOFT_FP8_ENV) not in ("", "0")


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
    # the compute capabilities on which this project's tests ran the route; elsewhere the
    # automatic choice runs ``canary`` first (module docstring)
    verified_ccs: tuple = ()
    canary: Optional[Canary] = None


def no_vendor_route(reason: str) -> VendorRoute:
    """The vendor route of an op no vendor package ships: ``explain`` gives ``reason``."""
    return VendorRoute(None, no_vendor(reason))


def implementations(op: str, *, vendor: VendorRoute, triton: Callable,
                    reference: Callable, triton_planner: Optional[Callable] = None) -> Dispatcher:
    """The dispatcher of ``op`` (its name without ``sparse_mla::``), registered the same way by
    every family's ops.py: the family's ``vendor`` route with its own checks; its ``triton``
    implementation wherever the arguments' tensors allow Triton (:func:`triton_check_args`);
    its ``reference`` everywhere. All three take the arguments the op passes its dispatcher,
    and so does ``triton_planner`` (the attention ops: what the Triton route would launch)."""
    d = Dispatcher(op)
    d.register("vendor", vendor.run, vendor.check, vendor.automatic, vendor.verified_ccs,
               vendor.canary)
    d.register("triton", triton, triton_check_args, planner=triton_planner)
    d.register("reference", reference)
    return d

"""A whole DeepSeek-V4 attention step through the backends, next to its attention op alone.

  PYTHONPATH=$(bash tools/pyroot.sh) python3 -m sparse_mla.tools.bench_backend [--quick]

Decode rows: a uniform decode batch (b requests, s_q tokens each, 8,192 tokens of context), C4A
(top-k 512 at h64, 1,024 at h128) and C128A layers, FlashMLA's 584 B caches. Times are
CUDA-graph replays (GPU µs per step): "step" = write (q-norm + RoPE + SWA insert + compressed
insert) + index planning + attention; "attn" = the attention op alone on the step's index lists;
"layer" = the same with the step's shared plan (token → request, windows, C128A lists) already
built, what each further layer of the kind pays (``forward(planned=True)``); "glue" = step or
layer - attn (the target: <= 10 µs at b 256). "FlashMLA" runs the same step / layer with
FlashMLA (``sgl-flash-mla``, legacy SM90 kernels) as the attention kernel, when the wheel
imports, its layer timed the way vLLM runs it: vLLM's FlashMLA backends build one
``get_mla_metadata()`` per step and hand it to every layer (FlashMLA plans it at the first call:
the step column, the first layer of a kind, includes that planner), and hand FlashMLA their
index lists as they are (``VllmLikeFlashMLA``). "layer ratio" = that FlashMLA layer µs / ours:
the fair one. "planner/call" is the second column: the FlashMLA layer as the op's stateless
vendor route runs it, fresh metadata (its planner), the lists' sanitising launches and the
copy of FlashMLA's output into the op's on every call: what a vLLM user would not pay.
"max|diff|" = their outputs apart (the larger of the op's vendor route and the vLLM-like
layer). Prefill row: one 8,192-token chunk after 8,192 tokens of context (FlashMLA's prefill
has no scheduler metadata: one column). With the wheel installed our prefill op's automatic
route is FlashMLA's prefill kernel too, so those rows compare FlashMLA with FlashMLA (the glue
around it differs); the last line names the ops that ran.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from sparse_mla.backends.common import BatchDescription
from sparse_mla.backends.v4 import FlashMLABackend, LayerConfig, LayerKind
from sparse_mla.ops import cache_insert as ci
from sparse_mla.ops import flashmla_decode as fd
from sparse_mla.ops.common import formats
from sparse_mla.ops.flashmla_decode.vendor import pad_for_flash_mla
from sparse_mla.tools import harness

CTX = 8192


def _cos_sin(n, device):
    inv = 1.0 / 10000 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
    return torch.cat([ang.cos(), ang.sin()], -1).float().to(device)


def _fill(cache, n_slots, bs, device):
    """Random rows quantized into every slot (real data: no NaN bytes in the timing)."""
    step = 1 << 18
    for s in range(0, n_slots, step):
        n = min(step, n_slots - s)
        k = torch.randn(n, 512, device=device, dtype=torch.bfloat16)
        ci.quantize_insert_v4(k, cache, torch.arange(s, s + n, device=device), bs)


def _batch(cfg, lens, device, g):
    """Requests with contiguous blocks; ``lens``: (context, new tokens) per request, decodes
    (new <= 2) first."""
    R = len(lens)
    seq = [c + n for c, n in lens]
    qsl = [0]
    for _, n in lens:
        qsl.append(qsl[-1] + n)
    T = qsl[-1]
    swa_w = -(-max(seq) // cfg.swa_block_size)
    swa_table = torch.arange(R * swa_w, dtype=torch.int32).view(R, swa_w)
    pos = torch.cat([torch.arange(c, c + n) for c, n in lens])
    req = torch.repeat_interleave(torch.arange(R), torch.tensor([n for _, n in lens]))
    swa_slot = (swa_table[req, pos // cfg.swa_block_size].long() * cfg.swa_block_size
                + pos % cfg.swa_block_size)
    kind = cfg.kind
    comp_table = comp_slot = topk = None
    if kind.compressed:
        cbs, r = cfg.compressed_block_size, kind.ratio
        cw = -(-(max(seq) // r) // cbs) + 1
        comp_table = torch.arange(R * cw, dtype=torch.int32).view(R, cw)
        e = pos // r
        comp_slot = torch.where((pos + 1) % r == 0,
                                comp_table[req, e // cbs].long() * cbs + e % cbs,
                                torch.full_like(pos, -1))
    if kind.uses_topk:      # C4A; DeepSeek-V4.1's C1A / C2A (lab/tools/gpu_v41be.sh)
        # the indexer's output: min(entries, top-k) distinct ids, left-aligned, -1 after
        topk = torch.full((len(pos), cfg.topk), -1, dtype=torch.int32)
        for t, a in enumerate(((pos + 1) // kind.ratio).tolist()):
            ids = torch.randperm(a, generator=g)[:cfg.topk]
            topk[t, :len(ids)] = ids.to(torch.int32)
    n_dec = sum(1 for _, n in lens if n <= 2)
    td = qsl[n_dec]
    dev = device
    batch = BatchDescription(
        num_decodes=n_dec, num_decode_tokens=td, num_prefills=R - n_dec,
        num_prefill_tokens=T - td,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=dev), positions=pos.to(dev),
        swa_block_table=swa_table.to(dev), swa_slot_mapping=swa_slot.to(dev),
        compressed_block_table=None if comp_table is None else comp_table.to(dev),
        compressed_slot_mapping=None if comp_slot is None else comp_slot.to(dev),
        topk_indices=None if topk is None else topk.to(dev),
        max_decode_query_len=max([n for _, n in lens[:n_dec]], default=1),
        max_prefill_query_len=max([n for _, n in lens[n_dec:]], default=0),
        query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
        seq_lens_cpu=torch.tensor(seq, dtype=torch.int32))
    blocks = {"swa": R * swa_w}
    if comp_table is not None:
        blocks["compressed"] = comp_table.numel()
    return batch, blocks, T


def _case(kind, h, lens, device, vendor):
    g = torch.Generator().manual_seed(0)
    topk = 512 if h <= 64 else 1024
    T = sum(n for _, n in lens)
    cfg = LayerConfig(num_heads=h, kind=kind, max_num_tokens=T, max_num_reqs=len(lens),
                      max_model_len=2 * CTX + 64, topk=topk)
    batch, blocks, T = _batch(cfg, lens, device, g)
    ours = FlashMLABackend(cfg, device)
    caches = ours.allocate_caches(blocks)
    for name, c in caches.items():
        bs = cfg.swa_block_size if name == "swa" else cfg.compressed_block_size
        _fill(c, blocks[name] * bs, bs, device)
    q = torch.randn(T, h, 512, device=device, dtype=torch.bfloat16)
    kv = torch.randn(T, 512, device=device, dtype=torch.bfloat16)
    comp = torch.randn(T, 512, device=device, dtype=torch.bfloat16) if kind.compressed else None
    cos_sin = _cos_sin(2 * CTX + 64, device)
    sink = torch.randn(h, device=device)
    out = torch.empty(T, h, 512, device=device, dtype=torch.bfloat16)
    res = {}

    def step(be):
        return lambda: be.forward(q, kv, caches, batch, cos_sin, sink, out, comp)

    def layer(be):
        return lambda: be.forward(q, kv, caches, batch, cos_sin, sink, out, comp, planned=True)

    res["step"] = harness.time_graph(step(ours))
    ours.plan(batch, T)
    res["layer"] = harness.time_graph(layer(ours))
    # the attention op alone on the index lists the step just planned
    ours.forward(q, kv, caches, batch, cos_sin, sink, out, comp)
    res["choice"] = ours.explain()
    ref = out.clone()
    q_rot = ours.q_rot[:T]
    p = ours.planner
    Td = batch.num_decode_tokens
    if Td:
        extra = {}
        if kind.compressed:
            extra = dict(extra_k_cache=caches["compressed"],
                         extra_indices=p.compressed_indices[:Td].unsqueeze(1),
                         extra_topk_length=p.compressed_lens[:Td],
                         extra_block_size=cfg.compressed_block_size)

        def attn():
            fd.flashmla_sparse_decode(q_rot[:Td].unsqueeze(1), caches["swa"],
                                      p.swa_indices[:Td].unsqueeze(1), out[:Td].unsqueeze(1),
                                      ours.decode_lse[:Td], topk_length=p.swa_lens[:Td],
                                      attn_sink=sink, softmax_scale=cfg.softmax_scale,
                                      block_size=cfg.swa_block_size, **extra)
    else:
        n = T
        idx, lens_ = ours.combined[:n], ours.combined_lens[:n]
        ws = ours.workspace

        def attn():
            fd.flashmla_sparse_prefill(q_rot, ws[:ours.planner.prefill_chunks(batch)[0].M]
                                       .view(-1, 1, 512), idx.unsqueeze(1), out,
                                       ours.prefill_max_logits[:n], ours.prefill_lse[:n],
                                       cfg.softmax_scale, lens_, sink)
    res["attn"] = harness.time_graph(attn)
    res["write"] = harness.time_graph(lambda: ours._write(q, kv, caches, batch, cos_sin, comp))
    res["plan"] = harness.time_graph(lambda: ours.plan(batch, T))
    if not Td:
        res.update(_prefill_parts(ours, caches, batch))
    res["op"] = fd.flashmla_sparse_decode if Td else None
    if vendor:
        theirs = FlashMLABackend(cfg, device, attention_impl="vendor")
        res["vendor_step"] = harness.time_graph(step(theirs))
        theirs.plan(batch, T)
        fair = vllm_like(FlashMLABackend)(cfg, device, attention_impl="vendor",
                                          planner=theirs.planner)
        res["vendor_layer"] = harness.time_graph(layer(fair))
        res["vendor_layer_planner"] = harness.time_graph(layer(theirs)) if Td else None
        theirs.forward(q, kv, caches, batch, cos_sin, sink, out, comp)
        err = (out.float() - ref.float()).abs().max()
        if Td:      # the fair layer's own output, which stayed in FlashMLA's tensors
            fair.forward(q, kv, caches, batch, cos_sin, sink, out, comp)
            err = torch.maximum(err, (fair.decode_out().float() - ref[:Td].float()).abs().max())
        res["vendor_err"] = float(err)
    return res


def _prefill_parts(be, caches, batch):
    """GPU µs of the prefill's gathers and index combine (one chunk), as ``_prefill`` runs them."""
    from sparse_mla.ops import index_combine as ic
    cfg, p = be.config, be.planner
    ch = p.prefill_chunks(batch)[0]
    a, b = batch.num_decodes + ch.r0, batch.num_decodes + ch.r1
    kv = be.workspace[:(b - a) * ch.M].view(b - a, ch.M, 512)

    def gather():
        if cfg.kind.compressed:
            ci.gather_dequant(kv, caches["compressed"], p.entries[a:b], None,
                              batch.compressed_block_table[a:b], cfg.compressed_block_size, 0)
        ci.gather_dequant(kv, caches["swa"], batch.seq_lens[a:b], p.gather_lens[a:b],
                          batch.swa_block_table[a:b], cfg.swa_block_size, ch.N)
    n = ch.t1 - ch.t0

    def combine():
        ic.combine_topk_swa_indices(p.prefill_topk(batch, ch.t0, ch.t1),
                                    batch.query_start_loc[a:b + 1], batch.seq_lens[a:b],
                                    p.gather_lens[a:b], be.combined[:n], be.combined_lens[:n],
                                    cfg.window, cfg.kind.ratio, p.prefill_topk_width, ch.M, ch.N)
    return {"gather": harness.time_graph(gather), "combine": harness.time_graph(combine)}


class VllmLikeFlashMLA:
    """A FlashMLA-layout backend (``FlashMLABackend``; ``V41FlashMLABackend`` with 584 B records)
    whose decode rows call FlashMLA as vLLM's FlashMLA backends do, for the fair column:

    * one ``get_mla_metadata()`` object for every step it runs, as vLLM's metadata builder
      gives every layer of a step the one it built. FlashMLA plans it at its first decode call
      (the capture's warm-up call: the graph then holds the layer's kernels without the
      planner, as every layer after a step's first one runs); :meth:`new_step` drops it;
    * the planner's index lists and lengths reach FlashMLA as they are, as vLLM hands its own
      over (ids in the cache or -1, lengths within the width: no sanitising launches, which a
      stateless op owes arbitrary input); only a list whose width is not a multiple of 64
      (C128A's) is padded with -1 columns, as the op's route pads it;
    * FlashMLA's output stays where FlashMLA wrote it (``last``, heads padded), as vLLM's pure
      decode hands it on: no copy into ``out`` (2 × T × h × 1 KiB of traffic, 2-17 µs here).
      :meth:`decode_out` gives the real heads, for comparing with ours.

    Prefill rows run the backend's own path. It uses only FlashMLA's public API and the
    backend's ``_attend`` hook, so it never patches the op's vendor route; the op stays
    stateless, and it alone is what users call."""

    _meta = None
    last = None

    def new_step(self) -> None:
        self._meta = None

    def _attend(self, q_rot, caches, batch, attn_sink, out):
        if any(r is not formats.V4 for r in self.records.values()):
            raise ValueError("FlashMLA's SM90 decode reads the 584 B record only")
        if batch.num_decode_tokens:
            self.planner.c4a_decode(batch)
            self._flash_mla_decode(q_rot, caches, batch, attn_sink)
        if batch.num_prefill_tokens:
            self._prefill(q_rot, caches, batch, attn_sink, out)

    def _flash_mla_decode(self, q_rot, caches, batch, attn_sink):
        import flash_mla
        cfg, p, Td = self.config, self.planner, batch.num_decode_tokens
        if self._meta is None:
            self._meta = flash_mla.get_mla_metadata()[0]
        qp, sink = pad_for_flash_mla(q_rot[:Td].unsqueeze(1), attn_sink, head_dim=2)
        kwargs = dict(softmax_scale=cfg.softmax_scale, causal=False, is_fp8_kvcache=True,
                      indices=_width64(p.swa_indices[:Td]), attn_sink=sink,
                      topk_length=p.swa_lens[:Td], use_legacy=True, kv_format="V4")
        if cfg.kind.compressed:
            kwargs.update(extra_k_cache=_paged(caches["compressed"], cfg.compressed_block_size),
                          extra_indices_in_kvcache=_width64(p.compressed_indices[:Td]),
                          extra_topk_length=p.compressed_lens[:Td])
        self.last = flash_mla.flash_mla_with_kvcache(
            qp, _paged(caches["swa"], cfg.swa_block_size), None, None, 512, self._meta,
            **kwargs)

    def decode_out(self):
        """The last step's decode rows ``[Td, h, 512]`` as FlashMLA left them (real heads)."""
        return self.last[0][:, 0, :self.config.num_heads]


def vllm_like(backend_cls):
    """``backend_cls`` with its decode rows run as :class:`VllmLikeFlashMLA` runs them."""
    return type(f"VllmLike{backend_cls.__name__}", (VllmLikeFlashMLA, backend_cls), {})


def _width64(idx):
    """``[Td, K]`` as FlashMLA's ``[Td, 1, K']`` list, ``K'`` a multiple of 64 (-1 columns)."""
    pad = (-idx.shape[-1]) % 64
    return (F.pad(idx, (0, pad), value=-1) if pad else idx).unsqueeze(1)


def _paged(cache, bs):
    """FlashMLA's ``[num_blocks, block_size, 1, 584]`` view of a backend's cache (a page may be
    longer than its records: the 584 B layout rounds pages up to a multiple of 576)."""
    raw = cache.view(torch.uint8)
    nbytes = formats.V4.bytes_per_token
    return raw.as_strided((cache.shape[0], bs, 1, nbytes), (raw.stride(0), nbytes, nbytes, 1),
                          raw.storage_offset())


def _vendor_available():
    try:
        import flash_mla  # noqa: F401
        return torch.cuda.get_device_capability() == (9, 0)
    except ImportError:
        return False


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="b 64 only, no prefill")
    ap.add_argument("--batches", type=int, nargs="+", help="decode batch sizes (default 1 64 "
                    "256; --quick: 64)")
    ap.add_argument("--no-prefill", action="store_true", help="no prefill rows")
    ap.add_argument("--kinds", nargs="+", choices=("C4A", "C128A"), default=("C4A", "C128A"),
                    help="decode layer kinds (default both)")
    ap.add_argument("--heads", type=int, nargs="+", default=(64, 128),
                    help="head counts (default 64 128)")
    ap.add_argument("--s-q", type=int, nargs="+", default=(1, 2),
                    help="decode tokens per request (default 1 2)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_backend needs a CUDA GPU")
    dev = "cuda"
    vendor = _vendor_available()
    print(f"# {harness.device_name(dev)}; FlashMLA wheel: {'yes' if vendor else 'no'}")
    rows = []
    batches = args.batches or ((64,) if args.quick else (1, 64, 256))
    for kind in (LayerKind[k] for k in args.kinds):
        for h in args.heads:
            for b in batches:
                for s_q in args.s_q:
                    r = _case(kind, h, [(CTX, s_q)] * b, dev, vendor)
                    rows.append((f"{kind.name} h{h} b{b} s_q{s_q}", r))
                    _print_row(*rows[-1])
    if not (args.quick or args.no_prefill):
        for kind in (LayerKind.C4A, LayerKind.C128A):
            r = _case(kind, 64, [(CTX, 8192)], dev, vendor)
            rows.append((f"{kind.name} h64 prefill 8192 after {CTX}", r))
            _print_row(*rows[-1])
    ran = rows[0][1]["choice"]
    print("# ops ran (ours, first row): " + ", ".join(f"{op}={c.impl}" for op, c in ran.items()
                                                      if c))


def _us(x):
    return "-" if x is None else f"{x * 1e6:.1f}"


def _print_row(name, r):
    def minus(a, b):
        return None if a is None or b is None else a - b
    def ratio(theirs):
        return "-" if theirs is None or r["layer"] is None else f"{theirs / r['layer']:.2f}"
    vs, vl, vp = r.get("vendor_step"), r.get("vendor_layer"), r.get("vendor_layer_planner")
    print(f"{name:30s} step {_us(r['step']):>7s}  layer {_us(r['layer']):>7s}  "
          f"attn {_us(r['attn']):>7s}  glue step/layer {_us(minus(r['step'], r['attn'])):>5s}"
          f"/{_us(minus(r['layer'], r['attn'])):>5s}  FlashMLA step/layer {_us(vs):>7s}/"
          f"{_us(vl):>7s}  layer ratio {ratio(vl)}  FlashMLA layer planner/call "
          f"{_us(vp):>7s} (ratio {ratio(vp)})  max|diff| {r.get('vendor_err', '-')}",
          flush=True)
    parts = [f"{k} {_us(r[k])}" for k in ("write", "plan", "gather", "combine")
             if k in r]
    print(f"{'':30s} parts µs: " + ", ".join(parts), flush=True)


if __name__ == "__main__":
    main()

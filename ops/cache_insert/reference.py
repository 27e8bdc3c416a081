"""PyTorch reference for the cache-insert family (docs/semantics.md §2, §3): the oracle and
the CPU kernel.

Arguments arrive validated (see ops.py). Writes go through byte views built from each cache's
``stride(0)``, so padded pages are addressed exactly as the kernels address them.
"""
from __future__ import annotations

import torch

from sparse_mla.ops.common import checks, formats, quant


def _valid_slots(slot_mapping: torch.Tensor, n: int):
    """(token ids, slots) of the first ``n`` tokens whose slot is >= 0."""
    slots = slot_mapping[:n].long()
    keep = (slots >= 0).nonzero().flatten()
    return keep, slots[keep]


def _write_rows(cache, fmt, block_size, slots, parts):
    """Write per-token byte ``parts`` [(byte offset fn, rows [n, w] uint8), ...] to ``slots``."""
    blocks = checks.block_bytes_view(cache, fmt, block_size)
    b, o = slots // block_size, slots % block_size
    for addr_fn, rows in parts:
        cols = addr_fn(block_size, o).unsqueeze(1) + torch.arange(
            rows.shape[1], device=rows.device)
        blocks[b.unsqueeze(1), cols] = rows


def quantize_insert_v4(k, k_cache, slot_mapping, block_size):
    fmt = formats.V4
    tok, slots = _valid_slots(slot_mapping, slot_mapping.shape[0])
    data, scales = quant.quantize_v4(k[tok])
    _write_rows(k_cache, fmt, block_size, slots,
                [(fmt.token_data_addr, data), (fmt.token_scale_addr, scales)])


def quantize_insert_v32(kv_c, k_pe, kv_cache, slot_mapping, block_size, scale_format):
    fmt = formats.V32
    tok, slots = _valid_slots(slot_mapping, slot_mapping.shape[0])
    rec = quant.quantize_v32(kv_c[tok], k_pe[tok], scale_format)
    _write_rows(kv_cache, fmt, block_size, slots, [(fmt.token_data_addr, rec)])


def quantize_insert_v32_nope(kv_c, kv_cache, slot_mapping, block_size, scale_format):
    # GLM-5.3's k_pe is exactly zero (vLLM pads kv_a_proj with zero rows): the V3.2 record
    # with +0.0 RoPE bytes.
    k_pe = torch.zeros(kv_c.shape[0], 64, dtype=torch.bfloat16, device=kv_c.device)
    quantize_insert_v32(kv_c, k_pe, kv_cache, slot_mapping, block_size, scale_format)


def rotate_q(q, positions, cos_sin_cache, eps, apply_q_norm):
    """The q path of docs/semantics.md §3.1: optional weightless RMSNorm, forward GPT-J RoPE;
    fp32 [N, H, 512]."""
    qf = quant.rms_norm_no_weight(q, eps) if apply_q_norm else q.float()
    return quant.rope_gptj(qf, cos_sin_cache[positions.long()].unsqueeze(1))


def write_q_out(q_out, q_rot):
    """Heads beyond q's are the zero padding FlashMLA's 64/128-head kernels want."""
    h = q_rot.shape[1]
    q_out[:, :h] = q_rot.to(q_out.dtype)
    q_out[:, h:] = 0


def fused_insert_v4(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, q_out, eps,
                    block_size, apply_q_norm):
    write_q_out(q_out, rotate_q(q, positions, cos_sin_cache, eps, apply_q_norm))
    tok, slots = _valid_slots(slot_mapping, slot_mapping.shape[0])
    kv_rot = quant.rope_gptj(kv[tok].float(), cos_sin_cache[positions[tok].long()])
    data, scales = quant.quantize_v4(kv_rot)
    _write_rows(k_cache, formats.V4, block_size, slots,
                [(formats.V4.token_data_addr, data), (formats.V4.token_scale_addr, scales)])


def fused_insert_plain(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, q_out,
                       kv_scale, q_scale_inv, eps, apply_q_norm):
    q_rot = rotate_q(q, positions, cos_sin_cache, eps, apply_q_norm)
    if q_out.dtype == torch.bfloat16:
        q_out.copy_(q_rot.to(torch.bfloat16))
    else:
        q_out.copy_(quant.e4m3(q_rot * q_scale_inv.float().reshape(())).view(q_out.dtype))
    tok, slots = _valid_slots(slot_mapping, slot_mapping.shape[0])
    kv_rot = quant.rope_gptj(kv[tok].float(), cos_sin_cache[positions[tok].long()])
    if k_cache.dtype == torch.bfloat16:
        rows = kv_rot.to(torch.bfloat16)
    else:
        # vLLM's kernel multiplies by the fp32 reciprocal (not x / scale) and skips the bf16
        # round trip here; with non-power-of-two scales the two differ in the last bit.
        inv = torch.reciprocal(kv_scale.float().reshape(()))
        rows = quant.e4m3(kv_rot * inv).view(k_cache.dtype)
    bs = k_cache.shape[1]
    k_cache[slots // bs, slots % bs] = rows


def insert_plain(k, k_cache, slot_mapping, kv_scale):
    """SPEC §3.3 item 4: a finished row stored as bf16 or as e4m3 of ``k * (1 / kv_scale)``."""
    tok, slots = _valid_slots(slot_mapping, slot_mapping.shape[0])
    rows = k[tok].float()
    if k_cache.dtype == torch.bfloat16:
        out = rows.to(torch.bfloat16)
    else:
        out = quant.e4m3(rows * torch.reciprocal(kv_scale.float().reshape(()))).view(k_cache.dtype)
    bs = k_cache.shape[1]
    k_cache[slots // bs, slots % bs] = out


def fused_insert_v41(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, q_out,
                     block_size, fmt_name):
    """docs/semantics.md §12: q RoPE'd (no norm) into ``q_out``; kv RoPE'd at its position in
    fp32, rounded to bf16 and back (as vLLM's CUDA SWA writer does before the absmax), then
    stored as the 528 B record (either layout) or the V4 record (584 B, which rounds the same)."""
    write_q_out(q_out, rotate_q(q, positions, cos_sin_cache, 0.0, False))
    tok, slots = _valid_slots(slot_mapping, slot_mapping.shape[0])
    kv_rot = quant.rope_gptj(kv[tok].float(), cos_sin_cache[positions[tok].long()])
    kv_rot = kv_rot.to(torch.bfloat16).float()
    _write_record(k_cache, fmt_name, block_size, slots, kv_rot)


def _write_record(cache, fmt_name, block_size, slots, rows):
    fmt = formats.get_format(fmt_name)
    data, scales = quant.quantize_record(rows, fmt_name)
    _write_rows(cache, fmt, block_size, slots,
                [(fmt.token_data_addr, data), (fmt.token_scale_addr, scales)])


def compressed_insert_v41(k, k_cache, slot_mapping, positions, cos_sin_cache, ratio, block_size,
                          fmt_name, kv_scale):
    """docs/semantics.md §12: token t is written only when (pos + 1) % ratio == 0, rotated at
    (pos // ratio) * ratio in fp32; paged records quantize that row directly (the V4 record
    stores its RoPE dims as bf16), plain caches store it rounded to bf16 (e4m3 of the bf16 row
    times the fp32 reciprocal of ``kv_scale`` for an fp8 cache)."""
    n = slot_mapping.shape[0]
    slots = slot_mapping.long()
    pos = positions[:n].long()
    keep = ((slots >= 0) & ((pos + 1) % ratio == 0)).nonzero().flatten()
    slots = slots[keep]
    rot = quant.rope_gptj(k[keep].float(), cos_sin_cache[(pos[keep] // ratio) * ratio])
    if fmt_name in formats.PAGED_FORMATS:
        _write_record(k_cache, fmt_name, block_size, slots, rot)
        return
    rows = rot.to(torch.bfloat16)
    if k_cache.dtype != torch.bfloat16:
        inv = torch.reciprocal(kv_scale.float().reshape(()))
        rows = quant.e4m3(rows.float() * inv).view(k_cache.dtype)
    bs = k_cache.shape[1]
    k_cache[slots // bs, slots % bs] = rows


def gather_dequant(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset,
                   fmt_name):
    """docs/semantics.md §3.4: request r's positions [seq_len - gather_len, seq_len) go to
    out[r, offset + i]."""
    fmt = formats.get_format(fmt_name)
    blocks = checks.block_bytes_view(k_cache, fmt, block_size)
    max_tokens = out.shape[1]
    nb = k_cache.shape[0]
    for r in range(seq_lens.shape[0]):
        seq_len = int(seq_lens[r])
        glen = seq_len if gather_lens is None else int(gather_lens[r])
        i = torch.arange(glen, device=out.device)
        pos = seq_len - glen + i
        dst = offset + i
        blk_col = pos // block_size
        in_table = (blk_col < block_table.shape[1]) & (pos >= 0)
        blk = torch.full_like(pos, -1)
        blk[in_table] = block_table[r, blk_col[in_table]].long()
        keep = (blk >= 0) & (blk < nb) & (dst >= 0) & (dst < max_tokens)
        blk, o, dst = blk[keep], (pos % block_size)[keep], dst[keep]
        if fmt.codec != "v32":
            data_cols = (fmt.token_data_addr(block_size, o).unsqueeze(1)
                         + torch.arange(_record_data_bytes(fmt), device=o.device))
            scale_cols = (fmt.token_scale_addr(block_size, o).unsqueeze(1)
                          + torch.arange(fmt.scale_bytes, device=o.device))
            rows = quant.dequantize_record(blocks[blk.unsqueeze(1), data_cols],
                                           blocks[blk.unsqueeze(1), scale_cols], fmt.name)
        else:
            cols = (fmt.token_data_addr(block_size, o).unsqueeze(1)
                    + torch.arange(fmt.token_data_bytes, device=o.device))
            rows = quant.dequantize_v32(blocks[blk.unsqueeze(1), cols])
        out[r, dst] = rows


def _record_data_bytes(fmt) -> int:
    """Bytes quant.dequantize_record takes as a token's data: the V4 record's bf16 RoPE dims
    sit after its e4m3 bytes, inside the data record."""
    return fmt.token_data_bytes if fmt.scale_in_tail else fmt.data_bytes

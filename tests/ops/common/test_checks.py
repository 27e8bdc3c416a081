"""ops/common/checks.py: the argument and value checks every op family calls, and
unit_stride, what the ops hand kernels that take lists by base pointer."""
import re

import pytest
import torch

from sparse_mla.ops.common import checks
from sparse_mla.ops.common.checks import unit_stride
from sparse_mla.tests.helpers import gapped


def test_unit_stride_copies_only_views_with_gaps():
    rows = torch.arange(24, dtype=torch.int32).view(4, 6)
    assert unit_stride(None) is None
    for same in (rows, rows[1:], rows[:, 2:5], rows[:, :1], torch.tensor(3.0)):
        assert unit_stride(same) is same          # unit last stride (or nothing to stride)
    for view in (rows[:, ::2], rows[:, 0], gapped(rows, -7)):
        got = unit_stride(view)
        assert got.stride(-1) == 1 and torch.equal(got, view)
        assert got.data_ptr() != view.data_ptr()


def _raises(fn, *args, match, exc=ValueError, **kwargs):
    with pytest.raises(exc, match=re.escape(match)):
        fn(*args, **kwargs)


def test_value_checks_name_the_argument_the_bound_and_the_first_entry_outside():
    t = torch.tensor([3, 0, -2, -5], dtype=torch.int32)
    _raises(checks.expect_values_in, "seq_lens", t, 0, entry="request",
            match="seq_lens must be >= 0; request 2 has -2")
    _raises(checks.expect_values_in, "lens", t, -5, 2, " (the list's width)", "row",
            match="lens must be in [-5, 2] (the list's width); row 0 has 3")
    checks.expect_values_in("lens", t, -5, 3)
    _raises(checks.expect_indices, "positions", t.abs(), 5, " (rows of cos_sin_cache)", "token",
            match="positions must be in [0, 5) (rows of cos_sin_cache); token 3 has 5")
    checks.expect_indices("positions", t.abs(), 6)
    checks.expect_values_in("empty", t[:0], 0, 0)


def test_query_starts_and_seq_lens():
    starts = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    assert checks.expect_query_starts("query_start_loc", starts).tolist() == [2, 0, 3]
    _raises(checks.expect_query_starts, "cum_seq_lens_q", torch.tensor([0, 3, 1]), "q_len",
            match="cum_seq_lens_q must be non-decreasing; request 1 has q_len -2")
    _raises(checks.expect_query_starts, "query_start_loc", starts - 1, lo=0,
            match="query_start_loc[0] must be >= 0, got -1")
    _raises(checks.expect_query_starts, "cum_seq_lens_q", starts, hi=4, note=" (query rows)",
            match="cum_seq_lens_q[-1] must be <= 4 (query rows), got 5")
    checks.expect_seq_lens_cover(torch.tensor([2, 0, 3]), torch.tensor([2, 0, 3]))
    _raises(checks.expect_seq_lens_cover, torch.tensor([2, 0, 2]), torch.tensor([2, 0, 3]),
            "q_len", " (why)",
            match="seq_lens must be >= the request's q_len (why): request 2 has seq_len 2 < "
                  "q_len 3")


def test_tensor_forms():
    rows = torch.zeros(3, 8, dtype=torch.int32)
    checks.expect_tensor("rows", rows, torch.int32, (3, None))
    _raises(checks.expect_tensor, "rows", rows[:, ::2], torch.int32, (3, 4),
            match="rows must have a contiguous last dimension")
    _raises(checks.expect_tensor, "rows", rows, torch.int32, (4, 8),
            match="rows must have shape [4, 8], got [3, 8]")
    _raises(checks.expect_tensor, "rows", rows, torch.int64, (3, 8), exc=TypeError,
            match="rows must have dtype int64, got int32")
    v = torch.zeros(4, dtype=torch.int32)
    checks.expect_vector("v", v, torch.int32, at_least=4, at_most=4)
    _raises(checks.expect_vector, "v", v, torch.int32, at_least=5,
            match="v must be 1-D with at least 5 entries, got shape [4]")
    _raises(checks.expect_vector, "slot_mapping", v, torch.int32, at_most=3,
            note=" (one per token)",
            match="slot_mapping must be 1-D with at most 3 entries (one per token), got shape [4]")
    _raises(checks.expect_vector, "v", rows, torch.int32, match="v must be 1-D, got shape [3, 8]")
    _raises(checks.expect_block_table, "block_table", rows, 4,
            match="block_table must have shape [>= 4, max_blocks], got [3, 8]")
    checks.expect_block_table("block_table", rows, 3)
    checks.expect_scalar_tensor("kv_scale", torch.tensor([2.0]))
    _raises(checks.expect_scalar_tensor, "kv_scale", torch.ones(2),
            match="kv_scale must hold one scalar (one fp32 element), got shape [2]")
    _raises(checks.expect_scalar_tensor, "kv_scale", torch.ones(1, dtype=torch.float64),
            exc=TypeError, match="kv_scale must have dtype float32")


def test_active_slots_and_request_tables():
    idx = torch.tensor([[0, 9, -1], [9, 1, 2]], dtype=torch.int32)
    checks.expect_active_slots("idx", idx, torch.tensor([1, 0]), 4)   # 9s are not active
    _raises(checks.expect_active_slots, "idx", idx, torch.tensor([1, 1]), 4,
            match="idx[1, 0] = 9 is not a slot in [0, 4)")
    _raises(checks.expect_active_slots, "idx", idx, torch.tensor([2, 0]), 4, "row < {capacity}",
            match="idx[0, 1] = 9 is not row < 4")
    tokens, req = torch.tensor([0, 1, 2]), torch.tensor([0, 0, 1])
    qsl = torch.tensor([0, 2, 3])
    checks.expect_tokens_in_requests("token_to_req", tokens, req, qsl, 2)
    _raises(checks.expect_request_ids, "token_to_req", tokens, req, 1,
            match="token_to_req[2] = 1 is not a request id in [0, 1) (block_table rows)")
    _raises(checks.expect_tokens_in_requests, "token_to_req", tokens, torch.tensor([0, 1, 1]),
            qsl, 2, match="token 1 is mapped by token_to_req to request 1, whose tokens are "
                          "[2, 3)")
    table = torch.zeros(2, 3, dtype=torch.int32)
    checks.expect_table_covers("bt", table, req, torch.tensor([5, -1, 0]), 2, "position")
    _raises(checks.expect_table_covers, "bt", table, req, torch.tensor([5, 6, 0]), 2,
            "position",
            match="bt has 3 blocks per request, too few for position 6 of request 0 (block 3, "
                  "block_size 2)")

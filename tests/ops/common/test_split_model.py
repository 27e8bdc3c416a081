"""The split-count cost model of the sparse-attention launch (pure Python, no kernel)."""
import pytest

from sparse_mla.ops.common.sparse_attention_triton import choose_splits


@pytest.mark.parametrize("units,tiles,want", [
    (74, 10, 5),     # one split would leave 58 of 132 SMs idle
    (64, 10, 2),     # 128 programs: one wave
    (128, 10, 1),    # already one full wave
    (2, 10, 10),     # tiny batch: one tile per program
    (148, 18, 3),
])
def test_choose_splits_examples(units, tiles, want):
    assert choose_splits(units, tiles, 132, 1) == want      # the model at overhead 1


@pytest.mark.parametrize("units", [1, 3, 64, 74, 132, 133, 256, 4096])
@pytest.mark.parametrize("tiles", [1, 2, 9, 18, 32])
def test_choose_splits_is_the_cheapest_and_in_range(units, tiles):
    def cost(s):
        return -(-units * s // 132) * (-(-tiles // s) + 1)

    got = choose_splits(units, tiles, 132, 1)
    assert 1 <= got <= tiles
    assert cost(got) == min(cost(s) for s in range(1, tiles + 1))
    assert all(cost(s) > cost(got) for s in range(1, got))   # ties go to fewer splits

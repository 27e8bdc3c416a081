"""The DeepSeek-V4.1 records (docs/semantics.md §12) of ops/common/quant.py against bytes
worked out by hand: 528 B MXFP8 (e4m3, one UE8M0 scale per 32 dims) and 288 B NVFP4 (e2m1
pairs, one e4m3 scale per 16 dims), and their page layout."""
import pytest
import torch

from sparse_mla.ops.common import formats, quant

# the fp32 number after 14
NEXT_14 = torch.nextafter(torch.tensor(14.0), torch.tensor(15.0)).item()


def _mxfp8_row():
    """A 512-dim row whose 16 tiles of 32 each exercise one rule (see the test)."""
    x = torch.zeros(512, dtype=torch.float64)
    x[0:32] = 1.0                                   # tile 0
    # tile 1: zeros
    x[64:96] = 3584.0                               # tile 2: 448 * 8
    t3 = [448.0, 17.0, 19.0, 31.0, 248.0, 3 * 2.0 ** -10, 2.0 ** -10, -2.0 ** -10,
          5 * 2.0 ** -11, 15 * 2.0 ** -10, -300.0]
    x[96:96 + len(t3)] = torch.tensor(t3, dtype=torch.float64)
    x[128] = 5e-5                                   # tile 4: below the amax floor
    x[160] = 14.0                                   # tile 5: amax = 448 * 2^-5
    x[192] = NEXT_14                                # tile 6: just above it
    x[224] = 2.0 ** 100                             # tile 7
    x[256] = float(torch.finfo(torch.float32).max)  # tile 8
    return x.float()


def test_mxfp8_hand_bytes():
    data, scales = quant.quantize_v41(_mxfp8_row().unsqueeze(0))
    data, scales = data[0], scales[0]
    # e = ceil(log2(amax / 448)); byte = e + 127. Tiles 9..15 are zero rows like tile 1.
    assert scales.tolist() == [119, 105, 130, 127, 105, 122, 123, 219, 247] + [105] * 7
    assert data[0:32].tolist() == [0x78] * 32           # 1 * 2^8 = 256
    assert data[32:64].tolist() == [0] * 32
    assert data[64:96].tolist() == [0x7E] * 32          # 448
    # e = 0: the values themselves, round to nearest even:
    # 448; 17 -> 16 (tie, even mantissa); 19 -> 20 (tie); 31 -> 32 (tie, carries into the
    # exponent); 248 -> 256 (tie, carry); subnormals: 1.5 * 2^-9 -> 2 * 2^-9, 0.5 * 2^-9 -> 0,
    # -0.5 * 2^-9 -> -0, 1.25 * 2^-9 -> 2^-9, 7.5 * 2^-9 -> 2^-6 (the smallest normal, tie);
    # -300 -> -288
    assert data[96:108].tolist() == [0x7E, 0x58, 0x5A, 0x60, 0x78, 0x02, 0x00, 0x80, 0x01,
                                     0x08, 0xF9, 0x00]
    assert data[128].item() == 0x75                     # 5e-5 * 2^22 = 209.7 -> 208
    assert data[160].item() == 0x7E                     # 14 * 2^5 = 448
    assert data[192].item() == 0x76                     # just above 14: e = -4, 224.00002 -> 224
    assert data[224].item() == 0x78                     # 2^100 * 2^-92 = 256
    assert data[256].item() == 0x78                     # (2 - 2^-23) * 2^7 -> 256


def test_mxfp8_dequantizes_to_the_scaled_e4m3_values():
    data, scales = quant.quantize_v41(_mxfp8_row().unsqueeze(0))
    y = quant.dequantize_v41(data, scales)[0].double()
    assert y[0].item() == 1.0
    assert y[64].item() == 3584.0
    assert y[97:100].tolist() == [16.0, 20.0, 32.0]
    assert y[101].item() == 2.0 ** -8
    assert y[128].item() == 208 * 2.0 ** -22
    assert y[192].item() == 14.0
    assert y[32:64].abs().sum().item() == 0


def _nvfp4_row():
    x = torch.zeros(512, dtype=torch.float64)
    x[0:16] = torch.tensor([6, 3, -1.5, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 0.5, 1, 2, 4, -6,
                            0], dtype=torch.float64)
    x[17] = -0.0                                    # group 1: zeros (one negative)
    x[32:35] = torch.tensor([11.625, 5.0, 0.5])     # group 2: scale 1.9375 -> 2 (carry)
    x[48:50] = torch.tensor([6.375, -6.2])          # group 3: scale 1.0625 -> 1 (tie, even)
    x[64:66] = torch.tensor([6000.0, -1000.0])      # group 4: scale clamped to 448
    x[80:83] = torch.tensor([0.006, 0.004, -0.001])  # group 5: scale clamped up to 2^-9
    s = 3 * 2.0 ** -9                               # group 6: a subnormal e4m3 scale
    x[96:102] = torch.tensor([6 * s, 4.5 * s, 0.75 * s, 1.25 * s, 2.5 * s, -5 * s])
    return x.float()


def test_nvfp4_hand_bytes():
    data, scales = quant.quantize_v41_fp4(_nvfp4_row().unsqueeze(0))
    data, scales = data[0], scales[0]
    # e4m3 scales: 1.0, 2^-9 (amax 0), 2.0, 1.0, 448, 2^-9, 3 * 2^-9, then 2^-9 for zeros
    assert scales.tolist() == [0x38, 0x01, 0x40, 0x38, 0x7E, 0x01, 0x03] + [0x01] * 25
    # codes: 6->7, 3->5, -1.5->0xB | 0.25->0 (tie to even), 0.75->2 (tie), 1.25->2 (tie),
    # 1.75->4 (tie), 2.5->4 (tie), 3.5->6 (tie), 5->6 (tie), 0.5->1, 1->2, 2->4, 4->6,
    # -6->0xF, 0->0; low nibble the even dim
    assert data[0:8].tolist() == [0x57, 0x0B, 0x22, 0x44, 0x66, 0x21, 0x64, 0x0F]
    assert data[8:16].tolist() == [0x80] + [0] * 7     # -0 keeps its sign bit
    # /2: 5.8125 -> 6, 2.5 -> 2 (tie), 0.25 -> 0 (tie)
    assert data[16:18].tolist() == [0x47, 0x00]
    assert data[24].item() == 0xF7                      # 6.375 -> 6 (saturates), -6.2 -> -6
    assert data[32].item() == 0xC7                      # 13.4 -> 6, -2.23 -> -2
    # /2^-9: 3.072 -> 3, 2.048 -> 2 | -0.512 -> -0.5
    assert data[40:42].tolist() == [0x45, 0x09]
    # /(3 * 2^-9), divided exactly: 6, 4.5 -> 4, 0.75 -> 1 (tie), 1.25 -> 1 (tie),
    # 2.5 -> 2 (tie), -5 -> -4 (tie)
    assert data[48:51].tolist() == [0x67, 0x22, 0xE4]


def test_nvfp4_dequantizes_to_code_times_scale():
    data, scales = quant.quantize_v41_fp4(_nvfp4_row().unsqueeze(0))
    y = quant.dequantize_v41_fp4(data, scales)[0].double()
    assert y[0:16].tolist() == [6, 3, -1.5, 0, 1, 1, 2, 2, 4, 4, 0.5, 1, 2, 4, -6, 0]
    assert y[32:35].tolist() == [12.0, 4.0, 0.0]
    assert y[64:66].tolist() == [6 * 448.0, -2 * 448.0]
    assert y[96:102].tolist() == [x * 3 * 2.0 ** -9 for x in (6, 4, 1, 1, 2, -4)]


def test_e2m1_codes_every_magnitude_and_midpoint():
    vals = torch.tensor(quant.E2M1_VALUES)
    assert quant.e2m1_codes(vals).tolist() == list(range(8))
    assert quant.e2m1_codes(-vals[1:]).tolist() == list(range(9, 16))
    mids = (vals[:-1] + vals[1:]) / 2              # 0.25 0.75 1.25 1.75 2.5 3.5 5
    assert quant.e2m1_codes(mids).tolist() == [0, 2, 2, 4, 4, 6, 6]
    up = torch.nextafter(mids, torch.full_like(mids, 10.0))
    assert quant.e2m1_codes(up).tolist() == list(range(1, 8))
    assert quant.e2m1_codes(torch.tensor([7.0, 1e30, -9.0])).tolist() == [7, 7, 15]


@pytest.mark.parametrize("fmt,bs,page", [("v41", 32, 16896), ("v41", 64, 33792),
                                         ("v41", 3, 2048), ("v41_fp4", 64, 18432),
                                         ("v41_fp4", 5, 1536)])
def test_page_bytes_round_up_to_512(fmt, bs, page):
    f = formats.get_format(fmt)
    assert f.page_bytes(bs) == page
    assert f.token_data_addr(bs, 2) == 2 * f.token_data_bytes
    assert f.token_scale_addr(bs, 2) == bs * f.token_data_bytes + 2 * f.scale_offset
    assert f.token_data_bytes + f.scale_offset == f.bytes_per_token


def test_alloc_padded_pages_keep_block_stride():
    cache = formats.alloc_paged_cache("v41_fp4", 3, 64, page_bytes=18432 + 16896)
    assert cache.shape == (3, 64, 288) and cache.stride(0) == 18432 + 16896

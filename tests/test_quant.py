import pytest
import torch

from kernels.pages import pack_2bit, unpack_2bit
from kitty_core.quant import dequantize_keys, dequantize_values, key_codes, quantize_keys, quantize_values


def test_pack_unpack_round_trip_is_bit_exact():
    codes = torch.randint(0, 4, (3, 5, 64), dtype=torch.uint8)
    packed = pack_2bit(codes)
    assert packed.shape == (3, 5, 16) and packed.dtype == torch.uint8
    assert torch.equal(unpack_2bit(packed), codes)
    # bit order: element j of n at bits 2 * (j // (n/4)) of byte j % (n/4)
    assert pack_2bit(torch.tensor([1, 2, 3, 0], dtype=torch.uint8)).item() == 1 | 2 << 2 | 3 << 4
    row = torch.zeros(8, dtype=torch.uint8)
    row[5] = 3  # plane 2 (bits 4-5) of byte 1
    assert pack_2bit(row).tolist() == [0, 3 << 4]
    with pytest.raises(ValueError):
        pack_2bit(torch.zeros(6, dtype=torch.uint8))


def _keys_with_outliers(n=2, h=3, g=32, d=16, outliers=(3, 11)):
    torch.manual_seed(0)
    x = torch.randn(n, h, g, d)
    x[..., list(outliers)] *= 20
    return x


@pytest.mark.parametrize("n_boost", [0, 2, 4, 16])
def test_key_pages_layout_and_error_bound(n_boost):
    x = _keys_with_outliers()
    p = quantize_keys(x, n_boost)
    n, h, g, d = x.shape
    assert p.dense.shape == (n, h, d, g // 4) and p.high.shape == (n, h, n_boost, g // 4)
    assert p.boost_ch.shape == (n, h, n_boost) and p.boost_ch.dtype == torch.uint8
    assert p.scale.dtype == torch.float16 and p.scale.shape == (n, h, d)
    # the boost index lists distinct channels, ascending: row r of `high` is channel boost_ch[r]
    assert (p.boost_ch[..., 1:] > p.boost_ch[..., :-1]).all()
    boosted = torch.zeros((n, h, d), dtype=torch.bool).scatter_(-1, p.boost_ch.long(), True)
    assert boosted.sum(-1).eq(n_boost).all()
    codes = key_codes(p)
    if n_boost:  # the high plane's rows are the high bits of the listed channels' codes
        rows = codes.gather(-2, p.boost_ch.long().unsqueeze(-1).expand(n, h, n_boost, g))
        assert torch.equal(unpack_2bit(p.high), rows >> 2)
    assert codes.max() <= 15 and (codes[~boosted.unsqueeze(-1).expand_as(codes)] <= 3).all()
    err = (dequantize_keys(p) - x).abs().transpose(-1, -2)  # [N, H, D, G]
    bound = p.scale.float().unsqueeze(-1) / 2 + 1e-3 * x.abs().amax()  # half a step, plus fp16 rounding of zero
    assert (err <= bound).all()


def test_magnitude_rule_boosts_the_outlier_channels():
    p = quantize_keys(_keys_with_outliers(outliers=(3, 11)), 2)
    assert (p.boost_ch.long() == torch.tensor([3, 11])).all()


def test_boosting_lowers_the_error():
    x = _keys_with_outliers()
    errs = [(dequantize_keys(quantize_keys(x, b)) - x).pow(2).mean().item() for b in (0, 2, 4, 16)]
    assert errs[0] > errs[1] > errs[2] > errs[3]


def test_random_rule_is_seeded_and_differs_from_magnitude():
    x = _keys_with_outliers(n=4)
    a = quantize_keys(x, 4, "random", torch.Generator().manual_seed(1))
    b = quantize_keys(x, 4, "random", torch.Generator().manual_seed(1))
    m = quantize_keys(x, 4, "magnitude")
    assert torch.equal(a.boost_ch, b.boost_ch) and not torch.equal(a.boost_ch, m.boost_ch)


@pytest.mark.parametrize("bits", [2, 4])
def test_value_pages_error_bound(bits):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 16)
    p = quantize_values(x, bits)
    assert p.low.shape == (2, 3, 32, 4) and p.high.shape == (2, 3, 32, 4 if bits == 4 else 0)
    err = (dequantize_values(p) - x).abs()
    assert (err <= p.scale.float().unsqueeze(-1) / 2 + 1e-3 * x.abs().amax()).all()
    assert p.scale.float().max() <= (x.amax(-1) - x.amin(-1)).max() / (2**bits - 1) * 1.001


def test_constant_channel_is_exact():
    x = torch.ones(1, 1, 8, 4) * 0.5
    assert torch.equal(dequantize_keys(quantize_keys(x, 1)), x)


@pytest.mark.parametrize("d", [256, 320, 512])
def test_boost_index_holds_every_channel_of_large_heads(d):
    """The last eighth of the channels x10: they are the boosted ones, listed by their own numbers
    (past 255 too), and every element stays within half a step of its channel's grid."""
    torch.manual_seed(0)
    x = torch.randn(2, 2, 32, d)
    x[..., -d // 8:] *= 10
    p = quantize_keys(x, d // 4)
    assert p.boost_ch.dtype == (torch.uint8 if d <= 256 else torch.int16)
    assert set(range(d - d // 8, d)) <= set(p.boost_ch[0, 0].tolist())
    err = (dequantize_keys(p) - x).abs().transpose(-1, -2)
    assert (err <= p.scale.float().unsqueeze(-1) / 2 + 1e-3 * x.abs().amax()).all()
    assert float(err[..., -d // 8:, :].max()) < 3  # half a 4-bit step of a x10 channel (~2.4; at 2 bits ~12)

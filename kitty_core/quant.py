"""The PyTorch reference quantizers of the packed page format (Kitty, section 4.1 and Algorithm 1).

The format itself (fields, shapes, bit order) is defined in `kernels/pages.py`, beside the kernels that
read it; the Triton pack kernel (`kernels/pack.py`) writes the same bytes as these functions.

Codes are computed against the FP16-rounded scale and zero that are stored, so dequantizing a page
reproduces exactly what the page encodes; the error of each element is at most scale / 2.
"""

from __future__ import annotations

import torch

from kernels.pages import KeyPages, ValuePages, boost_index_dtype, pack_2bit, unpack_2bit


def _minmax_params(x: torch.Tensor, levels: torch.Tensor, dim: int):
    """FP16 scale/zero of asymmetric min-max quantization along `dim`, and the codes against them."""
    lo = x.amin(dim=dim, keepdim=True)
    hi = x.amax(dim=dim, keepdim=True)
    scale = ((hi - lo) / levels).to(torch.float16)
    zero = lo.to(torch.float16)
    s32, z32 = scale.float(), zero.float()
    codes = torch.where(s32 > 0, torch.round((x - z32) / s32.clamp_min(1e-30)), torch.zeros_like(x))
    codes = torch.minimum(codes.clamp_min(0), levels).to(torch.uint8)
    return codes, scale.squeeze(dim).contiguous(), zero.squeeze(dim).contiguous()


def channel_scores(keys: torch.Tensor, rule: str, generator: torch.Generator | None = None,
                   query_rms: torch.Tensor | None = None) -> torch.Tensor:
    """Importance of each key channel of each page: [N, H, G, D] -> [N, H, D] (higher = boost first).

    magnitude  mean |k| of the channel over the page's tokens (the paper's rule)
    random     uniform scores (the paper's ablation)
    range      max - min of the channel over the page: its INT2 step, i.e. its quantization error
    qk         range x the RMS of the queries on that channel ([N or 1, H, D] `query_rms`): the size
               of the logit error q_d * e_d that leaving channel d at 2 bits causes
    """
    if rule == "magnitude":
        return keys.float().abs().mean(dim=-2)
    if rule == "random":
        n, h, _, d = keys.shape
        return torch.rand((n, h, d), generator=generator).to(keys.device)
    if rule in ("range", "qk"):
        x = keys.float()
        spread = x.amax(dim=-2) - x.amin(dim=-2)
        if rule == "range":
            return spread
        if query_rms is None:
            raise ValueError("the qk rule needs the RMS of the queries per channel (query_rms)")
        return spread * query_rms.to(spread.device, torch.float32)
    raise ValueError(f"unknown channel selection rule {rule!r}")


def quantize_keys(
    keys: torch.Tensor, n_boost: int, rule: str = "magnitude", generator: torch.Generator | None = None,
    query_rms: torch.Tensor | None = None,
) -> KeyPages:
    """keys [N, H, G, D] (any float dtype) -> KeyPages with the top-`n_boost` channels of each page at 4 bits."""
    n, h, g, d = keys.shape
    if not 0 <= n_boost <= d:
        raise ValueError(f"n_boost must be in [0, {d}], got {n_boost}")
    x = keys.float().transpose(-1, -2)  # [N, H, D, G]
    boosted = torch.zeros((n, h, d), dtype=torch.bool, device=keys.device)
    if n_boost == d:
        boosted[:] = True
    elif n_boost > 0:
        top = channel_scores(keys, rule, generator, query_rms).topk(n_boost, dim=-1).indices
        boosted.scatter_(-1, top, True)
    levels = torch.where(boosted, 15.0, 3.0).unsqueeze(-1)  # [N, H, D, 1]
    codes, scale, zero = _minmax_params(x, levels, dim=-1)  # codes [N, H, D, G]
    # the boosted channels in ascending order: a stable sort puts True first without reordering them
    order = torch.sort((~boosted).to(torch.uint8), dim=-1, stable=True).indices[..., :n_boost]
    high_codes = torch.gather(codes >> 2, -2, order.unsqueeze(-1).expand(n, h, n_boost, g))
    return KeyPages(
        dense=pack_2bit(codes & 3), high=pack_2bit(high_codes), boost_ch=order.to(boost_index_dtype(d)), scale=scale,
        zero=zero,
    )


def key_codes(pages: KeyPages) -> torch.Tensor:
    """Full codes [N, H, D, G] of key pages: low | high << 2 through the boost index (Algorithm 1)."""
    low = unpack_2bit(pages.dense)  # [N, H, D, G]
    if pages.n_boost == 0:
        return low
    high = unpack_2bit(pages.high)  # [N, H, Db, G]
    rows = pages.boost_ch.long().unsqueeze(-1).expand_as(high)
    return low | torch.zeros_like(low).scatter_(-2, rows, high) << 2


def dequantize_keys(pages: KeyPages, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """KeyPages -> keys [N, H, G, D]."""
    x = key_codes(pages).float() * pages.scale.float().unsqueeze(-1) + pages.zero.float().unsqueeze(-1)
    return x.transpose(-1, -2).to(dtype)


def quantize_values(values: torch.Tensor, bits: int) -> ValuePages:
    """values [N, H, G, D] -> ValuePages with one scale/zero per token."""
    if bits not in (2, 4):
        raise ValueError(f"value bits must be 2 or 4, got {bits}")
    x = values.float()
    levels = torch.tensor(float(2**bits - 1), device=x.device)
    codes, scale, zero = _minmax_params(x, levels, dim=-1)  # codes [N, H, G, D]
    high = pack_2bit(codes >> 2) if bits == 4 else codes.new_zeros((*codes.shape[:-1], 0))
    return ValuePages(low=pack_2bit(codes & 3), high=high, scale=scale, zero=zero)


def dequantize_values(pages: ValuePages, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """ValuePages -> values [N, H, G, D]."""
    codes = unpack_2bit(pages.low)
    if pages.high.shape[-1]:
        codes = codes | (unpack_2bit(pages.high) << 2)
    x = codes.float() * pages.scale.float().unsqueeze(-1) + pages.zero.float().unsqueeze(-1)
    return x.to(dtype)

"""GGUF blocks in plain torch: the dequantization of a GGUF tensor's raw blocks on any device, and
the oracle of the CPU kernels (gguf_cpu.cpp): the gguf package's own dequantization, then F.linear.

A GGUF weight is kept as its raw blocks, one row of blocks per output row: (N, K / QK * BYTES)
uint8, for these block types (ggml's layouts, each value a float32 product of float16 scales and
small integers):

- Q8_0: 32 values, float16 d then 32 int8 q: d * q;
- Q4_0: 32 values, float16 d then 16 bytes, value j in the low nibble of byte j and value j + 16
  in its high nibble: d * (q - 8);
- Q4_1: as Q4_0 with a float16 minimum m after d: d * q + m;
- Q4_K: 256 values in 8 sub-blocks of 32, float16 d and dmin, 12 bytes of 6-bit scales and
  minimums, 128 bytes of nibbles: (d * scale) * q - dmin * min;
- Q6_K: 256 values in 16 sub-blocks of 16, 128 bytes of low nibbles, 64 of high 2-bit pairs, 16
  int8 scales, float16 d: (d * scale) * (q - 32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixlm.kernels.quant_ref import pack_int4

# ggml's type id -> (name, values a block, bytes a block)
BLOCK_TYPES: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    14: ("Q6_K", 256, 210),
}


def row_bytes(gtype: int, k: int) -> int:
    """The bytes of one row of K values of block type `gtype`."""
    _, qk, nbytes = BLOCK_TYPES[gtype]
    return k // qk * nbytes


def _half(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) bytes -> (...) float32 (little-endian float16)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """(..., n) bytes -> (..., 2, n) values: the low nibbles, then the high ones."""
    return torch.stack([q & 0xF, q >> 4], dim=-2)


def dequantize(w: torch.Tensor, gtype: int, k: int) -> torch.Tensor:
    """The float32 values (N, K) of the raw blocks `w` (N, row bytes) of type `gtype`."""
    if gtype not in BLOCK_TYPES:
        raise ValueError(f"GGUF block type {gtype} is not supported")
    _, qk, nbytes = BLOCK_TYPES[gtype]
    n = w.shape[0]
    b = w[:, : row_bytes(gtype, k)].reshape(n, k // qk, nbytes)  # (N, blocks, bytes)
    if gtype == 8:  # Q8_0
        return (_half(b[..., :2]).unsqueeze(-1) * b[..., 2:].view(torch.int8).float()).reshape(n, k)
    if gtype in (2, 3):  # Q4_0, Q4_1
        start = 2 if gtype == 2 else 4
        q = _nibbles(b[..., start:]).reshape(n, k // qk, qk).float()
        d = _half(b[..., :2]).unsqueeze(-1)
        if gtype == 2:
            return (d * (q - 8.0)).reshape(n, k)
        return (d * q + _half(b[..., 2:4]).unsqueeze(-1)).reshape(n, k)
    if gtype == 12:  # Q4_K
        d, dmin = _half(b[..., 0:2]).unsqueeze(-1), _half(b[..., 2:4]).unsqueeze(-1)
        s = b[..., 4:16].long()  # the 12 bytes of scales and minimums
        lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
        scale = torch.cat([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], dim=-1).float()
        mins = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1).float()
        q = _nibbles(b[..., 16:].reshape(n, -1, 4, 32)).reshape(n, -1, 8, 32).float()
        y = (d * scale).unsqueeze(-1) * q - (dmin * mins).unsqueeze(-1)
        return y.reshape(n, k)
    q, s = _q6k(b)  # Q6_K
    return (s.unsqueeze(-1) * q.float()).reshape(n, k)


def _q6k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K blocks (N, blocks, 210) -> their integers q - 32 (N, K // 16, 16) int8 and each
    sub-block's scale d * scale (N, K // 16) float32 (exact: an 11-bit float16 times an int8)."""
    n = b.shape[0]
    ql = b[..., :128].reshape(n, -1, 2, 64)
    qh = b[..., 128:192].reshape(n, -1, 2, 1, 32)
    scales = b[..., 192:208].view(torch.int8).float()
    d = _half(b[..., 208:210]).unsqueeze(-1)
    # per half of 128: the low nibbles of bytes 0-31, of 32-63, then their high nibbles
    low = _nibbles(ql).reshape(n, -1, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).view(4, 1)
    high = (qh >> shifts) & 3  # (N, blocks, 2, 4, 32)
    q = ((low | (high << 4)).view(torch.int8) - 32).reshape(n, -1, 16)
    return q, (d * scales).reshape(n, -1)


# the 4-bit block types whose values are s * q + c over groups of 32 columns (`as_int4`)
INT4_TYPES = (2, 3, 12)  # Q4_0, Q4_1, Q4_K


def as_int4(w: torch.Tensor, gtype: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The raw 4-bit blocks `w` (N, row bytes) of type `gtype` (INT4_TYPES) in the packed INT4
    layout of kernels/quant_ref.py: (N, K // 2) uint8 (column 2j low, 2j + 1 high) with a
    float32 scale and zero point (N, K // 32) each, (q - zero) * scale being the block's
    s * q + c: the same 4-bit integers, in another order, with zero = -c / s. A group whose s
    is 0 holds the one value c: its integers become 0, its scale 1 and its zero point -c.
    On the device `w` is on (a GPU converts a model's layers at load in milliseconds)."""
    q, scale, zero = _int4_groups(w, gtype, k)
    return pack_int4(q), scale, zero


def _int4_groups(
    w: torch.Tensor, gtype: int, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`as_int4` before packing: the integers (N, K) uint8 in [0, 15], scales and zero points."""
    if gtype not in INT4_TYPES:
        raise ValueError(f"GGUF block type {BLOCK_TYPES[gtype][0]} is not 4-bit: no INT4 layout")
    _, qk, nbytes = BLOCK_TYPES[gtype]
    n = w.shape[0]
    b = w[:, : row_bytes(gtype, k)].reshape(n, k // qk, nbytes)
    if gtype in (2, 3):  # one group a block: d, (m), 16 bytes of 32 nibbles
        start = 2 if gtype == 2 else 4
        q = _nibbles(b[..., start:]).reshape(n, k // 32, 32)
        s = _half(b[..., :2])
        c = -8.0 * s if gtype == 2 else _half(b[..., 2:4])
    else:  # Q4_K: eight groups a block, 6-bit scales and minimums (as `dequantize` reads them)
        d, dmin = _half(b[..., 0:2]).unsqueeze(-1), _half(b[..., 2:4]).unsqueeze(-1)
        sm = b[..., 4:16].long()
        lo, mid, hi = sm[..., 0:4], sm[..., 4:8], sm[..., 8:12]
        scale = torch.cat([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], dim=-1).float()
        mins = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1).float()
        q = _nibbles(b[..., 16:].reshape(n, -1, 4, 32)).reshape(n, k // 32, 32)
        s = (d * scale).reshape(n, k // 32)
        c = -(dmin * mins).reshape(n, k // 32)
    flat = s == 0
    q = torch.where(flat.unsqueeze(-1), torch.zeros_like(q), q)
    zero = torch.where(flat, -c, -c / torch.where(flat, torch.ones_like(s), s))
    scale = torch.where(flat, torch.ones_like(s), s)
    return q.reshape(n, k), scale.contiguous(), zero.contiguous()


# the columns a group of `as_int8` has, by block type
INT8_GROUPS = {2: 32, 3: 32, 8: 32, 12: 32, 14: 16}


def as_int8(
    w: torch.Tensor, gtype: int, k: int, group: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The raw blocks `w` (N, row bytes) of any type here in the int8 layout of
    kernels/quant_ref.py: (N, K) int8 integers with a float32 scale and zero point (N, K // group)
    each, (q - zero) * scale being the block's value. Q8_0 (groups of 32) and Q6_K (16) are
    d * q and (d * scale) * (q - 32): their integers as they are, the scales exact, and no zero
    points (None: symmetric), so the layout holds the file's values exactly; the 4-bit types are
    `as_int4`'s integers, scales and zero points. `group`: the columns of a group, a divisor of the type's own
    (INT8_GROUPS), its scale and zero point repeated (the layer of a Q4_K_M file whose v is
    Q6_K: one group size for all its parts). On the device `w` is on."""
    if gtype not in BLOCK_TYPES:
        raise ValueError(f"GGUF block type {gtype} is not supported")
    own = INT8_GROUPS[gtype]
    group = group or own
    if own % group:
        raise ValueError(f"groups of {group} columns do not split {BLOCK_TYPES[gtype][0]}'s {own}")
    _, qk, nbytes = BLOCK_TYPES[gtype]
    n = w.shape[0]
    if gtype in INT4_TYPES:
        q, scale, zero = _int4_groups(w, gtype, k)
        q = q.to(torch.int8)
    else:
        b = w[:, : row_bytes(gtype, k)].reshape(n, k // qk, nbytes)
        if gtype == 8:  # Q8_0
            q, scale = b[..., 2:].contiguous().view(torch.int8).reshape(n, k), _half(b[..., :2])
        else:  # Q6_K
            q, scale = _q6k(b)
            q = q.reshape(n, k)
        zero = None
    if group != own:
        scale = scale.repeat_interleave(own // group, dim=1)
        zero = None if zero is None else zero.repeat_interleave(own // group, dim=1)
    return q.contiguous(), scale.contiguous(), None if zero is None else zero.contiguous()


def gguf_package_dequantize(w: torch.Tensor, gtype: int, k: int) -> torch.Tensor:
    """The gguf package's own dequantization of the raw blocks (the oracle; on the CPU)."""
    from gguf import GGMLQuantizationType
    from gguf import dequantize as gguf_dequantize

    data = w[:, : row_bytes(gtype, k)].contiguous().cpu().numpy()
    return torch.from_numpy(gguf_dequantize(data, GGMLQuantizationType(gtype))).float()


def gguf_linear_ref(
    x: torch.Tensor, w: torch.Tensor, gtype: int, k: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ W^T in float32, W dequantized by the gguf package: the kernels' oracle."""
    weight = gguf_package_dequantize(w, gtype, k).to(x.device)
    return F.linear(x.float(), weight, None if bias is None else bias.float())

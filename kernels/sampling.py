"""Fused sampling on the GPU: temperature, min-p, top-k, top-p and the exponential race in a few
passes over each row's logits, with no sort, no (B, V) temporaries and no host sync.

Its oracle is beside it: kernels/sampling_ref.py, the plain-torch twins of every kernel here (and
the sampler's CPU path). `sample` draws what `sample_ref` draws: the token of a sampled row is
argmax(p_i / q_i) over the tokens its filters keep (`filtered_probs`), where p is the softmax at
the row's temperature and q_i the same splitmix64 Exp(1) noise as `exponential_noise(row seed)`,
compared in the log domain as (y_i - max y) - log q_i with y = logits / temperature. One program
per row:

1. One pass: the running max m of y, the smallest finite y, and the race winner over all tokens
   (scores rebased as m grows). A row with no filter is done here.
2. Top-k / top-p keep the tokens at or above a threshold t. Bisection passes evaluate PIVOTS
   thresholds at once, counting the tokens and the mass e = exp(y - m) at or above each (min-p
   survivors only), until the bracket holds one token, or one value, below its top: a threshold
   t is "ok" when fewer than k tokens and less than top_p of the mass lie at or above it, and then
   the next token below t is kept too. Once the bracket holds at most CAPACITY tokens, the next
   full pass also copies them to a per-row scratch, and later passes read only that copy.
3. If the winner of pass 1 is kept it wins the kept set as well; otherwise a last pass runs the
   race over the kept tokens (min-p alone needs only this pass, and only when it drops the winner).

Where the fused path may differ from the oracle: where float32 rounding decides (y is computed
as logits * (1 / temperature) where torch divides; two race scores within a few ulps; a token
whose probability is within rounding of the min-p threshold, or whose preceding mass is within
rounding of top_p, which at a 128k vocabulary and top_p near 1 moves the boundary of a few rows
by one token of tiny probability); at the top-k / top-p boundary, where both keep every token tied
with the last one kept but the fused path also counts tokens within a few ulps of each other as
tied when the bracket cannot be split further; and tokens more than 100 below the max of y
(probability under e^-100 of the max), which neither win nor add mass in float32, are never kept.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CUT = 100.0  # y below max(y) - CUT: p < e^-100 * p_max, too small to win or to add float32 mass
MAX_PASSES = 24  # bisection passes; float32 resolution is reached well before this


@triton.jit
def _neg_log_noise(seed, start, steps):
    """-log(q) for tokens start + arange, q the Exp(1) noise of sampling_ref.exponential_noise;
    steps = (arange + 1) * golden, hoisted out of the caller's loop (uint64 arithmetic wraps as
    torch's int64 does; the shifts of uint64 are logical)."""
    z = (seed + tl.cast(start, tl.uint64) * 0x9E3779B97F4A7C15) + steps
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    u = ((z >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    u = tl.minimum(u, 1.0 - 1.0 / 16777216.0)  # as exponential_noise: q > 0
    return -tl.log(-tl.log(u))


@triton.jit
def _tempered(base, cols, vocab, inv_temp):
    x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    return x * inv_temp  # torch divides: y may differ in the last bit


@triton.jit
def _count_at_or_above(
    src, n, inv_temp, m, min_p, t, compact, lo, hi, dst,
    BLOCK: tl.constexpr, PIVOTS: tl.constexpr,
):  # fmt: skip
    """For each threshold t[j]: the number and the mass exp(y - m) of the min-p survivors with
    y >= t[j], y = src[:n] * inv_temp. Both are non-increasing in t (float addition is monotone).
    Where `compact`, also writes the survivors in [lo, hi) to dst, in order; returns their count."""
    count = tl.zeros([PIVOTS], tl.int32)
    mass = tl.zeros([PIVOTS], tl.float32)
    written = tl.zeros([], tl.int32)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        y = _tempered(src, cols, n, inv_temp)
        e = tl.exp(y - m)
        survivor = e >= min_p
        at = (y[:, None] >= t[None, :]) & survivor[:, None]  # (BLOCK, PIVOTS)
        count += tl.sum(at.to(tl.int32), axis=0)
        mass += tl.sum(tl.where(at, e[:, None], 0.0), axis=0)
        if compact:
            inside = (survivor & (y >= lo) & (y < hi)).to(tl.int32)
            tl.store(dst + written + tl.cumsum(inside, axis=0) - 1, y, mask=inside != 0)
            written += tl.sum(inside, axis=0)
    return count, mass, written


@triton.jit
def _pick(v, j, i):
    """v[i] for a 1-d tensor v indexed by j = arange."""
    return tl.sum(tl.where(j == i, v, 0), axis=0)


@triton.jit
def _sample_kernel(
    logits_ptr, stride_row, vocab,
    src_ptr, seed_ptr, top_k_ptr,  # (R,) int64: logits row, noise seed, top-k (<= 0: off)
    temp_ptr, top_p_ptr, min_p_ptr,  # (R,) float32
    out_ptr,  # (R,) int64
    threshold_ptr,  # (R,) float32, written where STORE_THRESHOLD (for tests)
    scratch_ptr,  # (R, CAPACITY) float32; unused while CAPACITY <= 1
    STORE_THRESHOLD: tl.constexpr, BLOCK: tl.constexpr, BISECT_BLOCK: tl.constexpr,
    PIVOTS: tl.constexpr, CAPACITY: tl.constexpr,
    CUT: tl.constexpr, MAX_PASSES: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    base = logits_ptr + tl.load(src_ptr + r) * stride_row
    seed = tl.load(seed_ptr + r).to(tl.uint64, bitcast=True)
    inv_temp = 1.0 / tl.load(temp_ptr + r)
    steps = (tl.arange(0, BLOCK) + 1).to(tl.uint64) * 0x9E3779B97F4A7C15
    top_k = tl.load(top_k_ptr + r)
    top_p = tl.load(top_p_ptr + r)
    min_p = tl.load(min_p_ptr + r)
    NEG_INF: tl.constexpr = float("-inf")
    INF: tl.constexpr = float("inf")

    # pass 1: max, smallest finite value, race winner over every token
    m = tl.full([], NEG_INF, tl.float32)
    y_min = tl.full([], INF, tl.float32)
    best = tl.zeros([], tl.int32)
    best_y = tl.full([], NEG_INF, tl.float32)
    best_g = tl.zeros([], tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = tl.arange(0, BLOCK)
        cols = start + offs
        y = _tempered(base, cols, vocab, inv_temp)
        m = tl.maximum(m, tl.max(y, axis=0))
        y_min = tl.minimum(y_min, tl.min(tl.where(y > NEG_INF, y, INF), axis=0))
        ref = tl.where(m > NEG_INF, m, 0.0)
        g = _neg_log_noise(seed, start, steps)
        score = (y - ref) + g
        block_best = tl.max(score, axis=0)
        i = tl.argmax(score, axis=0)
        take = block_best > (best_y - ref) + best_g  # strict: the first index wins ties
        best = tl.where(take, start + i, best)
        best_y = tl.where(take, tl.max(tl.where(offs == i, y, NEG_INF), axis=0), best_y)
        best_g = tl.where(take, tl.max(tl.where(offs == i, g, NEG_INF), axis=0), best_g)

    # top-k / top-p: bisection on the threshold t of the kept set {y >= t}
    bisect = (top_k > 0) | (top_p < 1.0)
    k_limit = tl.where(top_k > 0, top_k, vocab + 1)
    min_p_floor = tl.where(min_p > 0.0, tl.log(tl.maximum(min_p, 1e-38)) - 0.01, -CUT)
    lo = tl.maximum(y_min, m + tl.maximum(min_p_floor, -CUT)).to(tl.float32)  # no survivor below
    hi = m
    count_lo = vocab + 1
    count_hi = tl.zeros([], tl.int32)  # of a bracket top at +inf: the first pass's top is m itself
    mass_hi = tl.zeros([], tl.float32)
    p_limit = tl.full([], INF, tl.float32)
    # once the bracket holds at most CAPACITY tokens, a full pass copies their y to the row's
    # scratch and later passes read only those (count/mass_top: the tokens at or above its top)
    scratch = scratch_ptr + r * CAPACITY
    in_scratch = tl.zeros([], tl.int1)
    n_scratch = tl.zeros([], tl.int32)
    count_top = tl.zeros([], tl.int32)
    mass_top = tl.zeros([], tl.float32)
    threshold = tl.full([], NEG_INF, tl.float32)
    j = tl.arange(0, PIVOTS)
    passes = tl.zeros([], tl.int32)
    done = bisect == 0
    while (done == 0) & (passes < MAX_PASSES):
        # the first pass spans [lo, m] ends included; later ones split (lo, hi) strictly inside
        frac = tl.where(
            passes == 0, j.to(tl.float32) / (PIVOTS - 1), (j + 1).to(tl.float32) / (PIVOTS + 1)
        )
        t = tl.minimum(lo + (hi - lo) * frac, hi).to(tl.float32)
        t = tl.where((passes == 0) & (j == PIVOTS - 1), m, t)
        if in_scratch:  # y in [lo, hi) of the compaction, the rest counted in count/mass_top
            count, mass, _ = _count_at_or_above(
                scratch, n_scratch, 1.0, m, min_p, t, False, lo, hi, scratch,
                BISECT_BLOCK, PIVOTS,
            )  # fmt: skip
            count += count_top
            mass += mass_top
        else:
            compact = (passes > 0) & (count_lo - count_hi <= CAPACITY)
            count, mass, n_scratch = _count_at_or_above(
                base, vocab, inv_temp, m, min_p, t, compact, lo, hi, scratch,
                BISECT_BLOCK, PIVOTS,
            )  # fmt: skip
            in_scratch = compact
            count_top = count_hi
            mass_top = mass_hi
        # in the first pass the mass at t[0] = lo is the mass of every survivor
        total = tl.max(mass, axis=0)
        p_limit = tl.where((passes == 0) & (top_p < 1.0), top_p * total, p_limit)
        ok = (count < k_limit) & (mass < p_limit)
        n_bad = tl.sum(tl.where(ok, 0, 1), axis=0)  # ok is false below some pivot, true above
        new_lo = tl.where(n_bad > 0, _pick(t, j, n_bad - 1), lo)
        count_lo = tl.where(n_bad > 0, _pick(count, j, n_bad - 1), count_lo)
        new_hi = tl.where(n_bad < PIVOTS, _pick(t, j, n_bad), hi)
        count_hi = tl.where(n_bad < PIVOTS, _pick(count, j, n_bad), count_hi)
        mass_hi = tl.where(n_bad < PIVOTS, _pick(mass, j, n_bad), mass_hi)
        stuck = (new_lo == lo) & (new_hi == hi) & (passes > 0)
        done = (count_lo - count_hi <= 1) | (new_lo >= new_hi) | stuck
        lo = new_lo
        hi = new_hi
        threshold = lo
        passes += 1

    # the pass-1 winner wins any kept set that holds it; otherwise race over the kept tokens
    kept = (best_y >= threshold) & (tl.exp(best_y - m) >= min_p)
    if kept == 0:
        best_score = tl.full([], NEG_INF, tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            y = _tempered(base, cols, vocab, inv_temp)
            keep = (y >= threshold) & (tl.exp(y - m) >= min_p)
            score = tl.where(keep, (y - m) + _neg_log_noise(seed, start, steps), NEG_INF)
            block_best = tl.max(score, axis=0)
            take = block_best > best_score
            best = tl.where(take, start + tl.argmax(score, axis=0), best)
            best_score = tl.where(take, block_best, best_score)
    tl.store(out_ptr + r, best.to(tl.int64))
    if STORE_THRESHOLD:
        tl.store(threshold_ptr + r, threshold)


def sample(
    logits: torch.Tensor,  # (B, V), unit stride in V; not modified
    rows: torch.Tensor,  # (R,) int64: the logits row each sampled row reads
    seeds: torch.Tensor,  # (R,) int64: row_seed of each row
    top_k: torch.Tensor,  # (R,) int64, <= 0: no top-k
    temperature: torch.Tensor,  # (R,) float32, > 0
    top_p: torch.Tensor,  # (R,) float32 in (0, 1]; 1: no top-p
    min_p: torch.Tensor,  # (R,) float32 in [0, 1]; 0: no min-p
    *,
    block: int = 2048,
    bisect_block: int = 1024,
    pivots: int = 8,
    capacity: int = 16384,
    num_warps: int = 8,
    threshold_out: torch.Tensor | None = None,
    bisects: bool = True,
) -> torch.Tensor:
    """(R,) int64 sampled token ids on the logits' device, launched without waiting for it (the
    oracle: kernels/sampling_ref.sample_ref with each row's parameters).
    `threshold_out` (R,) float32, if given, receives each row's top-k / top-p threshold on
    y = logits / temperature: the row keeps the min-p survivors with y >= it (-inf: no cut).
    `bisects=False` says that no row has top-k or top-p (the caller knows it on the host): the
    kernel then gets no (R, capacity) scratch and never compacts, so a wrong False costs only
    speed."""
    out = torch.empty(rows.shape[0], dtype=torch.int64, device=logits.device)
    if rows.shape[0] == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if not bisects:
        # a bracket still open holds at least 2 tokens, so a capacity of 1 never compacts
        capacity = 1
    _sample_kernel[(rows.shape[0],)](
        logits, logits.stride(0), logits.shape[1],
        rows, seeds, top_k, temperature, top_p, min_p, out,
        threshold_out if threshold_out is not None else out,
        torch.empty(rows.shape[0], capacity, dtype=torch.float32, device=logits.device),
        STORE_THRESHOLD=threshold_out is not None, BLOCK=block, BISECT_BLOCK=bisect_block,
        PIVOTS=pivots, CAPACITY=capacity, CUT=CUT, MAX_PASSES=MAX_PASSES, num_warps=num_warps,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# greedy


@triton.jit
def _argmax_chunks_kernel(
    logits_ptr, stride, vocab, val_ptr, idx_ptr, mask_ptr, mask_stride, words, mask_rows_ptr,
    BLOCK: tl.constexpr, MASKED: tl.constexpr, MASK_ROWS: tl.constexpr,
):  # fmt: skip
    """The max of one chunk of one row and its first index; with MASKED, over the tokens whose
    bit is set in the row's packed bitmask row (row `mask_rows[r]` with MASK_ROWS, where -1
    reads no mask; else row r)."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab
    x = tl.load(logits_ptr + r.to(tl.int64) * stride + cols, mask=in_vocab, other=-float("inf"))
    x = tl.where(x != x, float("inf"), x)  # a NaN wins, as in torch (and never a masked lane)
    if MASKED:
        m = r
        if MASK_ROWS:
            m = tl.load(mask_rows_ptr + r)
        if m >= 0:
            at = mask_ptr + m.to(tl.int64) * mask_stride + cols // 32
            word = tl.load(at, mask=in_vocab & (cols // 32 < words), other=0)
            x = tl.where(((word >> (cols % 32)) & 1) != 0, x, -float("inf"))
    at = r * tl.num_programs(1) + c
    tl.store(val_ptr + at, tl.max(x, axis=0))
    best = c * BLOCK + tl.argmax(x, axis=0, tie_break_left=True)
    tl.store(idx_ptr + at, tl.minimum(best, vocab - 1))


@triton.jit
def _argmax_rows_kernel(
    val_ptr, idx_ptr, chunks, out_ptr, buf_ptr, rows_ptr,
    SCATTER: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """The first chunk holding a row's max gives its index (chunks are in index order)."""
    r = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    mask = c < chunks
    v = tl.load(val_ptr + r * chunks + c, mask=mask, other=-float("inf"))
    i = tl.load(idx_ptr + r * chunks + c, mask=mask, other=0)
    first = tl.min(tl.where(mask & (v == tl.max(v, axis=0)), c, BLOCK_C), axis=0)
    best = tl.sum(tl.where(c == first, i, 0), axis=0).to(tl.int64)
    tl.store(out_ptr + r, best)
    if SCATTER:
        tl.store(buf_ptr + tl.load(rows_ptr + r), best)


def argmax_rows(
    logits: torch.Tensor,
    into: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    block: int = 4096,
    bitmask: torch.Tensor | None = None,
    mask_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """`logits.argmax(dim=-1)` (B,) int64 for (B, V) logits with a unit stride along V: the first
    index of each row's max, as torch gives it, in two short kernels (chunks of `block` tokens, then
    their winners) where torch's reduction of one long row runs as one block of threads. With
    `into` and `rows` (B,) it also writes `into[rows] = the result` (what a decode graph keeps in
    `token_buf`), saving that kernel too. With a packed (M, W) int32 `bitmask` on the device, the
    argmax is over each row's allowed tokens (bit i % 32 of word i // 32; none past 32 * W), as
    `apply_token_bitmask` then an argmax give it, without writing the logits: row i reads bitmask
    row `mask_rows[i]` (B,) (-1: no mask), or row i without `mask_rows`. Launched without waiting
    for the device. The oracle is kernels/sampling_ref.argmax_rows_ref."""
    b, vocab = logits.shape
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    if logits.stride(1) != 1 or (bitmask is not None and bitmask.stride(1) != 1):
        raise ValueError("argmax_rows takes logits and bitmask rows with a unit stride")
    if bitmask is not None and bitmask.dtype != torch.int32:
        raise ValueError(f"argmax_rows takes an int32 bitmask, not {bitmask.dtype}")
    chunks = triton.cdiv(vocab, block)
    vals = torch.empty(b, chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(b, chunks, dtype=torch.int64, device=logits.device)
    masked = bitmask is not None
    _argmax_chunks_kernel[(b, chunks)](
        logits, logits.stride(0), vocab, vals, idx,
        bitmask if masked else logits, bitmask.stride(0) if masked else 0,
        bitmask.shape[1] if masked else 0, mask_rows if mask_rows is not None else out,
        BLOCK=block, MASKED=masked, MASK_ROWS=masked and mask_rows is not None, num_warps=8,
    )  # fmt: skip
    scatter = into is not None and rows is not None
    _argmax_rows_kernel[(b,)](
        vals, idx, chunks, out, into if scatter else out, rows if scatter else out,
        SCATTER=scatter, BLOCK_C=max(2, triton.next_power_of_2(chunks)), num_warps=1,
    )  # fmt: skip
    return out


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr, logits_stride, mask_ptr, mask_stride, vocab, words, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab
    word = tl.load(
        mask_ptr + row * mask_stride + cols // 32, mask=in_vocab & (cols // 32 < words), other=0
    )
    allowed = (word >> (cols % 32)) & 1
    tl.store(logits_ptr + row * logits_stride + cols, float("-inf"), mask=in_vocab & (allowed == 0))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, block: int = 4096) -> None:
    """In place, in one kernel: the logits (B, V) of tokens whose bit is clear in the packed
    (B, W) int32 `bitmask` (bit i % 32 of word i // 32), and of columns past 32 * W, become -inf.
    The oracle is kernels/sampling_ref.apply_token_bitmask_ref."""
    b, vocab = logits.shape
    if b == 0:
        return
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("apply_token_bitmask takes rows with a unit stride")
    _apply_bitmask_kernel[(b, triton.cdiv(vocab, block))](
        logits, logits.stride(0), bitmask, bitmask.stride(0), vocab, bitmask.shape[1],
        BLOCK=block, num_warps=4,
    )  # fmt: skip

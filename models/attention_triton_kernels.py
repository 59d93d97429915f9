"""Triton kernels of relative-position attention (Transformer-XL's score) with the position term computed per tile.

Shape letters (models/shapes.md): B lanes, Q queries, K keys, P relative distances (the distance slots), H heads,
E head width, BE head width E padded to a power of two, BQ query tile rows, BK key tile rows, BR rows of a tile a
helper loads (BQ or BK), BAND distance slots one (query tile, key tile) pair touches (padded to a power of
two). Per lane b and head h, with qu = (q + u) / sqrt(E) and qv = (q + v) / sqrt(E):
    s(i, j) = qu_i . k_j + qv_i . R[d(i, j)],   d(i, j) = offset + SIGN * (i - j)
    p = softmax_j(s masked to allowed(b, i, j) = structure[i, j] & key_valid[b, j]),  lse_i = log sum_j exp s(i, j)

Why a band: inside a tile, i - j takes BQ + BK - 1 consecutive values, so the position scores of the whole tile are
one [BQ, E] x [E, BAND] product against the BAND rows of R that the tile reads ("pb"), and each score picks its
slot from its own row of pb with tl.gather (`_band`: slot = base + t(i, j)). No [B, H, Q, P] tensor is written and
no score reads global memory. Backward reverses the map: within one query row the slots of a tile are distinct,
so the band's gradient is ds moved within rows (a gather again, by the inverse map), followed by two matmuls.

Which key tiles a query tile visits (and the reverse) is a span [first, end) per lane, made by torch ops before
the launch (`attention_triton.triton_layout`) from the first and last tiles holding an allowed pair, so causal
layouts skip the future and a lane's empty memory is skipped. A span, not a list: the callers' live tiles are
contiguous (a dead tile inside a span is computed, fully masked, and stays correct), and contiguous key tiles are
what lets the position gradient be carried from one tile to the next (bwd_q_kernel).

Softmax runs in base 2 (exp2 is the hardware instruction): scores are multiplied by log2(e) once per tile, and
lse is stored in natural log. Products run on the keys' dtype (bf16/fp16 tensor cores; fp32 as `PREC` says) and
accumulate in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _band(q0, k0, offset, SIGN: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr):
    """Slot of the tile's first band row and each pair's row in the band: (base, t [BQ, BK] int32).

    slot(i, j) = base + t(i, j) with t in [0, BQ + BK - 1): for SIGN +1, t = ii - jj + BK - 1 (larger i - j, later
    slot); for SIGN -1, t = jj - ii + BQ - 1. ii, jj are offsets inside the tile."""
    ii = tl.arange(0, BQ)[:, None]
    jj = tl.arange(0, BK)[None, :]
    if SIGN > 0:
        base = offset + q0 - k0 - (BK - 1)
        t = ii - jj + (BK - 1)
    else:
        base = offset - q0 + k0 - (BQ - 1)
        t = jj - ii + (BQ - 1)
    return base, t


@triton.jit
def _rows(ptr, first, n_rows, stride_row, stride_e, E, BR: tl.constexpr, BE: tl.constexpr):
    """Rows first..first+BR of a [n_rows, E] matrix ([BR, BE]); rows outside [0, n_rows) and padded columns read 0."""
    rows = first + tl.arange(0, BR)
    cols = tl.arange(0, BE)
    ok = ((rows >= 0) & (rows < n_rows))[:, None] & (cols < E)[None, :]
    return tl.load(ptr + rows[:, None] * stride_row + cols[None, :] * stride_e, mask=ok, other=0.0)


@triton.jit
def _vector(ptr, first, n, stride, BR: tl.constexpr):
    """Entries first..first+BR of a length-n vector ([BR] fp32), 0 outside."""
    idx = first + tl.arange(0, BR)
    return tl.load(ptr + idx * stride, mask=idx < n, other=0.0).to(tl.float32)


@triton.jit
def _allowed(struct_ptr, stride_sq, kv_ptr, q0, k0, Qn, Kn, BQ: tl.constexpr, BK: tl.constexpr):
    """structure[i, j] & key_valid[b, j] over the tile ([BQ, BK] bool), False on padded rows and columns.
    kv_ptr points at lane b's key_valid row (int8, contiguous)."""
    i = q0 + tl.arange(0, BQ)
    j = k0 + tl.arange(0, BK)
    inside = (i < Qn)[:, None] & (j < Kn)[None, :]
    structure = tl.load(struct_ptr + i[:, None] * stride_sq + j[None, :], mask=inside, other=0)
    key_ok = tl.load(kv_ptr + j, mask=j < Kn, other=0)
    return (structure != 0) & (key_ok != 0)[None, :]


@triton.jit
def _queries(q_ptr, u_ptr, w_ptr, q0, Qn, stride_qq, stride_qe, stride_ue, stride_we, E, scale,
             DT: tl.constexpr, BQ: tl.constexpr, BE: tl.constexpr):
    """qu = (q + u) * scale and qv = (q + v) * scale for the query tile ([BQ, BE] each, in the products' dtype DT).
    The sums run in fp32, as autocast's fp32 bias + bf16 query does before the einsum path's product casts down."""
    q = _rows(q_ptr, q0, Qn, stride_qq, stride_qe, E, BQ, BE).to(tl.float32)
    cols = tl.arange(0, BE)
    u = tl.load(u_ptr + cols * stride_ue, mask=cols < E, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols * stride_we, mask=cols < E, other=0.0).to(tl.float32)
    # Padded rows stay 0 (their q is 0 but the biases are not): they must not feed the position gradient.
    real = (q0 + tl.arange(0, BQ) < Qn)[:, None]
    qu = tl.where(real, (q + u[None, :]) * scale, 0.0)
    qv = tl.where(real, (q + w[None, :]) * scale, 0.0)
    return qu.to(DT), qv.to(DT)


@triton.jit
def _scores(qu, qv, k_tile, r_ptr, stride_rp, stride_re, P, E, q0, k0, offset,
            SIGN: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, BAND: tl.constexpr, BE: tl.constexpr,
            DT: tl.constexpr, PREC: tl.constexpr):
    """The tile's scores s [BQ, BK] (fp32, natural units): content qu . k plus the band's position scores."""
    base, t = _band(q0, k0, offset, SIGN, BQ, BK)
    r_band = _rows(r_ptr, base, P, stride_rp, stride_re, E, BAND, BE).to(DT)  # [BAND, BE]
    pb = tl.dot(qv, tl.trans(r_band), input_precision=PREC)  # [BQ, BAND] every position score the tile uses
    position = tl.gather(pb, t, 1)  # [BQ, BK] pb[ii, t(ii, jj)]
    return tl.dot(qu, tl.trans(k_tile), input_precision=PREC) + position


@triton.jit
def fwd_kernel(
    q_ptr, k_ptr, v_ptr, r_ptr, u_ptr, w_ptr, struct_ptr, kv_ptr, span_ptr, out_ptr, lse_ptr,
    s_qb, s_qq, s_qh, s_qe, s_kb, s_kk, s_kh, s_ke, s_vb, s_vk, s_vh, s_ve, s_rp, s_rh, s_re, s_uh, s_ue, s_wh, s_we,
    s_sq, s_kvb, s_nb, s_nt,
    s_ob, s_oq, s_oh, s_oe, s_zb, s_zq, s_zh,
    H, Qn, Kn, P, E, n_qt, offset, scale,
    SIGN: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, BAND: tl.constexpr, BE: tl.constexpr,
    PREC: tl.constexpr,
):
    """One program per (lane, head, query tile): online softmax over the live key tiles; writes the context
    [BQ, E] and lse [BQ] (natural log)."""
    pid = tl.program_id(0)
    qt = pid % n_qt
    bh = pid // n_qt
    b = bh // H
    h = bh % H
    q0 = qt * BQ
    DT = k_ptr.dtype.element_ty  # the products' dtype (a compile-time value)
    qu, qv = _queries(q_ptr + b * s_qb + h * s_qh, u_ptr + h * s_uh, w_ptr + h * s_wh, q0, Qn, s_qq, s_qe, s_ue,
                      s_we, E, scale, DT, BQ, BE)
    k_base = k_ptr + b * s_kb + h * s_kh
    v_base = v_ptr + b * s_vb + h * s_vh
    r_base = r_ptr + h * s_rh
    m = tl.full([BQ], float("-inf"), tl.float32)  # running max (base-2 units)
    total = tl.zeros([BQ], tl.float32)  # running sum of exp2(s - m)
    acc = tl.zeros([BQ, BE], tl.float32)
    first = tl.load(span_ptr + b * s_nb + qt * s_nt)
    end = tl.load(span_ptr + b * s_nb + qt * s_nt + 1)
    for kt in range(first, end):
        k0 = kt * BK
        k_tile = _rows(k_base, k0, Kn, s_kk, s_ke, E, BK, BE).to(DT)
        v_tile = _rows(v_base, k0, Kn, s_vk, s_ve, E, BK, BE)
        s = _scores(qu, qv, k_tile, r_base, s_rp, s_re, P, E, q0, k0, offset, SIGN, BQ, BK, BAND, BE, DT, PREC)
        ok = _allowed(struct_ptr, s_sq, kv_ptr + b * s_kvb, q0, k0, Qn, Kn, BQ, BK)
        s = tl.where(ok, s * LOG2E, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # A row with nothing allowed yet keeps m = -inf; subtracting 0 instead keeps exp2 away from -inf - -inf.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        rescale = tl.exp2(m - m_ref)
        total = total * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=PREC)
        m = m_new
    # Padded query rows (and only they) have no allowed key: keep them finite, they are not stored.
    total = tl.where(total > 0, total, 1.0)
    rows = q0 + tl.arange(0, BQ)
    cols = tl.arange(0, BE)
    keep = (rows < Qn)[:, None] & (cols < E)[None, :]
    out = acc / total[:, None]
    tl.store(out_ptr + b * s_ob + h * s_oh + rows[:, None] * s_oq + cols[None, :] * s_oe,
             out.to(out_ptr.dtype.element_ty), mask=keep)
    lse = (m + tl.log2(total)) * LN2
    tl.store(lse_ptr + b * s_zb + h * s_zh + rows * s_zq, lse, mask=rows < Qn)


@triton.jit
def bwd_kv_kernel(
    q_ptr, k_ptr, v_ptr, r_ptr, u_ptr, w_ptr, struct_ptr, kv_ptr, span_ptr, do_ptr, lse_ptr, dl_ptr,
    dk_ptr, dv_ptr,
    s_qb, s_qq, s_qh, s_qe, s_kb, s_kk, s_kh, s_ke, s_vb, s_vk, s_vh, s_ve, s_rp, s_rh, s_re, s_uh, s_ue, s_wh, s_we,
    s_sq, s_kvb, s_nb, s_nt,
    s_gb, s_gq, s_gh, s_ge, s_zb, s_zq, s_zh,
    s_dkb, s_dkk, s_dkh, s_dke,
    H, Qn, Kn, P, E, n_kt, offset, scale,
    SIGN: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, BAND: tl.constexpr, BE: tl.constexpr,
    PREC: tl.constexpr,
):
    """One program per (lane, head, key tile): dk and dv over the live query tiles, scores recomputed.
    dl = delta - d lse (delta_i = do_i . o_i), so ds = p * (do . v - dl) carries the log-normaliser's gradient.
    dk, dv share strides (both are allocated here, contiguous)."""
    pid = tl.program_id(0)
    kt = pid % n_kt
    bh = pid // n_kt
    b = bh // H
    h = bh % H
    k0 = kt * BK
    DT = k_ptr.dtype.element_ty  # the products' dtype (a compile-time value)
    k_tile = _rows(k_ptr + b * s_kb + h * s_kh, k0, Kn, s_kk, s_ke, E, BK, BE).to(DT)
    v_tile = _rows(v_ptr + b * s_vb + h * s_vh, k0, Kn, s_vk, s_ve, E, BK, BE).to(DT)
    r_base = r_ptr + h * s_rh
    dk = tl.zeros([BK, BE], tl.float32)
    dv = tl.zeros([BK, BE], tl.float32)
    first = tl.load(span_ptr + b * s_nb + kt * s_nt)
    end = tl.load(span_ptr + b * s_nb + kt * s_nt + 1)
    for qt in range(first, end):
        q0 = qt * BQ
        qu, qv = _queries(q_ptr + b * s_qb + h * s_qh, u_ptr + h * s_uh, w_ptr + h * s_wh, q0, Qn, s_qq, s_qe,
                          s_ue, s_we, E, scale, DT, BQ, BE)
        d_out = _rows(do_ptr + b * s_gb + h * s_gh, q0, Qn, s_gq, s_ge, E, BQ, BE).to(DT)
        lse = _vector(lse_ptr + b * s_zb + h * s_zh, q0, Qn, s_zq, BQ)
        dl = _vector(dl_ptr + b * s_zb + h * s_zh, q0, Qn, s_zq, BQ)
        s = _scores(qu, qv, k_tile, r_base, s_rp, s_re, P, E, q0, k0, offset, SIGN, BQ, BK, BAND, BE, DT, PREC)
        ok = _allowed(struct_ptr, s_sq, kv_ptr + b * s_kvb, q0, k0, Qn, Kn, BQ, BK)
        p = tl.exp2(tl.where(ok, s * LOG2E, float("-inf")) - (lse * LOG2E)[:, None])  # [BQ, BK]
        dv += tl.dot(tl.trans(p.to(DT)), d_out, input_precision=PREC)
        dp = tl.dot(d_out, tl.trans(v_tile), input_precision=PREC)
        ds = p * (dp - dl[:, None])
        dk += tl.dot(tl.trans(ds.to(DT)), qu, input_precision=PREC)
    rows = k0 + tl.arange(0, BK)
    cols = tl.arange(0, BE)
    keep = (rows < Kn)[:, None] & (cols < E)[None, :]
    at = b * s_dkb + h * s_dkh + rows[:, None] * s_dkk + cols[None, :] * s_dke
    tl.store(dk_ptr + at, dk.to(dk_ptr.dtype.element_ty), mask=keep)
    tl.store(dv_ptr + at, dv.to(dv_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _flush(dr_ptr, first, P, s_dp, s_de, grad, BR: tl.constexpr, BE: tl.constexpr, E):
    """Add grad [BR, BE] into rows first..first+BR of this head's d r_k accumulator (rows in [0, P) only: first = P
    adds nothing)."""
    rows = first + tl.arange(0, BR)
    cols = tl.arange(0, BE)
    ok = ((rows >= 0) & (rows < P))[:, None] & (cols < E)[None, :]
    tl.atomic_add(dr_ptr + rows[:, None] * s_dp + cols[None, :] * s_de, grad, mask=ok, sem="relaxed")


@triton.jit
def bwd_q_kernel(
    q_ptr, k_ptr, v_ptr, r_ptr, u_ptr, w_ptr, struct_ptr, kv_ptr, span_ptr, do_ptr, lse_ptr, dl_ptr,
    dq_ptr, du_ptr, dw_ptr, dr_ptr,
    s_qb, s_qq, s_qh, s_qe, s_kb, s_kk, s_kh, s_ke, s_vb, s_vk, s_vh, s_ve, s_rp, s_rh, s_re, s_uh, s_ue, s_wh, s_we,
    s_sq, s_kvb, s_nb, s_nt,
    s_gb, s_gq, s_gh, s_ge, s_zb, s_zq, s_zh,
    s_dqb, s_dqq, s_dqh, s_dqe, s_pb, s_pq, s_ph, s_pe, s_dg, s_dp, s_dh, s_de,
    H, Qn, Kn, P, E, n_qt, offset, scale, GROUPS,
    SIGN: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr, PREC: tl.constexpr,
):
    """One program per (lane, head, query tile): dq over the live key tiles, this tile's share of the bias
    gradients (du, dw partials [B, n_qt, H, E], summed by torch after the launch), and the band gradients of d r_k.

    The band is handled as two halves of BK slots, lo = [base, base + BK) and hi = [base + BK, base + 2BK) (BQ = BK,
    so the 2BK - 1 slots fit). Consecutive key tiles of the span shift the band by exactly BK, so a
    half is shared by two neighbouring tiles: SIGN +1 moves the band down (tile kt + 1's hi = tile kt's lo), SIGN -1
    up (tile kt + 1's lo = tile kt's hi). The shared half is carried to the next tile and added there, so each slot
    leaves the program in one atomic add, not two (half the atomics into d r_k, one atomic site per tile). d r_k is
    accumulated in fp32 in GROUPS copies (this program adds into copy (b * n_qt + qt) % GROUPS) so that programs
    collide less (attention_triton.DR_COPIES says why)."""
    pid = tl.program_id(0)
    qt = pid % n_qt
    bh = pid // n_qt
    b = bh // H
    h = bh % H
    q0 = qt * BQ
    DT = k_ptr.dtype.element_ty  # the products' dtype (a compile-time value)
    qu, qv = _queries(q_ptr + b * s_qb + h * s_qh, u_ptr + h * s_uh, w_ptr + h * s_wh, q0, Qn, s_qq, s_qe, s_ue,
                      s_we, E, scale, DT, BQ, BE)
    d_out = _rows(do_ptr + b * s_gb + h * s_gh, q0, Qn, s_gq, s_ge, E, BQ, BE).to(DT)
    lse = _vector(lse_ptr + b * s_zb + h * s_zh, q0, Qn, s_zq, BQ)
    dl = _vector(dl_ptr + b * s_zb + h * s_zh, q0, Qn, s_zq, BQ)
    k_base = k_ptr + b * s_kb + h * s_kh
    v_base = v_ptr + b * s_vb + h * s_vh
    r_base = r_ptr + h * s_rh
    dr_base = dr_ptr + ((b * n_qt + qt) % GROUPS) * s_dg + h * s_dh
    d_content = tl.zeros([BQ, BE], tl.float32)  # d qu
    d_position = tl.zeros([BQ, BE], tl.float32)  # d qv
    # With BQ = BK, a pair's band row t lies in [0, 2BK - 1): its half is t < BK (lo) or not (hi), its column in
    # that half t mod BK. Read the other way (band column x of a half, row ii), the key jj that feeds it is unique
    # and lies in exactly one half's range, so one gather of ds fills both halves.
    ii = tl.arange(0, BQ)[:, None]
    x = tl.arange(0, BK)[None, :]
    if SIGN > 0:  # t = ii - jj + BK - 1; inverted, jj = ii - x + BK - 1 (lo) or that minus BK (hi): the same form
        t = ii - x + (BK - 1)
        pos_column = t & (BK - 1)
        pos_low = t < BK
        key_column = pos_column
        key_low = pos_low
    else:  # t = jj - ii + BQ - 1; inverted, jj = x + ii - (BQ - 1) (lo) or that plus BK (hi)
        t = x - ii + (BQ - 1)
        pos_column = t & (BK - 1)
        pos_low = t < BK
        j = x + ii - (BQ - 1)
        key_column = j & (BK - 1)
        key_low = j >= 0
    first = tl.load(span_ptr + b * s_nb + qt * s_nt)
    end = tl.load(span_ptr + b * s_nb + qt * s_nt + 1)
    carry = tl.zeros([BK, BE], tl.float32)  # the previous tile's shared half, not yet added
    carry_first = P + first * 0  # its first slot; P (no row) before the first tile
    for kt in range(first, end):
        k0 = kt * BK
        k_tile = _rows(k_base, k0, Kn, s_kk, s_ke, E, BK, BE).to(DT)
        v_tile = _rows(v_base, k0, Kn, s_vk, s_ve, E, BK, BE).to(DT)
        base, _ = _band(q0, k0, offset, SIGN, BQ, BK)
        r_lo = _rows(r_base, base, P, s_rp, s_re, E, BK, BE).to(DT)
        r_hi = _rows(r_base, base + BK, P, s_rp, s_re, E, BK, BE).to(DT)
        pb_lo = tl.dot(qv, tl.trans(r_lo), input_precision=PREC)  # [BQ, BK] slots base + tb
        pb_hi = tl.dot(qv, tl.trans(r_hi), input_precision=PREC)  # [BQ, BK] slots base + BK + tb
        position = tl.where(pos_low, tl.gather(pb_lo, pos_column, 1), tl.gather(pb_hi, pos_column, 1))
        s = tl.dot(qu, tl.trans(k_tile), input_precision=PREC) + position
        ok = _allowed(struct_ptr, s_sq, kv_ptr + b * s_kvb, q0, k0, Qn, Kn, BQ, BK)
        p = tl.exp2(tl.where(ok, s * LOG2E, float("-inf")) - (lse * LOG2E)[:, None])
        dp = tl.dot(d_out, tl.trans(v_tile), input_precision=PREC)
        ds = p * (dp - dl[:, None])  # [BQ, BK] d s
        d_content += tl.dot(ds.to(DT), k_tile, input_precision=PREC)
        # d pb: ds moved to the band, row by row (a row's slots are distinct, so nothing is summed here).
        moved = tl.gather(ds, key_column, 1)  # [BQ, BK]
        g_lo = tl.where(key_low, moved, 0.0).to(DT)
        g_hi = tl.where(key_low, 0.0, moved).to(DT)
        d_position += tl.dot(g_lo, r_lo, input_precision=PREC) + tl.dot(g_hi, r_hi, input_precision=PREC)
        dr_lo = tl.dot(tl.trans(g_lo), qv, input_precision=PREC)  # [BK, BE] d R[base + tb]
        dr_hi = tl.dot(tl.trans(g_hi), qv, input_precision=PREC)  # [BK, BE] d R[base + BK + tb]
        if SIGN > 0:  # lo is shared with the next tile, hi with the previous one
            shared, shared_first, done, done_first = dr_lo, base, dr_hi, base + BK
        else:
            shared, shared_first, done, done_first = dr_hi, base + BK, dr_lo, base
        done += carry  # the same slots (zeros before the first tile)
        _flush(dr_base, done_first, P, s_dp, s_de, done, BK, BE, E)
        carry = shared
        carry_first = shared_first
    _flush(dr_base, carry_first, P, s_dp, s_de, carry, BK, BE, E)
    rows = q0 + tl.arange(0, BQ)
    cols = tl.arange(0, BE)
    keep = (rows < Qn)[:, None] & (cols < E)[None, :]
    d_content = d_content * scale
    d_position = d_position * scale
    tl.store(dq_ptr + b * s_dqb + h * s_dqh + rows[:, None] * s_dqq + cols[None, :] * s_dqe,
             (d_content + d_position).to(dq_ptr.dtype.element_ty), mask=keep)
    # Padded rows hold zeros (ds is 0 there), so the column sums are this tile's share of d u and d v.
    part = b * s_pb + qt * s_pq + h * s_ph + tl.arange(0, BE) * s_pe
    tl.store(du_ptr + part, tl.sum(d_content, 0), mask=tl.arange(0, BE) < E)
    tl.store(dw_ptr + part, tl.sum(d_position, 0), mask=tl.arange(0, BE) < E)

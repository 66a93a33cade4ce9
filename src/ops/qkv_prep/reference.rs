//! Host side of the qkv_prep family: the model's per-token steps (`model::reference`, the oracle) run over one
//! row each, the window ring slot rule, and the indexer query encoding (e4m3 codes + the head scale folded into
//! the weight) the kernel writes. Every function takes the values a kernel reads (BF16 inputs as f32).

use anyhow::{ensure, Result};

use crate::formats::{e4m3, kv, mxfp4, ue8m0};
use crate::model::numerics::{fp4_sim_inplace, RopeTable};
use crate::model::reference::{
    indexer_head_weights, indexer_q_rotate, q_head_scale_rope, q_heads_finish, window_kv_rope,
    window_kv_rope_with,
};

use super::{ENTRY_BYTES, HEAD_DIM, INDEX_HEAD_DIM, NOPE_DIM, ROPE_DIM};

/// The pool entry [`super::kv_entries`] writes row `row` (at `position`) to, or `None` when it writes nothing:
/// `seq_base[row / tokens_per_seq] + position % window` when the position and base are >= 0 and the entry is
/// inside a pool of `n_entries`.
pub fn ring_slot(
    seq_base: &[i32],
    tokens_per_seq: usize,
    window: usize,
    n_entries: usize,
    row: usize,
    position: i32,
) -> Option<usize> {
    let base = seq_base[row / tokens_per_seq];
    if position < 0 || base < 0 {
        return None;
    }
    let slot = base as usize + position as usize % window;
    (slot < n_entries).then_some(slot)
}

/// The model's query heads of one row ([`q_heads_finish`]: the per-head factor
/// [`head_rms_scale_bf16`](crate::model::numerics::head_rms_scale_bf16), the official BF16 op order).
pub fn q_heads_row(q_row: &[f32], position: usize, rope: &RopeTable, eps: f32) -> Vec<f32> {
    let mut q = q_row.to_vec();
    q_heads_finish(&mut q, HEAD_DIM, NOPE_DIM, rope, position, eps);
    q
}

/// The model's query-head steps of one row with the per-head factors `rstd[h]` given ([`q_head_scale_rope`]):
/// what the kernel computes after its factor (which differs from the model's only where its f32 sum of squares
/// and the model's f64 one round the mean to different BF16 values).
pub fn q_heads_row_with(
    q_row: &[f32],
    rstd: &[f32],
    position: usize,
    rope: &RopeTable,
) -> Vec<f32> {
    let mut q = q_row.to_vec();
    for (qh, &inv) in q.chunks_exact_mut(HEAD_DIM).zip(rstd) {
        q_head_scale_rope(qh, NOPE_DIM, inv, rope, position);
    }
    q
}

fn entry_of(x: &[f32]) -> Result<[u8; ENTRY_BYTES]> {
    let x: &[f32; HEAD_DIM] = x.try_into().expect("a window KV vector has 512 dims");
    kv::encode_entry(x)
}

/// The model's window KV of one row ([`window_kv_rope`], f64 `inv_rms`) encoded as a cache entry.
pub fn kv_entry_row(
    kv_row: &[f32],
    kv_norm: &[f32],
    position: usize,
    rope: &RopeTable,
    eps: f32,
) -> Result<[u8; ENTRY_BYTES]> {
    entry_of(&window_kv_rope(
        kv_row, kv_norm, NOPE_DIM, rope, position, eps,
    ))
}

/// [`kv_entry_row`] with the RMS factor given ([`window_kv_rope_with`]).
pub fn kv_entry_row_with(
    kv_row: &[f32],
    kv_norm: &[f32],
    rstd: f32,
    position: usize,
    rope: &RopeTable,
) -> Result<[u8; ENTRY_BYTES]> {
    entry_of(&window_kv_rope_with(
        kv_row, kv_norm, rstd, NOPE_DIM, rope, position,
    ))
}

/// The model's indexer query of one row: per head [`indexer_q_rotate`] then FP4 simulation per 32, and the head
/// weights ([`indexer_head_weights`]); what `Model::attn_projections` returns as `(qi, w)`.
pub fn indexer_model_row(
    qi_row: &[f32],
    w_row: &[f32],
    position: usize,
    rope: &RopeTable,
    w_scale: f32,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let mut qi = qi_row.to_vec();
    for qh in qi.chunks_exact_mut(INDEX_HEAD_DIM) {
        indexer_q_rotate(qh, ROPE_DIM, rope, position);
        fp4_sim_inplace(qh, mxfp4::BLOCK)?;
    }
    let mut w = w_row.to_vec();
    indexer_head_weights(&mut w, w_scale);
    Ok((qi, w))
}

/// The indexer query as the kernel writes it for one row: e4m3 codes `[heads, 128]` and f32 weights `[heads]`.
/// Per head, with `K` the largest FP4 block scale code (`mxfp4::scale_code` of the block amax before the FP4
/// simulation) the head scale code is `hc = max(K - 6, 1)`: codes `e4m3(f * 2^(127 - hc))` of the FP4-simulated
/// values `f`, weight `w * 2^(hc - 127)` (identities at the top of kernels/qkv_prep.cu).
pub fn indexer_query_row(
    qi_row: &[f32],
    w_row: &[f32],
    position: usize,
    rope: &RopeTable,
    w_scale: f32,
) -> Result<(Vec<u8>, Vec<f32>)> {
    let heads = w_row.len();
    ensure!(
        qi_row.len() == heads * INDEX_HEAD_DIM,
        "qi row has {} values, expected {heads} x {INDEX_HEAD_DIM}",
        qi_row.len()
    );
    let mut codes = Vec::with_capacity(qi_row.len());
    let mut w = w_row.to_vec();
    indexer_head_weights(&mut w, w_scale);
    for (qh, wh) in qi_row.chunks_exact(INDEX_HEAD_DIM).zip(&mut w) {
        let mut x = qh.to_vec();
        indexer_q_rotate(&mut x, ROPE_DIM, rope, position);
        let k = x
            .chunks_exact(mxfp4::BLOCK)
            .map(|b| mxfp4::scale_code(b.iter().fold(0.0f32, |m, v| m.max(v.abs()))))
            .max()
            .expect("a head has blocks");
        fp4_sim_inplace(&mut x, mxfp4::BLOCK)?;
        let hc = head_scale_code(k);
        let inv = ue8m0::decode(254 - hc);
        codes.extend(x.iter().map(|&f| e4m3::encode_rne(f * inv)));
        *wh *= ue8m0::decode(hc);
    }
    Ok((codes, w))
}

/// The head scale code of the indexer query from the largest FP4 block scale code `k`: `max(k - 6, 1)`.
pub fn head_scale_code(k: u8) -> u8 {
    k.saturating_sub(6).max(1)
}

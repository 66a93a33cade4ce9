//! Glue between the compressor kernels and the CPU model (the oracle is `model::reference`: `CompressorState`,
//! `pool_softmax`, `Model::compressor_inputs` / `finalize_entry`; nothing is re-derived here): the device state
//! layout of a CPU state, a layer's compressor weights, and the decoding of stored entries.

use anyhow::{bail, ensure, Result};

use super::{CompressorKind, CompressorShape, INDEX_DIM, MAIN_DIM};
use crate::formats::{indexer_key, kv};
use crate::model::config::LayerKind;
use crate::model::reference::{CompressorState, Which};
use crate::model::Model;
use crate::ops::indexer::KeyFormat;

/// The device state of one sequence for a CPU state: `kv` then `score` (the layout the kernels keep).
pub fn host_state(st: &CompressorState) -> Vec<f32> {
    let mut v = Vec::with_capacity(st.kv.len() + st.score.len());
    v.extend_from_slice(&st.kv);
    v.extend_from_slice(&st.score);
    v
}

/// The shape of a CPU state (kind from its overlap and dim; an indexer state gets `format`).
pub fn shape_of(st: &CompressorState, format: KeyFormat) -> Result<CompressorShape> {
    let kind = match (st.overlap, st.dim) {
        (true, MAIN_DIM) => CompressorKind::CsaMain,
        (false, MAIN_DIM) => CompressorKind::HcaMain,
        (true, INDEX_DIM) => CompressorKind::CsaIndex(format),
        (o, d) => bail!("compressor: no kernel for a state with overlap {o} and d = {d}"),
    };
    Ok(CompressorShape {
        kind,
        ratio: st.ratio,
    })
}

/// A layer's compressor as the model defines it: its shape and host weights (ape `[m, W]`, norm `[d]`, the
/// layer's RoPE frequencies, eps).
pub struct LayerCompressor {
    pub shape: CompressorShape,
    pub which: Which,
    pub ape: Vec<f32>,
    pub norm: Vec<f32>,
    pub freqs: Vec<f64>,
    pub eps: f32,
}

/// The compressor `kind` of `layer` of `model` (CSA main / indexer need a CSA layer, HCA main an HCA layer).
pub fn layer_compressor(
    model: &Model,
    layer: usize,
    kind: CompressorKind,
) -> Result<LayerCompressor> {
    let cfg = model.config();
    let lk = cfg.layer_kind(layer);
    let (ratio, which, prefix) = match (lk, kind) {
        (LayerKind::Csa { ratio }, CompressorKind::CsaMain)
        | (LayerKind::Hca { ratio }, CompressorKind::HcaMain) => (
            ratio,
            Which::Main,
            format!("layers.{layer}.attn.compressor"),
        ),
        (LayerKind::Csa { ratio }, CompressorKind::CsaIndex(_)) => (
            ratio,
            Which::Indexer,
            format!("layers.{layer}.attn.indexer.compressor"),
        ),
        _ => bail!(
            "compressor: layer {layer} ({lk:?}) has no {} compressor",
            kind.name()
        ),
    };
    let shape = CompressorShape { kind, ratio };
    ensure!(
        cfg.rope_head_dim == super::ROPE_DIMS,
        "compressor: rope_head_dim {} (the kernels rotate {})",
        cfg.rope_head_dim,
        super::ROPE_DIMS
    );
    let dim = match which {
        Which::Main => cfg.head_dim,
        Which::Indexer => cfg.index_head_dim,
    };
    ensure!(
        dim == kind.dim(),
        "compressor: the model's {} compressor has d = {dim}, the kernel {}",
        kind.name(),
        kind.dim()
    );
    Ok(LayerCompressor {
        shape,
        which,
        ape: model.weights.vector(&format!("{prefix}.ape"))?,
        norm: model.weights.vector(&format!("{prefix}.norm.weight"))?,
        freqs: model.rope(layer).freqs.clone(),
        eps: cfg.norm_eps,
    })
}

/// The values a stored entry decodes to (KV entry: 512 dims; indexer key: 128 dims).
pub fn decode_stored(kind: CompressorKind, entry: &[u8]) -> Result<Vec<f32>> {
    Ok(match kind {
        CompressorKind::CsaMain | CompressorKind::HcaMain => kv::decode_entry(entry)?.to_vec(),
        CompressorKind::CsaIndex(KeyFormat::Fp8) => indexer_key::decode_fp8(entry)?.to_vec(),
        CompressorKind::CsaIndex(KeyFormat::Mxfp4) => indexer_key::decode_mxfp4(entry)?.to_vec(),
    })
}

/// What a stored entry must decode to, given `finalize_entry`'s values: the values themselves where the cache
/// format holds them exactly (KV entry: FP8-simulated nope dims and BF16 rope dims; MXFP4 key: FP4-simulated
/// values), the FP8 key codec's round trip otherwise (its f32 scale is not a power of two).
pub fn expected_stored(kind: CompressorKind, finalized: &[f32]) -> Result<Vec<f32>> {
    Ok(match kind {
        CompressorKind::CsaIndex(KeyFormat::Fp8) => {
            let x: &[f32; indexer_key::DIMS] = finalized.try_into().map_err(|_| {
                anyhow::anyhow!("compressor: indexer key of {} values", finalized.len())
            })?;
            indexer_key::decode_fp8(&indexer_key::encode_fp8(x)?)?.to_vec()
        }
        _ => finalized.to_vec(),
    })
}

/// One stored entry of a cache laid out as the kernels write it: the KV pool's entry `slot`, or the key cache's
/// codes and scales of `slot` joined into the `formats::indexer_key` entry.
pub fn entry_bytes_at(kind: CompressorKind, codes: &[u8], scales: &[u8], slot: usize) -> Vec<u8> {
    match kind {
        CompressorKind::CsaMain | CompressorKind::HcaMain => {
            codes[slot * kv::ENTRY_BYTES..(slot + 1) * kv::ENTRY_BYTES].to_vec()
        }
        CompressorKind::CsaIndex(f) => {
            let cb = f.code_bytes();
            let mut e = codes[slot * cb..(slot + 1) * cb].to_vec();
            e.extend_from_slice(&scales[slot * 4..(slot + 1) * 4]);
            e
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_state_is_kv_then_score() {
        let mut st = CompressorState::new(4, true, INDEX_DIM);
        let kvr: Vec<f32> = (0..2 * INDEX_DIM).map(|i| i as f32).collect();
        let g: Vec<f32> = (0..2 * INDEX_DIM).map(|i| -(i as f32)).collect();
        st.push(1, &kvr, &g);
        let v = host_state(&st);
        let shape = shape_of(&st, KeyFormat::Fp8).unwrap();
        assert_eq!(v.len(), shape.state_floats());
        let w = shape.width();
        // Token 1 of a CSA state sits at row m + 1.
        assert_eq!(v[5 * w + 3], 3.0);
        assert_eq!(v[shape.rows() * w + 5 * w + 3], -3.0);
        assert_eq!(v[0], 0.0);
        assert_eq!(v[shape.rows() * w], f32::NEG_INFINITY);
    }
}

/// Host twin of [`super::chunk`] (kernels/compressor.cu, `chunk_entries_body` / `chunk_state_body`): `n` tokens at
/// positions `p0..p0 + n` with inputs `kv` and `score` (`[n, W]` each; the score is gate + ape, as
/// [`CompressorState::push`] takes it) continuing `st` (as p0 pushes left it). Returns each emitted entry `(j,
/// pooled)` in order and leaves `st` as n pushes would: the kernels' token lookup (the chunk's rows from p0, the
/// state's current block and, CSA, previous block below), their pooling sources in the push's order and their state
/// rows, restated so that a CPU test can hold them against [`CompressorState::push`].
pub fn chunk_host(
    st: &mut CompressorState,
    p0: usize,
    kv: &[f32],
    score: &[f32],
) -> Vec<(usize, Vec<f32>)> {
    let (m, d, overlap) = (st.ratio, st.dim, st.overlap);
    let w = if overlap { 2 * d } else { d };
    let n = kv.len() / w;
    let done0 = (p0 / m) * m;
    let old = st.clone();
    // Token t's (kv, score) rows, or None (empty).
    let token = |t: i64| -> Option<(&[f32], &[f32])> {
        if t >= p0 as i64 {
            let i = (t as usize - p0) * w;
            return Some((&kv[i..i + w], &score[i..i + w]));
        }
        let row = if t >= done0 as i64 {
            if overlap {
                m + t as usize - done0
            } else {
                t as usize - done0
            }
        } else if overlap && t >= 0 && t + m as i64 >= done0 as i64 {
            (t + m as i64 - done0 as i64) as usize
        } else {
            return None;
        };
        Some((
            &old.kv[row * w..(row + 1) * w],
            &old.score[row * w..(row + 1) * w],
        ))
    };
    let empty_kv = vec![0f32; w];
    let empty_sc = vec![f32::NEG_INFINITY; w];
    let src = |t: i64, off: usize| -> (&[f32], &[f32], usize) {
        match token(t) {
            Some((k, s)) => (k, s, off),
            None => (&empty_kv[..], &empty_sc[..], off),
        }
    };
    let end = p0 + n;
    let mut out = Vec::new();
    let mut j = p0 / m;
    while (j + 1) * m <= end {
        let sources: Vec<(&[f32], &[f32], usize)> = if overlap {
            (0..m)
                .map(|s| src(((j as i64) - 1) * m as i64 + s as i64, 0))
                .chain((0..m).map(|s| src((j * m + s) as i64, d)))
                .collect()
        } else {
            (0..m).map(|s| src((j * m + s) as i64, 0)).collect()
        };
        out.push((j, crate::model::reference::pool_softmax(d, &sources)));
        j += 1;
    }
    let done1 = (end / m) * m;
    let rows = if overlap { 2 * m } else { m };
    let mut set = |r: usize, t: Option<usize>| {
        let (k, s) = match t.and_then(|t| token(t as i64)) {
            Some((k, s)) => (k.to_vec(), s.to_vec()),
            None => (empty_kv.clone(), empty_sc.clone()),
        };
        st.kv[r * w..(r + 1) * w].copy_from_slice(&k);
        st.score[r * w..(r + 1) * w].copy_from_slice(&s);
    };
    for r in 0..m {
        let tb = (done1 + r < end).then_some(done1 + r);
        if overlap {
            set(r, (done1 > 0).then(|| done1 - m + r));
            set(m + r, tb);
        } else {
            set(r, tb);
        }
    }
    debug_assert!(rows <= st.kv.len() / w);
    out
}

#[cfg(test)]
mod chunk_tests {
    use super::*;

    /// [`chunk_host`] (the kernels' chunk logic) against [`CompressorState::push`] token by token: the same
    /// entries (bit for bit) and the same state, for chunks of every length at every start (CSA m = 4 overlapping,
    /// HCA m = 8), including chunks inside one block, ending on a block edge, and spanning several blocks.
    #[test]
    fn a_chunk_is_n_decode_pushes() {
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        };
        for (m, overlap) in [(4usize, true), (8, false), (3, true)] {
            let d = 8;
            let w = if overlap { 2 * d } else { d };
            let total = 40;
            let kv: Vec<f32> = (0..total * w).map(|_| rnd()).collect();
            let sc: Vec<f32> = (0..total * w).map(|_| rnd()).collect();
            let row = |t: usize| (t * w)..((t + 1) * w);
            for p0 in 0..total {
                for n in 1..=(total - p0).min(2 * m + 3) {
                    let mut want = CompressorState::new(m, overlap, d);
                    let mut got = CompressorState::new(m, overlap, d);
                    for t in 0..p0 {
                        want.push(t, &kv[row(t)], &sc[row(t)]);
                        got.push(t, &kv[row(t)], &sc[row(t)]);
                    }
                    let mut emitted = Vec::new();
                    for t in p0..p0 + n {
                        if let Some(p) = want.push(t, &kv[row(t)], &sc[row(t)]) {
                            emitted.push(((t + 1) / m - 1, p));
                        }
                    }
                    let out = chunk_host(
                        &mut got,
                        p0,
                        &kv[p0 * w..(p0 + n) * w],
                        &sc[p0 * w..(p0 + n) * w],
                    );
                    let what = format!("m {m} overlap {overlap} chunk {p0}+{n}");
                    assert_eq!(out.len(), emitted.len(), "{what}: entries");
                    for ((j, p), (wj, wp)) in out.iter().zip(&emitted) {
                        assert_eq!(j, wj, "{what}");
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(p), bits(wp), "{what}: entry {j}");
                    }
                    assert_eq!(host_state(&got), host_state(&want), "{what}: state");
                }
            }
        }
    }
}

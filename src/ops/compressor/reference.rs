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

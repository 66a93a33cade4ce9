//! `megamoe exec indexer`: logits + top-k on user tensors (GPU: the routed kernels, [`super::run`]; `--cpu`: the f64 reference
//! logits rounded to f32, then the reference top-k of those scores).

use anyhow::{ensure, Result};
use safetensors::Dtype;

use super::reference::{self, IndexerShape, KeyCacheHost, KeyFormat, HEAD_DIM, NUM_HEADS};
use super::{IndexerWorkspace, KeyCacheGpu, QueryBatch, TopkOutput, TOPK_MAX_K};
use crate::gpu::arena::Arena;
use crate::gpu::Gpu;
use crate::ops::exec::{input, ExecKernel, HostTensor, TensorMap};

const NAME: &str = "indexer";

/// The `exec indexer` entry.
pub fn exec_kernels() -> Vec<ExecKernel> {
    vec![ExecKernel {
        name: NAME,
        doc: "in: q U8|F8_E4M3 [rows, 64, 128] (e4m3 codes, Hadamard-rotated like the keys, no NaN code 0x7F/0xFF), \
              w F32 [rows, 64] (per-head weights with the q scale folded in, all finite), \
              num_valid I32 [rows] (visible entries per row, each 0..=capacity), \
              key_codes U8|F8_E4M3 [batch, capacity, 128] (FP8 keys, e4m3) or U8 [batch, capacity, 64] (MXFP4 keys, \
              e2m1 with dim 2i in the low nibble; the last axis picks the format), \
              key_scales F32 [batch, capacity] (FP8) or U8 [batch, capacity, 4] (MXFP4 ue8m0, one per 32 dims), \
              k I32 [1] (1..=2048). Shapes: batch >= 1, capacity >= 1, rows = batch * next_n with next_n in {1, 2} \
              (row b * next_n + t is token t of sequence b). \
              out: scores F32 [rows, capacity] (-inf past num_valid), indices I32 [rows, k] (score desc, lower index \
              first on ties, then -1), top_scores F32 [rows, k] (-inf on padding)",
        run: run_exec,
    }]
}

/// Validated `exec indexer` arguments (everything checked before any launch).
#[derive(Debug)]
pub struct ExecArgs {
    pub shape: IndexerShape,
    pub q: Vec<u8>,
    pub w: Vec<f32>,
    pub cache: KeyCacheHost,
    pub k: usize,
}

/// Parse and check the input tensors of `exec indexer` (no GPU involved).
pub fn parse_exec_inputs(inputs: &TensorMap) -> Result<ExecArgs> {
    let q = input(
        inputs,
        NAME,
        "q",
        &[Dtype::U8, Dtype::F8_E4M3],
        &[None, Some(NUM_HEADS), Some(HEAD_DIM)],
    )?;
    let rows = q.shape[0];
    let w = input(
        inputs,
        NAME,
        "w",
        &[Dtype::F32],
        &[Some(rows), Some(NUM_HEADS)],
    )?;
    let nv = input(inputs, NAME, "num_valid", &[Dtype::I32], &[Some(rows)])?;
    let codes = input(
        inputs,
        NAME,
        "key_codes",
        &[Dtype::U8, Dtype::F8_E4M3],
        &[None, None, None],
    )?;
    let (batch, capacity, code_bytes) = (codes.shape[0], codes.shape[1], codes.shape[2]);
    let format = match code_bytes {
        reference::FP8_CODE_BYTES => KeyFormat::Fp8,
        reference::MXFP4_CODE_BYTES if codes.dtype == Dtype::U8 => KeyFormat::Mxfp4,
        c => anyhow::bail!(
            "`{NAME}`: key_codes last axis is {c} ({:?}); expected 128 (FP8 e4m3) or 64 (MXFP4, U8)",
            codes.dtype
        ),
    };
    ensure!(
        batch > 0 && capacity > 0,
        "`{NAME}`: empty key cache [{batch}, {capacity}]"
    );
    let scales = match format {
        KeyFormat::Fp8 => input(
            inputs,
            NAME,
            "key_scales",
            &[Dtype::F32],
            &[Some(batch), Some(capacity)],
        )?,
        KeyFormat::Mxfp4 => input(
            inputs,
            NAME,
            "key_scales",
            &[Dtype::U8],
            &[Some(batch), Some(capacity), Some(4)],
        )?,
    };
    let kt = input(inputs, NAME, "k", &[Dtype::I32], &[Some(1)])?;
    let k = i32::from_le_bytes([kt.bytes[0], kt.bytes[1], kt.bytes[2], kt.bytes[3]]);
    ensure!(
        (1..=TOPK_MAX_K as i32).contains(&k),
        "`{NAME}`: k = {k}; supported 1..={TOPK_MAX_K}"
    );
    ensure!(
        rows % batch == 0 && (rows / batch == 1 || rows / batch == 2),
        "`{NAME}`: q has {rows} rows for {batch} sequences; rows must be batch x next_n with next_n in {{1, 2}}"
    );
    let next_n = rows / batch;
    let num_valid: Vec<i32> = nv
        .bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let w = w.to_f32()?;
    super::validate_queries(batch, next_n, &q.bytes, &w, &num_valid)?;
    if let Some(i) = num_valid.iter().position(|&n| n as usize > capacity) {
        anyhow::bail!(
            "`{NAME}`: num_valid[{i}] = {} exceeds the cache capacity {capacity}",
            num_valid[i]
        );
    }
    Ok(ExecArgs {
        shape: IndexerShape {
            batch,
            next_n,
            num_valid,
        },
        q: q.bytes.clone(),
        w,
        cache: KeyCacheHost {
            format,
            batch,
            capacity,
            codes: codes.bytes.clone(),
            scales: scales.bytes.clone(),
        },
        k: k as usize,
    })
}

fn run_exec(inputs: &TensorMap, gpu: Option<&Gpu>) -> Result<TensorMap> {
    let a = parse_exec_inputs(inputs)?;
    let rows = a.shape.batch * a.shape.next_n;
    let (cap, k) = (a.cache.capacity, a.k);
    let mut scores = vec![f32::NEG_INFINITY; rows * cap];
    let (indices, top_scores) = match gpu {
        Some(g) => {
            let cache = KeyCacheGpu::upload(g, &a.cache)?;
            let qb = QueryBatch::upload(
                g,
                a.shape.batch,
                a.shape.next_n,
                &a.q,
                &a.w,
                &a.shape.num_valid,
            )?;
            let stream = &g.stream;
            let mut arena = Arena::new(g, IndexerWorkspace::workspace_bytes(rows, cap, k))?;
            let ws = IndexerWorkspace::carve(&mut arena, stream, rows, cap, k)?;
            let out = TopkOutput::new(g, rows, k)?;
            super::run(g, stream, &qb, &cache, &ws, &out.idx, &out.score)?;
            let s = crate::gpu::arena::download(stream, &ws.scores)?;
            for r in 0..rows {
                let n = a.shape.num_valid[r] as usize;
                scores[r * cap..r * cap + n].copy_from_slice(&s[r * cap..r * cap + n]);
            }
            out.download(g)?
        }
        None => {
            let want = reference::logits(&a.shape, &a.q, &a.w, &a.cache);
            let (mut idx, mut ts) = (Vec::with_capacity(rows * k), Vec::with_capacity(rows * k));
            for (r, row) in want.iter().enumerate() {
                scores[r * cap..r * cap + row.len()].copy_from_slice(row);
                for i in reference::topk(row, k) {
                    idx.push(i);
                    ts.push(if i >= 0 {
                        reference::canonical_score(row[i as usize])
                    } else {
                        f32::NEG_INFINITY
                    });
                }
            }
            (idx, ts)
        }
    };
    let mut m = TensorMap::new();
    m.insert(
        "scores".into(),
        HostTensor::from_f32(vec![rows, cap], &scores),
    );
    m.insert(
        "indices".into(),
        HostTensor::from_u8(
            Dtype::I32,
            vec![rows, k],
            indices.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
    );
    m.insert(
        "top_scores".into(),
        HostTensor::from_f32(vec![rows, k], &top_scores),
    );
    Ok(m)
}

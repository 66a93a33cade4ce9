//! `megamoe exec` entries of the qkv_prep family. BF16 inputs may be given as F32 (rounded to BF16 first, on
//! both paths); `positions` I32 `[rows]` (< 0 = empty row: its outputs stay zero); `freqs` F64 `[32]` (the
//! layer's `RopeTable::freqs`). The CPU path runs the model's steps; the GPU path the kernels. Both compute the
//! query heads' RMS factor in the official BF16 op order and differ only where a head's mean of squares sits at
//! a BF16 rounding midpoint (f64 vs f32 sum); the KV's f32 factor comes from an f64 sum on the CPU and an f32
//! sum on the GPU, so its outputs may differ in a BF16 rounding.

use anyhow::{bail, Result};
use safetensors::Dtype;

use super::reference as r;
use super::{bench::EPS, ENTRY_BYTES, HEAD_DIM, INDEX_HEAD_DIM, ROPE_DIM};
use crate::formats::bf16 as fbf16;
use crate::gpu::Gpu;
use crate::model::numerics::RopeTable;
use crate::model::reference::indexer_weight_scale;
use crate::ops::exec::{input, ExecKernel, HostTensor, TensorMap};

const FLOATS: &[Dtype] = &[Dtype::F32, Dtype::BF16];

pub fn exec_kernels() -> Vec<ExecKernel> {
    vec![
        ExecKernel {
            name: "qkv_q_heads",
            doc: "Per-head q RMS (no weight) + RoPE on dims 448..511. in: q F32|BF16 [rows, heads, 512], positions I32 [rows], freqs F64 [32]. out: q BF16 [rows, heads, 512], rstd F32 [rows, heads] (the BF16 factor r: q = bf16(q_in * r) before RoPE)",
            run: run_q_heads,
        },
        ExecKernel {
            name: "qkv_kv_entries",
            doc: "Window KV: RMSNorm(kv; kv_norm) + RoPE + FP8 entry. in: kv F32|BF16 [rows, 512], kv_norm F32|BF16 [512], positions I32 [rows], freqs F64 [32]. out: entries U8 [rows, 584] (row r's entry; zero for empty rows)",
            run: run_kv_entries,
        },
        ExecKernel {
            name: "qkv_indexer_q",
            doc: "Indexer query: RoPE on dims 64..127, Hadamard, FP4 sim per 32 -> e4m3 codes with the head scale folded into w. in: qi F32|BF16 [rows, heads, 128], w F32|BF16 [rows, heads] (weights_proj out), positions I32 [rows], freqs F64 [32]. out: q F8_E4M3 [rows, heads, 128], w F32 [rows, heads]",
            run: run_indexer_q,
        },
    ]
}

fn bf16_values(
    inputs: &TensorMap,
    k: &str,
    name: &str,
    shape: &[Option<usize>],
) -> Result<(Vec<f32>, Vec<usize>)> {
    let t = input(inputs, k, name, FLOATS, shape)?;
    let v: Vec<f32> = t.to_f32()?.iter().map(|&x| fbf16::round(x)).collect();
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        bail!("`{k}`: `{name}` has a non-finite value at index {i}");
    }
    Ok((v, t.shape.clone()))
}

fn positions(inputs: &TensorMap, k: &str, rows: usize) -> Result<Vec<i32>> {
    let t = input(inputs, k, "positions", &[Dtype::I32], &[Some(rows)])?;
    Ok(t.bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn rope(inputs: &TensorMap, k: &str) -> Result<RopeTable> {
    let t = input(inputs, k, "freqs", &[Dtype::F64], &[Some(ROPE_DIM / 2)])?;
    let freqs = t
        .bytes
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    Ok(RopeTable { freqs })
}

fn run_q_heads(inputs: &TensorMap, gpu: Option<&Gpu>) -> Result<TensorMap> {
    let k = "qkv_q_heads";
    let (q, shape) = bf16_values(inputs, k, "q", &[None, None, Some(HEAD_DIM)])?;
    let (rows, heads) = (shape[0], shape[1]);
    super::check_rows_heads(rows, heads)?;
    let pos = positions(inputs, k, rows)?;
    let rope = rope(inputs, k)?;
    let row_len = heads * HEAD_DIM;
    let (out, rstd) = match gpu {
        Some(g) => {
            let dq = g.upload(&fbf16::to_bf16_vec(&q))?;
            let dout = g.zeros::<half::bf16>(rows * row_len)?;
            let drstd = g.zeros::<f32>(rows * heads)?;
            let (dp, df) = (g.upload(&pos)?, g.upload(&rope.freqs)?);
            super::q_heads(g, &g.stream, &dq, &dp, &df, rows, heads, EPS, &dout, &drstd)?;
            let out: Vec<f32> = g.download(&dout)?.iter().map(|v| v.to_f32()).collect();
            (out, g.download(&drstd)?)
        }
        None => {
            let mut out = vec![0.0f32; rows * row_len];
            let mut rstd = vec![0.0f32; rows * heads];
            for (row, &p) in pos.iter().enumerate().filter(|(_, &p)| p >= 0) {
                let src = &q[row * row_len..(row + 1) * row_len];
                out[row * row_len..(row + 1) * row_len]
                    .copy_from_slice(&r::q_heads_row(src, p as usize, &rope, EPS));
                for (h, qh) in src.chunks_exact(HEAD_DIM).enumerate() {
                    rstd[row * heads + h] = crate::model::numerics::head_rms_scale_bf16(qh, EPS);
                }
            }
            (out, rstd)
        }
    };
    let mut m = TensorMap::new();
    m.insert(
        "q".into(),
        HostTensor::from_bf16(vec![rows, heads, HEAD_DIM], &fbf16::to_bf16_vec(&out)),
    );
    m.insert(
        "rstd".into(),
        HostTensor::from_f32(vec![rows, heads], &rstd),
    );
    Ok(m)
}

fn run_kv_entries(inputs: &TensorMap, gpu: Option<&Gpu>) -> Result<TensorMap> {
    let k = "qkv_kv_entries";
    let (kv, shape) = bf16_values(inputs, k, "kv", &[None, Some(HEAD_DIM)])?;
    let rows = shape[0];
    super::check_rows_heads(rows, 1)?;
    let (w, _) = bf16_values(inputs, k, "kv_norm", &[Some(HEAD_DIM)])?;
    let pos = positions(inputs, k, rows)?;
    let rope = rope(inputs, k)?;
    let entries = match gpu {
        Some(g) => {
            // Row r writes entry r: one ring of one slot per row.
            let base: Vec<i32> = (0..rows as i32).collect();
            let pool = g.zeros::<u8>(rows * ENTRY_BYTES)?;
            let (dkv, dw) = (
                g.upload(&fbf16::to_bf16_vec(&kv))?,
                g.upload(&fbf16::to_bf16_vec(&w))?,
            );
            let (dp, df, db) = (g.upload(&pos)?, g.upload(&rope.freqs)?, g.upload(&base)?);
            let drstd = g.zeros::<f32>(rows)?;
            let ring = super::WindowRing {
                pool: &pool,
                seq_base: &db,
                tokens_per_seq: 1,
                window: 1,
            };
            super::kv_entries(g, &g.stream, &dkv, &dw, &dp, &df, rows, EPS, &ring, &drstd)?;
            g.download(&pool)?
        }
        None => {
            let mut pool = vec![0u8; rows * ENTRY_BYTES];
            for (row, &p) in pos.iter().enumerate().filter(|(_, &p)| p >= 0) {
                let e = r::kv_entry_row(
                    &kv[row * HEAD_DIM..(row + 1) * HEAD_DIM],
                    &w,
                    p as usize,
                    &rope,
                    EPS,
                )?;
                pool[row * ENTRY_BYTES..(row + 1) * ENTRY_BYTES].copy_from_slice(&e);
            }
            pool
        }
    };
    let mut m = TensorMap::new();
    m.insert(
        "entries".into(),
        HostTensor::from_u8(Dtype::U8, vec![rows, ENTRY_BYTES], entries),
    );
    Ok(m)
}

fn run_indexer_q(inputs: &TensorMap, gpu: Option<&Gpu>) -> Result<TensorMap> {
    let k = "qkv_indexer_q";
    let (qi, shape) = bf16_values(inputs, k, "qi", &[None, None, Some(INDEX_HEAD_DIM)])?;
    let (rows, heads) = (shape[0], shape[1]);
    super::check_rows_heads(rows, heads)?;
    let (w, _) = bf16_values(inputs, k, "w", &[Some(rows), Some(heads)])?;
    let pos = positions(inputs, k, rows)?;
    let rope = rope(inputs, k)?;
    let scale = indexer_weight_scale(INDEX_HEAD_DIM, heads);
    let row_len = heads * INDEX_HEAD_DIM;
    let (codes, w_out) = match gpu {
        Some(g) => {
            // w is BF16 values (the model's weights_proj output); the kernel takes them as f32 and rounds, which
            // leaves a BF16 value unchanged.
            let (dq, dw) = (g.upload(&fbf16::to_bf16_vec(&qi))?, g.upload(&w)?);
            let (dp, df) = (g.upload(&pos)?, g.upload(&rope.freqs)?);
            let dcodes = g.zeros::<u8>(rows * row_len)?;
            let dwo = g.zeros::<f32>(rows * heads)?;
            super::indexer_q(
                g, &g.stream, &dq, &dw, &dp, &df, rows, heads, scale, &dcodes, &dwo, None,
            )?;
            (g.download(&dcodes)?, g.download(&dwo)?)
        }
        None => {
            let mut codes = vec![0u8; rows * row_len];
            let mut w_out = vec![0.0f32; rows * heads];
            for (row, &p) in pos.iter().enumerate().filter(|(_, &p)| p >= 0) {
                let (c, wo) = r::indexer_query_row(
                    &qi[row * row_len..(row + 1) * row_len],
                    &w[row * heads..(row + 1) * heads],
                    p as usize,
                    &rope,
                    scale,
                )?;
                codes[row * row_len..(row + 1) * row_len].copy_from_slice(&c);
                w_out[row * heads..(row + 1) * heads].copy_from_slice(&wo);
            }
            (codes, w_out)
        }
    };
    let mut m = TensorMap::new();
    m.insert(
        "q".into(),
        HostTensor::from_u8(Dtype::F8_E4M3, vec![rows, heads, INDEX_HEAD_DIM], codes),
    );
    m.insert("w".into(), HostTensor::from_f32(vec![rows, heads], &w_out));
    Ok(m)
}

//! `megamoe exec sparse_attn_decode`: FP8 decode attention on user tensors (the kernel on the GPU, the
//! reference with the kernel's rounding points on `--cpu`). Every shape, range and NaN problem is reported
//! before anything is uploaded.

use anyhow::{ensure, Context, Result};
use half::bf16;
use safetensors::Dtype;

use super::reference::{self, DecodeProblem, QueryPrecision};
use super::{
    decode, DecodeInputs, DecodeShape, DecodeWorkspace, Path, SplitPlan, ENTRY_BYTES, HEAD_DIM,
    ROPE_DIM,
};
use crate::gpu::Gpu;
use crate::ops::exec::{input, ExecKernel, HostTensor, TensorMap};

pub const EXEC_NAME: &str = "sparse_attn_decode";

pub fn exec_kernels() -> Vec<ExecKernel> {
    vec![ExecKernel {
        name: EXEC_NAME,
        doc: "DSV4 decode attention over FP8 KV entries with sink and inverse RoPE (the routed path: \
              sparse_attn_decode_fp8, plus a split combine when the plan splits). Inputs: `q` BF16 [B, H, 512] \
              (finite; RoPE at the query position already on dims 448..512; 1 <= B <= 65535; H a positive multiple of \
              64), `pool` U8 [N, 584] (formats::kv entries; N >= 1 on the GPU), `candidates` I32 [B, S] (S >= 1; pool \
              indices in 0..N, -1 = invalid), `lengths` I32 [B] (0..=S: the first lengths[b] candidates of row b are \
              used), `positions` I32 [B] (query position, >= 0), `sinks` F32 [H] (not NaN), `freqs` F32 [32] (the \
              layer's RoPE frequencies, finite). Output: `out` BF16 [B, H, 512] (inverse RoPE applied to dims \
              448..512; a query with no valid candidate gives 0).",
        run,
    }]
}

fn i32s(t: &HostTensor) -> Vec<i32> {
    t.bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The call's tensors, checked: dtypes, shapes, and (through [`DecodeProblem::validate`]) lengths, pool
/// indices, positions and NaNs.
struct HostCall {
    shape: DecodeShape,
    q: Vec<bf16>,
    pool: Vec<u8>,
    candidates: Vec<i32>,
    lengths: Vec<i32>,
    positions: Vec<i32>,
    sinks: Vec<f32>,
    freqs: [f32; ROPE_DIM / 2],
}

impl HostCall {
    fn read(inputs: &TensorMap) -> Result<HostCall> {
        let k = EXEC_NAME;
        let qt = input(
            inputs,
            k,
            "q",
            &[Dtype::BF16],
            &[None, None, Some(HEAD_DIM)],
        )?;
        let (batch, heads) = (qt.shape[0], qt.shape[1]);
        let pt = input(inputs, k, "pool", &[Dtype::U8], &[None, Some(ENTRY_BYTES)])?;
        let n_entries = pt.shape[0];
        let ct = input(inputs, k, "candidates", &[Dtype::I32], &[Some(batch), None])?;
        let stride = ct.shape[1];
        let shape = DecodeShape {
            batch,
            heads,
            stride,
            n_entries,
        };
        shape.validate().with_context(|| {
            format!("`{k}`: q [{batch}, {heads}, 512], candidates [{batch}, {stride}]")
        })?;
        let lengths = i32s(input(inputs, k, "lengths", &[Dtype::I32], &[Some(batch)])?);
        let positions = i32s(input(
            inputs,
            k,
            "positions",
            &[Dtype::I32],
            &[Some(batch)],
        )?);
        let sinks = input(inputs, k, "sinks", &[Dtype::F32], &[Some(heads)])?.to_f32()?;
        let freqs: [f32; ROPE_DIM / 2] =
            input(inputs, k, "freqs", &[Dtype::F32], &[Some(ROPE_DIM / 2)])?
                .to_f32()?
                .try_into()
                .expect("shape checked: 32 elements");
        if let Some(i) = freqs.iter().position(|f| !f.is_finite()) {
            anyhow::bail!("`{k}`: freqs[{i}] = {} is not finite", freqs[i]);
        }
        let q: Vec<bf16> = qt
            .bytes
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
            .collect();
        let call = HostCall {
            shape,
            q,
            pool: pt.bytes.clone(),
            candidates: i32s(ct),
            lengths,
            positions,
            sinks,
            freqs,
        };
        call.problem()
            .validate()
            .with_context(|| format!("`{k}`: invalid inputs"))?;
        Ok(call)
    }

    fn problem(&self) -> DecodeProblem<'_> {
        DecodeProblem {
            batch: self.shape.batch,
            heads: self.shape.heads,
            q: &self.q,
            pool: &self.pool,
            candidates: &self.candidates,
            stride: self.shape.stride,
            lengths: &self.lengths,
            positions: &self.positions,
            sinks: &self.sinks,
            freqs: &self.freqs,
        }
    }
}

fn run(inputs: &TensorMap, gpu: Option<&Gpu>) -> Result<TensorMap> {
    let call = HostCall::read(inputs)?;
    let s = call.shape;
    let out: Vec<bf16> = match gpu {
        Some(g) => {
            ensure!(s.n_entries >= 1, "`{EXEC_NAME}`: the pool is empty");
            let d_q = g.upload(&call.q)?;
            let d_pool = g.upload(&call.pool)?;
            let d_cand = g.upload(&call.candidates)?;
            let d_len = g.upload(&call.lengths)?;
            let d_pos = g.upload(&call.positions)?;
            let d_sinks = g.upload(&call.sinks)?;
            let d_freqs = g.upload(&call.freqs)?;
            let inp = DecodeInputs {
                q: &d_q,
                pool: &d_pool,
                candidates: &d_cand,
                lengths: &d_len,
                positions: &d_pos,
                sinks: &d_sinks,
                freqs: &d_freqs,
            };
            let plan = SplitPlan::fp8(g.info.sm_count as usize, &s);
            let (_arena, ws) = DecodeWorkspace::with_arena(g, &s, plan, false)?;
            let mut d_out = g.poisoned::<bf16>(s.batch * s.heads * HEAD_DIM, 0xFF)?;
            let stream = g.stream.clone();
            decode(g, &stream, Path::Fp8, &s, &inp, &ws, &mut d_out)?;
            g.download(&d_out)?
        }
        None => reference::decode_attention(&call.problem(), QueryPrecision::Fp8Tiles)?
            .out
            .iter()
            .map(|&v| bf16::from_f64(v))
            .collect(),
    };
    let mut m = TensorMap::new();
    m.insert(
        "out".into(),
        HostTensor::from_bf16(vec![s.batch, s.heads, HEAD_DIM], &out),
    );
    Ok(m)
}

//! `megamoe exec moe_gemm_grouped`: the grouped GEMM on user tensors (contiguous layout, plain BF16 output), through
//! the same routed path as the benchmarks: the weights are tiled at upload
//! ([`DeviceExpertWeights::tiled`]), [`launch_partial`] takes the prefill mainloop on the tiled
//! weights or the decode mainloop (F16 operands for NVFP4 activations, BF16 operands for BF16 activations), then
//! the BF16 finish.

use anyhow::{ensure, Result};
use safetensors::Dtype;

use super::reference::{self, Activations, ExpertWeights, Grouping, Nvfp4Rows};
use super::*;
use crate::ops::exec::{input, ExecKernel, HostTensor, TensorMap};

const NAME: &str = "moe_gemm_grouped";

pub fn exec_kernels() -> Vec<ExecKernel> {
    vec![ExecKernel {
        name: NAME,
        doc: "D[m, n] = gsa[m] * gsb[e, n] * sum_k A[m, k] * B[e, n, k], rows of A sorted by expert (row m of \
              A belongs to expert e when offsets[e] <= m < offsets[e+1]). Inputs: w_codes U8 [E, N, K/2] (e2m1, \
              low nibble first), w_scales U8 or F8_E4M3 [E, N, K/16] (e4m3 block scales, no NaN code), w_global \
              F32 [E, N] (finite, > 0), offsets I32 [E+1] (offsets[0] = 0, non-decreasing; R = offsets[E]); and \
              A as either `a` BF16 [R', K] (finite; gsa = 1) or `a_codes` U8 [R', K/2] + `a_scales` U8 or \
              F8_E4M3 [R', K/16] + `a_global` F32 [R'] (finite, > 0), with R' >= R. 1 <= E <= 512, \
              N % 256 == 0 (the weights' tiling), K % 512 == 0. The GPU runs the \
              routed mainloops on the tiled weights as the benchmarks do. Output: d BF16 [R, N] (GPU) or F32 [R, N] (--cpu, the f64 reference rounded to f32).",
        run,
    }]
}

fn bytes_u8(t: &HostTensor) -> Vec<u8> {
    t.bytes.clone()
}

fn f32s(t: &HostTensor) -> Result<Vec<f32>> {
    t.to_f32()
}

fn i32s(t: &HostTensor) -> Vec<i32> {
    t.bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn run(inputs: &TensorMap, gpu: Option<&Gpu>) -> Result<TensorMap> {
    let u8s = [Dtype::U8, Dtype::F8_E4M3];
    let wc = input(inputs, NAME, "w_codes", &[Dtype::U8], &[None, None, None])?;
    let (e, n, k) = (wc.shape[0], wc.shape[1], wc.shape[2] * 2);
    check_gemm_shape(n, k)?;
    let ws = input(
        inputs,
        NAME,
        "w_scales",
        &u8s,
        &[Some(e), Some(n), Some(k / 16)],
    )?;
    let wg = input(inputs, NAME, "w_global", &[Dtype::F32], &[Some(e), Some(n)])?;
    let offsets = i32s(input(
        inputs,
        NAME,
        "offsets",
        &[Dtype::I32],
        &[Some(e + 1)],
    )?);
    let grouping = Grouping::Contiguous { offsets };
    grouping.validate()?;
    let rows = grouping.rows_total();
    let w = ExpertWeights {
        experts: e,
        n,
        k,
        rows: Nvfp4Rows {
            rows: e * n,
            cols: k,
            codes: bytes_u8(wc),
            scales: bytes_u8(ws),
            global: f32s(wg)?,
        },
    };
    w.validate()?;
    let a = if inputs.contains_key("a") {
        let t = input(inputs, NAME, "a", &[Dtype::BF16], &[None, Some(k)])?;
        let data = t
            .bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
            .collect();
        Activations::Bf16 {
            rows: t.shape[0],
            k,
            data,
        }
    } else {
        let c = input(inputs, NAME, "a_codes", &[Dtype::U8], &[None, Some(k / 2)])?;
        let r = c.shape[0];
        let s = input(inputs, NAME, "a_scales", &u8s, &[Some(r), Some(k / 16)])?;
        let g = input(inputs, NAME, "a_global", &[Dtype::F32], &[Some(r)])?;
        Activations::Nvfp4(Nvfp4Rows {
            rows: r,
            cols: k,
            codes: bytes_u8(c),
            scales: bytes_u8(s),
            global: f32s(g)?,
        })
    };
    ensure!(
        a.rows() >= rows,
        "{NAME}: A has {} rows, offsets span {rows}",
        a.rows()
    );
    if let Activations::Nvfp4(q) = &a {
        ensure!(
            q.global.iter().all(|g| g.is_finite() && *g > 0.0),
            "{NAME}: a_global must be finite and positive"
        );
        ensure!(
            q.scales.iter().all(|s| s & 0x7F != 0x7F),
            "{NAME}: a_scales holds a NaN e4m3 code"
        );
    }
    if let Activations::Bf16 { data, .. } = &a {
        ensure!(
            data.iter().all(|v| v.is_finite()),
            "{NAME}: A holds a non-finite value"
        );
    }
    let mut out = TensorMap::new();
    match gpu {
        None => {
            let (acc, _) = reference::grouped_gemm_acc_f64(&w, &a, &grouping)?;
            let d: Vec<f32> = reference::apply_global_scales(&acc, &w, &a, &grouping)
                .iter()
                .map(|v| *v as f32)
                .collect();
            out.insert("d".into(), HostTensor::from_f32(vec![rows, n], &d));
        }
        Some(gpu) => {
            let dw = DeviceExpertWeights::upload(gpu, &w)?;
            let dg = DeviceGrouping::upload(gpu, &grouping)?;
            let active = (0..e)
                .filter(|&x| !grouping.expert_rows(x).is_empty())
                .count()
                .max(1);
            let cfg = GemmConfig::choose(
                gpu.info.sm_count as usize,
                rows as f64 / active as f64,
                active,
                n,
                k,
            );
            let ws_shape = WorkspaceShape::for_launch(&dw, &dg, &cfg);
            let mut arena = Arena::new(gpu, workspace_bytes(&ws_shape))?;
            let ws = Workspace::carve(&mut arena, &ws_shape)?;
            let stream = gpu.stream.clone();
            let mut d = gpu.poisoned::<half::bf16>((rows * n).max(1), 0xFF)?;
            match &a {
                Activations::Bf16 { rows: r, data, .. } => {
                    let buf = gpu.upload(data)?;
                    let da = DeviceActivations::Bf16 {
                        rows: *r,
                        k,
                        data: &buf,
                    };
                    grouped_gemm_bf16(gpu, &stream, &dw, &da, &dg, &cfg, &ws, &mut d)?;
                }
                Activations::Nvfp4(q) => {
                    let (c, s, g) = (
                        gpu.upload(&q.codes)?,
                        gpu.upload(&q.scales)?,
                        gpu.upload(&q.global)?,
                    );
                    let da = DeviceActivations::Nvfp4 {
                        rows: q.rows,
                        k,
                        codes: &c,
                        scales: &s,
                        global: &g,
                    };
                    grouped_gemm_bf16(gpu, &stream, &dw, &da, &dg, &cfg, &ws, &mut d)?;
                }
            }
            let host = gpu.download(&d)?;
            out.insert(
                "d".into(),
                HostTensor::from_bf16(vec![rows, n], &host[..rows * n]),
            );
        }
    }
    Ok(out)
}

//! `megamoe exec` entries of the head family: `head_embed` (token ids -> the 4 mHC residual streams). The final
//! norm is mhc's `hc_head` entry (the same kernels).

use anyhow::{ensure, Result};
use half::bf16;
use safetensors::Dtype;

use super::{embed_tokens, EmbedShape, STREAMS};
use crate::gpu::Gpu;
use crate::ops::exec::{input, ExecKernel, HostTensor, TensorMap};

pub fn exec_kernels() -> Vec<ExecKernel> {
    vec![ExecKernel {
        name: "head_embed",
        doc: "embedding into the 4 mHC streams. in: ids I32 [T] (< 0: an empty row), embed BF16 [vocab, D]; T >= 1, D % 8 == 0, every id < vocab. out: X BF16 [T, 4, D], X[t][s] = embed[ids[t]] (zeros for an id < 0)",
        run: run_head_embed,
    }]
}

fn run_head_embed(inputs: &TensorMap, gpu: Option<&Gpu>) -> Result<TensorMap> {
    let k = "head_embed";
    let ids_t = input(inputs, k, "ids", &[Dtype::I32], &[None])?;
    let ids: Vec<i32> = ids_t
        .bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let table_t = input(inputs, k, "embed", &[Dtype::BF16], &[None, None])?;
    let (vocab, d) = (table_t.shape[0], table_t.shape[1]);
    let shape = EmbedShape {
        tokens: ids.len(),
        vocab,
        dim: d,
    };
    shape.check()?;
    if let Some(&bad) = ids.iter().find(|&&i| i >= 0 && i as usize >= vocab) {
        ensure!(false, "`{k}`: id {bad} outside the vocabulary (0..{vocab})");
    }
    let table: Vec<bf16> = table_t
        .bytes
        .chunks_exact(2)
        .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
        .collect();
    let x: Vec<bf16> = match gpu {
        Some(g) => {
            let di = g.upload(&ids)?;
            let dt = g.upload(&table)?;
            let dx = g.poisoned::<bf16>(ids.len() * STREAMS * d, 0xFF)?;
            let err = g.zeros::<u32>(1)?;
            embed_tokens(g, &g.stream, &di, &dt, &shape, &dx, &err)?;
            ensure!(g.download(&err)?[0] == 0, "`{k}`: the kernel flagged an id");
            g.download(&dx)?
        }
        None => {
            let mut x = Vec::with_capacity(ids.len() * STREAMS * d);
            for &id in &ids {
                let row: Vec<bf16> = if id < 0 {
                    vec![bf16::ZERO; d]
                } else {
                    table[id as usize * d..(id as usize + 1) * d].to_vec()
                };
                for _ in 0..STREAMS {
                    x.extend_from_slice(&row);
                }
            }
            x
        }
    };
    let mut m = TensorMap::new();
    m.insert(
        "X".into(),
        HostTensor::from_bf16(vec![ids.len(), STREAMS, d], &x),
    );
    Ok(m)
}

//! The CPU twin of the sampler's device state machine: one sequence's `model::sampler::generate` loop, one step
//! at a time, with the draws the kernel makes (a pure function of the seed and the step). The choice itself is the
//! CPU model's (`Sampler::sample_at`); only the bookkeeping of the device buffers lives here.

use anyhow::Result;

use super::{STATUS_FAILED, STATUS_MAX_TOKENS, STATUS_RUNNING, STATUS_STOPPED};
use crate::model::sampler::{Sampler, SamplerConfig, StopSet};

/// One sequence as the CPU model samples it.
pub struct CpuSequence {
    pub sampler: Sampler,
    pub max_new_tokens: usize,
    /// Prompt + generated tokens (the penalty's history).
    pub history: Vec<u32>,
    /// Generated tokens (the device's `steps` is their count).
    pub generated: Vec<u32>,
    /// The device's `status`.
    pub status: i32,
}

impl CpuSequence {
    pub fn new(
        config: SamplerConfig,
        max_new_tokens: usize,
        prompt: &[u32],
    ) -> Result<CpuSequence> {
        Ok(CpuSequence {
            sampler: Sampler::new(config)?,
            max_new_tokens,
            history: prompt.to_vec(),
            generated: Vec::new(),
            status: STATUS_RUNNING,
        })
    }

    /// One step of `generate` on `logits`: returns (`sampled`, `next`) as the kernel writes them.
    pub fn step(&mut self, logits: &[f32], stop: &StopSet) -> (i32, i32) {
        if self.status != STATUS_RUNNING {
            return (-1, -1);
        }
        if self.generated.len() >= self.max_new_tokens {
            self.status = STATUS_MAX_TOKENS;
            return (-1, -1);
        }
        let step = self.generated.len() as u64;
        let id = match self.sampler.sample_at(logits, &self.history, step) {
            Ok(id) => id,
            Err(_) => {
                // NaN logits: the CPU bails, the device marks the sequence failed.
                self.status = STATUS_FAILED;
                return (-1, -1);
            }
        };
        if stop.contains(id) {
            self.status = STATUS_STOPPED;
            return (id as i32, -1);
        }
        self.history.push(id);
        self.generated.push(id);
        (id as i32, id as i32)
    }
}

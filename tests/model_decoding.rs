//! Decoding hygiene (seeds Part A1/A2): stop set, repetition penalty over prompt + generated tokens,
//! sampler modes; the chat prompt ids (the tokenizer and the rendered prompts: tests/tokenizer.rs).

use anyhow::Result;
use megamoe::model::chat::{self, build_prompt, Role, SpecialTokens, Turn};
use megamoe::model::sampler::{
    apply_repetition_penalty, generate, LogitsSource, Sampler, SamplerConfig, StopReason, StopSet,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn test_seed(label: &str) -> u64 {
    megamoe::ops::inputs::fresh_seed(label, "MEGAMOE_SEED")
}

/// A scripted model: logits peaked on the next id of a script, then on `loop_id` forever.
struct Scripted {
    vocab: usize,
    script: Vec<u32>,
    loop_id: u32,
    calls: usize,
    noise: Vec<f32>,
}

impl Scripted {
    fn logits(&mut self) -> Vec<f32> {
        let id = self.script.get(self.calls).copied().unwrap_or(self.loop_id);
        self.calls += 1;
        let mut l = self.noise.clone();
        l[id as usize] += 8.0;
        l
    }
}

impl LogitsSource for Scripted {
    fn prefill(&mut self, _tokens: &[u32]) -> Result<Vec<f32>> {
        Ok(self.logits())
    }
    fn step(&mut self, token: u32) -> Result<Vec<f32>> {
        assert!((token as usize) < self.vocab);
        Ok(self.logits())
    }
}

fn noise(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
}

#[test]
fn a1_stop_token_outside_eos_token_id_still_stops() {
    let seed = test_seed("noise");
    let vocab = 128810;
    // The model answers 3 tokens then opens a new user turn (128803), which is not eos_token_id (1).
    let mut src = Scripted {
        vocab,
        script: vec![500, 501, 502, chat::USER_ID],
        loop_id: 77,
        calls: 0,
        noise: noise(seed, vocab),
    };
    let stop = StopSet::dsv4_chat(1, None);
    assert!(stop.contains(1) && stop.contains(chat::USER_ID) && stop.contains(chat::EOS_ID));
    let mut s = Sampler::new(SamplerConfig::greedy()).unwrap();
    let g = generate(&mut src, &[0, 10, 11], &mut s, &stop, 100).unwrap();
    assert_eq!(g.tokens, vec![500, 501, 502]);
    assert_eq!(
        g.stop,
        StopReason::StopToken {
            id: chat::USER_ID,
            name: chat::USER_TEXT.to_string()
        }
    );

    // With only eos_token_id in the set, the same model never stops and degenerates into the loop.
    let mut only_eos = StopSet::new();
    only_eos.insert(1, "eos_token_id");
    let mut src = Scripted {
        vocab,
        script: vec![500, 501, 502, chat::USER_ID],
        loop_id: 77,
        calls: 0,
        noise: noise(seed, vocab),
    };
    let g = generate(&mut src, &[0, 10, 11], &mut s, &only_eos, 20).unwrap();
    assert_eq!(g.stop, StopReason::MaxTokens);
    assert_eq!(g.tokens[3], chat::USER_ID);
    assert!(g.tokens[4..].iter().all(|&t| t == 77));

    // Configurable: removing the User token from the set, adding another id.
    let mut custom = StopSet::dsv4_chat(1, None);
    assert!(custom.remove(chat::USER_ID));
    custom.insert(502, "custom");
    let mut src = Scripted {
        vocab,
        script: vec![500, 501, 502],
        loop_id: 77,
        calls: 0,
        noise: noise(seed, vocab),
    };
    let g = generate(&mut src, &[0], &mut s, &custom, 20).unwrap();
    assert_eq!(
        g.stop,
        StopReason::StopToken {
            id: 502,
            name: "custom".into()
        }
    );
}

#[test]
fn a2_penalty_1_5_changes_a_looping_distribution() {
    let seed = test_seed("noise");
    let vocab = 64;
    // A looping model: logit margin of the loop token over the runner-up ~ small.
    let mut logits = noise(seed, vocab);
    for v in &mut logits {
        *v = *v * 0.1 + 1.0; // all positive around 1
    }
    let loop_id = 9u32;
    logits[loop_id as usize] = 2.0;
    logits[20] = 1.6; // runner-up: 2.0/1.1 > 1.6 > 2.0/1.5
    let runner_up = (0..vocab)
        .filter(|&i| i != loop_id as usize)
        .max_by(|&a, &b| logits[a].partial_cmp(&logits[b]).unwrap())
        .unwrap();
    let history: Vec<u32> = vec![3, 4, loop_id, loop_id, loop_id];

    let greedy = |pen: f32| {
        let s = Sampler::new(SamplerConfig {
            repetition_penalty: pen,
            ..SamplerConfig::greedy()
        })
        .unwrap();
        s.distribution(&logits, &history).unwrap()[0].0
    };
    assert_eq!(greedy(1.0), loop_id, "no penalty: the loop continues");
    assert_eq!(
        greedy(1.1),
        loop_id,
        "1.1 is too weak for this margin (2.0/1.1 > {})",
        logits[runner_up]
    );
    assert_eq!(
        greedy(1.5),
        runner_up as u32,
        "1.5 breaks the loop (2.0/1.5 < {})",
        logits[runner_up]
    );

    // Sampled: the loop token's probability drops.
    let p_loop = |pen: f32| {
        let s = Sampler::new(SamplerConfig {
            repetition_penalty: pen,
            temperature: 0.6,
            ..Default::default()
        })
        .unwrap();
        s.distribution(&logits, &history)
            .unwrap()
            .iter()
            .find(|(i, _)| *i == loop_id)
            .unwrap()
            .1
    };
    assert!(
        p_loop(1.5) < 0.5 * p_loop(1.0),
        "{} vs {}",
        p_loop(1.5),
        p_loop(1.0)
    );

    // Negative logits are multiplied (pushed down), positive divided.
    let mut l = vec![2.0, -2.0, 1.0];
    apply_repetition_penalty(&mut l, &[0, 1, 0], 2.0, 256);
    assert_eq!(l, vec![1.0, -4.0, 1.0]);
}

#[test]
fn a2_prompt_word_is_penalized_and_window_is_respected() {
    let vocab = 16;
    let mut logits = vec![0.5f32; vocab];
    let prompt_word = 7u32; // "capital" in the seeds' example
    logits[prompt_word as usize] = 3.0;
    logits[2] = 2.5;
    // The word appears only in the prompt; nothing generated yet.
    let prompt = vec![0u32, 5, prompt_word, 6];
    let s = Sampler::new(SamplerConfig {
        repetition_penalty: 1.5,
        ..SamplerConfig::greedy()
    })
    .unwrap();
    assert_eq!(
        s.distribution(&logits, &prompt).unwrap()[0].0,
        2,
        "prompt token penalized (3.0/1.5 < 2.5)"
    );
    // Outside the window (older than the last 2 tokens) it is not penalized.
    let s2 = Sampler::new(SamplerConfig {
        repetition_penalty: 1.5,
        penalty_window: 1,
        ..SamplerConfig::greedy()
    })
    .unwrap();
    assert_eq!(s2.distribution(&logits, &prompt).unwrap()[0].0, prompt_word);

    // Through generate(): the prompt is in the history the sampler sees from the first step.
    let mut src = Scripted {
        vocab,
        script: vec![],
        loop_id: prompt_word,
        calls: 0,
        noise: logits.clone(),
    };
    src.noise[prompt_word as usize] = 3.0 - 8.0; // Scripted adds 8 to the loop id
    let mut s3 = Sampler::new(SamplerConfig {
        repetition_penalty: 1.5,
        ..SamplerConfig::greedy()
    })
    .unwrap();
    let g = generate(&mut src, &prompt, &mut s3, &StopSet::new(), 1).unwrap();
    assert_eq!(g.tokens, vec![2]);
}

#[test]
fn sampler_modes_top_k_top_p_temperature_seed() {
    let seed = test_seed("noise");
    let logits = noise(seed, 50)
        .iter()
        .map(|v| v * 4.0)
        .collect::<Vec<f32>>();
    let mut order: Vec<usize> = (0..50).collect();
    order.sort_by(|&a, &b| logits[b].partial_cmp(&logits[a]).unwrap());
    let s = Sampler::new(SamplerConfig {
        temperature: 1.0,
        top_k: 5,
        ..Default::default()
    })
    .unwrap();
    let d = s.distribution(&logits, &[]).unwrap();
    assert_eq!(d.len(), 5);
    assert_eq!(
        d.iter().map(|x| x.0 as usize).collect::<Vec<_>>(),
        order[..5].to_vec()
    );
    let s = Sampler::new(SamplerConfig {
        temperature: 1.0,
        top_p: 0.5,
        ..Default::default()
    })
    .unwrap();
    let d = s.distribution(&logits, &[]).unwrap();
    let full = Sampler::new(SamplerConfig {
        temperature: 1.0,
        ..Default::default()
    })
    .unwrap()
    .distribution(&logits, &[])
    .unwrap();
    let mass_before: f32 = full[..d.len() - 1].iter().map(|x| x.1).sum();
    let mass_kept: f32 = full[..d.len()].iter().map(|x| x.1).sum();
    assert!(
        mass_before < 0.5 && mass_kept >= 0.5 - 1e-6,
        "{mass_before} {mass_kept}"
    );
    assert!((d.iter().map(|x| x.1).sum::<f32>() - 1.0).abs() < 1e-5);
    // Same seed, same draws; another seed, another sequence.
    let draws = |sd: u64| {
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            seed: sd,
            ..Default::default()
        })
        .unwrap();
        (0..64)
            .map(|_| s.sample(&logits, &[]).unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(draws(seed), draws(seed));
    assert_ne!(draws(seed), draws(seed ^ 0xFFFF));
    // Greedy: argmax.
    let g = Sampler::new(SamplerConfig::greedy())
        .unwrap()
        .distribution(&logits, &[])
        .unwrap();
    assert_eq!(g, vec![(order[0] as u32, 1.0)]);
    assert!(Sampler::new(SamplerConfig {
        top_p: 0.0,
        ..Default::default()
    })
    .is_err());
    assert!(Sampler::new(SamplerConfig::greedy())
        .unwrap()
        .distribution(&[f32::NAN], &[])
        .is_err());
}

/// The chat prompt over the DSV4 ids: BOS, system, `<User>` turns, an earlier reply as
/// `<Assistant></think>{reply}<eos>`, then `<Assistant>` and `</think>` (chat) or `<think>` (thinking). The same
/// prompts rendered as text against the real tokenizer: tests/tokenizer.rs.
#[test]
fn chat_prompt_over_dsv4_ids() {
    let sp4 = SpecialTokens::dsv4();
    let turns = [
        Turn {
            role: Role::User,
            tokens: vec![10, 11],
        },
        Turn {
            role: Role::Assistant,
            tokens: vec![12],
        },
        Turn {
            role: Role::User,
            tokens: vec![13],
        },
    ];
    let p = build_prompt(&sp4, &[], &turns, false).unwrap();
    assert_eq!(
        p,
        vec![0, 128803, 10, 11, 128804, 128822, 12, 1, 128803, 13, 128804, 128822]
    );
    let think = build_prompt(&sp4, &[7], &turns[..1], true).unwrap();
    assert_eq!(think, vec![0, 7, 128803, 10, 11, 128804, 128821]);
    assert!(
        build_prompt(&sp4, &[], &turns[..2], false).is_err(),
        "must end with a user turn"
    );
    assert!(build_prompt(&sp4, &[], &[], false).is_err(), "needs a turn");
    assert!(
        build_prompt(&sp4, &[], &turns[1..], false).is_err(),
        "user first"
    );
}

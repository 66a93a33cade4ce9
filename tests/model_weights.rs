//! Config parsing, the synthetic weight function, and the checkpoint layout (write, map, validate).

use megamoe::model::checkpoint::{load_weights, write_checkpoint, Checkpoint, INDEX_FILE};
use megamoe::model::weights::{
    element_bits, synthetic_uniform, tensor_key, tensor_manifest, StoredDtype,
};
use megamoe::model::{CachePolicy, LayerKind, Model, ModelConfig, Weights};
use std::path::PathBuf;

fn test_seed(label: &str) -> u64 {
    megamoe::ops::inputs::fresh_seed(label, "MEGAMOE_SEED")
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "megamoe-{tag}-{}-{}",
        std::process::id(),
        test_seed(tag)
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

const FLASH_LIKE_CONFIG: &str = r#"{
  "architectures": ["DeepseekV4ForCausalLM"], "bos_token_id": 0, "eos_token_id": 1,
  "compress_ratios": [0,0,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,0],
  "compress_rope_theta": 160000, "expert_dtype": "fp4", "hc_eps": 1e-06, "hc_mult": 4, "hc_sinkhorn_iters": 20,
  "head_dim": 512, "hidden_act": "silu", "hidden_size": 4096, "index_head_dim": 128, "index_n_heads": 64,
  "index_topk": 512, "max_position_embeddings": 1048576, "model_type": "deepseek_v4", "moe_intermediate_size": 2048,
  "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": true, "num_attention_heads": 64,
  "num_experts_per_tok": 6, "num_hash_layers": 3, "num_hidden_layers": 43, "num_key_value_heads": 1,
  "num_nextn_predict_layers": 1, "o_groups": 8, "o_lora_rank": 1024, "q_lora_rank": 1024, "qk_rope_head_dim": 64,
  "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
  "rms_norm_eps": 1e-06,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536, "type": "yarn"},
  "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": 128,
  "swiglu_limit": 10.0, "tie_word_embeddings": false, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
  "some_future_field": {"x": 1}, "vocab_size": 129280
}"#;

#[test]
fn config_json_reads_as_is_and_matches_builtin_flash() {
    let cfg = ModelConfig::from_json_str(FLASH_LIKE_CONFIG).unwrap();
    let flash = ModelConfig::flash();
    assert_eq!(
        ModelConfig {
            name: "flash".into(),
            ..cfg.clone()
        },
        flash
    );
    assert_eq!(cfg.mtp_compress_ratios, vec![0]);
    // Layer schedule counts (arch §1.1).
    let count = |c: &ModelConfig, f: &dyn Fn(LayerKind) -> bool| {
        (0..c.n_layers).filter(|&l| f(c.layer_kind(l))).count()
    };
    assert_eq!(count(&flash, &|k| k == LayerKind::SlidingWindow), 2);
    assert_eq!(
        count(&flash, &|k| matches!(k, LayerKind::Csa { ratio: 4 })),
        21
    );
    assert_eq!(
        count(&flash, &|k| matches!(k, LayerKind::Hca { ratio: 128 })),
        20
    );
    let pro = ModelConfig::pro();
    assert_eq!(
        count(&pro, &|k| matches!(k, LayerKind::Hca { ratio: 128 })),
        31
    );
    assert_eq!(
        count(&pro, &|k| matches!(k, LayerKind::Csa { ratio: 4 })),
        30
    );
    let small = ModelConfig::small();
    small.validate().unwrap();
    assert!((0..small.n_layers).any(|l| matches!(small.layer_kind(l), LayerKind::Csa { .. })));
    assert!(
        (0..small.n_layers).any(|l| matches!(small.layer_kind(l), LayerKind::Hca { ratio: 128 }))
    );

    // Missing required field: a clear error naming it.
    let missing = FLASH_LIKE_CONFIG.replace("\"o_groups\": 8,", "");
    let err = format!("{:#}", ModelConfig::from_json_str(&missing).unwrap_err());
    assert!(err.contains("o_groups"), "{err}");
    let bad = FLASH_LIKE_CONFIG.replace("\"hidden_size\": 4096", "\"hidden_size\": \"big\"");
    assert!(format!("{:#}", ModelConfig::from_json_str(&bad).unwrap_err()).contains("hidden_size"));
}

#[test]
fn manifest_shapes_match_the_flash_checkpoint() {
    let specs = tensor_manifest(&ModelConfig::flash());
    let get = |n: &str| {
        specs
            .iter()
            .find(|s| s.name == n)
            .unwrap_or_else(|| panic!("{n}"))
    };
    assert_eq!(get("layers.3.attn.wq_b.weight").shape, vec![32768, 1024]);
    assert_eq!(get("layers.3.attn.wq_b.scale").shape, vec![256, 8]);
    assert_eq!(get("layers.3.attn.wo_a.weight").shape, vec![8192, 4096]);
    assert_eq!(get("layers.2.attn.compressor.ape").shape, vec![4, 1024]);
    assert_eq!(get("layers.3.attn.compressor.ape").shape, vec![128, 512]);
    assert_eq!(
        get("layers.2.attn.indexer.compressor.wkv.weight").shape,
        vec![256, 4096]
    );
    let w1 = get("layers.5.ffn.experts.7.w1.weight");
    assert_eq!(
        (w1.dtype, w1.shape.clone()),
        (StoredDtype::I8, vec![2048, 2048])
    );
    assert_eq!(get("layers.5.ffn.experts.7.w2.scale").shape, vec![4096, 64]);
    assert_eq!(get("layers.0.ffn.gate.tid2eid").shape, vec![129280, 6]);
    assert!(!specs.iter().any(|s| s.name == "layers.3.ffn.gate.tid2eid"));
    assert!(!specs
        .iter()
        .any(|s| s.name == "layers.1.attn.compressor.ape"));
    assert_eq!(get("hc_head_fn").shape, vec![4, 16384]);
    // Dtype counts of the official checkpoint without MTP (CKSUM minus the MTP layer's share).
    let n = |d: StoredDtype| specs.iter().filter(|s| s.dtype == d).count();
    assert_eq!(n(StoredDtype::I8), 43 * 256 * 3);
    assert_eq!(n(StoredDtype::I64), 3);
}

#[test]
fn synthetic_weights_are_a_pure_function_of_seed_name_index() {
    let seed = test_seed("weights");
    let cfg = ModelConfig::small();
    let w = Weights::synthetic(cfg.clone(), seed, CachePolicy::Nothing).unwrap();
    // A row slice equals the same rows of the whole tensor, whatever was read before.
    let name = "layers.4.attn.wq_b.weight";
    let whole = w.matrix(name).unwrap();
    let part = w.dequant_rows(name, 130, 7).unwrap();
    assert_eq!(
        part.data,
        whole.data[130 * whole.cols..137 * whole.cols].to_vec()
    );
    let e = w
        .dequant_rows("layers.5.ffn.experts.3.w2.weight", 17, 2)
        .unwrap();
    let e_all = w.matrix("layers.5.ffn.experts.3.w2.weight").unwrap();
    assert_eq!(
        e.data,
        e_all.data[17 * e_all.cols..19 * e_all.cols].to_vec()
    );
    // The documented recipe reproduces a BF16 element.
    let nw = w.vector("layers.1.attn_norm.weight").unwrap();
    let i = (seed % 256) as usize;
    let u = synthetic_uniform(element_bits(
        tensor_key(seed, "layers.1.attn_norm.weight"),
        i as u64,
    ));
    assert_eq!(nw[i], half::bf16::from_f32(1.0 + 0.1 * u).to_f32());
    // Another seed changes the values; scales are powers of two near 1/sqrt(fan_in).
    let w2 = Weights::synthetic(ModelConfig::small(), seed ^ 1, CachePolicy::Nothing).unwrap();
    assert_ne!(w2.matrix(name).unwrap().data, whole.data);
    let rms =
        |v: &[f32]| (v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
    // wq_b's fan-in is q_lora_rank, expert w2's is moe_inter_dim.
    let target = 1.0 / (cfg.q_lora_rank as f64).sqrt();
    let r = rms(&whole.data);
    assert!(
        r > target / 2.0 && r < target * 2.0,
        "wq_b rms {r} vs target {target}"
    );
    let r = rms(&e_all.data);
    let target = 1.0 / (cfg.moe_inter_dim as f64).sqrt();
    assert!(
        r > target / 2.0 && r < target * 2.0,
        "expert w2 rms {r} vs target {target}"
    );
}

#[test]
fn checkpoint_roundtrip_in_the_official_layout() {
    let seed = test_seed("weights");
    let dir = tmpdir("ckpt");
    let cfg = ModelConfig::small();
    let synth = Weights::synthetic(cfg.clone(), seed, CachePolicy::All).unwrap();
    let shards = write_checkpoint(&synth, &dir, 3).unwrap();
    assert_eq!(shards.len(), 3);
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(INDEX_FILE)).unwrap()).unwrap();
    assert_eq!(
        index["weight_map"]["layers.2.ffn.experts.0.w1.scale"]
            .as_str()
            .map(|s| s.starts_with("model-")),
        Some(true)
    );

    let ck = Checkpoint::open(&dir, &cfg).unwrap();
    for spec in tensor_manifest(&cfg) {
        assert_eq!(
            ck.tensor_bytes(&spec.name).unwrap(),
            synth.raw(&spec.name).unwrap().as_slice(),
            "{}",
            spec.name
        );
    }
    // Decoding from the mapped checkpoint gives bit-identical logits.
    let a = Model::new(synth).unwrap();
    let b = Model::new(load_weights(&dir, Some(cfg.clone()), CachePolicy::All).unwrap()).unwrap();
    let (mut sa, mut sb) = (a.new_state(), b.new_state());
    for tk in [0u32, 17, 300] {
        assert_eq!(
            a.decode_step(&mut sa, tk).unwrap().logits,
            b.decode_step(&mut sb, tk).unwrap().logits
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn broken_checkpoints_are_clear_errors() {
    let seed = test_seed("weights");
    let cfg = ModelConfig {
        n_layers: 3,
        compress_ratios: vec![0, 4, 128],
        ..ModelConfig::small()
    };
    let synth = Weights::synthetic(cfg.clone(), seed, CachePolicy::Nothing).unwrap();
    let err_of = |dir: &std::path::Path| {
        format!(
            "{:#}",
            Checkpoint::open(dir, &cfg).err().expect("must fail")
        )
    };

    // Truncated shard.
    let dir = tmpdir("trunc");
    let shards = write_checkpoint(&synth, &dir, 2).unwrap();
    let len = std::fs::metadata(&shards[1]).unwrap().len();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&shards[1])
        .unwrap();
    f.set_len(len - 100).unwrap();
    let e = err_of(&dir);
    assert!(e.contains("not a valid safetensors file"), "{e}");
    std::fs::remove_dir_all(&dir).ok();

    // Config disagrees with the shapes (another geometry's checkpoint).
    let dir = tmpdir("shape");
    write_checkpoint(&synth, &dir, 1).unwrap();
    let other = ModelConfig {
        moe_inter_dim: 256,
        ..cfg.clone()
    };
    let e = format!(
        "{:#}",
        Checkpoint::open(&dir, &other).err().expect("must fail")
    );
    assert!(e.contains("the config expects"), "{e}");

    // Index names a tensor its shard does not hold.
    let idx_path = dir.join(INDEX_FILE);
    let mut idx: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&idx_path).unwrap()).unwrap();
    idx["weight_map"]["layers.9.attn.bogus"] =
        serde_json::json!("model-00001-of-00001.safetensors");
    std::fs::write(&idx_path, idx.to_string()).unwrap();
    let e = err_of(&dir);
    assert!(e.contains("does not contain it"), "{e}");
    // Index pointing outside the directory.
    idx["weight_map"]["layers.9.attn.bogus"] = serde_json::json!("../x.safetensors");
    std::fs::write(&idx_path, idx.to_string()).unwrap();
    assert!(err_of(&dir).contains("not a plain file name"));
    std::fs::remove_dir_all(&dir).ok();

    // Missing directory contents.
    let dir = tmpdir("empty");
    assert!(err_of(&dir).contains("neither"));
    std::fs::remove_dir_all(&dir).ok();
}

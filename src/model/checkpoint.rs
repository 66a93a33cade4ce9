//! The official checkpoint layout: safetensors shards named by `model.safetensors.index.json`
//! (`weight_map`: tensor name -> shard file), memory-mapped, every tensor the geometry needs checked
//! for dtype and shape before use. Also a writer that produces that exact layout (for tests and for
//! materializing synthetic weights).

use super::config::ModelConfig;
use super::weights::{tensor_manifest, StoredDtype, TensorSource, TensorSpec, Weights};
use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, TensorView};
use safetensors::SafeTensors;
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

/// The index file name of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The single-file checkpoint name (used when there is no index).
pub const SINGLE_FILE: &str = "model.safetensors";

struct Shard {
    path: PathBuf,
    mmap: Mmap,
    header_len: usize,
    metadata: Metadata,
}

/// A memory-mapped checkpoint directory, validated against a model config's manifest.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    /// tensor name -> shard index
    location: HashMap<String, usize>,
}

fn to_safetensors_dtype(d: StoredDtype) -> Dtype {
    match d {
        StoredDtype::BF16 => Dtype::BF16,
        StoredDtype::F32 => Dtype::F32,
        StoredDtype::F8E4M3 => Dtype::F8_E4M3,
        StoredDtype::F8E8M0 => Dtype::F8_E8M0,
        StoredDtype::I8 => Dtype::I8,
        StoredDtype::I64 => Dtype::I64,
    }
}

impl Checkpoint {
    /// Opens `dir` (index + shards, or a single `model.safetensors`), maps every shard and checks that
    /// every tensor of `config`'s manifest exists with the expected dtype and shape. Tensors the manifest
    /// does not know (e.g. `mtp.*`) are allowed and ignored.
    pub fn open(dir: &Path, config: &ModelConfig) -> Result<Self> {
        let index_path = dir.join(INDEX_FILE);
        let mut files: Vec<String> = Vec::new();
        let mut weight_map: HashMap<String, String> = HashMap::new();
        if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .with_context(|| format!("reading {}", index_path.display()))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", index_path.display()))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| anyhow!("{}: missing object `weight_map`", index_path.display()))?;
            for (name, file) in map {
                let file = file.as_str().ok_or_else(|| {
                    anyhow!(
                        "{}: weight_map[{name}] is not a file name",
                        index_path.display()
                    )
                })?;
                if file.contains('/') || file.contains('\\') || file.starts_with('.') {
                    bail!(
                        "{}: weight_map[{name}] = {file:?} is not a plain file name",
                        index_path.display()
                    );
                }
                if !files.iter().any(|f| f == file) {
                    files.push(file.to_string());
                }
                weight_map.insert(name.clone(), file.to_string());
            }
        } else if dir.join(SINGLE_FILE).exists() {
            files.push(SINGLE_FILE.to_string());
        } else {
            bail!(
                "{}: neither {INDEX_FILE} nor {SINGLE_FILE} found",
                dir.display()
            );
        }
        files.sort();

        let mut shards = Vec::new();
        let mut location = HashMap::new();
        for (si, file) in files.iter().enumerate() {
            let path = dir.join(file);
            let f =
                File::open(&path).with_context(|| format!("opening shard {}", path.display()))?;
            // SAFETY: the file is opened read-only and the map is only read; a concurrent writer truncating
            // the file is outside this program's contract (as for any mmap-based loader).
            let mmap = unsafe { Mmap::map(&f) }
                .with_context(|| format!("mapping shard {}", path.display()))?;
            // read_metadata checks the header, that offsets are contiguous and in bounds, and that the
            // data section has exactly the length the header declares (a truncated file fails here).
            let (header_len, metadata) = SafeTensors::read_metadata(&mmap).map_err(|e| {
                anyhow!(
                    "shard {} is not a valid safetensors file: {e}",
                    path.display()
                )
            })?;
            for name in metadata.offset_keys() {
                if let Some(expected_file) = weight_map.get(&name) {
                    if expected_file != file {
                        bail!("{}: tensor {name} found in {file} but the index maps it to {expected_file}", dir.display());
                    }
                }
                if let Some(prev) = location.insert(name.clone(), si) {
                    bail!(
                        "{}: tensor {name} appears in both {} and {file}",
                        dir.display(),
                        files[prev]
                    );
                }
            }
            shards.push(Shard {
                path,
                mmap,
                header_len,
                metadata,
            });
        }
        for (name, file) in &weight_map {
            if !location.contains_key(name) {
                bail!(
                    "{}: index maps {name} to {file}, but that shard does not contain it",
                    dir.display()
                );
            }
        }
        let ck = Checkpoint {
            dir: dir.to_path_buf(),
            shards,
            location,
        };
        for spec in tensor_manifest(config) {
            ck.check_spec(&spec)?;
        }
        Ok(ck)
    }

    fn check_spec(&self, spec: &TensorSpec) -> Result<()> {
        let si = *self.location.get(&spec.name).ok_or_else(|| {
            anyhow!(
                "{}: tensor {} missing from the checkpoint",
                self.dir.display(),
                spec.name
            )
        })?;
        let info = self.shards[si]
            .metadata
            .info(&spec.name)
            .expect("located tensor has metadata");
        let want = to_safetensors_dtype(spec.dtype);
        if info.dtype != want || info.shape != spec.shape {
            bail!(
                "{}: tensor {} is {:?} {:?}, the config expects {} {:?}",
                self.shards[si].path.display(),
                spec.name,
                info.dtype,
                info.shape,
                spec.dtype.safetensors_name(),
                spec.shape
            );
        }
        Ok(())
    }

    /// The raw bytes of a tensor (zero copy).
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        let si = *self
            .location
            .get(name)
            .ok_or_else(|| anyhow!("tensor {name} not in checkpoint"))?;
        let sh = &self.shards[si];
        let info = sh.metadata.info(name).expect("located tensor has metadata");
        let base = 8 + sh.header_len;
        Ok(&sh.mmap[base + info.data_offsets.0..base + info.data_offsets.1])
    }

    /// Names of all tensors in the checkpoint.
    pub fn tensor_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.location.keys().cloned().collect();
        v.sort();
        v
    }
}

impl TensorSource for Checkpoint {
    fn read_elements(
        &self,
        spec: &TensorSpec,
        first: usize,
        count: usize,
    ) -> Result<Cow<'_, [u8]>> {
        let bytes = self.tensor_bytes(&spec.name)?;
        let es = spec.dtype.size();
        let (a, b) = (first * es, (first + count) * es);
        if b > bytes.len() {
            bail!(
                "{}: element range {first}+{count} beyond the tensor",
                spec.name
            );
        }
        Ok(Cow::Borrowed(&bytes[a..b]))
    }
    fn describe(&self) -> String {
        format!(
            "checkpoint {} ({} shards)",
            self.dir.display(),
            self.shards.len()
        )
    }
}

/// Opens a checkpoint directory as model weights: the config from `dir/config.json` unless given.
pub fn load_weights(
    dir: &Path,
    config: Option<ModelConfig>,
    policy: super::weights::CachePolicy,
) -> Result<Weights> {
    let config = match config {
        Some(c) => c,
        None => ModelConfig::from_config_json(&dir.join("config.json"))?,
    };
    let ck = Checkpoint::open(dir, &config)?;
    Weights::new(config, Box::new(ck), policy)
}

/// Writes every manifest tensor of `weights` (read through its source, raw stored bytes) into `n_shards`
/// safetensors files `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`, the
/// official layout. Returns the shard paths.
pub fn write_checkpoint(weights: &Weights, dir: &Path, n_shards: usize) -> Result<Vec<PathBuf>> {
    if n_shards == 0 {
        bail!("write_checkpoint: n_shards must be >= 1");
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let specs = tensor_manifest(&weights.config);
    let total: usize = specs.iter().map(|s| s.nbytes()).sum();
    let per_shard = total.div_ceil(n_shards);
    let mut groups: Vec<Vec<&TensorSpec>> = vec![Vec::new()];
    let mut acc = 0;
    for s in &specs {
        if acc >= per_shard * groups.len() && groups.len() < n_shards {
            groups.push(Vec::new());
        }
        groups.last_mut().expect("non-empty").push(s);
        acc += s.nbytes();
    }
    let n = groups.len();
    let mut weight_map = BTreeMap::new();
    let mut paths = Vec::new();
    for (i, group) in groups.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, n);
        let raws: Vec<Vec<u8>> = group
            .iter()
            .map(|s| weights.raw(&s.name))
            .collect::<Result<_>>()?;
        let views: Vec<(String, TensorView<'_>)> = group
            .iter()
            .zip(&raws)
            .map(|(s, raw)| {
                TensorView::new(to_safetensors_dtype(s.dtype), s.shape.clone(), raw)
                    .map(|v| (s.name.clone(), v))
                    .map_err(|e| anyhow!("{}: {e}", s.name))
            })
            .collect::<Result<_>>()?;
        let path = dir.join(&file);
        safetensors::serialize_to_file(views, None, &path)
            .map_err(|e| anyhow!("writing {}: {e}", path.display()))?;
        for s in group {
            weight_map.insert(s.name.clone(), file.clone());
        }
        paths.push(path);
    }
    let index = serde_json::json!({
        "metadata": { "total_size": total },
        "weight_map": weight_map,
    });
    std::fs::write(dir.join(INDEX_FILE), serde_json::to_string_pretty(&index)?)?;
    Ok(paths)
}

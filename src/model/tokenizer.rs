//! A byte-level BPE tokenizer read from a checkpoint's `tokenizer.json` (HF `tokenizers` format:
//! `model.vocab`, `model.merges` as "a b" strings or ["a", "b"] pairs, `added_tokens`).
//!
//! Pre-tokenization is a simplified stand-in for DeepSeek's regex split (no regex dependency): text is
//! cut into letter runs (with one leading space attached), digit runs of at most 3, punctuation runs
//! (with one leading space attached), and whitespace runs (leaving a final space to the next word).
//! It matches GPT-2-style splitting on plain ASCII text; on CJK or mixed scripts token boundaries can
//! differ from the official tokenizer, so ids of such text are not guaranteed identical. Added/special
//! tokens are matched verbatim first, and every byte sequence round-trips through `decode`.

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;

/// A loaded tokenizer.
pub struct Tokenizer {
    vocab: HashMap<String, u32>,
    id_to_token: HashMap<u32, String>,
    merge_rank: HashMap<(String, String), usize>,
    /// Added tokens, longest content first (so the longest match wins).
    added: Vec<(String, u32)>,
    added_ids: HashMap<u32, String>,
    byte_to_char: [char; 256],
    char_to_byte: HashMap<char, u8>,
}

/// GPT-2's reversible byte -> printable char map: printable Latin-1 bytes map to themselves, the others
/// to U+0100 onwards in byte order.
fn byte_chars() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        let printable =
            (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        map[b as usize] = if printable {
            char::from_u32(b).expect("latin-1")
        } else {
            let c = char::from_u32(next).expect("valid code point");
            next += 1;
            c
        };
    }
    map
}

impl Tokenizer {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::from_json_str(&text).with_context(|| format!("parsing tokenizer {}", path.display()))
    }

    pub fn from_json_str(text: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(text).context("tokenizer.json is not valid JSON")?;
        let model = v
            .get("model")
            .ok_or_else(|| anyhow!("tokenizer.json: missing `model`"))?;
        if let Some(t) = model.get("type").and_then(|t| t.as_str()) {
            if t != "BPE" {
                bail!("tokenizer.json: model type {t:?} is not BPE");
            }
        }
        let vocab_obj = model
            .get("vocab")
            .and_then(|x| x.as_object())
            .ok_or_else(|| anyhow!("tokenizer.json: missing object `model.vocab`"))?;
        let mut vocab = HashMap::new();
        let mut id_to_token = HashMap::new();
        for (tok, id) in vocab_obj {
            let id = id
                .as_u64()
                .ok_or_else(|| anyhow!("tokenizer.json: vocab[{tok:?}] is not an id"))?
                as u32;
            vocab.insert(tok.clone(), id);
            id_to_token.insert(id, tok.clone());
        }
        let mut merge_rank = HashMap::new();
        let merges = model
            .get("merges")
            .and_then(|x| x.as_array())
            .cloned()
            .unwrap_or_default();
        for (rank, m) in merges.iter().enumerate() {
            let (a, b) = match m {
                Value::String(s) => {
                    let mut it = s.splitn(2, ' ');
                    match (it.next(), it.next()) {
                        (Some(a), Some(b)) => (a.to_string(), b.to_string()),
                        _ => bail!("tokenizer.json: merge {rank} {s:?} is not \"a b\""),
                    }
                }
                Value::Array(p) if p.len() == 2 => match (p[0].as_str(), p[1].as_str()) {
                    (Some(a), Some(b)) => (a.to_string(), b.to_string()),
                    _ => bail!("tokenizer.json: merge {rank} is not a pair of strings"),
                },
                other => bail!("tokenizer.json: merge {rank} has unexpected form {other}"),
            };
            merge_rank.entry((a, b)).or_insert(rank);
        }
        let mut added = Vec::new();
        let mut added_ids = HashMap::new();
        if let Some(list) = v.get("added_tokens").and_then(|x| x.as_array()) {
            for t in list {
                let content = t
                    .get("content")
                    .and_then(|x| x.as_str())
                    .ok_or_else(|| anyhow!("tokenizer.json: added token without `content`"))?;
                let id = t.get("id").and_then(|x| x.as_u64()).ok_or_else(|| {
                    anyhow!("tokenizer.json: added token {content:?} without `id`")
                })? as u32;
                added.push((content.to_string(), id));
                added_ids.insert(id, content.to_string());
            }
        }
        added.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let byte_to_char = byte_chars();
        let char_to_byte = byte_to_char
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        Ok(Tokenizer {
            vocab,
            id_to_token,
            merge_rank,
            added,
            added_ids,
            byte_to_char,
            char_to_byte,
        })
    }

    /// The id of an exact token string (added tokens first, then the BPE vocabulary).
    pub fn token_id(&self, s: &str) -> Option<u32> {
        self.added
            .iter()
            .find(|(c, _)| c == s)
            .map(|&(_, id)| id)
            .or_else(|| self.vocab.get(s).copied())
    }

    /// One past the largest id known.
    pub fn vocab_size(&self) -> usize {
        let a = self
            .id_to_token
            .keys()
            .chain(self.added_ids.keys())
            .max()
            .copied()
            .unwrap_or(0);
        a as usize + 1
    }

    /// Encodes text; added tokens appearing verbatim become their ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            // Earliest added-token occurrence (longest at equal position).
            let mut best: Option<(usize, &str, u32)> = None;
            for (c, id) in &self.added {
                if c.is_empty() {
                    continue;
                }
                if let Some(pos) = rest.find(c.as_str()) {
                    if best.is_none_or(|(bp, bc, _)| pos < bp || (pos == bp && c.len() > bc.len()))
                    {
                        best = Some((pos, c.as_str(), *id));
                    }
                }
            }
            match best {
                Some((pos, c, id)) => {
                    self.encode_plain(&rest[..pos], &mut out)?;
                    out.push(id);
                    rest = &rest[pos + c.len()..];
                }
                None => {
                    self.encode_plain(rest, &mut out)?;
                    rest = "";
                }
            }
        }
        Ok(out)
    }

    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        for piece in pre_tokenize(text) {
            let mut syms: Vec<String> = piece
                .bytes()
                .map(|b| self.byte_to_char[b as usize].to_string())
                .collect();
            loop {
                let mut best: Option<(usize, usize)> = None; // (rank, position)
                for i in 0..syms.len().saturating_sub(1) {
                    if let Some(&r) = self.merge_rank.get(&(syms[i].clone(), syms[i + 1].clone())) {
                        if best.is_none_or(|(br, _)| r < br) {
                            best = Some((r, i));
                        }
                    }
                }
                let Some((_, i)) = best else { break };
                let merged = format!("{}{}", syms[i], syms[i + 1]);
                syms.splice(i..i + 2, [merged]);
            }
            for s in syms {
                let id = self
                    .vocab
                    .get(&s)
                    .ok_or_else(|| anyhow!("tokenizer: symbol {s:?} is not in the vocabulary (incomplete byte vocabulary?)"))?;
                out.push(*id);
            }
        }
        Ok(())
    }

    /// Decodes ids to text (invalid UTF-8 replaced by U+FFFD); an unknown id is an error.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut bytes = Vec::new();
        for &id in ids {
            if let Some(c) = self.added_ids.get(&id) {
                bytes.extend_from_slice(c.as_bytes());
            } else if let Some(tok) = self.id_to_token.get(&id) {
                for ch in tok.chars() {
                    let b = self.char_to_byte.get(&ch).ok_or_else(|| {
                        anyhow!(
                            "tokenizer: token {id} ({tok:?}) holds a non byte-level char {ch:?}"
                        )
                    })?;
                    bytes.push(*b);
                }
            } else {
                bail!("tokenizer: unknown id {id}");
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Letter,
    Digit,
    Space,
    Other,
}

fn class(c: char) -> Class {
    if c.is_alphabetic() {
        Class::Letter
    } else if c.is_numeric() {
        Class::Digit
    } else if c.is_whitespace() {
        Class::Space
    } else {
        Class::Other
    }
}

/// The simplified split described in the module docs.
pub fn pre_tokenize(text: &str) -> Vec<&str> {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let mut pieces = Vec::new();
    let mut i = 0;
    let end_of = |k: usize| {
        if k < chars.len() {
            chars[k].0
        } else {
            text.len()
        }
    };
    while i < chars.len() {
        let start = i;
        let (_, c) = chars[i];
        let mut cls = class(c);
        // A single ' ' attaches to a following letter or punctuation run.
        if c == ' '
            && i + 1 < chars.len()
            && matches!(class(chars[i + 1].1), Class::Letter | Class::Other)
        {
            i += 1;
            cls = class(chars[i].1);
        }
        match cls {
            Class::Digit => {
                let mut n = 0;
                while i < chars.len() && class(chars[i].1) == Class::Digit && n < 3 {
                    i += 1;
                    n += 1;
                }
            }
            Class::Space => {
                while i < chars.len() && class(chars[i].1) == Class::Space {
                    i += 1;
                }
                // Leave a final ' ' for the next word when one follows.
                if i < chars.len()
                    && i - start > 1
                    && chars[i - 1].1 == ' '
                    && class(chars[i].1) != Class::Digit
                {
                    i -= 1;
                }
            }
            k => {
                while i < chars.len() && class(chars[i].1) == k {
                    i += 1;
                }
            }
        }
        pieces.push(&text[chars[start].0..end_of(i)]);
    }
    pieces
}

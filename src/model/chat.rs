//! The DeepSeek-V4 chat prompt over token ids (arch §6; no Jinja template, the encoder inserts BOS):
//! `<｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>` in chat mode, ending in
//! `<｜Assistant｜><think>` in thinking mode; earlier assistant replies as `</think>{reply}<｜end▁of▁sentence｜>`.

use super::tokenizer::Tokenizer;
use anyhow::{anyhow, bail, Result};

pub const BOS_TEXT: &str = "<｜begin▁of▁sentence｜>";
pub const EOS_TEXT: &str = "<｜end▁of▁sentence｜>";
pub const USER_TEXT: &str = "<｜User｜>";
pub const ASSISTANT_TEXT: &str = "<｜Assistant｜>";
pub const THINK_TEXT: &str = "<think>";
pub const END_THINK_TEXT: &str = "</think>";

pub const BOS_ID: u32 = 0;
pub const EOS_ID: u32 = 1;
pub const USER_ID: u32 = 128803;
pub const ASSISTANT_ID: u32 = 128804;
pub const THINK_ID: u32 = 128821;
pub const END_THINK_ID: u32 = 128822;

/// The special token ids of the template.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos: u32,
    pub eos: u32,
    pub user: u32,
    pub assistant: u32,
    pub think: u32,
    pub end_think: u32,
}

impl SpecialTokens {
    /// The DeepSeek-V4 ids (arch §6).
    pub fn dsv4() -> Self {
        SpecialTokens {
            bos: BOS_ID,
            eos: EOS_ID,
            user: USER_ID,
            assistant: ASSISTANT_ID,
            think: THINK_ID,
            end_think: END_THINK_ID,
        }
    }

    /// The ids a tokenizer assigns to the template strings; every one must exist.
    pub fn from_tokenizer(tok: &Tokenizer) -> Result<Self> {
        let get = |s: &str| {
            tok.token_id(s)
                .ok_or_else(|| anyhow!("tokenizer has no token {s:?}"))
        };
        Ok(SpecialTokens {
            bos: get(BOS_TEXT)?,
            eos: get(EOS_TEXT)?,
            user: get(USER_TEXT)?,
            assistant: get(ASSISTANT_TEXT)?,
            think: get(THINK_TEXT)?,
            end_think: get(END_THINK_TEXT)?,
        })
    }
}

/// Who speaks a turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    User,
    Assistant,
}

/// One turn of a conversation, already tokenized (use [`Tokenizer::encode`] for text).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Turn {
    pub role: Role,
    pub tokens: Vec<u32>,
}

/// Builds the generation prompt: BOS, system tokens, the turns, then the assistant opener. The last turn
/// must be the user's; turns must alternate starting with the user.
pub fn build_prompt(
    sp: &SpecialTokens,
    system: &[u32],
    turns: &[Turn],
    thinking: bool,
) -> Result<Vec<u32>> {
    if turns.is_empty() {
        bail!("a chat prompt needs at least one user turn");
    }
    let mut out = vec![sp.bos];
    out.extend_from_slice(system);
    for (i, turn) in turns.iter().enumerate() {
        let expected = if i % 2 == 0 {
            Role::User
        } else {
            Role::Assistant
        };
        if turn.role != expected {
            bail!(
                "turn {i} is {:?}, expected {expected:?} (turns alternate, user first)",
                turn.role
            );
        }
        match turn.role {
            Role::User => {
                out.push(sp.user);
                out.extend_from_slice(&turn.tokens);
            }
            Role::Assistant => {
                // Reasoning of earlier turns is dropped: a past reply is always `</think>{answer}<eos>`.
                out.push(sp.assistant);
                out.push(sp.end_think);
                out.extend_from_slice(&turn.tokens);
                out.push(sp.eos);
            }
        }
    }
    if turns.last().map(|t| t.role) != Some(Role::User) {
        bail!("the last turn of a generation prompt must be the user's");
    }
    out.push(sp.assistant);
    out.push(if thinking { sp.think } else { sp.end_think });
    Ok(out)
}

/// Single-turn convenience over text, with a tokenizer.
pub fn build_text_prompt(
    tok: &Tokenizer,
    system: &str,
    user: &str,
    thinking: bool,
) -> Result<Vec<u32>> {
    let sp = SpecialTokens::from_tokenizer(tok)?;
    let system = tok.encode(system)?;
    let turns = [Turn {
        role: Role::User,
        tokens: tok.encode(user)?,
    }];
    build_prompt(&sp, &system, &turns, thinking)
}

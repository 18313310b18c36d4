//! The workspace's module graph has no cycles: in every crate, no module reaches a module that
//! reaches it back through `crate::` or `super::` paths. Every source file is a module
//! (`a/b.rs` and `a/b/mod.rs` are `a::b`); comments are not read; a file's own test modules
//! belong to it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const CRATES: &[&str] = &[
    "protocol",
    "prompt",
    "filter",
    "indexer-sidecar",
    "examples/sim",
    "examples/harness",
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `src/a/b.rs` → `["a", "b"]`; `lib.rs`, `main.rs`, `mod.rs` name their directory; binaries
/// under `src/bin` are crates of their own and skipped.
fn module_of(src: &Path, file: &Path) -> Option<Vec<String>> {
    let rel = file.strip_prefix(src).ok()?;
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_owned())
        .collect();
    if parts.first().is_some_and(|p| p == "bin") {
        return None;
    }
    if matches!(
        parts.last().map(String::as_str),
        Some("lib" | "main" | "mod")
    ) {
        parts.pop();
    }
    Some(parts)
}

/// Every path the code names after `crate::` or `super::` (resolved against `module`), with
/// `{a, b::c}` groups expanded.
fn referenced_paths(code: &str, module: &[String]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    for (start, prefix) in [("crate::", None), ("super::", Some(()))] {
        let mut from = 0;
        while let Some(at) = code[from..].find(start) {
            let at = from + at;
            from = at + start.len();
            let before = code[..at].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
                continue;
            }
            let mut base: Vec<String> = match prefix {
                None => Vec::new(),
                Some(()) => {
                    let mut m = module.to_vec();
                    let mut rest = &code[from..];
                    m.pop();
                    while let Some(r) = rest.strip_prefix("super::") {
                        m.pop();
                        rest = r;
                    }
                    m
                }
            };
            let mut i = from;
            while code[i..].starts_with("super::") {
                i += "super::".len();
            }
            parse_tree(code, bytes, &mut i, &mut base, &mut out);
        }
    }
    out
}

fn ident(bytes: &[u8], i: &mut usize) -> Option<String> {
    let start = *i;
    while *i < bytes.len() && (bytes[*i].is_ascii_alphanumeric() || bytes[*i] == b'_') {
        *i += 1;
    }
    (*i > start).then(|| String::from_utf8_lossy(&bytes[start..*i]).into_owned())
}

fn skip_ws(bytes: &[u8], i: &mut usize) {
    while *i < bytes.len() && bytes[*i].is_ascii_whitespace() {
        *i += 1;
    }
}

/// Parse `a::b::{c, d::e}` at `i`, pushing each full path onto `out`.
fn parse_tree(
    code: &str,
    bytes: &[u8],
    i: &mut usize,
    base: &mut Vec<String>,
    out: &mut Vec<Vec<String>>,
) {
    let depth = base.len();
    loop {
        skip_ws(bytes, i);
        if bytes.get(*i) == Some(&b'{') {
            *i += 1;
            loop {
                skip_ws(bytes, i);
                match bytes.get(*i) {
                    Some(b'}') | None => {
                        *i += 1;
                        break;
                    }
                    Some(b',') => *i += 1,
                    _ => {
                        let mut inner = base.clone();
                        let before = *i;
                        parse_tree(code, bytes, i, &mut inner, out);
                        if *i == before {
                            *i += 1;
                        }
                    }
                }
            }
            break;
        }
        match ident(bytes, i) {
            Some(name) => base.push(name),
            None => break,
        }
        if code[*i..].starts_with("::") {
            *i += 2;
        } else {
            break;
        }
    }
    if base.len() > depth || depth == 0 {
        out.push(base.clone());
    }
    base.truncate(depth);
}

/// The code of a file without its comments (line comments, doc comments, block comments).
fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    let mut in_string = false;
    while let Some(c) = rest.chars().next() {
        if !in_string && rest.starts_with("//") {
            let end = rest.find('\n').unwrap_or(rest.len());
            rest = &rest[end..];
            continue;
        }
        if !in_string && rest.starts_with("/*") {
            let end = rest.find("*/").map_or(rest.len(), |e| e + 2);
            rest = &rest[end..];
            continue;
        }
        if c == '"' && !out.ends_with('\\') && !out.ends_with('\'') {
            in_string = !in_string;
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// The module a path lands in: its longest prefix that is a module of the crate.
fn target(path: &[String], modules: &BTreeSet<Vec<String>>) -> Option<Vec<String>> {
    (0..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|p| modules.contains(p))
}

/// Every module's dependencies on the crate's other modules.
fn edges_of(crate_dir: &Path) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let src = crate_dir.join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let named: Vec<(Vec<String>, PathBuf)> = files
        .into_iter()
        .filter_map(|f| Some((module_of(&src, &f)?, f)))
        .collect();
    let modules: BTreeSet<Vec<String>> = named.iter().map(|(m, _)| m.clone()).collect();
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for (module, file) in &named {
        let code = strip_comments(&std::fs::read_to_string(file).unwrap());
        for path in referenced_paths(&code, module) {
            if let Some(to) = target(&path, &modules) {
                // A module naming itself, or its own children's items, is not a dependency
                // between two modules.
                if &to != module && !to.starts_with(module) {
                    edges.entry(module.clone()).or_default().insert(to);
                }
            }
        }
    }
    edges
}

fn cycles_in(crate_dir: &Path) -> Vec<String> {
    let edges = edges_of(crate_dir);
    let mut found = Vec::new();
    for (from, tos) in &edges {
        for to in tos {
            if reaches(&edges, to, from) {
                found.push(format!("{} -> {}", from.join("::"), to.join("::")));
            }
        }
    }
    found
}

fn reaches(
    edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
    from: &[String],
    to: &[String],
) -> bool {
    let mut seen = BTreeSet::new();
    let mut stack = vec![from.to_vec()];
    while let Some(m) = stack.pop() {
        if m == to {
            return true;
        }
        if seen.insert(m.clone()) {
            stack.extend(edges.get(&m).into_iter().flatten().cloned());
        }
    }
    false
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn no_crate_has_an_import_cycle() {
    let mut all = Vec::new();
    for c in CRATES {
        for cycle in cycles_in(&workspace().join(c)) {
            all.push(format!("{c}: {cycle}"));
        }
    }
    assert!(
        all.is_empty(),
        "module dependencies that lead back to themselves:\n{}",
        all.join("\n")
    );
}

/// The sidecar's decisions are pure: the core and the replica plane's brain (with the peers'
/// state and the wire messages it reads) import no edge — no transport, observer, the shell
/// that holds the locks, its metrics, the HTTP API, or the loops that execute.
#[test]
fn the_sidecars_decisions_import_no_edge() {
    let edges = edges_of(&workspace().join("indexer-sidecar"));
    let name = |s: &str| s.split("::").map(str::to_owned).collect::<Vec<String>>();
    let pure = [
        "core",
        "replication::brain",
        "replication::peers",
        "replication::wire",
    ];
    let edge = [
        "sidecar",
        "transports",
        "observers",
        "metrics",
        "http_api",
        "replication::plane",
        "replication::disk",
    ];
    let mut wrong = Vec::new();
    for (from, tos) in &edges {
        if !pure.iter().any(|p| from.starts_with(&name(p))) {
            continue;
        }
        for to in tos {
            if edge.iter().any(|e| to.starts_with(&name(e))) {
                wrong.push(format!("{} -> {}", from.join("::"), to.join("::")));
            }
        }
    }
    assert!(
        pure.iter()
            .all(|p| edges.keys().any(|m| m.starts_with(&name(p)))),
        "a pure module was renamed: update this test"
    );
    assert!(
        wrong.is_empty(),
        "pure modules importing edges:\n{}",
        wrong.join("\n")
    );
}

/// What in an edge file's code would take a lock or write a metric.
const LOCKS_AND_METRIC_WRITES: &[&str] = &[
    "Mutex",
    "RwLock",
    ".lock()",
    ".read()",
    ".write()",
    ".core()",
    ".plane()",
    ".replication()",
    ".metrics",
    "get_or_create(",
    ".inc()",
    ".inc_by(",
    ".observe(",
];

/// Each of `patterns` in a file's code (comments stripped), with its line.
fn uses_of(code: &str, patterns: &[&str]) -> Vec<String> {
    code.lines()
        .enumerate()
        .flat_map(|(i, line)| {
            patterns
                .iter()
                .filter(move |p| line.contains(**p))
                .map(move |p| format!("line {}: {p}", i + 1))
        })
        .collect()
}

/// The sidecar's edges — event transports, observers, the HTTP API, the replica plane's loop and
/// the disk snapshot — call the shell's verbs: none takes a lock or writes a metric (the
/// shell's locks and metrics are private to `sidecar/`, which writes every metric and its line).
#[test]
fn no_edge_takes_a_lock_or_writes_a_metric() {
    let src = workspace().join("indexer-sidecar/src");
    let mut files = Vec::new();
    for dir in ["transports", "observers"] {
        rust_files(&src.join(dir), &mut files);
    }
    for file in ["http_api.rs", "replication/plane.rs", "replication/disk.rs"] {
        files.push(src.join(file));
    }
    assert!(files.len() >= 12, "edge files moved: update this test");
    let mut wrong = Vec::new();
    for file in &files {
        let code = strip_comments(&std::fs::read_to_string(file).unwrap());
        for hit in uses_of(&code, LOCKS_AND_METRIC_WRITES) {
            wrong.push(format!(
                "{}: {hit}",
                file.strip_prefix(&src).unwrap().display()
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "edges taking a lock or writing a metric:\n{}",
        wrong.join("\n")
    );
}

/// The edge check sees a lock and a metric write, and not one in a comment.
#[test]
fn the_edge_check_sees_locks_and_metric_writes() {
    let code = strip_comments(
        "fn f(s: &Sidecar) {\n    // s.core() in a comment\n    s.core().x();\n    s.metrics.hints.get_or_create(&l).inc();\n}\n",
    );
    assert_eq!(
        uses_of(&code, LOCKS_AND_METRIC_WRITES),
        [
            "line 3: .core()",
            "line 4: .metrics",
            "line 4: get_or_create(",
            "line 4: .inc()"
        ]
    );
}

/// The checker itself finds a cycle, groups and `super::` included.
#[test]
fn the_checker_sees_cycles() {
    let dir = tempfile_dir();
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("a")).unwrap();
    std::fs::write(src.join("lib.rs"), "pub mod a; pub mod b;").unwrap();
    std::fs::write(
        src.join("a/mod.rs"),
        "pub mod c;\n// crate::b is a comment\n",
    )
    .unwrap();
    std::fs::write(src.join("a/c.rs"), "use crate::{b::{X}, a};").unwrap();
    std::fs::write(src.join("b.rs"), "fn f() { super::a::c::g() }").unwrap();
    let cycles = cycles_in(&dir);
    assert!(cycles.contains(&"a::c -> b".to_owned()), "{cycles:?}");
    assert!(cycles.contains(&"b -> a::c".to_owned()), "{cycles:?}");
    std::fs::write(src.join("a/c.rs"), "use crate::a;").unwrap();
    assert!(cycles_in(&dir).is_empty(), "{:?}", cycles_in(&dir));
    std::fs::remove_dir_all(&dir).unwrap();
}

fn tempfile_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-layout-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

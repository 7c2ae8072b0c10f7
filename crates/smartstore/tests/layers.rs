//! The import rule of the layer table in `src/lib.rs` ("## Layers"): a
//! module names (`crate::x`) only modules of a lower layer. The table is
//! read from lib.rs's docs, so the docs and the check cannot drift; every
//! file under `src/` is read as text, its comments and string literals
//! blanked, and every `crate::x` path checked, the names inside
//! `use crate::{a, b::{C, D}}` groups included.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Module name to layer, as lib.rs's table gives them.
type Layers = BTreeMap<String, usize>;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The rows of the "## Layers" table in lib.rs's module docs: `| 2 |
/// `a`, `b` | what |`.
fn layer_table(lib: &str) -> Layers {
    let mut out = Layers::new();
    let mut in_section = false;
    for line in lib.lines() {
        let Some(doc) = line.trim().strip_prefix("//!") else {
            continue;
        };
        let doc = doc.trim();
        if let Some(heading) = doc.strip_prefix("## ") {
            in_section = heading.trim() == "Layers";
            continue;
        }
        let cells: Vec<&str> = doc.split('|').map(str::trim).collect();
        if !in_section || cells.len() < 4 {
            continue;
        }
        let Ok(layer) = cells[1].parse::<usize>() else {
            continue;
        };
        for m in cells[2].split(',') {
            out.insert(m.trim().trim_matches('`').to_string(), layer);
        }
    }
    out
}

/// Root items re-exported by lib.rs (`pub use error::{Error, Result};`),
/// each with the module it comes from: `crate::Error` names `error`.
fn root_items(lib: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for line in lib.lines() {
        let Some(rest) = line.trim().strip_prefix("pub use ") else {
            continue;
        };
        let Some((module, items)) = rest.split_once("::") else {
            continue;
        };
        for item in items
            .trim_end_matches(';')
            .trim_matches(['{', '}'])
            .split(',')
        {
            out.insert(item.trim().to_string(), module.trim().to_string());
        }
    }
    out
}

/// `code` with comments and the contents of string and character literals
/// replaced by spaces (line breaks kept, so offsets keep their lines).
fn blank_non_code(code: &str) -> String {
    let b = code.as_bytes();
    let mut out = b.to_vec();
    let blank = |out: &mut Vec<u8>, from: usize, to: usize| {
        for c in &mut out[from..to] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    };
    let mut i = 0;
    while i < b.len() {
        let rest = &b[i..];
        let end = if rest.starts_with(b"//") {
            i + rest.iter().position(|&c| c == b'\n').unwrap_or(rest.len())
        } else if rest.starts_with(b"/*") {
            i + 2
                + rest[2..]
                    .windows(2)
                    .position(|w| w == b"*/")
                    .map_or(rest.len() - 2, |p| p + 2)
        } else if rest.starts_with(b"r\"") || rest.starts_with(b"r#") {
            let hashes = rest[1..].iter().take_while(|&&c| c == b'#').count();
            if rest.get(1 + hashes) != Some(&b'"') {
                i += 1;
                continue;
            }
            let close: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            let body = 2 + hashes;
            i + body
                + rest[body..]
                    .windows(close.len())
                    .position(|w| w == close.as_slice())
                    .map_or(rest.len() - body, |p| p + close.len())
        } else if rest[0] == b'"' {
            let mut j = 1;
            while j < rest.len() && rest[j] != b'"' {
                j += if rest[j] == b'\\' { 2 } else { 1 };
            }
            i + (j + 1).min(rest.len())
        } else if rest[0] == b'\'' && (rest.get(1) == Some(&b'\\') || rest.get(2) == Some(&b'\'')) {
            // A character literal ('x', '\n', '\''), not a lifetime.
            let mut j = 1;
            while j < rest.len() && rest[j] != b'\'' {
                j += if rest[j] == b'\\' { 2 } else { 1 };
            }
            i + (j + 1).min(rest.len())
        } else {
            i += 1;
            continue;
        };
        blank(&mut out, i, end);
        i = end;
    }
    String::from_utf8(out).expect("only ASCII bytes were replaced")
}

/// The first names of the paths in a `use` group's body (`a, b::{C, D}`
/// gives `a` and `b`), each with its offset in `body`, splitting at
/// top-level commas.
fn group_heads(body: &str) -> Vec<(usize, String)> {
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    for (i, c) in body
        .char_indices()
        .chain(std::iter::once((body.len(), ',')))
    {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                let item = &body[start..i];
                let at = start + (item.len() - item.trim_start().len());
                let head = ident(&body[at..]);
                if !head.is_empty() && head != "self" {
                    heads.push((at, head));
                }
                start = i + 1;
            }
            _ => {}
        }
    }
    heads
}

/// The identifier `s` starts with (empty when none).
fn ident(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// Every `crate::x` the code names: (line, x).
fn crate_names(code: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (at, _) in code.match_indices("crate::") {
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        let after = at + "crate::".len();
        let rest = code[after..].trim_start();
        let from = code.len() - rest.len();
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 1;
            let end = group
                .char_indices()
                .find(|&(_, c)| {
                    match c {
                        '{' => depth += 1,
                        '}' => depth -= 1,
                        _ => {}
                    }
                    depth == 0
                })
                .map_or(group.len(), |(i, _)| i);
            for (offset, head) in group_heads(&group[..end]) {
                out.push((line_of(code, from + 1 + offset), head));
            }
        } else {
            out.push((line_of(code, from), ident(rest)));
        }
    }
    out
}

/// The line (from 1) of byte offset `at`.
fn line_of(code: &str, at: usize) -> usize {
    code[..at].matches('\n').count() + 1
}

/// The rule's breaches in one file of module `module`: one message each,
/// naming the file, the line, the forbidden name and the rule.
fn breaches(
    file: &str,
    module: &str,
    code: &str,
    layers: &Layers,
    roots: &BTreeMap<String, String>,
) -> Vec<String> {
    let Some(&own) = layers.get(module) else {
        return vec![format!(
            "{file}: module `{module}` is not in the layer table of src/lib.rs (\"## Layers\"); \
             give it a layer there"
        )];
    };
    let code = blank_non_code(code);
    let mut out = Vec::new();
    for (at, _) in code.match_indices("super::super::") {
        let line = line_of(&code, at);
        out.push(format!(
            "{file}:{line}: `super::super::` reaches past the module's own folder; \
             name other modules as `crate::x` so the layer rule can check them"
        ));
    }
    for (line, name) in crate_names(&code) {
        let target = roots.get(&name).cloned().unwrap_or(name.clone());
        if target == module {
            continue;
        }
        let Some(&theirs) = layers.get(&target) else {
            out.push(format!(
                "{file}:{line}: `crate::{name}` names `{target}`, which is not in the layer \
                 table of src/lib.rs (\"## Layers\")"
            ));
            continue;
        };
        if theirs >= own {
            out.push(format!(
                "{file}:{line}: `crate::{name}`: `{module}` is in layer {own} and may use only \
                 modules of layers below {own}, but `{target}` is in layer {theirs} \
                 (rule: the layer table of src/lib.rs, \"## Layers\")"
            ));
        }
    }
    out
}

/// Every `.rs` file under `dir`, with the module it belongs to (its first
/// path component under src/, without `.rs`); lib.rs, the root, is left out.
fn source_files(dir: &Path, out: &mut Vec<(PathBuf, String)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            source_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path.strip_prefix(src()).expect("under src");
            let first = rel.components().next().expect("a component");
            let module = first
                .as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_string();
            if module != "lib" {
                out.push((path, module));
            }
        }
    }
}

#[test]
fn every_module_names_only_modules_of_lower_layers() {
    let lib = std::fs::read_to_string(src().join("lib.rs")).expect("src/lib.rs");
    let layers = layer_table(&lib);
    let roots = root_items(&lib);
    assert!(
        layers.len() > 10,
        "the layer table of src/lib.rs (\"## Layers\") was not found: {layers:?}"
    );
    let mut failures = Vec::new();
    for line in lib.lines() {
        let decl = line.trim().trim_start_matches("pub ");
        if let Some(m) = decl.strip_prefix("mod ").and_then(|m| m.strip_suffix(';'))
            && !layers.contains_key(m)
        {
            failures.push(format!(
                "src/lib.rs: module `{m}` is not in the layer table (\"## Layers\")"
            ));
        }
    }
    let mut files = Vec::new();
    source_files(&src(), &mut files);
    for (path, module) in &files {
        let code = std::fs::read_to_string(path).expect("source file");
        let file = path
            .strip_prefix(src().parent().expect("crate dir"))
            .expect("in crate");
        failures.extend(breaches(
            &file.display().to_string(),
            module,
            &code,
            &layers,
            &roots,
        ));
    }
    assert!(
        failures.is_empty(),
        "import rule broken:\n{}",
        failures.join("\n")
    );
}

#[test]
fn the_check_catches_forbidden_names_in_groups_inline_paths_and_tables() {
    let layers: Layers = [("error", 0), ("plan", 1), ("wire", 2), ("node", 4)]
        .map(|(m, l)| (m.to_string(), l))
        .into_iter()
        .collect();
    let roots = root_items("pub use error::{Error, Result};");
    let code = r#"
        //! Docs may link [`crate::node`] freely.
        use crate::{
            error::Result,
            node::{Node, Stats},
            plan,
        };
        use crate::Error;
        fn f() -> usize { let _ = "crate::node"; let c = '"'; crate::node::data_bytes(x) }
        fn g<'a>(x: &'a str) -> &'a str { x } // crate::node in a comment
    "#;
    let found = breaches("src/wire.rs", "wire", code, &layers, &roots);
    assert_eq!(found.len(), 2, "{found:#?}");
    assert!(
        found[0].starts_with("src/wire.rs:5: `crate::node`"),
        "{}",
        found[0]
    );
    assert!(found[0].contains("layer 2") && found[0].contains("layer 4"));
    assert!(
        found[0].contains("src/lib.rs"),
        "names the rule: {}",
        found[0]
    );
    assert!(
        found[1].starts_with("src/wire.rs:9: `crate::node`"),
        "{}",
        found[1]
    );
    let unknown = breaches("src/wire.rs", "wire", "use crate::ghost;", &layers, &roots);
    assert!(unknown[0].contains("`ghost`") && unknown[0].contains("not in the layer"));
    let same = breaches(
        "src/plan.rs",
        "plan",
        "use crate::{plan, wire};",
        &layers,
        &roots,
    );
    assert_eq!(same.len(), 1, "{same:?}");
    let table = layer_table(
        "//! ## Layers\n//!\n//! | layer | modules | what |\n//! |---|---|---|\n\
         //! | 0 | `error` | e |\n//! | 3 | `client`, `tpch` | c |\n//! ## Next\n//! | 9 | `x` | no |",
    );
    assert_eq!(
        table.into_iter().collect::<Vec<_>>(),
        [
            ("client".to_string(), 3),
            ("error".to_string(), 0),
            ("tpch".to_string(), 3)
        ]
    );
}

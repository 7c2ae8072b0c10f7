//! The controller's import rules (README, "Architecture"; DESIGN.md,
//! "Controller layers"), checked on the source: every `crate::module`
//! path outside comments must name a module of the file's own layer or of
//! a layer below it. `host` and `control` sit side by side and never
//! import each other. A cycle may exist only inside `engine`: within the
//! other layers, the modules' imports must form no circle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A layer: its rank (imports go to a lower rank or the same layer) and
/// the top-level modules it holds.
struct Layer {
    name: &'static str,
    rank: u8,
    modules: &'static [&'static str],
}

const LAYERS: &[Layer] = &[
    Layer {
        name: "leaves",
        rank: 0,
        modules: &[
            "limits", "units", "files", "sockfile", "recovery", "timer", "blocking", "metrics",
            "sched", "faults", "nbd",
        ],
    },
    Layer {
        name: "store",
        rank: 1,
        modules: &["store"],
    },
    Layer {
        name: "backend",
        rank: 2,
        modules: &["backend"],
    },
    Layer {
        name: "config",
        rank: 3,
        modules: &["config"],
    },
    Layer {
        name: "engine",
        rank: 4,
        modules: &["engine"],
    },
    Layer {
        name: "controller",
        rank: 5,
        modules: &["controller"],
    },
    Layer {
        name: "host",
        rank: 6,
        modules: &["host"],
    },
    Layer {
        name: "control",
        rank: 6,
        modules: &["control"],
    },
    // The fuzz targets' entry points and checkers (feature `fuzzing`):
    // beside host and control, imported only by the tests.
    Layer {
        name: "fuzzing",
        rank: 6,
        modules: &["fuzzing"],
    },
    // In-process tests that open a whole controller: above everything.
    Layer {
        name: "tests",
        rank: 7,
        modules: &["tests"],
    },
];

fn layer_of(module: &str) -> Option<&'static Layer> {
    LAYERS.iter().find(|l| l.modules.contains(&module))
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, with its path relative to `src/`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("reading src/") {
        let path = entry.expect("reading src/").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file belongs to (`engine/datapath.rs` ->
/// `engine`, `limits.rs` -> `limits`); `None` for `lib.rs`.
fn module_of(rel: &Path) -> Option<String> {
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (name != "lib").then(|| name.to_owned())
}

/// Strip a line's comment (`//` outside a string literal; good enough for
/// this code base, whose strings hold no `//` before a `crate::` path).
fn code_of(line: &str) -> &str {
    let t = line.trim_start();
    if t.starts_with("//") {
        return "";
    }
    match line.find("//") {
        Some(i) if !line[..i].contains('"') => &line[..i],
        _ => line,
    }
}

/// The top-level modules a piece of code names through `crate::`,
/// including `use crate::{a, b::c}` groups.
fn imports(code: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let after = &rest[i + "crate::".len()..];
        if let Some(group) = after.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let name: String = item
                    .trim()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    found.push(name);
                }
            }
        } else {
            let name: String = after
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            found.push(name);
        }
        rest = after;
    }
    found
}

/// Every file's code (comments removed, `#[cfg(test)]` modules kept: a
/// test may not reach up either), by path relative to `src/`.
fn code_by_file() -> BTreeMap<PathBuf, Vec<(usize, String)>> {
    let root = src();
    let mut files = Vec::new();
    sources(&root, &mut files);
    files
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path).expect("reading a source file");
            let lines = text
                .lines()
                .enumerate()
                .map(|(n, l)| (n + 1, code_of(l).to_owned()))
                .collect();
            (path.strip_prefix(&root).unwrap().to_owned(), lines)
        })
        .collect()
}

#[test]
fn every_import_goes_to_the_same_layer_or_one_below() {
    let mut violations = Vec::new();
    for (rel, lines) in code_by_file() {
        let Some(module) = module_of(&rel) else {
            continue;
        };
        let Some(mine) = layer_of(&module) else {
            violations.push(format!(
                "{}: module `{module}` is in no layer (add it to LAYERS in tests/layers.rs and to the README's layer diagram)",
                rel.display()
            ));
            continue;
        };
        for (n, code) in &lines {
            for target in imports(code) {
                if matches!(target.as_str(), "self" | "super") {
                    continue;
                }
                let Some(theirs) = layer_of(&target) else {
                    violations.push(format!(
                        "{}:{n}: `crate::{target}` names no module of a layer (a re-export kept for the binary?); use the layered path",
                        rel.display()
                    ));
                    continue;
                };
                if theirs.name != mine.name && theirs.rank >= mine.rank {
                    violations.push(format!(
                        "{}:{n}: layer `{}` may not import `crate::{target}` (layer `{}`): imports run leaves, store, backend, config, engine, controller, then host and control",
                        rel.display(),
                        mine.name,
                        theirs.name
                    ));
                }
            }
        }
    }
    assert!(
        violations.is_empty(),
        "forbidden imports:\n{}",
        violations.join("\n")
    );
}

/// The second-level module a file is (`store/nvs.rs` -> `store::nvs`).
fn submodule_of(rel: &Path) -> String {
    let parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_owned())
        .collect();
    match parts.as_slice() {
        [one] => one.clone(),
        [dir, file, ..] if file == "mod" => dir.clone(),
        [dir, file, ..] => format!("{dir}::{file}"),
        [] => String::new(),
    }
}

#[test]
fn only_the_engine_has_a_cycle_among_its_modules() {
    // Edges between second-level modules of one layer (store::cache ->
    // store::nvs), taken from `crate::layer::module` paths.
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (rel, lines) in code_by_file() {
        let from = submodule_of(&rel);
        let Some(top) = module_of(&rel) else { continue };
        if top == "engine" {
            continue;
        }
        for (_, code) in &lines {
            let mut rest = code.as_str();
            let prefix = format!("crate::{top}::");
            while let Some(i) = rest.find(&prefix) {
                let after = &rest[i + prefix.len()..];
                let name: String = after
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                let to = format!("{top}::{name}");
                if to != from && !name.is_empty() {
                    edges.entry(from.clone()).or_default().insert(to);
                }
                rest = after;
            }
        }
    }
    // Depth-first search for a back edge.
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, edges, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    for node in edges.keys() {
        if let Some(cycle) = visit(node, &edges, &mut Vec::new(), &mut done) {
            panic!("an import cycle outside the engine: {}", cycle.join(" -> "));
        }
    }
}

#[test]
fn the_checker_sees_grouped_imports_and_ignores_comments() {
    assert_eq!(
        imports("use crate::{store::nvs, engine};"),
        ["store", "engine"]
    );
    assert_eq!(
        imports("let x = crate::backend::volume::Volume::open();"),
        ["backend"]
    );
    assert!(imports(code_of("    // see [`x`](crate::engine::Engine)")).is_empty());
    assert_eq!(
        imports(code_of("f(crate::units::X); // crate::engine")),
        ["units"]
    );
    assert_eq!(
        module_of(Path::new("engine/datapath.rs")).as_deref(),
        Some("engine")
    );
    assert_eq!(module_of(Path::new("lib.rs")), None);
    assert_eq!(submodule_of(Path::new("store/mod.rs")), "store");
    assert_eq!(submodule_of(Path::new("store/nvs.rs")), "store::nvs");
}

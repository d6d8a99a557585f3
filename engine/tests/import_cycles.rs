//! The engine's files import one another without circles of more than
//! two files: a pair that names each other (a module and its own
//! submodule, a type and its one user) is allowed, a longer circle is
//! not, since it is a knot a reader cannot start anywhere. Read from the
//! source: each `crate::…` or `super::…` path outside a test module
//! resolves to the longest module file it names.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("engine/src").flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a file: `train/checkpoint/mod.rs` is
/// `[train, checkpoint]`.
fn module_of(file: &Path, root: &Path) -> Vec<String> {
    let rel = file.strip_prefix(root).expect("under src");
    let mut parts: Vec<String> = rel
        .with_extension("")
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

/// The file of the longest prefix of `path` that is a module.
fn file_of(root: &Path, path: &[String]) -> PathBuf {
    let (mut best, mut dir) = (root.join("lib.rs"), root.to_path_buf());
    for part in path {
        let (file, folder) = (dir.join(format!("{part}.rs")), dir.join(part));
        if file.is_file() {
            best = file;
        } else if folder.join("mod.rs").is_file() {
            best = folder.join("mod.rs");
        } else {
            break;
        }
        dir = folder;
    }
    best
}

/// Every path a source names from `crate::` or `super::`, with the items
/// of a `{…}` group each appended, relative to the crate root.
fn named_paths(text: &str, module: &[String]) -> Vec<Vec<String>> {
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut out = Vec::new();
    for base in ["crate::", "super::"] {
        for (at, _) in text.match_indices(base) {
            if text[..at].ends_with(ident) {
                continue;
            }
            let rest = &text[at + base.len()..];
            let end = rest
                .find(|c: char| !(ident(c) || c == ':'))
                .unwrap_or(rest.len());
            let mut path: Vec<String> = match base {
                "super::" => module[..module.len().saturating_sub(1)].to_vec(),
                _ => Vec::new(),
            };
            path.extend(
                rest[..end]
                    .split("::")
                    .filter(|s| !s.is_empty())
                    .map(String::from),
            );
            if rest[end..].starts_with('{') {
                let group = &rest[end + 1..rest[end..].find('}').map_or(end + 1, |e| end + e)];
                for item in group.split(',') {
                    let item = item.trim().split(" as ").next().unwrap_or("");
                    let mut p = path.clone();
                    p.extend(
                        item.split("::")
                            .filter(|s| !s.is_empty() && *s != "self")
                            .map(String::from),
                    );
                    out.push(p);
                }
            }
            out.push(path);
        }
    }
    out
}

fn imports(root: &Path) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
    let mut files = Vec::new();
    rust_files(root, &mut files);
    let lib = root.join("lib.rs");
    let mut edges = BTreeMap::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("a source file");
        // Test modules may reach anywhere.
        let text = text.split("#[cfg(test)]\nmod ").next().unwrap_or("");
        let code: String = text
            .lines()
            .map(|l| l.split("//").next().unwrap_or(""))
            .collect::<Vec<_>>()
            .join("\n");
        let module = module_of(file, root);
        let to: BTreeSet<PathBuf> = named_paths(&code, &module)
            .iter()
            .map(|p| file_of(root, p))
            .filter(|t| t != file && *t != lib)
            .collect();
        edges.insert(file.clone(), to);
    }
    edges
}

/// The strongly connected components of `edges` (Tarjan's).
fn components(edges: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<Vec<PathBuf>> {
    struct State<'a> {
        edges: &'a BTreeMap<PathBuf, BTreeSet<PathBuf>>,
        index: BTreeMap<&'a PathBuf, (usize, usize)>,
        stack: Vec<&'a PathBuf>,
        out: Vec<Vec<PathBuf>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a PathBuf) {
        let n = s.index.len();
        s.index.insert(v, (n, n));
        s.stack.push(v);
        for w in s.edges.get(v).into_iter().flatten() {
            let low = match s.index.get(w) {
                None => {
                    visit(s, w);
                    s.index[w].1
                }
                Some(&(i, _)) if s.stack.contains(&w) => i,
                Some(_) => continue,
            };
            let entry = s.index.get_mut(v).expect("visited");
            entry.1 = entry.1.min(low);
        }
        let (i, low) = s.index[v];
        if i == low {
            let at = s.stack.iter().rposition(|x| *x == v).expect("on the stack");
            s.out.push(s.stack.drain(at..).cloned().collect());
        }
    }
    let mut s = State {
        edges,
        index: BTreeMap::new(),
        stack: Vec::new(),
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out
}

#[test]
fn no_circle_of_imports_spans_more_than_two_files() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let edges = imports(&root);
    assert!(edges.len() > 50, "{} files", edges.len());
    // The reader finds the imports it should: the session names the
    // checkpoint's state arrays.
    let session = root.join("train/session/mod.rs");
    assert!(edges[&session].contains(&root.join("train/checkpoint/sharded.rs")));
    for component in components(&edges) {
        assert!(
            component.len() <= 2,
            "a circle of imports: {:?}",
            component
                .iter()
                .map(|f| f.strip_prefix(&root).unwrap_or(f).display().to_string())
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn a_circle_of_three_is_found() {
    let p = |s: &str| PathBuf::from(s);
    let edges: BTreeMap<PathBuf, BTreeSet<PathBuf>> = [
        (p("a"), [p("b")].into()),
        (p("b"), [p("c")].into()),
        (p("c"), [p("a")].into()),
        (p("d"), [p("a")].into()),
    ]
    .into();
    let mut sizes: Vec<usize> = components(&edges).iter().map(Vec::len).collect();
    sizes.sort();
    assert_eq!(sizes, [1, 3]);
}

//! The source tree's shape, read from the sources themselves (the book:
//! Inside it → Architecture and layout):
//!
//! - inside `src/filter/` every reference runs down the floors: proxy →
//!   flow → stages → the call floor (the `Host` trait, one script call, the
//!   token → owner table, deferred calls, hand-offs, retries) → the
//!   filter's pure cores; below them all, the crate's pure cores outside
//!   `src/filter/`, which never reach into it;
//! - no import circle between `src/` files (a module's references to its
//!   own submodules are its parts, not imports), nor between the crate's
//!   top-level modules, nor between `envoy/`'s Python modules;
//! - no file of `src/` over 650 code lines (the stage rule's size).
//!
//! References are read from `use` trees and from paths in code
//! (`crate::…`, `super::…`, `self::…`, a submodule's name); comments,
//! strings and test-only code (`#[cfg(test)]` items and modules) are left
//! out. A new file directly under `src/filter/` must be given its floor in
//! [`FLOORS`]: the test names it until it is.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The floors of `src/filter/`, highest first; a file may reference its own
/// floor and those below. Prefixes are relative to `src/`; the longest that
/// matches wins. Everything outside `src/filter/` is floor 0.
const FLOORS: &[(&str, u8)] = &[
    // The proxy-wasm glue: the ABI's callbacks, the Host over host calls.
    ("filter/proxy/", 5),
    // One request's lifecycle: the stages' order, which stage owns a reply.
    ("filter/flow.rs", 4),
    // One file per feature, each owning its state and its replies.
    ("filter/stage/", 3),
    // The call floor: what every stage uses to talk to Redis and the host.
    ("filter/mod.rs", 2),
    ("filter/call.rs", 2),
    ("filter/owner.rs", 2),
    ("filter/deferred.rs", 2),
    ("filter/handoff.rs", 2),
    ("filter/retry.rs", 2),
    ("filter/cas.rs", 2),
    ("filter/first_failure.rs", 2),
    // The filter's pure cores: no Host, no call.
    ("filter/counter.rs", 1),
    ("filter/clock.rs", 1),
    ("filter/timers.rs", 1),
    ("filter/in_flight.rs", 1),
];

const FLOOR_NAMES: [&str; 6] = [
    "pure cores",
    "filter cores",
    "call floor",
    "stages",
    "flow",
    "proxy",
];

const MAX_CODE_LINES: usize = 650;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `text` with comments blanked out (newlines kept); with `strings`, the
/// contents of string and char literals too.
fn blank(text: &str, strings: bool) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let keep = |out: &mut String, ch: char, blank_it: bool| {
        out.push(if ch == '\n' || !blank_it { ch } else { ' ' });
    };
    let mut i = 0;
    while i < c.len() {
        let next = c.get(i + 1).copied();
        if c[i] == '/' && next == Some('/') {
            while i < c.len() && c[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c[i] == '/' && next == Some('*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    keep(&mut out, c[i], true);
                    i += 1;
                }
            }
        } else if c[i] == 'r'
            && (next == Some('"') || next == Some('#'))
            && (i == 0 || !(c[i - 1].is_alphanumeric() || c[i - 1] == '_'))
        {
            // A raw string: r"…", r#"…"#.
            let mut j = i + 1;
            while c.get(j) == Some(&'#') {
                j += 1;
            }
            if c.get(j) != Some(&'"') {
                out.push(c[i]);
                i += 1;
                continue;
            }
            let hashes = j - i - 1;
            out.extend(&c[i..=j]);
            i = j + 1;
            while i < c.len() {
                if c[i] == '"' && (1..=hashes).all(|k| c.get(i + k) == Some(&'#')) {
                    out.extend(&c[i..=i + hashes]);
                    i += hashes + 1;
                    break;
                }
                keep(&mut out, c[i], strings);
                i += 1;
            }
        } else if c[i] == '"' {
            out.push('"');
            i += 1;
            while i < c.len() && c[i] != '"' {
                if c[i] == '\\' {
                    keep(&mut out, c[i], strings);
                    i += 1;
                }
                if i < c.len() {
                    keep(&mut out, c[i], strings);
                    i += 1;
                }
            }
            out.push('"');
            i += 1;
        } else if c[i] == '\'' && (next == Some('\\') || c.get(i + 2) == Some(&'\'')) {
            // A char literal ('x', '\n', '\u{..}'), not a lifetime ('a).
            out.push('\'');
            i += 1;
            while i < c.len() && c[i] != '\'' {
                if c[i] == '\\' {
                    keep(&mut out, c[i], strings);
                    i += 1;
                }
                if i < c.len() {
                    keep(&mut out, c[i], strings);
                    i += 1;
                }
            }
            out.push('\'');
            i += 1;
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

/// `code` (comments and strings blanked) without its `#[cfg(test)]` items:
/// from the attribute to the item's `;` or its closing brace.
fn without_tests(code: &str) -> String {
    let mut out = code.to_string();
    while let Some(at) = out.find("#[cfg(test)]") {
        let b = out.as_bytes();
        let mut i = at;
        let mut depth = 0usize;
        while i < b.len() {
            match b[i] {
                b'{' => depth += 1,
                b'}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        break;
                    }
                }
                b';' if depth == 0 => break,
                _ => {}
            }
            i += 1;
        }
        let end = (i + 1).min(b.len());
        let lines = out[at..end].matches('\n').count();
        out.replace_range(at..end, &"\n".repeat(lines));
    }
    out
}

fn is_ident(ch: char) -> bool {
    ch.is_alphanumeric() || ch == '_'
}

/// One source file as the module tree places it.
#[derive(Debug, Clone)]
struct Module {
    /// Path relative to `src/`.
    file: String,
    /// The crate it belongs to: `lib` or a binary's name.
    krate: &'static str,
    /// Its module path inside that crate.
    path: Vec<String>,
    /// Declared `#[cfg(test)]`, or under such a module.
    test: bool,
    /// Its submodules declared as files (`mod x;`).
    children: Vec<String>,
}

/// The `mod x;` declarations of a file: (name, under #[cfg(test)], #[path]).
fn declarations(text: &str) -> Vec<(String, bool, Option<String>)> {
    let code = blank(text, false);
    let mut found = Vec::new();
    let mut attrs: Vec<String> = Vec::new();
    for line in code.lines().map(str::trim) {
        if line.starts_with("#[") {
            attrs.push(line.to_string());
            continue;
        }
        let decl = line
            .trim_start_matches("pub(crate) ")
            .trim_start_matches("pub(super) ")
            .trim_start_matches("pub ");
        if let Some(name) = decl.strip_prefix("mod ").and_then(|d| d.strip_suffix(';')) {
            let test = attrs.iter().any(|a| a == "#[cfg(test)]");
            let path = attrs.iter().find_map(|a| {
                let inner = a.strip_prefix("#[path = \"")?.strip_suffix("\"]")?;
                Some(inner.to_string())
            });
            found.push((name.trim().to_string(), test, path));
        }
        if !line.is_empty() {
            attrs.clear();
        }
    }
    found
}

/// Every file of a crate, from its root through its `mod` declarations.
fn crate_modules(krate: &'static str, root_file: &str) -> Vec<Module> {
    let src = root().join("src");
    let mut all = Vec::new();
    let mut todo = vec![(root_file.to_string(), Vec::<String>::new(), false)];
    while let Some((file, path, test)) = todo.pop() {
        let text = fs::read_to_string(src.join(&file)).unwrap_or_default();
        let dir = Path::new(&file)
            .parent()
            .unwrap_or(Path::new(""))
            .to_path_buf();
        let stem = Path::new(&file)
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("");
        let own_dir = if ["mod", "lib", "main"].contains(&stem) || path.is_empty() {
            dir.clone()
        } else {
            dir.join(stem)
        };
        let mut children = Vec::new();
        for (name, child_test, at) in declarations(&text) {
            let child = match at {
                Some(p) => dir.join(p),
                None if src.join(own_dir.join(format!("{name}.rs"))).is_file() => {
                    own_dir.join(format!("{name}.rs"))
                }
                None => own_dir.join(&name).join("mod.rs"),
            };
            let mut child_path = path.clone();
            child_path.push(name.clone());
            children.push(name);
            let child = child.to_string_lossy().into_owned();
            todo.push((child, child_path, test || child_test));
        }
        all.push(Module {
            file,
            krate,
            path,
            test,
            children,
        });
    }
    all
}

/// Every path a file's code names, as segments: `use` trees expanded, then
/// the paths in the rest of the code.
fn named_paths(code: &str) -> Vec<Vec<String>> {
    fn expand(tree: &str, prefix: &[String], out: &mut Vec<Vec<String>>) {
        let tree = tree.trim();
        if let Some(open) = tree.find('{') {
            let mut base = prefix.to_vec();
            base.extend(segments(&tree[..open]));
            let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
            let mut depth = 0;
            let mut start = 0;
            for (i, ch) in inner.char_indices() {
                match ch {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        expand(&inner[start..i], &base, out);
                        start = i + 1;
                    }
                    _ => {}
                }
            }
            expand(&inner[start..], &base, out);
        } else if !tree.is_empty() {
            let mut path = prefix.to_vec();
            let tree = tree.split(" as ").next().unwrap_or(tree);
            path.extend(
                segments(tree)
                    .into_iter()
                    .filter(|s| s != "self" || prefix.is_empty()),
            );
            out.push(path);
        }
    }
    fn segments(path: &str) -> Vec<String> {
        path.split("::")
            .map(str::trim)
            .filter(|s| !s.is_empty() && *s != "*")
            .map(String::from)
            .collect()
    }
    let mut out = Vec::new();
    let mut rest = String::new();
    let mut i = 0;
    while let Some(at) = code[i..].find("use ").map(|at| at + i) {
        let before = code[..at].chars().next_back();
        let end = code[at..].find(';').map_or(code.len(), |e| at + e);
        if before.is_some_and(is_ident) {
            rest.push_str(&code[i..at + 4]);
            i = at + 4;
            continue;
        }
        rest.push_str(&code[i..at]);
        expand(&code[at + 4..end], &[], &mut out);
        i = (end + 1).min(code.len());
    }
    rest.push_str(&code[i..]);
    // Paths in code: an identifier followed by `::`, not itself after `::`.
    let c: Vec<char> = rest.chars().collect();
    let mut j = 0;
    while j < c.len() {
        let starts = is_ident(c[j]) && (j == 0 || !is_ident(c[j - 1]));
        let after_colons = j >= 2 && c[j - 1] == ':' && c[j - 2] == ':';
        if !starts || after_colons {
            j += 1;
            continue;
        }
        let mut path = Vec::new();
        let mut k = j;
        loop {
            let s = k;
            while k < c.len() && is_ident(c[k]) {
                k += 1;
            }
            path.push(c[s..k].iter().collect::<String>());
            if c.get(k) == Some(&':')
                && c.get(k + 1) == Some(&':')
                && c.get(k + 2).is_some_and(|&ch| is_ident(ch))
            {
                k += 2;
            } else {
                break;
            }
        }
        if path.len() > 1 {
            out.push(path);
        }
        j = k.max(j + 1);
    }
    out
}

struct Tree {
    modules: Vec<Module>,
}

impl Tree {
    fn read() -> Tree {
        let mut modules = crate_modules("lib", "lib.rs");
        modules.extend(crate_modules("redis-guard", "cli/main.rs"));
        Tree { modules }
    }

    fn find(&self, krate: &str, path: &[String]) -> Option<&Module> {
        (0..=path.len()).rev().find_map(|n| {
            self.modules
                .iter()
                .find(|m| m.krate == krate && m.path == path[..n])
        })
    }

    /// The files `m` references: (file, whether it is one of `m`'s own
    /// submodules or below them).
    fn references(&self, m: &Module) -> BTreeSet<(String, bool)> {
        let text = fs::read_to_string(root().join("src").join(&m.file)).unwrap_or_default();
        let code = without_tests(&blank(&text, true));
        let mut found = BTreeSet::new();
        for path in named_paths(&code) {
            let Some(head) = path.first() else {
                continue;
            };
            let (mut base, rest) = match head.as_str() {
                "crate" => (Vec::new(), &path[1..]),
                "self" => (m.path.clone(), &path[1..]),
                "super" => {
                    let mut base = m.path.clone();
                    let mut rest = &path[..];
                    while rest.first().is_some_and(|s| s == "super") {
                        base.pop();
                        rest = &rest[1..];
                    }
                    (base, rest)
                }
                child if m.children.iter().any(|c| c == child) => (m.path.clone(), &path[..]),
                _ => continue,
            };
            base.extend(rest.iter().cloned());
            if let Some(to) = self.find(m.krate, &base) {
                if to.file != m.file {
                    let below = to.path.len() > m.path.len() && to.path.starts_with(&m.path);
                    found.insert((to.file.clone(), below));
                }
            }
        }
        found
    }
}

fn floor(file: &str) -> Option<u8> {
    if !file.starts_with("filter/") {
        return Some(0);
    }
    FLOORS
        .iter()
        .filter(|(prefix, _)| file.starts_with(prefix))
        .max_by_key(|(prefix, _)| prefix.len())
        .map(|(_, floor)| *floor)
}

/// The circles of a graph: its strongly connected parts of more than one node.
fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    // Reachability from every node: quadratic, plenty for a tree this size.
    let reach = |from: &str| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_string()];
        while let Some(n) = todo.pop() {
            for t in edges.get(&n).into_iter().flatten() {
                if seen.insert(t.clone()) {
                    todo.push(t.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&String, BTreeSet<String>> =
        edges.keys().map(|n| (n, reach(n))).collect();
    let mut parts: BTreeSet<Vec<String>> = BTreeSet::new();
    for (n, from_n) in &reaches {
        if !from_n.contains(*n) {
            continue;
        }
        let part: Vec<String> = from_n
            .iter()
            .filter(|m| reaches.get(m).is_some_and(|r| r.contains(*n)))
            .cloned()
            .collect();
        parts.insert(part);
    }
    parts.into_iter().filter(|p| p.len() > 1).collect()
}

#[test]
fn inside_the_filter_every_reference_runs_down_the_floors() {
    let tree = Tree::read();
    let mut wrong = Vec::new();
    for m in tree.modules.iter().filter(|m| m.krate == "lib" && !m.test) {
        let Some(mine) = floor(&m.file) else {
            wrong.push(format!(
                "src/{} has no floor: add it to FLOORS in tests/layering.rs",
                m.file
            ));
            continue;
        };
        for (to, _) in tree.references(m) {
            let theirs = floor(&to).unwrap_or(u8::MAX);
            if theirs > mine {
                wrong.push(format!(
                    "src/{} ({}) references src/{to} ({}), a floor up",
                    m.file,
                    FLOOR_NAMES[usize::from(mine)],
                    FLOOR_NAMES.get(usize::from(theirs)).unwrap_or(&"no floor"),
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn no_import_circle_in_src() {
    let tree = Tree::read();
    let mut files: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut tops: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let top = |m: &Module| {
        m.path
            .first()
            .cloned()
            .unwrap_or_else(|| m.krate.to_string())
    };
    for m in tree.modules.iter().filter(|m| !m.test) {
        for (to, below) in tree.references(m) {
            let Some(t) = tree.modules.iter().find(|t| t.file == to) else {
                continue;
            };
            if t.test || below {
                continue;
            }
            files.entry(m.file.clone()).or_default().insert(to.clone());
            if m.krate == "lib" && top(m) != top(t) {
                let from = format!("{}::{}", m.krate, top(m));
                tops.entry(from)
                    .or_default()
                    .insert(format!("{}::{}", t.krate, top(t)));
            }
        }
    }
    let mut found: Vec<String> = circles(&files)
        .into_iter()
        .map(|c| format!("files: {}", c.join(" ↔ ")))
        .collect();
    found.extend(
        circles(&tops)
            .into_iter()
            .map(|c| format!("top-level modules: {}", c.join(" ↔ "))),
    );
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

/// Python's own modules under `envoy/` each file imports (`import x`,
/// `from x import y`, `from . import y`, in functions too).
fn python_imports(file: &Path, all: &BTreeSet<PathBuf>) -> BTreeSet<PathBuf> {
    let text = fs::read_to_string(file).unwrap_or_default();
    let dir = file.parent().unwrap_or(Path::new(""));
    let envoy = root().join("envoy");
    let resolve = |dots: usize, name: &str| -> Option<PathBuf> {
        let parts: Vec<&str> = name.split('.').filter(|s| !s.is_empty()).collect();
        let bases: Vec<PathBuf> = if dots > 0 {
            let mut base = dir.to_path_buf();
            for _ in 1..dots {
                base.pop();
            }
            vec![base]
        } else {
            vec![dir.to_path_buf(), envoy.clone()]
        };
        bases.into_iter().find_map(|base| {
            let stem = parts.iter().fold(base, |p, s| p.join(s));
            [stem.with_extension("py"), stem.join("__init__.py")]
                .into_iter()
                .find(|p| all.contains(p) && !parts.is_empty())
        })
    };
    let mut found = BTreeSet::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if let Some(names) = line.strip_prefix("import ") {
            for name in names.split(',') {
                let name = name.split(" as ").next().unwrap_or("").trim();
                found.extend(resolve(0, name));
            }
        } else if let Some(rest) = line.strip_prefix("from ") {
            let Some((module, names)) = rest.split_once(" import ") else {
                continue;
            };
            let dots = module.chars().take_while(|&c| c == '.').count();
            let module = &module[dots..];
            found.extend(resolve(dots, module));
            for name in names.split([',', '(', ')']) {
                let name = name.split(" as ").next().unwrap_or("").trim();
                if !name.is_empty() && name != "*" {
                    let sub = if module.is_empty() {
                        name.to_string()
                    } else {
                        format!("{module}.{name}")
                    };
                    found.extend(resolve(dots, &sub));
                }
            }
        }
    }
    found.remove(file);
    found
}

fn python_files(dir: &Path, out: &mut BTreeSet<PathBuf>) {
    for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            python_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "py") {
            out.insert(path);
        }
    }
}

#[test]
fn no_import_circle_in_envoy() {
    let mut all = BTreeSet::new();
    python_files(&root().join("envoy"), &mut all);
    let shown = |p: &Path| {
        p.strip_prefix(root())
            .unwrap_or(p)
            .to_string_lossy()
            .into_owned()
    };
    let edges: BTreeMap<String, BTreeSet<String>> = all
        .iter()
        .map(|f| {
            let to = python_imports(f, &all).iter().map(|t| shown(t)).collect();
            (shown(f), to)
        })
        .collect();
    let found = circles(&edges);
    assert!(
        found.is_empty(),
        "import circles in envoy/: {}",
        found
            .iter()
            .map(|c| c.join(" ↔ "))
            .collect::<Vec<_>>()
            .join("; ")
    );
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_file_of_src_over_650_code_lines() {
    let mut sizes = Vec::new();
    let mut files = Vec::new();
    rust_files(&root().join("src"), &mut files);
    for f in files {
        let text = fs::read_to_string(&f).unwrap_or_default();
        // Code lines: not blank once comments are gone, a file's test
        // module left out (a test-only file counts whole).
        let code = without_tests(&blank(&text, false));
        sizes.push((code.lines().filter(|l| !l.trim().is_empty()).count(), f));
    }
    sizes.sort();
    let over: Vec<String> = sizes
        .iter()
        .filter(|(n, _)| *n > MAX_CODE_LINES)
        .map(|(n, f)| format!("{} ({n})", f.strip_prefix(root()).unwrap_or(f).display()))
        .collect();
    assert!(
        over.is_empty(),
        "over {MAX_CODE_LINES} code lines (split along what the file does): {}",
        over.join(", ")
    );
}

/// The reader finds what it must: a reference up a floor, a circle, a
/// `use` tree's inner paths, and it leaves comments, strings and tests out.
#[test]
fn the_reader_finds_what_it_must() {
    let code = without_tests(&blank(
        "use crate::filter::{call::{Budget, ScriptCall}, owner::Calls as C, Host};\n\
         // crate::filter::flow::Flow in a comment\n\
         let s = \"crate::filter::proxy::x\";\n\
         let t = super::stage::lease::CHECK_MS;\n\
         #[cfg(test)]\nmod tests {\n    use crate::filter::flow::Flow;\n}\n",
        true,
    ));
    let paths: Vec<String> = named_paths(&code).iter().map(|p| p.join("::")).collect();
    assert_eq!(
        paths,
        [
            "crate::filter::call::Budget",
            "crate::filter::call::ScriptCall",
            "crate::filter::owner::Calls",
            "crate::filter::Host",
            "super::stage::lease::CHECK_MS",
        ]
    );
    assert_eq!(floor("filter/stage/idempotency/record.rs"), Some(3));
    assert_eq!(floor("filter/proxy/root.rs"), Some(5));
    assert_eq!(floor("filter/new_file.rs"), None);
    let graph: BTreeMap<String, BTreeSet<String>> =
        [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]
            .iter()
            .fold(BTreeMap::new(), |mut g, (f, t)| {
                g.entry(f.to_string()).or_default().insert(t.to_string());
                g
            });
    assert_eq!(circles(&graph), [vec!["a", "b", "c"]]);
    let tree = Tree::read();
    let lease = tree
        .modules
        .iter()
        .find(|m| m.file == "filter/stage/lease.rs");
    let refs = lease.map(|m| tree.references(m)).unwrap_or_default();
    assert!(
        refs.contains(&("filter/call.rs".to_string(), false)),
        "the lease stage's call import is read: {refs:?}"
    );
    assert!(
        tree.modules
            .iter()
            .any(|m| m.file == "filter/tests/ratelimit.rs" && m.test),
        "the filter's unit tests are known as tests"
    );
}

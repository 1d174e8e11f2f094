//! Size limits kept by machine: no product function over [`MAX_FN_LINES`] lines and no product
//! file over [`MAX_FILE_LINES`] lines unless it is on its allowlist beside this file
//! (`long_functions.txt`, `long_files.txt`), and the allowlists only shrink: an entry that no
//! longer exceeds its limit fails too, so whoever splits it strikes it. Test code (`tests/`,
//! `tests.rs`, inline `#[cfg(test)]` modules) and benches are exempt. Functions are counted the
//! way clippy's `too_many_lines` counts them (clippy.toml sets the same threshold): the body's
//! lines that hold code, without blank and comment-only lines.

use std::collections::BTreeSet;
use std::path::PathBuf;

use super::{collect, inline_test_modules, rel, repo_root};

/// clippy.toml's `too-many-lines-threshold`.
const MAX_FN_LINES: usize = 120;
const MAX_FILE_LINES: usize = 600;

/// The product crates' sources.
const PRODUCT_ROOTS: [&str; 7] = [
    "src",
    "protocol/src",
    "actors/src",
    "demo/src",
    "broker/src",
    "prompt/src",
    "replay/src",
];

/// Product `.rs` files (test files left out), sorted.
fn product_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    for root in PRODUCT_ROOTS {
        collect(&repo_root().join(root), &mut files);
    }
    files.retain(|p| {
        let r = rel(p);
        let name = r.rsplit('/').next().unwrap_or("");
        !(r.split('/').any(|c| c == "tests") || name == "tests.rs" || name.ends_with("_tests.rs"))
    });
    files.sort();
    files
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// `text` with comments blanked and the contents of string and char literals replaced by `s`,
/// byte for byte (offsets and newlines hold): every brace left is a code brace, every line left
/// blank held no code.
fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let fill = |out: &mut String, c: char, with: char| {
        if c == '\n' {
            out.push('\n');
        } else {
            out.extend(std::iter::repeat_n(with, c.len_utf8()));
        }
    };
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        let prev = i.checked_sub(1).map(|p| chars[p]);
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                fill(&mut out, chars[i], ' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0usize;
            while i < chars.len() {
                let pair = (chars[i], chars.get(i + 1).copied());
                if pair == ('/', Some('*')) || pair == ('*', Some('/')) {
                    depth = if pair.0 == '/' { depth + 1 } else { depth - 1 };
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    fill(&mut out, chars[i], ' ');
                    i += 1;
                }
            }
        } else if c == 'r'
            && prev.is_none_or(|p| !is_ident(p) || p == 'b')
            && let Some(hashes) = chars[i + 1..].iter().position(|c| *c != '#')
            && chars[i + 1 + hashes] == '"'
        {
            // r"..." / r#"..."#: ends at a quote followed by as many hashes.
            out.push('r');
            out.extend(std::iter::repeat_n('#', hashes));
            out.push('"');
            i += 2 + hashes;
            while i < chars.len() {
                let closes = chars[i] == '"'
                    && chars[i + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|c| **c == '#')
                        .count()
                        == hashes;
                if closes {
                    out.push('"');
                    out.extend(std::iter::repeat_n('#', hashes));
                    i += 1 + hashes;
                    break;
                }
                fill(&mut out, chars[i], 's');
                i += 1;
            }
        } else if c == '"' {
            out.push('"');
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' && i + 1 < chars.len() {
                    fill(&mut out, chars[i], 's');
                    i += 1;
                }
                fill(&mut out, chars[i], 's');
                i += 1;
            }
            if i < chars.len() {
                out.push('"');
                i += 1;
            }
        } else if c == '\'' && (next == Some('\\') || chars.get(i + 2) == Some(&'\'')) {
            // A char literal ('{', '\'', '\u{7b}'); a lifetime or label is left as code.
            let end = if next == Some('\\') {
                chars[i + 3..]
                    .iter()
                    .position(|c| *c == '\'')
                    .map_or(chars.len() - 1, |p| i + 3 + p)
            } else {
                i + 2
            };
            out.push('\'');
            for &inner in &chars[i + 1..end] {
                fill(&mut out, inner, 's');
            }
            out.push('\'');
            i = end + 1;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// `text` as code only, without its inline `#[cfg(test)]` modules: what the size and import
/// scans read.
pub(super) fn product_code(text: &str) -> String {
    without_test_modules(&code_only(text))
}

/// `code` (from [`code_only`]) with its inline `#[cfg(test)]` modules blanked.
fn without_test_modules(code: &str) -> String {
    let mut out = code.to_owned();
    for module in inline_test_modules(code) {
        let start = module.as_ptr() as usize - code.as_ptr() as usize;
        let blank: String = module
            .chars()
            .map(|c| if c == '\n' { '\n' } else { ' ' })
            .collect();
        out.replace_range(start..start + module.len(), &blank);
    }
    out
}

/// Every function with a body in `code` (from [`code_only`]): its name and its body's lines
/// that hold code, from the line of the opening brace to the closing one.
fn function_lengths(code: &str) -> Vec<(String, usize)> {
    let bytes = code.as_bytes();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(found) = code[from..].find("fn") {
        let at = from + found;
        from = at + 2;
        let rest = &code[at + 2..];
        let name: String = rest
            .trim_start_matches([' ', '\t'])
            .chars()
            .take_while(|c| is_ident(*c))
            .collect();
        let token = code[..at].chars().next_back().is_none_or(|c| !is_ident(c));
        if !token || !rest.starts_with([' ', '\t']) || name.is_empty() {
            continue;
        }
        let Some(signature) = rest.find(['{', ';']) else {
            continue;
        };
        if rest.as_bytes()[signature] == b';' {
            continue; // a declaration without a body
        }
        let open = at + 2 + signature;
        let mut depth = 0usize;
        let mut close = None;
        for (k, b) in bytes[open..].iter().enumerate() {
            match b {
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        close = Some(open + k);
                        break;
                    }
                }
                _ => {}
            }
        }
        let Some(close) = close else {
            continue;
        };
        let line_start = code[..open].rfind('\n').map_or(0, |n| n + 1);
        let lines = code[line_start..=close]
            .lines()
            .filter(|l| !l.trim().is_empty())
            .count();
        out.push((name, lines));
    }
    out
}

/// The entries of an allowlist file beside this one (`#` comments and blank lines skipped).
fn allowlist(name: &str) -> BTreeSet<String> {
    let path = repo_root().join("tests/it/tidy").join(name);
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("read {}: {e}", rel(&path)))
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect()
}

/// Fails when `found` (what exceeds the limit today) is not exactly the allowlist `name`.
fn check_allowlist(name: &str, found: &BTreeSet<String>, what: &str) {
    let listed = allowlist(name);
    let new: Vec<&String> = found.difference(&listed).collect();
    let gone: Vec<&String> = listed.difference(found).collect();
    assert!(
        new.is_empty(),
        "{what}, not on tests/it/tidy/{name}: {new:#?}\nsplit them (the list only shrinks)"
    );
    assert!(
        gone.is_empty(),
        "on tests/it/tidy/{name} but no longer {what}: {gone:#?}\nstrike them from the list"
    );
}

#[test]
fn no_product_function_off_the_allowlist_is_over_120_lines() {
    let mut long = BTreeSet::new();
    let files = product_files();
    assert!(files.len() > 100, "the scan found the product files");
    for file in files {
        let text = std::fs::read_to_string(&file).expect("read a source file");
        let code = product_code(&text);
        for (name, lines) in function_lengths(&code) {
            if lines > MAX_FN_LINES {
                long.insert(format!("{}::{name}", rel(&file)));
            }
        }
    }
    check_allowlist(
        "long_functions.txt",
        &long,
        &format!("product functions over {MAX_FN_LINES} lines"),
    );
}

#[test]
fn no_product_file_off_the_allowlist_is_over_600_lines() {
    let long: BTreeSet<String> = product_files()
        .into_iter()
        .filter(|file| {
            let text = std::fs::read_to_string(file).expect("read a source file");
            text.lines().count() > MAX_FILE_LINES
        })
        .map(|file| rel(&file))
        .collect();
    check_allowlist(
        "long_files.txt",
        &long,
        &format!("product files over {MAX_FILE_LINES} lines"),
    );
}

#[test]
fn the_size_scan_sees_code_only() {
    let text = concat!(
        "fn a() {\n    let s = \"}}\"; // }\n    let c = '{';\n    /* { */\n\n    b()\n}\n",
        "trait T {\n    fn decl(&self);\n}\n",
        "fn raw() -> &'static str {\n    r#\"{ \"\n }\"#\n}\n",
        "#[cfg(test)]\nmod tests {\n    fn t() {\n        x()\n    }\n}\n",
    );
    let code = code_only(text);
    assert_eq!(code.len(), text.len(), "offsets hold");
    assert_eq!(code.lines().count(), text.lines().count(), "lines hold");
    assert_eq!(
        function_lengths(&code),
        [
            ("a".to_owned(), 5),
            ("raw".to_owned(), 4),
            ("t".to_owned(), 3)
        ]
    );
    assert_eq!(
        function_lengths(&without_test_modules(&code)),
        [("a".to_owned(), 5), ("raw".to_owned(), 4)]
    );
}

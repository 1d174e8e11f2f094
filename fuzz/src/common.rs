//! What the fuzz-target bodies share: [`Source`], a byte reader that turns the fuzzer's input into
//! choices (a small `arbitrary::Unstructured`, kept here so that the corpus replay in the
//! repository's stable tests needs no extra crate), the split of an input into pieces (to check
//! that a parser fed in pieces agrees with itself fed whole), and a JSON value generator for the
//! structured targets.
//!
//! Included by path (`#[path]`) into the replay tests as well as compiled into the fuzz crate, so
//! the replay runs exactly what the fuzzer ran.

use serde_json::{Map, Number, Value};

/// Reads choices from the front of the fuzzer's bytes; an exhausted source answers zeros.
#[derive(Debug)]
pub struct Source<'a> {
    data: &'a [u8],
}

impl<'a> Source<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Self { data }
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub fn byte(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    /// A number in `0..n` (`n` at most 65,536; 0 for `n == 0`).
    pub fn below(&mut self, n: usize) -> usize {
        if n <= 1 {
            return 0;
        }
        let raw = if n <= 256 {
            usize::from(self.byte())
        } else {
            usize::from(self.byte()) << 8 | usize::from(self.byte())
        };
        raw % n
    }

    pub fn u64(&mut self) -> u64 {
        (0..8).fold(0u64, |n, _| n << 8 | u64::from(self.byte()))
    }

    pub fn bool(&mut self) -> bool {
        self.byte() & 1 == 1
    }

    /// One of `items` (the first when exhausted).
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    /// Up to `max` bytes (a length byte, then the bytes).
    pub fn bytes(&mut self, max: usize) -> &'a [u8] {
        let n = self.below(max + 1).min(self.data.len());
        let (taken, rest) = self.data.split_at(n);
        self.data = rest;
        taken
    }

    /// Everything left.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }
}

/// `data` cut into pieces of 1 to 64 bytes, the sizes drawn from `seed` (a small LCG), so a
/// parser fed piece by piece can be compared with itself fed whole.
pub fn pieces(data: &[u8], seed: u8) -> Vec<&[u8]> {
    let mut state = u32::from(seed).wrapping_mul(2_654_435_761).wrapping_add(1);
    let mut out = Vec::new();
    let mut rest = data;
    while !rest.is_empty() {
        state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        let size = ((state >> 16) as usize % 64 + 1).min(rest.len());
        let (piece, tail) = rest.split_at(size);
        out.push(piece);
        rest = tail;
    }
    out
}

/// A text: one of `words` most of the time, else a short string of raw (lossily decoded) bytes.
pub fn text(src: &mut Source<'_>, words: &[&str]) -> String {
    if src.below(4) == 0 || words.is_empty() {
        String::from_utf8_lossy(src.bytes(12)).into_owned()
    } else {
        src.pick(words).to_owned()
    }
}

/// Any JSON value of at most `depth` levels, keys and strings drawn mostly from `words`.
pub fn json(src: &mut Source<'_>, depth: u32, words: &[&str]) -> Value {
    let kinds = if depth == 0 { 5 } else { 7 };
    match src.below(kinds) {
        0 => Value::Null,
        1 => Value::Bool(src.bool()),
        2 => Value::Number(number(src)),
        3 | 4 => Value::String(text(src, words)),
        5 => Value::Array(
            (0..src.below(4))
                .map(|_| json(src, depth - 1, words))
                .collect(),
        ),
        _ => {
            let mut map = Map::new();
            for _ in 0..src.below(4) {
                map.insert(text(src, words), json(src, depth - 1, words));
            }
            Value::Object(map)
        }
    }
}

/// A JSON number: small, huge, negative or fractional.
pub fn number(src: &mut Source<'_>) -> Number {
    match src.below(4) {
        0 => Number::from(src.below(300) as u64),
        1 => Number::from(src.u64()),
        2 => Number::from(-(src.below(1000) as i64)),
        _ => Number::from_f64(src.below(10_000) as f64 / 7.0).unwrap_or(Number::from(0)),
    }
}

/// `Some(value())` usually, absent sometimes, any JSON value (the wrong type) sometimes.
pub fn maybe(
    src: &mut Source<'_>,
    words: &[&str],
    value: impl FnOnce(&mut Source<'_>) -> Value,
) -> Option<Value> {
    match src.below(8) {
        0 => None,
        1 => Some(json(src, 2, words)),
        _ => Some(value(src)),
    }
}

/// An object of the members `fields` produce (absent ones left out), plus an unknown one sometimes.
pub fn object(fields: Vec<(&str, Option<Value>)>, src: &mut Source<'_>, words: &[&str]) -> Value {
    let mut map: Map<String, Value> = fields
        .into_iter()
        .filter_map(|(k, v)| Some((k.to_owned(), v?)))
        .collect();
    if src.below(8) == 0 {
        map.insert(text(src, words), json(src, 1, words));
    }
    Value::Object(map)
}

/// The corpus replay of the repository's stable tests (`tests/it/fuzz_corpus.rs`,
/// `protocol/tests/it/fuzz_corpus.rs`): runs `body` over every file of `<corpus>/<target>/`; a
/// panic names the file. The fuzz binaries do not call it.
pub fn replay_corpus(corpus: &std::path::Path, target: &str, body: fn(&[u8])) {
    let dir = corpus.join(target);
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{} holds no corpus", dir.display());
    // On a thread with libFuzzer's main-thread stack and room for unoptimised frames: a
    // decoder may recurse to its nesting bound (rmp-serde's 1,024 levels take < 256 KiB in a
    // release build, several MiB in a debug one).
    let name = target.to_owned();
    let replay = move || {
        let target = name;
        for file in files {
            let data = std::fs::read(&file).expect("a corpus file");
            if std::panic::catch_unwind(|| body(&data)).is_err() {
                panic!("fuzz target {target} fails on {}", file.display());
            }
        }
    };
    let target = target.to_owned();
    std::thread::Builder::new()
        .name(target.clone())
        .stack_size(64 << 20)
        .spawn(replay)
        .expect("a replay thread")
        .join()
        .unwrap_or_else(|_| panic!("the replay of {target} failed"));
}

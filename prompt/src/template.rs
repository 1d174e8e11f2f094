//! Hugging Face chat templates on minijinja: the environment transformers renders with
//! (`trim_blocks`, `lstrip_blocks`, loop controls, Python string methods, `raise_exception`,
//! `strftime_now`, a `json.dumps`-compatible `tojson`), with no loader and bounded fuel.
//!
//! Templates are fleet-authored code that the operator pinned by checksum; the bounds here keep
//! a pinned template that misbehaves on some request from costing more than one failed render.

use std::fmt::Write as _;
use std::io;

#[cfg(test)]
use minijinja::value::Serde;
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, syntax::SyntaxConfig};

use continuum_protocol::kv::prompt::RENDER_FUEL;

mod locality;

/// Template names inside the environment.
const DEFAULT_NAME: &str = "default";
const TOOL_USE_NAME: &str = "tool_use";
/// tokenizer_config.json files beyond this are not configs (the artifact cap is 64 MiB; real
/// configs with embedded templates are well under 1 MiB).
const MAX_CONFIG_BYTES: usize = 16 << 20;
/// A template source beyond this is refused before compiling.
const MAX_TEMPLATE_BYTES: usize = 1 << 20;
/// Nesting a `tojson` will walk (Python's default recursion limit is far above real tools).
const MAX_JSON_DEPTH: usize = 128;

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("tokenizer_config.json is not a JSON object: {0}")]
    Config(String),
    #[error("tokenizer_config.json has no chat_template")]
    NoChatTemplate,
    #[error("chat_template list has no \"default\" entry")]
    NoDefaultTemplate,
    #[error("template source is {0} bytes, over the {MAX_TEMPLATE_BYTES}-byte cap")]
    TooLarge(usize),
    #[error("template does not compile: {0}")]
    Syntax(String),
}

/// The special tokens transformers passes to a template (`special_tokens_map`): absent ones are
/// undefined in the template, as in Python.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub unk_token: Option<String>,
    pub pad_token: Option<String>,
}

impl SpecialTokens {
    /// Reads `bos_token` etc. from a tokenizer_config.json object: a string, or an AddedToken
    /// object `{ "content": ... }`; `null` and anything else count as absent.
    pub fn from_config(config: &serde_json::Map<String, serde_json::Value>) -> Self {
        let token = |key: &str| match config.get(key) {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Object(o)) => o
                .get("content")
                .and_then(serde_json::Value::as_str)
                .map(str::to_owned),
            _ => None,
        };
        Self {
            bos_token: token("bos_token"),
            eos_token: token("eos_token"),
            unk_token: token("unk_token"),
            pad_token: token("pad_token"),
        }
    }

    fn insert_into(&self, ctx: &mut Vec<(&'static str, Value)>) {
        for (name, value) in [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
            ("unk_token", &self.unk_token),
            ("pad_token", &self.pad_token),
        ] {
            if let Some(value) = value {
                ctx.push((name, Value::from(value.as_str())));
            }
        }
    }
}

/// A compiled chat template (and its `tool_use` variant when the config names one).
pub struct ChatTemplate {
    env: Environment<'static>,
    has_tool_use: bool,
    special: SpecialTokens,
    /// Whether the default / `tool_use` template is message-local (`locality`): then its
    /// rewrite is in the environment as `<name>_local`.
    local: [bool; 2],
    /// The rewrite's marks around the loop's text: random per template, so no request can
    /// know them (a text that holds one anyway is rendered whole).
    marks: [String; 2],
}

/// A render of a message-local template from message `from` on ([`ChatTemplate::render_local`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct LocalText {
    /// The text before the loop, the loop's text from message `from` on, the text after it.
    pub text: String,
    /// Where the loop's text starts and ends in `text`.
    pub loop_start: usize,
    pub loop_end: usize,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("has_tool_use", &self.has_tool_use)
            .field("special", &self.special)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// From a tokenizer_config.json: `chat_template` as a string, or as a list of
    /// `{name, template}` of which `default` (and `tool_use`, when tools are sent) are used.
    pub fn from_tokenizer_config_json(bytes: &[u8]) -> Result<Self, TemplateError> {
        if bytes.len() > MAX_CONFIG_BYTES {
            return Err(TemplateError::Config(format!(
                "{} bytes, over the {MAX_CONFIG_BYTES}-byte cap",
                bytes.len()
            )));
        }
        let config: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(bytes).map_err(|e| TemplateError::Config(e.to_string()))?;
        let special = SpecialTokens::from_config(&config);
        match config.get("chat_template") {
            Some(serde_json::Value::String(source)) => Self::compile(source, None, special),
            Some(serde_json::Value::Array(entries)) => {
                let named = |wanted: &str| {
                    entries.iter().find_map(|entry| {
                        (entry.get("name")?.as_str()? == wanted)
                            .then(|| entry.get("template")?.as_str())
                            .flatten()
                    })
                };
                let default = named(DEFAULT_NAME).ok_or(TemplateError::NoDefaultTemplate)?;
                Self::compile(default, named(TOOL_USE_NAME), special)
            }
            _ => Err(TemplateError::NoChatTemplate),
        }
    }

    /// From a raw `.jinja` file (`chat_template_file` on the card) and the model's special tokens.
    pub fn from_jinja(source: &str, special: SpecialTokens) -> Result<Self, TemplateError> {
        Self::compile(source, None, special)
    }

    /// Tests register blocking or counting functions to drive the renderer deterministically.
    #[cfg(test)]
    pub(crate) fn env_mut(&mut self) -> &mut Environment<'static> {
        &mut self.env
    }

    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    fn compile(
        default: &str,
        tool_use: Option<&str>,
        special: SpecialTokens,
    ) -> Result<Self, TemplateError> {
        let mut env = hf_environment(RENDER_FUEL);
        let mut local = [false; 2];
        for (i, (name, source)) in [(DEFAULT_NAME, Some(default)), (TOOL_USE_NAME, tool_use)]
            .into_iter()
            .enumerate()
        {
            let Some(source) = source else { continue };
            if source.len() > MAX_TEMPLATE_BYTES {
                return Err(TemplateError::TooLarge(source.len()));
            }
            env.add_template_owned(name, source.to_owned())
                .map_err(|e| TemplateError::Syntax(e.to_string()))?;
            if let Ok(rewritten) = locality::rewrite(source, hf_syntax()) {
                local[i] = env
                    .add_template_owned(format!("{name}_local"), rewritten)
                    .is_ok();
            }
        }
        let mark = |end: char| {
            let random = |n: u64| {
                use std::hash::{BuildHasher, Hasher};
                let mut h = std::collections::hash_map::RandomState::new().build_hasher();
                h.write_u64(n);
                h.finish()
            };
            format!("\u{F8FF}{:016x}{:016x}{end}\u{F8FF}", random(1), random(2))
        };
        Ok(Self {
            env,
            has_tool_use: tool_use.is_some(),
            special,
            local,
            marks: [mark('['), mark(']')],
        })
    }

    /// The template a request renders with: `tool_use` when it sends tools and there is one.
    fn variant(&self, has_tools: bool) -> usize {
        usize::from(has_tools && self.has_tool_use)
    }

    /// Whether the template `input` renders with is message-local.
    pub(crate) fn is_local(&self, has_tools: bool) -> bool {
        self.local[self.variant(has_tools)]
    }

    /// Renders the message-local rewrite of the template, skipping messages before `from`:
    /// `None` when the template is not message-local or a mark is not found exactly once (a
    /// message that holds one), for the caller to render whole.
    pub(crate) fn render_local(
        &self,
        input: &TemplateInput,
        from: usize,
        fuel: u64,
        max_bytes: usize,
    ) -> Result<Option<LocalText>, RenderFailure> {
        let variant = self.variant(input.has_tools);
        if !self.local[variant] {
            return Ok(None);
        }
        let name = if variant == 1 {
            "tool_use_local"
        } else {
            "default_local"
        };
        let [start, end] = &self.marks;
        let extra = [
            (locality::FROM_VAR, Value::from(from)),
            (locality::START_VAR, Value::from(start.as_str())),
            (locality::END_VAR, Value::from(end.as_str())),
        ];
        let cap = max_bytes.saturating_add(start.len() + end.len());
        let out = self.render_named(name, input, &extra, fuel, cap)?;
        let once = |mark: &str| {
            let finder = memchr::memmem::Finder::new(mark.as_bytes());
            let mut found = finder.find_iter(out.as_bytes());
            match (found.next(), found.next()) {
                (Some(at), None) => Some(at),
                _ => None,
            }
        };
        let (Some(s), Some(e)) = (once(start), once(end)) else {
            return Ok(None);
        };
        if e < s + start.len() {
            return Ok(None);
        }
        let mut text = String::with_capacity(out.len() - start.len() - end.len());
        text.push_str(&out[..s]);
        text.push_str(&out[s + start.len()..e]);
        text.push_str(&out[e + end.len()..]);
        Ok(Some(LocalText {
            text,
            loop_start: s,
            loop_end: e - start.len(),
        }))
    }

    /// Renders into `out`, failing once the text would pass `max_bytes`. `fuel` replaces the
    /// environment's per-render fuel (the seed's 5,000,000 unless a test shrinks it).
    pub(crate) fn render(
        &self,
        input: &TemplateInput,
        fuel: u64,
        max_bytes: usize,
    ) -> Result<String, RenderFailure> {
        let name = if self.variant(input.has_tools) == 1 {
            TOOL_USE_NAME
        } else {
            DEFAULT_NAME
        };
        self.render_named(name, input, &[], fuel, max_bytes)
    }

    fn render_named(
        &self,
        name: &str,
        input: &TemplateInput,
        extra: &[(&'static str, Value)],
        fuel: u64,
        max_bytes: usize,
    ) -> Result<String, RenderFailure> {
        let mut ctx: Vec<(&'static str, Value)> = vec![
            ("messages", input.messages.clone()),
            ("tools", input.tools.clone()),
            ("documents", Value::from(())),
            (
                "add_generation_prompt",
                Value::from(input.add_generation_prompt),
            ),
        ];
        self.special.insert_into(&mut ctx);
        ctx.extend(extra.iter().cloned());
        let mut root: Vec<(Value, Value)> = input.extra.clone();
        root.extend(ctx.into_iter().map(|(k, v)| (Value::from(k), v)));
        let root = Value::from_pairs(root);

        // Fuel is an environment setting; a clone per render is cheap (templates are Arc'd)
        // and keeps the shared template immutable across threads.
        let env = if fuel == RENDER_FUEL {
            None
        } else {
            let mut env = self.env.clone();
            env.set_fuel(Some(fuel));
            Some(env)
        };
        let env = env.as_ref().unwrap_or(&self.env);
        let template = env
            .get_template(name)
            .map_err(|e| RenderFailure::Template(e.to_string()))?;
        let mut out = CappedWriter {
            buf: Vec::with_capacity(input.size_hint.min(max_bytes)),
            cap: max_bytes,
            over: false,
        };
        let result = template.render_captured_to(root, &mut out);
        if out.over {
            return Err(RenderFailure::TooLarge);
        }
        match result {
            Ok(_) => String::from_utf8(out.buf)
                .map_err(|_| RenderFailure::Template("output is not UTF-8".into())),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(RenderFailure::OutOfFuel),
            Err(e) => Err(RenderFailure::Template(e.to_string())),
        }
    }
}

/// What a template sees besides the special tokens.
#[derive(Clone, Debug)]
pub(crate) struct TemplateInput {
    pub messages: Value,
    /// `none` when the request has no tools (templates test `tools is not none`).
    pub tools: Value,
    pub has_tools: bool,
    pub add_generation_prompt: bool,
    /// `chat_template_kwargs` / `chat_template_args` of the request, under the fixed keys.
    pub extra: Vec<(Value, Value)>,
    /// Bytes to reserve for the rendered text (the output buffer is not grown by doubling).
    pub size_hint: usize,
}

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum RenderFailure {
    TooLarge,
    OutOfFuel,
    Template(String),
}

struct CappedWriter {
    buf: Vec<u8>,
    cap: usize,
    over: bool,
}

impl io::Write for CappedWriter {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        if self.buf.len().saturating_add(bytes.len()) > self.cap {
            self.over = true;
            return Err(io::Error::other("rendered text over its cap"));
        }
        self.buf.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The environment transformers' `_compile_jinja_template` builds, minus its sandbox (minijinja
/// has no attribute access to Python objects to sandbox) and with no loader at all: an
/// `{% include %}` or `{% import %}` fails as "template not found".
fn hf_environment(fuel: u64) -> Environment<'static> {
    let mut env = Environment::new();
    env.set_syntax(hf_syntax());
    env.set_fuel(Some(fuel));
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env
}

/// transformers' syntax: default delimiters, `trim_blocks` and `lstrip_blocks`.
fn hf_syntax() -> SyntaxConfig {
    SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .expect("the default delimiters are a valid syntax")
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// Python `datetime.now().strftime(format)` for the codes chat templates use (dates in system
/// prompts); UTC, since the router's local zone is not the worker's anyway.
fn strftime_now(format: String) -> Result<String, Error> {
    Ok(strftime(time::OffsetDateTime::now_utc(), &format))
}

fn strftime(now: time::OffsetDateTime, format: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let month = MONTHS[usize::from(u8::from(now.month())) - 1];
    let day = DAYS[usize::from(now.weekday().number_days_from_monday())];
    let mut out = String::with_capacity(format.len() * 2);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let hour12 = match now.hour() % 12 {
            0 => 12,
            h => h,
        };
        // Writing to a String cannot fail.
        let _ = match chars.next() {
            Some('Y') => write!(out, "{}", now.year()),
            Some('y') => write!(out, "{:02}", now.year().rem_euclid(100)),
            Some('m') => write!(out, "{:02}", u8::from(now.month())),
            Some('d') => write!(out, "{:02}", now.day()),
            Some('e') => write!(out, "{:>2}", now.day()),
            Some('-') => match chars.next() {
                Some('d') => write!(out, "{}", now.day()),
                Some('m') => write!(out, "{}", u8::from(now.month())),
                Some(other) => write!(out, "%-{other}"),
                None => write!(out, "%-"),
            },
            Some('j') => write!(out, "{:03}", now.ordinal()),
            Some('B') => write!(out, "{month}"),
            Some('b') => write!(out, "{}", &month[..3]),
            Some('A') => write!(out, "{day}"),
            Some('a') => write!(out, "{}", &day[..3]),
            Some('H') => write!(out, "{:02}", now.hour()),
            Some('I') => write!(out, "{hour12:02}"),
            Some('M') => write!(out, "{:02}", now.minute()),
            Some('S') => write!(out, "{:02}", now.second()),
            Some('p') => write!(out, "{}", if now.hour() < 12 { "AM" } else { "PM" }),
            Some('%') => write!(out, "%"),
            Some(other) => write!(out, "%{other}"),
            None => write!(out, "%"),
        };
    }
    out
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent)`, so key order is
/// the value's own, separators are `", "`/`": "` (`","` with an indent) and nothing is
/// HTML-escaped (minijinja's built-in escapes `<>&'`, which would change the prompt).
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let _: Option<Value> = kwargs.get("ensure_ascii")?;
    let _: Option<Value> = kwargs.get("sort_keys")?;
    let _: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_i64() {
            Some(n) => Some(usize::try_from(n).unwrap_or(0).min(64)),
            None => Some(0),
        }
        .map(|n| " ".repeat(n)),
    };
    let mut out = String::new();
    dump(&value, indent.as_deref(), 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn dump(value: &Value, indent: Option<&str>, depth: usize, out: &mut String) -> Result<(), Error> {
    if depth > MAX_JSON_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value nested too deeply",
        ));
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(unit) = indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(unit);
            }
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            let json = serde_json::to_value(value)
                .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
            match json {
                serde_json::Value::Number(n) if n.is_f64() => {
                    let f = n.as_f64().unwrap_or(0.0);
                    // Python prints integral floats as `1.0`; serde_json as `1.0` too, but
                    // keep the check explicit for large magnitudes.
                    out.push_str(&serde_json::to_string(&f).unwrap_or_else(|_| "NaN".into()));
                }
                other => out.push_str(&other.to_string()),
            }
        }
        ValueKind::String | ValueKind::Bytes | ValueKind::Invalid => {
            let s = value
                .as_str()
                .map(str::to_owned)
                .unwrap_or_else(|| value.to_string());
            out.push_str(&serde_json::to_string(&s).unwrap_or_default());
        }
        ValueKind::Seq | ValueKind::Iterable | ValueKind::Plain => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                dump(item, indent, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                let name = key
                    .as_str()
                    .map(str::to_owned)
                    .unwrap_or_else(|| key.to_string());
                out.push_str(&serde_json::to_string(&name).unwrap_or_default());
                out.push_str(": ");
                dump(&value.get_item(key)?, indent, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => {
            let s = value.to_string();
            out.push_str(&serde_json::to_string(&s).unwrap_or_default());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;

//! Hugging Face chat templates, rendered the way `transformers` renders them.
//!
//! Reference: `transformers/utils/chat_template_utils.py` (`_compile_jinja_template`,
//! `render_jinja_template`) and `PreTrainedTokenizerBase.apply_chat_template`.
//! transformers compiles the template in a Jinja2 `ImmutableSandboxedEnvironment`
//! with `trim_blocks=True`, `lstrip_blocks=True` and the `loopcontrols` extension,
//! Jinja2's default `keep_trailing_newline=False`, and these additions:
//! - `raise_exception(msg)`: aborts rendering with `msg`;
//! - `strftime_now(fmt)`: the current time through `datetime.now().strftime`;
//! - a `tojson` filter that is `json.dumps(x, ensure_ascii=False, indent=None,
//!   separators=None, sort_keys=False)`, replacing Jinja2's HTML-escaping one.
//!
//! The template is rendered with `messages`, `tools=None`, `documents=None`,
//! `add_generation_prompt`, and the tokenizer's `special_tokens_map` (only the
//! tokens that are set: `bos_token`, `eos_token`, `unk_token`, `pad_token`, ...)
//! plus any extra keyword arguments. The output is not stripped.
//!
//! minijinja stands in for Jinja2; Python's string and dict methods
//! (`.strip()`, `.split()`, `.items()`, ...) come from
//! `minijinja_contrib::pycompat`. Booleans and `none` print as Python prints
//! them (`True`, `None`). Not supported: the `{% generation %}` tag that
//! transformers uses for assistant-token masks.
//!
//! Where a template lives (see [`ChatTemplate::from_model_dir`]): a
//! `chat_template.jinja` file in the model directory wins over the
//! `chat_template` key of `tokenizer_config.json`, as in transformers (its
//! `_from_pretrained` reads the file and lets it "clobber any template in the
//! config"; recent `save_pretrained` writes the file instead of the key).

use std::fmt;
use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, Rest, Serde, Value as JValue, ValueKind};
use minijinja::{Environment, ErrorKind};
use serde_json::{Map, Value};

use crate::data::prompt::Message;
use crate::error::{read_to_string, Error, Result};

/// The file name under which transformers saves a model's chat template.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// The name the template is registered under in the minijinja environment
/// (it appears in render errors as `(in chat_template:LINE)`).
const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template plus the variables that every render sees
/// (the special tokens).
#[derive(Clone)]
pub struct ChatTemplate {
    /// The file the template came from; errors name it.
    source: PathBuf,
    /// For templates picked out of a named list: which one.
    name: Option<String>,
    text: String,
    env: Environment<'static>,
    vars: Map<String, Value>,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("name", &self.name)
            .field("chars", &self.text.len())
            .field("vars", &self.vars)
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles `text`; `source` names the file it came from in errors.
    pub fn new(text: impl Into<String>, source: impl Into<PathBuf>) -> Result<ChatTemplate> {
        Self::compile(text.into(), source.into(), None)
    }

    fn compile(text: String, source: PathBuf, name: Option<String>) -> Result<ChatTemplate> {
        let env = build_environment(&text).map_err(|e| {
            Error::bad_file(&source, format!("chat template{} does not compile: {}", label(&name), describe(&e)))
        })?;
        Ok(ChatTemplate { source, name, text, env, vars: Map::new() })
    }

    /// Loads the template of a model directory, or `None` when it has none.
    ///
    /// `chat_template.jinja` wins when present (transformers does the same);
    /// otherwise the `chat_template` key of `tokenizer_config` (the parsed
    /// `tokenizer_config.json` of `dir`), which is either a string or a list of
    /// `{"name", "template"}` objects of which the one named `default` is used,
    /// as transformers' `get_chat_template` does when no name is asked for.
    pub fn from_model_dir(dir: &Path, tokenizer_config: Option<&Map<String, Value>>) -> Result<Option<ChatTemplate>> {
        let file = dir.join(CHAT_TEMPLATE_FILE);
        if file.is_file() {
            let text = read_to_string(&file)?;
            return Self::compile(text, file, None).map(Some);
        }
        let config_path = dir.join("tokenizer_config.json");
        match tokenizer_config.and_then(|c| c.get("chat_template")) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => Self::from_config_value(value, &config_path).map(Some),
        }
    }

    /// Reads the `chat_template` value of a `tokenizer_config.json` at `path`.
    pub fn from_config_value(value: &Value, path: &Path) -> Result<ChatTemplate> {
        match value {
            Value::String(text) => Self::compile(text.clone(), path.to_path_buf(), None),
            Value::Array(items) => {
                let mut names = Vec::new();
                for (i, item) in items.iter().enumerate() {
                    let (Some(name), Some(template)) =
                        (item.get("name").and_then(Value::as_str), item.get("template").and_then(Value::as_str))
                    else {
                        return Err(Error::bad_file(
                            path,
                            format!(
                                "chat_template[{i}]: expected an object with string fields \
                                 \"name\" and \"template\", got {}",
                                crate::data::prompt::describe_json(item)
                            ),
                        ));
                    };
                    if name == "default" {
                        return Self::compile(template.to_string(), path.to_path_buf(), Some(name.to_string()));
                    }
                    names.push(name.to_string());
                }
                Err(Error::bad_file(
                    path,
                    format!(
                        "chat_template: a list of named templates needs one named \"default\"; \
                         found {names:?}"
                    ),
                ))
            }
            other => Err(Error::bad_file(
                path,
                format!(
                    "chat_template: expected a string or a list of {{name, template}} objects, \
                     got {}",
                    crate::data::prompt::describe_json(other)
                ),
            )),
        }
    }

    /// Adds a variable that every render sees (a special token such as
    /// `bos_token`); render-time variables override it.
    pub fn with_var(mut self, name: impl Into<String>, value: Value) -> ChatTemplate {
        self.vars.insert(name.into(), value);
        self
    }

    /// The file the template came from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// The Jinja source text.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The variables every render sees (special tokens).
    pub fn vars(&self) -> &Map<String, Value> {
        &self.vars
    }

    /// Renders a conversation, like `tokenizer.apply_chat_template(messages,
    /// tokenize=False, add_generation_prompt=...)`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, &Map::new())
    }

    /// [`render`](Self::render) with extra template variables, which
    /// transformers passes as keyword arguments (`tools`, `date_string`,
    /// `enable_thinking`, ...); they override the special tokens.
    pub fn render_with(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        extra: &Map<String, Value>,
    ) -> Result<String> {
        // Same order as transformers' `render(messages=..., tools=None,
        // documents=None, add_generation_prompt=..., **special_tokens, **kwargs)`.
        let mut ctx = Map::new();
        ctx.insert("tools".into(), Value::Null);
        ctx.insert("documents".into(), Value::Null);
        for (k, v) in self.vars.iter().chain(extra) {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), serde_json::to_value(messages).expect("messages serialise"));
        ctx.insert("add_generation_prompt".into(), Value::Bool(add_generation_prompt));
        let template = self.env.get_template(TEMPLATE_NAME).expect("template registered at construction");
        template.render(JValue::from(Serde(&ctx))).map_err(|e| {
            Error::bad_file(&self.source, format!("chat template{} failed: {}", label(&self.name), describe(&e)))
        })
    }
}

fn label(name: &Option<String>) -> String {
    match name {
        Some(n) => format!(" \"{n}\""),
        None => String::new(),
    }
}

/// A minijinja error with its cause chain, in one line.
fn describe(e: &minijinja::Error) -> String {
    let mut out = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// The environment transformers builds, with the template compiled into it.
fn build_environment(text: &str) -> std::result::Result<Environment<'static>, minijinja::Error> {
    let mut env = Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()?,
    );
    // Never auto-escape: a template named after a `.json` file would otherwise
    // be JSON-escaped by minijinja's default callback.
    env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(|out, state, value| match value.kind() {
        // Jinja2 prints Python's `str()` of the value.
        ValueKind::Bool if value.is_true() => out.write_str("True").map_err(Into::into),
        ValueKind::Bool => out.write_str("False").map_err(Into::into),
        ValueKind::None => out.write_str("None").map_err(Into::into),
        _ => minijinja::escape_formatter(out, state, value),
    });
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env.add_template_owned(TEMPLATE_NAME, text.to_string())?;
    Ok(env)
}

fn raise_exception(message: String) -> std::result::Result<JValue, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

fn strftime_now(format: String) -> String {
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    strftime(&format, secs)
}

/// Python's `strftime` for the directives chat templates use, on a UTC
/// timestamp. Python formats the local time; on the UTC machines this runs on
/// the two agree. glibc's `%-d` style (no padding) is supported; unknown
/// directives are written unchanged.
pub fn strftime(format: &str, unix_secs: i64) -> String {
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
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let unpadded = chars.peek() == Some(&'-');
        if unpadded {
            chars.next();
        }
        let num = |v: i64, width: usize| {
            if unpadded {
                v.to_string()
            } else {
                format!("{v:0width$}")
            }
        };
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&num(year.rem_euclid(100), 2)),
            Some('m') => out.push_str(&num(month, 2)),
            Some('d') => out.push_str(&num(day, 2)),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('j') => out.push_str(&num(day_of_year, 3)),
            Some('H') => out.push_str(&num(hour, 2)),
            Some('I') => out.push_str(&num(hour12, 2)),
            Some('M') => out.push_str(&num(minute, 2)),
            Some('S') => out.push_str(&num(second, 2)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('b') | Some('h') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('u') => out.push_str(&(weekday + 1).to_string()),
            Some('w') => out.push_str(&((weekday + 1) % 7).to_string()),
            Some('F') => out.push_str(&format!("{year}-{month:02}-{day:02}")),
            Some('T') => out.push_str(&format!("{hour:02}:{minute:02}:{second:02}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// (year, month, day) of a day count since 1970-01-01 (Howard Hinnant's
/// `civil_from_days`, proleptic Gregorian calendar).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Inverse of [`civil_from_days`].
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, i.e. Python's `json.dumps` with those arguments
/// (positional or keyword).
fn tojson(value: &JValue, args: Rest<JValue>, kwargs: Kwargs) -> std::result::Result<JValue, minijinja::Error> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > NAMES.len() {
        return Err(minijinja::Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments (ensure_ascii, indent, separators, sort_keys)",
        ));
    }
    let mut params: [Option<JValue>; 4] = Default::default();
    for (i, a) in args.iter().enumerate() {
        params[i] = Some(a.clone());
    }
    for (i, name) in NAMES.iter().enumerate() {
        if let Some(v) = kwargs.get::<Option<JValue>>(name)? {
            params[i] = Some(v);
        }
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators, sort_keys] = params;
    let ensure_ascii = ensure_ascii.is_some_and(|v| v.is_true());
    let sort_keys = sort_keys.is_some_and(|v| v.is_true());
    // Python: an int indents by that many spaces, a string by itself, None
    // keeps one line.
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) if v.kind() == ValueKind::Bool => Some(if v.is_true() { " " } else { "" }.into()),
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or("").to_string()),
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.max(0) as usize)),
            None => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: indent must be an integer or a string, got {v}"),
                ))
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() && !v.is_undefined() => {
            let parts: Vec<JValue> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                    (a.as_str().unwrap_or_default().to_string(), b.as_str().unwrap_or_default().to_string())
                }
                _ => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ))
                }
            }
        }
        // Python's defaults: no trailing space after ',' when indenting.
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let mut w = PyJson { out: String::new(), ensure_ascii, sort_keys, indent, item_sep, key_sep };
    w.value(value, 0)?;
    Ok(JValue::from(w.out))
}

/// A writer that reproduces Python's `json.dumps` output byte for byte.
struct PyJson {
    out: String,
    ensure_ascii: bool,
    sort_keys: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
}

impl PyJson {
    fn value(&mut self, v: &JValue, depth: usize) -> std::result::Result<(), minijinja::Error> {
        match v.kind() {
            ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self.out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                if v.is_integer() {
                    self.out.push_str(&v.to_string());
                } else {
                    let f = f64::try_from(v.clone())?;
                    self.out.push_str(&python_float_repr(f));
                }
            }
            ValueKind::String => self.string(v.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<JValue> = v.try_iter()?.collect();
                self.container('[', ']', depth, items.len(), |w, i, d| w.value(&items[i], d))?;
            }
            ValueKind::Map => {
                let mut entries = Vec::new();
                for key in v.try_iter()? {
                    let item = v.get_item(&key)?;
                    entries.push((python_json_key(&key)?, item));
                }
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.container('{', '}', depth, entries.len(), |w, i, d| {
                    let (key, item) = &entries[i];
                    w.string(key);
                    let sep = w.key_sep.clone();
                    w.out.push_str(&sep);
                    w.value(item, d)
                })?;
            }
            kind => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: object of type {kind} is not JSON serializable"),
                ))
            }
        }
        Ok(())
    }

    fn container(
        &mut self,
        open: char,
        close: char,
        depth: usize,
        len: usize,
        mut item: impl FnMut(&mut Self, usize, usize) -> std::result::Result<(), minijinja::Error>,
    ) -> std::result::Result<(), minijinja::Error> {
        self.out.push(open);
        if len == 0 {
            self.out.push(close);
            return Ok(());
        }
        let indent = self.indent.clone();
        for i in 0..len {
            if i > 0 {
                let sep = self.item_sep.clone();
                self.out.push_str(&sep);
            }
            if let Some(ind) = &indent {
                self.out.push('\n');
                self.out.push_str(&ind.repeat(depth + 1));
            }
            item(self, i, depth + 1)?;
        }
        if let Some(ind) = &indent {
            self.out.push('\n');
            self.out.push_str(&ind.repeat(depth));
        }
        self.out.push(close);
        Ok(())
    }

    fn string(&mut self, s: &str) {
        self.out.push('"');
        for c in s.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{8}' => self.out.push_str("\\b"),
                '\u{c}' => self.out.push_str("\\f"),
                c if (c as u32) < 0x20 => self.out.push_str(&format!("\\u{:04x}", c as u32)),
                c if self.ensure_ascii && !c.is_ascii() => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        self.out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }
}

/// Python's `json.dumps` turns non-string keys into strings.
fn python_json_key(key: &JValue) -> std::result::Result<String, minijinja::Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_string(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_string(),
        ValueKind::None => "null".to_string(),
        ValueKind::Number if key.is_integer() => key.to_string(),
        ValueKind::Number => python_float_repr(f64::try_from(key.clone())?),
        kind => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
            ))
        }
    })
}

/// Python's `repr(float)` as `json.dumps` writes it: the shortest digits that
/// round-trip, positional for exponents in [-4, 16), else `1e-07` / `1e+16`
/// style; `NaN` and `Infinity` as Python emits them.
fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "-1.2345e-7".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').expect("`{:e}` has an exponent");
    let exp: i32 = exp.parse().expect("integer exponent");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if !(-4..16).contains(&exp) {
        let (head, tail) = digits.split_at(1);
        let frac = if tail.is_empty() { String::new() } else { format!(".{tail}") };
        let esign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{head}{frac}e{esign}{:02}", exp.abs());
    }
    if exp < 0 {
        let zeros = "0".repeat((-exp - 1) as usize);
        return format!("{sign}0.{zeros}{digits}");
    }
    let int_len = exp as usize + 1;
    if digits.len() <= int_len {
        let zeros = "0".repeat(int_len - digits.len());
        format!("{sign}{digits}{zeros}.0")
    } else {
        let (int, frac) = digits.split_at(int_len);
        format!("{sign}{int}.{frac}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fixture(name: &str) -> ChatTemplate {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates").join(name);
        let text = std::fs::read_to_string(&path).unwrap();
        ChatTemplate::new(text, path).unwrap()
    }

    fn llama(name: &str) -> ChatTemplate {
        fixture(name).with_var("bos_token", json!("<|begin_of_text|>")).with_var("eos_token", json!("<|eot_id|>"))
    }

    fn qwen(name: &str) -> ChatTemplate {
        fixture(name).with_var("eos_token", json!("<|im_end|>")).with_var("pad_token", json!("<|endoftext|>"))
    }

    fn system_user() -> Vec<Message> {
        vec![Message::new("system", "You are terse."), Message::new("user", "What is 2+2?")]
    }

    fn user_only() -> Vec<Message> {
        vec![Message::new("user", "Hello there")]
    }

    /// Renders the four cases (system+user / user only) x (generation prompt
    /// on / off) and compares with what transformers produces; the expected
    /// strings were rendered with Jinja2 set up as transformers sets it up.
    fn check(t: &ChatTemplate, expected: [&str; 4]) {
        assert_eq!(t.render(&system_user(), true).unwrap(), expected[0]);
        assert_eq!(t.render(&system_user(), false).unwrap(), expected[1]);
        assert_eq!(t.render(&user_only(), true).unwrap(), expected[2]);
        assert_eq!(t.render(&user_only(), false).unwrap(), expected[3]);
    }

    #[test]
    fn llama3_instruct_template_matches_transformers() {
        check(
            &llama("llama3.jinja"),
            [
                "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
                "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>",
                "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
                "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello there<|eot_id|>",
            ],
        );
    }

    #[test]
    fn llama3_1_template_adds_knowledge_date_lines() {
        check(
            &llama("llama3_1.jinja"),
            [
                "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nYou are terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
                "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nYou are terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>",
                "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
                "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello there<|eot_id|>",
            ],
        );
    }

    #[test]
    fn qwen2_5_template_adds_default_system_prompt() {
        check(
            &qwen("qwen2_5.jinja"),
            [
                "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
                "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
                "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n",
                "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n",
            ],
        );
    }

    #[test]
    fn qwen3_template_matches_transformers() {
        check(
            &qwen("qwen3.jinja"),
            [
                "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
                "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
                "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n",
                "<|im_start|>user\nHello there<|im_end|>\n",
            ],
        );
    }

    #[test]
    fn qwen3_drops_old_reasoning_and_honours_enable_thinking() {
        // Exercises the Python string methods (split, lstrip, strip,
        // startswith) and `is false`.
        let t = qwen("qwen3.jinja");
        let conv = vec![
            Message::new("user", "Hi"),
            Message::new("assistant", "<think>\nplan it\n</think>\n\nHello!"),
            Message::new("user", "Bye"),
        ];
        let extra = json!({"enable_thinking": false});
        assert_eq!(
            t.render_with(&conv, true, extra.as_object().unwrap()).unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        );
        assert_eq!(
            t.render(&conv[..2], false).unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nplan it\n</think>\n\nHello!<|im_end|>\n"
        );
    }

    #[test]
    fn llama3_1_tools_use_indented_tojson_like_python() {
        let t = llama("llama3_1.jinja");
        let extra = json!({
            "date_string": "01 Jan 2025",
            "tools": [{"type": "function", "function": {
                "name": "get_weather",
                "description": "Weather in a city, e.g. Zürich",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
            }}]
        });
        let got =
            t.render_with(&[Message::new("user", "Weather in Paris?")], true, extra.as_object().unwrap()).unwrap();
        assert_eq!(
            got,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 01 Jan 2025\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.Do not use variables.\n\n{\n    \"type\": \"function\",\n    \"function\": {\n        \"name\": \"get_weather\",\n        \"description\": \"Weather in a city, e.g. Z\u{fc}rich\",\n        \"parameters\": {\n            \"type\": \"object\",\n            \"properties\": {\n                \"city\": {\n                    \"type\": \"string\"\n                }\n            },\n            \"required\": [\n                \"city\"\n            ]\n        }\n    }\n}\n\nWeather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    #[test]
    fn raise_exception_becomes_an_error_naming_the_template() {
        let t = llama("llama3_1.jinja");
        let extra = json!({"tools": []});
        let err =
            t.render_with(&[Message::new("system", "sys")], true, extra.as_object().unwrap()).unwrap_err().to_string();
        assert!(
            err.contains("Cannot put tools in the first user message when there's no first user message!"),
            "{err}"
        );
        assert!(err.contains("llama3_1.jinja"), "{err}");
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let t = ChatTemplate::new(
            "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ \"é<>&'\" | tojson }}|{{ [1.5, 1e-7, 1e16, 100.0, 12345678901234567.0, true, none] | tojson }}",
            "inline",
        )
        .unwrap();
        let extra = json!({"x": {"b": [1, {"c": "d"}], "a": [], "e": {}}});
        assert_eq!(
            t.render_with(&[], false, extra.as_object().unwrap()).unwrap(),
            "{\"b\": [1, {\"c\": \"d\"}], \"a\": [], \"e\": {}}|{\n  \"b\": [\n    1,\n    {\n      \"c\": \"d\"\n    }\n  ],\n  \"a\": [],\n  \"e\": {}\n}|\"é<>&'\"|[1.5, 1e-07, 1e+16, 100.0, 1.2345678901234568e+16, true, null]"
        );
        let t = ChatTemplate::new(
            "{{ x | tojson(sort_keys=true, separators=(\",\", \":\")) }}|{{ \"é\\n\" | tojson(true) }}",
            "inline",
        )
        .unwrap();
        let extra = json!({"x": {"b": 1, "a": [1, 2]}});
        assert_eq!(
            t.render_with(&[], false, extra.as_object().unwrap()).unwrap(),
            "{\"a\":[1,2],\"b\":1}|\"\\u00e9\\n\""
        );
    }

    #[test]
    fn booleans_and_none_print_like_python() {
        let t = ChatTemplate::new("{{ true }} {{ none }} {{ false }}", "inline").unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "True None False");
    }

    #[test]
    fn trailing_newline_of_the_template_is_dropped() {
        let t = ChatTemplate::new("{% if add_generation_prompt %}\nA\n{% endif %}\n", "inline").unwrap();
        assert_eq!(t.render(&[], true).unwrap(), "A\n");
    }

    #[test]
    fn strftime_formats_the_directives_templates_use() {
        // 2024-07-26 13:05:09 UTC, a Friday.
        let t = 1_721_999_109;
        assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2024-07-26 13:05:09");
        assert_eq!(strftime("%A %B %-d, %I%p %j %%", t), "Friday July 26, 01PM 208 %");
        assert_eq!(strftime("%d %b %Y", 0), "01 Jan 1970");
        assert_eq!(strftime("%d %b %Y", 951_782_400), "29 Feb 2000");
    }

    #[test]
    fn strftime_now_is_callable_from_a_template() {
        let t = ChatTemplate::new("{{ strftime_now('%Y') }}", "inline").unwrap();
        let year: i64 = t.render(&[], false).unwrap().parse().unwrap();
        assert!(year >= 2025);
    }

    #[test]
    fn syntax_error_names_the_source() {
        let err = ChatTemplate::new("{% if %}", "/m/chat_template.jinja").unwrap_err().to_string();
        assert!(err.starts_with("/m/chat_template.jinja: chat template does not compile"), "{err}");
    }

    #[test]
    fn jinja_file_wins_over_tokenizer_config() {
        let dir = tempfile::tempdir().unwrap();
        let config = json!({"chat_template": "from config"});
        let config = config.as_object().unwrap();
        let t = ChatTemplate::from_model_dir(dir.path(), Some(config)).unwrap().unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "from config");
        assert_eq!(t.source(), dir.path().join("tokenizer_config.json"));

        std::fs::write(dir.path().join(CHAT_TEMPLATE_FILE), "from file\n").unwrap();
        let t = ChatTemplate::from_model_dir(dir.path(), Some(config)).unwrap().unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "from file");
        assert_eq!(t.source(), dir.path().join(CHAT_TEMPLATE_FILE));
    }

    #[test]
    fn no_template_anywhere_is_none() {
        let dir = tempfile::tempdir().unwrap();
        assert!(ChatTemplate::from_model_dir(dir.path(), None).unwrap().is_none());
        let config = json!({"chat_template": null});
        assert!(ChatTemplate::from_model_dir(dir.path(), Some(config.as_object().unwrap())).unwrap().is_none());
    }

    #[test]
    fn named_template_list_uses_default() {
        let value = json!([
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "plain"}
        ]);
        let t = ChatTemplate::from_config_value(&value, Path::new("tc.json")).unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "plain");

        let value = json!([{"name": "tool_use", "template": "tools"}]);
        let err = ChatTemplate::from_config_value(&value, Path::new("tc.json")).unwrap_err().to_string();
        assert!(err.contains("needs one named \"default\""), "{err}");
        assert!(err.contains("tool_use"), "{err}");
    }

    #[test]
    fn chat_template_of_wrong_type_is_rejected() {
        let err = ChatTemplate::from_config_value(&json!(3), Path::new("tc.json")).unwrap_err().to_string();
        assert_eq!(
            err,
            "tc.json: chat_template: expected a string or a list of {name, template} objects, got a number (3)"
        );
    }

    #[test]
    fn template_named_like_json_is_not_escaped() {
        let t = ChatTemplate::new("{{ '<&>' }}", "tokenizer_config.json").unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "<&>");
    }
}

//! `--dataset_filter`: which rows a command keeps, as a small expression
//! over the row's columns, e.g. `language == "english" and len(context) <= 4`.
//!
//! ```text
//! expr    := expr "or" expr | expr "and" expr | "not" expr | compare
//! compare := term [("==" | "!=" | "<" | "<=" | ">" | ">=" | "in" | "not in") term]
//! term    := "string" | 'string' | number | true | false | null
//!          | "[" term, ... "]" | len(term) | "(" expr ")" | column
//! column  := name ("." name)*     a column, or a field of a struct column
//!          | `any name`           a column whose name is not a plain word
//! ```
//! `and` binds tighter than `or`. Numbers compare with numbers, and with
//! strings that hold a number (CSV cells); strings compare with strings.
//! An order comparison with null is false. `x in [..]` tests membership,
//! `"s" in text` a substring, `"k" in object` a key. `len` counts a
//! string's characters, a list's items or an object's keys. Errors name the
//! position in the expression, and the column and row at fault.

use serde_json::Value;

use super::prompt::describe_json;
use super::rows::Row;
use crate::error::{Error, Result};

/// Most levels an expression may nest (brackets, `not`, `len`, and each
/// `and`/`or` of a chain): parsing and evaluating recurse once per level,
/// and an expression far past any real filter must not exhaust the stack.
const MAX_DEPTH: usize = 256;

/// A parsed filter.
#[derive(Debug, Clone)]
pub struct Filter {
    source: String,
    expr: Expr,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    In,
    NotIn,
}

#[derive(Debug, Clone)]
enum Expr {
    Literal(Value),
    Column { path: Vec<String>, pos: usize },
    List(Vec<Expr>),
    Len { arg: Box<Expr>, pos: usize },
    Not { arg: Box<Expr>, pos: usize },
    And(Box<Expr>, Box<Expr>),
    Or(Box<Expr>, Box<Expr>),
    Compare { op: Op, left: Box<Expr>, right: Box<Expr>, pos: usize },
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Str(String),
    Num(f64),
    Word(String),
    Quoted(String),
    Sym(&'static str),
    End,
}

/// An error at a character position of the expression.
struct At(usize, String);

impl Filter {
    /// Parses `source`; the error shows the expression with a caret under
    /// the fault.
    pub fn parse(source: &str) -> Result<Filter> {
        let toks = lex(source).map_err(|At(pos, msg)| invalid(source, pos, &msg))?;
        let mut parser = Parser { toks, i: 0, depth: 0 };
        let expr = parser.or().map_err(|At(pos, msg)| invalid(source, pos, &msg))?;
        if parser.peek() != &Tok::End {
            let pos = parser.pos();
            return Err(invalid(source, pos, &format!("unexpected {} after a complete expression", parser.describe())));
        }
        Ok(Filter { source: source.to_string(), expr })
    }

    /// The expression as written.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether `row` passes; an error names the row, the column and the
    /// position in the expression.
    pub fn keeps(&self, row: &Row) -> Result<bool> {
        let fail = |At(pos, msg): At| row.error(format!("--dataset_filter at character {}: {msg}", pos + 1));
        match eval(&self.expr, row).map_err(fail)? {
            Value::Bool(b) => Ok(b),
            other => Err(row.error(format!(
                "--dataset_filter {:?} gives {}, not true or false",
                self.source,
                describe_json(&other)
            ))),
        }
    }
}

/// The error at character `pos`, showing the expression around it with a
/// caret under the fault (at most [`SHOWN`] characters either side).
fn invalid(source: &str, pos: usize, msg: &str) -> Error {
    let chars: Vec<char> = source.chars().collect();
    let (from, to) = (pos.saturating_sub(SHOWN), (pos + SHOWN).min(chars.len()));
    let lead = if from > 0 { "..." } else { "" };
    let tail = if to < chars.len() { "..." } else { "" };
    let shown: String = chars[from..to].iter().collect();
    let caret = " ".repeat(lead.len() + pos - from);
    Error::Invalid(format!("--dataset_filter: {msg} at character {}\n  {lead}{shown}{tail}\n  {caret}^", pos + 1))
}

/// Characters of a long expression shown either side of a fault.
const SHOWN: usize = 40;

/// Tokens with the character position each starts at.
fn lex(source: &str) -> std::result::Result<Vec<(usize, Tok)>, At> {
    let chars: Vec<char> = source.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let start = i;
        if c.is_whitespace() {
            i += 1;
            continue;
        }
        let tok = if c == '"' || c == '\'' {
            let mut s = String::new();
            i += 1;
            loop {
                match chars.get(i) {
                    None => return Err(At(start, "unclosed string".into())),
                    Some(&q) if q == c => break,
                    Some('\\') => {
                        i += 1;
                        s.push(match chars.get(i) {
                            Some('n') => '\n',
                            Some('t') => '\t',
                            Some(&other) => other,
                            None => return Err(At(start, "unclosed string".into())),
                        });
                    }
                    Some(&other) => s.push(other),
                }
                i += 1;
            }
            i += 1;
            Tok::Str(s)
        } else if c == '`' {
            let end = chars[i + 1..].iter().position(|&x| x == '`').ok_or(At(start, "unclosed `".into()))?;
            let name: String = chars[i + 1..i + 1 + end].iter().collect();
            i += end + 2;
            Tok::Quoted(name)
        } else if c.is_ascii_digit() || (c == '-' && chars.get(i + 1).is_some_and(|d| d.is_ascii_digit() || *d == '.'))
        {
            i += 1;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.' || chars[i] == '_') {
                let exponent_sign = matches!(chars[i], 'e' | 'E') && matches!(chars.get(i + 1), Some('-' | '+'));
                i += if exponent_sign { 2 } else { 1 };
            }
            let text: String = chars[start..i].iter().filter(|&&d| d != '_').collect();
            Tok::Num(text.parse().map_err(|_| At(start, format!("`{text}` is not a number")))?)
        } else if c.is_alphabetic() || c == '_' {
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            Tok::Word(chars[start..i].iter().collect())
        } else {
            let two: String = chars[i..(i + 2).min(chars.len())].iter().collect();
            let sym = ["==", "!=", "<=", ">="].into_iter().find(|s| *s == two);
            let sym = sym.or_else(|| ["<", ">", "(", ")", "[", "]", ",", "."].into_iter().find(|s| s.starts_with(c)));
            let Some(sym) = sym else {
                let hint = if c == '=' { ": use == to compare" } else { "" };
                return Err(At(start, format!("unexpected `{c}`{hint}")));
            };
            i += sym.len();
            Tok::Sym(sym)
        };
        out.push((start, tok));
    }
    out.push((chars.len(), Tok::End));
    Ok(out)
}

struct Parser {
    toks: Vec<(usize, Tok)>,
    i: usize,
    /// Levels entered so far; see [`MAX_DEPTH`].
    depth: usize,
}

impl Parser {
    fn peek(&self) -> &Tok {
        &self.toks[self.i].1
    }

    fn pos(&self) -> usize {
        self.toks[self.i].0
    }

    fn bump(&mut self) -> Tok {
        let tok = self.toks[self.i].1.clone();
        self.i = (self.i + 1).min(self.toks.len() - 1);
        tok
    }

    fn is_word(&self, word: &str) -> bool {
        matches!(self.peek(), Tok::Word(w) if w == word)
    }

    fn describe(&self) -> String {
        match self.peek() {
            Tok::Str(s) => format!("string {s:?}"),
            Tok::Num(n) => format!("number {n}"),
            Tok::Word(w) | Tok::Quoted(w) => format!("`{w}`"),
            Tok::Sym(s) => format!("`{s}`"),
            Tok::End => "the end".to_string(),
        }
    }

    fn expect(&mut self, sym: &'static str) -> std::result::Result<(), At> {
        if self.peek() == &Tok::Sym(sym) {
            self.bump();
            Ok(())
        } else {
            Err(At(self.pos(), format!("expected `{sym}`, found {}", self.describe())))
        }
    }

    /// Enters one more level of nesting, or fails past [`MAX_DEPTH`];
    /// `leave` undoes it.
    fn enter(&mut self) -> std::result::Result<(), At> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(At(self.pos(), format!("the expression nests more than {MAX_DEPTH} levels deep")));
        }
        Ok(())
    }

    fn leave(&mut self, levels: usize) {
        self.depth -= levels;
    }

    fn or(&mut self) -> std::result::Result<Expr, At> {
        let mut left = self.and()?;
        let mut links = 0;
        while self.is_word("or") {
            self.bump();
            self.enter()?;
            links += 1;
            left = Expr::Or(Box::new(left), Box::new(self.and()?));
        }
        self.leave(links);
        Ok(left)
    }

    fn and(&mut self) -> std::result::Result<Expr, At> {
        let mut left = self.not()?;
        let mut links = 0;
        while self.is_word("and") {
            self.bump();
            self.enter()?;
            links += 1;
            left = Expr::And(Box::new(left), Box::new(self.not()?));
        }
        self.leave(links);
        Ok(left)
    }

    fn not(&mut self) -> std::result::Result<Expr, At> {
        if self.is_word("not") {
            let pos = self.pos();
            self.bump();
            self.enter()?;
            let arg = Box::new(self.not()?);
            self.leave(1);
            return Ok(Expr::Not { arg, pos });
        }
        self.compare()
    }

    fn compare(&mut self) -> std::result::Result<Expr, At> {
        let left = self.term()?;
        let pos = self.pos();
        let op = match self.peek() {
            Tok::Sym("==") => Op::Eq,
            Tok::Sym("!=") => Op::Ne,
            Tok::Sym("<") => Op::Lt,
            Tok::Sym("<=") => Op::Le,
            Tok::Sym(">") => Op::Gt,
            Tok::Sym(">=") => Op::Ge,
            Tok::Word(w) if w == "in" => Op::In,
            Tok::Word(w) if w == "not" && matches!(self.toks.get(self.i + 1), Some((_, Tok::Word(n))) if n == "in") => {
                self.bump();
                Op::NotIn
            }
            _ => return Ok(left),
        };
        self.bump();
        let right = self.term()?;
        Ok(Expr::Compare { op, left: Box::new(left), right: Box::new(right), pos })
    }

    fn term(&mut self) -> std::result::Result<Expr, At> {
        self.enter()?;
        let term = self.term_inside();
        self.leave(1);
        term
    }

    fn term_inside(&mut self) -> std::result::Result<Expr, At> {
        let pos = self.pos();
        match self.bump() {
            Tok::Str(s) => Ok(Expr::Literal(Value::String(s))),
            Tok::Num(n) => Ok(Expr::Literal(serde_json::Number::from_f64(n).map_or(Value::Null, Value::Number))),
            Tok::Sym("(") => {
                let inner = self.or()?;
                self.expect(")")?;
                Ok(inner)
            }
            Tok::Sym("[") => {
                let mut items = Vec::new();
                while self.peek() != &Tok::Sym("]") {
                    items.push(self.term()?);
                    if self.peek() != &Tok::Sym("]") {
                        self.expect(",")?;
                    }
                }
                self.bump();
                Ok(Expr::List(items))
            }
            Tok::Word(w) => match w.as_str() {
                "true" | "True" => Ok(Expr::Literal(Value::Bool(true))),
                "false" | "False" => Ok(Expr::Literal(Value::Bool(false))),
                "null" | "None" => Ok(Expr::Literal(Value::Null)),
                "and" | "or" | "not" | "in" => Err(At(pos, format!("expected a value, found `{w}`"))),
                "len" if self.peek() == &Tok::Sym("(") => {
                    self.bump();
                    let arg = self.term()?;
                    self.expect(")")?;
                    Ok(Expr::Len { arg: Box::new(arg), pos })
                }
                _ => self.column(w, pos),
            },
            Tok::Quoted(name) => self.column(name, pos),
            Tok::End => Err(At(pos, "expected a value, found the end".into())),
            Tok::Sym(s) => Err(At(pos, format!("expected a value, found `{s}`"))),
        }
    }

    fn column(&mut self, first: String, pos: usize) -> std::result::Result<Expr, At> {
        let mut path = vec![first];
        while self.peek() == &Tok::Sym(".") {
            self.bump();
            let at = self.pos();
            match self.bump() {
                Tok::Word(w) | Tok::Quoted(w) => path.push(w),
                _ => return Err(At(at, "expected a field name after `.`".into())),
            }
        }
        Ok(Expr::Column { path, pos })
    }
}

fn eval(expr: &Expr, row: &Row) -> std::result::Result<Value, At> {
    Ok(match expr {
        Expr::Literal(v) => v.clone(),
        Expr::List(items) => Value::Array(items.iter().map(|e| eval(e, row)).collect::<std::result::Result<_, _>>()?),
        Expr::Column { path, pos } => {
            let mut value = row.column(&path[0]).map_err(|e| At(*pos, e))?;
            for (depth, field) in path.iter().enumerate().skip(1) {
                value = match value {
                    Value::Object(map) => map.get(field).ok_or_else(|| {
                        let keys: Vec<&str> = map.keys().map(String::as_str).collect();
                        At(
                            *pos,
                            format!(
                                "`{}` has no field `{field}` (fields: {})",
                                path[..depth].join("."),
                                keys.join(", ")
                            ),
                        )
                    })?,
                    other => {
                        return Err(At(
                            *pos,
                            format!("`{}` is {}, which has no fields", path[..depth].join("."), describe_json(other)),
                        ))
                    }
                };
            }
            value.clone()
        }
        Expr::Len { arg, pos } => match eval(arg, row)? {
            Value::String(s) => s.chars().count().into(),
            Value::Array(a) => a.len().into(),
            Value::Object(m) => m.len().into(),
            other => return Err(At(*pos, format!("len() of {}", describe_json(&other)))),
        },
        Expr::Not { arg, pos } => Value::Bool(!truth(eval(arg, row)?, *pos)?),
        Expr::And(a, b) => Value::Bool(truth(eval(a, row)?, 0)? && truth(eval(b, row)?, 0)?),
        Expr::Or(a, b) => Value::Bool(truth(eval(a, row)?, 0)? || truth(eval(b, row)?, 0)?),
        Expr::Compare { op, left, right, pos } => {
            let (l, r) = (eval(left, row)?, eval(right, row)?);
            Value::Bool(compare(*op, &l, &r).map_err(|e| At(*pos, e))?)
        }
    })
}

fn truth(value: Value, pos: usize) -> std::result::Result<bool, At> {
    match value {
        Value::Bool(b) => Ok(b),
        other => Err(At(pos, format!("expected true or false, got {}", describe_json(&other)))),
    }
}

/// A number, or a string holding one.
fn numeric(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

fn equal(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(_), _) | (_, Value::Number(_)) => numeric(a).zip(numeric(b)).is_some_and(|(x, y)| x == y),
        (Value::Array(x), Value::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(p, q)| equal(p, q)),
        _ => a == b,
    }
}

fn compare(op: Op, l: &Value, r: &Value) -> std::result::Result<bool, String> {
    use std::cmp::Ordering;
    let order = || -> std::result::Result<Option<Ordering>, String> {
        match (l, r) {
            (Value::Null, _) | (_, Value::Null) => Ok(None),
            (Value::String(a), Value::String(b)) => Ok(Some(a.cmp(b))),
            _ => match (numeric(l), numeric(r)) {
                (Some(a), Some(b)) => Ok(a.partial_cmp(&b)),
                _ => Err(format!("cannot order {} and {}", describe_json(l), describe_json(r))),
            },
        }
    };
    let contains = || -> std::result::Result<bool, String> {
        match (l, r) {
            (_, Value::Array(items)) => Ok(items.iter().any(|x| equal(l, x))),
            (Value::String(needle), Value::String(hay)) => Ok(hay.contains(needle.as_str())),
            (Value::String(key), Value::Object(map)) => Ok(map.contains_key(key)),
            _ => Err(format!("`in` needs a list, a string or an object on its right, got {}", describe_json(r))),
        }
    };
    Ok(match op {
        Op::Eq => equal(l, r),
        Op::Ne => !equal(l, r),
        Op::Lt => order()? == Some(Ordering::Less),
        Op::Le => matches!(order()?, Some(Ordering::Less | Ordering::Equal)),
        Op::Gt => order()? == Some(Ordering::Greater),
        Op::Ge => matches!(order()?, Some(Ordering::Greater | Ordering::Equal)),
        Op::In => contains()?,
        Op::NotIn => !contains()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::RowPlace;
    use serde_json::json;

    fn row(v: Value) -> Row {
        Row::new(
            std::sync::Arc::from(std::path::Path::new("d.jsonl")),
            RowPlace::Line(7),
            v.as_object().unwrap().clone(),
        )
    }

    fn keeps(expr: &str, v: Value) -> bool {
        Filter::parse(expr).unwrap().keeps(&row(v)).unwrap()
    }

    #[test]
    fn helpsteer3_english_short_conversations() {
        let f = "language == \"english\" and len(context) <= 4";
        let turns = |n: usize| vec![json!({"role": "user", "content": "x"}); n];
        assert!(keeps(f, json!({"language": "english", "context": turns(3)})));
        assert!(!keeps(f, json!({"language": "english", "context": turns(5)})));
        assert!(!keeps(f, json!({"language": "chinese", "context": turns(1)})));
    }

    #[test]
    fn operators_precedence_and_membership() {
        let r = json!({"n": 3, "s": "abc", "tags": ["a", "b"], "m": {"k": 1.5}, "z": null, "csv": "12"});
        assert!(keeps("n > 2 and n != 4 or false", r.clone()));
        assert!(keeps("not n == 4", r.clone()));
        assert!(keeps("true or false and false", r.clone()), "and binds tighter");
        assert!(!keeps("(true or false) and false", r.clone()));
        assert!(keeps("n in [1, 2, 3] and 'b' in tags and \"bc\" in s and \"k\" in m", r.clone()));
        assert!(keeps("s not in ['x', 'y'] and m.k >= 1.5 and z == null and not z > 1", r.clone()));
        assert!(keeps("csv > 9 and csv == 12 and len(s) == 3 and `n` == 3.0", r));
    }

    #[test]
    fn parse_errors_point_at_the_fault() {
        let err = Filter::parse("language = \"english\"").unwrap_err().to_string();
        assert_eq!(err, "--dataset_filter: unexpected `=`: use == to compare at character 10\n  language = \"english\"\n           ^");
        let err = Filter::parse("len(context) <= ").unwrap_err().to_string();
        assert!(err.starts_with("--dataset_filter: expected a value, found the end at character 17"), "{err}");
        let err = Filter::parse("a == 1 b").unwrap_err().to_string();
        assert!(err.contains("unexpected `b` after a complete expression"), "{err}");
        assert!(Filter::parse("\"open").is_err());
    }

    #[test]
    fn nesting_past_the_limit_is_an_error_not_a_stack_overflow() {
        for deep in ["(".repeat(100_000), "not ".repeat(100_000), "[".repeat(100_000), "len(".repeat(100_000)] {
            let err = Filter::parse(&deep).unwrap_err().to_string();
            assert!(err.contains("the expression nests more than 256 levels deep"), "{}", &err[..200]);
        }
        let chain = vec!["n == 1"; 100_000].join(" or ");
        let err = Filter::parse(&chain).unwrap_err().to_string();
        assert!(err.contains("nests more than 256 levels"), "{err}");
        assert!(err.len() < 300, "a long expression is shown around the fault only: {err}");
        // Real filters are far from the limit.
        let wide = vec!["n == 1"; 200].join(" or ");
        assert!(keeps(&wide, json!({"n": 1})));
        assert!(keeps(&format!("{}true{}", "(".repeat(60), ")".repeat(60)), json!({})));
    }

    #[test]
    fn evaluation_errors_name_row_column_and_position() {
        let f = Filter::parse("langauge == \"english\"").unwrap();
        let err = f.keeps(&row(json!({"language": "english", "context": []}))).unwrap_err().to_string();
        assert_eq!(
            err,
            "d.jsonl:7: --dataset_filter at character 1: no column `langauge` (columns: language, context)"
        );
        let err = Filter::parse("n < \"x\"").unwrap().keeps(&row(json!({"n": 1}))).unwrap_err().to_string();
        assert!(err.ends_with("at character 3: cannot order a number (1) and a string (\"x\")"), "{err}");
        let err = Filter::parse("n").unwrap().keeps(&row(json!({"n": 1}))).unwrap_err().to_string();
        assert!(err.ends_with("gives a number (1), not true or false"), "{err}");
    }
}

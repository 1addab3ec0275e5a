//! Configuration files and `--set`: TOML in, dotted keys patched, TRL 1.x's
//! names renamed to rloo's, unknown keys named in errors.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A resolved configuration as TOML, as the commands print and save it.
pub fn to_toml<T: serde::Serialize>(cfg: &T) -> String {
    toml::to_string_pretty(cfg).unwrap_or_else(|e| format!("# cannot serialise config: {e}\n"))
}

/// A configuration from a TOML file (`prepare`d, e.g. renaming keys) with
/// `overrides` (dotted path, value) applied in order; unknown keys are
/// errors naming their path. Every command that trains loads its options so.
pub fn load_toml<T: serde::de::DeserializeOwned>(
    file: Option<&Path>,
    overrides: &[(String, toml::Value)],
    prepare: fn(&mut toml::Table, &Path) -> Result<()>,
) -> Result<T> {
    let mut table = match file {
        Some(path) => {
            let text = crate::error::read_to_string(path)?;
            let mut table = text.parse::<toml::Table>().map_err(|e| Error::bad_config(path, e.to_string()))?;
            prepare(&mut table, path)?;
            table
        }
        None => toml::Table::new(),
    };
    for (key, value) in overrides {
        set_path(&mut table, key, value.clone())?;
    }
    let source = file.map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("command line"));
    from_table(table, &source)
}

pub(super) fn from_table<T: serde::de::DeserializeOwned>(table: toml::Table, source: &Path) -> Result<T> {
    serde_path_to_error::deserialize(toml::Value::Table(table))
        .map_err(|e| Error::bad_config(source, format!("{}: {}", e.path(), e.inner())))
}

/// Sets `a.b.c = value` in a TOML table, creating tables on the way.
fn set_path(table: &mut toml::Table, key: &str, value: toml::Value) -> Result<()> {
    let parts: Vec<&str> = key.split('.').collect();
    let (last, sections) = parts.split_last().ok_or_else(|| Error::Invalid(format!("empty key in --set {key}")))?;
    let mut here = table;
    for part in sections {
        let entry = here.entry(part.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        here = entry.as_table_mut().ok_or_else(|| Error::Invalid(format!("--set {key}: `{part}` is not a section")))?;
    }
    here.insert(last.to_string(), value);
    Ok(())
}

/// Parses the value of `--set key=value`: TOML syntax (numbers, booleans,
/// quoted strings, arrays), falling back to a bare string.
pub fn parse_set(arg: &str) -> Result<(String, toml::Value)> {
    let (key, raw) =
        arg.split_once('=').ok_or_else(|| Error::Invalid(format!("--set expects section.key=value, got `{arg}`")))?;
    let value = format!("v = {raw}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()));
    Ok((key.trim().to_string(), value))
}

/// TRL 1.x's names of settings that rloo keeps under TRL 0.x's: (section,
/// TRL 1.x name, key). Both are accepted in files and in `--set`.
const TRL_NAMES: &[(&str, &str, &str)] = &[
    ("rloo", "num_generations", "k"),
    ("rloo", "beta", "kl_coef"),
    ("rloo", "num_iterations", "num_ppo_epochs"),
    ("rloo", "epsilon", "cliprange"),
    ("rloo", "epsilon_high", "cliprange_high"),
    ("rloo", "normalize_advantages", "normalize_advantage"),
    ("generation", "max_completion_length", "response_length"),
];

/// `section.key` with a TRL 1.x key replaced by rloo's.
pub(super) fn canonical_key(path: &str) -> String {
    TRL_NAMES
        .iter()
        .find(|(section, name, _)| path.strip_prefix(section).and_then(|r| r.strip_prefix('.')) == Some(name))
        .map_or_else(|| path.to_string(), |(section, _, key)| format!("{section}.{key}"))
}

/// Renames a file's TRL 1.x keys to rloo's; one setting under both names is
/// an error naming both.
pub(super) fn rename_trl_names(table: &mut toml::Table, path: &Path) -> Result<()> {
    for (section, name, key) in TRL_NAMES {
        let Some(toml::Value::Table(t)) = table.get_mut(*section) else { continue };
        let Some(value) = t.remove(*name) else { continue };
        if t.contains_key(*key) {
            return Err(Error::bad_config(
                path,
                format!("[{section}] sets both `{key}` and `{name}`, two names of one setting: give one"),
            ));
        }
        t.insert(key.to_string(), value);
    }
    Ok(())
}

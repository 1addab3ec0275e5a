//! Turning a model argument into a directory: a local path, or a Hugging Face
//! hub id found in the local cache (downloaded into it when the `hub`
//! feature is on and the process is not offline).
//!
//! The cache is the one `huggingface_hub` writes (`constants.py`,
//! `file_download.py`):
//! - its root is `$HF_HUB_CACHE`, else the legacy `$HUGGINGFACE_HUB_CACHE`,
//!   else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
//!   `~/.cache/huggingface/hub`;
//! - a model `owner/name` lives in `models--owner--name/`, where
//!   `refs/<revision>` holds the commit hash that `revision` (default `main`)
//!   points at, and `snapshots/<hash>/` holds the files. A revision that is
//!   itself a 40-hex commit hash names its snapshot directly.
//!
//! Offline mode: `HF_HUB_OFFLINE` (or the older `TRANSFORMERS_OFFLINE`) set to
//! 1/ON/YES/TRUE, as `huggingface_hub` reads it.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The environment variables the resolution reads, captured once so that
/// tests can pass their own instead of touching the process environment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HubEnv {
    pub hf_hub_cache: Option<String>,
    pub huggingface_hub_cache: Option<String>,
    pub hf_home: Option<String>,
    pub xdg_cache_home: Option<String>,
    pub home: Option<String>,
    pub hf_hub_offline: Option<String>,
    pub transformers_offline: Option<String>,
    pub hf_endpoint: Option<String>,
    pub hf_token: Option<String>,
    pub hf_token_path: Option<String>,
}

impl HubEnv {
    /// Reads the variables through `var` (empty values count as unset).
    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> HubEnv {
        let get = |name: &str| var(name).filter(|v| !v.is_empty());
        HubEnv {
            hf_hub_cache: get("HF_HUB_CACHE"),
            huggingface_hub_cache: get("HUGGINGFACE_HUB_CACHE"),
            hf_home: get("HF_HOME"),
            xdg_cache_home: get("XDG_CACHE_HOME"),
            home: get("HOME").or_else(|| get("USERPROFILE")),
            hf_hub_offline: get("HF_HUB_OFFLINE"),
            transformers_offline: get("TRANSFORMERS_OFFLINE"),
            hf_endpoint: get("HF_ENDPOINT"),
            hf_token: get("HF_TOKEN").or_else(|| get("HUGGING_FACE_HUB_TOKEN")),
            hf_token_path: get("HF_TOKEN_PATH"),
        }
    }

    /// The variables of this process.
    pub fn from_process() -> HubEnv {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// `$HF_HOME`, else `$XDG_CACHE_HOME/huggingface`, else
    /// `~/.cache/huggingface`; `None` when not even a home is known.
    pub fn hf_home(&self) -> Option<PathBuf> {
        if let Some(home) = &self.hf_home {
            return Some(PathBuf::from(home));
        }
        let cache = match (&self.xdg_cache_home, &self.home) {
            (Some(xdg), _) => PathBuf::from(xdg),
            (None, Some(home)) => Path::new(home).join(".cache"),
            (None, None) => return None,
        };
        Some(cache.join("huggingface"))
    }

    /// The hub cache root (see the module documentation for the order).
    pub fn cache_dir(&self) -> Option<PathBuf> {
        self.hf_hub_cache
            .as_ref()
            .or(self.huggingface_hub_cache.as_ref())
            .map(PathBuf::from)
            .or_else(|| self.hf_home().map(|h| h.join("hub")))
    }

    /// Whether downloads are switched off.
    pub fn offline(&self) -> bool {
        let truthy = |v: &Option<String>| {
            v.as_deref().is_some_and(|v| matches!(v.to_ascii_uppercase().as_str(), "1" | "ON" | "YES" | "TRUE"))
        };
        truthy(&self.hf_hub_offline) || truthy(&self.transformers_offline)
    }

    /// The access token: `$HF_TOKEN`, else the file at `$HF_TOKEN_PATH` or
    /// `$HF_HOME/token` (where `huggingface-cli login` stores it).
    pub fn token(&self) -> Option<String> {
        if let Some(token) = &self.hf_token {
            return Some(token.clone());
        }
        let path = match &self.hf_token_path {
            Some(p) => PathBuf::from(p),
            None => self.hf_home()?.join("token"),
        };
        let token = std::fs::read_to_string(path).ok()?;
        let token = token.trim();
        (!token.is_empty()).then(|| token.to_string())
    }
}

/// A hub model id with an optional revision (`owner/name@revision`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubId {
    /// `owner/name`, or a bare `name` for the old un-namespaced repos (`gpt2`).
    pub repo: String,
    /// Branch, tag or commit hash; `None` means `main`.
    pub revision: Option<String>,
}

impl HubId {
    /// Parses `owner/name` or `owner/name@revision`; `None` when `spec`
    /// cannot be a hub id (empty parts, more than one `/`, odd characters).
    pub fn parse(spec: &str) -> Option<HubId> {
        let (repo, revision) = match spec.split_once('@') {
            Some((repo, rev)) if !rev.is_empty() => (repo, Some(rev.to_string())),
            Some(_) => return None,
            None => (spec, None),
        };
        let parts: Vec<&str> = repo.split('/').collect();
        let valid = |p: &str| {
            !p.is_empty()
                && !p.starts_with(['.', '-'])
                && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        if parts.len() > 2 || !parts.iter().all(|p| valid(p)) {
            return None;
        }
        Some(HubId { repo: repo.to_string(), revision })
    }

    /// The revision asked for, `main` by default.
    pub fn revision(&self) -> &str {
        self.revision.as_deref().unwrap_or("main")
    }

    /// The cache folder name: `models--owner--name`.
    pub fn folder_name(&self) -> String {
        format!("models--{}", self.repo.replace('/', "--"))
    }

    /// The cache folder name of a dataset repo: `datasets--owner--name`.
    pub fn dataset_folder_name(&self) -> String {
        format!("datasets--{}", self.repo.replace('/', "--"))
    }
}

impl std::fmt::Display for HubId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.revision {
            Some(rev) => write!(f, "{}@{rev}", self.repo),
            None => f.write_str(&self.repo),
        }
    }
}

fn is_commit_hash(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The snapshot directory of `id` in the cache rooted at `cache_dir`, if it
/// is there and holds a `config.json`. Reads only the file system.
pub fn find_cached(cache_dir: &Path, id: &HubId) -> Option<PathBuf> {
    let snapshot = find_snapshot(&cache_dir.join(id.folder_name()), id.revision())?;
    snapshot.join("config.json").is_file().then_some(snapshot)
}

/// The snapshot directory that `revision` names in a cached repo folder
/// (`models--o--n`, `datasets--o--n`), if it is there.
pub fn find_snapshot(repo_dir: &Path, revision: &str) -> Option<PathBuf> {
    let commit = if is_commit_hash(revision) {
        revision.to_string()
    } else {
        let text = std::fs::read_to_string(repo_dir.join("refs").join(revision)).ok()?;
        text.trim().to_string()
    };
    if commit.is_empty() {
        return None;
    }
    let snapshot = repo_dir.join("snapshots").join(commit);
    snapshot.is_dir().then_some(snapshot)
}

/// Resolves a model argument with this process's environment; see
/// [`resolve_model_with`].
pub fn resolve_model(spec: &str) -> Result<PathBuf> {
    resolve_model_with(spec, &HubEnv::from_process())
}

/// Resolves a model argument to a model directory: an existing directory is
/// returned as is; otherwise `spec` is read as a hub id and looked up in the
/// cache, then downloaded when the `hub` feature is on and `env` is not
/// offline.
pub fn resolve_model_with(spec: &str, env: &HubEnv) -> Result<PathBuf> {
    let path = Path::new(spec);
    if path.is_dir() {
        return Ok(path.to_path_buf());
    }
    if path.exists() {
        return Err(Error::bad_file(
            path,
            "is a file; expected a model directory (with config.json, weights and tokenizer files) or a hub id owner/name",
        ));
    }
    let Some(id) = HubId::parse(spec) else {
        return Err(Error::bad_file(path, "no such directory, and not a hub id of the form owner/name[@revision]"));
    };
    let Some(cache_dir) = env.cache_dir() else {
        return Err(Error::bad_file(
            path,
            "no such directory, and no Hugging Face cache to look in (set HF_HUB_CACHE, HF_HOME or HOME)",
        ));
    };
    if let Some(snapshot) = find_cached(&cache_dir, &id) {
        return Ok(snapshot);
    }
    let not_cached = format!(
        "no such directory, and the hub id {id} is not in the Hugging Face cache at {} \
         (looked for {}/refs/{} and its snapshot with a config.json)",
        cache_dir.display(),
        id.folder_name(),
        id.revision()
    );
    if env.offline() {
        return Err(Error::bad_file(path, format!("{not_cached}; downloading is off because HF_HUB_OFFLINE is set")));
    }
    download(&id, env, &cache_dir).map_err(|why| Error::bad_file(path, format!("{not_cached}; {why}")))
}

#[cfg(not(feature = "hub"))]
fn download(_id: &HubId, _env: &HubEnv, _cache_dir: &Path) -> std::result::Result<PathBuf, String> {
    Err("downloading is off: rloo was built without the `hub` feature".to_string())
}

/// Files fetched besides the weights; those the repo lacks are skipped.
#[cfg(feature = "hub")]
const DOWNLOAD_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
];

/// The hub API for one repo, caching into `cache_dir`.
#[cfg(feature = "hub")]
pub(crate) fn hub_repo(
    id: &HubId,
    env: &HubEnv,
    cache_dir: &Path,
    kind: hf_hub::RepoType,
) -> std::result::Result<hf_hub::api::sync::ApiRepo, String> {
    let mut builder =
        hf_hub::api::sync::ApiBuilder::new().with_cache_dir(cache_dir.to_path_buf()).with_token(env.token());
    if let Some(endpoint) = &env.hf_endpoint {
        builder = builder.with_endpoint(endpoint.trim_end_matches('/').to_string());
    }
    let api = builder.build().map_err(|e| format!("downloading it failed: {e}"))?;
    Ok(api.repo(hf_hub::Repo::with_revision(id.repo.clone(), kind, id.revision().to_string())))
}

/// Downloads config, tokenizer files and safetensors weights (single file or
/// index plus shards) into the cache and returns the snapshot directory.
#[cfg(feature = "hub")]
fn download(id: &HubId, env: &HubEnv, cache_dir: &Path) -> std::result::Result<PathBuf, String> {
    let fail = |e: &dyn std::fmt::Display| format!("downloading it failed: {e}");
    let repo = hub_repo(id, env, cache_dir, hf_hub::RepoType::Model)?;
    let info = repo.info().map_err(|e| fail(&e))?;
    let present: std::collections::HashSet<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
    if !present.contains("config.json") {
        return Err(format!("the hub repo {id} has no config.json"));
    }

    let mut files: Vec<String> =
        DOWNLOAD_FILES.iter().filter(|f| present.contains(**f)).map(|f| f.to_string()).collect();
    const INDEX: &str = "model.safetensors.index.json";
    if present.contains(INDEX) {
        let index_path = repo.get(INDEX).map_err(|e| fail(&e))?;
        let index: serde_json::Value = crate::error::read_json(&index_path).map_err(|e| e.to_string())?;
        let Some(map) = index.get("weight_map").and_then(|m| m.as_object()) else {
            return Err(format!("{}: no weight_map object", index_path.display()));
        };
        let mut shards: Vec<String> = map.values().filter_map(|v| v.as_str().map(str::to_string)).collect();
        shards.sort();
        shards.dedup();
        files.extend(shards);
    } else if present.contains("model.safetensors") {
        files.push("model.safetensors".to_string());
    } else {
        return Err(format!("the hub repo {id} has no safetensors weights (model.safetensors or {INDEX})"));
    }

    let mut snapshot = None;
    for file in &files {
        let local = repo.get(file).map_err(|e| format!("downloading {file} failed: {e}"))?;
        if file == "config.json" {
            snapshot = local.parent().map(Path::to_path_buf);
        }
    }
    snapshot.ok_or_else(|| "the download left no config.json".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const HASH: &str = "0123456789abcdef0123456789abcdef01234567";

    fn env(vars: &[(&str, &str)]) -> HubEnv {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        HubEnv::from_lookup(|k| map.get(k).cloned())
    }

    /// A cache holding `owner/tiny` at `HASH`, with `refs/main` and a tag.
    fn fake_cache(root: &Path) {
        let repo = root.join("models--owner--tiny");
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), HASH).unwrap();
        std::fs::write(repo.join("refs/v1"), format!("{HASH}\n")).unwrap();
        let snap = repo.join("snapshots").join(HASH);
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::write(snap.join("config.json"), "{}").unwrap();
    }

    #[test]
    fn cache_dir_precedence_follows_huggingface_hub() {
        let all = [
            ("HF_HUB_CACHE", "/a"),
            ("HUGGINGFACE_HUB_CACHE", "/b"),
            ("HF_HOME", "/c"),
            ("XDG_CACHE_HOME", "/d"),
            ("HOME", "/e"),
        ];
        let expect = ["/a", "/b", "/c/hub", "/d/huggingface/hub", "/e/.cache/huggingface/hub"];
        for (i, want) in expect.iter().enumerate() {
            assert_eq!(env(&all[i..]).cache_dir(), Some(PathBuf::from(want)), "{i}");
        }
        assert_eq!(env(&[]).cache_dir(), None);
        assert_eq!(
            env(&[("HF_HUB_CACHE", ""), ("HF_HOME", "/c")]).cache_dir(),
            Some(PathBuf::from("/c/hub")),
            "empty counts as unset"
        );
    }

    #[test]
    fn offline_accepts_python_truthy_values() {
        for v in ["1", "true", "ON", "yes"] {
            assert!(env(&[("HF_HUB_OFFLINE", v)]).offline(), "{v}");
        }
        for v in ["0", "false", "no"] {
            assert!(!env(&[("HF_HUB_OFFLINE", v)]).offline(), "{v}");
        }
        assert!(env(&[("TRANSFORMERS_OFFLINE", "1")]).offline());
    }

    #[test]
    fn token_comes_from_env_or_the_token_file() {
        let home = tempfile::tempdir().unwrap();
        std::fs::write(home.path().join("token"), "hf_file\n").unwrap();
        let h = home.path().to_str().unwrap();
        assert_eq!(env(&[("HF_HOME", h)]).token().as_deref(), Some("hf_file"));
        assert_eq!(env(&[("HF_HOME", h), ("HF_TOKEN", "hf_env")]).token().as_deref(), Some("hf_env"));
        assert_eq!(env(&[("HF_HOME", "/nonexistent")]).token(), None);
    }

    #[test]
    fn hub_ids_parse_with_optional_revision() {
        assert_eq!(
            HubId::parse("Qwen/Qwen2.5-0.5B-Instruct"),
            Some(HubId { repo: "Qwen/Qwen2.5-0.5B-Instruct".into(), revision: None })
        );
        let id = HubId::parse("owner/name@v1.0").unwrap();
        assert_eq!((id.repo.as_str(), id.revision()), ("owner/name", "v1.0"));
        assert_eq!(id.folder_name(), "models--owner--name");
        assert_eq!(HubId::parse("gpt2").unwrap().revision(), "main");
        for bad in ["a/b/c", "/abs", "a/", "a b/c", "./x", "o/n@", "../up"] {
            assert_eq!(HubId::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn cached_snapshot_is_found_by_ref_or_commit() {
        let root = tempfile::tempdir().unwrap();
        fake_cache(root.path());
        let snap = root.path().join("models--owner--tiny/snapshots").join(HASH);
        let find = |spec: &str| find_cached(root.path(), &HubId::parse(spec).unwrap());
        assert_eq!(find("owner/tiny"), Some(snap.clone()));
        assert_eq!(find("owner/tiny@v1"), Some(snap.clone()));
        assert_eq!(find(&format!("owner/tiny@{HASH}")), Some(snap));
        assert_eq!(find("owner/tiny@v2"), None);
        assert_eq!(find("owner/other"), None);
    }

    #[test]
    fn snapshot_without_config_json_does_not_count() {
        let root = tempfile::tempdir().unwrap();
        fake_cache(root.path());
        let snap = root.path().join("models--owner--tiny/snapshots").join(HASH);
        std::fs::remove_file(snap.join("config.json")).unwrap();
        assert_eq!(find_cached(root.path(), &HubId::parse("owner/tiny").unwrap()), None);
    }

    #[test]
    fn existing_directory_is_returned_as_is() {
        let dir = tempfile::tempdir().unwrap();
        let spec = dir.path().to_str().unwrap();
        assert_eq!(resolve_model_with(spec, &env(&[])).unwrap(), dir.path());
    }

    #[test]
    fn hub_id_resolves_through_the_cache_named_by_the_env() {
        let root = tempfile::tempdir().unwrap();
        let hub = root.path().join("home/hub");
        fake_cache(&hub);
        let e = env(&[("HF_HOME", root.path().join("home").to_str().unwrap())]);
        assert_eq!(resolve_model_with("owner/tiny", &e).unwrap(), hub.join("models--owner--tiny/snapshots").join(HASH));
    }

    #[test]
    fn uncached_id_offline_names_the_cache_and_why() {
        let root = tempfile::tempdir().unwrap();
        let e = env(&[("HF_HUB_CACHE", root.path().to_str().unwrap()), ("HF_HUB_OFFLINE", "1")]);
        let err = resolve_model_with("owner/missing", &e).unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "owner/missing: no such directory, and the hub id owner/missing is not in the \
                 Hugging Face cache at {} (looked for models--owner--missing/refs/main and its \
                 snapshot with a config.json); downloading is off because HF_HUB_OFFLINE is set",
                root.path().display()
            )
        );
    }

    #[cfg(not(feature = "hub"))]
    #[test]
    fn without_the_hub_feature_an_uncached_id_says_downloading_is_off() {
        let root = tempfile::tempdir().unwrap();
        let e = env(&[("HF_HUB_CACHE", root.path().to_str().unwrap())]);
        let err = resolve_model_with("owner/missing", &e).unwrap_err().to_string();
        assert!(err.ends_with("downloading is off: rloo was built without the `hub` feature"), "{err}");
    }

    #[test]
    fn path_that_is_neither_dir_nor_id_says_so() {
        let err = resolve_model_with("./no/such/dir", &env(&[])).unwrap_err().to_string();
        assert_eq!(err, "./no/such/dir: no such directory, and not a hub id of the form owner/name[@revision]");
    }

    #[test]
    fn a_file_is_not_a_model_directory() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.json");
        std::fs::write(&file, "{}").unwrap();
        let err = resolve_model_with(file.to_str().unwrap(), &env(&[])).unwrap_err().to_string();
        assert!(err.contains("is a file; expected a model directory"), "{err}");
    }
}

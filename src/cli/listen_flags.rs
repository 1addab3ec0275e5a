//! Where a server listens and the token it asks for: the same flags for
//! `rloo serve` and `rloo reward serve`.

use anyhow::{Context, Result};
use clap::Args;

#[derive(Debug, Args)]
pub struct ListenFlags {
    /// Address to listen on (0.0.0.0: every interface).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the address is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Environment variable holding a token that clients must send as `Authorization: Bearer <token>`.
    #[arg(long)]
    pub api_key_env: Option<String>,
}

impl ListenFlags {
    /// The bearer token, read from the variable `--api-key-env` names.
    pub fn token(&self) -> Result<Option<String>> {
        match &self.api_key_env {
            Some(var) => Ok(Some(std::env::var(var).with_context(|| format!("--api-key-env: `{var}` is not set"))?)),
            None => Ok(None),
        }
    }
}

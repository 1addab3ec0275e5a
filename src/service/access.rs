//! Who may use a server: the checks every request passes before its body
//! is read.
//!
//! - **Host.** A web page can make a browser send requests to a loopback
//!   server under a name the page's owner controls (DNS rebinding), so the
//!   `Host` header must be a loopback name (`localhost`, `*.localhost`), an
//!   IP address (which rebinding cannot produce), or a name of
//!   `allowed_hosts`.
//! - **Origin.** A request a browser sends from a page of another origin
//!   is refused unless that origin is in `allowed_origins`, which alone get
//!   CORS headers (never `*`). Bodies must be `application/json`, a type a
//!   page can only send after a CORS preflight this server does not grant.
//! - **Token.** With a token, everything but `GET /` (the page) and
//!   `GET /health` needs `Authorization: Bearer <token>`.
//! - **Binding.** Listening beyond loopback without a token is refused
//!   unless asked for in so many words; beyond loopback is warned of
//!   either way.

use std::net::IpAddr;

use super::http::Head;
use super::server::HttpError;
use crate::error::{Error, Result};

#[derive(Debug, Clone, Default)]
pub struct Access {
    /// Required as `Authorization: Bearer <token>` on all but the public routes.
    pub token: Option<String>,
    /// Host names answered besides loopback names and IP addresses
    /// (`.example.com`: that name and its subdomains; `*`: any).
    pub allowed_hosts: Vec<String>,
    /// Origins (`scheme://host[:port]`) of web pages that may call the API
    /// besides the server's own page.
    pub allowed_origins: Vec<String>,
}

/// What a request that passed may be answered with.
#[derive(Debug, Default, PartialEq)]
pub struct Passed {
    /// A foreign origin of `allowed_origins`, to name in CORS headers.
    pub cors_origin: Option<String>,
    /// A CORS preflight, answered 204 with nothing more to do.
    pub preflight: bool,
}

impl Access {
    /// Refuses to listen on a host beyond loopback without a token, unless
    /// `insecure` says to.
    pub fn check_bind(&self, host: &str, port: u16, insecure: bool) -> Result<()> {
        if is_loopback(host) || self.token.is_some() || insecure {
            return Ok(());
        }
        Err(Error::Invalid(format!(
            "refusing to listen on {host}:{port} without a token: anyone who can reach this machine could use \
             the server. Give a token with --api-key-env VAR, listen on 127.0.0.1, or pass \
             --insecure-no-api-key to listen without one"
        )))
    }

    /// The warning owed to a server listening beyond loopback, if it is.
    pub fn exposure(&self, host: &str, port: u16) -> Option<String> {
        if is_loopback(host) {
            return None;
        }
        let how = if self.token.is_some() { "requests need the token" } else { "and takes requests WITHOUT a token" };
        Some(format!("listening on {host}:{port}, reachable from other machines; {how}"))
    }

    /// The checks of one request, in the order above; `public` routes
    /// need no token.
    pub fn check(&self, head: &Head, public: bool) -> std::result::Result<Passed, HttpError> {
        let host = head.header("host").ok_or_else(|| HttpError::bad_request("the request has no Host header"))?;
        if !self.host_allowed(host) {
            return Err(HttpError::new(
                403,
                format!(
                    "Host `{}` is not one this server answers to (loopback names and IP addresses); \
                     add the name with --allowed-hosts",
                    super::client::quote(host)
                ),
            ));
        }
        let mut passed = Passed::default();
        if let Some(origin) = head.header("origin") {
            let same = origin.split_once("://").is_some_and(|(_, authority)| authority.eq_ignore_ascii_case(host));
            if !same {
                if !self.allowed_origins.iter().any(|o| o == origin) {
                    return Err(HttpError::new(
                        403,
                        format!(
                            "requests from web pages of {} are refused; allow that origin with --allowed-origins",
                            super::client::quote(origin)
                        ),
                    ));
                }
                passed.cors_origin = Some(origin.to_string());
            }
        }
        if head.method == "OPTIONS" && head.header("access-control-request-method").is_some() {
            passed.preflight = true;
            return Ok(passed);
        }
        if let (Some(token), false) = (&self.token, public) {
            let given = head.header("authorization");
            let bearer = given.and_then(|v| v.strip_prefix("Bearer ")).map(str::trim);
            if !bearer.is_some_and(|b| same_bytes(b.as_bytes(), token.as_bytes())) {
                let what = if given.is_some() { "a wrong bearer token" } else { "no Authorization header" };
                return Err(HttpError::new(401, format!("{what}: send `Authorization: Bearer <token>`")));
            }
        }
        if !matches!(head.method.as_str(), "GET" | "HEAD" | "OPTIONS") {
            let content_type = head.header("content-type").unwrap_or("");
            let media = content_type.split(';').next().unwrap_or("").trim();
            if !media.eq_ignore_ascii_case("application/json") {
                let got = if content_type.is_empty() { "none".to_string() } else { super::client::quote(content_type) };
                return Err(HttpError::new(
                    415,
                    format!("send the body as JSON with `Content-Type: application/json` (got {got})"),
                ));
            }
        }
        Ok(passed)
    }

    fn host_allowed(&self, host: &str) -> bool {
        let name = host_name(host).to_ascii_lowercase();
        if name.is_empty() {
            return false;
        }
        if name == "localhost" || name.ends_with(".localhost") || name.parse::<IpAddr>().is_ok() {
            return true;
        }
        self.allowed_hosts.iter().any(|allowed| {
            let allowed = allowed.to_ascii_lowercase();
            allowed == "*"
                || allowed == name
                || allowed.strip_prefix('.').is_some_and(|domain| name == domain || name.ends_with(&allowed))
        })
    }
}

/// The name or address of a `Host` value, without its port (and without
/// the brackets of an IPv6 address).
fn host_name(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or("");
    }
    host.rsplit_once(':')
        .map_or(host, |(name, port)| if port.bytes().all(|b| b.is_ascii_digit()) { name } else { host })
}

/// Whether a listening host is loopback only.
pub fn is_loopback(host: &str) -> bool {
    let name = host.trim_start_matches('[').trim_end_matches(']');
    name.eq_ignore_ascii_case("localhost") || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Compares in time that does not depend on where the bytes differ.
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(method: &str, headers: &[(&str, &str)]) -> Head {
        Head {
            method: method.into(),
            target: "/v1/completions".into(),
            minor_version: 1,
            headers: headers.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect(),
        }
    }

    const JSON: (&str, &str) = ("content-type", "application/json; charset=utf-8");

    #[test]
    fn loopback_names_and_addresses_pass_other_names_need_listing() {
        let open = Access::default();
        for host in ["127.0.0.1:8000", "localhost:8000", "LOCALHOST", "app.localhost:1", "[::1]:8000", "10.0.0.7:80"] {
            assert_eq!(open.check(&head("POST", &[("host", host), JSON]), false), Ok(Passed::default()), "{host}");
        }
        for host in ["evil.example:8000", "attacker.com", "localhost.evil.com", ""] {
            let err = open.check(&head("POST", &[("host", host), JSON]), false).unwrap_err();
            assert_eq!(err.status, 403, "{host}: {err:?}");
        }
        assert_eq!(open.check(&head("GET", &[]), true).unwrap_err().status, 400);
        let listed = Access { allowed_hosts: vec!["models.lan".into(), ".corp.example".into()], ..Default::default() };
        for host in ["models.lan:8000", "corp.example", "gpu1.corp.example:8000"] {
            assert!(listed.check(&head("GET", &[("host", host)]), true).is_ok(), "{host}");
        }
        assert!(listed.check(&head("GET", &[("host", "evilcorp.example")]), true).is_err());
        let any = Access { allowed_hosts: vec!["*".into()], ..Default::default() };
        assert!(any.check(&head("GET", &[("host", "anything.at.all")]), true).is_ok());
    }

    #[test]
    fn foreign_origins_are_refused_unless_listed() {
        let access = Access { allowed_origins: vec!["http://localhost:3000".into()], ..Default::default() };
        let same = head("POST", &[("host", "127.0.0.1:8000"), ("origin", "http://127.0.0.1:8000"), JSON]);
        assert_eq!(access.check(&same, false), Ok(Passed::default()));
        let foreign = head("POST", &[("host", "127.0.0.1:8000"), ("origin", "https://evil.example"), JSON]);
        assert_eq!(access.check(&foreign, false).unwrap_err().status, 403);
        let null = head("POST", &[("host", "127.0.0.1:8000"), ("origin", "null"), JSON]);
        assert_eq!(access.check(&null, false).unwrap_err().status, 403);
        let listed = head("POST", &[("host", "127.0.0.1:8000"), ("origin", "http://localhost:3000"), JSON]);
        assert_eq!(access.check(&listed, false).unwrap().cors_origin.as_deref(), Some("http://localhost:3000"));
        let preflight = head(
            "OPTIONS",
            &[
                ("host", "127.0.0.1:8000"),
                ("origin", "http://localhost:3000"),
                ("access-control-request-method", "POST"),
            ],
        );
        assert!(access.check(&preflight, false).unwrap().preflight);
    }

    #[test]
    fn bodies_must_be_json() {
        let access = Access::default();
        for (content_type, ok) in
            [("application/json", true), ("Application/JSON;charset=utf-8", true), ("text/plain", false), ("", false)]
        {
            let mut h = head("POST", &[("host", "127.0.0.1")]);
            if !content_type.is_empty() {
                h.headers.push(("content-type".into(), content_type.into()));
            }
            let got = access.check(&h, false);
            assert_eq!(got.is_ok(), ok, "{content_type}: {got:?}");
            if !ok {
                assert_eq!(got.unwrap_err().status, 415);
            }
        }
        assert!(access.check(&head("GET", &[("host", "127.0.0.1")]), false).is_ok());
    }

    #[test]
    fn the_token_guards_all_but_public_routes() {
        let access = Access { token: Some("s3cret".into()), ..Default::default() };
        let with = |auth: &str| head("POST", &[("host", "127.0.0.1"), ("authorization", auth), JSON]);
        assert!(access.check(&with("Bearer s3cret"), false).is_ok());
        assert_eq!(access.check(&with("Bearer s3cre"), false).unwrap_err().status, 401);
        assert_eq!(access.check(&with("s3cret"), false).unwrap_err().status, 401);
        assert_eq!(access.check(&head("POST", &[("host", "127.0.0.1"), JSON]), false).unwrap_err().status, 401);
        assert!(access.check(&head("GET", &[("host", "127.0.0.1")]), true).is_ok());
    }

    #[test]
    fn listening_beyond_loopback_needs_a_token_or_an_explicit_flag() {
        let open = Access::default();
        for host in ["127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"] {
            assert!(open.check_bind(host, 8000, false).is_ok(), "{host}");
        }
        let err = open.check_bind("0.0.0.0", 8000, false).unwrap_err().to_string();
        assert!(err.contains("refusing to listen on 0.0.0.0:8000 without a token"), "{err}");
        assert!(open.check_bind("0.0.0.0", 8000, true).is_ok());
        let guarded = Access { token: Some("t".into()), ..Default::default() };
        assert!(guarded.check_bind("192.168.1.5", 8000, false).is_ok());
    }
}

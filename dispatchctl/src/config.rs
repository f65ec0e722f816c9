//! Which dispatcher to talk to.
//!
//! Precedence, first match wins:
//! 1. `--server URL`;
//! 2. the `DISPATCH_SERVER` environment variable;
//! 3. the `"server"` key of the config file: `$DISPATCH_CONFIG` when set
//!    (then the file must exist), else `$XDG_CONFIG_HOME/dispatch/config.json`,
//!    else `~/.config/dispatch/config.json` (skipped when absent);
//! 4. [`DEFAULT_SERVER`].
//!
//! The environment is read through a lookup function so that the
//! resolution is a pure function, testable without touching the process
//! environment.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Where the dispatcher listens when nothing says otherwise (the address
/// `dispatcher --dev` binds by default).
pub const DEFAULT_SERVER: &str = "http://127.0.0.1:50051";
/// Environment variable naming the server.
pub const ENV_SERVER: &str = "DISPATCH_SERVER";
/// Environment variable naming the config file.
pub const ENV_CONFIG: &str = "DISPATCH_CONFIG";

/// The config file could not be used, or the address is malformed.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file exists (or was named by `DISPATCH_CONFIG`) but cannot be read.
    #[error("cannot read the config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The file is not the expected JSON.
    #[error("invalid config file {path}: {source} (expected {{\"server\": \"http://host:port\"}})")]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    /// The address is not a URL tonic can connect to.
    #[error("invalid server address {addr:?} (from {source_name}): {why}")]
    Address {
        addr: String,
        source_name: String,
        why: String,
    },
}

/// The config file's contents. Unknown keys are ignored so that newer
/// files keep working with older tools.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigFile {
    /// Dispatcher URL, e.g. `http://dispatch.example:50051`.
    #[serde(default)]
    pub server: Option<String>,
}

/// Where the server address came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Source {
    /// `--server`.
    Flag,
    /// `DISPATCH_SERVER`.
    Env,
    /// The config file at this path.
    ConfigFile { path: PathBuf },
    /// [`DEFAULT_SERVER`].
    Default,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Flag => f.write_str("--server"),
            Source::Env => f.write_str(ENV_SERVER),
            Source::ConfigFile { path } => write!(f, "config file {}", path.display()),
            Source::Default => f.write_str("default"),
        }
    }
}

/// The resolved server address.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Server {
    /// Normalised URL (scheme added when missing). Serialised as `server`,
    /// so `dispatchctl config -o json` output is a valid config file.
    #[serde(rename = "server")]
    pub url: String,
    /// Where it came from.
    pub source: Source,
}

/// The config file path that applies: `$DISPATCH_CONFIG`, else
/// `$XDG_CONFIG_HOME/dispatch/config.json`, else
/// `$HOME/.config/dispatch/config.json`. The flag says whether the path was
/// named explicitly (then a missing file is an error).
pub fn config_path(env: &dyn Fn(&str) -> Option<String>) -> Option<(PathBuf, bool)> {
    let set = |k: &str| env(k).filter(|v| !v.is_empty());
    if let Some(p) = set(ENV_CONFIG) {
        return Some((PathBuf::from(p), true));
    }
    if let Some(x) = set("XDG_CONFIG_HOME") {
        return Some((Path::new(&x).join("dispatch/config.json"), false));
    }
    set("HOME").map(|h| (Path::new(&h).join(".config/dispatch/config.json"), false))
}

/// Reads a config file; `Ok(None)` when it is absent and was not named
/// explicitly.
pub fn read_config(path: &Path, explicit: bool) -> Result<Option<ConfigFile>, ConfigError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => return Ok(None),
        Err(source) => {
            return Err(ConfigError::Read {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| ConfigError::Parse {
            path: path.to_path_buf(),
            source,
        })
}

/// Resolves the server address from the flag, the environment (through
/// `env`) and the config file.
pub fn resolve_server(
    flag: Option<&str>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Server, ConfigError> {
    let nonempty = |s: String| {
        let t = s.trim().to_string();
        (!t.is_empty()).then_some(t)
    };
    let (raw, source) = if let Some(f) = flag.map(str::to_string).and_then(nonempty) {
        (f, Source::Flag)
    } else if let Some(e) = env(ENV_SERVER).and_then(nonempty) {
        (e, Source::Env)
    } else if let Some((path, explicit)) = config_path(env)
        && let Some(server) = read_config(&path, explicit)?
            .and_then(|c| c.server)
            .and_then(nonempty)
    {
        (server, Source::ConfigFile { path })
    } else {
        (DEFAULT_SERVER.to_string(), Source::Default)
    };
    // Several replicas: URL,URL,... (each normalised; the client finds
    // the leader among them).
    let url = proto::endpoints::parse_list(&raw)
        .iter()
        .map(|u| normalize_url(u))
        .collect::<Result<Vec<_>, _>>()
        .and_then(|urls| {
            if urls.is_empty() {
                Err("no address".to_string())
            } else {
                Ok(urls.join(","))
            }
        })
        .map_err(|why| ConfigError::Address {
            addr: raw.clone(),
            source_name: source.to_string(),
            why,
        })?;
    Ok(Server { url, source })
}

/// Adds `http://` to a bare `host:port` and checks the result is an
/// `http://` or `https://` (TLS, see `--tls-ca`) URL with a host that
/// tonic accepts.
pub fn normalize_url(raw: &str) -> Result<String, String> {
    let url = if raw.contains("://") {
        raw.to_string()
    } else {
        format!("http://{raw}")
    };
    let (scheme, rest) = url.split_once("://").unwrap_or(("", ""));
    if scheme != "http" && scheme != "https" {
        return Err(format!(
            "unsupported scheme {scheme:?}; use http://HOST:PORT or https://HOST:PORT"
        ));
    }
    let authority = rest.split('/').next().unwrap_or("");
    if authority.is_empty() {
        return Err("no host".to_string());
    }
    tonic::transport::Endpoint::from_shared(url.clone()).map_err(|e| e.to_string())?;
    Ok(url.trim_end_matches('/').to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    fn write_config(dir: &Path, body: &str) -> PathBuf {
        let p = dir.join("config.json");
        std::fs::write(&p, body).expect("write config");
        p
    }

    #[test]
    fn precedence() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = write_config(dir.path(), r#"{"server": "http://from-file:1"}"#);
        let cfg_s = cfg.to_string_lossy().to_string();
        let full = env_of(&[(ENV_SERVER, "http://from-env:2"), (ENV_CONFIG, &cfg_s)]);

        let s = resolve_server(Some("http://from-flag:3"), &full).expect("flag");
        assert_eq!(
            (s.url.as_str(), s.source),
            ("http://from-flag:3", Source::Flag)
        );

        let s = resolve_server(None, &full).expect("env");
        assert_eq!(
            (s.url.as_str(), s.source),
            ("http://from-env:2", Source::Env)
        );

        let no_env = env_of(&[(ENV_CONFIG, &cfg_s)]);
        let s = resolve_server(None, &no_env).expect("file");
        assert_eq!(s.url, "http://from-file:1");
        assert_eq!(s.source, Source::ConfigFile { path: cfg.clone() });

        let s = resolve_server(None, &env_of(&[])).expect("default");
        assert_eq!(
            (s.url.as_str(), s.source),
            (DEFAULT_SERVER, Source::Default)
        );
    }

    #[test]
    fn empty_values_fall_through() {
        let s = resolve_server(Some(" "), &env_of(&[(ENV_SERVER, "")])).expect("default");
        assert_eq!(s.source, Source::Default);
    }

    #[test]
    fn home_config_is_found_and_xdg_wins() {
        let home = tempfile::tempdir().expect("tempdir");
        let dir = home.path().join(".config/dispatch");
        std::fs::create_dir_all(&dir).expect("mkdir");
        write_config(&dir, r#"{"server": "home:7", "other": 1}"#);
        let h = home.path().to_string_lossy().to_string();
        let s = resolve_server(None, &env_of(&[("HOME", &h)])).expect("home");
        assert_eq!(s.url, "http://home:7");

        let xdg = tempfile::tempdir().expect("tempdir");
        let xdir = xdg.path().join("dispatch");
        std::fs::create_dir_all(&xdir).expect("mkdir");
        write_config(&xdir, r#"{"server": "http://xdg:8"}"#);
        let x = xdg.path().to_string_lossy().to_string();
        let s =
            resolve_server(None, &env_of(&[("HOME", &h), ("XDG_CONFIG_HOME", &x)])).expect("xdg");
        assert_eq!(s.url, "http://xdg:8");
    }

    #[test]
    fn missing_default_file_is_fine_missing_explicit_file_is_not() {
        let home = tempfile::tempdir().expect("tempdir");
        let h = home.path().to_string_lossy().to_string();
        let s = resolve_server(None, &env_of(&[("HOME", &h)])).expect("default");
        assert_eq!(s.source, Source::Default);

        let missing = home.path().join("nope.json").to_string_lossy().to_string();
        let err = resolve_server(None, &env_of(&[(ENV_CONFIG, &missing)])).unwrap_err();
        assert!(matches!(err, ConfigError::Read { .. }), "{err}");
    }

    #[test]
    fn bad_file_and_bad_address_are_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = write_config(dir.path(), "{not json")
            .to_string_lossy()
            .to_string();
        let err = resolve_server(None, &env_of(&[(ENV_CONFIG, &p)])).unwrap_err();
        assert!(err.to_string().contains("invalid config file"), "{err}");

        // A file without "server" falls through to the default.
        let p = write_config(dir.path(), "{}").to_string_lossy().to_string();
        let s = resolve_server(None, &env_of(&[(ENV_CONFIG, &p)])).expect("default");
        assert_eq!(s.source, Source::Default);

        let err = resolve_server(Some("ftp://x:1"), &env_of(&[])).unwrap_err();
        assert!(err.to_string().contains("unsupported scheme"), "{err}");
        let err = resolve_server(Some("http://"), &env_of(&[])).unwrap_err();
        assert!(err.to_string().contains("--server"), "{err}");
    }

    #[test]
    fn normalization() {
        assert_eq!(
            normalize_url("10.0.0.1:50051").as_deref(),
            Ok("http://10.0.0.1:50051")
        );
        assert_eq!(normalize_url("http://h:1/").as_deref(), Ok("http://h:1"));
        assert_eq!(normalize_url("https://h:1").as_deref(), Ok("https://h:1"));
        assert!(normalize_url("ftp://h:1").is_err());
        assert_eq!(normalize_url("[::1]:5").as_deref(), Ok("http://[::1]:5"));
    }
}

//! Who may call what on the client services (JobService, NodeService):
//! the bearer-token table read from `--tokens FILE`, the three roles and
//! the decision for each call. Agents are not authenticated here but by
//! their client certificate (see [`crate::tls`]); health and reflection
//! stay open.
//!
//! Roles:
//! - `user`: submit jobs (owned by the token's user), and read, watch,
//!   stream the logs of and cancel its *own* jobs. Other users' jobs are
//!   answered exactly like jobs that do not exist (`NOT_FOUND`), so a user
//!   learns nothing about them.
//! - `reader`: read every job and node; no submit, no cancel.
//! - `admin`: everything: submit, cancel any job, drain/cordon/uncordon.
//!
//! Every role may list and read nodes. Without `--tokens` the services
//! are open (the single-machine `--dev` default) and jobs have no owner.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tonic::Status;
use tonic::metadata::MetadataMap;

/// Shortest token accepted in a token file.
pub const MIN_TOKEN_LEN: usize = 16;

/// A caller's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Submits jobs; reads and cancels its own.
    User,
    /// Reads everything; changes nothing.
    Reader,
    /// Everything.
    Admin,
}

impl Role {
    /// The role named `s` (`user`, `reader`, `admin`).
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "user" => Some(Role::User),
            "reader" => Some(Role::Reader),
            "admin" => Some(Role::Admin),
            _ => None,
        }
    }

    /// Its name in token files and messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Reader => "reader",
            Role::Admin => "admin",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An authenticated caller: the user and role its token maps to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The user name (a job's owner).
    pub user: String,
    /// What it may do.
    pub role: Role,
}

/// Why a token file was refused. Line numbers count from 1.
#[derive(Debug, thiserror::Error)]
pub enum TokenFileError {
    /// The file could not be read.
    #[error("cannot read the token file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A line is malformed.
    #[error("{path} line {line}: {why}")]
    Line {
        path: PathBuf,
        line: usize,
        why: String,
    },
    /// No token at all: every call would be refused.
    #[error("{path}: no tokens (want lines of `TOKEN ROLE USER`)")]
    Empty { path: PathBuf },
}

/// The tokens a dispatcher accepts, each mapped to its caller. Kept and
/// looked up by SHA-256 digest, so neither the table nor the time a lookup
/// takes gives away a token's characters.
#[derive(Debug, Clone, Default)]
pub struct TokenTable {
    by_digest: HashMap<[u8; 32], Caller>,
}

fn digest(token: &str) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

impl TokenTable {
    /// Reads a token file: one `TOKEN ROLE USER` per line (fields
    /// separated by whitespace; ROLE is user, reader or admin); blank
    /// lines and lines starting with `#` are ignored.
    pub fn load(path: &Path) -> Result<Self, TokenFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| TokenFileError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses the text of a token file (`path` names it in errors).
    pub fn parse(text: &str, path: &Path) -> Result<Self, TokenFileError> {
        let bad = |line: usize, why: String| TokenFileError::Line {
            path: path.to_path_buf(),
            line,
            why,
        };
        let mut by_digest = HashMap::new();
        let mut first_line = HashMap::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let content = raw.trim();
            if content.is_empty() || content.starts_with('#') {
                continue;
            }
            let fields: Vec<&str> = content.split_whitespace().collect();
            let [token, role, user] = fields[..] else {
                return Err(bad(
                    line,
                    format!("want `TOKEN ROLE USER`, found {} field(s)", fields.len()),
                ));
            };
            if token.len() < MIN_TOKEN_LEN {
                return Err(bad(
                    line,
                    format!(
                        "the token is {} characters, want at least {MIN_TOKEN_LEN}",
                        token.len()
                    ),
                ));
            }
            if !token.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(bad(
                    line,
                    "the token has characters not allowed in a header".into(),
                ));
            }
            let role = Role::parse(role).ok_or_else(|| {
                bad(
                    line,
                    format!("unknown role {role:?} (want user, reader or admin)"),
                )
            })?;
            if !user
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._@-".contains(&b))
            {
                return Err(bad(
                    line,
                    format!("user {user:?}: use letters, digits and . _ @ - only"),
                ));
            }
            if let Some(prev) = first_line.insert(digest(token), line) {
                return Err(bad(line, format!("the token repeats line {prev}'s")));
            }
            by_digest.insert(
                digest(token),
                Caller {
                    user: user.to_string(),
                    role,
                },
            );
        }
        if by_digest.is_empty() {
            return Err(TokenFileError::Empty {
                path: path.to_path_buf(),
            });
        }
        Ok(TokenTable { by_digest })
    }

    /// The caller `token` belongs to.
    pub fn lookup(&self, token: &str) -> Option<&Caller> {
        self.by_digest.get(&digest(token))
    }

    /// How many tokens.
    pub fn len(&self) -> usize {
        self.by_digest.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.by_digest.is_empty()
    }
}

/// What a call does, for the role check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// SubmitJob, SubmitJobs.
    Submit,
    /// GetJob, ListJobs, WatchJobs, StreamLogs.
    ReadJobs,
    /// CancelJob.
    Cancel,
    /// ListNodes, GetNode.
    ReadNodes,
    /// DrainNode, CordonNode, UncordonNode.
    AdminNodes,
}

impl Action {
    fn describe(self) -> &'static str {
        match self {
            Action::Submit => "submitting jobs needs the user or admin role",
            Action::ReadJobs => "reading jobs needs the user, reader or admin role",
            Action::Cancel => "cancelling jobs needs the user (own jobs) or admin role",
            Action::ReadNodes => "reading nodes needs the user, reader or admin role",
            Action::AdminNodes => "draining, cordoning and uncordoning nodes needs the admin role",
        }
    }

    fn allows(self, role: Role) -> bool {
        match self {
            Action::Submit | Action::Cancel => matches!(role, Role::User | Role::Admin),
            Action::ReadJobs | Action::ReadNodes => true,
            Action::AdminNodes => role == Role::Admin,
        }
    }
}

/// Which jobs an allowed call may see or touch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Every job (open dispatcher, reader, admin).
    All,
    /// Only jobs owned by this user (role `user`).
    Own(String),
}

impl Scope {
    /// Whether a job with this owner is in scope.
    pub fn covers(&self, owner: &str) -> bool {
        match self {
            Scope::All => true,
            Scope::Own(user) => user == owner,
        }
    }
}

/// The result of an allowed call's check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The owner new jobs get (empty on an open dispatcher).
    pub owner: String,
    /// Jobs the call may see or touch.
    pub scope: Scope,
}

/// The access policy of the client services: open, or checked against a
/// token table.
#[derive(Debug, Clone, Default)]
pub struct Access {
    tokens: Option<Arc<TokenTable>>,
}

impl Access {
    /// No authentication (the default; `--dev` on one machine).
    pub fn open() -> Self {
        Access { tokens: None }
    }

    /// Every call needs a token from `tokens`.
    pub fn with_tokens(tokens: TokenTable) -> Self {
        Access {
            tokens: Some(Arc::new(tokens)),
        }
    }

    /// Whether calls are checked.
    pub fn is_enforced(&self) -> bool {
        self.tokens.is_some()
    }

    /// Checks a call's `authorization` metadata for `action`:
    /// UNAUTHENTICATED when the token is missing, malformed or unknown,
    /// PERMISSION_DENIED (naming the role needed) when its role may not.
    pub fn check(&self, metadata: &MetadataMap, action: Action) -> Result<Grant, Status> {
        let Some(tokens) = &self.tokens else {
            return Ok(Grant {
                owner: String::new(),
                scope: Scope::All,
            });
        };
        let header = metadata
            .get("authorization")
            .ok_or_else(|| Status::unauthenticated("missing bearer token"))?;
        let token = header
            .to_str()
            .ok()
            .and_then(|h| h.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or_else(|| Status::unauthenticated("authorization: want `Bearer TOKEN`"))?;
        let caller = tokens
            .lookup(token)
            .ok_or_else(|| Status::unauthenticated("unknown bearer token"))?;
        if !action.allows(caller.role) {
            return Err(Status::permission_denied(format!(
                "{}; the token of {} has the {} role",
                action.describe(),
                caller.user,
                caller.role
            )));
        }
        let scope = match (caller.role, action) {
            (Role::User, Action::ReadJobs | Action::Cancel) => Scope::Own(caller.user.clone()),
            _ => Scope::All,
        };
        Ok(Grant {
            owner: caller.user.clone(),
            scope,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "aaaaaaaaaaaaaaaaaaaa";
    const B: &str = "bbbbbbbbbbbbbbbbbbbb";
    const R: &str = "rrrrrrrrrrrrrrrrrrrr";
    const ADM: &str = "dddddddddddddddddddd";

    fn table() -> TokenTable {
        let text = format!(
            "# tokens\n{A} user alice\n\n{B}\tuser  bob\n  {R} reader audit\n{ADM} admin root-ops\n"
        );
        TokenTable::parse(&text, Path::new("tokens")).unwrap()
    }

    fn parse_err(text: &str) -> String {
        TokenTable::parse(text, Path::new("tokens"))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn token_files_parse_with_comments_and_blank_lines() {
        let t = table();
        assert_eq!(t.len(), 4);
        assert_eq!(
            t.lookup(B),
            Some(&Caller {
                user: "bob".into(),
                role: Role::User
            })
        );
        assert_eq!(t.lookup(R).map(|c| c.role), Some(Role::Reader));
        assert_eq!(t.lookup("nope"), None);
    }

    #[test]
    fn bad_lines_are_named_by_line_number() {
        let e = parse_err(&format!("# c\n{A} user alice\n{B} user\n"));
        assert_eq!(e, "tokens line 3: want `TOKEN ROLE USER`, found 2 field(s)");
        let e = parse_err(&format!("\n\n\n{A} root alice\n"));
        assert!(e.starts_with("tokens line 4: unknown role \"root\""), "{e}");
        let e = parse_err("short user alice\n");
        assert!(
            e.starts_with("tokens line 1: the token is 5 characters"),
            "{e}"
        );
        let e = parse_err(&format!("{A} user alice\n{A} admin mallory\n"));
        assert_eq!(e, "tokens line 2: the token repeats line 1's");
        let e = parse_err(&format!("{A} user al/ice\n"));
        assert!(e.starts_with("tokens line 1: user \"al/ice\""), "{e}");
        let e = parse_err(&format!("{A} user alice extra\n"));
        assert!(e.contains("line 1") && e.contains("4 field(s)"), "{e}");
        let e = parse_err("# only a comment\n");
        assert!(e.contains("no tokens"), "{e}");
    }

    fn md(token: Option<&str>) -> MetadataMap {
        let mut m = MetadataMap::new();
        if let Some(t) = token {
            m.insert("authorization", format!("Bearer {t}").parse().unwrap());
        }
        m
    }

    #[test]
    fn open_access_allows_everything_with_no_owner() {
        let g = Access::open().check(&md(None), Action::AdminNodes).unwrap();
        assert_eq!(g.owner, "");
        assert_eq!(g.scope, Scope::All);
    }

    #[test]
    fn tokens_are_required_and_roles_checked() {
        let access = Access::with_tokens(table());
        let e = access.check(&md(None), Action::ReadJobs).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert_eq!(e.message(), "missing bearer token");
        let e = access
            .check(&md(Some("unknown-token-xxxxxx")), Action::ReadJobs)
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let mut basic = MetadataMap::new();
        basic.insert("authorization", "Basic abc".parse().unwrap());
        let e = access.check(&basic, Action::ReadJobs).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);

        let e = access.check(&md(Some(R)), Action::Submit).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(
            e.message().contains("user or admin role"),
            "{}",
            e.message()
        );
        assert!(e.message().contains("reader role"), "{}", e.message());
        let e = access.check(&md(Some(R)), Action::Cancel).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        let e = access.check(&md(Some(A)), Action::AdminNodes).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(e.message().contains("admin role"), "{}", e.message());

        let g = access.check(&md(Some(A)), Action::Submit).unwrap();
        assert_eq!(g.owner, "alice");
        let g = access.check(&md(Some(A)), Action::ReadJobs).unwrap();
        assert_eq!(g.scope, Scope::Own("alice".into()));
        assert!(g.scope.covers("alice") && !g.scope.covers("bob"));
        let g = access.check(&md(Some(R)), Action::ReadJobs).unwrap();
        assert_eq!(g.scope, Scope::All);
        let g = access.check(&md(Some(ADM)), Action::Cancel).unwrap();
        assert_eq!(g.scope, Scope::All);
        assert!(access.check(&md(Some(ADM)), Action::AdminNodes).is_ok());
        assert!(access.check(&md(Some(B)), Action::ReadNodes).is_ok());
    }
}

//! The user map: which local uid:gid runs the jobs of which owner (the
//! dispatcher's authenticated user, `Job.owner`). Read from the agent's
//! `--user-map FILE`, one `OWNER UID:GID` per line; jobs of owners not in
//! the map run as the executor's default `run_as` (nobody when the agent
//! is root). uid 0 is refused unless root is explicitly allowed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Why a user map was refused. Line numbers count from 1.
#[derive(Debug, thiserror::Error)]
pub enum UserMapError {
    /// The file could not be read.
    #[error("cannot read the user map {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A line is malformed or not allowed.
    #[error("{path} line {line}: {why}")]
    Line {
        path: PathBuf,
        line: usize,
        why: String,
    },
}

/// Owner name to local `(uid, gid)`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UserMap {
    by_owner: HashMap<String, (u32, u32)>,
}

impl UserMap {
    /// Reads a user map file (see [`UserMap::parse`]).
    pub fn load(path: &Path, allow_root: bool) -> Result<Self, UserMapError> {
        let text = std::fs::read_to_string(path).map_err(|source| UserMapError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, path, allow_root)
    }

    /// Parses `OWNER UID:GID` lines; blank lines and `#` comments are
    /// ignored; an owner may appear once; uid 0 needs `allow_root`.
    pub fn parse(text: &str, path: &Path, allow_root: bool) -> Result<Self, UserMapError> {
        let bad = |line: usize, why: String| UserMapError::Line {
            path: path.to_path_buf(),
            line,
            why,
        };
        let mut by_owner = HashMap::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let content = raw.trim();
            if content.is_empty() || content.starts_with('#') {
                continue;
            }
            let fields: Vec<&str> = content.split_whitespace().collect();
            let [owner, ids] = fields[..] else {
                return Err(bad(
                    line,
                    format!("want `OWNER UID:GID`, found {} field(s)", fields.len()),
                ));
            };
            let parsed = ids
                .split_once(':')
                .and_then(|(u, g)| Some((u.parse::<u32>().ok()?, g.parse::<u32>().ok()?)));
            let Some((uid, gid)) = parsed else {
                return Err(bad(line, format!("{ids:?}: want UID:GID (numbers)")));
            };
            if (uid == 0 || gid == 0) && !allow_root {
                return Err(bad(
                    line,
                    format!(
                        "owner {owner} maps to uid/gid 0: jobs run as root only with --allow-root"
                    ),
                ));
            }
            if by_owner.insert(owner.to_string(), (uid, gid)).is_some() {
                return Err(bad(line, format!("owner {owner} appears twice")));
            }
        }
        Ok(UserMap { by_owner })
    }

    /// The `(uid, gid)` jobs of `owner` run as, if mapped.
    pub fn lookup(&self, owner: &str) -> Option<(u32, u32)> {
        self.by_owner.get(owner).copied()
    }

    /// How many owners are mapped.
    pub fn len(&self) -> usize {
        self.by_owner.len()
    }

    /// Whether no owner is mapped.
    pub fn is_empty(&self) -> bool {
        self.by_owner.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str, allow_root: bool) -> Result<UserMap, String> {
        UserMap::parse(text, Path::new("users"), allow_root).map_err(|e| e.to_string())
    }

    #[test]
    fn maps_owners_and_skips_comments() {
        let m = parse(
            "# owner uid:gid\nalice 1001:1001\n\n  bob\t1002:100\n",
            false,
        )
        .unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(m.lookup("alice"), Some((1001, 1001)));
        assert_eq!(m.lookup("bob"), Some((1002, 100)));
        assert_eq!(m.lookup("carol"), None);
    }

    #[test]
    fn bad_lines_are_named_by_line_number() {
        assert_eq!(
            parse("alice 1001:1001\nbob\n", false).unwrap_err(),
            "users line 2: want `OWNER UID:GID`, found 1 field(s)"
        );
        assert!(
            parse("alice 1001\n", false)
                .unwrap_err()
                .starts_with("users line 1: \"1001\"")
        );
        assert!(
            parse("alice x:1\n", false)
                .unwrap_err()
                .contains("want UID:GID")
        );
        assert_eq!(
            parse("a 1:1\na 2:2\n", false).unwrap_err(),
            "users line 2: owner a appears twice"
        );
    }

    #[test]
    fn root_needs_allow_root() {
        let e = parse("\nops 0:0\n", false).unwrap_err();
        assert!(
            e.starts_with("users line 2: owner ops maps to uid/gid 0"),
            "{e}"
        );
        assert_eq!(
            parse("ops 0:0\n", true).unwrap().lookup("ops"),
            Some((0, 0))
        );
    }
}

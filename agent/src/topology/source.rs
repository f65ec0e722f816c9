//! Where a [`SysfsReader`](super::SysfsReader) gets its files: this module
//! owns the four file operations topology discovery uses (read a file as
//! text, list a directory, test that a path exists, read a symbolic link)
//! and their two implementations: the real filesystem under the reader's
//! root, and [`SysfsTree`], a tree held in memory.
//!
//! The agent reads the real files. The in-memory tree is for callers that
//! build or transform many trees (the `topology_sysfs` fuzz target builds
//! one per input, where writing them to disk made the fuzzer measure the
//! disk), and for capturing a tree once ([`SysfsTree::load`]). The memory
//! tree answers like the filesystem does, with the same errors (the
//! kernel's errno): a missing path is `ENOENT`, a file used as a directory
//! `ENOTDIR`, a directory read as a file `EISDIR`, `read_link` of a
//! non-link `EINVAL`, a link loop `ELOOP`; links resolve as the kernel resolves them (a
//! `..` after a link leaves the link's target, not the link). A test reads
//! every fixture of `agent/tests/fixtures` both ways and compares.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fs;
use std::io;
use std::ops::Bound;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use nix::errno::Errno;

/// Symbolic links followed in one lookup before giving up, as Linux's
/// `MAXSYMLINKS`.
const MAX_LINKS: usize = 40;

/// One entry of a [`SysfsTree`].
#[derive(Clone, Debug, PartialEq, Eq)]
enum Entry {
    /// A regular file and its bytes.
    File(Vec<u8>),
    /// A directory; its children are the entries below its path.
    Dir,
    /// A symbolic link and its target as written (relative to the link's
    /// directory, or absolute meaning from the tree's root).
    Link(PathBuf),
}

/// A sysfs tree in memory: files, directories and symbolic links at paths
/// relative to the tree's root. Adding an entry creates its missing
/// parent directories; adding at a path that exists replaces that entry.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SysfsTree {
    entries: BTreeMap<PathBuf, Entry>,
}

impl SysfsTree {
    /// An empty tree (its root is an empty directory).
    pub fn new() -> Self {
        Self::default()
    }

    /// Add a file holding `contents` at `path` (relative to the root).
    pub fn file(&mut self, path: impl AsRef<Path>, contents: impl Into<Vec<u8>>) -> &mut Self {
        self.insert(path.as_ref(), Entry::File(contents.into()))
    }

    /// Add an (empty) directory at `path`.
    pub fn dir(&mut self, path: impl AsRef<Path>) -> &mut Self {
        self.insert(path.as_ref(), Entry::Dir)
    }

    /// Add a symbolic link at `path` to `target`: relative to the link's
    /// directory, or absolute meaning from the tree's root (as under
    /// `chroot`).
    pub fn link(&mut self, path: impl AsRef<Path>, target: impl Into<PathBuf>) -> &mut Self {
        self.insert(path.as_ref(), Entry::Link(target.into()))
    }

    /// The number of entries (files, directories and links).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the tree holds nothing but its root.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn insert(&mut self, path: &Path, entry: Entry) -> &mut Self {
        let path = normal(path);
        let mut parent = path.parent();
        while let Some(dir) = parent.filter(|d| !d.as_os_str().is_empty()) {
            self.entries.entry(dir.to_path_buf()).or_insert(Entry::Dir);
            parent = dir.parent();
        }
        if !path.as_os_str().is_empty() {
            self.entries.insert(path, entry);
        }
        self
    }

    /// Capture the tree under `root` from disk. A symbolic link whose
    /// target lies inside `root` is kept as a link; one leading outside
    /// (the x6-2 device fixtures borrow their CPUs from a sibling fixture)
    /// is replaced by what it points to, so the tree stands alone.
    pub fn load(root: &Path) -> io::Result<Self> {
        let mut tree = Self::new();
        let real_root = fs::canonicalize(root)?;
        tree.load_dir(root, &real_root, root, Path::new(""), 0)?;
        Ok(tree)
    }

    fn load_dir(
        &mut self,
        root: &Path,
        real_root: &Path,
        dir: &Path,
        rel: &Path,
        depth: usize,
    ) -> io::Result<()> {
        if depth > MAX_LINKS {
            return Err(errno(Errno::ELOOP));
        }
        if !rel.as_os_str().is_empty() {
            self.dir(rel);
        }
        for entry in fs::read_dir(dir)? {
            let entry = entry?;
            let (path, rel) = (entry.path(), rel.join(entry.file_name()));
            let kind = entry.file_type()?;
            if kind.is_symlink() {
                let inside = fs::canonicalize(&path)
                    .map(|real| real.starts_with(real_root))
                    .unwrap_or(true);
                if inside {
                    let target = fs::read_link(&path)?;
                    // An absolute target into the tree is kept from the
                    // tree's root, as the memory tree reads it.
                    let target = match target
                        .strip_prefix(root)
                        .or_else(|_| target.strip_prefix(real_root))
                    {
                        Ok(below) if target.is_absolute() => Path::new("/").join(below),
                        _ => target,
                    };
                    self.link(&rel, target);
                    continue;
                }
                if fs::metadata(&path)?.is_dir() {
                    self.load_dir(root, real_root, &path, &rel, depth + 1)?;
                } else {
                    self.file(&rel, fs::read(&path)?);
                }
            } else if kind.is_dir() {
                self.load_dir(root, real_root, &path, &rel, depth)?;
            } else {
                self.file(&rel, fs::read(&path)?);
            }
        }
        Ok(())
    }

    /// Resolve `path` (relative to the root) to its entry's physical path,
    /// following links on the way, and the last one when `follow_last`.
    fn resolve<'a>(
        &'a self,
        path: &'a Path,
        follow_last: bool,
    ) -> io::Result<(PathBuf, Option<&'a Entry>)> {
        let mut pending: Vec<Component<'a>> = path.components().rev().collect();
        let mut links = 0;
        let mut at = PathBuf::new();
        let mut entry: Option<&Entry> = None; // None: the root directory
        while let Some(c) = pending.pop() {
            match c {
                Component::CurDir => {}
                Component::RootDir | Component::Prefix(_) => {
                    at.clear();
                    entry = None;
                }
                Component::ParentDir => {
                    if let Some(Entry::File(_)) = entry {
                        return Err(errno(Errno::ENOTDIR));
                    }
                    at.pop();
                    entry = self.entries.get(&at);
                }
                Component::Normal(name) => {
                    match entry {
                        None | Some(Entry::Dir) => {}
                        Some(Entry::File(_)) => return Err(errno(Errno::ENOTDIR)),
                        Some(Entry::Link(_)) => unreachable!("links are followed when met"),
                    }
                    at.push(name);
                    entry = Some(self.entries.get(&at).ok_or_else(|| errno(Errno::ENOENT))?);
                    if let Some(Entry::Link(target)) = entry
                        && (follow_last || !pending.is_empty())
                    {
                        links += 1;
                        if links > MAX_LINKS {
                            return Err(errno(Errno::ELOOP));
                        }
                        if target.as_os_str().is_empty() {
                            return Err(errno(Errno::ENOENT));
                        }
                        at.pop();
                        entry = self.entries.get(&at);
                        pending.extend(target.components().rev());
                    }
                }
            }
        }
        Ok((at, entry))
    }

    fn read_to_string(&self, path: &Path) -> io::Result<String> {
        match self.resolve(path, true)?.1 {
            Some(Entry::File(bytes)) => String::from_utf8(bytes.clone()).map_err(|_| {
                // fs::read_to_string's error for the same bytes.
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    "stream did not contain valid UTF-8",
                )
            }),
            _ => Err(errno(Errno::EISDIR)),
        }
    }

    fn list_dir(&self, path: &Path) -> io::Result<Vec<OsString>> {
        let (at, entry) = self.resolve(path, true)?;
        if let Some(Entry::File(_)) = entry {
            return Err(errno(Errno::ENOTDIR));
        }
        let mut names = Vec::new();
        // Paths order component by component, so a directory's
        // descendants follow it without a gap.
        for (child, _) in self
            .entries
            .range::<PathBuf, _>((Bound::Excluded(&at), Bound::Unbounded))
        {
            let Ok(below) = child.strip_prefix(&at) else {
                break;
            };
            if below.components().count() == 1 {
                names.push(below.as_os_str().to_owned());
            }
        }
        Ok(names)
    }

    fn read_link(&self, path: &Path) -> io::Result<PathBuf> {
        match self.resolve(path, false)?.1 {
            Some(Entry::Link(target)) => Ok(target.clone()),
            _ => Err(errno(Errno::EINVAL)),
        }
    }
}

/// The error the kernel gives for `e`, so a tree in memory fails with the
/// very errors (kind and message) the filesystem gives.
fn errno(e: Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// `path` without `.` components or a leading `/`.
fn normal(path: &Path) -> PathBuf {
    path.components()
        .filter(|c| matches!(c, Component::Normal(_) | Component::ParentDir))
        .collect()
}

/// Where a reader's files come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    /// The filesystem: paths are read as they are.
    Disk,
    /// A tree in memory: paths are taken relative to the reader's root.
    Memory(Arc<SysfsTree>),
}

impl Source {
    fn relative<'a>(root: &Path, path: &'a Path) -> io::Result<&'a Path> {
        path.strip_prefix(root).map_err(|_| errno(Errno::ENOENT))
    }

    /// The file at `path` (under `root`) as text.
    pub(crate) fn read_to_string(&self, root: &Path, path: &Path) -> io::Result<String> {
        match self {
            Source::Disk => fs::read_to_string(path),
            Source::Memory(tree) => tree.read_to_string(Self::relative(root, path)?),
        }
    }

    /// The names in the directory at `path` (under `root`), in no
    /// particular order.
    pub(crate) fn list_dir(&self, root: &Path, path: &Path) -> io::Result<Vec<OsString>> {
        match self {
            Source::Disk => fs::read_dir(path)?
                .map(|entry| entry.map(|e| e.file_name()))
                .collect(),
            Source::Memory(tree) => tree.list_dir(Self::relative(root, path)?),
        }
    }

    /// Whether `path` (under `root`) exists, links followed.
    pub(crate) fn exists(&self, root: &Path, path: &Path) -> bool {
        match self {
            Source::Disk => path.exists(),
            Source::Memory(tree) => {
                Self::relative(root, path).is_ok_and(|rel| tree.resolve(rel, true).is_ok())
            }
        }
    }

    /// The target of the symbolic link at `path` (under `root`).
    pub(crate) fn read_link(&self, root: &Path, path: &Path) -> io::Result<PathBuf> {
        match self {
            Source::Disk => fs::read_link(path),
            Source::Memory(tree) => tree.read_link(Self::relative(root, path)?),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind<T: std::fmt::Debug>(r: io::Result<T>) -> Option<Errno> {
        r.expect_err("an error").raw_os_error().map(Errno::from_raw)
    }

    #[test]
    fn files_dirs_and_links_answer_like_a_filesystem() {
        let mut t = SysfsTree::new();
        t.file("sys/a/x", "1\n")
            .dir("sys/empty")
            .link("sys/l", "a")
            .link("sys/up", "../sys/a/x")
            .link("sys/loop", "loop")
            .link("sys/abs", "/sys/a");
        let p = Path::new;
        assert_eq!(t.read_to_string(p("sys/a/x")).unwrap(), "1\n");
        assert_eq!(t.read_to_string(p("sys/l/x")).unwrap(), "1\n");
        assert_eq!(t.read_to_string(p("sys/up")).unwrap(), "1\n");
        assert_eq!(t.read_to_string(p("sys/abs/x")).unwrap(), "1\n");
        assert_eq!(t.read_to_string(p("sys/./a/../a/x")).unwrap(), "1\n");
        // `..` after a link leaves its target: sys/l/.. is sys, not sys/l.
        assert_eq!(t.read_to_string(p("sys/l/../a/x")).unwrap(), "1\n");
        assert_eq!(kind(t.read_to_string(p("sys/a/y"))), Some(Errno::ENOENT));
        assert_eq!(kind(t.read_to_string(p("sys/a/x/y"))), Some(Errno::ENOTDIR));
        assert_eq!(kind(t.read_to_string(p("sys/a"))), Some(Errno::EISDIR));
        assert_eq!(kind(t.read_to_string(p("sys/loop"))), Some(Errno::ELOOP));
        let mut names = t.list_dir(p("sys")).unwrap();
        names.sort();
        assert_eq!(names, ["a", "abs", "empty", "l", "loop", "up"]);
        assert_eq!(t.list_dir(p("sys/l")).unwrap(), ["x"]);
        assert!(t.list_dir(p("sys/empty")).unwrap().is_empty());
        assert_eq!(t.list_dir(p("")).unwrap(), ["sys"]);
        assert_eq!(kind(t.list_dir(p("sys/a/x"))), Some(Errno::ENOTDIR));
        assert_eq!(kind(t.list_dir(p("nope"))), Some(Errno::ENOENT));
        assert_eq!(t.read_link(p("sys/l")).unwrap(), p("a"));
        assert_eq!(kind(t.read_link(p("sys/a"))), Some(Errno::EINVAL));
        t.file("bad", vec![0xff]);
        let bad = t.read_to_string(p("bad")).expect_err("not UTF-8");
        assert_eq!(bad.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn source_paths_are_taken_under_the_root() {
        let mut t = SysfsTree::new();
        t.file("sys/f", "x");
        let src = Source::Memory(Arc::new(t));
        let root = Path::new("/captured");
        assert_eq!(src.read_to_string(root, &root.join("sys/f")).unwrap(), "x");
        assert!(src.exists(root, &root.join("sys")));
        assert!(!src.exists(root, &root.join("sys/g")));
        assert!(!src.exists(root, Path::new("/sys/f")), "outside the root");
    }
}

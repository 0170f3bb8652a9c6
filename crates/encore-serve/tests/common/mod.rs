//! What the server's test files share: the default model on the CPU, loaded
//! once per process, and an HTTP client with a generous timeout.

#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use encore::{Config, Device};
use encore_llm::{Engine, EngineOptions};

/// `ENCORE_TEST_MODEL`, else the default model (fetched on first use).
pub fn model_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| match std::env::var_os("ENCORE_TEST_MODEL") {
        Some(p) => PathBuf::from(p),
        None => encore_llm::fetch::default_model(|p| eprintln!("{p:?}"))
            .expect("fetch the default model"),
    })
    .clone()
}

/// The model on the CPU, loaded once per test process.
pub fn engine() -> Arc<Engine> {
    static ENGINE: OnceLock<Arc<Engine>> = OnceLock::new();
    ENGINE
        .get_or_init(|| {
            let device = Device::open("cpu", &Config::default()).unwrap();
            Arc::new(Engine::load(model_path(), &device, &EngineOptions::default()).unwrap())
        })
        .clone()
}

/// A client that waits long enough for a CPU model's answers.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap()
}

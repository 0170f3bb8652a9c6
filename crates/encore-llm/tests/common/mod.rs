//! What the real-model tests share: the catalog's models, fetched on first
//! use into the user's cache (as `encore --model NAME` fetches them).

use std::ffi::OsStr;
use std::path::PathBuf;

/// The file of the catalog model `name`, fetched (and verified) on first use.
pub fn catalog_model(name: &str) -> PathBuf {
    encore_llm::fetch::resolve(Some(OsStr::new(name)), |p| eprintln!("{name}: {p:?}"))
        .unwrap_or_else(|e| panic!("fetching {name}: {e}"))
}

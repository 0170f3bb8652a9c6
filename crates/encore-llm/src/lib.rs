//! Llama-family inference on Encore: GGUF files, tokenizer, chat template,
//! model, KV cache, sampler.
//!
//! ```no_run
//! use encore_llm::{Engine, EngineOptions, GenerateOptions};
//! let device = encore::Device::open("cpu", &encore::Config::default())?;
//! let engine = Engine::load("SmolLM2-135M-Instruct.Q4_1.gguf", &device, &EngineOptions::default())?;
//! let out = engine.generate("The capital of France is", &GenerateOptions::greedy(16), |_| true)?;
//! println!("{}", out.text);
//! # Ok::<(), encore_llm::LlmError>(())
//! ```

pub mod batch;
pub mod blocks;
pub mod catalog;
pub mod chat;
pub mod config;
pub mod constraint;
mod engine;
mod error;
pub mod fetch;
pub mod gguf;
pub mod load;
pub mod model;
pub mod moe;
pub mod perplexity;
pub mod sampler;
pub mod scheduler;
pub mod session;
pub mod speculate;
pub mod stepper;
pub mod synthetic;
pub mod tokenizer;
pub mod tools;

pub use config::ModelConfig;
pub use engine::{Engine, EngineOptions, GenerateOptions, Generation, GREEDY_BATCH};
pub use error::{LlmError, Result};
pub use load::LoadProgress;
pub use model::Model;
pub use sampler::{Sampler, SamplerConfig, SamplerError, SamplerField, TokenLogprob};
pub use scheduler::{Event, FinishReason, GenRequest, Scheduler, SchedulerConfig};
pub use session::{Pass, Session};
pub use speculate::Speculation;
pub use stepper::{Step, Stepper, StopReason};

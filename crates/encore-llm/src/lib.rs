//! Llama-family inference on Encore.

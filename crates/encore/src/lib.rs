//! Encore runtime.

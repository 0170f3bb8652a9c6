//! Attention: decode and prefill, grouped-query, windowed.

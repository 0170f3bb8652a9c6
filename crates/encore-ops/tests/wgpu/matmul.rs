//! Matrix products and embedding lookups, every weight type.

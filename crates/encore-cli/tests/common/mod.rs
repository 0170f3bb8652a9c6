//! Checks shared by the CLI test binaries.

/// Checks that `stderr` holds exactly one `error: ` line and that it
/// contains every string of `expected`; `context` is shown on failure.
pub fn assert_one_error_line(stderr: &str, expected: &[&str], context: &str) {
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("error: "))
        .collect();
    assert_eq!(errors.len(), 1, "want one error line\n{context}");
    for want in expected {
        assert!(
            errors[0].contains(want),
            "error line lacks {want:?}\n{context}"
        );
    }
}

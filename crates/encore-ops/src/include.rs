//! Kernel sources assembled from files: a kernel file names the headers it
//! needs with `#include "name"` lines (in WGSL, which has no preprocessor,
//! as `// #include "name"` comments), and [`expand`] puts each header's
//! text in place of its line before the source goes to the runtime, whose
//! kernel key is the whole text.

/// The text of `file`, found in `files` (name and text), with every include
/// line replaced by the named file's text, itself expanded, each header at
/// most once (as `#pragma once` would). A file that does not exist becomes
/// the line `missing(name)` returns, an error the kernel's compiler reports
/// by name.
pub(crate) fn expand(
    files: &[(&str, &'static str)],
    file: &str,
    missing: fn(&str) -> String,
) -> String {
    let mut out = String::new();
    expand_file(files, file, missing, &mut Vec::new(), &mut out);
    out
}

/// Appends `file`'s text to `out`, its includes expanded; `included` holds
/// the headers already in `out`.
fn expand_file(
    files: &[(&str, &'static str)],
    file: &str,
    missing: fn(&str) -> String,
    included: &mut Vec<&'static str>,
    out: &mut String,
) {
    let Some(&(_, text)) = files.iter().find(|(name, _)| *name == file) else {
        out.push_str(&missing(file));
        return;
    };
    for line in text.lines() {
        match included_name(line) {
            Some(header) if included.contains(&header) => {}
            Some(header) => {
                included.push(header);
                expand_file(files, header, missing, included, out);
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
}

/// The file a line `#include "name"` or `// #include "name"` names.
fn included_name(line: &str) -> Option<&str> {
    let line = line.trim();
    let line = line.strip_prefix("//").map_or(line, str::trim_start);
    line.strip_prefix("#include")?
        .trim()
        .strip_prefix('"')?
        .strip_suffix('"')
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILES: &[(&str, &str)] = &[
        ("a.h", "fn a() {}\n"),
        (
            "k.cu",
            "#include \"a.h\"\n  #include \"a.h\"\n// #include \"b.h\"\nbody\n",
        ),
    ];

    /// A header comes once however often it is included, in either
    /// spelling, and an unknown one becomes the error line.
    #[test]
    fn headers_expand_once_and_unknown_ones_become_errors() {
        let out = expand(FILES, "k.cu", |f| format!("#error {f}\n"));
        assert_eq!(out, "fn a() {}\n#error b.h\nbody\n");
        assert_eq!(expand(FILES, "none", |f| format!("no {f}\n")), "no none\n");
    }
}

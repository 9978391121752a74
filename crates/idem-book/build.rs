//! Lists README.md and every Markdown page under docs/ as a module whose documentation is
//! that page, so each Rust block in the guide becomes a doctest of this crate, new pages
//! included without a list to keep up to date.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::{env, fs};

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let root = manifest
        .join("../..")
        .canonicalize()
        .expect("the repository");
    let mut pages = vec![root.join("README.md")];
    markdown_under(&root.join("docs"), &mut pages);
    pages.sort();

    let mut code = String::new();
    for page in &pages {
        println!("cargo::rerun-if-changed={}", page.display());
        let relative = page.strip_prefix(&root).expect("under the repository");
        let module: String = relative
            .with_extension("")
            .to_string_lossy()
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '_'
                }
            })
            .collect();
        writeln!(
            code,
            "#[doc = include_str!({:?})]\nmod {module} {{}}",
            page.display().to_string()
        )
        .expect("writing to a String");
    }
    // A page added or removed changes the directory, not a listed file.
    println!("cargo::rerun-if-changed={}", root.join("docs").display());
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("set by cargo")).join("pages.rs");
    fs::write(out, code).expect("OUT_DIR is writable");
}

fn markdown_under(dir: &Path, pages: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("docs/ is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            markdown_under(&path, pages);
        } else if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
}

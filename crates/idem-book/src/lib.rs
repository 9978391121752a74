//! The Rust code of idem's guide, compiled and run: README.md and every page of the book in
//! `docs/` are doctests of this crate (`cargo test --doc -p idem-book`). A block that is not
//! Rust names its language (`sh`, `text`, `toml`, …) so rustdoc leaves it alone; a Rust block
//! that cannot stand alone hides its set-up in `# ` lines, which mdBook hides too.

#[cfg(doctest)]
mod pages {
    include!(concat!(env!("OUT_DIR"), "/pages.rs"));
}

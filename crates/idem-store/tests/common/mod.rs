//! Support shared by the test files of one backend family.

#[cfg(feature = "postgres")]
pub(crate) mod pg;

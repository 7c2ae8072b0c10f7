//! In-process tests across the layers: fixtures that open a whole
//! controller on a temp dir and drive one layer through it. They sit above
//! every layer (tests/layers.rs), so they may build what they test.

mod engine;
mod host;

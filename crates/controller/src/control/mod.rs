//! # control: how people and tools steer and watch a running controller
//!
//! The admin socket (`rebound status`, `rebound inject`) and the
//! Prometheus metrics endpoint (DESIGN.md, "Controller layers").
//!
//! Imports: the `Controller`, the engine's state, and below. Never `host`.
//!
//! | module | concept |
//! |---|---|
//! | [`admin`] | the admin socket: one request line, one answer |
//! | [`status`] | the text of `rebound status` |
//! | [`http`] | the metrics endpoint (`--metrics`) |

pub mod admin;
pub mod http;
pub mod status;

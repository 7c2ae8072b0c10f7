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
//! | [`report`] | the same content as one JSON object (`rebound status --json`) |
//! | [`health`] | healthy or degraded, and why (status's exit code, systemd's notifications) |
//! | [`http`] | the metrics endpoint (`--metrics`) |

pub mod admin;
pub mod health;
pub mod http;
pub mod report;
pub mod status;

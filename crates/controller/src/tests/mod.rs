//! In-process tests across the layers: fixtures that open a whole
//! controller on a temp dir and drive one layer through it. They sit above
//! every layer (tests/layers.rs), so they may build what they test.

mod admin;
mod client;
mod engine;
mod fuzz_framer;
mod fuzz_handshake;
mod host;
mod http;

/// A small controller's configuration with every file in `dir` (no
/// /dev/shm, no listener started), no scrub.
fn temp_config(dir: &std::path::Path) -> crate::config::Config {
    crate::config::Config {
        data_dir: dir.join("data"),
        nvs: Some(dir.join("nvs")),
        box_path: Some(dir.join("box")),
        volume_size: 16 << 20,
        nvs_size: 72 << 20,
        cache_size: 1 << 20,
        workers: 2,
        scrub_interval: std::time::Duration::ZERO,
        ..crate::config::Config::default()
    }
}

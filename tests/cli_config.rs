//! Bad flags and configuration: `rebound serve` exits non-zero with a
//! message naming the problem, and touches no data.

mod common;

use std::process::Command;

use common::Server;

fn serve(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rebound"))
        .arg("serve")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bad_flag_values_are_refused_with_the_setting_named() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("d");
    let d = d.to_str().unwrap();
    for (args, expect) in [
        (vec!["--volume-size", "1X"], "unknown unit"),
        (vec!["--volume-size", "1000"], "volume_size"),
        (vec!["--policy", "fastest"], "policy"),
        (vec!["--nvs-size", "1M"], "nvs_size"),
        (vec!["--devices", "0"], "devices"),
        (vec!["--connection-threads", "0"], "connection_threads"),
        (vec!["--connection-threads", "65"], "connection_threads"),
        (
            vec!["--listen", "not-an-address"],
            "neither an address:port",
        ),
        (vec!["--listen", "unix:"], "needs a socket path"),
        (vec!["--socket-mode", "0999"], "not an octal file mode"),
        (vec!["--socket-mode", "0400"], "socket_mode"),
        (vec!["--handshake-timeout", "0s"], "handshake_timeout"),
        (vec!["--send-timeout", "2d"], "unknown unit"),
        (vec!["--send-timeout", "10ms"], "send_timeout"),
        (vec!["--idle-timeout", "100ms"], "idle_timeout"),
        (vec!["--reply-budget", "4K"], "reply_budget"),
        (vec!["--max-handshakes", "0"], "max_handshakes"),
        (
            vec!["--max-connections-per-peer", "5000"],
            "max_connections_per_peer",
        ),
        (vec!["--tcp-keepalive", "500ms"], "tcp_keepalive"),
        (vec!["--flush", "sometimes"], "possible values"),
        (vec!["--inject", "crash"], "invalid setting inject"),
        (vec!["--inject", "panic nowhere"], "unknown fault point"),
        (vec!["--inject", ""], "invalid setting inject"),
        (vec!["--output-commit", "sometimes"], "possible values"),
        (vec!["--checkpoint-interval", "5"], "unknown unit"),
        (vec!["--checkpoint-interval", "50us"], "checkpoint_interval"),
        (vec!["--scrub-interval", "10ms"], "scrub_interval"),
        (vec!["--scrub-interval", "2d"], "unknown unit"),
        (vec!["--checkpoint-interval", "11s"], "checkpoint_interval"),
        (vec!["--task-deadline", "500us"], "task_deadline"),
        (vec!["--task-deadline", "2d"], "unknown unit"),
        (vec!["--task-deadline", "2h"], "task_deadline"),
        (vec!["--hung-after", "1s"], "hung_after"),
        (
            vec!["--task-deadline", "0s", "--hung-after", "5s"],
            "hung_after",
        ),
        (
            vec!["--inject", "hang nowhere duration=1s"],
            "unknown fault point",
        ),
    ] {
        let mut all = vec!["--data-dir", d];
        if !args.contains(&"--listen") {
            all.extend(["--listen", "127.0.0.1:0"]);
        }
        all.extend(args.iter());
        let (ok, err) = serve(&all);
        assert!(!ok, "{args:?} accepted");
        assert!(err.contains(expect), "{args:?}: {err}");
    }
    assert!(
        !dir.path().join("d").exists(),
        "a refused configuration created the volume"
    );
}

#[test]
fn bad_output_commit_settings_in_the_file_are_refused_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("rebound.toml");
    for (text, expect) in [
        (
            "output_commit = \"bogus\"\n",
            "unknown output commit scheme",
        ),
        (
            "output_commit = \"Stall\"\n",
            "unknown output commit scheme",
        ),
        ("checkpoint_interval = \"20\"\n", "unknown unit"),
        ("checkpoint_interval = 20\n", "checkpoint_interval"),
    ] {
        std::fs::write(&cfg, text).unwrap();
        let (ok, err) = serve(&["--config", cfg.to_str().unwrap()]);
        assert!(!ok, "{text:?} accepted");
        assert!(err.contains(expect), "{text:?}: {err}");
    }
}

#[test]
fn a_bad_configuration_file_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("rebound.toml");
    std::fs::write(&cfg, "volume_sise = \"1G\"\n").unwrap();
    let (ok, err) = serve(&["--config", cfg.to_str().unwrap()]);
    assert!(!ok);
    assert!(
        err.contains("volume_sise") && err.contains("rebound.toml"),
        "{err}"
    );
    std::fs::write(&cfg, "cache_size = [1, 2\n").unwrap();
    let (ok, err) = serve(&["--config", cfg.to_str().unwrap()]);
    assert!(!ok && err.contains("invalid configuration file"), "{err}");
    let (ok, err) = serve(&[
        "--config",
        dir.path().join("missing.toml").to_str().unwrap(),
    ]);
    assert!(
        !ok && err.contains("cannot read configuration file"),
        "{err}"
    );
}

#[test]
fn reopening_a_volume_with_another_size_or_a_busy_nvs_is_refused() {
    let mut server = Server::start("32M", &[]);
    let data = server.dir.path().join("data");
    let data = data.to_str().unwrap().to_owned();
    let nvs = server.nvs.to_str().unwrap().to_owned();
    // The NVS is held by the running server.
    let (ok, err) = serve(&[
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        &data,
        "--nvs",
        &nvs,
        "--volume-size",
        "32M",
        "--nvs-size",
        "96M",
    ]);
    assert!(
        !ok && err.contains("in use by another rebound process"),
        "{err}"
    );
    assert!(server.stop().success());
    let (ok, err) = serve(&[
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        &data,
        "--nvs",
        &nvs,
        "--volume-size",
        "64M",
        "--nvs-size",
        "96M",
    ]);
    assert!(!ok && err.contains("volume_size"), "{err}");
    // An NVS of another volume is not replayed onto this one.
    let mut other = Server::start("32M", &[]);
    let other_nvs = other.nvs.to_str().unwrap().to_owned();
    assert!(other.stop().success());
    let (ok, err) = serve(&[
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        &data,
        "--nvs",
        &other_nvs,
        "--volume-size",
        "32M",
        "--nvs-size",
        "96M",
    ]);
    assert!(!ok && err.contains("belongs to volume"), "{err}");
}

/// `rebound bench badpath` checks its flags before it starts any server:
/// an unknown faulted group, or a count out of range, is named.
#[cfg(feature = "experiments")]
#[test]
fn bench_badpath_refuses_bad_flags_before_running() {
    refuses_before_running(
        "badpath",
        &[
            (vec!["--groups", "cache,bogus"], "unknown group \"bogus\""),
            (vec!["--rounds", "0"], "--rounds must be within"),
            (vec!["--connections", "65"], "--connections must be within"),
        ],
    );
}

/// Run `rebound bench NAME --quick` with each case's flags: refused, with
/// the expected message, before anything ran (nothing on stdout).
#[cfg(feature = "experiments")]
fn refuses_before_running(name: &str, cases: &[(Vec<&str>, &str)]) {
    let out = std::env::temp_dir().join(format!("rebound-{name}-flags"));
    for (args, expect) in cases {
        let o = Command::new(env!("CARGO_BIN_EXE_rebound"))
            .args(["bench", name, "--quick", "--out"])
            .arg(&out)
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} was accepted");
        assert!(err.contains(expect), "{args:?}: {err}");
        assert!(
            o.stdout.is_empty(),
            "{args:?}: refused only after running: {}",
            String::from_utf8_lossy(&o.stdout)
        );
    }
}

/// `rebound bench output-commit` checks its flags before it starts any
/// server: an unknown row, an interval or a round count out of range, is
/// named.
#[cfg(feature = "experiments")]
#[test]
fn bench_output_commit_refuses_bad_flags_before_running() {
    refuses_before_running(
        "output-commit",
        &[
            (
                vec!["--schemes", "buffering,bogus"],
                "unknown row \"bogus\"",
            ),
            (vec!["--intervals", "0"], "--intervals: 0 ms is outside"),
            (vec!["--intervals", "20,x"], "invalid value"),
            (vec!["--rounds", "0"], "--rounds must be within"),
            (vec!["--rollbacks", "1001"], "--rollbacks must be within"),
            (vec!["--warmup", "3601"], "--warmup must be within"),
            (vec!["--warmup", "-1"], "unexpected argument"),
        ],
    );
}

/// `--help` offers exactly the subcommands this build has: the server's
/// always, `node`/`query` with the `smartstore` feature, `bench`/`demo`
/// with `experiments`.
#[test]
fn help_lists_the_subcommands_of_this_build_only() {
    let out = Command::new(env!("CARGO_BIN_EXE_rebound"))
        .arg("--help")
        .output()
        .expect("running rebound --help");
    let help = String::from_utf8_lossy(&out.stdout);
    let listed = |name: &str| {
        help.lines()
            .any(|l| l.trim_start().starts_with(&format!("{name} ")))
    };
    for (name, built) in [
        ("serve", true),
        ("box", true),
        ("status", true),
        ("inject", true),
        ("node", cfg!(feature = "smartstore")),
        ("query", cfg!(feature = "smartstore")),
        ("bench", cfg!(feature = "experiments")),
        ("demo", cfg!(feature = "experiments")),
    ] {
        assert_eq!(listed(name), built, "{name} in rebound --help:\n{help}");
    }
}

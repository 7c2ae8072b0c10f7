//! The operator's commands: `rebound status --json` and its exit codes,
//! `completions`, `man`, `serve --dump-config` and dist/rebound.toml,
//! `--log-level`/`--log-format`/`--log-file` with SIGHUP, and `reset`.

mod common;

use std::collections::BTreeSet;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{Server, qemu_io, text};

fn rebound(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rebound"))
        .args(args)
        .output()
        .unwrap()
}

fn status(server_admin: &Path, json: bool) -> Output {
    let mut args = vec!["status", "--admin", server_admin.to_str().unwrap()];
    if json {
        args.push("--json");
    }
    rebound(&args)
}

#[test]
fn status_json_has_every_field_and_exit_codes_follow_health() {
    let mut server = Server::start(
        "32M",
        &[
            "--devices",
            "2",
            "--raid",
            "mirror",
            "--rebuild-rate",
            "256K",
        ],
    );
    let admin = server.admin_path();
    let out = status(&admin, true);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["health"]["state"], "healthy", "{v}");
    assert_eq!(v["startup"]["kind"], "fresh");
    assert_eq!(v["volume_size"], 32 << 20);
    assert_eq!(v["volume"]["devices"].as_array().unwrap().len(), 2);
    assert_eq!(v["volume"]["devices"][1]["state"], "online");
    assert_eq!(v["lost_tracks"]["count"], 0);
    assert!(v["nvs"]["fill_ratio"].is_number() && v["nvs"]["slots"].as_u64() > Some(0));
    assert!(!v["groups"].as_array().unwrap().is_empty());
    let rungs = v["recoveries_by_rung"].as_array().unwrap();
    assert_eq!(rungs.len(), 7);
    assert_eq!(rungs[4]["name"], "fast-restart");
    assert!(v["recent_recoveries"].is_array());
    let out = status(&admin, false);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).starts_with("health: healthy\n"),
        "{}",
        text(&out)
    );

    // A lost device (rebuilt slowly): degraded, exit 1, in both forms.
    server.admin("inject lose-device 1").unwrap();
    let out = status(&admin, true);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["health"]["state"], "degraded");
    assert!(
        v["health"]["reasons"][0]
            .as_str()
            .unwrap()
            .contains("device 1"),
        "{v}"
    );
    let out = status(&admin, false);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).starts_with("health: degraded: device 1"),
        "{}",
        text(&out)
    );

    // No server: exit 2, in both forms.
    assert!(server.stop().success());
    for json in [false, true] {
        let out = status(&admin, json);
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        assert!(
            text(&out).contains("cannot reach the admin socket"),
            "{}",
            text(&out)
        );
    }
}

#[test]
fn completions_name_serve_and_its_flags_and_a_bad_shell_is_refused() {
    let out = rebound(&["completions", "bash"]);
    assert!(out.status.success());
    let script = String::from_utf8_lossy(&out.stdout);
    assert!(
        script.contains("serve") && script.contains("--data-dir"),
        "{script}"
    );
    for shell in ["zsh", "fish", "elvish", "powershell"] {
        let out = rebound(&["completions", shell]);
        assert!(out.status.success() && out.stdout.len() > 100, "{shell}");
    }
    let out = rebound(&["completions", "tcsh"]);
    assert!(!out.status.success());
    let err = text(&out);
    assert!(
        err.contains("tcsh") && err.contains("bash") && err.contains("powershell"),
        "{err}"
    );
}

#[test]
fn man_writes_a_roff_page_naming_serve() {
    let out = rebound(&["man"]);
    assert!(out.status.success());
    let page = String::from_utf8_lossy(&out.stdout);
    assert!(
        page.starts_with('.'),
        "not roff: {}",
        &page[..80.min(page.len())]
    );
    assert!(page.contains(".TH rebound 1"), "no header");
    assert!(
        page.contains(".TH rebound-serve 1") && page.contains("data\\-dir"),
        "serve's page"
    );
}

#[test]
fn bad_log_settings_are_refused_naming_the_valid_values() {
    let out = rebound(&["serve", "--log-level", "loud", "--dump-config"]);
    assert!(!out.status.success());
    assert!(
        text(&out).contains("loud") && text(&out).contains("error, warn, info, debug, trace"),
        "{}",
        text(&out)
    );
    let out = rebound(&["serve", "--log-format", "xml", "--dump-config"]);
    assert!(
        !out.status.success() && text(&out).contains("text, json"),
        "{}",
        text(&out)
    );
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(&cfg, "log_level = \"loud\"\n").unwrap();
    let out = rebound(&["serve", "--config", cfg.to_str().unwrap(), "--dump-config"]);
    assert!(
        !out.status.success() && text(&out).contains("loud"),
        "{}",
        text(&out)
    );
}

fn keys(toml_text: &str) -> BTreeSet<String> {
    let table: toml::Table = toml_text.parse().unwrap();
    table.keys().cloned().collect()
}

/// Keys dist/rebound.toml sets, or shows commented out (`# key = ...`).
fn documented_keys(text: &str) -> BTreeSet<String> {
    let mut all = keys(text);
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# ")
            && let Some((key, _)) = rest.split_once(" = ")
            && key.chars().all(|c| c.is_ascii_lowercase() || c == '_')
        {
            all.insert(key.to_owned());
        }
    }
    all
}

#[test]
fn dump_config_prints_the_effective_configuration_without_serving() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d");
    let out = rebound(
        &[
            "serve",
            "--data-dir",
            data.to_str().unwrap(),
            "--volume-size",
            "64M",
            "--log-format",
            "json",
        ]
        .iter()
        .copied()
        .chain(["--dump-config"])
        .collect::<Vec<_>>(),
    );
    assert!(out.status.success(), "{}", text(&out));
    let dumped: toml::Table = String::from_utf8_lossy(&out.stdout).parse().unwrap();
    assert_eq!(dumped["volume_size"].as_str(), Some("64M"));
    assert_eq!(dumped["log_format"].as_str(), Some("json"));
    assert!(
        dumped["nvs"]
            .as_str()
            .unwrap()
            .starts_with("/dev/shm/rebound-"),
        "derived paths written out"
    );
    assert!(!data.exists(), "--dump-config created the volume");
    // The dump is a configuration serve accepts, and prints the same again.
    let cfg = dir.path().join("dumped.toml");
    std::fs::write(&cfg, &out.stdout).unwrap();
    let again = rebound(&["serve", "--config", cfg.to_str().unwrap(), "--dump-config"]);
    assert!(again.status.success(), "{}", text(&again));
    assert_eq!(again.stdout, out.stdout);
}

#[test]
fn dist_rebound_toml_is_accepted_and_names_every_key_dump_config_prints() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("dist/rebound.toml");
    let dist = std::fs::read_to_string(&path).unwrap();
    let out = rebound(&["serve", "--config", path.to_str().unwrap(), "--dump-config"]);
    assert!(
        out.status.success(),
        "dist/rebound.toml refused: {}",
        text(&out)
    );
    let dumped = keys(&String::from_utf8_lossy(&out.stdout));
    let documented = documented_keys(&dist);
    // Keys off by default are absent from the dump; dist shows them commented.
    let off_by_default: BTreeSet<String> = [
        "metrics",
        "trace_tasks",
        "log_file",
        "tls_certificates",
        "tls_psk",
    ]
    .map(String::from)
    .into();
    let missing: Vec<_> = dumped.difference(&documented).collect();
    assert!(missing.is_empty(), "dist/rebound.toml lacks {missing:?}");
    let unknown: Vec<_> = documented
        .difference(&dumped)
        .filter(|k| !off_by_default.contains(*k))
        .collect();
    assert!(
        unknown.is_empty(),
        "--dump-config does not print {unknown:?}"
    );
    // The default values: dist's data_dir aside, the file changes nothing.
    let defaults = rebound(&["serve", "--dump-config"]);
    assert_eq!(
        out.stdout, defaults.stdout,
        "dist/rebound.toml sets a value other than the default"
    );
}

fn wait_for_file(path: &Path, want: &str, limit: Duration) -> String {
    let deadline = Instant::now() + limit;
    loop {
        let t = std::fs::read_to_string(path).unwrap_or_default();
        if t.contains(want) {
            return t;
        }
        assert!(
            Instant::now() < deadline,
            "{} never contained {want:?}:\n{t}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn sighup_reopens_a_log_file_renamed_away_and_the_new_file_gets_the_next_lines() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("rebound.log");
    let mut server = Server::start(
        "32M",
        &["--log-file", log.to_str().unwrap(), "--log-format", "json"],
    );
    wait_for_file(&log, "serving NBD", Duration::from_secs(10));
    let rotated = dir.path().join("rebound.log.1");
    std::fs::rename(&log, &rotated).unwrap();
    let hup = Command::new("kill")
        .args(["-HUP", &server.pid().to_string()])
        .status()
        .unwrap();
    assert!(hup.success());
    let fresh = wait_for_file(&log, "SIGHUP: log file reopened", Duration::from_secs(10));
    assert!(
        fresh.lines().all(|l| l.starts_with('{')),
        "json lines: {fresh}"
    );
    // Later lines land in the new file too (a second SIGHUP logs again).
    let hup = Command::new("kill")
        .args(["-HUP", &server.pid().to_string()])
        .status()
        .unwrap();
    assert!(hup.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read_to_string(&log)
        .unwrap()
        .matches("SIGHUP: log file reopened")
        .count()
        < 2
    {
        assert!(
            Instant::now() < deadline,
            "the second SIGHUP's line did not reach the new file"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let old = std::fs::read_to_string(&rotated).unwrap();
    assert!(
        !old.contains("SIGHUP"),
        "the renamed file got lines after SIGHUP:\n{old}"
    );
    assert!(
        server.log().contains("rebound: serving"),
        "the banner stays on stderr"
    );
    let _ = server.alive();
}

fn reset(args: &[&str]) -> Output {
    let mut all = vec!["reset"];
    all.extend_from_slice(args);
    rebound(&all)
}

#[test]
fn a_deleted_data_dir_with_its_nvs_left_is_refused_and_reset_lets_serve_start_fresh() {
    let mut server = Server::start("32M", &[]);
    qemu_io(
        &["-f", "raw", &server.uri()],
        &["write -P 0xcd 0 64k".into()],
    );
    server.kill9();
    let data = server.dir.path().join("data");
    // Deleting the data directory by hand leaves the NVS: start is refused.
    std::fs::remove_dir_all(&data).unwrap();
    let (ok, err) = server.start_refused();
    assert!(!ok, "a deleted data dir with its old NVS started: {err}");
    // reset removes the NVS and box too; serve then starts a new volume.
    let (nvs, rbox) = (
        server.nvs.to_str().unwrap().to_owned(),
        server.rbox.to_str().unwrap().to_owned(),
    );
    let out = reset(&[
        "--data-dir",
        data.to_str().unwrap(),
        "--nvs",
        &nvs,
        "--box",
        &rbox,
        "--yes",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(!server.nvs.exists() && !server.rbox.exists());
    server.restart();
    assert!(
        server.banner().contains("new volume"),
        "{}",
        server.banner()
    );
    let out = qemu_io(&["-f", "raw", &server.uri()], &["read -P 0 0 64k".into()]);
    assert!(out.contains("read 65536/65536"), "{out}");
    assert!(server.stop().success());
    // And with the data directory intact: every volume file goes.
    let out = reset(&[
        "--data-dir",
        data.to_str().unwrap(),
        "--nvs",
        &nvs,
        "--box",
        &rbox,
        "--yes",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("volume.toml") && text(&out).contains("device0.img"),
        "{}",
        text(&out)
    );
    assert_eq!(
        std::fs::read_dir(&data).unwrap().count(),
        0,
        "files left in the data dir"
    );
    server.restart();
    assert!(
        server.banner().contains("new volume"),
        "{}",
        server.banner()
    );
}

#[test]
fn reset_refuses_a_running_server_and_keeps_its_files() {
    let server = Server::start("32M", &[]);
    let data = server.dir.path().join("data");
    let out = reset(&[
        "--data-dir",
        data.to_str().unwrap(),
        "--nvs",
        server.nvs.to_str().unwrap(),
        "--box",
        server.rbox.to_str().unwrap(),
        "--yes",
    ]);
    assert!(!out.status.success());
    assert!(text(&out).contains("a server is running"), "{}", text(&out));
    assert!(data.join("volume.toml").exists() && server.nvs.exists());
    server.admin("status").unwrap();
}

#[test]
fn reset_refuses_a_directory_that_is_not_a_data_dir_and_asks_before_deleting() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("notes.txt"), "mine").unwrap();
    let out = reset(&["--data-dir", dir.path().to_str().unwrap(), "--yes"]);
    assert!(!out.status.success());
    assert!(
        text(&out).contains("not a rebound data directory"),
        "{}",
        text(&out)
    );
    assert!(dir.path().join("notes.txt").exists());
    let out = reset(&[
        "--data-dir",
        dir.path().join("missing").to_str().unwrap(),
        "--yes",
    ]);
    assert!(
        !out.status.success() && text(&out).contains("nothing to reset"),
        "{}",
        text(&out)
    );
    // Without --yes, an answer other than yes removes nothing.
    let mut server = Server::start("32M", &[]);
    assert!(server.stop().success());
    let data = server.dir.path().join("data");
    let mut child = Command::new(env!("CARGO_BIN_EXE_rebound"))
        .args([
            "reset",
            "--data-dir",
            data.to_str().unwrap(),
            "--nvs",
            server.nvs.to_str().unwrap(),
            "--box",
            server.rbox.to_str().unwrap(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"n\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out).contains("Delete these files?") && text(&out).contains("nothing removed"),
        "{}",
        text(&out)
    );
    assert!(data.join("volume.toml").exists() && server.nvs.exists());
}

/// The policy numbers (field 41 of `/proc/PID/task/TID/stat`) of every
/// thread of `pid`.
fn thread_policies(pid: u32) -> Vec<(String, i32)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let path = entry.unwrap().path();
        let Ok(stat) = std::fs::read_to_string(path.join("stat")) else {
            continue; // the thread ended meanwhile
        };
        let comm = stat[stat.find('(').unwrap() + 1..stat.rfind(')').unwrap()].to_owned();
        let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
        // Fields after the command start at the third (state): policy is
        // the 41st, index 38 here.
        out.push((comm, fields[38].parse().unwrap()));
    }
    out
}

/// The policies of `pid`'s threads once a client is in the transmission
/// phase (its connection's threads started).
fn policies_with_a_client(server: &Server) -> Vec<(String, i32)> {
    let mut client = experiments::nbd_client::NbdClient::connect(&server.addr).unwrap();
    // A request answered: the connection's threads run.
    client.write(0, &[7u8; 4096]).unwrap();
    let mut back = [0u8; 4096];
    client.read(0, &mut back).unwrap();
    assert_eq!(back, [7u8; 4096]);
    let policies = thread_policies(server.pid());
    drop(client);
    policies
}

#[test]
fn connection_threads_run_under_sched_batch_and_the_others_keep_theirs() {
    const SCHED_BATCH: i32 = 3;
    // What the server inherits from this test (SCHED_OTHER unless the
    // tests themselves run under another policy).
    let inherited = controller::sched::thread_policy(0).unwrap();
    let is_connection = |comm: &str| comm.starts_with("nbd-conn-") || comm.starts_with("nbd-send-");
    let mut server = Server::start("64M", &["--output-commit", "buffering"]);
    let policies = policies_with_a_client(&server);
    let (conn, other): (Vec<_>, Vec<_>) = policies.iter().partition(|(c, _)| is_connection(c));
    // A reader per connection thread (4 by default) and the sender.
    assert!(conn.len() >= 2, "{policies:?}");
    assert!(
        conn.iter().all(|(_, p)| *p == SCHED_BATCH),
        "a connection's threads run under SCHED_BATCH by default: {policies:?}"
    );
    assert!(
        other.iter().any(|(c, _)| c == "rebound-epoch")
            && other.iter().all(|(_, p)| *p == inherited),
        "every other thread (the checkpoint thread too) keeps policy {inherited}: {policies:?}"
    );
    server.stop();

    let mut server = Server::start("64M", &["--sched-policy", "inherit"]);
    let policies = policies_with_a_client(&server);
    assert!(
        policies.iter().any(|(c, _)| is_connection(c)),
        "{policies:?}"
    );
    assert!(
        policies.iter().all(|(_, p)| *p == inherited),
        "--sched-policy inherit leaves every thread under policy {inherited}: {policies:?}"
    );
    server.stop();
}

//! The operations files against a live server: every metric the Grafana
//! dashboard (dist/grafana/rebound.json) and the Prometheus alert rules
//! (dist/prometheus/rebound-alerts.yml) name exists in a real `rebound
//! serve --metrics 127.0.0.1:0`'s exposition; the dashboard is valid JSON
//! with the Prometheus data source as a variable; and `promtool` accepts
//! the rules and passes their unit tests where it is installed
//! (scripts/test.sh installs it).

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use common::Server;
use common::raw::{CMD_READ, CMD_WRITE, Raw};

fn dist(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("dist")
        .join(file)
}

/// Every `rebound_...` metric name in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("rebound_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        names.insert(name);
    }
    names
}

/// The sample names and family names of an exposition.
fn exposed(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| match l.strip_prefix("# TYPE ") {
            Some(family) => family.split(' ').next(),
            None if l.starts_with('#') => None,
            None => l.split(['{', ' ']).next(),
        })
        .map(str::to_owned)
        .collect()
}

/// Every string under the key `key` anywhere in `v`.
fn strings_under<'v>(v: &'v serde_json::Value, key: &str, out: &mut Vec<&'v str>) {
    match v {
        serde_json::Value::Object(map) => {
            for (k, child) in map {
                match child {
                    serde_json::Value::String(s) if k == key => out.push(s),
                    _ => strings_under(child, key, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|i| strings_under(i, key, out)),
        _ => {}
    }
}

fn dashboard() -> serde_json::Value {
    let text =
        std::fs::read_to_string(dist("grafana/rebound.json")).expect("reading the dashboard");
    serde_json::from_str(&text).expect("the dashboard is valid JSON")
}

/// The PromQL of the dashboard (panel targets, variable queries) and of
/// the alert rules (their `expr:` lines, comments left out).
fn expressions() -> Vec<String> {
    let d = dashboard();
    let mut exprs = Vec::new();
    strings_under(&d, "expr", &mut exprs);
    strings_under(&d, "definition", &mut exprs);
    let mut all: Vec<String> = exprs.into_iter().map(str::to_owned).collect();
    let rules =
        std::fs::read_to_string(dist("prometheus/rebound-alerts.yml")).expect("reading the rules");
    all.extend(
        rules
            .lines()
            .filter_map(|l| l.trim_start().strip_prefix("expr:"))
            .map(str::to_owned),
    );
    all
}

/// A few writes and reads, so the request histograms hold something.
fn some_io(addr: &str) {
    let mut c = Raw::go(addr);
    for i in 0..4u64 {
        c.request(CMD_WRITE, 0, i, i * 4096, 4096);
        c.send(&[i as u8; 4096]);
        assert_eq!(c.simple_reply(0).1, 0, "write {i}");
        c.request(CMD_READ, 0, 100 + i, i * 4096, 4096);
        let (_, error, data) = c.simple_reply(4096);
        assert_eq!((error, data), (0, vec![i as u8; 4096]), "read {i}");
    }
}

#[test]
fn every_metric_of_the_dashboard_and_the_alerts_is_served() {
    let server = Server::start("64M", &["--metrics", "127.0.0.1:0"]);
    some_io(&server.addr);
    let text = common::scrape(&server.metrics_addr());
    assert!(
        text.contains("application/openmetrics-text"),
        "content type:\n{text}"
    );
    let exposed = exposed(&text);
    let exprs = expressions();
    assert!(exprs.len() > 20, "too few expressions found: {exprs:?}");
    let used: BTreeSet<String> = exprs.iter().flat_map(|e| metric_names(e)).collect();
    for must in [
        "rebound_request_duration_seconds_bucket",
        "rebound_recovery_duration_seconds_bucket",
        "rebound_recoveries_total",
        "rebound_nvs_fill_ratio",
        "rebound_lost_tracks",
        "rebound_volume_devices_degraded",
        "rebound_connections",
    ] {
        assert!(
            used.contains(must),
            "the dashboard and alerts never use {must}"
        );
    }
    let missing: Vec<&String> = used.iter().filter(|n| !exposed.contains(*n)).collect();
    assert!(missing.is_empty(), "not served: {missing:?}\nin:\n{text}");
    assert!(
        common::sample(
            &text,
            "rebound_request_duration_seconds_count{op=\"write\"}"
        ) >= 4.0
            && common::sample(&text, "rebound_request_duration_seconds_count{op=\"read\"}") >= 4.0,
        "{text}"
    );
}

#[test]
fn the_dashboard_takes_its_prometheus_data_source_from_a_variable() {
    let d = dashboard();
    let vars = d["templating"]["list"]
        .as_array()
        .expect("templating variables");
    assert!(
        vars.iter().any(|v| v["type"] == "datasource"
            && v["query"] == "prometheus"
            && v["name"] == "datasource"),
        "no Prometheus data source variable: {vars:?}"
    );
    let panels = d["panels"].as_array().expect("panels");
    let mut titles = Vec::new();
    for p in panels.iter().filter(|p| p["type"] != "row") {
        assert_eq!(
            p["datasource"]["uid"], "${datasource}",
            "panel {}",
            p["title"]
        );
        titles.push(p["title"].as_str().unwrap_or_default().to_lowercase());
    }
    for want in [
        "iops",
        "throughput",
        "latency",
        "recoveries",
        "recovery duration",
        "nvs",
        "cache hit",
        "degraded",
        "rebuild",
        "lost tracks",
        "connections",
    ] {
        assert!(
            titles.iter().any(|t| t.contains(want)),
            "no panel for {want}: {titles:?}"
        );
    }
}

#[test]
fn promtool_accepts_the_alert_rules_and_their_unit_tests() {
    let Some(promtool) = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("promtool"))
            .find(|p| p.is_file())
    }) else {
        // scripts/test.sh installs it (Debian package `prometheus`); CI must have it.
        assert!(
            std::env::var_os("CI").is_none(),
            "promtool is not installed"
        );
        eprintln!("skipped: promtool is not installed (apt-get install prometheus)");
        return;
    };
    let dir = dist("prometheus");
    for args in [
        ["check", "rules", "rebound-alerts.yml"],
        ["test", "rules", "rebound-alerts.test.yml"],
    ] {
        let out = std::process::Command::new(&promtool)
            .args(args)
            .current_dir(&dir)
            .output()
            .expect("running promtool");
        assert!(
            out.status.success(),
            "promtool {}:\n{}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

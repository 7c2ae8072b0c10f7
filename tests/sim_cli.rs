//! `rebound sim rcs` from the command line: the same seed gives the same
//! bytes, every bad flag or trace is refused with a message naming it, and
//! a trace file is replayed.

use std::process::Command;

fn sim(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rebound"))
        .args(["sim", "rcs"])
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const SHORT: &[&str] = &["--cpus", "4", "--duration", "50ms", "--format", "csv"];

#[test]
fn the_same_seed_gives_byte_identical_output_and_another_seed_does_not() {
    let run = |seed: &str| {
        let mut args = SHORT.to_vec();
        args.extend(["--seed", seed, "--fault-rate", "1e-3", "--recovery", "2ms"]);
        let (ok, out, err) = sim(&args);
        assert!(ok, "{err}");
        out
    };
    let a = run("7");
    assert_eq!(a, run("7"));
    assert_ne!(a, run("8"));
    let mut lines = a.lines();
    assert_eq!(
        lines.next(),
        Some("policy,path,cpus,groups,tasks_per_s,mean_latency_us,p99_latency_us")
    );
    // Four policies on the good and the bad path.
    assert_eq!(lines.count(), 8);
}

#[test]
fn bad_flags_are_refused_with_the_flag_named() {
    let dir = tempfile::tempdir().unwrap();
    let garbage = dir.path().join("garbage.trace");
    std::fs::write(&garbage, "not a trace\n").unwrap();
    let bad_line = dir.path().join("bad-line.trace");
    std::fs::write(
        &bad_line,
        "# rebound task trace v1\ngroup,priority,service_ns,count\nhost,urgent,100,1\n",
    )
    .unwrap();
    let missing = dir.path().join("missing.trace");
    let (garbage, bad_line, missing) = (
        garbage.to_str().unwrap(),
        bad_line.to_str().unwrap(),
        missing.to_str().unwrap(),
    );
    for (args, expect) in [
        (vec!["--cpus", "0"], "--cpus"),
        (vec!["--cpus", "5000"], "--cpus"),
        (
            vec!["--workload", "figure9", "--groups", "17"],
            "--groups 17",
        ),
        (vec!["--fault-rate", "2"], "--fault-rate"),
        (vec!["--recovery", "0s"], "--recovery"),
        (vec!["--recovery", "soon"], "not a duration"),
        (vec!["--duration", "1ms"], "--duration"),
        (vec!["--policy", "fastest"], "unknown policy"),
        (vec!["--clients-per-cpu", "0"], "--clients-per-cpu"),
        (vec!["--fault-group", "nosuch"], "--fault-group \"nosuch\""),
        (vec!["--task-us", "0", "--workload", "figure9"], "--task-us"),
        (
            vec!["--task-us", "fast", "--workload", "figure9"],
            "neither a number of microseconds nor `paper`",
        ),
        (
            vec!["--task-us", "paper"],
            "--task-us applies only to --workload figure9",
        ),
        (
            vec![
                "--workload",
                "figure9",
                "--task-us",
                "paper",
                "--fault-group",
                "g4",
            ],
            "cannot be combined with --fault-group",
        ),
        (
            vec![
                "--workload",
                "figure9",
                "--task-us",
                "paper",
                "--cpus",
                "8,0",
            ],
            "--cpus values must be within 1..=4096, not 0",
        ),
        (vec!["--trace", missing], "opening the trace"),
        (vec!["--trace", garbage], "not a rebound task trace"),
        (vec!["--trace", bad_line], "line 3: bad priority"),
    ] {
        let (ok, _, err) = sim(&args);
        assert!(!ok, "{args:?} was accepted");
        assert!(err.contains(expect), "{args:?}: {err}");
    }
}

#[test]
fn a_recorded_trace_is_replayed_with_its_groups() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("small.trace");
    std::fs::write(
        &trace,
        "# rebound task trace v1\ngroup,priority,service_ns,count\n\
         host,high,2000,600\ncache,medium,5000,300\ndevice,low,30000,100\n",
    )
    .unwrap();
    let (ok, out, err) = sim(&[
        "--trace",
        trace.to_str().unwrap(),
        "--cpus",
        "2",
        "--duration",
        "50ms",
        "--policy",
        "dynamic",
    ]);
    assert!(ok, "{err}");
    assert!(
        out.contains("3 groups: host 2.0us, cache 5.0us, device 30.0us; faulty group cache"),
        "{out}"
    );
    assert!(out.contains("dynamic"), "{out}");
}

#[test]
fn task_us_paper_finds_the_length_at_which_performance_loses_what_it_lost_in_the_paper() {
    let (ok, out, err) = sim(&[
        "--workload",
        "figure9",
        "--task-us",
        "paper",
        "--cpus",
        "8",
        "--duration",
        "4s",
        "--policy",
        "performance,dynamic",
    ]);
    assert!(ok, "{err}");
    let line = out
        .lines()
        .find(|l| l.starts_with("--task-us paper: "))
        .unwrap_or_else(|| panic!("no calibration line in {out}"));
    let field = |after: &str, before: &str| -> f64 {
        let rest = &line[line.find(after).unwrap() + after.len()..];
        rest[..rest.find(before).unwrap()].trim().parse().unwrap()
    };
    let us = field("paper: ", " us");
    let kept = field("keeps ", " of its");
    // Paper: 87.8 of 107 KIOps. Faults every 10,000 dispatches of 20 ms
    // each cost far more than that with short tasks and far less with long
    // ones, so a length that lands near it was searched for, not assumed.
    assert!((kept - 87.8 / 107.0).abs() < 0.02, "{line}");
    assert!((5.0..200.0).contains(&us), "{line}");
    // The runs that follow use that length.
    let skew = out
        .split("figure 9 skew, ")
        .nth(1)
        .and_then(|rest| rest.split(" us tasks").next())
        .unwrap_or_else(|| panic!("no workload line in {out}"));
    assert!((skew.parse::<f64>().unwrap() - us).abs() < 0.01, "{out}");
    // And the performance policy's bad path measured there keeps about the
    // same share of its good path.
    let tasks = |policy: &str, path: &str| -> f64 {
        let row = out
            .lines()
            .find(|l| {
                let mut w = l.split_whitespace();
                w.next() == Some(policy) && w.next() == Some(path)
            })
            .unwrap_or_else(|| panic!("no {policy} {path} row in {out}"));
        row.split_whitespace()
            .nth(6)
            .unwrap()
            .replace(',', "")
            .parse()
            .unwrap()
    };
    let ratio = tasks("performance", "bad") / tasks("performance", "good");
    assert!((ratio - 87.8 / 107.0).abs() < 0.03, "{ratio}: {out}");
}

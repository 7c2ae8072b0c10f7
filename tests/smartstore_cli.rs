//! `rebound node` and `rebound query` as a user runs them: node processes
//! on loopback, answers checked against a single-process run, bad flags
//! refused with the setting named.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

fn rebound(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rebound"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The TPC-H Q1 answer at scale factor 0.01 (dbgen's rows).
const Q1_SF001: &str = "\
l_returnflag,l_linestatus,sum_qty,sum_base_price,sum_disc_price,sum_charge,avg_qty,avg_price,avg_disc,count_order
A,F,380456.00,532348211.65,505822441.49,526165934.00,25.58,35785.71,0.05,14876
N,F,8971.00,12384801.37,11798257.21,12282485.06,25.78,35588.51,0.05,348
N,O,742802.00,1041502841.45,989737518.63,1029418531.52,25.45,35691.13,0.05,29181
R,F,381449.00,534594445.35,507996454.41,528524219.36,25.60,35874.01,0.05,14902
";

#[test]
fn query_q1_on_local_node_processes_prints_the_tpch_answer_as_csv() {
    for layout in ["mirror", "parity"] {
        let (ok, out, err) = rebound(&[
            "query", "--sf", "0.01", "--layout", layout, "--format", "csv", "--verify",
        ]);
        assert!(ok, "{layout}: {err}");
        assert_eq!(out, Q1_SF001, "{layout}");
        // The breakdown names every phase, checkpoints included.
        for phase in [
            "scan",
            "checkpoint scan",
            "sort",
            "checkpoint sort",
            "agg-grp-sort",
            "merge",
            "total",
        ] {
            assert!(err.contains(phase), "{layout}: no {phase} in\n{err}");
        }
        assert!(err.contains("verified"), "{err}");
    }
}

/// Node processes given less memory than their share (`--node-memory
/// 96K` against about 570 KB of Scan input a node) stream and spill every
/// primitive and still print the TPC-H answer, checked by `--verify`.
#[test]
fn query_on_nodes_with_less_memory_than_their_share_prints_the_same_answer() {
    let (ok, out, err) = rebound(&[
        "query",
        "--sf",
        "0.01",
        "--node-memory",
        "96K",
        "--format",
        "csv",
        "--verify",
    ]);
    assert!(ok, "{err}");
    assert_eq!(out, Q1_SF001);
    assert!(err.contains("verified"), "{err}");
}

#[test]
fn query_scan_with_a_device_model_returns_the_selected_rows() {
    let (ok, out, err) = rebound(&[
        "query",
        "--sf",
        "0.01",
        "--query",
        "scan",
        "--device-model",
        "mems-g3",
        "--format",
        "csv",
        "--verify",
        "--checkpoint",
        "off",
    ]);
    assert!(ok, "{err}");
    let mut lines = out.lines();
    assert!(
        lines
            .next()
            .unwrap()
            .starts_with("l_orderkey,l_partkey,l_suppkey,l_linenumber,")
    );
    let rows: Vec<&str> = lines.collect();
    assert!(rows.len() > 500, "{} rows", rows.len());
    // Every row shipped in January 1994 (column 11 is l_shipdate).
    assert!(
        rows.iter()
            .all(|r| r.split(',').nth(10).unwrap().starts_with("1994-01-"))
    );
    assert!(err.contains("device model mems-g3"), "{err}");
}

struct NodeProc(Child, String);

impl NodeProc {
    /// A node with `extra` flags, on a loopback port unless they say
    /// `--listen`.
    fn start(dir: &std::path::Path, extra: &[&std::ffi::OsStr]) -> NodeProc {
        let listen: &[&str] = if extra.contains(&"--listen".as_ref()) {
            &[]
        } else {
            &["--listen", "127.0.0.1:0"]
        };
        let mut c = Command::new(env!("CARGO_BIN_EXE_rebound"))
            .args(["node", "--dir"])
            .arg(dir)
            .args(listen)
            .args(extra)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(c.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line.trim().rsplit(' ').next().unwrap().to_string();
        assert!(line.starts_with("smartstore node listening on "), "{line}");
        NodeProc(c, addr)
    }
}

impl Drop for NodeProc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A CA and a certificate for 127.0.0.1 (server and client use, also as
/// the host's client certificate) in `dir`, in the `--tls-certificates`
/// layout (panics when the openssl command is missing: no test is skipped).
fn make_certificates(dir: &std::path::Path) -> bool {
    std::fs::create_dir_all(dir).unwrap();
    let script = r#"set -e
ec="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
openssl req -x509 $ec -keyout ca-key.pem -out ca-cert.pem -days 2 -subj /CN=rebound-test-ca
openssl req $ec -keyout server-key.pem -out server.csr -subj /CN=node
printf 'subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n' > ext
openssl x509 -req -in server.csr -CA ca-cert.pem -CAkey ca-key.pem -CAcreateserial -days 2 -extfile ext -out server-cert.pem
chmod 600 server-key.pem
cp server-cert.pem client-cert.pem && cp -p server-key.pem client-key.pem"#;
    if Command::new("openssl").arg("version").output().is_err() {
        panic!(
            "the openssl command is not installed; scripts/test.sh installs it (package openssl)"
        );
    }
    match Command::new("sh")
        .args(["-c", script])
        .current_dir(dir)
        .output()
    {
        Ok(out) if out.status.success() => true,
        Ok(out) => panic!("openssl: {}", String::from_utf8_lossy(&out.stderr)),
        Err(e) => panic!("sh: {e}"),
    }
}

/// Writes `text` to `path` with mode 0600 (a token or members file).
fn write_private(path: &std::path::Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

#[test]
fn query_runs_on_nodes_given_by_address_and_names_an_unreachable_one() {
    // The secure set-up of the README: a generated token, a members file.
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    let (ok, _, err) = rebound(&["node", "--generate-token", token.to_str().unwrap()]);
    assert!(ok, "{err}");
    let members = dir.path().join("members");
    write_private(&members, "");
    // And mutual TLS where the openssl command can make certificates.
    let certs = dir.path().join("tls");
    let tls = make_certificates(&certs);
    let mut flags = vec![
        "--token-file".as_ref(),
        token.as_os_str(),
        "--members-file".as_ref(),
        members.as_os_str(),
    ];
    if tls {
        flags.extend(["--tls-certificates".as_ref(), certs.as_os_str()]);
        flags.push("--tls-verify-peer".as_ref());
    }
    let nodes: Vec<NodeProc> = (0..5)
        .map(|i| NodeProc::start(&dir.path().join(format!("n{i}")), &flags))
        .collect();
    let addrs: Vec<String> = nodes.iter().map(|n| n.1.clone()).collect();
    write_private(&members, &addrs.join("\n"));
    let list = addrs.join(",");
    let query = |token: Option<&str>| {
        let mut args = vec![
            "query",
            "--sf",
            "0.01",
            "--layout",
            "parity",
            "--format",
            "csv",
            "--node-addrs",
            &list,
        ];
        args.extend(token.iter().flat_map(|t| ["--token-file", *t]));
        if tls {
            args.extend(["--tls-certificates", certs.to_str().unwrap()]);
        }
        rebound(&args)
    };
    // Without the token, the first node refuses the host.
    let (ok, _, err) = query(None);
    assert!(!ok);
    assert!(
        err.contains("main 0") && err.contains("unauthenticated"),
        "{err}"
    );
    let (ok, out, err) = query(Some(token.to_str().unwrap()));
    assert!(ok, "{err}");
    assert_eq!(out, Q1_SF001);
    // Data landed in the given nodes' directories, parity on the fifth.
    assert!(dir.path().join("n0/lineitem.obj").is_file());
    assert!(dir.path().join("n4/lineitem.parity.obj").is_file());

    // The nodes gone: the error names the first it could not reach.
    drop(nodes);
    let (ok, _, err) = query(Some(token.to_str().unwrap()));
    assert!(!ok);
    assert!(
        err.contains("main 0") && err.contains("unreachable"),
        "{err}"
    );
}

#[test]
fn bad_query_and_node_flags_are_refused_with_the_setting_named() {
    for (args, expect) in [
        (vec!["query", "--sf", "0"], "scale factor 0 out of range"),
        (vec!["query", "--sf", "11"], "out of range"),
        (
            vec!["query", "--sf", "abc"],
            "invalid value 'abc' for '--sf",
        ),
        (vec!["query", "--nodes", "1"], "1 data nodes: want 2 to 32"),
        (
            vec!["query", "--layout", "raid6"],
            "possible values: mirror, parity",
        ),
        (vec!["query", "--query", "q6"], "possible values: scan, q1"),
        (vec!["query", "--device-model", "ssd"], "mems-g3"),
        (
            vec!["query", "--format", "json"],
            "possible values: table, csv",
        ),
        (
            vec!["query", "--node-addrs", "127.0.0.1:1,127.0.0.1:2"],
            "2 node addresses given",
        ),
        (vec!["query", "--node-addrs", "nohost"], "node addresses"),
        (
            vec!["node", "--dir", "/proc/forbidden/x"],
            "/proc/forbidden/x",
        ),
        (
            vec!["node", "--dir", "/tmp/x", "--tls-verify-peer"],
            "--tls-certificates",
        ),
        (
            vec!["node", "--dir", "/tmp/x", "--listen", "nowhere"],
            "listening on nowhere",
        ),
    ] {
        let (ok, _, err) = rebound(&args);
        assert!(!ok, "{args:?} succeeded");
        assert!(err.contains(expect), "{args:?}: {err}");
    }
}

#[test]
fn a_node_process_sigkilled_mid_query_is_recovered_by_each_scheme() {
    for (args, query) in [
        (vec!["--fail-node", "1", "--recovery", "spare"], "q1"),
        (vec!["--fail-node", "2", "--recovery", "migrate"], "q1"),
        (
            vec![
                "--fail-node",
                "0",
                "--recovery",
                "redistribute",
                "--fail-at",
                "sort",
            ],
            "q1",
        ),
        (vec!["--fail-node", "3", "--recovery", "parity"], "q1"),
        (
            vec![
                "--fail-node",
                "2",
                "--recovery",
                "parity",
                "--fail-mid-checkpoint",
            ],
            "q1",
        ),
        (
            vec![
                "--fail-node",
                "1",
                "--layout",
                "parity",
                "--fail-mode",
                "unreadable",
            ],
            "scan",
        ),
    ] {
        let mut all = vec![
            "query", "--sf", "0.01", "--format", "csv", "--verify", "--query", query,
        ];
        all.extend(&args);
        let (ok, out, err) = rebound(&all);
        assert!(ok, "{args:?}: {err}");
        if query == "q1" {
            assert_eq!(out, Q1_SF001, "{args:?}");
        }
        assert!(
            err.contains("recovery: detected: node main"),
            "{args:?}: {err}"
        );
        assert!(
            err.contains("(after recovery)") && err.contains("verified"),
            "{args:?}: {err}"
        );
        // Lost mid-checkpoint: that checkpoint is never used.
        assert_eq!(
            err.contains("did not complete: recovering from q1.scan"),
            args.contains(&"--fail-mid-checkpoint"),
            "{args:?}: {err}"
        );
    }
}

/// Every node in a network namespace of its own on a shaped 1 Gbit/s link
/// (real TCP stacks, veths and a bridge): the answer is TPC-H's, a node
/// SIGKILLed mid-query is recovered across the links, the nodes listen on
/// their namespaces' addresses, and nothing of the network outlives the
/// run.
#[test]
fn nodes_on_their_own_network_stacks_answer_and_recover_and_leave_nothing_behind() {
    let namespaces = || -> Vec<String> {
        let out = std::process::Command::new("ip")
            .args(["netns", "list"])
            .output()
            .expect("ip (iproute2)");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.starts_with("rb"))
            .map(String::from)
            .collect()
    };
    let before = namespaces();
    let (ok, out, err) = rebound(&[
        "query",
        "--sf",
        "0.01",
        "--format",
        "csv",
        "--verify",
        "--link",
        "1gbit",
        "--fail-node",
        "1",
        "--recovery",
        "spare",
    ]);
    assert!(ok, "{err}");
    assert_eq!(out, Q1_SF001);
    assert!(err.contains("(after recovery)"), "{err}");
    // Nodes answer on their namespaces' addresses, not on loopback.
    assert!(err.contains("(10.") && !err.contains("127.0.0.1"), "{err}");
    assert_eq!(namespaces(), before, "namespaces left behind");
    let bridges = std::process::Command::new("ip")
        .args(["-o", "link", "show", "type", "bridge"])
        .output()
        .unwrap();
    let left = String::from_utf8_lossy(&bridges.stdout).to_string();
    assert!(
        !left
            .lines()
            .any(|l| l.contains(": rb") && l.contains("br:")),
        "{left}"
    );
}

#[test]
fn fault_flags_that_do_not_fit_are_refused() {
    for (args, expect) in [
        (
            vec![
                "query",
                "--query",
                "scan",
                "--fail-node",
                "1",
                "--recovery",
                "migrate",
            ],
            "Scan recovers with spare or parity",
        ),
        (vec!["query", "--fail-at", "sort"], "--fail-node"),
        (vec!["query", "--fail-node", "7"], "nodes 0 to 3"),
        (
            vec![
                "query",
                "--fail-node",
                "1",
                "--recovery",
                "parity",
                "--layout",
                "mirror",
            ],
            "needs --layout parity",
        ),
        (
            vec!["query", "--fail-node", "1", "--checkpoint", "off"],
            "--checkpoint on",
        ),
        (
            vec![
                "query",
                "--fail-node",
                "1",
                "--fail-at",
                "scan",
                "--fail-mid-checkpoint",
            ],
            "needs a checkpoint in flight",
        ),
        (vec!["query", "--fail-mid-checkpoint"], "--fail-node"),
        (
            vec!["query", "--checkpoint-codec", "gzip"],
            "unknown checkpoint codec \"gzip\"",
        ),
        (vec!["query", "--link", "fast"], "--link \"fast\""),
        (vec!["query", "--link", "1kbit"], "from 64kbit to 400gbit"),
        (
            vec!["query", "--link", "1gbit", "--node-addrs", "a:1"],
            "cannot be used with",
        ),
        (
            vec!["bench", "smartstore", "--quick", "--link", "1gb"],
            "--link \"1gb\"",
        ),
        (
            vec![
                "query",
                "--fail-node",
                "1",
                "--node-addrs",
                "a:1,b:2,c:3,d:4,e:5,f:6,g:7,h:8,i:9",
            ],
            "needs local nodes",
        ),
        (
            vec!["node", "--dir", "/tmp/x", "--memory", "lots"],
            "--memory",
        ),
    ] {
        let (ok, _, err) = rebound(&args);
        assert!(!ok, "{args:?} succeeded");
        assert!(err.contains(expect), "{args:?}: {err}");
    }
}

#[test]
fn memory_flags_that_make_no_sense_are_refused_with_the_flag_named() {
    for (args, expect) in [
        (vec!["node", "--dir", "/tmp/x", "--memory", "0"], "not 0"),
        (vec!["query", "--node-memory", "lots"], "--node-memory"),
        (
            vec!["query", "--node-memory", "0"],
            "--node-memory: a node needs",
        ),
        (
            vec!["query", "--node-memory", "1M", "--node-addrs", "a:1"],
            "cannot be used with",
        ),
        (
            vec!["bench", "smartstore", "--quick", "--node-memory", "1M"],
            "--scale",
        ),
    ] {
        let (ok, _, err) = rebound(&args);
        assert!(!ok, "{args:?} succeeded");
        assert!(err.contains(expect), "{args:?}: {err}");
    }
}

#[test]
fn node_refuses_a_token_file_others_can_read_and_a_public_bind_without_a_token() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    let t = token.to_str().unwrap();
    let (ok, out, err) = rebound(&["node", "--generate-token", t]);
    assert!(ok && out.contains(t), "{err}");
    let mode = std::fs::metadata(&token).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    // Never overwritten.
    let (ok, _, err) = rebound(&["node", "--generate-token", t]);
    assert!(!ok && err.contains("File exists"), "{err}");

    let d = dir.path().join("n");
    let d = d.to_str().unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (ok, _, err) = rebound(&[
        "node",
        "--dir",
        d,
        "--token-file",
        t,
        "--listen",
        "127.0.0.1:0",
    ]);
    assert!(!ok);
    assert!(
        err.contains("--token-file") && err.contains("mode 0644") && err.contains("chmod 600"),
        "{err}"
    );
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();

    // Every address, without a token: refused, saying what to do.
    let (ok, _, err) = rebound(&["node", "--dir", d, "--listen", "0.0.0.0:0"]);
    assert!(!ok);
    assert!(
        err.contains("refusing to listen on 0.0.0.0:")
            && err.contains("--token-file")
            && err.contains("--insecure"),
        "{err}"
    );
    // With the token it serves there.
    let n = NodeProc::start(
        std::path::Path::new(d),
        &[
            "--listen".as_ref(),
            "0.0.0.0:0".as_ref(),
            "--token-file".as_ref(),
            token.as_os_str(),
        ],
    );
    assert!(n.1.starts_with("0.0.0.0:"), "{}", n.1);
}

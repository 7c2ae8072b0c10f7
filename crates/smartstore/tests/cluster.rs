//! A whole cluster of in-process storage nodes at a small scale factor:
//! distributed results equal one DataFusion run over the whole table, and
//! every layout rebuilds any lost node's partition bit-exact.

use smartstore::devmodel::DeviceModel;
use smartstore::host::{Cluster, ClusterSpec, Launcher, Layout, Query, names};
use smartstore::node::RebuildCmd;
use smartstore::tpch;

const SF: f64 = 0.01;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn spec(layout: Layout, spare: bool) -> ClusterSpec {
    ClusterSpec {
        nodes: 4,
        layout,
        spare,
        model: DeviceModel::None,
    }
}

#[test]
fn q1_and_scan_equal_a_single_process_run_for_both_layouts() {
    let rt = rt();
    rt.block_on(async {
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        let want_q1 = tpch::to_csv(&[tpch::q1_single(schema.clone(), batches.clone())
            .await
            .unwrap()])
        .unwrap();
        let want_scan = tpch::to_csv(
            &tpch::scan_single(schema.clone(), batches.clone())
                .await
                .unwrap(),
        )
        .unwrap();
        assert_eq!(want_q1.lines().count(), 5, "{want_q1}");
        assert!(want_scan.lines().count() > 100, "the scan selects rows");
        for layout in [Layout::Mirror, Layout::Parity] {
            let work = tempfile::tempdir().unwrap();
            let mut c = Cluster::launch(spec(layout, false), &Launcher::InProcess, work.path())
                .await
                .unwrap();
            c.place(schema.clone(), &batches).await.unwrap();
            for checkpoint in [true, false] {
                let r = c.run_query(Query::Q1, checkpoint).await.unwrap();
                assert_eq!(
                    tpch::to_csv(&r.result).unwrap(),
                    want_q1,
                    "{layout:?} checkpoint {checkpoint}"
                );
                let names: Vec<&str> = r.phases.iter().map(|p| p.name.as_str()).collect();
                if checkpoint {
                    assert!(names.contains(&"checkpoint sort"), "{names:?}");
                } else {
                    assert!(
                        !names.iter().any(|n| n.starts_with("checkpoint")),
                        "{names:?}"
                    );
                }
            }
            let r = c.run_query(Query::Scan, false).await.unwrap();
            assert_eq!(
                tpch::to_csv(&r.result).unwrap(),
                want_scan,
                "{layout:?} scan"
            );
        }
    });
}

#[test]
fn checkpoints_land_on_the_redundancy_group() {
    let rt = rt();
    rt.block_on(async {
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        for layout in [Layout::Mirror, Layout::Parity] {
            let work = tempfile::tempdir().unwrap();
            let mut c = Cluster::launch(spec(layout, false), &Launcher::InProcess, work.path())
                .await
                .unwrap();
            c.place(schema.clone(), &batches).await.unwrap();
            c.run_query(Query::Q1, true).await.unwrap();
            for obj in &names::Q1_OUT[..2] {
                match layout {
                    Layout::Mirror => {
                        for (i, m) in c.mirror.iter_mut().enumerate() {
                            let copy = m.get_object(&names::ckpt(obj)).await.unwrap();
                            let orig = c.main[i].get_object(obj).await.unwrap();
                            assert_eq!(copy, orig, "mirror {i} holds main {i}'s {obj}");
                        }
                    }
                    Layout::Parity => {
                        let p = c
                            .parity
                            .as_mut()
                            .unwrap()
                            .get_object(&names::parity(obj))
                            .await
                            .unwrap();
                        assert!(!p.is_empty());
                    }
                }
            }
        }
    });
}

#[test]
fn any_single_main_node_is_rebuilt_bit_exact_on_the_spare_for_each_layout() {
    let rt = rt();
    rt.block_on(async {
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        for layout in [Layout::Mirror, Layout::Parity] {
            let work = tempfile::tempdir().unwrap();
            let mut c = Cluster::launch(spec(layout, true), &Launcher::InProcess, work.path())
                .await
                .unwrap();
            c.place(schema.clone(), &batches).await.unwrap();
            c.run_query(Query::Q1, true).await.unwrap();
            for lost in 0..4 {
                // The base partition, and the last checkpointed primitive output.
                for obj in [names::LINEITEM, names::Q1_OUT[1]] {
                    let orig = c.main[lost].get_object(obj).await.unwrap();
                    let cmd = match (layout, obj) {
                        (Layout::Mirror, names::LINEITEM) => RebuildCmd::MirrorColumns {
                            sources: c.mirror.iter().map(|m| m.addr().to_string()).collect(),
                            cols_object: names::LINEITEM_COLS.into(),
                            member: lost,
                            name: format!("rebuilt.{lost}.{obj}"),
                        },
                        (Layout::Mirror, _) => RebuildCmd::Copy {
                            source: c.mirror[lost].addr().to_string(),
                            object: names::ckpt(obj),
                            name: format!("rebuilt.{lost}.{obj}"),
                        },
                        (Layout::Parity, _) => RebuildCmd::Parity {
                            parity: (
                                c.parity.as_ref().unwrap().addr().to_string(),
                                names::parity(obj),
                            ),
                            survivors: (0..4)
                                .filter(|&i| i != lost)
                                .map(|i| (i, c.main[i].addr().to_string(), obj.to_string()))
                                .collect(),
                            member: lost,
                            name: format!("rebuilt.{lost}.{obj}"),
                        },
                    };
                    let spare = c.spare.as_mut().unwrap();
                    spare.rebuild(&cmd).await.unwrap();
                    let rebuilt = spare
                        .get_object(&format!("rebuilt.{lost}.{obj}"))
                        .await
                        .unwrap();
                    assert!(
                        rebuilt == orig,
                        "{layout:?}: main {lost}'s {obj} rebuilt differs ({} vs {} bytes)",
                        rebuilt.len(),
                        orig.len()
                    );
                }
            }
        }
    });
}

#[test]
fn a_damaged_column_is_an_error_naming_the_node_and_file_for_every_query_that_reads_it() {
    let rt = rt();
    rt.block_on(async {
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        let work = tempfile::tempdir().unwrap();
        let mut c = Cluster::launch(
            spec(Layout::Mirror, false),
            &Launcher::InProcess,
            work.path(),
        )
        .await
        .unwrap();
        c.place(schema.clone(), &batches).await.unwrap();
        // A scan leaves its output, not the partition, in the nodes' memory.
        c.run_query(Query::Scan, false).await.unwrap();
        let want = tpch::to_csv(&c.run_query(Query::Q1, false).await.unwrap().result).unwrap();
        let path = c.dirs[2].join("lineitem.obj");
        let good = std::fs::read(&path).unwrap();
        let flip_in = |column: &str| {
            let (at, len) = column_segment(&good, schema.index_of(column).unwrap());
            let mut bad = good.clone();
            bad[at + len / 2] ^= 1;
            std::fs::write(&path, &bad).unwrap();
        };
        // A column Q1 reads: an error, never an answer.
        flip_in("l_extendedprice");
        let e = c.run_query(Query::Q1, false).await.unwrap_err().to_string();
        assert!(
            e.contains("main 2") && e.contains("lineitem.obj") && e.contains("checksum"),
            "{e}"
        );
        // A column Q1 does not read: Q1's answer is unchanged, and the
        // Scan, which reads every column, refuses the partition.
        flip_in("l_comment");
        let got = c.run_query(Query::Q1, false).await.unwrap().result;
        assert_eq!(tpch::to_csv(&got).unwrap(), want);
        let e = c
            .run_query(Query::Scan, false)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("main 2") && e.contains("checksum"), "{e}");
    });
}

/// File offset and length of column `index`'s segment in a table object
/// file (object header, then the directory of `smartstore::columnar`).
fn column_segment(file: &[u8], index: usize) -> (usize, usize) {
    let header = smartstore::object::HEADER_LEN;
    let entry = header + 8 + 24 * (index + 1);
    let word = |at: usize| u64::from_le_bytes(file[at..at + 8].try_into().unwrap()) as usize;
    (header + word(entry), word(entry + 8))
}

/// Four live in-process nodes, with `other` inserted at `at` in the
/// address list (a fifth "node" that is dead or misbehaving).
fn four_nodes_and(
    dir: &std::path::Path,
    at: usize,
    other: &str,
) -> (Vec<smartstore::node::InProcessNode>, Vec<String>) {
    let live: Vec<_> = (0..4)
        .map(|i| {
            smartstore::node::InProcessNode::start(&dir.join(i.to_string()), DeviceModel::None)
                .unwrap()
        })
        .collect();
    let mut addrs: Vec<String> = live.iter().map(|n| n.addr.clone()).collect();
    addrs.insert(at, other.to_string());
    (live, addrs)
}

#[test]
fn an_unreachable_node_is_named() {
    let rt = rt();
    rt.block_on(async {
        // A port nothing listens on.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let dead = l.local_addr().unwrap().to_string();
        drop(l);
        let work = tempfile::tempdir().unwrap();
        let (_live, addrs) = four_nodes_and(work.path(), 2, &dead);
        let e = Cluster::connect(spec(Layout::Parity, false), &addrs)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("main 2") && e.contains(&dead) && e.contains("unreachable"),
            "{e}"
        );
        let e = Cluster::connect(spec(Layout::Parity, false), &addrs[..3])
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("3 node addresses given") && e.contains("parity"),
            "{e}"
        );
    });
}

#[test]
fn malformed_plan_fragments_and_tickets_are_refused_by_the_node() {
    let rt = rt();
    rt.block_on(async {
        let work = tempfile::tempdir().unwrap();
        let n = smartstore::node::InProcessNode::start(work.path(), DeviceModel::None).unwrap();
        let mut c = smartstore::client::NodeClient::connect(&n.addr, "main 0").await.unwrap();
        let cases: &[(&str, &[u8], &str)] = &[
            ("run", b"not json", "plan fragment: malformed"),
            ("run", br#"{"input":"lineitem","output":"x","primitive":{"op":"explode"}}"#, "explode"),
            ("run", br#"{"input":"missing","output":"x","primitive":{"op":"sort","keys":[{"column":"a"}]}}"#, "missing.obj"),
            ("checkpoint", b"{}", "malformed checkpoint"),
            ("rebuild", br#"{"copy":{}}"#, "malformed rebuild"),
            ("format-disk", b"", "unknown action"),
        ];
        for (kind, body, want) in cases {
            let e = c.action(kind, body.to_vec()).await.unwrap_err().to_string();
            assert!(e.contains("main 0") && e.contains(want), "{kind}: {e}");
        }
        // A fragment naming a column the partition lacks.
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        c.put_table("lineitem", schema, batches[..1].to_vec()).await.unwrap();
        let body = br#"{"input":"lineitem","output":"x","primitive":{"op":"sort","keys":[{"column":"l_nope"}]}}"#;
        let e = c.action("run", body.to_vec()).await.unwrap_err().to_string();
        assert!(e.contains("unknown column \"l_nope\""), "{e}");
        // The node still serves.
        c.ping().await.unwrap();
    });
}

/// Every scheme and scenario of the paper's section 4 (and the other fault
/// points): a main node lost mid-query, the query completes with exactly
/// the failure-free answer, and the phases show the loss and the recovery.
#[test]
fn every_scheme_recovers_a_node_lost_mid_query_with_the_failure_free_answer() {
    use smartstore::recovery::{FailMode, Fault, Scheme};
    let rt = rt();
    rt.block_on(async {
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        let want_q1 = tpch::to_csv(&[tpch::q1_single(schema.clone(), batches.clone())
            .await
            .unwrap()])
        .unwrap();
        let want_scan = tpch::to_csv(
            &tpch::scan_single(schema.clone(), batches.clone())
                .await
                .unwrap(),
        )
        .unwrap();
        let cases = [
            // (query, scheme, fail at, lost node, mode)
            (Query::Scan, Scheme::Spare, 0, 1, FailMode::Kill),
            (Query::Scan, Scheme::Parity, 0, 2, FailMode::Kill),
            (Query::Q1, Scheme::Spare, 2, 1, FailMode::Kill),
            (Query::Q1, Scheme::Migrate, 2, 1, FailMode::Kill),
            (Query::Q1, Scheme::Redistribute, 2, 1, FailMode::Kill),
            (Query::Q1, Scheme::Parity, 2, 1, FailMode::Kill),
            (Query::Q1, Scheme::Spare, 0, 3, FailMode::Kill),
            (Query::Q1, Scheme::Parity, 1, 0, FailMode::Kill),
            (Query::Q1, Scheme::Redistribute, 1, 2, FailMode::Kill),
            (Query::Q1, Scheme::Migrate, 2, 0, FailMode::Unreadable),
            (Query::Scan, Scheme::Parity, 0, 3, FailMode::Unreadable),
        ];
        for (query, scheme, at, node, mode) in cases {
            let what = format!("{query:?} {scheme:?} at {at} node {node} {mode:?}");
            let work = tempfile::tempdir().unwrap();
            let spec = ClusterSpec {
                nodes: 4,
                layout: scheme.layout(),
                spare: scheme.needs_spare(),
                model: DeviceModel::None,
            };
            let mut c = Cluster::launch(spec, &Launcher::InProcess, work.path())
                .await
                .unwrap();
            c.place(schema.clone(), &batches).await.unwrap();
            let fault = Fault {
                node,
                at,
                mode,
                scheme,
            };
            let r = c
                .run_query_with(query, true, Some(fault))
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let want = if query == Query::Q1 {
                &want_q1
            } else {
                &want_scan
            };
            assert_eq!(&tpch::to_csv(&r.result).unwrap(), want, "{what}");
            let names: Vec<&str> = r.phases.iter().map(|p| p.name.as_str()).collect();
            assert!(
                names.iter().any(|n| n.ends_with("(node lost)")),
                "{what}: {names:?}"
            );
            assert!(names.contains(&"recovery"), "{what}: {names:?}");
            // Q1 never restarts from the beginning: primitives before the
            // fault point run once.
            if query == Query::Q1 {
                let scans = names.iter().filter(|n| n.starts_with("scan")).count();
                assert_eq!(scans, if at == 0 { 2 } else { 1 }, "{what}: {names:?}");
            }
        }
    });
}

#[test]
fn a_second_unplanned_loss_is_an_error_not_a_wrong_answer() {
    use smartstore::recovery::{FailMode, Fault, Scheme};
    let rt = rt();
    rt.block_on(async {
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        let work = tempfile::tempdir().unwrap();
        let mut c = Cluster::launch(
            spec(Layout::Mirror, true),
            &Launcher::InProcess,
            work.path(),
        )
        .await
        .unwrap();
        c.place(schema, &batches).await.unwrap();
        // Main 2 is lost before the query without any fault planned.
        c.fail_node(2, FailMode::Kill).unwrap();
        let e = c.run_query(Query::Q1, true).await.unwrap_err();
        assert!(e.is_node_lost() && e.to_string().contains("main 2"), "{e}");
        // And with a plan for main 1, losing main 2 as well is refused.
        let fault = Fault {
            node: 1,
            at: 2,
            mode: FailMode::Kill,
            scheme: Scheme::Spare,
        };
        let e = c
            .run_query_with(Query::Q1, true, Some(fault))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("main 2"), "{e}");
    });
}

#[test]
fn a_misbehaving_node_that_speaks_no_flight_is_named() {
    use std::io::Write;
    // A "node" that accepts connections and answers garbage.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let bad = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for mut s in l.incoming().flatten() {
            let _ = s.write_all(b"HTTP/1.0 500 nope\r\n\r\n");
        }
    });
    let rt = rt();
    rt.block_on(async {
        let work = tempfile::tempdir().unwrap();
        let (_live, addrs) = four_nodes_and(work.path(), 1, &bad);
        let e = Cluster::connect(spec(Layout::Parity, false), &addrs)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("main 1") && e.contains(&bad), "{e}");
    });
}

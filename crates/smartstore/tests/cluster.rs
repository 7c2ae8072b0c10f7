//! A whole cluster of in-process storage nodes at a small scale factor:
//! distributed results equal one DataFusion run over the whole table, and
//! every layout rebuilds any lost node's partition bit-exact.

use arrow::record_batch::RecordBatch;
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
        memory: smartstore::host::DEFAULT_NODE_MEMORY,
    }
}

/// Q1's and the Scan's answers over the whole table in one process, as
/// CSV.
async fn answers(
    schema: &arrow::datatypes::SchemaRef,
    batches: &[arrow::record_batch::RecordBatch],
) -> (String, String) {
    let q1 = tpch::q1_single(schema.clone(), batches.to_vec())
        .await
        .unwrap();
    let scan = tpch::scan_single(schema.clone(), batches.to_vec())
        .await
        .unwrap();
    (tpch::to_csv(&[q1]).unwrap(), tpch::to_csv(&scan).unwrap())
}

/// A cluster of in-process nodes for `spec`, its files under `work`.
async fn launch(spec: ClusterSpec, work: &std::path::Path) -> Cluster {
    Cluster::launch(spec, &Launcher::InProcess, work)
        .await
        .unwrap()
}

#[test]
fn q1_and_scan_equal_a_single_process_run_for_both_layouts() {
    let rt = rt();
    rt.block_on(async {
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        let (want_q1, want_scan) = answers(&schema, &batches).await;
        assert_eq!(want_q1.lines().count(), 5, "{want_q1}");
        assert!(want_scan.lines().count() > 100, "the scan selects rows");
        for layout in [Layout::Mirror, Layout::Parity] {
            let work = tempfile::tempdir().unwrap();
            let mut c = launch(spec(layout, false), work.path()).await;
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

/// Without checkpoints Q1's Sort is deferred into the aggregation (which
/// ignores order): it sorts no row where it stands. With
/// `Cluster::materialise` every primitive runs where the paper's plan puts
/// it, as under checkpoints, and nothing is checkpointed: the Sort sorts
/// every row the Scan selected, no checkpoint phase runs, no node writes an
/// output object, and the answer is the same. A checkpointed query after
/// it still checkpoints.
#[test]
fn materialise_runs_the_papers_plan_without_checkpointing_and_answers_the_same() {
    let rt = rt();
    rt.block_on(async {
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        let (want_q1, _) = answers(&schema, &batches).await;
        let work = tempfile::tempdir().unwrap();
        let mut c = launch(spec(Layout::Mirror, false), work.path()).await;
        c.place(schema.clone(), &batches).await.unwrap();
        let rows = |r: &smartstore::host::QueryReport, i: usize| r.phases[i].rows;

        let deferred = c.run_query(Query::Q1, false).await.unwrap();
        assert_eq!(tpch::to_csv(&deferred.result).unwrap(), want_q1);
        assert_eq!(rows(&deferred, 1), 0, "the Sort deferred");

        c.materialise = true;
        let planned = c.run_query(Query::Q1, false).await.unwrap();
        assert_eq!(tpch::to_csv(&planned.result).unwrap(), want_q1);
        let scanned = rows(&planned, 0);
        // Q1's Scan keeps the lineitems shipped by 1998-09-02: nearly all.
        assert!(
            scanned > batches.iter().map(|b| b.num_rows() as u64).sum::<u64>() * 9 / 10,
            "{scanned}"
        );
        assert_eq!(rows(&planned, 1), scanned, "the Sort sorts every row");
        assert!(
            !planned
                .phases
                .iter()
                .any(|p| p.name.starts_with("checkpoint")),
            "{:?}",
            planned.phases.iter().map(|p| &p.name).collect::<Vec<_>>()
        );
        for d in &c.dirs {
            for out in names::Q1_OUT {
                let object = d.join(format!("{out}.obj"));
                assert!(!object.exists(), "{}", object.display());
            }
        }

        let checkpointed = c.run_query(Query::Q1, true).await.unwrap();
        assert_eq!(tpch::to_csv(&checkpointed.result).unwrap(), want_q1);
        assert!(
            checkpointed
                .phases
                .iter()
                .any(|p| p.name == "checkpoint sort"),
        );
        c.shutdown();
    });
}

#[test]
fn checkpoints_land_on_the_redundancy_group() {
    let rt = rt();
    rt.block_on(async {
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        for layout in [Layout::Mirror, Layout::Parity] {
            let work = tempfile::tempdir().unwrap();
            let mut c = launch(spec(layout, false), work.path()).await;
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
            let mut c = launch(spec(layout, true), work.path()).await;
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

/// Section 4.2 with checkpoints off the critical path: in every codec,
/// each primitive's checkpoint runs behind the next one, the answer is the
/// failure-free one, and what the mirror holds decodes to exactly the
/// output it protects; every codec but plain ships fewer bytes than the
/// output holds in memory.
#[test]
fn checkpoints_in_every_codec_run_behind_the_next_primitive_and_decode_to_its_output() {
    use arrow::compute::concat_batches;
    use smartstore::codec::Codec;
    let rt = rt();
    rt.block_on(async {
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        let want = tpch::to_csv(&[tpch::q1_single(schema.clone(), batches.clone())
            .await
            .unwrap()])
        .unwrap();
        let work = tempfile::tempdir().unwrap();
        let mut c = launch(spec(Layout::Mirror, false), work.path()).await;
        c.place(schema.clone(), &batches).await.unwrap();
        for codec in Codec::ALL {
            c.codec = codec;
            let r = c.run_query(Query::Q1, true).await.unwrap();
            assert_eq!(tpch::to_csv(&r.result).unwrap(), want, "{codec:?}");
            let behind: Vec<&str> = r.background().map(|p| p.name.as_str()).collect();
            assert_eq!(behind, ["checkpoint scan", "checkpoint sort"], "{codec:?}");
            assert!(
                !r.critical_path().any(|p| p.name.starts_with("checkpoint")),
                "{codec:?}: no checkpoint on the critical path"
            );
            assert!(r.settled_s >= r.wall_s(), "{codec:?}");
            let cost = r.checkpoint_cost();
            assert!(
                cost.raw_bytes > 0 && cost.sent_bytes > 0,
                "{codec:?}: {cost:?}"
            );
            if codec == Codec::Plain {
                assert!(cost.sent_bytes >= cost.raw_bytes, "{codec:?}: {cost:?}");
            } else {
                assert!(2 * cost.sent_bytes < cost.raw_bytes, "{codec:?}: {cost:?}");
            }
            for obj in &names::Q1_OUT[..2] {
                for i in 0..4 {
                    let (s, copy) = c.mirror[i]
                        .get_table(&names::ckpt(obj), None, None)
                        .await
                        .unwrap();
                    let (s0, orig) = c.main[i].get_table(obj, None, None).await.unwrap();
                    assert_eq!(s.fields(), s0.fields(), "{codec:?} {obj} {i}");
                    assert_eq!(
                        concat_batches(&s, &copy).unwrap(),
                        concat_batches(&s0, &orig).unwrap(),
                        "{codec:?}: mirror {i}'s checkpoint of {obj}"
                    );
                }
            }
        }
    });
}

/// A parity fold a lost member left unfinished belongs to its run: a
/// member of the next run starts a fresh fold instead of completing the
/// old one with mixed data.
#[test]
fn a_parity_fold_left_unfinished_never_mixes_with_the_next_runs_members() {
    use smartstore::client::NodeClient;
    use smartstore::node::PutCmd;
    use smartstore::redundancy::ParityBlock;
    let rt = rt();
    rt.block_on(async {
        let work = tempfile::tempdir().unwrap();
        let node =
            smartstore::node::InProcessNode::start(&work.path().join("p"), DeviceModel::None)
                .unwrap();
        let mut c = NodeClient::connect(&node.addr, "parity").await.unwrap();
        let add = |member, epoch| PutCmd::ParityAdd {
            name: "x.parity".into(),
            member,
            members: 2,
            epoch,
        };
        // Run 1: member 0 arrives, member 1 is lost.
        c.put_raw(&add(0, 1), vec![0xAA; 300]).await.unwrap();
        // Run 2: member 1 first, then member 0.
        let (a, b) = (vec![0x0F; 200], vec![0x33; 300]);
        c.put_raw(&add(1, 2), b.clone()).await.unwrap();
        assert!(
            c.get_object("x.parity").await.is_err(),
            "one member of run 2 completes nothing"
        );
        c.put_raw(&add(0, 2), a.clone()).await.unwrap();
        let mut want = ParityBlock::new(2);
        want.add(0, &a);
        want.add(1, &b);
        let want = smartstore::object::encode(smartstore::object::Kind::Raw, &want.to_bytes());
        assert_eq!(c.get_object("x.parity").await.unwrap(), want);
        // A member repeated within one run is still refused.
        c.put_raw(&add(0, 3), a.clone()).await.unwrap();
        let e = c.put_raw(&add(0, 3), a).await.unwrap_err().to_string();
        assert!(e.contains("repeated"), "{e}");
    });
}

#[test]
fn a_damaged_column_is_an_error_naming_the_node_and_file_for_every_query_that_reads_it() {
    let rt = rt();
    rt.block_on(async {
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        let work = tempfile::tempdir().unwrap();
        let mut c = launch(spec(Layout::Mirror, false), work.path()).await;
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
/// the failure-free answer, and the phases show the loss and the recovery,
/// whether the nodes hold their share in memory or stream it.
#[test]
fn every_scheme_recovers_a_node_lost_mid_query_with_the_failure_free_answer() {
    use smartstore::recovery::{FailMode, Fault, Scheme};
    let rt = rt();
    rt.block_on(async {
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        let (want_q1, want_scan) = answers(&schema, &batches).await;
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
        ]
        .map(|(q, s, at, n, m)| (q, s, at, n, m, false));
        // Lost while its checkpoint of the previous primitive is in flight:
        // recovery starts from the checkpoint before it (or the partition).
        let mid = [
            (Query::Q1, Scheme::Spare, 2, 1, FailMode::Kill, true),
            (Query::Q1, Scheme::Parity, 2, 2, FailMode::Kill, true),
            (Query::Q1, Scheme::Migrate, 2, 3, FailMode::Kill, true),
            (
                Query::Q1,
                Scheme::Redistribute,
                2,
                0,
                FailMode::Unreadable,
                true,
            ),
            (Query::Q1, Scheme::Spare, 1, 2, FailMode::Kill, true),
            (Query::Q1, Scheme::Parity, 1, 1, FailMode::Unreadable, true),
        ];
        // Nodes with the default memory run every primitive in memory;
        // nodes of 128 KiB stream, spill, and defer their Scan into the
        // Sort (several redistributed pieces at once after a
        // redistribution).
        let memories = [smartstore::host::DEFAULT_NODE_MEMORY, 128 << 10];
        let all = memories
            .into_iter()
            .flat_map(|m| cases.into_iter().chain(mid).map(move |c| (m, c)));
        for (memory, (query, scheme, at, node, mode, mid_checkpoint)) in all {
            let what = format!(
                "{query:?} {scheme:?} at {at} node {node} {mode:?} mid-checkpoint \
                 {mid_checkpoint}, memory {memory}"
            );
            let work = tempfile::tempdir().unwrap();
            let spec = ClusterSpec {
                nodes: 4,
                layout: scheme.layout(),
                spare: scheme.needs_spare(),
                model: DeviceModel::None,
                memory,
            };
            let mut c = launch(spec, work.path()).await;
            c.place(schema.clone(), &batches).await.unwrap();
            let fault = Fault {
                mid_checkpoint,
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
            check_recovery_phases(&what, &r, at, mid_checkpoint);
        }
    });
}

/// The phases of a query that lost a node before primitive `at` show the
/// loss and the recovery, rerun nothing before the fault point but what
/// the lost checkpoint forces, and never use a checkpoint that did not
/// complete.
fn check_recovery_phases(
    what: &str,
    r: &smartstore::host::QueryReport,
    at: usize,
    mid_checkpoint: bool,
) {
    let names: Vec<&str> = r.phases.iter().map(|p| p.name.as_str()).collect();
    assert!(
        names.iter().any(|n| n.ends_with("(node lost)")),
        "{what}: {names:?}"
    );
    assert!(names.contains(&"recovery"), "{what}: {names:?}");
    // Q1 never restarts from the beginning: primitives before the fault
    // point run once (twice for Scan when its checkpoint was lost).
    if r.query == Query::Q1 {
        let scans = names.iter().filter(|n| n.starts_with("scan")).count();
        let again = at == 0 || (mid_checkpoint && at == 1);
        assert_eq!(scans, if again { 2 } else { 1 }, "{what}: {names:?}");
    }
    // A lost checkpoint is never used: the previous primitive runs again
    // from the one before it.
    let lost_ckpt = names.iter().any(|n| n.contains("(1 lost)"));
    assert_eq!(lost_ckpt, mid_checkpoint, "{what}: {names:?}");
    if mid_checkpoint {
        let redo = format!(
            "{} (after recovery)",
            smartstore::recovery::PRIMITIVES[at - 1]
        );
        assert!(names.contains(&redo.as_str()), "{what}: {names:?}");
    }
}

#[test]
fn a_second_unplanned_loss_is_an_error_not_a_wrong_answer() {
    use smartstore::recovery::{FailMode, Fault, Scheme};
    let rt = rt();
    rt.block_on(async {
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        let work = tempfile::tempdir().unwrap();
        let mut c = launch(spec(Layout::Mirror, true), work.path()).await;
        c.place(schema, &batches).await.unwrap();
        // Main 2 is lost before the query without any fault planned.
        c.fail_node(2, FailMode::Kill).unwrap();
        let e = c.run_query(Query::Q1, true).await.unwrap_err();
        assert!(e.is_node_lost() && e.to_string().contains("main 2"), "{e}");
        // And with a plan for main 1, losing main 2 as well is refused.
        let fault = Fault {
            mid_checkpoint: false,
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

/// A node over `dir` that needs `token` and sends only to the addresses in
/// `members` (a private file), taking puts up to `max_put_bytes`.
fn guarded_node(
    dir: &std::path::Path,
    token: &smartstore::access::Token,
    members: &std::path::Path,
    max_put_bytes: u64,
) -> smartstore::node::InProcessNode {
    use smartstore::access::{Members, NodeAccess};
    let access = NodeAccess {
        token: Some(token.clone()),
        members: Some(Members::File(members.to_path_buf())),
        max_put_bytes,
        tls: None,
    };
    smartstore::node::InProcessNode::start_with(dir, DeviceModel::None, access).unwrap()
}

/// Every file of `dir` with its bytes, sorted by name.
fn contents(dir: &std::path::Path) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            let b = std::fs::read(&p).unwrap();
            (p, b)
        })
        .collect();
    files.sort();
    files
}

#[test]
fn a_client_without_the_cluster_token_or_with_a_wrong_one_is_refused_and_changes_nothing() {
    use smartstore::access::{Credentials, Token, write_private};
    use smartstore::client::NodeClient;
    use smartstore::node::{CheckpointCmd, PutCmd};
    let rt = rt();
    rt.block_on(async {
        let work = tempfile::tempdir().unwrap();
        let token = Token::generate(&work.path().join("token")).unwrap();
        let members = work.path().join("members");
        write_private(&members, "", true).unwrap();
        let n = guarded_node(&work.path().join("n"), &token, &members, 1 << 30);
        let mut good = NodeClient::connect_with(&n.addr, "main 0", &Credentials::token(token))
            .await
            .unwrap();
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        good.put_table("lineitem", schema.clone(), batches[..1].to_vec())
            .await
            .unwrap();
        let before = contents(&work.path().join("n"));
        let lineitem = good.get_object("lineitem").await.unwrap();

        let wrong = Token::new("not-the-cluster-token-at-all").unwrap();
        let mut refused = 0;
        for (who, creds) in [
            ("no token", Credentials::default()),
            ("wrong token", Credentials::token(wrong)),
        ] {
            let mut c = NodeClient::connect_with(&n.addr, "main 0", &creds)
                .await
                .unwrap();
            let fragment = br#"{"input":"lineitem","output":"x","primitive":{"op":"scan","columns":["l_orderkey"]}}"#;
            let ckpt = CheckpointCmd {
                object: "lineitem".into(),
                target: n.addr.clone(),
                as_name: "stolen".into(),
                parity: None,
                codec: Default::default(),
                epoch: 0,
            };
            let errors = [
                c.put_table("lineitem", schema.clone(), batches[1..2].to_vec())
                    .await
                    .err(),
                c.put_raw(&PutCmd::Object { name: "x".into() }, vec![7; 100])
                    .await
                    .err(),
                c.get_object("lineitem").await.err(),
                c.get_table("lineitem", None, None).await.err(),
                c.ping().await.err(),
                c.action("run", fragment.to_vec()).await.err(),
                c.checkpoint(&ckpt).await.err(),
            ];
            for (i, e) in errors.into_iter().enumerate() {
                let e = e.unwrap_or_else(|| panic!("{who}: call {i} was served")).to_string();
                let why = if creds.token.is_some() {
                    "wrong cluster token"
                } else {
                    "no cluster token"
                };
                assert!(e.contains("unauthenticated") && e.contains(why), "{who} {i}: {e}");
                refused += 1;
            }
        }
        // Nothing changed, and the node counted every refusal.
        assert_eq!(contents(&work.path().join("n")), before);
        assert_eq!(good.get_object("lineitem").await.unwrap(), lineitem);
        let info = good.ping().await.unwrap();
        assert_eq!(info["refused_calls"], refused, "{info}");
    });
}

/// One rebuild of each kind, each reading from `stranger` (and `member`).
fn rebuilds_reading_from(stranger: &str, member: &str) -> [RebuildCmd; 3] {
    [
        RebuildCmd::Copy {
            source: stranger.into(),
            object: "lineitem".into(),
            name: "copied".into(),
        },
        RebuildCmd::MirrorColumns {
            sources: vec![member.into(), stranger.into()],
            cols_object: "lineitem".into(),
            member: 0,
            name: "zipped".into(),
        },
        RebuildCmd::Parity {
            parity: (stranger.into(), "lineitem.parity".into()),
            survivors: vec![(1, member.into(), "lineitem".into())],
            member: 0,
            name: "xored".into(),
        },
    ]
}

#[test]
fn transfers_naming_an_address_outside_the_members_are_refused_and_never_connect() {
    use smartstore::access::{Credentials, Token, write_private};
    use smartstore::client::NodeClient;
    use smartstore::node::{CheckpointCmd, ScatterCmd};
    let rt = rt();
    rt.block_on(async {
        let work = tempfile::tempdir().unwrap();
        let token = Token::generate(&work.path().join("token")).unwrap();
        let members = work.path().join("members");
        write_private(&members, "", true).unwrap();
        let a = guarded_node(&work.path().join("a"), &token, &members, 1 << 30);
        let b = guarded_node(&work.path().join("b"), &token, &members, 1 << 30);
        write_private(&members, &format!("{}\n{}\n", a.addr, b.addr), true).unwrap();
        // A stranger that would accept data: it must never see a connection.
        let stranger = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        stranger.set_nonblocking(true).unwrap();
        let s = stranger.local_addr().unwrap().to_string();

        let creds = Credentials::token(token);
        let mut ca = NodeClient::connect_with(&a.addr, "a", &creds)
            .await
            .unwrap();
        let mut cb = NodeClient::connect_with(&b.addr, "b", &creds)
            .await
            .unwrap();
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        ca.put_table("lineitem", schema, batches[..2].to_vec())
            .await
            .unwrap();
        let ckpt = |target: &str| CheckpointCmd {
            object: "lineitem".into(),
            target: target.into(),
            as_name: "lineitem.ckpt".into(),
            parity: None,
            codec: Default::default(),
            epoch: 0,
        };
        // A member is a fine target.
        ca.checkpoint(&ckpt(&b.addr)).await.unwrap();

        let want = format!("{s} is not a member of this cluster");
        let scatter = ScatterCmd {
            object: "lineitem".into(),
            targets: vec![b.addr.clone(), s.clone()],
            as_name: "scattered".into(),
        };
        let rebuilds = rebuilds_reading_from(&s, &a.addr);
        let mut errors = vec![
            ca.checkpoint(&ckpt(&s)).await.unwrap_err(),
            ca.scatter(&scatter).await.unwrap_err(),
        ];
        for r in &rebuilds {
            errors.push(cb.rebuild(r).await.unwrap_err());
        }
        for e in errors {
            let e = e.to_string();
            assert!(e.contains(&want) && e.contains("refused"), "{e}");
        }
        // Nothing reached the stranger, nor (for the scatter) the member.
        assert_eq!(
            stranger.accept().unwrap_err().kind(),
            std::io::ErrorKind::WouldBlock
        );
        for name in ["scattered", "copied", "zipped", "xored"] {
            assert!(
                !work.path().join(format!("b/{name}.obj")).exists(),
                "{name}"
            );
        }
        assert!(work.path().join("b/lineitem.ckpt.obj").is_file());
    });
}

#[test]
fn a_put_over_the_limit_is_refused_while_streaming_and_the_node_stays_healthy() {
    use smartstore::access::{Credentials, Token, write_private};
    use smartstore::client::NodeClient;
    use smartstore::node::PutCmd;
    let rt = rt();
    rt.block_on(async {
        let work = tempfile::tempdir().unwrap();
        let token = Token::generate(&work.path().join("token")).unwrap();
        let members = work.path().join("members");
        write_private(&members, "", true).unwrap();
        let limit = 1 << 20;
        let n = guarded_node(&work.path().join("n"), &token, &members, limit);
        let mut c = NodeClient::connect_with(&n.addr, "main 0", &Credentials::token(token))
            .await
            .unwrap();
        let e = c
            .put_raw(&PutCmd::Object { name: "big".into() }, vec![1; 8 << 20])
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("put of big") && e.contains("--max-put-bytes") && e.contains("refused"),
            "{e}"
        );
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        let e = c
            .put_table("lineitem", schema.clone(), batches.clone())
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("put of lineitem") && e.contains("1048576"),
            "{e}"
        );
        assert!(!work.path().join("n/big.obj").exists());
        assert!(!work.path().join("n/lineitem.obj").exists());
        // Still serving: a put under the limit lands.
        c.ping().await.unwrap();
        let small = batches[0].slice(0, 100);
        c.put_table("lineitem", schema, vec![small.clone()])
            .await
            .unwrap();
        let (_, back) = c.get_table("lineitem", None, None).await.unwrap();
        assert_eq!(back, vec![small]);
    });
}

/// A CA and a certificate for 127.0.0.1 (server and client use) in `dir`,
/// in the `--tls-certificates` layout, made with the openssl command (panics
/// when it is missing: no test is skipped).
fn make_certificates(dir: &std::path::Path) -> bool {
    let script = r#"set -e
ec="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
openssl req -x509 $ec -keyout ca-key.pem -out ca-cert.pem -days 2 -subj /CN=rebound-test-ca
openssl req $ec -keyout server-key.pem -out server.csr -subj /CN=node
printf 'subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n' > ext
openssl x509 -req -in server.csr -CA ca-cert.pem -CAkey ca-key.pem -CAcreateserial -days 2 -extfile ext -out server-cert.pem
chmod 600 server-key.pem"#;
    if std::process::Command::new("openssl")
        .arg("version")
        .output()
        .is_err()
    {
        panic!(
            "the openssl command is not installed; scripts/test.sh installs it (package openssl)"
        );
    }
    match std::process::Command::new("sh")
        .args(["-c", script])
        .current_dir(dir)
        .output()
    {
        Ok(out) if out.status.success() => true,
        Ok(out) => panic!("openssl: {}", String::from_utf8_lossy(&out.stderr)),
        Err(e) => panic!("sh: {e}"),
    }
}

#[test]
fn mutual_tls_nodes_serve_only_clients_with_a_certificate_of_the_cluster_ca() {
    use smartstore::access::{Credentials, Members, NodeAccess, NodeTls, client_config};
    use smartstore::client::NodeClient;
    use smartstore::node::CheckpointCmd;
    let certs = tempfile::tempdir().unwrap();
    if !make_certificates(certs.path()) {
        eprintln!("skipped: no openssl command to make certificates");
        return;
    }
    let rt = rt();
    rt.block_on(async {
        let work = tempfile::tempdir().unwrap();
        let tls_node = |dir: &str, members: &[String]| {
            let access = NodeAccess {
                tls: Some(NodeTls::load(certs.path(), true).unwrap()),
                members: Some(Members::list(members).unwrap()),
                ..NodeAccess::default()
            };
            let dir = work.path().join(dir);
            smartstore::node::InProcessNode::start_with(&dir, DeviceModel::None, access).unwrap()
        };
        let peer = tls_node("peer", &[]);
        let n = tls_node("n", std::slice::from_ref(&peer.addr));
        // The node's own client side (CA + its certificate) is served.
        let tls = NodeTls::load(certs.path(), true).unwrap().client;
        let creds = Credentials {
            token: None,
            tls: Some(tls),
        };
        let mut c = NodeClient::connect_with(&n.addr, "main 0", &creds)
            .await
            .unwrap();
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        c.put_table("lineitem", schema, batches[..1].to_vec())
            .await
            .unwrap();
        let (_, back) = c.get_table("lineitem", None, None).await.unwrap();
        assert_eq!(
            back.iter().map(|b| b.num_rows()).sum::<usize>(),
            batches[0].num_rows()
        );
        // Nodes reach each other over mutual TLS too.
        let ckpt = CheckpointCmd {
            object: "lineitem".into(),
            target: peer.addr.clone(),
            as_name: "lineitem.ckpt".into(),
            parity: None,
            codec: Default::default(),
            epoch: 0,
        };
        c.checkpoint(&ckpt).await.unwrap();
        assert!(work.path().join("peer/lineitem.ckpt.obj").is_file());
        // Plaintext, and TLS without a client certificate, are not served.
        let no_cert = Credentials {
            token: None,
            tls: Some(client_config(certs.path()).unwrap()),
        };
        for (who, creds) in [
            ("plaintext", Credentials::default()),
            ("no client certificate", no_cert),
        ] {
            let refused = match NodeClient::connect_with(&n.addr, "main 0", &creds).await {
                Err(e) => e.to_string(),
                Ok(mut c) => c.ping().await.unwrap_err().to_string(),
            };
            assert!(refused.contains("main 0"), "{who}: {refused}");
        }
        c.ping().await.unwrap();
    });
}

/// `batches` cut into row blocks of at most `rows` rows.
fn blocks_of(
    batches: &[arrow::record_batch::RecordBatch],
    rows: usize,
) -> Vec<arrow::record_batch::RecordBatch> {
    batches
        .iter()
        .flat_map(|b| {
            (0..b.num_rows())
                .step_by(rows)
                .map(move |at| b.slice(at, rows.min(b.num_rows() - at)))
        })
        .collect()
}

#[test]
fn a_table_put_cut_short_stores_nothing_and_the_older_table_stays() {
    use smartstore::client::NodeClient;
    use smartstore::node::{InProcessNode, PutCmd};
    let rt = rt();
    rt.block_on(async {
        let work = tempfile::tempdir().unwrap();
        let n = InProcessNode::start(&work.path().join("n"), DeviceModel::None).unwrap();
        let mut c = NodeClient::connect(&n.addr, "main 0").await.unwrap();
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        // Row blocks of 5,000 rows: a dozen.
        let batches = blocks_of(&batches, 5000);
        c.put_table("lineitem", schema.clone(), batches[..2].to_vec())
            .await
            .unwrap();
        let before = contents(&work.path().join("n"));
        // A sender whose source fails midway: its stream ends without the
        // end marker.
        let blocks = futures::stream::iter(vec![
            Ok(batches[2].clone()),
            Ok(batches[3].clone()),
            Err(smartstore::error::Error::Invalid(
                "the generator failed".into(),
            )),
            Ok(batches[4].clone()),
        ]);
        let put = PutCmd::Table {
            name: "lineitem".into(),
            sync: true,
        };
        let e = c
            .put_table_stream(put, schema.clone(), blocks)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cut short") && e.contains("the generator failed"),
            "{e}"
        );
        let (_, back) = c.get_table("lineitem", None, None).await.unwrap();
        assert_eq!(back, batches[..2].to_vec(), "the older table is intact");
        assert_eq!(
            contents(&work.path().join("n")),
            before,
            "no spool or temporary file left behind"
        );
        // A whole streamed put lands, and reads back block for block.
        let put = PutCmd::Table {
            name: "lineitem".into(),
            sync: true,
        };
        let all: Vec<_> = batches.iter().cloned().map(Ok).collect();
        c.put_table_stream(put, schema, futures::stream::iter(all))
            .await
            .unwrap();
        let (_, back) = c.get_table("lineitem", None, None).await.unwrap();
        assert_eq!(back, batches);
    });
}

#[test]
fn a_placement_whose_source_fails_is_an_error_and_the_next_one_answers_exactly() {
    let rt = rt();
    rt.block_on(async {
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        let want = tpch::to_csv(&[tpch::q1_single(schema.clone(), batches.clone())
            .await
            .unwrap()])
        .unwrap();
        for layout in [Layout::Mirror, Layout::Parity] {
            let work = tempfile::tempdir().unwrap();
            let mut c = launch(spec(layout, false), work.path()).await;
            let mut failing: Vec<_> = batches[..3].iter().cloned().map(Ok).collect();
            failing.push(Err(smartstore::error::Error::Invalid(
                "generator stopped".into(),
            )));
            let e = c
                .place_stream(schema.clone(), futures::stream::iter(failing))
                .await
                .unwrap_err()
                .to_string();
            assert!(e.contains("generator stopped"), "{}: {e}", layout.name());
            // The table as a generator hands it over, block by block.
            let (s, blocks) = tpch::lineitem_blocks(SF).unwrap();
            c.place_stream(s, smartstore::host::blocking_source(blocks))
                .await
                .unwrap();
            let r = c.run_query(Query::Q1, true).await.unwrap();
            assert_eq!(tpch::to_csv(&r.result).unwrap(), want, "{}", layout.name());
            c.shutdown();
        }
    });
}

#[test]
fn a_placement_that_loses_a_node_leaves_no_partial_table_on_the_others() {
    use smartstore::recovery::FailMode;
    let rt = rt();
    rt.block_on(async {
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        // Blocks of 500 rows: the placement is still running when the lost
        // node's put fails.
        let blocks = blocks_of(&batches, 500);
        let work = tempfile::tempdir().unwrap();
        let mut c = launch(spec(Layout::Mirror, false), work.path()).await;
        c.fail_node(1, FailMode::Unreadable).unwrap();
        let source: Vec<_> = blocks.iter().cloned().map(Ok).collect();
        let e = c
            .place_stream(schema, futures::stream::iter(source))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("main 1"), "{e}");
        // Another main node holds nothing, or its whole partition: never a
        // part of it.
        for i in [0, 2, 3] {
            let whole: Vec<_> = blocks
                .iter()
                .enumerate()
                .filter(|(b, _)| b % 4 == i)
                .map(|(_, x)| x.clone())
                .collect();
            if let Ok((_, got)) = c.main[i].get_table(names::LINEITEM, None, None).await {
                assert_eq!(got, whole, "main {i} holds a partial partition");
            }
            let left: Vec<_> = std::fs::read_dir(&c.dirs[i])
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .filter(|n| n.contains("spool") || n.ends_with(".tmp"))
                .collect();
            assert!(left.is_empty(), "main {i} left {left:?}");
        }
        c.shutdown();
    });
}

/// Nodes whose memory is far below their share (128 KiB against about
/// 570 KB of Scan input each at sf 0.01): every primitive streams its
/// input, spills its sort runs and writes its output as it comes (an
/// object when checkpointed, spilled runs when not), and every answer is
/// still exactly the single-process one: without checkpoints, with them,
/// and after a main node is lost and recovered. Spill files live only as
/// long as the output they hold.
#[test]
fn nodes_with_less_memory_than_their_share_stream_and_spill_and_answer_exactly() {
    use smartstore::recovery::{FailMode, Fault, Scheme};
    let rt = rt();
    rt.block_on(async {
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        let (want_q1, want_scan) = answers(&schema, &batches).await;
        let spills = |d: &std::path::Path| -> Vec<String> {
            std::fs::read_dir(d.join(smartstore::node::SPILL_DIR))
                .map(|r| {
                    r.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default()
        };
        for scheme in [Scheme::Spare, Scheme::Parity] {
            let work = tempfile::tempdir().unwrap();
            let spec = ClusterSpec {
                nodes: 4,
                layout: scheme.layout(),
                spare: true,
                model: DeviceModel::None,
                memory: 128 << 10,
            };
            let mut c = launch(spec, work.path()).await;
            c.place(schema.clone(), &batches).await.unwrap();
            let r = c.run_query(Query::Scan, false).await.unwrap();
            assert_eq!(
                tpch::to_csv(&r.result).unwrap(),
                want_scan,
                "{scheme:?} scan"
            );
            for checkpoint in [false, true] {
                let r = c.run_query(Query::Q1, checkpoint).await.unwrap();
                assert_eq!(
                    tpch::to_csv(&r.result).unwrap(),
                    want_q1,
                    "{scheme:?} {checkpoint}"
                );
                for d in &c.dirs[..4] {
                    let object = d.join(format!("{}.obj", names::Q1_OUT[0])).exists();
                    let runs = spills(d);
                    if checkpoint {
                        // Materialised: table objects on the device; only
                        // the Scan query's spilled output is left.
                        assert!(object, "{}", d.display());
                        assert!(runs.len() <= 1, "{}: {runs:?}", d.display());
                    } else {
                        // The Scan deferred into the Sort, the Sort into
                        // the aggregation, which read the Scan's rows
                        // unsorted: Q1 wrote nothing; only the Scan
                        // query's spilled output is left.
                        assert!(!object, "{}", d.display());
                        assert!(runs.len() <= 1, "{}: {runs:?}", d.display());
                    }
                    assert!(runs.iter().all(|r| r.starts_with("run-")), "{runs:?}");
                }
            }
            let fault = Fault {
                mid_checkpoint: false,
                node: 1,
                at: 2,
                mode: FailMode::Kill,
                scheme,
            };
            let r = c
                .run_query_with(Query::Q1, true, Some(fault))
                .await
                .unwrap();
            assert_eq!(
                tpch::to_csv(&r.result).unwrap(),
                want_q1,
                "{scheme:?} recovered"
            );
            for d in &c.dirs {
                assert!(spills(d).len() <= 1, "{}: {:?}", d.display(), spills(d));
            }
        }
    });
}

/// A Scan of `lineitem` kept in memory only, and a Sort of its output
/// materialised.
fn scan_then_sort() -> (smartstore::plan::Fragment, smartstore::plan::Fragment) {
    use smartstore::plan::{Cmp, Fragment, Predicate, Primitive, SortKey, Value};
    let scan = Primitive::Scan {
        filter: vec![Predicate {
            left: Value::col("l_shipdate"),
            cmp: Cmp::Le,
            right: Value::Date("1995-06-17".into()),
        }],
        columns: Some(vec![
            "l_orderkey".into(),
            "l_linenumber".into(),
            "l_extendedprice".into(),
        ]),
    };
    let sort = Primitive::Sort {
        keys: vec![SortKey::asc("l_extendedprice"), SortKey::asc("l_orderkey")],
    };
    (
        Fragment {
            input: "lineitem".into(),
            also: Vec::new(),
            output: "picked".into(),
            primitive: scan,
            materialize: false,
            defer: true,
        },
        Fragment {
            input: "picked".into(),
            also: Vec::new(),
            output: "sorted".into(),
            primitive: sort,
            materialize: true,
            defer: false,
        },
    )
}

/// A Scan that streams and is not materialised is deferred: it writes
/// nothing, the next primitive runs it as it reads and answers exactly as
/// over the whole input, it reads its input as it was when deferred (base
/// data replaced by a rename since), and a damaged input fails that reader
/// with the file named, storing nothing.
#[test]
fn a_deferred_scan_writes_nothing_and_its_reader_answers_from_the_input_as_it_was() {
    let rt = rt();
    rt.block_on(async {
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let node = smartstore::node::Node::open(dir.path(), DeviceModel::None, 64 << 10).unwrap();
        let path = dir.path().join("lineitem.obj");
        // Base data is replaced by renaming a new file over it.
        let put = |batches: &[RecordBatch], damage: Option<usize>| {
            let mut file = smartstore::columnar::table_file(&schema, batches).unwrap();
            if let Some(every) = damage {
                // A flipped byte every `every` bytes past the header and
                // directory: some land in the columns the Scan reads.
                for at in (4096..file.len()).step_by(every) {
                    file[at] ^= 0x40;
                }
            }
            let tmp = dir.path().join("lineitem.tmp");
            smartstore::object::write_file(&tmp, &file).unwrap();
            std::fs::rename(&tmp, &path).unwrap();
            file.len()
        };
        let (scan, sort) = scan_then_sort();
        let (scan_prim, sort_prim) = (scan.primitive.clone(), sort.primitive.clone());
        let (s, picked) = smartstore::ops::run(&scan_prim, schema.clone(), batches.clone())
            .await
            .unwrap();
        let (_, want) = smartstore::ops::run(&sort_prim, s.clone(), picked)
            .await
            .unwrap();
        let want = arrow::compute::concat_batches(&s, &want).unwrap();
        let sorted = |node: &smartstore::node::Node| {
            let mut stats = smartstore::wire::Stats::default();
            let (s, b) = node.load_table("sorted", None, &mut stats).unwrap();
            arrow::compute::concat_batches(&s, &b).unwrap()
        };
        let spills = || {
            std::fs::read_dir(dir.path().join(smartstore::node::SPILL_DIR))
                .map(|d| d.count())
                .unwrap_or(0)
        };

        let len = put(&batches, None);
        node.run(&scan).await.unwrap();
        assert_eq!(spills(), 0, "a deferred Scan spills nothing");
        assert!(!dir.path().join("picked.obj").exists());
        node.run(&sort).await.unwrap();
        assert_eq!(sorted(&node), want);

        // Deferred over the whole table, then the table replaced by half
        // of it: the Sort still reads the whole one.
        node.run(&scan).await.unwrap();
        put(&batches[..batches.len() / 2], None);
        node.run(&sort).await.unwrap();
        assert_eq!(sorted(&node), want, "read as it was when deferred");

        // A damaged input: the Scan defers (its header is sound), the Sort
        // that runs it fails with the file named and stores nothing.
        put(&batches, None);
        std::fs::remove_file(dir.path().join("sorted.obj")).unwrap();
        put(&batches, Some(len / 16));
        node.run(&scan).await.unwrap();
        let e = node.run(&sort).await.unwrap_err().to_string();
        assert!(e.contains("lineitem.obj"), "{e}");
        assert!(!dir.path().join("sorted.obj").exists());
    });
}

/// Q1's Sort, kept in memory only, is deferred too, on a node whose
/// memory holds its input as on one where it streams: it writes nothing.
/// The AggGrpSort that reads it takes its rows in any order (sums and
/// counts of decimals), so it reads the Scan's rows unsorted and needs no
/// spill space at all, and answers exactly as the in-memory Scan, Sort
/// and AggGrpSort; a reader that needs the order (the host fetching the
/// Sort's output) gets it sorted.
#[test]
fn a_deferred_sort_is_skipped_by_an_aggregation_and_sorted_for_a_reader_that_needs_order() {
    use smartstore::plan::{Fragment, Primitive};
    let rt = rt();
    for memory in [64 << 10, 256 << 20] {
        rt.block_on(async {
            let (schema, batches) = tpch::lineitem(SF).unwrap();
            let dir = tempfile::tempdir().unwrap();
            let node = smartstore::node::Node::open(dir.path(), DeviceModel::None, memory).unwrap();
            let file = smartstore::columnar::table_file(&schema, &batches).unwrap();
            smartstore::object::write_file(&dir.path().join("lineitem.obj"), &file).unwrap();
            let [scan, sort, agg] = tpch::q1_primitives();
            let fragment = |input: &str, output: &str, primitive: &Primitive| Fragment {
                input: input.into(),
                also: Vec::new(),
                output: output.into(),
                primitive: primitive.clone(),
                materialize: false,
                defer: true,
            };
            let mut want = Vec::new();
            let (mut s, mut b) = (schema.clone(), batches.clone());
            for p in [&scan, &sort, &agg] {
                (s, b) = smartstore::ops::run(p, s, b).await.unwrap();
                want.push(arrow::compute::concat_batches(&s, &b).unwrap());
            }
            let fetched = |name: &str| {
                let mut stats = smartstore::wire::Stats::default();
                let (s, b) = node.load_table(name, None, &mut stats).unwrap();
                arrow::compute::concat_batches(&s, &b).unwrap()
            };
            let spill = dir.path().join(smartstore::node::SPILL_DIR);

            node.run(&fragment("lineitem", "picked", &scan))
                .await
                .unwrap();
            let stats = node
                .run(&fragment("picked", "sorted", &sort))
                .await
                .unwrap();
            assert_eq!(stats.rows_out, 0, "deferred: no row sorted yet");
            assert!(
                std::fs::read_dir(&spill).map_or(0, |d| d.count()) == 0,
                "a deferred Sort writes no runs"
            );
            // No spill space at all: a sort could not write a run.
            let _ = std::fs::remove_dir_all(&spill);
            std::fs::write(&spill, b"not a directory").unwrap();
            node.run(&fragment("sorted", "q1", &agg)).await.unwrap();
            assert_eq!(fetched("q1"), want[2]);
            assert_eq!(want[2].num_rows(), 4, "Q1's four groups");

            std::fs::remove_file(&spill).unwrap();
            assert_eq!(
                fetched("sorted"),
                want[1],
                "sorted for a reader that needs order"
            );
            // A query with checkpoints does not let the node defer: the
            // Sort runs where it is asked for.
            let ran = node
                .run(&Fragment {
                    defer: false,
                    ..fragment("picked", "sorted", &sort)
                })
                .await
                .unwrap();
            assert_eq!(ran.rows_out, want[1].num_rows() as u64);
            assert_eq!(fetched("sorted"), want[1]);
        });
    }
}

/// A node whose memory is smaller than its input reads the input a row
/// block at a time; a flipped byte in any column segment still fails the
/// primitive with the damaged file named, and no output is stored or held.
#[test]
fn a_damaged_input_fails_a_streamed_primitive_and_stores_no_output() {
    use smartstore::plan::{Fragment, Primitive};
    let rt = rt();
    rt.block_on(async {
        let (schema, batches) = tpch::lineitem(SF).unwrap();
        let file = smartstore::columnar::table_file(&schema, &batches).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let node = smartstore::node::Node::open(dir.path(), DeviceModel::None, 64 << 10).unwrap();
        let path = dir.path().join("lineitem.obj");
        let scan = Fragment {
            input: "lineitem".into(),
            also: Vec::new(),
            output: "out".into(),
            primitive: Primitive::Scan {
                filter: Vec::new(),
                columns: None,
            },
            materialize: true,
            defer: false,
        };
        // Intact, it streams (the input is far above 64 KiB) and stores.
        smartstore::object::write_file(&path, &file).unwrap();
        let s = node.run(&scan).await.unwrap();
        assert_eq!(
            s.rows_out,
            batches.iter().map(|b| b.num_rows() as u64).sum::<u64>()
        );
        assert!(dir.path().join("out.obj").exists());
        std::fs::remove_file(dir.path().join("out.obj")).unwrap();
        // Bytes inside the last column's segment (the payload's end), and
        // one in the middle of the file.
        for at in [file.len() - 100, file.len() - 5000, file.len() / 2] {
            let mut bad = file.clone();
            bad[at] ^= 0x40;
            smartstore::object::write_file(&path, &bad).unwrap();
            let e = node.run(&scan).await.unwrap_err().to_string();
            assert!(e.contains("lineitem.obj"), "byte {at}: {e}");
            assert!(!dir.path().join("out.obj").exists(), "byte {at}");
            let mut stats = smartstore::wire::Stats::default();
            assert!(
                node.load_table("out", None, &mut stats).is_err(),
                "byte {at}"
            );
        }
    });
}

//! Q1's primitives on one storage node's partition (smart-storage paper
//! section 4.2: Scan, then Sort, then the bundle Group-by + Aggregate +
//! LocalSort), each over the previous one's output, as a node runs them.
//!
//! The partition is TPC-H `lineitem` at scale factor 0.25 (1.5 million
//! rows): one of four data nodes' share at SF 1, the configuration of
//! `rebound bench smartstore`. It is stored and read back through the
//! node's columnar format, so the batches are what a node decodes. Each
//! benchmark times one primitive; its input is prepared once. The process
//! keeps its heap warm as a node does ([`smartstore::node::keep_heap_warm`]).
//!
//! `cargo bench -p smartstore --bench primitives`; the whole-cluster
//! numbers and the DuckDB peer are `rebound bench smartstore`.

use std::path::Path;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use smartstore::codec::Codec;
use smartstore::{columnar, ops, tpch};

/// Scale factor of the generated partition (one node's share at SF 1);
/// `SMARTSTORE_BENCH_SF=2.5` gives one node's share at SF 10.
fn sf() -> f64 {
    std::env::var("SMARTSTORE_BENCH_SF")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0.25)
}

fn run(
    rt: &tokio::runtime::Runtime,
    p: &smartstore::plan::Primitive,
    input: &(SchemaRef, Vec<RecordBatch>),
) -> (SchemaRef, Vec<RecordBatch>) {
    rt.block_on(ops::run(p, input.0.clone(), input.1.clone()))
        .expect("primitive runs")
}

fn primitives(c: &mut Criterion) {
    // The heap thresholds a node runs with (`rebound node`): without them
    // every primitive faults its output buffers in afresh.
    assert!(smartstore::node::keep_heap_warm(), "glibc heap thresholds");
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let (schema, batches) = tpch::lineitem(sf()).expect("generated");
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    let payload = columnar::encode(&schema, &batches).expect("encoded");
    let [scan, sort, bundle] = tpch::q1_primitives();
    let columns = scan.input_columns();
    let stored =
        columnar::decode(Path::new("lineitem"), &payload, columns.as_deref()).expect("decoded");
    let scanned = run(&rt, &scan, &stored);
    let sorted = run(&rt, &sort, &scanned);

    let mut g = c.benchmark_group(format!("q1 primitives, one node (sf {})", sf()));
    g.sample_size(10);
    g.throughput(Throughput::Elements(rows as u64));
    g.bench_function("decode (the columns Scan reads)", |b| {
        b.iter(|| columnar::decode(Path::new("lineitem"), &payload, columns.as_deref()))
    });
    g.bench_function("scan", |b| b.iter(|| run(&rt, &scan, &stored)));
    g.bench_function("sort", |b| b.iter(|| run(&rt, &sort, &scanned)));
    g.bench_function("agg-grp-sort (sorted input)", |b| {
        b.iter(|| run(&rt, &bundle, &sorted))
    });
    g.bench_function("agg-grp-sort (unsorted: hash path)", |b| {
        b.iter(|| run(&rt, &bundle, &scanned))
    });
    for codec in Codec::ALL {
        let name = format!(
            "encode the Sort's output as a checkpoint ({})",
            codec.name()
        );
        g.bench_function(name, |b| {
            b.iter(|| columnar::table_file_with(&sorted.0, &sorted.1, codec).expect("encoded"))
        });
    }
    for codec in Codec::ALL {
        let file = columnar::table_file_with(&sorted.0, &sorted.1, codec).expect("encoded");
        let (_, payload) = smartstore::object::decode(Path::new("c"), &file).expect("decoded");
        let name = format!("decode a checkpoint ({})", codec.name());
        g.bench_function(name, |b| {
            b.iter(|| columnar::decode(Path::new("c"), payload, None).expect("decoded"))
        });
    }
    g.finish();
}

criterion_group!(benches, primitives);
criterion_main!(benches);

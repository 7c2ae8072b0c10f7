//! The recovery box's costs, as the paper's Tables 5 and 6 measure them:
//! an insert+delete pair of a 52-byte item with checksum (paper: 28 µs),
//! an update of a 92-byte item (paper: 55 µs, of which 19 µs system call),
//! and open+validate of a box holding 20,000 and 1,000,000 items (the
//! paper's file server held 20,000 pieces of state). Boxes live in
//! /dev/shm, as by default.

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use recobox::{CreateOptions, RecoveryBox, TypeSpec};

fn shm() -> tempfile::TempDir {
    tempfile::tempdir_in("/dev/shm").unwrap_or_else(|_| tempfile::tempdir().unwrap())
}

fn ops(c: &mut Criterion) {
    let dir = shm();
    let b = RecoveryBox::create(&dir.path().join("box"), CreateOptions::default()).unwrap();
    let handles = b.init_type(TypeSpec::new(52, 20_000)).unwrap();
    let conns = b.init_type(TypeSpec::new(92, 1_000)).unwrap();
    // As the paper: the box already holds 1000 items.
    for i in 0..1000u32 {
        b.insert(handles, &[i as u8; 52], Some(u64::from(i)))
            .unwrap();
    }
    let conn = b.insert(conns, &[0; 92], None).unwrap();
    let mut g = c.benchmark_group("recobox");
    g.measurement_time(Duration::from_secs(3));
    g.bench_function("insert+delete 52 B, checksum", |bench| {
        let item = [7u8; 52];
        bench.iter(|| {
            let id = b.insert(handles, &item, Some(42)).unwrap();
            b.delete(id).unwrap();
        });
    });
    let plain = b.init_type(TypeSpec::new(52, 100).checksum(false)).unwrap();
    g.bench_function("insert+delete 52 B, no checksum", |bench| {
        let item = [7u8; 52];
        bench.iter(|| {
            let id = b.insert(plain, &item, None).unwrap();
            b.delete(id).unwrap();
        });
    });
    g.bench_function("update 92 B, checksum", |bench| {
        let mut item = [0u8; 92];
        let mut n = 0u64;
        bench.iter(|| {
            n += 1;
            item[..8].copy_from_slice(&n.to_le_bytes());
            b.update(conn, &item).unwrap();
        });
    });
    g.finish();
}

fn open(c: &mut Criterion) {
    let mut g = c.benchmark_group("recobox open+validate");
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(5));
    for n in [20_000u32, 1_000_000] {
        let dir = shm();
        let path = dir.path().join("box");
        {
            let b = RecoveryBox::create(
                &path,
                CreateOptions {
                    size_bytes: 256 << 20,
                    type_slots: 8,
                },
            )
            .unwrap();
            let t = b.init_type(TypeSpec::new(52, n)).unwrap();
            let item = [3u8; 52];
            let batch: Vec<&[u8]> = vec![&item; 1000];
            for _ in 0..n / 1000 {
                b.insert_many(t, &batch, None).unwrap();
            }
        }
        g.bench_with_input(BenchmarkId::new("items", n), &path, |bench, path| {
            bench.iter(|| {
                let b = RecoveryBox::open(path).unwrap();
                assert_eq!(b.open_report().items, u64::from(n));
            });
        });
    }
    g.finish();
}

criterion_group!(benches, ops, open);
criterion_main!(benches);

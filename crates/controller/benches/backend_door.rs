//! What the fault-injecting layer at the backend door costs when nothing
//! is armed (the bound: at most 1% of an I/O): a 4 KiB `pwrite`
//! and `pread` on one device file in /dev/shm, straight to the
//! `FileDevice` and through a disarmed `FaultyDevice`, alternating, twice,
//! in one run.
//!
//! `cargo bench -p controller --bench backend_door`

use std::sync::Arc;
use std::time::Duration;

use controller::backend::device::{Device, FileDevice};
use controller::backend::faulty::{FaultPlan, FaultyDevice};
use criterion::{Criterion, criterion_group, criterion_main};

const BLOCKS: u64 = 4096;

fn shm() -> tempfile::TempDir {
    tempfile::tempdir_in("/dev/shm").unwrap_or_else(|_| tempfile::tempdir().unwrap())
}

fn io(dev: &dyn Device, i: &mut u64, buf: &mut [u8]) {
    let offset = (*i % BLOCKS) * 4096;
    *i = i
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    dev.write_at(buf, offset).unwrap();
    dev.read_at(buf, offset).unwrap();
}

fn door(c: &mut Criterion) {
    let dir = shm();
    let plain =
        FileDevice::open_or_create(&dir.path().join("plain"), BLOCKS * 4096, false).unwrap();
    let inner =
        FileDevice::open_or_create(&dir.path().join("faulty"), BLOCKS * 4096, false).unwrap();
    let faulty = FaultyDevice::new(inner, 0, Arc::new(FaultPlan::default()), false);
    let mut g = c.benchmark_group("backend door: 4 KiB pwrite + pread");
    g.measurement_time(Duration::from_secs(4));
    let mut buf = vec![0x5au8; 4096];
    let mut i = 1u64;
    for round in 1..=2 {
        // Alternate which goes first: the order costs more than the layer.
        let mut cases: [(&str, &dyn Device); 2] =
            [("FileDevice", &plain), ("FaultyDevice, disarmed", &faulty)];
        if round == 2 {
            cases.reverse();
        }
        for (name, dev) in cases {
            g.bench_function(format!("{name} (round {round})"), |b| {
                b.iter(|| io(dev, &mut i, &mut buf))
            });
        }
    }
    g.finish();
}

criterion_group!(benches, door);
criterion_main!(benches);

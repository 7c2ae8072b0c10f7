//! Crash test with real processes: a child process performs random inserts,
//! updates, deletes and atomic two-item inserts on a box in a loop and is
//! SIGKILLed at a random moment; after each kill the parent opens the box,
//! which must be trusted, and checks every item: each is exactly its last
//! completed value or, for the one operation in flight, the value being
//! written, never a mix; counts and free lists are validated by `open`, so
//! nothing leaked.
//!
//! The child logs each operation in a shared mapped file *before* starting
//! it (begun, with everything needed to rebuild its data) and after it
//! returns (done, with the slot it used). `RECOBOX_KILLS` sets the number of
//! kills (default 1000). Runs without the libtest harness: the same binary
//! is parent and child.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use memmap2::MmapMut;
use recobox::{CreateOptions, ItemId, RecoveryBox, TypeId, TypeSpec};

const LOG_ENTRY: usize = 48;
const LOG_ENTRIES: usize = 1 << 16;
const BEGUN: u32 = 1;
const DONE: u32 = 2;
const INSERT: u32 = 1;
const DELETE: u32 = 2;
const UPDATE: u32 = 3;
const INSERT2: u32 = 4;
/// (item size, capacity, checksums) of the three types.
const TYPES: [(u32, u32, bool); 3] = [(52, 48, true), (92, 24, true), (20, 16, false)];

fn data(seed: u64, len: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    state: u32,
    op: u32,
    ty: u32,
    slot: u32,
    slot2: u32,
    seed: u64,
}

fn log_put(log: &mut [u8], i: usize, e: Entry) {
    let b = &mut log[i * LOG_ENTRY..(i + 1) * LOG_ENTRY];
    b[4..8].copy_from_slice(&e.op.to_le_bytes());
    b[8..12].copy_from_slice(&e.ty.to_le_bytes());
    b[12..16].copy_from_slice(&e.slot.to_le_bytes());
    b[16..20].copy_from_slice(&e.slot2.to_le_bytes());
    b[24..32].copy_from_slice(&e.seed.to_le_bytes());
    std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
    b[0..4].copy_from_slice(&e.state.to_le_bytes());
    std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
}

fn log_get(log: &[u8], i: usize) -> Entry {
    let b = &log[i * LOG_ENTRY..(i + 1) * LOG_ENTRY];
    let u = |a: usize| u32::from_le_bytes(b[a..a + 4].try_into().unwrap());
    Entry {
        state: u(0),
        op: u(4),
        ty: u(8),
        slot: u(12),
        slot2: u(16),
        seed: u64::from_le_bytes(b[24..32].try_into().unwrap()),
    }
}

fn type_ids(b: &RecoveryBox) -> Vec<TypeId> {
    (0..TYPES.len() as u64)
        .map(|i| b.type_by_app_id(i).expect("type exists"))
        .collect()
}

/// The child: random operations until killed.
fn child(box_path: &Path, log_path: &Path, seed: u64) {
    let b = RecoveryBox::open(box_path).expect("child: box opens");
    let types = type_ids(&b);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(log_path)
        .unwrap();
    // SAFETY: the log file is ours for this test; the parent reads it only
    // after this process is dead.
    let mut log = unsafe { MmapMut::map_mut(&file) }.unwrap();
    let mut live: Vec<Vec<u32>> = types
        .iter()
        .map(|&t| {
            b.items(t)
                .unwrap()
                .into_iter()
                .map(|(id, _, _)| id.index)
                .collect()
        })
        .collect();
    let mut rng = seed | 1;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for i in 0..LOG_ENTRIES {
        let r = next();
        let t = (r % 3) as usize;
        let (_, cap, _) = TYPES[t];
        let items = &mut live[t];
        let pick = |r: u64, items: &Vec<u32>| items[(r >> 8) as usize % items.len()];
        let value = next();
        let op = choose_op((r >> 4) % 4, items.len(), cap as usize);
        let slot = if matches!(op, DELETE | UPDATE) {
            pick(value, items)
        } else {
            u32::MAX
        };
        let begun = Entry {
            state: BEGUN,
            op,
            ty: t as u32,
            slot,
            slot2: u32::MAX,
            seed: value,
        };
        log_put(&mut log, i, begun);
        let done = perform(&b, types[t], items, begun);
        log_put(&mut log, i, done);
    }
    // Ran out of log: wait to be killed.
    std::thread::sleep(Duration::from_secs(3600));
}

/// The operation for a random `choice` (0 to 3) on a type with `len` of
/// `cap` items live: an insert when empty, never past the capacity.
fn choose_op(choice: u64, len: usize, cap: usize) -> u32 {
    match choice {
        _ if len == 0 => INSERT,
        0 if len < cap => INSERT,
        1 => DELETE,
        2 => UPDATE,
        3 if len + 2 <= cap => INSERT2,
        _ => UPDATE,
    }
}

/// Perform the operation `begun` logs on type `ty`, keeping its live slots
/// `items`; returns the done entry, with the slots it used.
fn perform(b: &RecoveryBox, ty: TypeId, items: &mut Vec<u32>, begun: Entry) -> Entry {
    let (size, _, _) = TYPES[begun.ty as usize];
    let (slot, value) = (begun.slot, begun.seed);
    let mut done = Entry {
        state: DONE,
        ..begun
    };
    match begun.op {
        INSERT => {
            let id = b.insert(ty, &data(value, size), Some(value)).unwrap();
            items.push(id.index);
            done.slot = id.index;
        }
        DELETE => {
            b.delete(ItemId { ty, index: slot }).unwrap();
            items.retain(|&s| s != slot);
        }
        UPDATE => b
            .update(ItemId { ty, index: slot }, &data(value, size))
            .unwrap(),
        _ => {
            let (d1, d2) = (data(value, size), data(value ^ 1, size));
            let ids = b
                .insert_many(ty, &[&d1, &d2], Some(&[value, value ^ 1]))
                .unwrap();
            items.extend(ids.iter().map(|id| id.index));
            done.slot = ids[0].index;
            done.slot2 = ids[1].index;
        }
    }
    done
}

/// Per type: slot -> (app id, data).
type Model = Vec<BTreeMap<u32, (u64, Vec<u8>)>>;

fn observe(b: &RecoveryBox) -> Model {
    type_ids(b)
        .into_iter()
        .map(|t| {
            b.items(t)
                .unwrap()
                .into_iter()
                .map(|(id, app, d)| (id.index, (app.expect("every item has an app id"), d)))
                .collect()
        })
        .collect()
}

/// Apply a completed operation to the model.
fn apply(model: &mut Model, e: &Entry) {
    let (size, _, _) = TYPES[e.ty as usize];
    let m = &mut model[e.ty as usize];
    match e.op {
        INSERT => {
            m.insert(e.slot, (e.seed, data(e.seed, size)));
        }
        DELETE => {
            m.remove(&e.slot);
        }
        UPDATE => {
            let app = m[&e.slot].0;
            m.insert(e.slot, (app, data(e.seed, size)));
        }
        _ => {
            m.insert(e.slot, (e.seed, data(e.seed, size)));
            m.insert(e.slot2, (e.seed ^ 1, data(e.seed ^ 1, size)));
        }
    }
}

/// Whether `got` is `model` with the in-flight op `e` applied entirely (its
/// slots unknown for inserts).
fn is_after(model: &Model, got: &Model, e: &Entry) -> bool {
    let (size, _, _) = TYPES[e.ty as usize];
    let t = e.ty as usize;
    for (i, (m, g)) in model.iter().zip(got).enumerate() {
        if i != t && m != g {
            return false;
        }
    }
    let (m, g) = (&model[t], &got[t]);
    match e.op {
        DELETE | UPDATE => {
            let mut want = model.clone();
            apply(&mut want, e);
            &want[t] == g
        }
        INSERT | INSERT2 => {
            let new: Vec<_> = g.iter().filter(|(k, _)| !m.contains_key(k)).collect();
            let kept = m.iter().all(|(k, v)| g.get(k) == Some(v));
            let mut want = vec![(e.seed, data(e.seed, size))];
            if e.op == INSERT2 {
                want.push((e.seed ^ 1, data(e.seed ^ 1, size)));
            }
            let mut have: Vec<_> = new.into_iter().map(|(_, v)| v.clone()).collect();
            have.sort();
            want.sort();
            kept && g.len() == m.len() + want.len() && have == want
        }
        _ => false,
    }
}

/// A fresh box with the three types of [`TYPES`].
fn create_box(box_path: &Path) {
    let b = RecoveryBox::create(
        box_path,
        CreateOptions {
            size_bytes: 1 << 20,
            type_slots: 4,
        },
    )
    .unwrap();
    for (i, &(size, cap, sum)) in TYPES.iter().enumerate() {
        b.init_type(TypeSpec::new(size, cap).app_id(i as u64).checksum(sum))
            .unwrap();
    }
}

/// Run a child on the box with a fresh log, SIGKILL it after a random
/// 0.5 to 4.5 ms, and map the log it left.
fn run_and_kill(exe: &Path, box_path: &Path, log_path: &Path, rng: u64) -> memmap2::Mmap {
    let log = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(log_path)
        .unwrap();
    log.set_len((LOG_ENTRY * LOG_ENTRIES) as u64).unwrap();
    let mut child = Command::new(exe)
        .env("RECOBOX_CHILD", "1")
        .env("RECOBOX_BOX", box_path)
        .env("RECOBOX_LOG", log_path)
        .env("RECOBOX_SEED", rng.to_string())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_micros(500 + rng % 4000));
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert!(!status.success(), "child exited on its own: {status}");
    // SAFETY: the child is dead; the log file is ours.
    unsafe { memmap2::Mmap::map(&log) }.unwrap()
}

/// Apply the log's completed operations to the model, counting them in
/// `ops_done`; returns the operation in flight at the kill, if any.
fn replay(log: &[u8], model: &mut Model, ops_done: &mut u64) -> Option<Entry> {
    for i in 0..LOG_ENTRIES {
        let e = log_get(log, i);
        match e.state {
            DONE => {
                apply(model, &e);
                *ops_done += 1;
            }
            BEGUN => return Some(e),
            _ => break,
        }
    }
    None
}

fn parent(kills: u32) {
    let dir = tempfile::tempdir().unwrap();
    let box_path = dir.path().join("box");
    let log_path = dir.path().join("log");
    create_box(&box_path);
    let mut model: Model = vec![BTreeMap::new(); TYPES.len()];
    let exe = std::env::current_exe().unwrap();
    let started = Instant::now();
    let (mut ops_done, mut in_flight_landed, mut rolled_back) = (0u64, 0u64, 0u64);
    let mut rng = 0xfeed_beef_u64;
    for kill in 0..kills {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let log = run_and_kill(&exe, &box_path, &log_path, rng);
        let in_flight = replay(&log, &mut model, &mut ops_done);
        let b = RecoveryBox::open(&box_path)
            .unwrap_or_else(|e| panic!("kill {kill}: box not trusted after SIGKILL: {e}"));
        rolled_back += u64::from(b.open_report().rolled_back);
        let got = observe(&b);
        if got != model {
            let e = in_flight.unwrap_or_else(|| {
                panic!("kill {kill}: box differs from the completed operations with none in flight")
            });
            assert!(
                is_after(&model, &got, &e),
                "kill {kill}: in-flight {e:?} left a mixed state"
            );
            in_flight_landed += 1;
        }
        model = got;
    }
    println!(
        "sigkill: {kills} kills in {:?}; {ops_done} operations completed, {in_flight_landed} in-flight operations found applied, {rolled_back} rolled back at open; every item exact",
        started.elapsed()
    );
    assert!(ops_done > u64::from(kills), "the children hardly ran");
    assert!(
        rolled_back > 0,
        "no kill ever landed inside an operation; the test would not see a torn one"
    );
}

fn main() {
    if std::env::var_os("RECOBOX_CHILD").is_some() {
        let var = |k: &str| PathBuf::from(std::env::var_os(k).expect("child env"));
        let seed: u64 = std::env::var("RECOBOX_SEED").unwrap().parse().unwrap();
        child(&var("RECOBOX_BOX"), &var("RECOBOX_LOG"), seed);
        return;
    }
    let kills = std::env::var("RECOBOX_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    parent(kills);
}

//! The recovery box's open fed the input shape of the cargo-fuzz target
//! `open` (`crates/recobox/fuzz`): a whole box image as bytes. The suite
//! runs it with proptest on generated images, through both doors: the
//! target's own (`inspect_bytes`, validation of an in-memory copy) and
//! `RecoveryBox::open` on a real file holding the same bytes.
//!
//! Two generators: raw bytes, and valid boxes (one built here with
//! checksummed and unchecked types, and the fuzz target's seed corpus
//! file) with a few bytes overwritten or flipped anywhere, and sometimes
//! truncated or extended.
//!
//! Invariants checked:
//! - Neither door panics, and they agree: an image `inspect_bytes`
//!   trusts opens, one it refuses is refused by `open` as `Untrusted`
//!   with a reason (never an I/O error: the file is readable).
//! - The fuzz target's own checks: a trusted image counts no more items
//!   per type than the type holds, and validation is idempotent.
//! - A damaged box that opens holds only checksum-valid items: exactly
//!   the original items (slot and data) of every checksummed type, and the
//!   same live types; every type's items can be listed.
//!
//! Cases scale with `REBOUND_FUZZ_CASES` (a factor; unset means 1).

use std::path::Path;
use std::sync::OnceLock;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use recobox::{CreateOptions, OpenError, RecoveryBox, TypeId, TypeSpec};

/// Cases of the raw-bytes generator.
const RAW_CASES: u32 = 1_000;
/// Cases of the damaged-box generator.
const DAMAGED_CASES: u32 = 2_000;

/// The fuzz target's seed: a box with 20 items.
const SEED: &[u8] = include_bytes!("../fuzz/corpus/open/seed-20-items");

fn cases(base: u32) -> u32 {
    let factor = std::env::var("REBOUND_FUZZ_CASES").map_or(1.0, |v| {
        v.trim()
            .parse::<f64>()
            .unwrap_or_else(|_| panic!("REBOUND_FUZZ_CASES={v:?} is not a number"))
    });
    ((f64::from(base) * factor).round() as u32).max(1)
}

fn config(base: u32) -> Config {
    Config {
        cases: cases(base),
        failure_persistence: None,
        ..Config::default()
    }
}

/// (slot, data) of each item of one type.
type Slots = Vec<(u32, Vec<u8>)>;

/// A valid image and what opening it must show.
struct Golden {
    bytes: Vec<u8>,
    types: Vec<TypeId>,
    /// Per checksummed type: (slot, data) of every item.
    checked: Vec<(TypeId, Slots)>,
}

impl Golden {
    fn of(bytes: Vec<u8>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("box");
        std::fs::write(&path, &bytes).unwrap();
        let b = RecoveryBox::open(&path).expect("a golden image opens");
        Self {
            types: b.types().iter().map(|t| t.id).collect(),
            checked: b
                .types()
                .iter()
                .filter(|t| t.checksum)
                .map(|t| (t.id, items(&b, t.id)))
                .collect(),
            bytes,
        }
    }
}

fn items(b: &RecoveryBox, t: TypeId) -> Slots {
    b.items(t)
        .expect("listing a type's items")
        .into_iter()
        .map(|(id, _, d)| (id.index, d))
        .collect()
}

/// A 16 KiB box: two checksummed types (one with deletions and
/// updates), one unchecked.
fn built() -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("box");
    let b = RecoveryBox::create(
        &path,
        CreateOptions {
            size_bytes: 16 << 10,
            type_slots: 4,
        },
    )
    .unwrap();
    let a = b.init_type(TypeSpec::new(24, 30).app_id(1)).unwrap();
    let c = b.init_type(TypeSpec::new(40, 12).app_id(2)).unwrap();
    let u = b
        .init_type(TypeSpec::new(16, 8).app_id(3).checksum(false))
        .unwrap();
    for i in 0..20u8 {
        let id = b.insert(a, &[i; 24], Some(u64::from(i))).unwrap();
        if i % 5 == 0 {
            b.delete(id).unwrap();
        }
    }
    for i in 0..8u8 {
        let id = b.insert(c, &[i ^ 0x3c; 40], None).unwrap();
        if i % 3 == 0 {
            b.update(id, &[i; 40]).unwrap();
        }
    }
    b.insert(u, &[9; 16], None).unwrap();
    drop(b);
    std::fs::read(&path).unwrap()
}

fn goldens() -> &'static [Golden] {
    static G: OnceLock<Vec<Golden>> = OnceLock::new();
    G.get_or_init(|| vec![Golden::of(built()), Golden::of(SEED.to_vec())])
}

/// Check both doors on `image`; `golden` is the box it was damaged from.
/// Returns whether the image was trusted.
fn check(image: &[u8], golden: Option<&Golden>, path: &Path) -> bool {
    // The fuzz target, verbatim in effect.
    let verdict = recobox::inspect_bytes(image.to_vec()).verdict;
    if let Ok(contents) = &verdict {
        for t in &contents.types {
            assert!(t.count <= t.max_items, "{t:?}");
        }
        assert!(recobox::inspect_bytes(image.to_vec()).verdict.is_ok());
    }
    std::fs::write(path, image).unwrap();
    match (RecoveryBox::open(path), &verdict) {
        (Ok(b), Ok(_)) => {
            for t in b.types() {
                items(&b, t.id);
            }
            if let Some(g) = golden {
                let types: Vec<TypeId> = b.types().iter().map(|t| t.id).collect();
                assert_eq!(types, g.types, "the live types");
                for (t, want) in &g.checked {
                    assert_eq!(&items(&b, *t), want, "items of checksummed type {t}");
                }
            }
        }
        (Err(OpenError::Untrusted(u)), Err(_)) => {
            assert!(!u.to_string().is_empty());
            return false;
        }
        (opened, inspected) => panic!(
            "open and inspect disagree: open {:?}, inspect {:?}",
            opened.as_ref().map(|_| "trusted"),
            inspected.as_ref().map(|_| "trusted")
        ),
    }
    true
}

#[test]
fn open_on_arbitrary_bytes_never_panics_and_refuses_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("box");
    // u64 words: a debug proptest makes one about as fast as a byte.
    let raw = prop::collection::vec(any::<u64>(), 0..600)
        .prop_map(|w| w.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
    let mut runner = TestRunner::new(config(RAW_CASES));
    let result = runner.run(&raw, |image| {
        check(&image, None, &path);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// An edit of an image: at a position (a fraction of its length), xor a
/// byte or overwrite four.
#[derive(Debug, Clone)]
enum Edit {
    Xor(prop::sample::Index, u8),
    Set(prop::sample::Index, [u8; 4]),
}

fn damaged() -> impl Strategy<Value = (usize, Vec<Edit>, Option<i32>)> {
    let edit = prop_oneof![
        3 => (any::<prop::sample::Index>(), 1u8..=255).prop_map(|(i, x)| Edit::Xor(i, x)),
        1 => (any::<prop::sample::Index>(), any::<[u8; 4]>()).prop_map(|(i, v)| Edit::Set(i, v)),
    ];
    let resize = prop_oneof![8 => Just(None), 1 => (-4096i32..4096).prop_map(Some)];
    (0usize..2, prop::collection::vec(edit, 1..6), resize)
}

#[test]
fn open_of_a_damaged_box_refuses_it_or_keeps_only_checksum_valid_items() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("box");
    let trusted = std::cell::Cell::new(0u32);
    let mut runner = TestRunner::new(config(DAMAGED_CASES));
    let result = runner.run(&damaged(), |(which, edits, resize)| {
        let g = &goldens()[which];
        let mut image = g.bytes.clone();
        for e in &edits {
            match e {
                Edit::Xor(at, x) => {
                    let at = at.index(image.len());
                    image[at] ^= x;
                }
                Edit::Set(at, v) => {
                    let at = at.index(image.len() - 3);
                    image[at..at + 4].copy_from_slice(v);
                }
            }
        }
        if let Some(d) = resize {
            let len = (image.len() as i64 + i64::from(d)).max(0) as usize;
            image.resize(len, 0);
        }
        if check(&image, Some(g), &path) {
            trusted.set(trusted.get() + 1);
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    // Damage in unused space leaves a box that opens: both verdicts are
    // exercised (given enough cases).
    let (trusted, all) = (trusted.get(), cases(DAMAGED_CASES));
    if all >= 200 {
        assert!(trusted > 0 && trusted < all, "{trusted} of {all} trusted");
    }
}

#[test]
fn the_golden_boxes_open_with_their_items() {
    for g in goldens() {
        let dir = tempfile::tempdir().unwrap();
        assert!(check(&g.bytes, Some(g), &dir.path().join("box")));
        assert!(g.checked.iter().any(|(_, items)| !items.is_empty()));
    }
}

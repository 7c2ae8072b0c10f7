//! Damage anywhere in a box: `open` reports it untrusted whenever the damage
//! lies in live data or metadata, and otherwise opens it with every item
//! intact. Truncated or extended files are always untrusted.
//!
//! Live: the header's fields (0..64 and its checksum), every type entry's
//! static part, the dynamic part (count, free-list head) of live types,
//! every info entry of live types, and the bytes of allocated
//! items of checksummed types. Not live: reserved bytes, op records when no
//! operation is in flight (a torn op record is a legitimate crash state and
//! carries nothing), free and shadow slots, unallocated space, and items of
//! types created without checksums (documented as unchecked).

use std::ops::Range;

use proptest::prelude::*;
use recobox::layout::{HEADER_BYTES, INFO_BYTES, TYPE_BYTES, type_entry_offset};
use recobox::{CreateOptions, OpenError, RecoveryBox, TypeId, TypeSpec};

/// Slot -> data of one type.
type Slots = Vec<(u32, Vec<u8>)>;

struct Golden {
    bytes: Vec<u8>,
    live: Vec<Range<usize>>,
    checked_types: Vec<(TypeId, Slots)>,
}

fn golden() -> Golden {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("box");
    let b = RecoveryBox::create(
        &path,
        CreateOptions {
            size_bytes: 64 << 10,
            type_slots: 6,
        },
    )
    .unwrap();
    let a = b.init_type(TypeSpec::new(52, 40).app_id(1)).unwrap();
    let c = b.init_type(TypeSpec::new(92, 20).app_id(2)).unwrap();
    let u = b
        .init_type(TypeSpec::new(30, 10).app_id(3).checksum(false))
        .unwrap();
    for i in 0..30u8 {
        let id = b.insert(a, &[i; 52], Some(u64::from(i))).unwrap();
        if i % 4 == 0 {
            b.delete(id).unwrap();
        }
    }
    for i in 0..12u8 {
        let id = b.insert(c, &[i ^ 0x55; 92], None).unwrap();
        if i % 3 == 0 {
            b.update(id, &[i; 92]).unwrap();
        }
    }
    b.insert(u, &[7; 30], None).unwrap();
    let mut live = vec![0..64, 124..128];
    let slots = 6;
    let used: Vec<u32> = b.types().iter().map(|t| t.id.index).collect();
    for t in 0..slots {
        let at = type_entry_offset(t);
        // A free entry's count and free-list head mean nothing.
        let end = if used.contains(&t) { 72 } else { 60 };
        live.push(at..at + end);
    }
    let mut checked_types = Vec::new();
    for info in b.types() {
        let info_start = info.region_offset as usize;
        live.push(info_start..info_start + info.max_items as usize * INFO_BYTES);
        let storage = info_start + info.max_items as usize * INFO_BYTES;
        let items: Vec<(u32, Vec<u8>)> = b
            .items(info.id)
            .unwrap()
            .into_iter()
            .map(|(id, _, d)| (id.index, d))
            .collect();
        if info.checksum {
            for (index, _) in &items {
                let s = storage + *index as usize * info.item_bytes as usize;
                live.push(s..s + info.item_bytes as usize);
            }
            checked_types.push((info.id, items));
        }
    }
    drop(b);
    const { assert!(TYPE_BYTES > 72 && HEADER_BYTES == 128) };
    Golden {
        bytes: std::fs::read(&path).unwrap(),
        live,
        checked_types,
    }
}

fn open(bytes: &[u8]) -> Result<RecoveryBox, OpenError> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("box");
    std::fs::write(&path, bytes).unwrap();
    let r = RecoveryBox::open(&path);
    std::mem::forget(dir); // keep the file while the box is open
    r
}

fn flip_and_check(g: &Golden, offset: usize, bit: u8) {
    let mut bytes = g.bytes.clone();
    bytes[offset] ^= 1 << bit;
    let live = g.live.iter().any(|r| r.contains(&offset));
    match open(&bytes) {
        Err(OpenError::Untrusted(_)) if live => {}
        Err(e) => panic!("flip at {offset} (live: {live}) gave {e}"),
        Ok(b) => {
            assert!(!live, "flip in live byte {offset} was not detected");
            for (t, items) in &g.checked_types {
                let got: Vec<(u32, Vec<u8>)> = b
                    .items(*t)
                    .unwrap()
                    .into_iter()
                    .map(|(id, _, d)| (id.index, d))
                    .collect();
                assert_eq!(&got, items, "flip at {offset} changed items of type {t}");
            }
        }
    }
}

#[test]
fn every_bit_of_the_metadata_is_protected() {
    let g = golden();
    // Exhaustive over the header and type table (every bit).
    let table_end = type_entry_offset(6);
    for offset in 0..table_end {
        for bit in [0u8, 7] {
            flip_and_check(&g, offset, bit);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]
    #[test]
    fn random_bit_flips_anywhere_are_detected_when_live(offset in 0usize..(64 << 10), bit in 0u8..8) {
        static G: std::sync::OnceLock<Golden> = std::sync::OnceLock::new();
        flip_and_check(G.get_or_init(golden), offset, bit);
    }
}

#[test]
fn truncated_or_extended_files_are_untrusted() {
    let g = golden();
    for len in [
        0,
        1,
        64,
        127,
        128,
        129,
        1000,
        g.bytes.len() / 2,
        g.bytes.len() - 1,
    ] {
        assert!(
            matches!(open(&g.bytes[..len]), Err(OpenError::Untrusted(_))),
            "truncated to {len} accepted"
        );
    }
    let mut longer = g.bytes.clone();
    longer.extend_from_slice(&[0; 4096]);
    assert!(matches!(open(&longer), Err(OpenError::Untrusted(_))));
}

#[test]
fn foreign_files_are_untrusted_with_a_reason() {
    for bytes in [
        vec![0u8; 64 << 10],
        b"hello, world".repeat(1000),
        vec![0xffu8; 8192],
    ] {
        match open(&bytes) {
            Err(OpenError::Untrusted(u)) => assert!(!u.to_string().is_empty()),
            other => panic!("foreign file accepted: {other:?}"),
        }
    }
}

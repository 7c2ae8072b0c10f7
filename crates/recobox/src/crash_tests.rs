//! Crash at every ordering point of every operation: after recovery the box
//! validates and holds exactly the state before or after the operation.
//!
//! Invariants checked: single-item insert, delete and update, multi-item
//! insert, type creation and deletion are all-or-nothing at every crash
//! point; rollback leaves counts, free lists and checksums valid.

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::layout::{INFO_BYTES, crash_point, data_start, get_u64, put_u64};
use crate::ops::TypeView;
use crate::validate::{TypeMeta, recover_and_validate, view, write_header_crc, write_type};
use crate::{TypeId, layout};

/// The logical contents: per type, slot -> (app id, data).
type State = BTreeMap<u32, BTreeMap<u32, (u64, Vec<u8>)>>;

fn state(buf: &mut [u8]) -> State {
    let v =
        recover_and_validate(buf).unwrap_or_else(|e| panic!("box not valid after recovery: {e}"));
    let mut s = State::new();
    for m in v.types.iter().filter(|m| m.live) {
        let view = view(buf, m);
        let mut items = BTreeMap::new();
        for i in 0..m.max_items {
            let info = view.info_at(i).unwrap();
            if info.allocated {
                items.insert(i, (info.app_id, view.slot(i).to_vec()));
            }
        }
        s.insert(m.id.index, items);
    }
    s
}

/// A box image with one type of 4 slots of 12 bytes, holding two items.
fn image() -> (Vec<u8>, TypeMeta) {
    let slots = 2;
    let size = data_start(slots) + 16384;
    let mut buf = vec![0u8; size as usize];
    crate::rbox::format_box(&mut buf, size, slots);
    let at = data_start(slots);
    let m = TypeMeta {
        id: TypeId {
            index: 0,
            generation: 1,
        },
        live: true,
        app_type_id: None,
        item_bytes: 12,
        max_items: 4,
        checksum: true,
        info_offset: at,
        storage_offset: at + 4 * INFO_BYTES as u64,
        region_bytes: layout::region_bytes(12, 4).unwrap(),
    };
    write_type(&mut buf, &m);
    put_u64(&mut buf, layout::H_DATA_ALLOC_END, at + m.region_bytes);
    write_header_crc(&mut buf);
    {
        let mut v = view(&mut buf, &m);
        v.format();
        v.insert(&[1; 12], Some(10)).unwrap();
        v.insert(&[2; 12], None).unwrap();
    }
    (buf, m)
}

/// Run `op` on copies of the image, crashing at ordering point 0, 1, 2, ...
/// until it completes; check every crash state.
fn exhaust(name: &str, op: impl Fn(&mut TypeView<'_>)) {
    let (base, m) = image();
    let before = state(&mut base.clone());
    let mut after_img = base.clone();
    op(&mut view(&mut after_img, &m));
    let after = state(&mut after_img);
    assert_ne!(before, after, "{name}: the operation changed nothing");
    let mut crash_at = 0;
    loop {
        let mut img = base.clone();
        crash_point::arm(crash_at);
        let crashed = catch_unwind(AssertUnwindSafe(|| op(&mut view(&mut img, &m)))).is_err();
        crash_point::disarm();
        let got = state(&mut img);
        assert!(
            got == before || got == after,
            "{name}: crash at point {crash_at} left a mixed state {got:?}"
        );
        if !crashed {
            assert_eq!(got, after, "{name}: completed without a crash");
            break;
        }
        crash_at += 1;
        assert!(crash_at < 64, "{name}: never completed");
    }
    assert!(
        crash_at >= 2,
        "{name}: only {crash_at} crash points exercised"
    );
}

#[test]
fn insert_is_atomic_at_every_crash_point() {
    exhaust("insert", |v| {
        v.insert(&[7; 12], Some(77)).unwrap();
    });
}

#[test]
fn delete_is_atomic_at_every_crash_point() {
    exhaust("delete", |v| v.delete(0).unwrap());
}

#[test]
fn update_is_atomic_at_every_crash_point() {
    exhaust("update", |v| v.update(1, &[9; 12]).unwrap());
}

#[test]
fn multi_insert_is_atomic_at_every_crash_point() {
    exhaust("insert_many", |v| {
        v.insert_many(&[&[3; 12], &[4; 12]], Some(&[30, 40]))
            .unwrap();
    });
}

#[test]
fn a_torn_multi_insert_entry_is_recovered_from_the_chain() {
    // The state in the middle of a two-item insert: op record written, the
    // first item (slot 2) written, the second item's info entry (slot 3)
    // half written when the process died.
    let (mut img, m) = image();
    let before = state(&mut img.clone());
    {
        let v = view(&mut img, &m);
        let head = v.first_free();
        assert_eq!(head, 2);
        let count = v.count();
        let next = v.info_at(head).unwrap().link;
        let r = crate::ops::OpRecord {
            code: layout::op::INSERT_MANY,
            a: 2,
            b: head,
            c: count,
            ..Default::default()
        };
        r.write(&mut v.entry[layout::T_OP..]);
        let at = head as usize * INFO_BYTES;
        crate::ops::Info {
            app_id: 5,
            allocated: true,
            link: 0,
            saved_link: next,
        }
        .write(&mut v.info[at..at + INFO_BYTES]);
        let torn = next as usize * INFO_BYTES;
        v.info[torn + 8] = 1; // state byte written, checksum not yet
    }
    assert_eq!(state(&mut img), before);
}

#[test]
fn type_creation_and_deletion_are_atomic() {
    let (base, m) = image();
    let before = state(&mut base.clone());
    // Interrupted creation of type 1: header op written, entry half done.
    let mut img = base.clone();
    let alloc_end = get_u64(&img, layout::H_DATA_ALLOC_END);
    crate::ops::OpRecord {
        code: layout::op::INIT_TYPE,
        a: 1,
        b: 1,
        d: alloc_end,
        ..Default::default()
    }
    .write(&mut img[layout::H_OP..]);
    put_u64(&mut img, layout::H_DATA_ALLOC_END, alloc_end + 4096);
    write_header_crc(&mut img);
    let entry = layout::type_entry_offset(1);
    img[entry..entry + 40].fill(0xab);
    assert_eq!(state(&mut img), before);
    assert_eq!(get_u64(&img, layout::H_DATA_ALLOC_END), alloc_end);
    // Interrupted deletion of type 0: it is live again.
    let mut img = base.clone();
    crate::ops::OpRecord {
        code: layout::op::DELETE_TYPE,
        a: 0,
        ..Default::default()
    }
    .write(&mut img[layout::H_OP..]);
    let mut dead = m;
    dead.live = false;
    write_type(&mut img, &dead);
    assert_eq!(state(&mut img), before);
}

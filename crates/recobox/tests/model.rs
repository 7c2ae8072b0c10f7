//! Random operation sequences against a reference model (a map), with the
//! box closed and reopened at random points: the box always holds exactly
//! what the model holds, and every error is the one the model predicts.

use std::collections::BTreeMap;

use proptest::prelude::*;
use recobox::{CreateOptions, ItemError, ItemId, RecoveryBox, TypeSpec};

#[derive(Debug, Clone)]
enum Op {
    Insert(u8, u8),
    InsertTwo(u8, u8),
    Delete(u8, usize),
    Update(u8, usize, u8),
    Reopen,
    RecreateType(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, any::<u8>()).prop_map(|(t, v)| Op::Insert(t, v)),
        1 => (0u8..3, any::<u8>()).prop_map(|(t, v)| Op::InsertTwo(t, v)),
        2 => (0u8..3, any::<usize>()).prop_map(|(t, i)| Op::Delete(t, i)),
        3 => (0u8..3, any::<usize>(), any::<u8>()).prop_map(|(t, i, v)| Op::Update(t, i, v)),
        1 => Just(Op::Reopen),
        1 => (0u8..3).prop_map(Op::RecreateType),
    ]
}

const SIZES: [u32; 3] = [8, 52, 92];
const CAPS: [u32; 3] = [5, 9, 3];

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn the_box_always_equals_the_model(ops in prop::collection::vec(op(), 1..120)) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("box");
        let mut b = RecoveryBox::create(&path, CreateOptions { size_bytes: 256 << 10, type_slots: 4 }).unwrap();
        let mut types: Vec<_> = (0..3).map(|t| b.init_type(TypeSpec::new(SIZES[t], CAPS[t]).app_id(t as u64)).unwrap()).collect();
        let mut model: Vec<BTreeMap<ItemId, Vec<u8>>> = vec![BTreeMap::new(); 3];
        for op in ops {
            match op {
                Op::Insert(t, v) => {
                    let t = t as usize;
                    let data = vec![v; SIZES[t] as usize];
                    match b.insert(types[t], &data, None) {
                        Ok(id) => { prop_assert!(model[t].insert(id, data).is_none(), "slot reused while live"); }
                        Err(ItemError::Full { .. }) => prop_assert_eq!(model[t].len(), CAPS[t] as usize),
                        Err(e) => prop_assert!(false, "unexpected {}", e),
                    }
                }
                Op::InsertTwo(t, v) => {
                    let t = t as usize;
                    let (d1, d2) = (vec![v; SIZES[t] as usize], vec![!v; SIZES[t] as usize]);
                    match b.insert_many(types[t], &[&d1, &d2], None) {
                        Ok(ids) => { model[t].insert(ids[0], d1); model[t].insert(ids[1], d2); }
                        Err(ItemError::Full { .. }) => prop_assert!(model[t].len() + 2 > CAPS[t] as usize),
                        Err(e) => prop_assert!(false, "unexpected {}", e),
                    }
                }
                Op::Delete(t, i) => {
                    let t = t as usize;
                    if let Some(&id) = model[t].keys().nth(i % model[t].len().max(1)) {
                        b.delete(id).unwrap();
                        model[t].remove(&id);
                        prop_assert_eq!(b.delete(id), Err(ItemError::UnknownItem(id)));
                    }
                }
                Op::Update(t, i, v) => {
                    let t = t as usize;
                    if let Some(&id) = model[t].keys().nth(i % model[t].len().max(1)) {
                        let data = vec![v; SIZES[t] as usize];
                        b.update(id, &data).unwrap();
                        model[t].insert(id, data);
                    }
                }
                Op::Reopen => {
                    drop(b);
                    b = RecoveryBox::open(&path).unwrap();
                    prop_assert_eq!(b.open_report().rolled_back, 0);
                }
                Op::RecreateType(t) => {
                    let t = t as usize;
                    b.delete_type(types[t]).unwrap();
                    types[t] = b.init_type(TypeSpec::new(SIZES[t], CAPS[t]).app_id(t as u64)).unwrap();
                    model[t].clear();
                }
            }
            for t in 0..3 {
                let got: BTreeMap<ItemId, Vec<u8>> = b.items(types[t]).unwrap().into_iter().map(|(id, _, d)| (id, d)).collect();
                prop_assert_eq!(&got, &model[t]);
            }
        }
    }
}

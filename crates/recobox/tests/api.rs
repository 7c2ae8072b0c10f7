//! The interface of Table 4, its errors, persistence across reopen, and
//! concurrent use.

use std::sync::Arc;

use recobox::{CreateError, CreateOptions, ItemError, OpenError, RecoveryBox, TypeError, TypeSpec};

fn fresh() -> (tempfile::TempDir, RecoveryBox) {
    let dir = tempfile::tempdir().unwrap();
    let b = RecoveryBox::create(
        &dir.path().join("box"),
        CreateOptions {
            size_bytes: 4 << 20,
            type_slots: 8,
        },
    )
    .unwrap();
    (dir, b)
}

#[test]
fn items_are_inserted_read_updated_and_deleted() {
    let (_d, b) = fresh();
    let t = b.init_type(TypeSpec::new(52, 100).app_id(7)).unwrap();
    let a = b.insert(t, &[1; 52], Some(1001)).unwrap();
    let c = b.insert(t, &[2; 52], None).unwrap();
    let mut out = [0u8; 52];
    assert_eq!(b.get(a, &mut out).unwrap(), Some(1001));
    assert_eq!(out, [1; 52]);
    b.update(a, &[3; 52]).unwrap();
    b.get(a, &mut out).unwrap();
    assert_eq!(out, [3; 52]);
    assert_eq!(b.type_info(t).unwrap().count, 2);
    b.delete(c).unwrap();
    assert_eq!(b.get(c, &mut out), Err(ItemError::UnknownItem(c)));
    assert_eq!(b.type_by_app_id(7), Some(t));
    assert_eq!(b.item_by_app_id(t, 1001).unwrap(), Some(a));
    assert_eq!(b.item_by_app_id(t, 9).unwrap(), None);
}

#[test]
fn contents_survive_reopen_exactly() {
    let (dir, b) = fresh();
    let t = b.init_type(TypeSpec::new(16, 10)).unwrap();
    let u = b
        .init_type(TypeSpec::new(100, 3).checksum(false).app_id(2))
        .unwrap();
    let ids = b
        .insert_many(t, &[&[5; 16], &[6; 16]], Some(&[50, 60]))
        .unwrap();
    b.insert(u, &[9; 100], None).unwrap();
    drop(b);
    let b = RecoveryBox::open(&dir.path().join("box")).unwrap();
    assert_eq!(b.open_report().rolled_back, 0);
    assert_eq!(b.open_report().items, 3);
    let items = b.items(t).unwrap();
    assert_eq!(
        items,
        vec![
            (ids[0], Some(50), vec![5; 16]),
            (ids[1], Some(60), vec![6; 16])
        ]
    );
    assert_eq!(b.type_by_app_id(2), Some(u));
    assert_eq!(b.types().len(), 2);
}

#[test]
fn wrong_lengths_full_types_and_unknown_ids_are_typed_errors() {
    let (_d, b) = fresh();
    let t = b.init_type(TypeSpec::new(8, 2)).unwrap();
    assert_eq!(
        b.insert(t, &[0; 9], None),
        Err(ItemError::WrongLength {
            ty: t,
            expected: 8,
            got: 9
        })
    );
    let a = b.insert(t, &[0; 8], None).unwrap();
    b.insert(t, &[0; 8], None).unwrap();
    assert_eq!(
        b.insert(t, &[0; 8], None),
        Err(ItemError::Full { ty: t, max: 2 })
    );
    assert_eq!(
        b.insert_many(t, &[&[0; 8]], None),
        Err(ItemError::Full { ty: t, max: 2 })
    );
    let mut small = [0u8; 4];
    assert!(matches!(
        b.get(a, &mut small),
        Err(ItemError::WrongLength { .. })
    ));
    assert!(matches!(
        b.update(a, &[1; 7]),
        Err(ItemError::WrongLength { .. })
    ));
    let mut buf = [0u8; 8];
    assert_eq!(
        b.get_all(t, &mut buf),
        Err(ItemError::BufferTooSmall { needed: 16, got: 8 })
    );
    let mut past = a;
    past.index = 99;
    assert_eq!(b.delete(past), Err(ItemError::UnknownItem(past)));
    // A type id goes stale with its type.
    b.delete_type(t).unwrap();
    assert_eq!(b.insert(t, &[0; 8], None), Err(ItemError::UnknownType(t)));
    assert_eq!(b.delete_type(t), Err(TypeError::UnknownType(t)));
    let t2 = b.init_type(TypeSpec::new(8, 2)).unwrap();
    assert_eq!(t2.index, t.index, "the slot (and region) is reused");
    assert_ne!(t2.generation, t.generation);
    assert_eq!(b.get(a, &mut buf), Err(ItemError::UnknownType(t)));
    assert!(matches!(
        b.insert_many(t2, &[&[0; 8]], Some(&[1, 2])),
        Err(ItemError::Arguments(_))
    ));
}

#[test]
fn type_creation_limits_are_typed_errors() {
    let (_d, b) = fresh();
    assert!(matches!(
        b.init_type(TypeSpec::new(0, 1)),
        Err(TypeError::ItemBytes { .. })
    ));
    assert!(matches!(
        b.init_type(TypeSpec::new(8, 0)),
        Err(TypeError::MaxItems { .. })
    ));
    assert!(matches!(
        b.init_type(TypeSpec::new(8, u32::MAX)),
        Err(TypeError::MaxItems { .. })
    ));
    assert!(matches!(
        b.init_type(TypeSpec::new(1 << 19, 100)),
        Err(TypeError::NoSpace { .. })
    ));
    b.init_type(TypeSpec::new(8, 1).app_id(3)).unwrap();
    assert_eq!(
        b.init_type(TypeSpec::new(8, 1).app_id(3)),
        Err(TypeError::DuplicateAppId(3))
    );
    for _ in 1..8 {
        b.init_type(TypeSpec::new(8, 1)).unwrap();
    }
    assert_eq!(
        b.init_type(TypeSpec::new(8, 1)),
        Err(TypeError::TableFull(8))
    );
}

#[test]
fn bad_geometry_and_missing_or_busy_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("box");
    assert!(matches!(
        RecoveryBox::create(
            &p,
            CreateOptions {
                size_bytes: 100,
                type_slots: 8
            }
        ),
        Err(CreateError::Geometry(_))
    ));
    assert!(matches!(
        RecoveryBox::create(
            &p,
            CreateOptions {
                size_bytes: 1 << 20,
                type_slots: 0
            }
        ),
        Err(CreateError::Geometry(_))
    ));
    assert!(matches!(
        RecoveryBox::open(&dir.path().join("missing")),
        Err(OpenError::Io { .. })
    ));
    let held = RecoveryBox::create(&p, CreateOptions::default()).unwrap();
    assert!(matches!(RecoveryBox::open(&p), Err(OpenError::Locked(_))));
    drop(held);
    RecoveryBox::open(&p).unwrap();
}

#[test]
fn threads_on_different_and_shared_types_keep_every_item() {
    let (dir, b) = fresh();
    let b = Arc::new(b);
    let types: Vec<_> = (0..4)
        .map(|i| b.init_type(TypeSpec::new(24, 2000).app_id(i)).unwrap())
        .collect();
    let handles: Vec<_> = (0..8u8)
        .map(|th| {
            let (b, t) = (Arc::clone(&b), types[th as usize % 4]);
            std::thread::spawn(move || {
                let mut mine = Vec::new();
                for k in 0..400u32 {
                    let mut data = [th; 24];
                    data[..4].copy_from_slice(&k.to_le_bytes());
                    let id = b
                        .insert(t, &data, Some(u64::from(th) << 32 | u64::from(k)))
                        .unwrap();
                    if k % 3 == 0 {
                        data[23] = 0xee;
                        b.update(id, &data).unwrap();
                    }
                    if k % 5 == 0 {
                        b.delete(id).unwrap();
                    } else {
                        mine.push((id, data));
                    }
                }
                mine
            })
        })
        .collect();
    let kept: Vec<_> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    drop(b);
    let b = RecoveryBox::open(&dir.path().join("box")).unwrap();
    assert_eq!(b.open_report().items, kept.len() as u64);
    let mut out = [0u8; 24];
    for (id, data) in kept {
        b.get(id, &mut out).unwrap();
        assert_eq!(out, data);
    }
}

#[test]
fn an_invalidated_box_is_not_trusted_on_open() {
    let (dir, b) = fresh();
    let t = b.init_type(TypeSpec::new(8, 4)).unwrap();
    b.insert(t, &[1; 8], None).unwrap();
    b.invalidate();
    drop(b);
    match RecoveryBox::open(&dir.path().join("box")) {
        Err(OpenError::Untrusted(u)) => assert_eq!(u.reason, recobox::Reason::NotABox),
        other => panic!("invalidated box opened: {other:?}"),
    }
}

fn small() -> CreateOptions {
    CreateOptions {
        size_bytes: 1 << 20,
        type_slots: 4,
    }
}

#[test]
fn a_created_box_is_mode_0600() {
    use std::os::unix::fs::PermissionsExt;
    let (d, b) = fresh();
    let mode = std::fs::metadata(b.path()).unwrap().permissions().mode() & 0o7777;
    assert_eq!(
        mode, 0o600,
        "the box holds state another user must not read"
    );
    drop(d);
}

#[test]
fn a_symlink_at_the_box_path_is_refused_and_its_target_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("precious");
    std::fs::write(&target, b"not a box").unwrap();
    let path = dir.path().join("box");
    std::os::unix::fs::symlink(&target, &path).unwrap();
    let err = RecoveryBox::create(&path, small()).unwrap_err();
    assert!(
        err.to_string().contains(&format!(
            "{} is a symbolic link; refusing to follow it",
            path.display()
        )),
        "{err}"
    );
    let err = RecoveryBox::open(&path).unwrap_err();
    assert!(matches!(err, OpenError::Io { .. }), "{err}");
    assert!(err.to_string().contains("is a symbolic link"), "{err}");
    assert_eq!(std::fs::read(&target).unwrap(), b"not a box");
}

#[test]
fn a_box_file_owned_by_another_user_is_refused_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("box");
    drop(RecoveryBox::create(&path, small()).unwrap());
    let before = std::fs::read(&path).unwrap();
    std::os::unix::fs::chown(&path, Some(65534), Some(65534)).unwrap();
    for err in [
        RecoveryBox::create(&path, small()).unwrap_err().to_string(),
        RecoveryBox::open(&path).unwrap_err().to_string(),
    ] {
        assert!(
            err.contains(&*path.to_string_lossy()) && err.contains("owned by uid 65534"),
            "{err}"
        );
    }
    assert_eq!(std::fs::read(&path).unwrap(), before, "not truncated");
}

//! The recovery box: create, open (validate and recover), and the item and
//! type operations of the paper's Table 4.

use std::fs::File;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;

use crate::backing::Backing;
use crate::error::{CreateError, ItemError, OpenError, TypeError};
use crate::layout::{
    H_DATA_ALLOC_END, H_DATA_START, H_HEADER_BYTES, H_LAYOUT_HASH, H_MAGIC, H_NEXT_GENERATION,
    H_OP, H_TOTAL, H_TYPE_SLOTS, H_VERSION, HEADER_BYTES, INFO_BYTES, MAGIC, TYPE_BYTES, VERSION,
    data_start, get_u32, get_u64, layout_hash, op, put_u32, put_u64, region_bytes,
    type_entry_offset,
};
use crate::ops::{OpRecord, TypeView};
use crate::validate::{self, TypeMeta, encode_type, recover_and_validate, write_header_crc};
use crate::{ITEM_BYTES_MAX, MAX_ITEMS_MAX, TYPE_SLOTS_MAX};
use crate::{ItemId, TypeId, TypeInfo, TypeSpec};

/// An item read back: its id, application id and data.
pub type Item = (ItemId, Option<u64>, Vec<u8>);

/// Sizes for [`RecoveryBox::create`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CreateOptions {
    /// Size of the box file.
    pub size_bytes: u64,
    /// Types it can hold.
    pub type_slots: u32,
}

impl Default for CreateOptions {
    fn default() -> Self {
        Self {
            size_bytes: 64 << 20,
            type_slots: 64,
        }
    }
}

/// What `open` found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenReport {
    /// Interrupted operations rolled back.
    pub rolled_back: u32,
    /// Live types.
    pub types: u32,
    /// Allocated items.
    pub items: u64,
}

/// An open recovery box.
pub struct RecoveryBox {
    path: PathBuf,
    _file: File,
    backing: Backing,
    header: Mutex<()>,
    types: Box<[Mutex<TypeMeta>]>,
    report: OpenReport,
}

impl std::fmt::Debug for RecoveryBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecoveryBox")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

fn open_file(path: &Path, create: bool) -> std::io::Result<Result<File, std::io::Error>> {
    let file = crate::file::open_private(path, create)?;
    Ok(match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(std::io::Error::new(
            std::io::ErrorKind::WouldBlock,
            "locked",
        )),
        Err(std::fs::TryLockError::Error(e)) => Err(e),
    })
}

impl RecoveryBox {
    /// Create a fresh, empty box at `path` (mode 0600), replacing a box
    /// file of ours that was there; a symbolic link, another user's file or
    /// anything but a regular file at `path` is refused and left as it is
    /// (see `file.rs`).
    pub fn create(path: &Path, options: CreateOptions) -> Result<Self, CreateError> {
        let io = |source| CreateError::Io {
            path: path.to_owned(),
            source,
        };
        let CreateOptions {
            size_bytes,
            type_slots,
        } = options;
        if type_slots == 0 || type_slots > TYPE_SLOTS_MAX {
            return Err(CreateError::Geometry(format!(
                "type slots must be within 1..={TYPE_SLOTS_MAX}"
            )));
        }
        let start = data_start(type_slots);
        if size_bytes < start || size_bytes > (1 << 40) {
            return Err(CreateError::Geometry(format!(
                "size must be within {start}..=1 TiB for {type_slots} type slots (got {size_bytes})"
            )));
        }
        let file = match open_file(path, true).map_err(io)? {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                return Err(CreateError::Locked(path.to_owned()));
            }
            Err(e) => return Err(io(e)),
        };
        file.set_len(0).map_err(io)?;
        file.set_len(size_bytes).map_err(io)?;
        let backing = Backing::map(&file).map_err(io)?;
        {
            // SAFETY: the file is new, locked by us, and mapped only here;
            // no other slice of the mapping exists yet.
            let buf = unsafe { backing.slice_mut(0, backing.len()) };
            format_box(buf, size_bytes, type_slots);
        }
        Self::assemble(path, file, backing, 0).map_err(|e| match e {
            OpenError::Io { path, source } => CreateError::Io { path, source },
            OpenError::Locked(p) => CreateError::Locked(p),
            OpenError::Untrusted(u) => {
                CreateError::Geometry(format!("fresh box failed validation: {u}"))
            }
        })
    }

    /// Open an existing box: roll back an interrupted operation, validate
    /// everything, and return it, or the reason it cannot be trusted. The
    /// file is refused as by [`RecoveryBox::create`] unless it is our own
    /// regular file.
    pub fn open(path: &Path) -> Result<Self, OpenError> {
        let io = |source| OpenError::Io {
            path: path.to_owned(),
            source,
        };
        let file = match open_file(path, false).map_err(io)? {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                return Err(OpenError::Locked(path.to_owned()));
            }
            Err(e) => return Err(io(e)),
        };
        let len = file.metadata().map_err(io)?.len();
        if len < HEADER_BYTES as u64 {
            return Err(crate::error::untrusted(
                crate::Reason::Truncated,
                format!("{len} bytes, shorter than the header"),
            )
            .into());
        }
        let backing = Backing::map(&file).map_err(io)?;
        Self::assemble(path, file, backing, 0)
    }

    fn assemble(path: &Path, file: File, backing: Backing, _: u32) -> Result<Self, OpenError> {
        let validated = {
            // SAFETY: the file is locked by us and mapped only here; no
            // other slice of the mapping exists while this one lives.
            let buf = unsafe { backing.slice_mut(0, backing.len()) };
            recover_and_validate(buf)?
        };
        let mut items = 0u64;
        for m in validated.types.iter().filter(|m| m.live) {
            // SAFETY: as above (single-threaded, no other slice alive).
            let buf = unsafe { backing.slice_mut(0, backing.len()) };
            items += u64::from(validate::view(buf, m).count());
        }
        let report = OpenReport {
            rolled_back: validated.rolled_back,
            types: validated.types.iter().filter(|m| m.live).count() as u32,
            items,
        };
        Ok(Self {
            path: path.to_owned(),
            _file: file,
            backing,
            header: Mutex::new(()),
            types: validated.types.into_iter().map(Mutex::new).collect(),
            report,
        })
    }

    /// What `open` (or `create`) found.
    pub fn open_report(&self) -> OpenReport {
        self.report
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Mark the box untrusted on its medium (its magic is cleared), for a
    /// client that can no longer keep it current: the next `open` reports
    /// `NotABox` and the client takes its slow path, instead of trusting
    /// stale state.
    pub fn invalidate(&self) {
        let _header = self.header.lock();
        // SAFETY: the header is touched only under the header lock (held);
        // no other slice of it is alive.
        let head = unsafe { self.backing.slice_mut(0, HEADER_BYTES) };
        put_u64(head, H_MAGIC, 0);
        crate::layout::persist_order();
    }

    /// Flush to the file (`msync`), for media that survive power loss.
    pub fn sync(&self) -> std::io::Result<()> {
        self.backing.flush()
    }

    fn with_type<T>(
        &self,
        ty: TypeId,
        f: impl FnOnce(&mut TypeView<'_>) -> Result<T, ItemError>,
    ) -> Result<T, ItemError> {
        let slot = self
            .types
            .get(ty.index as usize)
            .ok_or(ItemError::UnknownType(ty))?;
        let m = slot.lock();
        if !m.live || m.id != ty {
            return Err(ItemError::UnknownType(ty));
        }
        let entry_at = type_entry_offset(ty.index);
        let info_len = m.max_items as usize * INFO_BYTES;
        let storage_len = (m.max_items as usize + 1) * m.item_bytes as usize;
        // SAFETY: the type entry and region of a live type are disjoint from
        // every other type's and from the header (validated at open, kept by
        // init_type); this type's lock is held for the slices' lifetime and
        // every access to these ranges takes it.
        let (entry, info, storage) = unsafe {
            (
                self.backing.slice_mut(entry_at, TYPE_BYTES),
                self.backing.slice_mut(m.info_offset as usize, info_len),
                self.backing
                    .slice_mut(m.storage_offset as usize, storage_len),
            )
        };
        let mut v = TypeView {
            id: ty,
            entry,
            info,
            storage,
            item_bytes: m.item_bytes as usize,
            max_items: m.max_items,
            checksum: m.checksum,
        };
        f(&mut v)
    }

    /// InsertItem: store `data` (exactly the type's item size), optionally
    /// under an application item id. Atomic.
    pub fn insert(
        &self,
        ty: TypeId,
        data: &[u8],
        app_item_id: Option<u64>,
    ) -> Result<ItemId, ItemError> {
        self.with_type(ty, |v| v.insert(data, app_item_id))
            .map(|index| ItemId { ty, index })
    }

    /// DeleteItem. Atomic.
    pub fn delete(&self, id: ItemId) -> Result<(), ItemError> {
        self.with_type(id.ty, |v| v.delete(id.index))
    }

    /// UpdateItem: replace the item's data. Atomic (shadow copy).
    pub fn update(&self, id: ItemId, data: &[u8]) -> Result<(), ItemError> {
        self.with_type(id.ty, |v| v.update(id.index, data))
    }

    /// ReturnItem: copy the item into `out` (exactly the item size); returns
    /// its application id. A checksum failure is an error, never data.
    pub fn get(&self, id: ItemId, out: &mut [u8]) -> Result<Option<u64>, ItemError> {
        self.with_type(id.ty, |v| v.get(id.index, out))
    }

    /// InsertItemArray: insert all of `items` or none, atomically.
    pub fn insert_many(
        &self,
        ty: TypeId,
        items: &[&[u8]],
        app_item_ids: Option<&[u64]>,
    ) -> Result<Vec<ItemId>, ItemError> {
        self.with_type(ty, |v| v.insert_many(items, app_item_ids))
            .map(|v| v.into_iter().map(|index| ItemId { ty, index }).collect())
    }

    /// DeleteItemArray: each deletion is atomic; the array as a whole is
    /// not (it stops at the first error).
    pub fn delete_many(&self, ids: &[ItemId]) -> Result<(), ItemError> {
        ids.iter().try_for_each(|&id| self.delete(id))
    }

    /// UpdateItemArray: each update is atomic; the array as a whole is not.
    pub fn update_many(&self, updates: &[(ItemId, &[u8])]) -> Result<(), ItemError> {
        updates.iter().try_for_each(|&(id, d)| self.update(id, d))
    }

    /// ReturnItemArray: copy every item of `ty` into `buf` (item size each,
    /// in slot order) and return their ids and application ids. If `buf` is
    /// too small, nothing is copied and the error says how much is needed.
    pub fn get_all(
        &self,
        ty: TypeId,
        buf: &mut [u8],
    ) -> Result<Vec<(ItemId, Option<u64>)>, ItemError> {
        self.with_type(ty, |v| {
            let needed = v.count() as usize * v.item_bytes;
            if buf.len() < needed {
                return Err(ItemError::BufferTooSmall {
                    needed,
                    got: buf.len(),
                });
            }
            let mut out = Vec::with_capacity(v.count() as usize);
            let mut at = 0;
            for i in 0..v.max_items {
                match v.info_at(i) {
                    Some(info) if !info.allocated => continue,
                    None => return Err(ItemError::Corrupt(ItemId { ty, index: i })),
                    Some(_) => {}
                }
                let app = v.get(i, &mut buf[at..at + v.item_bytes])?;
                at += v.item_bytes;
                out.push((ItemId { ty, index: i }, app));
            }
            Ok(out)
        })
    }

    /// Every item of `ty` as `(id, app id, data)`.
    pub fn items(&self, ty: TypeId) -> Result<Vec<Item>, ItemError> {
        let info = self.type_info(ty).ok_or(ItemError::UnknownType(ty))?;
        let mut buf = vec![0u8; info.count as usize * info.item_bytes as usize];
        let ids = self.get_all(ty, &mut buf)?;
        Ok(ids
            .into_iter()
            .zip(buf.chunks(info.item_bytes as usize))
            .map(|((id, app), d)| (id, app, d.to_vec()))
            .collect())
    }

    /// GetItemIDMapping: the item with application id `app_item_id`
    /// (a linear scan, as in the paper; keep your own map for hot lookups).
    pub fn item_by_app_id(
        &self,
        ty: TypeId,
        app_item_id: u64,
    ) -> Result<Option<ItemId>, ItemError> {
        self.with_type(ty, |v| {
            Ok((0..v.max_items)
                .find(|&i| {
                    v.info_at(i)
                        .is_some_and(|f| f.allocated && f.app_id == app_item_id)
                })
                .map(|index| ItemId { ty, index }))
        })
    }

    /// GetTypeIDMapping: the live type with application id `app_type_id`.
    pub fn type_by_app_id(&self, app_type_id: u64) -> Option<TypeId> {
        self.types.iter().find_map(|m| {
            let m = m.lock();
            (m.live && m.app_type_id == Some(app_type_id)).then_some(m.id)
        })
    }

    /// Description of a live type.
    pub fn type_info(&self, ty: TypeId) -> Option<TypeInfo> {
        let m = *self.types.get(ty.index as usize)?.lock();
        if !m.live || m.id != ty {
            return None;
        }
        let count = self.with_type(ty, |v| Ok(v.count())).ok()?;
        Some(TypeInfo::from_meta(&m, count))
    }

    /// Every live type.
    pub fn types(&self) -> Vec<TypeInfo> {
        let ids: Vec<TypeId> = self
            .types
            .iter()
            .filter_map(|m| {
                let m = m.lock();
                m.live.then_some(m.id)
            })
            .collect();
        ids.into_iter().filter_map(|t| self.type_info(t)).collect()
    }

    /// InitItemType: a new type. Atomic.
    pub fn init_type(&self, spec: TypeSpec) -> Result<TypeId, TypeError> {
        let need = Self::region_for(&spec)?;
        let _header = self.header.lock();
        if let Some(app) = spec.app_type_id
            && self.type_by_app_id(app).is_some()
        {
            return Err(TypeError::DuplicateAppId(app));
        }
        let (index, reuse) = self.free_slot(need)?;
        let mut slot = self.types[index].lock();
        let entry_at = type_entry_offset(index as u32);
        // SAFETY: the header is touched only under the header lock (held),
        // and this type's entry only under its lock (held); the two ranges
        // are disjoint and no other slice of them is alive.
        let (head, entry) = unsafe {
            (
                self.backing.slice_mut(0, HEADER_BYTES),
                self.backing.slice_mut(entry_at, TYPE_BYTES),
            )
        };
        let alloc_end = get_u64(head, H_DATA_ALLOC_END);
        let (offset, region) = if reuse {
            (slot.info_offset, slot.region_bytes)
        } else {
            let free = self.backing.len() as u64 - alloc_end;
            if need > free {
                return Err(TypeError::NoSpace { needed: need, free });
            }
            (alloc_end, need)
        };
        let generation = get_u32(head, H_NEXT_GENERATION).wrapping_add(1).max(1);
        OpRecord {
            code: op::INIT_TYPE,
            a: index as u32,
            b: u32::from(!reuse),
            d: alloc_end,
            ..Default::default()
        }
        .write(&mut head[H_OP..]);
        put_u32(head, H_NEXT_GENERATION, generation);
        if !reuse {
            put_u64(head, H_DATA_ALLOC_END, alloc_end + need);
        }
        write_header_crc(head);
        let meta = TypeMeta {
            id: TypeId {
                index: index as u32,
                generation,
            },
            live: true,
            app_type_id: spec.app_type_id,
            item_bytes: spec.item_bytes,
            max_items: spec.max_items,
            checksum: spec.checksum,
            info_offset: offset,
            storage_offset: offset + u64::from(spec.max_items) * INFO_BYTES as u64,
            region_bytes: region,
        };
        encode_type(entry, &meta);
        {
            // SAFETY: the new type's region is free space (bump-allocated
            // past every live region, or the region of a free slot, which
            // no live type uses); the type's lock is held and nothing else
            // references it.
            let buf_region = unsafe { self.backing.slice_mut(offset as usize, need as usize) };
            let (info, storage) = buf_region.split_at_mut(spec.max_items as usize * INFO_BYTES);
            let mut v = TypeView {
                id: meta.id,
                entry: &mut *entry,
                info,
                storage,
                item_bytes: spec.item_bytes as usize,
                max_items: spec.max_items,
                checksum: spec.checksum,
            };
            v.format();
        }
        OpRecord::clear(&mut head[H_OP..]);
        *slot = meta;
        Ok(meta.id)
    }

    /// The bytes a type of `spec` needs (item info, then storage), once its
    /// sizes are checked against the limits.
    fn region_for(spec: &TypeSpec) -> Result<u64, TypeError> {
        if spec.item_bytes == 0 || spec.item_bytes > ITEM_BYTES_MAX {
            return Err(TypeError::ItemBytes {
                got: spec.item_bytes,
                max: ITEM_BYTES_MAX,
            });
        }
        if spec.max_items == 0 || spec.max_items > MAX_ITEMS_MAX {
            return Err(TypeError::MaxItems {
                got: spec.max_items,
                max: MAX_ITEMS_MAX,
            });
        }
        region_bytes(spec.item_bytes, spec.max_items).ok_or(TypeError::MaxItems {
            got: spec.max_items,
            max: MAX_ITEMS_MAX,
        })
    }

    /// A free slot whose old region fits (`reuse` true), else any free slot
    /// and fresh space. The caller holds the header lock.
    fn free_slot(&self, need: u64) -> Result<(usize, bool), TypeError> {
        let mut any = None;
        let mut fit = None;
        for (i, m) in self.types.iter().enumerate() {
            let m = m.lock();
            if !m.live {
                any.get_or_insert(i);
                if m.region_bytes >= need && fit.is_none() {
                    fit = Some(i);
                }
            }
        }
        match (fit, any) {
            (Some(i), _) => Ok((i, true)),
            (None, Some(i)) => Ok((i, false)),
            (None, None) => Err(TypeError::TableFull(self.types.len() as u32)),
        }
    }

    /// DeleteItemType: the type and its items are gone; its region can be
    /// reused by a later type that fits. Atomic.
    pub fn delete_type(&self, ty: TypeId) -> Result<(), TypeError> {
        let _header = self.header.lock();
        let mut slot = self
            .types
            .get(ty.index as usize)
            .ok_or(TypeError::UnknownType(ty))?
            .lock();
        if !slot.live || slot.id != ty {
            return Err(TypeError::UnknownType(ty));
        }
        // SAFETY: the header under the header lock (held), this type's entry
        // under its lock (held); disjoint ranges, no other slice alive.
        let (head, entry) = unsafe {
            (
                self.backing.slice_mut(0, HEADER_BYTES),
                self.backing
                    .slice_mut(type_entry_offset(ty.index), TYPE_BYTES),
            )
        };
        OpRecord {
            code: op::DELETE_TYPE,
            a: ty.index,
            ..Default::default()
        }
        .write(&mut head[H_OP..]);
        slot.live = false;
        encode_type(entry, &slot);
        OpRecord::clear(&mut head[H_OP..]);
        Ok(())
    }
}

/// Write an empty box: header, free type table.
pub(crate) fn format_box(buf: &mut [u8], size: u64, type_slots: u32) {
    buf[..type_entry_offset(type_slots)].fill(0);
    put_u64(buf, H_MAGIC, 0);
    put_u32(buf, H_VERSION, VERSION);
    put_u32(buf, H_HEADER_BYTES, HEADER_BYTES as u32);
    put_u64(buf, H_TOTAL, size);
    put_u64(buf, H_LAYOUT_HASH, layout_hash());
    put_u32(buf, H_TYPE_SLOTS, type_slots);
    put_u32(buf, H_NEXT_GENERATION, 0);
    put_u64(buf, H_DATA_START, data_start(type_slots));
    put_u64(buf, H_DATA_ALLOC_END, data_start(type_slots));
    OpRecord::clear(&mut buf[H_OP..]);
    for index in 0..type_slots {
        let m = TypeMeta {
            id: TypeId {
                index,
                generation: 0,
            },
            live: false,
            app_type_id: None,
            item_bytes: 0,
            max_items: 0,
            checksum: false,
            info_offset: 0,
            storage_offset: 0,
            region_bytes: 0,
        };
        crate::validate::write_type(buf, &m);
        let at = type_entry_offset(index);
        OpRecord::clear(&mut buf[at + crate::layout::T_OP..]);
    }
    // The magic goes last: a crash while formatting leaves no box.
    crate::layout::persist_order();
    put_u64(buf, H_MAGIC, MAGIC);
    write_header_crc(buf);
}

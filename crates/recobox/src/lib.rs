//! # recobox: the recovery box
//!
//! Baker and Sullivan, *The Recovery Box: Using Fast Recovery to Provide
//! High Availability in the UNIX Environment* (`papers/recovery-box.txt`):
//! "a stable area of memory in which the system stores carefully selected
//! pieces of system state, and from which the system can be regenerated
//! quickly. Error detection using checksums allows the system to revert to
//! its traditional reboot sequence if the recovery box data is corrupted."
//!
//! Here the stable memory is a file mapped shared (by default under
//! `/dev/shm`, where it outlives the process; any path works, e.g. a file on
//! disk or a DAX mount, with [`RecoveryBox::sync`] for power-loss
//! durability). [`RecoveryBox::open`] validates everything and returns
//! either a usable box or an [`Untrusted`] reason, on which the caller takes
//! its slow path (a hard restart). It never hands out damaged data.
//!
//! ## Interface (paper, Table 4)
//!
//! | paper | here |
//! |---|---|
//! | InitItemType, DeleteItemType | [`RecoveryBox::init_type`], [`RecoveryBox::delete_type`] |
//! | InsertItem, DeleteItem, UpdateItem, ReturnItem | [`insert`](RecoveryBox::insert), [`delete`](RecoveryBox::delete), [`update`](RecoveryBox::update), [`get`](RecoveryBox::get) |
//! | InsertItemArray, DeleteItemArray, UpdateItemArray, ReturnItemArray | [`insert_many`](RecoveryBox::insert_many) (atomic), [`delete_many`](RecoveryBox::delete_many), [`update_many`](RecoveryBox::update_many), [`get_all`](RecoveryBox::get_all) |
//! | GetTypeIDMapping, GetItemIDMapping | [`type_by_app_id`](RecoveryBox::type_by_app_id), [`item_by_app_id`](RecoveryBox::item_by_app_id) |
//!
//! The interface is structured, as the paper's: clients never get a pointer
//! into the box; every copy in or out is length-checked against the type's
//! item size.
//!
//! ## Format (version 1)
//!
//! ```text
//! | header 128 B | type table: type_slots x 128 B | data area: per live type,
//! |  magic, version, layout hash, size, next type    info array (24 B per item)
//! |  generation, data area bounds, type-level op     + storage array ((max+1) x item size,
//! |  record, crc                                       the last slot: update shadow)
//! ```
//!
//! Every field, with its offset, is in [`layout`]. All integers are
//! little-endian; all offsets are relative to the start of the file, so it
//! can be mapped anywhere. Checksums are CRC32C (hardware-accelerated):
//! over the header, each type entry (static part, and count + free-list head
//! separately), each info entry, each op record, and each item when the
//! type was created with checksums on.
//!
//! ## Crash assumptions and atomicity
//!
//! The box survives the death of its process: stores made before the crash
//! are in the page cache, in program order as far as the release fences
//! between phases order them. (On `/dev/shm` it does not survive a reboot;
//! on a file on persistent storage, `sync` makes it survive power loss.)
//!
//! Every single-item insert, delete and update is atomic under a crash at
//! any instruction: each operation first writes an op record naming what it
//! does and what undoing it needs (the paper's "current operation" field);
//! an update first copies the item to the type's shadow slot. `open` rolls
//! back whatever op record it finds (see [`ops`](crate::ops)). Multi-item
//! insert is atomic too (all or none). Multi-item delete and update are a
//! series of atomic single-item operations: after a crash, a prefix of them
//! happened. Type creation and deletion are atomic.
//!
//! ## Concurrency
//!
//! Any number of threads may use one box. Each type has its own lock and its
//! own op record, so operations on different types never serialise; type
//! creation and deletion also take a header lock.
//!
//! ## Not covered
//!
//! Items of a type created without checksums are not checked: damage to
//! their bytes goes undetected (their metadata is still checked). A stale
//! [`ItemId`] (of a deleted item whose slot was reused) refers to the new
//! item; [`TypeId`]s carry a generation and go stale with their type.

#![deny(unsafe_op_in_unsafe_fn)]

mod backing;
mod checksum;
#[cfg(test)]
mod crash_tests;
mod error;
mod file;
mod inspect;
pub mod layout;
pub mod ops;
mod rbox;
mod validate;

pub use error::{CreateError, ItemError, OpenError, Reason, TypeError, Untrusted};
pub use inspect::{Contents, Inspection, inspect, inspect_bytes};
pub use rbox::{CreateOptions, Item, OpenReport, RecoveryBox};

/// Largest item.
pub const ITEM_BYTES_MAX: u32 = 1 << 20;
/// Most items of one type.
pub const MAX_ITEMS_MAX: u32 = 1 << 26;
/// Most type slots in one box.
pub const TYPE_SLOTS_MAX: u32 = 4096;

/// A type of items: its slot in the type table and its generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TypeId {
    /// Slot in the type table.
    pub index: u32,
    /// Generation (changes when the slot is reused).
    pub generation: u32,
}

impl std::fmt::Display for TypeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.index, self.generation)
    }
}

/// An item: its type and slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ItemId {
    /// Its type.
    pub ty: TypeId,
    /// Its slot in the type's arrays.
    pub index: u32,
}

impl std::fmt::Display for ItemId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.ty, self.index)
    }
}

/// What [`RecoveryBox::init_type`] creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TypeSpec {
    /// Size of every item of the type.
    pub item_bytes: u32,
    /// Most items valid at once.
    pub max_items: u32,
    /// The application's own, well-known id for the type.
    pub app_type_id: Option<u64>,
    /// Checksum every item (detects damage to item bytes).
    pub checksum: bool,
}

impl TypeSpec {
    /// Items of `item_bytes`, at most `max_items`, checksummed, no app id.
    pub fn new(item_bytes: u32, max_items: u32) -> Self {
        Self {
            item_bytes,
            max_items,
            app_type_id: None,
            checksum: true,
        }
    }

    /// With an application type id.
    pub fn app_id(mut self, id: u64) -> Self {
        self.app_type_id = Some(id);
        self
    }

    /// With or without item checksums.
    pub fn checksum(mut self, on: bool) -> Self {
        self.checksum = on;
        self
    }
}

/// Description of a live type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TypeInfo {
    /// Its id.
    pub id: TypeId,
    /// Its application id.
    pub app_type_id: Option<u64>,
    /// Item size.
    pub item_bytes: u32,
    /// Capacity.
    pub max_items: u32,
    /// Items allocated.
    pub count: u32,
    /// Item checksums on.
    pub checksum: bool,
    /// Offset of its region in the box (info array first, then storage).
    pub region_offset: u64,
    /// Bytes of its region (info, storage, shadow).
    pub region_bytes: u64,
}

impl TypeInfo {
    pub(crate) fn from_meta(m: &validate::TypeMeta, count: u32) -> Self {
        Self {
            id: m.id,
            app_type_id: m.app_type_id,
            item_bytes: m.item_bytes,
            max_items: m.max_items,
            count,
            checksum: m.checksum,
            region_offset: m.info_offset,
            region_bytes: m.region_bytes,
        }
    }
}

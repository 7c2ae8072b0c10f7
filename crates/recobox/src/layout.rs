//! The byte layout of a recovery box, field by field. Every offset is
//! derived from the previous field's; sizes are asserted at compile time.
//! All integers are little-endian. All offsets stored in the box are
//! relative to its first byte, so the region can be mapped at any address.
//!
//! ```text
//! header (HEADER_BYTES = 128) at 0
//!   0  u64 magic "RBNDRBOX"          8  u32 version          12  u32 header_bytes
//!  16  u64 total_bytes              24  u64 layout_hash      32  u32 type_slots
//!  36  u32 reserved (0)             40  u32 next_generation  44  u32 reserved (0)
//!  48  u64 data_start (first byte of the data area)
//!  56  u64 data_alloc_end (first byte never given to a type)
//!  64  op record (type-level operations), 32 bytes
//!  96  reserved (0) ..124          124 u32 crc32c of bytes 0..64
//!
//! op record (OP_BYTES = 32)
//!   0  u32 code   4 u32 a   8 u32 b   12 u32 c   16 u64 d   24 u32 e   28 u32 crc32c of 0..28
//!
//! type table: type_slots entries of TYPE_BYTES = 128 at HEADER_BYTES
//!   0  u32 state (0 free, 1 live)     4  u32 flags (bit 0: item checksums)
//!   8  u64 app_type_id (u64::MAX: none)
//!  16  u32 item_bytes               20  u32 max_items
//!  24  u32 generation               28  u32 reserved (0)
//!  32  u64 info_offset              40  u64 storage_offset   48  u64 region_bytes
//!  56  u32 crc32c of 0..56 (the static part)
//!  60  u32 count                    64  u32 first_free (u32::MAX: none)
//!  68  u32 crc32c of 60..68 (the dynamic part)
//!  72  op record (item operations of this type), 32 bytes
//! 104  reserved (0) ..128
//!
//! per type, in the data area (region_bytes, 64-aligned):
//!   info array: max_items entries of INFO_BYTES = 24
//!     0  u64 app_item_id (u64::MAX: none)   8  u32 state (0 free, 1 allocated)
//!    12  u32 link: allocated -> crc32c of the item (0 without checksums);
//!                  free -> next free index (u32::MAX: end)
//!    16  u32 saved_link (an atomic multi-insert's original free link)
//!    20  u32 crc32c of 0..20
//!   storage array: (max_items + 1) slots of item_bytes; the last slot is the
//!   update shadow
//! ```

/// Magic: "RBNDRBOX".
pub const MAGIC: u64 = u64::from_le_bytes(*b"RBNDRBOX");
/// Format version.
pub const VERSION: u32 = 1;
/// "None" for ids and links.
pub const NONE32: u32 = u32::MAX;
/// "None" for application ids.
pub const NONE64: u64 = u64::MAX;

/// Header size.
pub const HEADER_BYTES: usize = 128;
pub(crate) const H_MAGIC: usize = 0;
pub(crate) const H_VERSION: usize = H_MAGIC + 8;
pub(crate) const H_HEADER_BYTES: usize = H_VERSION + 4;
pub(crate) const H_TOTAL: usize = H_HEADER_BYTES + 4;
pub(crate) const H_LAYOUT_HASH: usize = H_TOTAL + 8;
pub(crate) const H_TYPE_SLOTS: usize = H_LAYOUT_HASH + 8;
pub(crate) const H_RESERVED0: usize = H_TYPE_SLOTS + 4;
pub(crate) const H_NEXT_GENERATION: usize = H_RESERVED0 + 4;
pub(crate) const H_RESERVED1: usize = H_NEXT_GENERATION + 4;
pub(crate) const H_DATA_START: usize = H_RESERVED1 + 4;
pub(crate) const H_DATA_ALLOC_END: usize = H_DATA_START + 8;
pub(crate) const H_CRC_COVERS: usize = H_DATA_ALLOC_END + 8;
pub(crate) const H_OP: usize = H_CRC_COVERS;
pub(crate) const H_CRC: usize = 124;
const _: () = assert!(H_CRC_COVERS == 64);
const _: () = assert!(H_OP + OP_BYTES <= H_CRC);
const _: () = assert!(H_CRC + 4 == HEADER_BYTES);

/// Operation record size.
pub const OP_BYTES: usize = 32;
pub(crate) const O_CODE: usize = 0;
pub(crate) const O_A: usize = O_CODE + 4;
pub(crate) const O_B: usize = O_A + 4;
pub(crate) const O_C: usize = O_B + 4;
pub(crate) const O_D: usize = O_C + 4;
pub(crate) const O_E: usize = O_D + 8;
pub(crate) const O_CRC: usize = O_E + 4;
const _: () = assert!(O_CRC + 4 == OP_BYTES);

/// Type entry size.
pub const TYPE_BYTES: usize = 128;
pub(crate) const T_STATE: usize = 0;
pub(crate) const T_FLAGS: usize = T_STATE + 4;
pub(crate) const T_APP_ID: usize = T_FLAGS + 4;
pub(crate) const T_ITEM_BYTES: usize = T_APP_ID + 8;
pub(crate) const T_MAX_ITEMS: usize = T_ITEM_BYTES + 4;
pub(crate) const T_GENERATION: usize = T_MAX_ITEMS + 4;
pub(crate) const T_RESERVED: usize = T_GENERATION + 4;
pub(crate) const T_INFO_OFFSET: usize = T_RESERVED + 4;
pub(crate) const T_STORAGE_OFFSET: usize = T_INFO_OFFSET + 8;
pub(crate) const T_REGION_BYTES: usize = T_STORAGE_OFFSET + 8;
pub(crate) const T_STATIC_CRC: usize = T_REGION_BYTES + 8;
pub(crate) const T_COUNT: usize = T_STATIC_CRC + 4;
pub(crate) const T_FIRST_FREE: usize = T_COUNT + 4;
pub(crate) const T_DYN_CRC: usize = T_FIRST_FREE + 4;
pub(crate) const T_OP: usize = T_DYN_CRC + 4;
const _: () = assert!(T_STATIC_CRC == 56 && T_COUNT == 60 && T_DYN_CRC == 68 && T_OP == 72);
const _: () = assert!(T_OP + OP_BYTES <= TYPE_BYTES);

/// Info entry size.
pub const INFO_BYTES: usize = 24;
pub(crate) const I_APP_ID: usize = 0;
pub(crate) const I_STATE: usize = I_APP_ID + 8;
pub(crate) const I_LINK: usize = I_STATE + 4;
pub(crate) const I_SAVED_LINK: usize = I_LINK + 4;
pub(crate) const I_CRC: usize = I_SAVED_LINK + 4;
const _: () = assert!(I_CRC + 4 == INFO_BYTES);

/// Alignment of type regions in the data area.
pub const REGION_ALIGN: u64 = 64;

/// Operation codes (the `code` of an op record).
pub mod op {
    /// No operation in progress.
    pub const NONE: u32 = 0;
    /// Type-level: initialising type `a` (d: previous data_alloc_end).
    pub const INIT_TYPE: u32 = 1;
    /// Type-level: deleting type `a`.
    pub const DELETE_TYPE: u32 = 2;
    /// Insert into slot `a` (c: previous count, e: the slot's free link).
    pub const INSERT: u32 = 3;
    /// Delete slot `a` (b: previous first_free, c: previous count,
    /// d: app id, e: item crc).
    pub const DELETE: u32 = 4;
    /// Update of slot `a`, copying it to the shadow (nothing else changed yet).
    pub const UPDATE_SHADOW: u32 = 5;
    /// Update of slot `a`, shadow complete (e: previous item crc).
    pub const UPDATE_WRITE: u32 = 6;
    /// Insert `a` items from free list head `b` (c: previous count).
    pub const INSERT_MANY: u32 = 7;
}

/// Hash of this layout, stored in the header: a box written by a build with
/// another layout is refused, whatever its version field says.
pub fn layout_hash() -> u64 {
    let desc = format!(
        "recobox v{VERSION} header={HEADER_BYTES} op={OP_BYTES} type={TYPE_BYTES} info={INFO_BYTES} align={REGION_ALIGN}"
    );
    let lo = crc32c::crc32c(desc.as_bytes());
    let hi = crc32c::crc32c_append(lo, desc.as_bytes());
    (u64::from(hi) << 32) | u64::from(lo)
}

/// Bytes of a type's region: info array, storage with shadow, 64-aligned.
pub fn region_bytes(item_bytes: u32, max_items: u32) -> Option<u64> {
    let info = u64::from(max_items).checked_mul(INFO_BYTES as u64)?;
    let storage = (u64::from(max_items) + 1).checked_mul(u64::from(item_bytes))?;
    let raw = info.checked_add(storage)?;
    raw.div_ceil(REGION_ALIGN).checked_mul(REGION_ALIGN)
}

/// Offset of type entry `index`.
pub fn type_entry_offset(index: u32) -> usize {
    HEADER_BYTES + index as usize * TYPE_BYTES
}

/// Start of the data area for `type_slots` types.
pub fn data_start(type_slots: u32) -> u64 {
    (type_entry_offset(type_slots) as u64).div_ceil(REGION_ALIGN) * REGION_ALIGN
}

// Little-endian accessors on byte slices.

pub(crate) fn get_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

pub(crate) fn get_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

pub(crate) fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

pub(crate) fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

pub(crate) fn crc(b: &[u8]) -> u32 {
    crate::checksum::crc32c(b)
}

/// Order the stores before this point before the stores after it, for an
/// observer after a crash (the next process). A release fence is a compiler
/// barrier on x86 (whose stores are already ordered) and a `dmb` on ARM.
pub(crate) fn persist_order() {
    #[cfg(test)]
    crash_point::hit();
    std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
}

/// Deterministic crash injection for unit tests: a crash (an unwinding
/// panic) at the Nth ordering point of this thread.
#[cfg(test)]
pub(crate) mod crash_point {
    use std::cell::Cell;

    thread_local! {
        static COUNTDOWN: Cell<Option<u32>> = const { Cell::new(None) };
    }

    /// Crash at the `n`th ordering point from now (0: the next one).
    pub(crate) fn arm(n: u32) {
        COUNTDOWN.with(|c| c.set(Some(n)));
    }

    pub(crate) fn disarm() {
        COUNTDOWN.with(|c| c.set(None));
    }

    pub(crate) fn hit() {
        COUNTDOWN.with(|c| match c.get() {
            Some(0) => {
                c.set(None);
                panic!("simulated crash");
            }
            Some(n) => c.set(Some(n - 1)),
            None => {}
        });
    }
}

//! Validation of a whole box image, with crash recovery first.
//!
//! Order: header (magic, version, layout hash, size, checksum); the
//! type-level op record is rolled back; every type entry's static checksum
//! and geometry (bounds, no overlap between live regions); each live type's
//! op record is rolled back; then its dynamic checksum, every info entry's
//! checksum, the allocated count, the free list (visits exactly the free
//! entries, each once, no cycle), and every item checksum. Any failure is a
//! typed [`Untrusted`] reason; nothing damaged is accepted.
//!
//! The same code runs on the mapped box (`open`, which repairs in place) and
//! on a copy (`inspect`, read-only).

use crate::error::{Reason, Untrusted, untrusted};
use crate::layout::{
    H_CRC, H_CRC_COVERS, H_DATA_ALLOC_END, H_DATA_START, H_HEADER_BYTES, H_LAYOUT_HASH, H_MAGIC,
    H_OP, H_TOTAL, H_TYPE_SLOTS, H_VERSION, HEADER_BYTES, INFO_BYTES, MAGIC, NONE32, NONE64,
    T_APP_ID, T_FLAGS, T_GENERATION, T_INFO_OFFSET, T_ITEM_BYTES, T_MAX_ITEMS, T_REGION_BYTES,
    T_STATE, T_STATIC_CRC, T_STORAGE_OFFSET, TYPE_BYTES, VERSION, crc, data_start, get_u32,
    get_u64, layout_hash, op, put_u32, put_u64, region_bytes, type_entry_offset,
};
use crate::ops::{OpRecord, TypeView};
use crate::{MAX_ITEMS_MAX, TypeId};

/// Geometry from a valid header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub total: u64,
    pub type_slots: u32,
    pub data_start: u64,
    pub data_alloc_end: u64,
}

/// The fixed description of a type, from its entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TypeMeta {
    pub id: TypeId,
    pub live: bool,
    pub app_type_id: Option<u64>,
    pub item_bytes: u32,
    pub max_items: u32,
    pub checksum: bool,
    pub info_offset: u64,
    pub storage_offset: u64,
    pub region_bytes: u64,
}

pub(crate) fn write_header_crc(buf: &mut [u8]) {
    let c = crc(&buf[..H_CRC_COVERS]);
    put_u32(buf, H_CRC, c);
}

pub(crate) fn check_header(buf: &[u8]) -> Result<Geometry, Untrusted> {
    if buf.len() < HEADER_BYTES {
        return Err(untrusted(
            Reason::Truncated,
            format!("{} bytes, shorter than the header", buf.len()),
        ));
    }
    if get_u64(buf, H_MAGIC) != MAGIC {
        return Err(untrusted(Reason::NotABox, "no recovery box magic"));
    }
    if get_u32(buf, H_CRC) != crc(&buf[..H_CRC_COVERS]) {
        return Err(untrusted(Reason::MetadataChecksum, "header"));
    }
    if get_u32(buf, H_VERSION) != VERSION || get_u64(buf, H_LAYOUT_HASH) != layout_hash() {
        return Err(untrusted(
            Reason::Version,
            format!("version {} with another layout", get_u32(buf, H_VERSION)),
        ));
    }
    if get_u32(buf, H_HEADER_BYTES) as usize != HEADER_BYTES {
        return Err(untrusted(Reason::Structure, "header size"));
    }
    let g = Geometry {
        total: get_u64(buf, H_TOTAL),
        type_slots: get_u32(buf, H_TYPE_SLOTS),
        data_start: get_u64(buf, H_DATA_START),
        data_alloc_end: get_u64(buf, H_DATA_ALLOC_END),
    };
    if g.total != buf.len() as u64 {
        return Err(untrusted(
            Reason::Truncated,
            format!("{} bytes, the header records {}", buf.len(), g.total),
        ));
    }
    if g.type_slots == 0 || g.data_start != data_start(g.type_slots) || g.data_start > g.total {
        return Err(untrusted(Reason::Structure, "type table does not fit"));
    }
    if g.data_alloc_end < g.data_start || g.data_alloc_end > g.total {
        return Err(untrusted(
            Reason::Structure,
            "data allocation pointer out of range",
        ));
    }
    Ok(g)
}

/// Decode a type entry (checking its static checksum).
pub(crate) fn read_type(buf: &[u8], index: u32) -> Result<TypeMeta, Untrusted> {
    let at = type_entry_offset(index);
    let e = &buf[at..at + TYPE_BYTES];
    if get_u32(e, T_STATIC_CRC) != crc(&e[..T_STATIC_CRC]) {
        return Err(untrusted(
            Reason::MetadataChecksum,
            format!("type entry {index}"),
        ));
    }
    let state = get_u32(e, T_STATE);
    if state > 1 {
        return Err(untrusted(
            Reason::Structure,
            format!("type entry {index} state {state}"),
        ));
    }
    let app = get_u64(e, T_APP_ID);
    Ok(TypeMeta {
        id: TypeId {
            index,
            generation: get_u32(e, T_GENERATION),
        },
        live: state == 1,
        app_type_id: (app != NONE64).then_some(app),
        item_bytes: get_u32(e, T_ITEM_BYTES),
        max_items: get_u32(e, T_MAX_ITEMS),
        checksum: get_u32(e, T_FLAGS) & 1 != 0,
        info_offset: get_u64(e, T_INFO_OFFSET),
        storage_offset: get_u64(e, T_STORAGE_OFFSET),
        region_bytes: get_u64(e, T_REGION_BYTES),
    })
}

/// Encode a type entry's static part into `buf` (the whole box).
pub(crate) fn write_type(buf: &mut [u8], m: &TypeMeta) {
    let at = type_entry_offset(m.id.index);
    encode_type(&mut buf[at..at + TYPE_BYTES], m);
}

/// Encode a type entry's static part into the entry's own bytes.
pub(crate) fn encode_type(e: &mut [u8], m: &TypeMeta) {
    put_u32(e, T_STATE, u32::from(m.live));
    put_u32(e, T_FLAGS, u32::from(m.checksum));
    put_u64(e, T_APP_ID, m.app_type_id.unwrap_or(NONE64));
    put_u32(e, T_ITEM_BYTES, m.item_bytes);
    put_u32(e, T_MAX_ITEMS, m.max_items);
    put_u32(e, T_GENERATION, m.id.generation);
    put_u64(e, T_INFO_OFFSET, m.info_offset);
    put_u64(e, T_STORAGE_OFFSET, m.storage_offset);
    put_u64(e, T_REGION_BYTES, m.region_bytes);
    let c = crc(&e[..T_STATIC_CRC]);
    put_u32(e, T_STATIC_CRC, c);
}

/// Geometry of a live type must be self-consistent and inside the data area.
fn check_geometry(m: &TypeMeta, g: &Geometry) -> Result<(), Untrusted> {
    let bad = |what: &str| {
        Err(untrusted(
            Reason::Structure,
            format!("type {}: {what}", m.id),
        ))
    };
    if m.item_bytes == 0 || m.max_items == 0 || m.max_items > MAX_ITEMS_MAX {
        return bad("item size or count out of range");
    }
    let Some(need) = region_bytes(m.item_bytes, m.max_items) else {
        return bad("region size overflows");
    };
    if m.region_bytes < need {
        return bad("region smaller than its arrays");
    }
    let end = m.info_offset.checked_add(m.region_bytes);
    if m.info_offset < g.data_start || end.is_none_or(|e| e > g.data_alloc_end) {
        return bad("region outside the data area");
    }
    if m.storage_offset != m.info_offset + u64::from(m.max_items) * INFO_BYTES as u64 {
        return bad("storage array not after the info array");
    }
    Ok(())
}

/// The mutable view of one type inside a whole-box buffer.
pub(crate) fn view<'a>(buf: &'a mut [u8], m: &TypeMeta) -> TypeView<'a> {
    let entry_at = type_entry_offset(m.id.index);
    let (head, data) = buf.split_at_mut(m.info_offset as usize);
    let entry = &mut head[entry_at..entry_at + TYPE_BYTES];
    let info_len = m.max_items as usize * INFO_BYTES;
    let storage_len = (m.max_items as usize + 1) * m.item_bytes as usize;
    let (info, rest) = data.split_at_mut(info_len);
    TypeView {
        id: m.id,
        entry,
        info,
        storage: &mut rest[..storage_len],
        item_bytes: m.item_bytes as usize,
        max_items: m.max_items,
        checksum: m.checksum,
    }
}

/// Undo an interrupted type-level operation.
fn roll_back_type_op(buf: &mut [u8], g: &mut Geometry) -> Result<bool, Untrusted> {
    let r = OpRecord::read(&buf[H_OP..]);
    if r.code == op::NONE {
        return Ok(false);
    }
    if r.a >= g.type_slots {
        return Err(untrusted(
            Reason::Structure,
            "type operation names a missing slot",
        ));
    }
    // The entry itself may be torn: it was being written by the op.
    let mut m = read_type(buf, r.a).unwrap_or(TypeMeta {
        id: TypeId {
            index: r.a,
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
    });
    match r.code {
        op::INIT_TYPE => {
            m.live = false;
            if r.b == 1 {
                m.region_bytes = 0;
            }
            put_u64(buf, H_DATA_ALLOC_END, r.d);
            g.data_alloc_end = r.d;
        }
        op::DELETE_TYPE => m.live = true,
        other => {
            return Err(untrusted(
                Reason::Structure,
                format!("unknown type-level op {other}"),
            ));
        }
    }
    write_type(buf, &m);
    write_header_crc(buf);
    OpRecord::clear(&mut buf[H_OP..]);
    Ok(true)
}

/// What validation found.
#[derive(Debug, Clone)]
pub(crate) struct Validated {
    pub geometry: Geometry,
    pub types: Vec<TypeMeta>,
    pub rolled_back: u32,
}

/// Roll back interrupted operations and validate everything.
pub(crate) fn recover_and_validate(buf: &mut [u8]) -> Result<Validated, Untrusted> {
    let mut g = check_header(buf)?;
    let table_end = type_entry_offset(g.type_slots) as u64;
    if table_end > g.data_start {
        return Err(untrusted(
            Reason::Structure,
            "type table overlaps the data area",
        ));
    }
    let mut rolled_back = u32::from(roll_back_type_op(buf, &mut g)?);
    let mut types = Vec::with_capacity(g.type_slots as usize);
    for index in 0..g.type_slots {
        let m = read_type(buf, index)?;
        if m.live {
            check_geometry(&m, &g)?;
        }
        types.push(m);
    }
    check_no_overlap(&types)?;
    for m in types.iter().filter(|m| m.live) {
        let mut v = view(buf, m);
        rolled_back += u32::from(
            v.roll_back()
                .map_err(|e| untrusted(Reason::Structure, format!("type {}: {e}", m.id)))?,
        );
        validate_type(&v)?;
    }
    Ok(Validated {
        geometry: g,
        types,
        rolled_back,
    })
}

fn check_no_overlap(types: &[TypeMeta]) -> Result<(), Untrusted> {
    let mut regions: Vec<(u64, u64, TypeId)> = types
        .iter()
        .filter(|m| m.live)
        .map(|m| (m.info_offset, m.info_offset + m.region_bytes, m.id))
        .collect();
    regions.sort_unstable();
    for w in regions.windows(2) {
        if w[0].1 > w[1].0 {
            return Err(untrusted(
                Reason::Structure,
                format!("types {} and {} overlap", w[0].2, w[1].2),
            ));
        }
    }
    Ok(())
}

/// Counts, free list and checksums of one type.
pub(crate) fn validate_type(v: &TypeView<'_>) -> Result<(), Untrusted> {
    let id = v.id;
    if !v.dyn_ok() {
        return Err(untrusted(
            Reason::MetadataChecksum,
            format!("type {id} count/free list head"),
        ));
    }
    let mut allocated = 0u32;
    let mut free = vec![false; v.max_items as usize];
    for i in 0..v.max_items {
        let info = v.info_at(i).ok_or_else(|| {
            untrusted(Reason::MetadataChecksum, format!("type {id} item {i} info"))
        })?;
        if info.allocated {
            allocated += 1;
            if v.checksum && crc(v.slot(i)) != info.link {
                return Err(untrusted(
                    Reason::ItemChecksum,
                    format!("type {id} item {i}"),
                ));
            }
        } else {
            free[i as usize] = true;
        }
    }
    if allocated != v.count() {
        return Err(untrusted(
            Reason::Structure,
            format!(
                "type {id}: {allocated} items allocated, count says {}",
                v.count()
            ),
        ));
    }
    let mut seen = 0u32;
    let mut i = v.first_free();
    while i != NONE32 {
        if i >= v.max_items || !free[i as usize] {
            return Err(untrusted(
                Reason::Structure,
                format!("type {id}: free list reaches {i}, not a free slot (or twice)"),
            ));
        }
        free[i as usize] = false;
        seen += 1;
        i = v.info_at(i).map_or(NONE32, |f| f.link);
    }
    if seen != v.max_items - allocated {
        return Err(untrusted(
            Reason::Structure,
            format!(
                "type {id}: free list holds {seen} of {} free slots",
                v.max_items - allocated
            ),
        ));
    }
    Ok(())
}

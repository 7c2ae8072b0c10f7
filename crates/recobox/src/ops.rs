//! Item operations on one type, and their crash recovery (paper,
//! "Recovery Box Structure": the current-operation record and the shadow
//! copy).
//!
//! Every operation that changes a type first writes an *op record* saying
//! what it is about to do and what it needs to undo it, then changes the
//! item, its info entry and the type's count and free list, then clears the
//! record. A release fence orders each phase after the previous one. After a
//! crash at any instruction, [`TypeView::roll_back`] finds the record and
//! restores the state before the operation:
//!
//! | op | undo |
//! |---|---|
//! | insert into slot `i` | slot `i` free again with its old link, head and count restored |
//! | delete slot `i` | slot `i` allocated again with its app id and item checksum |
//! | update slot `i`, copying to the shadow | nothing changed yet |
//! | update slot `i`, shadow complete | shadow copied back, old item checksum |
//! | insert `n` items | the `n` slots taken from the free list head freed again |
//!
//! A torn op record (bad checksum) means the crash hit while it was being
//! written, before anything else changed (or after everything had): no undo.
//!
//! Invariants (checked by `validate`): `count` allocated info entries; the
//! free list from `first_free` visits exactly the other entries, each once.

use crate::error::ItemError;
use crate::layout::{
    I_APP_ID, I_CRC, I_LINK, I_SAVED_LINK, I_STATE, INFO_BYTES, NONE32, NONE64, O_A, O_B, O_C,
    O_CODE, O_CRC, O_D, O_E, OP_BYTES, T_COUNT, T_DYN_CRC, T_FIRST_FREE, T_OP, crc, get_u32,
    get_u64, op, persist_order, put_u32, put_u64,
};
use crate::{ItemId, TypeId};

/// An op record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct OpRecord {
    pub code: u32,
    pub a: u32,
    pub b: u32,
    pub c: u32,
    pub d: u64,
    pub e: u32,
}

impl OpRecord {
    /// Read a record; a torn one (bad checksum) reads as no operation.
    pub fn read(b: &[u8]) -> OpRecord {
        let r = &b[..OP_BYTES];
        if get_u32(r, O_CRC) != crc(&r[..O_CRC]) {
            return OpRecord::default();
        }
        OpRecord {
            code: get_u32(r, O_CODE),
            a: get_u32(r, O_A),
            b: get_u32(r, O_B),
            c: get_u32(r, O_C),
            d: get_u64(r, O_D),
            e: get_u32(r, O_E),
        }
    }

    /// Write the record, then order it before what follows.
    pub fn write(&self, b: &mut [u8]) {
        let r = &mut b[..OP_BYTES];
        put_u32(r, O_CODE, self.code);
        put_u32(r, O_A, self.a);
        put_u32(r, O_B, self.b);
        put_u32(r, O_C, self.c);
        put_u64(r, O_D, self.d);
        put_u32(r, O_E, self.e);
        let c = crc(&r[..O_CRC]);
        put_u32(r, O_CRC, c);
        persist_order();
    }

    /// Clear (no operation in progress): the bytes of
    /// `OpRecord::default().write`, with the all-zero record's checksum
    /// computed once (every operation ends here).
    pub fn clear(b: &mut [u8]) {
        static CLEARED_CRC: std::sync::LazyLock<u32> =
            std::sync::LazyLock::new(|| crc(&[0u8; O_CRC]));
        persist_order();
        let r = &mut b[..OP_BYTES];
        r[..O_CRC].fill(0);
        put_u32(r, O_CRC, *CLEARED_CRC);
        persist_order();
    }
}

#[cfg(test)]
mod op_record_tests {
    use super::*;

    #[test]
    fn a_cleared_record_is_byte_for_byte_the_default_record() {
        let mut a = [0xa5u8; OP_BYTES];
        let mut b = [0x5au8; OP_BYTES];
        OpRecord::clear(&mut a);
        OpRecord::default().write(&mut b);
        assert_eq!(a, b);
        assert_eq!(OpRecord::read(&a), OpRecord::default());
    }
}

/// An info entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Info {
    pub app_id: u64,
    pub allocated: bool,
    pub link: u32,
    pub saved_link: u32,
}

impl Info {
    pub fn free(link: u32) -> Self {
        Self {
            app_id: NONE64,
            allocated: false,
            link,
            saved_link: 0,
        }
    }

    /// Decode; `None` if its checksum fails.
    pub fn read(b: &[u8]) -> Option<Info> {
        if get_u32(b, I_CRC) != crc(&b[..I_CRC]) {
            return None;
        }
        let state = get_u32(b, I_STATE);
        if state > 1 {
            return None;
        }
        Some(Info {
            app_id: get_u64(b, I_APP_ID),
            allocated: state == 1,
            link: get_u32(b, I_LINK),
            saved_link: get_u32(b, I_SAVED_LINK),
        })
    }

    pub fn write(&self, b: &mut [u8]) {
        put_u64(b, I_APP_ID, self.app_id);
        put_u32(b, I_STATE, u32::from(self.allocated));
        put_u32(b, I_LINK, self.link);
        put_u32(b, I_SAVED_LINK, self.saved_link);
        let c = crc(&b[..I_CRC]);
        put_u32(b, I_CRC, c);
    }
}

/// The bytes of one live type: its entry, info array and storage.
#[derive(Debug)]
pub(crate) struct TypeView<'a> {
    pub id: TypeId,
    pub entry: &'a mut [u8],
    pub info: &'a mut [u8],
    pub storage: &'a mut [u8],
    pub item_bytes: usize,
    pub max_items: u32,
    pub checksum: bool,
}

impl TypeView<'_> {
    fn info_bytes(&mut self, i: u32) -> &mut [u8] {
        let at = i as usize * INFO_BYTES;
        &mut self.info[at..at + INFO_BYTES]
    }

    pub fn info_at(&self, i: u32) -> Option<Info> {
        let at = i as usize * INFO_BYTES;
        Info::read(&self.info[at..at + INFO_BYTES])
    }

    fn put_info(&mut self, i: u32, info: Info) {
        info.write(self.info_bytes(i));
    }

    pub fn slot(&self, i: u32) -> &[u8] {
        let at = i as usize * self.item_bytes;
        &self.storage[at..at + self.item_bytes]
    }

    fn slot_mut(&mut self, i: u32) -> &mut [u8] {
        let at = i as usize * self.item_bytes;
        &mut self.storage[at..at + self.item_bytes]
    }

    fn shadow(&self) -> u32 {
        self.max_items
    }

    pub fn count(&self) -> u32 {
        get_u32(self.entry, T_COUNT)
    }

    pub fn first_free(&self) -> u32 {
        get_u32(self.entry, T_FIRST_FREE)
    }

    pub fn dyn_ok(&self) -> bool {
        get_u32(self.entry, T_DYN_CRC) == crc(&self.entry[T_COUNT..T_DYN_CRC])
    }

    fn set_dyn(&mut self, count: u32, first_free: u32) {
        put_u32(self.entry, T_COUNT, count);
        put_u32(self.entry, T_FIRST_FREE, first_free);
        let c = crc(&self.entry[T_COUNT..T_DYN_CRC]);
        put_u32(self.entry, T_DYN_CRC, c);
    }

    fn op(&mut self) -> &mut [u8] {
        &mut self.entry[T_OP..T_OP + OP_BYTES]
    }

    fn item_crc(&self, data: &[u8]) -> u32 {
        if self.checksum { crc(data) } else { 0 }
    }

    fn check_len(&self, data: &[u8]) -> Result<(), ItemError> {
        if data.len() == self.item_bytes {
            Ok(())
        } else {
            Err(ItemError::WrongLength {
                ty: self.id,
                expected: self.item_bytes,
                got: data.len(),
            })
        }
    }

    fn item_id(&self, i: u32) -> ItemId {
        ItemId {
            ty: self.id,
            index: i,
        }
    }

    /// The info of allocated item `i`, or the matching error.
    fn allocated(&self, i: u32) -> Result<Info, ItemError> {
        if i >= self.max_items {
            return Err(ItemError::UnknownItem(self.item_id(i)));
        }
        match self.info_at(i) {
            Some(info) if info.allocated => Ok(info),
            Some(_) => Err(ItemError::UnknownItem(self.item_id(i))),
            None => Err(ItemError::Corrupt(self.item_id(i))),
        }
    }

    /// Insert an item; atomic.
    pub fn insert(&mut self, data: &[u8], app_id: Option<u64>) -> Result<u32, ItemError> {
        self.check_len(data)?;
        let i = self.first_free();
        if i == NONE32 {
            return Err(ItemError::Full {
                ty: self.id,
                max: self.max_items,
            });
        }
        let old = self
            .info_at(i)
            .filter(|f| !f.allocated)
            .ok_or(ItemError::Corrupt(self.item_id(i)))?;
        let count = self.count();
        OpRecord {
            code: op::INSERT,
            a: i,
            c: count,
            e: old.link,
            ..Default::default()
        }
        .write(self.op());
        self.slot_mut(i).copy_from_slice(data);
        let item_crc = self.item_crc(data);
        self.put_info(
            i,
            Info {
                app_id: app_id.unwrap_or(NONE64),
                allocated: true,
                link: item_crc,
                saved_link: 0,
            },
        );
        self.set_dyn(count + 1, old.link);
        OpRecord::clear(self.op());
        Ok(i)
    }

    /// Delete item `i`; atomic.
    pub fn delete(&mut self, i: u32) -> Result<(), ItemError> {
        let info = self.allocated(i)?;
        let (count, head) = (self.count(), self.first_free());
        OpRecord {
            code: op::DELETE,
            a: i,
            b: head,
            c: count,
            d: info.app_id,
            e: info.link,
        }
        .write(self.op());
        self.put_info(i, Info::free(head));
        self.set_dyn(count - 1, i);
        OpRecord::clear(self.op());
        Ok(())
    }

    /// Replace item `i`'s data; atomic (the original goes to the shadow slot first).
    pub fn update(&mut self, i: u32, data: &[u8]) -> Result<(), ItemError> {
        self.check_len(data)?;
        let info = self.allocated(i)?;
        OpRecord {
            code: op::UPDATE_SHADOW,
            a: i,
            ..Default::default()
        }
        .write(self.op());
        let (src, shadow) = (
            i as usize * self.item_bytes,
            self.shadow() as usize * self.item_bytes,
        );
        self.storage.copy_within(src..src + self.item_bytes, shadow);
        persist_order();
        OpRecord {
            code: op::UPDATE_WRITE,
            a: i,
            e: info.link,
            ..Default::default()
        }
        .write(self.op());
        self.slot_mut(i).copy_from_slice(data);
        let item_crc = self.item_crc(data);
        self.put_info(
            i,
            Info {
                link: item_crc,
                ..info
            },
        );
        OpRecord::clear(self.op());
        Ok(())
    }

    /// Copy item `i` into `out`, checking every checksum on the way.
    pub fn get(&self, i: u32, out: &mut [u8]) -> Result<Option<u64>, ItemError> {
        self.check_len(out)?;
        let info = self.allocated(i)?;
        let data = self.slot(i);
        if self.checksum && crc(data) != info.link {
            return Err(ItemError::Corrupt(self.item_id(i)));
        }
        out.copy_from_slice(data);
        Ok((info.app_id != NONE64).then_some(info.app_id))
    }

    /// Insert several items, all or none (atomic under a crash).
    pub fn insert_many(
        &mut self,
        items: &[&[u8]],
        app_ids: Option<&[u64]>,
    ) -> Result<Vec<u32>, ItemError> {
        for d in items {
            self.check_len(d)?;
        }
        if app_ids.is_some_and(|a| a.len() != items.len()) {
            return Err(ItemError::Arguments("app_ids and items differ in length"));
        }
        let n = u32::try_from(items.len()).map_err(|_| ItemError::Arguments("too many items"))?;
        if n == 0 {
            return Ok(Vec::new());
        }
        if self.max_items - self.count() < n {
            return Err(ItemError::Full {
                ty: self.id,
                max: self.max_items,
            });
        }
        let (count, head) = (self.count(), self.first_free());
        OpRecord {
            code: op::INSERT_MANY,
            a: n,
            b: head,
            c: count,
            ..Default::default()
        }
        .write(self.op());
        let mut taken = Vec::with_capacity(items.len());
        let mut i = head;
        for (k, data) in items.iter().enumerate() {
            let free = self
                .info_at(i)
                .filter(|f| !f.allocated)
                .ok_or(ItemError::Corrupt(self.item_id(i)))?;
            self.slot_mut(i).copy_from_slice(data);
            let app_id = app_ids.map_or(NONE64, |a| a[k]);
            let item_crc = self.item_crc(data);
            self.put_info(
                i,
                Info {
                    app_id,
                    allocated: true,
                    link: item_crc,
                    saved_link: free.link,
                },
            );
            taken.push(i);
            i = free.link;
        }
        self.set_dyn(count + n, i);
        OpRecord::clear(self.op());
        Ok(taken)
    }

    /// Undo an operation a crash interrupted. Returns whether there was one.
    pub fn roll_back(&mut self) -> Result<bool, String> {
        let r = OpRecord::read(self.op());
        let ok_index = |i: u32| -> Result<(), String> {
            if i < self.max_items {
                Ok(())
            } else {
                Err(format!("op record names slot {i} past {}", self.max_items))
            }
        };
        match r.code {
            op::NONE => return Ok(false),
            op::INSERT => {
                ok_index(r.a)?;
                self.put_info(r.a, Info::free(r.e));
                self.set_dyn(r.c, r.a);
            }
            op::DELETE => {
                ok_index(r.a)?;
                self.put_info(
                    r.a,
                    Info {
                        app_id: r.d,
                        allocated: true,
                        link: r.e,
                        saved_link: 0,
                    },
                );
                self.set_dyn(r.c, r.b);
            }
            op::UPDATE_SHADOW => ok_index(r.a)?,
            op::UPDATE_WRITE => {
                ok_index(r.a)?;
                let (dst, shadow) = (
                    r.a as usize * self.item_bytes,
                    self.shadow() as usize * self.item_bytes,
                );
                self.storage
                    .copy_within(shadow..shadow + self.item_bytes, dst);
                // The app id bytes were rewritten with the same value: intact
                // even if the info write was torn.
                let app_id = get_u64(&self.info[r.a as usize * INFO_BYTES..], I_APP_ID);
                self.put_info(
                    r.a,
                    Info {
                        app_id,
                        allocated: true,
                        link: r.e,
                        saved_link: 0,
                    },
                );
            }
            op::INSERT_MANY => self.roll_back_insert_many(r)?,
            other => return Err(format!("unknown op code {other}")),
        }
        OpRecord::clear(self.op());
        Ok(true)
    }

    /// Free again the slots an interrupted multi-insert took: walk the free
    /// chain from the saved head; slots already taken carry their original
    /// link in `saved_link`; at most one slot, the next on the chain, may be
    /// torn (it was being written).
    fn roll_back_insert_many(&mut self, r: OpRecord) -> Result<(), String> {
        let mut i = r.b;
        for _ in 0..r.a {
            if i >= self.max_items {
                return Err(format!("multi-insert chain leaves the array at {i}"));
            }
            match self.info_at(i) {
                Some(info) if info.allocated => {
                    self.put_info(i, Info::free(info.saved_link));
                    i = info.saved_link;
                }
                Some(_) => break,
                None => {
                    // Torn while being written: its original link is lost, so
                    // rebuild the whole free list below.
                    self.put_info(i, Info::free(NONE32));
                    self.rebuild_free_list(r.c);
                    return Ok(());
                }
            }
        }
        self.set_dyn(r.c, r.b);
        Ok(())
    }

    fn rebuild_free_list(&mut self, count: u32) {
        let mut head = NONE32;
        for i in (0..self.max_items).rev() {
            if let Some(info) = self.info_at(i)
                && !info.allocated
            {
                self.put_info(i, Info::free(head));
                head = i;
            }
        }
        self.set_dyn(count, head);
    }

    /// Format a fresh type: every slot free, chained in index order.
    pub fn format(&mut self) {
        for i in 0..self.max_items {
            let next = if i + 1 < self.max_items {
                i + 1
            } else {
                NONE32
            };
            self.put_info(i, Info::free(next));
        }
        self.set_dyn(0, 0);
        OpRecord::clear(self.op());
    }
}

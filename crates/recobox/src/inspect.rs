//! Read-only inspection (`rebound box inspect`): validates a copy of the
//! file, so nothing is written even when an interrupted operation would be
//! rolled back.

use std::path::Path;

use crate::error::{Reason, Untrusted, untrusted};
use crate::validate::{recover_and_validate, view};
use crate::{TypeInfo, layout::HEADER_BYTES};

/// What `inspect` found.
#[derive(Debug, Clone)]
pub struct Inspection {
    /// File size.
    pub file_bytes: u64,
    /// The verdict: the live types, or why the box cannot be trusted.
    pub verdict: Result<Contents, Untrusted>,
}

/// The contents of a trusted box.
#[derive(Debug, Clone)]
pub struct Contents {
    /// Type slots in the table.
    pub type_slots: u32,
    /// Live types.
    pub types: Vec<TypeInfo>,
    /// Bytes given to types (data area in use).
    pub data_used_bytes: u64,
    /// Bytes of the data area not given to any type.
    pub data_free_bytes: u64,
    /// Interrupted operations that opening it would roll back.
    pub interrupted_ops: u32,
}

/// Validate the box at `path` without changing it.
pub fn inspect(path: &Path) -> std::io::Result<Inspection> {
    Ok(inspect_bytes(std::fs::read(path)?))
}

/// Validate a box image held in memory (a copy: nothing is written back).
pub fn inspect_bytes(mut bytes: Vec<u8>) -> Inspection {
    let file_bytes = bytes.len() as u64;
    if bytes.len() < HEADER_BYTES {
        return Inspection {
            file_bytes,
            verdict: Err(untrusted(
                Reason::Truncated,
                format!("{file_bytes} bytes, shorter than the header"),
            )),
        };
    }
    let verdict = recover_and_validate(&mut bytes).map(|v| {
        let types = v
            .types
            .iter()
            .filter(|m| m.live)
            .map(|m| TypeInfo::from_meta(m, view(&mut bytes, m).count()))
            .collect();
        Contents {
            type_slots: v.geometry.type_slots,
            types,
            data_used_bytes: v.geometry.data_alloc_end - v.geometry.data_start,
            data_free_bytes: v.geometry.total - v.geometry.data_alloc_end,
            interrupted_ops: v.rolled_back,
        }
    });
    Inspection {
        file_bytes,
        verdict,
    }
}

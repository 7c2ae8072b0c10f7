//! Errors, one enum per kind of operation. Damage (`Untrusted`) is kept
//! apart from I/O failure (`Io`).

use std::path::PathBuf;

/// Why a box cannot be trusted (found by `open`; the caller takes its slow
/// path, e.g. a hard restart).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("recovery box cannot be trusted: {reason}: {detail}")]
pub struct Untrusted {
    /// The kind of damage.
    pub reason: Reason,
    /// Where and what, for people.
    pub detail: String,
}

/// Kinds of damage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Shorter than its header or than the size it records.
    Truncated,
    /// Not a recovery box (no magic).
    NotABox,
    /// Another format version or layout.
    Version,
    /// A checksum over metadata failed.
    MetadataChecksum,
    /// An item failed its checksum.
    ItemChecksum,
    /// Metadata inconsistent with itself (offsets, overlapping regions,
    /// counts, free lists).
    Structure,
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Reason::Truncated => "truncated",
            Reason::NotABox => "not a recovery box",
            Reason::Version => "another format version or layout",
            Reason::MetadataChecksum => "metadata checksum mismatch",
            Reason::ItemChecksum => "item checksum mismatch",
            Reason::Structure => "inconsistent structure",
        })
    }
}

pub(crate) fn untrusted(reason: Reason, detail: impl Into<String>) -> Untrusted {
    Untrusted {
        reason,
        detail: detail.into(),
    }
}

/// Errors of `open`.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The file could not be opened or mapped.
    #[error("recovery box {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Another process holds the box.
    #[error("recovery box {0} is in use by another process")]
    Locked(PathBuf),
    /// Validation failed.
    #[error(transparent)]
    Untrusted(#[from] Untrusted),
}

/// Errors of `create`.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    /// The file could not be created or mapped.
    #[error("recovery box {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Another process holds the box.
    #[error("recovery box {0} is in use by another process")]
    Locked(PathBuf),
    /// A size or type table that does not fit.
    #[error("invalid recovery box geometry: {0}")]
    Geometry(String),
}

/// Errors of type operations.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TypeError {
    /// Every type slot is in use.
    #[error("the type table is full ({0} types)")]
    TableFull(u32),
    /// The data area has no room for the type's region.
    #[error("no room for {needed} more bytes in the recovery box ({free} free)")]
    NoSpace {
        /// Bytes the type needs.
        needed: u64,
        /// Bytes left.
        free: u64,
    },
    /// Item size zero or over the limit.
    #[error("item size must be within 1..={max} bytes (got {got})")]
    ItemBytes {
        /// Given.
        got: u32,
        /// Largest accepted.
        max: u32,
    },
    /// Maximum item count zero or over the limit.
    #[error("max items must be within 1..={max} (got {got})")]
    MaxItems {
        /// Given.
        got: u32,
        /// Largest accepted.
        max: u32,
    },
    /// Another live type has this application type id.
    #[error("application type id {0} is already used")]
    DuplicateAppId(u64),
    /// No live type with this id.
    #[error("unknown type {0}")]
    UnknownType(crate::TypeId),
}

/// Errors of item operations.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ItemError {
    /// No live type with this id.
    #[error("unknown type {0}")]
    UnknownType(crate::TypeId),
    /// The item is not allocated (or out of range).
    #[error("unknown item {0}")]
    UnknownItem(crate::ItemId),
    /// Data of the wrong length for the type.
    #[error("item of type {ty} must be exactly {expected} bytes (got {got})")]
    WrongLength {
        /// The type.
        ty: crate::TypeId,
        /// Its item size.
        expected: usize,
        /// Given.
        got: usize,
    },
    /// Every item of the type is in use.
    #[error("type {ty} is full ({max} items)")]
    Full {
        /// The type.
        ty: crate::TypeId,
        /// Its capacity.
        max: u32,
    },
    /// The item (or its metadata) failed its checksum: it is not handed out.
    #[error("item {0} failed its checksum; the box should be treated as untrusted")]
    Corrupt(crate::ItemId),
    /// A caller buffer too small for an array operation.
    #[error("buffer too small: {needed} bytes needed, {got} given")]
    BufferTooSmall {
        /// Needed.
        needed: usize,
        /// Given.
        got: usize,
    },
    /// Mismatched argument lengths in an array operation.
    #[error("{0}")]
    Arguments(&'static str),
}

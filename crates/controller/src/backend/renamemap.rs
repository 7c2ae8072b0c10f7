//! The rename area of output commit's `renaming` scheme (paper:
//! revive-io-output-commit, "renaming": a write goes to a fresh location
//! and the block is remapped; the map is checkpointed state and the old
//! location is freed once the epoch commits).
//!
//! Two files beside the devices:
//!
//! - `output-commit.rename`: the rename area, track-sized slots; slot `s`
//!   at byte `s * 4096`.
//! - `output-commit.map`: the durable map, written at commit. A 32-byte
//!   header, then one 16-byte entry per volume track:
//!
//! ```text
//! header: magic "RBRNMAP1" | version u32 = 1 | reserved u32 | tracks u64 | crc32c(bytes 0..24) u32 | pad u32
//! entry:  slot+1 u32 (0: the track is at home) | data crc32c u32 | generation u32 | crc32c(track u64, slot+1, data crc, generation) u32
//! ```
//!
//! All integers little-endian. An all-zero entry means "at home" (a new map
//! file is sparse). A committed entry is written before the destage it
//! ends invalidates its NVS record, so after a crash every track either
//! has its record in the NVS or its data where the map says. A header or
//! entry failing its checksum is refused at start with the track named;
//! a rename slot whose data fails the entry's data checksum is a read
//! error, never wrong data.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use rustc_hash::FxHashMap;

use crate::limits::TRACK_BYTES;

const MAGIC: &[u8; 8] = b"RBRNMAP1";
const VERSION: u32 = 1;
const HEADER_BYTES: u64 = 32;
const ENTRY_BYTES: u64 = 16;

/// A renamed track: its slot and the checksum of its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Renamed {
    pub slot: u32,
    pub data_crc: u32,
}

/// Why the rename map cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RenameMapError {
    /// An I/O error on one of the files.
    #[error("rename map {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The header is damaged or belongs to another volume.
    #[error("rename map {path}: {reason}")]
    Header {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// An entry fails its checksum: where that track's data is is unknown.
    #[error("rename map {path}: the entry of track {track} fails its checksum")]
    Entry {
        /// The file.
        path: PathBuf,
        /// The track.
        track: u64,
    },
}

/// The durable map and the rename area.
#[derive(Debug)]
pub(crate) struct RenameMap {
    map: File,
    map_path: PathBuf,
    area: File,
    area_path: PathBuf,
    tracks: u64,
    /// Committed renames.
    pub live: FxHashMap<u64, Renamed>,
    free: Vec<u32>,
    slots: u32,
    generation: u32,
}

fn entry_crc(track: u64, slot1: u32, data_crc: u32, generation: u32) -> u32 {
    let mut b = [0u8; 20];
    b[..8].copy_from_slice(&track.to_le_bytes());
    b[8..12].copy_from_slice(&slot1.to_le_bytes());
    b[12..16].copy_from_slice(&data_crc.to_le_bytes());
    b[16..].copy_from_slice(&generation.to_le_bytes());
    crc32c::crc32c(&b)
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// The error of an I/O on `path`.
fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RenameMapError + use<> {
    let path = path.to_owned();
    move |source| RenameMapError::Io { path, source }
}

/// A new map: write its header for a volume of `tracks`, and size it for
/// an entry per track (all zero: no track renamed).
fn write_header(map: &File, map_path: &Path, tracks: u64) -> Result<(), RenameMapError> {
    let mut header = [0u8; HEADER_BYTES as usize];
    header[..8].copy_from_slice(MAGIC);
    header[8..12].copy_from_slice(&VERSION.to_le_bytes());
    header[16..24].copy_from_slice(&tracks.to_le_bytes());
    let crc = crc32c::crc32c(&header[..24]);
    header[24..28].copy_from_slice(&crc.to_le_bytes());
    map.write_all_at(&header, 0).map_err(io(map_path))?;
    map.set_len(HEADER_BYTES + tracks * ENTRY_BYTES)
        .map_err(io(map_path))?;
    Ok(())
}

/// An existing map: its header is whole, is a rename map's of this
/// version, and was made for a volume of `tracks`, and the file holds an
/// entry per track.
fn check_header(map: &File, map_path: &Path, len: u64, tracks: u64) -> Result<(), RenameMapError> {
    let mut header = [0u8; HEADER_BYTES as usize];
    let bad = |reason: String| RenameMapError::Header {
        path: map_path.to_owned(),
        reason,
    };
    if len < HEADER_BYTES {
        return Err(bad(format!("truncated to {len} bytes")));
    }
    map.read_exact_at(&mut header, 0).map_err(io(map_path))?;
    if &header[..8] != MAGIC {
        return Err(bad("not a rename map (bad magic)".into()));
    }
    if le32(&header, 24) != crc32c::crc32c(&header[..24]) {
        return Err(bad("header fails its checksum".into()));
    }
    if le32(&header, 8) != VERSION {
        return Err(bad(format!("unknown version {}", le32(&header, 8))));
    }
    let have = u64::from_le_bytes(header[16..24].try_into().expect("8 bytes"));
    if have != tracks {
        return Err(bad(format!(
            "made for a volume of {have} tracks, this one has {tracks}"
        )));
    }
    if len != HEADER_BYTES + tracks * ENTRY_BYTES {
        return Err(bad(format!(
            "{len} bytes, expected {}",
            HEADER_BYTES + tracks * ENTRY_BYTES
        )));
    }
    Ok(())
}

/// Load the committed entries: the renamed tracks, and the highest
/// generation any entry carries. An entry failing its checksum is an error.
fn load_entries(
    map: &File,
    map_path: &Path,
    tracks: u64,
) -> Result<(FxHashMap<u64, Renamed>, u32), RenameMapError> {
    let mut live = FxHashMap::default();
    let mut generation = 0;
    let mut buf = vec![0u8; 64 * 1024];
    let mut track = 0u64;
    while track < tracks {
        let n = ((tracks - track) * ENTRY_BYTES).min(buf.len() as u64) as usize;
        map.read_exact_at(&mut buf[..n], HEADER_BYTES + track * ENTRY_BYTES)
            .map_err(io(map_path))?;
        for e in buf[..n].chunks_exact(ENTRY_BYTES as usize) {
            if e.iter().any(|&b| b != 0) {
                let (slot1, data_crc, g, crc) = (le32(e, 0), le32(e, 4), le32(e, 8), le32(e, 12));
                if crc != entry_crc(track, slot1, data_crc, g) {
                    return Err(RenameMapError::Entry {
                        path: map_path.to_owned(),
                        track,
                    });
                }
                generation = generation.max(g);
                if slot1 != 0 {
                    live.insert(
                        track,
                        Renamed {
                            slot: slot1 - 1,
                            data_crc,
                        },
                    );
                }
            }
            track += 1;
        }
    }
    Ok((live, generation))
}

impl RenameMap {
    /// The map's file names in `dir`.
    pub fn paths(dir: &Path) -> (PathBuf, PathBuf) {
        (
            dir.join("output-commit.map"),
            dir.join("output-commit.rename"),
        )
    }

    /// Open (or create, syncing `dir` so the new files last) the map of a
    /// volume of `tracks` in `dir` and load its committed entries.
    pub fn open(dir: &Path, tracks: u64) -> Result<Self, RenameMapError> {
        let (map_path, area_path) = Self::paths(dir);
        let open = |p: &Path| crate::files::open_state_file(p, crate::files::Create::IfMissing);
        let created = !map_path.exists() || !area_path.exists();
        let map = open(&map_path).map_err(io(&map_path))?;
        let area = open(&area_path).map_err(io(&area_path))?;
        let len = map.metadata().map_err(io(&map_path))?.len();
        if len == 0 {
            write_header(&map, &map_path, tracks)?;
        } else {
            check_header(&map, &map_path, len, tracks)?;
        }
        if created {
            // A new file's header and name must last as its entries or
            // slots will.
            map.sync_data().map_err(io(&map_path))?;
            crate::files::sync_dir(dir).map_err(io(&map_path))?;
        }
        let (live, generation) = load_entries(&map, &map_path, tracks)?;
        let slots = live.values().map(|r| r.slot + 1).max().unwrap_or(0);
        let mut used = vec![false; slots as usize];
        for r in live.values() {
            used[r.slot as usize] = true;
        }
        let free = (0..slots).rev().filter(|&s| !used[s as usize]).collect();
        Ok(Self {
            map,
            map_path,
            area,
            area_path,
            tracks,
            live,
            free,
            slots,
            generation,
        })
    }

    /// A free slot of the rename area.
    pub fn alloc(&mut self) -> u32 {
        self.free.pop().unwrap_or_else(|| {
            self.slots += 1;
            self.slots - 1
        })
    }

    /// Give a slot back.
    pub fn release(&mut self, slot: u32) {
        self.free.push(slot);
    }

    /// Write a track's data into `slot`; returns its checksum.
    pub fn write_slot(&self, slot: u32, data: &[u8]) -> std::io::Result<u32> {
        self.area
            .write_all_at(data, u64::from(slot) * TRACK_BYTES as u64)?;
        Ok(crc32c::crc32c(data))
    }

    /// Read a renamed track's data, checked against its checksum.
    pub fn read_slot(&self, r: Renamed, out: &mut [u8]) -> std::io::Result<()> {
        self.area
            .read_exact_at(out, u64::from(r.slot) * TRACK_BYTES as u64)?;
        if crc32c::crc32c(out) != r.data_crc {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "rename slot {} in {} fails its checksum",
                    r.slot,
                    self.area_path.display()
                ),
            ));
        }
        Ok(())
    }

    /// Commit `track` to `to` (None: home): the durable entry first, then
    /// the live map; returns the slot it left, to give back.
    pub fn commit(&mut self, track: u64, to: Option<Renamed>) -> std::io::Result<Option<u32>> {
        debug_assert!(track < self.tracks);
        self.generation = self.generation.wrapping_add(1);
        let mut e = [0u8; ENTRY_BYTES as usize];
        if let Some(r) = to {
            let slot1 = r.slot + 1;
            e[0..4].copy_from_slice(&slot1.to_le_bytes());
            e[4..8].copy_from_slice(&r.data_crc.to_le_bytes());
            e[8..12].copy_from_slice(&self.generation.to_le_bytes());
            let crc = entry_crc(track, slot1, r.data_crc, self.generation);
            e[12..16].copy_from_slice(&crc.to_le_bytes());
        }
        self.map
            .write_all_at(&e, HEADER_BYTES + track * ENTRY_BYTES)?;
        let old = match to {
            Some(r) => self.live.insert(track, r),
            None => self.live.remove(&track),
        };
        Ok(old.map(|o| o.slot))
    }

    /// `fdatasync` both files.
    pub fn sync(&self) -> std::io::Result<()> {
        self.area.sync_data()?;
        self.map.sync_data()
    }

    /// The map file (for messages).
    pub fn path(&self) -> &Path {
        &self.map_path
    }
}

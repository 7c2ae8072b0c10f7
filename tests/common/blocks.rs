//! Self-identifying track contents for the crash and power-loss loops:
//! each 4 KiB block names its track and version and is filled from both,
//! so a read tells which write it came from, or that it is torn or foreign.

/// The track size the loops write in.
pub const TRACK: usize = 4096;

/// The block for (track, version).
pub fn block(track: u64, version: u64) -> Vec<u8> {
    let mut b = vec![0u8; TRACK];
    b[0..8].copy_from_slice(&track.to_le_bytes());
    b[8..16].copy_from_slice(&version.to_le_bytes());
    let mut x = track.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ version.wrapping_add(1);
    for chunk in b[16..].chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    b
}

/// What a block holds: a version of its track (checked byte for byte), the
/// never-written zero block, or garbage.
pub fn identify(track: u64, data: &[u8]) -> Result<Option<u64>, String> {
    if data.iter().all(|&b| b == 0) {
        return Ok(None);
    }
    let t = u64::from_le_bytes(data[0..8].try_into().unwrap());
    let v = u64::from_le_bytes(data[8..16].try_into().unwrap());
    if t != track || data != block(track, v).as_slice() {
        return Err(format!(
            "track {track} holds bytes no one wrote (header says track {t} v{v})"
        ));
    }
    Ok(Some(v))
}

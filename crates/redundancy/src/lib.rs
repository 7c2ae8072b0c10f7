//! The redundancy module: how a group's data survives the loss of a node.
//!
//! Section 3 of the smart-storage paper protects a storage group either by a
//! mirror group (3.1 to 3.3: row-wise partitions in the main group,
//! column-wise in the mirror) or by a dedicated parity node (3.4, RAID level
//! 4: "data recovery is performed by XORing the last check-pointed data on
//! the remaining SDs with those on the parity disk"). This module holds the
//! layouts as pure functions over byte blocks, so the storage nodes use them
//! for partitions and checkpoints and the controller can reuse them for
//! device RAID:
//!
//! - [`row_owner`], [`column_groups`]: the mirror layout of section 3.1.
//! - [`ParityBlock`]: dedicated parity (RAID-4) over members of any length.
//! - [`RotatedParity`]: parity rotated across the nodes, stripe by stripe
//!   (RAID-5, left-symmetric), for when one parity node would be the
//!   bottleneck the paper observes in Figure 8.
//! - [`ReedSolomon`]: k data + m recovery shards, surviving any m losses,
//!   through the `reed-solomon-simd` crate.
//!
//! ## Parity block format
//!
//! A [`ParityBlock`] is stored as the payload of a raw object:
//!
//! ```text
//! u32 member count n (little-endian)
//! u64 x n: each member's length in bytes
//! bytes:   XOR of all members, each zero-padded to the longest
//! ```

use std::ops::Range;

/// Why a layout could not place or rebuild data (the message names the
/// member, shard or length at fault).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Error(pub String);

/// A redundancy result.
pub type Result<T> = std::result::Result<T, Error>;

/// Which node of a group of `nodes` holds row block `block` (section 3.1:
/// "data 1-5-9-13 originally held by D1", blocks striped round-robin).
pub fn row_owner(block: usize, nodes: usize) -> usize {
    assert!(nodes > 0, "a group has at least one node");
    block % nodes
}

/// The mirror group's column-wise split: `columns` columns into `groups`
/// contiguous, nearly equal ranges (the first ones one wider). A group may
/// be empty when there are more nodes than columns.
pub fn column_groups(columns: usize, groups: usize) -> Vec<Range<usize>> {
    assert!(groups > 0, "a group has at least one node");
    let base = columns / groups;
    let extra = columns % groups;
    let mut start = 0;
    (0..groups)
        .map(|g| {
            let len = base + usize::from(g < extra);
            let r = start..start + len;
            start += len;
            r
        })
        .collect()
}

/// XOR `src` into `dst` (which must be at least as long).
pub fn xor_into(dst: &mut [u8], src: &[u8]) {
    assert!(dst.len() >= src.len(), "xor destination too short");
    // Word at a time; the compiler vectorises the chunked loop.
    let (d_words, d_tail) = dst[..src.len()].split_at_mut(src.len() / 8 * 8);
    let (s_words, s_tail) = src.split_at(src.len() / 8 * 8);
    for (d, s) in d_words.chunks_exact_mut(8).zip(s_words.chunks_exact(8)) {
        let x = u64::from_ne_bytes(d.try_into().expect("8"))
            ^ u64::from_ne_bytes(s.try_into().expect("8"));
        d.copy_from_slice(&x.to_ne_bytes());
    }
    for (d, s) in d_tail.iter_mut().zip(s_tail) {
        *d ^= s;
    }
}

/// Dedicated parity over a group's members (RAID-4): the XOR of every
/// member, zero-padded to the longest, plus each member's length so a
/// rebuilt member is cut back to its exact size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParityBlock {
    /// Length of each member, by member index.
    pub lens: Vec<u64>,
    /// XOR of the members.
    pub xor: Vec<u8>,
}

impl ParityBlock {
    /// An empty accumulator for `members` members.
    pub fn new(members: usize) -> Self {
        ParityBlock {
            lens: vec![0; members],
            xor: Vec::new(),
        }
    }

    /// Parity of all `members`.
    pub fn of(members: &[&[u8]]) -> Self {
        let mut p = ParityBlock::new(members.len());
        for (i, m) in members.iter().enumerate() {
            p.add(i, m);
        }
        p
    }

    /// Folds member `index` into the parity. Each member is added once.
    pub fn add(&mut self, index: usize, member: &[u8]) {
        if self.xor.len() < member.len() {
            self.xor.resize(member.len(), 0);
        }
        xor_into(&mut self.xor, member);
        self.lens[index] = member.len() as u64;
    }

    /// Rebuilds member `lost` from the parity and every other member
    /// (`survivors`: index and bytes; each must be present exactly once).
    pub fn rebuild(&self, lost: usize, survivors: &[(usize, &[u8])]) -> Result<Vec<u8>> {
        let n = self.lens.len();
        if lost >= n {
            return Err(Error(format!("member {lost} is not one of {n}")));
        }
        let mut seen = vec![false; n];
        let mut out = self.xor.clone();
        for &(i, bytes) in survivors {
            if i >= n || i == lost || seen[i] {
                return Err(Error(format!("survivor {i} unexpected or repeated")));
            }
            if bytes.len() as u64 != self.lens[i] {
                return Err(Error(format!(
                    "survivor {i} is {} bytes, parity recorded {}",
                    bytes.len(),
                    self.lens[i]
                )));
            }
            seen[i] = true;
            xor_into(&mut out, bytes);
        }
        let missing: Vec<usize> = (0..n).filter(|&i| i != lost && !seen[i]).collect();
        if !missing.is_empty() {
            return Err(Error(format!(
                "parity rebuilds one lost member; also missing {missing:?}"
            )));
        }
        out.truncate(self.lens[lost] as usize);
        Ok(out)
    }

    /// Serialises (see the module's format).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + 8 * self.lens.len() + self.xor.len());
        out.extend_from_slice(&(self.lens.len() as u32).to_le_bytes());
        for l in &self.lens {
            out.extend_from_slice(&l.to_le_bytes());
        }
        out.extend_from_slice(&self.xor);
        out
    }

    /// Parses what [`ParityBlock::to_bytes`] wrote.
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        let bad = |m: &str| Error(format!("parity block: {m}"));
        let n = u32::from_le_bytes(
            b.get(..4)
                .ok_or_else(|| bad("truncated"))?
                .try_into()
                .expect("4"),
        ) as usize;
        let head = 4 + 8 * n;
        if b.len() < head || n == 0 || n > 1024 {
            return Err(bad("truncated or bad member count"));
        }
        let lens: Vec<u64> = (0..n)
            .map(|i| u64::from_le_bytes(b[4 + 8 * i..12 + 8 * i].try_into().expect("8")))
            .collect();
        let xor = b[head..].to_vec();
        if lens.iter().any(|&l| l > xor.len() as u64) {
            return Err(bad("a member is longer than the parity"));
        }
        Ok(ParityBlock { lens, xor })
    }
}

/// Parity rotated across `nodes` nodes, one block per node per stripe
/// (RAID-5, left-symmetric): stripe `s` keeps its parity on node
/// `nodes - 1 - s % nodes` and its data blocks on the following nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RotatedParity {
    /// Nodes in the group (at least 2).
    pub nodes: usize,
    /// Bytes per block.
    pub block: usize,
}

impl RotatedParity {
    /// The node holding stripe `stripe`'s parity.
    pub fn parity_node(&self, stripe: usize) -> usize {
        self.nodes - 1 - stripe % self.nodes
    }

    /// The node holding data block `d` (0..nodes-1) of stripe `stripe`.
    pub fn data_node(&self, stripe: usize, d: usize) -> usize {
        debug_assert!(d < self.nodes - 1);
        (self.parity_node(stripe) + 1 + d) % self.nodes
    }

    /// Lays `data` out: each node's contents, block after block, stripe by
    /// stripe (the last stripe zero-padded).
    pub fn place(&self, data: &[u8]) -> Vec<Vec<u8>> {
        assert!(self.nodes >= 2 && self.block > 0);
        let per_stripe = self.block * (self.nodes - 1);
        let stripes = data.len().div_ceil(per_stripe).max(1);
        let mut out = vec![Vec::with_capacity(stripes * self.block); self.nodes];
        for s in 0..stripes {
            let mut parity = vec![0u8; self.block];
            let mut blocks = vec![vec![0u8; self.block]; self.nodes - 1];
            for (d, blk) in blocks.iter_mut().enumerate() {
                let start = (s * per_stripe + d * self.block).min(data.len());
                let end = (start + self.block).min(data.len());
                blk[..end - start].copy_from_slice(&data[start..end]);
                xor_into(&mut parity, blk);
            }
            out[self.parity_node(s)].extend_from_slice(&parity);
            for (d, blk) in blocks.into_iter().enumerate() {
                out[self.data_node(s, d)].extend_from_slice(&blk);
            }
        }
        out
    }

    /// Rebuilds the lost node's contents from the others (`None` = lost;
    /// exactly one may be missing).
    pub fn rebuild(&self, nodes: &[Option<&[u8]>]) -> Result<Vec<u8>> {
        let lost: Vec<usize> = (0..nodes.len()).filter(|&i| nodes[i].is_none()).collect();
        if nodes.len() != self.nodes || lost.len() != 1 {
            return Err(Error(format!(
                "rotated parity over {} nodes rebuilds exactly one; {} missing of {}",
                self.nodes,
                lost.len(),
                nodes.len()
            )));
        }
        let len = nodes.iter().flatten().map(|n| n.len()).max().unwrap_or(0);
        let mut out = vec![0u8; len];
        for n in nodes.iter().flatten() {
            xor_into(&mut out, n);
        }
        Ok(out)
    }

    /// Reads the data back from all nodes' contents (`len` bytes).
    pub fn gather(&self, nodes: &[&[u8]], len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len);
        let mut s = 0;
        while out.len() < len {
            for d in 0..self.nodes - 1 {
                let n = nodes[self.data_node(s, d)];
                out.extend_from_slice(&n[s * self.block..(s + 1) * self.block]);
            }
            s += 1;
        }
        out.truncate(len);
        out
    }
}

/// Reed-Solomon erasure coding: `k` data shards and `m` recovery shards;
/// any `m` of the `k + m` may be lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReedSolomon {
    /// Data shards.
    pub k: usize,
    /// Recovery shards.
    pub m: usize,
}

impl ReedSolomon {
    /// The shard size used for members of at most `longest` bytes (the
    /// codec wants a non-zero even size).
    fn shard_len(longest: usize) -> usize {
        longest.max(2).next_multiple_of(2)
    }

    /// Recovery shards for `data` (k members of any lengths, zero-padded).
    pub fn encode(&self, data: &[&[u8]]) -> Result<Vec<Vec<u8>>> {
        if data.len() != self.k {
            return Err(Error(format!(
                "{} members given, k = {}",
                data.len(),
                self.k
            )));
        }
        let len = Self::shard_len(data.iter().map(|d| d.len()).max().unwrap_or(0));
        let padded: Vec<Vec<u8>> = data
            .iter()
            .map(|d| {
                let mut v = d.to_vec();
                v.resize(len, 0);
                v
            })
            .collect();
        reed_solomon_simd::encode(self.k, self.m, &padded).map_err(|e| Error(e.to_string()))
    }

    /// Rebuilds every lost data member. `data[i]` is `None` when lost;
    /// `recovery[j]` likewise; `lens` gives each data member's length.
    pub fn rebuild(
        &self,
        data: &[Option<&[u8]>],
        recovery: &[Option<&[u8]>],
        lens: &[usize],
    ) -> Result<Vec<Vec<u8>>> {
        if data.len() != self.k || recovery.len() != self.m || lens.len() != self.k {
            return Err(Error("shard counts do not match k and m".into()));
        }
        let len = recovery
            .iter()
            .flatten()
            .map(|r| r.len())
            .next()
            .unwrap_or(0);
        let padded: Vec<(usize, Vec<u8>)> = data
            .iter()
            .enumerate()
            .filter_map(|(i, d)| {
                d.map(|d| {
                    let mut v = d.to_vec();
                    v.resize(len, 0);
                    (i, v)
                })
            })
            .collect();
        let rec = recovery
            .iter()
            .enumerate()
            .filter_map(|(j, r)| r.map(|r| (j, r)));
        let mut restored =
            reed_solomon_simd::decode(self.k, self.m, padded.iter().map(|(i, v)| (*i, v)), rec)
                .map_err(|e| Error(e.to_string()))?;
        let mut out = Vec::with_capacity(self.k);
        for (i, d) in data.iter().enumerate() {
            let mut v = match d {
                Some(d) => d.to_vec(),
                None => restored
                    .remove(&i)
                    .ok_or_else(|| Error(format!("data shard {i} not restored")))?,
            };
            v.truncate(lens[i]);
            out.push(v);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rows_stripe_round_robin_as_the_paper_figure_4() {
        let d1: Vec<usize> = (0..16).filter(|&b| row_owner(b, 4) == 1).collect();
        assert_eq!(d1, vec![1, 5, 9, 13]);
    }

    #[test]
    fn column_groups_cover_every_column_once() {
        let g = column_groups(16, 4);
        assert_eq!(g, vec![0..4, 4..8, 8..12, 12..16]);
        let g = column_groups(16, 3);
        assert_eq!(g, vec![0..6, 6..11, 11..16]);
    }

    proptest! {
        #[test]
        fn dedicated_parity_rebuilds_any_single_lost_member(
            members in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..300), 2..6),
            lost_seed in any::<usize>(),
        ) {
            let refs: Vec<&[u8]> = members.iter().map(|m| m.as_slice()).collect();
            let p = ParityBlock::from_bytes(&ParityBlock::of(&refs).to_bytes()).unwrap();
            let lost = lost_seed % members.len();
            let survivors: Vec<(usize, &[u8])> = refs.iter().enumerate().filter(|(i, _)| *i != lost).map(|(i, m)| (i, *m)).collect();
            prop_assert_eq!(p.rebuild(lost, &survivors).unwrap(), members[lost].clone());
        }

        #[test]
        fn rotated_parity_rebuilds_any_lost_node_and_reads_back(
            data in prop::collection::vec(any::<u8>(), 0..2000),
            nodes in 2usize..7,
            lost_seed in any::<usize>(),
        ) {
            let rp = RotatedParity { nodes, block: 64 };
            let placed = rp.place(&data);
            let refs: Vec<&[u8]> = placed.iter().map(|p| p.as_slice()).collect();
            prop_assert_eq!(rp.gather(&refs, data.len()), data.clone());
            let lost = lost_seed % nodes;
            let view: Vec<Option<&[u8]>> = placed.iter().enumerate().map(|(i, p)| (i != lost).then_some(p.as_slice())).collect();
            prop_assert_eq!(rp.rebuild(&view).unwrap(), placed[lost].clone());
        }

        #[test]
        fn reed_solomon_survives_any_m_losses(
            members in prop::collection::vec(prop::collection::vec(any::<u8>(), 1..200), 2..6),
            m in 1usize..3,
            seed in any::<u64>(),
        ) {
            let k = members.len();
            let rs = ReedSolomon { k, m };
            let refs: Vec<&[u8]> = members.iter().map(|v| v.as_slice()).collect();
            let rec = rs.encode(&refs).unwrap();
            // Lose m shards out of k + m, chosen by the seed.
            let mut order: Vec<usize> = (0..k + m).collect();
            let mut s = seed;
            for i in (1..order.len()).rev() {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                order.swap(i, (s >> 33) as usize % (i + 1));
            }
            let lost: Vec<usize> = order[..m].to_vec();
            let data: Vec<Option<&[u8]>> = (0..k).map(|i| (!lost.contains(&i)).then_some(refs[i])).collect();
            let recovery: Vec<Option<&[u8]>> = (0..m).map(|j| (!lost.contains(&(k + j))).then_some(rec[j].as_slice())).collect();
            let lens: Vec<usize> = members.iter().map(|v| v.len()).collect();
            prop_assert_eq!(rs.rebuild(&data, &recovery, &lens).unwrap(), members);
        }
    }

    #[test]
    fn parity_refuses_two_lost_members() {
        let a = [1u8, 2, 3];
        let b = [4u8, 5];
        let c = [6u8];
        let p = ParityBlock::of(&[&a, &b, &c]);
        let e = p.rebuild(0, &[(1, &b)]).unwrap_err().to_string();
        assert!(e.contains("missing [2]"), "{e}");
    }
}

//! The simulator's pending events: at most one per slot, the earliest
//! first, in a tournament tree.
//!
//! A virtual processor has at most one pending event at any time (its task's
//! end, the end of a hold, or a wake-up), and so does each light group's
//! trickle. The event set is therefore a fixed array of slots, one per
//! processor and one per group, and the next event is the slot with the
//! smallest key (time, sequence number): the same order a heap of
//! (time, sequence) would give, so runs stay byte-identical for a seed.
//!
//! The tree keeps, at every inner node, the slot that wins between its two
//! children, with its key beside it. Reading the minimum is one load;
//! changing a slot's key replays the matches on its path to the root:
//! log2(slots) comparisons, where a heap sifts. Against `BinaryHeap`'s
//! sift-down on every pop and sift-up on every push, and with (time,
//! sequence) packed into one `u128`, this made the simulator about 1.15x
//! faster at 8 processors (docs/simulation.md).

/// An empty slot's key: after every real one.
const NONE: u128 = u128::MAX;

/// (time, sequence) as one number that orders the same way.
#[inline]
fn key(time: u64, seq: u64) -> u128 {
    (u128::from(time) << 64) | u128::from(seq)
}

/// A match's winner: its key and slot, side by side so that a match
/// loads one node, not two arrays.
#[derive(Debug, Clone, Copy)]
struct Node {
    key: u128,
    slot: u32,
}

/// Pending events of `E`, one per slot.
#[derive(Debug)]
pub(super) struct Events<E> {
    /// Per slot: the event, meaningful while the slot's key is not `NONE`.
    what: Vec<E>,
    /// The tournament, as a heap-ordered array: node `leaves + s` is slot
    /// `s`'s own key; node `n` holds the smaller of nodes `2n` and `2n + 1`
    /// (key and slot); node 1 is the earliest event.
    nodes: Vec<Node>,
    leaves: usize,
    /// Slots in use: `0..used`.
    used: usize,
}

impl<E: Copy> Events<E> {
    /// An empty set of `slots` slots; `filler` stands in for absent events.
    pub(super) fn new(slots: usize, filler: E) -> Self {
        let leaves = slots.max(1).next_power_of_two();
        let mut nodes = vec![Node { key: NONE, slot: 0 }; 2 * leaves];
        for s in 0..leaves {
            nodes[leaves + s].slot = u32::try_from(s).expect("slots fit in u32");
        }
        Events {
            what: vec![filler; leaves],
            nodes,
            leaves,
            used: slots,
        }
    }

    /// Give `slot` the key `k` and replay its matches up to the root.
    #[inline]
    fn replay(&mut self, slot: usize, k: u128) {
        let mut n = self.leaves + slot;
        let nodes = &mut self.nodes[..];
        nodes[n].key = k;
        // The winner so far, carried up.
        let mut won = nodes[n];
        while n > 1 {
            let other = nodes[n ^ 1];
            let other_wins = other.key < won.key;
            won.key = if other_wins { other.key } else { won.key };
            won.slot = if other_wins { other.slot } else { won.slot };
            n /= 2;
            nodes[n] = won;
        }
    }

    /// Schedule `what` in `slot` at (`time`, `seq`). The slot must be empty:
    /// a processor or a trickle never has two events pending.
    #[inline]
    pub(super) fn set(&mut self, slot: usize, time: u64, seq: u64, what: E) {
        assert!(
            self.nodes[self.leaves + slot].key == NONE,
            "slot {slot} already has an event pending"
        );
        self.replace(slot, time, seq, what);
    }

    /// Schedule `what` in `slot`, replacing what it held.
    #[inline]
    pub(super) fn replace(&mut self, slot: usize, time: u64, seq: u64, what: E) {
        debug_assert!(slot < self.used, "slot {slot} of {}", self.used);
        let k = key(time, seq);
        debug_assert!(k != NONE);
        self.what[slot] = what;
        self.replay(slot, k);
    }

    /// Empty `slot`.
    #[inline]
    pub(super) fn clear(&mut self, slot: usize) {
        debug_assert!(slot < self.used, "slot {slot} of {}", self.used);
        self.replay(slot, NONE);
    }

    /// The earliest event: its slot, time, sequence number and what it is.
    #[inline]
    pub(super) fn first(&self) -> Option<(usize, u64, u64, E)> {
        let Node { key: k, slot } = self.nodes[1];
        let slot = slot as usize;
        // Truncations take the two halves of the key apart.
        (k != NONE).then(|| (slot, (k >> 64) as u64, k as u64, self.what[slot]))
    }

    /// Whether `slot` has an event pending.
    #[cfg(test)]
    fn pending(&self, slot: usize) -> bool {
        self.nodes[self.leaves + slot].key != NONE
    }
}

#[cfg(test)]
mod tests {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;

    use proptest::prelude::*;

    use super::Events;

    proptest! {
        /// Whatever the slots and times, events come out in the order a heap
        /// of (time, sequence) gives, which is what keeps runs identical.
        #[test]
        fn events_leave_in_time_then_sequence_order_like_a_heap(
            slots in 1usize..40,
            ops in proptest::collection::vec((0usize..40, 0u64..50, 0u8..3), 1..400),
        ) {
            let mut events = Events::new(slots, 0u8);
            let mut heap = BinaryHeap::new();
            let mut seq = 0u64;
            let mut now = 0u64;
            for (slot, dt, op) in ops {
                let slot = slot % slots;
                if op == 2 {
                    // Handle the first event by scheduling its slot again,
                    // as the engine does with a processor's next event.
                    let got = events.first().map(|(slot, t, s, _)| (slot, t, s));
                    let want = heap.pop().map(|Reverse((t, s, slot))| (slot, t, s));
                    prop_assert_eq!(got, want);
                    if let Some((first, t, _)) = got {
                        now = t;
                        seq += 1;
                        events.replace(first, now + dt, seq, 2);
                        heap.push(Reverse((now + dt, seq, first)));
                    }
                } else if op == 1 {
                    let want = heap.pop().map(|Reverse((t, s, slot))| (slot, t, s));
                    let got = events.first().map(|(slot, t, s, _)| (slot, t, s));
                    prop_assert_eq!(got, want);
                    if let Some((slot, t, _)) = got {
                        events.clear(slot);
                        now = t;
                    }
                } else if !events.pending(slot) {
                    seq += 1;
                    events.set(slot, now + dt, seq, 1);
                    heap.push(Reverse((now + dt, seq, slot)));
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "already has an event pending")]
    fn a_second_event_for_a_busy_slot_is_refused() {
        let mut events = Events::new(4, ());
        events.set(2, 10, 1, ());
        events.set(2, 11, 2, ());
    }

    #[test]
    fn an_empty_set_has_no_first_event() {
        let mut events = Events::new(3, ());
        assert_eq!(events.first(), None);
        events.set(1, 5, 1, ());
        assert_eq!(events.first(), Some((1, 5, 1, ())));
        events.clear(1);
        assert_eq!(events.first(), None);
    }
}

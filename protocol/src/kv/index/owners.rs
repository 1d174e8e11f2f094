//! A node's owning ranks, as a bitset while that is exact.
//!
//! Fleets are mostly below 64 ranks and an engine hash names a node once, so the common node is
//! a `u64` of slot bits: adding or removing an owner is one bit, a second owner costs no
//! allocation, and `find_matches` intersects a whole walk step with one `&`. A slot ≥ 64 or a
//! second engine hash naming the same node for one rank switches the node to a sorted list with
//! refcounts, and it returns to bits once they are exact again.

use super::Slot;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Owner {
    pub(super) slot: Slot,
    pub(super) refs: u32,
}

#[derive(Debug)]
pub(super) enum Owners {
    /// Bit `s` set: slot `s` owns the node through exactly one engine hash.
    Mask(u64),
    /// Sorted by slot, each with how many of the rank's engine hashes name the node.
    /// Boxed so a node's owners stay 16 bytes (a bare `Vec` would make every node 8 bytes
    /// larger for a case most nodes never reach).
    #[allow(clippy::box_collection)]
    Many(Box<Vec<Owner>>),
}

impl Default for Owners {
    fn default() -> Self {
        Owners::Mask(0)
    }
}

const MASK_SLOTS: Slot = 64;

fn mask_owners(mask: u64) -> impl Iterator<Item = Owner> {
    let mut rest = mask;
    std::iter::from_fn(move || {
        if rest == 0 {
            return None;
        }
        let slot = rest.trailing_zeros();
        rest &= rest - 1;
        Some(Owner { slot, refs: 1 })
    })
}

/// The slots of a mask, ascending.
pub(super) fn mask_slots(mask: u64) -> impl Iterator<Item = Slot> {
    mask_owners(mask).map(|o| o.slot)
}

impl Owners {
    #[inline]
    pub(super) fn len(&self) -> usize {
        match self {
            Owners::Mask(mask) => mask.count_ones() as usize,
            Owners::Many(owners) => owners.len(),
        }
    }

    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        match self {
            Owners::Mask(mask) => *mask == 0,
            Owners::Many(owners) => owners.is_empty(),
        }
    }

    #[inline]
    pub(super) fn contains(&self, slot: Slot) -> bool {
        match self {
            Owners::Mask(mask) => slot < MASK_SLOTS && mask & (1 << slot) != 0,
            Owners::Many(owners) => owners.binary_search_by_key(&slot, |o| o.slot).is_ok(),
        }
    }

    /// Owners in ascending slot order.
    pub(super) fn iter(&self) -> impl Iterator<Item = Owner> + '_ {
        let (mask, list) = match self {
            Owners::Mask(mask) => (*mask, &[][..]),
            Owners::Many(owners) => (0, owners.as_slice()),
        };
        mask_owners(mask).chain(list.iter().copied())
    }

    /// Adds one claim of `slot`. The bitset case (a new slot below 64 on a bitset) is a few
    /// instructions and inlined into every store; the rest is out of line.
    #[inline]
    pub(super) fn add(&mut self, slot: Slot) {
        if let Owners::Mask(mask) = self {
            let bit = 1u64.checked_shl(slot).unwrap_or(0);
            if bit != 0 && *mask & bit == 0 {
                *mask |= bit;
                return;
            }
        }
        self.add_to_list(slot);
    }

    /// [`Self::add`] where the result is a list: a slot ≥ 64, or a second claim of a slot.
    #[inline(never)]
    fn add_to_list(&mut self, slot: Slot) {
        if let Owners::Mask(mask) = self {
            *self = Owners::Many(Box::new(mask_owners(*mask).collect()));
        }
        if let Owners::Many(owners) = self {
            match owners.binary_search_by_key(&slot, |o| o.slot) {
                Ok(i) => owners[i].refs += 1,
                Err(i) => owners.insert(i, Owner { slot, refs: 1 }),
            }
        }
    }

    /// Removes one claim of `slot` (nothing if it has none). Inlined for bitsets, like
    /// [`Self::add`].
    #[inline]
    pub(super) fn remove(&mut self, slot: Slot) {
        match self {
            Owners::Mask(mask) => {
                if slot < MASK_SLOTS {
                    *mask &= !(1u64 << slot);
                }
            }
            Owners::Many(_) => self.remove_from_list(slot),
        }
    }

    /// [`Self::remove`] on a list; back to a bitset once that is exact again.
    #[inline(never)]
    fn remove_from_list(&mut self, slot: Slot) {
        let Owners::Many(owners) = self else {
            return;
        };
        if let Ok(i) = owners.binary_search_by_key(&slot, |o| o.slot) {
            owners[i].refs -= 1;
            if owners[i].refs == 0 {
                owners.remove(i);
            }
        }
        if owners.len() <= MASK_SLOTS as usize
            && owners.iter().all(|o| o.slot < MASK_SLOTS && o.refs == 1)
        {
            let mask = owners.iter().fold(0u64, |m, o| m | (1 << o.slot));
            *self = Owners::Mask(mask);
        }
    }

    /// Owner entries on the heap (for the memory estimate).
    pub(super) fn heap_entries(&self) -> usize {
        match self {
            Owners::Mask(_) => 0,
            Owners::Many(owners) => owners.capacity(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    proptest! {
        /// Against a refcount map, across the bit/list boundary (slots up to 70, refs > 1).
        #[test]
        fn agrees_with_a_refcount_map(
            ops in proptest::collection::vec((any::<bool>(), 0u32..70), 1..300),
        ) {
            let mut owners = Owners::default();
            let mut model: BTreeMap<Slot, u32> = BTreeMap::new();
            for (add, slot) in ops {
                if add {
                    owners.add(slot);
                    *model.entry(slot).or_default() += 1;
                } else if model.contains_key(&slot) {
                    owners.remove(slot);
                    let refs = model.get_mut(&slot).expect("present");
                    *refs -= 1;
                    if *refs == 0 {
                        model.remove(&slot);
                    }
                }
                let got: Vec<(Slot, u32)> = owners.iter().map(|o| (o.slot, o.refs)).collect();
                let want: Vec<(Slot, u32)> = model.iter().map(|(s, r)| (*s, *r)).collect();
                prop_assert_eq!(&got, &want);
                prop_assert_eq!(owners.len(), want.len());
                prop_assert_eq!(owners.is_empty(), want.is_empty());
                for s in 0..70 {
                    prop_assert_eq!(owners.contains(s), model.contains_key(&s));
                }
                let exact = model.iter().all(|(s, r)| *s < 64 && *r == 1);
                prop_assert_eq!(matches!(owners, Owners::Mask(_)), exact);
            }
        }
    }

    #[test]
    fn owners_fit_in_sixteen_bytes() {
        assert_eq!(std::mem::size_of::<Owners>(), 16);
    }
}

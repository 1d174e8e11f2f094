//! A bounded log of the last [`CHANGE_LOG`] changes, each naming what changed, so a reader that
//! remembers how many changes it has seen catches up on those alone (the load store's slot
//! writes; the dispatch ledger's instances whose legs changed).

/// Changes a log keeps: a reader further behind re-reads everything.
pub const CHANGE_LOG: usize = 1024;

/// Change `n` names its item at `n % CHANGE_LOG`, for the last [`CHANGE_LOG`] changes.
#[derive(Clone, Debug)]
pub struct ChangeLog<T> {
    changes: u64,
    items: Vec<T>,
}

impl<T> Default for ChangeLog<T> {
    fn default() -> Self {
        Self {
            changes: 0,
            items: Vec::new(),
        }
    }
}

impl<T: Copy> ChangeLog<T> {
    /// Logs a change to `item` (bounded: the oldest entry is overwritten).
    #[inline]
    pub fn push(&mut self, item: T) {
        // The remainder is < CHANGE_LOG, so it fits usize.
        let at = (self.changes % CHANGE_LOG as u64) as usize;
        match self.items.get_mut(at) {
            Some(entry) => *entry = item,
            None => self.items.push(item),
        }
        self.changes += 1;
    }

    /// Changes so far.
    #[inline]
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// What changed since [`Self::changes`] read `seen` (in order, an item once per change), or
    /// `None` when the log no longer reaches back that far (or `seen` is ahead). `missing` is
    /// never yielded: every change in range is logged and not yet overwritten.
    pub fn since(&self, seen: u64, missing: T) -> Option<impl Iterator<Item = T> + '_> {
        let behind = self.changes.checked_sub(seen)?;
        if behind > CHANGE_LOG as u64 {
            return None;
        }
        Some((seen..self.changes).map(move |n| {
            self.items
                .get((n % CHANGE_LOG as u64) as usize)
                .copied()
                .unwrap_or(missing)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reader_catches_up_within_the_log_and_is_told_when_it_cannot() {
        let mut log = ChangeLog::default();
        for n in 0..10u32 {
            log.push(n);
        }
        let seen: Vec<u32> = log.since(7, u32::MAX).expect("in range").collect();
        assert_eq!(seen, vec![7, 8, 9]);
        assert!(log.since(11, u32::MAX).is_none(), "ahead of the log");
        for n in 10..10 + CHANGE_LOG as u32 {
            log.push(n);
        }
        assert!(log.since(9, u32::MAX).is_none(), "overwritten");
        let back = log.changes() - CHANGE_LOG as u64;
        let all: Vec<u32> = log
            .since(back, u32::MAX)
            .expect("exactly the log")
            .collect();
        assert_eq!(all.len(), CHANGE_LOG);
        assert_eq!(all.first(), Some(&10));
    }
}

//! The decode column read with each row's ledger backlog beside it, for picks where many rows
//! hold a backlog.
//!
//! [`gather_column`](super::gather_column) sets the (usually few) backlogged rows aside and
//! tallies them one by one. When a fleet's publishers fall silent every rank holds unanswered
//! legs, and setting 1,000 rows aside and back cost more than the whole column pass. Here the
//! rows' backlogs are read as two more columns ([`RowBacklogs::columns`]: decode blocks and the
//! time a stall starts) in the same tight passes: per tier (not stalled, stalled), the lowest
//! `key + backlog`, how many rows hold it and the first; a tie past the first is counted off
//! the same way. Costs compare by numerator (one capacity), as in the column pass.

use super::{COLUMN_LIMIT, Gathered, Lowest, RowBacklogs, SelectionReason, Tally, column_start};
use crate::picker::dense::DecodeColumn;

/// Whether enough rows hold a backlog (more than a quarter) that reading the backlogs beside
/// the keys beats setting the rows aside.
pub(super) fn many_backlogged(backlogs: &RowBacklogs, rows: usize) -> bool {
    backlogs.rows().len().saturating_mul(4) > rows
}

/// A row's numerator without the request's blocks in tier `stalled`, or
/// [`DecodeColumn::NONE`] when it has no cost or belongs to the other tier.
#[inline(always)]
fn combined(key: u64, decode: u64, stall_from: u64, now: u64, stalled: bool) -> u64 {
    if key == DecodeColumn::NONE || (stall_from <= now) != stalled {
        DecodeColumn::NONE
    } else {
        key.saturating_add(decode)
    }
}

/// What [`gather_column`](super::gather_column) gathers, read with the backlogs beside the
/// keys. `None` where this cannot answer exactly (a fresh field equal to the column's "no
/// cost", a numerator near saturation, columns of another length): the caller then runs
/// [`gather_mirrored`](super::gather_mirrored).
#[inline(never)]
pub(super) fn gather_beside(
    column: &DecodeColumn,
    backlogs: &RowBacklogs,
    request_blocks: u64,
    den: u64,
) -> Option<Gathered> {
    let keys = column.keys();
    let (decode, stall, now) = backlogs.columns();
    if !column.exact()
        || request_blocks >= COLUMN_LIMIT
        || decode.len() != keys.len()
        || stall.len() != keys.len()
    {
        return None;
    }
    // One pass for both tiers' lowest (and whether a numerator nears saturation), then a count
    // per tier holding a cost.
    let mut lowest = [DecodeColumn::NONE; 2];
    let mut over = false;
    for ((&k, &d), &s) in keys.iter().zip(decode).zip(stall) {
        let num = if k == DecodeColumn::NONE {
            DecodeColumn::NONE
        } else {
            k.saturating_add(d)
        };
        over |= k != DecodeColumn::NONE && num >= COLUMN_LIMIT;
        let (free, stalled) = if s <= now {
            (DecodeColumn::NONE, num)
        } else {
            (num, DecodeColumn::NONE)
        };
        lowest[0] = lowest[0].min(free);
        lowest[1] = lowest[1].min(stalled);
    }
    if over {
        return None;
    }
    let mut tiers = [Lowest::default(); 2];
    for ((tier, stalled), lowest) in tiers.iter_mut().zip([false, true]).zip(lowest) {
        if lowest == DecodeColumn::NONE {
            continue;
        }
        let mut rows = tier_rows(keys, decode, stall, now, stalled, lowest);
        let first = rows.next()?;
        *tier = Lowest {
            num: lowest + request_blocks,
            den,
            ties: 1 + rows.count(),
            first,
        };
    }
    let [free, stalled] = tiers;
    Some(Gathered {
        tally: Tally {
            any_fresh: column.fresh() > 0,
            free: free.best(),
            stalled: stalled.best(),
        },
        candidates: keys.len(),
    })
}

/// The rows of tier `stalled` whose numerator without the request's blocks is `target`, in
/// row order.
fn tier_rows<'a>(
    keys: &'a [u64],
    decode: &'a [u64],
    stall: &'a [u64],
    now: u64,
    stalled: bool,
    target: u64,
) -> impl Iterator<Item = usize> + 'a {
    keys.iter()
        .zip(decode)
        .zip(stall)
        .enumerate()
        .filter(move |&(_, ((&k, &d), &s))| combined(k, d, s, now, stalled) == target)
        .map(|(row, _)| row)
}

/// What [`choose_column`](super::choose_column) chooses after [`gather_beside`]: the same
/// rotation, tier and tie rules, a tie past the first counted off the columns.
pub(super) fn choose_beside(
    column: &DecodeColumn,
    backlogs: &RowBacklogs,
    request_blocks: u64,
    gathered: &Gathered,
    advance: &mut impl FnMut() -> u64,
) -> Option<(usize, SelectionReason)> {
    let (stalled, best, wanted) = match column_start(gathered, advance) {
        Ok(tie) => tie,
        Err(settled) => return settled,
    };
    let (decode, stall, now) = backlogs.columns();
    // Exact: the gathered numerator is the lowest plus the request's blocks, both below
    // `COLUMN_LIMIT`.
    let target = best.cost.num - request_blocks;
    tier_rows(column.keys(), decode, stall, now, stalled, target)
        .nth(wanted)
        .map(|row| (row, SelectionReason::Load))
}
